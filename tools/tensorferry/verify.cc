// tensorferry verify PATH: full validation of a checkpoint (every header, the index) and then a
// read of every byte of every file, proving that the files are complete and readable. A file
// whose size changes between validation and the end of its read is reported.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/object_store.h"

namespace tensorferry::cli {
namespace {

constexpr size_t kChunkSize = 8u << 20;

struct VerifyArgs {
  std::string path;
  bool json = false;
};

struct VerifyResult {
  uint64_t tensors = 0;
  uint64_t files = 0;
  uint64_t bytes = 0;  // file bytes read
  uint64_t tensor_bytes = 0;
};

Status CheckSize(const RandomAccessFile& file, uint64_t expected, const char* when) {
  auto size = file.Size();
  if (!size.ok()) return size.status();
  if (*size != expected) {
    return Status(Code::kIoError, file.path() + ": file changed " + when + ": size was " +
                                      std::to_string(expected) + " bytes when validated, now " +
                                      std::to_string(*size));
  }
  return Status::Ok();
}

// Reads every byte of `file` (its size checked first): a local file, or an object-store file
// opened by the checkpoint (an object has no path to open again).
Status ReadEveryByte(const RandomAccessFile& file, const FileInfo& info,
                     std::vector<std::byte>& buffer) {
  if (Status s = CheckSize(file, info.file_size, "since validation"); !s.ok()) return s;
  for (uint64_t offset = 0; offset < info.file_size;) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(buffer.size(), info.file_size - offset));
    if (Status s = ReadFully(file, offset, std::span<std::byte>(buffer.data(), n)); !s.ok()) {
      return s;
    }
    offset += n;
  }
  return Status::Ok();
}

// Reads every byte of `info`'s file, checking its size before and after.
Status ReadWholeFile(Env* env, const FileInfo& info, std::vector<std::byte>& buffer) {
  auto opened = env->OpenRandomAccess(info.path);
  if (!opened.ok()) return opened.status();
  const RandomAccessFile& file = **opened;
  if (Status s = ReadEveryByte(file, info, buffer); !s.ok()) return s;
  // One byte past the end must not exist: a file that grew is not the file that was validated.
  std::byte extra{};
  auto past_end = file.Read(info.file_size, std::span<std::byte>(&extra, 1));
  if (!past_end.ok()) return past_end.status();
  if (*past_end != 0) {
    return Status(Code::kIoError, info.path +
                                      ": file changed while being verified: it has bytes "
                                      "past the validated size " +
                                      std::to_string(info.file_size));
  }
  return CheckSize(file, info.file_size, "while being verified");
}

Status Verify(const std::string& path, VerifyResult& result) {
  auto opened = Checkpoint::Open(path);
  if (!opened.ok()) return opened.status();
  const Checkpoint& ckpt = **opened;
  result.tensors = ckpt.tensors().size();
  result.files = ckpt.files().size();
  result.tensor_bytes = ckpt.total_tensor_bytes();
  std::vector<std::byte> buffer(kChunkSize);
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    const FileInfo& info = ckpt.files()[f];
    if (IsObjectUrl(info.path)) {
      // An object has no path to open again: read it through the checkpoint's own file (every
      // ranged GET pinned to the ETag seen at open, so a replaced object is reported).
      auto file = ckpt.File(f);
      if (!file.ok()) return file.status();
      if (Status s = ReadEveryByte(**file, info, buffer); !s.ok()) return s;
    } else if (Status s = ReadWholeFile(Env::Default(), info, buffer); !s.ok()) {
      return s;
    }
    result.bytes += info.file_size;
  }
  return Status::Ok();
}

int RunVerify(const VerifyArgs& args) {
  const int64_t start = NowNs();
  VerifyResult result;
  const Status status = Verify(args.path, result);
  const double seconds = SecondsSince(start);
  const double gbps = seconds > 0 ? static_cast<double>(result.bytes) / seconds / 1e9 : 0.0;

  if (args.json) {
    JsonOut j;
    j.BeginObject().Field("path", args.path).Field("ok", status.ok());
    if (status.ok()) {
      j.Field("tensors", result.tensors)
          .Field("files", result.files)
          .Field("bytes", result.bytes)
          .Field("tensor_bytes", result.tensor_bytes)
          .Field("seconds", seconds)
          .Field("gb_per_s", gbps);
    } else {
      JsonError(j, args.path, status);
    }
    j.EndObject();
    return PrintReport(j.str(), status);
  }

  if (!status.ok()) {
    PrintError(args.path, status);
    return kExitError;
  }
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.2f s (%.2f GB/s)", seconds, gbps);
  const std::string line = "ok: " + Plural(result.tensors, "tensor") + ", " +
                           Plural(result.files, "file") + ", " + FormatBytes(result.bytes) +
                           " verified in " + rate;
  return PrintReport(line);
}

}  // namespace

Command AddVerifyCommand(CLI::App& parent) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* app = parent.add_subcommand(
      "verify", "Validate a checkpoint and read every byte of its files (exit 1 on any problem)");
  AddCheckpointPath(*app, args->path);
  app->add_flag("--json", args->json, "Print the result as one JSON document");
  return {app, [args] { return RunVerify(*args); }};
}

}  // namespace tensorferry::cli

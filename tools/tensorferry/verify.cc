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
#include "tensorferry/options.h"

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

// Reads every byte of file `f` (the checkpoint's own open file: local, or an object read by
// ranged GETs), checking its size before and after.
Status ReadWholeFile(const Checkpoint& ckpt, uint32_t f, std::vector<std::byte>& buffer) {
  const FileInfo& info = ckpt.files()[f];
  auto opened = ckpt.File(f);
  if (!opened.ok()) return opened.status();
  const SourceFile& file = **opened;
  if (Status s = CheckSize(file, info.file_size, "since validation"); !s.ok()) return s;
  for (uint64_t offset = 0; offset < info.file_size;) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(buffer.size(), info.file_size - offset));
    if (Status s = ReadFully(file, offset, std::span<std::byte>(buffer.data(), n)); !s.ok()) {
      return s;
    }
    offset += n;
  }
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
  if (Status s = CheckSize(file, info.file_size, "while being verified"); !s.ok()) return s;
  // Read through the descriptor opened at validation: a file renamed over meanwhile is the path
  // no longer naming it.
  return file.CheckUnchanged();
}

Status Verify(const std::string& path, VerifyResult& result) {
  Result<LoadOptions> env = LoadOptions::FromEnvironment();  // TENSORFERRY_OBJECT_* for URLs
  if (!env.ok()) return env.status();
  OpenOptions open;
  open.object_store = env->object_store;
  auto opened = Checkpoint::Open(path, open);
  if (!opened.ok()) return opened.status();
  const Checkpoint& ckpt = **opened;
  result.tensors = ckpt.tensors().size();
  result.files = ckpt.files().size();
  result.tensor_bytes = ckpt.total_tensor_bytes();
  std::vector<std::byte> buffer(kChunkSize);
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    if (Status s = ReadWholeFile(ckpt, f, buffer); !s.ok()) return s;
    result.bytes += ckpt.files()[f].file_size;
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

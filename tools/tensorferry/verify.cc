// tensorferry verify PATH: full validation of a checkpoint (every header, the index) and then a
// read of every byte of every file, proving that the files are complete and readable. A file
// whose size changes between validation and the end of its read is reported. Integrity records
// are checked on the way (docs/integrity.md): the per-tensor checksums embedded in a file or, for
// a file without them, those of the sidecar manifest beside the checkpoint; and, for a file of a
// Hugging Face hub-cache snapshot, the SHA-256 its blob is named by (files hashed in parallel).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/integrity.h"
#include "tensorferry/options.h"

namespace tensorferry::cli {
namespace {

constexpr size_t kChunkSize = 8u << 20;

struct VerifyArgs {
  std::string path;
  bool json = false;
};

struct FileResult {
  std::string path;
  std::string checksums = "none";   // ChecksumSourceName
  uint64_t checksum_bytes = 0;      // tensor bytes whose chunks matched their digests
  std::string hub_sha256 = "none";  // "none" (not a hub blob), "ok"
};

struct VerifyResult {
  uint64_t tensors = 0;
  uint64_t files = 0;
  uint64_t bytes = 0;  // file bytes read
  uint64_t tensor_bytes = 0;
  uint64_t checksum_bytes = 0;
  std::vector<FileResult> per_file;
};

// Checks the SHA-256 of every file that is a hub-cache blob, files in parallel. `done[f]` is set
// for those checked (their every byte has been read).
Status CheckHubBlobs(const Checkpoint& ckpt, std::vector<FileResult>& results,
                     std::vector<bool>& done) {
  std::vector<std::pair<uint32_t, std::pair<std::string, std::string>>> blobs;
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    if (auto blob = HubCacheBlob(ckpt.files()[f].path)) blobs.emplace_back(f, *blob);
  }
  std::vector<Status> statuses(blobs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < blobs.size();) {
      const auto& [f, blob] = blobs[i];
      auto sha = Sha256OfFile(blob.first);
      if (!sha.ok()) {
        statuses[i] = sha.status();
      } else if (*sha != blob.second) {
        statuses[i] =
            Status(Code::kChecksumMismatch, ckpt.files()[f].path + ": hub-cache blob " +
                                                blob.first + " is named by SHA-256 " + blob.second +
                                                " but its content hashes to " + *sha);
      }
    }
  };
  std::vector<std::thread> pool;
  const size_t workers = std::min<size_t>(HashThreads(), blobs.size());
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
  if (workers > 0) work();
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < blobs.size(); ++i) {
    if (!statuses[i].ok()) return statuses[i];
    results[blobs[i].first].hub_sha256 = "ok";
    done[blobs[i].first] = true;
  }
  return Status::Ok();
}

Status CheckSize(const RandomAccessFile& file, uint64_t expected, const char* when) {
  auto size = file.Size();
  if (!size.ok()) return size.status();
  if (*size != expected) {
    return Status(Code::kIoError, Shown(file.path()) + ": file changed " + when + ": size was " +
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
    return Status(Code::kIoError, Shown(info.path) +
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
  auto opened = OpenCheckpoint(path);
  if (!opened.ok()) return opened.status();
  const Checkpoint& ckpt = **opened;
  result.tensors = ckpt.tensors().size();
  result.files = ckpt.files().size();
  result.tensor_bytes = ckpt.total_tensor_bytes();
  result.per_file.resize(ckpt.files().size());
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) result.per_file[f].path = ckpt.files()[f].path;
  std::vector<bool> hashed(ckpt.files().size(), false);
  if (Status s = CheckHubBlobs(ckpt, result.per_file, hashed); !s.ok()) return s;
  if (Status s = VerifyCheckpointChecksums(ckpt, HashThreads(),
                                           [&](uint32_t f, ChecksumSource source, uint64_t bytes) {
                                             FileResult& r = result.per_file[f];
                                             r.checksums = std::string(ChecksumSourceName(source));
                                             r.checksum_bytes = bytes;
                                             result.checksum_bytes += bytes;
                                           });
      !s.ok()) {
    return s;
  }
  std::vector<std::byte> buffer(kChunkSize);
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    const FileInfo& info = ckpt.files()[f];
    // The whole file is still read once (headers, padding, the size checks), unless its SHA-256
    // just did.
    if (!hashed[f]) {
      if (Status s = ReadWholeFile(ckpt, f, buffer); !s.ok()) return s;
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
    j.BeginObject().Field("path", Shown(args.path)).Field("ok", status.ok());
    if (status.ok()) {
      j.Field("tensors", result.tensors)
          .Field("files", result.files)
          .Field("bytes", result.bytes)
          .Field("tensor_bytes", result.tensor_bytes)
          .Field("checksum_bytes", result.checksum_bytes)
          .Field("seconds", seconds)
          .Field("gb_per_s", gbps);
      j.Key("per_file").BeginArray();
      for (const FileResult& f : result.per_file) {
        j.BeginObject()
            .Field("path", Shown(f.path))
            .Field("checksums", f.checksums)
            .Field("checksum_bytes", f.checksum_bytes)
            .Field("hub_sha256", f.hub_sha256)
            .EndObject();
      }
      j.EndArray();
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
  std::string line = "ok: " + Plural(result.tensors, "tensor") + ", " +
                     Plural(result.files, "file") + ", " + FormatBytes(result.bytes) +
                     " verified in " + rate;
  uint64_t embedded = 0, from_manifest = 0, hub = 0;
  for (const FileResult& f : result.per_file) {
    embedded += f.checksums == "embedded";
    from_manifest += f.checksums == "manifest";
    hub += f.hub_sha256 == "ok";
  }
  line += "; checksums: " + std::to_string(embedded) + " embedded, " +
          std::to_string(from_manifest) + " from the manifest, " +
          std::to_string(result.per_file.size() - embedded - from_manifest) + " none";
  if (hub > 0) line += "; hub-cache SHA-256: " + Plural(hub, "file") + " ok";
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

// tensorferry checksum PATH: computes the per-tensor checksums of every file of a checkpoint
// (docs/integrity.md) and writes them, atomically, as the sidecar manifest
// tensorferry.checksums.json beside it; for third-party checkpoints written without them. `verify`
// and loads with verify=auto|on use it for files that carry no embedded checksums.
#include <memory>
#include <string>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"

namespace tensorferry::cli {
namespace {

struct ChecksumArgs {
  std::string path;
  std::string chunk_size;
  bool replace = false;
  bool json = false;
};

int RunChecksum(const ChecksumArgs& args) {
  uint64_t chunk_size = kDefaultChecksumChunkSize;
  if (!args.chunk_size.empty()) {
    auto size = ParseSize(args.chunk_size);
    if (!size || *size < kMinChecksumChunkSize || *size > kMaxChecksumChunkSize) {
      return UsageError("--chunk-size: not a size between 1KiB and 1GiB: " + args.chunk_size);
    }
    chunk_size = *size;
  }
  const int64_t start = NowNs();
  std::shared_ptr<const Checkpoint> ckpt;
  std::string manifest_path;
  uint64_t tensors = 0;
  Status status = [&]() -> Status {
    // Opened here: with --json, its failure is the error document too.
    Result<std::shared_ptr<const Checkpoint>> opened = OpenCheckpoint(args.path);
    if (!opened.ok()) return opened.status();
    ckpt = *std::move(opened);
    if (ckpt->files().empty()) {
      return Status(Code::kInvalidArgument, "the checkpoint has no file (its index names none)");
    }
    if (ckpt->files()[0].path.find("://") != std::string::npos) {
      return Status(Code::kUnsupported, "a manifest is written beside local files only");
    }
    // Without --chunk-size, the chunk size of a manifest already there, whose other files'
    // entries are kept (WriteChecksumManifest).
    if (args.chunk_size.empty()) {
      Result<std::optional<ChecksumManifest>> existing = ReadChecksumManifest(*ckpt);
      if (existing.ok() && *existing) chunk_size = (*existing)->chunk_size;
    }
    // A file the manifest records is checked against its entry unless --replace.
    auto manifest = ComputeChecksumManifest(
        *ckpt, chunk_size, HashThreads(),
        args.replace ? RecordedChecksums::kReplace : RecordedChecksums::kCheck);
    if (!manifest.ok()) return manifest.status();
    for (const auto& [name, file] : manifest->files) tensors += file.checksums.tensors.size();
    manifest_path = ChecksumManifestPath(*ckpt);
    return WriteChecksumManifest(*ckpt, *manifest);
  }();
  const double seconds = SecondsSince(start);
  if (args.json) {
    JsonOut j;
    j.BeginObject().Field("path", Shown(args.path)).Field("ok", status.ok());
    if (status.ok()) {
      j.Field("manifest", manifest_path)
          .Field("files", static_cast<uint64_t>(ckpt->files().size()))
          .Field("tensors", tensors)
          .Field("bytes", ckpt->total_tensor_bytes())
          .Field("chunk_size", chunk_size)
          .Field("seconds", seconds);
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
  return PrintReport("wrote " + manifest_path + ": " + Plural(ckpt->files().size(), "file") + ", " +
                     Plural(tensors, "tensor") + ", " + FormatBytes(ckpt->total_tensor_bytes()) +
                     " hashed");
}

}  // namespace

Command AddChecksumCommand(CLI::App& parent) {
  auto args = std::make_shared<ChecksumArgs>();
  CLI::App* app = parent.add_subcommand(
      "checksum",
      "Write per-tensor checksums of every file as tensorferry.checksums.json beside a checkpoint");
  AddCheckpointPath(*app, args->path);
  app->add_option("--chunk-size", args->chunk_size, "Bytes per hashed chunk (default 4MiB)");
  app->add_flag("--replace", args->replace,
                "Record the files as they are, also those the manifest records otherwise "
                "(changed on purpose; without it, such a file is refused as damaged)");
  app->add_flag("--json", args->json, "Print the result as one JSON document");
  return {app, [args] { return RunChecksum(*args); }};
}

}  // namespace tensorferry::cli

// Implements the checkpoint half of integrity.h: the sidecar manifest beside a checkpoint, and the
// checksums of a checkpoint's files computed or verified by reading them.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "format/rollback_registry.h"
#include "integrity/manifest_update.h"
#include "io/read_engine.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "tensorferry/options.h"
#include "util/json_writer.h"
#include "util/macros.h"
#include "util/parallel.h"
#include "util/writer_temporaries.h"

namespace tensorferry {
namespace {

// Bytes read at once: a whole number of chunks, at least 64 MiB, so that every thread has chunks.
uint64_t PieceSize(uint64_t chunk_size) {
  return std::max<uint64_t>(1, (64u << 20) / chunk_size) * chunk_size;
}

// The tensors of file `f`, in file order.
std::vector<const TensorInfo*> TensorsOf(const Checkpoint& ckpt, uint32_t f) {
  std::vector<const TensorInfo*> out;
  for (const TensorInfo& t : ckpt.tensors()) {
    if (t.file == f) out.push_back(&t);
  }
  std::sort(out.begin(), out.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  return out;
}

// Reads every tensor of file `f` in pieces of whole chunks and calls
// fn(tensor, first chunk index, piece bytes).
Status ForEachPiece(
    const Checkpoint& ckpt, uint32_t f, uint64_t chunk_size,
    const std::function<Status(const TensorInfo&, uint64_t, std::span<const std::byte>)>& fn) {
  TF_ASSIGN_OR_RETURN(std::shared_ptr<const SourceFile> file, ckpt.File(f));
  const uint64_t piece = PieceSize(chunk_size);
  std::vector<std::byte> buffer;
  for (const TensorInfo* t : TensorsOf(ckpt, f)) {
    if (t->size == 0) {
      TF_RETURN_IF_ERROR(fn(*t, 0, {}));
      continue;
    }
    for (uint64_t done = 0; done < t->size; done += piece) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(piece, t->size - done));
      if (buffer.size() < n) buffer.resize(n);
      std::span<std::byte> bytes(buffer.data(), n);
      if (Status read = ReadFully(*file, t->offset + done, bytes); !read.ok()) {
        return io::WithReadHeld(std::move(read), "tensor " + json::Quote(t->name));
      }
      TF_RETURN_IF_ERROR(fn(*t, done / chunk_size, bytes));
    }
  }
  return Status::Ok();
}

std::string DirectoryOf(const std::string& path) {
  const std::filesystem::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : std::string();
}

// The file's name relative to the manifest's directory; nullopt for a file outside it (files
// given one by one from several folders): the manifest has no entry for it, and none of its
// entries (another file of the same name there) is its.
std::optional<std::string> RelativeName(const std::string& dir, const std::string& path) {
  if (dir.empty()) {
    if (path.find('/') == std::string::npos) return path;
    return std::nullopt;
  }
  if (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
      path[dir.size()] == '/') {
    return path.substr(dir.size() + 1);
  }
  return std::nullopt;
}

std::string ManifestPathIn(const std::string& dir) {
  return dir.empty() ? std::string(kChecksumManifestName)
                     : dir + "/" + std::string(kChecksumManifestName);
}

// The manifest at `path`, nullopt when there is none.
Result<std::optional<ChecksumManifest>> ReadManifestFile(Env* env, const std::string& path) {
  auto file = env->OpenRandomAccess(path);
  if (!file.ok()) {
    if (file.status().code() == Code::kNotFound) return std::optional<ChecksumManifest>();
    return file.status();
  }
  TF_ASSIGN_OR_RETURN(const uint64_t size, (*file)->Size());
  if (size > (256u << 20)) {
    return Status(Code::kChecksumsInvalid,
                  path + ": manifest of " + std::to_string(size) + " bytes is larger than 256 MiB");
  }
  std::string text(static_cast<size_t>(size), '\0');
  TF_RETURN_IF_ERROR(
      ReadFully(**file, 0, std::as_writable_bytes(std::span<char>(text.data(), text.size()))));
  TF_ASSIGN_OR_RETURN(ChecksumManifest manifest, ParseChecksumManifest(text, path));
  return std::optional<ChecksumManifest>(std::move(manifest));
}

// Writes `text` to `path` atomically: a temporary file beside it (registered for removal on a
// signal), fsynced when `sync`, renamed over it.
Status ReplaceFile(Env* env, const std::string& dir, const std::string& path,
                   const std::string& text, bool sync) {
  using internal::RollbackEntry;
  RollbackEntry registered;
  const auto reserve = [&registered](const std::string& name) {
    // Registered before the file exists, so no signal can leave it behind unregistered.
    registered =
        name.empty() ? RollbackEntry() : RollbackEntry(RollbackEntry::Kind::kTemporary, name);
  };
  TF_ASSIGN_OR_RETURN(
      std::unique_ptr<WritableFile> file,
      env->NewTempFile(dir, util::HiddenSibling(kChecksumManifestName, util::kTemporaryKind),
                       reserve));
  Status s = file->Append(std::as_bytes(std::span<const char>(text.data(), text.size())));
  if (s.ok() && sync) s = file->Sync();
  const Status closed = file->Close();
  if (s.ok()) s = closed;
  if (s.ok()) s = env->RenameFile(file->path(), path);
  if (!s.ok()) (void)env->RemoveFile(file->path());
  return s;
}

// Ok when every file of `ckpt` is still the one it opened (SourceFile::CheckUnchanged: same
// device, inode, size and mtime, and its path still names it); else the change, and that nothing
// is recorded for it.
Status CheckHashedFilesUnchanged(const Checkpoint& ckpt) {
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    Result<std::shared_ptr<const SourceFile>> file = ckpt.File(f);
    Status s = file.ok() ? (*file)->CheckUnchanged() : file.status();
    if (!s.ok()) {
      return Status(s.code(), s.message() +
                                  "; it changed while its checksums were computed, which would "
                                  "describe the old bytes: nothing was written (the manifest is "
                                  "as it was); run the checksum again (tensorferry checksum)");
    }
  }
  return Status::Ok();
}

}  // namespace

namespace internal {

Result<std::optional<ChecksumManifest>> ReadManifestIn(Env* env, const std::string& dir) {
  return ReadManifestFile(env, ManifestPathIn(dir));
}

Result<std::optional<FileLock>> LockManifest(const std::string& dir) {
  Result<FileLock> lock = FileLock::LockDirectory(dir, FileLock::Wait::kBlock,
                                                  "updating " + std::string(kChecksumManifestName));
  if (lock.ok()) return std::optional<FileLock>(std::move(lock).value());
  // No such directory on the real file system: an Env of its own (in memory) holds the manifest,
  // and no other process can reach it through this file system.
  if (lock.status().code() == Code::kNotFound) return std::optional<FileLock>();
  return lock.status();
}

Status UpdateManifest(
    Env* env, const std::string& dir, bool sync,
    const std::function<Result<ManifestEdit>(const Result<std::optional<ChecksumManifest>>&)>&
        edit) {
  TF_ASSIGN_OR_RETURN(const std::optional<FileLock> lock, LockManifest(dir));
  return UpdateManifestLocked(env, dir, sync, edit);
}

Status UpdateManifestLocked(
    Env* env, const std::string& dir, bool sync,
    const std::function<Result<ManifestEdit>(const Result<std::optional<ChecksumManifest>>&)>&
        edit) {
  // Temporaries of the manifest that dead writers of this machine left (util/writer_temporaries.h).
  (void)util::RemoveDeadWritersFiles(dir, {std::string(kChecksumManifestName)},
                                     {util::kTemporaryKind});
  const std::string path = ManifestPathIn(dir);
  TF_ASSIGN_OR_RETURN(const ManifestEdit change, edit(ReadManifestFile(env, path)));
  switch (change.action) {
    case ManifestEdit::Action::kKeep: return Status::Ok();
    case ManifestEdit::Action::kWrite:
      TF_RETURN_IF_ERROR(
          ReplaceFile(env, dir, path, SerializeChecksumManifest(change.manifest), sync));
      break;
    case ManifestEdit::Action::kRemove: TF_RETURN_IF_ERROR(env->RemoveFile(path)); break;
  }
  return sync ? env->SyncDirectory(dir) : Status::Ok();
}

}  // namespace internal

std::string ChecksumManifestPath(const Checkpoint& ckpt) {
  if (ckpt.files().empty()) return std::string();
  // Beside the index, which names its shards relative to its folder (subfolders included); a
  // single file's folder otherwise.
  return ManifestPathIn(
      DirectoryOf(ckpt.index_path().empty() ? ckpt.files()[0].path : ckpt.index_path()));
}

Result<std::optional<ChecksumManifest>> ReadChecksumManifest(const Checkpoint& ckpt) {
  const std::string path = ChecksumManifestPath(ckpt);
  if (path.empty()) return std::optional<ChecksumManifest>();
  return ReadManifestFile(Env::Default(), path);
}

Result<ChecksumManifest> ComputeChecksumManifest(const Checkpoint& ckpt, uint64_t chunk_size,
                                                 unsigned threads, RecordedChecksums recorded) {
  if (chunk_size < kMinChecksumChunkSize || chunk_size > kMaxChecksumChunkSize) {
    return Status(Code::kInvalidArgument, "checksum chunk size " + std::to_string(chunk_size) +
                                              " is outside [" +
                                              std::to_string(kMinChecksumChunkSize) + ", " +
                                              std::to_string(kMaxChecksumChunkSize) + "]");
  }
  // The manifest already there: a file it records (one saved without embedded checksums, whose
  // only protection it is) is checked against its entry, as one that carries its own checksums
  // is against those; recording its bytes anew would make damage since then pass every check.
  std::optional<ChecksumManifest> manifest_there;
  if (recorded == RecordedChecksums::kCheck && !ckpt.files().empty() &&
      ckpt.files()[0].path.find("://") == std::string::npos) {
    Result<std::optional<ChecksumManifest>> read = ReadChecksumManifest(ckpt);
    if (!read.ok()) {
      return Status(read.status().code(),
                    read.status().message() +
                        " (the files it records cannot be checked against it; remove it to "
                        "record the files as they are)");
    }
    manifest_there = *std::move(read);
  }
  constexpr std::string_view kReplaceAdvice =
      ": the file is not what the manifest recorded (damaged, or changed on purpose: then ask to "
      "replace its entry, tensorferry checksum --replace)";
  ChecksumManifest manifest;
  manifest.chunk_size = chunk_size;
  const std::string dir = DirectoryOf(ChecksumManifestPath(ckpt));
  for (const FileInfo& info : ckpt.files()) {  // before any file is read
    if (!RelativeName(dir, info.path)) {
      return Status(Code::kInvalidArgument,
                    info.path + ": not in " + json::Quote(dir.empty() ? "." : dir) +
                        ", the folder of the checksum manifest (" +
                        json::Quote(ManifestPathIn(dir)) +
                        "): a manifest records the files of its own folder; checksum each "
                        "folder's files on their own");
    }
  }
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    // What the file must hold: its own checksums (written by tensorferry), else the manifest's
    // entry. Digests of damaged bytes must not be recorded as the truth about the file. (A record
    // of an algorithm this version does not know, a newer writer's, cannot be checked: the file
    // is hashed as one without.)
    ChecksumSource source = ChecksumSource::kNone;
    Result<std::optional<FileChecksums>> own = ChecksumsForFile(ckpt, f, nullptr, &source);
    if (!own.ok() && own.status().code() != Code::kUnsupported) return own.status();
    std::optional<FileChecksums> expected = own.ok() ? *own : std::nullopt;
    if (!expected && own.ok() && manifest_there) {
      Result<std::optional<FileChecksums>> entry =
          ChecksumsForFile(ckpt, f, &*manifest_there, &source);
      if (!entry.ok()) {
        return Status(entry.status().code(),
                      entry.status().message() + std::string(kReplaceAdvice));
      }
      expected = *std::move(entry);
    }
    const std::string against =
        source == ChecksumSource::kEmbedded
            ? " (against the checksums embedded in the file: no checksum is recorded for damaged "
              "bytes)"
            : std::string(" (against the checksums the manifest records for it") +
                  std::string(kReplaceAdvice) + ")";
    // A record in another chunk size is checked in a pass of its own (the file is read twice);
    // one in this chunk size is compared with the digests as they are computed.
    if (expected && expected->chunk_size != chunk_size) {
      Status checked = VerifyFileChecksums(ckpt, f, *expected, threads);
      if (checked.code() == Code::kChecksumMismatch) {
        return Status(checked.code(), checked.message() + against);
      }
      TF_RETURN_IF_ERROR(checked);
      expected.reset();
    }
    const std::string& path = ckpt.files()[f].path;
    ManifestFile entry;
    entry.size = ckpt.files()[f].file_size;
    entry.checksums.chunk_size = chunk_size;
    TF_RETURN_IF_ERROR(ForEachPiece(
        ckpt, f, chunk_size,
        [&](const TensorInfo& t, uint64_t first, std::span<const std::byte> bytes) -> Status {
          TensorChecksum& sum = entry.checksums.tensors[t.name];
          sum.chunks.resize(ChecksumChunkCount(t.size, chunk_size));
          const uint64_t n = ChecksumChunkCount(bytes.size(), chunk_size);
          ParallelFor(n, threads, [&](size_t i) {
            const uint64_t begin = i * chunk_size;
            sum.chunks[first + i] = ChecksumChunk(
                bytes.subspan(begin, std::min<uint64_t>(chunk_size, bytes.size() - begin)));
          });
          if (!expected) return Status::Ok();
          // ChecksumsForFile made sure the record covers every tensor, in its chunk count.
          const TensorChecksum& want = expected->tensors.at(t.name);
          for (uint64_t i = 0; i < n; ++i) {
            const uint64_t begin = i * chunk_size;
            Status checked = CheckChunkDigest(want, chunk_size, t.size, first + i,
                                              std::min<uint64_t>(chunk_size, bytes.size() - begin),
                                              sum.chunks[first + i], path, t.name, t.offset);
            if (checked.code() == Code::kChecksumMismatch) {
              return Status(checked.code(), checked.message() + against);
            }
            if (!checked.ok()) return checked;
          }
          return Status::Ok();
        }));
    for (auto& [name, sum] : entry.checksums.tensors) sum.digest = CombineChunkDigests(sum.chunks);
    const std::string name = *RelativeName(dir, path);  // (checked above)
    if (!manifest.files.emplace(name, std::move(entry)).second) {
      return Status(Code::kInvalidArgument,
                    path + ": has the same name in the checksum manifest (" + json::Quote(name) +
                        ") as another file of the checkpoint");
    }
  }
  return manifest;
}

Status WriteChecksumManifest(const Checkpoint& ckpt, const ChecksumManifest& manifest, Env* env) {
  if (env == nullptr) env = Env::Default();
  const std::string path = ChecksumManifestPath(ckpt);
  if (path.empty())
    return Status(Code::kInvalidArgument, "a checkpoint of no file has no manifest");
  const std::string dir = DirectoryOf(path);
  std::set<std::string> ours;
  for (const FileInfo& f : ckpt.files()) {
    if (std::optional<std::string> name = RelativeName(dir, f.path)) ours.insert(std::move(*name));
  }
  // The entries of other files in the manifest already there (a folder of single-file
  // checkpoints shares one) are kept; this checkpoint's are replaced. Read, merged and written
  // back under the manifest's lock: another writer's entries written meanwhile are kept too.
  using internal::ManifestEdit;
  return internal::UpdateManifest(
      env, dir, /*sync=*/true,
      [&](const Result<std::optional<ChecksumManifest>>& existing) -> Result<ManifestEdit> {
        if (!existing.ok()) {
          return Status(existing.status().code(), existing.status().message() +
                                                      " (the manifest there cannot be updated; " +
                                                      "remove it to write a new one)");
        }
        // The checksums were computed from the files as the checkpoint opened them; a file that
        // its name no longer names (replaced by a writer meanwhile, or rewritten in place) would
        // get digests of other bytes, failing every later check of the good new file. Checked
        // here, under the lock that writers take to drop a replaced file's entry.
        TF_RETURN_IF_ERROR(CheckHashedFilesUnchanged(ckpt));
        ManifestEdit edit{ManifestEdit::Action::kWrite, manifest};
        if (!*existing) return edit;
        size_t others = 0;
        for (const auto& [name, file] : (*existing)->files) others += ours.count(name) == 0;
        if (others > 0 && (*existing)->chunk_size != manifest.chunk_size) {
          return Status(Code::kInvalidArgument,
                        path + ": holds the checksums of " + std::to_string(others) +
                            " other file(s) in chunks of " +
                            std::to_string((*existing)->chunk_size) + " bytes, not " +
                            std::to_string(manifest.chunk_size) +
                            "; write with that chunk size to keep them, or remove the manifest");
        }
        for (const auto& [name, file] : (*existing)->files) {
          if (ours.count(name) == 0) edit.manifest.files.emplace(name, file);
        }
        return edit;
      });
}

Status VerifyCheckpointChecksums(
    const Checkpoint& ckpt, unsigned threads,
    const std::function<void(uint32_t f, ChecksumSource source, uint64_t bytes)>& on_file) {
  // A sidecar manifest applies to local checkpoints (an object store has no "beside").
  std::optional<ChecksumManifest> manifest;
  if (!ckpt.files().empty() && ckpt.files()[0].path.find("://") == std::string::npos) {
    TF_ASSIGN_OR_RETURN(manifest, ReadChecksumManifest(ckpt));
  }
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    ChecksumSource source = ChecksumSource::kNone;
    TF_ASSIGN_OR_RETURN(const std::optional<FileChecksums> sums,
                        ChecksumsForFile(ckpt, f, manifest ? &*manifest : nullptr, &source));
    uint64_t bytes = 0;
    if (sums) TF_RETURN_IF_ERROR(VerifyFileChecksums(ckpt, f, *sums, threads, &bytes));
    if (on_file) on_file(f, source, bytes);
  }
  return Status::Ok();
}

std::string_view ChecksumSourceName(ChecksumSource source) noexcept {
  switch (source) {
    case ChecksumSource::kNone: return "none";
    case ChecksumSource::kEmbedded: return "embedded";
    case ChecksumSource::kManifest: return "manifest";
  }
  return "none";
}

Result<std::optional<FileChecksums>> ChecksumsForFile(const Checkpoint& ckpt, uint32_t f,
                                                      const ChecksumManifest* manifest,
                                                      ChecksumSource* source) {
  const FileInfo& info = ckpt.files()[f];
  ChecksumSource from = ChecksumSource::kNone;
  std::optional<FileChecksums> sums;
  TF_ASSIGN_OR_RETURN(sums, EmbeddedChecksums(info.metadata, info.path));
  if (sums) {
    from = ChecksumSource::kEmbedded;
  } else if (manifest != nullptr) {
    const std::optional<std::string> name =
        RelativeName(DirectoryOf(ChecksumManifestPath(ckpt)), info.path);
    auto it = name ? manifest->files.find(*name) : manifest->files.end();
    if (it != manifest->files.end()) {
      if (it->second.size != info.file_size) {
        return Status(Code::kChecksumMismatch, info.path + ": the checksum manifest records " +
                                                   std::to_string(it->second.size) +
                                                   " bytes, the file has " +
                                                   std::to_string(info.file_size));
      }
      sums = it->second.checksums;
      from = ChecksumSource::kManifest;
    }
  }
  if (source != nullptr) *source = from;
  if (!sums) return sums;
  // The record must cover exactly the file's tensors, each with its chunk count.
  uint64_t covered = 0;
  for (const TensorInfo& t : ckpt.tensors()) {
    if (t.file != f) continue;
    auto it = sums->tensors.find(t.name);
    if (it == sums->tensors.end()) {
      return Status(Code::kChecksumsInvalid, info.path + ": tensor " + json::Quote(t.name) +
                                                 " has no checksum in the " +
                                                 std::string(ChecksumSourceName(from)) + " record");
    }
    TF_RETURN_IF_ERROR(CheckChecksumShape(it->second, sums->chunk_size, t.size, info.path, t.name));
    ++covered;
  }
  if (covered != sums->tensors.size()) {
    return Status(Code::kChecksumsInvalid,
                  info.path + ": the " + std::string(ChecksumSourceName(from)) +
                      " checksum record names " + std::to_string(sums->tensors.size()) +
                      " tensors, the file has " + std::to_string(covered));
  }
  return sums;
}

Result<std::vector<std::optional<FileChecksums>>> ChecksumsForLoad(const Checkpoint& ckpt,
                                                                   VerifyMode verify) {
  std::vector<std::optional<FileChecksums>> per_file;
  if (verify == VerifyMode::kOff) return per_file;
  std::optional<ChecksumManifest> manifest;
  // The sidecar manifest sits beside local files (an object store has no "beside").
  if (!ckpt.files().empty() && ckpt.files()[0].path.find("://") == std::string::npos) {
    auto read = ReadChecksumManifest(ckpt);
    if (!read.ok()) {
      // A manifest of an algorithm this version does not know is ignored in auto mode.
      if (read.status().code() != Code::kUnsupported || verify == VerifyMode::kOn) {
        return read.status();
      }
    } else {
      manifest = std::move(*read);
    }
  }
  per_file.resize(ckpt.files().size());
  bool any = false;
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    ChecksumSource source = ChecksumSource::kNone;
    auto sums = ChecksumsForFile(ckpt, f, manifest ? &*manifest : nullptr, &source);
    if (!sums.ok()) {
      if (sums.status().code() == Code::kUnsupported && verify == VerifyMode::kAuto) {
        continue;  // checksums of a newer algorithm: loaded unchecked
      }
      // A well-formed embedded record of other tensors than the file's was copied with the
      // metadata by a writer that does not update it (safetensors.save_file(..., metadata=
      // f.metadata()) of new tensors): in auto mode the file loads unchecked, as the safetensors
      // package loads it. verify=on, and `tensorferry verify`, report it; so does auto a record
      // that is not one (malformed: the header is damaged).
      if (sums.status().code() == Code::kChecksumsInvalid && verify == VerifyMode::kAuto) {
        const FileInfo& info = ckpt.files()[f];
        const Result<std::optional<FileChecksums>> embedded =
            EmbeddedChecksums(info.metadata, info.path);
        if (embedded.ok() && embedded->has_value()) {
          // Other names: another file's. The same names (with other chunk counts) are this
          // file's tensors rewritten, or damaged: that stays an error.
          std::set<std::string_view> names;
          for (const TensorInfo& t : ckpt.tensors()) {
            if (t.file == f) names.insert(t.name);
          }
          bool same = names.size() == (*embedded)->tensors.size();
          for (const auto& [name, sum] : (*embedded)->tensors) {
            same = same && names.contains(name);
          }
          if (!same) continue;
        }
      }
      return sums.status();
    }
    if (!sums->has_value() && verify == VerifyMode::kOn) {
      return Status(Code::kChecksumsInvalid,
                    ckpt.files()[f].path +
                        ": verify=on, but the file has no checksums (none in its metadata, none "
                        "in a " +
                        std::string(kChecksumManifestName) +
                        " beside it; `tensorferry checksum` writes one)");
    }
    any = any || sums->has_value();
    per_file[f] = std::move(*sums);
  }
  if (!any) per_file.clear();
  return per_file;
}

Status VerifyFileChecksums(const Checkpoint& ckpt, uint32_t f, const FileChecksums& checksums,
                           unsigned threads, uint64_t* bytes_verified) {
  const std::string& path = ckpt.files()[f].path;
  const uint64_t chunk = checksums.chunk_size;
  return ForEachPiece(
      ckpt, f, chunk, [&](const TensorInfo& t, uint64_t first, std::span<const std::byte> bytes) {
        auto it = checksums.tensors.find(t.name);
        if (it == checksums.tensors.end()) {
          return Status(Code::kChecksumsInvalid,
                        path + ": tensor " + json::Quote(t.name) + " has no checksum");
        }
        TF_RETURN_IF_ERROR(CheckChecksumShape(it->second, chunk, t.size, path, t.name));
        const uint64_t n = ChecksumChunkCount(bytes.size(), chunk);
        TF_RETURN_IF_ERROR(ParallelForUntilError(n, threads, [&](size_t i) {
          const uint64_t begin = i * chunk;
          return VerifyChunk(it->second, chunk, t.size, first + i,
                             bytes.subspan(begin, std::min<uint64_t>(chunk, bytes.size() - begin)),
                             path, t.name, t.offset);
        }));
        if (bytes_verified != nullptr) *bytes_verified += bytes.size();
        return Status::Ok();
      });
}

}  // namespace tensorferry

// Internal: changing the sidecar checksum manifest of a directory (integrity.h), one writer at a
// time. WriteChecksumManifest (a checkpoint's entries replaced) and the writers (writer.cc: the
// entries of the files a write replaces dropped) both read the manifest, change it and write it
// back; two of them at once, from two threads or two processes writing different files into one
// folder, would otherwise lose each other's entries. Every such read-modify-write holds
// LockManifest(dir) (docs/integrity.md, "Concurrent writers", says what it guarantees where).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "tensorferry/env.h"
#include "tensorferry/integrity.h"
#include "tensorferry/status.h"
#include "util/file_lock.h"

namespace tensorferry::internal {

// The manifest kChecksumManifestName in `dir` ("" is the working directory), read through
// `env`; nullopt when there is none. Errors: kChecksumsInvalid for one above 256 MiB and those of
// ParseChecksumManifest; kIoError when it exists but cannot be read.
Result<std::optional<ChecksumManifest>> ReadManifestIn(Env* env, const std::string& dir);

// The lock every change of the manifest in `dir` holds: FileLock::LockDirectory(dir, kBlock) on
// the directory itself (no file is created); nullopt when the real file system has no such
// directory (the manifest lives in an Env of its own, which no other process reaches through it).
// Errors: those of LockDirectory but kNotFound.
Result<std::optional<FileLock>> LockManifest(const std::string& dir);

// What UpdateManifest does with the manifest it read.
struct ManifestEdit {
  enum class Action : uint8_t { kKeep, kWrite, kRemove };
  Action action = Action::kKeep;
  ChecksumManifest manifest;  // kWrite: the new content
};

// Holding LockManifest(dir): reads the manifest (ReadManifestIn; its errors are handed to
// `edit`, which decides), then does what `edit` returns. kWrite: a temporary file
// util::HiddenSibling(kChecksumManifestName, kTemporaryKind) + 16 hex digits beside it (a dead
// writer's of this machine removed first, util/writer_temporaries.h) (registered for removal if a
// signal ends the process, writer.h's AbandonWritesInProgress), fsynced when `sync`, renamed over
// the manifest, the directory fsynced when `sync`; kRemove: the manifest removed. Errors: those of
// LockManifest; `edit`'s; kIoError of the write, rename or removal (the temporary file is removed;
// the manifest is as it was).
Status UpdateManifest(
    Env* env, const std::string& dir, bool sync,
    const std::function<Result<ManifestEdit>(const Result<std::optional<ChecksumManifest>>&)>&
        edit);
// The same where the caller already holds LockManifest(dir) (or could not have it): the writers,
// which hold it over their renames too.
Status UpdateManifestLocked(
    Env* env, const std::string& dir, bool sync,
    const std::function<Result<ManifestEdit>(const Result<std::optional<ChecksumManifest>>&)>&
        edit);

}  // namespace tensorferry::internal

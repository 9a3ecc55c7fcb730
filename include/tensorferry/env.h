// tensorferry/env.h: the file-access seam.
//
// Every read tensorferry makes goes through an Env, so tests can substitute files that return
// short reads, fail with EIO, shrink in the middle of a load or hold corrupted bytes, without
// touching the disk. Env::Default() reads real files with POSIX calls.
//
// Writes (writer.h) go through the Env too: temporary files, renames, removals and directory
// fsyncs, so tests can make the Nth write fail with ENOSPC or a rename fail halfway through a
// sharded write. The base class implements them with POSIX calls on real paths; an Env that
// overrides only reads (MemoryEnv) therefore writes to disk.
//
// Ownership: OpenRandomAccess and NewTempFile return uniquely owned files; closing happens in
// their destructors (or WritableFile::Close, which reports errors).
// Thread-safety: an Env and a RandomAccessFile may be used from several threads at once (Read is
// positional and const). Env::Default() lives for the whole process.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "tensorferry/status.h"

namespace tensorferry {

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;

  // Reads up to dst.size() bytes at `offset` into dst. Returns the count read, which may be
  // short (including 0 at or past the end of file). Retries EINTR itself.
  // Errors: kIoError naming the path, offset and OS error.
  virtual Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const = 0;

  // Size of the file in bytes, as of now (re-queried on each call).
  virtual Result<uint64_t> Size() const = 0;

  // The path this file was opened with.
  virtual const std::string& path() const noexcept = 0;

  // The POSIX file descriptor behind this file, or -1 when there is none (test doubles). The
  // io_uring, O_DIRECT and mmap paths need one; without it they fall back to Read(). Owned by the
  // file: do not close it.
  virtual int native_handle() const noexcept { return -1; }
};

// A file being written, front to back. Not thread-safe.
class WritableFile {
 public:
  // Closes the file if Close() was not called (errors then go unreported).
  virtual ~WritableFile() = default;

  // Writes all of `data` after the bytes written so far, continuing short writes and retrying
  // EINTR. Errors: kIoError naming the path, the byte offset and the OS error (ENOSPC, EIO...).
  virtual Status Append(std::span<const std::byte> data) = 0;
  // Overwrites `data.size()` bytes already written, starting at `offset` (the writer fills in a
  // header's checksums after streaming the data). REQUIRES: offset + data.size() <= bytes written
  // so far, and buffered Append data is irrelevant (there is none: Append writes through).
  // Errors: kUnsupported from files that cannot (the default; the writer then hashes first),
  // kIoError naming the path, the offset and the OS error.
  virtual Status WriteAt(uint64_t offset, std::span<const std::byte> data) {
    (void)offset;
    (void)data;
    return Status(Code::kUnsupported, path() + ": positioned writes are not supported");
  }
  // fsync. Errors: kIoError naming the path and the OS error.
  virtual Status Sync() = 0;
  // Closes the descriptor, reporting the error (NFS reports some write errors only here). After
  // it, only path() may be called.
  virtual Status Close() = 0;

  virtual const std::string& path() const noexcept = 0;
};

class Env {
 public:
  virtual ~Env() = default;

  // Opens `path` for reading. Errors: kNotFound when it does not exist, kIoError otherwise.
  virtual Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) = 0;

  // Creates a new, empty file "<dir>/<stem><16 hex digits>" that did not exist before (O_EXCL;
  // mode 0666 & ~umask), for writing. `dir` empty means the working directory.
  // Before creating the file, calls `reserve(path)` with the name it is about to create (the
  // writer registers it for removal on a signal, writer.h), and `reserve("")` if the attempt
  // fails. Errors: kIoError naming the path and the OS error.
  virtual Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& dir, const std::string& stem,
      const std::function<void(const std::string& path)>& reserve = {});
  // rename(2): moves `from` to `to`, replacing `to` if it exists, atomically.
  // Errors: kNotFound when `from` does not exist, kIoError otherwise (naming both paths).
  virtual Status RenameFile(const std::string& from, const std::string& to);
  // unlink(2). Errors: kNotFound when it does not exist, kIoError otherwise.
  virtual Status RemoveFile(const std::string& path);
  // fsync of directory `dir`, so the names created, renamed or removed in it are durable. A
  // filesystem that cannot fsync a directory (EINVAL) is not an error.
  // Errors: kIoError naming the directory and the OS error.
  virtual Status SyncDirectory(const std::string& dir);

  // The process-wide POSIX implementation. Never null; never destroyed.
  static Env* Default();
};

// Reads exactly dst.size() bytes at `offset`, looping over short reads. Once *cancel (when given)
// is true, a file whose reads wait in code of their own (an object store's ranged GETs and their
// retries) gives its read up, and ReadFully returns kCancelled ("<path>: read cancelled"); a
// local file's read in progress finishes first.
// Errors: those of Read, kCancelled, and kUnexpectedEof ("<path>: unexpected end of file at
// offset X: wanted N bytes, got M") when the file ends first.
Status ReadFully(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst,
                 const std::atomic<bool>* cancel = nullptr);

}  // namespace tensorferry

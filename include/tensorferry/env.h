// tensorferry/env.h: the file-access seam.
//
// Every read tensorferry makes goes through an Env, so tests can substitute files that return
// short reads, fail with EIO, shrink in the middle of a load or hold corrupted bytes, without
// touching the disk. Env::Default() reads real files with POSIX calls.
//
// Ownership: OpenRandomAccess returns a uniquely owned file; closing happens in its destructor.
// Thread-safety: an Env and a RandomAccessFile may be used from several threads at once (Read is
// positional and const). Env::Default() lives for the whole process.
#pragma once

#include <cstddef>
#include <cstdint>
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

class Env {
 public:
  virtual ~Env() = default;

  // Opens `path` for reading. Errors: kNotFound when it does not exist, kIoError otherwise.
  virtual Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) = 0;

  // The process-wide POSIX implementation. Never null; never destroyed.
  static Env* Default();
};

// Reads exactly dst.size() bytes at `offset`, looping over short reads.
// Errors: those of Read, and kUnexpectedEof ("<path>: unexpected end of file at offset X: wanted
// N bytes, got M") when the file ends first.
Status ReadFully(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst);

}  // namespace tensorferry

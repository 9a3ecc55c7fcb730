// Internal: read engines execute byte-range reads into memory. They know nothing about tensors.
//
// An engine takes a list of requests (a file, an offset, a destination span) and completes all of
// them or fails. Requests are independent: they run concurrently on the engine's workers in the
// order given (the plan interleaves files so workers spread across them). Short reads are
// continued; a read that hits the end of the file early is kUnexpectedEof naming the file and the
// offset; an OS error is kIoError naming file, offset and errno text. After the first failure the
// engine stops starting new requests, waits for the running ones, and returns that first error.
//
// Thread-safety: Execute may be called from several threads at once; requests of concurrent calls
// share the workers. The files must outlive the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "tensorferry/env.h"
#include "tensorferry/status.h"

namespace tensorferry::io {

struct ReadRequest {
  const RandomAccessFile* file = nullptr;
  uint64_t offset = 0;
  std::span<std::byte> dst;
};

struct EngineStats {
  uint64_t bytes_read = 0;  // bytes delivered into destinations
  uint64_t requests = 0;
  uint64_t read_calls = 0;  // system calls (or Env::Read calls) made, short reads included
};

class ReadEngine {
 public:
  virtual ~ReadEngine() = default;
  // Blocks until every request is done or the first error. Errors: see the file comment.
  virtual Status Execute(std::span<const ReadRequest> requests) = 0;
  // Totals since construction.
  virtual EngineStats stats() const = 0;
  virtual std::string_view name() const = 0;
};

// A pool of `threads` workers (0: the number of online CPUs) each calling RandomAccessFile::Read
// (pread for the default Env). Workers are started once and reused across Execute calls.
Result<std::unique_ptr<ReadEngine>> MakePreadEngine(unsigned threads);

// Page-cache residency of [offset, offset + length) of the file at `path`, as a fraction in [0, 1],
// measured with mmap + mincore (no data is read). Errors: kIoError, kNotFound.
Result<double> CachedFraction(const std::string& path, uint64_t offset, uint64_t length);

}  // namespace tensorferry::io

// Integrity checks as bytes land (LoadOptions::verify, docs/integrity.md): the checksum chunks of
// a batch's whole host tensors are hashed by the read engine's workers as the bytes land
// (ReadRequest::landed), while those bytes are still in the worker's cache, instead of in a
// second pass over the batch buffer. Each chunk keeps a streaming hash of its bytes landed in
// order from its start; a piece that lands ahead of that waits (its bytes are hashed from memory
// once the gap before it has landed), and the chunk is compared once all of it has landed.
// Internal to the sinks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "integrity/xxh3_isa.h"
#include "io/read_engine.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "tensorferry/plan.h"

namespace tensorferry::sink {

// What the checks of one load counted (LoadStats::verified_*, verify_*); shared by the threads
// that read batches.
struct VerifyCounts {
  std::atomic<uint64_t> tensors{0}, bytes{0}, skipped{0}, nanos{0};
};

class LandingCheck {
 public:
  // The check of `tensors` (a batch's) laid out at `base` (each tensor at its buffer_offset; with
  // a null `base`, buffer_offset is the tensor's address: LoadInto's destinations), or nullptr
  // when none of them has a checksum. The tensors may not overlap. `sums` is per file
  // (Loader::Impl::checksums); borrowed, as is the checkpoint, for the check's lifetime.
  // Tensor-parallel slices are counted as skipped.
  static std::unique_ptr<LandingCheck> Make(const Checkpoint& checkpoint,
                                            std::span<const PlannedTensor> tensors,
                                            const std::vector<std::optional<FileChecksums>>& sums,
                                            const std::byte* base, VerifyCounts& counts);
  // Bytes [begin, end) past `base` have landed (each byte once): hashes what of them continues a
  // chunk's hash, and checks each chunk this completes. Thread-safe. Errors: kChecksumMismatch
  // (VerifyChunk's message).
  Status Landed(uint64_t begin, uint64_t end);
  // Every chunk not yet hashed, on up to `threads` threads (after a batch's reads and its
  // tensor-parallel moves). Errors: the first mismatching chunk's.
  Status VerifyAll(unsigned threads);
  // As a ReadRequest::landed hook (the request's dst among the tensors).
  const std::function<Status(const io::ReadRequest&)>* hook() const { return &hook_; }
  // Adds the checked tensors to the counts (after a batch whose every chunk landed).
  void Count();

 private:
  struct Chunk {
    uint64_t begin = 0, end = 0;  // past base_
    uint64_t index = 0;           // within its tensor
    const TensorChecksum* expected = nullptr;
    uint64_t chunk_size = 0;
    const TensorInfo* info = nullptr;
    std::mutex mu;  // guards the rest
    bool done = false;
    uint64_t landed = 0;                                 // bytes landed so far
    uint64_t hashed_to = 0;                              // [begin, hashed_to) is in `hash`
    std::vector<std::pair<uint64_t, uint64_t>> waiting;  // landed beyond hashed_to, not hashed
    // Made when the chunk's first bytes land without the rest (a chunk that lands in one piece
    // is hashed in one call, and a batch of many small tensors holds no 576-byte states).
    std::unique_ptr<integrity_internal::Xxh3Stream> hash;
  };
  LandingCheck(const Checkpoint& checkpoint, const std::byte* base, VerifyCounts& counts);
  // Adds [from, to) to the chunk's hash (c.mu held; from == c.hashed_to).
  void Extend(Chunk& c, uint64_t from, uint64_t to);
  // The chunk's hash, from the bytes in the buffer (c.mu held or no writer left).
  uint64_t HashWhole(const Chunk& c);
  // The chunk's whole hash against its checksum.
  Status Compare(const Chunk& c, uint64_t got) const;

  const Checkpoint& checkpoint_;
  uintptr_t base_;  // 0: offsets are addresses
  VerifyCounts& counts_;
  std::unique_ptr<Chunk[]> chunks_;  // sorted by begin, not overlapping
  size_t num_chunks_ = 0;
  uint64_t tensors_ = 0, bytes_ = 0;
  std::function<Status(const io::ReadRequest&)> hook_;
};

}  // namespace tensorferry::sink

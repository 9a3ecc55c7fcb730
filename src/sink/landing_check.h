// Integrity checks as bytes land (LoadOptions::verify, docs/integrity.md): the checksum chunks of
// a batch's whole host tensors are hashed by the read engine's workers as the bytes land
// (ReadRequest::landed), while those bytes are still in the worker's cache, instead of in a
// second pass over the batch buffer. Each chunk keeps a streaming hash of its bytes landed in
// order from its start; a piece that lands ahead of that waits (its bytes are hashed from memory
// once the gap before it has landed), and the chunk is compared once all of it has landed.
// Internal to the sinks.
#pragma once

#include <algorithm>
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
#include "tensorferry/shard.h"

namespace tensorferry::sink {

// What the checks of one load counted (LoadStats::verified_*, verify_*); shared by the threads
// that read batches.
struct VerifyCounts {
  std::atomic<uint64_t> tensors{0}, bytes{0}, skipped{0}, partial{0}, nanos{0};
};

// The checksum chunks (of `chunk_size` bytes, docs/integrity.md) that the tensor-parallel slice
// `slice` of `info` holds whole, each as (chunk index, offset of the chunk's first byte in the
// local tensor), in local order. A dim-0 split holds the chunks inside its rows; a strided split
// (dim > 0) holds a chunk only where one of its ranges is a chunk long or more, which is checked
// without listing ranges shorter than a chunk. Empty when it holds none.
std::vector<std::pair<uint64_t, uint64_t>> SliceWholeChunks(const TensorInfo& info,
                                                            const TensorSlice& slice,
                                                            uint64_t chunk_size);

// Calls chunk(index, local offset) for each checksum chunk that the bytes `tensor` delivers hold
// whole: every chunk of a whole tensor, SliceWholeChunks of a slice. Returns the bytes they
// cover: tensor.size(info) when every delivered byte is checked, less for a slice whose edges
// are left out, 0 for a slice that holds no whole chunk (and for an empty tensor).
template <typename F>
uint64_t ForEachHeldChunk(const TensorInfo& info, const PlannedTensor& tensor, uint64_t chunk_size,
                          F&& chunk) {
  uint64_t covered = 0;
  auto held = [&](uint64_t index, uint64_t local) {
    chunk(index, local);
    covered += std::min(chunk_size, info.size - index * chunk_size);
  };
  if (tensor.slice) {
    for (const auto& [index, local] : SliceWholeChunks(info, *tensor.slice, chunk_size)) {
      held(index, local);
    }
  } else {
    const uint64_t n = ChecksumChunkCount(info.size, chunk_size);
    for (uint64_t c = 0; c < n; ++c) held(c, c * chunk_size);
  }
  return covered;
}

class LandingCheck {
 public:
  // The check of `tensors` (a batch's) laid out at `base` (each tensor at its buffer_offset; with
  // a null `base`, buffer_offset is the tensor's address: LoadInto's destinations), or nullptr
  // when none of them has a checksum. The tensors may not overlap. `sums` is per file
  // (Loader::Impl::checksums); borrowed, as is the checkpoint, for the check's lifetime.
  // A tensor-parallel slice is checked over the chunks it holds whole (SliceWholeChunks): counted
  // as verified when they are all of its bytes, as partial when bytes at its edges are left out,
  // and as skipped when it holds no whole chunk.
  static std::unique_ptr<LandingCheck> Make(const Checkpoint& checkpoint,
                                            std::span<const PlannedTensor> tensors,
                                            const std::vector<std::optional<FileChecksums>>& sums,
                                            const std::byte* base, VerifyCounts& counts);
  // Bytes [begin, end) past `base` have landed (each byte once): hashes what of them continues a
  // chunk's hash, and checks each chunk this completes. Thread-safe. Errors: kChecksumMismatch
  // (VerifyChunk's message).
  Status Landed(uint64_t begin, uint64_t end);
  // Bytes [begin, end) past `base` have passed through `data` on their way there (a pinned
  // staging slot before its copy to the device; `base` is then a device address and is never
  // read): `data` holds them during the call only. Hashed from `data` where they continue a
  // chunk's hash; a piece ahead of that is copied and waits for the gap (at most a chunk's bytes
  // per piece). Thread-safe. Errors: kChecksumMismatch; kInternal when a chunk's bytes pass more
  // than once (its hash cannot be redone from device memory).
  Status Passed(uint64_t begin, uint64_t end, const std::byte* data);
  // Every chunk not yet hashed, on up to `threads` threads (after a batch's reads and its
  // tensor-parallel moves). Errors: the first mismatching chunk's. Host buffers only.
  Status VerifyAll(unsigned threads);
  // As a ReadRequest::landed hook (the request's dst among the tensors).
  const std::function<Status(const io::ReadRequest&)>* hook() const { return &hook_; }
  // As a DeviceTask::passed hook: Passed(dst - base, ..., bytes).
  const std::function<Status(const std::byte* dst, std::span<const std::byte> bytes)>* passed_hook()
      const {
    return &passed_hook_;
  }
  // Adds to the counts the tensors whose every planned chunk was checked: as verified (every byte
  // delivered checked) or partial (a slice's whole chunks checked, its edges not); the rest (bytes
  // that never passed through host memory: GDS reads) as skipped.
  void Count();

 private:
  struct Chunk {
    uint64_t begin = 0, end = 0;  // past base_
    uint64_t index = 0;           // within its tensor
    const TensorChecksum* expected = nullptr;
    uint64_t chunk_size = 0;
    const TensorInfo* info = nullptr;
    uint32_t entry = 0;  // its tensor, in entries_
    std::mutex mu;       // guards the rest
    bool done = false;
    uint64_t landed = 0;     // bytes landed so far
    uint64_t hashed_to = 0;  // [begin, hashed_to) is in `hash`
    struct Waiting {
      uint64_t from = 0, to = 0;
      std::unique_ptr<std::byte[]> copy;  // Passed: the bytes; Landed: null (at base + from)
    };
    std::vector<Waiting> waiting;  // landed beyond hashed_to, not hashed
    // Made when the chunk's first bytes land without the rest (a chunk that lands in one piece
    // is hashed in one call, and a batch of many small tensors holds no 576-byte states).
    std::unique_ptr<integrity_internal::Xxh3Stream> hash;
  };
  LandingCheck(const Checkpoint& checkpoint, const std::byte* base, VerifyCounts& counts);
  // Adds [from, to), held at `data`, to the chunk's hash (c.mu held; from == c.hashed_to).
  void Extend(Chunk& c, uint64_t from, uint64_t to, const std::byte* data);
  // Landed and Passed: `data` holds [begin, end), or null for the buffer at base.
  Status Arrived(uint64_t begin, uint64_t end, const std::byte* data);
  // The chunk's hash, from `data` (the chunk's bytes), or from the buffer when null (c.mu held or
  // no writer left).
  uint64_t HashWhole(const Chunk& c, const std::byte* data = nullptr);
  // The chunk's whole hash against its checksum.
  Status Compare(const Chunk& c, uint64_t got) const;

  const Checkpoint& checkpoint_;
  uintptr_t base_;  // 0: offsets are addresses
  VerifyCounts& counts_;
  // A planned tensor with chunks to check: the bytes it delivers, and those its chunks cover.
  struct Entry {
    uint64_t local_bytes = 0;    // the tensor's size, or a slice's
    uint64_t covered_bytes = 0;  // its chunks' bytes
  };
  std::vector<Entry> entries_;
  std::unique_ptr<Chunk[]> chunks_;  // sorted by begin, not overlapping
  size_t num_chunks_ = 0;
  uint64_t empty_tensors_ = 0;  // zero-byte tensors with checksums: no chunk
  std::function<Status(const io::ReadRequest&)> hook_;
  std::function<Status(const std::byte*, std::span<const std::byte>)> passed_hook_;
};

}  // namespace tensorferry::sink

// Internal: a ring of reusable pinned staging buffers ("slots") for host-to-device copies.
//
// Each slot is its own cudaHostAlloc, made once and kept for the ring's life (pinning is expensive:
// it is paid once per slot, never per chunk). Only the first slot is pinned at creation; the others
// are pinned by the Acquire that first needs them, so the first reads start after one slot's
// pinning rather than the whole ring's, the rest is pinned while earlier slots are read and
// copied, and a load smaller than the ring pins only what it uses. A slot that cannot be pinned
// (the pinned-memory limit) is not an error: the ring stops growing and works with the slots it
// has. Each slot has an event. A producer Acquires a free slot, reads file bytes into it,
// queues the copy to the device on its stream and Submits the slot, which records the slot's event
// behind the copy. The slot is handed out again only after that event has completed, i.e. after
// the device has finished reading it: a slot is never overwritten under a pending copy. Slot count
// times slot size bounds the pinned memory a load uses.
//
// Acquire prefers a never-used or already-completed slot; otherwise it waits for the oldest
// submitted one. An asynchronous copy failure surfaces from the Acquire or Drain that observes the
// slot's event, with the description given at Submit (file, offset, destination).
//
// Thread-safety: Acquire, Submit, Release and Drain may be called from several threads at once.
// A slot's bytes belong to the thread that acquired it until it Submits or Releases it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_api.h"
#include "cuda/resources.h"
#include "tensorferry/status.h"

namespace tensorferry::device {

class StagingRing {
 public:
  // At most `slot_count` slots of `slot_size` bytes each, rounded up to 4 KiB so every slot is page
  // aligned (as O_DIRECT reads need); the first is pinned now. Errors: kInvalidArgument (no slots,
  // size 0), kDeviceOutOfMemory (the first slot's pinned allocation), kCudaError (event creation).
  static Result<std::unique_ptr<StagingRing>> Create(std::shared_ptr<const cuda::Runtime> runtime,
                                                     unsigned slot_count, uint64_t slot_size);
  // Waits for every submitted slot, then frees events and memory.
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  unsigned slot_count() const noexcept { return static_cast<unsigned>(slots_.size()); }
  uint64_t slot_size() const noexcept { return slot_size_; }
  // The pinned memory the ring holds now (slots pinned so far).
  uint64_t pinned_bytes() const;
  // REQUIRES: the caller owns slot `index` (from Acquire).
  std::span<std::byte> slot(unsigned index) const noexcept {
    return {slots_[index].memory->data(), static_cast<size_t>(slot_size_)};
  }

  // Blocks until a slot is free and returns its index; the caller owns it until Submit/Release.
  // Prefers, in order: a free pinned slot, a submitted slot whose copy has completed, a slot not
  // pinned yet (pinned by this call, outside the lock), the oldest submitted slot (waited for).
  // Errors: the asynchronous failure of the copy that last used the slot waited for (kCudaError,
  // "<what given to Submit>: <CUDA error>"); that slot is free again afterwards.
  Result<unsigned> Acquire();
  // The caller queued copies from slot `index` on `stream`: records the slot's event behind them.
  // Errors: kCudaError from cudaEventRecord (the stream is then synchronized and the slot freed).
  Status Submit(unsigned index, cuda::Stream stream, std::string what);
  // Returns a slot from which nothing was queued.
  void Release(unsigned index);
  // Waits until every submitted slot's copy has completed; the first asynchronous error, if any.
  Status Drain();

  // After a pinning failure stopped the ring's growth, lets the next Acquire that finds no free
  // slot try to pin one again (pinned memory may have been freed since): called when a new load
  // takes a kept ring (the pipeline shelf). A failure stops growth again, as before.
  void RetryGrowth();

  unsigned in_use() const;       // slots acquired or submitted and not yet known complete
  unsigned peak_in_use() const;  // highest in_use() seen since creation or ResetPeak
  void ResetPeak();              // peak_in_use() = in_use()

 private:
  enum class SlotState : uint8_t { kFree, kFilling, kSubmitted, kWaiting };
  struct Slot {
    std::unique_ptr<cuda::PinnedHostBuffer> memory;  // null until pinned
    cuda::UniqueEvent event;
    SlotState state = SlotState::kFree;
    std::string what;  // the copy it was submitted for
  };
  StagingRing(std::shared_ptr<const cuda::Runtime> runtime, uint64_t slot_size)
      : runtime_(std::move(runtime)), slot_size_(slot_size) {}
  // REQUIRES: mu_ held. A free slot becomes the caller's.
  unsigned Take(unsigned index);
  // REQUIRES: mu_ held. A slot whose copy completed becomes the caller's, or free again with the
  // copy's error.
  Result<unsigned> Reuse(unsigned index, cuda::Error error);
  // REQUIRES: `lock` holds mu_ and submitted_ is not empty. Takes the oldest submitted slot
  // (kWaiting) and waits for its event with the lock released; the slot and the wait's result.
  std::pair<unsigned, cuda::Error> WaitOldest(std::unique_lock<std::mutex>& lock);
  // REQUIRES: mu_ held. Back to the free list.
  void MakeFree(unsigned index);
  // REQUIRES: mu_ held. Whether a slot is left to pin and growth has not stopped.
  bool CanGrow() const noexcept {
    return !growth_failed_ && (grown_ < slots_.size() || !unpinned_.empty());
  }
  // REQUIRES: `lock` holds mu_ and CanGrow(). Pins a slot not pinned yet with the lock released;
  // the slot, now the caller's, or nothing when pinning failed (the ring stops growing).
  std::optional<unsigned> Grow(std::unique_lock<std::mutex>& lock);

  std::shared_ptr<const cuda::Runtime> runtime_;
  uint64_t slot_size_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  std::deque<unsigned> free_;       // never used, or known complete
  std::deque<unsigned> submitted_;  // in submission order
  unsigned grown_ = 0;              // slots [0, grown_) are pinned, being pinned or unpinned_
  std::vector<unsigned> unpinned_;  // slots below grown_ whose pinning failed
  bool growth_failed_ = false;      // a pinning failed: no more slots are tried (RetryGrowth)
  uint64_t pinned_bytes_ = 0;
  unsigned in_use_ = 0;
  unsigned peak_in_use_ = 0;
};

}  // namespace tensorferry::device

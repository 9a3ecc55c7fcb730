#include "device/staging_ring.h"

#include <algorithm>

#include "util/macros.h"

namespace tensorferry::device {

Result<std::unique_ptr<StagingRing>> StagingRing::Create(
    std::shared_ptr<const cuda::Runtime> runtime, unsigned slot_count, uint64_t slot_size) {
  if (slot_count == 0 || slot_size == 0) {
    return Status(Code::kInvalidArgument,
                  "staging ring: needs at least one slot of at least one "
                  "byte (got " +
                      std::to_string(slot_count) + " slots of " + std::to_string(slot_size) +
                      " bytes)");
  }
  constexpr uint64_t kAlign = 4096;
  const uint64_t rounded = (slot_size + kAlign - 1) / kAlign * kAlign;
  if (rounded < slot_size || rounded > UINT64_MAX / slot_count) {
    return Status(Code::kInvalidArgument, "staging ring: slot count times slot size overflows");
  }
  std::unique_ptr<StagingRing> ring(new StagingRing(runtime, rounded));
  ring->slots_.resize(slot_count);
  for (unsigned i = 0; i < slot_count; ++i) {
    TF_ASSIGN_OR_RETURN(ring->slots_[i].event, cuda::UniqueEvent::Create(runtime));
  }
  // The first slot now: a ring that cannot pin even one slot fails here, at creation.
  TF_ASSIGN_OR_RETURN(ring->slots_[0].memory, cuda::PinnedHostBuffer::Allocate(runtime, rounded));
  ring->grown_ = 1;
  ring->pinned_bytes_ = rounded;
  ring->free_.push_back(0);
  return ring;
}

uint64_t StagingRing::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_bytes_;
}

std::optional<unsigned> StagingRing::Grow(std::unique_lock<std::mutex>& lock) {
  // In no list while it is pinned: no one else sees it.
  unsigned index;
  if (!unpinned_.empty()) {
    index = unpinned_.back();
    unpinned_.pop_back();
  } else {
    index = grown_++;
  }
  lock.unlock();
  auto memory = cuda::PinnedHostBuffer::Allocate(runtime_, slot_size_);
  lock.lock();
  if (!memory.ok()) {
    // The pinned-memory limit (or a failing driver): the ring keeps the slots it has, and does
    // not hand this one out. At least the first slot exists, so loads go on, with less overlap.
    unpinned_.push_back(index);
    growth_failed_ = true;
    return std::nullopt;
  }
  slots_[index].memory = std::move(memory).value();
  pinned_bytes_ += slot_size_;
  return Take(index);
}

void StagingRing::RetryGrowth() {
  std::lock_guard<std::mutex> lock(mu_);
  growth_failed_ = false;
}

StagingRing::~StagingRing() {
  // Nothing may free the memory while a copy still reads it.
  (void)Drain();
}

unsigned StagingRing::Take(unsigned index) {
  slots_[index].state = SlotState::kFilling;
  slots_[index].what.clear();
  ++in_use_;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  return index;
}

void StagingRing::MakeFree(unsigned index) {
  slots_[index].state = SlotState::kFree;
  free_.push_back(index);
  --in_use_;
  cv_.notify_one();
}

Result<unsigned> StagingRing::Reuse(unsigned index, cuda::Error error) {
  if (error != cuda::kSuccess) {
    Status status = runtime_->Check(error, slots_[index].what);
    MakeFree(index);
    return status;
  }
  // Submitted (counted in in_use_) straight to filling.
  slots_[index].state = SlotState::kFilling;
  slots_[index].what.clear();
  return index;
}

Result<unsigned> StagingRing::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!free_.empty()) {
      const unsigned index = free_.front();
      free_.pop_front();
      return Take(index);
    }
    // A submitted slot whose copy has already completed, in any order (copies on different
    // streams finish out of order).
    for (auto it = submitted_.begin(); it != submitted_.end(); ++it) {
      const unsigned index = *it;
      const cuda::Error error = runtime_->api().cudaEventQuery(slots_[index].event.get());
      if (error == cuda::kErrorNotReady) continue;
      submitted_.erase(it);
      return Reuse(index, error);
    }
    // Rather than wait for a copy, pin the next slot: the ring reaches its size while the first
    // reads and copies run (each slot's pinning is paid once).
    if (CanGrow()) {
      if (const std::optional<unsigned> index = Grow(lock)) return *index;
      continue;  // another slot may have come free meanwhile
    }
    if (!submitted_.empty()) {
      // Wait for the oldest, outside the lock so other producers can submit and release.
      const auto [index, error] = WaitOldest(lock);
      return Reuse(index, error);
    }
    // Every slot is being filled or waited for by another thread: one of them frees up.
    cv_.wait(lock, [this] { return !free_.empty() || !submitted_.empty(); });
  }
}

std::pair<unsigned, cuda::Error> StagingRing::WaitOldest(std::unique_lock<std::mutex>& lock) {
  const unsigned index = submitted_.front();
  submitted_.pop_front();
  slots_[index].state = SlotState::kWaiting;
  lock.unlock();
  const cuda::Error error = runtime_->api().cudaEventSynchronize(slots_[index].event.get());
  lock.lock();
  return {index, error};
}

Status StagingRing::Submit(unsigned index, cuda::Stream stream, std::string what) {
  const cuda::Error error = runtime_->api().cudaEventRecord(slots_[index].event.get(), stream);
  std::lock_guard<std::mutex> lock(mu_);
  Slot& slot = slots_[index];
  slot.what = std::move(what);
  if (error != cuda::kSuccess) {
    // Without the event nothing tells when the copy is done: wait for the whole stream.
    Status status = runtime_->Check(error, slot.what + ": cudaEventRecord");
    runtime_->api().cudaStreamSynchronize(stream);
    MakeFree(index);
    return status;
  }
  // Still counted in in_use_: the device reads the slot until the event completes.
  slot.state = SlotState::kSubmitted;
  submitted_.push_back(index);
  cv_.notify_one();
  return Status::Ok();
}

void StagingRing::Release(unsigned index) {
  std::lock_guard<std::mutex> lock(mu_);
  MakeFree(index);
}

Status StagingRing::Drain() {
  Status first;
  std::unique_lock<std::mutex> lock(mu_);
  while (!submitted_.empty()) {
    const auto [index, error] = WaitOldest(lock);
    if (first.ok() && error != cuda::kSuccess) first = runtime_->Check(error, slots_[index].what);
    MakeFree(index);
  }
  return first;
}

unsigned StagingRing::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

unsigned StagingRing::peak_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_in_use_;
}

void StagingRing::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_in_use_ = in_use_;
}

}  // namespace tensorferry::device

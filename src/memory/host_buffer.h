// Internal: destination memory for loaded batches, and the byte budget.
//
// HostBuffer is one anonymous mapping (page-aligned, transparent huge pages requested with
// madvise(MADV_HUGEPAGE) for buffers of 2 MiB and more), unmapped when the last reference goes.
// BufferPool keeps released buffers for reuse, so a second load into the same pool does not pay the
// first-touch cost of fresh memory again (on these VMs ~1-2 GB/s against 10+ GB/s for reused
// memory). Budget counts bytes of live batches: Acquire blocks until the bytes fit, and the
// reservation is returned when the BudgetLease (held by the batch's buffer) is destroyed, i.e. when
// the caller drops the last tensor of that batch.
//
// Thread-safety: all three classes are safe to use from several threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry::memory {

class HostBuffer {
 public:
  // A buffer of `size` bytes mapped for at least `min_capacity` (so that it can serve larger
  // requests later). Errors: kBudgetExceeded when the mapping fails (ENOMEM), with the size in the
  // message.
  static Result<std::unique_ptr<HostBuffer>> Allocate(uint64_t size, uint64_t min_capacity = 0);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  std::byte* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }          // as requested
  uint64_t capacity() const noexcept { return capacity_; }  // mapped bytes
  // Bytes from the start that may hold memory: the largest size requested since the buffer was
  // mapped or last trimmed (BufferPool with trim), rounded up to the huge page when trimmed.
  uint64_t resident() const noexcept { return resident_; }

  // Writes one byte per page of [offset, offset + length) so the kernel allocates the pages now
  // (used to populate ahead of, or alongside, reads). Returns the number of pages touched.
  uint64_t Populate(uint64_t offset, uint64_t length) noexcept;

 private:
  friend class BufferPool;  // a reused buffer takes the size of the new request
  HostBuffer(std::byte* data, uint64_t size, uint64_t capacity)
      : data_(data), size_(size), capacity_(capacity), resident_(size) {}
  // Takes the size of a new request; when `trim`, first returns the memory beyond it (rounded up to
  // the huge page) to the kernel (madvise MADV_DONTNEED: read back as zeros when touched again).
  void Resize(uint64_t size, bool trim) noexcept;
  std::byte* data_;
  uint64_t size_;
  uint64_t capacity_;
  uint64_t resident_;
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Keeps at most `max_cached_bytes` of released buffers (0: keep none), counted by what each may
  // hold (HostBuffer::resident). With `trim` (pools under a byte budget), a buffer reused for a
  // smaller request first returns the memory beyond it when what all the pool's buffers (in use
  // and cached) may hold would otherwise pass `max_cached_bytes`: a buffer that once held a large
  // batch does not keep those pages while it serves smaller ones beside others; without, a reused
  // buffer keeps its pages (no first touch again).
  static std::shared_ptr<BufferPool> Create(uint64_t max_cached_bytes, bool trim = false);

  // A buffer of at least `size` bytes: a cached one whose capacity fits (smallest first, and not
  // more than twice `size`), else a new one mapped for at least `min_capacity` bytes (a budgeted
  // load's batches share one capacity, so that any buffer fits any batch). Released to the pool
  // when the last reference goes, even if the pool has been destroyed meanwhile (then it is simply
  // unmapped).
  Result<std::shared_ptr<HostBuffer>> Acquire(uint64_t size, uint64_t min_capacity = 0);

  uint64_t cached_bytes() const;
  uint64_t reused() const;     // Acquire calls served from the cache
  uint64_t allocated() const;  // Acquire calls that mapped new memory

 private:
  BufferPool(uint64_t max_cached_bytes, bool trim)
      : max_cached_bytes_(max_cached_bytes), trim_(trim) {}
  void Release(std::unique_ptr<HostBuffer> buffer);

  mutable std::mutex mu_;
  uint64_t max_cached_bytes_;
  const bool trim_;
  uint64_t resident_total_ = 0;  // resident() of every buffer of this pool still mapped
  uint64_t cached_bytes_ = 0;
  uint64_t reused_ = 0;
  uint64_t allocated_ = 0;
  std::vector<std::unique_ptr<HostBuffer>> cache_;
};

class Budget;

// A reservation of bytes in a Budget; returns them on destruction. Move-only.
class BudgetLease {
 public:
  BudgetLease() = default;
  BudgetLease(BudgetLease&& other) noexcept;
  BudgetLease& operator=(BudgetLease&& other) noexcept;
  ~BudgetLease();
  uint64_t bytes() const noexcept { return bytes_; }
  // Moves min(bytes, this->bytes()) of this lease into a new lease of the same budget (nothing is
  // released or acquired: the two together hold what this one held).
  BudgetLease Split(uint64_t bytes);

 private:
  friend class Budget;
  BudgetLease(std::shared_ptr<Budget> budget, uint64_t bytes)
      : budget_(std::move(budget)), bytes_(bytes) {}
  std::shared_ptr<Budget> budget_;
  uint64_t bytes_ = 0;
};

class Budget : public std::enable_shared_from_this<Budget> {
 public:
  // `limit` bytes; 0 means unbounded.
  static std::shared_ptr<Budget> Create(uint64_t limit);

  // Blocks until `bytes` fit under the limit, then reserves them. A request larger than the whole
  // limit is granted only when nothing else is held (the caller allowed an oversized tensor).
  BudgetLease Acquire(uint64_t bytes);
  // Non-blocking: nullopt when the bytes do not fit now.
  std::optional<BudgetLease> TryAcquire(uint64_t bytes);
  // Blocks until `bytes` fit (then reserves them, as Acquire) or `stop` is set (then nullopt; stop
  // wins when both hold); a thread that sets `stop` calls Interrupt() after, so that the wait sees
  // it.
  std::optional<BudgetLease> AcquireUnless(uint64_t bytes, const std::atomic<bool>& stop);
  // Wakes every AcquireUnless to check its `stop` again.
  void Interrupt();

  uint64_t limit() const noexcept { return limit_; }
  uint64_t in_use() const;
  uint64_t peak() const;  // highest in_use() seen (since creation or ResetPeak)
  void ResetPeak();       // peak() restarts from in_use()

 private:
  explicit Budget(uint64_t limit) : limit_(limit) {}
  friend class BudgetLease;
  void Release(uint64_t bytes);

  const uint64_t limit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t in_use_ = 0;
  uint64_t peak_ = 0;
};

}  // namespace tensorferry::memory

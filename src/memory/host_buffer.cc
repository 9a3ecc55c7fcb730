// HostBuffer, BufferPool and Budget: see host_buffer.h.
#include "memory/host_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

namespace tensorferry::memory {
namespace {

constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr uint64_t kTouchStride = 4096;  // Populate's step: the smallest page size we run on

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

uint64_t RoundUp(uint64_t n, uint64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// The mapped size for a request of `size` bytes: whole huge pages from 2 MiB on (so the last huge
// page is not split into small ones), whole small pages below, and at least one page.
uint64_t CapacityFor(uint64_t size) {
  if (size >= kHugePage) return RoundUp(size, kHugePage);
  return std::max(RoundUp(size, PageSize()), PageSize());
}

}  // namespace

// --- HostBuffer ----------------------------------------------------------------------------------

Result<std::unique_ptr<HostBuffer>> HostBuffer::Allocate(uint64_t size, uint64_t min_capacity) {
  const uint64_t mapped = std::max(size, min_capacity);
  // Twice the huge page of headroom: the rounding below and the alignment slack must not overflow.
  if (mapped > std::numeric_limits<size_t>::max() - 2 * kHugePage) {
    return Status(Code::kBudgetExceeded, "cannot allocate a host buffer of " +
                                             std::to_string(mapped) + " bytes: too large");
  }
  const uint64_t capacity = CapacityFor(mapped);
  const bool huge = mapped >= kHugePage;
  // mmap only guarantees page alignment, and the kernel backs only 2 MiB-aligned ranges with
  // transparent huge pages; map 2 MiB more than needed and trim both ends to an aligned range.
  const uint64_t map_len = huge ? capacity + kHugePage : capacity;
  void* addr = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (addr == MAP_FAILED) {
    const int err = errno;
    return Status(Code::kBudgetExceeded,
                  "cannot allocate a host buffer of " + std::to_string(size) + " bytes (" +
                      std::to_string(capacity) + " mapped): " + std::strerror(err) + " (errno " +
                      std::to_string(err) + ")");
  }
  auto* base = static_cast<std::byte*>(addr);
  std::byte* data = base;
  if (huge) {
    const auto raw = reinterpret_cast<uintptr_t>(base);
    data = base + (RoundUp(raw, kHugePage) - raw);
    const uint64_t head = static_cast<uint64_t>(data - base);
    const uint64_t tail = map_len - head - capacity;
    if (head > 0) ::munmap(base, head);
    if (tail > 0) ::munmap(data + capacity, tail);
    // Advisory: without THP (disabled, or not built in) the buffer still works with small pages.
    (void)::madvise(data, capacity, MADV_HUGEPAGE);
  }
  return std::unique_ptr<HostBuffer>(new HostBuffer(data, size, capacity));
}

HostBuffer::~HostBuffer() {
  ::munmap(data_, capacity_);
}

void HostBuffer::Resize(uint64_t size, bool trim) noexcept {
  size_ = size;
  if (trim) {
    const uint64_t keep = std::min(capacity_, RoundUp(size, kHugePage));
    if (resident_ > keep) {
      (void)::madvise(data_ + keep, resident_ - keep, MADV_DONTNEED);
      resident_ = keep;
    }
  }
  resident_ = std::max(resident_, size);
}

// The byte written is zero: callers populate a range before reading data into it (fresh anonymous
// memory is zero anyway, and a reused buffer's old contents are about to be overwritten).
uint64_t HostBuffer::Populate(uint64_t offset, uint64_t length) noexcept {
  if (offset >= capacity_) return 0;
  const uint64_t end = offset + std::min(length, capacity_ - offset);
  uint64_t touched = 0;
  // volatile: the stores have no visible effect for the compiler, which could drop them otherwise.
  volatile std::byte* bytes = data_;
  for (uint64_t p = offset / kTouchStride * kTouchStride; p < end; p += kTouchStride) {
    bytes[std::max(p, offset)] = std::byte{0};
    ++touched;
  }
  return touched;
}

// --- BufferPool ----------------------------------------------------------------------------------

std::shared_ptr<BufferPool> BufferPool::Create(uint64_t max_cached_bytes, bool trim) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes, trim));
}

Result<std::shared_ptr<HostBuffer>> BufferPool::Acquire(uint64_t size, uint64_t min_capacity) {
  std::unique_ptr<HostBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Smallest fit, at most twice the request so a small batch does not pin a huge mapping. A
    // buffer of exactly the capacity a fresh allocation would get always qualifies (tiny sizes,
    // and a budgeted load's shared capacity: min_capacity).
    const uint64_t fresh_capacity = CapacityFor(std::max(size, min_capacity));
    auto best = cache_.end();
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      const uint64_t cap = (*it)->capacity();
      const bool fits = cap >= size && (cap / 2 <= size || cap == fresh_capacity);
      if (fits && (best == cache_.end() || cap < (*best)->capacity())) best = it;
    }
    if (best != cache_.end()) {
      buffer = std::move(*best);
      cache_.erase(best);
      cached_bytes_ -= buffer->resident();
      ++reused_;
      // Trimmed only when what the pool's buffers may hold would pass the cache's limit (under a
      // budget: the budget): a buffer that once held a larger batch gives those pages back then,
      // and not while they still fit (each trim is a first touch again for a later larger batch).
      const uint64_t before = buffer->resident();
      const bool trim =
          trim_ && resident_total_ - before + std::max(before, size) > max_cached_bytes_;
      buffer->Resize(size, trim);
      resident_total_ = resident_total_ - before + buffer->resident();
    }
  }
  if (buffer == nullptr) {
    // Mapped outside the lock: a large mmap can take a while and must not stall other callers.
    auto fresh = HostBuffer::Allocate(size, min_capacity);
    if (!fresh.ok()) return fresh.status();
    buffer = std::move(fresh).value();
    std::lock_guard<std::mutex> lock(mu_);
    ++allocated_;
    resident_total_ += buffer->resident();
  }
  // The deleter holds the pool weakly: buffers may outlive it, and must not keep it alive.
  std::weak_ptr<BufferPool> pool = weak_from_this();
  return std::shared_ptr<HostBuffer>(buffer.release(), [pool](HostBuffer* released) {
    std::unique_ptr<HostBuffer> owned(released);
    if (auto p = pool.lock()) p->Release(std::move(owned));
  });
}

void BufferPool::Release(std::unique_ptr<HostBuffer> buffer) {
  std::vector<std::unique_ptr<HostBuffer>> evicted;  // unmapped after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (buffer->resident() > max_cached_bytes_) {  // could never be kept: unmap now
      resident_total_ -= buffer->resident();
      return;
    }
    cached_bytes_ += buffer->resident();
    cache_.push_back(std::move(buffer));
    // Oldest first: the newest buffer is the likeliest to match the next load's batch sizes.
    size_t n = 0;
    while (cached_bytes_ > max_cached_bytes_) {
      cached_bytes_ -= cache_[n]->resident();
      resident_total_ -= cache_[n]->resident();
      evicted.push_back(std::move(cache_[n]));
      ++n;
    }
    cache_.erase(cache_.begin(), cache_.begin() + static_cast<std::ptrdiff_t>(n));
  }
}

uint64_t BufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}

uint64_t BufferPool::reused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reused_;
}

uint64_t BufferPool::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

// --- Budget --------------------------------------------------------------------------------------

BudgetLease::BudgetLease(BudgetLease&& other) noexcept
    : budget_(std::move(other.budget_)), bytes_(std::exchange(other.bytes_, 0)) {}

BudgetLease& BudgetLease::operator=(BudgetLease&& other) noexcept {
  if (this != &other) {
    if (budget_) budget_->Release(bytes_);
    budget_ = std::move(other.budget_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

BudgetLease::~BudgetLease() {
  if (budget_) budget_->Release(bytes_);
}

BudgetLease BudgetLease::Split(uint64_t bytes) {
  const uint64_t n = std::min(bytes, bytes_);
  bytes_ -= n;
  return BudgetLease(budget_, n);
}

std::shared_ptr<Budget> Budget::Create(uint64_t limit) {
  return std::shared_ptr<Budget>(new Budget(limit));
}

namespace {

// Whether `bytes` more can be granted now. An empty budget grants anything: that is how a request
// larger than the whole limit gets through, alone.
bool Fits(uint64_t limit, uint64_t in_use, uint64_t bytes) {
  if (limit == 0 || in_use == 0) return true;
  return in_use <= limit && bytes <= limit - in_use;
}

}  // namespace

BudgetLease Budget::Acquire(uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return Fits(limit_, in_use_, bytes); });
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return BudgetLease(shared_from_this(), bytes);
}

std::optional<BudgetLease> Budget::TryAcquire(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Fits(limit_, in_use_, bytes)) return std::nullopt;
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return BudgetLease(shared_from_this(), bytes);
}

std::optional<BudgetLease> Budget::AcquireUnless(uint64_t bytes, const std::atomic<bool>& stop) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return stop.load() || Fits(limit_, in_use_, bytes); });
  if (stop.load()) return std::nullopt;
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return BudgetLease(shared_from_this(), bytes);
}

void Budget::Interrupt() {
  // Under the lock: a waiter is either before its check (and sees `stop`) or waiting (and wakes).
  std::lock_guard<std::mutex> lock(mu_);
  cv_.notify_all();
}

uint64_t Budget::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

uint64_t Budget::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void Budget::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = in_use_;
}

void Budget::Release(uint64_t bytes) {
  if (bytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_use_ -= bytes;
  }
  // Every waiter re-checks: a release may let several small requests, or one large one, through.
  cv_.notify_all();
}

}  // namespace tensorferry::memory

#include "memory/host_buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

namespace tensorferry::memory {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

uint64_t Page() {
  return static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// --- HostBuffer ----------------------------------------------------------------------------------

TEST(HostBufferTest, CapacityAndAlignment) {
  struct Case {
    uint64_t size;
    uint64_t capacity;
  };
  for (const Case& c :
       {Case{0, Page()}, Case{1, Page()}, Case{Page() + 1, 2 * Page()},
        Case{2 * kMiB - 1, 2 * kMiB}, Case{2 * kMiB, 2 * kMiB}, Case{5 * kMiB + 3, 6 * kMiB}}) {
    SCOPED_TRACE("size=" + std::to_string(c.size));
    auto buffer = HostBuffer::Allocate(c.size);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    EXPECT_EQ((*buffer)->size(), c.size);
    EXPECT_EQ((*buffer)->capacity(), c.capacity);
    const auto addr = reinterpret_cast<uintptr_t>((*buffer)->data());
    EXPECT_EQ(addr % Page(), 0u);
    if (c.size >= 2 * kMiB) {
      EXPECT_EQ(addr % (2 * kMiB), 0u);  // huge-page aligned
    }
  }
}

TEST(HostBufferTest, WholeRangeWritableAndReadable) {
  auto buffer = HostBuffer::Allocate(3 * kMiB + 123);
  ASSERT_TRUE(buffer.ok());
  HostBuffer& b = **buffer;
  for (uint64_t i = 0; i < b.capacity(); ++i) b.data()[i] = static_cast<std::byte>(i * 7);
  uint64_t mismatches = 0;
  for (uint64_t i = 0; i < b.capacity(); ++i) {
    mismatches += b.data()[i] != static_cast<std::byte>(i * 7);
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(HostBufferTest, PopulateCountsPages) {
  auto buffer = HostBuffer::Allocate(4 * kMiB);
  ASSERT_TRUE(buffer.ok());
  HostBuffer& b = **buffer;
  EXPECT_EQ(b.Populate(0, 4 * kMiB), 1024u);
  EXPECT_EQ(b.Populate(0, 0), 0u);
  EXPECT_EQ(b.Populate(4095, 2), 2u);            // straddles a 4 KiB boundary
  EXPECT_EQ(b.Populate(8192, 4096), 1u);         // exactly one page
  EXPECT_EQ(b.Populate(4 * kMiB - 1, 100), 1u);  // clamped to the mapping
  EXPECT_EQ(b.Populate(5 * kMiB, 100), 0u);
  EXPECT_EQ(b.data()[4095], std::byte{0});
}

TEST(HostBufferTest, ImpossibleSizeIsBudgetExceeded) {
  auto buffer = HostBuffer::Allocate(UINT64_MAX - 10);
  ASSERT_FALSE(buffer.ok());
  EXPECT_EQ(buffer.status().code(), Code::kBudgetExceeded);
  EXPECT_NE(buffer.status().message().find(std::to_string(UINT64_MAX - 10)), std::string::npos)
      << buffer.status().ToString();
}

// --- BufferPool ----------------------------------------------------------------------------------

TEST(BufferPoolTest, ReusesSmallestFittingBuffer) {
  auto pool = BufferPool::Create(64 * kMiB);
  {
    auto a = pool->Acquire(4 * kMiB);
    auto b = pool->Acquire(8 * kMiB);
    ASSERT_TRUE(a.ok() && b.ok());
  }
  EXPECT_EQ(pool->allocated(), 2u);
  EXPECT_EQ(pool->cached_bytes(), 12 * kMiB);

  // 3 MiB: the 4 MiB buffer fits (the 8 MiB one is more than twice the size).
  auto c = pool->Acquire(3 * kMiB);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->capacity(), 4 * kMiB);
  EXPECT_EQ((*c)->size(), 3 * kMiB);  // a reused buffer reports the new request's size
  EXPECT_EQ(pool->reused(), 1u);
  EXPECT_EQ(pool->cached_bytes(), 8 * kMiB);

  // 1 MiB: only the 8 MiB buffer is cached, and it is too big: a new buffer.
  auto d = pool->Acquire(1 * kMiB);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(pool->allocated(), 3u);
  EXPECT_EQ(pool->reused(), 1u);

  // Same pointer comes back for the same size.
  std::byte* data = (*c)->data();
  c = pool->Acquire(0);  // the assignment gives the 3 MiB request's buffer back to the cache
  EXPECT_TRUE(c.ok());
  auto e = pool->Acquire(3 * kMiB);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->data(), data);
}

TEST(BufferPoolTest, EvictsBeyondMaxCachedBytes) {
  auto pool = BufferPool::Create(10 * kMiB);
  {
    auto a = pool->Acquire(4 * kMiB);
    auto b = pool->Acquire(4 * kMiB);
    auto c = pool->Acquire(4 * kMiB);
    auto huge = pool->Acquire(12 * kMiB);  // larger than the whole cache: never kept
    ASSERT_TRUE(a.ok() && b.ok() && c.ok() && huge.ok());
  }
  EXPECT_LE(pool->cached_bytes(), 10 * kMiB);
  EXPECT_EQ(pool->cached_bytes(), 8 * kMiB);

  auto none = BufferPool::Create(0);
  { auto a = none->Acquire(kMiB); }
  EXPECT_EQ(none->cached_bytes(), 0u);
  { auto a = none->Acquire(kMiB); }
  EXPECT_EQ(none->reused(), 0u);
  EXPECT_EQ(none->allocated(), 2u);
}

// Pages of [offset, offset + length) of `b` that are resident (mincore).
uint64_t ResidentPages(const HostBuffer& b, uint64_t offset, uint64_t length) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((length + page - 1) / page);
  EXPECT_EQ(::mincore(b.data() + offset, length, in.data()), 0) << std::strerror(errno);
  uint64_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return n;
}

// Under a budget (trim), a buffer that held a large batch and is reused for a smaller one returns
// the memory beyond the new size (rounded up to the huge page) when what the pool's buffers may
// hold, in use and cached, would pass the cache's limit; while it fits, or without trim, the pages
// stay (no first touch again).
TEST(BufferPoolTest, TrimReturnsTheMemoryBeyondASmallerRequestPastTheLimit) {
  struct Case {
    const char* name;
    uint64_t limit;
    bool trim;
    bool trimmed;
  };
  for (const Case& c : {Case{"trim past the limit", 10 * kMiB, true, true},
                        Case{"trim within the limit", 64 * kMiB, true, false},
                        Case{"no trim", 10 * kMiB, false, false}}) {
    SCOPED_TRACE(c.name);
    auto pool = BufferPool::Create(c.limit, c.trim);
    std::byte* data = nullptr;
    {
      auto a = pool->Acquire(8 * kMiB);
      ASSERT_TRUE(a.ok());
      std::memset((*a)->data(), 0x5a, 8 * kMiB);
      data = (*a)->data();
      EXPECT_EQ((*a)->resident(), 8 * kMiB);
    }
    EXPECT_EQ(pool->cached_bytes(), 8 * kMiB);
    auto other = pool->Acquire(3 * kMiB);  // a new buffer (8 MiB is over twice 3 MiB), in use
    ASSERT_TRUE(other.ok());
    ASSERT_NE((*other)->data(), data);
    auto b = pool->Acquire(5 * kMiB);  // the 8 MiB buffer again
    ASSERT_TRUE(b.ok());
    ASSERT_EQ((*b)->data(), data);
    EXPECT_EQ((*b)->size(), 5 * kMiB);
    EXPECT_EQ((*b)->resident(), c.trimmed ? 6 * kMiB : 8 * kMiB);
    EXPECT_EQ(ResidentPages(**b, 0, 5 * kMiB) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)),
              5 * kMiB);
    const uint64_t tail = ResidentPages(**b, 6 * kMiB, 2 * kMiB);
    if (c.trimmed) {
      EXPECT_EQ(tail, 0u);
      EXPECT_EQ((*b)->data()[7 * kMiB], std::byte{0});  // read back as zeros
    } else {
      EXPECT_GT(tail, 0u);
      EXPECT_EQ((*b)->data()[7 * kMiB], std::byte{0x5a});
    }
    EXPECT_EQ((*b)->data()[5 * kMiB - 1], std::byte{0x5a});  // the request's bytes are kept
    b = pool->Acquire(0);
    EXPECT_EQ(pool->cached_bytes(), c.trimmed ? 6 * kMiB : 8 * kMiB);
  }
}

TEST(BufferPoolTest, BufferOutlivesPool) {
  std::shared_ptr<HostBuffer> buffer;
  {
    auto pool = BufferPool::Create(64 * kMiB);
    auto r = pool->Acquire(kMiB);
    ASSERT_TRUE(r.ok());
    buffer = *r;
  }
  std::memset(buffer->data(), 0x5a, buffer->size());  // still mapped
  EXPECT_EQ(buffer->data()[kMiB - 1], std::byte{0x5a});
  buffer.reset();  // unmapped without a pool (ASan would report a use-after-free otherwise)
}

TEST(BufferPoolTest, ConcurrentAcquireRelease) {
  auto pool = BufferPool::Create(16 * kMiB);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 50; ++i) {
        auto b = pool->Acquire(static_cast<uint64_t>((i % 3 + 1) * 100000 + t));
        ASSERT_TRUE(b.ok());
        (*b)->data()[0] = std::byte{1};
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool->reused() + pool->allocated(), 200u);
  EXPECT_GT(pool->reused(), 0u);
}

// --- Budget --------------------------------------------------------------------------------------

// A split lease holds part of the bytes on its own: each part is released when it goes, and a
// split of more than is held takes what there is.
TEST(BudgetTest, SplitLeasesReleaseTheirOwnParts) {
  auto budget = Budget::Create(100);
  auto whole = budget->TryAcquire(80);
  ASSERT_TRUE(whole.has_value());
  {
    BudgetLease part = whole->Split(30);
    EXPECT_EQ(part.bytes(), 30u);
    EXPECT_EQ(whole->bytes(), 50u);
    EXPECT_EQ(budget->in_use(), 80u);
    whole.reset();
    EXPECT_EQ(budget->in_use(), 30u);
    BudgetLease rest = part.Split(500);
    EXPECT_EQ(rest.bytes(), 30u);
    EXPECT_EQ(part.bytes(), 0u);
  }
  EXPECT_EQ(budget->in_use(), 0u);
  EXPECT_EQ(budget->peak(), 80u);
  BudgetLease empty;
  EXPECT_EQ(empty.Split(10).bytes(), 0u);
}

TEST(BudgetTest, TryAcquireAndPeak) {
  auto budget = Budget::Create(100);
  EXPECT_EQ(budget->limit(), 100u);
  auto a = budget->TryAcquire(60);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->bytes(), 60u);
  EXPECT_FALSE(budget->TryAcquire(41).has_value());
  {
    auto b = budget->TryAcquire(40);
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(budget->in_use(), 100u);
  }
  EXPECT_EQ(budget->in_use(), 60u);
  EXPECT_EQ(budget->peak(), 100u);
  EXPECT_FALSE(budget->TryAcquire(200).has_value());  // oversized, and something is held

  // Moves transfer the reservation exactly once.
  BudgetLease moved = std::move(*a);
  EXPECT_EQ(moved.bytes(), 60u);
  a.reset();
  EXPECT_EQ(budget->in_use(), 60u);
  BudgetLease other = budget->Acquire(10);
  other = std::move(moved);  // releases the 10
  EXPECT_EQ(budget->in_use(), 60u);
  other = BudgetLease();
  EXPECT_EQ(budget->in_use(), 0u);

  // Oversized, alone.
  auto big = budget->TryAcquire(250);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(budget->peak(), 250u);
  EXPECT_FALSE(budget->TryAcquire(1).has_value());
}

TEST(BudgetTest, ZeroLimitIsUnbounded) {
  auto budget = Budget::Create(0);
  auto a = budget->Acquire(uint64_t{1} << 50);
  auto b = budget->TryAcquire(uint64_t{1} << 50);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(budget->in_use(), uint64_t{1} << 51);
}

TEST(BudgetTest, AcquireBlocksUntilALeaseIsDestroyed) {
  auto budget = Budget::Create(100);
  auto held = std::make_unique<BudgetLease>(budget->Acquire(80));
  std::atomic<bool> granted{false};
  std::thread waiter([&] {
    BudgetLease lease = budget->Acquire(50);
    granted = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(granted.load());
  held.reset();
  waiter.join();
  EXPECT_TRUE(granted.load());
  EXPECT_EQ(budget->in_use(), 0u);
  EXPECT_EQ(budget->peak(), 80u);
}

// AcquireUnless: granted when a lease goes, like Acquire; or ended by its stop flag and Interrupt
// (nullopt, nothing reserved), while a waiter with its own flag unset keeps waiting.
TEST(BudgetTest, AcquireUnlessWaitsUntilFreedOrStopped) {
  auto budget = Budget::Create(100);
  auto held = std::make_unique<BudgetLease>(budget->Acquire(80));
  std::atomic<bool> stop_a{false}, stop_b{false};
  std::atomic<int> a_result{0}, b_result{0};  // 0 waiting, 1 granted, 2 stopped
  std::thread a([&] {
    std::optional<BudgetLease> lease = budget->AcquireUnless(50, stop_a);
    a_result = lease ? 1 : 2;
  });
  std::optional<BudgetLease> b_lease;
  std::thread b([&] {
    b_lease = budget->AcquireUnless(40, stop_b);
    b_result = b_lease ? 1 : 2;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(a_result.load(), 0);
  EXPECT_EQ(b_result.load(), 0);
  stop_a = true;
  budget->Interrupt();
  a.join();
  EXPECT_EQ(a_result.load(), 2);  // stopped: nothing reserved
  EXPECT_EQ(budget->in_use(), 80u);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(b_result.load(), 0);  // woken by Interrupt, its flag unset: still waiting
  held.reset();
  b.join();
  EXPECT_EQ(b_result.load(), 1);
  EXPECT_EQ(budget->in_use(), 40u);
  b_lease.reset();
  EXPECT_EQ(budget->in_use(), 0u);
  // A stop set before the call: nullopt at once.
  std::atomic<bool> stopped{true};
  auto most = budget->Acquire(100);
  EXPECT_FALSE(budget->AcquireUnless(1, stopped).has_value());
  EXPECT_EQ(budget->in_use(), 100u);
}

TEST(BudgetTest, OversizedWaitsForEmptyBudget) {
  auto budget = Budget::Create(100);
  auto a = std::make_unique<BudgetLease>(budget->Acquire(10));
  auto b = std::make_unique<BudgetLease>(budget->Acquire(10));
  std::atomic<bool> granted{false};
  std::thread waiter([&] {
    BudgetLease lease = budget->Acquire(500);
    granted = true;
    EXPECT_EQ(budget->in_use(), 500u);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  a.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(granted.load());  // 10 bytes are still held
  b.reset();
  waiter.join();
  EXPECT_TRUE(granted.load());
  EXPECT_EQ(budget->peak(), 500u);
  EXPECT_EQ(budget->in_use(), 0u);
}

}  // namespace
}  // namespace tensorferry::memory

#include "device/staging_ring.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::device {
namespace {

using ::tensorferry::testing::Contains;

class StagingRingTest : public testing::FakeCudaTest {
 protected:
  // Three 4 KiB slots whose second pinning (the first Grow) fails; null after a failed ASSERT.
  std::unique_ptr<StagingRing> RingWhoseSecondPinningFails() {
    auto config = DefaultConfig();
    config.fail_host_alloc_at = 2;  // the second cudaHostAlloc only
    Configure(config);
    auto ring = StagingRing::Create(runtime_, 3, 4096);
    EXPECT_TRUE(ring.ok()) << ring.status().ToString();
    return ring.ok() ? std::move(ring).value() : nullptr;
  }

  // Waits (up to 60 s) until the fake has failed a cudaHostAlloc: the waiter thread then has
  // tried to grow, failed, and waits for a slot (or is about to: it waits for one either way).
  bool WaitForTheFailedPinning() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (fake_->Stats().host_alloc_failures == 0) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  void* Malloc(size_t size) {
    void* p = nullptr;
    EXPECT_EQ(runtime_->api().cudaMalloc(&p, size), cuda::kSuccess);
    return p;
  }
};

TEST_F(StagingRingTest, SlotsArePinnedPageAlignedAsTheyAreFirstNeeded) {
  EXPECT_EQ(StagingRing::Create(runtime_, 0, 4096).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(StagingRing::Create(runtime_, 2, 0).status().code(), Code::kInvalidArgument);
  auto ring = StagingRing::Create(runtime_, 3, 5000);
  ASSERT_TRUE(ring.ok()) << ring.status().ToString();
  StagingRing& r = **ring;
  EXPECT_EQ(r.slot_count(), 3u);
  EXPECT_EQ(r.slot_size(), 8192u);
  // Creation pins the first slot only.
  EXPECT_EQ(r.pinned_bytes(), 8192u);
  EXPECT_EQ(fake_->Stats().pinned_bytes_in_use, 8192u);
  EXPECT_EQ(fake_->Stats().events_live, 3u);
  // A free pinned slot is handed out again rather than pinning another.
  auto first = r.Acquire();
  ASSERT_TRUE(first.ok());
  r.Release(*first);
  auto again = r.Acquire();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *first);
  EXPECT_EQ(r.pinned_bytes(), 8192u);
  // Held slots: the next Acquires pin the others, each page aligned and distinct.
  auto second = r.Acquire();
  auto third = r.Acquire();
  ASSERT_TRUE(second.ok() && third.ok());
  std::vector<std::byte*> seen;
  for (const unsigned i : {*again, *second, *third}) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r.slot(i).data()) % 4096, 0u);
    EXPECT_EQ(r.slot(i).size(), 8192u);
    std::memset(r.slot(i).data(), 'x', 8192);
    seen.push_back(r.slot(i).data());
  }
  EXPECT_NE(seen[0], seen[1]);
  EXPECT_NE(seen[1], seen[2]);
  EXPECT_NE(seen[0], seen[2]);
  const TfFakeCudaStats s = fake_->Stats();
  EXPECT_EQ(s.pinned_allocations_live, 3u);
  EXPECT_EQ(s.pinned_bytes_in_use, 3u * 8192);
  EXPECT_EQ(r.pinned_bytes(), 3u * 8192);
  EXPECT_EQ(r.in_use(), 3u);
  for (const unsigned i : {*again, *second, *third}) r.Release(i);
}

TEST_F(StagingRingTest, PinnedAllocationFailureIsReported) {
  auto config = DefaultConfig();
  config.fail_host_alloc_at = 1;
  Configure(config);
  auto ring = StagingRing::Create(runtime_, 4, 1 << 20);
  ASSERT_FALSE(ring.ok());
  EXPECT_EQ(ring.status().code(), Code::kDeviceOutOfMemory);
  EXPECT_TRUE(Contains(ring.status().message(), "cudaHostAlloc(1.05 MB of pinned memory)"))
      << ring.status().ToString();
  EXPECT_TRUE(Contains(ring.status().message(), "cudaErrorMemoryAllocation"));
}

// A slot that cannot be pinned later (the pinned-memory limit) stops the ring's growth, not the
// load: the Acquire that tried waits for a slot that exists, and no pinning is tried again.
TEST_F(StagingRingTest, APinningFailureStopsGrowthAndTheRingGoesOnWithItsSlots) {
  std::unique_ptr<StagingRing> ring = RingWhoseSecondPinningFails();
  ASSERT_NE(ring, nullptr);
  StagingRing& r = *ring;
  auto held = r.Acquire();
  ASSERT_TRUE(held.ok());
  std::atomic<bool> got{false};
  unsigned other = 99;
  std::thread waiter([&] {
    auto slot = r.Acquire();  // pinning fails: waits for the held slot
    ASSERT_TRUE(slot.ok()) << slot.status().ToString();
    other = *slot;
    got = true;
  });
  const bool failed = WaitForTheFailedPinning();
  EXPECT_TRUE(failed) << "the waiter never tried to pin its slot";
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(got.load()) << "handed out a slot that was never pinned";
  r.Release(*held);
  waiter.join();
  EXPECT_EQ(other, *held);
  r.Release(other);
  EXPECT_EQ(r.pinned_bytes(), 4096u);
  EXPECT_EQ(r.in_use(), 0u);
  // Two slots held in turn: the ring does not try to pin again.
  auto a = r.Acquire();
  ASSERT_TRUE(a.ok());
  r.Release(*a);
  const TfFakeCudaStats s = fake_->Stats();
  EXPECT_EQ(s.pinned_allocations_live, 1u);
  EXPECT_EQ(s.pinned_bytes_in_use, 4096u);
}

// A ring whose growth stopped tries again after RetryGrowth (a new load took it): the slot whose
// pinning failed is pinned now, then the one never tried.
TEST_F(StagingRingTest, AfterRetryGrowthTheSlotThatFailedIsPinned) {
  std::unique_ptr<StagingRing> ring = RingWhoseSecondPinningFails();
  ASSERT_NE(ring, nullptr);
  StagingRing& r = *ring;
  auto held = r.Acquire();
  ASSERT_TRUE(held.ok());
  std::thread waiter([&] {  // pinning fails: waits for the held slot
    auto slot = r.Acquire();
    ASSERT_TRUE(slot.ok()) << slot.status().ToString();
    r.Release(*slot);
  });
  // Released only once the waiter's pinning failed: released before, the slot would be taken
  // without a try, and the failure would come to this thread's Acquire below, with `a` held.
  const bool failed = WaitForTheFailedPinning();
  r.Release(*held);
  waiter.join();
  ASSERT_TRUE(failed) << "the waiter never tried to pin its slot";
  EXPECT_EQ(fake_->Stats().host_alloc_failures, 1u);
  EXPECT_EQ(r.pinned_bytes(), 4096u);
  r.RetryGrowth();
  auto a = r.Acquire();
  auto b = r.Acquire();  // none free: pins the slot that failed
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  auto c = r.Acquire();  // and the third, never tried
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(r.pinned_bytes(), 3u * 4096u);
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 3u);
  for (const auto& slot : {a, b, c}) r.Release(*slot);
  EXPECT_EQ(r.in_use(), 0u);
}

// With every slot submitted behind slow copies, Acquire hands a slot out only once the copy that
// used it has run.
TEST_F(StagingRingTest, ASlotIsReusedOnlyAfterItsCopyCompleted) {
  auto config = DefaultConfig();
  config.copy_delay_us = 5000;
  Configure(config);
  auto ring = StagingRing::Create(runtime_, 2, 4096);
  ASSERT_TRUE(ring.ok());
  StagingRing& r = **ring;
  void* dev = Malloc(8192);
  auto stream = cuda::UniqueStream::Create(runtime_);
  ASSERT_TRUE(stream.ok());
  for (int round = 0; round < 6; ++round) {
    auto slot = r.Acquire();
    ASSERT_TRUE(slot.ok()) << slot.status().ToString();
    // The copy of round - 2 used this slot; it (and, in stream order, all before it) has run.
    if (round >= 2) {
      EXPECT_GE(fake_->Stats().copies_executed, static_cast<uint64_t>(round - 1)) << round;
    }
    std::memset(r.slot(*slot).data(), 'a' + round, 4096);
    ASSERT_EQ(runtime_->api().cudaMemcpyAsync(static_cast<char*>(dev) + 4096 * (round % 2),
                                              r.slot(*slot).data(), 4096, cuda::kMemcpyHostToDevice,
                                              stream->get()),
              cuda::kSuccess);
    ASSERT_TRUE(r.Submit(*slot, stream->get(), "round " + std::to_string(round)).ok());
    EXPECT_LE(r.in_use(), 2u);
  }
  ASSERT_TRUE(r.Drain().ok());
  EXPECT_EQ(r.in_use(), 0u);
  EXPECT_EQ(r.peak_in_use(), 2u);
  EXPECT_EQ(fake_->ReadDevice(dev, 8192), std::string(4096, 'e') + std::string(4096, 'f'));
  EXPECT_EQ(runtime_->api().cudaFree(dev), cuda::kSuccess);
}

TEST_F(StagingRingTest, AnAsynchronousCopyErrorNamesItsCopyAndFreesTheSlot) {
  auto config = DefaultConfig();
  config.fail_copy_execute_at = 1;
  config.copy_delay_us = 2000;
  Configure(config);
  auto ring = StagingRing::Create(runtime_, 1, 4096);
  ASSERT_TRUE(ring.ok());
  StagingRing& r = **ring;
  void* dev = Malloc(4096);
  auto stream = cuda::UniqueStream::Create(runtime_);
  ASSERT_TRUE(stream.ok());
  auto slot = r.Acquire();
  ASSERT_TRUE(slot.ok());
  ASSERT_EQ(runtime_->api().cudaMemcpyAsync(dev, r.slot(*slot).data(), 4096,
                                            cuda::kMemcpyHostToDevice, stream->get()),
            cuda::kSuccess);
  ASSERT_TRUE(r.Submit(*slot, stream->get(), "copy of model.safetensors [0, 4096)").ok());
  auto again = r.Acquire();  // waits for the failed copy
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kCudaError);
  EXPECT_TRUE(Contains(again.status().message(),
                       "copy of model.safetensors [0, 4096): cudaErrorIllegalAddress"));
  EXPECT_EQ(r.in_use(), 0u);
  // The slot is usable again (the stream is not: it stays failed, like a CUDA context would).
  auto third = r.Acquire();
  ASSERT_TRUE(third.ok());
  r.Release(*third);
  EXPECT_TRUE(r.Drain().ok());
  EXPECT_EQ(runtime_->api().cudaFree(dev), cuda::kSuccess);
}

TEST_F(StagingRingTest, DrainReportsTheFirstErrorAndWaitsForAll) {
  auto config = DefaultConfig();
  config.fail_copy_execute_at = 2;
  config.copy_delay_us = 1000;
  Configure(config);
  auto ring = StagingRing::Create(runtime_, 4, 4096);
  ASSERT_TRUE(ring.ok());
  StagingRing& r = **ring;
  void* dev = Malloc(4 * 4096);
  std::vector<cuda::UniqueStream> streams;
  for (int i = 0; i < 4; ++i)
    streams.push_back(std::move(cuda::UniqueStream::Create(runtime_)).value());
  for (int i = 0; i < 4; ++i) {
    auto slot = r.Acquire();
    ASSERT_TRUE(slot.ok());
    std::memset(r.slot(*slot).data(), '0' + i, 4096);
    ASSERT_EQ(
        runtime_->api().cudaMemcpyAsync(static_cast<char*>(dev) + 4096 * i, r.slot(*slot).data(),
                                        4096, cuda::kMemcpyHostToDevice, streams[i].get()),
        cuda::kSuccess);
    ASSERT_TRUE(r.Submit(*slot, streams[i].get(), "chunk " + std::to_string(i)).ok());
  }
  const Status drained = r.Drain();
  EXPECT_EQ(drained.code(), Code::kCudaError);
  EXPECT_TRUE(Contains(drained.message(), "chunk "));
  EXPECT_EQ(r.in_use(), 0u);
  EXPECT_EQ(fake_->Stats().copies_executed, 3u);
  EXPECT_EQ(runtime_->api().cudaFree(dev), cuda::kSuccess);
}

// Many threads share a small ring; the fake checks every copy's source at run time against its
// bytes at enqueue time, so a slot handed out under a pending copy shows as a violation (and as
// a data race under ThreadSanitizer).
TEST_F(StagingRingTest, ConcurrentProducersNeverOverwriteAPendingCopy) {
  auto config = DefaultConfig();
  config.copy_delay_us = 200;
  Configure(config);
  constexpr unsigned kSlots = 3, kThreads = 5, kRounds = 40;
  auto ring = StagingRing::Create(runtime_, kSlots, 4096);
  ASSERT_TRUE(ring.ok());
  StagingRing& r = **ring;
  void* dev = Malloc(kThreads * 4096);
  std::vector<cuda::UniqueStream> streams;
  for (unsigned i = 0; i < kThreads; ++i) {
    streams.push_back(std::move(cuda::UniqueStream::Create(runtime_)).value());
  }
  std::atomic<unsigned> failures{0};
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (unsigned round = 0; round < kRounds; ++round) {
        auto slot = r.Acquire();
        if (!slot.ok()) {
          ++failures;
          return;
        }
        std::memset(r.slot(*slot).data(), static_cast<int>(t * kRounds + round), 4096);
        if (runtime_->api().cudaMemcpyAsync(static_cast<char*>(dev) + 4096 * t,
                                            r.slot(*slot).data(), 4096, cuda::kMemcpyHostToDevice,
                                            streams[t].get()) != cuda::kSuccess ||
            !r.Submit(*slot, streams[t].get(), "t").ok()) {
          ++failures;
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
  ASSERT_TRUE(r.Drain().ok());
  EXPECT_LE(r.peak_in_use(), kSlots);
  EXPECT_EQ(fake_->Stats().copies_executed, kThreads * kRounds);
  for (unsigned t = 0; t < kThreads; ++t) {
    EXPECT_EQ(fake_->ReadDevice(static_cast<char*>(dev) + 4096 * t, 4096),
              std::string(4096, static_cast<char>(t * kRounds + kRounds - 1)));
  }
  EXPECT_EQ(runtime_->api().cudaFree(dev), cuda::kSuccess);
}

}  // namespace
}  // namespace tensorferry::device

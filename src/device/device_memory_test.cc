#include "device/device_memory.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::device {
namespace {

using ::tensorferry::testing::Contains;

class DeviceMemoryTest : public testing::FakeCudaTest {};

TEST_F(DeviceMemoryTest, BudgetIsNeverExceeded) {
  auto allocator = DeviceAllocator::Create(runtime_, 0, 10000);
  auto a = allocator->Allocate(6000);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = allocator->Allocate(5000);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), Code::kBudgetExceeded);
  EXPECT_TRUE(Contains(b.status().message(), "device budget of 10.00 KB on device 0 exceeded"));
  EXPECT_TRUE(Contains(b.status().message(), "6.00 KB held, 5.00 KB more requested"));
  EXPECT_EQ(allocator->Allocate(20000).status().code(), Code::kBudgetExceeded);
  auto c = allocator->Allocate(4000);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(allocator->in_use(), 10000u);
  a->reset();  // dropping a buffer returns its bytes
  EXPECT_EQ(allocator->in_use(), 4000u);
  auto d = allocator->Allocate(6000);
  EXPECT_TRUE(d.ok());
  EXPECT_EQ(allocator->peak(), 10000u);
  EXPECT_EQ(allocator->allocations(), 3u);
  EXPECT_LE(fake_->Stats().peak_device_bytes, 10000u);
}

TEST_F(DeviceMemoryTest, ConcurrentCallersNeverOvershootTogether) {
  auto allocator = DeviceAllocator::Create(runtime_, 0, 64 * 1024);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&allocator] {
      for (int i = 0; i < 50; ++i) {
        auto buffer = allocator->Allocate(20 * 1024);
        if (buffer.ok()) {
          EXPECT_LE(allocator->in_use(), 64u * 1024);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(allocator->peak(), 64u * 1024);
  EXPECT_LE(fake_->Stats().peak_device_bytes, 64u * 1024);
  EXPECT_EQ(allocator->in_use(), 0u);
}

TEST_F(DeviceMemoryTest, OutOfMemoryGivesFreeAndTotalAndClearsTheError) {
  auto config = DefaultConfig();
  config.device_memory = 1 << 20;
  Configure(config);
  auto allocator = DeviceAllocator::Create(runtime_, 0, 0);
  auto held = allocator->Allocate(700 * 1024);
  ASSERT_TRUE(held.ok());
  auto more = allocator->Allocate(700 * 1024);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), Code::kDeviceOutOfMemory);
  EXPECT_TRUE(Contains(more.status().message(), "cudaMalloc(716.80 KB)"));
  EXPECT_TRUE(Contains(more.status().message(), "(device 0: 331.78 KB free of 1.05 MB)"));
  EXPECT_TRUE(Contains(more.status().message(), "cudaErrorMemoryAllocation"));
  EXPECT_EQ(runtime_->api().cudaGetLastError(), cuda::kSuccess);
  EXPECT_EQ(allocator->in_use(), 700u * 1024) << "the failed reservation was not returned";
}

// Tensors are views that co-own the batch buffer: cudaFree runs when the last one goes.
TEST_F(DeviceMemoryTest, ViewsKeepTheBufferAliveAndTheLastOneFreesIt) {
  auto allocator = DeviceAllocator::Create(runtime_, 0, 0);
  std::shared_ptr<const void> first_view, second_view;
  {
    auto buffer = allocator->Allocate(8192);
    ASSERT_TRUE(buffer.ok());
    std::shared_ptr<DeviceBuffer> owner = std::move(buffer).value();
    first_view = std::shared_ptr<const void>(owner, owner->data());
    second_view = std::shared_ptr<const void>(owner, owner->data() + 4096);
  }
  allocator.reset();  // the allocator may go first too
  EXPECT_EQ(fake_->Stats().device_allocations_live, 1u);
  first_view.reset();
  EXPECT_EQ(fake_->Stats().device_allocations_live, 1u);
  second_view.reset();
  EXPECT_EQ(fake_->Stats().device_allocations_live, 0u);
}

TEST_F(DeviceMemoryTest, AllocatesOnItsDeviceAndLeavesTheCallersDeviceAlone) {
  auto config = DefaultConfig();
  config.device_count = 2;
  Configure(config);
  ASSERT_EQ(runtime_->api().cudaSetDevice(0), cuda::kSuccess);
  auto allocator = DeviceAllocator::Create(runtime_, 1, 0);
  auto buffer = allocator->Allocate(4096);
  ASSERT_TRUE(buffer.ok());
  EXPECT_EQ((*buffer)->device(), 1);
  int current = -1;
  runtime_->api().cudaGetDevice(&current);
  EXPECT_EQ(current, 0);
  size_t free = 0, total = 0;
  ASSERT_EQ(runtime_->api().cudaSetDevice(1), cuda::kSuccess);
  runtime_->api().cudaMemGetInfo(&free, &total);
  EXPECT_EQ(total - free, 4096u) << "allocated on the wrong device";
  ASSERT_EQ(runtime_->api().cudaSetDevice(0), cuda::kSuccess);

  auto bad = DeviceAllocator::Create(runtime_, 5, 0)->Allocate(16);
  EXPECT_EQ(bad.status().code(), Code::kCudaError);
  EXPECT_TRUE(Contains(bad.status().message(), "cudaSetDevice(5)"));
}

TEST_F(DeviceMemoryTest, ZeroBytesNeedNoAllocation) {
  auto allocator = DeviceAllocator::Create(runtime_, 0, 16);
  auto buffer = allocator->Allocate(0);
  ASSERT_TRUE(buffer.ok());
  EXPECT_EQ((*buffer)->data(), nullptr);
  EXPECT_EQ(fake_->Stats().device_allocations_total, 0u);
}

TEST_F(DeviceMemoryTest, CufileRegistrationHappensOnceAndIsUndoneBeforeFree) {
  auto driver = cuda::CufileDriver::Open(fake_->cufile());
  ASSERT_TRUE(driver.ok());
  std::shared_ptr<cuda::CufileDriver> shared = std::move(driver).value();
  auto allocator = DeviceAllocator::Create(runtime_, 0, 0);
  auto buffer = allocator->Allocate(1 << 16);
  ASSERT_TRUE(buffer.ok());
  EXPECT_TRUE((*buffer)->RegisterWithCufile(shared).ok());
  EXPECT_TRUE((*buffer)->RegisterWithCufile(shared).ok());
  EXPECT_TRUE((*buffer)->cufile_registered());
  EXPECT_EQ(fake_->Stats().cufile_buf_register_calls, 1u);
  shared.reset();  // the registration keeps the driver open
  EXPECT_EQ(fake_->Stats().cufile_drivers_open, 1u);
  buffer->reset();  // deregisters (no violation from cudaFree), then closes the driver
  EXPECT_EQ(fake_->Stats().cufile_drivers_open, 0u);
  EXPECT_EQ(fake_->Stats().cufile_buffers_registered_live, 0u);
}

}  // namespace
}  // namespace tensorferry::device

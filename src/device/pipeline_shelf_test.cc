// The shelf of idle device pipelines (pipeline_shelf.h) against the fake CUDA runtime: what is
// taken matches exactly, at most one per configuration and kMaxIdlePipelines in all, counters reset
// for the new owner, and ReleaseIdlePipelines frees every pinned byte and stream.
#include "device/pipeline_shelf.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/read_engine.h"
#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::device {
namespace {

class PipelineShelfTest : public testing::FakeCudaTest {
 protected:
  static DevicePipelineOptions Options(uint64_t slot_size) {
    DevicePipelineOptions o;
    o.slot_size = slot_size;
    o.staging_bytes = 256 << 10;
    o.gds = GdsMode::kOff;
    return o;
  }
  std::unique_ptr<DevicePipeline> Make(const DevicePipelineOptions& options) {
    auto made = DevicePipeline::Create(runtime_, options, fake_->cufile());
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    return made.ok() ? std::move(made).value() : nullptr;
  }
};

TEST_F(PipelineShelfTest, TakesOnlyAPipelineMadeAlike) {
  ASSERT_EQ(IdlePipelines(), 0u);
  auto made = Make(Options(16 << 10));
  ASSERT_NE(made, nullptr);
  const DevicePipeline* kept = made.get();
  KeepIdlePipeline(std::move(made));
  EXPECT_EQ(IdlePipelines(), 1u);
  EXPECT_EQ(IdlePinnedBytes(), 16u << 10);  // one slot pinned at creation

  // Another slot size, staging size, producer count, GDS mode or device: not this one.
  DevicePipelineOptions other = Options(16 << 10);
  other.staging_bytes *= 2;
  EXPECT_EQ(TakeIdlePipeline(runtime_, other), nullptr);
  other = Options(16 << 10);
  other.producers = 3;
  EXPECT_EQ(TakeIdlePipeline(runtime_, other), nullptr);
  other = Options(16 << 10);
  other.gds = GdsMode::kAuto;
  EXPECT_EQ(TakeIdlePipeline(runtime_, other), nullptr);
  other = Options(16 << 10);
  other.device = 1;
  EXPECT_EQ(TakeIdlePipeline(runtime_, other), nullptr);
  EXPECT_EQ(TakeIdlePipeline(runtime_, Options(20 << 10)), nullptr);
  EXPECT_EQ(IdlePipelines(), 1u);

  // The slot size as Create rounds it (4 KiB) matches.
  auto taken = TakeIdlePipeline(runtime_, Options((16 << 10) - 100));
  ASSERT_EQ(taken.get(), kept);
  EXPECT_EQ(IdlePipelines(), 0u);
  EXPECT_EQ(TakeIdlePipeline(runtime_, Options(16 << 10)), nullptr) << "taken once";
}

TEST_F(PipelineShelfTest, OnePerConfigurationAndABoundInAll) {
  KeepIdlePipeline(Make(Options(16 << 10)));
  KeepIdlePipeline(Make(Options(16 << 10)));  // replaces the first
  EXPECT_EQ(IdlePipelines(), 1u);
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 1u) << "the replaced one was freed";
  for (uint64_t i = 0; i < kMaxIdlePipelines + 2; ++i) {
    KeepIdlePipeline(Make(Options((5 + i) << 12)));
  }
  EXPECT_EQ(IdlePipelines(), kMaxIdlePipelines);
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, kMaxIdlePipelines);
  // The oldest went first.
  EXPECT_EQ(TakeIdlePipeline(runtime_, Options(16 << 10)), nullptr);
  EXPECT_EQ(TakeIdlePipeline(runtime_, Options(5 << 12)), nullptr);
  EXPECT_NE(TakeIdlePipeline(runtime_, Options((5 + kMaxIdlePipelines + 1) << 12)), nullptr);
  EXPECT_EQ(ReleaseIdlePipelines(), kMaxIdlePipelines - 1);
  const TfFakeCudaStats s = fake_->Stats();
  EXPECT_EQ(s.pinned_allocations_live, 0u);
  EXPECT_EQ(s.streams_live, 0u);
  EXPECT_EQ(s.events_live, 0u);
}

TEST_F(PipelineShelfTest, ATakenPipelineCountsOnlyItsNewOwnersWork) {
  testing::TempDir dir;
  const std::string path = dir.Join("f.bin");
  testing::WriteBytes(path, std::string(100 << 10, 'x'));
  auto file = Env::Default()->OpenRandomAccess(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto engine = io::MakePreadEngine(2);
  ASSERT_TRUE(engine.ok());
  auto allocator = DeviceAllocator::Create(runtime_, 0, 0);
  auto buffer = allocator->Allocate(100 << 10);
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  DeviceTask task;
  task.file = file->get();
  task.length = 100 << 10;
  task.dst = (*buffer)->data();

  auto pipeline = Make(Options(16 << 10));
  ASSERT_TRUE(pipeline->Run({&task, 1}, **engine).ok());
  const DevicePipelineStats first = pipeline->stats();
  EXPECT_EQ(first.staged_bytes, 100u << 10);
  EXPECT_GE(first.pinned_bytes, 16u << 10);  // grown as far as the run's reads overlapped
  KeepIdlePipeline(std::move(pipeline));
  EXPECT_EQ(IdlePinnedBytes(), first.pinned_bytes);

  pipeline = TakeIdlePipeline(runtime_, Options(16 << 10));
  ASSERT_NE(pipeline, nullptr);
  DevicePipelineStats fresh = pipeline->stats();
  EXPECT_EQ(fresh.tasks, 0u);
  EXPECT_EQ(fresh.staged_bytes, 0u);
  EXPECT_EQ(fresh.copies, 0u);
  EXPECT_EQ(fresh.peak_slots_in_use, 0u);
  EXPECT_EQ(fresh.pinned_bytes, first.pinned_bytes) << "the ring stays pinned";
  EXPECT_EQ(fresh.slots, first.slots);
  ASSERT_TRUE(pipeline->Run({&task, 1}, **engine).ok());
  EXPECT_EQ(pipeline->stats().staged_bytes, 100u << 10);
  EXPECT_EQ(fake_->ReadDevice((*buffer)->data(), 100 << 10), std::string(100 << 10, 'x'));
}

}  // namespace
}  // namespace tensorferry::device

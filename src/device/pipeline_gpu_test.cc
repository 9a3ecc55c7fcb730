// The device pipeline on a real GPU (label "gpu"; skipped where no device is usable). Run on a
// GPU machine with: ctest --test-dir build/release -L gpu --output-on-failure (docs/gpu.md).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "device/device_memory.h"
#include "device/pipeline.h"
#include "io/read_engine.h"
#include "tensorferry/cuda.h"
#include "testing/real_gpu.h"
#include "testing/test_util.h"

namespace tensorferry::device {
namespace {

class RealGpuPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto runtime = testing::RealGpuRuntime();
    if (!runtime.ok()) GTEST_SKIP() << runtime.status().ToString();
    runtime_ = *runtime;
    auto engine = io::MakePreadEngine(8);
    ASSERT_TRUE(engine.ok());
    engine_ = std::move(engine).value();
  }

  // A file of `size` pseudo-random bytes and tasks covering it in odd pieces, packed.
  void MakeWorkload(uint64_t size) {
    std::mt19937_64 rng(42);
    content_.resize(size);
    for (auto& c : content_) c = static_cast<char>(rng());
    path_ = dir_.Join("weights.bin");
    testing::WriteBytes(path_, content_);
    auto file = Env::Default()->OpenRandomAccess(path_);
    ASSERT_TRUE(file.ok());
    file_ = std::move(file).value();
    auto buffer = DeviceAllocator::Create(runtime_, 0, 0)->Allocate(size);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    buffer_ = std::move(buffer).value();
    uint64_t at = 0;
    while (at < size) {
      // Mostly aligned pieces (GDS-eligible), some odd ones.
      uint64_t length = std::min<uint64_t>(
          size - at, (rng() % 4 == 0) ? 1 + rng() % 100'000 : 4096 * (1 + rng() % 512));
      tasks_.push_back(DeviceTask{file_.get(), at, length, buffer_->data() + at});
      at += length;
    }
  }

  std::string ReadBack() {
    std::string out(content_.size(), '\0');
    EXPECT_EQ(runtime_->api().cudaMemcpy(out.data(), buffer_->data(), out.size(),
                                         cuda::kMemcpyDeviceToHost),
              cuda::kSuccess);
    return out;
  }

  void RunAndCheck(GdsMode mode) {
    DevicePipelineOptions options;
    options.gds = mode;
    auto pipeline = DevicePipeline::Create(runtime_, options);
    if (mode == GdsMode::kOn && !pipeline.ok() &&
        pipeline.status().code() == Code::kGdsUnavailable) {
      GTEST_SKIP() << pipeline.status().ToString();
    }
    ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
    const auto start = std::chrono::steady_clock::now();
    const Status ran = (*pipeline)->Run(tasks_, *engine_, buffer_.get());
    if (mode == GdsMode::kOn && ran.code() == Code::kGdsUnavailable) {
      // The driver opened but the file system refused the file (e.g. no nvidia-fs, or a file
      // system cuFile does not support): forced GDS must say so rather than fall back.
      EXPECT_NE(ran.message().find(path_), std::string::npos) << ran.ToString();
      GTEST_SKIP() << ran.ToString();
    }
    ASSERT_TRUE(ran.ok()) << ran.ToString();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(ReadBack() == content_) << "device bytes differ";
    const DevicePipelineStats stats = (*pipeline)->stats();
    std::printf("gds=%s: %.1f MB in %.3f s (%.2f GB/s), staged %llu B, gds %llu B; %s\n",
                std::string(GdsModeName(mode)).c_str(), content_.size() / 1e6, seconds,
                content_.size() / 1e9 / seconds,
                static_cast<unsigned long long>(stats.staged_bytes),
                static_cast<unsigned long long>(stats.gds_bytes), stats.gds_reason.c_str());
  }

  std::shared_ptr<const cuda::Runtime> runtime_;
  std::unique_ptr<io::ReadEngine> engine_;
  testing::TempDir dir_;
  std::string path_, content_;
  std::unique_ptr<RandomAccessFile> file_;
  std::shared_ptr<DeviceBuffer> buffer_;
  std::vector<DeviceTask> tasks_;
};

TEST_F(RealGpuPipelineTest, StagedCopiesAreByteExact) {
  MakeWorkload(256ull << 20);
  RunAndCheck(GdsMode::kOff);
}

TEST_F(RealGpuPipelineTest, AutoGdsIsByteExact) {
  MakeWorkload(256ull << 20);
  RunAndCheck(GdsMode::kAuto);
}

TEST_F(RealGpuPipelineTest, ForcedGdsIsByteExactOrSkipsWithTheReason) {
  MakeWorkload(64ull << 20);
  RunAndCheck(GdsMode::kOn);
}

TEST_F(RealGpuPipelineTest, DiagnoseSeesTheDevice) {
  const CudaReport report = DiagnoseDevices();
  ASSERT_TRUE(report.cuda_usable()) << report.device_error;
  EXPECT_FALSE(report.devices[0].name.empty());
  EXPECT_GT(report.devices[0].total_memory, 0u);
  EXPECT_GT(report.devices[0].free_memory, 0u);
  EXPECT_FALSE(report.devices[0].pci_bus_id.empty());
  std::printf("%s: %s\n", report.devices[0].name.c_str(), report.gds_reason.c_str());
}

}  // namespace
}  // namespace tensorferry::device

// The Loader on a real GPU (CTest label "gpu"; skipped where the CUDA runtime or a device is
// missing): tensors loaded to cuda:0, with and without GDS, under a device budget, copied back
// with CopyToHost, equal the host load byte for byte; prints the throughput.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cuda/cuda_api.h"
#include "tensorferry/device.h"
#include "tensorferry/loader.h"
#include "tensorferry/writer.h"
#include "testing/real_gpu.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

class LoaderGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto runtime = testing::RealGpuRuntime();
    if (!runtime.ok()) GTEST_SKIP() << runtime.status().ToString();
    // ~96 MB over 3 shards, tensors of odd sizes.
    std::vector<TensorToWrite> tensors;
    data_.reserve(48);
    for (int i = 0; i < 48; ++i) {
      const uint64_t n = (2u << 20) + static_cast<uint64_t>(i) * 4099 + 2;
      std::string bytes(n, '\0');
      for (uint64_t k = 0; k < n; ++k) bytes[k] = static_cast<char>((k * 131 + i * 7) & 0xff);
      data_.push_back(std::move(bytes));
      TensorToWrite t;
      t.name = "model.layers." + std::to_string(i / 4) + ".w" + std::to_string(i % 4);
      t.dtype = DType::kU8;
      t.shape = {n};
      tensors.push_back(std::move(t));
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      tensors[i].data = std::as_bytes(std::span<const char>(data_[i]));
    }
    ShardOptions so;
    so.max_shard_size = 40u << 20;
    ASSERT_TRUE(WriteSharded(dir_.path(), tensors, {}, so).ok());
    auto host = Loader::Open(dir_.path());
    ASSERT_TRUE(host.ok());
    auto got = (*host)->Load();
    ASSERT_TRUE(got.ok());
    for (const Tensor& t : *got) {
      expected_[t.name()] = std::string(reinterpret_cast<const char*>(t.data()), t.size());
    }
  }

  // The pipelines the loads kept (keep_staging) go with the test: tests after it in the same
  // process (on the fake runtime, which counts what is live) find nothing left over.
  void TearDown() override { static_cast<void>(ReleaseIdleStaging()); }

  testing::TempDir dir_;
  std::vector<std::string> data_;
  std::map<std::string, std::string> expected_;
};

TEST_F(LoaderGpuTest, DeviceLoadEqualsHostLoadForEveryGdsMode) {
  for (GdsMode gds : {GdsMode::kOff, GdsMode::kAuto}) {
    for (uint64_t budget : {uint64_t{0}, uint64_t{32} << 20}) {
      LoadOptions o;
      o.device = Device::CUDA(0);
      o.gds = gds;
      o.device_budget = budget;
      auto loader = Loader::Open(dir_.path(), o);
      ASSERT_TRUE(loader.ok()) << loader.status().ToString();
      size_t seen = 0;
      std::string host;
      const auto t0 = std::chrono::steady_clock::now();
      Status s = (*loader)->Stream(Selection::All(), [&](Batch b) -> Status {
        for (const Tensor& t : b.tensors) {
          EXPECT_EQ(t.device(), Device::CUDA(0));
          host.resize(t.size());
          Status c = CopyToHost(t.device(), t.data(), std::as_writable_bytes(std::span(host)));
          if (!c.ok()) return c;
          EXPECT_TRUE(host == expected_.at(t.name())) << t.name();
          ++seen;
        }
        return Status::Ok();
      });
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(seen, expected_.size());
      const LoadStats st = (*loader)->stats();
      if (budget > 0) {
        EXPECT_LE(st.peak_device_bytes, budget);
      }
      std::printf(
          "[gpu loader] gds %s budget %llu: %.2f GB/s (loader time %.3f s, wall %.3f s "
          "with checks); staged %llu, GDS %llu bytes (%s)\n",
          std::string(GdsModeName(gds)).c_str(), static_cast<unsigned long long>(budget),
          st.seconds > 0 ? static_cast<double>(st.bytes) / st.seconds / 1e9 : 0.0, st.seconds,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
          static_cast<unsigned long long>(st.staged_bytes),
          static_cast<unsigned long long>(st.gds_bytes), st.gds_reason.c_str());
    }
  }
}

}  // namespace
}  // namespace tensorferry

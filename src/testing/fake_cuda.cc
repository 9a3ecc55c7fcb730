#include "testing/fake_cuda.h"

#include <dlfcn.h>
#include <stdlib.h>

#include <vector>

#include "device/pipeline_shelf.h"

namespace tensorferry::testing {

Result<FakeCuda> FakeCuda::Load() {
  FakeCuda fake;
  cuda::RuntimeSearch search;
  search.use_environment = false;
  search.path = TENSORFERRY_FAKE_CUDA_PATH;
  auto runtime = cuda::OpenRuntime(search);
  if (!runtime.ok()) return runtime.status();
  fake.runtime_ = std::move(runtime).value();
  cuda::CufileSearch cufile_search;
  cufile_search.use_environment = false;
  cufile_search.path = TENSORFERRY_FAKE_CUDA_PATH;
  auto cufile = cuda::OpenCufile(cufile_search);
  if (!cufile.ok()) return cufile.status();
  fake.cufile_ = std::move(cufile).value();
  // The same file the runtime came from: dlopen hands back the handle already loaded.
  void* handle = ::dlopen(TENSORFERRY_FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle == nullptr) return Status(Code::kInternal, "fake CUDA runtime not loaded");
  fake.default_config_ =
      reinterpret_cast<TfFakeCudaDefaultConfigFn>(::dlsym(handle, "tf_fake_cuda_default_config"));
  fake.reset_ = reinterpret_cast<TfFakeCudaResetFn>(::dlsym(handle, "tf_fake_cuda_reset"));
  fake.stats_ = reinterpret_cast<TfFakeCudaStatsFn>(::dlsym(handle, "tf_fake_cuda_stats"));
  fake.violations_ =
      reinterpret_cast<TfFakeCudaViolationsFn>(::dlsym(handle, "tf_fake_cuda_violations"));
  ::dlclose(handle);  // drops the NOLOAD reference only; the library stays loaded
  if (!fake.default_config_ || !fake.reset_ || !fake.stats_ || !fake.violations_) {
    return Status(Code::kInternal, "fake CUDA runtime lacks its control functions");
  }
  return fake;
}

TfFakeCudaConfig FakeCuda::DefaultConfig() const {
  TfFakeCudaConfig config;
  default_config_(&config);
  return config;
}

void FakeCuda::Reset(const TfFakeCudaConfig& config) const {
  reset_(&config);
}

TfFakeCudaStats FakeCuda::Stats() const {
  TfFakeCudaStats stats;
  stats_(&stats);
  return stats;
}

uint64_t FakeCuda::ViolationCount() const {
  return violations_(nullptr, 0);
}

std::string FakeCuda::Violations() const {
  std::vector<char> buffer(16384);
  violations_(buffer.data(), buffer.size());
  return buffer.data();
}

std::string FakeCuda::ReadDevice(const void* device, uint64_t size) const {
  std::string out(static_cast<size_t>(size), '\0');
  if (size == 0) return out;
  const cuda::Error error =
      runtime_->api().cudaMemcpy(out.data(), device, out.size(), cuda::kMemcpyDeviceToHost);
  EXPECT_EQ(error, cuda::kSuccess) << runtime_->ErrorText(error);
  return out;
}

void FakeCudaTest::SetUp() {
  auto fake = FakeCuda::Load();
  ASSERT_TRUE(fake.ok()) << fake.status().ToString();
  fake_ = std::move(fake).value();
  runtime_ = fake_->runtime();
  config_ = fake_->DefaultConfig();
  fake_->Reset(config_);
  const TfFakeCudaStats s = fake_->Stats();
  ASSERT_EQ(s.device_allocations_live + s.pinned_allocations_live + s.streams_live + s.events_live,
            0u)
      << "an earlier test leaked fake CUDA objects";
}

void FakeCudaProcessTest::SetUp() {
  // Before the first use of the process-wide runtime and cuFile, so both are the fake.
  runtime_env_.emplace("TENSORFERRY_CUDA_RUNTIME", TENSORFERRY_FAKE_CUDA_PATH);
  cufile_env_.emplace("TENSORFERRY_CUFILE_LIBRARY", TENSORFERRY_FAKE_CUDA_PATH);
  auto process = cuda::ProcessRuntime();
  if (!process.ok() || (*process)->path() != TENSORFERRY_FAKE_CUDA_PATH) {
    GTEST_SKIP() << "this process loaded another CUDA runtime first; run through ctest";
  }
  ASSERT_TRUE(cuda::ProcessCufile().ok());
  FakeCudaTest::SetUp();
}

void FakeCudaTest::TearDown() {
  if (!fake_) return;
  // Pipelines Loaders kept for reuse (LoadOptions::keep_staging) hold fake pinned memory, streams
  // and events: a test's objects end with the test.
  device::ReleaseIdlePipelines();
  EXPECT_EQ(fake_->ViolationCount(), 0u) << fake_->Violations();
  const TfFakeCudaStats s = fake_->Stats();
  EXPECT_EQ(s.device_allocations_live, 0u) << "device memory leaked";
  EXPECT_EQ(s.device_bytes_in_use, 0u);
  EXPECT_EQ(s.pinned_allocations_live, 0u) << "pinned memory leaked";
  EXPECT_EQ(s.streams_live, 0u) << "streams leaked";
  EXPECT_EQ(s.events_live, 0u) << "events leaked";
  EXPECT_EQ(s.cufile_handles_live, 0u) << "cuFile file handles leaked";
  EXPECT_EQ(s.cufile_buffers_registered_live, 0u) << "cuFile buffer registrations leaked";
  EXPECT_EQ(s.cufile_drivers_open, 0u) << "cuFile driver left open";
  fake_->Reset();
}

std::string FakeCudaTest::TakeViolations() {
  std::string v = fake_->Violations();
  fake_->Reset(config_);
  return v;
}

}  // namespace tensorferry::testing

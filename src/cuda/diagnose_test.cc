#include "cuda/diagnose.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::cuda {
namespace {

using ::tensorferry::testing::Contains;

class CudaDiagnoseTest : public testing::FakeCudaTest {};

TEST_F(CudaDiagnoseTest, ReportsDevicesAndUsableGds) {
  auto config = DefaultConfig();
  config.device_count = 2;
  config.device_memory = 3ull << 30;
  Configure(config);
  ASSERT_EQ(runtime_->api().cudaSetDevice(0), kSuccess);  // the caller's device, with a context
  const CudaReport report = Diagnose(runtime_, fake_->cufile(), DiagnoseOptions{});
  EXPECT_TRUE(report.runtime_loaded);
  EXPECT_EQ(report.runtime_path, TENSORFERRY_FAKE_CUDA_PATH);
  EXPECT_EQ(report.runtime_version, 13000);
  EXPECT_EQ(report.driver_version, 13000);
  ASSERT_EQ(report.devices.size(), 2u);
  EXPECT_TRUE(report.cuda_usable());
  for (int i = 0; i < 2; ++i) {
    const CudaDeviceInfo& d = report.devices[static_cast<size_t>(i)];
    EXPECT_EQ(d.index, i);
    EXPECT_EQ(d.name, "tensorferry fake GPU " + std::to_string(i));
    EXPECT_EQ(d.pci_bus_id, i == 0 ? "0000:10:00.0" : "0000:11:00.0");
    EXPECT_EQ(d.compute_major, 9);
    EXPECT_EQ(d.total_memory, 3ull << 30);
    EXPECT_EQ(d.free_memory, 3ull << 30);
    EXPECT_EQ(d.error, "");
  }
  EXPECT_TRUE(report.cufile_loaded);
  EXPECT_TRUE(report.cufile_driver_opened);
  EXPECT_TRUE(report.gds_usable);
  EXPECT_TRUE(Contains(report.gds_reason, "cuFile driver opened"));
  EXPECT_EQ(fake_->Stats().cufile_drivers_open, 0u) << "the diagnosis left the driver open";
  // The caller's device is restored.
  int current = -1;
  runtime_->api().cudaGetDevice(&current);
  EXPECT_EQ(current, 0);
}

// A thread that never used a device reads device 0 as current; "restoring" it would create a
// context there (CUDA 12): it is left on the last device queried instead, GPU 0 untouched.
TEST_F(CudaDiagnoseTest, AThreadWithoutAContextGetsNoneOnGpu0) {
  auto config = DefaultConfig();
  config.device_count = 2;
  Configure(config);
  std::thread([&] {
    DiagnoseOptions options;
    options.open_cufile_driver = false;  // the driver's own context is on device 0, on purpose
    const CudaReport report = Diagnose(runtime_, fake_->cufile(), options);
    EXPECT_EQ(report.devices.size(), 2u);
  }).join();
  EXPECT_EQ(fake_->Stats().contexts_active_mask, 0b10u);
}

TEST_F(CudaDiagnoseTest, SaysWhyThereIsNoDevice) {
  auto config = DefaultConfig();
  config.device_count_error = 35;
  Configure(config);
  const CudaReport report = Diagnose(runtime_, fake_->cufile(), DiagnoseOptions{});
  EXPECT_TRUE(report.runtime_loaded);
  EXPECT_FALSE(report.cuda_usable());
  EXPECT_TRUE(Contains(report.device_error, "cudaErrorInsufficientDriver"));
  EXPECT_FALSE(report.gds_usable);
  EXPECT_TRUE(Contains(report.gds_reason, "no usable CUDA device"));
}

TEST_F(CudaDiagnoseTest, SaysWhyGdsIsNotUsable) {
  auto config = DefaultConfig();
  config.cufile_driver_open_error = 5007;
  Configure(config);
  CudaReport report = Diagnose(runtime_, fake_->cufile(), DiagnoseOptions{});
  EXPECT_TRUE(report.cuda_usable());
  EXPECT_TRUE(report.cufile_loaded);
  EXPECT_FALSE(report.cufile_driver_opened);
  EXPECT_TRUE(Contains(report.cufile_driver_error, "CU_FILE_PLATFORM_NOT_SUPPORTED"));
  EXPECT_FALSE(report.gds_usable);
  EXPECT_TRUE(Contains(report.gds_reason, "the cuFile driver did not open"));

  report = Diagnose(runtime_, Status(Code::kCudaNotFound, "libcufile.so.0 not found"),
                    DiagnoseOptions{});
  EXPECT_FALSE(report.cufile_loaded);
  EXPECT_TRUE(Contains(report.gds_reason, "cuFile is not installed (libcufile.so.0 not found)"));
}

TEST(CudaDiagnoseNoRuntimeTest, SaysWhyThereIsNoRuntime) {
  const CudaReport report =
      Diagnose(Status(Code::kCudaNotFound, "CUDA runtime (libcudart) not found; tried: x"),
               Status(Code::kCudaNotFound, "not loaded"), DiagnoseOptions{});
  EXPECT_FALSE(report.runtime_loaded);
  EXPECT_FALSE(report.cuda_usable());
  EXPECT_TRUE(Contains(report.runtime_error, "tried: x"));
  EXPECT_TRUE(Contains(report.gds_reason, "no usable CUDA device (CUDA runtime"));
}

// The process-wide entry points agree with each other, whatever this machine has.
TEST(CudaDiagnoseNoRuntimeTest, PublicCallsAgree) {
  DiagnoseOptions options;
  options.query_free_memory = false;
  options.open_cufile_driver = false;
  const CudaReport report = DiagnoseDevices(options);
  EXPECT_EQ(report.cuda_usable(), CudaAvailable());
  if (!report.runtime_loaded) {
    EXPECT_FALSE(report.runtime_error.empty());
  }
  if (report.runtime_loaded && report.devices.empty()) {
    EXPECT_FALSE(report.device_error.empty());
  }
  EXPECT_FALSE(report.gds_reason.empty());
}

}  // namespace
}  // namespace tensorferry::cuda

// The run-time loading of the CUDA runtime and cuFile: search order, the environment override,
// error reporting for missing libraries and functions, device checks, the cuFile driver.
#include "cuda/cuda_api.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "cuda/cufile_api.h"
#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::cuda {
namespace {

using testing::FakeCudaTest;
using testing::ScopedEnv;

using ::tensorferry::testing::Contains;

std::string DirOf(const std::string& path) {
  return path.substr(0, path.rfind('/'));
}
std::string BaseOf(const std::string& path) {
  return path.substr(path.rfind('/') + 1);
}

TEST(CudaShimTest, LoadsTheRuntimeGivenByPath) {
  RuntimeSearch search;
  search.use_environment = false;
  search.path = TENSORFERRY_FAKE_CUDA_PATH;
  auto runtime = OpenRuntime(search);
  ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
  EXPECT_EQ((*runtime)->path(), TENSORFERRY_FAKE_CUDA_PATH);
  EXPECT_EQ((*runtime)->RuntimeVersion(), 13000);
  EXPECT_EQ(VersionText((*runtime)->RuntimeVersion()), "13.0");
  EXPECT_EQ(VersionText(0), "none");
  EXPECT_NE((*runtime)->api().cudaGetDeviceProperties, nullptr);
  EXPECT_TRUE(Contains((*runtime)->ErrorText(kErrorMemoryAllocation),
                       "cudaErrorMemoryAllocation: out of memory"));
}

TEST(CudaShimTest, MissingLibraryNamesEveryCandidateAndTheReason) {
  RuntimeSearch search;
  search.use_environment = false;
  search.names = {"libtensorferry_absent_a.so.1", "libtensorferry_absent_b.so"};
  auto runtime = OpenRuntime(search);
  ASSERT_FALSE(runtime.ok());
  EXPECT_EQ(runtime.status().code(), Code::kCudaNotFound);
  EXPECT_EQ(runtime.status().category(), Category::kUnsupported);
  EXPECT_TRUE(Contains(runtime.status().message(), "CUDA runtime (libcudart) not found"));
  EXPECT_TRUE(Contains(runtime.status().message(), "libtensorferry_absent_a.so.1 ("));
  EXPECT_TRUE(Contains(runtime.status().message(), "libtensorferry_absent_b.so ("));
  EXPECT_TRUE(Contains(runtime.status().message(), "cannot open shared object file"));
}

TEST(CudaShimTest, MissingPathIsReported) {
  RuntimeSearch search;
  search.use_environment = false;
  search.path = "/nonexistent/tensorferry/libcudart.so.13";
  auto runtime = OpenRuntime(search);
  ASSERT_FALSE(runtime.ok());
  EXPECT_EQ(runtime.status().code(), Code::kCudaNotFound);
  EXPECT_TRUE(Contains(runtime.status().message(), "/nonexistent/tensorferry/libcudart.so.13"));
}

TEST(CudaShimTest, MissingFunctionNamesTheLibraryAndTheFunction) {
  RuntimeSearch search;
  search.use_environment = false;
  search.path = TENSORFERRY_FAKE_CUDA_INCOMPLETE_PATH;
  auto runtime = OpenRuntime(search);
  ASSERT_FALSE(runtime.ok());
  EXPECT_EQ(runtime.status().code(), Code::kCudaSymbolMissing);
  EXPECT_EQ(runtime.status().category(), Category::kUnsupported);
  EXPECT_TRUE(Contains(runtime.status().message(), TENSORFERRY_FAKE_CUDA_INCOMPLETE_PATH));
  EXPECT_TRUE(Contains(runtime.status().message(), "missing symbol cudaSetDevice"));

  CufileSearch cufile;
  cufile.use_environment = false;
  cufile.path = TENSORFERRY_FAKE_CUDA_INCOMPLETE_PATH;
  auto lib = OpenCufile(cufile);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), Code::kCudaSymbolMissing);
  EXPECT_TRUE(Contains(lib.status().message(), "missing symbol cuFileDriverOpen"));
}

TEST(CudaShimTest, EnvironmentVariableOverridesEverythingElse) {
  {
    ScopedEnv env(kRuntimeEnvVar, TENSORFERRY_FAKE_CUDA_PATH);
    RuntimeSearch search;
    search.path = "/nonexistent/ignored.so";
    auto runtime = OpenRuntime(search);
    ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
    EXPECT_EQ((*runtime)->path(), TENSORFERRY_FAKE_CUDA_PATH);
  }
  {
    // Set but wrong: an error, not a silent fallback to the system's runtime.
    ScopedEnv env(kRuntimeEnvVar, "/nonexistent/from-env/libcudart.so");
    auto runtime = OpenRuntime(RuntimeSearch{});
    ASSERT_FALSE(runtime.ok());
    EXPECT_EQ(runtime.status().code(), Code::kCudaNotFound);
    EXPECT_TRUE(Contains(runtime.status().message(), "/nonexistent/from-env/libcudart.so"));
  }
  {
    ScopedEnv env(kCufileEnvVar, "/nonexistent/from-env/libcufile.so.0");
    auto cufile = OpenCufile(CufileSearch{});
    ASSERT_FALSE(cufile.ok());
    EXPECT_EQ(cufile.status().code(), Code::kCudaNotFound);
    EXPECT_TRUE(Contains(cufile.status().message(), "cuFile library (libcufile) not found"));
    EXPECT_TRUE(Contains(cufile.status().message(), "/nonexistent/from-env/libcufile.so.0"));
  }
}

TEST(CudaShimTest, SearchesHintDirectoriesFirst) {
  const std::string fake = TENSORFERRY_FAKE_CUDA_PATH;
  RuntimeSearch search;
  search.use_environment = false;
  search.directories = {"/nonexistent/torch/lib", DirOf(fake)};
  search.names = {BaseOf(fake)};
  auto runtime = OpenRuntime(search);
  ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
  EXPECT_EQ((*runtime)->path(), fake);
}

class CudaShimFakeTest : public FakeCudaTest {};

TEST_F(CudaShimFakeTest, DeviceCountErrorsBecomeNoDeviceWithTheReason) {
  auto config = DefaultConfig();
  config.device_count_error = kErrorInsufficientDriver;
  Configure(config);
  auto count = runtime_->DeviceCount();
  ASSERT_FALSE(count.ok());
  EXPECT_EQ(count.status().code(), Code::kCudaNoDevice);
  EXPECT_TRUE(Contains(count.status().message(), "cudaGetDeviceCount"));
  EXPECT_TRUE(Contains(count.status().message(), "cudaErrorInsufficientDriver"));
  // The error was cleared: it does not leak into the next call.
  EXPECT_EQ(runtime_->api().cudaGetLastError(), kSuccess);

  config = DefaultConfig();
  config.device_count = 0;
  Configure(config);
  count = runtime_->DeviceCount();
  ASSERT_FALSE(count.ok());
  EXPECT_TRUE(Contains(count.status().message(), "cudaErrorNoDevice"));

  Configure(DefaultConfig());
  ASSERT_TRUE(runtime_->DeviceCount().ok());
  EXPECT_EQ(*runtime_->DeviceCount(), 1);
  EXPECT_TRUE(runtime_->CheckDevice(0).ok());
  const Status bad = runtime_->CheckDevice(1);
  EXPECT_EQ(bad.code(), Code::kCudaNoDevice);
  EXPECT_TRUE(Contains(bad.message(), "CUDA device 1 does not exist (1 device)"));
}

TEST_F(CudaShimFakeTest, ScopedDeviceRestoresTheCallersDevice) {
  auto config = DefaultConfig();
  config.device_count = 2;
  Configure(config);
  ASSERT_EQ(runtime_->api().cudaSetDevice(1), kSuccess);
  {
    ScopedDevice scoped(*runtime_, 0);
    ASSERT_TRUE(scoped.status().ok());
    int current = -1;
    runtime_->api().cudaGetDevice(&current);
    EXPECT_EQ(current, 0);
  }
  int current = -1;
  runtime_->api().cudaGetDevice(&current);
  EXPECT_EQ(current, 1);
  {
    ScopedDevice bad(*runtime_, 7);
    EXPECT_EQ(bad.status().code(), Code::kCudaError);
    EXPECT_TRUE(Contains(bad.status().message(), "cudaSetDevice(7)"));
  }
  runtime_->api().cudaGetLastError();
  ASSERT_EQ(runtime_->api().cudaSetDevice(0), kSuccess);
}

TEST_F(CudaShimFakeTest, CufileDriverOpensAndClosesOrSaysWhy) {
  {
    auto driver = CufileDriver::Open(fake_->cufile());
    ASSERT_TRUE(driver.ok()) << driver.status().ToString();
    EXPECT_EQ(fake_->Stats().cufile_drivers_open, 1u);
  }
  EXPECT_EQ(fake_->Stats().cufile_drivers_open, 0u);

  auto config = DefaultConfig();
  config.cufile_driver_open_error = 5007;
  Configure(config);
  auto driver = CufileDriver::Open(fake_->cufile());
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), Code::kGdsUnavailable);
  EXPECT_TRUE(Contains(driver.status().message(),
                       "cuFileDriverOpen: CU_FILE_PLATFORM_NOT_SUPPORTED (5007)"));
}

TEST(CudaShimTest, CufileErrorTexts) {
  EXPECT_EQ(CufileErrorText(CufileError{5008, 0}), "CU_FILE_IO_NOT_SUPPORTED (5008)");
  EXPECT_EQ(CufileErrorText(CufileError{5011, 700}),
            "CU_FILE_CUDA_DRIVER_ERROR (5011), CUDA driver error 700");
  EXPECT_EQ(CufileErrorText(CufileError{5999, 0}), "cuFile error (5999)");
  EXPECT_EQ(CufileReadErrorText(-1, EIO), std::string(std::strerror(EIO)));
  EXPECT_EQ(CufileReadErrorText(-5012, 0), "CU_FILE_CUDA_POINTER_INVALID (5012)");
}

TEST(CudaShimTest, CodesHaveNamesAndCategories) {
  EXPECT_EQ(CodeName(Code::kCudaNotFound), "cuda_not_found");
  EXPECT_EQ(CodeName(Code::kCudaSymbolMissing), "cuda_symbol_missing");
  EXPECT_EQ(CodeName(Code::kCudaNoDevice), "cuda_no_device");
  EXPECT_EQ(CodeName(Code::kDeviceOutOfMemory), "device_out_of_memory");
  EXPECT_EQ(CodeName(Code::kGdsUnavailable), "gds_unavailable");
  EXPECT_EQ(CodeName(Code::kCufileError), "cufile_error");
  EXPECT_EQ(CategoryOf(Code::kCudaNoDevice), Category::kUnsupported);
  EXPECT_EQ(CategoryOf(Code::kGdsUnavailable), Category::kUnsupported);
  EXPECT_EQ(CategoryOf(Code::kDeviceOutOfMemory), Category::kCuda);
  EXPECT_EQ(CategoryOf(Code::kCufileError), Category::kCuda);
}

}  // namespace
}  // namespace tensorferry::cuda

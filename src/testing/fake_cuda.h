// Test-only: the fake CUDA runtime and cuFile (tests/fake_cuda/), loaded by path, and a fixture
// that resets it before each test and checks after it that nothing leaked and nothing was misused.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "fake_cuda/fake_cuda_control.h"
#include "testing/test_util.h"

namespace tensorferry::testing {

class FakeCuda {
 public:
  // Loads the fake (once per process: it is never unloaded) as both the runtime and cuFile.
  static Result<FakeCuda> Load();

  const std::shared_ptr<const cuda::Runtime>& runtime() const { return runtime_; }
  const std::shared_ptr<const cuda::Cufile>& cufile() const { return cufile_; }

  TfFakeCudaConfig DefaultConfig() const;
  void Reset(const TfFakeCudaConfig& config) const;
  void Reset() const { Reset(DefaultConfig()); }
  TfFakeCudaStats Stats() const;
  uint64_t ViolationCount() const;
  std::string Violations() const;

  // Reads `size` bytes of device memory at `device` back to the host (synchronous cudaMemcpy).
  std::string ReadDevice(const void* device, uint64_t size) const;

 private:
  std::shared_ptr<const cuda::Runtime> runtime_;
  std::shared_ptr<const cuda::Cufile> cufile_;
  TfFakeCudaDefaultConfigFn default_config_ = nullptr;
  TfFakeCudaResetFn reset_ = nullptr;
  TfFakeCudaStatsFn stats_ = nullptr;
  TfFakeCudaViolationsFn violations_ = nullptr;
};

// Base fixture: loads and resets the fake before each test; after it, expects no violation and
// no live device memory, pinned memory, stream, event or cuFile object (tests must have destroyed
// what they created).
class FakeCudaTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  // Applies `config` (counters restart from zero).
  void Configure(const TfFakeCudaConfig& config) {
    config_ = config;
    fake_->Reset(config);
  }
  TfFakeCudaConfig DefaultConfig() const { return fake_->DefaultConfig(); }
  // For tests that provoke violations on purpose: returns them and clears them (and the counters;
  // the configuration stays).
  std::string TakeViolations();

  std::optional<FakeCuda> fake_;
  TfFakeCudaConfig config_{};
  std::shared_ptr<const cuda::Runtime> runtime_;
};

// FakeCudaTest for code that reaches CUDA through the process-wide runtime and cuFile
// (cuda::ProcessRuntime, cuda::ProcessCufile): selects the fake for both with
// TENSORFERRY_CUDA_RUNTIME / TENSORFERRY_CUFILE_LIBRARY before their first use, and skips the test
// where the process loaded another runtime first (run through ctest: a process per test).
class FakeCudaProcessTest : public FakeCudaTest {
 protected:
  void SetUp() override;

  std::optional<ScopedEnv> runtime_env_;
  std::optional<ScopedEnv> cufile_env_;
};

}  // namespace tensorferry::testing

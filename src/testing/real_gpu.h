// Test-only: the real CUDA runtime for the tests labelled "gpu", which skip where it is unusable.
#pragma once

#include <memory>

#include "cuda/cuda_api.h"
#include "tensorferry/status.h"

namespace tensorferry::testing {

// The process-wide CUDA runtime when it loads and device 0 is usable; otherwise why not (the gpu
// tests skip with that status).
Result<std::shared_ptr<const cuda::Runtime>> RealGpuRuntime();

}  // namespace tensorferry::testing

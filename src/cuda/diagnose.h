// Internal: the diagnostics of tensorferry/cuda.h over a given runtime and cuFile, so tests can
// run them against the fake libraries; the public functions pass the process-wide ones.
#pragma once

#include <memory>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "tensorferry/cuda.h"

namespace tensorferry::cuda {

CudaReport Diagnose(const Result<std::shared_ptr<const Runtime>>& runtime,
                    const Result<std::shared_ptr<const Cufile>>& cufile,
                    const DiagnoseOptions& options);

}  // namespace tensorferry::cuda

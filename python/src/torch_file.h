// torch.save checkpoints ("pytorch_model.bin", "*.pt") read without running their pickles
// (tensorferry/convert.h's TorchCheckpoint), tensor by tensor into memory the caller owns: the
// engine of the vLLM plugin's .bin/.pt weights (python/tensorferry/_torch_file.py).
#pragma once

#include <nanobind/nanobind.h>

namespace tensorferry::python {

// Binds TorchFile into `m`.
void RegisterTorchFile(nanobind::module_& m);

}  // namespace tensorferry::python

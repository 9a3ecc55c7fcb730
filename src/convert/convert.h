// Internal: the plan of a conversion (which tensors are written, which are aliases, what the
// metadata holds), separate from the writing so it can be tested on its own.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "tensorferry/convert.h"

namespace tensorferry::convert {

struct ConversionPlan {
  std::vector<size_t> write;  // indices into TorchCheckpoint::tensors(), in source order
  std::vector<std::pair<std::string, std::string>> aliases;       // (alias, kept), by alias
  std::vector<std::pair<std::string, std::string>> copied_views;  // (name, why), by name
  std::vector<std::pair<std::string, std::string>> kept_values;   // (name, text)
  std::vector<std::pair<std::string, std::string>> skipped;       // (name, why)
  Metadata metadata;                                              // sorted by key
};

// Tensors that are the same view (storage, dtype, offset, shape, stride) of one storage are one
// tensor: the first name in byte order is written, the others become aliases (metadata
// alias -> kept, as safetensors.torch.save_model records removed names). Empty tensors are never
// aliases. Views that overlap without being identical are all written (copied_views says so).
ConversionPlan PlanConversion(const TorchCheckpoint& checkpoint, bool keep_values);

}  // namespace tensorferry::convert

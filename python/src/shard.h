// Tensor-parallel slicing across the Python boundary (tensorferry/shard.h): the bound ShardSpec
// (tensor name -> rule, tied aliases) and slice_of_rule, with rules and slices as the JSON
// schema's dicts ({"replicate": True} or {"split": dim[, "parts": [...] | "equal_parts": k]}).
#pragma once

#include <nanobind/nanobind.h>

namespace tensorferry::python {

// Binds ShardSpec and slice_of_rule into `m`.
void RegisterShard(nanobind::module_& m);

}  // namespace tensorferry::python

// Bindings for cooperative tensor-parallel loading (python/tensorferry/_distributed.py).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"

namespace tensorferry::python {

// _core.assign_readers.
void RegisterDistributed(nanobind::module_& m);

// Reader.cooperative_plan: the schedule of a cooperative load of `checkpoint` (the Reader's, so
// the checkpoint is opened once): (entries, outputs). entries: one (name, dtype, shape, reader,
// round, dim, parts) per tensor to read, in checkpoint order; parts: per rank (local shape,
// blocks, bytes), empty for a replicated tensor (dim -1). outputs: (name, name of the read tensor
// whose data it is) in Loader order (tied aliases). Takes the GIL; releases it while planning.
nanobind::object CooperativePlan(const Checkpoint& checkpoint,
                                 const std::optional<std::vector<std::string>>& names,
                                 const std::string& spec_text, uint32_t world,
                                 uint64_t round_bytes);

}  // namespace tensorferry::python

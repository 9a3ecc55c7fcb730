// Bindings for cooperative tensor-parallel loading (python/tensorferry/_distributed.py).
#pragma once

#include <nanobind/nanobind.h>

namespace tensorferry::python {

// _core.assign_readers, _core.cooperative_plan.
void RegisterDistributed(nanobind::module_& m);

}  // namespace tensorferry::python

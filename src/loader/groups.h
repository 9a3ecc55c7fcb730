// Planning one load: the selected tensors grouped by device (host first, then CUDA devices by
// index; batches never mix devices), each group planned under its budget (plan.h), device groups
// of a tensor-parallel load laid out again for the device (LayOutForDevice). Internal to the
// loader; no I/O except the page-cache check of TensorParallelOptions::exact_when_cached.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "plan/device_layout.h"
#include "tensorferry/loader.h"
#include "tensorferry/plan.h"

namespace tensorferry {

// The selected tensors bound for one device, planned together.
struct Group {
  Device device;
  Plan plan;
  // Tensor-parallel device groups: per batch, the strided reads besides the batch's contiguous
  // tasks (gathered from the page cache, StridedRead::gather, for files mostly cached under
  // exact_when_cached).
  std::vector<std::vector<StridedRead>> strided;
};

class GroupPlanner {
 public:
  GroupPlanner(const Checkpoint& checkpoint, const LoadOptions& options)
      : checkpoint_(checkpoint), options_(options) {}

  // The plan of a load of the tensors `read` (indices into checkpoint.tensors(), ascending), one
  // group per device. Errors: those of MakePlan and SliceOf, kInvalidArgument for a placement on
  // a negative CUDA device index.
  Result<std::vector<Group>> MakeGroups(const std::vector<uint32_t>& read) const;

 private:
  uint64_t BatchBudget(std::span<const uint32_t> indices, uint64_t limit, bool on_device) const;
  uint64_t LocalSize(const TensorInfo& t) const;
  Device Place(const TensorInfo& t) const;
  // Per file, whether at least half of its tensor bytes are in the page cache; empty unless
  // tensor_parallel->exact_when_cached (the only check that does I/O).
  std::vector<bool> CachedFiles() const;
  // `cached`: CachedFiles() (exact strides for cached files, max_gap for the others).
  PlanOptions MakePlanOptions(uint64_t batch_budget, const std::vector<bool>& cached) const;

  const Checkpoint& checkpoint_;
  const LoadOptions& options_;
};

}  // namespace tensorferry

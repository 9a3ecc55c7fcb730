// Planning a load per device group (groups.h).
#include "loader/groups.h"

#include <algorithm>
#include <map>
#include <utility>

#include "tensorferry/residency.h"
#include "util/macros.h"

namespace tensorferry {

// The plan's batches hold at most half the budget when every selected tensor fits in half of it,
// so that the next batch is read while the caller handles the current one (double buffering).
// When a tensor is larger than half: on the host, the budget less the largest tensor, so that a
// batch still fits beside any other (a tensor over that goes alone: PlanOptions::alone_budget,
// set by MakeGroups), as long as that leaves batches of at least a quarter of the budget (smaller
// ones would leave too few reads in flight); otherwise, and on a device (whose buffers are sized
// with their padding below), the whole budget: no double buffering.
// On a device a sliced tensor occupies exactly its slice; on the host its covering reads may
// take up to the whole tensor's bytes, so the whole size decides there.
uint64_t GroupPlanner::BatchBudget(std::span<const uint32_t> indices, uint64_t limit,
                                   bool on_device) const {
  if (limit == 0) return 0;
  uint64_t largest = 0;
  for (uint32_t i : indices) {
    const TensorInfo& t = checkpoint_.tensors()[i];
    largest = std::max(largest, on_device ? LocalSize(t) : t.size);
  }
  const uint64_t half = limit / 2;
  if (largest <= half) return half;
  if (!on_device && largest < limit && limit - largest >= limit / 4) return limit - largest;
  return limit;
}

// The bytes a tensor occupies once loaded: its slice's under LoadOptions::tensor_parallel (the
// whole size when the slice is invalid: planning reports that error).
uint64_t GroupPlanner::LocalSize(const TensorInfo& t) const {
  if (!options_.tensor_parallel) return t.size;
  const ShardRule rule = options_.tensor_parallel->spec.RuleFor(t.name);
  if (!rule.is_split()) return t.size;
  Result<TensorSlice> slice =
      SliceOf(t, rule, options_.tensor_parallel->rank, options_.tensor_parallel->world);
  return slice.ok() ? slice->bytes : t.size;
}

// The device each selected tensor goes to.
Device GroupPlanner::Place(const TensorInfo& t) const {
  return options_.placement ? options_.placement(t) : options_.device;
}

// The plan of a load, one group per device (host first, then CUDA devices by index).
Result<std::vector<Group>> GroupPlanner::MakeGroups(const std::vector<uint32_t>& read) const {
  std::vector<uint32_t> indices = read;
  std::map<Device, std::vector<uint32_t>> by_device;
  if (options_.placement) {
    for (uint32_t i : indices) by_device[Place(checkpoint_.tensors()[i])].push_back(i);
  } else {
    by_device[options_.device] = std::move(indices);
  }
  if (by_device.empty()) by_device[options_.device];  // an empty selection: an empty plan
  std::vector<Group> groups;
  const std::vector<bool> cached = CachedFiles();  // once per load: mincore is not free
  for (auto& [dev, idx] : by_device) {
    if (dev.is_cuda() && dev.index < 0) {
      return Status(Code::kInvalidArgument, "placement: CUDA device index " +
                                                std::to_string(dev.index) + " for tensor \"" +
                                                checkpoint_.tensors()[idx.front()].name + "\"");
    }
    Group g;
    g.device = dev;
    const uint64_t limit = dev.is_cpu() ? options_.budget : options_.device_budget;
    const uint64_t batch_budget = BatchBudget(idx, limit, dev.is_cuda());
    PlanOptions p = MakePlanOptions(batch_budget, cached);
    if (batch_budget < limit && !dev.is_cuda()) p.alone_budget = limit;
    // Device buffers are sized exactly (no pool): ranges keep their file offset modulo 4 KiB
    // only when GDS may read them (aligned cuFile reads), else 64-byte alignment suffices.
    if (dev.is_cuda() && options_.gds == GdsMode::kOff) p.io_alignment = 0;
    const bool relayout = dev.is_cuda() && options_.tensor_parallel.has_value();
    if (relayout) {
      // Batches are formed from the local sizes: the device layout holds no covered gaps.
      p.file_max_gap.assign(checkpoint_.files().size(), 0);
    }
    const std::vector<uint32_t>& selected = idx;  // (lambdas cannot capture bindings in C++20)
    auto plan = [&]() -> Status {
      TF_ASSIGN_OR_RETURN(g.plan, tensorferry::MakePlan(checkpoint_, selected, p));
      if (!relayout) return Status::Ok();
      g.strided.assign(g.plan.batches.size(), {});
      g.plan.read_bytes = 0;
      g.plan.num_moves = 0;
      g.plan.num_tasks = 0;
      for (size_t b = 0; b < g.plan.batches.size(); ++b) {
        g.strided[b] = LayOutForDevice(checkpoint_.tensors(), p.io_alignment, g.plan.batches[b]);
        for (StridedRead& r : g.strided[b]) {  // (cached: empty unless exact_when_cached)
          // From the page cache a row is a memcpy: gather the rows rather than stage the whole
          // covering range (at world 8 a row-parallel weight's covering range is 8x its slice).
          if (r.rows > 1 && r.file < cached.size() && cached[r.file]) {
            r.gather = true;
            g.plan.batches[b].read_bytes -= r.length() - r.rows * r.row_bytes;
          }
        }
        g.plan.read_bytes += g.plan.batches[b].read_bytes;
        g.plan.num_tasks += g.plan.batches[b].tasks.size() + g.strided[b].size();
      }
      return Status::Ok();
    };
    TF_RETURN_IF_ERROR(plan());
    if (dev.is_cuda() && limit > 0 && p.io_alignment != 0) {
      // A tensor that fits the device budget but not with the padding that keeps its file
      // offset modulo 4 KiB (for GDS): plan the group without that alignment (staged copies)
      // rather than exceed the budget.
      for (const PlanBatch& b : g.plan.batches) {
        if (b.buffer_size > limit && b.tensor_bytes <= limit) {
          p.io_alignment = 0;
          TF_RETURN_IF_ERROR(plan());
          break;
        }
      }
    }
    if (dev.is_cuda() && limit > 0 && batch_budget < limit) {
      // The device budget counts whole buffers, padding included: when padding pushes a batch
      // past half the budget, plan again with the batch budget lowered by the overshoot, so two
      // batches still fit (double buffering).
      uint64_t largest_buffer = 0, largest_tensor = 0;
      for (const PlanBatch& b : g.plan.batches) {
        largest_buffer = std::max(largest_buffer, b.buffer_size);
      }
      for (uint32_t i : idx)
        largest_tensor = std::max(largest_tensor, LocalSize(checkpoint_.tensors()[i]));
      const uint64_t over = largest_buffer > batch_budget ? largest_buffer - batch_budget : 0;
      if (over > 0 && batch_budget - largest_tensor > over) {
        p.budget = batch_budget - over;
        TF_RETURN_IF_ERROR(plan());
      }
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

// With tensor_parallel->exact_when_cached: files mostly in the page cache (host groups: exact
// strides; device groups: gathered rows) and the others (max_gap; files the check cannot see, e.g.
// a MemoryEnv's, count as not cached). The check reads the real file system by path: it only
// chooses how to read, never what is read.
std::vector<bool> GroupPlanner::CachedFiles() const {
  std::vector<bool> cached;
  if (!options_.tensor_parallel || !options_.tensor_parallel->exact_when_cached) return cached;
  for (const FileInfo& f : checkpoint_.files()) {
    bool mostly = false;
    if (f.file_size > f.data_offset) {
      Result<double> in = CachedFraction(f.path, f.data_offset, f.file_size - f.data_offset);
      mostly = in.ok() && *in >= 0.5;
    }
    cached.push_back(mostly);
  }
  return cached;
}

PlanOptions GroupPlanner::MakePlanOptions(uint64_t batch_budget,
                                          const std::vector<bool>& cached) const {
  PlanOptions p;
  p.chunk_size = options_.chunk_size;
  p.budget = batch_budget;
  p.allow_oversized = options_.allow_oversized;
  p.order = options_.order;
  p.tensor_parallel = options_.tensor_parallel;
  for (bool c : cached) p.file_max_gap.push_back(c ? 0 : options_.tensor_parallel->max_gap);
  return p;
}

}  // namespace tensorferry

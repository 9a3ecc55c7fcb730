// The schedule of a cooperative load (tensorferry/cooperative.h) for the Python package, so that
// Python ranks exchanging through torch.distributed read and slice exactly as the C++ ranks do:
// the same AssignReaders/AssignRounds, the same SliceOf.
#include "distributed.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "errors.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/cooperative.h"
#include "tensorferry/format.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

using Block = std::pair<uint64_t, uint64_t>;
// One rank's part: local shape, blocks along the split dimension, bytes.
using RankPart = std::tuple<std::vector<uint64_t>, std::vector<Block>, uint64_t>;
// name, dtype, full shape, reader, round, split dimension (-1: replicated), every rank's part.
using PlanEntry = std::tuple<std::string, std::string, std::vector<uint64_t>, uint32_t, uint32_t,
                             int64_t, std::vector<RankPart>>;

Result<ShardSpec> SpecOf(const std::string& spec) {
  if (spec == "builtin") return ShardSpec::Builtin();
  if (spec == "none" || spec.empty()) return ShardSpec::None();
  return ShardSpec::FromJson(spec);
}

// (name, name of the read tensor whose data it is): what the caller gets, in Loader::Load's order
// (tied aliases share their target's).
using Output = std::pair<std::string, std::string>;

}  // namespace

nb::object CooperativePlan(const Checkpoint& checkpoint_ref,
                           const std::optional<std::vector<std::string>>& names,
                           const std::string& spec_text, uint32_t world, uint64_t round_bytes) {
  if (world == 0) Check(Status(Code::kInvalidArgument, "cooperative_plan: world size 0"));
  const Checkpoint* checkpoint = &checkpoint_ref;
  ShardSpec spec;
  std::vector<uint32_t> indices;
  std::vector<Output> outputs;
  {
    nb::gil_scoped_release release;
    spec = Unwrap(SpecOf(spec_text));
    const Selection selection = names ? Selection::Names(*names) : Selection::All();
    TensorParallelOptions tp;
    tp.spec = spec;
    tp.world = world;
    const Description described = Unwrap(DescribeSelection(*checkpoint, selection, &tp));
    indices = described.read;
    for (const OutputInfo& o : described.outputs) {
      outputs.emplace_back(o.name, checkpoint->tensors()[o.tensor].name);
    }
  }
  const std::vector<TensorInfo>& infos = checkpoint->tensors();
  std::vector<uint64_t> sizes;
  sizes.reserve(indices.size());
  for (uint32_t i : indices) sizes.push_back(infos[i].size);
  const std::vector<uint32_t> readers = AssignReaders(sizes, world);
  const std::vector<uint32_t> rounds = AssignRounds(sizes, readers, world, round_bytes);
  std::vector<PlanEntry> plan;
  plan.reserve(indices.size());
  for (size_t k = 0; k < indices.size(); ++k) {
    const TensorInfo& info = infos[indices[k]];
    const ShardRule rule = spec.RuleFor(info.name);
    std::vector<RankPart> parts;
    if (rule.is_split()) {
      parts.reserve(world);
      for (uint32_t q = 0; q < world; ++q) {
        TensorSlice slice = Unwrap(SliceOf(info, rule, q, world));
        parts.emplace_back(std::move(slice.shape), std::move(slice.blocks), slice.bytes);
      }
    }
    plan.emplace_back(info.name, std::string(DTypeName(info.dtype)), info.shape, readers[k],
                      rounds[k], rule.is_split() ? static_cast<int64_t>(rule.dim) : -1,
                      std::move(parts));
  }
  return nb::cast(std::make_pair(std::move(plan), std::move(outputs)));
}

void RegisterDistributed(nb::module_& m) {
  m.def(
      "assign_readers",
      [](const std::vector<uint64_t>& sizes, uint32_t world) {
        if (world == 0) Check(Status(Code::kInvalidArgument, "assign_readers: world size 0"));
        return AssignReaders(sizes, world);
      },
      nb::arg("sizes"), nb::arg("world"),
      "Reader rank of each tensor (sizes in checkpoint order): tensorferry::AssignReaders");
}

}  // namespace tensorferry::python

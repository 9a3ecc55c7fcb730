// The schedule of a cooperative load (tensorferry/cooperative.h) for the Python package, so that
// Python ranks exchanging through torch.distributed read and slice exactly as the C++ ranks do:
// the same PlanCooperative (cost model, readers, rounds, row pieces), the same SliceOf.
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
#include "options.h"
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
// One tensor to read (see distributed.h).
using PlanEntry = std::tuple<std::string, std::string, std::vector<uint64_t>, uint64_t, bool,
                             uint32_t, uint32_t, std::vector<Block>, std::vector<uint32_t>, int64_t,
                             std::vector<RankPart>, bool, uint64_t>;

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
                           const std::string& spec_text, const std::vector<uint32_t>& hosts,
                           const nb::dict& options, double probe_seconds) {
  if (hosts.empty()) Check(Status(Code::kInvalidArgument, "cooperative_plan: no ranks"));
  const Checkpoint* checkpoint = &checkpoint_ref;
  const uint32_t world = static_cast<uint32_t>(hosts.size());
  const LoadOptions load_options = MakeLoadOptions(options);
  std::vector<Output> outputs;
  uint64_t fingerprint = 0;
  std::vector<PlanEntry> entries;
  {
    nb::gil_scoped_release release;
    const ShardSpec spec = Unwrap(SpecOf(spec_text));
    const Selection selection = names ? Selection::Names(*names) : Selection::All();
    TensorParallelOptions tp;
    tp.spec = spec;
    tp.world = world;
    const Description described = Unwrap(DescribeSelection(*checkpoint, selection, &tp));
    for (const OutputInfo& o : described.outputs) {
      outputs.emplace_back(o.name, checkpoint->tensors()[o.tensor].name);
    }
    const tensorferry::CooperativePlan plan =
        Unwrap(PlanCooperative(*checkpoint, selection, spec, load_options, hosts, probe_seconds));
    fingerprint = plan.fingerprint;
    const std::vector<TensorInfo>& infos = checkpoint->tensors();
    entries.reserve(plan.tensors.size());
    for (const CooperativeTensorPlan& t : plan.tensors) {
      const TensorInfo& info = infos[t.tensor];
      const ShardRule rule = spec.RuleFor(info.name);
      std::vector<RankPart> parts;
      if (rule.is_split()) {
        parts.reserve(world);
        for (uint32_t q = 0; q < world; ++q) {
          TensorSlice slice = Unwrap(SliceOf(info, rule, q, world));
          parts.emplace_back(std::move(slice.shape), std::move(slice.blocks), slice.bytes);
        }
      }
      // Rows of each piece of a tensor split among the readers: the rows Split(0) in units of
      // piece_granule rows gives rank p (the same rule the C++ ranks read by).
      std::vector<Block> piece_rows;
      if (t.exchanged && t.readers > 1) {
        ShardRule pieces = ShardRule::Split(0);
        pieces.granule = t.piece_granule;
        for (uint32_t p = 0; p < t.readers; ++p) {
          piece_rows.push_back(Unwrap(SliceOf(info, pieces, p, t.readers)).blocks[0]);
        }
      }
      entries.emplace_back(info.name, std::string(DTypeName(info.dtype)), info.shape, info.size,
                           t.exchanged, t.reader, t.round, std::move(piece_rows), t.piece_rounds,
                           rule.is_split() ? static_cast<int64_t>(rule.dim) : -1, std::move(parts),
                           t.SavesReads(), t.piece_granule);
    }
  }
  return nb::cast(std::make_tuple(std::move(entries), std::move(outputs), fingerprint));
}

void RegisterDistributed(nb::module_& m) {
  // The network probe of a cooperative plan (tensorferry::NetworkProbe), for the ranks that run it
  // over torch.distributed.
  m.def(
      "cooperative_options_digest",
      [](const nb::dict& options) { return CooperativeOptionsDigest(MakeLoadOptions(options)); },
      nb::arg("options"),
      "What the ranks' options must agree on, as parsed: tensorferry::CooperativeOptionsDigest");
  m.def(
      "network_probe_bytes",
      [](const std::vector<uint32_t>& hosts, const nb::dict& options) {
        return NetworkProbeBytes(MakeLoadOptions(options), hosts);
      },
      nb::arg("hosts"), nb::arg("options"),
      "Bytes each rank sends in the network probe, 0 for none: tensorferry::NetworkProbeBytes");
  m.def(
      "network_probe_counts",
      [](const std::vector<uint32_t>& hosts, uint64_t bytes, uint32_t rank, bool warmup) {
        if (rank >= hosts.size()) {
          Check(Status(Code::kInvalidArgument, "network_probe_counts: rank " +
                                                   std::to_string(rank) + " of " +
                                                   std::to_string(hosts.size())));
        }
        const NetworkProbe probe(hosts, bytes);
        return std::make_pair(probe.SendCounts(rank, warmup), probe.RecvCounts(rank, warmup));
      },
      nb::arg("hosts"), nb::arg("bytes"), nb::arg("rank"), nb::arg("warmup"),
      "(send counts, receive counts) of `rank` in the probe's exchange (warmup: the one-byte one)");
  m.def("network_probe_first_bytes", &NetworkProbe::FirstBytes, nb::arg("limit"),
        "The probe's first round's bytes per rank: tensorferry::NetworkProbe::FirstBytes");
  m.def("network_probe_next_bytes", &NetworkProbe::NextBytes, nb::arg("bytes"), nb::arg("nanos"),
        nb::arg("limit"),
        "The next round's bytes per rank, 0 when done: tensorferry::NetworkProbe::NextBytes");
  m.def(
      "network_probe_rate",
      [](const std::vector<uint32_t>& hosts, uint64_t bytes, uint64_t nanos) {
        return NetworkProbe(hosts, bytes).Rate(nanos);
      },
      nb::arg("hosts"), nb::arg("bytes"), nb::arg("nanos"),
      "Bytes per second per host when the probe's round took `nanos` (the slowest rank's)");
  m.def(
      "assign_readers",
      [](const std::vector<uint64_t>& sizes, uint32_t world, const std::vector<uint64_t>& loaded) {
        if (world == 0) Check(Status(Code::kInvalidArgument, "assign_readers: world size 0"));
        return AssignReaders(sizes, world, loaded);
      },
      nb::arg("sizes"), nb::arg("world"), nb::arg("loaded") = std::vector<uint64_t>(),
      "Reader rank of each tensor (sizes in checkpoint order), given the bytes each rank reads "
      "besides (`loaded`, missing entries 0): tensorferry::AssignReaders");
}

}  // namespace tensorferry::python

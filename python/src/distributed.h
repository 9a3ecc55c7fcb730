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
// the checkpoint is opened once) over len(hosts) ranks, rank r on host hosts[r] (dense indices):
// PlanCooperative with LoadOptions from `options` (MakeLoadOptions: budget, coop_exchange,
// coop_storage_rate, coop_network_rate, shard_max_gap, verify), made after a network probe of
// `probe_seconds` (0: none ran). Returns (entries, outputs, fingerprint:
// CooperativePlan::fingerprint, what the ranks compare: it covers the tensors' files and offsets
// and the content digest, which the entries lack). entries: one
// (name, dtype, shape, nbytes, exchanged, reader, round, piece_rows, piece_rounds, dim, parts,
// saves_reads, piece_granule) per tensor to read, in checkpoint order: exchanged false: every
// rank reads its own part;
// piece_rows non-empty: split among the readers, piece p (rows (start, count)) read by rank p in
// round piece_rounds[p], the rows {"split": 0, "granule": piece_granule} gives rank p; else read
// whole by `reader` in `round`. dim: the split dimension (-1:
// replicated); parts: per rank (local shape, blocks, bytes), empty for a replicated tensor;
// saves_reads: CooperativeTensorPlan::SavesReads (false: read during a probe, whatever it finds).
// outputs: (name, name of the read tensor whose data it is) in Loader order (tied aliases).
// Takes the GIL; releases it while planning.
nanobind::object CooperativePlan(const Checkpoint& checkpoint,
                                 const std::optional<std::vector<std::string>>& names,
                                 const std::string& spec_text, const std::vector<uint32_t>& hosts,
                                 const nanobind::dict& options, double probe_seconds);

}  // namespace tensorferry::python

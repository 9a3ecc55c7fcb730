// tensorferry/cooperative.h: tensor-parallel loading in which the ranks of a group share the
// reads: each file byte is read once by one rank, and the slices reach their owners through a
// Collective (collective.h: MPI, an in-process group; torch.distributed in Python).
//
// The flow (docs/distributed.md):
//   1. Every rank computes, from the checkpoint alone, the same CooperativeSchedule: which rank
//      reads each selected tensor (AssignReaders) and in which round (budget-bounded).
//   2. Every rank computes every rank's TensorSlice of every selected tensor (SliceOf of the
//      ShardSpec's rule): a rule error fails every rank the same way before any I/O.
//   3. Round by round: each rank loads its tensors of the round with an ordinary Loader (any
//      engine, O_DIRECT, ...), then, for each tensor of the round in checkpoint order, its reader
//      broadcasts it (replicated tensors) or packs every rank's slice (SliceByteRanges, in
//      destination order) and scatters the blocks (split tensors). A read error on any rank is
//      made known to every rank (an AllGather of each rank's status per round) so that all stop
//      together instead of waiting in a collective.
// The tensors each rank ends with are byte for byte those of the independent sliced path: the
// same SliceOf/SliceByteRanges decide which bytes, in the same order.
//
// Memory: per round a rank holds its own reads of the round (at most max(budget, its largest
// tensor in the round)) plus one packing buffer of one tensor, besides the result. The Loader under
// the rounds runs without a budget of its own: the rounds bound what it holds, and without
// options.tensor_parallel (the reader reads whole tensors and cuts every rank's slice itself).
//
// Thread-safety: a call uses its Collective exclusively; concurrent calls on distinct groups are
// fine.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/collective.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/status.h"

namespace tensorferry {

// Which rank reads each tensor, given the tensors' byte sizes in checkpoint order ((file,
// offset) order) and the world size (>= 1). The rule, identical in C++ and Python (the Python
// package calls this function): the sequence is cut into `world` contiguous runs, rank r reading
// run r, so that the largest run's bytes are as small as possible (the minimum over all contiguous
// cuts, found by binary search on that maximum, with each run then filled greedily up to it from
// the front). Contiguous runs keep each rank's reads sequential in the files; balance is within
// one tensor of the ideal share. Ranks may get empty runs (fewer tensors than ranks).
std::vector<uint32_t> AssignReaders(std::span<const uint64_t> sizes, uint32_t world);

// Round of each tensor: every rank walks its own run in order and starts a new round when the
// next tensor would take its bytes in the current round above `round_bytes` (0: one round). Round
// k of the load is round k of every rank, so all ranks read at once. A tensor larger than
// round_bytes takes a round of its own.
std::vector<uint32_t> AssignRounds(std::span<const uint64_t> sizes,
                                   std::span<const uint32_t> readers, uint32_t world,
                                   uint64_t round_bytes);

struct CooperativeStats {
  uint64_t tensors = 0;         // tensors this rank ends with
  uint64_t bytes = 0;           // bytes of those tensors (its slices)
  uint64_t bytes_read = 0;      // bytes this rank read from the files
  uint64_t bytes_sent = 0;      // bytes this rank sent to others (a broadcast counts world-1 times)
  uint64_t bytes_received = 0;  // bytes this rank received from others
  uint64_t rounds = 0;
  double seconds = 0;           // wall time of the whole call
  double read_seconds = 0;      // inside the Loader
  double exchange_seconds = 0;  // inside the collectives (waiting for slower readers included)
  std::string engine;           // the engine that ran the reads
  // Requests, retries and bytes received of this rank's reads from object storage
  // (LoadStats::remote_*; zero for local files).
  uint64_t remote_requests = 0, remote_retries = 0, remote_bytes = 0;
};

// Loads this rank's slice of every selected tensor cooperatively (see the file comment): rank
// collective.rank() of collective.size(). Every rank of the group must call it with the same
// checkpoint, selection, spec and options.budget (the schedule depends on them). Returns the
// rank's tensors in the order Loader::Load returns them, with their local shapes
// (TensorSlice::shape); replicated tensors whole. Tied aliases (ShardSpec::Tie) resolve as for the
// Loader (DescribeSelection, loader.h): the target is read and exchanged once and the alias
// shares its result. options.budget bounds each rank's reads per round (0: one round, the whole
// share at once); options.tensor_parallel is ignored (the spec and the collective decide). Errors:
// those of DescribeSelection (SliceOf included) (identical on every rank), kUnsupported for a CUDA
// target in `options` (device or placement: the exchange moves host memory; for slices on a GPU use
// LoadOptions::tensor_parallel per rank, docs/gpu.md), of the Loader on any rank (the failing rank
// returns its own error, the others kIoError naming the failed rank), of the collective.
Result<std::vector<Tensor>> LoadCooperative(std::shared_ptr<const Checkpoint> checkpoint,
                                            const Selection& selection, const ShardSpec& spec,
                                            const LoadOptions& options, Collective& collective,
                                            CooperativeStats* stats = nullptr);

}  // namespace tensorferry

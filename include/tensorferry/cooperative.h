// tensorferry/cooperative.h: tensor-parallel loading in which the ranks of a group share the
// reads: each file byte is read once by one rank, and the slices reach their owners through a
// Collective (collective.h: MPI, an in-process group; torch.distributed in Python).
//
// The flow (docs/distributed.md):
//   1. The ranks learn which of them share a host (HostsOfRanks: an all-gather of host names),
//      and, when the plan may choose and no network rate is given, measure the rate between the
//      hosts through the collective (WithMeasuredNetworkRate, MeasureNetworkRate).
//   2. Every rank computes, from the checkpoint alone, the same CooperativePlan
//      (PlanCooperative): which selected tensors are exchanged (read once by one rank, the
//      reader, and sent to the others) and which are local (every rank reads its own slice, or
//      the whole of a replicated tensor, as the independent sliced load does). The choice is
//      LoadOptions::cooperative.exchange: all, none, or auto, a cost model of each host's
//      storage and network time (the plan's comment); the exchanged tensors get their reader
//      (AssignReaders) and round (AssignRounds, budget-bounded). Every rank's TensorSlice of
//      every selected tensor is computed first (SliceOf), and the ranks agree on them before any
//      I/O or other collective (one AllGather of a fingerprint of every tensor read, every rank's
//      slices and the options the plan depends on; again for the final plan): a rank whose
//      planning failed, or that planned something else (another checkpoint, selection, rules or
//      options), fails every rank at once with an error that says so, rather than leaving the
//      others waiting in a collective or taking another rank's bytes for their own.
//   3. The local tensors are read by each rank with a sliced Loader (LoadOptions::tensor_parallel)
//      on a helper thread: those that no exchange could save reads of
//      (CooperativeTensorPlan::SavesReads) while the network probe runs, when it runs; the others
//      once the rank's reads of the first round are done (so that the first exchange starts as
//      early as the storage allows), beside the rounds. On an error they are cancelled
//      (LoadOptions::cancel: the Loader's own flag unless the caller set one), not waited for.
//   4. Round by round: each rank loads its exchanged tensors of the round with an ordinary Loader
//      (any engine, O_DIRECT, ...), and its row pieces of the tensors split among the readers
//      with a sliced one; while round k is exchanged, round k + 1 is already being read. In one
//      AllToAllv per round, each reader sends every other rank that rank's part of what it read:
//      the whole tensor (replicated), its slice (SliceByteRanges, in destination order), or the
//      part of its slice inside a piece's rows, which the receiver copies into place. A read error
//      on any rank is made known to every rank (an AllGather of each rank's status per round, and
//      one for the local reads at the end) so that all stop together instead of waiting in a
//      collective.
// The tensors each rank ends with are byte for byte those of the independent sliced path: the
// same SliceOf/SliceByteRanges decide which bytes, in the same order.
//
// Memory: a rank holds its own reads of two rounds (the one exchanged and the next, each at most
// max(budget, its largest tensor in the round)) plus one packing buffer of one tensor, besides
// the result (its local slices included). The Loader under the rounds runs without a budget of
// its own: the rounds bound what it holds, and without options.tensor_parallel (the reader reads
// whole tensors and cuts every rank's slice itself).
//
// Thread-safety: a call uses its Collective exclusively; concurrent calls on distinct groups are
// fine.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/collective.h"
#include "tensorferry/loader.h"
#include "tensorferry/options.h"
#include "tensorferry/shard.h"
#include "tensorferry/status.h"

namespace tensorferry {

// Which rank reads each tensor, given the tensors' byte sizes in checkpoint order ((file,
// offset) order) and the world size (>= 1). The rule, identical in C++ and Python (the Python
// package calls this function): the sequence is cut into `world` contiguous runs, rank r reading
// run r, so that the most bytes a rank reads, `loaded`[r] (what it reads besides, such as its
// pieces of the tensors split among the readers; missing entries are 0) plus its run's, is as
// small as possible (the minimum over all contiguous cuts, found by binary search on that
// maximum, with each run then filled greedily up to it from the front). Contiguous runs keep each
// rank's reads sequential in the files; balance is within one tensor of the ideal share. Ranks
// may get empty runs (fewer tensors than ranks, or a rank loaded already).
std::vector<uint32_t> AssignReaders(std::span<const uint64_t> sizes, uint32_t world,
                                    std::span<const uint64_t> loaded = {});

// Round of each tensor: every rank walks its own run in order and starts a new round when the
// next tensor would take its bytes in the current round above `round_bytes` (0: one round). Round
// k of the load is round k of every rank, so all ranks read at once. A tensor larger than
// round_bytes takes a round of its own.
std::vector<uint32_t> AssignRounds(std::span<const uint64_t> sizes,
                                   std::span<const uint32_t> readers, uint32_t world,
                                   uint64_t round_bytes);

// Which host each rank runs on: dense indices in the order of first appearance, from each
// rank's host name (gethostname). A collective call (an AllGather): every rank of the group must
// make it. Errors: those of the collective.
Result<std::vector<uint32_t>> HostsOfRanks(Collective& collective);

// The exchange of a network probe (MeasureNetworkRate; the Python package runs the same one over
// torch.distributed): every rank sends `bytes` in equal blocks to the ranks on other hosts, after
// a one-byte exchange between the same pairs that opens lazily made connections. Counts are per
// member, in AllToAllv's layout. Thread-safe (immutable).
class NetworkProbe {
 public:
  // host_of_rank as HostsOfRanks gives it; every rank makes the same probe.
  NetworkProbe(std::span<const uint32_t> host_of_rank, uint64_t bytes);
  // Whether the ranks are on more than one host (else there is nothing to measure).
  bool several_hosts() const noexcept { return several_hosts_; }
  std::vector<uint64_t> SendCounts(uint32_t rank, bool warmup) const;
  std::vector<uint64_t> RecvCounts(uint32_t rank, bool warmup) const;
  // The rate, in bytes per second, of the slowest host's receiving when the probe's exchange took
  // `nanos` (the slowest rank's time); at least 1; 0 with one host.
  uint64_t Rate(uint64_t nanos) const;
  // The probe runs rounds of growing size, so that a slow link is not made to carry the whole
  // `limit` (probe_bytes) and a fast one is timed over long enough: the first round's bytes per
  // rank (64 KiB), and the next round's after one of `bytes` took `nanos`: sized to last about
  // 150 ms at that round's rate, at most four times larger and at least one byte larger, up to
  // `limit` (0: the last round is the measurement: it lasted 100 ms or more, or reached the
  // limit).
  static uint64_t FirstBytes(uint64_t limit);
  static uint64_t NextBytes(uint64_t bytes, uint64_t nanos, uint64_t limit);

 private:
  std::map<uint32_t, uint64_t> Received() const;  // bytes each host receives
  std::vector<uint32_t> host_of_rank_;
  std::vector<uint64_t> block_;  // what rank p sends each rank on another host
  bool several_hosts_ = false;
};

// What a network probe measured: the rate one host receives from the others, in bytes per second,
// and how long the probe took (the slowest rank's time from its first exchange to its last); both
// 0 when no probe ran.
struct NetworkMeasurement {
  uint64_t rate = 0;
  double seconds = 0;
};

// The rate one host receives from the others through `collective`: every rank sends its bytes in
// equal blocks to the ranks on other hosts (host_of_rank, as HostsOfRanks gives it) in one
// AllToAllv per round, after a one-byte exchange that opens lazily made connections; rounds grow
// from 64 KiB per rank up to `bytes` until one lasts 100 ms (NetworkProbe::NextBytes), and the
// rate is the last round's; times are the slowest rank's, and rates the slowest host's, so every
// rank returns the same values (one more AllGather agrees on the probe's time, at least 1 ns).
// Zeros when every rank is on one host (no collective call then). A collective call: every rank
// must make it with the same arguments. Errors: kInvalidArgument (host_of_rank does not match the
// group), those of the collective.
Result<NetworkMeasurement> MeasureNetworkRate(Collective& collective,
                                              std::span<const uint32_t> host_of_rank,
                                              uint64_t bytes);

// The bytes each rank sends in the network probe the plan is made with: options.cooperative's
// probe_bytes when the plan may choose (exchange kAuto), no network_rate was given and the ranks
// are on more than one host; else 0 (no probe).
uint64_t NetworkProbeBytes(const LoadOptions& options, std::span<const uint32_t> host_of_rank);

// A digest of the options the ranks of a cooperative load must agree on, as parsed (so "2GB" and
// 2000000000 agree, as do a default left unset and the same value given): cooperative.exchange,
// storage_rate, network_rate (0, measured, is a value of its own) and probe_bytes, budget, the
// shard rules' max_gap and verify (it decides the pieces' granule and the records compared).
// LoadCooperative and Python's cooperative load compare it across ranks
// before any I/O, with the plan's per-tensor figures.
uint64_t CooperativeOptionsDigest(const LoadOptions& options) noexcept;

// The options the cooperative plan is made with: `options`, with cooperative.network_rate
// measured by MeasureNetworkRate(collective, host_of_rank, cooperative.probe_bytes) when the plan
// may choose (exchange kAuto), no rate was given, probe_bytes > 0 and the ranks are on more than
// one host (a collective call then); `measured` gets what the probe measured, or zeros.
// LoadCooperative calls it; a caller that prints the plan calls it, and PlanCooperative with
// measured->seconds, to print the plan a load makes.
Result<LoadOptions> WithMeasuredNetworkRate(Collective& collective,
                                            std::span<const uint32_t> host_of_rank,
                                            const LoadOptions& options,
                                            NetworkMeasurement* measured);

// One selected tensor in a cooperative plan, and the cost model's figures for it.
struct CooperativeTensorPlan {
  uint32_t tensor = 0;     // index in Checkpoint::tensors()
  bool exchanged = false;  // read once by `reader` and exchanged; false: each rank reads its part
  uint32_t reader = 0;     // exchanged and read whole: the rank that reads it
  uint32_t round = 0;      // exchanged: its round (split among readers: its last piece's)
  // Exchanged: 1 when one reader reads it whole; world when it is split among every rank by rows
  // (a huge tensor, see PlanCooperative): piece p, the rows a ShardRule::Split(0) with granule
  // `piece_granule` gives rank p of world, is read by rank p in round piece_rounds[p], and each
  // rank receives its part of every piece from the piece's reader. The granule is 1, or with
  // checksums checked (a record, verify not off) the fewest rows whose bytes are a multiple of the
  // file's chunk size: every piece starts on a chunk, so that its reader checks every chunk it
  // holds whole.
  uint32_t readers = 1;
  std::vector<uint32_t> piece_rounds;
  uint64_t piece_granule = 1;
  // Bytes per host, averaged over the hosts: read from storage when each rank reads its own part
  // (its slice's covering reads, gaps up to max_gap included; a replicated tensor once per
  // rank), read when exchanged (the tensor's size over the hosts), and received from other hosts
  // when exchanged (each rank's part, from a reader on another host with probability
  // (hosts - 1) / hosts; ranks of one host exchange through memory, counted as free).
  uint64_t local_read = 0;
  uint64_t exchange_read = 0;
  uint64_t exchange_network = 0;
  // Whether exchanging it would save storage bytes (local_read > exchange_read): the candidates
  // of ExchangeChoice::kAuto. An exact dim-0 slice saves none (the ranks' parts are disjoint):
  // such tensors are read while the network probe runs (LoadCooperative), whatever it measures.
  bool SavesReads() const noexcept { return local_read > exchange_read; }
};

// A cooperative load's plan: identical on every rank (a pure function of its arguments).
struct CooperativePlan {
  uint32_t world = 1;
  uint32_t hosts = 1;
  std::vector<uint32_t> host_of_rank;  // HostsOfRanks
  ExchangeChoice choice = ExchangeChoice::kAuto;
  uint64_t storage_rate = 0;  // bytes/s per host, defaults applied (options.h)
  uint64_t network_rate = 0;
  double probe_seconds = 0;  // the network probe's time before the plan (0: no probe)
  std::vector<CooperativeTensorPlan> tensors;  // the tensors read, in checkpoint order
  uint32_t rounds = 0;                         // rounds of the exchanged tensors
  // What tells two copies of a checkpoint with the same layout but other bytes apart (a stale
  // copy on one host, a hub branch that moved between two ranks' opens), combined over the files
  // and tensors read: the checksum records (docs/integrity.md) of the tensors, unless
  // LoadOptions::verify is off; the commit of a hub repository's files (a snapshot folder of the
  // hub cache or the hub's resolve/<commit> URL: a rank reading the cache and one streaming from
  // the hub agree); the ETag of an object-store file. 0 when none applies (local files without
  // records: their identities differ between hosts). Part of what the ranks compare before any
  // exchange.
  uint64_t content_digest = 0;
  // What the plan stands on, equal on ranks that planned alike: every tensor read (name, dtype,
  // shape, file and offset), every rank's slice of it, the plan's choices per tensor and
  // content_digest. The ranks compare it before any exchange (LoadCooperative, and Python's
  // cooperative load through _core.Checkpoint.cooperative_plan).
  uint64_t fingerprint = 0;
  // The model's prediction for a placement of the reads: the busiest host's bytes read from
  // storage and received over the network, both flowing at once, per host h:
  // seconds = max(read_h / storage_rate, network_h / network_rate), the largest over the hosts.
  // After a probe of P = probe_seconds (it ran, and the tensors that save no reads, pre_h bytes
  // per host, were read during it), the plan's clock starts with the probe: the other reads
  // start at P, and so does the network:
  // seconds = max(read_h / S, P + (read_h - pre_h) / S, network_h > 0 ? P + network_h / B : 0).
  // Computed with the actual readers (AssignReaders) of the exchanged tensors.
  struct Estimate {
    uint64_t read = 0;
    uint64_t network = 0;
    double seconds = 0;
  };
  Estimate all_local;      // every tensor local (the independent sliced load)
  Estimate all_exchanged;  // every tensor exchanged
  Estimate chosen;         // this plan
  // Bytes rank `rank` reads of the exchanged tensors: those it reads whole and its row pieces of
  // those split among the readers. `checkpoint` gives the sizes.
  uint64_t ExchangedBytesReadBy(const Checkpoint& checkpoint, uint32_t rank) const;
  // The plan as text (`tensorferry-mpi load --explain`): the settings, the three estimates, and
  // one line per tensor with its choice and figures. `checkpoint` gives the names.
  std::string ToString(const Checkpoint& checkpoint) const;
};

// The plan of a cooperative load of `selection` over `host_of_rank.size()` ranks (rank r on host
// host_of_rank[r], dense indices from 0). The choice (options.cooperative.exchange):
//   all / none: every tensor exchanged / local.
//   auto: start with every tensor local; the tensors whose exchange would save storage bytes
//   (local_read > exchange_read) are ordered by decreasing storage bytes saved per network byte
//   spent, and the plan exchanges the prefix of that order whose exact estimate (below: actual
//   readers, the busiest host) is the lowest, among the first 32 prefixes, 64 spread over the
//   order, and those around the best prefix of the same model over average hosts (ties: the
//   shorter prefix); all exchanged replaces it when strictly faster (not after a probe: the
//   tensors that save no reads were read during it); an exchange must beat all local by 10%
//   (the costs the model leaves out). On one host the network is free: every tensor that saves
//   reads is exchanged; exact dim-0 slices never save any and stay local.
// probe_seconds: the network probe's time (NetworkMeasurement::seconds) when one ran before this
// plan, else 0; it enters the estimates (Estimate above).
// An exchanged tensor larger than half the even share of the exchanged bytes (share = total /
// world), or than share / 128 if also over 1 MiB, or than options.budget, with at least one row
// per rank (one unit of rows per rank with checksums checked: piece_granule), is split among
// every rank by rows instead of given to one reader (CooperativeTensorPlan::readers): one reader
// of a huge embedding or lm_head would hold up every round-synchronised rank and hold it all in
// memory, and AssignReaders' contiguous runs, the pieces counted, balance within one unsplit
// tensor, so no rank reads more than its share + max(share / 128, 1 MiB) plus, with checksums
// checked, up to a unit of rows per split tensor (whole units go to the first ranks, a short
// last one to the last rank); the estimates count a split tensor's reads spread over the hosts. The
// other exchanged tensors get their readers from AssignReaders. Covering reads use
// options.tensor_parallel's max_gap when it is set, else the default 64 KiB. Rounds are bounded by
// options.budget (AssignRounds over the tensors read whole and the pieces). Errors: those of
// DescribeSelection (SliceOf included), kInvalidArgument for an empty host_of_rank or host indices
// that are not dense.
Result<CooperativePlan> PlanCooperative(const Checkpoint& checkpoint, const Selection& selection,
                                        const ShardSpec& spec, const LoadOptions& options,
                                        std::span<const uint32_t> host_of_rank,
                                        double probe_seconds = 0);

struct CooperativeStats {
  uint64_t tensors = 0;         // tensors this rank ends with
  uint64_t bytes = 0;           // bytes of those tensors (its slices)
  uint64_t bytes_read = 0;      // bytes this rank read from the files
  uint64_t bytes_sent = 0;      // bytes this rank sent to others (a broadcast counts world-1 times)
  uint64_t bytes_received = 0;  // bytes this rank received from others
  uint64_t rounds = 0;
  uint64_t hosts = 0;              // distinct hosts of the group (HostsOfRanks)
  uint64_t exchanged_tensors = 0;  // tensors read once and exchanged (the plan's choice)
  uint64_t local_tensors = 0;      // tensors every rank read its own part of
  double seconds = 0;              // wall time of the whole call
  double read_seconds = 0;         // inside the Loader of the rounds
  // The local tensors' reads (on a helper thread, beside the probe and the rounds): from the
  // start of the first to the end of the last.
  double local_seconds = 0;
  double exchange_seconds = 0;  // inside the collectives (waiting for slower readers included)
  // Of exchange_seconds, the time inside the rounds' AllToAllv calls (the transfers, and the
  // wait for the other ranks to reach them).
  double network_seconds = 0;
  // The network rate the plan used when the probe measured it (CooperativeOptions::probe_bytes),
  // in bytes per second per host (the same on every rank), and the probe's wall time; 0 when no
  // probe ran.
  uint64_t measured_network_rate = 0;
  double probe_seconds = 0;
  std::string engine;  // the engine that ran the reads
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
// share at once); options.cooperative chooses what is exchanged (PlanCooperative, with the hosts
// of HostsOfRanks); options.tensor_parallel gives only max_gap, for the local tensors' reads and
// the cost model (the spec and the collective decide the rest). Errors:
// those of DescribeSelection (SliceOf included) and of ChecksumsForLoad (integrity.h: an
// unreadable manifest or record) on the failing rank (kIoError naming it on the others), before
// any read; kInvalidArgument on every rank when the ranks' plans differ, kUnsupported for a CUDA
// target in `options` (device or placement: the exchange moves host memory; for slices on a GPU use
// LoadOptions::tensor_parallel per rank, docs/gpu.md), of the Loader on any rank (the failing rank
// returns its own error, the others kIoError naming the failed rank), of the collective.
Result<std::vector<Tensor>> LoadCooperative(std::shared_ptr<const Checkpoint> checkpoint,
                                            const Selection& selection, const ShardSpec& spec,
                                            const LoadOptions& options, Collective& collective,
                                            CooperativeStats* stats = nullptr);

}  // namespace tensorferry

// Cooperative tensor-parallel loading (cooperative.h).
#include "tensorferry/cooperative.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>

#include "util/macros.h"

namespace tensorferry {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Number of contiguous runs, each at most `limit` bytes, that greedy filling from the front needs.
uint64_t RunsNeeded(std::span<const uint64_t> sizes, uint64_t limit) {
  uint64_t runs = 1;
  uint64_t current = 0;
  for (uint64_t s : sizes) {
    if (current + s > limit) {
      ++runs;
      current = 0;
    }
    current += s;
  }
  return runs;
}

// One selected tensor and every rank's part of it.
struct Item {
  const TensorInfo* info = nullptr;
  bool whole = true;                  // replicated: broadcast
  std::vector<TensorSlice> slices;    // split: one per rank
  std::vector<uint64_t> counts;       // split: slice bytes per rank
  std::vector<uint64_t> local_shape;  // this rank's shape
};

}  // namespace

std::vector<uint32_t> AssignReaders(std::span<const uint64_t> sizes, uint32_t world) {
  std::vector<uint32_t> readers(sizes.size(), 0);
  if (sizes.empty() || world <= 1) return readers;
  // The smallest run limit at which `world` runs suffice: between the largest tensor and the
  // total (always feasible). Binary search over that range (monotone: a larger limit never
  // needs more runs).
  uint64_t lo = *std::max_element(sizes.begin(), sizes.end());
  uint64_t hi = 0;
  for (uint64_t s : sizes) hi += s;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (RunsNeeded(sizes, mid) <= world) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  uint32_t rank = 0;
  uint64_t current = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (current + sizes[i] > lo && current > 0 && rank + 1 < world) {
      ++rank;
      current = 0;
    }
    readers[i] = rank;
    current += sizes[i];
  }
  return readers;
}

std::vector<uint32_t> AssignRounds(std::span<const uint64_t> sizes,
                                   std::span<const uint32_t> readers, uint32_t world,
                                   uint64_t round_bytes) {
  std::vector<uint32_t> rounds(sizes.size(), 0);
  if (round_bytes == 0) return rounds;
  std::vector<uint32_t> round(world, 0);
  std::vector<uint64_t> bytes(world, 0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint32_t r = readers[i];
    if (bytes[r] > 0 && bytes[r] + sizes[i] > round_bytes) {
      ++round[r];
      bytes[r] = 0;
    }
    rounds[i] = round[r];
    bytes[r] += sizes[i];
  }
  return rounds;
}

namespace {

// The schedule every rank computes alike: each tensor read with its parts, its reader and round.
struct Schedule {
  std::vector<Item> items;        // the tensors read, in checkpoint order
  std::vector<uint32_t> readers;  // AssignReaders
  std::vector<uint32_t> rounds;   // AssignRounds
  uint32_t round_count = 0;
};

// kUnsupported unless `options` targets host memory.
Status CheckHostTarget(const LoadOptions& options) {
  // The exchange packs slices out of the reader's tensors and the collectives move host bytes:
  // device tensors would be device addresses here. Refused the same way on every rank, before
  // any I/O or collective.
  if (options.device.is_cuda() || options.placement) {
    return Status(
        Code::kUnsupported,
        "cooperative load: tensors are exchanged in host memory; LoadOptions::device " +
            DeviceName(options.device) + (options.placement ? " with a placement" : "") +
            " is not supported by LoadCooperative (load each rank's slices onto its "
            "device with LoadOptions::tensor_parallel, or move the returned host tensors)");
  }
  return Status::Ok();
}

// The selection's description for rank `me` of `world` under `spec`.
Result<Description> DescribeForRank(const Checkpoint& checkpoint, const Selection& selection,
                                    const ShardSpec& spec, uint32_t me, uint32_t world) {
  // Tied aliases resolve as for the Loader: their targets are read (once) and exchanged, the
  // aliases added at the end sharing their target's result.
  TensorParallelOptions tp;
  tp.spec = spec;
  tp.rank = me;
  tp.world = world;
  return DescribeSelection(checkpoint, selection, &tp);
}

// `info` with every rank's slice of it under its rule in `spec` (none when the rule keeps it
// whole).
Result<Item> MakeItem(const TensorInfo& info, const ShardSpec& spec, uint32_t me, uint32_t world) {
  Item item;
  item.info = &info;
  const ShardRule rule = spec.RuleFor(info.name);
  item.whole = !rule.is_split();
  if (item.whole) {
    item.local_shape = info.shape;
    return item;
  }
  item.slices.reserve(world);
  item.counts.reserve(world);
  for (uint32_t q = 0; q < world; ++q) {
    TF_ASSIGN_OR_RETURN(TensorSlice slice, SliceOf(info, rule, q, world));
    item.counts.push_back(slice.bytes);
    item.slices.push_back(std::move(slice));
  }
  item.local_shape = item.slices[me].shape;
  return item;
}

// The schedule of the tensors `indices` (checkpoint order), rounds bounded by `budget`.
Result<Schedule> MakeSchedule(const Checkpoint& checkpoint, std::span<const uint32_t> indices,
                              const ShardSpec& spec, uint64_t budget, uint32_t me, uint32_t world) {
  // Every rank's slice of every tensor, before any I/O: a rule error stops every rank here.
  const std::vector<TensorInfo>& infos = checkpoint.tensors();
  Schedule schedule;
  std::vector<uint64_t> sizes;
  for (const uint32_t index : indices) {
    TF_ASSIGN_OR_RETURN(Item item, MakeItem(infos[index], spec, me, world));
    sizes.push_back(item.info->size);
    schedule.items.push_back(std::move(item));
  }
  schedule.readers = AssignReaders(sizes, world);
  schedule.rounds = AssignRounds(sizes, schedule.readers, world, budget);
  schedule.round_count =
      indices.empty() ? 0 : *std::max_element(schedule.rounds.begin(), schedule.rounds.end()) + 1;
  return schedule;
}

// The Loader under the rounds: whole tensors, no budget of its own.
Result<std::unique_ptr<Loader>> OpenRoundLoader(std::shared_ptr<const Checkpoint> checkpoint,
                                                const LoadOptions& options) {
  // The rounds are the budget: the loader under them loads each round's reads at once.
  // It reads whole tensors: any per-rank slicing of the caller's options does not apply here.
  LoadOptions load_options = options;
  load_options.budget = 0;
  load_options.tensor_parallel.reset();
  return Loader::Open(std::move(checkpoint), load_options);
}

// Copies `slice` of `info` out of `source` (the whole tensor's bytes) to `dst`; returns its end.
std::byte* CopySlice(const TensorInfo& info, const TensorSlice& slice, const std::byte* source,
                     std::byte* dst) {
  for (const auto& [offset, length] : SliceByteRanges(info, slice)) {
    std::memcpy(dst, source + offset, length);
    dst += length;
  }
  return dst;
}

// This rank's side of the rounds: its reads, the status exchange, the tensor exchange.
class RoundRunner {
 public:
  // `loader` is null when it could not open (`open_status` says why).
  RoundRunner(const Schedule& schedule, Collective& collective, Loader* loader, Status open_status,
              CooperativeStats& stats)
      : schedule_(schedule),
        collective_(collective),
        loader_(loader),
        open_status_(std::move(open_status)),
        stats_(stats),
        me_(collective.rank()),
        world_(collective.size()) {}

  // Runs round k: this rank's result of each tensor of the round lands in out[i] (schedule order).
  Status Run(uint32_t k, std::vector<Tensor>& out) {
    Result<std::vector<Tensor>> loaded = Read(k);
    const Clock::time_point exchange_start = Clock::now();
    TF_RETURN_IF_ERROR(AgreeOnReads(loaded.status()));
    TF_RETURN_IF_ERROR(Exchange(k, *loaded, out));
    stats_.exchange_seconds += SecondsSince(exchange_start);
    stats_.rounds++;
    return Status::Ok();
  }

 private:
  // This rank's reads of round k, in checkpoint order.
  Result<std::vector<Tensor>> Read(uint32_t k) {
    if (!open_status_.ok()) return open_status_;
    std::vector<std::string> names;
    for (size_t i = 0; i < schedule_.items.size(); ++i) {
      if (schedule_.readers[i] == me_ && schedule_.rounds[i] == k) {
        names.push_back(schedule_.items[i].info->name);
      }
    }
    if (names.empty()) return std::vector<Tensor>{};
    const Clock::time_point read_start = Clock::now();
    Result<std::vector<Tensor>> r = loader_->Load(Selection::Names(std::move(names)));
    stats_.read_seconds += SecondsSince(read_start);
    if (r.ok()) {
      const LoadStats ls = loader_->stats();
      stats_.bytes_read += ls.bytes;
      stats_.engine = ls.engine;
      stats_.remote_requests += ls.remote_requests;
      stats_.remote_retries += ls.remote_retries;
      stats_.remote_bytes += ls.remote_bytes;
    }
    return r;
  }

  // Shares this rank's read status with every rank; an error unless every rank has its reads.
  Status AgreeOnReads(const Status& read_status) {
    // Everyone learns whether every rank has its reads, so nobody waits in a collective for a
    // rank that gave up.
    TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> codes,
                        collective_.AllGather(
                            read_status.ok() ? 0 : 1 + static_cast<uint64_t>(read_status.code())));
    if (!read_status.ok()) return read_status;
    for (uint32_t q = 0; q < world_; ++q) {
      if (codes[q] != 0) {
        return Status(Code::kIoError, "cooperative load: rank " + std::to_string(q) +
                                          " failed reading its share (" +
                                          std::string(CodeName(static_cast<Code>(codes[q] - 1))) +
                                          "); see that rank's error");
      }
    }
    return Status::Ok();
  }

  // Exchanges round k's tensors, tensor by tensor in checkpoint order; `loaded`: this rank's reads.
  Status Exchange(uint32_t k, const std::vector<Tensor>& loaded, std::vector<Tensor>& out) {
    size_t next_loaded = 0;
    for (size_t i = 0; i < schedule_.items.size(); ++i) {
      if (schedule_.rounds[i] != k) continue;
      const Item& item = schedule_.items[i];
      const uint32_t root = schedule_.readers[i];
      const Tensor* source = nullptr;
      if (root == me_) {
        if (next_loaded >= loaded.size() || loaded[next_loaded].name() != item.info->name) {
          return Status(
              Code::kInternal,
              "cooperative load: loader returned tensors out of order at " + item.info->name);
        }
        source = &loaded[next_loaded++];
      }
      TF_ASSIGN_OR_RETURN(out[i],
                          item.whole ? Broadcast(item, root, source) : Scatter(item, root, source));
    }
    return Status::Ok();
  }

  // A replicated tensor: the reader (`root`, holding `source`) broadcasts it whole.
  Result<Tensor> Broadcast(const Item& item, uint32_t root, const Tensor* source) {
    const TensorInfo& info = *item.info;
    if (root == me_) {
      stats_.bytes_sent += info.size * (world_ - 1);
      if (info.size > 0) {
        TF_RETURN_IF_ERROR(collective_.Broadcast({source->data(), source->size()}, {}, root)
                               .WithPrefix(info.name));
      }
      return *source;  // shares the loader's buffer
    }
    std::shared_ptr<std::byte[]> buffer(new std::byte[info.size]);
    if (info.size > 0) {
      TF_RETURN_IF_ERROR(
          collective_.Broadcast({}, {buffer.get(), info.size}, root).WithPrefix(info.name));
    }
    stats_.bytes_received += info.size;
    const std::byte* data = buffer.get();
    return Tensor(info.name, info.dtype, info.shape, data, info.size, std::move(buffer));
  }

  // A split tensor: the reader (`root`, holding `source`) scatters every rank's slice.
  Result<Tensor> Scatter(const Item& item, uint32_t root, const Tensor* source) {
    const TensorInfo& info = *item.info;
    const uint64_t mine = item.counts[me_];
    std::shared_ptr<std::byte[]> buffer(new std::byte[mine]);
    if (info.size > 0) {
      // The reader copies its own slice straight into its result; the transfer carries the
      // other ranks' slices only (the root's count is 0 in it, on every rank alike).
      std::vector<uint64_t> transfer = item.counts;
      transfer[root] = 0;
      std::span<const std::byte> send;
      std::span<std::byte> recv;
      if (root == me_) {
        CopySlice(info, item.slices[me_], source->data(), buffer.get());
        Pack(item, *source, transfer);
        send = pack_;
        stats_.bytes_sent += pack_.size();
      } else {
        recv = {buffer.get(), mine};
        stats_.bytes_received += mine;
      }
      if (world_ > 1) {
        TF_RETURN_IF_ERROR(collective_.Scatterv(send, transfer, recv, root).WithPrefix(info.name));
      }
    }
    const std::byte* data = buffer.get();
    return Tensor(info.name, info.dtype, item.local_shape, data, mine, std::move(buffer));
  }

  // Packs every other rank's slice of `source` into pack_, in rank order, each in destination
  // order.
  void Pack(const Item& item, const Tensor& source, std::span<const uint64_t> transfer) {
    pack_.resize(std::accumulate(transfer.begin(), transfer.end(), uint64_t{0}));
    std::byte* dst = pack_.data();
    for (uint32_t q = 0; q < world_; ++q) {
      if (q == me_) continue;
      dst = CopySlice(*item.info, item.slices[q], source.data(), dst);
    }
  }

  const Schedule& schedule_;
  Collective& collective_;
  Loader* loader_;
  const Status open_status_;
  CooperativeStats& stats_;
  const uint32_t me_;
  const uint32_t world_;
  std::vector<std::byte> pack_;  // the reader's packing buffer, reused across tensors
};

// What the caller asked for, in the Loader's order, from `exchanged` (the tensors read, in
// described.read's order): tensors read only for an alias dropped, aliases sharing their
// target's bytes.
std::vector<Tensor> Deliver(const Description& described, size_t tensor_count,
                            const std::vector<Tensor>& exchanged) {
  std::vector<size_t> position(tensor_count, SIZE_MAX);
  for (size_t i = 0; i < described.read.size(); ++i) position[described.read[i]] = i;
  std::vector<Tensor> delivered;
  for (const OutputInfo& o : described.outputs) {
    const Tensor& t = exchanged[position[o.tensor]];
    if (!o.alias) {
      delivered.push_back(t);
    } else {
      delivered.emplace_back(o.name, t.dtype(), t.shape(), t.data(), t.size(), t.owner(),
                             t.device());
    }
  }
  return delivered;
}

}  // namespace

Result<std::vector<Tensor>> LoadCooperative(std::shared_ptr<const Checkpoint> checkpoint,
                                            const Selection& selection, const ShardSpec& spec,
                                            const LoadOptions& options, Collective& collective,
                                            CooperativeStats* stats) {
  const Clock::time_point start = Clock::now();
  CooperativeStats local;
  if (checkpoint == nullptr)
    return Status(Code::kInvalidArgument, "LoadCooperative: no checkpoint");
  TF_RETURN_IF_ERROR(CheckHostTarget(options));
  TF_ASSIGN_OR_RETURN(
      const Description described,
      DescribeForRank(*checkpoint, selection, spec, collective.rank(), collective.size()));
  TF_ASSIGN_OR_RETURN(const Schedule schedule,
                      MakeSchedule(*checkpoint, described.read, spec, options.budget,
                                   collective.rank(), collective.size()));

  // A rank whose loader cannot open still takes part in the first status exchange, so the others
  // learn of it instead of waiting for it in a collective.
  Result<std::unique_ptr<Loader>> opened = OpenRoundLoader(checkpoint, options);
  const Status open_status = opened.status();
  std::unique_ptr<Loader> loader = opened.ok() ? std::move(opened).value() : nullptr;
  if (schedule.round_count == 0 && !open_status.ok()) return open_status;

  RoundRunner rounds(schedule, collective, loader.get(), open_status, local);
  std::vector<Tensor> exchanged(schedule.items.size());
  for (uint32_t k = 0; k < schedule.round_count; ++k) TF_RETURN_IF_ERROR(rounds.Run(k, exchanged));

  std::vector<Tensor> out = Deliver(described, checkpoint->tensors().size(), exchanged);
  for (const Tensor& t : out) local.bytes += t.size();
  local.tensors = out.size();
  local.seconds = SecondsSince(start);
  if (stats != nullptr) *stats = std::move(local);
  return out;
}

}  // namespace tensorferry

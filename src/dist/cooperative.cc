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

Result<std::vector<Tensor>> LoadCooperative(std::shared_ptr<const Checkpoint> checkpoint,
                                            const Selection& selection, const ShardSpec& spec,
                                            const LoadOptions& options, Collective& collective,
                                            CooperativeStats* stats) {
  const Clock::time_point start = Clock::now();
  CooperativeStats local;
  const uint32_t world = collective.size();
  const uint32_t me = collective.rank();
  if (checkpoint == nullptr)
    return Status(Code::kInvalidArgument, "LoadCooperative: no checkpoint");
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
  // Tied aliases resolve as for the Loader: their targets are read (once) and exchanged, the
  // aliases added at the end sharing their target's result.
  TensorParallelOptions tp;
  tp.spec = spec;
  tp.rank = me;
  tp.world = world;
  TF_ASSIGN_OR_RETURN(const Description described, DescribeSelection(*checkpoint, selection, &tp));
  const std::vector<uint32_t>& indices = described.read;
  const std::vector<TensorInfo>& infos = checkpoint->tensors();
  const size_t n = indices.size();

  // Every rank's slice of every tensor, before any I/O: a rule error stops every rank here.
  std::vector<Item> items(n);
  std::vector<uint64_t> sizes(n);
  for (size_t i = 0; i < n; ++i) {
    Item& item = items[i];
    item.info = &infos[indices[i]];
    sizes[i] = item.info->size;
    const ShardRule rule = spec.RuleFor(item.info->name);
    item.whole = !rule.is_split();
    if (item.whole) {
      item.local_shape = item.info->shape;
      continue;
    }
    item.slices.reserve(world);
    item.counts.reserve(world);
    for (uint32_t q = 0; q < world; ++q) {
      TF_ASSIGN_OR_RETURN(TensorSlice slice, SliceOf(*item.info, rule, q, world));
      item.counts.push_back(slice.bytes);
      item.slices.push_back(std::move(slice));
    }
    item.local_shape = item.slices[me].shape;
  }
  const std::vector<uint32_t> readers = AssignReaders(sizes, world);
  const std::vector<uint32_t> rounds = AssignRounds(sizes, readers, world, options.budget);
  const uint32_t round_count = n == 0 ? 0 : *std::max_element(rounds.begin(), rounds.end()) + 1;

  // The rounds are the budget: the loader under them loads each round's reads at once.
  // It reads whole tensors: any per-rank slicing of the caller's options does not apply here.
  LoadOptions load_options = options;
  load_options.budget = 0;
  load_options.tensor_parallel.reset();
  // A rank whose loader cannot open still takes part in the first status exchange, so the others
  // learn of it instead of waiting for it in a collective.
  Result<std::unique_ptr<Loader>> opened = Loader::Open(checkpoint, load_options);
  const Status open_status = opened.status();
  std::unique_ptr<Loader> loader = opened.ok() ? std::move(opened).value() : nullptr;

  if (round_count == 0 && !open_status.ok()) return open_status;
  std::vector<Tensor> out(n);
  std::vector<std::byte> pack;
  for (uint32_t k = 0; k < round_count; ++k) {
    // 1. This rank's reads of the round.
    std::vector<std::string> names;
    for (size_t i = 0; i < n; ++i) {
      if (readers[i] == me && rounds[i] == k) names.push_back(items[i].info->name);
    }
    std::vector<Tensor> loaded;
    Status read_status = open_status;
    if (read_status.ok() && !names.empty()) {
      const Clock::time_point read_start = Clock::now();
      Result<std::vector<Tensor>> r = loader->Load(Selection::Names(std::move(names)));
      local.read_seconds += SecondsSince(read_start);
      if (r.ok()) {
        loaded = std::move(r).value();
        const LoadStats ls = loader->stats();
        local.bytes_read += ls.bytes;
        local.engine = ls.engine;
      } else {
        read_status = r.status();
      }
    }
    // 2. Everyone learns whether every rank has its reads, so nobody waits in a collective for a
    // rank that gave up.
    const Clock::time_point exchange_start = Clock::now();
    TF_ASSIGN_OR_RETURN(
        const std::vector<uint64_t> codes,
        collective.AllGather(read_status.ok() ? 0 : 1 + static_cast<uint64_t>(read_status.code())));
    if (!read_status.ok()) return read_status;
    for (uint32_t q = 0; q < world; ++q) {
      if (codes[q] != 0) {
        return Status(Code::kIoError, "cooperative load: rank " + std::to_string(q) +
                                          " failed reading its share (" +
                                          std::string(CodeName(static_cast<Code>(codes[q] - 1))) +
                                          "); see that rank's error");
      }
    }
    // 3. The exchange, tensor by tensor in checkpoint order.
    size_t next_loaded = 0;
    for (size_t i = 0; i < n; ++i) {
      if (rounds[i] != k) continue;
      const Item& item = items[i];
      const TensorInfo& info = *item.info;
      const uint32_t root = readers[i];
      const Tensor* source = nullptr;
      if (root == me) {
        if (next_loaded >= loaded.size() || loaded[next_loaded].name() != info.name) {
          return Status(Code::kInternal,
                        "cooperative load: loader returned tensors out of order at " + info.name);
        }
        source = &loaded[next_loaded++];
      }
      if (item.whole) {
        if (root == me) {
          out[i] = *source;  // shares the loader's buffer
          local.bytes_sent += info.size * (world - 1);
          if (info.size > 0) {
            TF_RETURN_IF_ERROR(collective.Broadcast({source->data(), source->size()}, {}, root)
                                   .WithPrefix(info.name));
          }
        } else {
          std::shared_ptr<std::byte[]> buffer(new std::byte[info.size]);
          if (info.size > 0) {
            TF_RETURN_IF_ERROR(
                collective.Broadcast({}, {buffer.get(), info.size}, root).WithPrefix(info.name));
          }
          local.bytes_received += info.size;
          const std::byte* data = buffer.get();
          out[i] = Tensor(info.name, info.dtype, info.shape, data, info.size, std::move(buffer));
        }
        continue;
      }
      const uint64_t mine = item.counts[me];
      std::shared_ptr<std::byte[]> buffer(new std::byte[mine]);
      if (info.size > 0) {
        // The reader copies its own slice straight into its result; the transfer carries the
        // other ranks' slices only (the root's count is 0 in it, on every rank alike).
        std::vector<uint64_t> transfer = item.counts;
        transfer[root] = 0;
        std::span<const std::byte> send;
        std::span<std::byte> recv;
        if (root == me) {
          std::byte* own = buffer.get();
          for (const auto& [offset, length] : SliceByteRanges(info, item.slices[me])) {
            std::memcpy(own, source->data() + offset, length);
            own += length;
          }
          // Every other rank's slice, in rank order, each in destination order.
          pack.resize(std::accumulate(transfer.begin(), transfer.end(), uint64_t{0}));
          std::byte* dst = pack.data();
          for (uint32_t q = 0; q < world; ++q) {
            if (q == me) continue;
            for (const auto& [offset, length] : SliceByteRanges(info, item.slices[q])) {
              std::memcpy(dst, source->data() + offset, length);
              dst += length;
            }
          }
          send = pack;
          local.bytes_sent += pack.size();
        } else {
          recv = {buffer.get(), mine};
          local.bytes_received += mine;
        }
        if (world > 1) {
          TF_RETURN_IF_ERROR(collective.Scatterv(send, transfer, recv, root).WithPrefix(info.name));
        }
      }
      const std::byte* data = buffer.get();
      out[i] = Tensor(info.name, info.dtype, item.local_shape, data, mine, std::move(buffer));
    }
    local.exchange_seconds += SecondsSince(exchange_start);
    local.rounds++;
  }
  // What the caller asked for, in the Loader's order: tensors read only for an alias dropped,
  // aliases sharing their target's bytes.
  std::vector<size_t> position(infos.size(), SIZE_MAX);
  for (size_t i = 0; i < n; ++i) position[indices[i]] = i;
  std::vector<Tensor> delivered;
  for (const OutputInfo& o : described.outputs) {
    const Tensor& t = out[position[o.tensor]];
    if (!o.alias) {
      delivered.push_back(t);
    } else {
      delivered.emplace_back(o.name, t.dtype(), t.shape(), t.data(), t.size(), t.owner(),
                             t.device());
    }
  }
  out = std::move(delivered);
  for (const Tensor& t : out) local.bytes += t.size();
  local.tensors = out.size();
  local.seconds = SecondsSince(start);
  if (stats != nullptr) *stats = std::move(local);
  return out;
}

}  // namespace tensorferry

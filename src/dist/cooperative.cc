// Cooperative tensor-parallel loading (cooperative.h).
#include "tensorferry/cooperative.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "io/file_set.h"
#include "tensorferry/integrity.h"
#include "tensorferry/object_store.h"
#include "tensorferry/size.h"
#include "util/macros.h"

namespace tensorferry {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Whether `sizes` fit in contiguous runs, rank r's in order, each rank's bytes (`loaded`[r]
// plus its run's) at most `limit`: greedy filling from the front (as much as each rank holds,
// which never leaves less room for the rest).
bool RunsFit(std::span<const uint64_t> sizes, std::span<const uint64_t> loaded, uint64_t limit) {
  uint32_t rank = 0;
  uint64_t room = limit - std::min(limit, loaded[0]);
  for (uint64_t s : sizes) {
    while (s > room) {
      if (++rank == loaded.size()) return false;
      room = limit - std::min(limit, loaded[rank]);
    }
    room -= s;
  }
  return true;
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

std::vector<uint32_t> AssignReaders(std::span<const uint64_t> sizes, uint32_t world,
                                    std::span<const uint64_t> loaded) {
  std::vector<uint32_t> readers(sizes.size(), 0);
  if (sizes.empty() || world <= 1) return readers;
  std::vector<uint64_t> before(world, 0);
  for (uint32_t r = 0; r < world && r < loaded.size(); ++r) before[r] = loaded[r];
  // The smallest limit on a rank's bytes at which the runs fit: between the most any rank holds
  // already and that plus the total (always feasible: everything on rank 0). Binary search over
  // that range (monotone: a larger limit never fits worse).
  const uint64_t most = *std::max_element(before.begin(), before.end());
  uint64_t lo = most, hi = most;
  for (uint64_t s : sizes) hi += s;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (RunsFit(sizes, before, mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  uint32_t rank = 0;
  uint64_t current = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    while (before[rank] + current + sizes[i] > lo && rank + 1 < world) {
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

// Bytes covered by `periods` repetitions (`stride` bytes apart) of `blocks` (start, length) in
// units of `row` bytes, consecutive ranges merged across gaps of at most max_gap.
uint64_t CoveringOfPeriods(const std::vector<std::pair<uint64_t, uint64_t>>& blocks, uint64_t row,
                           uint64_t stride, uint64_t periods, uint64_t max_gap) {
  uint64_t total = 0;
  uint64_t run_start = 0, run_end = 0;
  bool open = false;
  for (uint64_t o = 0; o < periods; ++o) {
    for (const auto& [start, length] : blocks) {
      if (length == 0) continue;
      const uint64_t offset = o * stride + start * row;
      if (open && offset >= run_end && offset - run_end <= max_gap) {
        run_end = offset + length * row;
        continue;
      }
      if (open) total += run_end - run_start;
      run_start = offset;
      run_end = offset + length * row;
      open = true;
    }
  }
  if (open) total += run_end - run_start;
  return total;
}

// The bytes a rank reads for `slice` of `info` when it reads its own part: the slice's ranges
// (SliceByteRanges), consecutive ones merged across gaps of at most max_gap (the covering reads
// of the sliced plan). The ranges repeat with every index of the dimensions before the split one,
// and so do the merges: the cover of n repetitions is C1 + (n - 1) (C2 - C1), computed from one
// and two (the plan stays cheap for thousands of rows times hundreds of ranks).
uint64_t CoveringBytes(const TensorInfo& info, const TensorSlice& slice, uint64_t max_gap) {
  if (!slice.rule.is_split()) return info.size;
  const uint32_t dim = slice.rule.dim;
  uint64_t outer = 1;
  for (uint32_t d = 0; d < dim; ++d) outer *= info.shape[d];
  if (outer == 0 || info.shape[dim] == 0 || info.size == 0) return 0;
  const uint64_t row = info.size / (outer * info.shape[dim]);  // bytes per index of `dim`
  const uint64_t stride = info.shape[dim] * row;
  if (outer <= 2) return CoveringOfPeriods(slice.blocks, row, stride, outer, max_gap);
  const uint64_t one = CoveringOfPeriods(slice.blocks, row, stride, 1, max_gap);
  const uint64_t two = CoveringOfPeriods(slice.blocks, row, stride, 2, max_gap);
  return one + (outer - 1) * (two - one);
}

// One selected tensor and every rank's part of it, with its cost-model figures per host.
struct Costed {
  Item item;
  std::vector<uint64_t> local_read;  // per host: bytes its ranks read for their own parts
  std::vector<uint64_t> received;    // per host: bytes its ranks end with (their parts)
  bool splittable = false;           // may be split among the readers by rows (SplitAmongReaders)
  uint64_t granule = 1;              // split: the pieces' rows in units of this many (PieceGranule)
  bool preread = false;  // read while the network probe ran (it ran, and this saves no reads)
};

// What the estimates depend on besides the placement (CooperativePlan::Estimate).
struct Model {
  std::span<const uint32_t> host_of_rank;
  uint32_t hosts = 1;
  uint64_t storage_rate = 1;
  uint64_t network_rate = 1;
  uint64_t budget = 0;
  double probe_seconds = 0;  // > 0: a probe ran first, the Costed::preread tensors read during it

  // A host's time: its storage reads (those not read during the probe start after it) and, when
  // it receives anything, its network transfers (after the probe), both at once.
  double Seconds(double read, double preread, double network) const {
    const double s = static_cast<double>(storage_rate), b = static_cast<double>(network_rate);
    double t = read / s;
    if (probe_seconds > 0) t = std::max(t, probe_seconds + (read - preread) / s);
    if (network > 0) t = std::max(t, probe_seconds + network / b);
    return t;
  }
};

// The rule by which a tensor split among the readers is read: by rows, in units of `granule`
// rows (CooperativeTensorPlan::piece_granule).
ShardRule PieceRule(uint64_t granule) {
  ShardRule rule = ShardRule::Split(0);
  rule.granule = granule;
  return rule;
}

// Byte range [begin, end) of the tensor that rank p of `world` reads when the tensor is split
// among the readers by rows: the rows PieceRule(granule) gives rank p (the uneven rule of
// shard.h, which SliceOf applies and the piece Loader reads). REQUIRES: the tensor is splittable
// (CanSplit with that granule).
std::pair<uint64_t, uint64_t> PieceRange(const TensorInfo& info, uint32_t p, uint32_t world,
                                         uint64_t granule) {
  const Result<TensorSlice> slice = SliceOf(info, PieceRule(granule), p, world);
  if (!slice.ok() || slice->blocks.size() != 1) return {0, p == 0 ? info.size : 0};  // not met
  const uint64_t row = info.size / info.shape[0];
  const auto [start, count] = slice->blocks[0];
  return {start * row, (start + count) * row};
}

// The unit of rows a tensor split among the readers is cut in: 1, or with checksum chunks of
// `chunk` bytes (0: none) the fewest rows whose bytes are a multiple of it, so that every piece
// starts on a chunk (its reader checks the chunks it holds whole; a piece cutting chunks would
// leave those unchecked). REQUIRES: whole bytes per row.
uint64_t PieceGranule(const TensorInfo& info, uint64_t chunk) {
  if (chunk == 0 || info.shape.empty() || info.shape[0] == 0) return 1;
  const uint64_t row = info.size / info.shape[0];
  return row == 0 ? 1 : chunk / std::gcd(chunk, row);
}

// True when `info` can be split among `world` readers by rows in units of `granule` rows: at
// least one unit per reader and whole bytes per row (a sub-byte dtype may not be).
bool CanSplit(const TensorInfo& info, uint32_t world, uint64_t granule) {
  if (world <= 1 || info.shape.empty() || info.size == 0 || info.shape[0] == 0 ||
      info.size % info.shape[0] != 0) {
    return false;
  }
  const uint64_t rows = info.shape[0];
  return rows / granule + (rows % granule != 0 ? 1 : 0) >= world;
}

// FNV-1a over what the ranks must agree on (not adversarial: it tells honest ranks apart).
class Fingerprint {
 public:
  void Add(uint64_t v) {
    for (int i = 0; i < 8; ++i) Byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  void Add(std::string_view s) {
    Add(s.size());
    for (char c : s) Byte(static_cast<uint8_t>(c));
  }
  uint64_t value() const noexcept { return h_; }

 private:
  void Byte(uint8_t b) { h_ = (h_ ^ b) * 0x100000001b3ull; }
  uint64_t h_ = 0xcbf29ce484222325ull;
};

// `s` with each %XX decoded (a hub URL's file name is percent-encoded, the cache's is not).
std::string PercentDecoded(std::string_view s) {
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// The hub commit a file path lies under: <...>/snapshots/<commit>/<file> (the hub cache) or
// <...>/resolve/<commit>/<file> (the hub), as (commit, file); nullopt for any other path.
std::optional<std::pair<std::string_view, std::string_view>> HubCommitOf(std::string_view path) {
  for (const std::string_view marker : {"/snapshots/", "/resolve/"}) {
    for (size_t at = path.find(marker); at != std::string_view::npos;
         at = path.find(marker, at + 1)) {
      const size_t commit = at + marker.size();
      if (path.size() <= commit + 41 || path[commit + 40] != '/') continue;
      const std::string_view id = path.substr(commit, 40);
      if (std::all_of(id.begin(), id.end(),
                      [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); })) {
        return std::make_pair(id, path.substr(commit + 41));
      }
    }
  }
  return std::nullopt;
}

// What names the bytes of `ckpt`'s files beyond their layout, the same on every rank that reads
// the same bytes (CooperativePlan::content_digest): a hub file's commit and name, an object's
// ETag (the version tag of its identity, source.h); local files add nothing.
void AddContentIdentities(const Checkpoint& ckpt, std::span<const uint32_t> indices,
                          Fingerprint& f) {
  std::vector<bool> seen(ckpt.files().size(), false);
  for (const uint32_t index : indices) {
    const uint32_t file = ckpt.tensors()[index].file;
    if (seen[file]) continue;
    seen[file] = true;
    const std::string& path = ckpt.files()[file].path;
    if (const auto hub = HubCommitOf(path)) {
      f.Add(file);
      f.Add(hub->first);
      f.Add(PercentDecoded(hub->second));
    } else if (IsObjectUrl(path)) {
      f.Add(file);
      f.Add(ckpt.file_set() != nullptr ? ckpt.file_set()->identity(file).inode : 0);
    }
  }
}

// The checksum records of the files a load checks (ChecksumsForLoad): each file's chunk size (0
// without a record, PieceGranule), and the records of `indices` combined with their files'
// content identities (CooperativePlan::content_digest). Errors: those of ChecksumsForLoad (an
// unreadable manifest or record), which the loads would report too: reported in planning, by the
// rank that met them, rather than as a disagreement of the plans.
struct CheckedFiles {
  std::vector<uint64_t> chunk_size;  // per file
  uint64_t digest = 0;
};

Result<CheckedFiles> Checked(const Checkpoint& ckpt, std::span<const uint32_t> indices,
                             const LoadOptions& options) {
  CheckedFiles out;
  out.chunk_size.assign(ckpt.files().size(), 0);
  TF_ASSIGN_OR_RETURN(const std::vector<std::optional<FileChecksums>> sums,
                      ChecksumsForLoad(ckpt, options.verify));
  Fingerprint sources;
  AddContentIdentities(ckpt, indices, sources);
  const uint64_t nothing = Fingerprint().value();
  const uint64_t identities = sources.value() != nothing ? sources.value() | 1 : 0;
  if (sums.empty()) {
    out.digest = identities;
    return out;
  }
  for (uint32_t f = 0; f < sums.size(); ++f) {
    if (sums[f]) out.chunk_size[f] = sums[f]->chunk_size;
  }
  std::vector<uint64_t> digests;
  for (const uint32_t index : indices) {
    const TensorInfo& info = ckpt.tensors()[index];
    if (!sums[info.file]) continue;
    const auto it = sums[info.file]->tensors.find(info.name);
    if (it == sums[info.file]->tensors.end()) continue;
    digests.push_back(index);
    digests.push_back(CombineChunkDigests(it->second.chunks));
  }
  if (identities != 0) digests.push_back(identities);
  if (!digests.empty()) out.digest = CombineChunkDigests(digests) | 1;  // never 0
  return out;
}

// Which exchanged tensors are split among every rank by rows (CooperativeTensorPlan::readers):
// the splittable ones larger than
// - half the even share of the exchanged bytes (one reader would hold up the others);
// - 1/kBalanceFraction of that share, if also over kMinSplitBytes: the readers' contiguous runs
//   balance within one unsplit tensor, so no rank reads (or, from object storage, transfers)
//   more than its share + 1/128 (issue 13: "share + 1%"), or than its share + 1 MiB on a
//   checkpoint whose share is under 128 MiB (pieces of small tensors would cost more requests
//   than the balance gains);
// - the round budget (one rank would read it whole in a round of its own while the others wait,
//   and hold all of it).
constexpr uint64_t kBalanceFraction = 128;
constexpr uint64_t kMinSplitBytes = uint64_t{1} << 20;

std::vector<bool> SplitAmongReaders(const std::vector<Costed>& costed,
                                    const std::vector<bool>& exchanged, uint32_t world,
                                    uint64_t budget) {
  std::vector<bool> split(costed.size(), false);
  if (world <= 1) return split;
  uint64_t total = 0;
  for (size_t i = 0; i < costed.size(); ++i) {
    if (exchanged[i]) total += costed[i].item.info->size;
  }
  const uint64_t share = total / world;
  const uint64_t threshold =
      std::min(share / 2, std::max(share / kBalanceFraction, kMinSplitBytes));
  for (size_t i = 0; i < costed.size(); ++i) {
    const uint64_t size = costed[i].item.info->size;
    split[i] =
        exchanged[i] && costed[i].splittable && (size > threshold || (budget > 0 && size > budget));
  }
  return split;
}

// Per-host totals of a placement and the model's estimate of it.
// `split` receives SplitAmongReaders' choice, `readers_out` the readers (AssignReaders) of the
// exchanged tensors read whole, in order.
CooperativePlan::Estimate Estimate(const std::vector<Costed>& costed,
                                   const std::vector<bool>& exchanged, const Model& model,
                                   std::vector<uint32_t>* readers_out = nullptr,
                                   std::vector<bool>* split_out = nullptr) {
  const std::span<const uint32_t> host_of_rank = model.host_of_rank;
  const uint32_t world = static_cast<uint32_t>(host_of_rank.size()), hosts = model.hosts;
  const std::vector<bool> split = SplitAmongReaders(costed, exchanged, world, model.budget);
  // The readers of the tensors read whole balance the pieces too: the units of several chunks
  // that pieces are cut in leave the uneven remainder with the first ranks.
  std::vector<uint64_t> sizes, pieces(world, 0);
  for (size_t i = 0; i < costed.size(); ++i) {
    if (!exchanged[i]) continue;
    if (!split[i]) {
      sizes.push_back(costed[i].item.info->size);
      continue;
    }
    for (uint32_t p = 0; p < world; ++p) {
      const auto [begin, end] = PieceRange(*costed[i].item.info, p, world, costed[i].granule);
      pieces[p] += end - begin;
    }
  }
  const std::vector<uint32_t> readers = AssignReaders(sizes, world, pieces);
  std::vector<uint64_t> read(hosts, 0), preread(hosts, 0), network(hosts, 0);
  std::vector<uint64_t> ranks_on(hosts, 0);
  for (uint32_t h : host_of_rank) ranks_on[h]++;
  size_t next = 0;
  for (size_t i = 0; i < costed.size(); ++i) {
    const Costed& c = costed[i];
    if (!exchanged[i]) {
      for (uint32_t h = 0; h < hosts; ++h) {
        read[h] += c.local_read[h];
        if (c.preread) preread[h] += c.local_read[h];
      }
      continue;
    }
    if (split[i]) {
      // Rank p reads piece p; a host receives its ranks' parts of the pieces read elsewhere,
      // counted as the other hosts' share of the rows.
      for (uint32_t p = 0; p < world; ++p) {
        const auto [begin, end] = PieceRange(*c.item.info, p, world, c.granule);
        read[host_of_rank[p]] += end - begin;
      }
      for (uint32_t h = 0; h < hosts; ++h) {
        network[h] += c.received[h] / world * (world - ranks_on[h]);
      }
      continue;
    }
    const uint32_t reader_host = host_of_rank[readers[next++]];
    read[reader_host] += c.item.info->size;
    for (uint32_t h = 0; h < hosts; ++h) {
      if (h != reader_host) network[h] += c.received[h];
    }
  }
  if (readers_out != nullptr) *readers_out = readers;
  if (split_out != nullptr) *split_out = split;
  CooperativePlan::Estimate e;
  e.read = *std::max_element(read.begin(), read.end());
  e.network = *std::max_element(network.begin(), network.end());
  for (uint32_t h = 0; h < hosts; ++h) {
    e.seconds = std::max(
        e.seconds, model.Seconds(static_cast<double>(read[h]), static_cast<double>(preread[h]),
                                 static_cast<double>(network[h])));
  }
  return e;
}

// The tensors to exchange under ExchangeChoice::kAuto (see PlanCooperative).
std::vector<bool> ChooseExchanged(const std::vector<CooperativeTensorPlan>& tensors,
                                  const std::vector<Costed>& costed, const Model& model) {
  const uint32_t hosts = model.hosts;
  std::vector<size_t> candidates;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].SavesReads()) candidates.push_back(i);
  }
  // Storage bytes saved per network byte spent, best first (no network cost: first of all).
  auto saved = [&](size_t i) {
    return static_cast<double>(tensors[i].local_read - tensors[i].exchange_read);
  };
  std::stable_sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
    // a before b when saved(a) / net(a) > saved(b) / net(b), without dividing by zero.
    return saved(a) * static_cast<double>(tensors[b].exchange_network) >
           saved(b) * static_cast<double>(tensors[a].exchange_network);
  });
  const size_t n = candidates.size();
  // The model over average hosts, prefix by prefix: storage falls, network rises; its best
  // prefix is where the two meet.
  double read = 0, preread = 0, network = 0;
  for (const Costed& c : costed) {
    uint64_t sum = 0;
    for (uint64_t b : c.local_read) sum += b;
    read += static_cast<double>(sum) / hosts;
    if (c.preread) preread += static_cast<double>(sum) / hosts;
  }
  auto seconds = [&] { return model.Seconds(read, preread, network); };
  double best_average = seconds();
  size_t average_prefix = 0;
  for (size_t k = 0; k < n; ++k) {
    const CooperativeTensorPlan& t = tensors[candidates[k]];
    read -= static_cast<double>(t.local_read - t.exchange_read);
    network += static_cast<double>(t.exchange_network);
    if (seconds() < best_average * (1 - 1e-12)) {
      best_average = seconds();
      average_prefix = k + 1;
    }
  }
  // The busiest host differs from the average one (a tensor read on one host is received by
  // every other), so prefixes are compared by the exact estimate: the first 32, 64 spread over
  // the whole order, and those around the average model's best.
  std::vector<size_t> prefixes;
  for (size_t p = 0; p <= std::min<size_t>(n, 32); ++p) prefixes.push_back(p);
  for (size_t i = 1; i <= 64; ++i) prefixes.push_back((n * i + 63) / 64);
  for (size_t p = average_prefix >= 2 ? average_prefix - 2 : 0; p <= average_prefix + 2; ++p) {
    if (p <= n) prefixes.push_back(p);
  }
  std::sort(prefixes.begin(), prefixes.end());
  prefixes.erase(std::unique(prefixes.begin(), prefixes.end()), prefixes.end());
  std::vector<bool> exchanged(tensors.size(), false), best;
  double best_seconds = 0;
  size_t done = 0;
  for (const size_t p : prefixes) {
    for (; done < p; ++done) exchanged[candidates[done]] = true;
    const double e = Estimate(costed, exchanged, model).seconds;
    if (best.empty() || e < best_seconds * (1 - 1e-12)) {
      best_seconds = e;
      best = exchanged;
    }
  }
  return best;
}

Status CheckHosts(std::span<const uint32_t> host_of_rank, uint32_t* hosts) {
  if (host_of_rank.empty()) {
    return Status(Code::kInvalidArgument, "cooperative plan: no ranks (host_of_rank is empty)");
  }
  const uint32_t count = *std::max_element(host_of_rank.begin(), host_of_rank.end()) + 1;
  std::vector<bool> seen(count, false);
  for (uint32_t h : host_of_rank) seen[h] = true;
  if (std::find(seen.begin(), seen.end(), false) != seen.end()) {
    return Status(Code::kInvalidArgument, "cooperative plan: host indices are not dense (0 to " +
                                              std::to_string(count - 1) + ", each used)");
  }
  *hosts = count;
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

// The least fraction of the all-local estimate an exchange must save to be chosen (auto): in the
// multi-host rehearsal's network-bound setting a predicted 8% gain measured as a 15-40% loss
// (docs/benchmarks.md, "Multi-host rehearsal"), the exchange's fixed costs being outside the model.
constexpr double kMinExchangeGain = 0.10;

// What a plan stands on, the same on every rank when they agree: each tensor read (name, dtype,
// shape, place in its file), every rank's slice of it, and the plan's choices per tensor.
uint64_t PlanFingerprint(const CooperativePlan& plan, const std::vector<Item>& items) {
  Fingerprint f;
  f.Add(plan.world);
  f.Add(static_cast<uint64_t>(plan.choice));
  f.Add(plan.storage_rate);
  f.Add(plan.network_rate);
  f.Add(plan.rounds);
  f.Add(plan.content_digest);
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const CooperativeTensorPlan& t = plan.tensors[i];
    const TensorInfo& info = *items[i].info;
    f.Add(info.name);
    f.Add(static_cast<uint64_t>(info.dtype));
    for (uint64_t d : info.shape) f.Add(d);
    f.Add(info.file);
    f.Add(info.offset);
    f.Add(info.size);
    f.Add(items[i].whole);
    for (const TensorSlice& slice : items[i].slices) {
      f.Add(slice.rule.dim);
      for (const auto& [start, length] : slice.blocks) {
        f.Add(start);
        f.Add(length);
      }
      f.Add(slice.bytes);
    }
    f.Add(t.exchanged);
    f.Add(t.reader);
    f.Add(t.round);
    f.Add(t.readers);
    f.Add(t.piece_granule);
    for (uint32_t r : t.piece_rounds) f.Add(r);
  }
  return f.value();
}

// The plan of the tensors `indices` (checkpoint order), with the items of rank `me`, made after a
// network probe of `probe_seconds` (0: none ran; see PlanCooperative).
Result<CooperativePlan> MakePlan(const Checkpoint& checkpoint, std::span<const uint32_t> indices,
                                 const ShardSpec& spec, const LoadOptions& options,
                                 std::span<const uint32_t> host_of_rank, uint32_t me,
                                 std::vector<Item>* items_out, double probe_seconds = 0) {
  CooperativePlan plan;
  TF_RETURN_IF_ERROR(CheckHosts(host_of_rank, &plan.hosts));
  if (!(probe_seconds >= 0) || !std::isfinite(probe_seconds)) {
    return Status(Code::kInvalidArgument,
                  "cooperative plan: probe_seconds must be finite and >= 0");
  }
  plan.world = static_cast<uint32_t>(host_of_rank.size());
  plan.host_of_rank.assign(host_of_rank.begin(), host_of_rank.end());
  plan.choice = options.cooperative.exchange;
  plan.storage_rate = options.cooperative.storage_rate != 0 ? options.cooperative.storage_rate
                                                            : kDefaultStorageRate;
  plan.network_rate = options.cooperative.network_rate != 0 ? options.cooperative.network_rate
                                                            : kDefaultNetworkRate;
  plan.probe_seconds = probe_seconds;
  const uint64_t max_gap =
      options.tensor_parallel ? options.tensor_parallel->max_gap : TensorParallelOptions{}.max_gap;
  const uint32_t world = plan.world, hosts = plan.hosts;
  std::vector<uint32_t> ranks_on(hosts, 0);
  for (uint32_t h : host_of_rank) ranks_on[h]++;

  // Every rank's slice of every tensor, before any I/O: a rule error stops every rank here.
  const std::vector<TensorInfo>& infos = checkpoint.tensors();
  TF_ASSIGN_OR_RETURN(const CheckedFiles checked, Checked(checkpoint, indices, options));
  plan.content_digest = checked.digest;
  std::vector<Costed> costed;
  costed.reserve(indices.size());
  for (const uint32_t index : indices) {
    Costed c;
    TF_ASSIGN_OR_RETURN(c.item, MakeItem(infos[index], spec, me, world));
    c.granule = PieceGranule(infos[index], checked.chunk_size[infos[index].file]);
    c.splittable = CanSplit(infos[index], world, c.granule);
    c.local_read.assign(hosts, 0);
    c.received.assign(hosts, 0);
    const uint64_t size = infos[index].size;
    for (uint32_t q = 0; q < world; ++q) {
      const uint32_t h = host_of_rank[q];
      const bool whole = c.item.whole;
      c.local_read[h] += whole ? size : CoveringBytes(infos[index], c.item.slices[q], max_gap);
      c.received[h] += whole ? size : c.item.counts[q];
    }
    CooperativeTensorPlan t;
    t.tensor = index;
    uint64_t local = 0, received = 0;
    for (uint32_t h = 0; h < hosts; ++h) {
      local += c.local_read[h];
      received += c.received[h];
    }
    t.local_read = local / hosts;
    t.exchange_read = size / hosts;
    // From a reader on another host with probability (hosts - 1) / hosts.
    t.exchange_network = hosts > 1 ? received / hosts * (hosts - 1) / hosts : 0;
    // After a probe, the tensors that no exchange saves reads of were read during it.
    c.preread = probe_seconds > 0 && !t.SavesReads();
    plan.tensors.push_back(t);
    costed.push_back(std::move(c));
  }

  const Model model{host_of_rank,      hosts,          plan.storage_rate,
                    plan.network_rate, options.budget, probe_seconds};
  std::vector<bool> exchanged(plan.tensors.size(), plan.choice == ExchangeChoice::kAll);
  if (plan.choice == ExchangeChoice::kAuto)
    exchanged = ChooseExchanged(plan.tensors, costed, model);
  const std::vector<bool> none(plan.tensors.size(), false), all(plan.tensors.size(), true);
  plan.all_local = Estimate(costed, none, model);
  plan.all_exchanged = Estimate(costed, all, model);
  std::vector<uint32_t> readers;
  std::vector<bool> split;
  plan.chosen = Estimate(costed, exchanged, model, &readers, &split);
  if (plan.choice == ExchangeChoice::kAuto) {
    // Prefixes hold only the tensors that save reads: exchanging every tensor (exact dim-0
    // slices too, which spreads the reads by bytes) may still be faster: take it when strictly so
    // (not after a probe: those tensors were read during it).
    // Then, exchanging anything costs what the model does not count (each round's collectives,
    // the helper thread): it must beat reading everything locally by kMinExchangeGain.
    auto take = [&](bool uniform) {
      exchanged.assign(plan.tensors.size(), uniform);
      plan.chosen = Estimate(costed, exchanged, model, &readers, &split);
    };
    if (probe_seconds == 0 && plan.all_exchanged.seconds < plan.chosen.seconds * (1 - 1e-9)) {
      take(true);
    }
    if (plan.chosen.seconds > plan.all_local.seconds * (1 - kMinExchangeGain)) take(false);
  }

  // Readers and rounds of the exchanged tensors: the units of reading are the tensors read whole
  // and every piece of the tensors split among the readers (piece p read by rank p), in
  // checkpoint order, so each rank's rounds follow its reads through the files.
  std::vector<uint64_t> unit_sizes;
  std::vector<uint32_t> unit_readers;
  size_t next_reader = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (!exchanged[i]) continue;
    const TensorInfo& info = *costed[i].item.info;
    if (split[i]) {
      for (uint32_t p = 0; p < world; ++p) {
        const auto [begin, end] = PieceRange(info, p, world, costed[i].granule);
        unit_sizes.push_back(end - begin);
        unit_readers.push_back(p);
      }
    } else {
      unit_sizes.push_back(info.size);
      unit_readers.push_back(readers[next_reader++]);
    }
  }
  const std::vector<uint32_t> rounds =
      AssignRounds(unit_sizes, unit_readers, world, options.budget);
  size_t next = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (!exchanged[i]) continue;
    CooperativeTensorPlan& t = plan.tensors[i];
    t.exchanged = true;
    if (split[i]) {
      t.readers = world;
      t.piece_granule = costed[i].granule;
      t.piece_rounds.assign(rounds.begin() + next, rounds.begin() + next + world);
      t.reader = 0;
      t.round = *std::max_element(t.piece_rounds.begin(), t.piece_rounds.end());
      next += world;
    } else {
      t.reader = unit_readers[next];
      t.round = rounds[next];
      ++next;
    }
    plan.rounds = std::max(plan.rounds, t.round + 1);
  }
  std::vector<Item> items;
  items.reserve(costed.size());
  for (Costed& c : costed) items.push_back(std::move(c.item));
  plan.fingerprint = PlanFingerprint(plan, items);
  if (items_out != nullptr) *items_out = std::move(items);
  return plan;
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

// The Loader of this rank's row pieces of the tensors split among the readers (null when there
// are none): sliced, each such tensor by rows (Split(0)) over the readers, no budget of its own.
Result<std::unique_ptr<Loader>> OpenPieceLoader(std::shared_ptr<const Checkpoint> checkpoint,
                                                const LoadOptions& options,
                                                const CooperativePlan& plan,
                                                const std::vector<Item>& items, uint32_t me,
                                                uint32_t world) {
  ShardSpec pieces = ShardSpec::None();
  bool any = false;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (plan.tensors[i].exchanged && plan.tensors[i].readers > 1) {
      pieces.Set(items[i].info->name, PieceRule(plan.tensors[i].piece_granule));
      any = true;
    }
  }
  if (!any) return std::unique_ptr<Loader>();
  LoadOptions load_options = options;
  load_options.budget = 0;
  TensorParallelOptions tp;
  tp.spec = std::move(pieces);
  tp.rank = me;
  tp.world = world;
  load_options.tensor_parallel = std::move(tp);
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

Status AgreeOnStatus(Collective& collective, const Status& status, const char* what);

// One unit of the rounds' reading: an exchanged tensor its reader reads whole, or one row piece
// of a tensor split among the readers (CooperativeTensorPlan::readers).
struct Unit {
  size_t tensor = 0;  // index in plan.tensors
  uint32_t reader = 0;
  uint32_t round = 0;
  bool piece = false;
  uint64_t begin = 0, end = 0;  // piece: its bytes of the tensor
};

// Part of a piece for one rank: `length` bytes at `from` in the tensor go to `to` in the rank's
// part (its whole copy, or its slice's row-major bytes).
struct PieceSpan {
  uint64_t from = 0, to = 0, length = 0;
};

// The cancel flag of the loaders one cooperative load opens (its rounds', its local reads'): set
// by the load itself to abandon reads it no longer needs (this or another rank failed), or when
// the caller's LoadOptions::cancel is set (which the caller alone may set): a watcher thread,
// only when the caller gave a flag, polls it every 10 ms while this object lives.
class LinkedCancel {
 public:
  explicit LinkedCancel(std::shared_ptr<const std::atomic<bool>> caller) {
    if (caller == nullptr) return;
    watcher_ = std::thread([this, caller = std::move(caller)] {
      std::unique_lock<std::mutex> lk(mu_);
      while (!stop_) {
        if (caller->load(std::memory_order_relaxed)) flag_->store(true);
        cv_.wait_for(lk, std::chrono::milliseconds(10));
      }
    });
  }
  ~LinkedCancel() {
    if (!watcher_.joinable()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    watcher_.join();
  }
  LinkedCancel(const LinkedCancel&) = delete;
  LinkedCancel& operator=(const LinkedCancel&) = delete;

  const std::shared_ptr<std::atomic<bool>>& flag() const noexcept { return flag_; }
  void Set() noexcept { flag_->store(true); }

 private:
  std::shared_ptr<std::atomic<bool>> flag_ = std::make_shared<std::atomic<bool>>(false);
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread watcher_;
};

// This rank's side of the rounds: its reads, the status exchange, the tensor exchange.
class RoundRunner {
 public:
  // `loader` reads the tensors read whole, `piece_loader` (sliced by rows) this rank's pieces of
  // those split among the readers; either is null when it could not open (`open_status` says
  // why) or is not needed. `items[i]` is the item of plan.tensors[i].
  RoundRunner(const CooperativePlan& plan, const std::vector<Item>& items, Collective& collective,
              CollectiveWatchdog& watchdog, Loader* loader, Loader* piece_loader,
              Status open_status, CooperativeStats& stats, LinkedCancel& cancel)
      : cancel_(cancel),
        plan_(plan),
        watchdog_(watchdog),
        items_(items),
        collective_(collective),
        loader_(loader),
        piece_loader_(piece_loader),
        open_status_(std::move(open_status)),
        stats_(stats),
        me_(collective.rank()),
        world_(collective.size()),
        assembly_(plan.tensors.size()),
        part_ranges_(plan.tensors.size()) {
    for (size_t i = 0; i < plan_.tensors.size(); ++i) {
      const CooperativeTensorPlan& t = plan_.tensors[i];
      if (!t.exchanged) continue;
      const TensorInfo& info = *items_[i].info;
      if (t.readers <= 1) {
        units_.push_back({i, t.reader, t.round, false, 0, info.size});
        continue;
      }
      for (uint32_t p = 0; p < t.readers; ++p) {
        const auto [begin, end] = PieceRange(info, p, t.readers, t.piece_granule);
        units_.push_back({i, p, t.piece_rounds[p], true, begin, end});
      }
      // Every rank's part as ranges of the tensor, in the part's order.
      part_ranges_[i].resize(world_);
      for (uint32_t q = 0; q < world_; ++q) {
        part_ranges_[i][q] = items_[i].whole
                                 ? std::vector<std::pair<uint64_t, uint64_t>>{{0, info.size}}
                                 : SliceByteRanges(info, items_[i].slices[q]);
      }
    }
  }

  // Runs every round: this rank's result of each exchanged tensor lands in out[i] (plan order).
  // Round k + 1 is read on a helper thread while round k is exchanged. `after_first_read` runs
  // once this rank's reads of round 0 succeeded.
  Status RunAll(std::vector<Tensor>& out, const std::function<void()>& after_first_read) {
    if (plan_.rounds == 0) return Status::Ok();
    Result<std::vector<Tensor>> current = Read(0);
    if (current.ok()) after_first_read();
    for (uint32_t k = 0; k < plan_.rounds; ++k) {
      std::future<Result<std::vector<Tensor>>> next;
      if (k + 1 < plan_.rounds && current.ok()) {  // (this rank's failed read ends the load)
        next = std::async(std::launch::async, [this, k] { return Read(k + 1); });
      }
      // On an error (here or on another rank) the read ahead is cancelled, then waited for
      // (within a chunk per worker) before the loader goes away.
      struct AbandonAhead {
        std::future<Result<std::vector<Tensor>>>& next;
        LinkedCancel& cancel;
        ~AbandonAhead() {
          if (!next.valid()) return;
          cancel.Set();
          next.wait();
        }
      } abandon{next, cancel_};
      const Clock::time_point exchange_start = Clock::now();
      const std::string round =
          "round " + std::to_string(k) + " of " + std::to_string(plan_.rounds);
      TF_RETURN_IF_ERROR(Exchange(k, current, out, round));
      stats_.exchange_seconds += SecondsSince(exchange_start);
      stats_.rounds++;
      if (next.valid()) {
        current = next.get();
      }
    }
    return Status::Ok();
  }

 private:
  // This rank's units of round k, in unit order.
  std::vector<size_t> MyUnits(uint32_t k) const {
    std::vector<size_t> mine;
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].round == k && units_[u].reader == me_) mine.push_back(u);
    }
    return mine;
  }

  // Loads `names` with `loader` and adds what it read to the statistics.
  Result<std::vector<Tensor>> LoadNames(Loader* loader, std::vector<std::string> names) {
    if (names.empty()) return std::vector<Tensor>{};
    TF_ASSIGN_OR_RETURN(std::vector<Tensor> tensors,
                        loader->Load(Selection::Names(std::move(names))));
    const LoadStats ls = loader->stats();
    stats_.bytes_read += ls.bytes;
    stats_.engine = ls.engine;
    stats_.remote_requests += ls.remote_requests;
    stats_.remote_retries += ls.remote_retries;
    stats_.remote_bytes += ls.remote_bytes;
    return tensors;
  }

  // This rank's reads of round k: one tensor per unit of MyUnits(k), in that order.
  Result<std::vector<Tensor>> Read(uint32_t k) {
    if (!open_status_.ok()) return open_status_;
    const std::vector<size_t> mine = MyUnits(k);
    std::vector<std::string> whole, pieces;
    for (const size_t u : mine) {
      (units_[u].piece ? pieces : whole).push_back(items_[units_[u].tensor].info->name);
    }
    const Clock::time_point read_start = Clock::now();
    Result<std::vector<Tensor>> read_whole = LoadNames(loader_, std::move(whole));
    Result<std::vector<Tensor>> read_pieces =
        read_whole.ok() ? LoadNames(piece_loader_, std::move(pieces)) : std::vector<Tensor>{};
    stats_.read_seconds += SecondsSince(read_start);
    TF_RETURN_IF_ERROR(read_whole.status());
    TF_RETURN_IF_ERROR(read_pieces.status());
    // Both loaders return checkpoint order, as the units are.
    std::vector<Tensor> out;
    size_t next_whole = 0, next_piece = 0;
    for (const size_t u : mine) {
      const Unit& unit = units_[u];
      std::vector<Tensor>& from = unit.piece ? *read_pieces : *read_whole;
      size_t& next = unit.piece ? next_piece : next_whole;
      const std::string& name = items_[unit.tensor].info->name;
      if (next >= from.size() || from[next].name() != name ||
          from[next].size() != unit.end - unit.begin) {
        return Status(Code::kInternal, "cooperative load: the loader returned " +
                                           std::string(unit.piece ? "a row piece of " : "") + name +
                                           " out of order or of another size");
      }
      out.push_back(std::move(from[next++]));
    }
    return out;
  }

  // Bytes of tensor `i`'s part for rank q: the whole tensor (replicated) or q's slice.
  uint64_t Part(size_t i, uint32_t q) const {
    return items_[i].whole ? items_[i].info->size : items_[i].counts[q];
  }

  // Rank q's part of piece `unit`: the ranges of q's part inside the piece's bytes.
  std::vector<PieceSpan> PieceSpans(const Unit& unit, uint32_t q) const {
    std::vector<PieceSpan> spans;
    uint64_t to = 0;
    for (const auto& [offset, length] : part_ranges_[unit.tensor][q]) {
      const uint64_t begin = std::max(offset, unit.begin);
      const uint64_t end = std::min(offset + length, unit.end);
      if (begin < end) spans.push_back({begin, to + (begin - offset), end - begin});
      to += length;
    }
    return spans;
  }

  static uint64_t SpanBytes(const std::vector<PieceSpan>& spans) {
    uint64_t n = 0;
    for (const PieceSpan& s : spans) n += s.length;
    return n;
  }

  // Where this rank's part of a tensor split among the readers is assembled (allocated, and
  // handed to out[i], at its first piece).
  std::byte* Assembly(size_t i, std::vector<Tensor>& out) {
    if (assembly_[i] == nullptr) {
      const TensorInfo& info = *items_[i].info;
      const uint64_t mine = Part(i, me_);
      assembly_[i].reset(new std::byte[std::max<uint64_t>(mine, 1)]);
      const std::byte* data = assembly_[i].get();
      out[i] = Tensor(info.name, info.dtype, items_[i].local_shape, data, mine, assembly_[i]);
    }
    return assembly_[i].get();
  }

  // Exchanges round k's units in one AllToAllv: every rank sends each other rank that rank's
  // parts of what it read this round, in unit order, each padded to kPartAlign bytes, and
  // receives its parts from every reader the same way; all links are busy at once. The received
  // parts of tensors read whole stay in one buffer that the tensors co-own; parts of pieces are
  // copied into place. `loaded`: this rank's reads of the round (Read).
  // Round k's exchange of this rank's reads `current` (or its read error). Every rank agrees on
  // its outcome once its reads are in and its exchange buffers allocated: nobody waits in the
  // exchange for a rank that gave up (a failed read, a buffer it could not allocate).
  Status Exchange(uint32_t k, const Result<std::vector<Tensor>>& current, std::vector<Tensor>& out,
                  const std::string& round_name) {
    const auto agree = [&](const Status& status) {
      return watchdog_.Watch(round_name + " (every rank's reads)", [&] {
        return AgreeOnStatus(collective_, status, "reading its share");
      });
    };
    if (!current.ok()) return agree(current.status());
    const std::vector<Tensor>& loaded = *current;
    std::vector<size_t> round;  // the round's units
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].round == k) round.push_back(u);
    }
    // This rank's reads, by position in `round`; the parts of pieces per rank.
    std::vector<const Tensor*> source(round.size(), nullptr);
    std::vector<std::vector<std::vector<PieceSpan>>> spans(round.size());
    size_t next_loaded = 0;
    for (size_t j = 0; j < round.size(); ++j) {
      const Unit& unit = units_[round[j]];
      if (unit.reader == me_) {
        if (next_loaded >= loaded.size()) {
          return agree(Status(Code::kInternal, "cooperative load: round " + std::to_string(k) +
                                                   " has fewer reads than units"));
        }
        source[j] = &loaded[next_loaded++];
      }
      if (!unit.piece) continue;
      spans[j].resize(world_);
      for (uint32_t q = 0; q < world_; ++q) {
        if (unit.reader == me_ || q == me_) spans[j][q] = PieceSpans(unit, q);
      }
    }
    auto bytes = [&](size_t j, uint32_t q) {
      const Unit& unit = units_[round[j]];
      return unit.piece ? SpanBytes(spans[j][q]) : Part(unit.tensor, q);
    };
    std::vector<uint64_t> send_counts(world_, 0), recv_counts(world_, 0);
    for (size_t j = 0; j < round.size(); ++j) {
      const uint32_t reader = units_[round[j]].reader;
      if (reader == me_) {
        for (uint32_t q = 0; q < world_; ++q) {
          if (q == me_) continue;
          send_counts[q] += AlignPart(bytes(j, q));
          stats_.bytes_sent += bytes(j, q);
        }
      } else {
        recv_counts[reader] += AlignPart(bytes(j, me_));
        stats_.bytes_received += bytes(j, me_);
      }
    }
    // Pack: block q holds q's parts of this rank's reads of the round, in unit order.
    std::vector<uint64_t> cursor(world_, 0);
    uint64_t send_total = 0, recv_total = 0;
    for (uint32_t q = 0; q < world_; ++q) {
      cursor[q] = send_total;
      send_total += send_counts[q];
      recv_total += recv_counts[q];
    }
    std::shared_ptr<std::byte[]> received;
    try {
      if (pack_.size() < send_total) pack_.resize(send_total);
      received.reset(new std::byte[std::max<uint64_t>(recv_total, 1)]);
    } catch (const std::bad_alloc&) {
      return agree(Status(Code::kBudgetExceeded,
                          "cooperative load: " + round_name + ": cannot allocate the exchange's " +
                              std::to_string(send_total) + "-byte send and " +
                              std::to_string(recv_total) + "-byte receive buffers"));
    }
    TF_RETURN_IF_ERROR(agree(Status::Ok()));
    for (size_t j = 0; j < round.size(); ++j) {
      if (source[j] == nullptr) continue;
      const Unit& unit = units_[round[j]];
      const Item& item = items_[unit.tensor];
      for (uint32_t q = 0; q < world_; ++q) {
        if (q == me_) continue;
        std::byte* dst = pack_.data() + cursor[q];
        if (unit.piece) {
          for (const PieceSpan& s : spans[j][q]) {
            std::memcpy(dst, source[j]->data() + (s.from - unit.begin), s.length);
            dst += s.length;
          }
        } else if (item.whole) {
          if (item.info->size > 0) std::memcpy(dst, source[j]->data(), item.info->size);
        } else {
          CopySlice(*item.info, item.slices[q], source[j]->data(), dst);
        }
        cursor[q] += AlignPart(bytes(j, q));
      }
    }
    const std::string step =
        "round " + std::to_string(k) + " of " + std::to_string(plan_.rounds) + " (the exchange)";
    const Clock::time_point network_start = Clock::now();
    TF_RETURN_IF_ERROR(watchdog_
                           .Watch(step,
                                  [&] {
                                    return collective_.AllToAllv(
                                        {pack_.data(), send_total}, send_counts,
                                        {received.get(), recv_total}, recv_counts);
                                  })
                           .WithPrefix(step));
    stats_.network_seconds += SecondsSince(network_start);
    // Unpack: the parts from each reader follow one another in unit order.
    uint64_t offset = 0;
    for (uint32_t p = 0; p < world_; ++p) {
      cursor[p] = offset;
      offset += recv_counts[p];
    }
    // What a kept tensor would hold alive besides its bytes. A whole tensor this rank read shares
    // its loader's batch: when the batch holds other tensors (read only to be sent, or sliced)
    // it is copied out. Received tensors share the receive buffer: when more than an eighth of
    // it is parts of row pieces (copied into their assembly below, then dead), they are copied
    // out too, so the result holds little more than its own bytes.
    size_t sources = 0;
    for (size_t j = 0; j < round.size(); ++j) sources += source[j] != nullptr ? 1 : 0;
    uint64_t piece_bytes_received = 0;
    for (size_t j = 0; j < round.size(); ++j) {
      const Unit& unit = units_[round[j]];
      if (unit.piece && unit.reader != me_) piece_bytes_received += AlignPart(bytes(j, me_));
    }
    const bool copy_received = piece_bytes_received * 8 > recv_total;
    auto own_copy = [](const TensorInfo& info, const std::vector<uint64_t>& shape,
                       const std::byte* from, uint64_t n) {
      std::shared_ptr<std::byte[]> buffer(new std::byte[std::max<uint64_t>(n, 1)]);
      if (n > 0) std::memcpy(buffer.get(), from, n);
      const std::byte* data = buffer.get();
      return Tensor(info.name, info.dtype, shape, data, n, std::move(buffer));
    };
    for (size_t j = 0; j < round.size(); ++j) {
      const Unit& unit = units_[round[j]];
      const size_t i = unit.tensor;
      const Item& item = items_[i];
      const TensorInfo& info = *item.info;
      const uint64_t mine = bytes(j, me_);
      if (unit.piece) {
        std::byte* base = Assembly(i, out);
        const std::byte* from = nullptr;
        if (unit.reader != me_) {
          from = received.get() + cursor[unit.reader];
          cursor[unit.reader] += AlignPart(mine);
        }
        for (const PieceSpan& s : spans[j][me_]) {
          if (unit.reader == me_) {
            std::memcpy(base + s.to, source[j]->data() + (s.from - unit.begin), s.length);
          } else {
            std::memcpy(base + s.to, from, s.length);
            from += s.length;
          }
        }
        continue;
      }
      if (unit.reader == me_) {
        if (item.whole) {
          out[i] = sources == 1 ? *source[j]  // the batch holds this tensor alone
                                : own_copy(info, info.shape, source[j]->data(), info.size);
          continue;
        }
        std::shared_ptr<std::byte[]> buffer(new std::byte[std::max<uint64_t>(mine, 1)]);
        CopySlice(info, item.slices[me_], source[j]->data(), buffer.get());
        const std::byte* data = buffer.get();
        out[i] = Tensor(info.name, info.dtype, item.local_shape, data, mine, std::move(buffer));
        continue;
      }
      const std::byte* data = received.get() + cursor[unit.reader];
      cursor[unit.reader] += AlignPart(mine);
      out[i] = copy_received
                   ? own_copy(info, item.local_shape, data, mine)
                   : Tensor(info.name, info.dtype, item.local_shape, data, mine, received);
    }
    return Status::Ok();
  }

  // Parts start at multiples of 64 bytes in the exchange buffers (aligned tensor data).
  static constexpr uint64_t kPartAlign = 64;
  static uint64_t AlignPart(uint64_t n) { return (n + kPartAlign - 1) / kPartAlign * kPartAlign; }

  LinkedCancel& cancel_;  // the loaders' flag: set to abandon a round read ahead
  const CooperativePlan& plan_;
  CollectiveWatchdog& watchdog_;
  const std::vector<Item>& items_;
  Collective& collective_;
  Loader* loader_;
  Loader* piece_loader_;
  const Status open_status_;
  CooperativeStats& stats_;
  const uint32_t me_;
  const uint32_t world_;
  std::vector<Unit> units_;  // in plan order, pieces by reader
  // Tensors split among the readers: this rank's part, assembled piece by piece.
  std::vector<std::shared_ptr<std::byte[]>> assembly_;
  // Tensors split among the readers: every rank's part as ranges of the tensor.
  std::vector<std::vector<std::vector<std::pair<uint64_t, uint64_t>>>> part_ranges_;
  std::vector<std::byte> pack_;  // the outgoing parts of a round, reused across rounds
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

uint64_t CooperativeOptionsDigest(const LoadOptions& options) noexcept {
  // The values the plan uses (a default given explicitly is the default), but for network_rate,
  // whose 0 means "measured by the probe".
  Fingerprint f;
  f.Add(static_cast<uint64_t>(options.cooperative.exchange));
  f.Add(options.cooperative.storage_rate != 0 ? options.cooperative.storage_rate
                                              : kDefaultStorageRate);
  f.Add(options.cooperative.network_rate);
  f.Add(options.cooperative.probe_bytes);
  f.Add(options.budget);
  f.Add(options.tensor_parallel ? options.tensor_parallel->max_gap
                                : TensorParallelOptions{}.max_gap);
  f.Add(static_cast<uint64_t>(options.verify));  // the pieces' granule, the records compared
  return f.value();
}

namespace {

// One exchange of every rank's planning outcome: this rank's error; or, when another rank failed
// or planned something else (another checkpoint, selection, shard rules or cooperative options),
// an error naming it, on every rank, instead of a wait in the next collective until the timeout,
// or, when the byte counts happen to agree, another rank's bytes taken for this rank's.
Status AgreeOnPlan(Collective& collective, const Result<uint64_t>& fingerprint, const char* what) {
  constexpr uint64_t kFailed = uint64_t{1} << 63;
  const uint64_t mine = fingerprint.ok()
                            ? *fingerprint & ~kFailed
                            : kFailed | static_cast<uint64_t>(fingerprint.status().code());
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, collective.AllGather(mine));
  if (!fingerprint.ok()) return fingerprint.status();
  for (uint32_t q = 0; q < all.size(); ++q) {
    if ((all[q] & kFailed) != 0) {
      return Status(Code::kIoError,
                    "cooperative load: rank " + std::to_string(q) + " failed " + what + " (" +
                        std::string(CodeName(static_cast<Code>(all[q] & ~kFailed))) +
                        "); see that rank's error");
    }
  }
  for (uint32_t q = 0; q < all.size(); ++q) {
    if (all[q] != mine) {
      return Status(Code::kInvalidArgument,
                    "cooperative load: rank " + std::to_string(q) + " and rank " +
                        std::to_string(collective.rank()) + " disagree on " + what +
                        ": every rank needs the same checkpoint (the same bytes, where checksum "
                        "records, a hub commit or an ETag tell), selection, shard rules and "
                        "cooperative options");
    }
  }
  return Status::Ok();
}

Status AgreeOnStatus(Collective& collective, const Status& status, const char* what) {
  TF_ASSIGN_OR_RETURN(
      const std::vector<uint64_t> codes,
      collective.AllGather(status.ok() ? 0 : 1 + static_cast<uint64_t>(status.code())));
  if (!status.ok()) return status;
  for (uint32_t q = 0; q < codes.size(); ++q) {
    if (codes[q] != 0) {
      return Status(Code::kIoError, "cooperative load: rank " + std::to_string(q) + " failed " +
                                        what + " (" +
                                        std::string(CodeName(static_cast<Code>(codes[q] - 1))) +
                                        "); see that rank's error");
    }
  }
  return Status::Ok();
}

// The local tensors' reads: this rank's part of each (a sliced Loader), and what they cost.
struct LocalReads {
  std::vector<Tensor> tensors;  // in Loader::Load's order
  uint64_t bytes_read = 0;
  Clock::time_point started, finished;
  std::string engine;
  uint64_t remote_requests = 0, remote_retries = 0, remote_bytes = 0;
};

Result<LocalReads> ReadLocal(std::shared_ptr<const Checkpoint> checkpoint,
                             const LoadOptions& options, const ShardSpec& spec, uint32_t me,
                             uint32_t world, std::vector<std::string> names) {
  const Clock::time_point start = Clock::now();
  LoadOptions o = options;
  TensorParallelOptions tp = options.tensor_parallel.value_or(TensorParallelOptions{});
  tp.spec = spec;
  tp.rank = me;
  tp.world = world;
  o.tensor_parallel = std::move(tp);
  o.budget = 0;  // the result is held whole anyway
  TF_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::Open(std::move(checkpoint), o));
  LocalReads r;
  TF_ASSIGN_OR_RETURN(r.tensors, loader->Load(Selection::Names(std::move(names))));
  const LoadStats ls = loader->stats();
  r.bytes_read = ls.bytes_read;
  r.engine = ls.engine;
  r.remote_requests = ls.remote_requests;
  r.remote_retries = ls.remote_retries;
  r.remote_bytes = ls.remote_bytes;
  r.started = start;
  r.finished = Clock::now();
  return r;
}

// A ReadLocal on a helper thread; an empty list reads nothing (and starts no thread). One that is
// abandoned (destroyed before Get, on an error path) is cancelled through the load's
// LinkedCancel, so that the error reaches the caller within a chunk per worker instead of after
// every local read.
class LocalReadTask {
 public:
  explicit LocalReadTask(LinkedCancel& cancel) : cancel_(cancel) {}
  LocalReadTask(const LocalReadTask&) = delete;
  LocalReadTask& operator=(const LocalReadTask&) = delete;
  ~LocalReadTask() {
    if (!future_.valid()) return;
    cancel_.Set();
    future_.wait();
  }

  void Start(std::shared_ptr<const Checkpoint> checkpoint, const LoadOptions& options,
             const ShardSpec& spec, uint32_t me, uint32_t world, std::vector<std::string> names) {
    if (names.empty()) return;
    LoadOptions o = options;
    o.cancel = cancel_.flag();
    future_ = std::async(std::launch::async, [=, names = std::move(names)]() mutable {
      return ReadLocal(std::move(checkpoint), o, spec, me, world, std::move(names));
    });
  }
  // What it read (nothing when it did not start). Waits for it.
  Result<LocalReads> Get() { return future_.valid() ? future_.get() : LocalReads{}; }

 private:
  LinkedCancel& cancel_;
  std::future<Result<LocalReads>> future_;
};

}  // namespace

Result<std::vector<uint32_t>> HostsOfRanks(Collective& collective) {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  // FNV-1a of the host name: equal names, equal values.
  uint64_t hash = 1469598103934665603ull;
  for (const char* p = name; *p != '\0'; ++p) {
    hash = (hash ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  }
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, collective.AllGather(hash));
  std::vector<uint32_t> hosts(all.size());
  std::vector<uint64_t> seen;
  for (size_t r = 0; r < all.size(); ++r) {
    auto it = std::find(seen.begin(), seen.end(), all[r]);
    hosts[r] = static_cast<uint32_t>(it - seen.begin());
    if (it == seen.end()) seen.push_back(all[r]);
  }
  return hosts;
}

NetworkProbe::NetworkProbe(std::span<const uint32_t> host_of_rank, uint64_t bytes)
    : host_of_rank_(host_of_rank.begin(), host_of_rank.end()), block_(host_of_rank.size(), 0) {
  const size_t world = host_of_rank_.size();
  for (size_t p = 0; p < world; ++p) {
    uint64_t remote = 0;
    for (size_t q = 0; q < world; ++q) remote += host_of_rank_[q] != host_of_rank_[p] ? 1 : 0;
    block_[p] = remote == 0 ? 0 : std::max<uint64_t>(1, bytes / remote);
    several_hosts_ = several_hosts_ || remote > 0;
  }
}

std::vector<uint64_t> NetworkProbe::SendCounts(uint32_t rank, bool warmup) const {
  std::vector<uint64_t> out(host_of_rank_.size(), 0);
  for (size_t q = 0; q < out.size() && rank < out.size(); ++q) {
    if (host_of_rank_[q] != host_of_rank_[rank]) out[q] = warmup ? 1 : block_[rank];
  }
  return out;
}

std::vector<uint64_t> NetworkProbe::RecvCounts(uint32_t rank, bool warmup) const {
  std::vector<uint64_t> out(host_of_rank_.size(), 0);
  for (size_t p = 0; p < out.size() && rank < out.size(); ++p) {
    if (host_of_rank_[p] != host_of_rank_[rank]) out[p] = warmup ? 1 : block_[p];
  }
  return out;
}

std::map<uint32_t, uint64_t> NetworkProbe::Received() const {
  std::map<uint32_t, uint64_t> received;
  for (size_t q = 0; q < host_of_rank_.size(); ++q) {
    for (size_t p = 0; p < host_of_rank_.size(); ++p) {
      if (host_of_rank_[p] != host_of_rank_[q]) received[host_of_rank_[q]] += block_[p];
    }
  }
  return received;
}

uint64_t NetworkProbe::Rate(uint64_t nanos) const {
  if (!several_hosts_) return 0;
  double rate = std::numeric_limits<double>::max();
  for (const auto& [host, got] : Received()) {
    rate = std::min(
        rate, static_cast<double>(got) * 1e9 / static_cast<double>(std::max<uint64_t>(1, nanos)));
  }
  return std::max<uint64_t>(1, static_cast<uint64_t>(std::min(rate, 1.8e19)));
}

uint64_t NetworkProbe::FirstBytes(uint64_t limit) {
  return std::min<uint64_t>(limit, 64u << 10);
}

uint64_t NetworkProbe::NextBytes(uint64_t bytes, uint64_t nanos, uint64_t limit) {
  constexpr uint64_t kLongEnoughNanos = 100'000'000;  // 100 ms: latency is a small part
  if (nanos >= kLongEnoughNanos || bytes >= limit) return 0;
  // Sized to last about 1.5 times the threshold at this round's rate, and at most four times
  // larger (a short round is mostly latency, a poor guide): fourfold steps overshot, a round of
  // 85 ms followed by one of 420 ms on the rehearsal's 50 Mbit/s links.
  const double factor = std::min(4.0, 1.5 * static_cast<double>(kLongEnoughNanos) /
                                          static_cast<double>(std::max<uint64_t>(1, nanos)));
  const auto next = static_cast<uint64_t>(static_cast<double>(bytes) * factor);
  return std::min<uint64_t>(limit, std::max<uint64_t>(bytes + 1, next));
}

Result<NetworkMeasurement> MeasureNetworkRate(Collective& collective,
                                              std::span<const uint32_t> host_of_rank,
                                              uint64_t bytes) {
  const uint32_t world = collective.size(), me = collective.rank();
  if (host_of_rank.size() != world || me >= world) {
    return Status(Code::kInvalidArgument, "network probe: host_of_rank has " +
                                              std::to_string(host_of_rank.size()) +
                                              " entries for a group of " + std::to_string(world));
  }
  if (!NetworkProbe(host_of_rank, bytes).several_hosts()) return NetworkMeasurement{};
  const Clock::time_point probe_start = Clock::now();
  auto exchange = [&](const NetworkProbe& probe, bool warmup) {
    const std::vector<uint64_t> send = probe.SendCounts(me, warmup);
    const std::vector<uint64_t> recv = probe.RecvCounts(me, warmup);
    std::vector<std::byte> out(std::accumulate(send.begin(), send.end(), uint64_t{0}),
                               std::byte{0x5a});
    std::vector<std::byte> in(std::accumulate(recv.begin(), recv.end(), uint64_t{0}));
    return collective.AllToAllv(out, send, in, recv);
  };
  TF_RETURN_IF_ERROR(exchange(NetworkProbe(host_of_rank, 1), /*warmup=*/true));
  // Rounds of growing size until one lasts long enough (every rank takes the same decision, from
  // the slowest rank's time).
  uint64_t rate = 0;
  for (uint64_t size = NetworkProbe::FirstBytes(bytes); size != 0;) {
    const NetworkProbe probe(host_of_rank, size);
    TF_RETURN_IF_ERROR(collective.Barrier());
    const Clock::time_point start = Clock::now();
    TF_RETURN_IF_ERROR(exchange(probe, /*warmup=*/false));
    const uint64_t nanos = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
    TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, collective.AllGather(nanos));
    const uint64_t slowest = *std::max_element(all.begin(), all.end());
    // The last round's whole time, its fixed cost (latency, the barrier's skew) included: a
    // slope between rounds, which leaves that out, measured too noisy on a loaded machine
    // (docs/benchmarks.md); an underestimate errs toward reading locally.
    rate = probe.Rate(slowest);
    size = NetworkProbe::NextBytes(size, slowest, bytes);
  }
  // The probe's time, the slowest rank's: the plan's clock starts after it on every rank.
  const auto elapsed =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - probe_start);
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> all,
                      collective.AllGather(static_cast<uint64_t>(elapsed.count())));
  const uint64_t slowest = std::max<uint64_t>(1, *std::max_element(all.begin(), all.end()));
  return NetworkMeasurement{rate, static_cast<double>(slowest) / 1e9};
}

uint64_t NetworkProbeBytes(const LoadOptions& options, std::span<const uint32_t> host_of_rank) {
  const CooperativeOptions& c = options.cooperative;
  const bool several_hosts = std::any_of(host_of_rank.begin(), host_of_rank.end(),
                                         [&](uint32_t h) { return h != host_of_rank.front(); });
  return c.exchange == ExchangeChoice::kAuto && c.network_rate == 0 && several_hosts ? c.probe_bytes
                                                                                     : 0;
}

Result<LoadOptions> WithMeasuredNetworkRate(Collective& collective,
                                            std::span<const uint32_t> host_of_rank,
                                            const LoadOptions& options,
                                            NetworkMeasurement* measured) {
  if (measured != nullptr) *measured = NetworkMeasurement{};
  const uint64_t bytes = NetworkProbeBytes(options, host_of_rank);
  if (bytes == 0) return options;
  TF_ASSIGN_OR_RETURN(const NetworkMeasurement got,
                      MeasureNetworkRate(collective, host_of_rank, bytes));
  LoadOptions out = options;
  out.cooperative.network_rate = got.rate;
  if (measured != nullptr) *measured = got;
  return out;
}

Result<CooperativePlan> PlanCooperative(const Checkpoint& checkpoint, const Selection& selection,
                                        const ShardSpec& spec, const LoadOptions& options,
                                        std::span<const uint32_t> host_of_rank,
                                        double probe_seconds) {
  if (host_of_rank.empty()) {
    return Status(Code::kInvalidArgument, "cooperative plan: no ranks (host_of_rank is empty)");
  }
  const uint32_t world = static_cast<uint32_t>(host_of_rank.size());
  TF_ASSIGN_OR_RETURN(const Description described,
                      DescribeForRank(checkpoint, selection, spec, 0, world));
  return MakePlan(checkpoint, described.read, spec, options, host_of_rank, 0, nullptr,
                  probe_seconds);
}

uint64_t CooperativePlan::ExchangedBytesReadBy(const Checkpoint& checkpoint, uint32_t rank) const {
  uint64_t bytes = 0;
  for (const CooperativeTensorPlan& t : tensors) {
    const TensorInfo& info = checkpoint.tensors()[t.tensor];
    if (t.exchanged && t.readers > 1 && rank < t.readers) {
      const auto [begin, end] = PieceRange(info, rank, t.readers, t.piece_granule);
      bytes += end - begin;
    } else if (t.exchanged && t.readers <= 1 && t.reader == rank) {
      bytes += info.size;
    }
  }
  return bytes;
}

std::string CooperativePlan::ToString(const Checkpoint& checkpoint) const {
  auto rate = [](uint64_t r) { return FormatBytes(r) + "/s"; };
  auto estimate = [](const Estimate& e) {
    char line[160];
    std::snprintf(line, sizeof(line), "%.3g s (busiest host reads %s, receives %s)", e.seconds,
                  FormatBytes(e.read).c_str(), FormatBytes(e.network).c_str());
    return std::string(line);
  };
  uint64_t exchanged = 0;
  for (const CooperativeTensorPlan& t : tensors) exchanged += t.exchanged ? 1 : 0;
  std::string out = "cooperative plan: " + std::to_string(world) + " ranks on " +
                    std::to_string(hosts) + " host" + (hosts == 1 ? "" : "s") + ", exchange " +
                    std::string(ExchangeChoiceName(choice)) + ", storage " + rate(storage_rate) +
                    " and network " + rate(network_rate) + " per host\n";
  if (probe_seconds > 0) {
    char line[160];
    std::snprintf(line, sizeof(line),
                  "  planned after a network probe of %.3g s (the tensors that save no reads are "
                  "read during it)\n",
                  probe_seconds);
    out += line;
  }
  out += "  " + std::to_string(exchanged) + " of " + std::to_string(tensors.size()) +
         " tensors exchanged in " + std::to_string(rounds) + " round" + (rounds == 1 ? "" : "s") +
         ", " + std::to_string(tensors.size() - exchanged) + " read by each rank for itself\n";
  out += "  estimate, chosen:        " + estimate(chosen) + "\n";
  out += "  estimate, all local:     " + estimate(all_local) + "\n";
  out += "  estimate, all exchanged: " + estimate(all_exchanged) + "\n";
  out += "  per tensor (bytes per host: local read | exchanged read + received):\n";
  for (const CooperativeTensorPlan& t : tensors) {
    out += "    " + checkpoint.tensors()[t.tensor].name + ": ";
    if (t.exchanged && t.readers > 1) {
      const auto [first, last] = std::minmax_element(t.piece_rounds.begin(), t.piece_rounds.end());
      out += "exchanged (split among " + std::to_string(t.readers) + " readers by rows, round" +
             (*first == *last ? " " + std::to_string(*first)
                              : "s " + std::to_string(*first) + "-" + std::to_string(*last)) +
             ")";
    } else if (t.exchanged) {
      out += "exchanged (reader " + std::to_string(t.reader) + ", round " +
             std::to_string(t.round) + ")";
    } else {
      out += "local";
    }
    out += ", " + FormatBytes(t.local_read) + " | " + FormatBytes(t.exchange_read) + " + " +
           FormatBytes(t.exchange_network) + "\n";
  }
  return out;
}

Result<std::vector<Tensor>> LoadCooperative(std::shared_ptr<const Checkpoint> checkpoint,
                                            const Selection& selection, const ShardSpec& spec,
                                            const LoadOptions& options, Collective& collective,
                                            CooperativeStats* stats) {
  const Clock::time_point start = Clock::now();
  CooperativeStats local;
  if (checkpoint == nullptr)
    return Status(Code::kInvalidArgument, "LoadCooperative: no checkpoint");
  TF_RETURN_IF_ERROR(CheckHostTarget(options));
  const uint32_t me = collective.rank(), world = collective.size();
  CollectiveWatchdog watchdog(collective, options.cooperative.timeout_ms, "cooperative load");
  TF_ASSIGN_OR_RETURN(const std::vector<uint32_t> hosts,
                      watchdog.Watch("the start (learning every rank's host)",
                                     [&] { return HostsOfRanks(collective); }));
  // Every rank's slices and per-tensor figures, before any I/O or other collective: the ranks
  // agree on them (and on the options the probe and the plan depend on), or every rank fails.
  Description described;
  CooperativePlan figures;
  const Result<uint64_t> inputs = [&]() -> Result<uint64_t> {
    TF_ASSIGN_OR_RETURN(described, DescribeForRank(*checkpoint, selection, spec, me, world));
    LoadOptions o = options;
    o.cooperative.exchange = ExchangeChoice::kNone;  // only the per-tensor figures are needed
    TF_ASSIGN_OR_RETURN(figures,
                        MakePlan(*checkpoint, described.read, spec, o, hosts, me, nullptr));
    Fingerprint f;
    f.Add(figures.fingerprint);
    f.Add(CooperativeOptionsDigest(options));
    return f.value();
  }();
  TF_RETURN_IF_ERROR(watchdog.Watch("the plan's inputs", [&] {
    return AgreeOnPlan(collective, inputs, "planning (slices and options)");
  }));
  const std::vector<TensorInfo>& infos = checkpoint->tensors();
  // With a network probe ahead (auto, no rate given, several hosts), the tensors that no
  // exchange saves reads of (exact dim-0 slices) are local whatever it measures: they are read
  // while it runs, so the storage works while the network is measured.
  // The loaders below read under this flag: set when this load returns early (an error here or
  // on another rank), so that reads in flight (a round read ahead, the local reads) stop within
  // a chunk per worker instead of running to their end; and when the caller's flag is.
  LinkedCancel cancel(options.cancel);
  LocalReadTask preread(cancel);
  std::unordered_set<std::string_view> preread_names;
  if (NetworkProbeBytes(options, hosts) > 0) {
    std::vector<std::string> names;
    for (const CooperativeTensorPlan& t : figures.tensors) {
      if (!t.SavesReads()) {
        names.push_back(infos[t.tensor].name);
        preread_names.insert(infos[t.tensor].name);
      }
    }
    preread.Start(checkpoint, options, spec, me, world, std::move(names));
  }
  // The network rate the plan assumes, measured through this group's collective when it may
  // decide the plan.
  NetworkMeasurement measured;
  TF_ASSIGN_OR_RETURN(const LoadOptions planned, watchdog.Watch("the network probe", [&] {
    return WithMeasuredNetworkRate(collective, hosts, options, &measured);
  }));
  local.measured_network_rate = measured.rate;
  local.probe_seconds = measured.seconds;
  std::vector<Item> items;
  CooperativePlan plan;
  const Result<uint64_t> planned_fingerprint = [&]() -> Result<uint64_t> {
    TF_ASSIGN_OR_RETURN(plan, MakePlan(*checkpoint, described.read, spec, planned, hosts, me,
                                       &items, measured.seconds));
    return plan.fingerprint;
  }();
  TF_RETURN_IF_ERROR(watchdog.Watch(
      "the plan", [&] { return AgreeOnPlan(collective, planned_fingerprint, "the plan"); }));
  local.hosts = plan.hosts;

  // The other local tensors, read on a helper thread once this rank's reads of the first round
  // are done (the first exchange waits for those), beside the rounds.
  std::vector<std::string> local_names;
  size_t preread_planned = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (plan.tensors[i].exchanged) continue;
    if (preread_names.count(items[i].info->name) != 0) {
      ++preread_planned;
    } else {
      local_names.push_back(items[i].info->name);
    }
  }
  if (preread_planned != preread_names.size()) {
    return Status(Code::kInternal,
                  "cooperative load: the plan exchanges a tensor read during the network probe");
  }
  local.local_tensors = local_names.size() + preread_planned;
  local.exchanged_tensors = plan.tensors.size() - local.local_tensors;
  LocalReadTask rest(cancel);
  auto start_rest = [&] {
    rest.Start(checkpoint, options, spec, me, world, std::move(local_names));
  };

  std::vector<Tensor> exchanged(plan.tensors.size());
  Status rounds_status = Status::Ok();
  if (plan.rounds > 0) {
    // A rank whose loader cannot open still takes part in the first status exchange, so the
    // others learn of it instead of waiting for it in a collective.
    LoadOptions round_options = options;
    round_options.cancel = cancel.flag();
    Result<std::unique_ptr<Loader>> opened = OpenRoundLoader(checkpoint, round_options);
    Status open_status = opened.status();
    std::unique_ptr<Loader> loader = opened.ok() ? std::move(opened).value() : nullptr;
    std::unique_ptr<Loader> piece_loader;
    if (open_status.ok()) {
      Result<std::unique_ptr<Loader>> pieces =
          OpenPieceLoader(checkpoint, round_options, plan, items, me, world);
      open_status = pieces.status();
      if (pieces.ok()) piece_loader = std::move(pieces).value();
    }
    RoundRunner rounds(plan, items, collective, watchdog, loader.get(), piece_loader.get(),
                       open_status, local, cancel);
    rounds_status = rounds.RunAll(exchanged, start_rest);
  } else {
    start_rest();
  }
  // A failed round returns at once: the local reads still running are cancelled (~LocalReadTask).
  TF_RETURN_IF_ERROR(rounds_status);
  Result<LocalReads> first = preread.Get();
  Result<LocalReads> second = rest.Get();
  const Status reads_status = !first.ok() ? first.status() : second.status();
  TF_RETURN_IF_ERROR(watchdog.Watch("the end (every rank's local reads)", [&] {
    return AgreeOnStatus(collective, reads_status, "reading its local tensors");
  }));
  std::unordered_map<std::string_view, size_t> position;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (!plan.tensors[i].exchanged) position.emplace(items[i].info->name, i);
  }
  std::optional<Clock::time_point> local_start, local_end;
  for (LocalReads* reads : {&*first, &*second}) {
    if (reads->started == Clock::time_point{}) continue;  // nothing to read
    local_start = local_start ? std::min(*local_start, reads->started) : reads->started;
    local_end = local_end ? std::max(*local_end, reads->finished) : reads->finished;
    local.bytes_read += reads->bytes_read;
    if (local.engine.empty()) local.engine = reads->engine;
    local.remote_requests += reads->remote_requests;
    local.remote_retries += reads->remote_retries;
    local.remote_bytes += reads->remote_bytes;
    for (Tensor& t : reads->tensors) {
      auto it = position.find(t.name());
      if (it == position.end()) {
        return Status(Code::kInternal,
                      "cooperative load: the local reads returned an unplanned tensor " + t.name());
      }
      exchanged[it->second] = std::move(t);
    }
  }
  if (local_start)
    local.local_seconds = std::chrono::duration<double>(*local_end - *local_start).count();

  std::vector<Tensor> out = Deliver(described, checkpoint->tensors().size(), exchanged);
  std::unordered_set<const void*> counted;  // a tied alias shares its target's bytes: once
  for (const Tensor& t : out) {
    if (t.size() == 0 || counted.insert(t.data()).second) local.bytes += t.size();
  }
  local.tensors = out.size();
  local.seconds = SecondsSince(start);
  if (stats != nullptr) *stats = std::move(local);
  return out;
}

}  // namespace tensorferry

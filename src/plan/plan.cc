// MakePlan: from a set of tensors to batches, destination layouts and read tasks; no I/O.
//
// Three passes, each simple enough to check by eye:
//   1. validate and sort the selection (by group, then (file, offset));
//   2. cut the sorted list greedily into batches that fit the budget;
//   3. lay each batch out (coalesce file-adjacent tensors into ranges, align each range in the
//      buffer) and cut its ranges into tasks interleaved across files.
#include "tensorferry/plan.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/size.h"
#include "util/decimal.h"
#include "util/macros.h"

namespace tensorferry {

namespace {

// REQUIRES: alignment is a power of two. Saturates instead of wrapping: a buffer that large could
// never be allocated anyway, and saturation keeps the layout monotonic.
uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  const uint64_t mask = alignment - 1;
  if (value > std::numeric_limits<uint64_t>::max() - mask)
    return std::numeric_limits<uint64_t>::max();
  return (value + mask) & ~mask;
}

bool IsPowerOfTwo(uint64_t v) {
  return v != 0 && (v & (v - 1)) == 0;
}

// The sort key of a selected tensor. `group` is empty for every tensor with DeliveryOrder::kFile;
// with kLayer it is empty for tensors without a layer and the layer otherwise, so the no-layer
// group comes first (an empty optional orders before every value). The tensor index breaks ties
// (zero-size tensors may share an offset with a neighbour) so the plan is deterministic whatever
// order the caller listed the tensors in.
struct Item {
  std::optional<uint64_t> group;
  uint32_t file = 0;
  uint64_t offset = 0;
  uint32_t tensor = 0;
  uint64_t size = 0;    // bytes delivered (the slice's when sliced)
  uint64_t cost = 0;    // bytes held in the buffer: size, or the covering reads' bytes if larger
  int64_t layout = -1;  // index into the sliced layouts; -1: the whole tensor, one read

  friend bool operator<(const Item& a, const Item& b) {
    if (a.group != b.group) return a.group < b.group;
    if (a.file != b.file) return a.file < b.file;
    if (a.offset != b.offset) return a.offset < b.offset;
    return a.tensor < b.tensor;
  }
};

// A coalesced run of file bytes and where it lands in the batch buffer. A sealed range (a
// segment of a sliced tensor) is never extended by a later tensor.
struct Range {
  uint32_t file = 0;
  uint64_t file_offset = 0;
  uint64_t length = 0;
  uint64_t buffer_offset = 0;
  bool sealed = false;
};

// How one sliced tensor is read: its slice, and the slice's byte ranges (absolute file offsets)
// grouped into segments, each one read covering its ranges and the gaps between them.
struct Segment {
  uint64_t file_offset = 0;
  uint64_t length = 0;
  size_t first_piece = 0, end_piece = 0;  // [first, end) into pieces
};
struct ShardLayout {
  TensorSlice slice;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // (absolute file offset, length)
  std::vector<Segment> segments;
  uint64_t read_bytes = 0;
};

// Segments of a later range of a sliced tensor are aligned for O_DIRECT (congruent with the file
// offset) only when at least this long: aligning every small strided piece would waste up to
// io_alignment bytes each, for reads too small to gain from O_DIRECT anyway.
constexpr uint64_t kAlignSegmentsFrom = 256u << 10;

// A slice of more pieces than this (rows of a few bytes: a [4M, 2] tensor split on dim 1) covers
// gaps under kManyPiecesGap whatever max_gap says: exact strides would make a range, a read task
// and a request per row (gigabytes of plan, millions of tiny reads for a tensor of megabytes).
constexpr size_t kManyPieces = 65536;
constexpr uint64_t kManyPiecesGap = 4096;

ShardLayout MakeLayout(const TensorInfo& t, TensorSlice slice, uint64_t max_gap) {
  ShardLayout l;
  l.pieces = SliceByteRanges(t, slice);
  for (auto& piece : l.pieces) piece.first += t.offset;
  if (l.pieces.size() > kManyPieces) max_gap = std::max(max_gap, kManyPiecesGap);
  l.slice = std::move(slice);
  for (size_t i = 0; i < l.pieces.size(); ++i) {
    const auto [off, len] = l.pieces[i];
    if (!l.segments.empty()) {
      Segment& last = l.segments.back();
      const uint64_t end = last.file_offset + last.length;
      if (off - end <= max_gap) {
        last.length = off + len - last.file_offset;
        last.end_piece = i + 1;
        continue;
      }
    }
    l.segments.push_back({off, len, i, i + 1});
  }
  for (const Segment& seg : l.segments) l.read_bytes += seg.length;
  return l;
}

// Where a new range reading from `file_offset` starts after buffer end `pos`: aligned, and
// congruent with the file offset modulo io_alignment (see PlanOptions::io_alignment).
uint64_t PlaceRange(uint64_t pos, uint64_t file_offset, const PlanOptions& options) {
  uint64_t at = AlignUp(pos, options.alignment);
  if (options.io_alignment != 0) {
    const uint64_t mask = options.io_alignment - 1;
    at = (pos & ~mask) + (file_offset & mask);
    if (at < pos) at += options.io_alignment;
  }
  return at;
}

// Adds a tensor read in one contiguous range (whole tensor, or a one-range slice) to `batch`.
void AddContiguousTensor(const Item& item, const ShardLayout* layout,
                         std::optional<TensorSlice> slice, const PlanOptions& options,
                         std::vector<Range>& ranges, uint64_t& pos, PlanBatch& batch) {
  const uint64_t offset = layout ? layout->pieces[0].first : item.offset;
  const uint64_t size = layout ? layout->pieces[0].second : item.size;
  const bool extends = !ranges.empty() && !ranges.back().sealed &&
                       ranges.back().file == item.file &&
                       ranges.back().file_offset + ranges.back().length == offset;
  if (!extends) ranges.push_back({item.file, offset, 0, PlaceRange(pos, offset, options)});
  Range& r = ranges.back();
  // Inside a range, a tensor keeps its distance from the range's first byte in the file, so
  // one read fills all of them.
  batch.tensors.push_back(
      {item.tensor, r.buffer_offset + (offset - r.file_offset), std::move(slice)});
  r.length = offset + size - r.file_offset;
  batch.read_bytes += size;
  pos = r.buffer_offset + r.length;
}

// Appends `mv` (one move) to `moves`, extending the last entry when `mv` continues its arithmetic
// progression: a strided slice's rows make one entry, whatever their number.
void AppendMove(std::vector<BufferMove>& moves, const BufferMove& mv) {
  if (!moves.empty()) {
    BufferMove& last = moves.back();
    if (last.length == mv.length && mv.from > last.from && mv.to > last.to) {
      if (last.count == 1) {
        last.from_stride = mv.from - last.from;
        last.to_stride = mv.to - last.to;
        last.count = 2;
        return;
      }
      if (mv.from == last.from + last.count * last.from_stride &&
          mv.to == last.to + last.count * last.to_stride) {
        ++last.count;
        return;
      }
    }
  }
  moves.push_back(mv);
}

// The moves `moves` describes (an entry's `count` each).
uint64_t MoveCount(const std::vector<BufferMove>& moves) {
  uint64_t n = 0;
  for (const BufferMove& mv : moves) n += mv.count;
  return n;
}

// Adds a tensor read in several pieces (sealed segment ranges plus packing moves) to `batch`.
void AddPiecedTensor(const Item& item, const ShardLayout& layout, std::optional<TensorSlice> slice,
                     const PlanOptions& options, std::vector<Range>& ranges, uint64_t& pos,
                     PlanBatch& batch) {
  // Each segment is read as a sealed range, segments one after the other, so every piece lands
  // at or after its packed position (the tensor's start plus the bytes of the pieces before it);
  // moves then pack them, in order, each moving left over bytes already consumed.
  uint64_t dest = 0, packed = 0;
  for (size_t k = 0; k < layout.segments.size(); ++k) {
    const Segment& seg = layout.segments[k];
    const uint64_t at = k == 0 || seg.length >= kAlignSegmentsFrom
                            ? PlaceRange(pos, seg.file_offset, options)
                            : pos;
    if (k == 0) dest = at;
    ranges.push_back({item.file, seg.file_offset, seg.length, at, /*sealed=*/true});
    for (size_t i = seg.first_piece; i < seg.end_piece; ++i) {
      const auto [off, len] = layout.pieces[i];
      const uint64_t from = at + (off - seg.file_offset), to = dest + packed;
      if (from != to) AppendMove(batch.moves, {from, to, len});
      packed += len;
    }
    batch.read_bytes += seg.length;
    pos = at + seg.length;
  }
  batch.tensors.push_back({item.tensor, dest, std::move(slice)});
}

// Cuts ranges into read tasks and interleaves them round-robin over files into `batch.tasks`.
void CutRangesIntoTasks(const std::vector<Range>& ranges, const PlanOptions& options,
                        PlanBatch& batch) {
  // One queue per file (ranges of a file are already in offset order).
  std::map<uint32_t, std::vector<ReadTask>> per_file;
  for (const Range& r : ranges) {
    std::vector<ReadTask>& queue = per_file[r.file];
    for (uint64_t done = 0; done < r.length;) {
      uint64_t n = std::min(options.chunk_size, r.length - done);
      if (options.io_alignment != 0 && n < r.length - done) {
        // End tasks on io_alignment boundaries of the file, so only the range's own head and
        // tail are unaligned for direct I/O (not every chunk's).
        const uint64_t end = (r.file_offset + done + n) & ~(options.io_alignment - 1);
        if (end > r.file_offset + done) n = end - (r.file_offset + done);
      }
      queue.push_back({r.file, r.file_offset + done, n, r.buffer_offset + done});
      done += n;
    }
  }
  // Round-robin over files: workers taking tasks in order spread across files, so one huge file
  // is read in parallel with the others rather than after them, and many small files overlap.
  size_t total = 0;
  for (const auto& [file, queue] : per_file) total += queue.size();
  batch.tasks.reserve(total);
  for (size_t i = 0; batch.tasks.size() < total; ++i) {
    for (const auto& [file, queue] : per_file) {
      if (i < queue.size()) batch.tasks.push_back(queue[i]);
    }
  }
}

// Lays out one batch (items in (file, offset) order) and fills `batch`; returns its range count.
uint64_t LayOutBatch(std::span<const Item> items, std::span<const ShardLayout> layouts,
                     const PlanOptions& options, PlanBatch& batch) {
  std::vector<Range> ranges;
  uint64_t pos = 0;  // end of the last range in the buffer
  batch.tensors.reserve(items.size());
  for (const Item& item : items) {
    batch.tensor_bytes += item.size;
    const ShardLayout* layout =
        item.layout >= 0 ? &layouts[static_cast<size_t>(item.layout)] : nullptr;
    std::optional<TensorSlice> slice;
    if (layout != nullptr) slice = layout->slice;
    if (item.size == 0) {
      // No bytes to read: any in-bounds offset is valid; the current end keeps offsets monotonic.
      batch.tensors.push_back({item.tensor, pos, std::move(slice)});
    } else if (layout == nullptr || layout->pieces.size() == 1) {
      AddContiguousTensor(item, layout, std::move(slice), options, ranges, pos, batch);
    } else {
      AddPiecedTensor(item, *layout, std::move(slice), options, ranges, pos, batch);
    }
  }
  batch.buffer_size = pos;
  CutRangesIntoTasks(ranges, options, batch);
  return ranges.size();
}

// Checks the options MakePlan depends on: chunk size, alignments and the tensor-parallel rank.
Status ValidatePlanOptions(const PlanOptions& options) {
  if (options.chunk_size == 0) {
    return Status(Code::kInvalidArgument, "plan: chunk_size must be > 0");
  }
  if (!IsPowerOfTwo(options.alignment)) {
    return Status(Code::kInvalidArgument, std::string("plan: alignment ") +
                                              std::to_string(options.alignment) +
                                              " is not a power of two");
  }
  if (options.io_alignment != 0 &&
      (!IsPowerOfTwo(options.io_alignment) || options.io_alignment < options.alignment)) {
    return Status(Code::kInvalidArgument, std::string("plan: io_alignment ") +
                                              std::to_string(options.io_alignment) +
                                              " is not a power of two >= alignment");
  }
  if (options.tensor_parallel) {
    if (options.tensor_parallel->world == 0 ||
        options.tensor_parallel->rank >= options.tensor_parallel->world) {
      return Status(Code::kInvalidArgument,
                    "plan: tensor parallelism: rank " +
                        std::to_string(options.tensor_parallel->rank) + " of " +
                        std::to_string(options.tensor_parallel->world) +
                        ": the rank must be below a world size of at least 1");
    }
    TF_RETURN_IF_ERROR(options.tensor_parallel->spec.Validate());
  }
  return Status::Ok();
}

// The sort item of tensor `index` (`t`): sliced when its shard rule splits it (the layout is
// appended to `layouts`), checked against the budget, grouped by layer for DeliveryOrder::kLayer.
Result<Item> MakeItem(const TensorInfo& t, uint32_t index, const PlanOptions& options,
                      std::vector<ShardLayout>& layouts) {
  uint64_t size = t.size, cost = t.size;
  int64_t layout = -1;
  if (options.tensor_parallel) {
    const ShardRule rule = options.tensor_parallel->spec.RuleFor(t.name);
    if (rule.is_split()) {
      TF_ASSIGN_OR_RETURN(TensorSlice slice, SliceOf(t, rule, options.tensor_parallel->rank,
                                                     options.tensor_parallel->world));
      const uint64_t gap = t.file < options.file_max_gap.size() ? options.file_max_gap[t.file]
                                                                : options.tensor_parallel->max_gap;
      layouts.push_back(MakeLayout(t, std::move(slice), gap));
      layout = static_cast<int64_t>(layouts.size() - 1);
      size = layouts.back().slice.bytes;
      cost = std::max(size, layouts.back().read_bytes);
    }
  }
  const uint64_t limit = std::max(options.budget, options.alone_budget);
  if (options.budget != 0 && cost > limit && !options.allow_oversized) {
    return Status(Code::kBudgetExceeded,
                  "plan: tensor '" + t.name + "' is " + std::to_string(cost) +
                      " bytes, more than the budget of " + std::to_string(limit) +
                      " bytes (allow_oversized gives it a batch of its own)");
  }
  std::optional<uint64_t> group;
  if (options.order == DeliveryOrder::kLayer) group = LayerOf(t.name);
  return Item{group, t.file, t.offset, index, size, cost, layout};
}

// Pass 1: checks the selection (indices in range, none twice) and appends one item per tensor.
Status CollectItems(const Checkpoint& checkpoint, std::span<const uint32_t> tensors,
                    const PlanOptions& options, std::vector<Item>& items,
                    std::vector<ShardLayout>& layouts) {
  const std::vector<TensorInfo>& all = checkpoint.tensors();
  std::vector<bool> seen(all.size(), false);
  items.reserve(tensors.size());
  for (const uint32_t index : tensors) {
    if (index >= all.size()) {
      return Status(Code::kInvalidArgument, std::string("plan: tensor index ") +
                                                std::to_string(index) +
                                                " out of range (checkpoint has " +
                                                std::to_string(all.size()) + " tensors)");
    }
    const TensorInfo& t = all[index];
    if (seen[index]) {
      return Status(Code::kInvalidArgument, "plan: tensor '" + t.name + "' (index " +
                                                std::to_string(index) + ") selected twice");
    }
    seen[index] = true;
    TF_ASSIGN_OR_RETURN(Item item, MakeItem(t, index, options, layouts));
    items.push_back(item);
  }
  return Status::Ok();
}

// A batch before layout: the [begin, end) span of the sorted items it holds, and their group.
struct Span {
  size_t begin, end;
  std::optional<uint64_t> group;
};

// Pass 2: greedy batching over the sorted list. Greedy keeps (file, offset) order across batches,
// which is what makes coalescing and sequential reads work.
std::vector<Span> CutIntoSpans(const std::vector<Item>& items, const PlanOptions& options) {
  std::vector<Span> spans;
  uint64_t bytes = 0;       // of the open span
  bool can_extend = false;  // false before the first tensor and after an oversized one
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    const bool oversized = options.budget != 0 && item.cost > options.budget;
    // `bytes <= budget` holds for every span but an oversized one, so the subtraction is safe.
    if (can_extend && !oversized && spans.back().group == item.group &&
        (options.budget == 0 || item.cost <= options.budget - bytes)) {
      spans.back().end = i + 1;
      bytes += item.cost;
    } else {
      spans.push_back({i, i + 1, item.group});
      bytes = item.cost;
    }
    can_extend = !oversized;
  }
  return spans;
}

// Pass 2b, with PlanOptions::alone_budget: a caller that holds one batch while it asks for the
// next (a plain Python loop) needs every two consecutive batches to fit the alone budget
// together. A batch within `budget` fits beside any tensor up to the alone budget, but two
// tensors that went alone one after the other may not: then the next batch within `budget` of
// the second one's group (its layer under DeliveryOrder::kLayer) is delivered between them, read
// earlier than its file order. Batches within `budget` keep their order among themselves, and so
// do the alone ones; where no such batch is left, the order stays (the caller must drop a batch
// before asking for the next, as documented).
std::vector<Span> SeparateAloneSpans(const std::vector<Item>& items, std::vector<Span> spans,
                                     const PlanOptions& options) {
  const uint64_t limit = options.alone_budget;
  if (options.budget == 0 || limit <= options.budget || spans.size() < 3) return spans;
  std::vector<uint64_t> cost(spans.size(), 0);
  bool adjacent = false;  // two alone spans over the limit together, one after the other
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t k = spans[i].begin; k < spans[i].end; ++k) cost[i] += items[k].cost;
    adjacent = adjacent || (i > 0 && cost[i - 1] > options.budget && cost[i] > options.budget &&
                            cost[i - 1] + cost[i] > limit);
  }
  if (!adjacent) return spans;
  const auto alone = [&](size_t i) { return cost[i] > options.budget; };
  std::vector<bool> used(spans.size(), false);
  std::vector<Span> out;
  std::vector<uint64_t> out_cost;
  out.reserve(spans.size());
  size_t next = 0;    // the first span not yet delivered, in order
  size_t normal = 0;  // the first span within `budget` not yet delivered
  while (out.size() < spans.size()) {
    while (used[next]) ++next;
    size_t pick = next;
    if (!out.empty() && out_cost.back() > options.budget && alone(next) &&
        out_cost.back() + cost[next] > limit) {
      while (normal < spans.size() && (used[normal] || alone(normal))) ++normal;
      // Of `next`'s group: moved to its start, it keeps the delivery by groups (`next` is the
      // first of its group left when the group changes here).
      if (normal < spans.size() && spans[normal].group == spans[next].group) {
        pick = normal;
      }
    }
    used[pick] = true;
    out.push_back(spans[pick]);
    out_cost.push_back(cost[pick]);
  }
  return out;
}

// Pass 3: lays out each span as one batch of the plan and sums the plan's totals.
Plan LayOutPlan(const std::vector<Item>& items, const std::vector<Span>& spans,
                const std::vector<ShardLayout>& layouts, const PlanOptions& options) {
  Plan plan;
  plan.batches.resize(spans.size());
  for (size_t b = 0; b < spans.size(); ++b) {
    PlanBatch& batch = plan.batches[b];
    const Span& s = spans[b];
    if (options.order == DeliveryOrder::kLayer) batch.layer = s.group;
    plan.num_ranges += LayOutBatch(std::span<const Item>(items).subspan(s.begin, s.end - s.begin),
                                   layouts, options, batch);
    plan.tensor_bytes += batch.tensor_bytes;
    plan.read_bytes += batch.read_bytes;
    plan.num_moves += MoveCount(batch.moves);
    plan.num_tensors += batch.tensors.size();
    plan.num_tasks += batch.tasks.size();
  }
  return plan;
}

}  // namespace

std::optional<uint64_t> LayerOf(std::string_view name) {
  static constexpr std::string_view kMarkers[] = {"layers", "layer", "h", "blocks", "block"};
  std::string_view previous;
  bool have_previous = false;
  while (true) {
    const size_t dot = name.find('.');
    const std::string_view component = name.substr(0, dot);
    if (have_previous &&
        std::find(std::begin(kMarkers), std::end(kMarkers), previous) != std::end(kMarkers)) {
      if (const std::optional<uint64_t> value = ParseDecimal(component)) return value;
      // Not a layer number ("h.99999999999", "layers.norm"): keep looking further on.
    }
    if (dot == std::string_view::npos) return std::nullopt;
    previous = component;
    have_previous = true;
    name.remove_prefix(dot + 1);
  }
}

Result<Plan> MakePlan(const Checkpoint& checkpoint, std::span<const uint32_t> tensors,
                      const PlanOptions& options) {
  TF_RETURN_IF_ERROR(ValidatePlanOptions(options));
  std::vector<Item> items;
  std::vector<ShardLayout> layouts;
  TF_RETURN_IF_ERROR(CollectItems(checkpoint, tensors, options, items, layouts));
  std::sort(items.begin(), items.end());
  const std::vector<Span> spans = SeparateAloneSpans(items, CutIntoSpans(items, options), options);
  return LayOutPlan(items, spans, layouts, options);
}

namespace {

// A file's path, or '#f' for an index the checkpoint does not have (a plan made for another
// checkpoint must not crash the printer).
std::string FileName(const Checkpoint& checkpoint, uint32_t f) {
  const auto& files = checkpoint.files();
  return f < files.size() ? files[f].path : std::string("#") + std::to_string(f);
}

// A tensor's quoted name, or '#t' for an index the checkpoint does not have.
std::string TensorName(const Checkpoint& checkpoint, uint32_t t) {
  const auto& all = checkpoint.tensors();
  return t < all.size() ? "'" + all[t].name + "'" : std::string("#") + std::to_string(t);
}

// The coalesced ranges of a batch, recovered from its tasks and ordered by buffer offset.
std::vector<ReadTask> RangesOf(const PlanBatch& batch) {
  // Ranges are not stored: recover them from the tasks. Two tasks of one range are contiguous in
  // both file and buffer; two ranges of one file never are in the file (they would have been
  // coalesced), so merging contiguous tasks gives back exactly the ranges.
  std::vector<ReadTask> ranges(batch.tasks);
  std::sort(ranges.begin(), ranges.end(), [](const ReadTask& x, const ReadTask& y) {
    return x.file != y.file ? x.file < y.file : x.file_offset < y.file_offset;
  });
  std::vector<ReadTask> merged;
  for (const ReadTask& t : ranges) {
    if (!merged.empty() && merged.back().file == t.file &&
        merged.back().file_offset + merged.back().length == t.file_offset &&
        merged.back().buffer_offset + merged.back().length == t.buffer_offset) {
      merged.back().length += t.length;
    } else {
      merged.push_back(t);
    }
  }
  // Order ranges as the buffer lays them out, which is how a reader thinks of a batch.
  std::sort(merged.begin(), merged.end(),
            [](const ReadTask& x, const ReadTask& y) { return x.buffer_offset < y.buffer_offset; });
  return merged;
}

// The plan's first line: its totals.
std::string ExplainTotals(const Plan& plan) {
  std::string out = std::string("plan: ") + std::to_string(plan.num_tensors) + " tensors, " +
                    std::to_string(plan.tensor_bytes) + " bytes (" +
                    FormatBytes(plan.tensor_bytes) + "), " + std::to_string(plan.batches.size()) +
                    " batches, " + std::to_string(plan.num_ranges) + " ranges, " +
                    std::to_string(plan.num_tasks) + " tasks";
  if (plan.read_bytes != plan.tensor_bytes || plan.num_moves != 0) {
    out += std::string(", reads ") + std::to_string(plan.read_bytes) + " bytes (" +
           FormatBytes(plan.read_bytes) + ") of which " +
           std::to_string(plan.read_bytes - plan.tensor_bytes) + " discarded, " +
           std::to_string(plan.num_moves) + " moves";
  }
  out += "\n";
  return out;
}

// The line that opens batch `b`: its tensors, bytes, ranges, tasks, layer and reads.
std::string ExplainBatchHeader(size_t b, const PlanBatch& batch, size_t num_ranges) {
  std::string out = std::string("batch ") + std::to_string(b) + ": " +
                    std::to_string(batch.tensors.size()) + " tensors, " +
                    std::to_string(batch.tensor_bytes) + " bytes (buffer " +
                    std::to_string(batch.buffer_size) + "), " + std::to_string(num_ranges) +
                    " ranges, " + std::to_string(batch.tasks.size()) + " tasks";
  if (batch.layer) out += std::string(", layer ") + std::to_string(*batch.layer);
  if (batch.read_bytes != batch.tensor_bytes || !batch.moves.empty()) {
    out += std::string(", reads ") + std::to_string(batch.read_bytes) + " bytes, " +
           std::to_string(MoveCount(batch.moves)) + " moves";
  }
  out += "\n";
  return out;
}

// One range's line: file bytes, buffer offset, and the first tensor it holds and how many more.
std::string ExplainRange(const Checkpoint& checkpoint, const PlanBatch& batch, const ReadTask& r) {
  const auto& all = checkpoint.tensors();
  std::string out = std::string("  file ") + FileName(checkpoint, r.file) + " [" +
                    std::to_string(r.file_offset) + ", +" + std::to_string(r.length) +
                    ") -> buffer +" + std::to_string(r.buffer_offset);
  // Name the tensors the range holds: the first, and how many more.
  size_t count = 0;
  uint32_t first = 0;
  for (const PlannedTensor& pt : batch.tensors) {
    if (pt.tensor < all.size() && all[pt.tensor].size > 0 && pt.buffer_offset >= r.buffer_offset &&
        pt.buffer_offset < r.buffer_offset + r.length) {
      if (count++ == 0) first = pt.tensor;
    }
  }
  if (count > 0) {
    out += std::string("  ") + TensorName(checkpoint, first);
    if (count > 1) out += std::string(" +") + std::to_string(count - 1) + " more";
  }
  out += "\n";
  return out;
}

}  // namespace

std::string Plan::Explain(const Checkpoint& checkpoint, size_t max_lines_per_batch) const {
  std::string out = ExplainTotals(*this);
  for (size_t b = 0; b < batches.size(); ++b) {
    const PlanBatch& batch = batches[b];
    const std::vector<ReadTask> ranges = RangesOf(batch);
    out += ExplainBatchHeader(b, batch, ranges.size());
    for (size_t i = 0; i < ranges.size() && i < max_lines_per_batch; ++i) {
      out += ExplainRange(checkpoint, batch, ranges[i]);
    }
    if (ranges.size() > max_lines_per_batch) {
      out += std::string("  ... ") + std::to_string(ranges.size() - max_lines_per_batch) +
             " more ranges\n";
    }
  }
  return out;
}

}  // namespace tensorferry

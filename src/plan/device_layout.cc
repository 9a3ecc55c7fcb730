#include "plan/device_layout.h"

#include <utility>

namespace tensorferry {
namespace {

// The bytes of one index along dimension `dim` of `t` (whole bytes: SliceOf refuses splits where
// they are not).
uint64_t IndexBytes(const TensorInfo& t, uint32_t dim) {
  uint64_t elements = 1;
  for (size_t i = dim + 1; i < t.shape.size(); ++i) elements *= t.shape[i];
  return elements * DTypeBits(t.dtype) / 8;
}

}  // namespace

std::vector<StridedRead> TensorReads(const TensorInfo& info,
                                     const std::optional<TensorSlice>& slice) {
  std::vector<StridedRead> reads;
  if (!slice) {
    if (info.size > 0)
      reads.push_back({info.file, info.offset, 0, 1, info.size, info.size, info.size});
    return reads;
  }
  const uint32_t dim = slice->rule.dim;
  uint64_t outer = 1;
  for (uint32_t i = 0; i < dim; ++i) outer *= info.shape[i];
  const uint64_t row = IndexBytes(info, dim);
  const uint64_t full = info.shape[dim] * row, local = slice->shape[dim] * row;
  if (outer == 0 || row == 0) return reads;
  uint64_t at = 0;  // where the block starts within a local row
  for (const auto& [start, len] : slice->blocks) {
    const uint64_t bytes = len * row;
    if (bytes == 0) continue;
    if (outer == 1) {
      reads.push_back({info.file, info.offset + start * row, at, 1, bytes, bytes, bytes});
    } else {
      reads.push_back({info.file, info.offset + start * row, at, outer, bytes, full, local});
    }
    at += bytes;
  }
  return reads;
}

StridedRead AsRead(const ReadTask& t) {
  return {t.file, t.file_offset, t.buffer_offset, 1, t.length, t.length, t.length};
}

std::vector<StridedRead> LayOutForDevice(std::span<const TensorInfo> infos, uint64_t io_alignment,
                                         PlanBatch& batch) {
  std::vector<ReadTask> tasks;
  std::vector<StridedRead> strided;
  batch.moves.clear();
  batch.read_bytes = 0;
  uint64_t pos = 0;
  bool can_extend = false;  // the last task ends at `pos` and may grow
  auto place = [&](uint64_t file_offset) {
    if (io_alignment == 0) return (pos + 63) & ~uint64_t{63};
    const uint64_t mask = io_alignment - 1;
    uint64_t at = (pos & ~mask) + (file_offset & mask);
    if (at < pos) at += io_alignment;
    return at;
  };
  for (PlannedTensor& pt : batch.tensors) {
    const TensorInfo& info = infos[pt.tensor];
    const uint64_t size = pt.size(info);
    if (size == 0) {
      pt.buffer_offset = pos;
      continue;
    }
    const uint64_t ranges = pt.slice ? SliceRangeCount(info, *pt.slice) : 1;
    if (ranges == 1) {
      const uint64_t offset =
          info.offset + (pt.slice ? SliceByteRanges(info, *pt.slice)[0].first : 0);
      if (can_extend && tasks.back().file == info.file &&
          tasks.back().file_offset + tasks.back().length == offset) {
        tasks.back().length += size;
      } else {
        tasks.push_back({info.file, offset, 0, place(offset)});
      }
      ReadTask& t = tasks.back();
      pt.buffer_offset = t.buffer_offset + (offset - t.file_offset);
      if (t.length == 0) t.length = size;
      pos = t.buffer_offset + t.length;
      batch.read_bytes += size;
      can_extend = true;
      continue;
    }
    std::vector<StridedRead> reads = TensorReads(info, pt.slice);
    const uint64_t base = place(reads.front().file_offset);
    for (StridedRead& r : reads) {
      r.buffer_offset += base;
      if (r.rows == 1) {
        tasks.push_back({r.file, r.file_offset, r.row_bytes, r.buffer_offset});
      } else {
        strided.push_back(r);
      }
      batch.read_bytes += r.length();
    }
    pt.buffer_offset = base;
    pos = base + size;
    can_extend = false;
  }
  batch.tasks = std::move(tasks);
  batch.buffer_size = pos;
  return strided;
}

}  // namespace tensorferry

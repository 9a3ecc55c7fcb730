// The device layout transform: every tensor at exactly its local bytes, contiguous reads coalesced
// and aligned as for GDS, strided reads for slices on dims > 0.
#include "plan/device_layout.h"

#include <gtest/gtest.h>

#include <vector>

namespace tensorferry {
namespace {

TensorInfo Info(DType dtype, std::vector<uint64_t> shape, uint64_t offset, uint32_t file = 0) {
  TensorInfo t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.file = file;
  t.offset = offset;
  t.size = DTypeBits(dtype) / 8;
  for (uint64_t d : t.shape) t.size *= d;
  return t;
}

TEST(DeviceLayout, TensorReadsWholeDimZeroAndStrided) {
  const TensorInfo t = Info(DType::kF32, {4, 10}, 1000);
  EXPECT_EQ(TensorReads(t, std::nullopt),
            (std::vector<StridedRead>{{0, 1000, 0, 1, 160, 160, 160}}));
  // Dim 0, rank 1 of 2: rows 2..3, one contiguous read.
  const TensorSlice rows = SliceOf(t, ShardRule::Split(0), 1, 2).value();
  EXPECT_EQ(TensorReads(t, rows), (std::vector<StridedRead>{{0, 1080, 0, 1, 80, 80, 80}}));
  // Dim 1, rank 1 of 2: columns 5..9 of every row, one strided read of 4 rows.
  const TensorSlice cols = SliceOf(t, ShardRule::Split(1), 1, 2).value();
  const std::vector<StridedRead> r = TensorReads(t, cols);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0], (StridedRead{0, 1020, 0, 4, 20, 40, 20}));
  EXPECT_EQ(r[0].length(), 3 * 40 + 20u);
  // Fused parts on dim 1: one strided read per part, packed side by side in a local row.
  const TensorSlice fused = SliceOf(t, ShardRule::Split(1, {6, 4}), 0, 2).value();
  const std::vector<StridedRead> f = TensorReads(t, fused);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0], (StridedRead{0, 1000, 0, 4, 12, 40, 20}));
  EXPECT_EQ(f[1], (StridedRead{0, 1024, 12, 4, 8, 40, 20}));
  EXPECT_TRUE(TensorReads(Info(DType::kF32, {0, 3}, 8), std::nullopt).empty());
}

TEST(DeviceLayout, EveryTensorAtItsLocalBytes) {
  // a, b adjacent in the file (one read), c split on dim 1 (strided), d split on dim 0.
  const std::vector<TensorInfo> infos = {
      Info(DType::kF32, {16}, 4096), Info(DType::kF32, {8}, 4096 + 64),
      Info(DType::kBF16, {6, 8}, 8192), Info(DType::kF32, {10, 4}, 12288)};
  for (const uint64_t alignment : {uint64_t{0}, uint64_t{4096}}) {
    PlanBatch batch;
    batch.tensors.push_back({0, 0, std::nullopt});
    batch.tensors.push_back({1, 0, std::nullopt});
    batch.tensors.push_back({2, 0, SliceOf(infos[2], ShardRule::Split(1), 0, 2).value()});
    batch.tensors.push_back({3, 0, SliceOf(infos[3], ShardRule::Split(0), 1, 2).value()});
    batch.moves.push_back({100, 0, 10});  // the host plan's: gone
    const std::vector<StridedRead> strided = LayOutForDevice(infos, alignment, batch);
    EXPECT_TRUE(batch.moves.empty());
    ASSERT_EQ(batch.tasks.size(), 2u);  // a+b coalesced, d
    EXPECT_EQ(batch.tasks[0].file_offset, 4096u);
    EXPECT_EQ(batch.tasks[0].length, 96u);
    EXPECT_EQ(batch.tensors[1].buffer_offset, batch.tensors[0].buffer_offset + 64);
    ASSERT_EQ(strided.size(), 1u);
    EXPECT_EQ(strided[0].rows, 6u);
    EXPECT_EQ(strided[0].row_bytes, 8u);
    EXPECT_EQ(strided[0].dst_pitch, 8u);
    EXPECT_EQ(strided[0].buffer_offset, batch.tensors[2].buffer_offset);
    EXPECT_EQ(batch.tasks[1].file_offset, 12288u + 80);
    EXPECT_EQ(batch.tasks[1].length, 80u);
    EXPECT_EQ(batch.tasks[1].buffer_offset, batch.tensors[3].buffer_offset);
    // Only local bytes are read: no covered gaps.
    EXPECT_EQ(batch.read_bytes, 96 + strided[0].length() + 80);
    for (const ReadTask& t : batch.tasks) {
      if (alignment != 0) {
        EXPECT_EQ(t.buffer_offset % alignment, t.file_offset % alignment);
      } else {
        EXPECT_EQ(t.buffer_offset % 64, 0u);
      }
    }
    // Tensors do not overlap and the buffer ends right after the last.
    for (size_t i = 1; i < batch.tensors.size(); ++i) {
      const PlannedTensor& prev = batch.tensors[i - 1];
      EXPECT_GE(batch.tensors[i].buffer_offset, prev.buffer_offset + prev.size(infos[prev.tensor]));
    }
    const PlannedTensor& last = batch.tensors.back();
    EXPECT_EQ(batch.buffer_size, last.buffer_offset + last.size(infos[last.tensor]));
  }
}

}  // namespace
}  // namespace tensorferry

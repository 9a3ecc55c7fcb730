// Device layout of a plan's batches: a pure transform (no I/O, no CUDA) from the host plan of a
// tensor-parallel load to the reads a device batch (or a caller's destination) needs, where every
// tensor occupies exactly its local bytes.
//
// The host plan reads covering ranges into the buffer and packs the pieces with memmoves
// afterwards, which on a device would cost the gap bytes in device memory plus device-to-device
// moves. Here whole tensors and single-range slices (dim 0) are contiguous reads, and each block
// of a slice on another dimension is one StridedRead whose rows the device pipeline copies with
// cudaMemcpy2DAsync (src/device/pipeline.h).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/plan.h"
#include "tensorferry/shard.h"

namespace tensorferry {

// `rows` rows of `row_bytes`, `src_pitch` apart in file `file` from `file_offset`, land
// `dst_pitch` apart in the destination from `buffer_offset`. rows == 1: one contiguous read.
struct StridedRead {
  uint32_t file = 0;
  uint64_t file_offset = 0;
  uint64_t buffer_offset = 0;
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
  // Gather the rows from the page cache (a mapping of the file) instead of reading the covering
  // range: set by the loader for files mostly cached under TensorParallelOptions::exact_when_cached
  // (src/loader/groups.cc); only rows * row_bytes bytes are then read and staged.
  bool gather = false;
  // The bytes of the file the read spans (first row's start to last row's end).
  uint64_t length() const { return (rows - 1) * src_pitch + row_bytes; }
  friend bool operator==(const StridedRead&, const StridedRead&) = default;
};

// The reads that put `tensor` (or its `slice`) at [0, local bytes) of a destination: per block of
// the slice, one contiguous read (a dim-0 split) or one strided read of every leading index's row;
// the whole tensor as one read without a slice. Empty for an empty tensor.
// REQUIRES: slice came from SliceOf(tensor, ...).
std::vector<StridedRead> TensorReads(const TensorInfo& tensor,
                                     const std::optional<TensorSlice>& slice);

// A contiguous task of a plan as a read (rows == 1).
StridedRead AsRead(const ReadTask& task);

// Lays out `batch` (of a plan over `tensors` with PlanOptions::tensor_parallel) again for a device:
// every tensor occupies exactly its local bytes in the buffer; contiguous reads coalesce when
// adjacent in the file and keep their file offset modulo `io_alignment` (0: 64-byte alignment
// only), as the host plan does, for GDS. The batch keeps its tensors and order; tasks, moves,
// buffer_size and read_bytes are replaced; the strided reads besides the batch's tasks are
// returned.
std::vector<StridedRead> LayOutForDevice(std::span<const TensorInfo> tensors, uint64_t io_alignment,
                                         PlanBatch& batch);

}  // namespace tensorferry

// tensorferry/plan.h: a read plan, as a plain value.
//
// A plan turns a set of tensors of a Checkpoint into the work of loading them: tensors grouped
// into batches whose bytes fit a budget (batches are made of tensors, never of whole files, and
// may mix files), each batch laid out in one destination buffer, and the batch's bytes cut into
// fixed-size read tasks spread across the files so one huge file is read in parallel and many
// small files do not serialize. Tensors adjacent in a file and selected together are read as one
// range (coalesced). A plan does no I/O: it can be printed (Explain), tested on its own, and is
// where the bytes a load will read are counted.
//
// Thread-safety: MakePlan is reentrant; a Plan is an immutable value once built.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/shard.h"
#include "tensorferry/status.h"

namespace tensorferry {

enum class DeliveryOrder : uint8_t {
  kFile,   // batches follow (file, offset) order: the fastest (one exception: alone_budget)
  kLayer,  // batches never mix transformer layers; tensors without a layer come first, then
           // layer 0, 1, ... (progressive layer-by-layer delivery)
};

struct PlanOptions {
  // Size of one read task in bytes (the unit of parallelism). Must be > 0.
  uint64_t chunk_size = 8ull << 20;
  // Most bytes of tensor data in one batch; 0 means unbounded (a single batch, or one per layer).
  uint64_t budget = 0;
  // A tensor larger than `budget` is kBudgetExceeded, unless this is set: then it gets a batch of
  // its own, the only batch allowed to exceed the budget.
  bool allow_oversized = false;
  // A tensor larger than `budget` but at most `alone_budget` gets a batch of its own rather than
  // kBudgetExceeded (0: none): the loader's batches under a budget stay small enough for one to be
  // read while the caller holds another, and a tensor too large for that goes alone. Two such
  // batches that would follow each other and together pass `alone_budget` get the next batch
  // within `budget` of the same group between them (delivered before its file order), so that
  // every two consecutive batches fit `alone_budget` together wherever such a batch is left.
  uint64_t alone_budget = 0;
  DeliveryOrder order = DeliveryOrder::kFile;
  // Destination offset alignment of each coalesced range within its batch buffer (power of two),
  // used when io_alignment is 0.
  uint64_t alignment = 64;
  // Each range's buffer offset is made congruent to its file offset modulo io_alignment (a power
  // of two >= alignment; 0 turns the rule off), so O_DIRECT can read the block-aligned middle
  // straight into the buffer, and every tensor keeps in memory the alignment it has in the file
  // (safetensors data is 8-byte aligned). Costs less than io_alignment bytes of padding per range.
  uint64_t io_alignment = 4096;
  // Tensor parallelism: each tensor is planned as the slice rank `tensor_parallel->rank` of
  // `tensor_parallel->world` holds under `tensor_parallel->spec` (SliceOf): only the slice's bytes
  // are read (plus gaps up to max_gap inside covering reads), and the batch's `moves` pack each
  // tensor's pieces together after the reads. Tensors of a slice that is the whole tensor are
  // planned as without.
  std::optional<TensorParallelOptions> tensor_parallel;
  // Per file (index into Checkpoint::files()), the max_gap of that file's sliced tensors,
  // overriding tensor_parallel->max_gap (the Loader fills it from
  // tensor_parallel->exact_when_cached); empty: none.
  std::vector<uint64_t> file_max_gap;
};

// One tensor placed in a batch buffer.
struct PlannedTensor {
  uint32_t tensor = 0;         // index into Checkpoint::tensors()
  uint64_t buffer_offset = 0;  // where its first byte lands in the batch buffer (after moves)
  // With PlanOptions::tensor_parallel and a split rule: the rank's part (local shape and bytes).
  std::optional<TensorSlice> slice;
  uint64_t size(const TensorInfo& info) const { return slice ? slice->bytes : info.size; }
};

// After every read of a batch: move `length` bytes of the batch buffer from `from` to `to`
// (memmove; from > to). Moves run in order; they pack the pieces of covering reads together.
struct BufferMove {
  uint64_t from = 0;
  uint64_t to = 0;
  uint64_t length = 0;
  // `count` moves of `length` bytes, the i-th from `from + i * from_stride` to `to + i *
  // to_stride`, in order (the rows of a strided slice: one entry, not one per row).
  uint64_t count = 1;
  uint64_t from_stride = 0;
  uint64_t to_stride = 0;
};

// Read `length` bytes of file `file` at `file_offset` into the batch buffer at `buffer_offset`.
struct ReadTask {
  uint32_t file = 0;  // index into Checkpoint::files()
  uint64_t file_offset = 0;
  uint64_t length = 0;
  uint64_t buffer_offset = 0;
};

struct PlanBatch {
  std::vector<PlannedTensor> tensors;  // in (file, offset) order
  std::vector<ReadTask> tasks;         // interleaved across files
  std::vector<BufferMove> moves;       // after the reads, in order (tensor-parallel plans only)
  uint64_t tensor_bytes = 0;           // sum of the tensors' (local) sizes: bytes delivered
  uint64_t read_bytes = 0;             // bytes the tasks read (tensor_bytes plus covered gaps)
  uint64_t buffer_size = 0;       // bytes of the destination buffer (alignment padding included)
  std::optional<uint64_t> layer;  // with DeliveryOrder::kLayer: the batch's layer, if any
};

struct Plan {
  std::vector<PlanBatch> batches;
  uint64_t tensor_bytes = 0;  // total over batches: bytes delivered
  uint64_t read_bytes = 0;    // total over batches: bytes read (tensor_bytes unless sliced)
  uint64_t num_tensors = 0;
  uint64_t num_moves = 0;
  uint64_t num_ranges = 0;  // coalesced ranges before cutting into tasks
  uint64_t num_tasks = 0;

  // Human-readable description: totals, then per batch its tensors' count and bytes, its ranges
  // and tasks (the first few of each), one line each. With `checkpoint`, names files and tensors.
  std::string Explain(const Checkpoint& checkpoint, size_t max_lines_per_batch = 8) const;
};

// Builds the plan for `tensors` (indices into checkpoint.tensors(); any order, no duplicates).
// Errors: kInvalidArgument (an index out of range, a duplicate, chunk_size 0, alignment not a
// power of two, io_alignment neither 0 nor a power of two >= alignment, every error of SliceOf
// with PlanOptions::tensor_parallel), kBudgetExceeded (a tensor
// larger than the budget without allow_oversized; the message names the tensor, its size and the
// budget).
Result<Plan> MakePlan(const Checkpoint& checkpoint, std::span<const uint32_t> tensors,
                      const PlanOptions& options = {});

// The transformer layer a tensor name belongs to: the integer component following a component
// named "layers", "layer", "h", "blocks" or "block" (e.g. "model.layers.12.mlp.up_proj.weight" ->
// 12, "transformer.h.3.attn.c_attn.weight" -> 3); nullopt when there is none (a number beyond
// 2^64 - 1 is not a layer number).
std::optional<uint64_t> LayerOf(std::string_view name);

}  // namespace tensorferry

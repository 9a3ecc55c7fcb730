// tensorferry/loader.h: load tensors of a checkpoint into host memory, under a byte budget.
//
// A Loader turns a Selection (which tensors) into a Plan (plan.h) and executes it batch by batch:
// each batch gets one destination buffer (from a pool that reuses released buffers, so repeated
// loads skip the first-touch cost of fresh memory), its read tasks run on a pool of I/O workers
// across all files at once, and its tensors are handed out as Tensor values that share ownership of
// that buffer. A tensor stays valid as long as it (or a copy) lives, whatever happens to the
// loader, the checkpoint or later batches: nothing is ever overwritten while referenced.
//
// Budget: with LoadOptions::budget > 0 the loader never holds more than `budget` bytes of tensor
// data at once. Batch bytes count against the budget from the moment the batch's reads start until
// the caller drops the last Tensor of that batch. Stream() delivers batches one at a time; if the
// caller still holds so much of earlier batches that the next one cannot fit, Stream returns
// kBudgetExceeded rather than wait forever (nothing else can free it).
//
// Errors name file, tensor and byte offset. A failed batch releases its memory and hands no tensor
// of it to the caller.
//
// Thread-safety: a Loader may be used from one thread at a time; different Loaders may run
// concurrently. Tensor is a value: copies may be used from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/plan.h"
#include "tensorferry/status.h"

namespace tensorferry {

// A loaded tensor: metadata plus bytes it co-owns.
class Tensor {
 public:
  Tensor() = default;
  Tensor(std::string name, DType dtype, std::vector<uint64_t> shape, const std::byte* data,
         uint64_t size, std::shared_ptr<const void> owner)
      : name_(std::move(name)),
        dtype_(dtype),
        shape_(std::move(shape)),
        data_(data),
        size_(size),
        owner_(std::move(owner)) {}

  const std::string& name() const noexcept { return name_; }
  DType dtype() const noexcept { return dtype_; }
  const std::vector<uint64_t>& shape() const noexcept { return shape_; }
  // Little-endian, row-major bytes; valid while this Tensor or a copy (or owner()) lives.
  const std::byte* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }
  // The shared owner of the memory (for hand-off to other frameworks, e.g. DLPack).
  const std::shared_ptr<const void>& owner() const noexcept { return owner_; }

 private:
  std::string name_;
  DType dtype_ = DType::kU8;
  std::vector<uint64_t> shape_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  std::shared_ptr<const void> owner_;
};

// Which tensors to load.
class Selection {
 public:
  static Selection All();
  static Selection Names(std::vector<std::string> names);  // each must exist (kNotFound)
  static Selection Where(std::function<bool(const TensorInfo&)> predicate);
  static Selection Layers(uint32_t first, uint32_t last);  // LayerOf(name) in [first, last]

  // Indices into checkpoint.tensors(), ascending. Errors: kNotFound for a missing name.
  Result<std::vector<uint32_t>> Resolve(const Checkpoint& checkpoint) const;

 private:
  std::vector<std::string> names_;
  std::function<bool(const TensorInfo&)> predicate_;
  bool by_name_ = false;
};

enum class Engine : uint8_t { kAuto, kPread, kIoUring, kMmap };

struct LoadOptions {
  Engine engine = Engine::kAuto;  // kAuto and kPread: the pread pool (io_uring and mmap: later)
  unsigned threads = 0;           // I/O workers; 0 = one per online CPU
  uint64_t chunk_size = 8ull << 20;
  uint64_t budget = 0;  // bytes of tensor data held at once; 0 = unbounded
  bool allow_oversized = false;
  DeliveryOrder order = DeliveryOrder::kFile;
  // Released batch buffers kept for reuse by later batches and loads.
  uint64_t pool_bytes = 4ull << 30;
  Env* env = nullptr;  // nullptr: Env::Default(). Not owned.
};

struct Batch {
  size_t index = 0;  // 0, 1, ... in delivery order
  size_t count = 0;  // batches in this load
  std::vector<Tensor> tensors;
  uint64_t bytes = 0;
};

struct LoadStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;  // tensor bytes delivered
  uint64_t batches = 0;
  double seconds = 0;              // wall time inside the loader (callbacks excluded)
  uint64_t peak_budget_bytes = 0;  // highest bytes held against the budget
  uint64_t buffers_reused = 0;
  uint64_t buffers_allocated = 0;
};

class Loader {
 public:
  // Errors: kInvalidArgument (chunk_size 0), kUnsupported (an engine not built yet), those of
  // Checkpoint::Open for the path overload.
  static Result<std::unique_ptr<Loader>> Open(std::shared_ptr<const Checkpoint> checkpoint,
                                              const LoadOptions& options = {});
  static Result<std::unique_ptr<Loader>> Open(const std::string& path,
                                              const LoadOptions& options = {});
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  const std::shared_ptr<const Checkpoint>& checkpoint() const noexcept;

  // The plan a load of `selection` would execute. Errors: those of Selection::Resolve and MakePlan.
  Result<Plan> MakePlan(const Selection& selection) const;

  // Loads batch by batch, calling `on_batch` for each on the calling thread; a non-OK status from
  // the callback stops the load and is returned. Errors: those of MakePlan, kIoError,
  // kUnexpectedEof (a file shorter than its header promises, e.g. truncated since opening),
  // kBudgetExceeded (see the file comment).
  Status Stream(const Selection& selection, const std::function<Status(Batch)>& on_batch);

  // Loads every selected tensor and returns them all (in checkpoint order). With a budget, the
  // total must fit it (kBudgetExceeded otherwise: use Stream).
  Result<std::vector<Tensor>> Load(const Selection& selection = Selection::All());

  // Totals of the last Stream or Load.
  LoadStats stats() const;

 private:
  struct Impl;
  explicit Loader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorferry

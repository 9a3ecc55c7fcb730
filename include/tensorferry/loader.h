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
// the caller drops the last Tensor of that batch. Batches hold at most half the budget (the whole
// budget when a selected tensor is larger than half), so that while the caller handles batch b,
// batch b + 1 is read on a helper thread (double buffering) whenever its bytes fit at that moment.
// Stream() delivers batches one at a time; if the caller still holds so much of earlier batches
// that the next one cannot fit, Stream returns kBudgetExceeded rather than wait forever (nothing
// else can free it). The mmap engine holds no tensor memory of its own (the page cache does), so
// the budget only shapes its batches.
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
#include <optional>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/plan.h"
#include "tensorferry/shard.h"
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
  friend class Loader;  // resolves tied aliases absent from the checkpoint
  std::vector<std::string> names_;
  std::function<bool(const TensorInfo&)> predicate_;
  bool by_name_ = false;
};

// How bytes get from the files into memory.
//   kAuto:    kIoUring where the kernel allows it, else kPread.
//   kPread:   a pool of threads issuing pread(2) (preadv2 with O_DIRECT when direct I/O is used).
//   kIoUring: one ring per worker thread through liburing, queue_depth reads in flight each.
//   kMmap:    zero-copy: each file is mapped read-only once per loader and every Tensor is a view
//             into the mapping (owner() keeps the mapping alive after the loader is gone). Pages
//             are read on first touch unless LoadOptions::populate. No budget applies (the page
//             cache owns the memory). SIGBUS: a file truncated while mapped would kill a plain
//             mmap reader. tensorferry registers each mapping with a process-wide SIGBUS handler
//             (installed once, chaining to any previous handler for addresses it does not own)
//             that replaces the vanished page with zeros and records the fault; a load that
//             faults returns kUnexpectedEof naming the file and offset, and tensors handed out
//             earlier read zeros where the file vanished instead of crashing the process
//             (docs/runtime_settings.md, "mmap and truncated files").
enum class Engine : uint8_t { kAuto, kPread, kIoUring, kMmap };

// O_DIRECT (bypassing the page cache) for the copying engines.
//   kAuto: per file, direct when less than half of the file's bytes to read are in the page cache
//          (measured with mincore) and the file system accepts O_DIRECT; buffered otherwise.
//   kOn:   direct for every file whose file system accepts it (buffered fallback reported in
//          LoadStats::direct_files / buffered_files).
//   kOff:  always buffered.
enum class DirectIO : uint8_t { kAuto, kOn, kOff };

// "auto", "pread", "io_uring", "mmap" / "auto", "on", "off". Parse* errors: kInvalidArgument.
std::string_view EngineName(Engine engine) noexcept;
Result<Engine> ParseEngine(std::string_view name);
std::string_view DirectIOName(DirectIO direct) noexcept;
Result<DirectIO> ParseDirectIO(std::string_view name);

// Every option with its default. Environment variables (TENSORFERRY_*) seed these defaults only
// through LoadOptions::FromEnvironment(); a default-constructed LoadOptions ignores the
// environment. docs/runtime_settings.md lists the variables.
struct LoadOptions {
  Engine engine = Engine::kAuto;      // TENSORFERRY_ENGINE
  unsigned threads = 0;               // I/O workers; 0 = one per online CPU (TENSORFERRY_THREADS)
  uint64_t chunk_size = 8ull << 20;   // bytes per read task (TENSORFERRY_CHUNK_SIZE)
  DirectIO direct = DirectIO::kAuto;  // TENSORFERRY_DIRECT_IO
  unsigned queue_depth = 8;  // io_uring reads in flight per worker (TENSORFERRY_QUEUE_DEPTH)
  uint64_t budget = 0;  // bytes of tensor data held at once; 0 = unbounded (TENSORFERRY_BUDGET)
  bool allow_oversized = false;  // a tensor larger than the budget loads alone instead of failing
  DeliveryOrder order = DeliveryOrder::kFile;  // TENSORFERRY_ORDER = file | layer
  // Released batch buffers kept for reuse by later batches and loads (TENSORFERRY_POOL_BYTES).
  uint64_t pool_bytes = 4ull << 30;
  // mmap engine: pre-fault every mapped page during the load (MAP_POPULATE-like, in parallel) so
  // first access costs nothing; false: pages are read on first touch.
  bool populate = false;
  Env* env = nullptr;  // nullptr: Env::Default(). Not owned. Direct I/O and mmap need the default.
  // Tensor parallelism: when set, every tensor is delivered as the slice rank `shard->rank` of
  // `shard->world` holds under `shard->spec` (shard.h): Tensor::shape() is the local shape,
  // only the slice's bytes are read (plus gaps up to shard->max_gap inside covering reads), and
  // LoadStats::bytes_read shows it. Dim-0 slices are one contiguous read (with mmap, a view
  // into the mapping); other slices are strided reads packed into pooled buffers. Under a
  // budget a tensor counts the bytes its reads occupy (its slice plus covered gaps).
  // Ties of the spec: an alias is delivered sharing its target's data (one read), also when the
  // alias is absent from the files (tie_word_embeddings) or present as a duplicate (then its own
  // bytes are not read).
  std::optional<TensorParallelOptions> shard;

  // Defaults overridden by the TENSORFERRY_* environment variables that are set. Errors:
  // kInvalidArgument naming the variable and its value.
  static Result<LoadOptions> FromEnvironment();
};

struct Batch {
  size_t index = 0;  // 0, 1, ... in delivery order
  size_t count = 0;  // batches in this load
  std::vector<Tensor> tensors;
  uint64_t bytes = 0;
};

struct LoadStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;  // tensor bytes delivered (tied aliases not counted twice)
  // Bytes read from files: `bytes` plus the gaps of covering reads (LoadOptions::shard). With
  // mmap, the bytes of the ranges it populates or gathers (views read on first touch count too).
  uint64_t bytes_read = 0;
  uint64_t batches = 0;
  double seconds = 0;              // wall time inside the loader (callbacks excluded)
  uint64_t peak_budget_bytes = 0;  // highest bytes held against the budget
  uint64_t buffers_reused = 0;
  uint64_t buffers_allocated = 0;
  std::string engine;           // the engine that ran ("pread", "io_uring", "mmap")
  uint64_t direct_files = 0;    // files read with O_DIRECT
  uint64_t direct_bytes = 0;    // bytes read with O_DIRECT (the rest went through the page cache)
  uint64_t buffered_files = 0;  // files read through the page cache
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

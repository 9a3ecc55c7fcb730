// tensorferry/loader.h: load tensors of a checkpoint into host or CUDA device memory, under byte
// budgets.
//
// A Loader turns a Selection (which tensors) into a Description (what is delivered, Describe) and
// a Plan (plan.h), and executes it batch by batch, plan -> read engine -> sink: each batch gets one
// destination buffer (host: from a pool that reuses released buffers, so
// repeated loads skip the first-touch cost of fresh memory; CUDA: one cudaMalloc), its read tasks
// run on a pool of I/O workers across all files at once, and its tensors are handed out as Tensor
// values that share ownership of that buffer. A tensor stays valid as long as it (or a copy) lives,
// whatever happens to the loader, the checkpoint or later batches: nothing is ever overwritten
// while referenced.
//
// Budget: with LoadOptions::budget > 0 the loader never holds more than `budget` bytes of tensor
// data at once. Batch bytes count against the budget from the moment the batch's reads start until
// the caller drops the last Tensor of that batch. Batches hold at most half the budget (the whole
// budget when a selected tensor is larger than half), so that while the caller handles batch b,
// batch b + 1 is read on a helper thread (double buffering) whenever its bytes fit at that moment.
// Iterate() (pull: BatchIterator::Next) and Stream() (push: a loop over Next) deliver batches one
// at a time; if the caller still holds so much of earlier batches
// that the next one cannot fit, Stream returns kBudgetExceeded rather than wait forever (nothing
// else can free it). The mmap engine holds no tensor memory of its own (the page cache does), so
// the budget only shapes its batches.
//
// Device loads (LoadOptions::device, or a per-tensor LoadOptions::placement; docs/gpu.md): a batch
// bound for CUDA device d gets one device buffer (one cudaMalloc, from a budgeted allocator), its
// read tasks go through the device pipeline: the same read engine reads each chunk into a slot of
// a pinned staging ring (O_DIRECT when the loader's direct policy chooses it for the file), and a
// cudaMemcpyAsync moves it to the tensor's final place; or, with GPUDirect Storage, cuFile reads
// straight into the buffer. The tensors are views co-owning the buffer: cudaFree runs when the last
// of them goes. The pipeline (its pinned ring, streams and cuFile driver) is created once per
// Loader and device and reused by every later batch and load. Batches never mix devices: a placed
// load delivers the host batches first, then each device's in device order.
//
// Device memory, precisely: the device memory a load uses is its live batch buffers, nothing else
// (the staging ring is pinned host memory; copies and GDS reads go straight to the tensors' final
// places; no buffer is ever sized after a shard file). A batch buffer holds the batch's tensors
// plus alignment padding: with GDS off, less than 64 bytes per coalesced range; otherwise less than
// 4 KiB per range (ranges keep their file offset modulo 4 KiB so GDS reads can be aligned). With
// LoadOptions::device_budget > 0 the bytes of live batch buffers on one device (padding included,
// tensors handed out counted until dropped) never exceed it: batches are planned at half of it
// for double buffering, exactly as `budget` for host memory, and a batch that does not fit is
// kBudgetExceeded. So the extra device memory of loading beyond the tensors themselves is the
// padding alone, and the peak device memory of a streamed load is at most device_budget whatever
// the size of the shard files. LoadStats::peak_device_bytes is that peak for the last load.
//
// Errors name file, tensor and byte offset. A failed batch releases its memory and hands no tensor
// of it to the caller.
//
// Thread-safety: a Loader may be used from one thread at a time (an open BatchIterator counts as
// a use); different Loaders may run concurrently. Describe and MakePlan are const and pure.
// Tensor is a value: copies may be used from any thread.
// Ownership: Loader::Open shares the Checkpoint; Tensors co-own their memory; a BatchIterator
// borrows its Loader (the Loader must outlive it).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/device.h"
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
         uint64_t size, std::shared_ptr<const void> owner, Device device = Device::CPU())
      : name_(std::move(name)),
        dtype_(dtype),
        shape_(std::move(shape)),
        data_(data),
        size_(size),
        owner_(std::move(owner)),
        device_(device) {}

  const std::string& name() const noexcept { return name_; }
  DType dtype() const noexcept { return dtype_; }
  const std::vector<uint64_t>& shape() const noexcept { return shape_; }
  // Little-endian, row-major bytes; valid while this Tensor or a copy (or owner()) lives. On a
  // CUDA device this is a device address: never dereference it on the host (CopyToHost).
  const std::byte* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }
  // The shared owner of the memory (for hand-off to other frameworks, e.g. DLPack).
  const std::shared_ptr<const void>& owner() const noexcept { return owner_; }
  // Where the bytes are: the host, or a CUDA device.
  Device device() const noexcept { return device_; }

 private:
  std::string name_;
  DType dtype_ = DType::kU8;
  std::vector<uint64_t> shape_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  std::shared_ptr<const void> owner_;
  Device device_;
};

class Selection;

// One tensor a load of a selection delivers (Loader::Describe).
struct OutputInfo {
  std::string name;  // as delivered: a tied alias under its own name
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;  // local shape: the tensor-parallel slice applied
  uint64_t bytes = 0;           // bytes of the delivered tensor (the slice's)
  uint32_t tensor = 0;          // index into checkpoint.tensors() of the tensor whose bytes it is
  // A tied alias (ShardSpec::Tie): its bytes are those of `tensor`, which has another name (read
  // once, shared with that tensor's output when it is selected too).
  bool alias = false;
  std::optional<TensorSlice> slice;  // the slice of `tensor` delivered, when its rule splits it
};

// What a load of a selection delivers and reads: the one resolution of tied aliases and output
// order that every path (Load, Stream, LoadInto, LoadCooperative, the Python binding) uses.
// A tied alias selected by name, or matched by a predicate (as its target would be, under the
// alias's name), stands for its target whether the files hold it (a duplicate, not read) or not
// (tie_word_embeddings). Without a shard spec or without ties, outputs are the selected tensors.
struct Description {
  // In the order Loader::Load returns them: checkpoint order; an alias the files lack comes right
  // after its target (aliases of one target by name).
  std::vector<OutputInfo> outputs;
  std::vector<uint32_t> read;  // indices into checkpoint.tensors() to read, ascending
  uint64_t bytes = 0;          // local bytes of the read tensors (LoadStats::bytes of a load)
};

// The description of `selection` over `checkpoint` for rank shard->rank of shard->world (no
// slicing when `shard` is null; ties come from shard->spec). Pure: no I/O. Errors: kNotFound (a
// name that is neither a tensor nor a tied alias of one), kInvalidArgument (a tie whose target is
// not in the checkpoint or whose alias in the files differs from it; the errors of SliceOf).
Result<Description> DescribeSelection(const Checkpoint& checkpoint, const Selection& selection,
                                      const TensorParallelOptions* shard);

// Which tensors to load.
class Selection {
 public:
  static Selection All();
  static Selection Names(std::vector<std::string> names);  // each must exist (kNotFound)
  static Selection Where(std::function<bool(const TensorInfo&)> predicate);
  static Selection Layers(uint64_t first, uint64_t last);  // LayerOf(name) in [first, last]

  // Indices into checkpoint.tensors(), ascending. Errors: kNotFound for a missing name.
  Result<std::vector<uint32_t>> Resolve(const Checkpoint& checkpoint) const;

 private:
  // Resolves tied aliases absent from the checkpoint.
  friend Result<Description> DescribeSelection(const Checkpoint&, const Selection&,
                                               const TensorParallelOptions*);
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
//             cache owns the memory). Files that change under their tensors
//             (include/tensorferry/mapping.h): each mapping holds a read lease, and a writer
//             that opens or truncates the file makes tensorferry copy the mapping into private
//             memory first, so tensors keep their bytes; where no lease can be had, a page that
//             vanished reads as zeros, is reported on stderr at once and by CheckMappedFiles
//             (every Stream, Load and LoadInto starts with it), and a batch from that mapping is
//             refused with kUnexpectedEof naming the file and offset (docs/runtime_settings.md,
//             "mmap and files that change").
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
// Limits Loader::Open applies to LoadOptions (clamping, not failing): docs/runtime_settings.md.
inline constexpr uint64_t kMinChunkSize = 4096;   // chunk_size below it reads as 4 KiB (a page)
inline constexpr unsigned kMaxThreads = 256;      // more threads start 256
inline constexpr unsigned kMaxQueueDepth = 4096;  // io_uring's own bound on a ring's entries

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
  // Cancellation: a flag the caller may set from any thread while a load runs. Host reads not yet
  // started are not started (those in flight finish: at most one chunk per worker), no further
  // batch is delivered, and the call returns kCancelled. The flag is the caller's: a load that
  // starts with it set returns kCancelled at once; clear it before the next load.
  std::shared_ptr<const std::atomic<bool>> cancel;
  // Tensor parallelism: when set, every tensor is delivered as the slice rank `shard->rank` of
  // `shard->world` holds under `shard->spec` (shard.h): Tensor::shape() is the local shape,
  // only the slice's bytes are read (plus gaps up to shard->max_gap inside covering reads), and
  // LoadStats::bytes_read shows it. Dim-0 slices are one contiguous read (with mmap, a view
  // into the mapping); other slices are strided reads packed into pooled buffers. Under a
  // budget a tensor counts the bytes its reads occupy (its slice plus covered gaps).
  // On a CUDA device (device/placement) the slice lands in the batch's device buffer holding
  // exactly the local bytes: dim-0 slices as contiguous device tasks (GDS-eligible), other dims
  // as strided tasks the pipeline copies with cudaMemcpy2DAsync from the staged covering range
  // (rows are staged together only as far as they fit one staging slot; max_gap and
  // exact_when_cached shape host reads only: see docs/gpu.md, "Tensor-parallel slices").
  // Ties of the spec: an alias is delivered sharing its target's data (one read), also when the
  // alias is absent from the files (tie_word_embeddings) or present as a duplicate (then its own
  // bytes are not read).
  std::optional<TensorParallelOptions> shard;

  // --- device loading (see the file comment and docs/gpu.md) ---
  // Where tensors go: the host (default) or a CUDA device (TENSORFERRY_DEVICE = cpu, cuda, cuda:N).
  // A CUDA target is checked at Loader::Open (kCudaNotFound, kCudaNoDevice with the reason).
  Device device = Device::CPU();
  // Per-tensor placement (like accelerate's device_map): when set, called once per selected tensor
  // at the start of each load and overrides `device` (Placement() builds one from name prefixes).
  // Host tensors take the host path, device tensors the device pipeline; batches never mix devices.
  std::function<Device(const TensorInfo&)> placement;
  // Pinned host memory of the staging ring, per device used (TENSORFERRY_STAGING_BYTES): at least
  // two slots' worth. Allocated once per Loader and device, reused by every load.
  uint64_t staging_bytes = 64ull << 20;
  // Bytes per staging slot: per read and per host-to-device copy (TENSORFERRY_STAGING_SLOT).
  uint64_t staging_slot = 8ull << 20;
  // Producer threads of the pipeline, each with its own CUDA stream; 0: min(4, slots).
  unsigned device_producers = 0;
  // Bytes of device batch buffers (tensors plus padding) live at once per device; 0 = unbounded
  // (TENSORFERRY_DEVICE_BUDGET). See "Device memory, precisely" in the file comment.
  uint64_t device_budget = 0;
  // GPUDirect Storage: auto, on, off (TENSORFERRY_GDS; device.h).
  GdsMode gds = GdsMode::kAuto;

  // Defaults overridden by the TENSORFERRY_* environment variables that are set. Errors:
  // kInvalidArgument naming the variable and its value.
  static Result<LoadOptions> FromEnvironment();
};

// A placement from name prefixes, as accelerate's device_map: a tensor goes to the device of the
// longest prefix that matches its name on a component boundary ("model.layers.1" matches
// "model.layers.1.mlp.weight" and "model.layers.1", not "model.layers.10.x"; "" matches every
// name), else to `fallback`.
std::function<Device(const TensorInfo&)> Placement(std::vector<std::pair<std::string, Device>> map,
                                                   Device fallback = Device::CPU());

struct Batch {
  size_t index = 0;  // 0, 1, ... in delivery order
  size_t count = 0;  // batches in this load
  std::vector<Tensor> tensors;
  uint64_t bytes = 0;
  Device device;  // where every tensor of the batch is
};

// A caller-provided destination for one tensor (Loader::LoadInto): `capacity` bytes at `data` on
// `device` (a device address for CUDA). The caller owns the memory and keeps it valid during the
// call.
struct Destination {
  std::string name;
  Device device;
  void* data = nullptr;
  uint64_t capacity = 0;
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

  // Device loading (zero for host-only loads).
  std::string device;                // "cpu", "cuda:0", or "mixed" (a placement used several)
  uint64_t device_tensors = 0;       // tensors delivered to CUDA devices
  uint64_t device_bytes = 0;         // their bytes
  uint64_t device_batches = 0;       // batches bound for CUDA devices
  uint64_t device_buffer_bytes = 0;  // device memory allocated for them (tensors plus padding)
  uint64_t staged_bytes = 0;         // bytes through the pinned staging ring
  uint64_t gds_bytes = 0;            // bytes read by cuFile straight into device memory
  std::string gds_reason;            // why GDS was not used (for some or all bytes); "" if it was
  uint64_t pinned_bytes = 0;         // pinned staging memory the loader holds (all devices)
  // Highest bytes of device batch buffers live at once during the load (summed over devices;
  // buffers still held from earlier loads included): what device_budget bounds.
  uint64_t peak_device_bytes = 0;
};

class Loader;

// A pull-style load (Loader::Iterate): the batches of Stream, in the same order, one per Next(),
// with the same budgets, errors and statistics. While the caller handles the batch Next returned,
// the next batch is read ahead on a helper thread when its memory fits its budget then (double
// buffering, as Stream).
// Lifetime: borrows its Loader, which must outlive it; destroying it (or moving from it) waits for
// the read ahead in flight and abandons the rest of the load (tensors handed out stay valid).
// Thread-safety: one thread at a time; while it exists, the Loader may not start another load
// (Stream, Load, LoadInto, Iterate) and must not be used from another thread except to set
// LoadOptions::cancel (the batch being read stops within a chunk per worker; Next returns
// kCancelled).
class BatchIterator {
 public:
  BatchIterator(BatchIterator&&) noexcept;
  BatchIterator& operator=(BatchIterator&&) noexcept;
  ~BatchIterator();

  // The next batch, or std::nullopt once every batch was delivered (Loader::stats() then holds
  // the load's totals). Errors: those of Stream (kIoError, kUnexpectedEof, kBudgetExceeded when
  // the caller still holds so much that the next batch cannot fit, kCancelled). After an error or
  // the end, Next returns std::nullopt.
  Result<std::optional<Batch>> Next();

 private:
  friend class Loader;
  struct State;
  explicit BatchIterator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class Loader {
 public:
  // Errors: kInvalidArgument (chunk_size 0, staging smaller than two slots), kUnsupported (an
  // engine not built yet), for a CUDA `device`: kCudaNotFound / kCudaSymbolMissing (the runtime
  // does not load: every candidate with its reason), kCudaNoDevice, kGdsUnavailable (gds kOn);
  // those of Checkpoint::Open for the path overload.
  static Result<std::unique_ptr<Loader>> Open(std::shared_ptr<const Checkpoint> checkpoint,
                                              const LoadOptions& options = {});
  static Result<std::unique_ptr<Loader>> Open(const std::string& path,
                                              const LoadOptions& options = {});
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  const std::shared_ptr<const Checkpoint>& checkpoint() const noexcept;

  // What a load of `selection` delivers (names in output order, dtypes, local shapes under
  // LoadOptions::shard, byte counts, tied aliases resolved) and reads. Pure: no I/O, may be called
  // at any time. Errors: those of DescribeSelection.
  Result<Description> Describe(const Selection& selection) const;

  // The plan a load of `selection` would execute. Errors: those of Selection::Resolve and MakePlan.
  Result<Plan> MakePlan(const Selection& selection) const;

  // Loads batch by batch, calling `on_batch` for each on the calling thread (a loop over Iterate's
  // Next); a non-OK status from the callback stops the load and is returned. Errors: those of MakePlan, kIoError,
  // kUnexpectedEof (a file shorter than its header promises, e.g. truncated since opening),
  // kBudgetExceeded (see the file comment).
  Status Stream(const Selection& selection, const std::function<Status(Batch)>& on_batch);

  // Starts a load of `selection` whose batches the caller pulls with BatchIterator::Next (see
  // there); Stream is a loop over it. Errors: those of MakePlan and of opening the files and
  // devices, before any read.
  Result<BatchIterator> Iterate(const Selection& selection);

  // Loads every selected tensor and returns them all (in checkpoint order). With a budget, the
  // total must fit it (kBudgetExceeded otherwise: use Stream).
  Result<std::vector<Tensor>> Load(const Selection& selection = Selection::All());

  // Reads the named tensors into caller-provided memory, host or device, each destination at least
  // as large as its tensor (the bytes past the tensor are left untouched). Host destinations are
  // read by the engine, device ones through the device pipeline. No budget applies (the memory is
  // the caller's). With LoadOptions::shard, each destination receives the tensor's slice (local
  // row-major bytes; its capacity is checked against the slice's size) and a tied alias its
  // target's slice; host rows are read exactly, device slices on dims > 0 as 2D copies.
  // Errors, all checked before any read: kNotFound (a name not in the checkpoint),
  // kInvalidArgument (a tensor named twice, a null destination for a non-empty tensor, a capacity
  // below the tensor's (slice's) size, two destinations overlapping on one device: the message
  // names the tensors and sizes; the errors of SliceOf), those of the device (kCudaNotFound,
  // kCudaNoDevice); then the read errors of Stream. After an error the destinations' contents are
  // unspecified.
  Status LoadInto(std::span<const Destination> destinations);

  // Totals of the last Stream, Load or LoadInto.
  LoadStats stats() const;

 private:
  struct Impl;
  friend struct BatchIterator::State;
  explicit Loader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorferry

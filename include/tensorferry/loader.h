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
// the caller drops the last Tensor of that batch. Batches hold at most half the budget; when a
// selected tensor is larger than half, host batches hold at most the budget less the largest
// tensor and a tensor over that has a batch of its own (the whole budget when that would leave
// batches under a quarter of it, and on a CUDA device; two such tensors that would pass the budget
// together get the next smaller batch delivered between them, ahead of its file order, while one
// is left: PlanOptions::alone_budget), so that while the caller handles batch b,
// batch b + 1 is read on a helper thread (double buffering) whenever its bytes fit at that moment;
// when the caller still holds batch b - 1 then (a loop holds it while asking for batch b), a host
// batch b + 1 is read as soon as the caller drops it.
// Iterate() (pull: BatchIterator::Next) and Stream() (push: a loop over Next) deliver batches one
// at a time; if the caller still holds so much of earlier batches
// that the next one cannot fit, Stream returns kBudgetExceeded rather than wait forever (nothing
// else can free it). The mmap engine holds no tensor memory of its own (the page cache does), so
// the budget only shapes its batches; the exception is a tensor-parallel slice of several ranges
// (rows of a dim > 0 split), which it copies into pooled host memory that the tensor owns: those
// copies keep their bytes of the budget until the last tensor in their buffer is dropped, as a
// copying engine's batches do (so Load refuses up front when the copies and a batch cannot fit
// together).
//
// Device loads (LoadOptions::device, or a per-tensor LoadOptions::placement; docs/gpu.md): a batch
// bound for CUDA device d gets one device buffer (one cudaMalloc, from a budgeted allocator), its
// read tasks go through the device pipeline: the same read engine reads each chunk into a slot of
// a pinned staging ring (O_DIRECT when the loader's direct policy chooses it for the file), and a
// cudaMemcpyAsync moves it to the tensor's final place; or, with GPUDirect Storage, cuFile reads
// straight into the buffer. The tensors are views co-owning the buffer: cudaFree runs when the last
// of them goes. The pipeline (its pinned ring, streams and cuFile driver) is made once per
// Loader and device and reused by every later batch and load, and when the Loader goes it is kept
// for the next Loader of the same configuration in the process (LoadOptions::keep_staging;
// ReleaseIdleStaging in device.h frees what is kept). Batches never mix devices: a placed
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
// Errors name the file and byte offset, and the tensor where one is at fault (checksums, shapes;
// a failed read names the file range, not the tensors it held). A failed batch releases its
// memory and hands no tensor of it to the caller.
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
#include "tensorferry/options.h"
#include "tensorferry/plan.h"
#include "tensorferry/shard.h"
#include "tensorferry/stats.h"
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

// The description of `selection` over `checkpoint` for rank tensor_parallel->rank of
// tensor_parallel->world (no slicing when `tensor_parallel` is null; ties come from
// tensor_parallel->spec). Pure: no I/O. Errors: kNotFound (a name that is neither a tensor nor a
// tied alias of one), kInvalidArgument (a tie whose target is not in the checkpoint or whose alias
// in the files differs from it; the errors of SliceOf).
Result<Description> DescribeSelection(const Checkpoint& checkpoint, const Selection& selection,
                                      const TensorParallelOptions* tensor_parallel);

// Whether this process can read with `engine` here (tensorferry doctor reports it): io_uring needs
// a build with liburing and a kernel and seccomp policy that allow a ring (containers often refuse
// io_uring_setup; the error says how it failed), and Engine::kAuto then reads local files with
// pread; the other engines are always available. Checked once per process; thread-safe.
Status EngineAvailable(Engine engine);

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

class Loader;

// A pull-style load (Loader::Iterate): the batches of Stream, in the same order, one per Next(),
// with the same budgets, errors and statistics. While the caller handles the batch Next returned,
// the next batch is read ahead on a helper thread when its memory fits its budget then, or for
// host batches as soon as the caller drops earlier batches (double buffering, as Stream).
// Lifetime: borrows its Loader, which must outlive it; destroying it waits for the read ahead in
// flight and abandons the rest of the load (tensors handed out stay valid). Moving hands the load
// to the target (assigning onto an iterator first abandons that one's load); a moved-from
// iterator's Next returns std::nullopt.
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
  // The options are checked and clamped by LoadOptions::Validated (options.h) first.
  // Errors: those of Validated, kInvalidArgument (staging smaller than two slots), kUnsupported (an
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
  // LoadOptions::tensor_parallel, byte counts, tied aliases resolved) and reads. Pure: no I/O, may
  // be called at any time. Errors: those of DescribeSelection.
  Result<Description> Describe(const Selection& selection) const;

  // The plan a load of `selection` would execute. Errors: those of Selection::Resolve and MakePlan.
  Result<Plan> MakePlan(const Selection& selection) const;

  // Loads batch by batch, calling `on_batch` for each on the calling thread (a loop over Iterate's
  // Next); a non-OK status from the callback stops the load and is returned. Errors: those of
  // MakePlan, kIoError, kUnexpectedEof (a file shorter than its header promises, e.g. truncated
  // since opening), kBudgetExceeded (see the file comment).
  Status Stream(const Selection& selection, const std::function<Status(Batch)>& on_batch);

  // Starts a load of `selection` whose batches the caller pulls with BatchIterator::Next (see
  // there); Stream is a loop over it. Errors: those of MakePlan and of opening the files and
  // devices, before any read.
  Result<BatchIterator> Iterate(const Selection& selection);

  // Loads every selected tensor and returns them all (in checkpoint order). With a budget, the
  // total must fit it (kBudgetExceeded otherwise: use Stream).
  Result<std::vector<Tensor>> Load(const Selection& selection = Selection::All());
  // The check Load makes before any read: every device's total of `selection` fits its budget
  // (the host's: `budget`, or the memory limit's when that set it; a CUDA device's: its batches'
  // buffers, alignment padding included, as its allocator charges them). Errors: kBudgetExceeded
  // naming the totals and the limit, those of MakePlan. For callers that load a selection in
  // parts but promise it whole (the Python Loader's load() with a progress bar, file by file).
  Status CheckFitsAtOnce(const Selection& selection = Selection::All()) const;

  // Reads the named tensors into caller-provided memory, host or device, each destination at least
  // as large as its tensor (the bytes past the tensor are left untouched). Host destinations are
  // read by the engine, device ones through the device pipeline. No budget applies (the memory is
  // the caller's). With LoadOptions::tensor_parallel, each destination receives the tensor's slice
  // (local row-major bytes; its capacity is checked against the slice's size) and a tied alias its
  // target's slice; host rows are read exactly, device slices on dims > 0 as 2D copies.
  // Errors, all checked before any read: kNotFound (a name not in the checkpoint),
  // kInvalidArgument (a tensor named twice, a null destination for a non-empty tensor, a capacity
  // below the tensor's (slice's) size, two destinations overlapping on one device: the message
  // names the tensors and sizes; the errors of SliceOf), those of the device (kCudaNotFound,
  // kCudaNoDevice); then the read errors of Stream. With checksums (LoadOptions::verify), whole
  // host destinations are hashed as their bytes land and whole device destinations in the
  // staging slots: a mismatch is kChecksumMismatch naming file, tensor, chunk and byte ranges
  // (a slice over the chunks it holds whole, LoadStats::verify_partial_tensors; destinations read
  // with GDS and slices holding no whole chunk are counted in verify_skipped_tensors). After
  // an error the destinations' contents are unspecified: bytes that did not match may be in them.
  Status LoadInto(std::span<const Destination> destinations);

  // Totals of the last Stream, Load or LoadInto. Before the first load: zeros, with what Open
  // decided (engine, engine_reason, filesystem).
  LoadStats stats() const;

 private:
  struct Impl;
  friend struct BatchIterator::State;
  explicit Loader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorferry

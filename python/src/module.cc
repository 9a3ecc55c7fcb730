// tensorferry._core: the compiled half of the Python package (the other half is
// python/tensorferry/*.py, which gives these functions the safetensors-compatible names).
//
// Reader wraps one Checkpoint (a single file for safe_open, a file, directory or index for
// Loader) with its files, opened once when the Reader opens (every later read, partial reads and
// the Loader's, goes to the files whose headers were validated), and a lazily created Loader.
// Every call that reads file bytes or waits releases the GIL (WithoutGil). A Reader may be shared
// by threads: calls on it are serialized by a mutex, taken only after the GIL is released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distributed.h"
#include "errors.h"
#include "export.h"
#include "gil.h"
#include "interrupt.h"
#include "options.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/cuda.h"
#include "tensorferry/device.h"
#include "tensorferry/env.h"
#include "tensorferry/format.h"
#include "tensorferry/loader.h"
#include "tensorferry/mapping.h"
#include "tensorferry/plan.h"
#include "tensorferry/shard.h"
#include "tensorferry/size.h"
#include "tensorferry/writer.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

Framework ToFramework(int framework) {
  if (framework < 0 || framework > 2) {
    throw StatusError(
        Status(Code::kInvalidArgument, "framework must be 0 (numpy), 1 (torch) or 2 (dlpack)"));
  }
  return static_cast<Framework>(framework);
}

nb::list ShapeList(const std::vector<uint64_t>& shape) {
  nb::list out;
  for (uint64_t d : shape) out.append(d);
  return out;
}

bool SameOwner(const std::shared_ptr<const void>& a, const std::shared_ptr<const void>& b) {
  return !a.owner_before(b) && !b.owner_before(a);
}

// The dtype's header name as a Python string, made once per dtype.
nb::str DTypeStr(DType dtype) {
  static nb::str* names[kNumDTypes] = {};
  nb::str*& name = names[static_cast<int>(dtype)];
  if (name == nullptr) {
    const std::string_view n = DTypeName(dtype);
    name = new nb::str(n.data(), n.size());  // never freed: lives as long as the module
  }
  return *name;
}

// (name, dtype name, array) triples (kExportedArray: the array's index). Consecutive tensors with
// one owner (a batch's buffer) share one Keeper, so the live-buffer count follows the real buffers.
constexpr size_t kExportedArray = 2;
nb::list ExportTensors(Framework framework, std::vector<Tensor>& tensors) {
  nb::list out;
  size_t i = 0;
  while (i < tensors.size()) {
    size_t j = i + 1;
    uint64_t bytes = tensors[i].size();
    while (j < tensors.size() && SameOwner(tensors[i].owner(), tensors[j].owner())) {
      bytes += tensors[j].size();
      ++j;
    }
    auto keeper = std::make_shared<Keeper>(tensors[i].owner(), bytes);
    for (; i < j; ++i) {
      const Tensor& t = tensors[i];
      out.append(nb::make_tuple(
          t.name(), DTypeStr(t.dtype()),
          Export(framework, keeper, t.data(), t.size(), t.dtype(), t.shape(), t.device())));
    }
  }
  return out;
}

[[noreturn]] void RaiseMissingTensor(const std::string& name) {
  // The reference's exception and message for a name the file does not hold.
  nb::object exc = SafetensorErrorType()(nb::str(("File does not contain tensor " + name).c_str()));
  exc.attr("code") = "not_found";
  exc.attr("category") = "not_found";
  PyErr_SetObject(SafetensorErrorType().ptr(), exc.ptr());
  throw nb::python_error();
}

// One tensor a load delivers, as Python sees it (Loader::Describe): tensorferry._core.Output.
struct PyOutput {
  std::string name;    // as delivered (a tied alias under its own name)
  std::string dtype;   // safetensors dtype name
  std::string stored;  // the tensor of the files whose bytes it is (its target for an alias)
  std::vector<uint64_t> shape;  // local shape (the tensor-parallel slice applied)
  uint64_t bytes = 0;           // local bytes
  uint32_t file = 0;            // index of the file holding `stored`
  bool alias = false;           // a tied alias of `stored`
};

class BatchStream;

class Reader {
 public:
  // single_file: `path` must be one safetensors file (safe_open). Otherwise a file, a directory or
  // an index (Loader).
  Reader(const std::string& path, bool single_file, const nb::dict& options)
      : options_(MakeLoadOptions(options)) {
    Check(CheckMappedFiles());  // tensors handed out earlier lost bytes: say so at the next call
    options_.cancel = cancel_;
    WithoutGil release;
    // The checkpoint opens each file once and owns it (checkpoint.h): the header is read through
    // the descriptor every later read uses, and a file replaced meanwhile is reported at the next
    // load.
    if (single_file) {
      const std::vector<std::string> paths{path};
      checkpoint_ = Unwrap(Checkpoint::OpenFiles(paths));
    } else {
      checkpoint_ = Unwrap(Checkpoint::Open(path));
    }
    Init();
  }

  // A Reader of `other`'s checkpoint (no file is opened again) with its own options.
  Reader(const Reader& other, const nb::dict& options)
      : checkpoint_(other.checkpoint_), options_(MakeLoadOptions(options)) {
    Check(CheckMappedFiles());
    options_.cancel = cancel_;
    WithoutGil release;
    Init();
  }

  nb::object CooperativePlan(const std::optional<std::vector<std::string>>& names,
                             const std::string& spec, uint32_t world, uint64_t round_bytes) const {
    return python::CooperativePlan(*checkpoint_, names, spec, world, round_bytes);
  }

  std::vector<std::string> Names(bool by_offset) const {
    std::vector<std::string> names;
    names.reserve(checkpoint_->tensors().size());
    for (const TensorInfo& t : checkpoint_->tensors()) names.push_back(t.name);
    if (!by_offset) std::sort(names.begin(), names.end());
    return names;
  }

  std::vector<std::string> Files() const {
    std::vector<std::string> out;
    for (const FileInfo& f : checkpoint_->files()) out.push_back(f.path);
    return out;
  }

  uint64_t TotalBytes() const { return checkpoint_->total_tensor_bytes(); }
  size_t Size() const { return checkpoint_->tensors().size(); }
  bool Contains(const std::string& name) const { return checkpoint_->Find(name) != nullptr; }

  // (dtype name, shape, bytes, file index, absolute offset)
  nb::tuple Info(const std::string& name) const {
    const TensorInfo& t = Lookup(name);
    const std::string_view dtype = DTypeName(t.dtype);
    return nb::make_tuple(nb::str(dtype.data(), dtype.size()), ShapeList(t.shape), t.size, t.file,
                          t.offset);
  }

  // The dtypes among `names` (all when None): {dtype name: [names of F4 tensors whose last
  // dimension is odd]} for F4, {dtype name: []} otherwise. One pass in C++ instead of one call
  // per tensor from Python.
  nb::dict DTypes(const std::optional<std::vector<std::string>>& names) const {
    bool seen[kNumDTypes] = {};
    std::vector<std::string> odd_f4;
    auto visit = [&](const TensorInfo& t) {
      seen[static_cast<int>(t.dtype)] = true;
      if (t.dtype == DType::kF4 && (t.shape.empty() || t.shape.back() % 2 != 0)) {
        odd_f4.push_back(t.name);
      }
    };
    if (names) {
      for (const std::string& n : *names) visit(Lookup(n));
    } else {
      for (const TensorInfo& t : checkpoint_->tensors()) visit(t);
    }
    nb::dict out;
    for (int i = 0; i < kNumDTypes; ++i) {
      if (!seen[i]) continue;
      nb::list odd;
      if (static_cast<DType>(i) == DType::kF4) {
        for (const std::string& n : odd_f4) odd.append(n);
      }
      out[DTypeStr(static_cast<DType>(i))] = odd;
    }
    return out;
  }

  // The "__metadata__" of file `index` as a dict, or None when the header has none.
  nb::object FileMetadata(size_t index) {
    if (index >= checkpoint_->files().size()) throw nb::index_error("file index out of range");
    const FileInfo& file = checkpoint_->files()[index];
    bool present = !file.metadata.empty();
    if (!present) {
      // An empty table is either "__metadata__": {} or no "__metadata__" at all; only the header
      // tells (read again, once, only in this case).
      WithoutGil release;
      Lock lock(*this);
      if (closed_) throw StatusError(Status(Code::kInvalidArgument, "the file is closed"));
      std::optional<bool>& known = has_metadata_[index];
      if (!known) {
        known = Unwrap(ReadHeader(*Unwrap(checkpoint_->File(static_cast<uint32_t>(index)))))
                    .has_metadata;
      }
      present = *known;
    }
    if (!present) return nb::none();
    nb::dict d;
    for (const auto& [k, v] : file.metadata)
      d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
    return d;
  }

  nb::dict IndexMetadata() const {
    nb::dict d;
    for (const auto& [k, v] : checkpoint_->index_metadata()) {
      d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
    }
    return d;
  }

  // Every selected tensor (all when `names` is None), through the Loader: one buffer per batch.
  nb::list Load(const std::optional<std::vector<std::string>>& names, int framework) {
    const Framework fw = ToFramework(framework);
    if (names) DescribeNames(names);  // SafetensorError naming a missing tensor
    // Locked on this thread (a stream callback reading through its own loader is refused here),
    // then loaded on Interruptible's helper thread.
    std::optional<Lock> lock;
    {
      WithoutGil release;
      lock.emplace(*this);
    }
    cancel_->store(false);
    std::vector<Tensor> tensors = Interruptible(*cancel_, [&] {
      Loader& loader = EnsureLoader();
      const Selection selection = names ? Selection::Names(*names) : Selection::All();
      Result<std::vector<Tensor>> got = loader.Load(selection);
      SetStats(loader.stats());
      return Unwrap(std::move(got));
    });
    lock.reset();
    return ExportTensors(fw, tensors);
  }

  // One tensor. Large tensors go through the Loader (parallel chunked reads into a pooled
  // buffer); small ones are read with one positional read on this thread into a heap block, which
  // costs far less per tensor than a batch and never uses a mapping per tensor.
  nb::object GetTensor(const std::string& name, int framework) {
    Check(CheckMappedFiles());
    const Framework fw = ToFramework(framework);
    const TensorInfo& t = Lookup(name);
    if (t.size >= 2 * options_.chunk_size || options_.device.is_cuda() || options_.placement) {
      std::vector<std::string> one{name};
      nb::list got = Load(one, framework);
      return nb::borrow<nb::tuple>(got[0])[kExportedArray];
    }
    std::shared_ptr<std::byte> block;
    {
      WithoutGil release;
      block = ReadBytes(t, 0, t.size);
    }
    auto keeper = std::make_shared<Keeper>(std::shared_ptr<const void>(block), t.size);
    return Export(fw, keeper, block.get(), t.size, t.dtype, t.shape);
  }

  // Bytes [begin, end) of tensor `name` in a block of their own: as a one-dimensional uint8 array,
  // or, given `shape` (in the header's terms), as that shape of the tensor's dtype.
  nb::object ReadRange(const std::string& name, uint64_t begin, uint64_t end, int framework,
                       const std::optional<std::vector<uint64_t>>& shape) {
    Check(CheckMappedFiles());
    const Framework fw = ToFramework(framework);
    const TensorInfo& t = Lookup(name);
    if (begin > end || end > t.size) {
      throw StatusError(Status(Code::kInvalidArgument, "byte range [" + std::to_string(begin) +
                                                           ", " + std::to_string(end) +
                                                           ") outside tensor \"" + name + "\" of " +
                                                           std::to_string(t.size) + " bytes"));
    }
    if (shape) {
      const Result<uint64_t> bytes = TensorByteSize(t.dtype, *shape);
      if (!bytes.ok() || *bytes != end - begin) {
        throw StatusError(Status(Code::kInvalidArgument,
                                 "shape does not match the byte range of tensor \"" + name + "\""));
      }
    }
    std::shared_ptr<std::byte> block;
    {
      WithoutGil release;
      block = ReadBytes(t, begin, end - begin);
    }
    auto keeper = std::make_shared<Keeper>(std::shared_ptr<const void>(block), end - begin);
    if (shape) return Export(fw, keeper, block.get(), end - begin, t.dtype, *shape);
    const std::vector<uint64_t> flat{end - begin};
    return Export(fw, keeper, block.get(), end - begin, DType::kU8, flat);
  }

  // Calls callback(index, count, bytes, [(name, array), ...], device) for each batch of
  // Loader::Stream (device: "cpu", "cuda:N").
  void Stream(const std::optional<std::vector<std::string>>& names, int framework,
              const nb::callable& callback) {
    const Framework fw = ToFramework(framework);
    if (names) DescribeNames(names);  // SafetensorError naming a missing tensor
    std::optional<nb::python_error> raised;
    Status status;
    {
      WithoutGil release;
      Lock lock(*this);
      Loader& loader = EnsureLoader();
      const Selection selection = names ? Selection::Names(*names) : Selection::All();
      status = loader.Stream(selection, [&](Batch batch) -> Status {
        nb::gil_scoped_acquire acquire;
        try {
          nb::list tensors = ExportTensors(fw, batch.tensors);
          batch.tensors.clear();
          callback(batch.index, batch.count, batch.bytes, tensors, DeviceName(batch.device));
        } catch (nb::python_error& e) {
          raised.emplace(std::move(e));
          return Status(Code::kInternal, "the stream callback raised an exception");
        }
        return Status::Ok();
      });
      SetStats(loader.stats());
    }
    if (raised) throw std::move(*raised);
    Check(status);
  }

  // The tensors of `names` (all when None) grouped as a plan with `budget` would batch them.
  std::vector<std::vector<std::string>> PlanGroups(
      const std::optional<std::vector<std::string>>& names, uint64_t budget, bool allow_oversized,
      const std::string& order) const {
    const Selection selection = names ? Selection::Names(*names) : Selection::All();
    PlanOptions p;
    p.chunk_size = options_.chunk_size;
    p.budget = budget;
    p.allow_oversized = allow_oversized;
    p.order = Unwrap(ParseDeliveryOrder(order));
    const std::vector<uint32_t> indices = Unwrap(selection.Resolve(*checkpoint_));
    const Plan plan = Unwrap(MakePlan(*checkpoint_, indices, p));
    std::vector<std::vector<std::string>> groups;
    for (const PlanBatch& b : plan.batches) {
      auto& g = groups.emplace_back();
      for (const PlannedTensor& t : b.tensors) g.push_back(checkpoint_->tensors()[t.tensor].name);
    }
    return groups;
  }

  // Reads tensors into caller memory: entries are (name, device string, address, capacity in
  // bytes); Loader::LoadInto checks names, capacities and overlaps before any read.
  void LoadInto(const nb::list& entries) {
    std::vector<Destination> destinations;
    destinations.reserve(entries.size());
    for (nb::handle h : entries) {
      nb::tuple e = nb::cast<nb::tuple>(h);
      if (e.size() != 4) throw nb::value_error("entries are (name, device, address, capacity)");
      Destination d;
      d.name = ToText(e[0], "tensor name");
      d.device = Unwrap(ParseDevice(ToText(e[1], "device")));
      d.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(e[2]));
      d.capacity = nb::cast<uint64_t>(e[3]);
      destinations.push_back(std::move(d));
    }
    std::optional<Lock> lock;  // as in Load
    {
      WithoutGil release;
      lock.emplace(*this);
    }
    cancel_->store(false);
    Interruptible(*cancel_, [&] {
      Loader& loader = EnsureLoader();
      const Status s = loader.LoadInto(destinations);
      SetStats(loader.stats());
      Check(s);
    });
  }

  nb::dict Stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return StatsDict(stats_);
  }

  nb::dict Options() const { return OptionsDict(options_); }

  // What a load of `names` (all when None) delivers, in output order (Loader::Describe).
  std::vector<PyOutput> Describe(const std::optional<std::vector<std::string>>& names) const {
    const Description d = DescribeNames(names);
    std::vector<PyOutput> out;
    out.reserve(d.outputs.size());
    for (const OutputInfo& o : d.outputs) {
      const TensorInfo& t = checkpoint_->tensors()[o.tensor];
      out.push_back(
          {o.name, std::string(DTypeName(o.dtype)), t.name, o.shape, o.bytes, t.file, o.alias});
    }
    return out;
  }

  // Starts a load whose batches are taken with BatchStream::Next (Loader::Iterate).
  std::unique_ptr<BatchStream> Iterate(const std::optional<std::vector<std::string>>& names,
                                       int framework);

  // Drops the loader (its buffer pool and threads). Tensors already handed out stay valid. The
  // files are the checkpoint's: they close with the Reader.
  void Close() {
    WithoutGil release;
    Lock lock(*this);
    closed_ = true;
    loader_.reset();
  }

 private:
  friend class BatchStream;

  // The rest of construction, once checkpoint_ is set.
  void Init() {
    has_metadata_.resize(checkpoint_->files().size());
    if (options_.device.is_cuda() && !options_.placement) {
      // A CUDA target is checked now, so that opening says at once why there is no device
      // (the runtime that did not load, or the device count), and the pipeline is made once.
      loader_ = Unwrap(Loader::Open(checkpoint_, options_));
    }
  }

  // Serializes calls on one Reader. Construct only with the GIL released. While an iteration
  // (BatchStream) is open, other calls fail at once instead of waiting for an iteration that may
  // never be resumed; its own steps (`step`) take the lock for the step only.
  class Lock {
   public:
    explicit Lock(Reader& r, bool step = false) : r_(r) {
      if (r.lock_owner_.load() == std::this_thread::get_id()) {
        throw StatusError(Status(Code::kInvalidArgument,
                                 "this loader is busy on this thread: a stream callback may not "
                                 "read through the loader that called it"));
      }
      if (!step) ThrowIfStreaming();
      r.mu_.lock();
      if (!step && r.streaming_.load()) {
        r.mu_.unlock();
        ThrowIfStreaming();
      }
      r.lock_owner_.store(std::this_thread::get_id());
    }
    ~Lock() {
      r_.lock_owner_.store(std::thread::id());
      r_.mu_.unlock();
    }
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    void ThrowIfStreaming() const {
      if (r_.streaming_.load()) {
        throw StatusError(Status(Code::kInvalidArgument,
                                 "this loader is busy: an iteration over its batches is in "
                                 "progress; finish or close it first"));
      }
    }
    Reader& r_;
  };

  void SetStats(const LoadStats& stats) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = stats;
  }

  // DescribeSelection under this reader's options. Raises SafetensorError (as the reference
  // does) for a name that is neither a tensor nor a tied alias of one.
  Description DescribeNames(const std::optional<std::vector<std::string>>& names) const {
    const TensorParallelOptions* shard = options_.shard ? &*options_.shard : nullptr;
    auto describe = [&](const Selection& selection) {
      return DescribeSelection(*checkpoint_, selection, shard);
    };
    Result<Description> d = describe(names ? Selection::Names(*names) : Selection::All());
    if (!d.ok() && d.status().code() == Code::kNotFound && names) {
      for (const std::string& n : *names) {  // which name: the reference's error names it
        Result<Description> one = describe(Selection::Names({n}));
        if (!one.ok() && one.status().code() == Code::kNotFound) RaiseMissingTensor(n);
      }
    }
    return Unwrap(std::move(d));
  }

  const TensorInfo& Lookup(const std::string& name) const {
    const TensorInfo* t = checkpoint_->Find(name);
    if (t == nullptr) RaiseMissingTensor(name);
    return *t;
  }

  // REQUIRES: the lock is held.
  Loader& EnsureLoader() {
    if (closed_) throw StatusError(Status(Code::kInvalidArgument, "the loader is closed"));
    if (!loader_) loader_ = Unwrap(Loader::Open(checkpoint_, options_));
    return *loader_;
  }

  // Reads `length` bytes of `t` from `begin` into a new block. Takes the lock. REQUIRES: the GIL
  // is released.
  std::shared_ptr<std::byte> ReadBytes(const TensorInfo& t, uint64_t begin, uint64_t length) {
    std::shared_ptr<std::byte> block = AllocateBytes(length);
    if (length == 0) return block;
    // Positional reads on one file are safe concurrently; the lock only guards against Close().
    {
      Lock lock(*this);
      if (closed_) throw StatusError(Status(Code::kInvalidArgument, "the file is closed"));
    }
    const std::shared_ptr<const SourceFile> file = Unwrap(checkpoint_->File(t.file));
    Check(ReadFully(*file, t.offset + begin, std::span<std::byte>(block.get(), length)));
    return block;
  }

  std::shared_ptr<const Checkpoint> checkpoint_;
  // LoadOptions::cancel of every load: cleared when a load starts, set by Ctrl-C (Interruptible)
  // or by closing a stream.
  std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
  LoadOptions options_;
  std::mutex mu_;
  std::atomic<std::thread::id> lock_owner_{};
  std::atomic<bool> streaming_{false};
  mutable std::mutex stats_mu_;
  std::unique_ptr<Loader> loader_;
  bool closed_ = false;
  std::vector<std::optional<bool>> has_metadata_;  // per file, once asked (see FileMetadata)
  LoadStats stats_;
};

// Pull-style iteration for Python generators over Loader::Iterate: each next() takes the batch
// read ahead (or reads it) on the calling thread, with Ctrl-C seen on the main thread
// (Interruptible); the iterator reads the following batch ahead while the consumer holds this one.
// The Reader is busy (other calls raise) from Iterate until the end, an error, or Close().
class BatchStream {
 public:
  BatchStream(Reader& reader, Loader& loader, BatchIterator batches, Framework framework)
      : reader_(reader), loader_(loader), batches_(std::move(batches)), framework_(framework) {}

  ~BatchStream() {
    std::lock_guard<std::mutex> l(mu_);
    Stop();
  }
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // (index, count, bytes, [(name, array), ...], device) for the next batch, or None at the end.
  // Raises the load's error, if any, once the batches before it have been taken.
  nb::object Next() {
    std::unique_lock<std::mutex> step(mu_, std::defer_lock);  // Close() waits for this step
    std::optional<Reader::Lock> lock;
    {
      WithoutGil release;
      step.lock();
      if (closed_) {
        throw StatusError(
            Status(Code::kInvalidArgument, "the iteration was stopped: its Loader was closed"));
      }
      if (batches_) lock.emplace(reader_, /*step=*/true);
    }
    if (!batches_) return nb::none();
    Result<std::optional<Batch>> got = Status(Code::kInternal, "unset");
    try {
      got = Interruptible(*reader_.cancel_, [&] { return batches_->Next(); });
    } catch (...) {  // KeyboardInterrupt: the reads were cancelled; the iteration is over
      WithoutGil release;
      End();
      closed_ = true;
      throw;
    }
    if (!got.ok() || !*got) {
      {
        WithoutGil release;
        End();
      }
      Check(got.status());
      return nb::none();
    }
    Batch batch = std::move(**got);
    lock.reset();
    step.unlock();
    nb::list tensors = ExportTensors(framework_, batch.tensors);
    return nb::make_tuple(batch.index, batch.count, batch.bytes, tensors, DeviceName(batch.device));
  }

  // Stops the iteration (tensors already handed out stay valid), waiting for a step in flight on
  // another thread; a later Next raises.
  void Close() {
    WithoutGil release;
    std::lock_guard<std::mutex> l(mu_);
    Stop();
    closed_ = true;
  }

 private:
  // Cancels the reads in flight (the batch read ahead stops within a chunk) and ends. REQUIRES:
  // mu_ held.
  void Stop() {
    if (batches_) reader_.cancel_->store(true);
    End();
  }

  // Ends the iteration: the read ahead waited for, the load's figures kept, the Reader free again.
  // REQUIRES: mu_ held.
  void End() {
    if (!batches_) return;
    batches_.reset();
    reader_.SetStats(loader_.stats());
    reader_.streaming_.store(false);
  }

  Reader& reader_;
  Loader& loader_;  // the Reader's: kept while streaming_ (Reader::Close refuses then)
  std::mutex mu_;   // guards batches_ and closed_
  std::optional<BatchIterator> batches_;  // empty once ended
  const Framework framework_;
  bool closed_ = false;  // Close() was called: Next raises
};

std::unique_ptr<BatchStream> Reader::Iterate(const std::optional<std::vector<std::string>>& names,
                                             int framework) {
  const Framework fw = ToFramework(framework);
  if (names) DescribeNames(names);  // SafetensorError naming a missing tensor
  WithoutGil release;
  Lock lock(*this);  // busy while another iteration is open
  cancel_->store(false);
  Loader& loader = EnsureLoader();
  const Selection selection = names ? Selection::Names(*names) : Selection::All();
  BatchIterator batches = Unwrap(loader.Iterate(selection));
  streaming_.store(true);
  return std::make_unique<BatchStream>(*this, loader, std::move(batches), fw);
}

// --- tensor parallelism (shard.h) ---------------------------------------------------------------

// A rule as the JSON schema's dict: {"replicate": True} or {"split": dim[, "parts": [...] |
// "equal_parts": k]}.
nb::dict RuleDict(const ShardRule& rule) {
  nb::dict d;
  if (!rule.is_split()) {
    d["replicate"] = true;
    return d;
  }
  d["split"] = rule.dim;
  if (!rule.parts.empty()) {
    d["parts"] = ShapeList(rule.parts);
  } else if (rule.equal_parts != 0) {
    d["equal_parts"] = rule.equal_parts;
  }
  return d;
}

// What rank `rank` of `world` holds of a tensor (name, dtype name, full shape) under `rule`:
// {"rule": dict, "dim": int or None, "blocks": [(start, length), ...], "shape": [...],
// "bytes": int}. With ranges=True also "ranges": [(offset, length), ...] relative to the tensor's
// first byte (SliceByteRanges).
nb::dict SliceDict(const ShardRule& rule, const std::string& name, const std::string& dtype,
                   const std::vector<uint64_t>& shape, uint32_t rank, uint32_t world, bool ranges) {
  TensorInfo t;
  t.name = name;
  const std::optional<DType> d = DTypeFromName(dtype);
  if (!d) throw StatusError(Status(Code::kInvalidArgument, "unknown dtype \"" + dtype + "\""));
  t.dtype = *d;
  t.shape = shape;
  t.size = Unwrap(TensorByteSize(t.dtype, t.shape));
  const TensorSlice slice = Unwrap(SliceOf(t, rule, rank, world));
  nb::dict out;
  out["rule"] = RuleDict(slice.rule);
  out["dim"] = slice.rule.is_split() ? nb::cast(slice.rule.dim) : nb::none();
  nb::list blocks;
  for (const auto& [start, length] : slice.blocks) blocks.append(nb::make_tuple(start, length));
  out["blocks"] = blocks;
  out["shape"] = ShapeList(slice.shape);
  out["bytes"] = slice.bytes;
  if (ranges) {
    nb::list r;
    for (const auto& [offset, length] : SliceByteRanges(t, slice)) {
      r.append(nb::make_tuple(offset, length));
    }
    out["ranges"] = r;
  }
  return out;
}

ShardRule RuleFromJson(const std::string& json) {
  // One override entry parsed by the spec's own parser: the same checks and messages.
  const ShardSpec spec = Unwrap(ShardSpec::FromJson("{\"overrides\":{\"rule\":" + json + "}}"));
  return spec.overrides().front().second;
}

}  // namespace
}  // namespace tensorferry::python

namespace tensorferry::python {
namespace {

// entries: [(name, dtype name, shape, data address, byte length)]; the caller keeps the memory
// alive and unchanged for the duration of the call.
std::vector<TensorToWrite> ToWrite(const nb::list& entries) {
  std::vector<TensorToWrite> out;
  out.reserve(entries.size());
  for (nb::handle h : entries) {
    nb::tuple e = nb::cast<nb::tuple>(h);
    if (e.size() != 5) throw nb::value_error("entries are (name, dtype, shape, address, length)");
    TensorToWrite t;
    t.name = ToText(e[0], "tensor name");
    const std::string dtype = ToText(e[1], "dtype");
    const std::optional<DType> d = DTypeFromName(dtype);
    if (!d) {
      throw StatusError(Status(Code::kInvalidArgument,
                               "tensor \"" + t.name + "\": unknown dtype \"" + dtype + "\""));
    }
    t.dtype = *d;
    t.shape = nb::cast<std::vector<uint64_t>>(e[2]);
    const auto address = nb::cast<uintptr_t>(e[3]);
    const auto length = nb::cast<size_t>(e[4]);
    t.data = std::span<const std::byte>(reinterpret_cast<const std::byte*>(address), length);
    out.push_back(std::move(t));
  }
  return out;
}

Metadata ToMetadata(const std::optional<nb::dict>& metadata) {
  Metadata out;
  if (!metadata) return out;
  for (auto [k, v] : *metadata)
    out.emplace_back(ToText(k, "metadata key"), ToText(v, "metadata value"));
  return out;
}

nb::bytes Serialize(const nb::list& entries, const std::optional<nb::dict>& metadata) {
  const std::vector<TensorToWrite> tensors = ToWrite(entries);
  const Metadata meta = ToMetadata(metadata);
  const SerializedHeader header = Unwrap(SerializeHeader(tensors, meta));
  const uint64_t total = 8 + header.json.size() + header.data_size;
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (raw == nullptr) throw nb::python_error();
  nb::bytes out = nb::steal<nb::bytes>(raw);
  char* dst = PyBytes_AS_STRING(raw);
  {
    WithoutGil release;
    uint64_t n = header.json.size();
    for (int i = 0; i < 8; ++i) dst[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    std::memcpy(dst + 8, header.json.data(), header.json.size());
    char* p = dst + 8 + header.json.size();
    for (size_t i : header.order) {
      const auto& d = tensors[i].data;
      if (!d.empty()) std::memcpy(p, d.data(), d.size());
      p += d.size();
    }
  }
  return out;
}

void SerializeFile(const nb::list& entries, const std::optional<nb::dict>& metadata,
                   const std::string& path) {
  Check(CheckMappedFiles());  // the tensors to write may be views of a file that shrank
  const std::vector<TensorToWrite> tensors = ToWrite(entries);
  const Metadata meta = ToMetadata(metadata);
  Status s;
  {
    WithoutGil release;
    s = WriteFile(path, tensors, meta);
  }
  Check(s);
}

// The tensors of a whole safetensors file held in `data` (any object with the buffer protocol),
// as (name, dtype name, shape, array) in name order. The data section is copied once into a block
// all tensors share.
nb::list Deserialize(nb::handle data, int framework) {
  const Framework fw = ToFramework(framework);
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
  struct Release {
    Py_buffer* v;
    ~Release() { PyBuffer_Release(v); }
  } release_view{&view};
  const auto* bytes = static_cast<const std::byte*>(view.buf);
  const auto size = static_cast<uint64_t>(view.len);
  Header header;
  std::shared_ptr<std::byte> block;
  {
    WithoutGil release;
    header = Unwrap(ParseHeader(std::span<const std::byte>(bytes, size), size, {}, "<bytes>"));
    block = AllocateBytes(header.data_size);
    if (header.data_size != 0) {
      std::memcpy(block.get(), bytes + header.data_offset(), header.data_size);
    }
  }
  auto keeper = std::make_shared<Keeper>(std::shared_ptr<const void>(block), header.data_size);
  std::vector<const TensorEntry*> entries;
  for (const TensorEntry& t : header.tensors) entries.push_back(&t);
  std::sort(entries.begin(), entries.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->name < b->name; });
  nb::list out;
  for (const TensorEntry* t : entries) {
    const std::string_view dtype = DTypeName(t->dtype);
    out.append(nb::make_tuple(
        t->name, nb::str(dtype.data(), dtype.size()), ShapeList(t->shape),
        Export(fw, keeper, block.get() + t->begin, t->byte_size(), t->dtype, t->shape)));
  }
  return out;
}

}  // namespace
}  // namespace tensorferry::python

NB_MODULE(_core, m) {
  using namespace tensorferry;
  using namespace tensorferry::python;
  m.doc() = "tensorferry's compiled core (use the tensorferry package, not this module)";
  m.attr("__version__") = TENSORFERRY_VERSION_STRING;
  m.attr("SOURCE_HASH") = TENSORFERRY_SOURCE_HASH;
  RegisterErrors(m);
  RememberMainThread();
  RegisterDistributed(m);

  nb::class_<BatchStream>(m, "BatchStream")
      .def("next", &BatchStream::Next)
      .def("close", &BatchStream::Close);

  nb::class_<PyOutput>(m, "Output", "A tensor a load delivers (tensorferry::Loader::Describe)")
      .def_ro("name", &PyOutput::name)
      .def_ro("dtype", &PyOutput::dtype)
      .def_ro("stored", &PyOutput::stored)
      .def_ro("shape", &PyOutput::shape)
      .def_ro("bytes", &PyOutput::bytes)
      .def_ro("file", &PyOutput::file)
      .def_ro("alias", &PyOutput::alias)
      .def("__repr__", [](const PyOutput& o) {
        return "Output(" + o.name + ", " + o.dtype + ", " + ShapeText(o.shape) + ", " +
               std::to_string(o.bytes) + " bytes" + (o.alias ? ", alias of " + o.stored : "") + ")";
      });

  nb::class_<Reader>(m, "Reader")
      .def(nb::init<const std::string&, bool, const nb::dict&>(), nb::arg("path"),
           nb::arg("single_file"), nb::arg("options"))
      .def(nb::init<const Reader&, const nb::dict&>(), nb::arg("other"), nb::arg("options"),
           "A Reader of other's checkpoint (its open files) with its own options.")
      .def("cooperative_plan", &Reader::CooperativePlan, nb::arg("names").none(), nb::arg("spec"),
           nb::arg("world"), nb::arg("round_bytes"),
           "The schedule of a cooperative load of this checkpoint: (entries, outputs), see "
           "distributed.h.")
      .def("names", &Reader::Names, nb::arg("by_offset"))
      .def("files", &Reader::Files)
      .def("total_bytes", &Reader::TotalBytes)
      .def("__len__", &Reader::Size)
      .def("__contains__", &Reader::Contains)
      .def("info", &Reader::Info)
      .def("dtypes", &Reader::DTypes, nb::arg("names").none())
      .def("file_metadata", &Reader::FileMetadata)
      .def("index_metadata", &Reader::IndexMetadata)
      .def("describe", &Reader::Describe, nb::arg("names").none())
      .def("load", &Reader::Load, nb::arg("names").none(), nb::arg("framework"))
      .def("get_tensor", &Reader::GetTensor)
      .def("read_range", &Reader::ReadRange, nb::arg("name"), nb::arg("begin"), nb::arg("end"),
           nb::arg("framework"), nb::arg("shape").none() = nb::none())
      .def("stream", &Reader::Stream, nb::arg("names").none(), nb::arg("framework"),
           nb::arg("callback"))
      .def("plan_groups", &Reader::PlanGroups, nb::arg("names").none(), nb::arg("budget"),
           nb::arg("allow_oversized"), nb::arg("order"))
      .def("iterate", &Reader::Iterate, nb::arg("names").none(), nb::arg("framework"),
           nb::keep_alive<0, 1>())
      .def("load_into", &Reader::LoadInto, nb::arg("entries"))
      .def("stats", &Reader::Stats)
      .def("options", &Reader::Options)
      .def("close", &Reader::Close);

  nb::class_<ShardSpec>(m, "ShardSpec", "tensorferry::ShardSpec: tensor name -> shard rule")
      .def_static("none", &ShardSpec::None)
      .def_static("builtin", &ShardSpec::Builtin)
      .def_static("from_json",
                  [](const std::string& json) { return Unwrap(ShardSpec::FromJson(json)); })
      .def("to_json", &ShardSpec::ToJson)
      .def("rule_for",
           [](const ShardSpec& s, const std::string& name) { return RuleDict(s.RuleFor(name)); })
      .def("tie_target",
           [](const ShardSpec& s, const std::string& name) { return s.TieTarget(name); })
      .def("ties", [](const ShardSpec& s) { return s.ties(); })
      .def(
          "slice",
          [](const ShardSpec& s, const std::string& name, const std::string& dtype,
             const std::vector<uint64_t>& shape, uint32_t rank, uint32_t world, bool ranges) {
            return SliceDict(s.RuleFor(name), name, dtype, shape, rank, world, ranges);
          },
          nb::arg("name"), nb::arg("dtype"), nb::arg("shape"), nb::arg("rank"), nb::arg("world"),
          nb::arg("ranges") = false)
      .def("__eq__", [](const ShardSpec& a, const ShardSpec& b) { return a == b; })
      .def("__repr__", [](const ShardSpec& s) { return "ShardSpec(" + s.ToJson() + ")"; });
  m.def(
      "slice_of_rule",
      [](const std::string& rule_json, const std::string& name, const std::string& dtype,
         const std::vector<uint64_t>& shape, uint32_t rank, uint32_t world, bool ranges) {
        return SliceDict(RuleFromJson(rule_json), name, dtype, shape, rank, world, ranges);
      },
      nb::arg("rule_json"), nb::arg("name"), nb::arg("dtype"), nb::arg("shape"), nb::arg("rank"),
      nb::arg("world"), nb::arg("ranges") = false);
  m.def("serialize", &Serialize, nb::arg("entries"), nb::arg("metadata").none());
  m.def("serialize_file", &SerializeFile, nb::arg("entries"), nb::arg("metadata").none(),
        nb::arg("path"));
  m.def("deserialize", &Deserialize, nb::arg("data"), nb::arg("framework"));
  m.def("parse_size", [](const std::string& text) {
    const std::optional<uint64_t> v = ParseSize(text);
    if (!v) {
      throw StatusError(Status(Code::kInvalidArgument,
                               "not a size: \"" + text + "\" (e.g. 256MB, 1.5GiB, 4096)"));
    }
    return *v;
  });
  m.def("format_bytes", &FormatBytes);
  m.def("cuda_available", [] { return CudaAvailable(); });
  m.def("mapping_stats", [] {
    const MappingStats s = GetMappingStats();
    nb::dict d;
    d["live"] = s.live;
    d["leased"] = s.leased;
    d["copied"] = s.copied;
    d["faults"] = s.faults;
    d["unleasable"] = s.unleasable;
    return d;
  });
  m.def("check_mapped_files", [] { Check(CheckMappedFiles()); });
  m.def("set_mapping_leases", [](bool enabled) { SetMappingLeases(enabled); });
  m.def(
      "copy_to_host",
      [](nb::ndarray<> array) {
        // The bytes of any DLPack array, host or CUDA (a synchronous cudaMemcpy for device memory):
        // lets tests check what was exported without a CUDA-enabled framework.
        const size_t n = array.nbytes();
        const int type = array.device_type();
        Device device = Device::CPU();
        if (type == nb::device::cuda::value) {
          device = Device::CUDA(array.device_id());
        } else if (type != nb::device::cpu::value) {
          throw StatusError(Status(Code::kUnsupported,
                                   "copy_to_host: DLPack device type " + std::to_string(type)));
        }
        std::string bytes(n, '\0');
        Status s;
        {
          WithoutGil release;
          s = CopyToHost(device, array.data(), std::as_writable_bytes(std::span<char>(bytes)));
        }
        Check(s);
        return nb::bytes(bytes.data(), bytes.size());
      },
      nb::arg("array"), "The bytes of a DLPack array (host or CUDA) as bytes, copied to the host");
  m.def("layer_of",
        [](const std::string& name) -> std::optional<uint64_t> { return LayerOf(name); });
  m.def("dtype_bits", [](const std::string& name) {
    const std::optional<DType> d = DTypeFromName(name);
    if (!d) throw nb::key_error(name.c_str());
    return DTypeBits(*d);
  });
  m.def("exports_natively", [](const std::string& name, int framework) {
    const std::optional<DType> d = DTypeFromName(name);
    if (!d) throw nb::key_error(name.c_str());
    return ExportsNatively(*d, ToFramework(framework));
  });
  m.def("dtype_names", [] {
    std::vector<std::string> out;
    for (int i = 0; i < kNumDTypes; ++i) out.emplace_back(DTypeName(static_cast<DType>(i)));
    return out;
  });
  m.def(
      "gil_checks",
      [] { return nb::make_tuple(g_gil_sections.load(), g_gil_held_sections.load()); },
      "(C++ sections that release the GIL, those that found it still held) since import");
  m.def(
      "live_buffers", [] { return nb::make_tuple(Keeper::live_buffers(), Keeper::live_bytes()); },
      "(buffers, bytes) of loaded memory still referenced by arrays handed to Python");
}

#include "reader.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

#include "distributed.h"
#include "errors.h"
#include "export.h"
#include "gil.h"
#include "interrupt.h"
#include "iterator.h"
#include "options.h"
#include "tensorferry/env.h"
#include "tensorferry/format.h"
#include "tensorferry/mapping.h"
#include "tensorferry/plan.h"

namespace nb = nanobind;

namespace tensorferry::python {

Reader::Reader(const std::string& path, bool single_file, const nb::dict& options)
    : options_(MakeLoadOptions(options)) {
  Check(CheckMappedFiles());  // tensors handed out earlier lost bytes: say so at the next call
  options_.cancel = cancel_;
  // The checkpoint opens each file once and owns it (checkpoint.h): the header is read through
  // the descriptor every later read uses, and a file replaced meanwhile is reported at the next
  // load. Opening a remote checkpoint waits on the network (a header GET per file, a listing,
  // credentials): Ctrl-C abandons it.
  OpenOptions open;
  open.object_store = options_.object_store;  // s3://, gs://, http(s):// paths (object_store.h)
  open.cancel = cancel_.get();
  checkpoint_ = Unwrap(Interruptible(*cancel_, [&] {
    if (single_file) {
      const std::vector<std::string> paths{path};
      return Checkpoint::OpenFiles(paths, open);
    }
    return Checkpoint::Open(path, open);
  }));
  cancel_->store(false);
  WithoutGil release;
  Init();
}

Reader::Reader(const Reader& other, const nb::dict& options)
    : checkpoint_(other.Open()), options_(MakeLoadOptions(options)) {
  Check(CheckMappedFiles());
  options_.cancel = cancel_;
  WithoutGil release;
  Init();
}

void Reader::Init() {
  has_metadata_.resize(checkpoint_->files().size());
  if (options_.device.is_cuda() && !options_.placement) {
    // A CUDA target is checked now, so that opening says at once why there is no device
    // (the runtime that did not load, or the device count), and the pipeline is made once.
    loader_ = Unwrap(Loader::Open(checkpoint_, options_));
  }
}

std::shared_ptr<const Checkpoint> Reader::Open() const {
  std::lock_guard<std::mutex> lock(checkpoint_mu_);
  if (!checkpoint_) throw StatusError(Status(Code::kInvalidArgument, "this Reader is closed"));
  return checkpoint_;
}

nb::object Reader::CooperativePlan(const std::optional<std::vector<std::string>>& names,
                                   const std::string& spec, const std::vector<uint32_t>& hosts,
                                   const nb::dict& options, double probe_seconds) const {
  return python::CooperativePlan(*Open(), names, spec, hosts, options, probe_seconds);
}

std::vector<std::string> Reader::Names(bool by_offset) const {
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  std::vector<std::string> names;
  names.reserve(checkpoint->tensors().size());
  for (const TensorInfo& t : checkpoint->tensors()) names.push_back(t.name);
  if (!by_offset) std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Reader::Files() const {
  std::vector<std::string> out;
  for (const FileInfo& f : Open()->files()) out.push_back(f.path);
  return out;
}

uint64_t Reader::TotalBytes() const {
  return Open()->total_tensor_bytes();
}
size_t Reader::Size() const {
  return Open()->tensors().size();
}
bool Reader::Contains(const std::string& name) const {
  return Open()->Find(name) != nullptr;
}

PyTensorInfo Reader::Info(const std::string& name) const {
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  const TensorInfo& t = Lookup(*checkpoint, name);
  return {t.name, std::string(DTypeName(t.dtype)), t.shape, t.size, t.file, t.offset};
}

nb::dict Reader::DTypes(const std::optional<std::vector<std::string>>& names) const {
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  bool seen[kNumDTypes] = {};
  std::vector<std::string> odd_f4;
  auto visit = [&](const TensorInfo& t) {
    seen[static_cast<int>(t.dtype)] = true;
    if (t.dtype == DType::kF4 && (t.shape.empty() || t.shape.back() % 2 != 0)) {
      odd_f4.push_back(t.name);
    }
  };
  if (names) {
    for (const std::string& n : *names) visit(Lookup(*checkpoint, n));
  } else {
    for (const TensorInfo& t : checkpoint->tensors()) visit(t);
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

nb::object Reader::FileMetadata(size_t index) {
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  if (index >= checkpoint->files().size()) throw nb::index_error("file index out of range");
  const FileInfo& file = checkpoint->files()[index];
  bool present = !file.metadata.empty();
  if (!present) {
    // An empty table is either "__metadata__": {} or no "__metadata__" at all; only the header
    // tells (read again, once, only in this case). Under a lock of its own, not the Reader's:
    // asked during an iteration or from a stream callback (which hold that one), or beside a
    // load on another thread; reading the header beside a load is safe.
    WithoutGil release;
    std::lock_guard<std::mutex> lock(metadata_mu_);
    std::optional<bool>& known = has_metadata_[index];
    if (!known) {
      known =
          Unwrap(ReadHeader(*Unwrap(checkpoint->File(static_cast<uint32_t>(index))))).has_metadata;
    }
    present = *known;
  }
  if (!present) return nb::none();
  nb::dict d;
  for (const auto& [k, v] : file.metadata)
    d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
  return d;
}

nb::dict Reader::IndexMetadata() const {
  nb::dict d;
  for (const auto& [k, v] : Open()->index_metadata()) {
    d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
  }
  return d;
}

std::vector<PyOutput> Reader::Describe(const std::optional<std::vector<std::string>>& names) const {
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  const Description d = DescribeNames(*checkpoint, names);
  std::vector<PyOutput> out;
  out.reserve(d.outputs.size());
  for (const OutputInfo& o : d.outputs) {
    const TensorInfo& t = checkpoint->tensors()[o.tensor];
    out.push_back(
        {o.name, std::string(DTypeName(o.dtype)), t.name, o.shape, o.bytes, t.file, o.alias});
  }
  return out;
}

nb::list Reader::Load(const std::optional<std::vector<std::string>>& names, int framework) {
  const Framework fw = ToFramework(framework);
  if (names) DescribeNames(*Open(), names);  // SafetensorError naming a missing tensor
  // Locked on this thread (a stream callback reading through its own loader is refused here),
  // then loaded on Interruptible's helper thread.
  std::optional<Lock> lock;
  {
    WithoutGil release;
    lock.emplace(*this);
  }
  ResetCancel();
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

void Reader::CheckFitsAtOnce(const std::optional<std::vector<std::string>>& names) {
  if (names) DescribeNames(*Open(), names);
  std::optional<Lock> lock;
  {
    WithoutGil release;
    lock.emplace(*this);
  }
  Status fits;
  {
    WithoutGil release;
    fits = EnsureLoader().CheckFitsAtOnce(names ? Selection::Names(*names) : Selection::All());
  }
  Check(fits);
}

nb::object Reader::GetTensor(const std::string& name, int framework) {
  Check(CheckMappedFiles());
  const Framework fw = ToFramework(framework);
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  const TensorInfo& t = Lookup(*checkpoint, name);
  if (t.size >= 2 * options_.chunk_size || options_.device.is_cuda() || options_.placement) {
    std::vector<std::string> one{name};
    nb::list got = Load(one, framework);
    return nb::borrow<nb::tuple>(got[0])[kExportedArray];
  }
  const std::shared_ptr<std::byte> block = ReadBytes(*checkpoint, t, 0, t.size);
  auto keeper = std::make_shared<Keeper>(std::shared_ptr<const void>(block), t.size);
  return Export(fw, keeper, block.get(), t.size, t.dtype, t.shape);
}

nb::object Reader::ReadRange(const std::string& name, uint64_t begin, uint64_t end, int framework,
                             const std::optional<std::vector<uint64_t>>& shape) {
  Check(CheckMappedFiles());
  const Framework fw = ToFramework(framework);
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  const TensorInfo& t = Lookup(*checkpoint, name);
  if (begin > end || end > t.size) {
    throw StatusError(Status(Code::kInvalidArgument, "byte range [" + std::to_string(begin) + ", " +
                                                         std::to_string(end) +
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
  const std::shared_ptr<std::byte> block = ReadBytes(*checkpoint, t, begin, end - begin);
  auto keeper = std::make_shared<Keeper>(std::shared_ptr<const void>(block), end - begin);
  if (shape) return Export(fw, keeper, block.get(), end - begin, t.dtype, *shape);
  const std::vector<uint64_t> flat{end - begin};
  return Export(fw, keeper, block.get(), end - begin, DType::kU8, flat);
}

namespace {

// Loader::Stream on a worker thread, each batch handed to this (the main) thread for
// `deliver`, so that this thread checks for signals every kSignalPoll while batches are read, as
// Interruptible does for a load: Ctrl-C (a handler's exception) during a read cancels it (within a
// chunk) instead of waiting for the batch. The callback still runs on the caller's thread (its
// thread-local state: CUDA's current stream, signal handlers). Called with the GIL held;
// `deliver` runs with it held; the worker never takes it.
Status StreamOnWorker(Loader& loader, const Selection& selection, std::atomic<bool>& cancel,
                      const std::function<Status(Batch&)>& deliver,
                      std::optional<nb::python_error>& interrupted) {
  struct Handoff {
    std::mutex mu;
    std::condition_variable cv;
    Batch* batch = nullptr;  // posted by the worker until replied
    bool posted = false;     // a batch waits to be taken
    bool replied = false;
    bool stop = false;  // no batch is delivered any more (a signal's exception)
    Status reply;
    bool done = false;
    Status status;  // Loader::Stream's, once done
  } h;
  std::thread worker([&] {
    Status s = loader.Stream(selection, [&](Batch b) -> Status {
      std::unique_lock<std::mutex> lk(h.mu);
      if (h.stop) return Status(Code::kCancelled, "the stream was interrupted");
      h.batch = &b;
      h.posted = true;
      h.replied = false;
      h.cv.notify_all();
      h.cv.wait(lk, [&] { return h.replied; });
      h.batch = nullptr;
      return h.reply;
    });
    std::lock_guard<std::mutex> lk(h.mu);
    h.status = std::move(s);
    h.done = true;
    h.cv.notify_all();
  });
  // Whatever ends this function (a signal, an exception from the delivery): the batches posted
  // from then on are refused, and the worker is waited for.
  struct Finish {
    Handoff& h;
    std::thread& worker;
    std::atomic<bool>& cancel;
    ~Finish() {
      WithoutGil release;
      std::unique_lock<std::mutex> lk(h.mu);
      h.stop = true;
      if (!h.done) cancel.store(true);  // the batch read ahead stops within a chunk
      // A batch waiting for its reply (posted, or taken by a delivery that threw) is refused.
      const auto unanswered = [&] { return h.batch != nullptr && !h.replied; };
      while (!h.done) {
        if (unanswered()) {
          h.posted = false;
          h.reply = Status(Code::kCancelled, "the stream was interrupted");
          h.replied = true;
          h.cv.notify_all();
        }
        h.cv.wait(lk, [&] { return unanswered() || h.done; });
      }
      lk.unlock();
      worker.join();
    }
  } finish{h, worker, cancel};
  for (;;) {
    Batch* batch = nullptr;
    {
      WithoutGil release;
      std::unique_lock<std::mutex> lk(h.mu);
      h.cv.wait_for(lk, kSignalPoll, [&] { return h.posted || h.done; });
      if (h.posted) {
        h.posted = false;
        batch = h.batch;
      } else if (h.done) {
        return h.status;
      }
    }
    if (batch != nullptr) {
      Status reply = deliver(*batch);
      std::lock_guard<std::mutex> lk(h.mu);
      h.reply = std::move(reply);
      h.replied = true;
      h.cv.notify_all();
    }
    if (!interrupted && PyErr_CheckSignals() != 0) {
      cancel.store(true);
      interrupted.emplace();  // takes the handler's exception
      return Status(Code::kCancelled, "the stream was interrupted");
    }
  }
}

}  // namespace

void Reader::Stream(const std::optional<std::vector<std::string>>& names, int framework,
                    const nb::callable& callback) {
  const Framework fw = ToFramework(framework);
  if (names) DescribeNames(*Open(), names);  // SafetensorError naming a missing tensor
  std::optional<nb::python_error> raised;
  // Called with the GIL held.
  const std::function<Status(Batch&)> deliver = [&](Batch& batch) -> Status {
    try {
      nb::list tensors = ExportTensors(fw, batch.tensors);
      batch.tensors.clear();
      callback(batch.index, batch.count, batch.bytes, tensors, DeviceName(batch.device));
    } catch (nb::python_error& e) {
      raised.emplace(std::move(e));
      // The batch read ahead is abandoned within a chunk, not read to its end before the
      // exception (Ctrl-C included) comes out.
      cancel_->store(true);
      return Status(Code::kInternal, "the stream callback raised an exception");
    }
    return Status::Ok();
  };
  // The Reader's lock, released without the GIL however this ends (a close deferred to it
  // drops the loader: its threads joined while other Python threads run).
  struct Held {
    std::optional<Lock> lock;
    ~Held() {
      WithoutGil release;
      lock.reset();
    }
  } held;
  Loader* loader = nullptr;
  Selection selection = names ? Selection::Names(*names) : Selection::All();
  {
    WithoutGil release;
    held.lock.emplace(*this);
    ResetCancel();  // an earlier load's cancel (an iteration left early, Ctrl-C) is over
    loader = &EnsureLoader();
  }
  Status status;
  if (OnMainThread()) {
    status = StreamOnWorker(*loader, selection, *cancel_, deliver, raised);
  } else {  // no signal handler runs here: the stream runs on this thread
    WithoutGil release;
    status = loader->Stream(selection, [&](Batch batch) -> Status {
      nb::gil_scoped_acquire acquire;
      return deliver(batch);
    });
  }
  {
    WithoutGil release;
    SetStats(loader->stats());
    held.lock.reset();
  }
  if (raised) throw std::move(*raised);
  Check(status);
}

std::vector<std::vector<std::string>> Reader::PlanGroups(
    const std::optional<std::vector<std::string>>& names, uint64_t budget, bool allow_oversized,
    const std::string& order) const {
  const std::shared_ptr<const Checkpoint> checkpoint = Open();
  const Selection selection = names ? Selection::Names(*names) : Selection::All();
  PlanOptions p;
  p.chunk_size = options_.chunk_size;
  p.budget = budget;
  p.allow_oversized = allow_oversized;
  p.order = Unwrap(ParseDeliveryOrder(order));
  const std::vector<uint32_t> indices = Unwrap(selection.Resolve(*checkpoint));
  const Plan plan = Unwrap(MakePlan(*checkpoint, indices, p));
  std::vector<std::vector<std::string>> groups;
  for (const PlanBatch& b : plan.batches) {
    auto& g = groups.emplace_back();
    for (const PlannedTensor& t : b.tensors) g.push_back(checkpoint->tensors()[t.tensor].name);
  }
  return groups;
}

void Reader::LoadInto(const nb::list& entries) {
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
  ResetCancel();
  Interruptible(*cancel_, [&] {
    Loader& loader = EnsureLoader();
    const Status s = loader.LoadInto(destinations);
    SetStats(loader.stats());
    Check(s);
  });
}

nb::dict Reader::Stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return StatsDict(stats_);
}

nb::dict Reader::Engine() {
  LoadStats s;
  {
    WithoutGil release;
    if (lock_owner_.load() == std::this_thread::get_id()) {
      // A stream callback, or a signal handler while this thread's load runs on its worker
      // (which may be opening the loader now): what the open decided, if it is done.
      std::lock_guard<std::mutex> l(stats_mu_);
      if (!opened_) {
        throw StatusError(Status(Code::kInvalidArgument,
                                 "the loader's engine is not known yet: this thread's load is "
                                 "still opening it"));
      }
      s = *opened_;
    } else {
      // The loader is made, read and closed under the lock (close() on another thread); as a
      // step, so that an iteration in progress does not make this refuse.
      Lock lock(*this, /*step=*/true);
      s = EnsureLoader().stats();
    }
  }
  nb::dict out;
  out["engine"] = s.engine;
  out["engine_reason"] = s.engine_reason;
  out["filesystem"] = s.filesystem;
  return out;
}

nb::dict Reader::Options() const {
  return OptionsDict(options_);
}

void Reader::Close() {
  WithoutGil release;
  if (lock_owner_.load() == std::this_thread::get_id()) {
    // Called from inside a call of this Reader on this thread (a signal handler run by the
    // Ctrl-C check of a load or of an iteration's step, or a stream callback): waiting for the
    // lock would wait for ever. The call in progress is cancelled (its reads stop within a
    // chunk), later calls are refused, and the call's lock drops the loader and the checkpoint
    // when it is released (Lock::~Lock).
    close_pending_.store(true);
    cancel_->store(true);
    return;
  }
  // A load running on another thread stops within a chunk instead of being waited for; calls
  // not started yet are refused.
  close_pending_.store(true);
  cancel_->store(true);
  Lock lock(*this, /*step=*/false, /*closing=*/true);  // refused while an iteration is open
  DropLocked();
}

void Reader::DropLocked() noexcept {
  {
    std::lock_guard<std::mutex> l(stats_mu_);
    opened_.reset();
  }
  loader_.reset();
  std::shared_ptr<const Checkpoint> dropped;  // released outside checkpoint_mu_
  {
    std::lock_guard<std::mutex> l(checkpoint_mu_);
    dropped = std::move(checkpoint_);
  }
}

void Reader::ResetCancel() noexcept {
  // A close pending since keeps the load cancelled. Cleared first, then close_pending_ read:
  // Close sets close_pending_ then cancel_, so either this read sees its close, or its cancel_
  // comes after this clear (a read-then-store of close_pending_ into cancel_ could write false
  // over a cancel set in between).
  cancel_->store(false);
  if (close_pending_.load()) cancel_->store(true);
}

Reader::Lock::Lock(Reader& r, bool step, bool closing) : r_(r) {
  if (r.lock_owner_.load() == std::this_thread::get_id()) {
    throw StatusError(Status(Code::kInvalidArgument,
                             "this loader is busy on this thread: a stream callback may not "
                             "read through the loader that called it"));
  }
  if (!closing) ThrowIfClosing();
  if (!step) ThrowIfStreaming();
  r.mu_.lock();
  if (!step && r.streaming_.load()) {
    r.mu_.unlock();
    ThrowIfStreaming();
  }
  if (!closing && r.close_pending_.load()) {
    r.mu_.unlock();
    ThrowIfClosing();
  }
  r.lock_owner_.store(std::this_thread::get_id());
}

Reader::Lock::~Lock() {
  r_.lock_owner_.store(std::thread::id());
  // A close asked for from inside the call that held this lock (Close) is done now, unless an
  // iteration still holds the loader (its end releases the step's lock again).
  if (r_.close_pending_.load() && !r_.streaming_.load()) {
    if (PyGILState_Check() != 0) {
      // Released by a call that holds the GIL (a load's end, its unwinding): the loader's
      // threads are joined and its buffers freed while other Python threads run.
      WithoutGil release;
      r_.DropLocked();
    } else {
      r_.DropLocked();
    }
  }
  r_.mu_.unlock();
}

void Reader::Lock::ThrowIfClosing() const {
  if (r_.close_pending_.load()) {
    throw StatusError(Status(Code::kInvalidArgument, "this Reader is closed"));
  }
}

void Reader::Lock::ThrowIfStreaming() const {
  if (r_.streaming_.load()) {
    throw StatusError(Status(Code::kInvalidArgument,
                             "this loader is busy: an iteration over its batches is in "
                             "progress; finish or close it first"));
  }
}

void Reader::SetStats(const LoadStats& stats) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_ = stats;
}

Description Reader::DescribeNames(const Checkpoint& checkpoint,
                                  const std::optional<std::vector<std::string>>& names) const {
  const TensorParallelOptions* tp = options_.tensor_parallel ? &*options_.tensor_parallel : nullptr;
  auto describe = [&](const Selection& selection) {
    return DescribeSelection(checkpoint, selection, tp);
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

const TensorInfo& Reader::Lookup(const Checkpoint& checkpoint, const std::string& name) {
  const TensorInfo* t = checkpoint.Find(name);
  if (t == nullptr) RaiseMissingTensor(name);
  return *t;
}

Loader& Reader::EnsureLoader() {
  // Opened outside checkpoint_mu_ (a copy of the checkpoint keeps it alive): other threads' calls
  // that read the checkpoint (names, info) take that mutex holding the GIL, and would hold every
  // Python thread for as long as the loader takes to open. The Reader's lock (held) serializes
  // the open itself.
  if (!loader_) {
    loader_ = Unwrap(Loader::Open(Open(), options_));
    std::lock_guard<std::mutex> l(stats_mu_);
    opened_ = loader_->stats();
  }
  return *loader_;
}

std::shared_ptr<std::byte> Reader::ReadBytes(const Checkpoint& checkpoint, const TensorInfo& t,
                                             uint64_t begin, uint64_t length) {
  // Positional reads on one file are safe concurrently; the caller's checkpoint reference keeps
  // the file open even if the Reader is closed meanwhile. Ctrl-C gives up a remote file's read
  // (its GETs, its retries' waits): a flag of this read's own, not the loads' cancel_, which
  // another thread's load of this Reader may be using.
  std::atomic<bool> cancel{false};
  const auto read = [&] {
    std::shared_ptr<std::byte> block = AllocateBytes(length);
    if (length == 0) return block;
    const std::shared_ptr<const SourceFile> file = Unwrap(checkpoint.File(t.file));
    Check(ReadFully(*file, t.offset + begin, std::span<std::byte>(block.get(), length), &cancel));
    CheckRead(checkpoint, t, begin, std::span<const std::byte>(block.get(), length));
    return block;
  };
  // A small read of a local file (an absolute path: URLs are not) runs on this thread, without
  // the GIL: a pread or two that Ctrl-C would not cut short anyway, where handing it to
  // Interruptible's helper thread and back cost more than the read (a loop of get_tensor over
  // 3000 small tensors took 5x the safetensors package's time).
  const std::string& path = checkpoint.files()[t.file].path;
  if (length <= kReadOnCallerBytes && path.starts_with('/')) {
    WithoutGil release;
    return read();
  }
  return Interruptible(cancel, read);
}

void Reader::CheckRead(const Checkpoint& checkpoint, const TensorInfo& t, uint64_t begin,
                       std::span<const std::byte> bytes) {
  if (options_.verify == VerifyMode::kOff) return;
  std::shared_ptr<const std::vector<std::optional<FileChecksums>>> sums;
  {
    std::lock_guard<std::mutex> lock(sums_mu_);
    if (!sums_) {
      sums_ = std::make_shared<const std::vector<std::optional<FileChecksums>>>(
          Unwrap(ChecksumsForLoad(checkpoint, options_.verify)));
    }
    sums = sums_;
  }
  if (t.file >= sums->size() || !(*sums)[t.file]) return;  // the file has none (kAuto)
  const FileChecksums& file = *(*sums)[t.file];
  const auto it = file.tensors.find(t.name);
  if (it == file.tensors.end()) return;  // ChecksumsForFile matched them to the file's tensors
  Check(VerifyTensorRange(it->second, file.chunk_size, t.size, begin, bytes,
                          checkpoint.files()[t.file].path, t.name, t.offset)
            .status());
}

void RegisterReader(nb::module_& m) {
  nb::class_<PyTensorInfo>(m, "TensorInfo", "A tensor of a checkpoint, as its header describes it")
      .def_ro("name", &PyTensorInfo::name)
      .def_ro("dtype", &PyTensorInfo::dtype)
      .def_ro("shape", &PyTensorInfo::shape)
      .def_ro("bytes", &PyTensorInfo::bytes)
      .def_ro("file", &PyTensorInfo::file)
      .def_ro("offset", &PyTensorInfo::offset)
      .def("__repr__", [](const PyTensorInfo& t) {
        return "TensorInfo(" + t.name + ", " + t.dtype + ", " + ShapeText(t.shape) + ", " +
               std::to_string(t.bytes) + " bytes, file " + std::to_string(t.file) + " at " +
               std::to_string(t.offset) + ")";
      });

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
      .def(
          "__init__",
          [](Reader* self, nb::handle path, bool single_file, const nb::dict& options) {
            new (self) Reader(ToPath(path, "path"), single_file, options);
          },
          nb::arg("path"), nb::arg("single_file"), nb::arg("options"),
          "path: a str, bytes or os.PathLike (a name that is not UTF-8 opens as os.fsencode "
          "gives it).")
      .def(nb::init<const Reader&, const nb::dict&>(), nb::arg("other"), nb::arg("options"),
           "A Reader of other's checkpoint (its open files) with its own options.")
      .def("cooperative_plan", &Reader::CooperativePlan, nb::arg("names").none(), nb::arg("spec"),
           nb::arg("hosts"), nb::arg("options"), nb::arg("probe_seconds") = 0.0,
           "The schedule of a cooperative load of this checkpoint: (entries, outputs, "
           "fingerprint), see distributed.h.")
      .def("names", &Reader::Names, nb::arg("by_offset"))
      .def(
          "files",
          [](const Reader& r) {
            nb::list out;
            for (const std::string& path : r.Files()) out.append(FromPath(path));
            return out;
          },
          "The files' paths (str, as os.fsdecode gives them), in file index order.")
      .def("total_bytes", &Reader::TotalBytes)
      .def("__len__", &Reader::Size)
      .def("__contains__", &Reader::Contains)
      .def("info", &Reader::Info, nb::arg("name"), "The tensor's TensorInfo")
      .def("dtypes", &Reader::DTypes, nb::arg("names").none())
      .def("file_metadata", &Reader::FileMetadata)
      .def("index_metadata", &Reader::IndexMetadata)
      .def("describe", &Reader::Describe, nb::arg("names").none())
      .def("load", &Reader::Load, nb::arg("names").none(), nb::arg("framework"))
      .def("check_fits_at_once", &Reader::CheckFitsAtOnce, nb::arg("names").none(),
           "Loader::CheckFitsAtOnce: BudgetExceededError when the selection cannot be held at "
           "once")
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
      .def("engine", &Reader::Engine)
      .def("options", &Reader::Options)
      .def("cancel", &Reader::Cancel,
           "Stops the load running on another thread within a chunk per worker; a load started "
           "later clears it.")
      .def("close", &Reader::Close,
           "Drops the loader and this Reader's reference to the checkpoint (its files close when "
           "nothing else holds it); every later call raises InvalidArgumentError.");
}

}  // namespace tensorferry::python

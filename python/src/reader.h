// tensorferry._core.Reader: one Checkpoint as Python sees it.
//
// A Reader wraps one Checkpoint (a single file for safe_open; a file, directory or index for
// Loader), whose files were opened once when the checkpoint opened (every later read, partial
// reads and the Loader's, goes to the files whose headers were validated), and a lazily created
// Loader. Every call that reads file bytes or waits releases the GIL (WithoutGil). A Reader may be
// shared by threads: calls on it are serialized by a mutex, taken only after the GIL is released.
//
// Close() drops the Reader's loader and its reference to the checkpoint: the files close when
// nothing else holds the checkpoint (another Reader made from this one, a cooperative load).
// Tensors already handed out stay valid (mapped tensors hold their mappings, not the
// descriptors). Every later call raises InvalidArgumentError "this Reader is closed". A load
// running on another thread is cancelled (it raises within a chunk per worker) rather than
// waited for; Close from inside a call of this Reader on the same thread (a signal handler run
// during a load or an iteration's step, a stream callback) cancels that call and returns at
// once, and the resources are dropped when that call ends.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "tensorferry/loader.h"
#include "tensorferry/options.h"
#include "tensorferry/stats.h"

namespace tensorferry::python {

// One tensor of the checkpoint (its header entry), as Python sees it: tensorferry._core.TensorInfo.
struct PyTensorInfo {
  std::string name;
  std::string dtype;            // safetensors dtype name
  std::vector<uint64_t> shape;  // as stored
  uint64_t bytes = 0;           // stored bytes
  uint32_t file = 0;            // index of the file holding it (Reader.files())
  uint64_t offset = 0;          // absolute offset of its first byte in that file
};

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
  // an index (Loader). `options`: see MakeLoadOptions (options.h).
  Reader(const std::string& path, bool single_file, const nanobind::dict& options);
  // A Reader of `other`'s checkpoint (no file is opened again) with its own options.
  Reader(const Reader& other, const nanobind::dict& options);

  // The schedule of a cooperative load of this checkpoint (distributed.h).
  nanobind::object CooperativePlan(const std::optional<std::vector<std::string>>& names,
                                   const std::string& spec, const std::vector<uint32_t>& hosts,
                                   const nanobind::dict& options, double probe_seconds) const;

  // Stops the load running on another thread within a chunk per worker (it raises as an
  // interrupted one does); a load started later clears it. Thread-safe.
  void Cancel() noexcept { cancel_->store(true); }

  std::vector<std::string> Names(bool by_offset) const;  // by offset, or sorted
  std::vector<std::string> Files() const;                // paths, in file index order
  uint64_t TotalBytes() const;
  size_t Size() const;
  bool Contains(const std::string& name) const;
  PyTensorInfo Info(const std::string& name) const;  // SafetensorError for a missing name

  // The dtypes among `names` (all when None): {dtype name: [names of F4 tensors whose last
  // dimension is odd]} for F4, {dtype name: []} otherwise. One pass in C++ instead of one call
  // per tensor from Python.
  nanobind::dict DTypes(const std::optional<std::vector<std::string>>& names) const;

  // The "__metadata__" of file `index` as a dict, or None when the header has none.
  nanobind::object FileMetadata(size_t index);
  nanobind::dict IndexMetadata() const;

  // What a load of `names` (all when None) delivers, in output order (Loader::Describe).
  std::vector<PyOutput> Describe(const std::optional<std::vector<std::string>>& names) const;

  // Every selected tensor (all when `names` is None), through the Loader: one buffer per batch.
  // (name, dtype name, array) triples in output order.
  nanobind::list Load(const std::optional<std::vector<std::string>>& names, int framework);
  // Loader::CheckFitsAtOnce: BudgetExceededError when `names` (all when empty) cannot be held at
  // once, before anything is read.
  void CheckFitsAtOnce(const std::optional<std::vector<std::string>>& names);

  // One tensor. Large tensors go through the Loader (parallel chunked reads into a pooled
  // buffer); small ones are read with one positional read on this thread into a heap block.
  nanobind::object GetTensor(const std::string& name, int framework);

  // Bytes [begin, end) of tensor `name` in a block of their own: as a one-dimensional uint8 array,
  // or, given `shape` (in the header's terms), as that shape of the tensor's dtype.
  nanobind::object ReadRange(const std::string& name, uint64_t begin, uint64_t end, int framework,
                             const std::optional<std::vector<uint64_t>>& shape);

  // Calls callback(index, count, bytes, [(name, dtype, array), ...], device) for each batch of
  // Loader::Stream (device: "cpu", "cuda:N").
  void Stream(const std::optional<std::vector<std::string>>& names, int framework,
              const nanobind::callable& callback);

  // Starts a load whose batches are taken with BatchStream::Next (Loader::Iterate). The Reader is
  // busy (other calls raise) until the iteration ends or is closed (iterator.h).
  std::unique_ptr<BatchStream> Iterate(const std::optional<std::vector<std::string>>& names,
                                       int framework);

  // The tensors of `names` (all when None) grouped as a plan with `budget` would batch them.
  std::vector<std::vector<std::string>> PlanGroups(
      const std::optional<std::vector<std::string>>& names, uint64_t budget, bool allow_oversized,
      const std::string& order) const;

  // Reads tensors into caller memory: entries are (name, device string, address, capacity in
  // bytes); Loader::LoadInto checks names, capacities and overlaps before any read.
  void LoadInto(const nanobind::list& entries);

  nanobind::dict Stats() const;  // the last load's LoadStats (StatsDict)
  // The engine the loader runs, why, and the files' file systems (LoadStats::engine,
  // engine_reason, filesystem), known from Loader::Open on (opens the loader if needed).
  nanobind::dict Engine();
  nanobind::dict Options() const;  // OptionsDict

  // Drops the loader and the checkpoint (see the file comment). Idempotent.
  void Close();

 private:
  friend class BatchStream;

  // Serializes calls on one Reader. Construct only with the GIL released. While an iteration
  // (BatchStream) is open, other calls fail at once instead of waiting for an iteration that may
  // never be resumed; its own steps (`step`) take the lock for the step only.
  class Lock {
   public:
    // `closing`: Close's own lock, taken once close_pending_ is set (other locks are then
    // refused: "this Reader is closed").
    explicit Lock(Reader& r, bool step = false, bool closing = false);
    ~Lock();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    void ThrowIfStreaming() const;
    void ThrowIfClosing() const;
    Reader& r_;
  };

  void Init();  // the rest of construction, once checkpoint_ is set

  // The checkpoint; InvalidArgumentError once closed. The copy keeps it alive for the call.
  std::shared_ptr<const Checkpoint> Open() const;

  void SetStats(const LoadStats& stats);

  // DescribeSelection under this reader's options. Raises SafetensorError (as the reference
  // does) for a name that is neither a tensor nor a tied alias of one.
  Description DescribeNames(const Checkpoint& checkpoint,
                            const std::optional<std::vector<std::string>>& names) const;

  // The tensor `name` of `checkpoint`; SafetensorError (the reference's) when missing.
  static const TensorInfo& Lookup(const Checkpoint& checkpoint, const std::string& name);

  // REQUIRES: the lock is held.
  Loader& EnsureLoader();
  // Drops the loader and the checkpoint (Close). REQUIRES: the lock is held.
  void DropLocked() noexcept;
  // Clears cancel_ at the start of a load, unless a close is pending. REQUIRES: the lock is held.
  void ResetCancel() noexcept;

  // Reads `length` bytes of `t` from `begin` into a new block, on Interruptible's helper thread
  // (Ctrl-C gives a remote file's read up), or on this thread for at most kReadOnCallerBytes of a
  // local file. REQUIRES: the GIL is held (Interruptible's rule).
  static constexpr uint64_t kReadOnCallerBytes = uint64_t{4} << 20;
  std::shared_ptr<std::byte> ReadBytes(const Checkpoint& checkpoint, const TensorInfo& t,
                                       uint64_t begin, uint64_t length);

  // Checks bytes [begin, begin + bytes.size()) of `t`, just read outside a load (GetTensor's
  // small tensors, ReadRange), against the checksums options_.verify applies (ChecksumsForLoad,
  // found on first use): the chunks they hold whole (every chunk of a whole tensor). Raises
  // ChecksumMismatchError naming file, tensor, chunk and byte ranges. Thread-safe; call without
  // the GIL.
  void CheckRead(const Checkpoint& checkpoint, const TensorInfo& t, uint64_t begin,
                 std::span<const std::byte> bytes);

  std::mutex sums_mu_;                                                     // guards sums_
  std::shared_ptr<const std::vector<std::optional<FileChecksums>>> sums_;  // CheckRead's
  mutable std::mutex checkpoint_mu_;  // guards checkpoint_ (reset by Close)
  std::shared_ptr<const Checkpoint> checkpoint_;
  // LoadOptions::cancel of every load: cleared when a load starts, set by Ctrl-C (Interruptible)
  // or by closing a stream.
  std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
  LoadOptions options_;
  std::mutex mu_;
  std::atomic<std::thread::id> lock_owner_{};
  std::atomic<bool> streaming_{false};
  // Close was called: later calls are refused; set before cancel_ (ResetCancel relies on it).
  std::atomic<bool> close_pending_{false};
  mutable std::mutex stats_mu_;
  std::unique_ptr<Loader> loader_;
  // What the loader's Open decided (engine, engine_reason, filesystem), under stats_mu_, for
  // Engine() from the thread holding the lock (a stream callback, a signal handler during a
  // load), which must not read loader_ while the load's worker may be opening it.
  std::optional<LoadStats> opened_;
  std::mutex metadata_mu_;                         // has_metadata_
  std::vector<std::optional<bool>> has_metadata_;  // per file, once asked (see FileMetadata)
  LoadStats stats_;
};

// Binds Reader, TensorInfo and Output into `m`.
void RegisterReader(nanobind::module_& m);

}  // namespace tensorferry::python

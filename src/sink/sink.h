// Sinks: where a batch's bytes go. The loader runs plan -> engine -> sink: a plan's batch is given
// memory by its group's sink (Reserve), read into it by the read engine, and handed out as Tensors
// co-owning that memory (Complete). Three sinks:
//   host:   a pooled host buffer under the host budget, read by the loader's engine (covering
//           reads of tensor-parallel slices packed with the plan's moves);
//   mapped: views into per-file mappings (Engine::kMmap; populate pre-faults pages), strided slices
//           gathered into one pooled buffer;
//   device: a device buffer from the device's budgeted allocator, read through its pipeline (the
//           plan laid out by LayOutForDevice, plan/device_layout.h).
// Internal to the loader: a sink borrows the Loader's state (SinkContext) and is made per load.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "device/device_memory.h"
#include "device/pipeline.h"
#include "io/file_set.h"
#include "io/mapped_file.h"
#include "io/read_engine.h"
#include "memory/host_buffer.h"
#include "plan/device_layout.h"
#include "sink/landing_check.h"
#include "tensorferry/loader.h"
#include "util/macros.h"

namespace tensorferry::sink {

// A batch's memory, reserved before its reads start: its share of the host budget, or (for a
// device batch) its device buffer.
struct Reservation {
  memory::BudgetLease lease;
  std::shared_ptr<device::DeviceBuffer> device;
};

// What every Tensor of a batch co-owns: a pooled buffer and its share of the budget. Both are
// released together when the last tensor goes: the buffer first (back to the pool), then the
// lease, so that a read-ahead waiting for the lease finds the buffer in the pool.
struct BatchMemory {
  memory::BudgetLease lease;
  std::shared_ptr<memory::HostBuffer> buffer;
};

// Per CUDA device: the budgeted allocator of batch buffers and the pipeline (pinned ring, streams,
// cuFile driver), made once per Loader and reused by every load.
struct DeviceSlot {
  std::shared_ptr<device::DeviceAllocator> allocator;
  std::unique_ptr<device::DevicePipeline> pipeline;
};

// Runs `run` over windows of the files in `used` (distinct file indices) with the window's files
// pinned (pins[f].file set for exactly the files of the window).
using FileWindows =
    std::function<Status(const std::vector<uint32_t>& used, const std::vector<bool>& want_direct,
                         const std::function<Status(const std::vector<io::FileSet::Pin>&)>& run)>;

// What a sink borrows from its Loader for one load. Every pointer outlives the sink.
struct SinkContext {
  const Checkpoint* checkpoint = nullptr;
  // The same checkpoint, for what outlives the load: the mapped sink's mappings name the tensors
  // of a faulted page in CheckMappedFiles while it lives (empty: they name none).
  std::weak_ptr<const Checkpoint> checkpoint_ref;
  const LoadOptions* options = nullptr;
  std::vector<bool> want_direct;  // per file: read with O_DIRECT
  FileWindows windows;
  io::ReadEngine* engine = nullptr;  // host sink: the loader's engine; device sink: the copy engine
  memory::BufferPool* pool = nullptr;
  memory::Budget* budget = nullptr;
  io::FileSet* files = nullptr;                                  // mapped sink
  std::vector<std::shared_ptr<io::MappedFile>>* maps = nullptr;  // mapped sink, per file
  // Mapped sink, per file: the tensors maps[f] has given views of (MapForViews).
  std::vector<std::unordered_set<uint32_t>>* viewed = nullptr;
  // Device sink, per file: transient mappings rows are gathered from (GatherMappingOf).
  std::vector<std::shared_ptr<io::MappedFile>>* gather_maps = nullptr;
  // Host and device sinks: per file, the checksums to check as bytes land (none: nullptr or
  // empty), and where the checks are counted (LoadOptions::verify, landing_check.h).
  const std::vector<std::optional<FileChecksums>>* checksums = nullptr;
  VerifyCounts* verify_counts = nullptr;
  // Threads that hash a batch's chunks after its reads (batches with tensor-parallel moves).
  unsigned verify_threads = 1;
};

class BatchSink {
 public:
  virtual ~BatchSink() = default;
  // The memory of `batch`, or nullopt when it does not fit its budget now (only the caller, by
  // dropping tensors of earlier batches, can free it). Errors: those of the allocator.
  virtual Result<std::optional<Reservation>> Reserve(const PlanBatch& batch) = 0;
  // Reads batch `b` of the group's plan into `memory` and makes its tensors, co-owning it.
  // Errors: the read errors (kIoError, kUnexpectedEof, kCancelled), those of the device.
  virtual Result<Batch> Complete(size_t b, Reservation memory) = 0;
  // kBudgetExceeded for a batch Reserve refused: batch `k` of `n` in delivery order.
  virtual Status BudgetError(const PlanBatch& batch, size_t k, size_t n) const = 0;
  // Whether ReserveWhenFree can wait for memory (the host budget's; a device's cannot be waited
  // for: its allocator may also be short of memory the budget does not count).
  virtual bool waits_for_memory() const { return false; }
  // Like Reserve, but when the memory is held by batches the caller still has, waits (on a helper
  // thread) until the caller drops enough of them, or until `stop` is set (then nullopt; whoever
  // sets it calls Budget::Interrupt). Only called when waits_for_memory().
  virtual Result<std::optional<Reservation>> ReserveWhenFree(const PlanBatch& batch,
                                                             const std::atomic<bool>& stop) {
    (void)stop;
    return Reserve(batch);
  }
  // Whether the next batch is worth reading on a helper thread (the mapped sink reads nothing).
  virtual bool reads_ahead() const { return true; }
};

// `plan`, `strided` (per batch, for the device sink) and `slot` are borrowed.
std::unique_ptr<BatchSink> MakeHostSink(const SinkContext& context, const Plan& plan);
std::unique_ptr<BatchSink> MakeMappedSink(const SinkContext& context, const Plan& plan);
// The loader's mappings of the files of `batch`'s tensors for the mapped sink's views
// (context.maps, made on first use and kept for the loader's later loads). A mapping gives a view
// of each tensor once: a batch asking again for a tensor the mapping of its file has given (an
// earlier load of the same Loader, whose caller may have written to the copy-on-write pages of
// its tensor) gets a new mapping of that file, so that every load hands out the file's bytes,
// never what the caller made of an earlier load's (the old mapping lives on with the tensors
// that view it). Errors: those of FileSet::Get and MappedFile::Map.
Status MapForViews(const SinkContext& context, const PlanBatch& batch);
// The transient mapping the device sink gathers rows of file `f` from (context.gather_maps[f],
// io::MappedFile::Use::kTransient: read-only, no read lease, pages dropped as they are copied).
// A mapping with a faulted page (zeros mapped over it) is never reused: that file is mapped
// again (also by MapForViews). Errors: those of FileSet::Get and MappedFile::Map.
Result<const io::MappedFile*> GatherMappingOf(const SinkContext& context, uint32_t f);
// At the end of a load, with no batch in flight: unmaps the gather mappings (they are needed only
// while rows are copied; the next load maps again).
void ReleaseGatherMappings(std::vector<std::shared_ptr<io::MappedFile>>& gather_maps);
std::unique_ptr<BatchSink> MakeDeviceSink(const SinkContext& context, const Plan& plan,
                                          const std::vector<std::vector<StridedRead>>& strided,
                                          Device device, DeviceSlot& slot);

// The bytes of the host budget `batch` takes: what its reads occupy (its tensors' bytes, or the
// covering reads' when larger: a tensor-parallel slice read with its gaps), as the planner counts
// them when it cuts batches (PlanOptions::budget). Alignment padding between a batch's separate
// ranges (under io_alignment each) is not counted.
uint64_t HostLeaseBytes(const PlanBatch& batch);
// The host budget's share of `batch` (host and mapped sinks), nullopt when it does not fit now, and
// the kBudgetExceeded error for that case.
std::optional<Reservation> ReserveHost(memory::Budget& budget, const PlanBatch& batch);
Status HostBudgetError(const memory::Budget& budget, const PlanBatch& batch, size_t k, size_t n);

// The tensor of `pt` (planned tensor `info`) whose bytes are at `data`: its local shape and size,
// co-owning `owner`, on `device`.
Tensor PlannedTensorAt(const TensorInfo& info, const PlannedTensor& pt, const std::byte* data,
                       std::shared_ptr<const void> owner, Device device = Device::CPU());

// The tensors of `batch` laid out in one buffer at `base` (each at its buffer_offset), every one
// co-owning `owner` (host and device sinks).
Batch BatchInBuffer(const Checkpoint& checkpoint, const PlanBatch& batch, const std::byte* base,
                    const std::shared_ptr<const void>& owner, Device device = Device::CPU());

// A device task of `read` landing at `base` (a device address) + read.buffer_offset.
device::DeviceTask DeviceTaskOf(const StridedRead& read, std::byte* base,
                                const std::atomic<bool>* cancel);

// Runs device tasks (task i reads file task_file[i]) through `slot`'s pipeline window by window of
// files; into `buffer` when given (GDS registration), else caller memory.
Status RunDeviceTasks(const SinkContext& context, const DeviceSlot& slot,
                      const std::vector<device::DeviceTask>& tasks,
                      const std::vector<uint32_t>& task_file, device::DeviceBuffer* buffer);

// What the bytes [offset, offset + length) of file `file` of `checkpoint` hold, for a read error:
// 'tensor "a"', 'tensors "a" and "b"', 'tensors "a", "b", "c" and 4 more' (names quoted as JSON
// strings, in file order); empty when no tensor's bytes are in the range.
std::string TensorsIn(const Checkpoint& checkpoint, uint32_t file, uint64_t offset,
                      uint64_t length);

// The io::ReadRequest::about hook of the reads of one window of files (`pins` as FileWindows gives
// them): TensorsIn of the failed request's file (found among the pins) and range. Borrows both.
std::function<std::string(const io::ReadRequest&)> AboutTensors(
    const Checkpoint& checkpoint, const std::vector<io::FileSet::Pin>& pins);

// `status` (a failed read of [offset, offset + length) of file `file`) naming the tensors those
// bytes hold (io::WithReadHeld of TensorsIn; as it is when that leaves it so).
Status LabelTensors(Status status, const Checkpoint& checkpoint, uint32_t file, uint64_t offset,
                    uint64_t length);

// io::MappedFile::FaultError of file `file`'s mapping, naming the tensors of the first faulted page
// (LabelTensors); OK without faults.
Status MappedFaultError(const Checkpoint& checkpoint, uint32_t file, const io::MappedFile& map);

// The tasks (io::ReadRequest or device::DeviceTask; task i reads file task_file[i]) whose files
// are pinned in this window, with their file and O_DIRECT descriptor filled in, and `about` (the
// window's AboutTensors) to name what a failed one held.
template <typename Task>
std::vector<Task> WindowOf(const std::vector<Task>& tasks, const std::vector<uint32_t>& task_file,
                           const std::vector<io::FileSet::Pin>& pins,
                           const std::function<std::string(const io::ReadRequest&)>* about) {
  std::vector<Task> window;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const io::FileSet::Pin& pin = pins[task_file[i]];
    if (!pin.file) continue;
    Task t = tasks[i];
    t.file = pin.file.get();
    t.direct_fd = pin.direct_fd();
    t.about = about;
    window.push_back(t);
  }
  return window;
}

// The distinct file indices of `ids`, in first-use order.
std::vector<uint32_t> DistinctFiles(const std::vector<uint32_t>& ids, size_t num_files);

}  // namespace tensorferry::sink

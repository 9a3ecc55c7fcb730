// Internal: the device pipeline, moving byte ranges of files into device memory.
//
// Input: a list of DeviceTasks (a file, a byte range, a device destination, optionally a strided
// layout and an O_DIRECT descriptor) and an io::ReadEngine. Each task is cut into chunks of at
// most slot_size bytes (chunk boundaries after the first fall on 4 KiB file offsets, and each chunk
// sits in its slot at its file offset modulo 4 KiB, so O_DIRECT reads need no bounce buffers).
// Producer threads (each with its own CUDA stream) take chunks in order and, for each one:
//   staged path: acquire a free slot of the pinned StagingRing, read the chunk into it through the
//     engine, queue cudaMemcpyAsync (cudaMemcpy2DAsync for strided tasks) to the destination on
//     the producer's stream, and submit the slot, which records the slot's event; the slot is
//     reused only after that event completes. So the read of chunk k+1 overlaps the copy of chunk
//     k, and several reads are in flight when there are several producers. A strided task with a
//     DeviceTask::source is gathered instead of read: its rows are copied from the source into
//     the slot packed (only the slice's bytes are staged).
//   GDS path: cuFileRead straight into the destination (registered once per DeviceBuffer), no
//     staging and no copy.
// Run returns when every chunk's bytes are in device memory (all copies complete) or on the first
// error; after an error no new chunk starts, every copy in flight is waited for, and every slot is
// free again before Run returns, so the caller may free the destinations at once.
//
// GDS selection (DevicePipelineOptions::gds; docs/gpu.md):
//   kOff:  never; the ring only.
//   kAuto: when libcufile loads and cuFileDriverOpen succeeds (checked once, at Create), per file
//          when it has a file descriptor (O_DIRECT where the file system allows, else the buffered
//          one) and cuFileHandleRegister accepts it, and per task when it is
//          contiguous and its file offset and device address are multiples of gds_alignment. Every
//          other task goes through the ring; stats().gds_reason says why, per cause.
//   kOn:   like kAuto but an unusable library, driver or file is an error (kGdsUnavailable), and
//          unaligned contiguous tasks use cuFile too (cuFile handles them, more slowly). Strided
//          tasks always use the ring.
//
// Memory: pinned host memory is the ring: at most slot_count x slot_size (both from the options),
// one slot pinned at Create and the others by the runs that first need them, kept until the
// pipeline goes. The pipeline allocates no device memory: destinations are the
// caller's (see device_memory.h for the budgeted allocator).
//
// Errors name the file and offset: the engine's read errors as they are (kIoError,
// kUnexpectedEof), kCudaError "copy of <path> [offset, end) to device <address>: <CUDA error>",
// kCufileError "<path>: cuFileRead at offset ...", kInvalidArgument for a malformed task (its
// index).
//
// Thread-safety: Run calls on one pipeline are serialized (a second caller waits); the tasks'
// files, the engine and the destinations must outlive the call.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "cuda/resources.h"
#include "device/device_memory.h"
#include "device/staging_ring.h"
#include "io/mapped_file.h"
#include "io/read_engine.h"
#include "tensorferry/device.h"
#include "tensorferry/env.h"
#include "tensorferry/status.h"

namespace tensorferry::device {

// The public GdsMode (tensorferry/device.h): kAuto, kOn, kOff.
using tensorferry::GdsMode;
using tensorferry::GdsModeName;
using tensorferry::ParseGdsMode;

struct DeviceTask {
  const RandomAccessFile* file = nullptr;
  uint64_t file_offset = 0;
  uint64_t length = 0;       // bytes read: [file_offset, file_offset + length)
  std::byte* dst = nullptr;  // device address (not touched on the host)
  // Strided copy when rows > 0 (a tensor-parallel slice along a dimension other than 0): the bytes
  // read hold `rows` rows of `row_bytes` bytes, `src_pitch` bytes apart, so length must be
  // (rows - 1) * src_pitch + row_bytes; row r lands at dst + r * dst_pitch (dst_pitch >=
  // row_bytes).
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
  // An O_DIRECT descriptor of `file` (io::DirectFile), or -1: passed to the engine with each read.
  // Staged data is placed in the slot congruent to its file offset modulo
  // io::kDirectAlignment, so the engine can read the aligned middle of every chunk directly.
  int direct_fd = -1;
  // LoadOptions::cancel: staged reads not yet started when it is set are not started.
  const std::atomic<bool>* cancel = nullptr;
  // The file's bytes in host memory from file offset 0 (a mapping of the file, io::MappedFile;
  // source_size bytes of it), or null. A strided task with a source is gathered: each chunk copies
  // only its rows' row_bytes from the source into its slot, packed, and one copy moves them to the
  // device; the gaps between rows are neither read nor staged, and the engine is not used. Meant
  // for files in the page cache (the Loader sets it under
  // TensorParallelOptions::exact_when_cached), where a row is a memcpy, not a read. Contiguous
  // tasks and rows longer than a slot ignore it.
  const std::byte* source = nullptr;
  uint64_t source_size = 0;
  // The mapping `source` belongs to, when it is a transient one (io::MappedFile::Use::kTransient):
  // each chunk drops the pages it gathered from the process once they are in its slot, so the
  // process does not hold the rows it has copied (RSS stays about the slots' worth).
  const io::MappedFile* source_map = nullptr;
  // Staged tasks: called with each piece of the task's bytes while it is in its staging slot,
  // before the slot's copy to the device, with the piece's destination address: a contiguous
  // task's (or a row longer than a slot's) as the engine lands it (a piece at a time where the
  // engine hands them out, io::ReadRequest::landed); a strided task's row by row once its chunk
  // is in the slot (the gaps between rows are not the task's). Not called for bytes read with
  // GDS. An error fails the run like a read error (the copy is not queued). Checksums use it
  // (sink/landing_check.h).
  const std::function<Status(const std::byte* dst, std::span<const std::byte> bytes)>* passed =
      nullptr;
  // Its bytes must pass `passed` (checksums under verify=on): never read with GDS, whose bytes
  // do not pass through host memory (with gds=on: an error naming the conflict).
  bool host_only = false;
  // Names what the task's bytes hold for a failed read of them (io::ReadRequest::about): staged
  // reads pass it to the engine; a failed GDS read is labelled with it too (io::LabelReadError).
  const std::function<std::string(const io::ReadRequest&)>* about = nullptr;
};

struct DevicePipelineOptions {
  int device = 0;
  // Bytes per staging slot, i.e. per read and per copy (rounded up to 4 KiB).
  uint64_t slot_size = 8ull << 20;
  // Pinned host memory for the ring: slot_count = staging_bytes / slot_size, at least 2 (one slot
  // filling while another copies), else kInvalidArgument.
  uint64_t staging_bytes = 64ull << 20;
  // Producer threads (each with a CUDA stream); 0: min(8, slot_count).
  unsigned producers = 0;
  GdsMode gds = GdsMode::kAuto;
  // File offsets and device addresses GDS reads need to be multiples of, under kAuto.
  uint64_t gds_alignment = 4096;
};

struct DevicePipelineStats {
  uint64_t tasks = 0;
  uint64_t chunks = 0;
  uint64_t staged_bytes = 0;    // through the ring (read, then copied)
  uint64_t gathered_bytes = 0;  // of staged_bytes: rows gathered from DeviceTask::source
  uint64_t gds_bytes = 0;       // read by cuFile straight into device memory
  uint64_t copies = 0;          // cudaMemcpyAsync calls
  uint64_t copies_2d = 0;       // cudaMemcpy2DAsync calls
  unsigned slots = 0;
  uint64_t slot_size = 0;
  uint64_t pinned_bytes = 0;  // the ring's pinned memory (its slots pinned so far)
  unsigned peak_slots_in_use = 0;
  unsigned producers = 0;
  bool gds_enabled = false;   // the driver opened (kAuto/kOn)
  uint64_t gds_tasks = 0;     // tasks read with cuFile
  uint64_t staged_tasks = 0;  // tasks through the ring
  std::string gds_reason;     // why GDS is off, or why some tasks did not use it ("" if all did)
};

class DevicePipeline {
 public:
  // Creates the ring, the streams and (unless GDS is off) opens the cuFile driver. `cufile` is
  // the cuFile library to use, or the reason it could not be loaded.
  // Errors: kInvalidArgument (options), those of Runtime::CheckDevice, StagingRing::Create and
  // stream creation, kGdsUnavailable (gds == kOn and cuFile or its driver is unusable).
  static Result<std::unique_ptr<DevicePipeline>> Create(
      std::shared_ptr<const cuda::Runtime> runtime, const DevicePipelineOptions& options,
      Result<std::shared_ptr<const cuda::Cufile>> cufile);
  // The same with the process-wide cuFile (cuda::ProcessCufile()), loaded only when gds != kOff.
  static Result<std::unique_ptr<DevicePipeline>> Create(
      std::shared_ptr<const cuda::Runtime> runtime, const DevicePipelineOptions& options);
  ~DevicePipeline();
  DevicePipeline(const DevicePipeline&) = delete;
  DevicePipeline& operator=(const DevicePipeline&) = delete;

  // Moves every task's bytes to its destination (see the file comment). `destination`, when given,
  // is the buffer all destinations lie in: with GDS it is registered with cuFile once (later runs
  // into the same buffer reuse the registration). Errors: see the file comment.
  Status Run(std::span<const DeviceTask> tasks, io::ReadEngine& engine,
             DeviceBuffer* destination = nullptr);

  // Totals since creation or the last ResetCounters (gds_reason: as of the last Run, with every
  // failed cuFileRead since creation or the last ResetCounters).
  DevicePipelineStats stats() const;
  // Zeroes the counters of stats() (tasks, chunks, bytes, copies, peak slots in use); what
  // describes the pipeline (slots, slot size, pinned bytes, producers, GDS) stays, and a ring
  // whose growth a pinning failure stopped may try again (StagingRing::RetryGrowth). For a
  // pipeline handed to a new owner (pipeline_shelf.h). REQUIRES: no Run in progress.
  void ResetCounters();
  // Whether this pipeline was made for `runtime` with `options` (the slot size as Create rounds
  // it; every other field equal), and whether two pipelines were made alike.
  bool Matches(const cuda::Runtime& runtime, const DevicePipelineOptions& options) const;
  bool SameConfiguration(const DevicePipeline& other) const {
    return Matches(*other.runtime_, other.options_);
  }
  const DevicePipelineOptions& options() const noexcept { return options_; }
  // Staging slots not free (0 whenever no Run is in progress).
  unsigned slots_in_use() const { return ring_->in_use(); }

 private:
  struct Chunk;
  struct GdsFile;
  struct RunState;
  DevicePipeline(std::shared_ptr<const cuda::Runtime> runtime, const DevicePipelineOptions& options)
      : runtime_(std::move(runtime)), options_(options) {}

  // Checks the tasks, picks GDS or the staging ring for each and cuts them into run.chunks.
  Status Plan(std::span<const DeviceTask> tasks, RunState& run);
  // Whether task `t` (checked) reads with GDS; opens its file with cuFile on first use and counts
  // in `run` why not. Errors: those of OpenGdsFile when GDS is forced on.
  Result<bool> ChooseGds(const DeviceTask& t, RunState& run);
  // Chunks of a contiguous task, or of a strided one whose rows exceed a slot: each row in pieces.
  static void ChunkRanges(size_t index, const DeviceTask& t, uint64_t slot, bool gds,
                          std::vector<Chunk>& chunks);
  // Chunks of a strided task whose rows fit a slot: as many whole rows per chunk as fit.
  static void ChunkRows(size_t index, const DeviceTask& t, uint64_t slot,
                        std::vector<Chunk>& chunks);
  // Chunks of a strided task with a source whose rows fit a slot: as many rows as fit packed.
  static void ChunkGathered(size_t index, const DeviceTask& t, uint64_t slot,
                            std::vector<Chunk>& chunks);
  // Appends to run.reasons why tasks of the run used the staging ring.
  void ExplainStaging(RunState& run) const;
  void Produce(unsigned producer, io::ReadEngine& engine, RunState& run);
  Status Stage(const Chunk& chunk, cuda::Stream stream, io::ReadEngine& engine, RunState& run);
  // A GDS chunk. Under GdsMode::kAuto a failed cuFileRead is not the load's end: the rest of the
  // chunk, the file's other GDS chunks of the run and its tasks of later runs (until
  // ResetCounters) are staged through the ring instead (the failure named in every run's
  // stats().gds_reason); under kOn it fails the run.
  Status ReadGds(const Chunk& chunk, cuda::Stream stream, io::ReadEngine& engine, RunState& run);
  // Whether a cuFileRead of `file` (by path) failed under kAuto; `count`: one more chunk staged.
  bool GdsFailedFor(const RandomAccessFile& file, bool count);
  void NoteGdsFailure(const RandomAccessFile& file, std::string message);
  // Errors: kGdsUnavailable naming the file and the reason (no descriptor, replaced file, cuFile
  // refusal).
  Result<std::unique_ptr<GdsFile>> OpenGdsFile(const RandomAccessFile& file);

  std::shared_ptr<const cuda::Runtime> runtime_;
  DevicePipelineOptions options_;
  std::unique_ptr<StagingRing> ring_;
  std::vector<cuda::UniqueStream> streams_;
  std::shared_ptr<cuda::CufileDriver> gds_driver_;  // null: GDS off or unusable
  std::string gds_off_reason_;                      // why gds_driver_ is null

  // Files (by path) whose cuFileRead failed under GdsMode::kAuto: the first failure, and the
  // chunks of a failed read staged since. Kept until ResetCounters.
  struct GdsFailure {
    std::string first;
    uint64_t chunks = 0;
  };
  std::mutex gds_failed_mu_;
  std::map<std::string, GdsFailure> gds_failed_;

  std::mutex run_mu_;  // one Run at a time
  mutable std::mutex stats_mu_;
  DevicePipelineStats stats_;
};

}  // namespace tensorferry::device

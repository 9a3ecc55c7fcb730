#include "device/pipeline.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <system_error>
#include <thread>

#include "tensorferry/size.h"
#include "util/macros.h"

namespace tensorferry::device {
namespace {

constexpr uint64_t kFileAlign = io::kDirectAlignment;  // chunk boundaries, slot congruence

// A staging slot's size as the ring is made: `requested` rounded up to kFileAlign (wraps past
// UINT64_MAX to a value below `requested`, which Create refuses).
uint64_t SlotSize(uint64_t requested) {
  return (requested + kFileAlign - 1) / kFileAlign * kFileAlign;
}

std::string Hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  return buf;
}

std::string Plural(uint64_t n, const char* noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

}  // namespace

struct DevicePipeline::Chunk {
  size_t task = 0;
  const RandomAccessFile* file = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::byte* dst = nullptr;
  uint64_t rows = 0;  // > 0: strided (2D) copy
  uint64_t row_bytes = 0;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
  uint64_t slot_offset = 0;  // where the bytes go in the slot: offset % kDirectAlignment
  int direct_fd = -1;
  const std::atomic<bool>* cancel = nullptr;
  bool gds = false;
  // A gathered chunk: its first row in the task's source; the slot holds the rows packed
  // (length = rows * row_bytes) and offset is the first row's file offset.
  const std::byte* gather = nullptr;
  const io::MappedFile* gather_map = nullptr;  // DeviceTask::source_map
  // DeviceTask::passed (staged chunks): as pieces land, or row by row for a strided chunk.
  const std::function<Status(const std::byte*, std::span<const std::byte>)>* passed = nullptr;
  const std::function<std::string(const io::ReadRequest&)>* about = nullptr;  // DeviceTask::about

  std::string Describe() const {
    if (gather != nullptr) {
      return "copy of " + file->path() + " (" + std::to_string(rows) + " rows of " +
             std::to_string(row_bytes) + " bytes from offset " + std::to_string(offset) +
             ", pitch " + std::to_string(src_pitch) + ", gathered) to device " + Hex(dst);
    }
    return "copy of " + file->path() + " [" + std::to_string(offset) + ", " +
           std::to_string(offset + length) + ") to device " + Hex(dst);
  }
};

// A file registered with cuFile: the handle (deregistered on destruction) over an O_DIRECT
// descriptor of its own where the file system allows, else over the file's buffered descriptor
// (cuFile's compatibility mode decides whether it accepts that).
struct DevicePipeline::GdsFile {
  std::shared_ptr<const cuda::Cufile> cufile;
  std::unique_ptr<io::DirectFile> direct;
  cuda::CufileHandle handle = nullptr;
  ~GdsFile() {
    if (handle != nullptr) cufile->api().cuFileHandleDeregister(handle);
  }
};

struct DevicePipeline::RunState {
  std::vector<Chunk> chunks;
  std::map<const RandomAccessFile*, std::unique_ptr<GdsFile>> gds_files;
  std::map<const RandomAccessFile*, std::string> gds_refused;  // file -> why
  DeviceBuffer* destination = nullptr;
  bool destination_registered = false;
  uint64_t tasks = 0, gds_tasks = 0, staged_tasks = 0;
  // Staged with GDS on, by cause (Plan); failed_before: files whose cuFileRead failed earlier.
  uint64_t strided = 0, unaligned = 0, refused = 0, failed_before = 0, checked = 0;
  std::vector<std::string> reasons;

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> staged_bytes{0}, gathered_bytes{0}, gds_bytes{0}, copies{0}, copies_2d{0};
  std::mutex mu;
  Status error;  // the first failure

  void Fail(Status status) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = std::move(status);
    failed.store(true, std::memory_order_release);
  }
};

Result<std::unique_ptr<DevicePipeline>> DevicePipeline::Create(
    std::shared_ptr<const cuda::Runtime> runtime, const DevicePipelineOptions& options) {
  if (options.gds == GdsMode::kOff) {
    return Create(std::move(runtime), options,
                  Status(Code::kGdsUnavailable, "not loaded (GDS off)"));
  }
  return Create(std::move(runtime), options, cuda::ProcessCufile());
}

Result<std::unique_ptr<DevicePipeline>> DevicePipeline::Create(
    std::shared_ptr<const cuda::Runtime> runtime, const DevicePipelineOptions& options,
    Result<std::shared_ptr<const cuda::Cufile>> cufile) {
  if (options.slot_size == 0) {
    return Status(Code::kInvalidArgument, "device pipeline: slot_size must be positive");
  }
  if (options.gds_alignment == 0) {
    return Status(Code::kInvalidArgument, "device pipeline: gds_alignment must be positive");
  }
  const uint64_t slot_size = SlotSize(options.slot_size);
  const uint64_t slots = slot_size < options.slot_size ? 0 : options.staging_bytes / slot_size;
  if (slots < 2) {
    return Status(Code::kInvalidArgument,
                  "device pipeline: staging_bytes (" + FormatBytes(options.staging_bytes) +
                      ") must hold at least 2 slots of slot_size (" + FormatBytes(slot_size) + ")");
  }
  const auto slot_count = static_cast<unsigned>(std::min<uint64_t>(slots, 1u << 16));
  TF_RETURN_IF_ERROR(runtime->CheckDevice(options.device));
  cuda::ScopedDevice scoped(*runtime, options.device);
  TF_RETURN_IF_ERROR(scoped.status());

  std::unique_ptr<DevicePipeline> pipeline(new DevicePipeline(runtime, options));
  pipeline->options_.slot_size = slot_size;

  // GDS first: when forced on and unusable, fail before pinning memory.
  std::string problem;  // why GDS cannot be used, when it cannot
  if (options.gds == GdsMode::kOff) {
    pipeline->gds_off_reason_ = "GDS off (option)";
  } else if (!cufile.ok()) {
    problem = cufile.status().message();
  } else if (options.gds == GdsMode::kAuto && !(*cufile)->platform_root().empty() &&
             !(problem = cuda::GdsPlatformProblem((*cufile)->platform_root())).empty()) {
    // Not worth the driver's start-up cost: no file could use it.
  } else {
    auto driver = cuda::CufileDriver::Open(*cufile);
    if (driver.ok()) {
      pipeline->gds_driver_ = std::move(driver).value();
    } else {
      problem = driver.status().message();
    }
  }
  if (!problem.empty()) {
    if (options.gds == GdsMode::kOn) {
      return Status(Code::kGdsUnavailable, "GDS forced on but unusable: " + problem);
    }
    pipeline->gds_off_reason_ = "GDS not used: " + problem;
  }

  TF_ASSIGN_OR_RETURN(pipeline->ring_, StagingRing::Create(runtime, slot_count, slot_size));
  const unsigned producers = options.producers > 0 ? options.producers : std::min(8u, slot_count);
  for (unsigned i = 0; i < producers; ++i) {
    TF_ASSIGN_OR_RETURN(cuda::UniqueStream stream, cuda::UniqueStream::Create(runtime));
    pipeline->streams_.push_back(std::move(stream));
  }
  pipeline->stats_.slots = pipeline->ring_->slot_count();
  pipeline->stats_.slot_size = pipeline->ring_->slot_size();
  pipeline->stats_.pinned_bytes = pipeline->ring_->pinned_bytes();
  pipeline->stats_.producers = producers;
  pipeline->stats_.gds_enabled = pipeline->gds_driver_ != nullptr;
  pipeline->stats_.gds_reason = pipeline->gds_off_reason_;
  return pipeline;
}

DevicePipeline::~DevicePipeline() = default;

namespace {

// "<what>" for task `index`.
Status BadTask(size_t index, const std::string& what) {
  return Status(Code::kInvalidArgument, "device task " + std::to_string(index) + ": " + what);
}

// kInvalidArgument unless task `index` (not empty) has a file, a destination and a valid layout.
Status CheckTask(size_t index, const DeviceTask& t) {
  if (t.file == nullptr) return BadTask(index, "no file");
  if (t.dst == nullptr) return BadTask(index, "no device destination");
  if (t.file_offset + t.length < t.file_offset) return BadTask(index, "offset + length overflows");
  if (t.rows > 0) {
    const bool ok_shape = t.row_bytes > 0 && t.src_pitch >= t.row_bytes &&
                          t.dst_pitch >= t.row_bytes &&
                          (t.rows - 1) <= (UINT64_MAX - t.row_bytes) / t.src_pitch &&
                          (t.rows - 1) * t.src_pitch + t.row_bytes == t.length;
    if (!ok_shape) {
      return BadTask(index, "strided layout (" + std::to_string(t.rows) + " rows of " +
                                std::to_string(t.row_bytes) + " bytes, source pitch " +
                                std::to_string(t.src_pitch) + ", destination pitch " +
                                std::to_string(t.dst_pitch) + ") does not match length " +
                                std::to_string(t.length));
    }
  }
  if (t.source != nullptr &&
      (t.source_size < t.file_offset || t.source_size - t.file_offset < t.length)) {
    return BadTask(index, "bytes [" + std::to_string(t.file_offset) + ", " +
                              std::to_string(t.file_offset + t.length) + ") beyond its source's " +
                              std::to_string(t.source_size) + " bytes");
  }
  return Status::Ok();
}

}  // namespace

Status DevicePipeline::Plan(std::span<const DeviceTask> tasks, RunState& run) {
  const uint64_t slot = ring_->slot_size();
  for (size_t i = 0; i < tasks.size(); ++i) {
    const DeviceTask& t = tasks[i];
    if (t.length == 0) continue;
    TF_RETURN_IF_ERROR(CheckTask(i, t));
    ++run.tasks;
    TF_ASSIGN_OR_RETURN(const bool gds, ChooseGds(t, run));
    gds ? ++run.gds_tasks : ++run.staged_tasks;
    // Chunks: at most `slot` bytes; boundaries after the first on kFileAlign file offsets; each
    // placed in its slot at its offset modulo kFileAlign (congruent, for O_DIRECT), which the
    // first chunk's shorter length leaves room for.
    if (t.rows == 0 || t.row_bytes > slot) {
      ChunkRanges(i, t, slot, gds, run.chunks);
    } else if (t.source != nullptr) {
      ChunkGathered(i, t, slot, run.chunks);
    } else {
      ChunkRows(i, t, slot, run.chunks);
    }
  }
  ExplainStaging(run);
  return Status::Ok();
}

Result<bool> DevicePipeline::ChooseGds(const DeviceTask& t, RunState& run) {
  if (!gds_driver_) return false;
  if (t.rows > 0) {
    ++run.strided;
    return false;
  }
  const bool forced = options_.gds == GdsMode::kOn;
  if (t.host_only) {
    if (forced) {
      return Status(Code::kInvalidArgument,
                    t.file->path() + ": gds=on reads with GDS, whose bytes never pass through " +
                        "host memory, but verify=on wants every tensor checked there: set " +
                        "gds=auto (checked tensors staged) or verify=auto (GDS tensors unchecked)");
    }
    ++run.checked;
    return false;
  }
  if (!forced && GdsFailedFor(*t.file, /*count=*/false)) {  // staged since a cuFileRead failed
    ++run.failed_before;
    return false;
  }
  if (!run.gds_files.contains(t.file) && !run.gds_refused.contains(t.file)) {
    auto opened = OpenGdsFile(*t.file);
    if (opened.ok()) {
      run.gds_files[t.file] = std::move(opened).value();
    } else {
      if (forced) return opened.status();
      run.gds_refused[t.file] = opened.status().message();
    }
  }
  if (!run.gds_files.contains(t.file)) {
    ++run.refused;
    return false;
  }
  const uint64_t align = options_.gds_alignment;
  const bool aligned =
      t.file_offset % align == 0 && reinterpret_cast<uintptr_t>(t.dst) % align == 0;
  if (!aligned && !forced) ++run.unaligned;
  return aligned || forced;
}

void DevicePipeline::ChunkRanges(size_t index, const DeviceTask& t, uint64_t slot, bool gds,
                                 std::vector<Chunk>& chunks) {
  // Contiguous, or strided with rows longer than a slot: each row (or the range) in pieces.
  const uint64_t rows = t.rows == 0 ? 1 : t.rows;
  const uint64_t piece = t.rows == 0 ? t.length : t.row_bytes;
  for (uint64_t r = 0; r < rows; ++r) {
    const uint64_t begin = t.file_offset + r * t.src_pitch;
    std::byte* dst = t.dst + r * t.dst_pitch;
    uint64_t at = begin;
    while (at < begin + piece) {
      uint64_t end = std::min(begin + piece, (at + slot) / kFileAlign * kFileAlign);
      if (end <= at) end = std::min(begin + piece, at + slot);
      Chunk c;
      c.task = index;
      c.file = t.file;
      c.offset = at;
      c.length = end - at;
      c.dst = dst + (at - begin);
      c.slot_offset = at % kFileAlign;
      if (c.slot_offset + c.length > slot) c.slot_offset = 0;
      c.direct_fd = t.direct_fd;
      c.cancel = t.cancel;
      c.about = t.about;
      c.gds = gds;
      // (a row longer than a slot: contiguous pieces too). A GDS chunk keeps the hook for a
      // fall back to the ring, which stages it whole so that every byte passes it.
      c.passed = t.passed;
      chunks.push_back(c);
      at = end;
    }
  }
}

void DevicePipeline::ChunkRows(size_t index, const DeviceTask& t, uint64_t slot,
                               std::vector<Chunk>& chunks) {
  // Strided: as many whole rows per chunk as fit a slot (after the congruence offset, when
  // a row still fits with it).
  uint64_t r = 0;
  while (r < t.rows) {
    const uint64_t offset = t.file_offset + r * t.src_pitch;
    uint64_t lead = offset % kFileAlign;
    if (t.row_bytes > slot - lead) lead = 0;
    const uint64_t n = std::min((slot - lead - t.row_bytes) / t.src_pitch + 1, t.rows - r);
    Chunk c;
    c.task = index;
    c.file = t.file;
    c.offset = offset;
    c.length = (n - 1) * t.src_pitch + t.row_bytes;
    c.dst = t.dst + r * t.dst_pitch;
    c.rows = n;
    c.row_bytes = t.row_bytes;
    c.src_pitch = t.src_pitch;
    c.dst_pitch = t.dst_pitch;
    c.slot_offset = lead;
    c.direct_fd = t.direct_fd;
    c.cancel = t.cancel;
    c.about = t.about;
    c.passed = t.passed;
    chunks.push_back(c);
    r += n;
  }
}

void DevicePipeline::ChunkGathered(size_t index, const DeviceTask& t, uint64_t slot,
                                   std::vector<Chunk>& chunks) {
  const uint64_t per_chunk = slot / t.row_bytes;  // >= 1: the rows fit a slot
  for (uint64_t r = 0; r < t.rows; r += per_chunk) {
    const uint64_t n = std::min(per_chunk, t.rows - r);
    Chunk c;
    c.task = index;
    c.file = t.file;
    c.offset = t.file_offset + r * t.src_pitch;
    c.length = n * t.row_bytes;
    c.dst = t.dst + r * t.dst_pitch;
    c.rows = n;
    c.row_bytes = t.row_bytes;
    c.src_pitch = t.src_pitch;
    c.dst_pitch = t.dst_pitch;
    c.cancel = t.cancel;
    c.about = t.about;
    c.gather = t.source + c.offset;
    c.gather_map = t.source_map;
    c.passed = t.passed;
    chunks.push_back(c);
  }
}

void DevicePipeline::ExplainStaging(RunState& run) const {
  if (!gds_driver_) {
    run.reasons.push_back(gds_off_reason_);
    return;
  }
  for (const auto& [file, why] : run.gds_refused) run.reasons.push_back(why);
  if (run.refused > 0) {
    run.reasons.push_back(Plural(run.refused, "task") +
                          " of files cuFile refused used the staging ring");
  }
  if (run.unaligned > 0) {
    run.reasons.push_back(Plural(run.unaligned, "task") + " not aligned to " +
                          std::to_string(options_.gds_alignment) +
                          " bytes (file offset or device address) used the staging ring");
  }
  if (run.strided > 0) {
    run.reasons.push_back(Plural(run.strided, "strided task") +
                          " used the staging ring (GDS reads contiguous ranges only)");
  }
  if (run.failed_before > 0) {
    run.reasons.push_back(Plural(run.failed_before, "task") +
                          " of files whose cuFileRead failed before used the staging ring");
  }
  if (run.checked > 0) {
    run.reasons.push_back(Plural(run.checked, "task") +
                          " checked against checksums (verify=on) used the staging ring");
  }
}

bool DevicePipeline::GdsFailedFor(const RandomAccessFile& file, bool count) {
  std::lock_guard<std::mutex> lock(gds_failed_mu_);
  auto it = gds_failed_.find(file.path());
  if (it == gds_failed_.end()) return false;
  if (count) ++it->second.chunks;
  return true;
}

void DevicePipeline::NoteGdsFailure(const RandomAccessFile& file, std::string message) {
  std::lock_guard<std::mutex> lock(gds_failed_mu_);
  GdsFailure& f = gds_failed_[file.path()];
  if (f.first.empty()) f.first = std::move(message);
  ++f.chunks;
}

Result<std::unique_ptr<DevicePipeline::GdsFile>> DevicePipeline::OpenGdsFile(
    const RandomAccessFile& file) {
  auto gds = std::make_unique<GdsFile>();
  gds->cufile = gds_driver_->cufile_ptr();
  int fd = file.native_handle();
  if (fd < 0) {
    return Status(Code::kGdsUnavailable,
                  file.path() + ": not used with GDS: no file descriptor (not a file on disk)");
  }
  auto direct = io::DirectFile::Open(file);
  if (direct.ok() && *direct) {
    gds->direct = std::move(direct).value();
    fd = gds->direct->fd();
  } else if (!direct.ok() && direct.status().code() != Code::kUnsupported) {
    // E.g. the path now names another file: never read it.
    return Status(Code::kGdsUnavailable, "not used with GDS: " + direct.status().message());
  }
  cuda::CufileDescr descr;
  descr.handle.fd = fd;
  const cuda::CufileError error = gds->cufile->api().cuFileHandleRegister(&gds->handle, &descr);
  if (error.err != cuda::kCufileSuccess) {
    gds->handle = nullptr;
    return Status(Code::kGdsUnavailable,
                  file.path() + ": cuFileHandleRegister: " + cuda::CufileErrorText(error));
  }
  return gds;
}

Status DevicePipeline::Run(std::span<const DeviceTask> tasks, io::ReadEngine& engine,
                           DeviceBuffer* destination) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  RunState run;
  run.destination = destination;
  TF_RETURN_IF_ERROR(Plan(tasks, run));
  if (run.gds_tasks > 0 && destination != nullptr && destination->size() > 0) {
    Status registered = destination->RegisterWithCufile(gds_driver_);
    if (registered.ok()) {
      run.destination_registered = true;
    } else {
      run.reasons.push_back(registered.message() +
                            " (reads into it go through cuFile's own bounce buffers)");
    }
  }

  if (!run.chunks.empty()) {
    const auto producers =
        static_cast<unsigned>(std::min<size_t>(streams_.size(), run.chunks.size()));
    std::vector<std::thread> threads;
    threads.reserve(producers);
    for (unsigned p = 1; p < producers; ++p) {
      try {
        threads.emplace_back([this, p, &engine, &run] { Produce(p, engine, run); });
      } catch (const std::system_error&) {
        break;  // fewer producers: slower, not wrong
      }
    }
    Produce(0, engine, run);
    for (std::thread& t : threads) t.join();
  }
  // Every copy in flight completes before the caller may touch (or free) the destinations.
  Status drained = ring_->Drain();
  {
    // Every failure since this pipeline was made (or handed over), in every run's reasons: a
    // load's later batches stage those files from the start.
    std::lock_guard<std::mutex> lock(gds_failed_mu_);
    for (const auto& [path, failure] : gds_failed_) {
      run.reasons.push_back(failure.first +
                            " (GDS given up for the file: " + Plural(failure.chunks, "GDS chunk") +
                            " read through the staging ring instead, its later tasks staged "
                            "from the start)");
    }
  }

  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.tasks += run.tasks;
    stats_.chunks += run.chunks.size();
    stats_.staged_bytes += run.staged_bytes.load();
    stats_.gathered_bytes += run.gathered_bytes.load();
    stats_.gds_bytes += run.gds_bytes.load();
    stats_.copies += run.copies.load();
    stats_.copies_2d += run.copies_2d.load();
    stats_.gds_tasks += run.gds_tasks;
    stats_.staged_tasks += run.staged_tasks;
    stats_.peak_slots_in_use = ring_->peak_in_use();
    stats_.pinned_bytes = ring_->pinned_bytes();  // slots are pinned as the runs need them
    std::string reason;
    for (const std::string& r : run.reasons) reason += (reason.empty() ? "" : "; ") + r;
    stats_.gds_reason = std::move(reason);
  }
  if (!run.error.ok()) return run.error;
  return drained;
}

void DevicePipeline::Produce(unsigned producer, io::ReadEngine& engine, RunState& run) {
  cuda::ScopedDevice scoped(*runtime_, options_.device);
  if (!scoped.status().ok()) {
    run.Fail(scoped.status());
    return;
  }
  const cuda::Stream stream = streams_[producer].get();
  while (!run.failed.load(std::memory_order_acquire)) {
    const size_t k = run.next.fetch_add(1);
    if (k >= run.chunks.size()) break;
    const Chunk& chunk = run.chunks[k];
    Status status =
        chunk.gds ? ReadGds(chunk, stream, engine, run) : Stage(chunk, stream, engine, run);
    if (!status.ok()) {
      run.Fail(std::move(status));
      break;
    }
  }
}

Status DevicePipeline::Stage(const Chunk& chunk, cuda::Stream stream, io::ReadEngine& engine,
                             RunState& run) {
  TF_ASSIGN_OR_RETURN(const unsigned slot, ring_->Acquire());
  const std::span<std::byte> buffer = ring_->slot(slot).subspan(
      static_cast<size_t>(chunk.slot_offset), static_cast<size_t>(chunk.length));
  if (chunk.gather != nullptr) {
    if (chunk.cancel != nullptr && chunk.cancel->load(std::memory_order_acquire)) {
      ring_->Release(slot);
      return Status(Code::kCancelled, "the load was cancelled");
    }
    // From the page cache through the mapping: the rows only, packed.
    const auto row = static_cast<size_t>(chunk.row_bytes);
    for (uint64_t r = 0; r < chunk.rows; ++r) {
      std::memcpy(buffer.data() + r * row, chunk.gather + r * chunk.src_pitch, row);
    }
    // Copied: the rows' pages leave the process (a transient mapping's only).
    if (chunk.gather_map != nullptr && chunk.rows > 0) {
      chunk.gather_map->DropPages(chunk.offset, (chunk.rows - 1) * chunk.src_pitch + row);
    }
  } else {
    io::ReadRequest request{chunk.file, chunk.offset, buffer, chunk.direct_fd, chunk.cancel};
    request.about = chunk.about;
    // Each piece handed to DeviceTask::passed as it lands in the slot, with its device address.
    const std::function<Status(const io::ReadRequest&)> on_piece =
        [&](const io::ReadRequest& piece) {
          return (*chunk.passed)(chunk.dst + (piece.dst.data() - buffer.data()), piece.dst);
        };
    if (chunk.passed != nullptr && chunk.rows == 0) request.landed = &on_piece;
    Status read = engine.Execute(std::span<const io::ReadRequest>(&request, 1));
    if (!read.ok()) {
      ring_->Release(slot);
      return read;
    }
  }
  if (chunk.passed != nullptr && chunk.rows > 0) {
    // A strided chunk: its rows (packed when gathered, at the source pitch when read with the
    // gaps between them), each with its destination.
    const uint64_t pitch = chunk.gather != nullptr ? chunk.row_bytes : chunk.src_pitch;
    for (uint64_t r = 0; r < chunk.rows; ++r) {
      Status passed = (*chunk.passed)(
          chunk.dst + r * chunk.dst_pitch,
          buffer.subspan(static_cast<size_t>(r * pitch), static_cast<size_t>(chunk.row_bytes)));
      if (!passed.ok()) {
        ring_->Release(slot);
        return passed;
      }
    }
  }
  const cuda::RuntimeApi& api = runtime_->api();
  cuda::Error error;
  // A gathered chunk is packed in the slot: one plain copy when the destination rows are too.
  const bool packed = chunk.gather != nullptr && chunk.dst_pitch == chunk.row_bytes;
  if (chunk.rows > 0 && !packed) {
    const uint64_t src_pitch = chunk.gather != nullptr ? chunk.row_bytes : chunk.src_pitch;
    error = api.cudaMemcpy2DAsync(chunk.dst, chunk.dst_pitch, buffer.data(), src_pitch,
                                  chunk.row_bytes, chunk.rows, cuda::kMemcpyHostToDevice, stream);
    run.copies_2d.fetch_add(1, std::memory_order_relaxed);
  } else {
    error = api.cudaMemcpyAsync(chunk.dst, buffer.data(), buffer.size(), cuda::kMemcpyHostToDevice,
                                stream);
    run.copies.fetch_add(1, std::memory_order_relaxed);
  }
  std::string what = chunk.Describe();
  if (error != cuda::kSuccess) {
    ring_->Release(slot);  // nothing was queued
    return runtime_->Check(error, what);
  }
  run.staged_bytes.fetch_add(chunk.length, std::memory_order_relaxed);
  if (chunk.gather != nullptr)
    run.gathered_bytes.fetch_add(chunk.length, std::memory_order_relaxed);
  return ring_->Submit(slot, stream, std::move(what));
}

Status DevicePipeline::ReadGds(const Chunk& chunk, cuda::Stream stream, io::ReadEngine& engine,
                               RunState& run) {
  // The chunk's bytes from `done` on, staged through the ring as a chunk planned so would be.
  auto staged_from = [&](uint64_t done) {
    Chunk rest = chunk;
    rest.gds = false;
    rest.offset += done;
    rest.length -= done;
    rest.dst += done;
    rest.slot_offset = rest.offset % kFileAlign;
    if (rest.slot_offset + rest.length > ring_->slot_size()) rest.slot_offset = 0;
    return Stage(rest, stream, engine, run);
  };
  const bool fall_back = options_.gds == GdsMode::kAuto;
  if (fall_back && GdsFailedFor(*chunk.file, /*count=*/true)) return staged_from(0);
  const GdsFile& file = *run.gds_files.at(chunk.file);
  void* base = chunk.dst;
  uint64_t base_offset = 0;
  const DeviceBuffer* dest = run.destination;
  if (run.destination_registered && chunk.dst >= dest->data() && chunk.length <= dest->size() &&
      static_cast<uint64_t>(chunk.dst - dest->data()) <= dest->size() - chunk.length) {
    base = dest->data();  // the registered base, so cuFile uses the registration
    base_offset = static_cast<uint64_t>(chunk.dst - dest->data());
  }
  uint64_t done = 0;
  while (done < chunk.length) {
    // Cancelled: stop within this chunk, as the staged reads do (loader.h, LoadOptions::cancel).
    if (chunk.cancel != nullptr && chunk.cancel->load(std::memory_order_acquire)) {
      return Status(Code::kCancelled, "the load was cancelled");
    }
    errno = 0;
    const ssize_t n = file.cufile->api().cuFileRead(
        file.handle, base, static_cast<size_t>(chunk.length - done),
        static_cast<off_t>(chunk.offset + done), static_cast<off_t>(base_offset + done));
    // What the failed read's bytes hold (device addresses: only their count is used).
    const io::ReadRequest failed{
        chunk.file,
        chunk.offset + done,
        std::span<std::byte>(chunk.dst + done, static_cast<size_t>(chunk.length - done)),
        -1,
        nullptr,
        nullptr,
        chunk.about};
    if (n < 0) {
      const int saved = errno;
      Status error = io::LabelReadError(
          failed, failed.offset,
          Status(Code::kCufileError, chunk.file->path() + ": cuFileRead at offset " +
                                         std::to_string(chunk.offset + done) + " (" +
                                         std::to_string(chunk.length - done) + " bytes to device " +
                                         Hex(chunk.dst + done) +
                                         "): " + cuda::CufileReadErrorText(n, saved)));
      if (!fall_back) return error;
      NoteGdsFailure(*chunk.file, error.message());
      run.gds_bytes.fetch_add(done, std::memory_order_relaxed);
      // Checked bytes are staged from the chunk's start: those cuFile wrote never passed the
      // check (read twice, counted twice).
      return staged_from(chunk.passed != nullptr ? 0 : done);
    }
    if (n == 0) {
      return io::LabelReadError(
          failed, failed.offset,
          Status(Code::kUnexpectedEof, chunk.file->path() + ": unexpected end of file at offset " +
                                           std::to_string(chunk.offset + done) + ": wanted " +
                                           std::to_string(chunk.length) + " bytes at offset " +
                                           std::to_string(chunk.offset) + ", got " +
                                           std::to_string(done)));
    }
    done += static_cast<uint64_t>(n);
  }
  run.gds_bytes.fetch_add(chunk.length, std::memory_order_relaxed);
  return Status::Ok();
}

DevicePipelineStats DevicePipeline::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

void DevicePipeline::ResetCounters() {
  ring_->ResetPeak();
  ring_->RetryGrowth();  // a new load: pinned memory may have been freed since growth stopped
  std::lock_guard<std::mutex> lock(stats_mu_);
  DevicePipelineStats fresh;
  fresh.slots = stats_.slots;
  fresh.slot_size = stats_.slot_size;
  fresh.pinned_bytes = ring_->pinned_bytes();
  fresh.producers = stats_.producers;
  fresh.gds_enabled = stats_.gds_enabled;
  fresh.gds_reason = gds_off_reason_;
  stats_ = std::move(fresh);
  std::lock_guard<std::mutex> failed(gds_failed_mu_);
  gds_failed_.clear();  // a new owner's loads ask cuFile again
}

bool DevicePipeline::Matches(const cuda::Runtime& runtime,
                             const DevicePipelineOptions& options) const {
  return &runtime == runtime_.get() && options.device == options_.device &&
         SlotSize(options.slot_size) == options_.slot_size &&
         options.staging_bytes == options_.staging_bytes &&
         options.producers == options_.producers && options.gds == options_.gds &&
         options.gds_alignment == options_.gds_alignment;
}

}  // namespace tensorferry::device

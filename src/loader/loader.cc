// The loader: Selection -> Description -> Plan (per device group, groups.h) -> read engine ->
// sink (sink.h: host, mapped, device) -> Tensors. This file: Loader::Impl's shared steps (device
// slots, files, O_DIRECT choice, statistics), Open, Describe, MakePlan, Load, Placement; the
// batch loop is batch_iterator.cc, LoadInto load_into.cc.
#include "tensorferry/loader.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <thread>
#include <unordered_map>
#include <utility>

#include "cuda/cuda_api.h"
#include "device/device_memory.h"
#include "device/pipeline.h"
#include "device/pipeline_shelf.h"
#include "io/engine_common.h"
#include "io/file_set.h"
#include "io/filesystem.h"
#include "io/read_engine.h"
#include "loader/groups.h"
#include "loader/loader_impl.h"
#include "memory/host_buffer.h"
#include "sink/sink.h"
#include "tensorferry/memory_limit.h"
#include "tensorferry/residency.h"
#include "tensorferry/size.h"
#include "util/macros.h"

namespace tensorferry {

// --- Loader -----------------------------------------------------------------------------------

namespace {

// With DirectIO::kAuto, a file is read with O_DIRECT when less than this fraction of the bytes to
// read is in the page cache.
constexpr double kDirectBelowCachedFraction = 0.5;

unsigned DefaultThreads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

// The file systems of a checkpoint's files: their types, comma-separated and each once, and the
// slow ones (network, user space) with their class, "" when none.
struct FileSystems {
  std::string types;
  std::string slow;
};

FileSystems DetectFileSystems(const Checkpoint& checkpoint) {
  FileSystems out;
  // The directory each file really is in: a symbolic link (a model cache's blobs, a single file
  // linked from elsewhere) may lead onto another file system, so the link is resolved first; the
  // directory, not the file, because overlayfs gives the files of an overlay over layers on
  // several file systems a private device number no mount lists (its directories keep the
  // overlay's, whose layers io::DetectFileSystem examines). One detection per device: the shards
  // of a checkpoint usually share one.
  std::map<dev_t, io::FileSystemInfo> by_device;
  for (const auto& file : checkpoint.files()) {
    std::error_code ec;
    const std::filesystem::path real = std::filesystem::canonical(file.path, ec);
    if (ec) continue;  // an injected Env's files: nothing to say
    const std::string dir = real.parent_path().string();
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) continue;
    if (by_device.count(st.st_dev)) continue;
    Result<io::FileSystemInfo> info = io::DetectFileSystem(dir);
    if (!info.ok()) continue;
    const auto known = [](const std::string& list, const std::string& item) {
      return ("," + list + ",").find("," + item + ",") != std::string::npos;
    };
    if (!known(out.types, info->type)) out.types += (out.types.empty() ? "" : ",") + info->type;
    if (info->slow_faults()) {
      const std::string what =
          info->type +
          (info->cls == io::FileSystemClass::kNetwork ? " (network file system)" : " (user space)");
      if (out.slow.find(what) == std::string::npos) {
        out.slow += (out.slow.empty() ? "files on " : ", ") + what;
      }
    }
    by_device.emplace(st.st_dev, *std::move(info));
  }
  return out;
}

// Engine::kAuto's io_uring: made into `engine` where it can be, else the reason it cannot (and
// auto reads with pread). Not only whether the kernel allows io_uring (IoUringAvailable's probe
// ring): the engine's one ring per worker may still fail (EMFILE under a low `ulimit -n` with
// many threads, ENOMEM), where pread, which needs no descriptors, reads.
Status MakeAutoIoUring(unsigned threads, unsigned queue_depth,
                       std::unique_ptr<io::ReadEngine>& engine) {
  Result<std::unique_ptr<io::ReadEngine>> made = io::MakeIoUringEngine(threads, queue_depth);
  if (!made.ok()) return made.status();
  engine = std::move(made).value();
  return Status::Ok();
}

}  // namespace

Loader::Impl::~Impl() {
  if (!options.keep_staging) return;
  for (auto& [index, slot] : slots) device::KeepIdlePipeline(std::move(slot.pipeline));
}

Result<sink::DeviceSlot*> Loader::Impl::Slot(int index) {
  auto it = slots.find(index);
  if (it != slots.end()) return &it->second;
  if (index < 0) {
    return Status(Code::kInvalidArgument, "CUDA device index " + std::to_string(index));
  }
  if (!runtime) {
    TF_ASSIGN_OR_RETURN(runtime, cuda::ProcessRuntime());
  }
  TF_RETURN_IF_ERROR(runtime->CheckDevice(index));
  device::DevicePipelineOptions p;
  p.device = index;
  p.slot_size = options.staging_slot;
  p.staging_bytes = options.staging_bytes;
  p.producers = options.device_producers;
  p.gds = options.gds;
  std::unique_ptr<device::DevicePipeline> pipeline;
  if (options.keep_staging) pipeline = device::TakeIdlePipeline(runtime, p);
  if (!pipeline) {
    TF_ASSIGN_OR_RETURN(pipeline, device::DevicePipeline::Create(runtime, p));
  }
  sink::DeviceSlot slot{device::DeviceAllocator::Create(runtime, index, options.device_budget),
                        std::move(pipeline)};
  return &slots.emplace(index, std::move(slot)).first->second;
}

Result<io::ReadEngine*> Loader::Impl::CopyEngine() {
  if (copy_engine == nullptr) {
    if (engine) {
      copy_engine = engine.get();
    } else {
      TF_ASSIGN_OR_RETURN(own_copy_engine, io::MakePreadEngine(options.threads));
      copy_engine = own_copy_engine.get();
    }
  }
  return copy_engine;
}

Status Loader::Impl::OpenFiles() {
  if (!files) {
    files = checkpoint->file_set();
    maps.clear();
    maps.resize(checkpoint->files().size());
    viewed.clear();
    viewed.resize(checkpoint->files().size());
    gather_maps.clear();
    gather_maps.resize(checkpoint->files().size());
  }
  return checkpoint->CheckUnchanged();
}

Status Loader::Impl::DropReadFiles(const std::vector<bool>& read) {
  if (!options.drop_cache || engine_kind == Engine::kMmap) return Status::Ok();
  for (size_t f = 0; f < read.size(); ++f) {
    if (!read[f]) continue;
    TF_ASSIGN_OR_RETURN(const io::FileSet::Pin pin,
                        checkpoint->file_set()->Get(static_cast<uint32_t>(f)));
    TF_RETURN_IF_ERROR(pin.file->DropFromPageCache());
  }
  return Status::Ok();
}

Status Loader::Impl::InFileWindows(
    const std::vector<uint32_t>& used, const std::vector<bool>& want_direct,
    const std::function<Status(const std::vector<io::FileSet::Pin>&)>& run) {
  const size_t window = std::max<size_t>(1, files->max_open() / 2);
  std::vector<io::FileSet::Pin> pins(files->size());
  for (size_t w = 0; w < used.size(); w += window) {
    const size_t end = std::min(used.size(), w + window);
    for (size_t i = w; i < end; ++i) {
      const uint32_t f = used[i];
      TF_ASSIGN_OR_RETURN(pins[f], files->Get(f, f < want_direct.size() && want_direct[f]));
    }
    TF_RETURN_IF_ERROR(run(pins));
    // Each file read is checked now, after its reads, through its pin: once unpinned it may be
    // closed (evicted from the file set) before the batch ends, by the next window or by another
    // loader of the checkpoint opening files, and then CheckFilesAfterReads would not see it.
    for (size_t i = w; i < end; ++i) TF_RETURN_IF_ERROR(pins[used[i]].file->CheckUnchanged());
    for (size_t i = w; i < end; ++i) pins[used[i]] = {};
  }
  return Status::Ok();
}

Result<Loader::Impl::Resolved> Loader::Impl::Resolve(const Selection& selection) const {
  TF_ASSIGN_OR_RETURN(Description d, Describe(selection));
  return Index(std::move(d));
}

Result<Description> Loader::Impl::Describe(const Selection& selection) const {
  return DescribeSelection(*checkpoint, selection,
                           options.tensor_parallel ? &*options.tensor_parallel : nullptr);
}

Loader::Impl::Resolved Loader::Impl::Index(Description d) {
  Resolved r;
  r.read = std::move(d.read);
  if (d.outputs.size() == r.read.size() &&
      std::none_of(d.outputs.begin(), d.outputs.end(), [](const auto& o) { return o.alias; })) {
    return r;  // every read tensor delivered as itself
  }
  r.deliver.assign(r.read.empty() ? 0 : r.read.back() + 1, false);
  std::vector<std::pair<std::string, uint32_t>> aliases;  // by name: a batch's order
  for (OutputInfo& o : d.outputs) {
    if (o.alias) {
      aliases.emplace_back(std::move(o.name), o.tensor);
    } else {
      r.deliver[o.tensor] = true;
    }
  }
  std::sort(aliases.begin(), aliases.end());
  for (auto& [name, target] : aliases) r.aliases.emplace(target, std::move(name));
  return r;
}

void Loader::Impl::Deliver(const Resolved& resolved, const PlanBatch& planned, Batch& batch) {
  if (resolved.deliver.empty()) return;
  std::vector<Tensor> out;
  out.reserve(batch.tensors.size() + resolved.aliases.size());
  for (size_t i = 0; i < batch.tensors.size(); ++i) {
    const uint32_t index = planned.tensors[i].tensor;
    Tensor& t = batch.tensors[i];
    const auto [first, last] = resolved.aliases.equal_range(index);
    for (auto it = first; it != last; ++it) {
      out.emplace_back(it->second, t.dtype(), t.shape(), t.data(), t.size(), t.owner(), t.device());
    }
    if (resolved.deliver[index]) out.push_back(std::move(t));
  }
  batch.tensors = std::move(out);
}

Result<std::vector<Group>> Loader::Impl::MakeGroups(const std::vector<uint32_t>& read) const {
  return GroupPlanner(*checkpoint, options).MakeGroups(read);
}

Result<std::vector<bool>> Loader::Impl::ChooseDirect(std::span<const Group> groups,
                                                     bool skip_host_mapped) {
  const auto& infos = checkpoint->files();
  std::vector<uint64_t> lo(infos.size(), UINT64_MAX), hi(infos.size(), 0);
  for (const Group& g : groups) {
    if (skip_host_mapped && g.device.is_cpu()) continue;
    for (const PlanBatch& b : g.plan.batches) {
      for (const ReadTask& t : b.tasks) {
        lo[t.file] = std::min(lo[t.file], t.file_offset);
        hi[t.file] = std::max(hi[t.file], t.file_offset + t.length);
      }
    }
    for (const std::vector<StridedRead>& reads : g.strided) {
      for (const StridedRead& t : reads) {
        lo[t.file] = std::min(lo[t.file], t.file_offset);
        hi[t.file] = std::max(hi[t.file], t.file_offset + t.length());
      }
    }
  }
  return ChooseDirect(std::make_pair(std::move(lo), std::move(hi)));
}

Result<std::vector<bool>> Loader::Impl::ChooseDirect(
    const std::pair<std::vector<uint64_t>, std::vector<uint64_t>>& spans) {
  const auto& [lo, hi] = spans;
  const auto& infos = checkpoint->files();
  std::vector<bool> use_direct(infos.size(), false);
  for (uint32_t f = 0; f < infos.size(); ++f) {
    if (hi[f] == 0) continue;  // not read by this plan
    bool use = false;
    if (options.direct != DirectIO::kOff) {
      TF_ASSIGN_OR_RETURN(io::FileSet::Pin pin, files->Get(f));
      use = options.direct == DirectIO::kOn;
      if (!use && pin.file->native_handle() >= 0) {
        auto cached =
            io::CachedFraction(pin.file->native_handle(), infos[f].path, lo[f], hi[f] - lo[f]);
        use = cached.ok() && *cached < kDirectBelowCachedFraction;
      }
      if (use) {
        TF_ASSIGN_OR_RETURN(pin, files->Get(f, true));
        use = pin.direct != nullptr;  // refused by the file system: buffered
      }
    }
    use_direct[f] = use;
    ++(use ? stats.direct_files : stats.buffered_files);
  }
  return use_direct;
}

Result<bool> Loader::Impl::PrepareDevices(const std::vector<Group>& groups) {
  bool any_device = false;
  for (const Group& g : groups) {
    if (!g.device.is_cuda()) continue;
    any_device = true;
    TF_ASSIGN_OR_RETURN(sink::DeviceSlot * slot, Slot(g.device.index));
    slot->allocator->ResetPeak();
  }
  if (any_device) TF_RETURN_IF_ERROR(CopyEngine().status());
  return any_device;
}

void Loader::Impl::ResetStats() {
  stats = LoadStats();
  stats.engine = std::string(EngineName(engine_kind));
  stats.engine_reason = engine_reason;
  stats.filesystem = filesystems;
}

const io::ReadEngine* Loader::Impl::Counted() const {
  return copy_engine ? copy_engine : engine.get();
}

sink::SinkContext Loader::Impl::Context(std::vector<bool> want_direct, io::ReadEngine* reader) {
  sink::SinkContext c;
  c.checkpoint = checkpoint.get();
  c.checkpoint_ref = checkpoint;
  c.options = &options;
  c.want_direct = std::move(want_direct);
  c.windows = [this](const std::vector<uint32_t>& used, const std::vector<bool>& direct,
                     const std::function<Status(const std::vector<io::FileSet::Pin>&)>& run) {
    return InFileWindows(used, direct, run);
  };
  c.engine = reader;
  c.pool = pool.get();
  c.budget = budget.get();
  c.files = files.get();
  c.maps = &maps;
  c.viewed = &viewed;
  c.gather_maps = &gather_maps;
  return c;
}

void Loader::Impl::CollectDeviceStats(const std::map<int, device::DevicePipelineStats>& before) {
  std::string reasons;
  for (const auto& [index, slot] : slots) {
    const device::DevicePipelineStats now = slot.pipeline->stats();
    stats.pinned_bytes += now.pinned_bytes;
    auto it = before.find(index);
    const uint64_t staged0 = it == before.end() ? 0 : it->second.staged_bytes;
    const uint64_t gds0 = it == before.end() ? 0 : it->second.gds_bytes;
    const uint64_t tasks0 = it == before.end() ? 0 : it->second.tasks;
    stats.staged_bytes += now.staged_bytes - staged0;
    const uint64_t gathered =
        now.gathered_bytes - (it == before.end() ? 0 : it->second.gathered_bytes);
    stats.gathered_bytes += gathered;
    stats.bytes_read += gathered;  // the engine did not read these: the mapping did
    stats.gds_bytes += now.gds_bytes - gds0;
    stats.bytes_read += now.gds_bytes - gds0;  // read by cuFile, not by the engine
    stats.peak_device_bytes += slot.allocator->peak();
    if (now.tasks != tasks0 && !now.gds_reason.empty()) {
      if (!reasons.empty()) reasons += "; ";
      reasons += slots.size() > 1 ? "cuda:" + std::to_string(index) + ": " + now.gds_reason
                                  : now.gds_reason;
    }
  }
  stats.gds_reason = std::move(reasons);
}

Status EngineAvailable(Engine engine) {
  return engine == Engine::kIoUring ? io::IoUringAvailable() : Status::Ok();
}

Loader::Loader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loader::~Loader() = default;

Result<std::unique_ptr<Loader>> Loader::Open(std::shared_ptr<const Checkpoint> checkpoint,
                                             const LoadOptions& given) {
  if (!checkpoint) return Status(Code::kInvalidArgument, "Loader::Open: null checkpoint");
  // Checks and clamps: LoadOptions::Validated (src/options/options.cc).
  TF_ASSIGN_OR_RETURN(const LoadOptions options, given.Validated());
  auto impl = std::make_unique<Impl>();
  impl->checkpoint = std::move(checkpoint);
  impl->options = options;
  Engine kind = options.engine;
  // A remote source (object storage): many network reads in flight, each of its part size.
  const SourceReadHints hints = impl->checkpoint->file_set()->source()->hints();
  // The engine setting is about local files: whatever it says (mmap has nothing to map), the
  // reads are requests issued by the pread engine's workers.
  if (hints.concurrency > 0) {
    kind = Engine::kPread;
    impl->options.threads = std::max(options.threads > 0 ? options.threads : 1,
                                     std::min(hints.concurrency, kMaxThreads));
    if (hints.read_size > 0) impl->options.chunk_size = hints.read_size;
    // On the way to a GPU, each staging slot's producer has a request in flight: one per slot.
    if (options.device_producers == 0 && options.staging_slot > 0) {
      impl->options.device_producers = static_cast<unsigned>(
          std::max<uint64_t>(1, options.staging_bytes / options.staging_slot));
    }
  }
  const FileSystems fs =
      hints.concurrency > 0 ? FileSystems{} : DetectFileSystems(*impl->checkpoint);
  impl->filesystems = fs.types;
  if (hints.concurrency > 0) {
    impl->engine_reason = "object storage: requests issued by the pread engine's workers";
    if (!hints.reason.empty()) impl->engine_reason += ", " + hints.reason;
  } else if (kind != Engine::kAuto) {
    impl->engine_reason = "set by the caller";
    if (kind == Engine::kMmap && !fs.slow.empty()) {
      impl->engine_reason += " (" + fs.slow + ": page faults there are slow; auto would read)";
    }
  } else if (!fs.slow.empty()) {
    // Large reads with many in flight, never page faults: each miss of a mapping would wait for
    // one round trip of at most the readahead window.
    const unsigned workers = options.threads > 0 ? options.threads : DefaultThreads();
    const LoadOptions defaults;
    const unsigned depth =
        options.queue_depth == defaults.queue_depth
            ? std::max(options.queue_depth, (kSlowFsInFlight + workers - 1) / workers)
            : options.queue_depth;
    const Status uring = MakeAutoIoUring(impl->options.threads, depth, impl->engine);
    kind = uring.ok() ? Engine::kIoUring : Engine::kPread;
    if (kind == Engine::kIoUring) {
      impl->options.queue_depth = depth;
    } else if (options.threads == 0) {
      impl->options.threads = kSlowFsInFlight;
    }
    const unsigned in_flight =
        kind == Engine::kIoUring
            ? impl->options.queue_depth * workers
            : (impl->options.threads > 0 ? impl->options.threads : DefaultThreads());
    impl->engine_reason = fs.slow + ": mmap page faults would wait for a round trip each; " +
                          std::string(EngineName(kind)) + " with " + std::to_string(in_flight) +
                          " reads of up to " + FormatBytes(impl->options.chunk_size) + " in flight";
    if (!uring.ok()) impl->engine_reason += " (io_uring unavailable: " + uring.message() + ")";
  } else if (options.prefer_mmap && !options.drop_cache) {
    // (drop_cache wants the pages back after the load: mapped tensors are those pages.)
    kind = Engine::kMmap;
    impl->engine_reason = "local file system (prefer_mmap): the files are mapped";
  } else {
    // io_uring where the kernel allows it: the same copies as pread for cached data, and deep
    // queues with few threads for cold and direct reads.
    const Status uring =
        MakeAutoIoUring(impl->options.threads, impl->options.queue_depth, impl->engine);
    kind = uring.ok() ? Engine::kIoUring : Engine::kPread;
    impl->engine_reason =
        uring.ok() ? "io_uring available" : "io_uring unavailable: " + uring.message();
    if (options.prefer_mmap && options.drop_cache) {
      impl->engine_reason += " (drop_cache: not mapped, so the pages can go after the load)";
    }
  }
  impl->engine_kind = kind;
  if (kind == Engine::kIoUring && !impl->engine) {  // (auto's was made above)
    TF_ASSIGN_OR_RETURN(impl->engine,
                        io::MakeIoUringEngine(impl->options.threads, impl->options.queue_depth));
  } else if (kind == Engine::kPread) {
    // threads 0: at least kPreadMinThreads workers (read_engine.h), as for CopyEngine's pool.
    TF_ASSIGN_OR_RETURN(impl->engine, io::MakePreadEngine(impl->options.threads));
  }  // kMmap copies nothing: no read engine
  // No budget, host tensors in memory the copying engines fill: a selection larger than the
  // memory this process may use is loaded under a budget of that much (LoadOptions::memory_limit).
  if (options.budget == 0 && kind != Engine::kMmap && !options.device.is_cuda() &&
      !options.placement && options.memory_limit != UINT64_MAX) {
    uint64_t limit = options.memory_limit;
    std::string where = "the memory_limit option";
    if (limit == 0) {
      const MemoryLimit m = ReadMemoryLimit();
      limit = m.DefaultLoadLimit();
      where = "3/4 of what this process may use: " + m.Describe();
    }
    if (limit > 0 && impl->checkpoint->total_tensor_bytes() > limit) {
      impl->options.budget = limit;
      impl->options.allow_oversized = true;
      impl->memory_note = FormatBytes(limit) + " (" + where + ")";
    }
  }
  // Under a budget, cached buffers count against memory too: keep no more than the budget.
  const uint64_t budget = impl->options.budget;
  impl->pool = memory::BufferPool::Create(
      budget > 0 ? std::min(options.pool_bytes, budget + (2u << 20)) : options.pool_bytes,
      /*trim=*/budget > 0);
  impl->budget = memory::Budget::Create(budget);
  if (options.device.is_cuda() && !options.placement) {
    // A CUDA target is checked now (runtime, device, staging options, GDS when forced), and its
    // pipeline made once for every later load.
    TF_RETURN_IF_ERROR(impl->Slot(options.device.index).status());
    TF_RETURN_IF_ERROR(impl->CopyEngine().status());
  }
  TF_RETURN_IF_ERROR(impl->LoadChecksums());  // LoadOptions::verify (src/loader/verify.cc)
  impl->ResetStats();  // stats() says which engine, and why, before the first load
  return std::unique_ptr<Loader>(new Loader(std::move(impl)));
}

Result<std::unique_ptr<Loader>> Loader::Open(const std::string& path, const LoadOptions& options) {
  OpenOptions open;
  open.env = options.env;
  open.object_store = options.object_store;
  TF_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> checkpoint, Checkpoint::Open(path, open));
  return Open(std::move(checkpoint), options);
}

const std::shared_ptr<const Checkpoint>& Loader::checkpoint() const noexcept {
  return impl_->checkpoint;
}

Result<Description> Loader::Describe(const Selection& selection) const {
  return impl_->Describe(selection);
}

Result<Plan> Loader::MakePlan(const Selection& selection) const {
  TF_ASSIGN_OR_RETURN(Impl::Resolved resolved, impl_->Resolve(selection));
  TF_ASSIGN_OR_RETURN(std::vector<Group> groups, impl_->MakeGroups(resolved.read));
  if (groups.size() == 1) return std::move(groups.front().plan);
  // Several devices: their batches in delivery order, as one plan.
  Plan out;
  for (Group& g : groups) {
    for (PlanBatch& b : g.plan.batches) out.batches.push_back(std::move(b));
    out.tensor_bytes += g.plan.tensor_bytes;
    out.read_bytes += g.plan.read_bytes;
    out.num_tensors += g.plan.num_tensors;
    out.num_moves += g.plan.num_moves;
    out.num_ranges += g.plan.num_ranges;
    out.num_tasks += g.plan.num_tasks;
  }
  return out;
}

Result<std::vector<Tensor>> Loader::Load(const Selection& selection) {
  TF_RETURN_IF_ERROR(CheckFitsAtOnce(selection));
  const Impl& m = *impl_;
  // Output order (Describe); batches deliver tensors in plan order.
  TF_ASSIGN_OR_RETURN(const Description description, m.Describe(selection));
  std::unordered_map<std::string_view, size_t> position;
  for (size_t i = 0; i < description.outputs.size(); ++i) {
    position.emplace(description.outputs[i].name, i);
  }
  std::vector<Tensor> out(description.outputs.size());
  TF_RETURN_IF_ERROR(Stream(selection, [&](Batch batch) {
    for (Tensor& t : batch.tensors) {
      auto it = position.find(t.name());
      if (it == position.end()) {
        return Status(Code::kInternal, "tensor \"" + t.name() + "\" delivered but not selected");
      }
      out[it->second] = std::move(t);
    }
    return Status::Ok();
  }));
  return out;
}

Status Loader::CheckFitsAtOnce(const Selection& selection) const {
  const Impl& m = *impl_;
  const bool host_budget = m.options.budget > 0 && m.engine_kind != Engine::kMmap;
  const bool mapped_budget = m.options.budget > 0 && m.engine_kind == Engine::kMmap;
  if (host_budget || mapped_budget || m.options.device_budget > 0) {
    // Load returns every tensor at once: each device's total must fit its budget. The totals are
    // the plans' (local sizes of tensor-parallel slices, and on the host their covered gaps, as
    // the leases will count them).
    TF_ASSIGN_OR_RETURN(Impl::Resolved resolved, m.Resolve(selection));
    TF_ASSIGN_OR_RETURN(std::vector<Group> groups, m.MakeGroups(resolved.read));
    for (const Group& g : groups) {
      const Device dev = g.device;
      if (mapped_budget && dev.is_cpu()) {
        // Views cost the budget nothing once made, but copies of slices of several ranges keep
        // their share until dropped: each batch's lease must fit beside the copies before it.
        uint64_t copies = 0;
        for (size_t k = 0; k < g.plan.batches.size(); ++k) {
          const PlanBatch& b = g.plan.batches[k];
          if (copies > 0 && copies + sink::HostLeaseBytes(b) > m.options.budget) {
            return Status(
                Code::kBudgetExceeded,
                "Load returns every tensor at once: the mmap engine's copies of "
                "tensor-parallel slices of several ranges (" +
                    std::to_string(copies) + " bytes before batch " + std::to_string(k + 1) +
                    " of " + std::to_string(g.plan.batches.size()) +
                    ") leave too little of the budget of " + std::to_string(m.options.budget) +
                    " bytes for the next batch; use Stream to load batch by batch");
          }
          for (const PlannedTensor& pt : b.tensors) {
            if (pt.slice && SliceRangeCount(m.checkpoint->tensors()[pt.tensor], *pt.slice) > 1) {
              copies += pt.slice->bytes;
            }
          }
        }
        continue;
      }
      uint64_t total = std::max(g.plan.tensor_bytes, g.plan.read_bytes);
      if (dev.is_cuda()) {
        // What the device allocator charges: each batch's buffer, alignment padding included
        // (a load that passed on tensor bytes failed part-way, after batches were read).
        uint64_t buffers = 0;
        for (const PlanBatch& b : g.plan.batches) buffers += b.buffer_size;
        total = std::max(total, buffers);
      }
      const uint64_t limit =
          dev.is_cpu() ? (host_budget ? m.options.budget : 0) : m.options.device_budget;
      if (limit > 0 && total > limit && dev.is_cpu() && !m.memory_note.empty()) {
        const std::string half = std::to_string(std::max<uint64_t>(limit / 2 >> 20, 1)) + "MiB";
        return Status(Code::kBudgetExceeded,
                      "Load returns every tensor at once: " + FormatBytes(total) +
                          " of tensors exceed the host memory limit of " + m.memory_note +
                          "; load batch by batch under a budget (Loader::Stream with budget " +
                          half + "; Python Loader(path, budget=\"" + half +
                          "\").iter_batches(); tensorferry load --budget " + half +
                          ") or map the files (engine mmap)");
      }
      if (limit > 0 && total > limit) {
        return Status(Code::kBudgetExceeded,
                      "Load returns every tensor at once: " + std::to_string(total) +
                          " bytes for " + DeviceName(dev) + " exceed the " +
                          (dev.is_cpu() ? "budget" : "device budget") + " of " +
                          std::to_string(limit) + " bytes; use Stream to load batch by batch");
      }
    }
  }
  return Status::Ok();
}

LoadStats Loader::stats() const {
  return impl_->stats;
}

// --- Placement ---------------------------------------------------------------------------------

std::function<Device(const TensorInfo&)> Placement(std::vector<std::pair<std::string, Device>> map,
                                                   Device fallback) {
  // Longest prefix first, so the first match is the most specific.
  std::stable_sort(map.begin(), map.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return [map = std::move(map), fallback](const TensorInfo& t) {
    const std::string_view name = t.name;
    for (const auto& [prefix, device] : map) {
      if (prefix.empty()) return device;
      if (name.size() >= prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
          (name.size() == prefix.size() || name[prefix.size()] == '.' || prefix.back() == '.')) {
        return device;
      }
    }
    return fallback;
  };
}

}  // namespace tensorferry

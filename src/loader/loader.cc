// The loader: Selection -> Plan (per device) -> read engine -> pooled host buffers or device
// buffers through the device pipeline -> Tensors.
#include "tensorferry/loader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "cuda/cuda_api.h"
#include "device/device_memory.h"
#include "device/pipeline.h"
#include "io/engine_common.h"
#include "io/file_set.h"
#include "io/mapped_file.h"
#include "io/read_engine.h"
#include "loader/groups.h"
#include "loader/sink.h"
#include "memory/host_buffer.h"
#include "plan/device_layout.h"
#include "tensorferry/format.h"
#include "tensorferry/mapping.h"
#include "tensorferry/residency.h"
#include "tensorferry/shard.h"
#include "tensorferry/size.h"
#include "util/macros.h"

namespace tensorferry {

// --- Loader -----------------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;

// With DirectIO::kAuto, a file is read with O_DIRECT when less than this fraction of the bytes to
// read is in the page cache.
constexpr double kDirectBelowCachedFraction = 0.5;

}  // namespace

struct Loader::Impl {
  std::shared_ptr<const Checkpoint> checkpoint;
  LoadOptions options;
  Env* env = nullptr;
  Engine engine_kind = Engine::kPread;  // resolved (never kAuto)
  std::unique_ptr<io::ReadEngine> engine;
  std::shared_ptr<memory::BufferPool> pool;
  std::shared_ptr<memory::Budget> budget;
  // The checkpoint's files, opened on demand under a bound on descriptors (io/file_set.h).
  std::unique_ptr<io::FileSet> files;
  // Per file, for the mmap engine: the mapping, created on first use and kept for the loader.
  std::vector<std::shared_ptr<io::MappedFile>> maps;
  LoadStats stats;
  // Device loading: the runtime (loaded on first use), one sink per CUDA device used, and the
  // engine device batches read through (the loader's engine; a pread engine for kMmap, which has
  // none).
  std::shared_ptr<const cuda::Runtime> runtime;
  std::map<int, sink::DeviceSlot> slots;
  std::unique_ptr<io::ReadEngine> own_copy_engine;
  io::ReadEngine* copy_engine = nullptr;

  // The sink of CUDA device `index`, created on first use. REQUIRES: not called while a batch is
  // being read on the helper thread.
  Result<sink::DeviceSlot*> Slot(int index) {
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
    TF_ASSIGN_OR_RETURN(std::unique_ptr<device::DevicePipeline> pipeline,
                        device::DevicePipeline::Create(runtime, p));
    sink::DeviceSlot slot{device::DeviceAllocator::Create(runtime, index, options.device_budget),
                          std::move(pipeline)};
    return &slots.emplace(index, std::move(slot)).first->second;
  }

  // The engine that copies bytes into memory (host destinations of LoadInto, device batches).
  Result<io::ReadEngine*> CopyEngine() {
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

  // Makes the file set once per loader, and checks that the files it holds open still have the
  // size seen at Checkpoint::Open (the others are checked when opened): a file replaced or
  // truncated since then is reported before a read of it.
  Status OpenFiles() {
    const auto& infos = checkpoint->files();
    if (!files) {
      std::vector<io::FileSet::FileSpec> specs;
      specs.reserve(infos.size());
      for (const FileInfo& f : infos) specs.push_back({f.path, f.file_size});
      files = std::make_unique<io::FileSet>(env, std::move(specs), io::FileSet::DefaultMaxOpen());
      maps.clear();
      maps.resize(infos.size());
    }
    return files->CheckOpenSizes();
  }

  // Runs `run` over windows of the files in `used` (distinct file indices), each window at most
  // half the file set's descriptor bound, with the window's files pinned: pins[f].file is set for
  // exactly the files of the window. One window unless a batch reads hundreds of files.
  Status InFileWindows(const std::vector<uint32_t>& used, const std::vector<bool>& want_direct,
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
      for (size_t i = w; i < end; ++i) pins[used[i]] = {};
    }
    return Status::Ok();
  }

  // What a selection means for one load (Describe), indexed for batches: the tensors to read,
  // which of them go to the caller under their own name, and the tied aliases (LoadOptions::shard
  // ties) delivered sharing their target's data.
  struct Resolved {
    std::vector<uint32_t> read;                    // indices into tensors(), ascending
    std::vector<bool> deliver;                     // per tensor index; empty: every read tensor
    std::multimap<uint32_t, std::string> aliases;  // target index -> alias name
  };

  Result<Resolved> Resolve(const Selection& selection) const {
    TF_ASSIGN_OR_RETURN(Description d, Describe(selection));
    return Index(std::move(d));
  }

  Result<Description> Describe(const Selection& selection) const {
    return DescribeSelection(*checkpoint, selection, options.shard ? &*options.shard : nullptr);
  }

  static Resolved Index(Description d) {
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

  // Applies `resolved` to a batch made from `planned`: tied aliases added after their target
  // (sharing its bytes and owner), tensors read only for an alias dropped.
  static void Deliver(const Resolved& resolved, const PlanBatch& planned, Batch& batch) {
    if (resolved.deliver.empty()) return;
    std::vector<Tensor> out;
    out.reserve(batch.tensors.size() + resolved.aliases.size());
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const uint32_t index = planned.tensors[i].tensor;
      Tensor& t = batch.tensors[i];
      const auto [first, last] = resolved.aliases.equal_range(index);
      for (auto it = first; it != last; ++it) {
        out.emplace_back(it->second, t.dtype(), t.shape(), t.data(), t.size(), t.owner(),
                         t.device());
      }
      if (resolved.deliver[index]) out.push_back(std::move(t));
    }
    batch.tensors = std::move(out);
  }

  Result<std::vector<Group>> MakeGroups(const std::vector<uint32_t>& read) const {
    return GroupPlanner(*checkpoint, options).MakeGroups(read);
  }

  // Decides, per file the plan reads, whether its reads use O_DIRECT: returns the descriptor per
  // file index (-1: buffered) and counts the choices into stats.
  // `reads`: the (file, offset, length) ranges the load reads; `skip_host_mapped`: the mmap
  // engine's host batches read nothing (only its device batches count).
  Result<std::vector<bool>> ChooseDirect(std::span<const Group> groups, bool skip_host_mapped) {
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

  // Per file, whether its reads within [lo, hi) use O_DIRECT (hi 0: not read). The O_DIRECT
  // descriptor is opened here, so a file system that refuses it is known (and counted) now.
  Result<std::vector<bool>> ChooseDirect(
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

  // Every device slot of `groups` (its peak reset) and the copy engine when a group is bound for a
  // device: whether one is.
  Result<bool> PrepareDevices(const std::vector<Group>& groups) {
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

  // The engine whose counters a load reports (it reads host and device batches alike).
  const io::ReadEngine* Counted() const { return copy_engine ? copy_engine : engine.get(); }

  // What the sinks of one load borrow.
  sink::SinkContext Context(std::vector<bool> want_direct, io::ReadEngine* reader) {
    sink::SinkContext c;
    c.checkpoint = checkpoint.get();
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
    return c;
  }

  // The device figures of the load that just ended: pipeline totals since `before`, the pinned
  // memory held, the peak of device buffers.
  void CollectDeviceStats(const std::map<int, device::DevicePipelineStats>& before) {
    std::string reasons;
    for (const auto& [index, slot] : slots) {
      const device::DevicePipelineStats now = slot.pipeline->stats();
      stats.pinned_bytes += now.pinned_bytes;
      auto it = before.find(index);
      const uint64_t staged0 = it == before.end() ? 0 : it->second.staged_bytes;
      const uint64_t gds0 = it == before.end() ? 0 : it->second.gds_bytes;
      const uint64_t tasks0 = it == before.end() ? 0 : it->second.tasks;
      stats.staged_bytes += now.staged_bytes - staged0;
      stats.gds_bytes += now.gds_bytes - gds0;
      stats.peak_device_bytes += slot.allocator->peak();
      if (now.tasks != tasks0 && !now.gds_reason.empty()) {
        if (!reasons.empty()) reasons += "; ";
        reasons += slots.size() > 1 ? "cuda:" + std::to_string(index) + ": " + now.gds_reason
                                    : now.gds_reason;
      }
    }
    stats.gds_reason = std::move(reasons);
  }
};

namespace {

// A destination of LoadInto for output `o`: a valid device, room for the tensor (its slice), not
// null unless the tensor is empty.
Status CheckDestination(const Destination& d, const OutputInfo& o,
                        const std::optional<TensorParallelOptions>& shard) {
  const std::string what = o.slice ? " (the slice of rank " + std::to_string(shard->rank) + " of " +
                                         std::to_string(shard->world) + ", " +
                                         o.slice->rule.ToString() + ")"
                                   : "";
  if (d.device.is_cuda() && d.device.index < 0) {
    return Status(Code::kInvalidArgument,
                  "tensor \"" + d.name + "\": CUDA device index " + std::to_string(d.device.index));
  }
  if (d.capacity < o.bytes) {
    return Status(Code::kInvalidArgument,
                  "tensor \"" + d.name + "\" needs " + std::to_string(o.bytes) + " bytes (" +
                      FormatBytes(o.bytes) + ")" + what + " but its destination on " +
                      DeviceName(d.device) + " holds " + std::to_string(d.capacity) + " bytes");
  }
  if (o.bytes > 0 && d.data == nullptr) {
    return Status(Code::kInvalidArgument, "tensor \"" + d.name + "\" (" + std::to_string(o.bytes) +
                                              " bytes" + what + "): null destination");
  }
  return Status::Ok();
}

// No two destinations may overlap on one device (the bytes each tensor occupies).
Status CheckOverlaps(std::span<const Destination> destinations,
                     const std::vector<const OutputInfo*>& outputs) {
  std::vector<size_t> by_address;
  for (size_t i = 0; i < destinations.size(); ++i) {
    if (outputs[i]->bytes > 0) by_address.push_back(i);
  }
  auto addr = [&](size_t i) { return reinterpret_cast<uintptr_t>(destinations[i].data); };
  std::sort(by_address.begin(), by_address.end(), [&](size_t a, size_t b) {
    const Device& da = destinations[a].device;
    const Device& db = destinations[b].device;
    return da == db ? addr(a) < addr(b) : da < db;
  });
  for (size_t j = 1; j < by_address.size(); ++j) {
    const size_t a = by_address[j - 1], b = by_address[j];
    const uint64_t size = outputs[a]->bytes;
    if (destinations[a].device == destinations[b].device && addr(a) + size > addr(b)) {
      return Status(Code::kInvalidArgument, "destinations of tensors \"" + destinations[a].name +
                                                "\" (" + std::to_string(size) + " bytes) and \"" +
                                                destinations[b].name + "\" overlap on " +
                                                DeviceName(destinations[a].device));
    }
  }
  return Status::Ok();
}

// Per file, the span [lo, hi) of the tensors `outputs` read (hi 0: not read).
std::pair<std::vector<uint64_t>, std::vector<uint64_t>> ReadSpans(
    const Checkpoint& ckpt, const std::vector<const OutputInfo*>& outputs) {
  const size_t nfiles = ckpt.files().size();
  std::vector<uint64_t> lo(nfiles, UINT64_MAX), hi(nfiles, 0);
  for (const OutputInfo* o : outputs) {
    const TensorInfo& t = ckpt.tensors()[o->tensor];
    if (t.size == 0) continue;
    lo[t.file] = std::min(lo[t.file], t.offset);
    hi[t.file] = std::max(hi[t.file], t.offset + t.size);
  }
  return {std::move(lo), std::move(hi)};
}

// The reads of LoadInto: host requests and, per CUDA device, device tasks (file and O_DIRECT
// descriptor filled in per window; element i reads file *_file[i]).
struct IntoReads {
  std::vector<io::ReadRequest> host;
  std::vector<uint32_t> host_file;
  std::map<int, std::vector<device::DeviceTask>> device_tasks;
  std::map<int, std::vector<uint32_t>> device_task_file;
  std::map<int, uint64_t> device_tensors, device_bytes;
};

IntoReads MakeIntoReads(const Checkpoint& ckpt, const std::vector<const OutputInfo*>& outputs,
                        std::span<const Destination> destinations, const LoadOptions& options) {
  IntoReads out;
  const std::atomic<bool>* cancel = options.cancel.get();
  for (size_t i = 0; i < destinations.size(); ++i) {
    const OutputInfo& o = *outputs[i];
    const TensorInfo& t = ckpt.tensors()[o.tensor];
    const Destination& d = destinations[i];
    if (o.bytes == 0) continue;
    auto* dst = static_cast<std::byte*>(d.data);
    // What lands where: the whole tensor, or the slice's blocks (contiguous or strided).
    const std::vector<StridedRead> reads = TensorReads(t, o.slice);
    if (d.device.is_cuda()) {
      for (const StridedRead& r : reads) {
        out.device_tasks[d.device.index].push_back(sink::DeviceTaskOf(r, dst, cancel));
        out.device_task_file[d.device.index].push_back(t.file);
      }
      out.device_tensors[d.device.index] += 1;
      out.device_bytes[d.device.index] += o.bytes;
      continue;
    }
    // Host: every row exactly (no covered gaps: the destination holds the slice only), cut into
    // chunk_size reads so one large tensor is read by every worker.
    for (const StridedRead& r : reads) {
      for (uint64_t row = 0; row < r.rows; ++row) {
        std::byte* to = dst + r.buffer_offset + row * r.dst_pitch;
        const uint64_t from = r.file_offset + row * r.src_pitch;
        for (uint64_t at = 0; at < r.row_bytes; at += options.chunk_size) {
          const uint64_t len = std::min(options.chunk_size, r.row_bytes - at);
          out.host.push_back({nullptr, from + at,
                              std::span<std::byte>(to + at, static_cast<size_t>(len)), -1, cancel});
          out.host_file.push_back(t.file);
        }
      }
    }
  }
  return out;
}

}  // namespace

Loader::Loader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loader::~Loader() = default;

Result<std::unique_ptr<Loader>> Loader::Open(std::shared_ptr<const Checkpoint> checkpoint,
                                             const LoadOptions& given) {
  if (!checkpoint) return Status(Code::kInvalidArgument, "Loader::Open: null checkpoint");
  if (given.chunk_size == 0) return Status(Code::kInvalidArgument, "chunk_size must be > 0");
  // Clamped, not refused: a tiny chunk only multiplies per-read costs (and plan memory: one task
  // per chunk), and threads beyond kMaxThreads only cost memory and start-up time.
  LoadOptions options = given;
  options.chunk_size = std::max(options.chunk_size, kMinChunkSize);
  options.threads = std::min(options.threads, kMaxThreads);
  options.queue_depth = std::min(options.queue_depth, kMaxQueueDepth);
  if (options.queue_depth == 0) return Status(Code::kInvalidArgument, "queue_depth must be > 0");
  if (options.shard) {
    if (options.shard->world == 0 || options.shard->rank >= options.shard->world) {
      return Status(Code::kInvalidArgument,
                    "tensor parallelism: rank " + std::to_string(options.shard->rank) + " of " +
                        std::to_string(options.shard->world) +
                        ": the rank must be below a world size of at least 1");
    }
    TF_RETURN_IF_ERROR(options.shard->spec.Validate());
  }
  auto impl = std::make_unique<Impl>();
  impl->checkpoint = std::move(checkpoint);
  impl->options = options;
  impl->env = options.env ? options.env : Env::Default();
  Engine kind = options.engine;
  if (kind == Engine::kAuto) {
    // io_uring where the kernel allows it: the same copies as pread for cached data, and deep
    // queues with few threads for cold and direct reads.
    kind = io::IoUringAvailable().ok() ? Engine::kIoUring : Engine::kPread;
  }
  impl->engine_kind = kind;
  if (kind == Engine::kIoUring) {
    TF_ASSIGN_OR_RETURN(impl->engine, io::MakeIoUringEngine(options.threads, options.queue_depth));
  } else if (kind == Engine::kPread) {
    TF_ASSIGN_OR_RETURN(impl->engine, io::MakePreadEngine(options.threads));
  }  // kMmap copies nothing: no read engine
  // Under a budget, cached buffers count against memory too: keep no more than the budget.
  impl->pool = memory::BufferPool::Create(
      options.budget > 0 ? std::min(options.pool_bytes, options.budget + (2u << 20))
                         : options.pool_bytes);
  impl->budget = memory::Budget::Create(options.budget);
  if (options.device.is_cuda() && !options.placement) {
    // A CUDA target is checked now (runtime, device, staging options, GDS when forced), and its
    // pipeline made once for every later load.
    TF_RETURN_IF_ERROR(impl->Slot(options.device.index).status());
    TF_RETURN_IF_ERROR(impl->CopyEngine().status());
  }
  return std::unique_ptr<Loader>(new Loader(std::move(impl)));
}

Result<std::unique_ptr<Loader>> Loader::Open(const std::string& path, const LoadOptions& options) {
  OpenOptions open;
  open.env = options.env;
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

// --- BatchIterator: plan -> engine -> sink, one batch per Next --------------------------------

struct BatchIterator::State {
  Loader::Impl* m = nullptr;
  Loader::Impl::Resolved resolved;
  std::vector<Group> groups;
  sink::SinkContext host, device;  // the sinks' borrowed state: the engine differs
  std::vector<std::unique_ptr<sink::BatchSink>> sinks;  // per group
  std::vector<std::pair<size_t, size_t>> order;         // (group, batch), the host's first
  size_t k = 0;                                         // the next batch to deliver
  bool over = false;                                    // ended, failed, or the end reached
  std::future<Result<Batch>> next;                      // batch k, read ahead
  // Statistics: the time the caller held a batch with no read in flight is not loading time.
  Clock::time_point start;
  Clock::duration idle{};
  std::optional<Clock::time_point> returned_at;
  bool returned_overlapped = false;
  uint64_t reused0 = 0, allocated0 = 0, direct0 = 0, read0 = 0;
  std::map<int, device::DevicePipelineStats> pipeline0;

  ~State() {
    if (next.valid()) next.wait();  // its buffer and files must not outlive the loader's use
  }

  const PlanBatch& BatchAt(size_t j) const {
    return groups[order[j].first].plan.batches[order[j].second];
  }

  // Reads batch j into `memory` through its group's sink.
  Result<Batch> Produce(size_t j, sink::Reservation memory) {
    const auto [g, b] = order[j];
    if (m->options.cancel && m->options.cancel->load(std::memory_order_relaxed)) {
      return Result<Batch>(Status(Code::kCancelled, "the load was cancelled"));
    }
    Result<Batch> got = sinks[g]->Complete(b, std::move(memory));
    if (got.ok()) {
      got->index = j;
      got->count = order.size();
      got->device = groups[g].device;
    }
    return got;
  }

  // Batch k: read ahead, or read now when its memory fits (kBudgetExceeded otherwise).
  Result<Batch> Take() {
    if (next.valid()) return next.get();
    sink::BatchSink& s = *sinks[order[k].first];
    TF_ASSIGN_OR_RETURN(std::optional<sink::Reservation> r, s.Reserve(BatchAt(k)));
    if (!r) return s.BudgetError(BatchAt(k), k, order.size());
    return Produce(k, std::move(*r));
  }

  // Double buffering: batch j is read on a helper thread while the caller handles batch j - 1,
  // when its memory fits its budget now (the plan halves batches under a budget so they do). A
  // failure to reserve (e.g. cudaMalloc while the caller still holds the batch) is not an error
  // yet: the batch is tried again, and its error reported, by the next Next.
  void ReadAhead(size_t j) {
    if (j >= order.size() || !sinks[order[j].first]->reads_ahead()) return;
    Result<std::optional<sink::Reservation>> r = sinks[order[j].first]->Reserve(BatchAt(j));
    if (!r.ok() || !*r) return;
    next = std::async(std::launch::async, [this, j, memory = std::move(**r)]() mutable {
      return Produce(j, std::move(memory));
    });
  }

  // Batch k as the caller gets it (tied aliases added, tensors read only for an alias dropped),
  // counted.
  void Count(Batch& batch) {
    const PlanBatch& planned = BatchAt(k);
    Loader::Impl::Deliver(resolved, planned, batch);
    LoadStats& stats = m->stats;
    stats.tensors += batch.tensors.size();
    stats.bytes += batch.bytes;
    stats.batches += 1;
    if (batch.device.is_cuda()) {
      stats.device_tensors += batch.tensors.size();
      stats.device_bytes += batch.bytes;
      stats.device_batches += 1;
      stats.device_buffer_bytes += planned.buffer_size;
    }
    stats.peak_budget_bytes = m->budget->peak();
  }

  // The totals of a load that reached its end.
  void Finish() {
    LoadStats& stats = m->stats;
    stats.seconds = std::chrono::duration<double>(Clock::now() - start - idle).count();
    stats.peak_budget_bytes = m->budget->peak();
    stats.buffers_reused = m->pool->reused() - reused0;
    stats.buffers_allocated = m->pool->allocated() - allocated0;
    const io::ReadEngine* counted = m->Counted();
    stats.direct_bytes = counted ? counted->stats().direct_bytes - direct0 : 0;
    // Bytes read: the engine's count (it reads host and device batches alike), plus, with the
    // mmap engine, what its host batches populate or gather.
    stats.bytes_read = counted ? counted->stats().bytes_read - read0 : 0;
    if (m->engine_kind == Engine::kMmap) {
      for (const Group& g : groups) {
        if (g.device.is_cpu()) stats.bytes_read += g.plan.read_bytes;
      }
    }
    m->CollectDeviceStats(pipeline0);
  }
};

BatchIterator::BatchIterator(std::unique_ptr<State> state) : state_(std::move(state)) {}
BatchIterator::BatchIterator(BatchIterator&&) noexcept = default;
BatchIterator& BatchIterator::operator=(BatchIterator&&) noexcept = default;
BatchIterator::~BatchIterator() = default;

Result<std::optional<Batch>> BatchIterator::Next() {
  State& s = *state_;
  if (s.over) return std::optional<Batch>();
  if (s.returned_at && !s.returned_overlapped) s.idle += Clock::now() - *s.returned_at;
  if (s.k == s.order.size()) {
    s.over = true;
    s.Finish();
    return std::optional<Batch>();
  }
  Result<Batch> current = s.Take();
  if (!current.ok()) {
    s.over = true;
    return current.status();
  }
  Batch batch = std::move(current).value();
  s.Count(batch);
  s.ReadAhead(++s.k);
  s.returned_overlapped = s.next.valid();
  s.returned_at = Clock::now();
  return std::optional<Batch>(std::move(batch));
}

Result<BatchIterator> Loader::Iterate(const Selection& selection) {
  TF_RETURN_IF_ERROR(CheckMappedFiles());  // tensors of an earlier load lost bytes: say so first
  Impl& m = *impl_;
  m.stats = LoadStats();
  m.stats.engine = std::string(EngineName(m.engine_kind));
  auto s = std::make_unique<BatchIterator::State>();
  s->m = &m;
  s->start = Clock::now();
  s->reused0 = m.pool->reused();
  s->allocated0 = m.pool->allocated();
  TF_ASSIGN_OR_RETURN(s->resolved, m.Resolve(selection));
  TF_ASSIGN_OR_RETURN(s->groups, m.MakeGroups(s->resolved.read));
  TF_RETURN_IF_ERROR(m.OpenFiles());
  // Every device slot and the copy engine before the first batch: their errors come first, and
  // the helper thread that reads ahead never creates one.
  TF_ASSIGN_OR_RETURN(const bool any_device, m.PrepareDevices(s->groups));
  for (const auto& [index, slot] : m.slots) s->pipeline0[index] = slot.pipeline->stats();
  if (const io::ReadEngine* counted = m.Counted()) {
    s->direct0 = counted->stats().direct_bytes;
    s->read0 = counted->stats().bytes_read;
  }
  const bool mapped = m.engine_kind == Engine::kMmap;
  std::vector<bool> want_direct;
  if (!mapped || any_device) {
    TF_ASSIGN_OR_RETURN(want_direct, m.ChooseDirect(s->groups, mapped));
  }
  m.stats.device = s->groups.size() == 1 ? DeviceName(s->groups.front().device) : "mixed";
  s->host = m.Context(want_direct, m.engine.get());
  s->device = m.Context(want_direct, m.copy_engine);
  for (size_t g = 0; g < s->groups.size(); ++g) {
    const Group& group = s->groups[g];
    if (group.device.is_cuda()) {
      s->sinks.push_back(sink::MakeDeviceSink(s->device, group.plan, group.strided, group.device,
                                              m.slots.at(group.device.index)));
    } else if (mapped) {
      s->sinks.push_back(sink::MakeMappedSink(s->host, group.plan));
    } else {
      s->sinks.push_back(sink::MakeHostSink(s->host, group.plan, group.batch_budget));
    }
    for (size_t b = 0; b < group.plan.batches.size(); ++b) s->order.emplace_back(g, b);
  }
  return BatchIterator(std::move(s));
}

Status Loader::Stream(const Selection& selection, const std::function<Status(Batch)>& on_batch) {
  TF_ASSIGN_OR_RETURN(BatchIterator batches, Iterate(selection));
  for (;;) {
    TF_ASSIGN_OR_RETURN(std::optional<Batch> batch, batches.Next());
    if (!batch) return Status::Ok();
    TF_RETURN_IF_ERROR(on_batch(std::move(*batch)));
  }
}

Result<std::vector<Tensor>> Loader::Load(const Selection& selection) {
  const Impl& m = *impl_;
  const bool host_budget = m.options.budget > 0 && m.engine_kind != Engine::kMmap;
  if (host_budget || m.options.device_budget > 0) {
    // Load returns every tensor at once: each device's total must fit its budget. The totals are
    // the plans' (local sizes of tensor-parallel slices, and on the host their covered gaps, as
    // the leases will count them).
    TF_ASSIGN_OR_RETURN(Impl::Resolved resolved, m.Resolve(selection));
    TF_ASSIGN_OR_RETURN(std::vector<Group> groups, m.MakeGroups(resolved.read));
    for (const Group& g : groups) {
      const Device dev = g.device;
      const uint64_t total = std::max(g.plan.tensor_bytes, g.plan.read_bytes);
      const uint64_t limit =
          dev.is_cpu() ? (host_budget ? m.options.budget : 0) : m.options.device_budget;
      if (limit > 0 && total > limit) {
        return Status(Code::kBudgetExceeded,
                      "Load returns every tensor at once: " + std::to_string(total) +
                          " bytes for " + DeviceName(dev) + " exceed the " +
                          (dev.is_cpu() ? "budget" : "device budget") + " of " +
                          std::to_string(limit) + " bytes; use Stream to load batch by batch");
      }
    }
  }
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

Status Loader::LoadInto(std::span<const Destination> destinations) {
  TF_RETURN_IF_ERROR(CheckMappedFiles());
  Impl& m = *impl_;
  m.stats = LoadStats();
  m.stats.engine = std::string(EngineName(m.engine_kind));
  const auto start = Clock::now();
  const Checkpoint& ckpt = *m.checkpoint;

  // Every check before any read. With LoadOptions::shard each tensor's slice is what is read
  // (and what the destination must hold); a tied alias reads its target (Describe).
  std::vector<std::string> names;
  names.reserve(destinations.size());
  std::set<std::string_view> seen;
  for (const Destination& d : destinations) {
    if (!seen.insert(d.name).second) {
      return Status(Code::kInvalidArgument, "tensor \"" + d.name + "\" has two destinations");
    }
    names.push_back(d.name);
  }
  TF_ASSIGN_OR_RETURN(const Description description, m.Describe(Selection::Names(names)));
  std::unordered_map<std::string_view, const OutputInfo*> output_of;
  for (const OutputInfo& o : description.outputs) output_of.emplace(o.name, &o);
  std::vector<const OutputInfo*> outputs;  // per destination
  std::set<Device> devices;
  for (const Destination& d : destinations) {
    const OutputInfo& o = *output_of.at(d.name);
    TF_RETURN_IF_ERROR(CheckDestination(d, o, m.options.shard));
    outputs.push_back(&o);
    if (o.bytes > 0) devices.insert(d.device);
  }
  TF_RETURN_IF_ERROR(CheckOverlaps(destinations, outputs));
  TF_RETURN_IF_ERROR(m.OpenFiles());
  for (const Device& d : devices) {
    if (d.is_cuda()) TF_RETURN_IF_ERROR(m.Slot(d.index).status());
  }
  TF_ASSIGN_OR_RETURN(io::ReadEngine * engine, m.CopyEngine());
  std::map<int, device::DevicePipelineStats> pipeline0;
  for (const auto& [index, slot] : m.slots) {
    pipeline0[index] = slot.pipeline->stats();
    slot.allocator->ResetPeak();
  }
  const uint64_t direct0 = engine->stats().direct_bytes;
  const uint64_t read0 = engine->stats().bytes_read;
  TF_ASSIGN_OR_RETURN(std::vector<bool> want_direct, m.ChooseDirect(ReadSpans(ckpt, outputs)));

  const IntoReads reads = MakeIntoReads(ckpt, outputs, destinations, m.options);
  for (const OutputInfo* o : outputs) {
    m.stats.tensors += 1;
    m.stats.bytes += o->bytes;
  }
  for (const auto& [index, tasks] : reads.device_tasks) {
    m.stats.device_tensors += reads.device_tensors.at(index);
    m.stats.device_bytes += reads.device_bytes.at(index);
  }
  const sink::SinkContext context = m.Context(std::move(want_direct), engine);
  if (!reads.host.empty()) {
    TF_RETURN_IF_ERROR(
        context.windows(sink::DistinctFiles(reads.host_file, ckpt.files().size()),
                        context.want_direct, [&](const std::vector<io::FileSet::Pin>& pins) {
                          return engine->Execute(sink::WindowOf(reads.host, reads.host_file, pins));
                        }));
  }
  for (const auto& [index, tasks] : reads.device_tasks) {
    TF_RETURN_IF_ERROR(sink::RunDeviceTasks(context, m.slots.at(index), tasks,
                                            reads.device_task_file.at(index), nullptr));
  }
  m.stats.batches = (reads.host.empty() ? 0 : 1) + reads.device_tasks.size();
  m.stats.device_batches = reads.device_tasks.size();
  m.stats.device = devices.size() == 1 ? DeviceName(*devices.begin())
                   : devices.empty()   ? DeviceName(Device::CPU())
                                       : "mixed";
  m.stats.direct_bytes = engine->stats().direct_bytes - direct0;
  m.stats.bytes_read = engine->stats().bytes_read - read0;
  m.CollectDeviceStats(pipeline0);
  m.stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
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

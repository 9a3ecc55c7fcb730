// The host loader: Selection -> Plan -> read engine -> pooled buffers -> Tensors.
#include "tensorferry/loader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "io/engine_common.h"
#include "io/mapped_file.h"
#include "io/read_engine.h"
#include "memory/host_buffer.h"
#include "tensorferry/residency.h"
#include "util/macros.h"

namespace tensorferry {

// --- Selection ---------------------------------------------------------------------------------

Selection Selection::All() {
  return Selection();
}

Selection Selection::Names(std::vector<std::string> names) {
  Selection s;
  s.names_ = std::move(names);
  s.by_name_ = true;
  return s;
}

Selection Selection::Where(std::function<bool(const TensorInfo&)> predicate) {
  Selection s;
  s.predicate_ = std::move(predicate);
  return s;
}

Selection Selection::Layers(uint32_t first, uint32_t last) {
  return Where([first, last](const TensorInfo& t) {
    auto layer = LayerOf(t.name);
    return layer && *layer >= first && *layer <= last;
  });
}

Result<std::vector<uint32_t>> Selection::Resolve(const Checkpoint& checkpoint) const {
  const auto& all = checkpoint.tensors();
  std::vector<uint32_t> out;
  if (by_name_) {
    out.reserve(names_.size());
    for (const auto& name : names_) {
      const TensorInfo* t = checkpoint.Find(name);
      if (t == nullptr) {
        return Status(Code::kNotFound, "tensor \"" + name + "\" is not in the checkpoint");
      }
      out.push_back(static_cast<uint32_t>(t - all.data()));
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }
  out.reserve(all.size());
  for (uint32_t i = 0; i < all.size(); ++i) {
    if (!predicate_ || predicate_(all[i])) out.push_back(i);
  }
  return out;
}

// --- Loader -----------------------------------------------------------------------------------

namespace {

// What every Tensor of a batch co-owns: the buffer and the batch's share of the budget. Both are
// released together when the last tensor goes.
struct BatchMemory {
  std::shared_ptr<memory::HostBuffer> buffer;
  memory::BudgetLease lease;
};

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
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  // Per file: its O_DIRECT descriptor once opened (nullptr: not opened or refused).
  std::vector<std::unique_ptr<io::DirectFile>> direct;
  std::vector<bool> direct_refused;
  // Per file, for the mmap engine: the mapping, created on first use and kept for the loader.
  std::vector<std::shared_ptr<io::MappedFile>> maps;
  LoadStats stats;

  // Opens every file once per loader and checks it still has the size seen at Checkpoint::Open:
  // a file replaced or truncated since then is reported here, before any read.
  Status OpenFiles() {
    const auto& infos = checkpoint->files();
    if (files.size() != infos.size()) {
      files.clear();
      for (const FileInfo& f : infos) {
        TF_ASSIGN_OR_RETURN(auto file, env->OpenRandomAccess(f.path));
        files.push_back(std::move(file));
      }
      direct.clear();
      direct.resize(infos.size());
      direct_refused.assign(infos.size(), false);
      maps.clear();
      maps.resize(infos.size());
    }
    for (size_t i = 0; i < infos.size(); ++i) {
      TF_ASSIGN_OR_RETURN(uint64_t size, files[i]->Size());
      if (size != infos[i].file_size) {
        return Status(Code::kIoError, infos[i].path +
                                          ": file changed since the checkpoint was opened: " +
                                          std::to_string(infos[i].file_size) + " bytes then, " +
                                          std::to_string(size) + " now");
      }
    }
    return Status::Ok();
  }

  // What a selection means for one load: the tensors to read, which of them go to the caller,
  // and the tied aliases (LoadOptions::shard ties) delivered sharing their target's data.
  struct Resolved {
    std::vector<uint32_t> read;                    // indices into tensors(), ascending
    std::vector<bool> deliver;                     // per tensor index; empty: every read tensor
    std::multimap<uint32_t, std::string> aliases;  // target index -> alias name
  };

  Result<Resolved> Resolve(const Selection& selection) const {
    const Checkpoint& ckpt = *checkpoint;
    Resolved r;
    const ShardSpec* spec = options.shard ? &options.shard->spec : nullptr;
    if (spec == nullptr || spec->ties().empty()) {
      TF_ASSIGN_OR_RETURN(r.read, selection.Resolve(ckpt));
      return r;
    }
    const auto& all = ckpt.tensors();
    std::vector<bool> read(all.size(), false);
    r.deliver.assign(all.size(), false);
    std::map<std::string, uint32_t> alias_target;
    auto index_of = [&](const TensorInfo* t) { return static_cast<uint32_t>(t - all.data()); };
    // The target an alias stands for, when the spec ties it to a tensor the checkpoint has.
    auto target_of = [&](std::string_view name) -> const TensorInfo* {
      std::optional<std::string> target = spec->TieTarget(name);
      return target ? ckpt.Find(*target) : nullptr;
    };
    auto add_alias = [&](const std::string& alias, const TensorInfo* target) {
      read[index_of(target)] = true;
      alias_target.emplace(alias, index_of(target));
    };
    if (selection.by_name_) {
      for (const std::string& name : selection.names_) {
        if (const TensorInfo* target = target_of(name)) {
          add_alias(name, target);  // present or not, the alias's own bytes are not read
          continue;
        }
        const TensorInfo* t = ckpt.Find(name);
        if (t == nullptr) {
          return Status(Code::kNotFound, "tensor \"" + name + "\" is not in the checkpoint");
        }
        read[index_of(t)] = r.deliver[index_of(t)] = true;
      }
    } else {
      const auto& predicate = selection.predicate_;
      for (uint32_t i = 0; i < all.size(); ++i) {
        if (predicate && !predicate(all[i])) continue;
        if (const TensorInfo* target = target_of(all[i].name)) {
          add_alias(all[i].name, target);  // a duplicate of its target: read once
        } else {
          read[i] = r.deliver[i] = true;
        }
      }
      // Aliases the files do not hold (tie_word_embeddings): selected as their target would be
      // under the alias's name.
      for (const auto& [alias, ignored] : spec->ties()) {
        if (ckpt.Find(alias) != nullptr) continue;
        const TensorInfo* target = target_of(alias);
        if (target == nullptr) continue;
        TensorInfo as_alias = *target;
        as_alias.name = alias;
        if (!predicate || predicate(as_alias)) add_alias(alias, target);
      }
    }
    for (uint32_t i = 0; i < all.size(); ++i) {
      if (read[i]) r.read.push_back(i);
    }
    for (const auto& [alias, target] : alias_target) r.aliases.emplace(target, alias);
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
        out.emplace_back(it->second, t.dtype(), t.shape(), t.data(), t.size(), t.owner());
      }
      if (resolved.deliver[index]) out.push_back(std::move(t));
    }
    batch.tensors = std::move(out);
  }

  // The plan's batches hold at most half the budget when the next batch is read while the caller
  // handles the current one (double buffering), so two fit; the whole budget when a selected
  // tensor is larger than half of it.
  uint64_t BatchBudget(const Checkpoint& ckpt, std::span<const uint32_t> indices) const {
    if (options.budget == 0) return 0;
    uint64_t largest = 0;
    for (uint32_t i : indices) largest = std::max(largest, ckpt.tensors()[i].size);
    // Half, minus room for the per-range alignment padding of a batch buffer.
    const uint64_t half = options.budget / 2;
    return largest <= half ? half : options.budget;
  }

  // With shard->exact_when_cached: exact strides (0) for files mostly in the page cache, max_gap
  // for the others (and for files the check cannot see, e.g. a MemoryEnv's). The check reads the
  // real file system by path: it only chooses how to read, never what is read.
  std::vector<uint64_t> FileMaxGaps() const {
    std::vector<uint64_t> gaps;
    if (!options.shard || !options.shard->exact_when_cached) return gaps;
    for (const FileInfo& f : checkpoint->files()) {
      uint64_t gap = options.shard->max_gap;
      if (f.file_size > f.data_offset) {
        Result<double> cached = CachedFraction(f.path, f.data_offset, f.file_size - f.data_offset);
        if (cached.ok() && *cached >= 0.5) gap = 0;
      }
      gaps.push_back(gap);
    }
    return gaps;
  }

  PlanOptions MakePlanOptions(uint64_t batch_budget) const {
    PlanOptions p;
    p.chunk_size = options.chunk_size;
    p.budget = batch_budget;
    p.allow_oversized = options.allow_oversized;
    p.order = options.order;
    p.shard = options.shard;
    p.file_max_gap = FileMaxGaps();
    return p;
  }

  // Decides, per file the plan reads, whether its reads use O_DIRECT: returns the descriptor per
  // file index (-1: buffered) and counts the choices into stats.
  Result<std::vector<int>> ChooseDirect(const Plan& plan) {
    const auto& infos = checkpoint->files();
    std::vector<uint64_t> lo(infos.size(), UINT64_MAX), hi(infos.size(), 0);
    for (const PlanBatch& b : plan.batches) {
      for (const ReadTask& t : b.tasks) {
        lo[t.file] = std::min(lo[t.file], t.file_offset);
        hi[t.file] = std::max(hi[t.file], t.file_offset + t.length);
      }
    }
    std::vector<int> fds(infos.size(), -1);
    for (size_t f = 0; f < infos.size(); ++f) {
      if (hi[f] == 0) continue;  // not read by this plan
      bool use = false;
      if (options.direct != DirectIO::kOff && files[f]->native_handle() >= 0 &&
          !direct_refused[f]) {
        use = options.direct == DirectIO::kOn;
        if (!use) {
          auto cached =
              io::CachedFraction(files[f]->native_handle(), infos[f].path, lo[f], hi[f] - lo[f]);
          use = cached.ok() && *cached < kDirectBelowCachedFraction;
        }
        if (use && !direct[f]) {
          auto d = io::DirectFile::Open(*files[f]);
          if (d.ok()) {
            direct[f] = std::move(d).value();
          } else if (d.status().code() == Code::kUnsupported) {
            direct_refused[f] = true;  // the file system refuses O_DIRECT: buffered from now on
            use = false;
          } else {
            return d.status();  // e.g. the file was replaced
          }
        }
      }
      if (use) {
        fds[f] = direct[f]->fd();
        ++stats.direct_files;
      } else {
        ++stats.buffered_files;
      }
    }
    return fds;
  }

  // Reads batch `b` into a pooled buffer and makes its tensors. `lease` is the batch's share of
  // the budget; it moves into the tensors' owner.
  Result<Batch> ReadBatch(const Plan& plan, size_t b, memory::BudgetLease lease,
                          const std::vector<int>& direct_fds, uint64_t batch_budget) {
    const PlanBatch& batch = plan.batches[b];
    // Under a budget every batch asks for a buffer of the same size (the batch budget plus room
    // for alignment padding), so the same buffers are reused for the whole load.
    const uint64_t uniform = batch_budget + batch.tasks.size() * 4096 + (64u << 10);
    const uint64_t want = batch_budget > 0 && batch.buffer_size <= batch_budget
                              ? std::max(batch.buffer_size, std::min(uniform, batch_budget * 2))
                              : batch.buffer_size;
    TF_ASSIGN_OR_RETURN(std::shared_ptr<memory::HostBuffer> buffer, pool->Acquire(want));
    std::vector<io::ReadRequest> requests;
    requests.reserve(batch.tasks.size());
    for (const ReadTask& t : batch.tasks) {
      requests.push_back({files[t.file].get(), t.file_offset,
                          std::span<std::byte>(buffer->data() + t.buffer_offset, t.length),
                          direct_fds[t.file]});
    }
    TF_RETURN_IF_ERROR(engine->Execute(requests));
    // Pack the pieces of covering reads (sharded plans); each moves left, in plan order.
    for (const BufferMove& mv : batch.moves) {
      std::memmove(buffer->data() + mv.to, buffer->data() + mv.from, mv.length);
    }

    auto owner = std::make_shared<BatchMemory>(BatchMemory{std::move(buffer), std::move(lease)});
    const auto& infos = checkpoint->tensors();
    Batch out;
    out.index = b;
    out.count = plan.batches.size();
    out.bytes = batch.tensor_bytes;
    out.tensors.reserve(batch.tensors.size());
    for (const PlannedTensor& pt : batch.tensors) {
      const TensorInfo& info = infos[pt.tensor];
      const std::byte* data = owner->buffer->data() + pt.buffer_offset;
      out.tensors.emplace_back(info.name, info.dtype, pt.slice ? pt.slice->shape : info.shape, data,
                               pt.size(info), std::shared_ptr<const void>(owner, data));
    }
    return out;
  }

  // The mmap engine's batch: views into the mappings; with populate, every page read first (in
  // parallel over the plan's tasks).
  Result<Batch> MapBatch(const Plan& plan, size_t b) {
    const PlanBatch& batch = plan.batches[b];
    const auto& file_infos = checkpoint->files();
    for (const PlannedTensor& pt : batch.tensors) {
      const uint32_t f = checkpoint->tensors()[pt.tensor].file;
      if (!maps[f]) {
        TF_ASSIGN_OR_RETURN(maps[f], io::MappedFile::Map(*files[f], file_infos[f].file_size));
      }
    }
    if (options.populate && !batch.tasks.empty()) {
      std::atomic<size_t> next{0};
      std::mutex mu;
      Status first;
      auto work = [&] {
        for (size_t i; (i = next.fetch_add(1)) < batch.tasks.size();) {
          const ReadTask& t = batch.tasks[i];
          Status s = maps[t.file]->Populate(t.file_offset, t.length);
          if (!s.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            if (first.ok()) first = std::move(s);
            next.store(batch.tasks.size());
          }
        }
      };
      const unsigned n = std::min<size_t>(options.threads ? options.threads : io::OnlineCpus(),
                                          batch.tasks.size());
      std::vector<std::thread> helpers;
      for (unsigned i = 1; i < n; ++i) helpers.emplace_back(work);
      work();
      for (std::thread& t : helpers) t.join();
      TF_RETURN_IF_ERROR(first);
    }
    const auto& infos = checkpoint->tensors();
    // Strided slices cannot be views: they are gathered from the mapping into one pooled buffer
    // per batch. Dim-0 slices (one range) stay views.
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> pieces(batch.tensors.size());
    std::vector<uint64_t> gather_at(batch.tensors.size(), 0);
    uint64_t gather_bytes = 0;
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const PlannedTensor& pt = batch.tensors[i];
      if (!pt.slice) continue;
      pieces[i] = SliceByteRanges(infos[pt.tensor], *pt.slice);
      if (pieces[i].size() > 1) {
        gather_at[i] = gather_bytes;
        gather_bytes += (pt.slice->bytes + 63) & ~uint64_t{63};
      }
    }
    std::shared_ptr<BatchMemory> gathered;
    if (gather_bytes > 0) {
      TF_ASSIGN_OR_RETURN(std::shared_ptr<memory::HostBuffer> buffer, pool->Acquire(gather_bytes));
      gathered = std::make_shared<BatchMemory>(BatchMemory{std::move(buffer), {}});
    }
    Batch out;
    out.index = b;
    out.count = plan.batches.size();
    out.bytes = batch.tensor_bytes;
    out.tensors.reserve(batch.tensors.size());
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const PlannedTensor& pt = batch.tensors[i];
      const TensorInfo& info = infos[pt.tensor];
      const std::shared_ptr<io::MappedFile>& map = maps[info.file];
      const std::vector<uint64_t>& shape = pt.slice ? pt.slice->shape : info.shape;
      const uint64_t size = pt.size(info);
      const std::byte* data = nullptr;
      std::shared_ptr<const void> owner;
      if (pieces[i].size() > 1) {
        std::byte* dst = gathered->buffer->data() + gather_at[i];
        for (const auto& [off, len] : pieces[i]) {
          std::memcpy(dst, map->data() + info.offset + off, len);
          dst += len;
        }
        data = gathered->buffer->data() + gather_at[i];
        owner = std::shared_ptr<const void>(gathered, data);
      } else {
        const uint64_t off = pieces[i].empty() ? 0 : pieces[i][0].first;
        data = map->data() + info.offset + off;
        owner = std::shared_ptr<const void>(map, data);
      }
      // A file that shrank while mapped (faults repaired with zeros) must not pass as loaded.
      if (map->faults() != 0) {
        return Status(Code::kUnexpectedEof,
                      map->path() + ": file shrank while mapped: page at offset " +
                          std::to_string(map->first_fault_offset()) + " is past its end");
      }
      out.tensors.emplace_back(info.name, info.dtype, shape, data, size, std::move(owner));
    }
    return out;
  }
};

Loader::Loader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loader::~Loader() = default;

Result<std::unique_ptr<Loader>> Loader::Open(std::shared_ptr<const Checkpoint> checkpoint,
                                             const LoadOptions& options) {
  if (!checkpoint) return Status(Code::kInvalidArgument, "Loader::Open: null checkpoint");
  if (options.chunk_size == 0) return Status(Code::kInvalidArgument, "chunk_size must be > 0");
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

Result<Plan> Loader::MakePlan(const Selection& selection) const {
  TF_ASSIGN_OR_RETURN(Impl::Resolved resolved, impl_->Resolve(selection));
  const std::vector<uint32_t>& indices = resolved.read;
  const uint64_t batch_budget = impl_->BatchBudget(*impl_->checkpoint, indices);
  return tensorferry::MakePlan(*impl_->checkpoint, indices, impl_->MakePlanOptions(batch_budget));
}

Status Loader::Stream(const Selection& selection, const std::function<Status(Batch)>& on_batch) {
  Impl& m = *impl_;
  m.stats = LoadStats();
  m.stats.engine = std::string(EngineName(m.engine_kind));
  const auto start = Clock::now();
  Clock::duration idle{};  // time in callbacks with no read in flight
  const uint64_t reused0 = m.pool->reused(), allocated0 = m.pool->allocated();
  const uint64_t direct0 = m.engine ? m.engine->stats().direct_bytes : 0;
  const uint64_t read0 = m.engine ? m.engine->stats().bytes_read : 0;

  TF_ASSIGN_OR_RETURN(Impl::Resolved resolved, m.Resolve(selection));
  const std::vector<uint32_t>& indices = resolved.read;
  const uint64_t batch_budget = m.BatchBudget(*m.checkpoint, indices);
  TF_ASSIGN_OR_RETURN(
      Plan plan, tensorferry::MakePlan(*m.checkpoint, indices, m.MakePlanOptions(batch_budget)));
  TF_RETURN_IF_ERROR(m.OpenFiles());
  const bool mapped = m.engine_kind == Engine::kMmap;
  std::vector<int> direct_fds;
  if (!mapped) {
    TF_ASSIGN_OR_RETURN(direct_fds, m.ChooseDirect(plan));
  }
  const size_t n = plan.batches.size();

  auto lease_for = [&](size_t b) -> std::optional<memory::BudgetLease> {
    // Covering reads of sharded tensors hold their gaps in the buffer too.
    return m.budget->TryAcquire(std::max(plan.batches[b].tensor_bytes, plan.batches[b].read_bytes));
  };
  auto budget_error = [&](size_t b) {
    return Status(Code::kBudgetExceeded,
                  "batch " + std::to_string(b + 1) + " of " + std::to_string(n) + " needs " +
                      std::to_string(plan.batches[b].tensor_bytes) + " bytes but " +
                      std::to_string(m.budget->in_use()) + " of the " +
                      std::to_string(m.budget->limit()) +
                      "-byte budget are still held by tensors of earlier batches: drop them "
                      "before the next batch, or raise the budget");
  };
  auto produce = [&](size_t b, memory::BudgetLease lease) -> Result<Batch> {
    if (mapped) return m.MapBatch(plan, b);
    return m.ReadBatch(plan, b, std::move(lease), direct_fds, batch_budget);
  };

  // Double buffering: while the caller handles batch b, batch b + 1 is read on a helper thread
  // when its bytes fit the budget at that moment (the plan halves batches under a budget so they
  // do). Otherwise it is read after the callback returns.
  std::future<Result<Batch>> next;
  for (size_t b = 0; b < n; ++b) {
    Result<Batch> current = Status(Code::kInternal, "unset");
    if (next.valid()) {
      current = next.get();
    } else {
      std::optional<memory::BudgetLease> lease = lease_for(b);
      if (!lease) return budget_error(b);
      current = produce(b, std::move(*lease));
    }
    if (!current.ok()) return current.status();
    Batch batch = std::move(current).value();
    Impl::Deliver(resolved, plan.batches[b], batch);
    m.stats.tensors += batch.tensors.size();
    m.stats.bytes += batch.bytes;
    m.stats.batches += 1;
    m.stats.peak_budget_bytes = m.budget->peak();

    if (b + 1 < n && !mapped) {
      if (std::optional<memory::BudgetLease> lease = lease_for(b + 1)) {
        next = std::async(std::launch::async, [&produce, b, l = std::move(*lease)]() mutable {
          return produce(b + 1, std::move(l));
        });
      }
    }
    const bool overlapped = next.valid();
    const auto cb_start = Clock::now();
    Status s = on_batch(std::move(batch));
    if (!overlapped) idle += Clock::now() - cb_start;
    if (!s.ok()) {
      if (next.valid()) next.wait();  // its buffer and files must not outlive this call's use
      return s;
    }
  }
  m.stats.seconds = std::chrono::duration<double>(Clock::now() - start - idle).count();
  m.stats.peak_budget_bytes = m.budget->peak();
  m.stats.buffers_reused = m.pool->reused() - reused0;
  m.stats.buffers_allocated = m.pool->allocated() - allocated0;
  m.stats.direct_bytes = m.engine ? m.engine->stats().direct_bytes - direct0 : 0;
  m.stats.bytes_read = m.engine ? m.engine->stats().bytes_read - read0 : plan.read_bytes;
  return Status::Ok();
}

Result<std::vector<Tensor>> Loader::Load(const Selection& selection) {
  const Checkpoint& ckpt = *impl_->checkpoint;
  if (impl_->options.budget > 0 && impl_->engine_kind != Engine::kMmap) {
    TF_ASSIGN_OR_RETURN(Impl::Resolved resolved, impl_->Resolve(selection));
    uint64_t total = 0;
    if (impl_->options.shard) {
      // Local sizes (and covered gaps) count, as the leases will.
      TF_ASSIGN_OR_RETURN(Plan plan,
                          tensorferry::MakePlan(ckpt, resolved.read, impl_->MakePlanOptions(0)));
      total = std::max(plan.tensor_bytes, plan.read_bytes);
    } else {
      for (uint32_t i : resolved.read) total += ckpt.tensors()[i].size;
    }
    if (total > impl_->options.budget) {
      return Status(Code::kBudgetExceeded,
                    "Load returns every tensor at once: " + std::to_string(total) +
                        " bytes exceed the budget of " + std::to_string(impl_->options.budget) +
                        " bytes; use Stream to load batch by batch");
    }
  }
  // Checkpoint order; a tied alias the files lack comes right after its target.
  auto order_of = [&](const std::string& name) -> size_t {
    const TensorInfo* t = ckpt.Find(name);
    if (t == nullptr && impl_->options.shard) {
      if (auto target = impl_->options.shard->spec.TieTarget(name)) t = ckpt.Find(*target);
      if (t != nullptr) return 2 * static_cast<size_t>(t - ckpt.tensors().data()) + 1;
    }
    return t == nullptr ? SIZE_MAX : 2 * static_cast<size_t>(t - ckpt.tensors().data());
  };
  std::vector<std::pair<size_t, Tensor>> got;
  TF_RETURN_IF_ERROR(Stream(selection, [&](Batch batch) {
    for (Tensor& t : batch.tensors) got.emplace_back(order_of(t.name()), std::move(t));
    return Status::Ok();
  }));
  std::stable_sort(got.begin(), got.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Tensor> out;
  out.reserve(got.size());
  for (auto& [index, tensor] : got) out.push_back(std::move(tensor));
  return out;
}

LoadStats Loader::stats() const {
  return impl_->stats;
}

}  // namespace tensorferry

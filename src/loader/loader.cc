// The host loader: Selection -> Plan -> read engine -> pooled buffers -> Tensors.
#include "tensorferry/loader.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "io/read_engine.h"
#include "memory/host_buffer.h"
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

// --- Loader
// ---------------------------------------------------------------------------------------

namespace {

// What every Tensor of a batch co-owns: the buffer and the batch's share of the budget. Both are
// released together when the last tensor goes.
struct BatchMemory {
  std::shared_ptr<memory::HostBuffer> buffer;
  memory::BudgetLease lease;
};

using Clock = std::chrono::steady_clock;

}  // namespace

struct Loader::Impl {
  std::shared_ptr<const Checkpoint> checkpoint;
  LoadOptions options;
  Env* env = nullptr;
  std::unique_ptr<io::ReadEngine> engine;
  std::shared_ptr<memory::BufferPool> pool;
  std::shared_ptr<memory::Budget> budget;
  std::vector<std::unique_ptr<RandomAccessFile>> files;
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

  PlanOptions MakePlanOptions() const {
    PlanOptions p;
    p.chunk_size = options.chunk_size;
    p.budget = options.budget;
    p.allow_oversized = options.allow_oversized;
    p.order = options.order;
    return p;
  }
};

Loader::Loader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loader::~Loader() = default;

Result<std::unique_ptr<Loader>> Loader::Open(std::shared_ptr<const Checkpoint> checkpoint,
                                             const LoadOptions& options) {
  if (!checkpoint) return Status(Code::kInvalidArgument, "Loader::Open: null checkpoint");
  if (options.chunk_size == 0) return Status(Code::kInvalidArgument, "chunk_size must be > 0");
  if (options.engine == Engine::kIoUring || options.engine == Engine::kMmap) {
    return Status(Code::kUnsupported,
                  std::string("engine ") +
                      (options.engine == Engine::kIoUring ? "io_uring" : "mmap") +
                      " is not available in this build yet; use auto or pread");
  }
  auto impl = std::make_unique<Impl>();
  impl->checkpoint = std::move(checkpoint);
  impl->options = options;
  impl->env = options.env ? options.env : Env::Default();
  TF_ASSIGN_OR_RETURN(impl->engine, io::MakePreadEngine(options.threads));
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
  TF_ASSIGN_OR_RETURN(std::vector<uint32_t> indices, selection.Resolve(*impl_->checkpoint));
  return tensorferry::MakePlan(*impl_->checkpoint, indices, impl_->MakePlanOptions());
}

Status Loader::Stream(const Selection& selection, const std::function<Status(Batch)>& on_batch) {
  Impl& m = *impl_;
  m.stats = LoadStats();
  const auto start = Clock::now();
  Clock::duration in_callbacks{};
  const uint64_t reused0 = m.pool->reused(), allocated0 = m.pool->allocated();

  TF_ASSIGN_OR_RETURN(Plan plan, MakePlan(selection));
  TF_RETURN_IF_ERROR(m.OpenFiles());
  const auto& infos = m.checkpoint->tensors();
  std::vector<io::ReadRequest> requests;

  for (size_t b = 0; b < plan.batches.size(); ++b) {
    const PlanBatch& batch = plan.batches[b];
    std::optional<memory::BudgetLease> lease = m.budget->TryAcquire(batch.tensor_bytes);
    if (!lease) {
      return Status(
          Code::kBudgetExceeded,
          "batch " + std::to_string(b + 1) + " of " + std::to_string(plan.batches.size()) +
              " needs " + std::to_string(batch.tensor_bytes) + " bytes but " +
              std::to_string(m.budget->in_use()) + " of the " + std::to_string(m.budget->limit()) +
              "-byte budget are still held by tensors of earlier batches: drop them "
              "before the next batch, or raise the budget");
    }
    // Under a budget every batch asks for a buffer of the budget's size, so one buffer (or as many
    // as the budget holds) is reused for the whole load instead of a fresh one per batch size.
    const uint64_t want = m.options.budget > 0 && batch.buffer_size <= m.options.budget
                              ? m.options.budget
                              : batch.buffer_size;
    TF_ASSIGN_OR_RETURN(std::shared_ptr<memory::HostBuffer> buffer, m.pool->Acquire(want));

    requests.clear();
    requests.reserve(batch.tasks.size());
    for (const ReadTask& t : batch.tasks) {
      requests.push_back({m.files[t.file].get(), t.file_offset,
                          std::span<std::byte>(buffer->data() + t.buffer_offset, t.length)});
    }
    if (Status s = m.engine->Execute(requests); !s.ok()) return s;

    auto owner = std::make_shared<BatchMemory>(BatchMemory{std::move(buffer), std::move(*lease)});
    Batch out;
    out.index = b;
    out.count = plan.batches.size();
    out.bytes = batch.tensor_bytes;
    out.tensors.reserve(batch.tensors.size());
    for (const PlannedTensor& pt : batch.tensors) {
      const TensorInfo& info = infos[pt.tensor];
      const std::byte* data = owner->buffer->data() + pt.buffer_offset;
      out.tensors.emplace_back(info.name, info.dtype, info.shape, data, info.size,
                               std::shared_ptr<const void>(owner, data));
    }
    owner.reset();
    m.stats.tensors += out.tensors.size();
    m.stats.bytes += batch.tensor_bytes;
    m.stats.batches += 1;
    m.stats.peak_budget_bytes = m.budget->peak();

    const auto cb_start = Clock::now();
    Status s = on_batch(std::move(out));
    in_callbacks += Clock::now() - cb_start;
    if (!s.ok()) return s;
  }
  m.stats.seconds = std::chrono::duration<double>(Clock::now() - start - in_callbacks).count();
  m.stats.buffers_reused = m.pool->reused() - reused0;
  m.stats.buffers_allocated = m.pool->allocated() - allocated0;
  return Status::Ok();
}

Result<std::vector<Tensor>> Loader::Load(const Selection& selection) {
  const Checkpoint& ckpt = *impl_->checkpoint;
  if (impl_->options.budget > 0) {
    TF_ASSIGN_OR_RETURN(std::vector<uint32_t> indices, selection.Resolve(ckpt));
    uint64_t total = 0;
    for (uint32_t i : indices) total += ckpt.tensors()[i].size;
    if (total > impl_->options.budget) {
      return Status(Code::kBudgetExceeded,
                    "Load returns every tensor at once: " + std::to_string(total) +
                        " bytes exceed the budget of " + std::to_string(impl_->options.budget) +
                        " bytes; use Stream to load batch by batch");
    }
  }
  std::vector<std::pair<size_t, Tensor>> got;
  TF_RETURN_IF_ERROR(Stream(selection, [&](Batch batch) {
    for (Tensor& t : batch.tensors) {
      got.emplace_back(static_cast<size_t>(ckpt.Find(t.name()) - ckpt.tensors().data()),
                       std::move(t));
    }
    return Status::Ok();
  }));
  std::sort(got.begin(), got.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Tensor> out;
  out.reserve(got.size());
  for (auto& [index, tensor] : got) out.push_back(std::move(tensor));
  return out;
}

LoadStats Loader::stats() const {
  return impl_->stats;
}

}  // namespace tensorferry

// The mapped sink (Engine::kMmap): tensors are views into per-file mappings kept for the Loader;
// with populate every page is read first; strided slices are gathered into one pooled buffer.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "io/engine_common.h"
#include "sink/sink.h"
#include "util/parallel.h"

namespace tensorferry::sink {
namespace {

class MappedSink final : public BatchSink {
 public:
  MappedSink(const SinkContext& context, const Plan& plan) : c_(context), plan_(plan) {}

  // The budget shapes the batches; the page cache owns the memory of views, so that part of the
  // lease is dropped as soon as the batch is made. Copies of slices of several ranges keep their
  // bytes' share of it until the last tensor in their buffer goes (as a copying engine's batches).
  Result<std::optional<Reservation>> Reserve(const PlanBatch& batch) override {
    return ReserveHost(*c_.budget, batch);
  }
  Status BudgetError(const PlanBatch& batch, size_t k, size_t n) const override {
    return HostBudgetError(*c_.budget, batch, k, n);
  }
  bool reads_ahead() const override { return false; }

  Result<Batch> Complete(size_t b, Reservation memory) override {
    const PlanBatch& batch = plan_.batches[b];
    TF_RETURN_IF_ERROR(MapForViews(c_, batch));
    if (c_.options->populate && !batch.tasks.empty()) TF_RETURN_IF_ERROR(Populate(batch));
    return MakeTensors(batch, memory.lease);
  }

 private:
  // Every page of the batch's tasks read, in parallel over the tasks, 64 MiB at a time so that a
  // cancelled load (LoadOptions::cancel) stops within that much per thread.
  Status Populate(const PlanBatch& batch) {
    constexpr uint64_t kPiece = uint64_t{64} << 20;
    const unsigned threads = c_.options->threads ? c_.options->threads : io::OnlineCpus();
    const std::atomic<bool>* cancel = c_.options->cancel.get();
    return ParallelForUntilError(batch.tasks.size(), threads, [&](size_t i) -> Status {
      const ReadTask& t = batch.tasks[i];
      for (uint64_t at = 0; at < t.length; at += kPiece) {
        if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
          return Status(Code::kCancelled, "the load was cancelled");
        }
        const uint64_t n = std::min(kPiece, t.length - at);
        TF_RETURN_IF_ERROR(LabelTensors((*c_.maps)[t.file]->Populate(t.file_offset + at, n),
                                        *c_.checkpoint, t.file, t.file_offset + at, n));
      }
      return Status::Ok();
    });
  }

  // Views, or copies gathered into one pooled buffer for slices of several ranges (dim-0 slices,
  // one range, stay views); the copies take their bytes out of the batch's `lease`.
  Result<Batch> MakeTensors(const PlanBatch& batch, memory::BudgetLease& lease) {
    const auto& infos = c_.checkpoint->tensors();
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> pieces(batch.tensors.size());
    std::vector<uint64_t> gather_at(batch.tensors.size(), 0);
    uint64_t gather_bytes = 0, copied_bytes = 0;
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const PlannedTensor& pt = batch.tensors[i];
      if (!pt.slice) continue;
      pieces[i] = SliceByteRanges(infos[pt.tensor], *pt.slice);
      if (pieces[i].size() > 1) {
        gather_at[i] = gather_bytes;
        gather_bytes += (pt.slice->bytes + 63) & ~uint64_t{63};
        copied_bytes += pt.slice->bytes;
      }
    }
    std::shared_ptr<BatchMemory> gathered;
    if (gather_bytes > 0) {
      gathered = std::make_shared<BatchMemory>();
      TF_ASSIGN_OR_RETURN(gathered->buffer, c_.pool->Acquire(gather_bytes));
      gathered->lease = lease.Split(copied_bytes);
    }
    Batch out;
    out.bytes = batch.tensor_bytes;
    out.tensors.reserve(batch.tensors.size());
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const PlannedTensor& pt = batch.tensors[i];
      const TensorInfo& info = infos[pt.tensor];
      const std::shared_ptr<io::MappedFile>& map = (*c_.maps)[info.file];
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
      // A page that read as zeros (its file shrank, or an I/O error) must not pass as loaded.
      if (map->faults() != 0) return MappedFaultError(*c_.checkpoint, info.file, *map);
      out.tensors.push_back(PlannedTensorAt(info, pt, data, std::move(owner)));
    }
    return out;
  }

  const SinkContext& c_;
  const Plan& plan_;
};

}  // namespace

namespace {

// The mapped and device sinks of one load may complete batches on different threads (a placement
// mixing host and device, read ahead): the loader's mapping tables are shared.
std::mutex& MapsMutex() {
  static std::mutex mu;
  return mu;
}

// maps[f], mapped now if it is not yet, or again if a page of it faulted (the handler put a
// page of zeros there for good: reused, it would hand out zeros without a new fault to say so;
// the old mapping lives on with whatever holds it); MapsMutex() held.
Result<const io::MappedFile*> MappingLocked(const SinkContext& context,
                                            std::vector<std::shared_ptr<io::MappedFile>>& maps,
                                            uint32_t f, io::MappedFile::Use use) {
  if (maps[f] && maps[f]->faults() != 0) maps[f].reset();
  if (!maps[f]) {
    TF_ASSIGN_OR_RETURN(io::FileSet::Pin pin, context.files->Get(f));
    io::MappedFile::About about = [checkpoint = context.checkpoint_ref, f](uint64_t offset,
                                                                           uint64_t length) {
      const std::shared_ptr<const Checkpoint> alive = checkpoint.lock();
      return alive ? TensorsIn(*alive, f, offset, length) : std::string();
    };
    TF_ASSIGN_OR_RETURN(
        maps[f], io::MappedFile::Map(*pin.file, context.checkpoint->files()[f].file_size, use,
                                     std::move(about)));
  }
  return maps[f].get();
}

}  // namespace

Status MapForViews(const SinkContext& context, const PlanBatch& batch) {
  std::lock_guard<std::mutex> lock(MapsMutex());
  std::vector<std::shared_ptr<io::MappedFile>>& maps = *context.maps;
  std::vector<std::unordered_set<uint32_t>>& viewed = *context.viewed;
  const std::vector<TensorInfo>& infos = context.checkpoint->tensors();
  for (const PlannedTensor& pt : batch.tensors) {
    const uint32_t f = infos[pt.tensor].file;
    if (maps[f] && (viewed[f].count(pt.tensor) != 0 || maps[f]->faults() != 0)) {
      maps[f].reset();  // the tensors of earlier loads keep it
      viewed[f].clear();
    }
  }
  for (const PlannedTensor& pt : batch.tensors) {
    const uint32_t f = infos[pt.tensor].file;
    TF_RETURN_IF_ERROR(MappingLocked(context, maps, f, io::MappedFile::Use::kViews).status());
    viewed[f].insert(pt.tensor);
  }
  return Status::Ok();
}

Result<const io::MappedFile*> GatherMappingOf(const SinkContext& context, uint32_t f) {
  std::lock_guard<std::mutex> lock(MapsMutex());
  return MappingLocked(context, *context.gather_maps, f, io::MappedFile::Use::kTransient);
}

void ReleaseGatherMappings(std::vector<std::shared_ptr<io::MappedFile>>& gather_maps) {
  std::lock_guard<std::mutex> lock(MapsMutex());
  for (std::shared_ptr<io::MappedFile>& map : gather_maps) map.reset();
}

std::unique_ptr<BatchSink> MakeMappedSink(const SinkContext& context, const Plan& plan) {
  return std::make_unique<MappedSink>(context, plan);
}

}  // namespace tensorferry::sink

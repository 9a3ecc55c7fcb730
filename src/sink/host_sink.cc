// The host sink: pooled host buffers under the host budget, read by the loader's engine.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "sink/sink.h"

namespace tensorferry::sink {
namespace {

class HostSink final : public BatchSink {
 public:
  HostSink(const SinkContext& context, const Plan& plan)
      : c_(context), plan_(plan), uniform_(UniformSize(plan, context.budget->limit())) {}

  Result<std::optional<Reservation>> Reserve(const PlanBatch& batch) override {
    return ReserveHost(*c_.budget, batch);
  }

  bool waits_for_memory() const override { return true; }

  Result<std::optional<Reservation>> ReserveWhenFree(const PlanBatch& batch,
                                                     const std::atomic<bool>& stop) override {
    std::optional<memory::BudgetLease> lease =
        c_.budget->AcquireUnless(HostLeaseBytes(batch), stop);
    if (!lease) return std::optional<Reservation>();
    return std::optional<Reservation>(Reservation{std::move(*lease), nullptr});
  }

  Status BudgetError(const PlanBatch& batch, size_t k, size_t n) const override {
    return HostBudgetError(*c_.budget, batch, k, n);
  }

  // Reads batch `b` into a pooled buffer and makes its tensors; the lease moves into their owner.
  Result<Batch> Complete(size_t b, Reservation memory) override {
    const PlanBatch& batch = plan_.batches[b];
    TF_ASSIGN_OR_RETURN(std::shared_ptr<memory::HostBuffer> buffer,
                        c_.pool->Acquire(batch.buffer_size, uniform_));
    // Checksums (LoadOptions::verify): each chunk hashed by the engine's worker that lands its
    // last byte, overlapping the reads still in flight (docs/benchmarks.md: cold loads hide the
    // hashing this way, not after the reads); with tensor-parallel moves, which put bytes in
    // their final place only after the reads, after them, in parallel.
    std::unique_ptr<LandingCheck> check;
    if (c_.checksums != nullptr && !c_.checksums->empty()) {
      check = LandingCheck::Make(*c_.checkpoint, batch.tensors, *c_.checksums, buffer->data(),
                                 *c_.verify_counts);
    }
    const bool on_landing = check && batch.moves.empty();
    TF_RETURN_IF_ERROR(Read(batch, *buffer, on_landing ? check.get() : nullptr));
    // Pack the pieces of covering reads (tensor-parallel plans); each moves left, in plan order.
    for (const BufferMove& mv : batch.moves) {
      for (uint64_t i = 0; i < mv.count; ++i) {
        std::memmove(buffer->data() + mv.to + i * mv.to_stride,
                     buffer->data() + mv.from + i * mv.from_stride, mv.length);
      }
    }
    if (check) {
      if (!on_landing) TF_RETURN_IF_ERROR(check->VerifyAll(c_.verify_threads));
      check->Count();
    }
    auto owner =
        std::make_shared<BatchMemory>(BatchMemory{std::move(memory.lease), std::move(buffer)});
    return BatchInBuffer(*c_.checkpoint, batch, owner->buffer->data(), owner);
  }

 private:
  // Under a budget, buffers are mapped for the largest batch within it (a tensor alone in its batch
  // included: PlanOptions::alone_budget), so that any buffer released to the pool fits any later
  // batch and the load reuses the same few buffers; each holds only what its batch uses (the pool
  // trims what a larger batch left). Batches over the budget (allow_oversized) get buffers of
  // their own size.
  static uint64_t UniformSize(const Plan& plan, uint64_t limit) {
    uint64_t uniform = 0;
    if (limit == 0) return uniform;
    for (const PlanBatch& b : plan.batches) {
      if (HostLeaseBytes(b) <= limit) uniform = std::max(uniform, b.buffer_size);
    }
    return uniform;
  }

  Status Read(const PlanBatch& batch, memory::HostBuffer& buffer, const LandingCheck* check) {
    std::vector<uint32_t> task_files;
    task_files.reserve(batch.tasks.size());
    for (const ReadTask& t : batch.tasks) task_files.push_back(t.file);
    return c_.windows(
        DistinctFiles(task_files, c_.checkpoint->files().size()), c_.want_direct,
        [&](const std::vector<io::FileSet::Pin>& pins) {
          const std::function<std::string(const io::ReadRequest&)> about =
              AboutTensors(*c_.checkpoint, pins);
          std::vector<io::ReadRequest> requests;
          requests.reserve(batch.tasks.size());
          for (const ReadTask& t : batch.tasks) {
            const io::FileSet::Pin& pin = pins[t.file];
            if (!pin.file) continue;  // another window's
            requests.push_back({pin.file.get(), t.file_offset,
                                std::span<std::byte>(buffer.data() + t.buffer_offset, t.length),
                                pin.direct_fd(), c_.options->cancel.get(),
                                check != nullptr ? check->hook() : nullptr, &about});
          }
          return c_.engine->Execute(requests);
        });
  }

  const SinkContext& c_;
  const Plan& plan_;
  const uint64_t uniform_;  // UniformSize(): the capacity buffers are mapped for (0: their size)
};

}  // namespace

std::unique_ptr<BatchSink> MakeHostSink(const SinkContext& context, const Plan& plan) {
  return std::make_unique<HostSink>(context, plan);
}

uint64_t HostLeaseBytes(const PlanBatch& batch) {
  return std::max(batch.tensor_bytes, batch.read_bytes);
}

std::optional<Reservation> ReserveHost(memory::Budget& budget, const PlanBatch& batch) {
  std::optional<memory::BudgetLease> lease = budget.TryAcquire(HostLeaseBytes(batch));
  if (!lease) return std::nullopt;
  return Reservation{std::move(*lease), nullptr};
}

Status HostBudgetError(const memory::Budget& budget, const PlanBatch& batch, size_t k, size_t n) {
  return Status(Code::kBudgetExceeded,
                "batch " + std::to_string(k + 1) + " of " + std::to_string(n) + " needs " +
                    std::to_string(HostLeaseBytes(batch)) + " bytes but " +
                    std::to_string(budget.in_use()) + " of the " + std::to_string(budget.limit()) +
                    "-byte budget are still held by tensors of earlier batches: drop them before "
                    "the next batch, or raise the budget");
}

Tensor PlannedTensorAt(const TensorInfo& info, const PlannedTensor& pt, const std::byte* data,
                       std::shared_ptr<const void> owner, Device device) {
  return Tensor(info.name, info.dtype, pt.slice ? pt.slice->shape : info.shape, data, pt.size(info),
                std::move(owner), device);
}

Batch BatchInBuffer(const Checkpoint& checkpoint, const PlanBatch& batch, const std::byte* base,
                    const std::shared_ptr<const void>& owner, Device device) {
  const auto& infos = checkpoint.tensors();
  Batch out;
  out.bytes = batch.tensor_bytes;
  out.tensors.reserve(batch.tensors.size());
  for (const PlannedTensor& pt : batch.tensors) {
    const std::byte* data = base + pt.buffer_offset;
    out.tensors.push_back(PlannedTensorAt(infos[pt.tensor], pt, data,
                                          std::shared_ptr<const void>(owner, data), device));
  }
  return out;
}

std::vector<uint32_t> DistinctFiles(const std::vector<uint32_t>& ids, size_t num_files) {
  std::vector<bool> seen(num_files, false);
  std::vector<uint32_t> out;
  for (uint32_t f : ids) {
    if (!seen[f]) out.push_back(f);
    seen[f] = true;
  }
  return out;
}

}  // namespace tensorferry::sink

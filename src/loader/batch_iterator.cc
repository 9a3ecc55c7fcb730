// Loader::Iterate and BatchIterator (loader.h): plan -> engine -> sink, one batch per Next, the
// next batch read ahead on a helper thread (double buffering); Stream is a loop over it.
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <optional>
#include <utility>

#include "loader/loader_impl.h"
#include "tensorferry/mapping.h"
#include "util/macros.h"

namespace tensorferry {

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
  // A read-ahead waiting for the caller to drop an earlier batch's memory.
  struct Waiting {
    std::atomic<bool> stop{false};      // set by the caller's thread: give up the wait
    std::atomic<bool> reserved{false};  // the memory was granted: the read ran or runs
  };
  std::shared_ptr<Waiting> waiting;  // of `next`, when it began by waiting
  // Statistics: the time the caller held a batch with no read in flight is not loading time.
  Clock::time_point start;
  Clock::duration idle{};
  std::optional<Clock::time_point> returned_at;
  bool returned_overlapped = false;
  uint64_t reused0 = 0, allocated0 = 0, direct0 = 0, read0 = 0;
  Loader::Impl::VerifyCounts verified;  // LoadOptions::verify, counted on whichever thread reads
  SourceStats source0;
  std::map<int, device::DevicePipelineStats> pipeline0;

  ~State() {
    StopWaiting();
    if (next.valid()) next.wait();  // its buffer and files must not outlive the loader's use
  }

  // Ends the wait of a read-ahead still waiting for memory (it returns without reading).
  void StopWaiting() {
    if (!waiting) return;
    waiting->stop.store(true);
    m->budget->Interrupt();
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
      // A file rewritten while the batch was read: the batch is dropped, not handed out mixed.
      if (Status s = m->CheckFilesAfterReads(); !s.ok()) return Result<Batch>(std::move(s));
      // Cancelled while the batch was read (the mapped engine's populate runs to its end).
      if (m->options.cancel && m->options.cancel->load(std::memory_order_relaxed)) {
        return Result<Batch>(Status(Code::kCancelled, "the load was cancelled"));
      }
    }
    // Checksums before anyone sees the batch: a mismatch fails it (the batch is dropped here).
    if (got.ok() && !m->checksums.empty() && !groups[g].device.is_cuda() &&
        m->engine_kind == Engine::kMmap) {
      if (Status s = m->VerifyBatch(groups[g].plan.batches[b], *got, verified); !s.ok()) {
        return Result<Batch>(std::move(s));
      }
    }
    if (got.ok()) {
      got->index = j;
      got->count = order.size();
      got->device = groups[g].device;
    }
    return got;
  }

  // Batch k: read ahead, or read now when its memory fits (kBudgetExceeded otherwise).
  Result<Batch> Take() {
    const auto cancelled = [&] {
      return m->options.cancel && m->options.cancel->load(std::memory_order_relaxed);
    };
    if (next.valid()) {
      StopWaiting();  // the caller asks for the batch now: it is read here if its wait is not over
      std::shared_ptr<Waiting> waited = std::move(waiting);
      Result<Batch> got = next.get();
      // A batch read ahead before the load was cancelled is not handed out after it.
      if (got.ok() && cancelled()) return Status(Code::kCancelled, "the load was cancelled");
      if (!waited || waited->reserved.load()) return got;  // else: it ended without memory
    }
    sink::BatchSink& s = *sinks[order[k].first];
    TF_ASSIGN_OR_RETURN(std::optional<sink::Reservation> r, s.Reserve(BatchAt(k)));
    if (!r) return s.BudgetError(BatchAt(k), k, order.size());
    return Produce(k, std::move(*r));
  }

  // Double buffering: batch j is read on a helper thread while the caller handles batch j - 1,
  // when its memory fits its budget now (the plan halves batches under a budget so they do). A
  // failure to reserve (e.g. cudaMalloc while the caller still holds the batch) is not an error
  // yet: the batch is tried again, and its error reported, by the next Next.
  // When the memory is still held by batches the caller has (a caller iterating in a loop
  // usually holds the batch before while it asks for the next), the helper waits for the caller
  // to drop them and reads then, while the caller works on its batch; Take ends a wait that has
  // not ended yet and reads the batch itself.
  void ReadAhead(size_t j) {
    if (j >= order.size() || !sinks[order[j].first]->reads_ahead()) return;
    sink::BatchSink& s = *sinks[order[j].first];
    Result<std::optional<sink::Reservation>> r = s.Reserve(BatchAt(j));
    if (!r.ok()) return;
    if (*r) {
      next = std::async(std::launch::async, [this, j, memory = std::move(**r)]() mutable {
        return Produce(j, std::move(memory));
      });
      return;
    }
    if (!s.waits_for_memory()) return;
    waiting = std::make_shared<Waiting>();
    next = std::async(std::launch::async, [this, j, w = waiting]() -> Result<Batch> {
      Result<std::optional<sink::Reservation>> got =
          sinks[order[j].first]->ReserveWhenFree(BatchAt(j), w->stop);
      if (!got.ok() || !*got) {  // Take reserves (or reports the budget error) itself
        return Status(Code::kCancelled, "read-ahead ended before its memory was free");
      }
      w->reserved.store(true);
      return Produce(j, std::move(**got));
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

  // The totals of a load that reached its end; with drop_cache, its files dropped from the page
  // cache.
  Status Finish() {
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
    m->CollectVerifyStats(verified);
    m->CollectDeviceStats(pipeline0);
    m->CollectSourceStats(source0);
    sink::ReleaseGatherMappings(m->gather_maps);
    if (!m->options.drop_cache) return Status::Ok();
    std::vector<bool> read(m->checkpoint->files().size(), false);
    for (const Group& g : groups) {
      for (const PlanBatch& b : g.plan.batches) {
        for (const ReadTask& t : b.tasks) read[t.file] = true;
      }
    }
    return m->DropReadFiles(read);
  }
};

BatchIterator::BatchIterator(std::unique_ptr<State> state) : state_(std::move(state)) {}
BatchIterator::BatchIterator(BatchIterator&&) noexcept = default;
BatchIterator& BatchIterator::operator=(BatchIterator&&) noexcept = default;
BatchIterator::~BatchIterator() = default;

Result<std::optional<Batch>> BatchIterator::Next() {
  if (!state_) return std::optional<Batch>();  // moved from: the load went with the move
  State& s = *state_;
  if (s.over) return std::optional<Batch>();
  // Time the caller held a batch while nothing was read: no read-ahead, or one that waited for
  // memory the whole time.
  const bool overlapped = s.returned_overlapped && (!s.waiting || s.waiting->reserved.load());
  if (s.returned_at && !overlapped) s.idle += Clock::now() - *s.returned_at;
  if (s.k == s.order.size()) {
    s.over = true;
    TF_RETURN_IF_ERROR(s.Finish());
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
  m.ResetStats();
  m.stats.memory_budget = m.memory_note;
  auto s = std::make_unique<BatchIterator::State>();
  s->m = &m;
  s->start = Clock::now();
  m.budget->ResetPeak();  // LoadStats::peak_budget_bytes is this load's (held tensors included)
  s->reused0 = m.pool->reused();
  s->source0 = m.SourceNow();
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
  s->host.checksums = &m.checksums;  // checked by the host sink as bytes land
  s->host.verify_counts = &s->verified;
  s->host.verify_threads = m.VerifyThreads();
  s->device = m.Context(want_direct, m.copy_engine);
  s->device.checksums = &m.checksums;  // checked by the device sink in the staging slots
  s->device.verify_counts = &s->verified;
  for (size_t g = 0; g < s->groups.size(); ++g) {
    const Group& group = s->groups[g];
    if (group.device.is_cuda()) {
      s->sinks.push_back(sink::MakeDeviceSink(s->device, group.plan, group.strided, group.device,
                                              m.slots.at(group.device.index)));
    } else if (mapped) {
      s->sinks.push_back(sink::MakeMappedSink(s->host, group.plan));
    } else {
      s->sinks.push_back(sink::MakeHostSink(s->host, group.plan));
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

}  // namespace tensorferry

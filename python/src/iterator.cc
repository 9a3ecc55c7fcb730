#include "iterator.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <thread>
#include <utility>

#include "errors.h"
#include "gil.h"
#include "interrupt.h"

namespace nb = nanobind;

namespace tensorferry::python {

BatchStream::BatchStream(Reader& reader, Loader& loader, BatchIterator batches, Framework framework)
    : reader_(reader), loader_(loader), batches_(std::move(batches)), framework_(framework) {}

BatchStream::~BatchStream() {
  std::lock_guard<std::mutex> l(mu_);
  Stop();
}

namespace {

Status StoppedError() {
  return Status(Code::kInvalidArgument, "the iteration was stopped: its Loader was closed");
}

}  // namespace

nb::object BatchStream::Next() {
  std::unique_lock<std::mutex> step(mu_, std::defer_lock);  // Close() waits for this step
  std::optional<Reader::Lock> lock;
  // Marks this thread as the step's while it holds mu_, for a Close from a signal handler run
  // during the step (on this thread: it must not wait for mu_).
  struct StepThread {
    std::atomic<std::thread::id>& owner;
    ~StepThread() { owner.store(std::thread::id()); }
  };
  std::optional<StepThread> marked;
  {
    WithoutGil release;
    step.lock();
    if (closed_) throw StatusError(StoppedError());
    marked.emplace(StepThread{step_thread_});
    step_thread_.store(std::this_thread::get_id());
    if (batches_) lock.emplace(reader_, /*step=*/true);
  }
  if (!batches_) return nb::none();
  Result<std::optional<Batch>> got = Status(Code::kInternal, "unset");
  try {
    got = Interruptible(*reader_.cancel_, [&] { return batches_->Next(); });
  } catch (...) {  // KeyboardInterrupt: the reads were cancelled; the iteration is over
    WithoutGil release;
    End();
    closed_ = true;
    throw;
  }
  if (close_requested_.load()) {  // closed by a signal handler during the step
    {
      WithoutGil release;
      End();
      closed_ = true;
    }
    Check(StoppedError());
  }
  if (!got.ok() || !*got) {
    {
      WithoutGil release;
      End();
    }
    Check(got.status());
    return nb::none();
  }
  Batch batch = std::move(**got);
  lock.reset();
  marked.reset();
  step.unlock();
  nb::list tensors = ExportTensors(framework_, batch.tensors);
  return nb::make_tuple(batch.index, batch.count, batch.bytes, tensors, DeviceName(batch.device));
}

void BatchStream::Close() {
  WithoutGil release;
  if (step_thread_.load() == std::this_thread::get_id()) {
    // From a signal handler run by this thread's step (Next holds mu_): the step's reads stop
    // within a chunk and the step ends the iteration itself.
    close_requested_.store(true);
    reader_.cancel_->store(true);
    return;
  }
  // A step in flight on another thread stops within a chunk instead of reading its batch to the
  // end first (not once the iteration ended: the Reader may be running another load by then).
  {
    std::lock_guard<std::mutex> running(running_mu_);  // End cannot pass between check and store
    if (running_.load()) reader_.cancel_->store(true);
  }
  std::lock_guard<std::mutex> l(mu_);
  Stop();
  closed_ = true;
}

void BatchStream::Stop() {
  // The batch read ahead stops within a chunk.
  if (batches_) reader_.cancel_->store(true);
  End();
}

void BatchStream::End() {
  if (!batches_) return;
  {
    std::lock_guard<std::mutex> running(running_mu_);
    running_.store(false);
  }
  batches_.reset();
  reader_.SetStats(loader_.stats());
  reader_.streaming_.store(false);
}

std::unique_ptr<BatchStream> Reader::Iterate(const std::optional<std::vector<std::string>>& names,
                                             int framework) {
  const Framework fw = ToFramework(framework);
  if (names) DescribeNames(*Open(), names);  // SafetensorError naming a missing tensor
  WithoutGil release;
  Lock lock(*this);  // busy while another iteration is open
  ResetCancel();
  Loader& loader = EnsureLoader();
  const Selection selection = names ? Selection::Names(*names) : Selection::All();
  BatchIterator batches = Unwrap(loader.Iterate(selection));
  streaming_.store(true);
  return std::make_unique<BatchStream>(*this, loader, std::move(batches), fw);
}

void RegisterIterator(nb::module_& m) {
  nb::class_<BatchStream>(m, "BatchStream")
      .def("next", &BatchStream::Next)
      .def("close", &BatchStream::Close);
}

}  // namespace tensorferry::python

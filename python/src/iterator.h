// tensorferry._core.BatchStream: pull-style iteration for Python generators over Loader::Iterate.
//
// Each next() takes the batch read ahead (or reads it) on the calling thread, with Ctrl-C seen on
// the main thread (Interruptible); the iterator reads the following batch ahead while the consumer
// holds this one. No bridge thread. The Reader is busy (its other calls raise) from
// Reader::Iterate until the end, an error, or close().
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <thread>

#include "export.h"
#include "reader.h"
#include "tensorferry/loader.h"

namespace tensorferry::python {

class BatchStream {
 public:
  // REQUIRES: `reader` and its `loader` outlive this stream (the binding keeps the Reader alive;
  // Reader::Close refuses while the stream is open).
  BatchStream(Reader& reader, Loader& loader, BatchIterator batches, Framework framework);
  ~BatchStream();
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // (index, count, bytes, [(name, dtype, array), ...], device) for the next batch, or None at the
  // end. Raises the load's error, if any, once the batches before it have been taken.
  nanobind::object Next();

  // Stops the iteration (tensors already handed out stay valid), waiting for a step in flight on
  // another thread (cancelled: it stops within a chunk); a later Next raises. From a signal
  // handler run during a step on the same thread, it cancels the step, which then ends the
  // iteration and raises (or lets the handler's exception through).
  void Close();

 private:
  void Stop();  // cancels the reads in flight and ends. REQUIRES: mu_ held.
  void End();   // the read ahead waited for, the figures kept, the Reader free. REQUIRES: mu_ held.

  Reader& reader_;
  Loader& loader_;  // the Reader's: kept while streaming_ (Reader::Close refuses then)
  std::mutex mu_;   // guards batches_ and closed_
  std::optional<BatchIterator> batches_;  // empty once ended
  const Framework framework_;
  bool closed_ = false;  // Close() was called: Next raises
  // The thread running a step (holding mu_), for Close from a signal handler on that thread.
  std::atomic<std::thread::id> step_thread_{};
  std::atomic<bool> close_requested_{false};  // such a Close: the step ends the iteration
  std::atomic<bool> running_{true};           // until End: batches_ without mu_, for Close
  // Held by Close from its check of running_ to its cancel, and by End to clear running_: a
  // Close cannot cancel a load that started on the Reader after this iteration ended.
  std::mutex running_mu_;
};

// Binds BatchStream into `m`.
void RegisterIterator(nanobind::module_& m);

}  // namespace tensorferry::python

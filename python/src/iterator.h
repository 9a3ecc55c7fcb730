// tensorferry._core.BatchStream: pull-style iteration for Python generators over Loader::Iterate.
//
// Each next() takes the batch read ahead (or reads it) on the calling thread, with Ctrl-C seen on
// the main thread (Interruptible); the iterator reads the following batch ahead while the consumer
// holds this one. No bridge thread. The Reader is busy (its other calls raise) from
// Reader::Iterate until the end, an error, or close().
#pragma once

#include <nanobind/nanobind.h>

#include <mutex>
#include <optional>

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
  // another thread; a later Next raises.
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
};

// Binds BatchStream into `m`.
void RegisterIterator(nanobind::module_& m);

}  // namespace tensorferry::python

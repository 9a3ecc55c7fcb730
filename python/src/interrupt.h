// Ctrl-C during long calls: Python runs signal handlers only on its main thread, between bytecodes,
// so a call that blocks in C++ with the GIL released would see KeyboardInterrupt only when it
// returns. Interruptible runs such work on a helper thread while the calling (main) thread checks
// for signals every kSignalPoll; on an exception from a handler (KeyboardInterrupt) it sets the
// work's cancel flag (LoadOptions::cancel: reads stop within a chunk per worker), waits for the
// work to end, and raises the handler's exception.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <utility>

#include "gil.h"

namespace tensorferry::python {

inline constexpr std::chrono::milliseconds kSignalPoll{50};

// Whether this thread is the interpreter's main thread (the one that runs signal handlers), as
// recorded by RememberMainThread at import.
bool OnMainThread();
void RememberMainThread();

// Runs f() (which must not touch Python objects) and returns its result or rethrows its
// exception. On the main thread, a signal handler's exception sets *cancel and is raised once f()
// has returned. Must be called with the GIL held.
template <typename F>
auto Interruptible(std::atomic<bool>& cancel, F&& f) -> decltype(f()) {
  using R = decltype(f());
  if (!OnMainThread()) {
    WithoutGil release;
    return f();
  }
  std::packaged_task<R()> task(std::forward<F>(f));
  std::future<R> done = task.get_future();
  std::thread worker(std::move(task));
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{worker};
  for (;;) {
    {
      WithoutGil release;
      if (done.wait_for(kSignalPoll) == std::future_status::ready) break;
    }
    if (PyErr_CheckSignals() != 0) {
      cancel.store(true, std::memory_order_relaxed);
      nanobind::python_error raised;  // takes the handler's exception
      {
        WithoutGil release;
        done.wait();
        worker.join();
      }
      throw raised;
    }
  }
  {
    WithoutGil release;
    worker.join();
  }
  return done.get();
}

}  // namespace tensorferry::python

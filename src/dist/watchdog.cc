// CollectiveWatchdog (tensorferry/collective.h): bounds the waits in collective calls.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "tensorferry/collective.h"

namespace tensorferry {

struct CollectiveWatchdog::State {
  using Clock = std::chrono::steady_clock;
  State(Collective& c, uint64_t timeout_ms, std::string w)
      : collective(c), timeout(std::chrono::milliseconds(timeout_ms)), what(std::move(w)) {}

  // The helper thread: sleeps until a step outlives the timeout, then aborts the group once.
  void Run() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      if (!active) {
        cv.wait(lock);
        continue;
      }
      const uint64_t watched = sequence;
      if (cv.wait_until(lock, start + timeout, [&] { return stop || sequence != watched; })) {
        continue;
      }
      char seconds[32];
      std::snprintf(seconds, sizeof(seconds), "%.3g",
                    std::chrono::duration<double>(timeout).count());
      const Status why(Code::kIoError,
                       what + ": rank " + std::to_string(collective.rank()) + " waited " + seconds +
                           " s in " + step +
                           " for the other ranks (coop_timeout_ms); a rank died or hangs, or a "
                           "link is down");
      lock.unlock();
      collective.Abort(why);
      return;
    }
  }

  Collective& collective;
  const std::chrono::milliseconds timeout;
  const std::string what;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool active = false;
  uint64_t sequence = 0;  // changes at every Begin and End
  std::string step;
  Clock::time_point start;
  std::thread thread;
};

CollectiveWatchdog::CollectiveWatchdog(Collective& collective, uint64_t timeout_ms,
                                       std::string what)
    : state_(std::make_unique<State>(collective, timeout_ms, std::move(what))) {
  if (timeout_ms > 0) state_->thread = std::thread([s = state_.get()] { s->Run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

void CollectiveWatchdog::Begin(const std::string& step) {
  if (!state_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->step = step;
    state_->start = State::Clock::now();
    state_->active = true;
    ++state_->sequence;
  }
  state_->cv.notify_all();
}

void CollectiveWatchdog::End() {
  if (!state_->thread.joinable()) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->active = false;
  ++state_->sequence;
}

}  // namespace tensorferry

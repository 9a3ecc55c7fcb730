#include "util/parallel.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace tensorferry {

Status ParallelForUntilError(size_t n, unsigned threads, const std::function<Status(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  size_t first_index = n;
  Status first;
  auto run = [&] {
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      Status s = fn(i);
      if (s.ok()) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (i < first_index) {
        first_index = i;
        first = std::move(s);
      }
      failed.store(true, std::memory_order_relaxed);
    }
  };
  const size_t workers = std::min<size_t>(std::max(threads, 1u), n);
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < workers; ++t) {
    try {
      helpers.emplace_back(run);
    } catch (const std::system_error&) {
      break;  // fewer threads, same result
    }
  }
  run();
  for (std::thread& t : helpers) t.join();
  return first;
}

void ParallelFor(size_t n, unsigned threads, const std::function<void(size_t)>& fn) {
  (void)ParallelForUntilError(n, threads, [&fn](size_t i) {
    fn(i);
    return Status::Ok();
  });
}

}  // namespace tensorferry

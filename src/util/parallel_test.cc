// ParallelFor, ParallelForUntilError: every item once, on at most the threads asked for; the first
// failure in item order is the one returned, and no item starts after a failure is seen.
#include "util/parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace tensorferry {
namespace {

TEST(ParallelFor, EveryItemOnceOnAtMostTheThreadsAsked) {
  for (unsigned threads : {0u, 1u, 3u, 16u}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{1000}}) {
      std::vector<std::atomic<int>> seen(n);
      std::mutex mu;
      std::set<std::thread::id> ids;
      ParallelFor(n, threads, [&](size_t i) {
        seen[i].fetch_add(1);
        std::lock_guard<std::mutex> lock(mu);
        ids.insert(std::this_thread::get_id());
      });
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i].load(), 1) << i;
      EXPECT_LE(ids.size(), std::max<size_t>(threads, 1)) << threads;
      if (n > 0 && threads <= 1) {
        EXPECT_EQ(*ids.begin(), std::this_thread::get_id());
      }
    }
  }
}

TEST(ParallelFor, FirstFailureInItemOrderStopsTheLoop) {
  for (unsigned threads : {1u, 4u}) {
    std::atomic<size_t> ran{0};
    const Status s = ParallelForUntilError(size_t{10000}, threads, [&](size_t i) {
      ran.fetch_add(1);
      if (i == 37 || i == 38 || i == 500) {
        return Status(Code::kIoError, "item " + std::to_string(i));
      }
      return Status::Ok();
    });
    EXPECT_EQ(s.code(), Code::kIoError);
    EXPECT_EQ(s.message(), "item 37") << threads;
    EXPECT_LT(ran.load(), size_t{10000}) << "items kept starting after the failure";
  }
  EXPECT_TRUE(ParallelForUntilError(size_t{5}, 2, [](size_t) { return Status::Ok(); }).ok());
}

}  // namespace
}  // namespace tensorferry

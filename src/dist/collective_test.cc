#include "tensorferry/collective.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

namespace tensorferry {
namespace {

// Runs fn(member) on one thread per member of a fresh in-process group of `world`.
template <typename Fn>
void RunGroup(uint32_t world, Fn fn) {
  auto group = MakeInProcessGroup(world);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { fn(*(*group)[r]); });
  }
  for (auto& t : threads) t.join();
}

std::vector<std::byte> Pattern(size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 31 + seed * 7) & 0xff);
  return v;
}

TEST(InProcessCollective, RefusesEmptyGroup) {
  EXPECT_EQ(MakeInProcessGroup(0).status().code(), Code::kInvalidArgument);
}

TEST(InProcessCollective, BroadcastScatterAllGatherEveryWorldSize) {
  for (uint32_t world : {1u, 2u, 3u, 4u, 8u}) {
    RunGroup(world, [&](Collective& c) {
      EXPECT_EQ(c.size(), world);
      for (uint32_t root = 0; root < world; ++root) {
        // Broadcast of 1000 bytes, several rounds in a row.
        const auto want = Pattern(1000, root);
        std::vector<std::byte> got(1000);
        if (c.rank() == root) {
          ASSERT_TRUE(c.Broadcast(want, {}, root).ok());
        } else {
          ASSERT_TRUE(c.Broadcast({}, got, root).ok());
          EXPECT_EQ(got, want);
        }
        // Scatterv with uneven blocks, one of them empty.
        std::vector<uint64_t> counts(world);
        uint64_t total = 0;
        for (uint32_t r = 0; r < world; ++r) {
          counts[r] = (r == 1 ? 0 : 10 + r * 3 + root);
          total += counts[r];
        }
        const auto all = Pattern(total, root + 100);
        std::vector<std::byte> mine(counts[c.rank()]);
        ASSERT_TRUE(c.Scatterv(c.rank() == root ? std::span<const std::byte>(all)
                                                : std::span<const std::byte>(),
                               counts, mine, root)
                        .ok());
        uint64_t offset = 0;
        for (uint32_t r = 0; r < c.rank(); ++r) offset += counts[r];
        EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + offset));
      }
      auto values = c.AllGather(c.rank() * 10 + 1);
      ASSERT_TRUE(values.ok());
      for (uint32_t r = 0; r < world; ++r) EXPECT_EQ((*values)[r], r * 10 + 1);
      EXPECT_TRUE(c.Barrier().ok());
    });
  }
}

TEST(InProcessCollective, MismatchesAreErrorsOnEveryMember) {
  RunGroup(3, [](Collective& c) {
    // Rank 2 expects a different size: every member gets the same error.
    std::vector<std::byte> buf(c.rank() == 2 ? 5 : 4);
    Status s = c.rank() == 0 ? c.Broadcast(buf, {}, 0) : c.Broadcast({}, buf, 0);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("rank 2 expects 5 bytes"), std::string::npos) << s.ToString();
    // Different roots.
    s = c.Broadcast(buf, buf, c.rank() == 1 ? 1 : 0);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    // A root outside the group.
    s = c.Barrier();
    EXPECT_TRUE(s.ok());
    std::vector<uint64_t> counts = {1, 1, 1};
    std::vector<std::byte> one(1);
    s = c.Scatterv({}, counts, one, 7);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("root 7 outside a group of 3"), std::string::npos);
    // Counts that do not sum to what the root sends.
    std::vector<std::byte> two(2);
    s = c.Scatterv(c.rank() == 0 ? std::span<const std::byte>(two) : std::span<const std::byte>(),
                   counts, one, 0);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
  });
}

}  // namespace
}  // namespace tensorferry

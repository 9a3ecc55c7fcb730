#include "tensorferry/collective.h"
#include "testing/test_util.h"

#include <gtest/gtest.h>

#include <chrono>
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

using ::tensorferry::testing::Pattern;

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

// Block p -> q has Count(p, q) bytes (some empty), filled with a pattern naming p and q.
uint64_t Count(uint32_t p, uint32_t q) {
  return ((p * 3 + q * 5 + 1) % 7) * 11;
}

TEST(InProcessCollective, AllToAllvEveryWorldSize) {
  for (uint32_t world : {1u, 2u, 3u, 4u, 8u}) {
    RunGroup(world, [&](Collective& c) {
      const uint32_t me = c.rank();
      for (int repeat = 0; repeat < 3; ++repeat) {
        std::vector<uint64_t> send_counts(world), recv_counts(world);
        std::vector<std::byte> send;
        for (uint32_t q = 0; q < world; ++q) {
          send_counts[q] = Count(me, q);
          recv_counts[q] = Count(q, me);
          const auto block = Pattern(send_counts[q], me * 16 + q + repeat);
          send.insert(send.end(), block.begin(), block.end());
        }
        uint64_t total = 0;
        for (uint64_t n : recv_counts) total += n;
        std::vector<std::byte> recv(total);
        ASSERT_TRUE(c.AllToAllv(send, send_counts, recv, recv_counts).ok());
        uint64_t offset = 0;
        for (uint32_t p = 0; p < world; ++p) {
          const auto want = Pattern(Count(p, me), p * 16 + me + repeat);
          EXPECT_TRUE(std::equal(want.begin(), want.end(), recv.begin() + offset))
              << "block from " << p << " to " << me;
          offset += Count(p, me);
        }
      }
    });
  }
}

// Abort, from another thread, ends a member's pending call and every later one with its status.
TEST(InProcessCollective, AbortEndsPendingAndLaterCalls) {
  auto group = MakeInProcessGroup(2).ValueOrThrow();
  Status pending;
  std::thread waiter([&] { pending = group[0]->Barrier(); });  // member 1 never comes
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(group[1]->Abort(Status(Code::kIoError, "rank 1 is gone")));
  waiter.join();
  EXPECT_EQ(pending.code(), Code::kIoError);
  EXPECT_EQ(pending.message(), "rank 1 is gone");
  EXPECT_EQ(group[0]->AllGather(1).status().message(), "rank 1 is gone");
  EXPECT_EQ(group[1]->Barrier().message(), "rank 1 is gone");
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
    // AllToAllv: rank 1 expects 3 bytes from rank 0, which sends 2.
    std::vector<uint64_t> send_counts = {2, 2, 2};
    std::vector<uint64_t> recv_counts = {c.rank() == 1 ? 3u : 2u, 2, 2};
    std::vector<std::byte> out(6), in(c.rank() == 1 ? 7 : 6);
    s = c.AllToAllv(out, send_counts, in, recv_counts);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("rank 0 sends 2 bytes to rank 1, which expects 3"),
              std::string::npos)
        << s.ToString();
  });
}

}  // namespace
}  // namespace tensorferry

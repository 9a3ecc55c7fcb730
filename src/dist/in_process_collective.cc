// In-process collective group (collective.h): members are threads of one process.
//
// Every operation is one rendezvous in three steps: each member deposits a description of its
// call (operation, root, sizes, buffer pointers) in its slot and waits for all; every member then
// checks that all descriptions agree (all see the same slots, so all reach the same verdict) and
// copies what it needs straight out of the root's buffers; a second wait keeps the root's buffers
// alive until everyone has copied. The mutex and condition variable order every deposit before
// every read, which is what ThreadSanitizer checks.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

#include "tensorferry/collective.h"

namespace tensorferry {
namespace {

enum class Op : uint8_t { kBroadcast, kScatterv, kAllToAllv, kAllGather, kBarrier };

const char* OpName(Op op) {
  switch (op) {
    case Op::kBroadcast: return "Broadcast";
    case Op::kScatterv: return "Scatterv";
    case Op::kAllToAllv: return "AllToAllv";
    case Op::kAllGather: return "AllGather";
    case Op::kBarrier: return "Barrier";
  }
  return "?";
}

struct Call {
  Op op = Op::kBarrier;
  uint32_t root = 0;
  std::span<const std::byte> send;
  std::span<std::byte> recv;
  std::span<const uint64_t> counts;       // Scatterv; AllToAllv: the send counts
  std::span<const uint64_t> recv_counts;  // AllToAllv
  uint64_t value = 0;
};

struct Shared {
  explicit Shared(uint32_t n) : world(n), slots(n) {}
  const uint32_t world;
  std::mutex mu;
  std::condition_variable cv;
  uint32_t arrived = 0;
  uint64_t generation = 0;
  std::vector<Call> slots;
  Status aborted = Status::Ok();  // set once by Abort: every pending and later call returns it

  // Blocks until every member has called Wait for the same generation, or, when `abortable`, the
  // group is aborted (then returns the abort's status). The wait after the copies is not
  // abortable: every member that passed the first wait reaches it without blocking, and no
  // member may free its buffers while another still copies from them.
  Status Wait(std::unique_lock<std::mutex>& lock, bool abortable) {
    if (abortable && !aborted.ok()) return aborted;
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return Status::Ok();
    }
    cv.wait(lock, [&] { return generation != gen || (abortable && !aborted.ok()); });
    return generation != gen ? Status::Ok() : aborted;
  }
};

class InProcessMember final : public Collective {
 public:
  InProcessMember(std::shared_ptr<Shared> shared, uint32_t rank)
      : shared_(std::move(shared)), rank_(rank) {}

  uint32_t rank() const noexcept override { return rank_; }
  uint32_t size() const noexcept override { return shared_->world; }

  Status Broadcast(std::span<const std::byte> send, std::span<std::byte> recv,
                   uint32_t root) override {
    Call c;
    c.op = Op::kBroadcast;
    c.root = root;
    c.send = send;
    c.recv = recv;
    return Run(c);
  }

  Status Scatterv(std::span<const std::byte> send, std::span<const uint64_t> counts,
                  std::span<std::byte> recv, uint32_t root) override {
    Call c;
    c.op = Op::kScatterv;
    c.root = root;
    c.send = send;
    c.recv = recv;
    c.counts = counts;
    return Run(c);
  }

  Status AllToAllv(std::span<const std::byte> send, std::span<const uint64_t> send_counts,
                   std::span<std::byte> recv, std::span<const uint64_t> recv_counts) override {
    Call c;
    c.op = Op::kAllToAllv;
    c.send = send;
    c.recv = recv;
    c.counts = send_counts;
    c.recv_counts = recv_counts;
    return Run(c);
  }

  Result<std::vector<uint64_t>> AllGather(uint64_t value) override {
    Call c;
    c.op = Op::kAllGather;
    c.value = value;
    std::vector<uint64_t> values(shared_->world);
    Status s = Run(c, &values);
    if (!s.ok()) return s;
    return values;
  }

  Status Barrier() override {
    Call c;
    c.op = Op::kBarrier;
    return Run(c);
  }

  bool Abort(const Status& why) override {
    Shared& s = *shared_;
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.aborted.ok()) {
      s.aborted = why.ok() ? Status(Code::kInternal, "in-process group aborted") : why;
    }
    s.cv.notify_all();
    return true;
  }

 private:
  // The verdict on the deposited calls; identical on every member.
  static Status Check(const std::vector<Call>& calls) {
    const Call& first = calls[0];
    const uint32_t world = static_cast<uint32_t>(calls.size());
    for (uint32_t r = 0; r < world; ++r) {
      if (calls[r].op != first.op || calls[r].root != first.root) {
        return Status(Code::kInvalidArgument,
                      std::string("collective mismatch: rank 0 called ") + OpName(first.op) +
                          " (root " + std::to_string(first.root) + "), rank " + std::to_string(r) +
                          " called " + OpName(calls[r].op) + " (root " +
                          std::to_string(calls[r].root) + ")");
      }
    }
    if (first.root >= world) {
      return Status(Code::kInvalidArgument, std::string(OpName(first.op)) + ": root " +
                                                std::to_string(first.root) +
                                                " outside a group of " + std::to_string(world));
    }
    const Call& root = calls[first.root];
    if (first.op == Op::kBroadcast) {
      for (uint32_t r = 0; r < world; ++r) {
        if (r != first.root && calls[r].recv.size() != root.send.size()) {
          return Status(Code::kInvalidArgument, "Broadcast: rank " + std::to_string(r) +
                                                    " expects " +
                                                    std::to_string(calls[r].recv.size()) +
                                                    " bytes, root " + std::to_string(first.root) +
                                                    " sends " + std::to_string(root.send.size()));
        }
      }
    } else if (first.op == Op::kScatterv) {
      for (uint32_t r = 0; r < world; ++r) {
        const Call& c = calls[r];
        if (c.counts.size() != world ||
            !std::equal(c.counts.begin(), c.counts.end(), root.counts.begin())) {
          return Status(Code::kInvalidArgument, "Scatterv: rank " + std::to_string(r) +
                                                    " passes counts that differ from the root's");
        }
        if (c.recv.size() != c.counts[r]) {
          return Status(Code::kInvalidArgument,
                        "Scatterv: rank " + std::to_string(r) + " receives into " +
                            std::to_string(c.recv.size()) + " bytes, its count is " +
                            std::to_string(c.counts[r]));
        }
      }
      uint64_t total = 0;
      for (uint64_t n : root.counts) total += n;
      if (root.send.size() != total) {
        return Status(Code::kInvalidArgument, "Scatterv: root " + std::to_string(first.root) +
                                                  " sends " + std::to_string(root.send.size()) +
                                                  " bytes, the counts sum to " +
                                                  std::to_string(total));
      }
    }
    if (first.op == Op::kAllToAllv) return CheckAllToAllv(calls);
    return Status::Ok();
  }

  static uint64_t Sum(std::span<const uint64_t> v) {
    uint64_t total = 0;
    for (uint64_t n : v) total += n;
    return total;
  }

  static Status CheckAllToAllv(const std::vector<Call>& calls) {
    const uint32_t world = static_cast<uint32_t>(calls.size());
    for (uint32_t p = 0; p < world; ++p) {
      const Call& c = calls[p];
      if (c.counts.size() != world || c.recv_counts.size() != world) {
        return Status(Code::kInvalidArgument, "AllToAllv: rank " + std::to_string(p) +
                                                  " passes counts of another group size");
      }
      if (c.send.size() != Sum(c.counts) || c.recv.size() != Sum(c.recv_counts)) {
        return Status(Code::kInvalidArgument, "AllToAllv: rank " + std::to_string(p) +
                                                  "'s buffers differ from its counts' sums");
      }
    }
    for (uint32_t p = 0; p < world; ++p) {
      for (uint32_t q = 0; q < world; ++q) {
        if (calls[p].counts[q] != calls[q].recv_counts[p]) {
          return Status(Code::kInvalidArgument, "AllToAllv: rank " + std::to_string(p) + " sends " +
                                                    std::to_string(calls[p].counts[q]) +
                                                    " bytes to rank " + std::to_string(q) +
                                                    ", which expects " +
                                                    std::to_string(calls[q].recv_counts[p]));
        }
      }
    }
    return Status::Ok();
  }

  Status Run(const Call& call, std::vector<uint64_t>* values = nullptr) {
    Shared& s = *shared_;
    std::unique_lock<std::mutex> lock(s.mu);
    s.slots[rank_] = call;
    if (Status w = s.Wait(lock, /*abortable=*/true); !w.ok()) return w;
    // Every slot is written; nobody writes a slot again before the second Wait.
    Status verdict = Check(s.slots);
    if (verdict.ok()) {
      const Call& root = s.slots[call.root];
      // Copies run without the lock: the buffers are the members' own, and each member writes
      // only its own recv.
      lock.unlock();
      switch (call.op) {
        case Op::kBroadcast:
          if (rank_ != call.root && !call.recv.empty()) {
            std::memcpy(call.recv.data(), root.send.data(), call.recv.size());
          }
          break;
        case Op::kScatterv: {
          uint64_t offset = 0;
          for (uint32_t r = 0; r < rank_; ++r) offset += call.counts[r];
          if (!call.recv.empty()) {
            std::memcpy(call.recv.data(), root.send.data() + offset, call.recv.size());
          }
          break;
        }
        case Op::kAllToAllv: {
          // From each member p: its block for this member, at the sum of the counts before it.
          uint64_t dst = 0;
          for (uint32_t p = 0; p < s.world; ++p) {
            const Call& from = s.slots[p];
            uint64_t src = 0;
            for (uint32_t q = 0; q < rank_; ++q) src += from.counts[q];
            const uint64_t n = from.counts[rank_];
            if (n > 0) std::memcpy(call.recv.data() + dst, from.send.data() + src, n);
            dst += call.recv_counts[p];
          }
          break;
        }
        case Op::kAllGather: break;
        case Op::kBarrier: break;
      }
      lock.lock();
      if (values != nullptr) {
        for (uint32_t r = 0; r < s.world; ++r) (*values)[r] = s.slots[r].value;
      }
    }
    static_cast<void>(s.Wait(lock, /*abortable=*/false));  // not abortable: always ok
    return verdict;
  }

  std::shared_ptr<Shared> shared_;
  uint32_t rank_;
};

}  // namespace

Result<std::vector<std::unique_ptr<Collective>>> MakeInProcessGroup(uint32_t world) {
  if (world == 0) return Status(Code::kInvalidArgument, "in-process group of 0 members");
  auto shared = std::make_shared<Shared>(world);
  std::vector<std::unique_ptr<Collective>> members;
  members.reserve(world);
  for (uint32_t r = 0; r < world; ++r) {
    members.push_back(std::make_unique<InProcessMember>(shared, r));
  }
  return members;
}

}  // namespace tensorferry

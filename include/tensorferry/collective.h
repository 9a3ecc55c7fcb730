// tensorferry/collective.h: the few collective operations the cooperative loader needs
// (cooperative.h), behind a small interface so that the protocol does not depend on one engine.
//
// Implementations:
//   - MakeInProcessGroup (here): N members in one process exchanging through shared memory, one
//     member per thread. For tests (every world size, under ThreadSanitizer) and for programs that
//     run tensor-parallel ranks as threads.
//   - MpiCollective (mpi.h, target tensorferry::mpi, built only where MPI is found): over an
//     MPI communicator the caller owns.
//   The Python package does the same exchange with torch.distributed (docs/distributed.md).
//
// Contract shared by every implementation (as with MPI): every member of the group makes the same
// sequence of collective calls with the same root and the same sizes; a member that skips a call
// leaves the others waiting in it. Sizes are in bytes and may exceed 2 GiB (implementations cut
// transfers into pieces where the engine limits a count to int). Errors are Status values: a
// mismatch the implementation can detect (sizes disagreeing with the root's, a root outside the
// group) is kInvalidArgument, a transport failure kIoError; after an error the group is in an
// unspecified state and should not be used further.
//
// Thread-safety: one member object is used by one thread at a time; distinct members of an
// in-process group are meant to be used from distinct threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry {

class Collective {
 public:
  virtual ~Collective() = default;

  // This member's index in [0, size()), and the number of members.
  virtual uint32_t rank() const noexcept = 0;
  virtual uint32_t size() const noexcept = 0;

  // The root's `send` bytes arrive in every other member's `recv`. The root passes `send` (recv
  // is ignored); the others pass `recv` of exactly the root's send.size() bytes (send ignored).
  // Arguments any member gets wrong (a root outside the group, or differing between members, a
  // recv of another size) are kInvalidArgument on every member, before any byte moves.
  virtual Status Broadcast(std::span<const std::byte> send, std::span<std::byte> recv,
                           uint32_t root) = 0;

  // Scatter of variable-size blocks: `counts` (identical on every member, size() entries) gives
  // the bytes for each member; the root passes `send`, the concatenation of the blocks in rank
  // order (sum of counts bytes); every member, the root included, receives its block in `recv`
  // (exactly counts[rank()] bytes). Non-roots pass an empty `send`. Arguments any member gets
  // wrong (counts or root differing between members, sizes that do not match the counts) are
  // kInvalidArgument on every member, before any byte moves.
  virtual Status Scatterv(std::span<const std::byte> send, std::span<const uint64_t> counts,
                          std::span<std::byte> recv, uint32_t root) = 0;

  // Every member sends a block to every member and receives one from each: `send` is the
  // concatenation of the blocks for members 0, 1, ... (send_counts[q] bytes for member q, the
  // member's own block included), `recv` the concatenation of the blocks from members 0, 1, ...
  // (recv_counts[p] bytes from member p). Counts must agree pairwise: send_counts[q] on member p
  // equals recv_counts[p] on member q (a mismatch is kInvalidArgument on every member). All
  // pairs transfer at once, so every member's link is busy (the cooperative exchange's one call
  // per round).
  virtual Status AllToAllv(std::span<const std::byte> send, std::span<const uint64_t> send_counts,
                           std::span<std::byte> recv, std::span<const uint64_t> recv_counts) = 0;

  // values[r] = the `value` member r passed, on every member.
  virtual Result<std::vector<uint64_t>> AllGather(uint64_t value) = 0;

  virtual Status Barrier() = 0;

  // Ends the group's work because of `why` (a rank died, a link is down: a call has waited too
  // long); callable from any thread while another thread is blocked in a call of this member.
  // Returns false where the implementation cannot interrupt anything. MpiCollective cannot cancel
  // an MPI call: it prints `why` on stderr and calls MPI_Abort on its communicator (the job ends,
  // as when a rank dies); the in-process group makes every member's pending and later calls
  // return `why`. Thread-safe, unlike the other calls.
  virtual bool Abort(const Status& why) {
    (void)why;
    return false;
  }
};

// Bounds how long one member waits in collective calls: each call (or group of calls) runs as a
// named step through Watch; a step that lasts longer than the timeout ends the group with
// Collective::Abort(kIoError "<what>: rank R waited T s in <step> for the other ranks
// (coop_timeout_ms); a rank died or hangs, or a link is down"). A helper thread exists only with a
// timeout (0: nothing is watched). The collective must outlive the watchdog. Watch is called by
// the thread that makes the collective calls; the watchdog's own thread only calls Abort.
class CollectiveWatchdog {
 public:
  CollectiveWatchdog(Collective& collective, uint64_t timeout_ms, std::string what);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // Runs fn() (collective calls) as step `step`; returns what fn returns.
  template <typename Fn>
  auto Watch(const std::string& step, Fn&& fn) {
    Begin(step);
    auto result = fn();
    End();
    return result;
  }

 private:
  void Begin(const std::string& step);
  void End();
  struct State;
  std::unique_ptr<State> state_;
};

// `world` members of one in-process group (world >= 1), member r at index r. The members share
// state and may outlive each other in any order. Each collective call blocks until every member
// has made it. Errors: kInvalidArgument for world 0.
Result<std::vector<std::unique_ptr<Collective>>> MakeInProcessGroup(uint32_t world);

}  // namespace tensorferry

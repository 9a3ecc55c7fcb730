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
  virtual Status Broadcast(std::span<const std::byte> send, std::span<std::byte> recv,
                           uint32_t root) = 0;

  // Scatter of variable-size blocks: `counts` (identical on every member, size() entries) gives
  // the bytes for each member; the root passes `send`, the concatenation of the blocks in rank
  // order (sum of counts bytes); every member, the root included, receives its block in `recv`
  // (exactly counts[rank()] bytes). Non-roots pass an empty `send`.
  virtual Status Scatterv(std::span<const std::byte> send, std::span<const uint64_t> counts,
                          std::span<std::byte> recv, uint32_t root) = 0;

  // values[r] = the `value` member r passed, on every member.
  virtual Result<std::vector<uint64_t>> AllGather(uint64_t value) = 0;

  virtual Status Barrier() = 0;
};

// `world` members of one in-process group (world >= 1), member r at index r. The members share
// state and may outlive each other in any order. Each collective call blocks until every member
// has made it. Errors: kInvalidArgument for world 0.
Result<std::vector<std::unique_ptr<Collective>>> MakeInProcessGroup(uint32_t world);

}  // namespace tensorferry

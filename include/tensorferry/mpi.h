// tensorferry/mpi.h: the Collective (collective.h) over an MPI communicator.
//
// Part of the separate target tensorferry::mpi, built only where CMake finds MPI; the core library
// never links MPI. The caller initializes MPI (MPI_Init or MPI_Init_thread), owns the communicator
// and finalizes MPI after destroying every MpiCollective.
//
// Create duplicates the communicator (MPI_Comm_dup: the library's messages never mix with the
// caller's) and sets MPI_ERRORS_RETURN on the duplicate only, so MPI failures come back as
// kIoError statuses naming the operation and MPI's error string instead of aborting. Transfers
// above 1 GiB are cut into 1 GiB pieces (MPI counts are int).
//
// Thread-safety: one thread at a time per object (MPI_THREAD_FUNNELED or better suffices when
// that thread is not the main one, MPI_THREAD_SINGLE when it is). Abort, called from another
// thread (the cooperative load's watchdog), calls MPI_Abort only under MPI_THREAD_MULTIPLE;
// below it, it ends the process (std::_Exit(1)), which the launcher sees as a rank that died.
#pragma once

// The C API only: the deprecated C++ bindings of Open MPI / MPICH are not wanted.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <memory>

#include "tensorferry/collective.h"

namespace tensorferry {

class MpiCollective final : public Collective {
 public:
  // REQUIRES: MPI is initialized. Collective over `comm` (every member calls it).
  // Errors: kIoError (MPI_Comm_dup failed), kInvalidArgument (MPI not initialized).
  static Result<std::unique_ptr<MpiCollective>> Create(MPI_Comm comm);
  ~MpiCollective() override;  // MPI_Comm_free of the duplicate: before MPI_Finalize
  MpiCollective(const MpiCollective&) = delete;
  MpiCollective& operator=(const MpiCollective&) = delete;

  uint32_t rank() const noexcept override { return rank_; }
  uint32_t size() const noexcept override { return size_; }
  Status Broadcast(std::span<const std::byte> send, std::span<std::byte> recv,
                   uint32_t root) override;
  Status Scatterv(std::span<const std::byte> send, std::span<const uint64_t> counts,
                  std::span<std::byte> recv, uint32_t root) override;
  Status AllToAllv(std::span<const std::byte> send, std::span<const uint64_t> send_counts,
                   std::span<std::byte> recv, std::span<const uint64_t> recv_counts) override;
  bool Abort(const Status& why) override;
  Result<std::vector<uint64_t>> AllGather(uint64_t value) override;
  Status Barrier() override;

 private:
  MpiCollective(MPI_Comm comm, uint32_t rank, uint32_t size)
      : comm_(comm), rank_(rank), size_(size) {}
  MPI_Comm comm_;
  uint32_t rank_;
  uint32_t size_;
};

}  // namespace tensorferry

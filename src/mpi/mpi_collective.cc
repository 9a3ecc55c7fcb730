// MpiCollective (tensorferry/mpi.h).
#include "tensorferry/mpi.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace tensorferry {
namespace {

// Largest piece of one transfer: MPI counts are int.
constexpr uint64_t kPiece = uint64_t{1} << 30;

Status MpiError(int rc, const char* op) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  return Status(Code::kIoError, std::string(op) + " failed: " + std::string(text, length) +
                                    " (MPI error " + std::to_string(rc) + ")");
}

// One verdict for every member before a transfer: a member that refused its arguments alone
// would leave the others waiting in the transfer. `mine` is this member's own verdict; `key`
// (the root, a digest of the counts) must be the same everywhere. Errors: `mine` on the member
// that failed, kInvalidArgument naming it on the others, or naming the disagreement.
Status AgreeOnArguments(MPI_Comm comm, uint32_t rank, const Status& mine, uint64_t key,
                        const char* op) {
  const uint64_t flagged[4] = {mine.ok() ? 0u : 1u, mine.ok() ? 0u : uint64_t{rank} + 1, key, ~key};
  uint64_t most[4] = {0, 0, 0, 0};
  const int rc = MPI_Allreduce(flagged, most, 4, MPI_UINT64_T, MPI_MAX, comm);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allreduce");
  if (!mine.ok()) return mine;
  if (most[0] != 0) {
    return Status(Code::kInvalidArgument, std::string(op) + ": rank " +
                                              std::to_string(most[1] - 1) +
                                              " refused its arguments; see that rank's error");
  }
  if (most[2] != key || most[3] != ~key) {
    return Status(Code::kInvalidArgument,
                  std::string(op) + ": the members disagree on the root or the counts");
  }
  return Status::Ok();
}

constexpr uint64_t kFnvBasis = 14695981039346656037ull;
uint64_t Digest(uint64_t h, uint64_t v) {  // FNV-1a over the 8 bytes of v
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

Result<std::unique_ptr<MpiCollective>> MpiCollective::Create(MPI_Comm comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return Status(Code::kInvalidArgument, "MpiCollective: MPI is not initialized");
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(comm, &dup);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_dup");
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  return std::unique_ptr<MpiCollective>(
      new MpiCollective(dup, static_cast<uint32_t>(rank), static_cast<uint32_t>(size)));
}

MpiCollective::~MpiCollective() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Status MpiCollective::Broadcast(std::span<const std::byte> send, std::span<std::byte> recv,
                                uint32_t root) {
  Status mine;
  if (root >= size_) {
    mine = Status(Code::kInvalidArgument, "Broadcast: root " + std::to_string(root) +
                                              " outside a group of " + std::to_string(size_));
  }
  if (Status agreed = AgreeOnArguments(comm_, rank_, mine, Digest(kFnvBasis, root), "Broadcast");
      !agreed.ok()) {
    return agreed;
  }
  // The root's buffer is only read (MPI_Bcast's buffer argument is not const).
  std::byte* data = rank_ == root ? const_cast<std::byte*>(send.data()) : recv.data();
  uint64_t total = rank_ == root ? send.size() : recv.size();
  // Every member must cut the same pieces: agree on the root's size first.
  uint64_t root_total = total;
  int rc = MPI_Bcast(&root_total, 1, MPI_UINT64_T, static_cast<int>(root), comm_);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
  if (root_total != total) {
    mine =
        Status(Code::kInvalidArgument,
               "Broadcast: rank " + std::to_string(rank_) + " expects " + std::to_string(total) +
                   " bytes, root " + std::to_string(root) + " sends " + std::to_string(root_total));
  }
  if (Status agreed = AgreeOnArguments(comm_, rank_, mine, root_total, "Broadcast"); !agreed.ok()) {
    return agreed;
  }
  for (uint64_t done = 0; done < total; done += kPiece) {
    const int count = static_cast<int>(std::min(kPiece, total - done));
    rc = MPI_Bcast(data + done, count, MPI_BYTE, static_cast<int>(root), comm_);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
  }
  return Status::Ok();
}

Status MpiCollective::Scatterv(std::span<const std::byte> send, std::span<const uint64_t> counts,
                               std::span<std::byte> recv, uint32_t root) {
  // Every member's arguments checked, and the root and counts compared, before any transfer.
  Status verdict;
  std::vector<uint64_t> offsets(size_, 0);
  uint64_t total = 0;
  uint64_t largest = 0;
  uint64_t key = Digest(kFnvBasis, root);
  for (const uint64_t count : counts) key = Digest(key, count);
  if (root >= size_) {
    verdict = Status(Code::kInvalidArgument, "Scatterv: root " + std::to_string(root) +
                                                 " outside a group of " + std::to_string(size_));
  } else if (counts.size() != size_) {
    verdict = Status(Code::kInvalidArgument, "Scatterv: " + std::to_string(counts.size()) +
                                                 " counts for a group of " + std::to_string(size_));
  } else if (recv.size() != counts[rank_]) {
    verdict =
        Status(Code::kInvalidArgument, "Scatterv: rank " + std::to_string(rank_) +
                                           " receives into " + std::to_string(recv.size()) +
                                           " bytes, its count is " + std::to_string(counts[rank_]));
  } else {
    for (uint32_t r = 0; r < size_; ++r) {
      offsets[r] = total;
      total += counts[r];
      largest = std::max(largest, counts[r]);
    }
    if (rank_ == root && send.size() != total) {
      verdict =
          Status(Code::kInvalidArgument, "Scatterv: root sends " + std::to_string(send.size()) +
                                             " bytes, the counts sum to " + std::to_string(total));
    }
  }
  if (Status agreed = AgreeOnArguments(comm_, rank_, verdict, key, "Scatterv"); !agreed.ok()) {
    return agreed;
  }
  // Piece p carries bytes [p * kPiece, (p + 1) * kPiece) of every block; displacements are int
  // too, so each piece goes through MPI with the root's blocks addressed relative to the lowest
  // block offset of the piece, which stays below INT_MAX when the whole piece does; otherwise
  // (total above 2 GiB) the root sends each block of the piece point to point.
  std::vector<int> piece_counts(size_);
  std::vector<int> displacements(size_);
  for (uint64_t start = 0; start < largest; start += kPiece) {
    uint64_t piece_total = 0;
    for (uint32_t r = 0; r < size_; ++r) {
      piece_total += counts[r] > start ? std::min(kPiece, counts[r] - start) : 0;
    }
    const uint64_t mine = counts[rank_] > start ? std::min(kPiece, counts[rank_] - start) : 0;
    const bool fits_int = total <= static_cast<uint64_t>(INT_MAX) && piece_total <= INT_MAX;
    if (fits_int) {
      for (uint32_t r = 0; r < size_; ++r) {
        piece_counts[r] =
            static_cast<int>(counts[r] > start ? std::min(kPiece, counts[r] - start) : 0);
        displacements[r] = static_cast<int>(offsets[r] + std::min(start, counts[r]));
      }
      const int rc = MPI_Scatterv(rank_ == root ? send.data() : nullptr, piece_counts.data(),
                                  displacements.data(), MPI_BYTE, recv.data() + start,
                                  static_cast<int>(mine), MPI_BYTE, static_cast<int>(root), comm_);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Scatterv");
      continue;
    }
    if (rank_ == root) {
      std::vector<MPI_Request> requests;
      for (uint32_t r = 0; r < size_; ++r) {
        const uint64_t count = counts[r] > start ? std::min(kPiece, counts[r] - start) : 0;
        if (count == 0) continue;
        if (r == root) {
          std::copy_n(send.data() + offsets[r] + start, count, recv.data() + start);
          continue;
        }
        requests.emplace_back();
        const int rc = MPI_Isend(send.data() + offsets[r] + start, static_cast<int>(count),
                                 MPI_BYTE, static_cast<int>(r), 0, comm_, &requests.back());
        if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Isend");
      }
      const int rc =
          MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Waitall");
    } else if (mine > 0) {
      const int rc = MPI_Recv(recv.data() + start, static_cast<int>(mine), MPI_BYTE,
                              static_cast<int>(root), 0, comm_, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Recv");
    }
  }
  return Status::Ok();
}

Status MpiCollective::AllToAllv(std::span<const std::byte> send,
                                std::span<const uint64_t> send_counts, std::span<std::byte> recv,
                                std::span<const uint64_t> recv_counts) {
  if (send_counts.size() != size_ || recv_counts.size() != size_) {
    return Status(Code::kInvalidArgument, "AllToAllv: counts for a group of " +
                                              std::to_string(send_counts.size()) + " and " +
                                              std::to_string(recv_counts.size()) + ", not " +
                                              std::to_string(size_));
  }
  std::vector<uint64_t> send_offsets(size_ + 1, 0), recv_offsets(size_ + 1, 0);
  for (uint32_t r = 0; r < size_; ++r) {
    send_offsets[r + 1] = send_offsets[r] + send_counts[r];
    recv_offsets[r + 1] = recv_offsets[r] + recv_counts[r];
  }
  // Every member learns what each peer will send it and compares it with what it expects; the
  // verdict is agreed on (a member that gave up alone would leave the others waiting).
  std::vector<uint64_t> incoming(size_);
  int rc =
      MPI_Alltoall(send_counts.data(), 1, MPI_UINT64_T, incoming.data(), 1, MPI_UINT64_T, comm_);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Alltoall");
  int bad = -1;  // the first peer whose count disagrees
  if (send.size() != send_offsets[size_] || recv.size() != recv_offsets[size_]) {
    bad = static_cast<int>(rank_);
  }
  for (uint32_t p = 0; p < size_ && bad < 0; ++p) {
    if (incoming[p] != recv_counts[p]) bad = static_cast<int>(p);
  }
  int flagged[2] = {bad >= 0 ? 1 : 0, bad >= 0 ? static_cast<int>(rank_) : -1};
  int any[2] = {0, -1};
  rc = MPI_Allreduce(flagged, any, 2, MPI_INT, MPI_MAX, comm_);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allreduce");
  if (any[0] != 0) {
    return Status(Code::kInvalidArgument,
                  "AllToAllv: counts disagree (rank " + std::to_string(any[1]) +
                      (bad >= 0 ? "; here: peer " + std::to_string(bad) : std::string()) + ")");
  }
  // Own block: a copy. Peers: every piece of every block posted at once (non-overtaking order
  // between a pair keeps the pieces of one block in sequence).
  std::copy_n(send.data() + send_offsets[rank_], send_counts[rank_],
              recv.data() + recv_offsets[rank_]);
  std::vector<MPI_Request> requests;
  for (uint32_t p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    for (uint64_t done = 0; done < recv_counts[p]; done += kPiece) {
      requests.emplace_back();
      rc = MPI_Irecv(recv.data() + recv_offsets[p] + done,
                     static_cast<int>(std::min(kPiece, recv_counts[p] - done)), MPI_BYTE,
                     static_cast<int>(p), 1, comm_, &requests.back());
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Irecv");
    }
  }
  for (uint32_t i = 1; i < size_; ++i) {
    // Start with the next rank up, so that not every member sends to rank 0 first.
    const uint32_t q = (rank_ + i) % size_;
    for (uint64_t done = 0; done < send_counts[q]; done += kPiece) {
      requests.emplace_back();
      rc = MPI_Isend(send.data() + send_offsets[q] + done,
                     static_cast<int>(std::min(kPiece, send_counts[q] - done)), MPI_BYTE,
                     static_cast<int>(q), 1, comm_, &requests.back());
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Isend");
    }
  }
  rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Waitall");
  return Status::Ok();
}

Result<std::vector<uint64_t>> MpiCollective::AllGather(uint64_t value) {
  std::vector<uint64_t> values(size_);
  const int rc = MPI_Allgather(&value, 1, MPI_UINT64_T, values.data(), 1, MPI_UINT64_T, comm_);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgather");
  return values;
}

bool MpiCollective::Abort(const Status& why) {
  // Called from the watchdog's thread while another thread is inside an MPI call: only
  // MPI_THREAD_MULTIPLE allows that. Below it, the process ends itself, which the launcher sees
  // as a rank that died (it ends the job too).
  int provided = MPI_THREAD_SINGLE;
  const bool multiple =
      MPI_Query_thread(&provided) == MPI_SUCCESS && provided == MPI_THREAD_MULTIPLE;
  std::fprintf(stderr, "error: rank %u: %s; %s\n", rank_, why.ToString().c_str(),
               multiple ? "aborting the MPI job" : "ending this rank");
  std::fflush(stderr);
  if (multiple) MPI_Abort(comm_, 1);
  std::_Exit(1);
}

Status MpiCollective::Barrier() {
  const int rc = MPI_Barrier(comm_);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Barrier");
  return Status::Ok();
}

}  // namespace tensorferry

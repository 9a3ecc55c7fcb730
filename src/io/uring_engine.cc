// The io_uring engine: worker threads each owning a ring, keeping up to queue_depth reads in
// flight. Requests come from the same JobQueue as the pread engine's. A request becomes one to
// three pieces (buffered head, O_DIRECT middle, buffered tail; or one buffered piece); each piece
// is one read SQE, resubmitted for the rest after a short read (a buffered request with a landed
// hook: kLandedPieceBytes per SQE, each handed to the hook as it completes). A piece that
// completes with -EINTR or -EAGAIN is submitted again a bounded number of times
// (TransientRetry, engine_common.h: the pread engine's rule), unless its request was cancelled.
// A request is Finish()ed only when none of its pieces is in the kernel any more, so its
// destination is never written after Execute returns, even when a sibling piece failed.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "io/engine_common.h"

#if defined(TENSORFERRY_HAVE_LIBURING)
#include <liburing.h>
#endif

namespace tensorferry::io {

#if defined(TENSORFERRY_HAVE_LIBURING)
namespace {

// Largest length of one read SQE (the field is 32 bits; stay well inside it).
constexpr uint64_t kMaxSqeBytes = uint64_t{1} << 30;

class Ring {
 public:
  // On failure, *err (when given) is the errno.
  static Result<std::unique_ptr<Ring>> Create(unsigned entries, int* err = nullptr) {
    auto ring = std::unique_ptr<Ring>(new Ring());
    const int rc = io_uring_queue_init(entries, &ring->ring_, 0);
    if (rc < 0) {
      if (err != nullptr) *err = -rc;
      return Status(Code::kUnsupported, "io_uring_queue_init(" + std::to_string(entries) +
                                            ") failed: " + ErrnoText(-rc));
    }
    ring->initialized_ = true;
    return ring;
  }
  ~Ring() {
    if (initialized_) io_uring_queue_exit(&ring_);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  io_uring* get() { return &ring_; }

 private:
  Ring() = default;
  io_uring ring_{};
  bool initialized_ = false;
};

struct RequestState;

// One read of a request: [offset, offset + length) of the file into dst.
struct Piece {
  RequestState* request = nullptr;
  int fd = -1;
  bool direct = false;
  uint64_t offset = 0;  // next file offset to read
  std::byte* dst = nullptr;
  uint64_t remaining = 0;
  TransientRetry retry;  // EINTR/EAGAIN completions since the piece last made progress
};

struct RequestState {
  JobQueue::Claim claim;
  Piece pieces[3];
  int pending = 0;  // pieces submitted and not completed
  // A buffered request with a landed hook: its piece goes to the kernel kLandedPieceBytes at a
  // time and each part is handed to the hook as it completes (read_engine.h).
  bool piecewise = false;
  Status status;
  uint64_t eof_at = UINT64_MAX;  // where the file ended, when status says so (the lowest piece's)
};

class UringEngine final : public ReadEngine {
 public:
  // At least 3 entries: one request (up to 3 pieces) must always fit. `filter` (tests only, may
  // be empty) rewrites each completion's result before it is handled.
  UringEngine(unsigned queue_depth, std::function<int(int)> filter)
      : queue_depth_(std::max(queue_depth, 3u)), filter_(std::move(filter)) {}
  ~UringEngine() override {
    queue_.Stop();
    for (std::thread& t : workers_) t.join();
  }
  UringEngine(const UringEngine&) = delete;
  UringEngine& operator=(const UringEngine&) = delete;

  // Creates every ring on this thread first (so failures are reported here), then the workers.
  Status Start(unsigned threads) {
    std::vector<std::unique_ptr<Ring>> rings;
    for (unsigned i = 0; i < threads; ++i) {
      auto ring = Ring::Create(queue_depth_);
      if (!ring.ok()) return ring.status();
      rings.push_back(std::move(ring).value());
    }
    workers_.reserve(threads);
    for (unsigned i = 0; i < threads; ++i) {
      try {
        workers_.emplace_back(
            [this, ring = std::shared_ptr<Ring>(std::move(rings[i]))] { WorkerLoop(*ring); });
      } catch (const std::system_error& e) {
        return Status(Code::kIoError, "io_uring engine: cannot start worker thread " +
                                          std::to_string(i) + ": " + e.what());
      }
    }
    return Status::Ok();
  }

  Status Execute(std::span<const ReadRequest> requests) override {
    return queue_.Run(requests, workers_.size());
  }
  EngineStats stats() const override { return counters_.Snapshot(); }
  std::string_view name() const override { return "io_uring"; }

 private:
  // Turns a claimed request into pieces. Returns false when it has none to submit (finished).
  bool Prepare(RequestState& r) {
    const ReadRequest& q = *r.claim.request;
    r.pending = 0;
    r.status = Status::Ok();
    auto add = [&](int fd, bool direct, uint64_t offset, std::byte* dst, uint64_t length) {
      if (length == 0) return;
      r.pieces[r.pending++] = Piece{&r, fd, direct, offset, dst, length, TransientRetry{}};
    };
    const int fd = q.file->native_handle();
    const DirectSplit split = SplitForDirect(q);
    r.piecewise = q.landed != nullptr && !split.direct;
    if (!split.direct) {
      add(fd, false, q.offset, q.dst.data(), q.dst.size());
    } else {
      add(fd, false, q.offset, q.dst.data(), split.head);
      add(q.direct_fd, true, q.offset + split.head, q.dst.data() + split.head, split.middle);
      const uint64_t tail = split.head + split.middle;
      add(fd, false, q.offset + tail, q.dst.data() + tail, q.dst.size() - tail);
    }
    return r.pending > 0;
  }

  // Copies every available completion out of the ring and marks them seen. The only place that
  // reads the completion ring itself (scripts/tsan.supp names it: the kernel writes that memory).
  static void DrainRingCompletions(io_uring* ring, std::vector<std::pair<Piece*, int>>& out) {
    out.clear();
    io_uring_cqe* cqe;
    unsigned head;
    io_uring_for_each_cqe(ring, head, cqe) {
      out.emplace_back(static_cast<Piece*>(io_uring_cqe_get_data(cqe)), cqe->res);
    }
    io_uring_cq_advance(ring, static_cast<unsigned>(out.size()));
  }

  static void Submit(io_uring* ring, Piece& p) {
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    // The worker never has more pieces in flight than the ring has entries (3 per request at most,
    // admitted only while in_flight + 3 <= queue_depth_ = ring entries), so an SQE is always free.
    const uint64_t most = p.request->piecewise ? kLandedPieceBytes : kMaxSqeBytes;
    io_uring_prep_read(sqe, p.fd, p.dst, static_cast<unsigned>(std::min(p.remaining, most)),
                       p.offset);
    io_uring_sqe_set_data(sqe, &p);
  }

  // Handles one completion; returns true when the piece is finished (done or failed).
  bool Complete(io_uring* ring, Piece& p, int res) {
    RequestState& r = *p.request;
    const ReadRequest& q = *r.claim.request;
    counters_.read_calls.fetch_add(1, std::memory_order_relaxed);
    if (filter_) res = filter_(res);
    auto fail = [&](Status s) {
      if (r.status.ok()) r.status = LabelReadError(q, p.offset, std::move(s));
      return true;
    };
    if (res == -EINTR || res == -EAGAIN) {
      if (q.cancel != nullptr && q.cancel->load(std::memory_order_relaxed)) {
        return fail(Status(Code::kCancelled, "the load was cancelled"));
      }
      // Again() sleeps before an EAGAIN retry (at most 10 ms), holding up this worker's other
      // completions meanwhile: rare, and a server that answers EAGAIN wants fewer requests.
      if (p.retry.Again(-res)) {
        Submit(ring, p);
        return false;
      }
      // Retries spent: the read fails with this errno, as a pread would (below).
    }
    if (res == -EINVAL && p.direct) {
      // The file system refused O_DIRECT here: read this piece through the page cache instead.
      p.direct = false;
      p.fd = q.file->native_handle();
      Submit(ring, p);
      return false;
    }
    if (res < 0) {
      return fail(Status(Code::kIoError, q.file->path() + ": read of " +
                                             std::to_string(p.remaining) + " bytes at offset " +
                                             std::to_string(p.offset) +
                                             " failed: " + ErrnoText(-res)));
    }
    const uint64_t n = static_cast<uint64_t>(res);
    if (n == 0 || n > p.remaining || (p.direct && n < p.remaining && n % kDirectAlignment != 0)) {
      if (n > p.remaining) {
        return fail(Status(Code::kInternal, q.file->path() + ": read returned too many bytes"));
      }
      // The request's pieces end in any order: the file's end is where the lowest one ended.
      const uint64_t at = p.offset + n;
      if (r.status.ok() || (r.status.code() == Code::kUnexpectedEof && at < r.eof_at)) {
        r.eof_at = at;
        r.status = LabelReadError(
            q, at,
            Status(Code::kUnexpectedEof, q.file->path() + ": unexpected end of file at offset " +
                                             std::to_string(at) + ": wanted " +
                                             std::to_string(q.dst.size()) + " bytes at offset " +
                                             std::to_string(q.offset)));
      }
      return true;
    }
    counters_.bytes_read.fetch_add(n, std::memory_order_relaxed);
    if (p.direct) counters_.direct_bytes.fetch_add(n, std::memory_order_relaxed);
    if (r.piecewise) {
      Status s = (*q.landed)(PieceOf(q, p.offset - q.offset, n));
      if (!s.ok()) return fail(std::move(s));
    }
    p.offset += n;
    p.dst += n;
    p.remaining -= n;
    p.retry.Progress();
    if (p.remaining == 0) return true;
    Submit(ring, p);  // short read: the rest
    return false;
  }

  void WorkerLoop(Ring& ring_owner) {
    io_uring* ring = ring_owner.get();
    std::vector<std::unique_ptr<RequestState>> free_states;
    std::vector<std::pair<Piece*, int>> completions;
    // Requests read whole (O_DIRECT) whose landed hook has yet to run: it runs once the next
    // reads are in the kernel, so the disk is not left short of requests while this core hashes.
    std::vector<RequestState*> unchecked;
    unsigned in_flight = 0;  // pieces in the kernel
    auto finish = [&](RequestState* r) {
      queue_.Finish(r->claim, std::move(r->status));
      free_states.emplace_back(r);
    };
    // Handles every completion in the ring; returns how many there were.
    auto reap = [&] {
      DrainRingCompletions(ring, completions);
      for (const auto& [piece, res] : completions) {
        if (!Complete(ring, *piece, res)) continue;  // resubmitted: still in flight
        --in_flight;
        RequestState* r = piece->request;
        if (--r->pending == 0) {
          const ReadRequest& q = *r->claim.request;
          if (r->status.ok() && q.landed != nullptr && !r->piecewise) {
            unchecked.push_back(r);
          } else {
            finish(r);
          }
        }
      }
      return completions.size();
    };
    // Piecewise reads of cached pages complete inside the submitting call: submitting them one
    // round at a time and reaping at once hands each piece to the hook while it is still in this
    // core's cache, instead of after a whole queue of copies. Pieces that go to the disk do not
    // complete here and stay in flight, so the queue depth still serves cold reads.
    auto pump = [&] {
      while (io_uring_sq_ready(ring) > 0) {
        io_uring_submit(ring);
        if (reap() == 0) break;
      }
    };
    for (;;) {
      // Admit requests while a whole request (up to 3 pieces) fits the ring.
      while (in_flight + 3 <= queue_depth_) {
        auto claim = queue_.Take(/*wait=*/in_flight == 0 && unchecked.empty());
        if (!claim) break;
        counters_.requests.fetch_add(1, std::memory_order_relaxed);
        const ReadRequest& q = *claim->request;
        if (q.dst.empty() || q.file == nullptr || q.file->native_handle() < 0) {
          // Nothing to read, or a file without a descriptor (test doubles): read it here.
          counters_.requests.fetch_sub(1, std::memory_order_relaxed);
          queue_.Finish(*claim, ReadRequestSync(q, counters_));
          continue;
        }
        std::unique_ptr<RequestState> state;
        if (free_states.empty()) {
          state = std::make_unique<RequestState>();
        } else {
          state = std::move(free_states.back());
          free_states.pop_back();
        }
        state->claim = *claim;
        Prepare(*state);
        for (int i = 0; i < state->pending; ++i) Submit(ring, state->pieces[i]);
        in_flight += static_cast<unsigned>(state->pending);
        const bool piecewise = state->piecewise;
        state.release();  // owned by its pieces' user_data until the last completes
        if (piecewise) pump();
      }
      if (!unchecked.empty()) {
        io_uring_submit(ring);  // the reads just admitted go to the disk before the hook runs
        for (RequestState* r : unchecked) {
          r->status = (*r->claim.request->landed)(*r->claim.request);
          finish(r);
        }
        unchecked.clear();
        continue;
      }
      if (in_flight == 0) return;  // Take(wait) returned nullopt: stopped
      io_uring_submit_and_wait(ring, 1);
      reap();
      pump();  // piecewise pieces resubmitted by reap()
    }
  }

  const unsigned queue_depth_;
  const std::function<int(int)> filter_;
  JobQueue queue_;
  std::vector<std::thread> workers_;
  EngineCounters counters_;
};

Result<std::unique_ptr<ReadEngine>> MakeEngine(unsigned threads, unsigned queue_depth,
                                               std::function<int(int)> filter) {
  if (queue_depth == 0) return Status(Code::kInvalidArgument, "io_uring: queue_depth must be > 0");
  // A kernel whose io_uring lacks IORING_OP_READ would fail every read: refuse it here.
  if (Status available = IoUringAvailable(); !available.ok()) return available;
  if (threads == 0) threads = OnlineCpus();
  auto engine = std::make_unique<UringEngine>(queue_depth, std::move(filter));
  const Status status = engine->Start(threads);
  if (!status.ok()) return status;
  return std::unique_ptr<ReadEngine>(std::move(engine));
}

}  // namespace

Result<std::unique_ptr<ReadEngine>> MakeIoUringEngine(unsigned threads, unsigned queue_depth) {
  return MakeEngine(threads, queue_depth, nullptr);
}

Result<std::unique_ptr<ReadEngine>> MakeIoUringEngineForTesting(
    unsigned threads, unsigned queue_depth, std::function<int(int res)> filter) {
  return MakeEngine(threads, queue_depth, std::move(filter));
}

Status IoUringAvailable() {
  // The answer is kept, unless the ring failed for want of a resource this process may have
  // again later (descriptors, memory): then the next call asks again.
  static std::mutex mu;
  static std::optional<Status> kept;
  std::lock_guard<std::mutex> lock(mu);
  if (kept) return *kept;
  int err = 0;
  auto ring = Ring::Create(2, &err);
  if (!ring.ok()) {
    if (err != EMFILE && err != ENFILE && err != ENOMEM) kept = ring.status();
    return ring.status();
  }
  // Setting up a ring is not enough: IORING_OP_READ came with Linux 5.6 (5.1-5.5 have rings and
  // only the vectored IORING_OP_READV), and so did the probe that lists the operations.
  IoUringOps ops;
  if (io_uring_probe* probe = io_uring_get_probe_ring((*ring)->get()); probe != nullptr) {
    ops.listed = true;
    ops.read = io_uring_opcode_supported(probe, IORING_OP_READ) != 0;
    io_uring_free_probe(probe);
  }
  kept = CheckIoUringOps(ops);
  return *kept;
}

#else  // !TENSORFERRY_HAVE_LIBURING

Result<std::unique_ptr<ReadEngine>> MakeIoUringEngine(unsigned, unsigned) {
  return IoUringAvailable();
}

Result<std::unique_ptr<ReadEngine>> MakeIoUringEngineForTesting(unsigned, unsigned,
                                                                std::function<int(int res)>) {
  return IoUringAvailable();
}

Status IoUringAvailable() {
  return Status(Code::kUnsupported, "io_uring: this build has no liburing");
}

#endif

Status CheckIoUringOps(const IoUringOps& ops) {
  if (!ops.listed) {
    return Status(Code::kUnsupported,
                  "io_uring: the kernel cannot list its operations (IORING_REGISTER_PROBE, Linux "
                  "5.6+), so IORING_OP_READ (Linux 5.6+), which every read needs, is taken as "
                  "missing");
  }
  if (!ops.read) {
    return Status(Code::kUnsupported,
                  "io_uring: the kernel does not support IORING_OP_READ (Linux 5.6+), which every "
                  "read needs");
  }
  return Status::Ok();
}

}  // namespace tensorferry::io

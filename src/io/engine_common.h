// Internal: what the read engines share: the job queue that hands requests of concurrent Execute
// calls to workers round-robin, the statistics counters, and the synchronous read of one request
// (buffered, or head/middle/tail with O_DIRECT).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "io/read_engine.h"

namespace tensorferry::io {

struct EngineCounters {
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> direct_bytes{0};
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> read_calls{0};
  SourceCounters source;  // requests the files' sources made for this engine's reads

  EngineStats Snapshot() const;
};

// A queue of jobs (one per Execute call). A job lives on the stack of its Execute call.
//
// Workers Take() one request at a time: the job at the front hands out its next request and moves
// to the back, so concurrent Execute calls share the workers instead of the first one starving the
// others. Every taken request must be Finish()ed. A job leaves the queue when its last request has
// been handed out or one of its requests failed; Run returns once its job has left the queue and
// no worker still runs one of its requests (the destinations belong to the caller).
class JobQueue {
 public:
  struct Job;
  struct Claim {
    Job* job = nullptr;
    const ReadRequest* request = nullptr;
  };

  // Enqueues `requests`, wakes workers, and blocks until all are finished; the first error.
  Status Run(std::span<const ReadRequest> requests, size_t workers);

  // The next request of any job. With `wait`, blocks until there is one or Stop() was called
  // (then nullopt); without, returns nullopt at once when there is none.
  std::optional<Claim> Take(bool wait);

  // Reports the outcome of a taken request.
  void Finish(const Claim& claim, Status status);

  // Makes every waiting and future Take(true) return nullopt once the queue is empty.
  void Stop();

  struct Job {
    explicit Job(std::span<const ReadRequest> r) : requests(r) {}
    std::span<const ReadRequest> requests;
    size_t next = 0;      // index of the next request to hand out
    size_t running = 0;   // requests taken and not finished
    bool queued = false;  // still in the queue (requests left to hand out, no failure yet)
    Status error;         // the first failure
    std::condition_variable done_cv;
  };

 private:
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<Job*> queue_;
  bool stop_ = false;
};

// Reads all of dst from `file` at `offset` through RandomAccessFile::Read, continuing short reads.
// `request_offset`/`request_size` describe the whole request for the EOF message.
// On failure, *failed_at (when given) is the file offset the failed read started at.
Status ReadBuffered(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst,
                    uint64_t request_offset, uint64_t request_size, EngineCounters& counters,
                    uint64_t* failed_at = nullptr);

// Reads all of dst at `offset` with pread on the O_DIRECT descriptor `fd` (offset, dst.data() and
// dst.size() must be multiples of kDirectAlignment). Returns kUnsupported for EINVAL (the caller
// falls back to buffered reads).
Status ReadDirect(int fd, const std::string& path, uint64_t offset, std::span<std::byte> dst,
                  EngineCounters& counters, uint64_t* failed_at = nullptr);

// One whole request, synchronously: buffered, or split for O_DIRECT (SplitForDirect) with a
// buffered fallback of the middle when the file system refuses the direct read.
// Errors are labelled with what the request held from the failed read on (LabelReadError).
Status ReadRequestSync(const ReadRequest& request, EngineCounters& counters);

std::string ErrnoText(int err);

// open(2) of `path` for reading (O_RDONLY | O_CLOEXEC) without waiting for a FIFO's writer
// (O_NONBLOCK: such files are refused by the callers), but waiting for a write lease on a regular
// file to be broken (Samba's oplocks, NFS delegations: an O_NONBLOCK open fails with EAGAIN
// there). Retries EINTR. The descriptor, or -1 with errno set.
int OpenForReading(const std::string& path);

// How a read answers EINTR and EAGAIN (a FUSE daemon may answer EAGAIN; an io_uring read may
// complete with -EINTR or -EAGAIN): it is issued again, but not forever. One object per read;
// both engines use it, so a file system that keeps answering EAGAIN fails a load the same way
// with either (kIoError naming file, offset, length and errno) instead of hanging it.
class TransientRetry {
 public:
  // EAGAINs in a row before the read fails; Again sleeps AgainBackoff(n) before the n-th retry
  // (n x 100 us, at most 10 ms: about 0.5 s over all of them).
  static constexpr unsigned kMaxAgain = 100;
  // EINTRs in a row before the read fails (retried at once: a signal, not a busy server).
  static constexpr unsigned kMaxIntr = 1000;

  // True when a read that failed with `err` should be issued again: EINTR or EAGAIN
  // with retries left. For EAGAIN it first sleeps the backoff. False for any other errno and
  // once the retries are spent: the read then fails with `err`.
  bool Again(int err);
  // The read made progress: the counts start over.
  void Progress() noexcept { again_ = intr_ = 0; }

  static std::chrono::microseconds AgainBackoff(unsigned retry) noexcept;

 private:
  unsigned again_ = 0;
  unsigned intr_ = 0;
};

// Online CPUs (at least 1): the default worker count of every engine.
unsigned OnlineCpus();

}  // namespace tensorferry::io

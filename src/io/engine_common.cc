// What the read engines share (engine_common.h).
#include "io/engine_common.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "util/macros.h"

namespace tensorferry::io {

int OpenForReading(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    // A lease held by another: a read-only open of a FIFO never says EAGAIN, so this is a regular
    // file; opened blocking, it waits for the lease's break (at most lease-break-time).
    do {
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
  }
  return fd;
}

std::string ErrnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

bool TransientRetry::Again(int err) {
  if (err == EINTR) {
    if (intr_ >= kMaxIntr) return false;
    ++intr_;
    return true;
  }
  if (err != EAGAIN) return false;  // EWOULDBLOCK is EAGAIN on Linux
  if (again_ >= kMaxAgain) return false;
  std::this_thread::sleep_for(AgainBackoff(++again_));
  return true;
}

std::chrono::microseconds TransientRetry::AgainBackoff(unsigned retry) noexcept {
  return std::chrono::microseconds(std::min<uint64_t>(uint64_t{100} * retry, 10'000));
}

unsigned OnlineCpus() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<unsigned>(n) : 1;
}

EngineStats EngineCounters::Snapshot() const {
  EngineStats s;
  s.bytes_read = bytes_read.load(std::memory_order_relaxed);
  s.direct_bytes = direct_bytes.load(std::memory_order_relaxed);
  s.requests = requests.load(std::memory_order_relaxed);
  s.read_calls = read_calls.load(std::memory_order_relaxed);
  s.source = source.Snapshot();
  return s;
}

// --- JobQueue ----------------------------------------------------------------------------------

Status JobQueue::Run(std::span<const ReadRequest> requests, size_t workers) {
  if (requests.empty()) return Status::Ok();
  Job job(requests);
  std::unique_lock<std::mutex> lock(mu_);
  queue_.push_back(&job);
  job.queued = true;
  // Wake as many workers as there are requests to hand out; notify_all when that is everyone.
  if (requests.size() >= workers) {
    work_cv_.notify_all();
  } else {
    for (size_t i = 0; i < requests.size(); ++i) work_cv_.notify_one();
  }
  job.done_cv.wait(lock, [&job] { return !job.queued && job.running == 0; });
  return job.error;
}

std::optional<JobQueue::Claim> JobQueue::Take(bool wait) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (wait) work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    // Run blocks until its job is finished, so the queue is empty whenever the engine is
    // destroyed by a well-behaved owner; stop_ alone ends the worker.
    if (queue_.empty()) return std::nullopt;
    Job* job = queue_.front();
    queue_.pop_front();
    const ReadRequest* request = &job->requests[job->next++];
    if (request->cancel != nullptr && request->cancel->load(std::memory_order_relaxed)) {
      // The caller cancelled: no further request of this job starts; Run returns kCancelled once
      // those in flight are done.
      if (job->error.ok()) job->error = Status(Code::kCancelled, "the load was cancelled");
      job->queued = false;
      if (job->running == 0) job->done_cv.notify_all();
      continue;
    }
    ++job->running;
    if (job->next < job->requests.size()) {
      queue_.push_back(job);  // round-robin between concurrent jobs
    } else {
      job->queued = false;
    }
    return Claim{job, request};
  }
}

void JobQueue::Finish(const Claim& claim, Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  Job* job = claim.job;
  --job->running;
  if (!status.ok() && job->error.ok()) {
    job->error = std::move(status);
    if (job->queued) {
      // Stop handing out this job's remaining requests.
      queue_.erase(std::find(queue_.begin(), queue_.end(), job));
      job->queued = false;
    }
  }
  // Notified under the lock: the waiter cannot return (and destroy the Job) before we let go.
  if (!job->queued && job->running == 0) job->done_cv.notify_all();
}

namespace {

// WithReadHeld's rule: a failure to label (not one that says what it is about already).
bool Labelled(const Status& status) {
  return !status.ok() && status.code() != Code::kCancelled &&
         status.code() != Code::kChecksumMismatch;
}

}  // namespace

Status LabelReadError(const ReadRequest& request, uint64_t failed_at, Status status) {
  if (request.about == nullptr || !Labelled(status)) return status;  // before `about` is asked
  const uint64_t end = request.offset + request.dst.size();
  failed_at = std::clamp(failed_at, request.offset, end);
  ReadRequest rest = request;
  rest.offset = failed_at;
  rest.dst = request.dst.subspan(static_cast<size_t>(failed_at - request.offset));
  if (rest.dst.empty()) rest = request;  // failed after its last byte (its hook): all of it
  return WithReadHeld(std::move(status), (*request.about)(rest));
}

Status WithReadHeld(Status status, std::string_view about) {
  if (about.empty() || !Labelled(status)) return status;
  std::string message = status.message();
  message += "; the read held ";
  message += about;
  return Status(status.code(), std::move(message));
}

void JobQueue::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
}

// --- reads -------------------------------------------------------------------------------------

Status ReadBuffered(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst,
                    uint64_t request_offset, uint64_t request_size, EngineCounters& counters,
                    uint64_t* failed_at) {
  const size_t wanted = dst.size();
  size_t done = 0;
  while (done < wanted) {
    if (failed_at != nullptr) *failed_at = offset + done;
    auto n = file.Read(offset + done, dst.subspan(done));
    counters.read_calls.fetch_add(1, std::memory_order_relaxed);
    if (!n.ok()) return n.status();
    if (*n == 0) {
      return Status(Code::kUnexpectedEof, file.path() + ": unexpected end of file at offset " +
                                              std::to_string(offset + done) + ": wanted " +
                                              std::to_string(request_size) + " bytes at offset " +
                                              std::to_string(request_offset) + ", got " +
                                              std::to_string(offset + done - request_offset));
    }
    if (*n > wanted - done) {
      // A Read that claims more than it was given would have written past the destination.
      return Status(Code::kInternal, file.path() + ": read at offset " +
                                         std::to_string(offset + done) + " returned " +
                                         std::to_string(*n) + " bytes for a " +
                                         std::to_string(wanted - done) + "-byte buffer");
    }
    done += *n;
    counters.bytes_read.fetch_add(*n, std::memory_order_relaxed);
  }
  return Status::Ok();
}

Status ReadDirect(int fd, const std::string& path, uint64_t offset, std::span<std::byte> dst,
                  EngineCounters& counters, uint64_t* failed_at) {
  size_t done = 0;
  TransientRetry retry;
  while (done < dst.size()) {
    if (failed_at != nullptr) *failed_at = offset + done;
    const ssize_t n =
        ::pread(fd, dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
    counters.read_calls.fetch_add(1, std::memory_order_relaxed);
    if (n < 0) {
      const int err = errno;
      if (retry.Again(err)) continue;
      if (err == EINVAL && done == 0) {
        return Status(Code::kUnsupported, path + ": O_DIRECT read refused (EINVAL)");
      }
      return Status(Code::kIoError, path + ": direct read of " + std::to_string(dst.size() - done) +
                                        " bytes at offset " + std::to_string(offset + done) +
                                        " failed: " + ErrnoText(err));
    }
    if (n == 0) {
      return Status(Code::kUnexpectedEof, path + ": unexpected end of file at offset " +
                                              std::to_string(offset + done) + " (direct read of " +
                                              std::to_string(dst.size()) + " bytes at offset " +
                                              std::to_string(offset) + ")");
    }
    done += static_cast<size_t>(n);
    retry.Progress();
    counters.bytes_read.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    counters.direct_bytes.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    // A short direct read mid-file ends on a block boundary only at EOF; continuing with an
    // unaligned remainder would be EINVAL, so a non-block-multiple short read means EOF next.
    if (done < dst.size() && done % kDirectAlignment != 0) {
      if (failed_at != nullptr) *failed_at = offset + done;
      return Status(Code::kUnexpectedEof, path + ": unexpected end of file at offset " +
                                              std::to_string(offset + done) + " (direct read of " +
                                              std::to_string(dst.size()) + " bytes at offset " +
                                              std::to_string(offset) + ")");
    }
  }
  return Status::Ok();
}

DirectSplit SplitForDirect(const ReadRequest& request) noexcept {
  DirectSplit split;
  if (request.direct_fd < 0 || request.dst.empty()) return split;
  const auto addr = reinterpret_cast<uintptr_t>(request.dst.data());
  if ((addr - request.offset) % kDirectAlignment != 0) return split;  // memory not congruent
  const uint64_t begin =
      (request.offset + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
  const uint64_t end = (request.offset + request.dst.size()) / kDirectAlignment * kDirectAlignment;
  if (end <= begin) return split;
  split.direct = true;
  split.head = begin - request.offset;
  split.middle = end - begin;
  return split;
}

namespace {

// Reads `part`, a piece of `request` (its whole, or one piece for the landed hook), buffered or
// split for O_DIRECT; EOF messages name the whole request.
// Sets *failed_at to the file offset of the read that failed (on error).
Status ReadPart(const ReadRequest& request, const ReadRequest& part, EngineCounters& counters,
                uint64_t* failed_at) {
  const RandomAccessFile& file = *request.file;
  const uint64_t size = request.dst.size();
  const DirectSplit split = SplitForDirect(part);
  if (!split.direct) {
    return ReadBuffered(file, part.offset, part.dst, request.offset, size, counters, failed_at);
  }
  if (split.head > 0) {
    Status s = ReadBuffered(file, part.offset, part.dst.first(split.head), request.offset, size,
                            counters, failed_at);
    if (!s.ok()) return s;
  }
  const auto middle = part.dst.subspan(split.head, split.middle);
  Status s = ReadDirect(part.direct_fd, file.path(), part.offset + split.head, middle, counters,
                        failed_at);
  if (s.code() == Code::kUnsupported) {
    s = ReadBuffered(file, part.offset + split.head, middle, request.offset, size, counters,
                     failed_at);
  }
  if (!s.ok()) return s;
  const uint64_t tail_at = split.head + split.middle;
  if (tail_at < part.dst.size()) {
    return ReadBuffered(file, part.offset + tail_at, part.dst.subspan(tail_at), request.offset,
                        size, counters, failed_at);
  }
  return Status::Ok();
}

// ReadRequestSync without the label.
Status ReadWhole(const ReadRequest& request, EngineCounters& counters, uint64_t* failed_at) {
  if (request.landed == nullptr) return ReadPart(request, request, counters, failed_at);
  if (SplitForDirect(request).direct) {
    // O_DIRECT reads stay whole (the device's transfer size matters more than the cache; the
    // bytes come from the device, not from the CPU's copy): the hook runs once, at the end.
    TF_RETURN_IF_ERROR(ReadPart(request, request, counters, failed_at));
    return (*request.landed)(request);
  }
  if (request.file->native_handle() < 0) {
    // Files without a descriptor (an object store's: each Read is ranged GETs of its part size,
    // which 512 KiB pieces would multiply) stay whole; a file that writes its bytes as they
    // arrive hands them over on the way (LandingScope), the rest goes at the end.
    LandingScope landing(request);
    TF_RETURN_IF_ERROR(ReadPart(request, request, counters, failed_at));
    return landing.Finish();
  }
  // Buffered: piece by piece, each handed to the hook right after the copy that brought it in.
  for (uint64_t at = 0; at < request.dst.size(); at += kLandedPieceBytes) {
    const ReadRequest piece =
        PieceOf(request, at, std::min<uint64_t>(kLandedPieceBytes, request.dst.size() - at));
    TF_RETURN_IF_ERROR(ReadPart(request, piece, counters, failed_at));
    TF_RETURN_IF_ERROR((*request.landed)(piece));
  }
  return Status::Ok();
}

}  // namespace

Status ReadRequestSync(const ReadRequest& request, EngineCounters& counters) {
  counters.requests.fetch_add(1, std::memory_order_relaxed);
  // An object store's requests for this read count as this engine's (its loader's).
  const SourceStatsScope scope(&counters.source);
  if (request.dst.empty()) return Status::Ok();
  if (request.file == nullptr) {
    return Status(Code::kInvalidArgument,
                  "read request at offset " + std::to_string(request.offset) + " has no file");
  }
  uint64_t failed_at = request.offset;
  const CancelScope cancel(request.cancel);  // an object store's GETs stop when it is set
  Status status = ReadWhole(request, counters, &failed_at);
  if (status.ok()) return status;
  return LabelReadError(request, failed_at, std::move(status));
}

// --- CancelScope -------------------------------------------------------------------------------

namespace {
thread_local const std::atomic<bool>* g_cancel_scope = nullptr;
}  // namespace

CancelScope::CancelScope(const std::atomic<bool>* cancel) noexcept
    : cancel_(cancel), previous_(g_cancel_scope) {
  g_cancel_scope = cancel_;
}

CancelScope::~CancelScope() {
  g_cancel_scope = previous_;
}

bool CancelScope::Requested() noexcept {
  const std::atomic<bool>* cancel = g_cancel_scope;
  return cancel != nullptr && cancel->load(std::memory_order_relaxed);
}

// --- LandingScope ------------------------------------------------------------------------------

namespace {
thread_local LandingScope* g_landing_scope = nullptr;
}  // namespace

LandingScope::LandingScope(const ReadRequest& request) noexcept
    : request_(request), reported_(request.dst.data()), previous_(g_landing_scope) {
  g_landing_scope = this;
}

LandingScope::~LandingScope() {
  g_landing_scope = previous_;
}

void LandingScope::Landed(const std::byte* end) noexcept {
  LandingScope* scope = g_landing_scope;
  if (scope == nullptr || !scope->status_.ok()) return;
  const std::byte* last = scope->request_.dst.data() + scope->request_.dst.size();
  if (end <= scope->reported_ || end > last) return;
  if (static_cast<uint64_t>(end - scope->reported_) < kLandedPieceBytes) return;
  scope->HandOver(end);
}

void LandingScope::HandOver(const std::byte* end) {
  const uint64_t at = static_cast<uint64_t>(reported_ - request_.dst.data());
  status_ = (*request_.landed)(PieceOf(request_, at, static_cast<uint64_t>(end - reported_)));
  reported_ = end;
}

Status LandingScope::Finish() {
  const std::byte* last = request_.dst.data() + request_.dst.size();
  if (status_.ok() && reported_ < last) HandOver(last);
  return status_;
}

// --- DirectFile --------------------------------------------------------------------------------

Result<std::unique_ptr<DirectFile>> DirectFile::Open(const RandomAccessFile& file) {
  const int buffered = file.native_handle();
  if (buffered < 0) {
    return Status(Code::kUnsupported, file.path() + ": no file descriptor for O_DIRECT");
  }
  // The open file itself, through its descriptor's /proc link (not its path, which may name
  // another file by now, or none); its path where /proc is not mounted.
  const std::string self = "/proc/self/fd/" + std::to_string(buffered);
  int fd;
  do {
    fd = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && errno == ENOENT) {
    do {
      fd = ::open(file.path().c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    } while (fd < 0 && errno == EINTR);
  }
  if (fd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      return Status(Code::kUnsupported,
                    file.path() + ": the file system does not support O_DIRECT");
    }
    if (err == EMFILE || err == ENFILE || err == ENOMEM || err == EACCES || err == EPERM) {
      return std::unique_ptr<DirectFile>();  // not now: the buffered descriptor reads the file
    }
    return Status(Code::kIoError, file.path() + ": cannot open with O_DIRECT: " + ErrnoText(err));
  }
  auto direct = std::unique_ptr<DirectFile>(new DirectFile(fd));
  struct stat a, b;
  if (::fstat(buffered, &a) != 0 || ::fstat(fd, &b) != 0) {
    const int err = errno;
    return Status(Code::kIoError, file.path() + ": fstat failed: " + ErrnoText(err));
  }
  if (a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
    return Status(Code::kIoError,
                  file.path() + ": file was replaced since it was opened (another inode now)");
  }
  return direct;
}

DirectFile::~DirectFile() {
  ::close(fd_);
}

}  // namespace tensorferry::io

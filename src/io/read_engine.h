// Internal: read engines execute byte-range reads into memory. They know nothing about tensors.
//
// An engine takes a list of requests (a file, an offset, a destination span) and completes all of
// them or fails. Requests are independent: they run concurrently on the engine's workers in the
// order given (the plan interleaves files so workers spread across them). Short reads are
// continued; a read that hits the end of the file early is kUnexpectedEof naming the file and the
// offset; an OS error is kIoError naming file, offset and errno text. After the first failure the
// engine stops starting new requests, waits for the running ones, and returns that first error.
//
// Direct I/O: a request may carry `direct_fd`, an O_DIRECT descriptor of the same file (see
// DirectFile). The engine then reads the block-aligned middle of the request through it and the
// unaligned head and tail (less than kDirectAlignment bytes each) through the buffered file, so
// callers may ask for any offset and length. When the destination is not congruent to the file
// offset modulo kDirectAlignment (O_DIRECT needs the memory aligned too), or when the file system
// refuses an O_DIRECT read with EINVAL, the request is read buffered instead.
//
// Thread-safety: Execute may be called from several threads at once; requests of concurrent calls
// share the workers. The files must outlive the call.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "tensorferry/env.h"
#include "tensorferry/source.h"
#include "tensorferry/status.h"
#include "util/unique_fd.h"

namespace tensorferry::io {

// Offset, length and memory alignment of every O_DIRECT transfer (a multiple of any logical block
// size in use: 512 and 4096).
inline constexpr uint64_t kDirectAlignment = 4096;

struct ReadRequest {
  const RandomAccessFile* file = nullptr;
  uint64_t offset = 0;
  std::span<std::byte> dst;
  int direct_fd = -1;  // >= 0: an O_DIRECT descriptor of `file` for the aligned middle
  // When set, requests not yet started when it becomes true are not started, and Execute returns
  // kCancelled once those in flight are done.
  const std::atomic<bool>* cancel = nullptr;
  // When set, called on the worker that read them for the request's bytes as they land (before
  // Execute can return), with a request naming the landed piece's offset and bytes: a buffered
  // request of a file with a descriptor is read in pieces of at most kLandedPieceBytes, each
  // handed over as it lands, in order; one split for O_DIRECT (SplitForDirect) is handed over
  // whole once all of it landed; one of a file without a descriptor (object storage: its reads
  // are ranged GETs of their own part size, which pieces would multiply) in pieces of at least
  // kLandedPieceBytes as the file writes them (LandingScope), else whole at the end.
  // An error it returns is the request's. Integrity checks hash the bytes here, while they are
  // still in the worker's cache. Borrowed; must be thread-safe.
  const std::function<Status(const ReadRequest&)>* landed = nullptr;
  // When set, names what the request's bytes hold (the loader: the tensors, TensorsIn in
  // sink/sink.h) for its error: a request that fails (but for kCancelled and kChecksumMismatch,
  // which say what they are about) fails with "<error>; the read held <about(rest)>", `rest` the
  // request from the file offset of the read that failed to its end (LabelReadError), so the
  // first thing named holds the failing byte. Called only on failure. Borrowed; thread-safe.
  const std::function<std::string(const ReadRequest&)>* about = nullptr;
};

// `status` of `request`, whose read starting at file offset `failed_at` failed, labelled by
// request.about as that comment says (failed_at clamped into the request); as it is when OK,
// kCancelled, kChecksumMismatch or without `about`. Engines apply it to every request's error.
Status LabelReadError(const ReadRequest& request, uint64_t failed_at, Status status);
// `status` with "; the read held <about>" appended to its message: the one form of those labels.
// As it is when OK, kCancelled or kChecksumMismatch (which say what they are about), or when
// `about` is empty.
Status WithReadHeld(Status status, std::string_view about);

// The pieces of a request with a `landed` hook: small enough to be in the core's cache (L2) when
// the hook hashes them, large enough that the extra system calls cost little (docs/benchmarks.md,
// "Integrity checksums").
inline constexpr uint64_t kLandedPieceBytes = uint64_t{512} << 10;

// The bytes [at, at + length) of `request` as the landed hook gets them: their file offset and
// destination, without the hook.
inline ReadRequest PieceOf(const ReadRequest& request, uint64_t at, uint64_t length) {
  ReadRequest piece = request;
  piece.offset = request.offset + at;
  piece.dst = request.dst.subspan(at, length);
  piece.landed = nullptr;
  piece.about = nullptr;
  return piece;
}

// A read whose bytes are written progressively by the file itself (an object store's GET writes
// its body as it arrives): while a scope lives on a thread, whatever writes a read's destination
// on that thread calls Landed(end) with the end of the bytes written so far, and the scope hands
// them to the request's landed hook in order, at least kLandedPieceBytes at a time, while they
// are still in the core's cache. Internal; the innermost scope on a thread gets the reports.
// The cancel flag of the request the calling thread is reading (ReadRequestSync sets it around
// each read), for files whose reads block in code of their own and can stop early: an object
// store's ranged GETs (abandoned, and their retries' waits cut short, once the flag is set).
class CancelScope {
 public:
  explicit CancelScope(const std::atomic<bool>* cancel) noexcept;
  ~CancelScope();
  CancelScope(const CancelScope&) = delete;
  CancelScope& operator=(const CancelScope&) = delete;
  // Whether the innermost scope's flag on this thread is set (false without one).
  static bool Requested() noexcept;

 private:
  const std::atomic<bool>* cancel_;
  const std::atomic<bool>* previous_;
};

class LandingScope {
 public:
  explicit LandingScope(const ReadRequest& request) noexcept;  // request.landed must be set
  ~LandingScope();
  LandingScope(const LandingScope&) = delete;
  LandingScope& operator=(const LandingScope&) = delete;
  // No-op without a scope on this thread, or for `end` outside its request's destination.
  static void Landed(const std::byte* end) noexcept;
  // After the read returned: hands over what is left; the hook's first error, if any.
  Status Finish();

 private:
  void HandOver(const std::byte* end);
  const ReadRequest& request_;
  const std::byte* reported_;  // the bytes before this were handed over
  Status status_;
  LandingScope* previous_;
};

struct EngineStats {
  uint64_t bytes_read = 0;    // bytes delivered into destinations
  uint64_t direct_bytes = 0;  // of which read with O_DIRECT
  uint64_t requests = 0;
  uint64_t read_calls = 0;  // system calls (or Env::Read calls) made, short reads included
  SourceStats source;       // requests of the files' sources for these reads (object storage)
};

class ReadEngine {
 public:
  virtual ~ReadEngine() = default;
  // Blocks until every request is done or the first error. Errors: see the file comment.
  virtual Status Execute(std::span<const ReadRequest> requests) = 0;
  // Totals since construction.
  virtual EngineStats stats() const = 0;
  virtual std::string_view name() const = 0;
};

// A pool of `threads` workers (0: the number of online CPUs, at least kPreadMinThreads: reads
// block, one in flight per worker, options.h) each calling RandomAccessFile::Read
// (pread for the default Env; preadv2 on the O_DIRECT descriptor for direct pieces). Workers are
// started once and reused across Execute calls.
Result<std::unique_ptr<ReadEngine>> MakePreadEngine(unsigned threads);

// `threads` workers (0: online CPUs), each owning an io_uring of `queue_depth` entries and keeping
// up to queue_depth reads in flight. Requests whose file has no native_handle() are read with
// RandomAccessFile::Read on the worker. Errors: kUnsupported when this build has no liburing, the
// kernel refuses io_uring or lacks IORING_OP_READ (IoUringAvailable), or a ring cannot be set up
// (the message says which, e.g. io_uring_queue_init's errno: EMFILE with one ring per worker).
Result<std::unique_ptr<ReadEngine>> MakeIoUringEngine(unsigned threads, unsigned queue_depth);

// Testing: the io_uring engine with `filter` applied to every completion's result before the
// engine handles it (fault injection: -EAGAIN, -EINTR, -EIO as a file system would answer; the
// read itself happened). Errors as MakeIoUringEngine.
Result<std::unique_ptr<ReadEngine>> MakeIoUringEngineForTesting(unsigned threads,
                                                                unsigned queue_depth,
                                                                std::function<int(int res)> filter);

// OK when an io_uring can be created here and its kernel has IORING_OP_READ (Linux 5.6+: older
// kernels have rings but no plain read, and would fail every read with EINVAL); otherwise the
// reason (kUnsupported). The answer is kept for the process, except a failure for want of
// descriptors or memory (EMFILE, ENFILE, ENOMEM), asked again next time. MakeIoUringEngine checks
// it first.
Status IoUringAvailable();

// What IoUringAvailable asks of the kernel beyond a ring, and its verdict on the answers: OK, or
// kUnsupported saying what is missing.
struct IoUringOps {
  bool listed = false;  // the kernel listed its operations (IORING_REGISTER_PROBE, Linux 5.6+)
  bool read = false;    // IORING_OP_READ is among them
};
Status CheckIoUringOps(const IoUringOps& ops);

// An O_DIRECT descriptor for a file already open buffered: the same file, opened again through
// its descriptor's /proc/self/fd link (whatever its path names now; through the path where /proc
// is not mounted, then checked to be the same inode: kIoError naming a file replaced since).
// kUnsupported when the file system refuses O_DIRECT (tmpfs, some FUSE) or the file has no native
// handle. nullptr (no error) when it cannot be had now: descriptors or memory exhausted (EMFILE,
// ENFILE, ENOMEM), the /proc link not permitted (EACCES, EPERM); the file is read buffered then.
// RAII: closes the descriptor.
class DirectFile {
 public:
  static Result<std::unique_ptr<DirectFile>> Open(const RandomAccessFile& file);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;
  int fd() const noexcept { return fd_; }

 private:
  explicit DirectFile(int fd) : fd_(fd) {}
  int fd_;
};

// How a request is cut for direct I/O: [head) buffered, [middle) direct, [tail) buffered, in
// request-relative bytes. `direct` is false when the whole request must be read buffered (no
// descriptor, misaligned destination, or no whole block inside).
struct DirectSplit {
  bool direct = false;
  uint64_t head = 0;    // bytes before the aligned middle
  uint64_t middle = 0;  // aligned bytes read with O_DIRECT
};
DirectSplit SplitForDirect(const ReadRequest& request) noexcept;

// Which pages CachedFraction looks at: every page of a range up to `above_pages` pages; beyond,
// `samples` runs of `pages_per_sample` pages spread evenly over the range (page-cache residency
// comes in runs: readahead, whole-file reads). mincore looks each page up in the page cache: on
// the development VM ~25 ms per GB checked in full (120-130 ns a page), which every load paid for
// its O_DIRECT choice; sampled, 1.4-1.7 ms a file whatever its size, within 3% of the full count
// (docs/benchmarks.md, "Residency checks").
struct ResidencySampling {
  uint64_t above_pages = uint64_t{1} << 16;  // 256 MiB of 4 KiB pages
  uint64_t samples = 256;
  uint64_t pages_per_sample = 32;
  // Bytes of the file mapped at once (whole pages, at least one): a checkpoint of hundreds of
  // gigabytes needs neither that much address space nor a residency byte per page at once.
  uint64_t window_bytes = uint64_t{1} << 30;
};

// Page-cache residency of [offset, offset + length) of the file at `path`, as a fraction in [0, 1],
// measured with mmap + mincore (no data is read), sampled for large ranges (ResidencySampling).
// Errors: kIoError, kNotFound, kInvalidArgument (not a regular file: OpenRegularFile).
Result<double> CachedFraction(const std::string& path, uint64_t offset, uint64_t length);
// The same for an open file descriptor.
Result<double> CachedFraction(int fd, const std::string& path, uint64_t offset, uint64_t length,
                              const ResidencySampling& sampling = {});

// Opens `path` for reading without waiting (O_NONBLOCK: a FIFO would wait for a writer) and
// refuses anything but a regular file. Errors: kNotFound, kIoError, kInvalidArgument ("is a
// directory", "not a regular file"), each naming the path.
Result<UniqueFd> OpenRegularFile(const std::string& path);

// Asks the kernel to drop the clean pages of the open file `fd` from the page cache
// (posix_fadvise POSIX_FADV_DONTNEED), its dirty pages written first (fdatasync); `path` names it
// in the error (kIoError). Pages mapped by a process stay.
Status DropPages(int fd, const std::string& path);

}  // namespace tensorferry::io

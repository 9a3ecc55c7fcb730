// tensorferry/source.h: where the bytes of a checkpoint come from.
//
// A Source opens the files of a checkpoint; a SourceFile is one of them, open, with the identity
// it had when opened. Checkpoint::Open opens each file once through a Source and the checkpoint
// owns it from then on (checkpoint.h): every loader, load and partial read made from that
// checkpoint reads through the same SourceFile, and a file that must be opened again (a
// checkpoint with more files than the open-file bound) must still have that identity.
//
// Identity: (device, inode, size, modification time in ns) for a POSIX file; a source without
// inodes (a test double, an object store) sets what it has (at least the size; an object store
// would put its ETag/generation hash in `inode`) and leaves the rest 0. Two identities are the
// same file when every field is equal.
//
// Reads: a SourceFile is a RandomAccessFile (env.h), so the read engines take it as is. Read() is
// one blocking positional read; ReadMany() submits a whole list at once. The POSIX file
// implements ReadMany by reading each in turn (its engines keep many reads in flight through
// their own threads or io_uring on the descriptor); a source whose reads have a high latency
// (an object store: HTTP range requests) overrides ReadMany to keep them all in flight from one
// caller thread, and reports native_handle() -1 so that the O_DIRECT, mmap and io_uring paths,
// which need a descriptor, fall back to Read/ReadMany.
//
// Change detection (CheckUnchanged): the POSIX file compares fstat of its descriptor (a file
// rewritten in place: size or mtime) and stat of its path (a file renamed over, or removed)
// with the identity taken at open. Two system calls per file, no reads.
//
// Object stores (object_store.h) implement this interface too: their files have no descriptor,
// their identity is (ETag hash, size), CheckUnchanged is free (every read is pinned to the ETag),
// and the Source tells the loader how to read them (hints(): many requests in flight, each of a
// bounded size) and what it did (stats()).
//
// Ownership: Open returns a uniquely owned file (the checkpoint shares it with its loaders).
// Thread-safety: a Source and a SourceFile may be used from several threads at once.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/env.h"
#include "tensorferry/status.h"

namespace tensorferry {

struct FileIdentity {
  uint64_t device = 0;
  uint64_t inode = 0;  // or a version tag of a source without inodes
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};

// What differs between `then` and `now`, in words ("" when they are equal), e.g. "100 bytes
// then, 96 now", "modified: mtime 1700000000.1 then, 1700000005.3 now", "replaced: inode 12 on
// device 2049 then, inode 40 now".
std::string DescribeIdentityChange(const FileIdentity& then, const FileIdentity& now);

// The error every identity check reports: kIoError "<path>: file changed since the checkpoint
// was opened: <DescribeIdentityChange>".
Status FileChangedError(const std::string& path, const FileIdentity& then, const FileIdentity& now);

struct SourceRead {
  uint64_t offset = 0;
  std::span<std::byte> dst;  // filled completely (kUnexpectedEof when the file ends first)
};

class SourceFile : public RandomAccessFile {
 public:
  // The identity taken when the file was opened.
  virtual const FileIdentity& identity() const noexcept = 0;

  // Reads every request completely, possibly concurrently and in any order; returns when all
  // are done or with the first error (kIoError or kUnexpectedEof naming path and offset). The
  // default reads them in turn with ReadFully.
  virtual Status ReadMany(std::span<const SourceRead> reads) const;

  // Ok while the file, and what its path names now, are the file opened (same identity); else
  // FileChangedError. Cheap enough to call before every load (no data is read).
  virtual Status CheckUnchanged() const = 0;

  // Bytes read from this file failed their checksums (a load's per-tensor check). A file served
  // from a copy the source keeps (the object cache's) drops that copy, so that the next open
  // fetches the file again, and returns what it did in words for the error ("its copy in the
  // object cache, DIR/blobs/KEY, is removed: ..."); the default, "", does nothing. Idempotent,
  // thread-safe; never fails (a copy that cannot be removed says so).
  virtual std::string Distrust() const { return ""; }

  // Asks the kernel to drop this file's pages from the page cache (LoadOptions::drop_cache):
  // posix_fadvise(POSIX_FADV_DONTNEED) on native_handle(), dirty pages written first; nothing
  // for a file without a descriptor. A file served from a local copy (the object cache's) drops
  // the copy's pages, at once, or when its download in progress is committed. Errors: kIoError
  // naming the path. Thread-safe.
  virtual Status DropFromPageCache() const;
};

// Counters of a Source's requests since it was made, every reader's together (a Loader reports
// its own through SourceStatsScope). Zero for local files.
struct SourceStats {
  uint64_t requests = 0;  // requests sent (reads, listings), retries included
  uint64_t retries = 0;   // requests that repeated a failed one
  uint64_t bytes = 0;     // bytes received
  // The local cache of object-store files (ObjectStoreOptions::cache_dir); zero without one:
  // files served by a copy in the cache, downloads into it begun and their objects' bytes (the
  // bytes received count in `bytes` too), and files that read the store because the cache
  // failed; the bytes received for copies that the local disk could not take in time (fetched
  // again by the cache after the load: ObjectStoreOptions::cache_write_behind); and all of that
  // in words, with the latest failure ("" without a cache).
  uint64_t cache_hits = 0, cache_fills = 0, cache_fill_bytes = 0, cache_errors = 0;
  uint64_t cache_refetch_bytes = 0;
  std::string cache_summary;
  std::string cache_last_error;  // the latest failure behind cache_errors, in words ("" if none)
};

// Requests counted for one reader of a Source (SourceStatsScope). Thread-safe.
struct SourceCounters {
  std::atomic<uint64_t> requests{0}, retries{0}, bytes{0};
  SourceStats Snapshot() const;
};

// Attribution of a Source's requests to the reader that made them: while a scope lives on a
// thread, every request a Source makes on that thread is added to the scope's counters as well as
// to the Source's own totals (stats()). Several loaders of one checkpoint share its Source, so
// the Source's totals mix their requests; each read engine scopes its reads with counters of its
// own, from which a Loader reports LoadStats::remote_*. Scopes nest (the innermost counts);
// a null `counters` suspends counting on the thread. Not copyable; destroy on the thread that made
// it.
class SourceStatsScope {
 public:
  explicit SourceStatsScope(SourceCounters* counters) noexcept;
  ~SourceStatsScope();
  SourceStatsScope(const SourceStatsScope&) = delete;
  SourceStatsScope& operator=(const SourceStatsScope&) = delete;
  // The counters of the innermost scope on this thread, or null.
  static SourceCounters* Current() noexcept;

 private:
  SourceCounters* previous_;
};

// How reads of a Source's files are best issued; zeros: as the load options say (local files).
struct SourceReadHints {
  unsigned concurrency = 0;  // reads in flight (the loader starts at least this many workers)
  uint64_t read_size = 0;    // the largest single read (the loader's chunk size for these files)
  // How these were chosen, for LoadStats::engine_reason ("8 GETs of 32 MiB in flight: the
  // endpoint 127.0.0.1 is this host"); "" when there is nothing to say.
  std::string reason;
};

class Source {
 public:
  virtual ~Source() = default;

  virtual SourceStats stats() const { return {}; }
  virtual SourceReadHints hints() const { return {}; }

  // The names (full paths) of the files directly inside `dir` whose names end with `suffix`,
  // sorted. The default: kUnsupported (the file system source lists through the Checkpoint's own
  // directory code).
  virtual Result<std::vector<std::string>> List(const std::string& dir, std::string_view suffix);

  // Opens `path`. With `expected`, the file opened must have that identity (FileChangedError
  // otherwise): the path of a checkpoint file reopened later must name the same file.
  // Errors: kNotFound when it does not exist, kIoError otherwise, FileChangedError.
  virtual Result<std::unique_ptr<SourceFile>> Open(const std::string& path,
                                                   const FileIdentity* expected = nullptr) = 0;
};

// The Source reading through `env` (nullptr: Env::Default()); not owned, must outlive the source.
// Identity comes from fstat of the file's native_handle(), and CheckUnchanged also stats its path;
// a file without a descriptor (a MemoryEnv's) has only its size as identity, and CheckUnchanged
// compares only that.
std::unique_ptr<Source> MakeEnvSource(Env* env = nullptr);

}  // namespace tensorferry

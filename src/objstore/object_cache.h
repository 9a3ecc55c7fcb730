// Internal: the local disk cache of object-store files (ObjectStoreOptions::cache_dir).
//
// A server restarted, or a second tensor-parallel rank on the same host, should not pull the same
// gigabytes over the network again. With a cache directory, the object Source keeps a whole copy
// of each file it reads on local disk, keyed by what identifies one version of an object: the URL
// it is fetched from (endpoint, bucket and key), its strong ETag and its size. Opening a file
// whose copy exists reads the copy (a SourceFile over a local descriptor). A new version of an
// object (another ETag or size) is another key: an entry is never updated in place.
//
// Filling, overlapped with the load: opening a file whose copy is missing fetches nothing more
// (header reads are served by the open's first GET, so `inspect` downloads nothing). The first
// read beyond those bytes starts the file's download into the cache, and from then on the
// object's bytes are claimed range by range, each fetched once (ranged GETs pinned to the ETag)
// and written into the copy in progress: a read fetches the bytes it needs that nobody claimed
// straight into its buffer (then hands them to the cache's writer thread through a ring of 32 MiB
// and goes on), reads the bytes already written from the copy (the page cache, just written), and
// waits for bytes another thread is fetching or writing; the cache's filler thread claims the
// rest, `part_size` at a time with `concurrency` in flight, from the end of the object down (so
// that it meets a load reading forward instead of racing it), one file after the other in the
// order their downloads began, once the load is done with the file (closed it, or paused its
// reads through the cache for a second): it neither competes with a load for the network nor
// makes the load's reads wait for ranges it is writing to a slow disk. A load that reads the whole
// file (the common case) thus streams it as it would without a cache, plus one write of each byte
// to local disk; one that reads part of a file (a tensor-parallel rank's slices, a lazy safe_open)
// still leaves a whole copy: the filler fetches the rest. A load never waits for the local disk:
// when the disk is slower than the network, the bytes the ring has no room for are given back
// (stats().given_back) and the filler fetches them again, so the load goes at the network's speed
// and the copy is completed at the disk's, after it (with `fetch_once`, the read waits for the
// disk instead, and each byte is fetched once). Downloads that began finish before the cache
// is destroyed: ~ObjectCache waits (object_source.cc lets a closed checkpoint's caches finish in
// the background).
//
// Layout under the directory:
//   blobs/<key>        one complete object (key: 64 hex digits, SHA-256 of URL, ETag and size)
//   blobs/<key>.json   what it is: {"url", "etag", "size", "created"} (for people and tools)
//   locks/<key>.lock   flock(2) target, held by the one process (or thread) filling the key from
//                      the start of its download to its end (it writes "<pid> <host>" in it);
//                      another that starts reading the same object waits for that download, then
//                      reads its copy. It waits while the download goes on (its file in tmp/
//                      changes: written, or touched while bytes arrive between two writes) and
//                      at most `lock_wait` without a change: a holder stopped
//                      (SIGSTOP, a frozen cgroup, a debugger) or stuck leaves the waiter reading
//                      the store for this load, the failure counted and described ("held by pid
//                      N on host H, whose download made no progress for T s")
//   tmp/               downloads in progress (<key>.<pid>.<n>), renamed into blobs/ when whole
//
// Consistency: a blob appears (rename) only after all of its bytes were written and fsync'd, so a
// crash or a failed download leaves no partial entry (tmp/ files of a dead process are removed by
// the next fill of the same key, and by eviction). A blob whose size is not the object's (damaged
// outside tensorferry) is replaced. The bytes of an entry are not hashed on use: per-tensor
// checksums (docs/integrity.md), checked by loads with verify auto, cover them as they cover local
// files.
//
// Bounded size: with `max_bytes`, a fill first removes the least recently used entries (the
// modification time of a blob, set again at each use) until the new object fits; entries that
// another process is filling or has locked are left alone. An object larger than max_bytes is not
// cached.
//
// Errors: failures of the cache never fail a load. A cache that cannot be used (a directory that
// cannot be created or written, a full disk, max_bytes too small) or a download that fails (the
// store's errors after its retries) leaves the file reading the store for the parts not yet in
// its copy; the failure is counted (stats().errors) and described (stats().last_error). A read
// whose own fetch from the store fails reports the store's error, as without a cache.
//
// Thread-safety: an ObjectCache and its files may be used from several threads; several processes
// may share one directory.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "objstore/http.h"
#include "tensorferry/object_store.h"
#include "tensorferry/source.h"
#include "tensorferry/status.h"
#include "util/unique_fd.h"

namespace tensorferry::objstore {

// Gives up every download in progress or queued in this process's caches (they end as failed
// downloads do: their copies removed) without waiting; downloads begun later are not affected.
// For AbandonObjectCaches (object_store.h).
void AbandonDownloads();

// One version of one object.
struct CachedObject {
  std::string name;         // the URL messages name ("s3://bucket/key")
  std::string request_url;  // the URL it is fetched from (the endpoint included)
  std::string etag;         // strong, never empty
  uint64_t size = 0;
  // ObjectCache::Layout::kHub only: where the copy goes in the hub cache (hub_cache.h): the
  // repository's folder, the commit and path of its snapshot link, the blob's name.
  std::string hub_folder, hub_commit, hub_path, hub_blob;
};

// Reads [offset, offset + dst.size()) of the object into dst completely; `on_body`, when not null,
// is told of the bytes as they land (a download's waiters see it progress between its writes).
using FetchRange =
    std::function<Status(uint64_t offset, std::span<std::byte> dst, const BodyProgress* on_body)>;

struct ObjectCacheStats {
  uint64_t hits = 0;        // files served by an entry that existed
  uint64_t fills = 0;       // downloads into the cache begun (a failed one counts in errors too)
  uint64_t fill_bytes = 0;  // the sizes of their objects
  uint64_t evicted = 0;     // entries removed to make room
  uint64_t errors = 0;      // files that read the store because the cache failed
  uint64_t given_back = 0;  // bytes the load fetched that the disk had no room for (fetched again)
  std::string last_error;   // the latest of those failures, in words
  // kHub: files read from their whole blob (or written into it) whose snapshot link could not be
  // made (a read-only cache): not read from the store, so not in `errors`; each file counted once.
  uint64_t unlinked = 0;
  std::string last_unlinked;  // the latest of those, in words
};

class ObjectCache {
 public:
  // kObjects: the layout above (ObjectStoreOptions::cache_dir). kHub: `dir` is a Hugging Face hub
  // cache and each copy goes where huggingface_hub keeps that file (hub_cache.h: blobs/<blob>,
  // its snapshot link made when it is whole, the lock huggingface_hub takes); nothing is
  // evicted there (max_bytes is ignored), and a whole object may also be kept at once (Keep).
  enum class Layout { kObjects, kHub };
  // `dir` is created (with its parents) at the first download; max_bytes 0: unbounded.
  // `write_behind`: the writer's ring in bytes (ObjectStoreOptions::cache_write_behind);
  // `fetch_once`: a read whose bytes find no room in it waits for room (or, when a piece cannot
  // fit it at all, writes them itself) instead of giving them back (cache_fetch_once).
  // `lock_wait`: how long a download of the same object by another thread or process (the key's
  // lock) is waited for while it makes no progress, before reading the store (kLockWait; > 0).
  ObjectCache(std::string dir, uint64_t max_bytes, Layout layout = Layout::kObjects,
              size_t write_behind = ObjectStoreOptions().cache_write_behind,
              bool fetch_once = false, std::chrono::milliseconds lock_wait = kLockWait);
  // The default lock_wait: long enough for a live filler's slowest step (a part's retries, an
  // fsync of a large copy), short enough that a stopped one costs a load little.
  static constexpr std::chrono::milliseconds kLockWait{30'000};
  // Waits for the downloads that began (and those queued behind them) to end.
  ~ObjectCache();
  ObjectCache(const ObjectCache&) = delete;
  ObjectCache& operator=(const ObjectCache&) = delete;

  // `object` as a SourceFile whose path() is object.name and identity `identity`: its entry when
  // one exists, else a file that serves reads within `prefix` (its first bytes, already fetched)
  // from memory and, from its first read beyond them, downloads the object into the cache as
  // described above (the filler's ranges: at most `part_size` bytes, `concurrency` at a time,
  // buffers at most 16 MiB together, parts of at least 2 MiB), fetched by `fetch`. `fetch` must
  // stay callable until the cache is destroyed; `owner` (may be null) is kept alive by the file.
  // Never fails for a missing entry.
  Result<std::unique_ptr<SourceFile>> Open(const CachedObject& object, const FileIdentity& identity,
                                           std::vector<std::byte> prefix, FetchRange fetch,
                                           unsigned concurrency, uint64_t part_size,
                                           std::shared_ptr<const void> owner = nullptr);

  // kHub: `object` whole in `bytes` (an object the open's first GET held whole: an index, a
  // config) written as its entry and linked, unless it is there already. A failure is counted in
  // stats() and changes nothing else.
  void Keep(const CachedObject& object, std::span<const std::byte> bytes);

  // An object read past the cache, for `why` (it has no strong ETag: a copy could not be told
  // from a changed object): counted in stats() as a failure, "<where>: <name> not cached: <why>".
  void Skip(const std::string& name, const std::string& why);

  // Blocks until the downloads begun so far (and those queued) have ended, in the cache or not.
  void Drain();
  // True while downloads are queued or running.
  bool Busy() const;

  const std::string& dir() const noexcept { return dir_; }
  ObjectCacheStats stats() const;
  // The failures counted in stats().errors from the `first`-th on (0: the first), each in words
  // as last_error; at most the latest kErrorLog of them.
  std::vector<std::string> ErrorsSince(uint64_t first) const;
  static constexpr size_t kErrorLog = 64;

  // The entry name of `object` (64 lower-case hex digits) in the kObjects layout.
  static std::string Key(const CachedObject& object);

 private:
  friend class FillingFile;
  struct Fill;
  class WriteBehind;  // the writer thread of the load's reads (object_cache.cc)
  // Where one object's copy goes, by layout.
  struct Place {
    std::string key;                // names the download (kObjects: Key(); kHub: the blob's name)
    std::string blob;               // the whole copy
    std::string lock;               // its flock(2) target
    std::string tmp_dir;            // where downloads are written (the blob's file system)
    std::string tmp_stem;           // the start of their names ("<key>." then pid and serial)
    std::vector<std::string> dirs;  // created first
  };
  Place PlaceOf(const CachedObject& object) const;
  // The place's folders made and its lock held, "<pid> <host>" written in it; waits for another
  // holder while its download progresses and at most lock_wait_ without progress. An invalid
  // descriptor when any of that fails (counted in stats(), naming `object` and the holder).
  UniqueFd Lock(const Place& place, const CachedObject& object);

  // The entry if it is whole (nullptr if absent; a blob of the wrong size is removed).
  std::unique_ptr<SourceFile> Find(const CachedObject& object, const Place& place,
                                   const FileIdentity& identity);
  // kHub: the snapshot link of a whole entry (a failure counted, nothing else).
  void Link(const CachedObject& object);
  // "object cache <dir>: " or "hub cache <dir>: ", for messages.
  std::string Where() const;
  // The start of a download of `object` (the first read beyond its prefix): its entry when one
  // appeared meanwhile (another process filled it: set in `found`), else a Fill queued for the
  // filler thread; nullptr for both when the cache cannot hold it (counted in stats()).
  std::shared_ptr<Fill> Start(const CachedObject& object, const FileIdentity& identity,
                              std::span<const std::byte> prefix, const FetchRange& fetch,
                              unsigned concurrency, uint64_t part_size,
                              std::unique_ptr<SourceFile>& found);
  // The filler thread: runs the queued downloads one after the other.
  void FillerLoop();
  void RunFill(Fill& fill);
  // After the last range: the copy committed, or removed when the download failed.
  void Finish(Fill& fill);
  // The copy `tmp` (open as `fd`) made the entry `blob`: its fsync, its description (kObjects),
  // its rename, its snapshot link (kHub); why not ("" when done). Downloads and Keep.
  std::string Commit(const CachedObject& object, int fd, const std::string& tmp,
                     const std::string& blob);
  // Removes least recently used entries until `incoming` more bytes fit under max_bytes_; false
  // (with `why`) when they cannot.
  // The downloads in progress count as entries (room_->reserved, this process's on the
  // directory): make room and reserve under room_->mu.
  bool MakeRoom(const std::string& keep, uint64_t incoming, std::string& why);
  void NoteError(const std::string& why);
  // kHub: the snapshot link of `object` not made (stats().unlinked, once per link).
  void NoteUnlinked(const CachedObject& object, const std::string& why);
  // A reader's fetched claim (`bytes` at `begin`) into the writer's ring, piece by piece; what
  // finds no room is given back to the filler (fetch_once_: waited for, or written here).
  void WriteLater(const std::shared_ptr<Fill>& fill, uint64_t begin,
                  std::span<const std::byte> bytes);
  // A read through a download in progress, for ReadsIdleFor (RAII).
  class Reading {
   public:
    explicit Reading(ObjectCache& cache);
    ~Reading();
    Reading(const Reading&) = delete;
    Reading& operator=(const Reading&) = delete;

   private:
    ObjectCache& cache_;
  };
  // How long since the last read through this cache's downloads ended; negative while one runs.
  std::chrono::nanoseconds ReadsIdleFor() const;

  const std::string dir_;
  const uint64_t max_bytes_;
  const Layout layout_;
  const bool fetch_once_;
  const std::chrono::milliseconds lock_wait_;
  std::atomic<uint64_t> hits_{0}, fills_{0}, fill_bytes_{0}, evicted_{0}, errors_{0};
  std::atomic<uint64_t> given_back_{0};
  std::atomic<int> reading_{0};           // Reading: reads in progress
  std::atomic<int64_t> last_read_ns_{0};  // Reading: when the last one ended (steady clock)
  mutable std::mutex mu_;  // last_error_, error_log_, queue_, active_, stop_, filler_
  std::string last_error_;
  std::deque<std::string> error_log_;  // the latest kErrorLog failures (the last is errors_ - 1)
  std::vector<std::string> unlinked_;  // mu_: the links NoteUnlinked counted (commit/path)
  std::string last_unlinked_;          // mu_
  std::set<std::string> swept_;        // mu_: leftovers swept (hub layout: per repository)
  std::condition_variable queue_cv_, idle_cv_;
  std::deque<std::shared_ptr<Fill>> queue_;
  size_t active_ = 0;  // downloads queued or running
  // The downloads in progress of every ObjectCache of this process on the same directory (each
  // source of a URL has its own cache: a safe_open per shard, two Loaders), under its mutex.
  struct Room {
    std::mutex mu;
    uint64_t reserved = 0;  // mu: the sizes of the downloads in progress
  };
  static std::shared_ptr<Room> RoomOf(const std::string& dir);
  const std::shared_ptr<Room> room_;
  bool stop_ = false;
  std::thread filler_;  // started by the first download
  std::unique_ptr<WriteBehind> writer_;
};

}  // namespace tensorferry::objstore

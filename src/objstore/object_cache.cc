// The local disk cache of object-store files (object_cache.h).
#include "objstore/object_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <simdjson.h>

#include "io/read_engine.h"
#include "objstore/hub_cache.h"
#include "tensorferry/env.h"
#include "tensorferry/object_store.h"
#include "util/json_writer.h"
#include "util/macros.h"
#include "util/parallel.h"
#include "util/unique_fd.h"

namespace tensorferry {
namespace objstore {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kFillBuffers = 16u << 20;  // the download's buffers, all threads together
constexpr uint64_t kMinFillPart = 2u << 20;   // the smallest range it fetches (unless part_size)
// The load's reads hand what they fetched to the cache's writer thread in pieces of at most this
// many bytes (WriteBehind below).
constexpr size_t kWritePiece = 4u << 20;
// The filler downloads what the load's reads leave of a file once the file is closed, or once
// reads through the cache have paused this long (Fill::AwaitTurn).
constexpr std::chrono::milliseconds kQuiet{1000};
// How often a download that receives bytes touches its copy in progress, at most (Fill::progress).
constexpr std::chrono::milliseconds kProgressEvery{250};

std::string Errno(int error) {
  return std::strerror(error);
}

// The calling thread (the cache's writer, filler and its fetchers: work in the background of a
// load) yields the CPUs and the disk to the load and to what consumes it: a lower CPU priority
// (a nice value 10 above the process's, at most 19; this thread only, and never raised: a thread
// a background thread made inherits its value, and calling this again changes nothing) and the
// best-effort I/O class's lowest priority. Best effort: failures change nothing.
void RunInBackground() {
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int process = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::getpid()));  // main thread
  const int target = std::min(19, process + 10);
  const int now = errno == 0 ? ::getpriority(PRIO_PROCESS, tid) : target;
  if (errno == 0 && now < target) static_cast<void>(::setpriority(PRIO_PROCESS, tid, target));
  constexpr int kClassBestEffort = 2, kClassShift = 13, kLowest = 7, kWhoProcess = 1;
  static_cast<void>(::syscall(SYS_ioprio_set, kWhoProcess, static_cast<int>(tid),
                              (kClassBestEffort << kClassShift) | kLowest));
}

// Writes all of `data` at `offset`; the errno of the failure, or 0.
int PwriteFully(int fd, std::span<const std::byte> data, uint64_t offset) {
  while (!data.empty()) {
    const ssize_t n = ::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    data = data.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

// Reads all of `dst` at `offset`; the errno of the failure, EIO when the file ends first, or 0.
int PreadFully(int fd, std::span<std::byte> dst, uint64_t offset) {
  while (!dst.empty()) {
    const ssize_t n = ::pread(fd, dst.data(), dst.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    dst = dst.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

// Flock that retries on EINTR; 0 or errno.
int Flock(int fd, int how) {
  while (::flock(fd, how) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

// AbandonDownloads: each call begins a new generation; a download of an earlier one is given up.
std::atomic<uint64_t> abandoned_generation{0};

// Beside a key's lock: the file on which those waiting for the lock hold a shared lock.
std::string WantPath(const std::string& lock) {
  return lock + ".want";
}

// True while someone waits for the lock whose WantPath is `want` (ObjectCache::Lock).
bool Wanted(const std::string& want) {
  const UniqueFd fd(::open(want.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return false;                            // nobody ever waited
  return Flock(fd.get(), LOCK_EX | LOCK_NB) == EWOULDBLOCK;  // (closing unlocks)
}

bool IsKey(std::string_view name) {
  if (name.size() != 64) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// Removes the entry `blob` (and its description) if it is still the file open as `fd` (not a
// copy filled again since); says so, for a checksum error.
std::string DropCopy(const std::string& blob, int fd) {
  struct stat mine {
  }, now{};
  if (::fstat(fd, &mine) == 0 && ::stat(blob.c_str(), &now) == 0 && mine.st_dev == now.st_dev &&
      mine.st_ino == now.st_ino) {
    if (::unlink(blob.c_str()) != 0 && errno != ENOENT) {
      return "it was read from its copy in the object cache, " + blob +
             ", which could not be removed (" + Errno(errno) + "): remove it by hand";
    }
    ::unlink((blob + ".json").c_str());
  }
  return "it was read from its copy in the object cache, " + blob +
         ", which is now removed: the next open downloads the file again";
}

// The copy of an object in the cache: positional reads of a local descriptor, named by the
// object's URL.
class CachedFile final : public SourceFile {
 public:
  CachedFile(UniqueFd fd, std::string name, std::string blob, FileIdentity identity)
      : fd_(fd.release()), name_(std::move(name)), blob_(std::move(blob)), identity_(identity) {}
  ~CachedFile() override { ::close(fd_); }

  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset >= identity_.size || dst.empty()) return size_t{0};
    dst = dst.first(static_cast<size_t>(std::min<uint64_t>(dst.size(), identity_.size - offset)));
    size_t done = 0;
    while (done < dst.size()) {
      const ssize_t n =
          ::pread(fd_, dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status(Code::kIoError, name_ + ": read of its cached copy " + blob_ + " at offset " +
                                          std::to_string(offset + done) +
                                          " failed: " + Errno(errno));
      }
      if (n == 0) break;  // the copy was cut short outside tensorferry: the reader says where
      done += static_cast<size_t>(n);
    }
    return done;
  }
  Result<uint64_t> Size() const override { return identity_.size; }
  const std::string& path() const noexcept override { return name_; }
  const FileIdentity& identity() const noexcept override { return identity_; }
  std::string Distrust() const override { return DropCopy(blob_, fd_); }
  Status DropFromPageCache() const override { return io::DropPages(fd_, blob_); }
  // Entries are never written after they appear: only a copy damaged outside tensorferry changes.
  Status CheckUnchanged() const override {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      return Status(Code::kIoError,
                    name_ + ": fstat of its cached copy " + blob_ + " failed: " + Errno(errno));
    }
    if (static_cast<uint64_t>(st.st_size) != identity_.size) {
      return Status(Code::kIoError, name_ + ": its cached copy " + blob_ +
                                        " changed: " + std::to_string(identity_.size) +
                                        " bytes then, " + std::to_string(st.st_size) + " now");
    }
    return Status::Ok();
  }

 private:
  const int fd_;
  const std::string name_, blob_;
  const FileIdentity identity_;
};

// The description <key>.json of an entry: its url and etag ("" when unreadable).
void ReadDescription(const std::string& path, ObjectCacheEntry& entry) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.load(path).get(doc) != simdjson::SUCCESS) return;
  std::string_view text;
  if (doc["url"].get(text) == simdjson::SUCCESS) entry.url = text;
  if (doc["etag"].get(text) == simdjson::SUCCESS) entry.etag = text;
}

// The lock of `key`, held, if nobody else holds it (never waits); an empty UniqueFd when another
// does, or when the lock file cannot be opened (then `*error`, if given, says why).
UniqueFd TryLockKey(const std::string& dir, const std::string& key, std::string* error = nullptr) {
  const std::string path = dir + "/locks/" + key + ".lock";
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));
  if (fd.get() < 0 && errno == ENOENT) {
    // locks/ removed (or a cache copied without it): made again, as the cache's open makes it.
    (void)::mkdir((dir + "/locks").c_str(), 0755);
    fd = UniqueFd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));
  }
  if (fd.get() < 0) {
    if (error != nullptr) *error = path + ": " + Errno(errno);
    return fd;
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e != EWOULDBLOCK && error != nullptr) *error = path + ": flock: " + Errno(e);
    fd.Reset();
  }
  return fd;
}

// An entry found in blobs/, with its time of last use to the nanosecond.
struct Scanned {
  ObjectCacheEntry entry;
  struct timespec used;
};

// The entries of `dir`, least recently used first.
Result<std::vector<Scanned>> ScanEntries(const std::string& dir) {
  const std::string blobs = dir + "/blobs";
  DIR* d = ::opendir(blobs.c_str());
  if (d == nullptr) {
    const int e = errno;
    return Status(e == ENOENT || e == ENOTDIR ? Code::kNotFound : Code::kIoError,
                  dir + ": " +
                      (e == ENOENT || e == ENOTDIR ? "not an object cache (no blobs/)"
                                                   : "cannot list blobs/: " + Errno(e)));
  }
  std::vector<Scanned> out;
  while (const dirent* e = ::readdir(d)) {
    struct stat st {};
    if (!IsKey(e->d_name) || ::fstatat(::dirfd(d), e->d_name, &st, 0) != 0 || !S_ISREG(st.st_mode))
      continue;
    Scanned s;
    s.entry.key = e->d_name;
    s.entry.size = static_cast<uint64_t>(st.st_size);
    s.entry.last_used = st.st_mtim.tv_sec;
    s.used = st.st_mtim;
    out.push_back(std::move(s));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const Scanned& a, const Scanned& b) {
    return a.used.tv_sec != b.used.tv_sec ? a.used.tv_sec < b.used.tv_sec
                                          : a.used.tv_nsec < b.used.tv_nsec;
  });
  for (Scanned& s : out) ReadDescription(blobs + "/" + s.entry.key + ".json", s.entry);
  return out;
}

uint64_t EvictUntil(const std::string& dir, uint64_t budget, const std::string& keep,
                    std::vector<ObjectCacheEntry>& removed, std::string* first_error) {
  Result<std::vector<Scanned>> scanned = ScanEntries(dir);
  if (!scanned.ok()) return 0;
  uint64_t total = 0;
  for (const Scanned& s : *scanned) total += s.entry.size;
  const std::string blobs = dir + "/blobs/";
  for (const Scanned& s : *scanned) {
    if (total <= budget) break;
    if (s.entry.key == keep) continue;
    // Never under a filler (or anyone holding the key): try, don't wait.
    std::string error;
    const UniqueFd lock = TryLockKey(dir, s.entry.key, &error);
    if (lock.get() < 0) {  // held by another process (kept, as promised), or an error
      if (first_error != nullptr && first_error->empty()) *first_error = error;
      continue;
    }
    // Readers that opened it keep reading: an unlinked file lives while it is open.
    if (::unlink((blobs + s.entry.key).c_str()) == 0) {
      ::unlink((blobs + s.entry.key + ".json").c_str());
      total -= s.entry.size;
      removed.push_back(s.entry);
    } else if (first_error != nullptr && first_error->empty()) {
      *first_error = blobs + s.entry.key + ": " + Errno(errno);
    }
  }
  return total;
}

void RemoveLeftovers(const std::string& dir) {
  // Downloads whose key nobody holds are over (their process died): tmp/<key>.<pid>.<n>[.json].
  if (DIR* d = ::opendir((dir + "/tmp").c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      if (name.size() <= 64 || name[64] != '.' || !IsKey(name.substr(0, 64))) continue;
      const UniqueFd lock = TryLockKey(dir, std::string(name.substr(0, 64)));
      if (lock.get() >= 0) ::unlinkat(::dirfd(d), e->d_name, 0);
    }
    ::closedir(d);
  }
  // Descriptions without their entry (a download that failed between the two renames).
  if (DIR* d = ::opendir((dir + "/blobs").c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      if (name.size() != 69 || name.substr(64) != ".json" || !IsKey(name.substr(0, 64))) continue;
      const std::string key(name.substr(0, 64));
      struct stat st {};
      if (::fstatat(::dirfd(d), key.c_str(), &st, 0) == 0) continue;
      const UniqueFd lock = TryLockKey(dir, key);
      if (lock.get() >= 0 && ::fstatat(::dirfd(d), key.c_str(), &st, 0) != 0) {
        ::unlinkat(::dirfd(d), e->d_name, 0);
      }
    }
    ::closedir(d);
  }
}

// The hub layout's downloads left by processes that died, in one repository's blobs/ folder
// (`blobs`): <blob>.tensorferry.<pid>.<n> whose blob's lock (in `locks`) nobody holds. Each was
// allocated at its object's full size, and huggingface_hub's tools do not know them.
void RemoveHubLeftovers(const std::string& blobs, const std::string& locks) {
  constexpr std::string_view kMark = ".tensorferry.";
  DIR* d = ::opendir(blobs.c_str());
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    const size_t mark = name.find(kMark);
    if (mark == 0 || mark == std::string_view::npos) continue;
    const std::string lock_path = locks + "/" + std::string(name.substr(0, mark)) + ".lock";
    const UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CLOEXEC));
    if (lock.get() >= 0 && Flock(lock.get(), LOCK_EX | LOCK_NB) == 0) {
      ::unlinkat(::dirfd(d), e->d_name, 0);
      static_cast<void>(::flock(lock.get(), LOCK_UN));
    }
  }
  ::closedir(d);
}

}  // namespace

void AbandonDownloads() {
  abandoned_generation.fetch_add(1, std::memory_order_relaxed);
}

// One download into the cache, shared by the file reading through it and the filler thread.
// The bytes below `head` (the open's prefix) are written when it starts; the rest, [head, size),
// is claimed range by range: a reader claims exactly the bytes it needs and nobody has claimed
// (fetched straight into its buffer, then written to the copy), the filler claims what is left
// from the end of the object down (so that it meets a load reading forward rather than racing
// it for the same bytes).
struct ObjectCache::Fill {
  CachedObject object;
  std::string key, tmp, blob;  // blob: where the copy goes when whole
  std::string want;            // WantPath of the key's lock
  uint64_t generation = 0;     // abandoned_generation when it began
  UniqueFd fd;                 // tmp, read and written
  UniqueFd lock;               // locks/<key>.lock, held until Finish
  FetchRange fetch;
  unsigned threads = 1;
  uint64_t head = 0, part = 0;
  // Told of the bytes of its GETs as they land: touches the copy in progress (its modification
  // time) at most every kProgressEvery, which is what another process waiting for the key's lock
  // sees of a download that goes on between its writes (a part of 32 MiB from a server sending
  // less than 1 MB/s takes longer than the lock wait).
  std::atomic<int64_t> touched{0};  // steady_clock nanoseconds of the last touch
  BodyProgress progress = [this](size_t) {
    const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    int64_t last = touched.load(std::memory_order_relaxed);
    if (now - last >= std::chrono::nanoseconds(kProgressEvery).count() &&
        touched.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
      static_cast<void>(::futimens(fd.get(), nullptr));  // best effort
    }
  };

  struct Claimed {
    uint64_t end;
    bool done;  // written to the copy (else being fetched)
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Claimed> claimed;  // mu: by first byte; never overlapping
  uint64_t done_bytes = 0;              // mu
  uint64_t top = 0;                     // mu: the filler claims below this
  size_t busy = 0;                      // mu: claims being fetched
  bool failed = false;                  // mu: given up (unclaimed bytes read the store)
  bool finished = false;                // mu: Finish is over (committed unless failed)
  bool gave_back = false;               // mu: a reader gave a claim back since the filler's scan
  bool closed = false;                  // mu: the file reading through this download is closed
  bool drop_pages = false;              // mu: drop the copy's pages once committed (drop_cache)
  std::string why;                      // mu: why

  bool Whole() const { return done_bytes == object.size - head; }
  // Given up by AbandonDownloads: marked failed (mu held); true when it is.
  bool Abandoned() {
    if (!failed && abandoned_generation.load(std::memory_order_relaxed) != generation) {
      failed = true;
      why = "given up: the process is ending (AbandonObjectCaches)";
      cv.notify_all();
    }
    return failed;
  }

  enum class Kind { kDone, kMine, kStore, kCancelled };
  struct Span {
    Kind kind;
    uint64_t end;
  };
  // What to do with the bytes from `at` (at < limit): read [at, end) from the copy, fetch it (now
  // the caller's claim), or read it from the store (the download was given up). Waits while
  // another thread fetches the bytes at `at`, unless this thread's load is cancelled
  // (io::CancelScope: kCancelled; that fetch goes on for the others).
  Span Next(uint64_t at, uint64_t limit) {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      auto it = claimed.upper_bound(at);
      const uint64_t next = it == claimed.end() ? limit : std::min(limit, it->first);
      if (it != claimed.begin() && std::prev(it)->second.end > at) {
        const Claimed& c = std::prev(it)->second;
        if (c.done) return {Kind::kDone, std::min(limit, c.end)};
        if (io::CancelScope::Requested()) return {Kind::kCancelled, at};
        cv.wait_for(lk, std::chrono::milliseconds(50));  // someone else's, in flight
        continue;
      }
      if (failed) return {Kind::kStore, next};
      claimed.emplace(at, Claimed{next, false});
      ++busy;
      return {Kind::kMine, next};
    }
  }
  // The filler's next claim: at most `part` bytes of the highest range nobody claimed; false
  // when there is none left (or the download was given up).
  // Ranges readers gave back (GiveBack) are claimed by a new scan from the top.
  bool NextFromTop(uint64_t& begin, uint64_t& end) {
    std::lock_guard<std::mutex> lk(mu);
    while (!Abandoned()) {
      if (top <= head) {
        if (!gave_back) return false;
        gave_back = false;
        top = object.size;
      }
      auto it = claimed.lower_bound(top);  // the first claim at or after top
      if (it != claimed.begin() && std::prev(it)->second.end >= top) {
        top = std::prev(it)->first;  // top lies inside (or at the end of) a claim: skip it
        continue;
      }
      const uint64_t floor =
          it == claimed.begin() ? head : std::max(head, std::prev(it)->second.end);
      end = top;
      begin = std::max(floor, top > part ? top - part : 0);
      claimed.emplace(begin, Claimed{end, false});
      ++busy;
      top = begin;
      return true;
    }
    return false;
  }
  // Ends the claim that starts at `begin`: written, or not (`error` says why: the download is
  // given up).
  void Release(uint64_t begin, const std::string& error) {
    std::lock_guard<std::mutex> lk(mu);
    --busy;
    auto it = claimed.find(begin);
    if (error.empty()) {
      it->second.done = true;
      done_bytes += it->second.end - begin;
    } else {
      claimed.erase(it);
      if (!failed) why = error;
      failed = true;
    }
    cv.notify_all();
  }
  // Returns when it is the filler's turn: the file reading through this download is closed, no
  // read has run through `cache` for kQuiet (a file kept open, read in part), or another thread
  // or process waits for the copy (for the key's lock: a second rank on this host). Until then
  // the filler neither competes with the load for the network nor makes its reads wait for
  // ranges it is writing to a slow disk.
  void AwaitTurn(const ObjectCache& cache) {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      if (closed || Abandoned()) return;
      const std::chrono::nanoseconds idle = cache.ReadsIdleFor();
      if (idle >= kQuiet || Wanted(want)) return;
      cv.wait_for(lk, idle.count() < 0 ? kQuiet / 4 : kQuiet - idle);
    }
  }
  // Gives the claim at `begin` back unwritten (its reader's bytes found no room in the writer's
  // ring): the filler fetches it again.
  void GiveBack(uint64_t begin) {
    std::lock_guard<std::mutex> lk(mu);
    --busy;
    claimed.erase(begin);
    gave_back = true;
    cv.notify_all();
  }
  // Splits the claim at `begin` (not written yet) at `mid` (inside it): two claims, released or
  // given back apart.
  void Split(uint64_t begin, uint64_t mid) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = claimed.find(begin);
    const uint64_t end = it->second.end;
    it->second.end = mid;
    claimed.emplace(mid, Claimed{end, false});
    ++busy;
  }
  // Fetches [begin, begin + buffer.size()) (claimed) into `buffer`; the store's error (the claim
  // released) or OK (then the caller writes it: Write, or the writer thread). A fetch cancelled
  // by its read's load (closed, or a cooperative load's read ahead abandoned) gives the claim
  // back for the filler instead of giving the download up: the store did not fail.
  Status FetchClaim(uint64_t begin, std::span<std::byte> buffer) {
    Status st = fetch(begin, buffer, &progress);
    if (st.code() == Code::kCancelled) {
      GiveBack(begin);
    } else if (!st.ok()) {
      Release(begin, st.message());
    }
    return st;
  }
  // Writes the claim at `begin` (its bytes in `bytes`) to the copy and releases it (a failed
  // write gives the download up, not the read).
  void Write(uint64_t begin, std::span<const std::byte> bytes) {
    if (const int e = PwriteFully(fd.get(), bytes, begin); e != 0) {
      Release(begin, "cannot write " + tmp + ": " + Errno(e));
      return;
    }
    // Start writing the range to disk now (asynchronously), so that the fsync at the end waits
    // for the last ranges only, not for the whole file.
    ::sync_file_range(fd.get(), static_cast<off_t>(begin), static_cast<off_t>(bytes.size()),
                      SYNC_FILE_RANGE_WRITE);
    Release(begin, "");
  }
};

// The cache's writer thread, for the bytes the load's reads fetch. A read that fetched a range of
// a download in progress into its own buffer copies it into a ring (ObjectStoreOptions::
// cache_write_behind bytes), in pieces of at most kWritePiece, and returns; this thread writes the
// pieces to their copies in the order they came and releases their claims (until then, another read
// of those bytes waits for them, as for bytes being fetched). The pieces the ring has no room for
// (the local disk is slower than the network) are given back: the filler fetches them again, later.
// So the load never waits for the local disk (a pwrite at every range used to serialize the reads
// on the copy's inode lock and stall them in the kernel's dirty-page throttling); a slow disk
// costs a second fetch of what it could not take, after the load. With fetch_once (for stores
// billed by the byte served), a read waits for room instead, and one whose piece could never fit
// the ring writes it itself: each byte is fetched once and the load goes at the disk's pace. One
// writer per cache: writes into one file do not run in parallel anyway.
class ObjectCache::WriteBehind {
 public:
  explicit WriteBehind(size_t capacity) : capacity_(capacity) {}
  ~WriteBehind() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    if (thread_.joinable()) thread_.join();  // after what is queued is written
  }
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Copies `bytes` (the claim of `fill` at `begin`) into the ring and queues their write. When
  // the ring has no room for them now: with `wait`, waits until the writer has freed enough;
  // else returns false, doing nothing. False too when they could never fit it.
  bool Queue(std::shared_ptr<Fill> fill, uint64_t begin, std::span<const std::byte> bytes,
             bool wait) {
    const size_t n = bytes.size();
    if (n == 0 || n > capacity_) return false;
    std::unique_lock<std::mutex> lk(mu_);
    try {  // the thread and the ring at the first write; without them the ring has no room
      if (!ring_) ring_ = std::make_unique<std::byte[]>(capacity_);
      if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    } catch (const std::exception&) {  // std::bad_alloc, std::system_error
      return false;
    }
    size_t at = 0, skip = 0;
    while (!Allocate(n, at, skip)) {
      if (!wait) return false;
      room_cv_.wait(lk);  // the ring is in use (used_ > 0): the writer frees it
    }
    // Queued in the order of allocation (the ring is freed in that order), written once copied.
    Item& item = items_.emplace_back(Item{std::move(fill), begin, at, n, skip, false});
    lk.unlock();
    std::memcpy(ring_.get() + at, bytes.data(), n);  // outside the lock: reads copy in parallel
    lk.lock();
    item.copied = true;  // (a deque's elements stay in place while others are added and popped)
    lk.unlock();
    work_cv_.notify_all();
    return true;
  }

 private:
  struct Item {
    std::shared_ptr<Fill> fill;
    uint64_t begin;
    size_t at, size, skip;  // skip: the ring's end left unused before `at` (= 0)
    bool copied;            // mu_: its bytes are in the ring
  };
  // Room for n contiguous bytes after those in use (start_, used_ bytes, wrapping at capacity_),
  // in allocation order. mu_ held.
  bool Allocate(size_t n, size_t& at, size_t& skip) {
    skip = 0;
    if (used_ == 0) {
      start_ = 0;
      at = 0;
    } else if (const size_t end = start_ + used_; end < capacity_) {  // not wrapped
      if (n <= capacity_ - end) {
        at = end;
      } else if (n <= start_) {
        skip = capacity_ - end;
        at = 0;
      } else {
        return false;
      }
    } else if (n <= start_ - (end - capacity_)) {  // wrapped: room between its end and start_
      at = end - capacity_;
    } else {
      return false;
    }
    used_ += skip + n;
    return true;
  }
  void Loop() {
    RunInBackground();
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] {
        return (stop_ && items_.empty()) || (!items_.empty() && items_.front().copied);
      });
      if (items_.empty()) return;
      Item& item = items_.front();  // stays in place: only this thread pops
      lk.unlock();
      item.fill->Write(item.begin, std::span<const std::byte>(ring_.get() + item.at, item.size));
      lk.lock();
      // Items are allocated and freed in the same order: the oldest starts at start_ (after its
      // skip).
      start_ = (item.at + item.size) % capacity_;
      used_ -= item.skip + item.size;
      items_.pop_front();
      room_cv_.notify_all();
    }
  }

  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable work_cv_, room_cv_;
  std::unique_ptr<std::byte[]> ring_;  // mu_: allocated at the first Queue
  size_t start_ = 0, used_ = 0;        // mu_
  std::deque<Item> items_;             // mu_
  bool stop_ = false;                  // mu_
  std::thread thread_;                 // mu_: started by the first Queue
};

// An object whose copy is not in the cache (yet): header reads from the open's prefix, then reads
// through the download the first read beyond it starts (ObjectCache::Start), or from the store
// when the cache cannot hold it.
class FillingFile final : public SourceFile {
 public:
  FillingFile(ObjectCache* cache, CachedObject object, FileIdentity identity,
              std::vector<std::byte> prefix, FetchRange fetch, unsigned concurrency,
              uint64_t part_size, std::shared_ptr<const void> owner)
      : cache_(cache),
        object_(std::move(object)),
        identity_(identity),
        prefix_(std::move(prefix)),
        fetch_(std::move(fetch)),
        concurrency_(concurrency),
        part_size_(part_size),
        owner_(std::move(owner)) {}
  // The filler's turn for what the reads left (Fill::AwaitTurn).
  ~FillingFile() override {
    if (fill_ == nullptr) return;
    {
      std::lock_guard<std::mutex> lk(fill_->mu);
      fill_->closed = true;
    }
    fill_->cv.notify_all();
  }

  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset >= identity_.size || dst.empty()) return size_t{0};
    const size_t n = static_cast<size_t>(std::min<uint64_t>(dst.size(), identity_.size - offset));
    dst = dst.first(n);
    std::shared_ptr<ObjectCache::Fill> fill;
    const SourceFile* entry = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!started_) {
        if (offset + n <= prefix_.size()) {
          std::memcpy(dst.data(), prefix_.data() + offset, n);
          return n;
        }
        started_ = true;
        fill_ =
            cache_->Start(object_, identity_, prefix_, fetch_, concurrency_, part_size_, entry_);
        std::vector<std::byte>().swap(prefix_);
      }
      fill = fill_;
      entry = entry_.get();
    }
    if (entry != nullptr) return entry->Read(offset, dst);
    if (fill == nullptr) {
      TF_RETURN_IF_ERROR(FromStore(offset, dst));
    } else {
      TF_RETURN_IF_ERROR(ReadThrough(fill, offset, dst));
    }
    return n;
  }
  Result<uint64_t> Size() const override { return identity_.size; }
  const std::string& path() const noexcept override { return object_.name; }
  const FileIdentity& identity() const noexcept override { return identity_; }
  // Every fetch is pinned to the ETag, and the copy is written by this process only.
  Status CheckUnchanged() const override { return Status::Ok(); }
  std::string Distrust() const override {
    ObjectCache::Fill* fill = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (entry_) return entry_->Distrust();
      fill = fill_.get();
    }
    if (fill == nullptr) return "";
    {
      std::lock_guard<std::mutex> lk(fill->mu);
      if (!fill->finished) {  // not committed: it never will be
        if (!fill->failed) fill->why = "bytes read from it failed their checksums";
        fill->failed = true;
        return "its download into the object cache is given up";
      }
      if (fill->failed) return "";
    }
    return DropCopy(fill->blob, fill->fd.get());
  }
  // A download in progress drops its pages when committed (its last ranges are still being
  // written); a given-up one has no pages to keep (its copy is removed); bytes read from the
  // store have none.
  Status DropFromPageCache() const override {
    ObjectCache::Fill* fill = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (entry_) return entry_->DropFromPageCache();
      fill = fill_.get();
    }
    if (fill == nullptr) return Status::Ok();
    {
      std::lock_guard<std::mutex> lk(fill->mu);
      if (fill->failed) return Status::Ok();
      if (!fill->finished) {
        fill->drop_pages = true;
        return Status::Ok();
      }
    }
    return io::DropPages(fill->fd.get(), fill->blob);
  }

 private:
  // dst from the store, in parts (as the object's own files read it).
  Status FromStore(uint64_t offset, std::span<std::byte> dst) const {
    const uint64_t part = std::max<uint64_t>(part_size_, 1u << 20);
    for (uint64_t at = 0; at < dst.size(); at += part) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(part, dst.size() - at));
      TF_RETURN_IF_ERROR(fetch_(offset + at, dst.subspan(static_cast<size_t>(at), len), nullptr));
    }
    return Status::Ok();
  }
  Status FromCopy(const ObjectCache::Fill& fill, uint64_t offset, std::span<std::byte> dst) const {
    if (const int e = PreadFully(fill.fd.get(), dst, offset); e != 0) {
      return Status(Code::kIoError, object_.name + ": read of its copy in progress " + fill.tmp +
                                        " at offset " + std::to_string(offset) +
                                        " failed: " + Errno(e));
    }
    return Status::Ok();
  }
  Status ReadThrough(const std::shared_ptr<ObjectCache::Fill>& shared, uint64_t offset,
                     std::span<std::byte> dst) const {
    using Kind = ObjectCache::Fill::Kind;
    ObjectCache::Fill& fill = *shared;
    const ObjectCache::Reading reading(*cache_);
    const uint64_t limit = offset + dst.size();
    uint64_t at = offset;
    if (at < fill.head) {  // the prefix, written when the download began
      const uint64_t end = std::min(limit, fill.head);
      TF_RETURN_IF_ERROR(FromCopy(fill, at, dst.first(static_cast<size_t>(end - at))));
      at = end;
    }
    while (at < limit) {
      const ObjectCache::Fill::Span span = fill.Next(at, limit);
      const std::span<std::byte> out =
          dst.subspan(static_cast<size_t>(at - offset), static_cast<size_t>(span.end - at));
      switch (span.kind) {
        case Kind::kDone: TF_RETURN_IF_ERROR(FromCopy(fill, at, out)); break;
        case Kind::kStore: TF_RETURN_IF_ERROR(FromStore(at, out)); break;
        case Kind::kCancelled:
          return Status(Code::kCancelled, object_.name +
                                              ": the load was cancelled while bytes from " +
                                              std::to_string(at) +
                                              " were being fetched for the cache by another "
                                              "reader");
        case Kind::kMine:
          TF_RETURN_IF_ERROR(fill.FetchClaim(at, out));
          cache_->WriteLater(shared, at, out);
          break;
      }
      at = span.end;
    }
    return Status::Ok();
  }

  ObjectCache* const cache_;
  const CachedObject object_;
  const FileIdentity identity_;
  mutable std::mutex mu_;
  mutable std::vector<std::byte> prefix_;            // mu_; released when the download starts
  mutable bool started_ = false;                     // mu_
  mutable std::shared_ptr<ObjectCache::Fill> fill_;  // set once (mu_), then read only
  mutable std::unique_ptr<SourceFile> entry_;        // set once (mu_), then read only
  const FetchRange fetch_;
  const unsigned concurrency_;
  const uint64_t part_size_;
  const std::shared_ptr<const void> owner_;
};

ObjectCache::ObjectCache(std::string dir, uint64_t max_bytes, Layout layout, size_t write_behind,
                         bool fetch_once, std::chrono::milliseconds lock_wait)
    : dir_(std::move(dir)),
      max_bytes_(layout == Layout::kHub ? 0 : max_bytes),
      layout_(layout),
      fetch_once_(fetch_once),
      lock_wait_(std::max(lock_wait, std::chrono::milliseconds(1))),
      room_(RoomOf(dir_)),
      writer_(std::make_unique<WriteBehind>(write_behind)) {}

std::shared_ptr<ObjectCache::Room> ObjectCache::RoomOf(const std::string& dir) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<Room>> rooms;  // by canonical path
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  const std::string key = ec ? dir : canonical.string();
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = rooms.begin(); it != rooms.end();) {  // the rooms no cache uses any more
    it = it->second.expired() ? rooms.erase(it) : std::next(it);
  }
  std::shared_ptr<Room> room = rooms[key].lock();
  if (!room) {
    room = std::make_shared<Room>();
    rooms[key] = room;
  }
  return room;
}

void ObjectCache::WriteLater(const std::shared_ptr<Fill>& fill, uint64_t begin,
                             std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const size_t n = std::min(bytes.size(), kWritePiece);
    if (n < bytes.size()) fill->Split(begin, begin + n);
    if (!writer_->Queue(fill, begin, bytes.first(n), fetch_once_)) {
      if (fetch_once_) {  // a piece larger than the ring: written by its read
        fill->Write(begin, bytes.first(n));
        begin += n;
        bytes = bytes.subspan(n);
        continue;
      }
      fill->GiveBack(begin);
      if (n < bytes.size()) fill->GiveBack(begin + n);
      given_back_.fetch_add(bytes.size(), std::memory_order_relaxed);
      return;
    }
    begin += n;
    bytes = bytes.subspan(n);
  }
}

ObjectCache::Place ObjectCache::PlaceOf(const CachedObject& object) const {
  Place p;
  if (layout_ == Layout::kObjects) {
    p.key = Key(object);
    p.blob = dir_ + "/blobs/" + p.key;
    p.lock = dir_ + "/locks/" + p.key + ".lock";
    p.tmp_dir = dir_ + "/tmp";
    p.tmp_stem = p.key + ".";
    p.dirs = {dir_ + "/blobs", dir_ + "/locks", p.tmp_dir};
    return p;
  }
  // huggingface_hub's places (hub_cache.h); downloads beside the blob under a name it ignores
  // (not <blob>.incomplete: it would resume from one, and ours are written out of order).
  const std::string repo = dir_ + "/" + object.hub_folder;
  p.key = object.hub_blob;
  p.blob = repo + "/blobs/" + p.key;
  p.lock = dir_ + "/.locks/" + object.hub_folder + "/" + p.key + ".lock";
  p.tmp_dir = repo + "/blobs";
  p.tmp_stem = p.key + ".tensorferry.";
  p.dirs = {p.tmp_dir, dir_ + "/.locks/" + object.hub_folder};
  return p;
}

std::string ObjectCache::Where() const {
  return (layout_ == Layout::kHub ? "hub cache " : "object cache ") + dir_ + ": ";
}

namespace {

// What shows a download of `place` in progress (by any process): the names, sizes and times of
// change of its files in tmp_dir (ours, and huggingface_hub's <blob>.incomplete or
// <blob>.<random>.incomplete in the hub cache: `incomplete` is <blob>.incomplete), and who holds
// the lock. Compared between polls: a change is progress.
std::string FillProgress(const std::string& tmp_dir, const std::string& stem,
                         const std::string& incomplete, int lock_fd) {
  std::string out;
  if (DIR* d = ::opendir(tmp_dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      struct stat st {};
      // huggingface_hub's: <blob>.incomplete, or <blob>.<8 hex>.incomplete (1.x and later).
      const std::string_view blob = std::string_view(incomplete).substr(0, incomplete.size() - 11);
      const bool theirs =
          name == incomplete || (name.size() > incomplete.size() && name.starts_with(blob) &&
                                 name[blob.size()] == '.' && name.ends_with(".incomplete"));
      if ((name.substr(0, stem.size()) != stem && !theirs) ||
          ::fstatat(::dirfd(d), e->d_name, &st, 0) != 0) {
        continue;
      }
      out.append(name).append(" ").append(std::to_string(st.st_size)).append(" ");
      out.append(std::to_string(st.st_mtim.tv_sec)).append(".");
      out.append(std::to_string(st.st_mtim.tv_nsec)).append("\n");
    }
    ::closedir(d);
  }
  char holder[256];
  const ssize_t n = ::pread(lock_fd, holder, sizeof holder, 0);
  if (n > 0) out.append(holder, static_cast<size_t>(n));
  return out;
}

// "pid N on host H", as the holder of the lock open as `fd` wrote it ("another process" when
// it wrote nothing: huggingface_hub, or a holder that has just taken it).
std::string LockHolder(int fd) {
  char text[256];
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  std::string holder(text, static_cast<size_t>(std::max<ssize_t>(n, 0)));
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) holder.pop_back();
  const size_t space = holder.find(' ');
  if (holder.empty() || space == std::string::npos) return "another process";
  return "pid " + holder.substr(0, space) + " on host " + holder.substr(space + 1);
}

// "<pid> <host>\n" into the held lock open as `fd`, for those who wait for it. Best effort.
void WriteLockHolder(int fd) {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  const std::string text = std::to_string(::getpid()) + " " + host + "\n";
  if (::ftruncate(fd, 0) == 0)
    static_cast<void>(PwriteFully(fd, std::as_bytes(std::span(text)), 0));
}

// Lets go of a key's lock held as `fd` and closes it. Unlocked first: a child forked meanwhile
// (multiprocessing, a DataLoader) shares the open file the lock belongs to, and closing our
// descriptor alone would leave the key locked until that child exits (eviction skipping it,
// others waiting on a download long done).
void ReleaseKeyLock(UniqueFd& fd) {
  if (fd.get() >= 0) static_cast<void>(::flock(fd.get(), LOCK_UN));
  fd.Reset();
}

// ReleaseKeyLock at the end of a scope.
struct KeyLockScope {
  UniqueFd& fd;
  ~KeyLockScope() { ReleaseKeyLock(fd); }
};

std::string Seconds(std::chrono::milliseconds t) {
  const auto ms = t.count();
  return ms % 1000 == 0 ? std::to_string(ms / 1000) + " s"
                        : std::to_string(ms / 1000) + "." + std::to_string(ms % 1000 / 100) + " s";
}

}  // namespace

UniqueFd ObjectCache::Lock(const Place& place, const CachedObject& object) {
  std::error_code ec;
  for (const std::string& sub : place.dirs) {
    fs::create_directories(sub, ec);
    if (ec) {
      NoteError(Where() + "cannot create " + sub + ": " + ec.message());
      return UniqueFd();
    }
  }
  UniqueFd lock(::open(place.lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));
  if (lock.get() < 0) {
    NoteError(Where() + "cannot open " + place.lock + ": " + Errno(errno));
    return UniqueFd();
  }
  int e = Flock(lock.get(), LOCK_EX | LOCK_NB);
  if (e == EWOULDBLOCK) {
    // Another thread or process is filling this key: say that we wait (a shared lock on
    // <lock>.want, held while waiting), so that its filler runs now rather than once its load is
    // done with the file (Fill::AwaitTurn). Best effort: without it we only wait longer.
    UniqueFd want(::open(WantPath(place.lock).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));
    if (want.get() >= 0) static_cast<void>(Flock(want.get(), LOCK_SH));
    const KeyLockScope unwant{want};  // let go of explicitly (a forked child shares it)
    // Polled, not a blocking flock: a holder that stopped (SIGSTOP, a frozen cgroup, a debugger)
    // keeps its lock forever, and a cache never makes a load wait for ever. A download that goes
    // on is waited for however long it takes; one that shows no progress for lock_wait_ is not.
    using Clock = std::chrono::steady_clock;
    const std::string incomplete = place.key + ".incomplete";
    std::string seen = FillProgress(place.tmp_dir, place.tmp_stem, incomplete, lock.get());
    Clock::time_point changed = Clock::now();
    std::chrono::milliseconds pause{1};
    while ((e = Flock(lock.get(), LOCK_EX | LOCK_NB)) == EWOULDBLOCK) {
      // This thread's load was cancelled: not waited for (the read goes to the store, which
      // sees the cancel at once), however long the other download still takes.
      if (io::CancelScope::Requested()) return UniqueFd();
      std::string now = FillProgress(place.tmp_dir, place.tmp_stem, incomplete, lock.get());
      if (now != seen) {
        seen = std::move(now);
        changed = Clock::now();
      } else if (Clock::now() - changed >= lock_wait_) {
        NoteError(Where() + object.name + " not cached: its entry is held by " +
                  LockHolder(lock.get()) + " (" + place.lock +
                  "), whose download made no progress for " + Seconds(lock_wait_));
        return UniqueFd();
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }
  if (e != 0) {
    NoteError(Where() + "cannot lock " + place.lock + ": " + Errno(e));
    return UniqueFd();
  }
  WriteLockHolder(lock.get());
  return lock;
}

void ObjectCache::Keep(const CachedObject& object, std::span<const std::byte> bytes) {
  if (layout_ != Layout::kHub || bytes.size() != object.size) return;
  const Place place = PlaceOf(object);
  const std::string where = Where();
  UniqueFd lock = Lock(place, object);
  if (lock.get() < 0) return;
  const KeyLockScope unlock{lock};
  if (Find(object, place, FileIdentity{})) {  // there already (and linked)
    hits_.fetch_add(1);
    return;
  }
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = place.tmp_dir + "/" + place.tmp_stem + std::to_string(::getpid()) + ".k" +
                          std::to_string(serial.fetch_add(1));
  std::string why;
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  int e = 0;
  if (fd.get() < 0) {
    why = "cannot create " + tmp + ": " + Errno(errno);
  } else if ((e = PwriteFully(fd.get(), bytes, 0)) != 0) {
    why = "cannot write " + tmp + ": " + Errno(e);
  } else {
    why = Commit(object, fd.get(), tmp, place.blob);
  }
  if (!why.empty()) {
    ::unlink(tmp.c_str());
    NoteError(where + object.name + " not cached: " + why);
    return;
  }
  fills_.fetch_add(1);
  fill_bytes_.fetch_add(object.size);
}

void ObjectCache::Link(const CachedObject& object) {
  if (layout_ != Layout::kHub) return;
  if (Status linked = LinkHubSnapshot(dir_, object.hub_folder, object.hub_commit, object.hub_path,
                                      object.hub_blob);
      !linked.ok()) {
    NoteUnlinked(object, Where() + object.name + " not linked: " + linked.message());
  }
}

void ObjectCache::NoteUnlinked(const CachedObject& object, const std::string& why) {
  const std::string link = object.hub_commit + "/" + object.hub_path;
  std::lock_guard<std::mutex> lock(mu_);
  last_unlinked_ = why;
  if (std::find(unlinked_.begin(), unlinked_.end(), link) == unlinked_.end()) {
    unlinked_.push_back(link);
  }
}

ObjectCache::~ObjectCache() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (filler_.joinable()) filler_.join();  // each download's Finish waited for its writes
}

std::string ObjectCache::Key(const CachedObject& object) {
  const std::string text =
      object.request_url + "\n" + object.etag + "\n" + std::to_string(object.size);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned i = 0; i < length; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

ObjectCacheStats ObjectCache::stats() const {
  ObjectCacheStats s;
  s.hits = hits_.load();
  s.fills = fills_.load();
  s.fill_bytes = fill_bytes_.load();
  s.evicted = evicted_.load();
  s.errors = errors_.load();
  s.given_back = given_back_.load();
  std::lock_guard<std::mutex> lock(mu_);
  s.last_error = last_error_;
  s.unlinked = unlinked_.size();
  s.last_unlinked = last_unlinked_;
  return s;
}

std::vector<std::string> ObjectCache::ErrorsSince(uint64_t first) const {
  std::lock_guard<std::mutex> lock(mu_);
  // errors_ grows under mu_ (NoteError), so the log's last entry is failure errors_ - 1.
  const uint64_t count = errors_.load();
  const uint64_t logged_from = count - error_log_.size();
  std::vector<std::string> out;
  for (uint64_t i = std::max(first, logged_from); i < count; ++i) {
    out.push_back(error_log_[static_cast<size_t>(i - logged_from)]);
  }
  return out;
}

void ObjectCache::Skip(const std::string& name, const std::string& why) {
  NoteError(Where() + name + " not cached: " + why);
}

void ObjectCache::NoteError(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  errors_.fetch_add(1);
  last_error_ = why;
  error_log_.push_back(why);
  if (error_log_.size() > kErrorLog) error_log_.pop_front();
}

std::unique_ptr<SourceFile> ObjectCache::Find(const CachedObject& object, const Place& place,
                                              const FileIdentity& identity) {
  const std::string& blob = place.blob;
  UniqueFd fd(::open(blob.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return nullptr;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) != object.size) {
    // Damaged: filled again (in the hub cache, renamed over: the blob may not be ours).
    if (layout_ == Layout::kObjects) ::unlink(blob.c_str());
    return nullptr;
  }
  Link(object);  // kHub: this commit's link to a blob another commit (or tool) wrote
  // Recently used, for eviction (a read-only cache shared by others keeps its times). Not in the
  // hub cache, which is not evicted from: its blobs are read as local files too (a snapshot
  // opened by path: another rank on this host, the next start), whose identity includes the
  // modification time; a touch would fail those loads with "file changed since the checkpoint
  // was opened".
  if (layout_ == Layout::kObjects) ::utimensat(AT_FDCWD, blob.c_str(), nullptr, 0);
  return std::make_unique<CachedFile>(std::move(fd), object.name, blob, identity);
}

Result<std::unique_ptr<SourceFile>> ObjectCache::Open(
    const CachedObject& object, const FileIdentity& identity, std::vector<std::byte> prefix,
    FetchRange fetch, unsigned concurrency, uint64_t part_size, std::shared_ptr<const void> owner) {
  if (std::unique_ptr<SourceFile> found = Find(object, PlaceOf(object), identity)) {
    hits_.fetch_add(1);
    return found;
  }
  return std::unique_ptr<SourceFile>(new FillingFile(this, object, identity, std::move(prefix),
                                                     std::move(fetch), concurrency, part_size,
                                                     std::move(owner)));
}

std::shared_ptr<ObjectCache::Fill> ObjectCache::Start(const CachedObject& object,
                                                      const FileIdentity& identity,
                                                      std::span<const std::byte> prefix,
                                                      const FetchRange& fetch, unsigned concurrency,
                                                      uint64_t part_size,
                                                      std::unique_ptr<SourceFile>& found) {
  const Place place = PlaceOf(object);
  const std::string& key = place.key;
  const std::string where = Where();
  // One filler per key, across threads and processes: the others wait here (for the whole
  // download: the holder's filler thread runs it to the end), then find its copy.
  UniqueFd lock = Lock(place, object);
  if (lock.get() < 0) return nullptr;
  if ((found = Find(object, place, identity))) {
    hits_.fetch_add(1);
    return nullptr;
  }
  // Downloads of other keys left by processes that died: swept at this cache's first download
  // (of each repository, in the hub layout), else nothing would remove them but a prune.
  bool sweep = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sweep = swept_.insert(layout_ == Layout::kHub ? object.hub_folder : std::string()).second;
  }
  if (sweep && layout_ == Layout::kHub) {
    RemoveHubLeftovers(place.tmp_dir, dir_ + "/.locks/" + object.hub_folder);
  } else if (sweep) {
    RemoveLeftovers(dir_);
  }
  std::string why;
  {
    std::lock_guard<std::mutex> room(room_->mu);
    if (max_bytes_ != 0 && !MakeRoom(key, object.size, why)) {  // kObjects only
      NoteError(where + object.name + " not cached: " + why);
      return nullptr;
    }
    room_->reserved += object.size;
  }
  const auto unreserve = [this, &object] {
    std::lock_guard<std::mutex> room(room_->mu);
    room_->reserved -= object.size;
  };
  // Downloads of this key left by a process that died (we hold the key's lock).
  if (DIR* d = ::opendir(place.tmp_dir.c_str())) {
    const std::string& stem = place.tmp_stem;
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      if (name.size() > stem.size() && name.compare(0, stem.size(), stem) == 0) {
        ::unlinkat(::dirfd(d), e->d_name, 0);
      }
    }
    ::closedir(d);
  }
  static std::atomic<uint64_t> serial{0};
  auto fill = std::make_shared<Fill>();
  fill->tmp = place.tmp_dir + "/" + place.tmp_stem + std::to_string(::getpid()) + "." +
              std::to_string(serial.fetch_add(1));
  fill->blob = place.blob;
  fill->want = WantPath(place.lock);
  fill->generation = abandoned_generation.load(std::memory_order_relaxed);
  fill->fd = UniqueFd(::open(fill->tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fill->fd.get() < 0) {
    unreserve();
    NoteError(where + object.name + " not cached: cannot create " + fill->tmp + ": " +
              Errno(errno));
    return nullptr;
  }
  // Reserve the space first: a full disk is found before any byte is downloaded. (fallocate(2),
  // not posix_fallocate: where the file system cannot reserve, glibc's fallback would write the
  // whole file once more in zeros.)
  const size_t head = static_cast<size_t>(std::min<uint64_t>(prefix.size(), object.size));
  int e = 0;
  if (::fallocate(fill->fd.get(), 0, 0, static_cast<off_t>(object.size)) != 0 &&
      errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL) {
    why = "cannot reserve " + std::to_string(object.size) + " bytes for " + fill->tmp + ": " +
          Errno(errno);
  } else if ((e = PwriteFully(fill->fd.get(), prefix.first(head), 0)) != 0) {
    why = "cannot write " + fill->tmp + ": " + Errno(e);
  }
  if (!why.empty()) {
    unreserve();
    ::unlink(fill->tmp.c_str());
    NoteError(where + object.name + " not cached: " + why);
    return nullptr;
  }
  fill->object = object;
  fill->key = key;
  fill->lock = std::move(lock);
  fill->fetch = fetch;
  fill->threads = std::max(1u, concurrency);
  fill->head = head;
  // Parts small enough for `threads` buffers to fit kFillBuffers together, but not below 2 MiB
  // (or part_size): fewer threads then. Small parts, few bytes in flight: the filler supplements
  // the load's own reads rather than competing with them for the network, the disk and the copy's
  // inode lock (16 MiB against 128 MiB: the first start 2.6 s against 5.0 s, 296 against 410 MiB
  // peak, docs/benchmarks.md "`hf://` streamed and kept in the hub cache").
  fill->part = std::clamp<uint64_t>(std::min<uint64_t>(part_size, kFillBuffers / fill->threads),
                                    std::min<uint64_t>(part_size, kMinFillPart), kFillBuffers);
  fill->part = std::max<uint64_t>(fill->part, 64u << 10);
  fill->threads =
      static_cast<unsigned>(std::clamp<uint64_t>(kFillBuffers / fill->part, 1, fill->threads));
  fill->top = object.size;
  fills_.fetch_add(1);
  fill_bytes_.fetch_add(object.size);
  // The read that started this download is one (its Reading begins after this returns): the
  // filler's turn is not before kQuiet from now.
  last_read_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                      std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!filler_.joinable()) {
      try {
        filler_ = std::thread([this] { FillerLoop(); });
      } catch (const std::system_error& error) {  // no thread to be had (a process at its limit)
        why = std::string("cannot start the filler thread: ") + error.what();
      }
    }
    if (why.empty()) {
      queue_.push_back(fill);
      ++active_;
    }
  }
  if (!why.empty()) {
    unreserve();
    ::unlink(fill->tmp.c_str());
    NoteError(where + object.name + " not cached: " + why);
    return nullptr;
  }
  queue_cv_.notify_one();
  return fill;
}

void ObjectCache::FillerLoop() {
  RunInBackground();
  for (;;) {
    std::shared_ptr<Fill> fill;
    {
      std::unique_lock<std::mutex> lk(mu_);
      queue_cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to download
      fill = std::move(queue_.front());
      queue_.pop_front();
    }
    RunFill(*fill);
    fill.reset();  // its copy's descriptor closes with the last reader
    std::lock_guard<std::mutex> lk(mu_);
    if (--active_ == 0) idle_cv_.notify_all();
  }
}

void ObjectCache::Drain() {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [this] { return active_ == 0; });
}

ObjectCache::Reading::Reading(ObjectCache& cache) : cache_(cache) {
  cache_.reading_.fetch_add(1, std::memory_order_relaxed);
}

ObjectCache::Reading::~Reading() {
  cache_.last_read_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                             std::memory_order_relaxed);
  cache_.reading_.fetch_sub(1, std::memory_order_release);
}

std::chrono::nanoseconds ObjectCache::ReadsIdleFor() const {
  if (reading_.load(std::memory_order_acquire) != 0) return std::chrono::nanoseconds(-1);
  using Clock = std::chrono::steady_clock;
  return Clock::now() -
         Clock::time_point(Clock::duration(last_read_ns_.load(std::memory_order_relaxed)));
}

bool ObjectCache::Busy() const {
  std::lock_guard<std::mutex> lk(mu_);
  return active_ != 0;
}

void ObjectCache::RunFill(Fill& fill) {
  // What no reader claims, from the top down, `threads` ranges at a time, each into a buffer of
  // its own (at most `part` bytes, reused range after range); then what readers gave back after
  // the last scan, until nothing is left.
  for (;;) {
    ParallelFor(fill.threads, fill.threads, [&](size_t) {
      RunInBackground();
      std::vector<std::byte> buffer;
      uint64_t begin = 0, end = 0;
      while (fill.AwaitTurn(*this), fill.NextFromTop(begin, end)) {
        buffer.resize(static_cast<size_t>(end - begin));
        if (fill.FetchClaim(begin, buffer).ok()) fill.Write(begin, buffer);  // else given up
      }
    });
    std::unique_lock<std::mutex> lk(fill.mu);
    fill.cv.wait(lk, [&] { return fill.busy == 0; });  // the readers' claims, written or not
    if (fill.failed || fill.Whole() || !fill.gave_back) break;
  }
  Finish(fill);
}

void ObjectCache::Finish(Fill& fill) {
  const std::string where = Where();
  std::string why;
  {
    // Parts readers are still fetching.
    std::unique_lock<std::mutex> lk(fill.mu);
    fill.cv.wait(lk, [&] { return fill.busy == 0; });
    if (!fill.failed && !fill.Whole()) {
      fill.failed = true;
      fill.why = "download incomplete";
    }
    if (fill.failed) why = "download failed: " + fill.why;
  }
  if (why.empty()) why = Commit(fill.object, fill.fd.get(), fill.tmp, fill.blob);
  if (!why.empty()) {
    ::unlink(fill.tmp.c_str());
    NoteError(where + fill.object.name + " not cached: " + why);
  }
  {
    std::lock_guard<std::mutex> room(room_->mu);
    room_->reserved -= fill.object.size;
  }
  bool distrusted = false, drop_pages = false;
  {
    std::lock_guard<std::mutex> lk(fill.mu);
    fill.finished = true;
    if (!why.empty()) {
      fill.failed = true;
    } else if (fill.failed) {
      distrusted = true;  // Distrust() came while the copy was being committed
    }
    drop_pages = fill.drop_pages && !fill.failed;
  }
  if (distrusted) static_cast<void>(DropCopy(fill.blob, fill.fd.get()));
  if (drop_pages) {  // asked for while downloading (drop_cache); a cache: best effort
    static_cast<void>(io::DropPages(fill.fd.get(), fill.blob));
  }
  ReleaseKeyLock(fill.lock);  // the key is free: waiting openers find the entry (or fill it)
}

std::string ObjectCache::Commit(const CachedObject& object, int fd, const std::string& tmp,
                                const std::string& blob) {
  if (::fsync(fd) != 0) {
    return "cannot write " + tmp + " to disk (fsync): " + Errno(errno);
  }
  if (layout_ == Layout::kObjects) {
    // What the entry is, beside it; then the entry itself, whole.
    std::string meta = "{\"url\":";
    json::AppendString(meta, object.name);
    meta += ",\"request_url\":";
    json::AppendString(meta, object.request_url);
    meta += ",\"etag\":";
    json::AppendString(meta, object.etag);
    meta += ",\"size\":";
    json::AppendUint(meta, object.size);
    meta += ",\"created\":";
    json::AppendUint(meta, static_cast<uint64_t>(std::time(nullptr)));
    meta += "}\n";
    const std::string meta_tmp = tmp + ".json";
    UniqueFd m(::open(meta_tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    const int e =
        m.get() < 0 ? errno : PwriteFully(m.get(), std::as_bytes(std::span<const char>(meta)), 0);
    if (e != 0 || ::rename(meta_tmp.c_str(), (blob + ".json").c_str()) != 0) {
      const std::string why = "cannot write " + meta_tmp + ": " + Errno(e != 0 ? e : errno);
      ::unlink(meta_tmp.c_str());
      return why;
    }
  }
  if (Status renamed = Env::Default()->RenameFile(tmp, blob); !renamed.ok()) {
    return renamed.message();
  }
  // A cache: best effort.
  static_cast<void>(Env::Default()->SyncDirectory(fs::path(blob).parent_path().string()));
  Link(object);
  return "";
}

bool ObjectCache::MakeRoom(const std::string& keep, uint64_t incoming, std::string& why) {
  const uint64_t reserved = room_->reserved;
  if (incoming > max_bytes_ || reserved + incoming > max_bytes_) {
    if (incoming <= max_bytes_) {
      why = std::to_string(incoming) + " bytes do not fit object_cache_max (" +
            std::to_string(max_bytes_) + ") beside the " + std::to_string(reserved) +
            " bytes of downloads in progress";
      return false;
    }
    why = std::to_string(incoming) + " bytes, more than object_cache_max (" +
          std::to_string(max_bytes_) + ")";
    return false;
  }
  std::vector<ObjectCacheEntry> removed;
  const uint64_t total = EvictUntil(dir_, max_bytes_ - incoming - reserved, keep, removed, nullptr);
  evicted_.fetch_add(removed.size());
  if (total + reserved + incoming > max_bytes_) {
    why = "object_cache_max (" + std::to_string(max_bytes_) + " bytes) holds " +
          std::to_string(total) + " bytes of entries in use; " + std::to_string(incoming) +
          " more do not fit";
    return false;
  }
  return true;
}

}  // namespace objstore

Result<std::vector<ObjectCacheEntry>> ListObjectCache(const std::string& dir) {
  TF_ASSIGN_OR_RETURN(std::vector<objstore::Scanned> scanned, objstore::ScanEntries(dir));
  std::vector<ObjectCacheEntry> out;
  for (objstore::Scanned& e : scanned) out.push_back(std::move(e.entry));
  std::reverse(out.begin(), out.end());  // most recently used first
  return out;
}

Result<ObjectCacheDownloads> ObjectCacheDownloadsIn(const std::string& dir) {
  struct stat blobs {};
  if (::stat((dir + "/blobs").c_str(), &blobs) != 0 || !S_ISDIR(blobs.st_mode)) {
    return Status(Code::kNotFound, dir + ": not an object cache (no blobs/)");
  }
  ObjectCacheDownloads out;
  const std::string tmp = dir + "/tmp";
  DIR* d = ::opendir(tmp.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return out;
    return Status(Code::kIoError, tmp + ": cannot list: " + objstore::Errno(errno));
  }
  while (const dirent* e = ::readdir(d)) {
    // tmp/<key>.<pid>.<n>[.json], as RemoveLeftovers reads them.
    const std::string_view name = e->d_name;
    struct stat st {};
    if (name.size() <= 64 || name[64] != '.' || !objstore::IsKey(name.substr(0, 64)) ||
        ::fstatat(::dirfd(d), e->d_name, &st, 0) != 0 || !S_ISREG(st.st_mode)) {
      continue;
    }
    // Held: a shared lock is refused while the downloading process holds the key (a lock file
    // that does not exist is held by nobody). Taken for a moment when free: a download of the
    // key starting now waits for it, as for any holder.
    const std::string lock = dir + "/locks/" + std::string(name.substr(0, 64)) + ".lock";
    const UniqueFd fd(::open(lock.c_str(), O_RDONLY | O_CLOEXEC));
    const bool running = fd.get() >= 0 && ::flock(fd.get(), LOCK_SH | LOCK_NB) != 0;
    const uint64_t bytes = static_cast<uint64_t>(st.st_blocks) * 512;
    // A download's description (<tmp>.json, written as it commits) is no download of its own.
    const bool description = name.size() > 5 && name.substr(name.size() - 5) == ".json";
    if (!description) (running ? out.running : out.left_over) += 1;
    (running ? out.running_bytes : out.left_over_bytes) += bytes;
  }
  ::closedir(d);
  return out;
}

Result<std::vector<ObjectCacheEntry>> PruneObjectCache(const std::string& dir, uint64_t max_bytes) {
  TF_RETURN_IF_ERROR(objstore::ScanEntries(dir).status());
  std::vector<ObjectCacheEntry> removed;
  std::string error;
  const uint64_t left = objstore::EvictUntil(dir, max_bytes, "", removed, &error);
  objstore::RemoveLeftovers(dir);
  if (left > max_bytes && !error.empty()) {
    return Status(Code::kIoError, dir + ": " + std::to_string(left) + " bytes left, more than " +
                                      std::to_string(max_bytes) + ", after removing " +
                                      std::to_string(removed.size()) +
                                      " entries: an entry could not be removed: " + error);
  }
  return removed;
}

}  // namespace tensorferry

// The local disk cache of object-store files (object_cache.h).
#include "objstore/object_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <utility>
#include <vector>

#include <simdjson.h>

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

constexpr uint64_t kFillBuffers = 128u << 20;  // the download's buffers, all threads together

std::string Errno(int error) {
  return std::strerror(error);
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

// Flock that retries on EINTR; 0 or errno.
int Flock(int fd, int how) {
  while (::flock(fd, how) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

bool IsKey(std::string_view name) {
  if (name.size() != 64) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
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
// does.
UniqueFd TryLockKey(const std::string& dir, const std::string& key) {
  UniqueFd fd(
      ::open((dir + "/locks/" + key + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (fd.get() >= 0 && ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) fd.Reset();
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
                    std::vector<ObjectCacheEntry>& removed) {
  Result<std::vector<Scanned>> scanned = ScanEntries(dir);
  if (!scanned.ok()) return 0;
  uint64_t total = 0;
  for (const Scanned& s : *scanned) total += s.entry.size;
  const std::string blobs = dir + "/blobs/";
  for (const Scanned& s : *scanned) {
    if (total <= budget) break;
    if (s.entry.key == keep) continue;
    // Never under a filler (or anyone holding the key): try, don't wait.
    const UniqueFd lock = TryLockKey(dir, s.entry.key);
    if (lock.get() < 0) continue;
    // Readers that opened it keep reading: an unlinked file lives while it is open.
    if (::unlink((blobs + s.entry.key).c_str()) == 0) {
      ::unlink((blobs + s.entry.key + ".json").c_str());
      total -= s.entry.size;
      removed.push_back(s.entry);
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

}  // namespace

ObjectCache::ObjectCache(std::string dir, uint64_t max_bytes)
    : dir_(std::move(dir)), max_bytes_(max_bytes) {}

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
  std::lock_guard<std::mutex> lock(mu_);
  s.last_error = last_error_;
  return s;
}

void ObjectCache::NoteError(const std::string& why) {
  errors_.fetch_add(1);
  std::lock_guard<std::mutex> lock(mu_);
  last_error_ = why;
}

Result<std::unique_ptr<SourceFile>> ObjectCache::Find(const CachedObject& object,
                                                      const std::string& key,
                                                      const FileIdentity& identity) {
  const std::string blob = dir_ + "/blobs/" + key;
  UniqueFd fd(::open(blob.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return std::unique_ptr<SourceFile>();
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) != object.size) {
    ::unlink(blob.c_str());  // damaged: filled again
    return std::unique_ptr<SourceFile>();
  }
  // Recently used, for eviction (a read-only cache shared by others keeps its times).
  ::utimensat(AT_FDCWD, blob.c_str(), nullptr, 0);
  return std::unique_ptr<SourceFile>(new CachedFile(std::move(fd), object.name, blob, identity));
}

Result<std::unique_ptr<SourceFile>> ObjectCache::Open(const CachedObject& object,
                                                      const FileIdentity& identity,
                                                      std::span<const std::byte> prefix,
                                                      const FetchRange& fetch, unsigned concurrency,
                                                      uint64_t part_size) {
  const std::string key = Key(object);
  TF_ASSIGN_OR_RETURN(std::unique_ptr<SourceFile> found, Find(object, key, identity));
  if (found) {
    hits_.fetch_add(1);
    return found;
  }
  const std::string where = "object cache " + dir_ + ": ";
  std::error_code ec;
  for (const char* sub : {"blobs", "locks", "tmp"}) {
    fs::create_directories(dir_ + "/" + sub, ec);
    if (ec) {
      NoteError(where + "cannot create " + dir_ + "/" + sub + ": " + ec.message());
      return std::unique_ptr<SourceFile>();
    }
  }
  // One filler per key, across threads and processes: the others wait here, then find its copy.
  const std::string lock_path = dir_ + "/locks/" + key + ".lock";
  UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (lock.get() < 0 || Flock(lock.get(), LOCK_EX) != 0) {
    NoteError(where + "cannot lock " + lock_path + ": " + Errno(errno));
    return std::unique_ptr<SourceFile>();
  }
  TF_ASSIGN_OR_RETURN(found, Find(object, key, identity));
  if (found) {
    hits_.fetch_add(1);
    return found;
  }
  // One download at a time per cache object: opens run in parallel (Checkpoint::Open opens an
  // object checkpoint's files several at a time), and each download already keeps `concurrency`
  // GETs in flight.
  std::lock_guard<std::mutex> filling(fill_mu_);
  std::string why;
  if (max_bytes_ != 0 && !MakeRoom(key, object.size, why)) {
    NoteError(where + object.name + " not cached: " + why);
    return std::unique_ptr<SourceFile>();
  }
  TF_ASSIGN_OR_RETURN(const bool filled,
                      Fill(object, key, prefix, fetch, concurrency, part_size, why));
  if (!filled) {
    NoteError(where + object.name + " not cached: " + why);
    return std::unique_ptr<SourceFile>();
  }
  fills_.fetch_add(1);
  fill_bytes_.fetch_add(object.size);
  TF_ASSIGN_OR_RETURN(found, Find(object, key, identity));
  if (!found) {
    NoteError(where + object.name + ": the entry just written is gone");
  }
  return found;
}

Result<bool> ObjectCache::Fill(const CachedObject& object, const std::string& key,
                               std::span<const std::byte> prefix, const FetchRange& fetch,
                               unsigned concurrency, uint64_t part_size, std::string& why) {
  // Downloads of this key left by a process that died (we hold the key's lock).
  if (DIR* d = ::opendir((dir_ + "/tmp").c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      if (name.size() > key.size() && name.compare(0, key.size(), key) == 0 &&
          name[key.size()] == '.') {
        ::unlinkat(::dirfd(d), e->d_name, 0);
      }
    }
    ::closedir(d);
  }
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = dir_ + "/tmp/" + key + "." + std::to_string(::getpid()) + "." +
                          std::to_string(serial.fetch_add(1));
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    why = "cannot create " + tmp + ": " + Errno(errno);
    return false;
  }
  struct Cleanup {
    const std::string& path;
    bool armed = true;
    ~Cleanup() {
      if (armed) ::unlink(path.c_str());
    }
  } cleanup{tmp};
  // Reserve the space first: a full disk is found before any byte is downloaded. (fallocate(2),
  // not posix_fallocate: where the file system cannot reserve, glibc's fallback would write the
  // whole file once more in zeros.)
  if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(object.size)) != 0 && errno != EOPNOTSUPP &&
      errno != ENOSYS && errno != EINVAL) {
    why =
        "cannot reserve " + std::to_string(object.size) + " bytes for " + tmp + ": " + Errno(errno);
    return false;
  }
  const size_t head = static_cast<size_t>(std::min<uint64_t>(prefix.size(), object.size));
  if (const int e = PwriteFully(fd.get(), prefix.first(head), 0); e != 0) {
    why = "cannot write " + tmp + ": " + Errno(e);
    return false;
  }
  // The rest in parts, `concurrency` downloads at a time, each into a buffer of its own (taken
  // from a pool: at most one per thread, reused part after part).
  const unsigned threads = std::max(1u, concurrency);
  const uint64_t part = std::clamp<uint64_t>(std::min<uint64_t>(part_size, kFillBuffers / threads),
                                             64u << 10, kFillBuffers);
  const uint64_t rest = object.size - head;
  const uint64_t parts = (rest + part - 1) / part;
  std::mutex mu;
  std::vector<std::vector<std::byte>> buffers;  // free ones
  std::string write_error;
  const Status fetched = ParallelForUntilError(
      static_cast<size_t>(parts), static_cast<unsigned>(std::min<uint64_t>(threads, parts)),
      [&](size_t i) -> Status {
        const uint64_t offset = head + i * part;
        const size_t n = static_cast<size_t>(std::min<uint64_t>(part, object.size - offset));
        std::vector<std::byte> buffer;
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!buffers.empty()) {
            buffer = std::move(buffers.back());
            buffers.pop_back();
          }
        }
        buffer.resize(n);
        TF_RETURN_IF_ERROR(fetch(offset, std::span<std::byte>(buffer.data(), n)));
        if (const int e = PwriteFully(fd.get(), buffer, offset); e != 0) {
          std::lock_guard<std::mutex> lock(mu);
          write_error = "cannot write " + tmp + ": " + Errno(e);
          return Status(Code::kIoError, write_error);
        }
        // Start writing the part to disk now (asynchronously), so that the fsync at the end
        // waits for the last parts only, not for the whole file.
        ::sync_file_range(fd.get(), static_cast<off_t>(offset), static_cast<off_t>(n),
                          SYNC_FILE_RANGE_WRITE);
        std::lock_guard<std::mutex> lock(mu);
        buffers.push_back(std::move(buffer));
        return Status::Ok();
      });
  if (!write_error.empty()) {
    why = write_error;
    return false;
  }
  if (!fetched.ok()) return fetched;
  if (::fsync(fd.get()) != 0) {
    why = "cannot write " + tmp + " to disk (fsync): " + Errno(errno);
    return false;
  }
  fd.Reset();
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
  {
    UniqueFd m(::open(meta_tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    const int e =
        m.get() < 0 ? errno : PwriteFully(m.get(), std::as_bytes(std::span<const char>(meta)), 0);
    if (e != 0 || ::rename(meta_tmp.c_str(), (dir_ + "/blobs/" + key + ".json").c_str()) != 0) {
      why = "cannot write " + meta_tmp + ": " + Errno(e != 0 ? e : errno);
      ::unlink(meta_tmp.c_str());
      return false;
    }
  }
  const std::string blob = dir_ + "/blobs/" + key;
  if (Status renamed = Env::Default()->RenameFile(tmp, blob); !renamed.ok()) {
    why = renamed.message();
    return false;
  }
  cleanup.armed = false;
  static_cast<void>(Env::Default()->SyncDirectory(dir_ + "/blobs"));  // a cache: best effort
  return true;
}

bool ObjectCache::MakeRoom(const std::string& keep, uint64_t incoming, std::string& why) {
  if (incoming > max_bytes_) {
    why = std::to_string(incoming) + " bytes, more than object_cache_max (" +
          std::to_string(max_bytes_) + ")";
    return false;
  }
  std::vector<ObjectCacheEntry> removed;
  const uint64_t total = EvictUntil(dir_, max_bytes_ - incoming, keep, removed);
  evicted_.fetch_add(removed.size());
  if (total + incoming > max_bytes_) {
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

Result<std::vector<ObjectCacheEntry>> PruneObjectCache(const std::string& dir, uint64_t max_bytes) {
  TF_RETURN_IF_ERROR(objstore::ScanEntries(dir).status());
  std::vector<ObjectCacheEntry> removed;
  objstore::EvictUntil(dir, max_bytes, "", removed);
  objstore::RemoveLeftovers(dir);
  return removed;
}

}  // namespace tensorferry

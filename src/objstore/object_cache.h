// Internal: the local disk cache of object-store files (ObjectStoreOptions::cache_dir).
//
// A server restarted, or a second tensor-parallel rank on the same host, should not pull the same
// gigabytes over the network again. With a cache directory, the object Source keeps a whole copy
// of each file it opens on local disk, keyed by what identifies one version of an object: the URL
// it is fetched from (endpoint, bucket and key), its strong ETag and its size. Opening a file
// whose copy exists reads the copy (a SourceFile over a local descriptor); opening one whose copy
// is missing first downloads it into the cache (ranged GETs pinned to the ETag, `concurrency` in
// flight), then reads the copy. A new version of an object (another ETag or size) is another key:
// an entry is never updated in place.
//
// Layout under the directory:
//   blobs/<key>        one complete object (key: 64 hex digits, SHA-256 of URL, ETag and size)
//   blobs/<key>.json   what it is: {"url", "etag", "size", "created"} (for people and tools)
//   locks/<key>.lock   flock(2) target: one process (or thread) fills a key at a time; the others
//                      wait for it and then read its copy
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
// Errors: failures of the cache itself (a directory that cannot be created or written, a full
// disk, max_bytes too small) never fail a load: Open returns nullptr and the caller reads the
// store; the failure is counted (stats().errors) and described (stats().last_error). Failures of
// the store during a fill (the ranged GETs' errors, an object changed under the download) are
// Open's errors, as they would be a load's.
//
// Thread-safety: an ObjectCache may be used from several threads (its downloads run one at a time:
// each keeps `concurrency` GETs in flight); several processes may share one directory.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "tensorferry/source.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

// One version of one object.
struct CachedObject {
  std::string name;         // the URL messages name ("s3://bucket/key")
  std::string request_url;  // the URL it is fetched from (the endpoint included)
  std::string etag;         // strong, never empty
  uint64_t size = 0;
};

// Reads [offset, offset + dst.size()) of the object into dst completely.
using FetchRange = std::function<Status(uint64_t offset, std::span<std::byte> dst)>;

struct ObjectCacheStats {
  uint64_t hits = 0;        // opens served by an entry that existed
  uint64_t fills = 0;       // objects downloaded into the cache
  uint64_t fill_bytes = 0;  // their bytes
  uint64_t evicted = 0;     // entries removed to make room
  uint64_t errors = 0;      // opens that read the store because the cache failed
  std::string last_error;   // the latest of those failures, in words
};

class ObjectCache {
 public:
  // `dir` is created (with its parents) at the first Open; max_bytes 0: unbounded.
  ObjectCache(std::string dir, uint64_t max_bytes);

  // The entry of `object` as a SourceFile whose path() is object.name and identity `identity`,
  // downloaded first when missing: `prefix` (its first bytes, already fetched) is written as is
  // and the rest fetched by `fetch` in parts of at most `part_size` bytes, `concurrency` at a
  // time (buffers: at most 128 MiB together). nullptr when the cache cannot hold it (counted in
  // stats()). Errors: `fetch`'s.
  Result<std::unique_ptr<SourceFile>> Open(const CachedObject& object, const FileIdentity& identity,
                                           std::span<const std::byte> prefix,
                                           const FetchRange& fetch, unsigned concurrency,
                                           uint64_t part_size);

  const std::string& dir() const noexcept { return dir_; }
  ObjectCacheStats stats() const;

  // The entry name of `object` (64 lower-case hex digits).
  static std::string Key(const CachedObject& object);

 private:
  // The entry if it is whole (nullptr if absent; a blob of the wrong size is removed).
  Result<std::unique_ptr<SourceFile>> Find(const CachedObject& object, const std::string& key,
                                           const FileIdentity& identity);
  // Downloads `object` into tmp/ and renames it into blobs/; false (with `why`) when the cache
  // failed; errors are fetch's.
  Result<bool> Fill(const CachedObject& object, const std::string& key,
                    std::span<const std::byte> prefix, const FetchRange& fetch,
                    unsigned concurrency, uint64_t part_size, std::string& why);
  // Removes least recently used entries until `incoming` more bytes fit under max_bytes_; false
  // (with `why`) when they cannot.
  bool MakeRoom(const std::string& keep, uint64_t incoming, std::string& why);
  void NoteError(const std::string& why);

  const std::string dir_;
  const uint64_t max_bytes_;
  std::atomic<uint64_t> hits_{0}, fills_{0}, fill_bytes_{0}, evicted_{0}, errors_{0};
  std::mutex fill_mu_;  // held by the one download in progress
  mutable std::mutex mu_;
  std::string last_error_;
};

}  // namespace tensorferry::objstore

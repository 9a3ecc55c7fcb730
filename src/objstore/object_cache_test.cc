// The local cache of object-store files (object_cache.h) with an in-memory object: fills
// overlapped with reads, hits, versions, damage, failures of the store and of the cache,
// concurrent fillers, eviction.
// src/objstore/object_source_live_test.cc and tests/python/test_object_store_cache.py drive it
// through a real S3 server.
#include "objstore/object_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "io/read_engine.h"
#include "tensorferry/object_store.h"
#include "tensorferry/residency.h"
#include "testing/test_util.h"

namespace tensorferry::objstore {
namespace {

namespace fs = std::filesystem;
using testing::Contains;

// An object in memory, and a fetch of its ranges that counts what it was asked for.
struct Remote {
  std::vector<std::byte> bytes;
  std::string etag = "\"v1\"";
  std::atomic<uint64_t> fetched{0}, calls{0};
  std::atomic<int> fail_from_call{-1};   // every call from this one (0-based) on fails; -1: none
  std::atomic<int> cancel_call{-1};      // this call (0-based) is cancelled (its load's flag)
  std::atomic<int64_t> fail_offset{-1};  // the first fetch at this offset fails; -1: none
  std::atomic<int64_t> hold_offset{-1};  // a fetch at this offset waits for `released`
  std::atomic<bool> released{false};
  std::atomic<int64_t> watch_from{-1};  // fetches reaching this offset or beyond are counted
  // A fetch at this offset trickles: its bytes arrive over `trickle_ms`, a few at a time (told
  // to its on_body every 20 ms), as from a server sending less than 1 MB/s.
  std::atomic<int64_t> trickle_offset{-1};
  int trickle_ms = 0;
  std::atomic<int> watched{0};

  explicit Remote(size_t size, unsigned seed = 1) : bytes(testing::Pattern(size, seed)) {}

  CachedObject Object(const std::string& url = "http://127.0.0.1:9/b/model.safetensors") const {
    CachedObject o;
    o.name = o.request_url = url;
    o.etag = etag;
    o.size = bytes.size();
    return o;
  }
  // The same object as a file of the hub (ObjectCache::Layout::kHub).
  CachedObject HubObject(const std::string& path = "model.safetensors",
                         const std::string& commit = std::string(40, 'a')) const {
    CachedObject o = Object();
    o.hub_folder = "models--org--tiny";
    o.hub_commit = commit;
    o.hub_path = path;
    o.hub_blob = std::string(64, 'b');
    return o;
  }
  FileIdentity Identity() const {
    FileIdentity id;
    id.size = bytes.size();
    id.inode = std::hash<std::string>()(etag);
    return id;
  }
  FetchRange Fetch() {
    return
        [this](uint64_t offset, std::span<std::byte> dst, const BodyProgress* on_body) -> Status {
          const int call = static_cast<int>(calls.fetch_add(1));
          if (call == cancel_call.load()) {
            return Status(Code::kCancelled, "GET cancelled: the load was cancelled");
          }
          const int from = fail_from_call.load();
          int64_t at = static_cast<int64_t>(offset);
          if ((from >= 0 && call >= from) || fail_offset.compare_exchange_strong(at, -1)) {
            return Status(Code::kIoError, "GET failed: HTTP 403 AccessDenied");
          }
          if (hold_offset.load() == static_cast<int64_t>(offset)) {
            while (!released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          if (trickle_offset.load() == static_cast<int64_t>(offset)) {
            for (int ms = 0; ms < trickle_ms; ms += 20) {
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
              if (on_body != nullptr) (*on_body)(1);
            }
          }
          if (const int64_t w = watch_from.load(); w >= 0 && offset + dst.size() > uint64_t(w)) {
            ++watched;
          }
          EXPECT_LE(offset + dst.size(), bytes.size());
          std::memcpy(dst.data(), bytes.data() + offset, dst.size());
          fetched += dst.size();
          return Status::Ok();
        };
  }
  // Opens through `cache` with the first `head` bytes as the open's prefix.
  Result<std::unique_ptr<SourceFile>> Open(ObjectCache& cache, size_t head = 4096,
                                           unsigned concurrency = 4, uint64_t part = 64u << 10,
                                           const std::string& url = "") {
    return OpenAs(cache, url.empty() ? Object() : Object(url), head, concurrency, part);
  }
  Result<std::unique_ptr<SourceFile>> OpenAs(ObjectCache& cache, const CachedObject& object,
                                             size_t head = 4096, unsigned concurrency = 4,
                                             uint64_t part = 64u << 10) {
    return cache.Open(object, Identity(),
                      std::vector<std::byte>(bytes.begin(), bytes.begin() + head), Fetch(),
                      concurrency, part);
  }
};

std::vector<std::byte> ReadAll(const SourceFile& file) {
  std::vector<std::byte> out(static_cast<size_t>(file.identity().size));
  Result<size_t> n = file.Read(0, out);
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  if (n.ok()) {
    EXPECT_EQ(*n, out.size());
  }
  return out;
}

// Opens `remote` through `cache`, reads it whole and waits for its download: a filled entry.
void Fill(ObjectCache& cache, Remote& remote, const std::string& url = "") {
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10, url);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  cache.Drain();
}

// Returns once another ObjectCache holds the lock of `object`'s key in the cache `dir` (its
// download began).
void AwaitLocked(const std::string& dir, const CachedObject& object) {
  const std::string lock = dir + "/locks/" + ObjectCache::Key(object) + ".lock";
  for (;;) {
    const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
    const bool held = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0;
    if (fd >= 0) ::close(fd);
    if (held) return;
    std::this_thread::yield();
  }
}

// Opens (creating it) and locks the lock file `path` as another process would (huggingface_hub,
// a filler); an empty UniqueFd when it cannot (a failure added).
UniqueFd HoldLock(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0664));
  if (fd.get() < 0 || ::flock(fd.get(), LOCK_EX) != 0) {
    ADD_FAILURE() << path << ": cannot open and lock: " << std::strerror(errno);
    return UniqueFd();
  }
  return fd;
}

size_t CountFiles(const std::string& dir) {
  size_t n = 0;
  if (fs::exists(dir)) {
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
  }
  return n;
}

TEST(ObjectCache, FillsOnceThenReadsTheCopy) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  {
    ObjectCache cache(tmp.Join("cache"), 0);
    Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ASSERT_NE(*file, nullptr);
    EXPECT_EQ(ReadAll(**file), remote.bytes);
    EXPECT_EQ((*file)->path(), remote.Object().name);  // messages name the URL
    EXPECT_EQ((*file)->identity(), remote.Identity());
    EXPECT_TRUE((*file)->CheckUnchanged().ok());
    cache.Drain();
    // The prefix is not fetched again; every other byte exactly once.
    EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
    const ObjectCacheStats s = cache.stats();
    EXPECT_EQ(s.fills, 1u);
    EXPECT_EQ(s.fill_bytes, remote.bytes.size());
    EXPECT_EQ(s.hits, 0u);
    EXPECT_EQ(s.errors, 0u) << s.last_error;
    const std::string key = ObjectCache::Key(remote.Object());
    EXPECT_EQ(testing::ReadBytes(tmp.Join("cache/blobs/" + key)),
              std::string(reinterpret_cast<const char*>(remote.bytes.data()), remote.bytes.size()));
    const std::string meta = testing::ReadBytes(tmp.Join("cache/blobs/" + key + ".json"));
    EXPECT_TRUE(Contains(meta, "\"url\":\"http://127.0.0.1:9/b/model.safetensors\""));
    EXPECT_TRUE(Contains(meta, "\"etag\":\"\\\"v1\\\"\""));
    EXPECT_TRUE(Contains(meta, "\"size\":1000000"));
    EXPECT_EQ(CountFiles(tmp.Join("cache/tmp")), 0u);
    // The file keeps reading (its copy, now the entry).
    std::vector<std::byte> some(1000);
    ASSERT_TRUE((*file)->Read(500'000, some).ok());
    EXPECT_TRUE(std::equal(some.begin(), some.end(), remote.bytes.begin() + 500'000));
  }
  // Another process (another cache object on the directory): a hit, nothing fetched.
  remote.fetched = 0;
  ObjectCache again(tmp.Join("cache"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(again);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  EXPECT_EQ(remote.fetched.load(), 0u);
  EXPECT_EQ(again.stats().hits, 1u);
  EXPECT_EQ(again.stats().fills, 0u);
  // Reads past the end stop at the end, as a file's do.
  std::vector<std::byte> tail(100);
  Result<size_t> n = (*file)->Read(remote.bytes.size() - 10, tail);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 10u);
}

TEST(ObjectCache, HeaderReadsWithinThePrefixDownloadNothing) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  {
    ObjectCache cache(tmp.Join("c"), 0);
    Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
    ASSERT_TRUE(file.ok() && *file != nullptr);
    std::vector<std::byte> header(4096);
    Result<size_t> n = (*file)->Read(0, header);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, 4096u);
    EXPECT_TRUE(std::equal(header.begin(), header.end(), remote.bytes.begin()));
    EXPECT_EQ(cache.stats().fills, 0u);
  }
  // An inspection of a checkpoint fetches nor writes anything more.
  EXPECT_EQ(remote.calls.load(), 0u);
  EXPECT_FALSE(fs::exists(tmp.Join("c")));
}

TEST(ObjectCache, ReadsFetchWhatTheFillerHasNotClaimed) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  // The filler downloads from the end down, 64 KiB at a time: its first range is held until
  // the end.
  remote.hold_offset = static_cast<int64_t>(remote.bytes.size() - (64u << 10));
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  // Bytes after the header, while the filler is stuck: served at once (this read fetches
  // exactly its bytes, into its buffer and the copy).
  std::vector<std::byte> some(100'000);
  Result<size_t> n = (*file)->Read(5000, some);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_TRUE(std::equal(some.begin(), some.end(), remote.bytes.begin() + 5000));
  remote.released = true;
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  cache.Drain();
  // Every byte fetched once, by whoever came first; the copy whole.
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  EXPECT_EQ(testing::ReadBytes(blob),
            std::string(reinterpret_cast<const char*>(remote.bytes.data()), remote.bytes.size()));
  EXPECT_EQ(cache.stats().errors, 0u) << cache.stats().last_error;
}

// A read of bytes another reader (here the filler) is fetching waits for them, unless its load is
// cancelled: then it returns kCancelled at once instead of waiting for that fetch (which may
// take minutes of retries), and the fetch goes on for the others.
TEST(ObjectCache, ACancelledReadStopsWaitingForAnotherReadersFetch) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  const uint64_t top = remote.bytes.size() - (64u << 10);  // the filler's first range: held
  remote.hold_offset = static_cast<int64_t>(top);
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  std::vector<std::byte> got(1000);
  ASSERT_TRUE((*file)->Read(5000, got).ok());  // starts the download: one fetch
  ASSERT_EQ(remote.calls.load(), 1u);
  // The filler starts once reads are quiet, from the top: its fetch is held.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (remote.calls.load() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(remote.calls.load(), 2u);  // (its other fetches, lower down, go on)
  {
    const std::atomic<bool> cancelled{true};
    const io::CancelScope scope(&cancelled);
    const auto start = std::chrono::steady_clock::now();
    Result<size_t> n = (*file)->Read(top + 10, got);
    ASSERT_FALSE(n.ok());
    EXPECT_EQ(n.status().code(), Code::kCancelled) << n.status().ToString();
    EXPECT_TRUE(Contains(n.status().message(), "cancelled while bytes from"));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  }
  // Not cancelled: the same read waits for the filler's fetch and gets its bytes.
  remote.released = true;
  Result<size_t> n = (*file)->Read(top + 10, got);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.bytes.begin() + top + 10));
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  cache.Drain();
  EXPECT_EQ(cache.stats().errors, 0u) << cache.stats().last_error;
}

// A read whose own fetch is cancelled (its load closed, or a cooperative load's read ahead
// abandoned) fails with kCancelled, and its range goes back to the filler: the download is not
// given up, the copy is whole and committed.
TEST(ObjectCache, AReadCancelledDuringItsFetchLeavesTheDownloadToTheFiller) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  remote.cancel_call = 0;
  {
    ObjectCache cache(tmp.Join("c"), 0);
    Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
    ASSERT_TRUE(file.ok() && *file != nullptr);
    std::vector<std::byte> got(1000);
    Result<size_t> n = (*file)->Read(5000, got);  // its own fetch, cancelled
    ASSERT_FALSE(n.ok());
    EXPECT_EQ(n.status().code(), Code::kCancelled) << n.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
    cache.Drain();
    EXPECT_EQ(cache.stats().errors, 0u) << cache.stats().last_error;
    EXPECT_EQ(cache.stats().fills, 1u);
  }
  remote.fetched = 0;
  ObjectCache again(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(again);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  EXPECT_EQ(remote.fetched.load(), 0u);  // from the copy
  EXPECT_EQ(again.stats().hits, 1u);
}

// Reads hand what they fetched to the cache's writer thread through its ring (32 MiB): ranges of
// many sizes from several threads, around the ring many times, one range larger than the ring
// (handed over in pieces), and reads of bytes still queued for writing: every read byte-exact,
// every byte fetched once unless the disk had no room for it (then once more, by the filler), the
// copy whole.
TEST(ObjectCache, ReadsHandTheirBytesToTheWriterThroughItsRing) {
  testing::TempDir tmp;
  constexpr size_t kSize = 72u << 20;
  Remote remote(kSize);
  remote.hold_offset = static_cast<int64_t>(kSize - (64u << 10));  // the filler's first range
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  // Range sizes cycled through by the readers: odd sizes, a few MiB, and one of 33 MiB.
  const std::vector<size_t> sizes = {1000,           (5u << 20) + 7, 3u << 20, 123'457,
                                     (9u << 20) - 1, 33u << 20,      700'001,  (2u << 20) + 3};
  std::atomic<uint64_t> next{4096};
  std::atomic<size_t> turn{0};
  std::atomic<int> wrong{0}, failed{0};
  const auto check = [&](uint64_t at, size_t n) {
    std::vector<std::byte> got(n);
    Result<size_t> r = (*file)->Read(at, got);
    if (!r.ok() || *r != n) {
      ++failed;
    } else if (!std::equal(got.begin(), got.end(), remote.bytes.begin() + at)) {
      ++wrong;
    }
  };
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&] {
      for (;;) {
        const size_t n = sizes[turn.fetch_add(1) % sizes.size()];
        const uint64_t at = next.fetch_add(n);
        if (at >= kSize - (64u << 10)) return;
        const size_t len = static_cast<size_t>(std::min<uint64_t>(n, kSize - (64u << 10) - at));
        check(at, len);
        check(at + len / 2, len - len / 2);  // again, from the copy or the writer's queue
      }
    });
  }
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  remote.released = true;
  cache.Drain();
  EXPECT_EQ(remote.fetched.load(), kSize - 4096 + cache.stats().given_back);
  // A good part of it through the ring, whatever the writer's speed: a writer starved of CPU
  // leaves its ring full, not empty (about 28 MiB of these reads' ranges fit a 32 MiB ring before
  // one does not). How much more the writer takes as the reads go is its speed, a benchmark's
  // matter (docs/benchmarks.md, "Copies into the cache after the load"); on a loaded 2-core VM it
  // took little more than that (given back 38.3 of 72 MiB).
  EXPECT_LT(cache.stats().given_back, kSize * 3 / 4);
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  EXPECT_TRUE(testing::ReadBytes(blob) ==
              std::string(reinterpret_cast<const char*>(remote.bytes.data()), kSize));
  EXPECT_EQ(cache.stats().errors, 0u) << cache.stats().last_error;
}

// A disk that cannot keep up (here: a ring with no room at all, then one that holds one piece):
// the load's reads never wait for it; what they fetched and the ring could not take is given back
// and fetched again by the filler, which scans again for what was given back after it passed (its
// first range is held until the readers are done); the reads byte-exact, the copy whole.
// A ring of 0 or of 1 MiB (smaller than the reads' ranges together): the bytes it has no room
// for are given back and fetched again after the load; with fetch_once the reads wait for room
// (or, with no ring, write their bytes themselves) and each byte is fetched once.
TEST(ObjectCache, WhatTheDiskCannotTakeIsFetchedAgainAfterTheLoadOrWaitedFor) {
  for (const bool fetch_once : {false, true})
    for (const size_t ring : {size_t{0}, size_t{1u << 20}}) {
      SCOPED_TRACE(std::to_string(ring) + (fetch_once ? " fetch_once" : ""));
      testing::TempDir tmp;
      constexpr size_t kSize = 12u << 20;
      Remote remote(kSize);
      remote.hold_offset = static_cast<int64_t>(kSize - (64u << 10));  // the filler's first range
      ObjectCache cache(tmp.Join("c"), 0, ObjectCache::Layout::kObjects, ring, fetch_once);
      Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
      ASSERT_TRUE(file.ok() && *file != nullptr);
      // Ranges of 700 KB from three threads (the ring of 1 MiB takes one at a time) below 3 MiB,
      // and one read of the next 9 MiB less 64 KiB (split into pieces of 4 MiB, none of which fits
      // either ring); then reads of what they read again.
      std::atomic<uint64_t> next{4096};
      std::atomic<int> wrong{0};
      const uint64_t below = kSize - (64u << 10), split = 3u << 20;
      std::vector<std::thread> readers;
      for (int t = 0; t < 4; ++t) {
        readers.emplace_back([&, t] {
          if (t == 3) {
            std::vector<std::byte> got(static_cast<size_t>(below - split));
            for (int again = 0; again < 2; ++again) {
              Result<size_t> r = (*file)->Read(split, got);
              if (!r.ok() || *r != got.size() ||
                  !std::equal(got.begin(), got.end(), remote.bytes.begin() + split)) {
                ++wrong;
              }
            }
            return;
          }
          for (uint64_t at; (at = next.fetch_add(700'000)) < split;) {
            std::vector<std::byte> got(
                static_cast<size_t>(std::min<uint64_t>(700'000, split - at)));
            for (int again = 0; again < 2; ++again) {
              Result<size_t> r = (*file)->Read(at, got);
              if (!r.ok() || *r != got.size() ||
                  !std::equal(got.begin(), got.end(), remote.bytes.begin() + at)) {
                ++wrong;
              }
            }
          }
        });
      }
      for (std::thread& t : readers) t.join();
      EXPECT_EQ(wrong.load(), 0);
      const uint64_t given_back = cache.stats().given_back;
      if (fetch_once) {
        EXPECT_EQ(given_back, 0u);
      } else if (ring == 0) {
        EXPECT_GE(given_back, below - 4096);  // nothing went through the ring (read again: again)
      } else {
        EXPECT_GE(given_back, below - split);  // the large read's pieces fit no ring
      }
      remote.released = true;
      cache.Drain();
      EXPECT_EQ(remote.fetched.load(), kSize - 4096 + given_back);
      const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
      EXPECT_TRUE(testing::ReadBytes(blob) ==
                  std::string(reinterpret_cast<const char*>(remote.bytes.data()), kSize));
      EXPECT_EQ(cache.stats().errors, 0u) << cache.stats().last_error;
      EXPECT_EQ(CountFiles(tmp.Join("c/tmp")), 0u);
    }
}

// The filler leaves the network to the load: nothing above what the load reads is fetched while
// it reads (the file open, reads one after the other); once its reads pause for a second, the
// filler fetches the rest though the file is still open.
TEST(ObjectCache, TheFillerWaitsWhileTheLoadReads) {
  testing::TempDir tmp;
  Remote remote(4u << 20);
  remote.watch_from = 1 << 20;
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  std::vector<std::byte> got(16u << 10);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  for (int round = 0; std::chrono::steady_clock::now() < until; ++round) {
    for (uint64_t at = 4096; at + got.size() <= (1u << 20); at += got.size()) {
      ASSERT_TRUE((*file)->Read(at, got).ok());
    }
  }
  EXPECT_EQ(remote.watched.load(), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (remote.watched.load() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(remote.watched.load(), 0);  // the file still open
  cache.Drain();
  EXPECT_EQ(testing::ReadBytes(tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()))),
            std::string(reinterpret_cast<const char*>(remote.bytes.data()), remote.bytes.size()));
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
}

// A second reader of the same object through another cache of the directory (another process,
// say: a second rank on the host) waits for the first one's download; its wait starts that
// download's filler at once, not when the first one's load is done with the file.
TEST(ObjectCache, AWaiterForTheDownloadStartsItsFiller) {
  testing::TempDir tmp;
  Remote remote(4u << 20);
  ObjectCache first(tmp.Join("c"), 0), second(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> a = remote.Open(first, 4096, 2, 64u << 10);
  Result<std::unique_ptr<SourceFile>> b = remote.Open(second, 4096, 2, 64u << 10);
  ASSERT_TRUE(a.ok() && *a != nullptr && b.ok() && *b != nullptr);
  std::vector<std::byte> head(16u << 10);
  ASSERT_TRUE((*a)->Read(4096, head).ok());  // the first one's download begins
  std::atomic<bool> waited{false}, ok{false};
  std::thread waiter([&] {
    std::vector<std::byte> got(64u << 10);
    Result<size_t> r = (*b)->Read(2u << 20, got);
    ok = r.ok() && std::equal(got.begin(), got.end(), remote.bytes.begin() + (2u << 20));
    waited = true;
  });
  // The first one reads on (up to 30 s) until the second one has its bytes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  bool while_reading = false;
  while (std::chrono::steady_clock::now() < deadline) {
    for (uint64_t at = 4096; at + head.size() <= (1u << 20); at += head.size()) {
      ASSERT_TRUE((*a)->Read(at, head).ok());
    }
    if (waited.load()) {
      while_reading = true;
      break;
    }
  }
  waiter.join();
  EXPECT_TRUE(while_reading);
  EXPECT_TRUE(ok.load());
  EXPECT_EQ(second.stats().hits, 1u);  // it read the first one's copy
  EXPECT_EQ(second.stats().fills, 0u);
}

// A filler that stops (SIGSTOP, a frozen cgroup: here, a fetch that never returns) keeps the
// key's lock: another cache waits for its download only while it progresses, then reads the store.
TEST(ObjectCache, AFillerThatStopsIsWaitedForAtMostLockWait) {
  testing::TempDir tmp;
  Remote remote(1u << 20);
  remote.hold_offset = 4096;  // the first one's read past the header never returns (until released)
  ObjectCache stopped(tmp.Join("c"), 0);
  ObjectCache waiter(tmp.Join("c"), 0, ObjectCache::Layout::kObjects, 32u << 20, false,
                     std::chrono::milliseconds(200));
  Result<std::unique_ptr<SourceFile>> a = remote.Open(stopped, 4096, 2, 64u << 10);
  Result<std::unique_ptr<SourceFile>> b = remote.Open(waiter, 4096, 2, 64u << 10);
  ASSERT_TRUE(a.ok() && b.ok());
  std::thread holder([&] {
    std::vector<std::byte> got(4096);
    EXPECT_TRUE((*a)->Read(4096, got).ok());
  });
  AwaitLocked(tmp.Join("c"), remote.Object());  // the first one's download began
  std::vector<std::byte> got(64u << 10);
  Result<size_t> n = (*b)->Read(512u << 10, got);  // returns (the store's bytes)
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.bytes.begin() + (512u << 10)));
  const ObjectCacheStats s = waiter.stats();
  EXPECT_EQ(s.errors, 1u);
  EXPECT_EQ(s.fills, 0u);
  EXPECT_TRUE(Contains(s.last_error, "model.safetensors not cached: its entry is held by pid " +
                                         std::to_string(::getpid()) + " on host "))
      << s.last_error;
  EXPECT_TRUE(Contains(s.last_error, "whose download made no progress for 0.2 s")) << s.last_error;
  remote.released = true;  // the first one goes on and completes its copy
  holder.join();
  a->reset();
  stopped.Drain();
  EXPECT_EQ(stopped.stats().errors, 0u) << stopped.stats().last_error;
  EXPECT_TRUE(fs::is_regular_file(tmp.Join("c") + "/blobs/" + ObjectCache::Key(remote.Object())));
}

// A download whose GET receives bytes slowly, for longer than the waiter's lock_wait without a
// write to its copy (a part of 32 MiB from a server sending less than 1 MB/s), is still waited for:
// its copy is touched as the bytes arrive, and the waiter reads the finished copy instead of
// giving up and downloading the object a second time.
TEST(ObjectCache, ASlowDownloadThatGoesOnIsWaitedFor) {
  testing::TempDir tmp;
  Remote remote(1u << 20);
  remote.trickle_offset = 4096;  // the first one's read past the header takes 2 s
  remote.trickle_ms = 2000;
  ObjectCache filler(tmp.Join("c"), 0);
  ObjectCache waiter(tmp.Join("c"), 0, ObjectCache::Layout::kObjects, 32u << 20, false,
                     std::chrono::milliseconds(700));
  Result<std::unique_ptr<SourceFile>> a = remote.Open(filler, 4096, 2, 64u << 10);
  Result<std::unique_ptr<SourceFile>> b = remote.Open(waiter, 4096, 2, 64u << 10);
  ASSERT_TRUE(a.ok() && b.ok());
  std::thread holder([&] {
    std::vector<std::byte> got(4096);
    EXPECT_TRUE((*a)->Read(4096, got).ok());
  });
  AwaitLocked(tmp.Join("c"), remote.Object());  // the first one's download began
  std::vector<std::byte> got(64u << 10);
  Result<size_t> n = (*b)->Read(512u << 10, got);  // waits for the copy, then reads it
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.bytes.begin() + (512u << 10)));
  holder.join();
  const ObjectCacheStats s = waiter.stats();
  EXPECT_EQ(s.errors, 0u) << s.last_error;
  EXPECT_EQ(s.fills, 0u);
  EXPECT_EQ(s.hits, 1u);
  a->reset();
  filler.Drain();
  EXPECT_EQ(filler.stats().errors, 0u) << filler.stats().last_error;
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);  // once, by the first one
}

TEST(ObjectCache, APartialReadStillLeavesAWholeCopy) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  {
    ObjectCache cache(tmp.Join("c"), 0);
    Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 3, 64u << 10);
    ASSERT_TRUE(file.ok() && *file != nullptr);
    std::vector<std::byte> slice(1000);  // a tensor-parallel rank's slice, say
    ASSERT_TRUE((*file)->Read(300'000, slice).ok());
    EXPECT_TRUE(std::equal(slice.begin(), slice.end(), remote.bytes.begin() + 300'000));
  }  // the cache's end waits for the rest of the download
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  EXPECT_EQ(testing::ReadBytes(blob),
            std::string(reinterpret_cast<const char*>(remote.bytes.data()), remote.bytes.size()));
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
}

TEST(ObjectCache, AnotherVersionIsAnotherEntry) {
  testing::TempDir tmp;
  ObjectCache cache(tmp.Join("c"), 0);
  Remote v1(300'000, 1);
  Fill(cache, v1);
  Remote v2(300'000, 2);  // same URL and size, overwritten: a new ETag
  v2.etag = "\"v2\"";
  Fill(cache, v2);
  EXPECT_EQ(cache.stats().fills, 2u);
  EXPECT_EQ(CountFiles(tmp.Join("c/blobs")), 4u);
  EXPECT_NE(ObjectCache::Key(v1.Object()), ObjectCache::Key(v2.Object()));
  // Another endpoint serving the same bucket and key is another object too.
  EXPECT_NE(ObjectCache::Key(v1.Object("http://a:9000/b/k")),
            ObjectCache::Key(v1.Object("http://b:9000/b/k")));
}

TEST(ObjectCache, DamagedCopyIsReplaced) {
  testing::TempDir tmp;
  Remote remote(200'000);
  ObjectCache cache(tmp.Join("c"), 0);
  Fill(cache, remote);
  Result<std::unique_ptr<SourceFile>> first = remote.Open(cache);
  ASSERT_TRUE(first.ok() && *first != nullptr);
  EXPECT_EQ(cache.stats().hits, 1u);
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  ASSERT_EQ(::truncate(blob.c_str(), 1000), 0);
  // A reader holding the damaged copy is told, naming the URL and the copy.
  const Status changed = (*first)->CheckUnchanged();
  EXPECT_EQ(changed.code(), Code::kIoError);
  EXPECT_TRUE(Contains(changed.message(), "model.safetensors: its cached copy " + blob));
  Fill(cache, remote);
  EXPECT_EQ(cache.stats().fills, 2u);
  EXPECT_EQ(fs::file_size(blob), remote.bytes.size());
}

TEST(ObjectCache, DistrustedCopyIsRemovedAndFilledAgain) {
  testing::TempDir tmp;
  Remote remote(200'000);
  ObjectCache cache(tmp.Join("c"), 0);
  Fill(cache, remote);
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  Result<std::unique_ptr<SourceFile>> hit = remote.Open(cache);
  ASSERT_TRUE(hit.ok() && *hit != nullptr);
  // A load's checksums failed on bytes of the copy: the copy goes, and the error says so.
  const std::string words = (*hit)->Distrust();
  EXPECT_EQ(words, "it was read from its copy in the object cache, " + blob +
                       ", which is now removed: the next open downloads the file again");
  EXPECT_FALSE(fs::exists(blob));
  EXPECT_FALSE(fs::exists(blob + ".json"));
  EXPECT_EQ((*hit)->Distrust(), words);  // idempotent
  // The next open downloads it again; the old file's Distrust leaves the new copy alone.
  remote.fetched = 0;
  Fill(cache, remote);
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
  EXPECT_TRUE(fs::exists(blob));
  static_cast<void>((*hit)->Distrust());
  EXPECT_TRUE(fs::exists(blob));
}

TEST(ObjectCache, DistrustedDownloadIsNotCommitted) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  std::vector<std::byte> some(1000);
  ASSERT_TRUE((*file)->Read(10'000, some).ok());  // the download begins
  const std::string words = (*file)->Distrust();
  EXPECT_TRUE(words == "its download into the object cache is given up" ||
              Contains(words, "which is now removed"))  // the download won the race
      << words;
  EXPECT_EQ(ReadAll(**file), remote.bytes);  // the reads go on (what the copy lacks: the store)
  cache.Drain();
  EXPECT_EQ(CountFiles(tmp.Join("c/blobs")), 0u);
  EXPECT_EQ(CountFiles(tmp.Join("c/tmp")), 0u);
}

// drop_cache: a copy drops its pages at once; a download in progress when it commits.
TEST(ObjectCache, DropFromPageCacheDropsTheCopysPages) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  ObjectCache cache(tmp.Join("c"), 0);
  Fill(cache, remote);
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  Result<std::unique_ptr<SourceFile>> hit = remote.Open(cache);
  ASSERT_TRUE(hit.ok() && *hit != nullptr);
  EXPECT_EQ(ReadAll(**hit), remote.bytes);
  ASSERT_GT(*CachedFraction(blob), 0.9);  // written and read: in the page cache
  Status dropped = (*hit)->DropFromPageCache();
  ASSERT_TRUE(dropped.ok()) << dropped.ToString();
  EXPECT_LT(*CachedFraction(blob), 0.1);

  // Two downloads held before their last range: one asked to drop its pages, one not.
  Remote held(1'000'000, 2), kept(1'000'000, 3);
  const uint64_t top_part = held.bytes.size() - (64u << 10);  // the filler's first range
  held.hold_offset = static_cast<int64_t>(top_part);
  kept.hold_offset = static_cast<int64_t>(top_part);
  const std::string held_url = "http://127.0.0.1:9/b/held.safetensors";
  const std::string kept_url = "http://127.0.0.1:9/b/kept.safetensors";
  Result<std::unique_ptr<SourceFile>> a = held.Open(cache, 4096, 2, 64u << 10, held_url);
  Result<std::unique_ptr<SourceFile>> b = kept.Open(cache, 4096, 2, 64u << 10, kept_url);
  ASSERT_TRUE(a.ok() && *a != nullptr && b.ok() && *b != nullptr);
  // Every byte below the held range, read through (the held one would wait for it).
  for (auto [file, object] : {std::pair{a->get(), &held}, std::pair{b->get(), &kept}}) {
    std::vector<std::byte> below(static_cast<size_t>(top_part));
    ASSERT_TRUE(file->Read(0, below).ok());
    EXPECT_TRUE(std::equal(below.begin(), below.end(), object->bytes.begin()));
  }
  dropped = (*a)->DropFromPageCache();  // not committed yet: dropped when it is
  ASSERT_TRUE(dropped.ok()) << dropped.ToString();
  held.released = true;
  kept.released = true;
  cache.Drain();
  const std::string held_blob = tmp.Join("c/blobs/" + ObjectCache::Key(held.Object(held_url)));
  const std::string kept_blob = tmp.Join("c/blobs/" + ObjectCache::Key(kept.Object(kept_url)));
  ASSERT_TRUE(fs::exists(held_blob) && fs::exists(kept_blob));
  EXPECT_LT(*CachedFraction(held_blob), 0.1);
  EXPECT_GT(*CachedFraction(kept_blob), 0.9);
  EXPECT_EQ(ReadAll(**a), held.bytes);  // the copy, read from disk
  dropped = (*a)->DropFromPageCache();  // committed: at once
  ASSERT_TRUE(dropped.ok()) << dropped.ToString();
  EXPECT_LT(*CachedFraction(held_blob), 0.1);
}

TEST(ObjectCache, StoreErrorFailsTheReadAndLeavesNothing) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  remote.fail_from_call = 0;  // the store stops answering
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  std::vector<std::byte> all(remote.bytes.size());
  Result<size_t> n = (*file)->Read(0, all);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), Code::kIoError);
  EXPECT_TRUE(Contains(n.status().message(), "AccessDenied"));
  cache.Drain();
  EXPECT_EQ(CountFiles(tmp.Join("c/blobs")), 0u);
  EXPECT_EQ(CountFiles(tmp.Join("c/tmp")), 0u);
  const ObjectCacheStats s = cache.stats();
  EXPECT_EQ(s.errors, 1u);
  EXPECT_TRUE(Contains(s.last_error, "model.safetensors not cached: download failed: "));
  EXPECT_TRUE(Contains(s.last_error, "AccessDenied"));
  // The next open downloads it whole.
  remote.fail_from_call = -1;
  Fill(cache, remote);
  EXPECT_EQ(CountFiles(tmp.Join("c/blobs")), 2u);
}

TEST(ObjectCache, FailedDownloadLeavesTheReadsOnTheStore) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  remote.fail_offset = 4096;  // the filler's last range (it goes from the end down) fails once
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  std::vector<std::byte> last(10);
  ASSERT_TRUE((*file)->Read(remote.bytes.size() - 10, last).ok());  // starts the download
  cache.Drain();
  EXPECT_EQ(cache.stats().errors, 1u);
  EXPECT_TRUE(Contains(cache.stats().last_error, "download failed: GET failed"));
  // The parts the download wrote are read from its copy; the others from the store.
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  EXPECT_EQ(CountFiles(tmp.Join("c/blobs")), 0u);
  EXPECT_EQ(CountFiles(tmp.Join("c/tmp")), 0u);
}

TEST(ObjectCache, UnusableDirectoryReadsTheStoreAndSaysWhy) {
  testing::TempDir tmp;
  testing::WriteBytes(tmp.Join("not-a-dir"), "x");
  Remote remote(100'000);
  ObjectCache cache(tmp.Join("not-a-dir"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr) << file.status().ToString();
  EXPECT_EQ(ReadAll(**file), remote.bytes);  // from the store
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size());
  const ObjectCacheStats s = cache.stats();
  EXPECT_EQ(s.errors, 1u);
  EXPECT_EQ(s.fills, 0u);
  EXPECT_TRUE(Contains(s.last_error, "object cache " + tmp.Join("not-a-dir") + ": cannot create"));
}

TEST(ObjectCache, EachFailureIsKeptInWordsTheLatestFirst) {
  testing::TempDir tmp;
  testing::WriteBytes(tmp.Join("not-a-dir"), "x");
  Remote remote(10'000);
  ObjectCache cache(tmp.Join("not-a-dir"), 0);
  const uint64_t n = ObjectCache::kErrorLog + 3;
  for (uint64_t i = 0; i < n; ++i) {
    Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
    ASSERT_TRUE(file.ok() && *file != nullptr) << file.status().ToString();
    ASSERT_EQ(ReadAll(**file), remote.bytes);
  }
  ASSERT_EQ(cache.stats().errors, n);
  EXPECT_EQ(cache.ErrorsSince(0).size(), ObjectCache::kErrorLog);  // the oldest 3 not kept
  EXPECT_EQ(cache.ErrorsSince(5).size(), n - 5);
  const std::vector<std::string> last = cache.ErrorsSince(n - 1);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0], cache.stats().last_error);
  EXPECT_TRUE(Contains(last[0], "object cache " + tmp.Join("not-a-dir") + ": cannot create"));
  EXPECT_TRUE(cache.ErrorsSince(n).empty());
  EXPECT_TRUE(cache.ErrorsSince(n + 10).empty());
}

TEST(ObjectCache, LeftoversOfADeadFillerAreRemoved) {
  testing::TempDir tmp;
  Remote remote(100'000);
  const std::string key = ObjectCache::Key(remote.Object());
  fs::create_directories(tmp.Join("c/tmp"));
  testing::WriteBytes(tmp.Join("c/tmp/" + key + ".999999.0"), "half a download");
  testing::WriteBytes(tmp.Join("c/tmp/other.1.0"), "not a download's name");
  // Another key's download, left by a process that died (nobody holds its lock), and one whose
  // key is held (a download going on): the first is removed too (it stayed until a prune: a
  // full-size file the limit did not count), the second stays.
  const std::string dead = std::string(64, 'd'), live = std::string(64, 'e');
  testing::WriteBytes(tmp.Join("c/tmp/" + dead + ".999999.3"), "another key's half");
  testing::WriteBytes(tmp.Join("c/tmp/" + live + ".999999.4"), "another key's, going on");
  fs::create_directories(tmp.Join("c/locks"));
  const UniqueFd held = HoldLock(tmp.Join("c/locks/" + live + ".lock"));
  ASSERT_GE(held.get(), 0);
  ObjectCache cache(tmp.Join("c"), 0);
  Fill(cache, remote);
  EXPECT_FALSE(fs::exists(tmp.Join("c/tmp/" + key + ".999999.0")));
  EXPECT_FALSE(fs::exists(tmp.Join("c/tmp/" + dead + ".999999.3")));
  EXPECT_TRUE(fs::exists(tmp.Join("c/tmp/" + live + ".999999.4")));
  EXPECT_TRUE(fs::exists(tmp.Join("c/tmp/other.1.0")));
}

// The hub layout: a dead process's <blob>.tensorferry.<pid>.<n> beside the blobs of a repository
// is removed at the next download into that repository when nobody holds its blob's lock
// (huggingface_hub's tools do not know these files; each was as large as its object).
TEST(HubLayout, LeftoversOfADeadFillerAreRemoved) {
  testing::TempDir tmp;
  Remote remote(100'000);
  const std::string root = tmp.Join("hub");
  const CachedObject object = remote.HubObject();
  const std::string blobs = root + "/models--org--tiny/blobs/";
  fs::create_directories(blobs);
  const std::string dead = std::string(64, 'd'), live = std::string(64, 'e');
  testing::WriteBytes(blobs + dead + ".tensorferry.999999.0", "half");
  testing::WriteBytes(blobs + live + ".tensorferry.999999.1", "going on");
  testing::WriteBytes(blobs + dead + ".incomplete", "huggingface_hub's own");
  const std::string locks = root + "/.locks/models--org--tiny/";
  fs::create_directories(locks);
  testing::WriteBytes(locks + dead + ".lock", "");
  const UniqueFd held = HoldLock(locks + live + ".lock");
  ASSERT_GE(held.get(), 0);
  {
    ObjectCache cache(root, 0, ObjectCache::Layout::kHub);
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(cache, object);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
  }
  EXPECT_FALSE(fs::exists(blobs + dead + ".tensorferry.999999.0"));
  EXPECT_TRUE(fs::exists(blobs + live + ".tensorferry.999999.1"));
  EXPECT_TRUE(fs::exists(blobs + dead + ".incomplete"));
}

TEST(ObjectCache, ConcurrentReadersDownloadOnce) {
  testing::TempDir tmp;
  Remote remote(2'000'000);
  constexpr int kOpeners = 6;
  std::vector<std::thread> threads;
  std::atomic<int> exact{0};
  for (int i = 0; i < kOpeners; ++i) {
    threads.emplace_back([&] {
      ObjectCache cache(tmp.Join("shared"), 0);  // as separate processes would
      Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
      if (file.ok() && *file != nullptr && ReadAll(**file) == remote.bytes) ++exact;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(exact.load(), kOpeners);
  EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
  EXPECT_EQ(CountFiles(tmp.Join("shared/blobs")), 2u);  // the blob and its description
}

TEST(ObjectCache, EvictsTheLeastRecentlyUsed) {
  testing::TempDir tmp;
  const std::string dir = tmp.Join("c");
  ObjectCache cache(dir, 250'000);  // room for two of the 100 kB objects below
  Remote a(100'000, 1), b(100'000, 2), c(100'000, 3);
  const auto url = [](const char* name) { return std::string("http://h:1/") + name; };
  Fill(cache, a, url("a"));
  Fill(cache, b, url("b"));
  // Times set by hand (a file system may keep whole seconds): a used last, b before it.
  const auto age = [&](Remote& r, const char* name, time_t seconds) {
    const std::string blob = dir + "/blobs/" + ObjectCache::Key(r.Object(url(name)));
    const struct timespec times[2] = {{seconds, 0}, {seconds, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, blob.c_str(), times, 0), 0);
  };
  age(a, "a", 2'000'000'000);
  age(b, "b", 1'000'000'000);
  Fill(cache, c, url("c"));
  EXPECT_EQ(cache.stats().evicted, 1u);
  EXPECT_TRUE(fs::exists(dir + "/blobs/" + ObjectCache::Key(a.Object(url("a")))));
  EXPECT_FALSE(fs::exists(dir + "/blobs/" + ObjectCache::Key(b.Object(url("b")))));
  EXPECT_FALSE(fs::exists(dir + "/blobs/" + ObjectCache::Key(b.Object(url("b"))) + ".json"));
  EXPECT_TRUE(fs::exists(dir + "/blobs/" + ObjectCache::Key(c.Object(url("c")))));

  // Larger than the whole cache: read from the store, and said so.
  Remote big(300'000, 4);
  Fill(cache, big, url("big"));
  EXPECT_EQ(big.fetched.load(), big.bytes.size());
  EXPECT_FALSE(fs::exists(dir + "/blobs/" + ObjectCache::Key(big.Object(url("big")))));
  EXPECT_TRUE(Contains(cache.stats().last_error, "300000 bytes, more than object_cache_max"));
}

// Two caches of one process on one directory (each source of a URL has its own: a safe_open per
// shard, two Loaders) count each other's downloads in progress against object_cache_max: the
// second download does not fit beside the first (both were cached, 200 kB under a 150 kB limit).
TEST(ObjectCache, TheLimitCountsTheDownloadsOfEveryCacheOfTheProcess) {
  testing::TempDir tmp;
  const std::string dir = tmp.Join("c");
  ObjectCache first(dir, 150'000), second(tmp.path() + "/./c", 150'000);
  Remote a(100'000, 1), b(100'000, 2);
  a.hold_offset = 4096;  // a's download waits until released
  Result<std::unique_ptr<SourceFile>> held = a.Open(first, 4096, 2, 16u << 10, "http://h:1/a");
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  std::thread reader([&] {
    std::vector<std::byte> got(4096);
    EXPECT_TRUE((*held)->Read(4096, got).ok());
  });
  AwaitLocked(dir, a.Object("http://h:1/a"));
  Fill(second, b, "http://h:1/b");  // read from the store
  EXPECT_EQ(b.fetched.load(), b.bytes.size());
  EXPECT_TRUE(Contains(second.stats().last_error,
                       "100000 bytes do not fit object_cache_max (150000) beside the 100000 "
                       "bytes of downloads in progress"))
      << second.stats().last_error;
  a.released = true;
  reader.join();
  held->reset();
  first.Drain();
  EXPECT_EQ(first.stats().fills, 1u) << first.stats().last_error;
  // a's done: b fits now.
  Fill(second, b, "http://h:1/b");
  EXPECT_EQ(second.stats().fills, 1u) << second.stats().last_error;
}

TEST(ObjectCache, EntriesInUseByAFillerAreNotEvicted) {
  testing::TempDir tmp;
  const std::string dir = tmp.Join("c");
  ObjectCache cache(dir, 150'000);
  Remote a(100'000, 1), b(100'000, 2);
  Fill(cache, a, "http://h:1/a");
  // Another process holds a's lock (filling or evicting it): b cannot make room.
  const std::string lock_path =
      dir + "/locks/" + ObjectCache::Key(a.Object("http://h:1/a")) + ".lock";
  const int held = ::open(lock_path.c_str(), O_RDWR);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  Fill(cache, b, "http://h:1/b");  // read from the store
  EXPECT_EQ(b.fetched.load(), b.bytes.size());
  EXPECT_TRUE(Contains(cache.stats().last_error, "holds 100000 bytes of entries in use"));
  ::close(held);
}

// The hub layout: huggingface_hub's blob, snapshot link and lock; tests/python (hf_hub tests)
// check the result with huggingface_hub itself.
TEST(HubLayout, FillsTheBlobThenLinksTheSnapshot) {
  testing::TempDir tmp;
  Remote remote(300'000);
  const std::string root = tmp.Join("hub");
  const CachedObject object = remote.HubObject("sub/dir/model.safetensors");
  const std::string repo = root + "/models--org--tiny";
  const std::string blob = repo + "/blobs/" + object.hub_blob;
  const std::string link = repo + "/snapshots/" + object.hub_commit + "/sub/dir/model.safetensors";
  {
    ObjectCache cache(root, 1, ObjectCache::Layout::kHub);  // max_bytes is not for the hub
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(cache, object);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
    cache.Drain();
    EXPECT_EQ(cache.stats().fills, 1u);
    EXPECT_EQ(cache.stats().errors, 0u) << cache.stats().last_error;
  }
  ASSERT_TRUE(fs::is_regular_file(blob));
  EXPECT_EQ(fs::file_size(blob), remote.bytes.size());
  ASSERT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(fs::read_symlink(link), fs::path("../../../../blobs/" + object.hub_blob));
  EXPECT_EQ(fs::canonical(link), fs::canonical(blob));
  EXPECT_TRUE(fs::exists(root + "/.locks/models--org--tiny/" + object.hub_blob + ".lock"));
  EXPECT_FALSE(fs::exists(root + "/blobs"));   // nothing of the objects layout
  EXPECT_EQ(CountFiles(repo + "/blobs"), 1u);  // no download left beside the blob

  // Another commit with the same file: read from the blob, linked for that commit too.
  const CachedObject again = remote.HubObject("model.safetensors", std::string(40, 'c'));
  const uint64_t fetched = remote.fetched.load();
  {
    ObjectCache cache(root, 0, ObjectCache::Layout::kHub);
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(cache, again);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
    EXPECT_EQ(cache.stats().hits, 1u);
  }
  EXPECT_EQ(remote.fetched.load(), fetched);
  EXPECT_EQ(fs::read_symlink(repo + "/snapshots/" + again.hub_commit + "/model.safetensors"),
            fs::path("../../blobs/" + object.hub_blob));
}

// huggingface_hub (1.x and later) downloads a blob to <blob>.<8 hex>.incomplete under its lock:
// a tensorferry load waiting for that lock sees the file grow as progress and waits for the
// download however long it takes (it gave up after lock_wait, seeing no <blob>.incomplete), then
// reads the blob. Lock files are made for the group (0666 less the umask, as huggingface_hub's).
TEST(HubLayout, AHuggingfaceHubDownloadInProgressIsWaitedFor) {
  testing::TempDir tmp;
  Remote remote(300'000);
  const std::string root = tmp.Join("hub");
  const CachedObject object = remote.HubObject();
  const std::string repo = root + "/models--org--tiny";
  const std::string blob = repo + "/blobs/" + object.hub_blob;
  const std::string locks = root + "/.locks/models--org--tiny";
  fs::create_directories(repo + "/blobs");
  fs::create_directories(locks);
  const UniqueFd held = HoldLock(locks + "/" + object.hub_blob + ".lock");
  ASSERT_GE(held.get(), 0);
  std::thread hub([&] {
    // 2 s of writes 100 ms apart: longer than the waiter's lock_wait (700 ms) by far, each
    // write well within it (a loaded machine's stall of a few hundred ms does not matter).
    const std::string part = blob + ".deadbeef.incomplete";
    const size_t step = remote.bytes.size() / 20;
    for (size_t at = 0; at < remote.bytes.size(); at += step) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const size_t n = std::min(step, remote.bytes.size() - at);
      std::string text(reinterpret_cast<const char*>(remote.bytes.data()) + at, n);
      std::FILE* f = std::fopen(part.c_str(), "ab");
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
    }
    fs::rename(part, blob);
    ::flock(held.get(), LOCK_UN);
  });
  {
    ObjectCache waiter(root, 0, ObjectCache::Layout::kHub, 32u << 20, false,
                       std::chrono::milliseconds(700));
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(waiter, object);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
    file->reset();
    waiter.Drain();
    EXPECT_EQ(waiter.stats().errors, 0u) << waiter.stats().last_error;
    EXPECT_EQ(waiter.stats().fills, 0u);
  }
  hub.join();
  EXPECT_EQ(CountFiles(repo + "/blobs"), 1u);

  // A lock file tensorferry makes: read-write for the group under umask 002.
  const std::string other_root = tmp.Join("hub2");
  const mode_t old_mask = ::umask(002);
  {
    ObjectCache cache(other_root, 0, ObjectCache::Layout::kHub);
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(cache, object);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
  }
  ::umask(old_mask);
  struct stat st {};
  ASSERT_EQ(
      ::stat((other_root + "/.locks/models--org--tiny/" + object.hub_blob + ".lock").c_str(), &st),
      0);
  EXPECT_EQ(st.st_mode & 0777, 0664u);
}

// A child forked while a download runs shares the open file its lock belongs to: the lock is
// let go of explicitly when the copy is done, not only closed (which left the key locked until
// the child exited: eviction skipped it, others waited).
TEST(CacheKeyLock, AForkedChildDoesNotKeepTheKeyLocked) {
  testing::TempDir tmp;
  Remote remote(1u << 20);
  remote.hold_offset = 4096;  // the download waits until released
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache, 4096, 2, 64u << 10);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::thread reader([&] {
    std::vector<std::byte> got(4096);
    EXPECT_TRUE((*file)->Read(4096, got).ok());
  });
  AwaitLocked(tmp.Join("c"), remote.Object());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::sleep(30);
    ::_exit(0);
  }
  remote.released = true;
  reader.join();
  file->reset();
  cache.Drain();
  EXPECT_EQ(cache.stats().fills, 1u) << cache.stats().last_error;
  const std::string lock = tmp.Join("c") + "/locks/" + ObjectCache::Key(remote.Object()) + ".lock";
  const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0) << "the key is still locked (by the child)";
  ::close(fd);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

// A read-only hub cache holding the blob but not this commit's link: the file is read from the
// blob, and the link's failure is told as such, not as a read from the store.
TEST(HubLayout, ALinkThatCannotBeMadeIsNoReadFromTheStore) {
  testing::TempDir tmp;
  Remote remote(100'000);
  const std::string root = tmp.Join("hub");
  const CachedObject object = remote.HubObject();
  const std::string repo = root + "/models--org--tiny";
  fs::create_directories(repo + "/blobs");
  testing::WriteBytes(
      repo + "/blobs/" + object.hub_blob,
      std::string(reinterpret_cast<const char*>(remote.bytes.data()), remote.bytes.size()));
  fs::create_directories(repo + "/snapshots");
  testing::WriteBytes(repo + "/snapshots/" + object.hub_commit, "not a folder");  // no link
  ObjectCache cache(root, 0, ObjectCache::Layout::kHub);
  for (int i = 0; i < 2; ++i) {
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(cache, object);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
  }
  EXPECT_EQ(remote.fetched.load(), 0u);
  const ObjectCacheStats s = cache.stats();
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.errors, 0u) << s.last_error;
  EXPECT_EQ(s.unlinked, 1u);  // one link, however often it was tried
  EXPECT_TRUE(Contains(s.last_unlinked, "hub cache " + root + ": " + object.name + " not linked: "))
      << s.last_unlinked;
}

TEST(HubLayout, KeepsWholeObjectsAtOnce) {
  testing::TempDir tmp;
  Remote remote(1'000);
  const std::string root = tmp.Join("hub");
  const CachedObject object = remote.HubObject("model.safetensors.index.json");
  ObjectCache cache(root, 0, ObjectCache::Layout::kHub);
  cache.Keep(object, remote.bytes);
  EXPECT_EQ(cache.stats().fills, 1u);
  const std::string link =
      root + "/models--org--tiny/snapshots/" + object.hub_commit + "/model.safetensors.index.json";
  ASSERT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(testing::ToBytes(testing::ReadBytes(link)), remote.bytes);
  // Found there again (by Keep, by Open): the blob is left as it is, so a load that opened the
  // snapshot as a local file (another rank on this host) finds it unchanged.
  struct stat before {};
  ASSERT_EQ(::stat(link.c_str(), &before), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  cache.Keep(object, remote.bytes);  // there already
  EXPECT_EQ(cache.stats().fills, 1u);
  EXPECT_EQ(cache.stats().hits, 1u);
  Result<std::unique_ptr<SourceFile>> found = remote.OpenAs(cache, object, 100);
  ASSERT_TRUE(found.ok() && *found != nullptr);
  EXPECT_EQ(cache.stats().hits, 2u);
  struct stat after {};
  ASSERT_EQ(::stat(link.c_str(), &after), 0);
  EXPECT_EQ(after.st_mtim.tv_sec, before.st_mtim.tv_sec);
  EXPECT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
  cache.Keep(object, std::span(remote.bytes).first(10));  // not the whole object: nothing
  EXPECT_EQ(testing::ToBytes(testing::ReadBytes(link)), remote.bytes);
}

TEST(HubLayout, ABlobOfTheWrongSizeIsReplacedAndAnUnwritableCacheFailsNothing) {
  testing::TempDir tmp;
  Remote remote(200'000);
  const std::string root = tmp.Join("hub");
  const CachedObject object = remote.HubObject();
  const std::string blob = root + "/models--org--tiny/blobs/" + object.hub_blob;
  fs::create_directories(fs::path(blob).parent_path());
  testing::WriteBytes(blob, "short");
  {
    ObjectCache cache(root, 0, ObjectCache::Layout::kHub);
    Fill(cache, remote);  // through Remote::Open: the objects layout's object, not linked
    Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(cache, object);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(ReadAll(**file), remote.bytes);
    cache.Drain();
  }
  EXPECT_EQ(fs::file_size(blob), remote.bytes.size());

  testing::WriteBytes(tmp.Join("file"), "x");
  ObjectCache broken(tmp.Join("file") + "/hub", 0, ObjectCache::Layout::kHub);
  Result<std::unique_ptr<SourceFile>> file = remote.OpenAs(broken, object);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(ReadAll(**file), remote.bytes);  // from the store
  broken.Keep(object, remote.bytes);
  EXPECT_EQ(broken.stats().errors, 2u);
  EXPECT_TRUE(Contains(broken.stats().last_error, "hub cache " + tmp.Join("file") + "/hub: "))
      << broken.stats().last_error;
}

TEST(ObjectCacheTools, ListsMostRecentFirstAndPrunesTheLeastRecent) {
  testing::TempDir tmp;
  const std::string dir = tmp.Join("c");
  EXPECT_EQ(ListObjectCache(dir).status().code(), Code::kNotFound);
  ObjectCache cache(dir, 0);
  Remote a(100'000, 1), b(100'000, 2), c(100'000, 3);
  const std::vector<std::pair<Remote*, std::string>> objects = {{&a, "s3://bucket/a.safetensors"},
                                                                {&b, "s3://bucket/b.safetensors"},
                                                                {&c, "s3://bucket/c.safetensors"}};
  time_t when = 1'000'000'000;
  for (const auto& [remote, url] : objects) {
    Fill(cache, *remote, url);
    const std::string blob = dir + "/blobs/" + ObjectCache::Key(remote->Object(url));
    const struct timespec times[2] = {{when, 0}, {when, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, blob.c_str(), times, 0), 0);
    when += 10;
  }
  Result<std::vector<ObjectCacheEntry>> listed = ListObjectCache(dir);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 3u);
  EXPECT_EQ((*listed)[0].url, "s3://bucket/c.safetensors");  // used last
  EXPECT_EQ((*listed)[2].url, "s3://bucket/a.safetensors");
  EXPECT_EQ((*listed)[0].etag, "\"v1\"");
  EXPECT_EQ((*listed)[0].size, 100'000u);
  EXPECT_EQ((*listed)[0].last_used, 1'000'000'020);
  EXPECT_EQ((*listed)[0].key, ObjectCache::Key(c.Object("s3://bucket/c.safetensors")));

  // What interrupted downloads left: a download whose key nobody holds is over; one whose key
  // is held is running; a description without its entry.
  const std::string dead = ObjectCache::Key(a.Object("s3://bucket/dead"));
  const std::string running = ObjectCache::Key(a.Object("s3://bucket/running"));
  testing::WriteBytes(dir + "/tmp/" + dead + ".4242.0", "partial");
  testing::WriteBytes(dir + "/tmp/" + running + ".4243.0", "partial");
  testing::WriteBytes(dir + "/tmp/" + running + ".4243.0.json", "{}");  // committing: no 2nd one
  testing::WriteBytes(dir + "/blobs/" + dead + ".json", "{}");
  const int held = ::open((dir + "/locks/" + running + ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  Result<ObjectCacheDownloads> downloads = ObjectCacheDownloadsIn(dir);
  ASSERT_TRUE(downloads.ok()) << downloads.status().ToString();
  EXPECT_EQ(downloads->running, 1u);
  EXPECT_EQ(downloads->left_over, 1u);
  EXPECT_GT(downloads->running_bytes, 0u);
  EXPECT_GT(downloads->left_over_bytes, 0u);
  EXPECT_FALSE(fs::exists(dir + "/locks/" + dead + ".lock"));  // the count made no lock file

  // Down to 150 kB: the two least recently used go.
  Result<std::vector<ObjectCacheEntry>> removed = PruneObjectCache(dir, 150'000);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  ASSERT_EQ(removed->size(), 2u);
  EXPECT_EQ((*removed)[0].url, "s3://bucket/a.safetensors");
  EXPECT_EQ((*removed)[1].url, "s3://bucket/b.safetensors");
  listed = ListObjectCache(dir);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].url, "s3://bucket/c.safetensors");
  EXPECT_FALSE(fs::exists(dir + "/tmp/" + dead + ".4242.0"));
  EXPECT_TRUE(fs::exists(dir + "/tmp/" + running + ".4243.0"));
  EXPECT_FALSE(fs::exists(dir + "/blobs/" + dead + ".json"));
  downloads = ObjectCacheDownloadsIn(dir);
  ASSERT_TRUE(downloads.ok());
  EXPECT_EQ(downloads->running, 1u);
  EXPECT_EQ(downloads->left_over, 0u);
  ::close(held);

  // An entry another process holds is kept even by a prune to 0; the rest go.
  const std::string c_key = ObjectCache::Key(c.Object("s3://bucket/c.safetensors"));
  const int c_lock = ::open((dir + "/locks/" + c_key + ".lock").c_str(), O_RDWR);
  ASSERT_GE(c_lock, 0);
  ASSERT_EQ(::flock(c_lock, LOCK_EX), 0);
  removed = PruneObjectCache(dir, 0);
  ASSERT_TRUE(removed.ok());
  EXPECT_TRUE(removed->empty());
  ::close(c_lock);
  // An entry whose lock cannot be taken for another reason (locks/ not a folder, no
  // permission) is an error naming it, not a prune that quietly removed nothing.
  fs::rename(dir + "/locks", dir + "/locks.gone");
  testing::WriteBytes(dir + "/locks", "not a folder");
  removed = PruneObjectCache(dir, 0);
  EXPECT_EQ(removed.status().code(), Code::kIoError);
  EXPECT_NE(removed.status().message().find("an entry could not be removed: " + dir + "/locks/" +
                                            c_key + ".lock: "),
            std::string::npos)
      << removed.status().ToString();
  fs::remove(dir + "/locks");
  // A cache whose locks/ was removed (removing what a cache holds is always safe) gets it
  // again: the prune goes on.
  removed = PruneObjectCache(dir, 0);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(removed->size(), 1u);
  EXPECT_TRUE(ListObjectCache(dir)->empty());
  EXPECT_TRUE(fs::is_directory(dir + "/locks"));
  fs::remove_all(dir + "/locks.gone");
}

}  // namespace
}  // namespace tensorferry::objstore

// The local cache of object-store files (object_cache.h) with an in-memory object: fills, hits,
// versions, damage, failures of the store and of the cache, concurrent fillers, eviction.
// src/objstore/object_source_live_test.cc and tests/python/test_object_store_cache.py drive it
// through a real S3 server.
#include "objstore/object_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tensorferry/object_store.h"
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
  std::atomic<int> fail_at_call{-1};  // the call (0-based) that fails, -1: none

  explicit Remote(size_t size, unsigned seed = 1) : bytes(testing::Pattern(size, seed)) {}

  CachedObject Object(const std::string& url = "http://127.0.0.1:9/b/model.safetensors") const {
    return {url, url, etag, bytes.size()};
  }
  FileIdentity Identity() const {
    FileIdentity id;
    id.size = bytes.size();
    id.inode = std::hash<std::string>()(etag);
    return id;
  }
  FetchRange Fetch() {
    return [this](uint64_t offset, std::span<std::byte> dst) -> Status {
      if (static_cast<int>(calls.fetch_add(1)) == fail_at_call.load()) {
        return Status(Code::kIoError, "GET failed: HTTP 403 AccessDenied");
      }
      EXPECT_LE(offset + dst.size(), bytes.size());
      std::memcpy(dst.data(), bytes.data() + offset, dst.size());
      fetched += dst.size();
      return Status::Ok();
    };
  }
  // Opens through `cache` with the first `head` bytes as the open's prefix.
  Result<std::unique_ptr<SourceFile>> Open(ObjectCache& cache, size_t head = 4096,
                                           unsigned concurrency = 4, uint64_t part = 64u << 10) {
    return cache.Open(Object(), Identity(), std::span<const std::byte>(bytes).first(head), Fetch(),
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
    // The prefix is not fetched again; every other byte exactly once.
    EXPECT_EQ(remote.fetched.load(), remote.bytes.size() - 4096);
    const ObjectCacheStats s = cache.stats();
    EXPECT_EQ(s.fills, 1u);
    EXPECT_EQ(s.fill_bytes, remote.bytes.size());
    EXPECT_EQ(s.hits, 0u);
    EXPECT_EQ(s.errors, 0u);
    const std::string key = ObjectCache::Key(remote.Object());
    EXPECT_EQ(fs::file_size(tmp.Join("cache/blobs/" + key)), remote.bytes.size());
    const std::string meta = testing::ReadBytes(tmp.Join("cache/blobs/" + key + ".json"));
    EXPECT_TRUE(Contains(meta, "\"url\":\"http://127.0.0.1:9/b/model.safetensors\""));
    EXPECT_TRUE(Contains(meta, "\"etag\":\"\\\"v1\\\"\""));
    EXPECT_TRUE(Contains(meta, "\"size\":1000000"));
    EXPECT_EQ(CountFiles(tmp.Join("cache/tmp")), 0u);
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

TEST(ObjectCache, AnotherVersionIsAnotherEntry) {
  testing::TempDir tmp;
  ObjectCache cache(tmp.Join("c"), 0);
  Remote v1(300'000, 1);
  ASSERT_TRUE(v1.Open(cache).ok());
  Remote v2(300'000, 2);  // same URL and size, overwritten: a new ETag
  v2.etag = "\"v2\"";
  Result<std::unique_ptr<SourceFile>> file = v2.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_EQ(ReadAll(**file), v2.bytes);
  EXPECT_EQ(cache.stats().fills, 2u);
  EXPECT_NE(ObjectCache::Key(v1.Object()), ObjectCache::Key(v2.Object()));
  // Another endpoint serving the same bucket and key is another object too.
  EXPECT_NE(ObjectCache::Key(v1.Object("http://a:9000/b/k")),
            ObjectCache::Key(v1.Object("http://b:9000/b/k")));
}

TEST(ObjectCache, DamagedCopyIsReplaced) {
  testing::TempDir tmp;
  Remote remote(200'000);
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> first = remote.Open(cache);
  ASSERT_TRUE(first.ok() && *first != nullptr);
  const std::string blob = tmp.Join("c/blobs/" + ObjectCache::Key(remote.Object()));
  ASSERT_EQ(::truncate(blob.c_str(), 1000), 0);
  // A reader holding the damaged copy is told, naming the URL and the copy.
  const Status changed = (*first)->CheckUnchanged();
  EXPECT_EQ(changed.code(), Code::kIoError);
  EXPECT_TRUE(Contains(changed.message(), "model.safetensors: its cached copy " + blob));
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_EQ(ReadAll(**file), remote.bytes);
  EXPECT_EQ(cache.stats().fills, 2u);
}

TEST(ObjectCache, StoreErrorFailsTheOpenAndLeavesNothing) {
  testing::TempDir tmp;
  Remote remote(1'000'000);
  remote.fail_at_call = 5;
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), Code::kIoError);
  EXPECT_TRUE(Contains(file.status().message(), "AccessDenied"));
  EXPECT_EQ(CountFiles(tmp.Join("c/blobs")), 0u);
  EXPECT_EQ(CountFiles(tmp.Join("c/tmp")), 0u);
  EXPECT_EQ(cache.stats().fills, 0u);
  // The next open downloads it whole.
  remote.fail_at_call = -1;
  file = remote.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_EQ(ReadAll(**file), remote.bytes);
}

TEST(ObjectCache, UnusableDirectoryReadsTheStoreAndSaysWhy) {
  testing::TempDir tmp;
  testing::WriteBytes(tmp.Join("not-a-dir"), "x");
  Remote remote(100'000);
  ObjectCache cache(tmp.Join("not-a-dir"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(*file, nullptr);  // the caller reads the store
  EXPECT_EQ(remote.fetched.load(), 0u);
  const ObjectCacheStats s = cache.stats();
  EXPECT_EQ(s.errors, 1u);
  EXPECT_TRUE(Contains(s.last_error, "object cache " + tmp.Join("not-a-dir") + ": cannot create"));
}

TEST(ObjectCache, LeftoversOfADeadFillerAreRemoved) {
  testing::TempDir tmp;
  Remote remote(100'000);
  const std::string key = ObjectCache::Key(remote.Object());
  fs::create_directories(tmp.Join("c/tmp"));
  testing::WriteBytes(tmp.Join("c/tmp/" + key + ".999999.0"), "half a download");
  testing::WriteBytes(tmp.Join("c/tmp/other.1.0"), "another key's");
  ObjectCache cache(tmp.Join("c"), 0);
  Result<std::unique_ptr<SourceFile>> file = remote.Open(cache);
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_FALSE(fs::exists(tmp.Join("c/tmp/" + key + ".999999.0")));
  EXPECT_TRUE(fs::exists(tmp.Join("c/tmp/other.1.0")));
}

TEST(ObjectCache, ConcurrentOpenersDownloadOnce) {
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
  const auto open = [&](Remote& r, const char* name) {
    return cache.Open(r.Object(url(name)), r.Identity(), {}, r.Fetch(), 2, 64u << 10);
  };
  ASSERT_TRUE(open(a, "a").ok());
  ASSERT_TRUE(open(b, "b").ok());
  // Times set by hand (a file system may keep whole seconds): a used last, b before it.
  const auto age = [&](Remote& r, const char* name, time_t seconds) {
    const std::string blob = dir + "/blobs/" + ObjectCache::Key(r.Object(url(name)));
    const struct timespec times[2] = {{seconds, 0}, {seconds, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, blob.c_str(), times, 0), 0);
  };
  age(a, "a", 2'000'000'000);
  age(b, "b", 1'000'000'000);
  Result<std::unique_ptr<SourceFile>> file = open(c, "c");
  ASSERT_TRUE(file.ok() && *file != nullptr);
  EXPECT_EQ(ReadAll(**file), c.bytes);
  EXPECT_EQ(cache.stats().evicted, 1u);
  EXPECT_TRUE(fs::exists(dir + "/blobs/" + ObjectCache::Key(a.Object(url("a")))));
  EXPECT_FALSE(fs::exists(dir + "/blobs/" + ObjectCache::Key(b.Object(url("b")))));
  EXPECT_FALSE(fs::exists(dir + "/blobs/" + ObjectCache::Key(b.Object(url("b"))) + ".json"));

  // Larger than the whole cache: read from the store, and said so; nothing fetched for it.
  Remote big(300'000, 4);
  Result<std::unique_ptr<SourceFile>> none =
      cache.Open(big.Object(url("big")), big.Identity(), {}, big.Fetch(), 2, 64u << 10);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
  EXPECT_EQ(big.fetched.load(), 0u);
  EXPECT_TRUE(Contains(cache.stats().last_error, "300000 bytes, more than object_cache_max"));
}

TEST(ObjectCache, EntriesInUseByAFillerAreNotEvicted) {
  testing::TempDir tmp;
  const std::string dir = tmp.Join("c");
  ObjectCache cache(dir, 150'000);
  Remote a(100'000, 1), b(100'000, 2);
  ASSERT_TRUE(cache.Open(a.Object("http://h:1/a"), a.Identity(), {}, a.Fetch(), 1, 1 << 20).ok());
  // Another process holds a's lock (filling or evicting it): b cannot make room.
  const std::string lock_path =
      dir + "/locks/" + ObjectCache::Key(a.Object("http://h:1/a")) + ".lock";
  const int held = ::open(lock_path.c_str(), O_RDWR);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  Result<std::unique_ptr<SourceFile>> file =
      cache.Open(b.Object("http://h:1/b"), b.Identity(), {}, b.Fetch(), 1, 1 << 20);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(*file, nullptr);
  EXPECT_TRUE(Contains(cache.stats().last_error, "holds 100000 bytes of entries in use"));
  ::close(held);
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
    ASSERT_TRUE(
        cache.Open(remote->Object(url), remote->Identity(), {}, remote->Fetch(), 1, 1 << 20).ok());
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
  testing::WriteBytes(dir + "/blobs/" + dead + ".json", "{}");
  const int held = ::open((dir + "/locks/" + running + ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);

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
  removed = PruneObjectCache(dir, 0);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->size(), 1u);
  EXPECT_TRUE(ListObjectCache(dir)->empty());
}

}  // namespace
}  // namespace tensorferry::objstore

// The object source against a real S3 server, through the public C++ API (Checkpoint, Loader).
//
// Needs a server: tests/python/test_object_store.py starts SeaweedFS, uploads a sharded checkpoint
// and runs this binary with
//   TENSORFERRY_TEST_S3_URL    the checkpoint's s3:// prefix,
//   TENSORFERRY_TEST_S3_LOCAL  the same checkpoint on disk,
//   AWS_* variables            the server's endpoint and credentials.
// Without them every test here skips (the Python suite is what runs them, in CI too).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "io/file_set.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/loader.h"
#include "tensorferry/object_store.h"
#include "tensorferry/options.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

struct Live {
  std::string url, local;
};

std::optional<Live> LiveServer() {
  const char* url = std::getenv("TENSORFERRY_TEST_S3_URL");
  const char* local = std::getenv("TENSORFERRY_TEST_S3_LOCAL");
  if (url == nullptr || local == nullptr) return std::nullopt;
  return Live{url, local};
}

#define REQUIRE_LIVE(live)                       \
  const std::optional<Live> live = LiveServer(); \
  if (!live) GTEST_SKIP() << "no S3 server (run by tests/python/test_object_store.py)"

// Loads everything (or a tensor-parallel rank) and returns (name, bytes) pairs in load order.
std::vector<std::pair<std::string, std::string>> LoadAll(const std::string& path,
                                                         LoadOptions options, LoadStats* stats) {
  auto loader = Loader::Open(path, options);
  EXPECT_TRUE(loader.ok()) << loader.status().ToString();
  if (!loader.ok()) return {};
  auto tensors = (*loader)->Load();
  EXPECT_TRUE(tensors.ok()) << tensors.status().ToString();
  if (!tensors.ok()) return {};
  std::vector<std::pair<std::string, std::string>> out;
  for (const Tensor& t : *tensors) {
    out.emplace_back(t.name(), std::string(reinterpret_cast<const char*>(t.data()), t.size()));
  }
  if (stats != nullptr) *stats = (*loader)->stats();
  return out;
}

TEST(ObjectSourceLive, ShardedCheckpointMatchesTheLocalCopy) {
  REQUIRE_LIVE(live);
  auto remote = Checkpoint::Open(live->url);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  auto local = Checkpoint::Open(live->local);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  ASSERT_EQ((*remote)->files().size(), (*local)->files().size());
  EXPECT_GT((*remote)->files().size(), 1u);
  EXPECT_EQ((*remote)->files()[0].path.rfind("s3://", 0), 0u);
  ASSERT_EQ((*remote)->tensors().size(), (*local)->tensors().size());

  LoadStats stats;
  const auto got = LoadAll(live->url, LoadOptions{}, &stats);
  const auto want = LoadAll(live->local, LoadOptions{}, nullptr);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_TRUE(got[i].second == want[i].second) << got[i].first << " differs";
  }
  EXPECT_GT(stats.remote_requests, 0u);
  EXPECT_EQ(stats.remote_bytes, stats.bytes_read);  // the prefixes were read at open
}

TEST(ObjectSourceLive, TensorParallelRanksReadTheirSlicesOnly) {
  REQUIRE_LIVE(live);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    LoadOptions o;
    ASSERT_TRUE(o.Set("tp_rank", std::to_string(rank)).ok());
    ASSERT_TRUE(o.Set("tp_size", "2").ok());
    LoadStats stats;
    const auto got = LoadAll(live->url, o, &stats);
    const auto want = LoadAll(live->local, o, nullptr);
    ASSERT_EQ(got, want) << "rank " << rank;
    auto checkpoint = Checkpoint::Open(live->local);
    ASSERT_TRUE(checkpoint.ok());
    EXPECT_LT(stats.remote_bytes, (*checkpoint)->total_tensor_bytes()) << "rank " << rank;
    EXPECT_EQ(stats.remote_bytes, stats.bytes_read) << "rank " << rank;
  }
}

// Two loaders of one checkpoint (one Source) reading at the same time: each reports the requests
// and bytes of its own reads only (SourceStatsScope), not the other's, as the cooperative load's
// round and local loaders do.
TEST(ObjectSourceLive, ConcurrentLoadersOfOneCheckpointCountTheirOwnRequests) {
  REQUIRE_LIVE(live);
  auto checkpoint = Checkpoint::Open(live->url);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  std::shared_ptr<const Checkpoint> shared = std::move(checkpoint).value();
  const SourceStats before = shared->file_set()->source()->stats();
  LoadStats stats[2];
  std::thread threads[2];
  for (uint32_t rank = 0; rank < 2; ++rank) {
    threads[rank] = std::thread([&, rank] {
      LoadOptions o;
      ASSERT_TRUE(o.Set("tp_rank", std::to_string(rank)).ok());
      ASSERT_TRUE(o.Set("tp_size", "2").ok());
      auto loader = Loader::Open(shared, o);
      ASSERT_TRUE(loader.ok()) << loader.status().ToString();
      ASSERT_TRUE((*loader)->Load().ok());
      stats[rank] = (*loader)->stats();
    });
  }
  for (std::thread& t : threads) t.join();
  const SourceStats after = shared->file_set()->source()->stats();
  for (uint32_t rank = 0; rank < 2; ++rank) {
    EXPECT_GT(stats[rank].bytes_read, 0u);
    EXPECT_EQ(stats[rank].remote_bytes, stats[rank].bytes_read) << "rank " << rank;
  }
  // Together they are every request the source made meanwhile.
  EXPECT_EQ(stats[0].remote_bytes + stats[1].remote_bytes, after.bytes - before.bytes);
  EXPECT_EQ(stats[0].remote_requests + stats[1].remote_requests, after.requests - before.requests);
}

// The bytes of every file in `dir` that is not a description (.json): a cache's copies, or a
// checkpoint's shards.
std::set<std::string> Contents(const std::string& dir, const std::string& suffix) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() >= suffix.size() && name.ends_with(suffix) && !name.ends_with(".json")) {
      out.insert(testing::ReadBytes(e.path().string()));
    }
  }
  return out;
}

// With a local cache (object_cache_dir): a rank that reads only its slices leaves each file's
// copy to the cache's filler, which finishes it after the checkpoint is closed (the close does
// not wait); WaitForObjectCaches waits for it, and every copy then holds the file's bytes. A
// copy given up before (AbandonObjectCaches) does not affect those begun after it.
TEST(ObjectSourceLive, CopiesOfAClosedCheckpointFinishInTheBackground) {
  REQUIRE_LIVE(live);
  AbandonObjectCaches();  // nothing in progress: copies begun later are not affected
  testing::TempDir tmp;
  LoadOptions o;
  ASSERT_TRUE(o.Set("object_cache_dir", tmp.Join("cache")).ok());
  ASSERT_TRUE(o.Set("object_header_bytes", "4096").ok());  // the open's GET leaves bytes to copy
  ASSERT_TRUE(o.Set("tp_rank", "0").ok());
  ASSERT_TRUE(o.Set("tp_size", "2").ok());
  LoadStats stats;
  ASSERT_FALSE(LoadAll(live->url, o, &stats).empty());  // the loader and checkpoint closed
  EXPECT_GT(stats.cache_fills, 0u);
  EXPECT_TRUE(WaitForObjectCaches(std::chrono::seconds(60)));
  EXPECT_FALSE(ObjectCachesCopying());
  EXPECT_EQ(Contents(tmp.Join("cache/blobs"), ""), Contents(live->local, ".safetensors"));
  EXPECT_TRUE(std::filesystem::is_empty(tmp.Join("cache/tmp")));
  const std::vector<std::string> failures = TakeObjectCacheFailures();  // none: all whole
  EXPECT_TRUE(failures.empty()) << failures.front();
}

// The server runs on loopback: the automatic transport takes the local choice (transport.h), the
// load's engine_reason says so, and values set win.
TEST(ObjectSourceLive, TransportForAStoreOnThisHost) {
  REQUIRE_LIVE(live);
  auto checkpoint = Checkpoint::Open(live->url);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const SourceReadHints h = (*checkpoint)->file_set()->source()->hints();
  EXPECT_EQ(h.concurrency, 8u);
  EXPECT_EQ(h.read_size, 32u << 20);
  EXPECT_NE(h.reason.find("the store is on this host ("), std::string::npos) << h.reason;

  LoadStats stats;
  ASSERT_FALSE(LoadAll(live->url, LoadOptions{}, &stats).empty());
  EXPECT_NE(stats.engine_reason.find("8 GETs of 33.55 MB in flight (the store is on this host"),
            std::string::npos)
      << stats.engine_reason;

  OpenOptions o;
  o.object_store.concurrency = 3;
  o.object_store.part_size = 64u << 10;
  auto set = Checkpoint::Open(live->url, o);
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const SourceReadHints s = (*set)->file_set()->source()->hints();
  EXPECT_EQ(s.concurrency, 3u);
  EXPECT_EQ(s.read_size, 64u << 10);
  EXPECT_EQ(s.reason, "3 GETs of 65.54 KB in flight (as set)");
  auto loader = Loader::Open(std::shared_ptr<const Checkpoint>(std::move(set).value()));
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
  // Every GET is at most 64 KiB: at least that many requests for the bytes read.
  const LoadStats& st = (*loader)->stats();
  EXPECT_GE(st.remote_requests, st.bytes_read / (64u << 10));
}

TEST(ObjectSourceLive, MissingObjectIsNotFoundNamingTheKey) {
  REQUIRE_LIVE(live);
  const std::string url = live->url + "/no-such-shard.safetensors";
  auto opened = Checkpoint::Open(url);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), Code::kNotFound);
  EXPECT_NE(opened.status().message().find("no-such-shard.safetensors"), std::string::npos)
      << opened.status().message();
  EXPECT_NE(opened.status().message().find("NoSuchKey"), std::string::npos)
      << opened.status().message();
}

TEST(ObjectSourceLive, WrongSecretNamesTheS3ErrorAndTheCredentials) {
  REQUIRE_LIVE(live);
  OpenOptions o;
  o.object_store.access_key_id = std::getenv("AWS_ACCESS_KEY_ID");
  o.object_store.secret_access_key = "not-the-secret";
  o.object_store.retries = 0;
  auto opened = Checkpoint::Open(live->url, o);
  ASSERT_FALSE(opened.ok());
  const std::string m = opened.status().message();
  EXPECT_NE(m.find("HTTP 403 SignatureDoesNotMatch"), std::string::npos) << m;
  EXPECT_NE(m.find("credentials: options"), std::string::npos) << m;
  EXPECT_NE(m.find(live->url), std::string::npos) << m;
}

// Whole objects (the files beside a checkpoint): ReadObject and ObjectSize, byte-exact against the
// local copy, read in one GET or in several (an object larger than the open's first GET), and
// what each refusal says.
TEST(ObjectSourceLive, ReadObjectReadsAWholeObjectOrSaysWhy) {
  REQUIRE_LIVE(live);
  auto local = Checkpoint::Open(live->local);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  const std::string shard_path = (*local)->files()[0].path;
  const std::string shard = shard_path.substr(shard_path.rfind('/') + 1);
  std::string want;
  {
    std::FILE* f = std::fopen(shard_path.c_str(), "rb");
    ASSERT_NE(f, nullptr) << shard_path;
    char buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) want.append(buf, n);
    std::fclose(f);
  }
  ASSERT_GT(want.size(), 8192u);
  const std::string url = live->url + "/" + shard;
  for (const uint64_t first_get : {uint64_t{256} << 10, uint64_t{4096}}) {
    ObjectStoreOptions o;
    o.header_bytes = first_get;  // 4 KiB: the rest in further ranged GETs
    auto size = ObjectSize(url, o);
    ASSERT_TRUE(size.ok()) << size.status().ToString();
    EXPECT_EQ(*size, want.size());
    auto bytes = ReadObject(url, o, want.size());
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    EXPECT_TRUE(std::string(reinterpret_cast<const char*>(bytes->data()), bytes->size()) == want)
        << "first GET " << first_get;
  }
  auto large = ReadObject(url, ObjectStoreOptions{}, want.size() - 1);
  ASSERT_FALSE(large.ok());
  EXPECT_EQ(large.status().code(), Code::kInvalidArgument);
  EXPECT_NE(
      large.status().message().find(url + ": the object is " + std::to_string(want.size()) +
                                    " bytes, more than the " + std::to_string(want.size() - 1)),
      std::string::npos)
      << large.status().message();
  auto missing = ReadObject(live->url + "/config.json", ObjectStoreOptions{}, 1u << 20);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find(live->url + "/config.json"), std::string::npos)
      << missing.status().message();
  auto path = ObjectSize(live->local, ObjectStoreOptions{});
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().code(), Code::kInvalidArgument);
  EXPECT_NE(path.status().message().find("is not an s3://, gs://, http:// or https:// URL"),
            std::string::npos)
      << path.status().message();
}

// ListObjects: the objects directly under a prefix with a suffix, sorted, as full URLs; a
// cancelled listing ends with kCancelled naming the URL, and an HTTP URL cannot be listed.
TEST(ObjectSourceLive, ListObjectsListsAPrefixOrSaysWhy) {
  REQUIRE_LIVE(live);
  auto local = Checkpoint::Open(live->local);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  std::vector<std::string> want;
  for (const auto& f : (*local)->files()) {
    want.push_back(live->url + "/" + f.path.substr(f.path.rfind('/') + 1));
  }
  std::sort(want.begin(), want.end());
  ASSERT_GT(want.size(), 1u);
  auto listed = ListObjects(live->url, ".safetensors", ObjectStoreOptions{});
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, want);
  auto slash = ListObjects(live->url + "/", ".safetensors", ObjectStoreOptions{});
  ASSERT_TRUE(slash.ok()) << slash.status().ToString();
  EXPECT_EQ(*slash, want);
  auto none = ListObjects(live->url, ".jinja", ObjectStoreOptions{});
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->empty());

  const std::atomic<bool> cancel{true};
  auto cancelled = ListObjects(live->url, ".safetensors", ObjectStoreOptions{}, &cancel);
  ASSERT_FALSE(cancelled.ok());
  EXPECT_EQ(cancelled.status().code(), Code::kCancelled) << cancelled.status().ToString();
  EXPECT_NE(cancelled.status().message().find(live->url), std::string::npos)
      << cancelled.status().message();

  auto http = ListObjects("http://127.0.0.1:9/models/m", ".safetensors", ObjectStoreOptions{});
  ASSERT_FALSE(http.ok());
  EXPECT_EQ(http.status().code(), Code::kNotFound);
  EXPECT_NE(http.status().message().find("an HTTP server cannot be listed"), std::string::npos)
      << http.status().message();
}

}  // namespace
}  // namespace tensorferry

#include "tensorferry/loader.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <thread>

#include "io/filesystem.h"
#include "io/mapped_file.h"
#include "io/read_engine.h"
#include "tensorferry/mapping.h"
#include "tensorferry/residency.h"
#include "tensorferry/size.h"
#include "tensorferry/writer.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::MemoryEnv;
using testing::ReadBytes;
using testing::TempDir;

// A sharded checkpoint of `layers` Llama-like layers with odd-sized tensors of several dtypes,
// filled with a pattern derived from the name.
struct Fixture : testing::TestCheckpoint {
  // `rows` scales the leading dimension of the matrices (1: a few KB in all; 1000: megabytes).
  explicit Fixture(int layers = 4, uint64_t shard = 4096, uint64_t rows = 1)
      : TestCheckpoint(
            [](uint64_t i, size_t h) { return static_cast<char>((i * 131 + h) & 0xff); }) {
    testing::AddLayeredModel(*this, layers, rows);
    Write(shard);
  }
};

using testing::HostBytes;

// LoadOptions::cancel: a load that starts cancelled reads nothing; one cancelled from a callback
// delivers no further batch; both return kCancelled. Tiny chunk sizes are clamped, threads too.
TEST(Loader, CancelStopsTheLoad) {
  Fixture f(8, 4096, 200);
  for (Engine engine : {Engine::kPread, Engine::kIoUring, Engine::kMmap}) {
    LoadOptions o;
    o.engine = engine;
    o.budget = 64 << 10;  // many batches
    o.allow_oversized = true;
    auto cancel = std::make_shared<std::atomic<bool>>(true);
    o.cancel = cancel;
    auto loader = Loader::Open(f.dir.path(), o).value();
    size_t delivered = 0;
    const Status none = loader->Stream(Selection::All(), [&](Batch) {
      ++delivered;
      return Status::Ok();
    });
    EXPECT_EQ(none.code(), Code::kCancelled) << none.ToString();
    EXPECT_EQ(delivered, 0u);
    cancel->store(false);
    size_t batches = 0;
    const Status s = loader->Stream(Selection::All(), [&](Batch) {
      ++batches;
      cancel->store(true);
      return Status::Ok();
    });
    EXPECT_EQ(s.code(), Code::kCancelled) << s.ToString();
    EXPECT_EQ(batches, 1u);
    cancel->store(false);
    size_t tensors = 0;  // cleared: loads again
    const Status all = loader->Stream(Selection::All(), [&](Batch b) {
      tensors += b.tensors.size();
      return Status::Ok();
    });
    ASSERT_TRUE(all.ok()) << all.ToString();
    EXPECT_EQ(tensors, f.tensors.size());
  }
}

TEST(Loader, LoadsEveryTensorByteExact) {
  Fixture f;
  for (unsigned threads : {1u, 3u}) {
    for (uint64_t chunk : {uint64_t{1}, uint64_t{7}, uint64_t{64}, uint64_t{8} << 20}) {
      LoadOptions o;
      o.threads = threads;
      o.chunk_size = chunk;
      auto loader = Loader::Open(f.dir.path(), o);
      ASSERT_TRUE(loader.ok()) << loader.status().ToString();
      auto tensors = (*loader)->Load();
      ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
      ASSERT_EQ(tensors->size(), f.tensors.size());
      for (const Tensor& t : *tensors) {
        EXPECT_EQ(HostBytes(t), f.Full(t.name())) << t.name() << " chunk " << chunk;
        const TensorInfo* info = (*loader)->checkpoint()->Find(t.name());
        EXPECT_EQ(t.dtype(), info->dtype);
        EXPECT_EQ(t.shape(), info->shape);
      }
      EXPECT_EQ((*loader)->stats().tensors, f.tensors.size());
    }
  }
}

// LoadOptions::memory_limit: with no budget, a checkpoint larger than the memory the process may
// use streams under a budget of that much, and Load refuses before reading, naming the limit.
TEST(Loader, MemoryLimitBoundsLoadsWithoutABudget) {
  Fixture f(8, 1u << 30, 200);
  const uint64_t total = f.total;
  const uint64_t limit = total / 4;
  for (Engine engine : {Engine::kPread, Engine::kIoUring}) {
    LoadOptions o;
    o.engine = engine;
    o.memory_limit = limit;
    auto loader = Loader::Open(f.dir.path(), o).value();
    auto refused = loader->Load();
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), Code::kBudgetExceeded);
    EXPECT_NE(refused.status().message().find("host memory limit of " + FormatBytes(limit) +
                                              " (the memory_limit option)"),
              std::string::npos)
        << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("--budget"), std::string::npos);
    EXPECT_EQ(loader->stats().bytes_read, 0u);
    size_t tensors = 0;
    const Status s = loader->Stream(Selection::All(), [&](Batch b) {
      for (const Tensor& t : b.tensors) {
        EXPECT_EQ(HostBytes(t), f.Full(t.name())) << t.name();
        ++tensors;
      }
      return Status::Ok();
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(tensors, f.tensors.size());
    EXPECT_GT(loader->stats().batches, 1u);
    EXPECT_LE(loader->stats().peak_budget_bytes, limit);
  }
  // A selection that fits, "off", the mmap engine and an explicit budget are not affected.
  LoadOptions fits;
  fits.engine = Engine::kPread;
  fits.memory_limit = total * 2;
  EXPECT_TRUE(Loader::Open(f.dir.path(), fits).value()->Load().ok());
  LoadOptions off = fits;
  ASSERT_TRUE(off.Set("memory_limit", "off").ok());
  EXPECT_TRUE(Loader::Open(f.dir.path(), off).value()->Load().ok());
  LoadOptions mapped;
  mapped.engine = Engine::kMmap;
  mapped.memory_limit = limit;
  EXPECT_TRUE(Loader::Open(f.dir.path(), mapped).value()->Load().ok());
  LoadOptions budgeted;
  budgeted.engine = Engine::kPread;
  budgeted.memory_limit = limit;
  budgeted.budget = total;
  EXPECT_TRUE(Loader::Open(f.dir.path(), budgeted).value()->Load().ok());
}

// LoadOptions::drop_cache: the files a load read leave the page cache when it ends.
TEST(Loader, DropCacheEvictsTheFilesRead) {
  Fixture f(4, 1u << 30, 200);
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kPread;
  o.direct = DirectIO::kOff;
  auto warm = Loader::Open(f.dir.path(), o).value()->Load();
  ASSERT_TRUE(warm.ok());
  ASSERT_GT(*CachedFraction(path), 0.9);  // buffered reads leave it cached
  o.drop_cache = true;
  auto loader = Loader::Open(f.dir.path(), o).value();
  auto tensors = loader->Load();
  ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
  for (const Tensor& t : *tensors) EXPECT_EQ(HostBytes(t), f.Full(t.name()));
  EXPECT_LT(*CachedFraction(path), 0.1);
  // Automatic engine with prefer_mmap (the Python package's default): not mapped when the pages
  // are to go, so they do go; an explicit mmap engine is refused.
  ASSERT_TRUE(Loader::Open(f.dir.path(), LoadOptions{}).value()->Load().ok());  // cached again
  LoadOptions automatic;
  automatic.prefer_mmap = true;
  automatic.drop_cache = true;
  auto read = Loader::Open(f.dir.path(), automatic).value();
  EXPECT_NE(read->stats().engine, "mmap") << read->stats().engine_reason;
  ASSERT_TRUE(read->Load().ok());
  EXPECT_LT(*CachedFraction(path), 0.1);
  automatic.engine = Engine::kMmap;
  EXPECT_EQ(Loader::Open(f.dir.path(), automatic).status().code(), Code::kInvalidArgument);
  // LoadInto too: the destinations are the caller's, the pages go.
  LoadOptions keep = o;
  keep.drop_cache = false;
  ASSERT_TRUE(Loader::Open(f.dir.path(), keep).value()->Load().ok());  // cached again
  ASSERT_GT(*CachedFraction(path), 0.9);
  auto into = Loader::Open(f.dir.path(), o).value();
  const Description all = into->Describe(Selection::All()).value();
  std::vector<std::vector<std::byte>> buffers;
  std::vector<Destination> destinations;
  for (const OutputInfo& out : all.outputs) {
    buffers.emplace_back(out.bytes);
    destinations.push_back({out.name, Device::CPU(), buffers.back().data(), out.bytes});
  }
  const Status s = into->LoadInto(destinations);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_LT(*CachedFraction(path), 0.1);
}

// Rewrites `path` in place (the same inode, as cp does) with the bytes of its second half
// inverted, its mtime moved 5 s on (a coarse clock must not hide the change).
void RewriteSecondHalfInPlace(const std::string& path) {
  std::string other = ReadBytes(path);
  for (size_t i = other.size() / 2; i < other.size(); ++i) other[i] = static_cast<char>(~other[i]);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::pwrite(fd, other.data(), other.size(), 0), static_cast<ssize_t>(other.size()));
  const struct timespec later[2] = {{0, UTIME_OMIT}, {::time(nullptr) + 5, 0}};
  EXPECT_EQ(::futimens(fd, later), 0);
  ::close(fd);
}

// A file rewritten in place while a load reads it (`cp` over a shard: same size, other bytes):
// the batch read across the change is not handed out; the load fails naming the file. Copying
// engines (the mapped one's pages are leased).
TEST(Loader, AFileRewrittenDuringAStreamFailsItsNextBatch) {
  Fixture f(8, 1u << 30, 200);
  const std::string path = f.dir.Join("model.safetensors");
  const std::string original = ReadBytes(path);
  for (Engine engine : {Engine::kPread, Engine::kIoUring}) {
    SCOPED_TRACE(EngineName(engine));
    testing::WriteBytes(path, original);
    LoadOptions o;
    o.engine = engine;
    o.budget = 64 << 10;  // many batches
    o.allow_oversized = true;
    auto loader = Loader::Open(f.dir.path(), o).value();
    size_t batches = 0;
    const Status s = loader->Stream(Selection::All(), [&](Batch b) {
      for (const Tensor& t : b.tensors) EXPECT_EQ(HostBytes(t), f.Full(t.name())) << t.name();
      if (++batches == 1) {
        RewriteSecondHalfInPlace(path);
      }
      return Status::Ok();
    });
    ASSERT_FALSE(s.ok()) << "no error after " << batches << " batches";
    EXPECT_NE(s.message().find("changed since the checkpoint was opened"), std::string::npos)
        << s.ToString();
    EXPECT_NE(s.message().find(path), std::string::npos) << s.ToString();
  }
  testing::WriteBytes(path, original);
}

TEST(Loader, TensorsOutliveLoaderAndCheckpoint) {
  Fixture f;
  std::vector<Tensor> kept;
  {
    auto loader = Loader::Open(f.dir.path());
    ASSERT_TRUE(loader.ok());
    auto tensors = (*loader)->Load(Selection::Names({"lm_head.weight", "model.layers.1.scalar"}));
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    kept = std::move(*tensors);
  }  // loader and checkpoint gone
  ASSERT_EQ(kept.size(), 2u);
  for (const Tensor& t : kept) EXPECT_EQ(HostBytes(t), f.Full(t.name()));
}

// The mmap engine's tensors are private copy-on-write views (the Python package hands them out
// writable): what a caller writes to one load's tensors is not what the next load of the same
// Loader hands out, whole or by name, and the first load's tensors keep the caller's bytes.
TEST(Loader, MappedTensorsWrittenByTheCallerDoNotReachTheNextLoad) {
  Fixture f;
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  auto first = (*loader)->Load();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ((*loader)->stats().engine, "mmap");
  for (const Tensor& t : *first) {
    if (t.size() > 0) const_cast<std::byte*>(t.data())[0] ^= std::byte{0xFF};
  }
  for (int round = 0; round < 2; ++round) {
    auto again =
        round == 0 ? (*loader)->Load() : (*loader)->Load(Selection::Names({"lm_head.weight"}));
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    for (const Tensor& t : *again) EXPECT_EQ(HostBytes(t), f.Full(t.name())) << t.name();
    for (const Tensor& t : *again) {
      if (t.size() > 0) const_cast<std::byte*>(t.data())[0] ^= std::byte{0x0F};
    }
  }
  for (const Tensor& t : *first) {
    if (t.size() == 0) continue;
    std::string want = f.Full(t.name());
    want[0] = static_cast<char>(want[0] ^ 0xFF);
    EXPECT_EQ(HostBytes(t), want) << t.name();
  }
}

TEST(Loader, SelectionByNameMissingIsNotFound) {
  Fixture f;
  auto loader = Loader::Open(f.dir.path());
  ASSERT_TRUE(loader.ok());
  auto r = (*loader)->Load(Selection::Names({"nope"}));
  EXPECT_EQ(r.status().code(), Code::kNotFound);
}

// Found by a review: peak_budget_bytes kept the highest of every earlier load of the loader.
// It is each load's own peak (tensors still held from earlier loads included).
TEST(Loader, PeakBudgetBytesIsTheLastLoads) {
  Fixture f(8);
  LoadOptions o;
  o.budget = 1 << 20;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  uint64_t all = 0;
  {
    auto everything = (*loader)->Load();
    ASSERT_TRUE(everything.ok()) << everything.status().ToString();
    all = (*loader)->stats().peak_budget_bytes;
    EXPECT_GT(all, 0u);
  }
  const std::string one = f.tensors[0].name;
  auto small = (*loader)->Load(Selection::Names({one}));
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  const uint64_t peak = (*loader)->stats().peak_budget_bytes;
  EXPECT_GT(peak, 0u);
  EXPECT_LT(peak, all);
  EXPECT_LE(peak, (*small)[0].size() + 4096) << "one tensor's buffer (alignment at most)";
}

TEST(Loader, StreamUnderBudgetNeverExceedsIt) {
  Fixture f(8);
  const uint64_t budget = 600;
  LoadOptions o;
  o.budget = budget;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  std::map<std::string, int> seen;
  size_t batches = 0;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    EXPECT_LE(b.bytes, budget);
    ++batches;
    for (const Tensor& t : b.tensors) {
      ++seen[t.name()];
      EXPECT_EQ(HostBytes(t), f.Full(t.name()));
    }
    return Status::Ok();  // tensors dropped here: budget returns
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GT(batches, 3u);
  EXPECT_EQ(seen.size(), f.tensors.size());
  for (auto& [name, n] : seen) EXPECT_EQ(n, 1) << name;
  EXPECT_LE((*loader)->stats().peak_budget_bytes, budget);
  EXPECT_GT((*loader)->stats().buffers_reused, 0u) << "released buffers are reused";
}

// The pull API: the batches of Stream, in order, under the budget; nullopt at the end (and after
// it); the load's totals once it ends; an iterator abandoned midway leaves the loader usable.
TEST(Loader, IterateDeliversStreamsBatchesOnePerNext) {
  Fixture f(8);
  LoadOptions o;
  o.budget = 600;
  auto loader = Loader::Open(f.dir.path(), o).value();
  std::vector<std::vector<std::string>> streamed;
  ASSERT_TRUE(loader
                  ->Stream(Selection::All(),
                           [&](Batch b) {
                             auto& names = streamed.emplace_back();
                             for (const Tensor& t : b.tensors) names.push_back(t.name());
                             return Status::Ok();
                           })
                  .ok());
  const LoadStats stream_stats = loader->stats();
  {
    BatchIterator batches = loader->Iterate(Selection::All()).value();
    size_t k = 0;
    for (;;) {
      Result<std::optional<Batch>> got = batches.Next();
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      if (!*got) break;
      const Batch& b = **got;
      EXPECT_EQ(b.index, k);
      EXPECT_EQ(b.count, streamed.size());
      EXPECT_LE(b.bytes, o.budget);
      ASSERT_LT(k, streamed.size());
      ASSERT_EQ(b.tensors.size(), streamed[k].size());
      for (size_t i = 0; i < b.tensors.size(); ++i) {
        EXPECT_EQ(b.tensors[i].name(), streamed[k][i]);
        EXPECT_EQ(HostBytes(b.tensors[i]), f.Full(b.tensors[i].name()));
      }
      ++k;
    }
    EXPECT_EQ(k, streamed.size());
    EXPECT_FALSE(batches.Next().value().has_value());
    const LoadStats stats = loader->stats();
    EXPECT_EQ(stats.tensors, stream_stats.tensors);
    EXPECT_EQ(stats.bytes, stream_stats.bytes);
    EXPECT_EQ(stats.batches, stream_stats.batches);
    EXPECT_EQ(stats.bytes_read, stream_stats.bytes_read);
    EXPECT_LE(stats.peak_budget_bytes, o.budget);
  }
  {
    BatchIterator abandoned = loader->Iterate(Selection::All()).value();
    ASSERT_TRUE(abandoned.Next().value().has_value());  // the next one is being read ahead
  }
  {
    // A move hands the load on; the moved-from iterator has nothing left to give.
    BatchIterator first = loader->Iterate(Selection::All()).value();
    ASSERT_TRUE(first.Next().value().has_value());
    BatchIterator second = std::move(first);
    EXPECT_FALSE(first.Next().value().has_value());  // NOLINT(bugprone-use-after-move)
    size_t rest = 0;
    while (second.Next().value().has_value()) ++rest;
    EXPECT_EQ(rest + 1, streamed.size());
  }
  EXPECT_EQ(loader->Load(Selection::Names({f.tensors.front().name})).value().size(), 1u);
}

TEST(Loader, HoldingEarlierBatchesIsAClearBudgetError) {
  Fixture f(8);
  LoadOptions o;
  o.budget = 600;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  std::vector<Tensor> hoard;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    for (Tensor& t : b.tensors) hoard.push_back(std::move(t));
    return Status::Ok();
  });
  EXPECT_EQ(s.code(), Code::kBudgetExceeded) << s.ToString();
  EXPECT_NE(s.message().find("held by tensors of earlier batches"), std::string::npos);
  // What was delivered is intact.
  for (const Tensor& t : hoard) EXPECT_EQ(HostBytes(t), f.Full(t.name()));
  // Load of more than the budget is refused up front.
  EXPECT_EQ((*loader)->Load().status().code(), Code::kBudgetExceeded);
}

TEST(Loader, OversizedTensor) {
  Fixture f;
  LoadOptions o;
  o.budget = 100;  // the embedding is 462 bytes
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  Status s = (*loader)->Stream(Selection::All(), [](Batch) { return Status::Ok(); });
  EXPECT_EQ(s.code(), Code::kBudgetExceeded);
  EXPECT_NE(s.message().find("more than the budget of 100 bytes"), std::string::npos)
      << s.message();
  o.allow_oversized = true;
  auto loader2 = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader2.ok());
  size_t n = 0;
  ASSERT_TRUE((*loader2)
                  ->Stream(Selection::All(),
                           [&](Batch b) {
                             n += b.tensors.size();
                             return Status::Ok();
                           })
                  .ok());
  EXPECT_EQ(n, f.tensors.size());
}

TEST(Loader, LayerByLayerDelivery) {
  Fixture f(5);
  LoadOptions o;
  o.order = DeliveryOrder::kLayer;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  std::vector<std::optional<uint32_t>> order;
  ASSERT_TRUE((*loader)
                  ->Stream(Selection::All(),
                           [&](Batch b) {
                             std::optional<uint32_t> layer = LayerOf(b.tensors.at(0).name());
                             for (const Tensor& t : b.tensors)
                               EXPECT_EQ(LayerOf(t.name()), layer) << t.name();
                             order.push_back(layer);
                             return Status::Ok();
                           })
                  .ok());
  ASSERT_EQ(order.size(), 6u);
  EXPECT_FALSE(order[0].has_value());
  for (uint32_t l = 0; l < 5; ++l) EXPECT_EQ(order[l + 1], l);
  auto some = (*loader)->Load(Selection::Layers(1, 2));
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(some->size(), 8u);
}

TEST(Loader, CallbackErrorStopsTheLoad) {
  Fixture f(8);
  LoadOptions o;
  o.budget = 600;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  int calls = 0;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch) {
    ++calls;
    return Status(Code::kInvalidArgument, "stop");
  });
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(calls, 1);
}

// --- engines -----------------------------------------------------------------------------------

struct EngineCase {
  Engine engine;
  DirectIO direct;
  bool populate;
};

std::string CaseName(const EngineCase& c) {
  return std::string(EngineName(c.engine)) + "/direct=" + std::string(DirectIOName(c.direct)) +
         (c.populate ? "/populate" : "");
}

std::vector<EngineCase> AllEngineCases() {
  std::vector<EngineCase> cases;
  for (Engine e : {Engine::kAuto, Engine::kPread, Engine::kIoUring}) {
    for (DirectIO d : {DirectIO::kOff, DirectIO::kOn, DirectIO::kAuto})
      cases.push_back({e, d, false});
  }
  cases.push_back({Engine::kMmap, DirectIO::kAuto, false});
  cases.push_back({Engine::kMmap, DirectIO::kAuto, true});
  return cases;
}

bool IoUringWorks() {
  LoadOptions o;
  o.engine = Engine::kIoUring;
  Fixture f(1);
  return Loader::Open(f.dir.path(), o).ok();
}

// Every engine and O_DIRECT mode, several thread counts and chunk sizes (including ones that cut
// tensors mid-element), on a checkpoint of odd-sized tensors of several dtypes at unaligned
// offsets: the bytes must equal what was written. Big tensors make the O_DIRECT middles real.
TEST(LoaderEngines, ByteExactForEveryEngine) {
  Fixture small;
  Fixture big(3, 600000, 1000);  // ~1.5 MB in 3 files
  const bool uring = IoUringWorks();
  for (const EngineCase& c : AllEngineCases()) {
    if (c.engine == Engine::kIoUring && !uring) continue;
    for (Fixture* f : {&small, &big}) {
      for (unsigned threads : {1u, 3u}) {
        for (uint64_t chunk : {uint64_t{7}, uint64_t{4096}, uint64_t{8} << 20}) {
          if (f == &big && chunk == 7) continue;  // too many tasks to be quick
          LoadOptions o;
          o.engine = c.engine;
          o.direct = c.direct;
          o.populate = c.populate;
          o.threads = threads;
          o.chunk_size = chunk;
          o.queue_depth = 4;
          auto loader = Loader::Open(f->dir.path(), o);
          ASSERT_TRUE(loader.ok()) << CaseName(c) << ": " << loader.status().ToString();
          auto tensors = (*loader)->Load();
          ASSERT_TRUE(tensors.ok()) << CaseName(c) << ": " << tensors.status().ToString();
          ASSERT_EQ(tensors->size(), f->tensors.size());
          for (const Tensor& t : *tensors) {
            ASSERT_EQ(HostBytes(t), f->Full(t.name()))
                << CaseName(c) << " " << t.name() << " threads " << threads << " chunk " << chunk;
          }
          const LoadStats s = (*loader)->stats();
          EXPECT_NE(s.engine, "auto");
          if (c.engine != Engine::kAuto) {
            EXPECT_EQ(s.engine, EngineName(c.engine));
          }
          if (c.direct == DirectIO::kOff || c.engine == Engine::kMmap) {
            EXPECT_EQ(s.direct_bytes, 0u) << CaseName(c);
          }
        }
      }
    }
  }
}

TEST(LoaderEngines, DirectReadsBypassThePageCacheWhereSupported) {
  Fixture f(3, 600000, 1000);
  // Whether this file system takes O_DIRECT at all (tmpfs does not).
  auto any = Env::Default()->OpenRandomAccess((*Checkpoint::Open(f.dir.path()))->files()[0].path);
  ASSERT_TRUE(any.ok());
  auto probe = io::DirectFile::Open(**any);
  const bool supported = probe.ok() && *probe;
  for (Engine e : {Engine::kPread, Engine::kIoUring}) {
    if (e == Engine::kIoUring && !IoUringWorks()) continue;
    LoadOptions o;
    o.engine = e;
    o.direct = DirectIO::kOn;
    auto loader = Loader::Open(f.dir.path(), o);
    ASSERT_TRUE(loader.ok());
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    const LoadStats s = (*loader)->stats();
    if (supported) {
      EXPECT_GT(s.direct_files, 0u) << EngineName(e);
      // The big tensors' aligned middles, at least: most of the bytes.
      EXPECT_GT(s.direct_bytes, s.bytes / 2) << EngineName(e);
    } else {
      EXPECT_EQ(s.direct_files, 0u);
      EXPECT_EQ(s.direct_bytes, 0u);
    }
    EXPECT_EQ(s.direct_files + s.buffered_files, (*loader)->checkpoint()->files().size());
  }
}

TEST(LoaderEngines, MmapTensorsOutliveTheLoaderAndAreViews) {
  Fixture f;
  std::vector<Tensor> kept;
  {
    LoadOptions o;
    o.engine = Engine::kMmap;
    auto loader = Loader::Open(f.dir.path(), o);
    ASSERT_TRUE(loader.ok());
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    EXPECT_EQ((*loader)->stats().buffers_allocated, 0u);  // nothing copied
    kept = std::move(*tensors);
  }
  for (const Tensor& t : kept) EXPECT_EQ(HostBytes(t), f.Full(t.name()));
}

// A checkpoint opened by a relative path is found again by path later (O_DIRECT descriptors, the
// check that the path still names the file): a chdir in between changes nothing.
TEST(LoaderEngines, ARelativePathStillNamesItsFileAfterAChdir) {
  Fixture f(2, 1u << 30, 100);
  char before[4096];
  ASSERT_NE(::getcwd(before, sizeof before), nullptr);
  ASSERT_EQ(::chdir(f.dir.path().c_str()), 0);
  for (Engine engine : testing::AvailableEngines()) {
    LoadOptions o;
    o.engine = engine;
    o.direct = engine == Engine::kMmap ? DirectIO::kOff : DirectIO::kOn;
    ASSERT_EQ(::chdir(f.dir.path().c_str()), 0);
    auto loader = Loader::Open("./model.safetensors", o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    EXPECT_EQ((*loader)->checkpoint()->files()[0].path, f.dir.Join("model.safetensors"));
    ASSERT_EQ(::chdir("/"), 0);
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << EngineName(engine) << ": " << tensors.status().ToString();
    for (const Tensor& t : *tensors) EXPECT_EQ(HostBytes(t), f.Full(t.name())) << t.name();
  }
  ASSERT_EQ(::chdir(before), 0);
}

// Turns mapping leases off for one test (the loud-failure guard alone), and back on after it.
struct WithoutLeases {
  WithoutLeases() { SetMappingLeases(false); }
  ~WithoutLeases() { SetMappingLeases(true); }
};

std::vector<std::vector<std::byte>> CopyBytes(const std::vector<Tensor>& tensors) {
  std::vector<std::vector<std::byte>> out;
  for (const Tensor& t : tensors) out.emplace_back(t.data(), t.data() + t.size());
  return out;
}

// Another process opens `path` for writing (waiting for a lease's break), overwrites its first
// `bytes` with 0xEE, then shrinks it to `shrink_to` bytes (>= 0) and/or moves its mtime 5 s on.
// Returns the child's exit status (0: all done), -1 when it did not exit normally.
int RewriteInAnotherProcess(const std::string& path, off_t bytes, off_t shrink_to,
                            bool later_mtime) {
  const pid_t child = ::fork();
  if (child < 0) return -1;
  if (child == 0) {  // only async-signal-safe calls here
    const int fd = ::open(path.c_str(), O_WRONLY);
    if (fd < 0) ::_exit(3);
    unsigned char junk[4096];
    for (unsigned char& c : junk) c = 0xEE;
    for (off_t at = 0; at < bytes; at += sizeof junk) {
      if (::pwrite(fd, junk, sizeof junk, at) < 0) ::_exit(4);
    }
    if (shrink_to >= 0 && ::ftruncate(fd, shrink_to) != 0) ::_exit(5);
    const struct timespec later[2] = {{0, UTIME_OMIT}, {::time(nullptr) + 5, 0}};
    if (later_mtime && ::futimens(fd, later) != 0) ::_exit(5);
    ::_exit(::close(fd) == 0 ? 0 : 6);
  }
  int status = 0;
  if (::waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// With a read lease (the default), a file truncated under the mmap engine's views does not take
// their bytes: the truncation waits until the mapping has been copied into private memory.
TEST(LoaderEngines, MmapLeaseKeepsTensorsWhenTheFileIsTruncated) {
  Fixture f(2, 1u << 30, 100);  // one file of ~100 KB
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(path, o);
  ASSERT_TRUE(loader.ok());
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok());
  const auto before = CopyBytes(*tensors);
  const MappingStats s0 = GetMappingStats();
  ASSERT_GE(s0.leased, 1u) << "no read lease taken (filesystem without leases?)";
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);  // this thread: blocks until the copy is made
  EXPECT_EQ(CopyBytes(*tensors), before);
  const MappingStats s1 = GetMappingStats();
  EXPECT_EQ(s1.copied, s0.copied + 1);
  EXPECT_EQ(s1.faults, s0.faults);
  EXPECT_TRUE(CheckMappedFiles().ok());
}

// Another process rewriting the file in place (open for writing, no truncation): the views keep
// the bytes they had, where a plain MAP_PRIVATE mapping would show the new ones.
TEST(LoaderEngines, MmapLeaseKeepsTensorsWhenAnotherProcessRewritesTheFile) {
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(path, o);
  ASSERT_TRUE(loader.ok());
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok());
  const auto before = CopyBytes(*tensors);
  // Every byte overwritten, then the file shrunk.
  ASSERT_EQ(RewriteInAnotherProcess(path, 1 << 17, /*shrink_to=*/100, /*later_mtime=*/false), 0);
  EXPECT_EQ(CopyBytes(*tensors), before);
  EXPECT_TRUE(CheckMappedFiles().ok());
}

// A lease broken without a copy taking the mapping's place (no memory for the copy here; also a
// copy slower than the kernel's lease-break time): the mapping stays the file's, so another
// process's in-place rewrite shows through the views. It is watched as a mapping without a lease
// is: CheckMappedFiles reports the rewrite (it went unsaid).
TEST(LoaderEngines, MmapLeaseBrokenWithoutACopyReportsAnInPlaceRewrite) {
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(path, o).value();
  auto tensors = loader->Load();
  ASSERT_TRUE(tensors.ok());
  ASSERT_GE(GetMappingStats().leased, 1u) << "no read lease taken (filesystem without leases?)";
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // its checks are 200 ms apart
  EXPECT_TRUE(CheckMappedFiles().ok());
  io::FailLeaseCopiesForTesting(true);
  const MappingStats s0 = GetMappingStats();
  // The writer waits for the break, then rewrites every byte in place.
  const int rewritten =
      RewriteInAnotherProcess(path, 1 << 16, /*shrink_to=*/-1, /*later_mtime=*/true);
  io::FailLeaseCopiesForTesting(false);
  ASSERT_EQ(rewritten, 0);
  EXPECT_EQ(GetMappingStats().copied, s0.copied);  // no copy was made
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  const Status s = CheckMappedFiles();
  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_NE(s.message().find(path + ": file rewritten in place"), std::string::npos)
      << s.ToString();
}

// Without a lease (leases off here; in practice: a file of another user, or already open for
// writing): touching the vanished pages must not kill the process (SIGBUS); they read as zeros,
// stderr says so at once, CheckMappedFiles reports it once, the next load refuses to start, and a
// later populated load reports the change.
TEST(LoaderEngines, MmapWithoutLeaseFailsLoudlyAfterTruncation) {
  WithoutLeases no_leases;
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(path, o);
  ASSERT_TRUE(loader.ok());
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok());
  EXPECT_EQ(GetMappingStats().leased, 0u);
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  // Every byte of every tensor: the process survives, the vanished pages read zeros.
  ::testing::internal::CaptureStderr();
  uint64_t nonzero = 0;
  for (const Tensor& t : *tensors) {
    for (uint64_t i = 0; i < t.size(); ++i) nonzero += t.data()[i] != std::byte{0};
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(nonzero, 0u);
  EXPECT_NE(said.find("tensorferry: error: " + path + ": file shrank"), std::string::npos) << said;
  auto refused = (*loader)->Load();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kUnexpectedEof);
  EXPECT_NE(refused.status().message().find(path), std::string::npos)
      << refused.status().ToString();
  // What the first vanished page held (the loader and its checkpoint still live).
  const std::string refusal = refused.status().message();
  const size_t held = refusal.find("; the read held tensor");
  ASSERT_NE(held, std::string::npos) << refusal;
  size_t named = 0;
  for (const Tensor& t : *tensors)
    named += refusal.find('"' + t.name() + '"', held) != std::string::npos;
  EXPECT_GE(named, 1u) << refusal;
  EXPECT_TRUE(CheckMappedFiles().ok());  // reported once
  o.populate = true;
  auto again = (*loader)->Load();
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(path), std::string::npos) << again.status().ToString();
}

// Without a lease, a file rewritten in place (the same size, other bytes: no page vanishes, no
// fault) shows through the mapped tensors; CheckMappedFiles says so, once, naming the file.
TEST(LoaderEngines, MmapWithoutLeaseReportsAnInPlaceRewrite) {
  WithoutLeases no_leases;
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(path, o).value();
  auto tensors = loader->Load();
  ASSERT_TRUE(tensors.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // its checks are 200 ms apart
  EXPECT_TRUE(CheckMappedFiles().ok());
  RewriteSecondHalfInPlace(path);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  const Status s = CheckMappedFiles();
  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_NE(s.message().find(path + ": file rewritten in place"), std::string::npos)
      << s.ToString();
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_TRUE(CheckMappedFiles().ok());  // once
}

TEST(LoaderEngines, MmapPopulateReportsAFileThatShrankUnderneath) {
  WithoutLeases no_leases;
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  auto file = Env::Default()->OpenRandomAccess(path);
  ASSERT_TRUE(file.ok());
  const uint64_t size = *(*file)->Size();
  auto map = io::MappedFile::Map(**file, size);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_FALSE((*map)->leased());
  ASSERT_TRUE((*map)->Populate(0, size).ok());
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  Status s = (*map)->Populate(0, size);
  EXPECT_EQ(s.code(), Code::kUnexpectedEof) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos);
  // Touch a vanished page directly: repaired with zeros and counted, not a crash.
  ::testing::internal::CaptureStderr();
  const volatile std::byte* p = (*map)->data();
  const std::byte last = p[size - 1];
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(last, std::byte{0});
  EXPECT_GE((*map)->faults(), 1u);
  EXPECT_EQ((*map)->first_fault_offset() % 4096, 0u);
  EXPECT_EQ(CheckMappedFiles().code(), Code::kUnexpectedEof);
}

// A broken lease's descriptor is closed, and the next lease often gets its number: the first
// mapping's end must not end the second one's lease (it did: leases were known by number only).
TEST(LoaderEngines, MmapABrokenLeasesNumberIsNotAnotherMappingsLease) {
  Fixture fa(2, 1u << 30, 100), fb(3, 1u << 30, 100);
  const std::string pa = fa.dir.Join("model.safetensors"), pb = fb.dir.Join("model.safetensors");
  auto file_a = Env::Default()->OpenRandomAccess(pa);
  auto file_b = Env::Default()->OpenRandomAccess(pb);
  ASSERT_TRUE(file_a.ok() && file_b.ok());
  const uint64_t size_a = *(*file_a)->Size(), size_b = *(*file_b)->Size();
  auto a = io::MappedFile::Map(**file_a, size_a);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE((*a)->leased()) << "no read lease taken (filesystem without leases?)";
  const uint64_t copied0 = GetMappingStats().copied;
  // Opening A for writing breaks its lease: the open returns once A was copied and let go.
  const int writer = ::open(pa.c_str(), O_WRONLY);
  ASSERT_GE(writer, 0);
  ::close(writer);
  EXPECT_EQ(GetMappingStats().copied, copied0 + 1);
  EXPECT_FALSE((*a)->leased());
  auto b = io::MappedFile::Map(**file_b, size_b);  // likely the number A's lease had
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_TRUE((*b)->leased());
  EXPECT_FALSE((*a)->leased());
  const uint64_t leased = GetMappingStats().leased;
  a->reset();  // A's mapping goes
  EXPECT_TRUE((*b)->leased());
  EXPECT_EQ(GetMappingStats().leased, leased);
  const std::string before(reinterpret_cast<const char*>((*b)->data()), size_b);
  ASSERT_EQ(::truncate(pb.c_str(), 0), 0);  // B is copied first, as its lease promises
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*b)->data()), size_b), before);
  EXPECT_EQ(GetMappingStats().copied, copied0 + 2);
  EXPECT_TRUE(CheckMappedFiles().ok());
}

// Leases are bounded (one descriptor each): mappings beyond kMaxLeases fall back on the loud
// guard, and a mapping's lease ends with it.
TEST(LoaderEngines, MmapLeasesAreBoundedAndReleased) {
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  auto file = Env::Default()->OpenRandomAccess(path);
  ASSERT_TRUE(file.ok());
  const uint64_t size = *(*file)->Size();
  const uint64_t leased0 = GetMappingStats().leased;
  std::vector<std::shared_ptr<io::MappedFile>> maps;
  for (size_t i = 0; i < io::MappedFile::kMaxLeases + 3; ++i) {
    auto map = io::MappedFile::Map(**file, size);
    ASSERT_TRUE(map.ok());
    maps.push_back(*map);
  }
  EXPECT_EQ(GetMappingStats().leased, io::MappedFile::kMaxLeases);
  EXPECT_TRUE(maps.front()->leased());
  EXPECT_FALSE(maps.back()->leased());
  maps.clear();
  EXPECT_EQ(GetMappingStats().leased, leased0);
}

TEST(LoaderEngines, NamesAndEnvironment) {
  for (Engine e : {Engine::kAuto, Engine::kPread, Engine::kIoUring, Engine::kMmap}) {
    EXPECT_EQ(*ParseEngine(EngineName(e)), e);
  }
  for (DirectIO d : {DirectIO::kAuto, DirectIO::kOn, DirectIO::kOff}) {
    EXPECT_EQ(*ParseDirectIO(DirectIOName(d)), d);
  }
  EXPECT_EQ(ParseEngine("fast").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ParseDirectIO("maybe").status().code(), Code::kInvalidArgument);

  ::setenv("TENSORFERRY_ENGINE", "mmap", 1);
  ::setenv("TENSORFERRY_BUDGET", "256MiB", 1);
  ::setenv("TENSORFERRY_DIRECT_IO", "off", 1);
  ::setenv("TENSORFERRY_THREADS", "3", 1);
  ::setenv("TENSORFERRY_QUEUE_DEPTH", "16", 1);
  ::setenv("TENSORFERRY_ORDER", "layer", 1);
  ::setenv("TENSORFERRY_POPULATE", "1", 1);
  auto o = LoadOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->engine, Engine::kMmap);
  EXPECT_EQ(o->budget, 256ull << 20);
  EXPECT_EQ(o->direct, DirectIO::kOff);
  EXPECT_EQ(o->threads, 3u);
  EXPECT_EQ(o->queue_depth, 16u);
  EXPECT_EQ(o->order, DeliveryOrder::kLayer);
  EXPECT_TRUE(o->populate);
  EXPECT_EQ(o->chunk_size, LoadOptions().chunk_size);  // unset: the default
  ::setenv("TENSORFERRY_BUDGET", "lots", 1);
  auto bad = LoadOptions::FromEnvironment();
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("TENSORFERRY_BUDGET=\"lots\""), std::string::npos)
      << bad.status().message();
  for (const char* v :
       {"TENSORFERRY_ENGINE", "TENSORFERRY_BUDGET", "TENSORFERRY_DIRECT_IO", "TENSORFERRY_THREADS",
        "TENSORFERRY_QUEUE_DEPTH", "TENSORFERRY_ORDER", "TENSORFERRY_POPULATE"}) {
    ::unsetenv(v);
  }
  EXPECT_TRUE(LoadOptions::FromEnvironment().ok());
}

// Engine::kAuto's choice and its reason, known from Open on; the files' file system in stats.
TEST(LoaderEngines, AutoSaysWhatItChoseAndWhy) {
  Fixture f;
  const std::string fs = io::DetectFileSystem(f.dir.path()).value().type;
  struct Case {
    Engine engine;
    bool prefer_mmap;
    std::string reason;
  };
  const bool uring = io::IoUringAvailable().ok();
  for (const Case& c :
       {Case{Engine::kAuto, false, uring ? "io_uring available" : "io_uring unavailable"},
        Case{Engine::kAuto, true, "local file system (prefer_mmap)"},
        Case{Engine::kPread, true, "set by the caller"},
        Case{Engine::kMmap, false, "set by the caller"}}) {
    LoadOptions o;
    o.engine = c.engine;
    o.prefer_mmap = c.prefer_mmap;
    auto loader = Loader::Open(f.dir.path(), o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    const LoadStats before = (*loader)->stats();
    const bool slow = io::DetectFileSystem(f.dir.path())->slow_faults();
    if (!slow) {
      const Engine want = c.engine != Engine::kAuto ? c.engine
                          : c.prefer_mmap           ? Engine::kMmap
                          : uring                   ? Engine::kIoUring
                                                    : Engine::kPread;
      EXPECT_EQ(before.engine, EngineName(want));
      EXPECT_EQ(before.engine_reason.rfind(c.reason, 0), 0u) << before.engine_reason;
    }
    EXPECT_EQ(before.filesystem, fs);
    EXPECT_EQ(before.tensors, 0u);
    ASSERT_TRUE((*loader)->Load().ok());
    const LoadStats after = (*loader)->stats();
    EXPECT_EQ(after.engine, before.engine);
    EXPECT_EQ(after.engine_reason, before.engine_reason);
    EXPECT_EQ(after.filesystem, fs);
    EXPECT_EQ(after.tensors, f.tensors.size());
  }
  LoadOptions o;
  ASSERT_TRUE(o.Set("prefer_mmap", "yes").ok());
  EXPECT_TRUE(o.prefer_mmap);
  EXPECT_FALSE(o.Set("prefer_mmap", "sometimes").ok());
}

// --- faults through the file interface ------------------------------------------------------

struct MemoryFixture {
  Fixture f{4, 1u << 20};  // one file
  MemoryEnv env;
  std::string path;
  MemoryFixture() {
    path = f.dir.Join("model.safetensors");
    env.AddFile(path, ReadBytes(path));
  }
  Result<std::unique_ptr<Loader>> Open(LoadOptions o = {}) {
    o.env = &env;
    return Loader::Open(path, o);
  }
};

TEST(LoaderFaults, ShortReadsStillLoadExactly) {
  MemoryFixture m;
  MemoryEnv::Faults faults;
  faults.max_read = 3;
  m.env.SetFaults(m.path, faults);
  auto loader = m.Open();
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
  for (const Tensor& t : *tensors) EXPECT_EQ(HostBytes(t), m.f.Full(t.name()));
}

TEST(LoaderFaults, EioNamesFileAndOffset) {
  MemoryFixture m;
  auto loader = m.Open();
  ASSERT_TRUE(loader.ok());
  MemoryEnv::Faults faults;
  const TensorInfo* t = (*loader)->checkpoint()->Find("lm_head.weight");
  faults.eio_at = static_cast<int64_t>(t->offset + 3);
  m.env.SetFaults(m.path, faults);
  auto r = (*loader)->Load();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kIoError);
  EXPECT_NE(r.status().message().find(m.path), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find(std::to_string(t->offset + 3)), std::string::npos);
}

// A bad sector inside a tensor: the error names that tensor first (what the failed read held from
// the failing offset on), with either engine, whole loads and LoadInto alike.
TEST(LoaderFaults, EioNamesTheTensorItHit) {
  for (Engine engine : {Engine::kPread, Engine::kIoUring}) {
    SCOPED_TRACE(EngineName(engine));
    MemoryFixture m;
    LoadOptions o;
    o.engine = engine;
    auto loader = m.Open(o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    for (const char* name : {"model.layers.1.mlp.up_proj.weight", "lm_head.weight"}) {
      SCOPED_TRACE(name);
      const TensorInfo* t = (*loader)->checkpoint()->Find(name);
      ASSERT_NE(t, nullptr);
      MemoryEnv::Faults faults;
      faults.eio_at = static_cast<int64_t>(t->offset + t->size / 2);
      m.env.SetFaults(m.path, faults);
      // The tensor first (alone, or before those after it in the same read).
      auto names_it = [&](const std::string& message) {
        const std::string quoted = "\"" + std::string(name) + "\"";
        return message.find("; the read held tensor " + quoted) != std::string::npos ||
               message.find("; the read held tensors " + quoted) != std::string::npos;
      };
      auto r = (*loader)->Load();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), Code::kIoError);
      EXPECT_NE(
          r.status().message().find("injected EIO at offset " + std::to_string(faults.eio_at)),
          std::string::npos)
          << r.status().message();
      EXPECT_TRUE(names_it(r.status().message())) << r.status().message();

      std::string into(t->size, '\0');
      const Destination d{name, Device::CPU(), into.data(), into.size()};
      const Status s = (*loader)->LoadInto({&d, 1});
      ASSERT_FALSE(s.ok());
      EXPECT_TRUE(names_it(s.message())) << s.message();
    }
  }
}

// A caller iterating in a loop holds batch k - 1 while it asks for batch k, so batch k + 1's
// memory is not free when it would be read ahead: the helper waits for the caller to drop batch
// k - 1 and reads then, not when the caller asks for batch k + 1. An iterator destroyed while its
// read-ahead waits ends the wait (no hang).
TEST(LoaderFaults, ReadAheadWaitsForTheCallerToDropTheBatchBefore) {
  MemoryFixture m;
  LoadOptions o;
  o.engine = Engine::kPread;
  uint64_t total = 0, largest = 0;
  {
    auto probe = m.Open();
    ASSERT_TRUE(probe.ok()) << probe.status().ToString();
    for (const TensorInfo& t : (*probe)->checkpoint()->tensors()) {
      total += t.size;
      largest = std::max(largest, t.size);
    }
  }
  o.budget = std::max(2 * largest, total / 2);  // batches of at most a quarter of the tensors
  auto loader = m.Open(o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  auto wait_for_reads_above = [&](uint64_t n) {
    for (int i = 0; i < 1000 && m.env.reads(m.path) <= n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return m.env.reads(m.path) > n;
  };
  {
    BatchIterator batches = (*loader)->Iterate(Selection::All()).value();
    std::optional<Batch> before = batches.Next().value();  // batch 0; batch 1 is read ahead
    ASSERT_TRUE(before.has_value());
    ASSERT_GE(before->count, 4u);
    std::optional<Batch> current = batches.Next().value();  // batch 1; batch 2 must wait
    ASSERT_TRUE(current.has_value());
    const uint64_t reads = m.env.reads(m.path);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(m.env.reads(m.path), reads) << "read ahead beyond the budget";
    before.reset();  // batch 0 dropped: batch 2 is read now, while the caller holds batch 1
    EXPECT_TRUE(wait_for_reads_above(reads)) << "the waiting read-ahead did not read";
    size_t k = 1;
    for (;;) {
      for (const Tensor& t : current->tensors) EXPECT_EQ(HostBytes(t), m.f.Full(t.name()));
      EXPECT_EQ(current->index, k);
      Result<std::optional<Batch>> got = batches.Next();  // batch k held during the call
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      if (!*got) break;
      current = std::move(*got);
      ++k;
    }
    EXPECT_EQ(k + 1, (*loader)->stats().batches);
    EXPECT_LE((*loader)->stats().peak_budget_bytes, o.budget);
  }
  {
    BatchIterator batches = (*loader)->Iterate(Selection::All()).value();
    std::optional<Batch> first = batches.Next().value();
    std::optional<Batch> second = batches.Next().value();  // batch 2's read-ahead waits
    ASSERT_TRUE(first && second);
  }  // destroyed with the wait pending: returns (the tensors stay valid)
  // Holding every batch: the waiting read-ahead gives up when the batch is asked for, and the
  // caller gets the budget error.
  BatchIterator batches = (*loader)->Iterate(Selection::All()).value();
  std::vector<Batch> hoard;
  Result<std::optional<Batch>> got = Status::Ok();
  while ((got = batches.Next()).ok() && got->has_value()) hoard.push_back(std::move(**got));
  EXPECT_EQ(got.status().code(), Code::kBudgetExceeded) << got.status().ToString();
  for (const Batch& b : hoard) {
    for (const Tensor& t : b.tensors) EXPECT_EQ(HostBytes(t), m.f.Full(t.name()));
  }
}

// The largest tensor of `f`, and its name.
std::pair<uint64_t, std::string> LargestTensor(const testing::TestCheckpoint& f) {
  std::pair<uint64_t, std::string> largest{0, ""};
  for (const auto& t : f.tensors) {
    if (f.Full(t.name).size() > largest.first) largest = {f.Full(t.name).size(), t.name};
  }
  return largest;
}

// Every engine, a loop that holds batch k - 1 while it asks for batch k, under a budget of 1.6x
// the largest tensor (read in tasks of `chunk_size`): every tensor over the budget less the
// largest goes alone, and no two batches held at once pass the budget.
void ExpectALoopHoldingTheBatchBeforeFits(const testing::TestCheckpoint& f, uint64_t chunk_size) {
  const auto [largest, largest_name] = LargestTensor(f);
  const uint64_t budget = largest * 16 / 10;  // the largest is 5/8 of it
  for (Engine engine : {Engine::kPread, Engine::kIoUring, Engine::kMmap}) {
    SCOPED_TRACE(EngineName(engine));
    LoadOptions o;
    o.engine = engine;
    o.budget = budget;
    o.chunk_size = chunk_size;
    auto loader = Loader::Open(f.dir.path(), o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    BatchIterator batches = (*loader)->Iterate(Selection::All()).value();
    std::optional<Batch> before;
    size_t tensors = 0;
    bool alone = false;
    for (;;) {
      Result<std::optional<Batch>> got = batches.Next();  // the batch before still held
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      if (!*got) break;
      const Batch& b = **got;
      uint64_t bytes = 0;
      for (const Tensor& t : b.tensors) {
        EXPECT_EQ(HostBytes(t), f.Full(t.name()));
        bytes += t.size();
      }
      if (bytes > budget - largest) {
        ASSERT_EQ(b.tensors.size(), 1u) << "a batch over the budget less the largest tensor";
        alone = alone || b.tensors[0].name() == largest_name;
      }
      tensors += b.tensors.size();
      before = std::move(*got);
    }
    EXPECT_TRUE(alone);
    EXPECT_EQ(tensors, f.tensors.size());
    const LoadStats st = (*loader)->stats();
    EXPECT_LE(st.peak_budget_bytes, budget);
    EXPECT_GT(st.batches, 4u);
    if (engine != Engine::kMmap) {
      EXPECT_LE(st.buffers_allocated, 3u);
    }
  }
}

// Under a budget smaller than twice the largest tensor, batches hold at most the budget less the
// largest tensor and a tensor over that goes alone, so a loop that holds batch k - 1 while it asks
// for batch k still fits (before, every batch took the whole budget and such a loop got
// kBudgetExceeded at batch 2), the same few buffers serve the whole load, and each engine
// delivers the exact bytes.
TEST(Loader, BatchesBesideATensorOverHalfTheBudgetStillFitTwoAtOnce) {
  Fixture f(8, 1u << 20, 200);  // embedding 92,400 bytes; layers 80,400 bytes each
  ExpectALoopHoldingTheBatchBeforeFits(f, LoadOptions{}.chunk_size);
  ExpectALoopHoldingTheBatchBeforeFits(f, 16u << 10);  // several tasks per tensor
  const uint64_t largest = LargestTensor(f).first;
  // Batches of less than a quarter of the budget would leave too few reads in flight: with the
  // largest tensor at 9/10 of the budget, batches take the whole budget again (as before).
  LoadOptions o;
  o.budget = largest * 10 / 9;
  auto loader = Loader::Open(f.dir.path(), o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  uint64_t most = 0;
  ASSERT_TRUE((*loader)
                  ->Stream(Selection::All(),
                           [&](Batch b) {
                             uint64_t bytes = 0;
                             for (const Tensor& t : b.tensors) bytes += t.size();
                             most = std::max(most, bytes);
                             return Status::Ok();
                           })
                  .ok());
  EXPECT_GT(most, o.budget - largest);
  EXPECT_LE(most, o.budget);
}

// The same at sizes past the huge page (and past the task size, with 1 MiB tasks): buffers of
// megabytes, which the pool trims when a smaller batch reuses the buffer of the tensor that went
// alone.
// Two tensors that go alone, one after the other in the file (an lm_head beside the embedding, as
// in a single-file Llama checkpoint), would pass the budget together: a batch within the budget is
// delivered between them, so a loop holding the batch before still fits.
TEST(Loader, TwoTensorsThatGoAloneOneAfterTheOtherGetABatchBetweenThem) {
  testing::TestCheckpoint f(
      [](uint64_t i, size_t h) { return static_cast<char>((i * 131 + h) & 0xff); });
  f.Add("lm_head.weight", DType::kBF16, {33 * 200, 7});
  f.Add("model.embed_tokens.weight", DType::kBF16, {33 * 200, 7});
  for (int l = 0; l < 6; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    f.Add(p + "self_attn.q_proj.weight", DType::kBF16, {13 * 200, 7});
    f.Add(p + "mlp.up_proj.weight", DType::kF32, {5 * 200, 11});
  }
  f.Write(1u << 20);
  auto ckpt = Checkpoint::Open(f.dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const TensorInfo* head = (*ckpt)->Find("lm_head.weight");
  const TensorInfo* embed = (*ckpt)->Find("model.embed_tokens.weight");
  ASSERT_TRUE(head != nullptr && embed != nullptr);
  ASSERT_EQ(head->file, embed->file);
  ASSERT_EQ(head->offset + head->size, embed->offset) << "the two are next to each other";
  ExpectALoopHoldingTheBatchBeforeFits(f, LoadOptions{}.chunk_size);
  ExpectALoopHoldingTheBatchBeforeFits(f, 16u << 10);
}

TEST(Loader, BatchesBesideATensorOverHalfTheBudgetStillFitTwoAtOnceInLargeBuffers) {
  Fixture f(8, 64u << 20, 6000);  // embedding 2.77 MB; layers 2.41 MB each
  ExpectALoopHoldingTheBatchBeforeFits(f, LoadOptions{}.chunk_size);
  ExpectALoopHoldingTheBatchBeforeFits(f, 1u << 20);
}

TEST(LoaderFaults, TruncatedMidLoad) {
  MemoryFixture m;
  auto loader = m.Open();
  ASSERT_TRUE(loader.ok());
  MemoryEnv::Faults faults;
  faults.truncate_after_reads = 2;
  faults.truncate_to = 300;
  m.env.SetFaults(m.path, faults);
  auto r = (*loader)->Load();
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().code() == Code::kUnexpectedEof || r.status().code() == Code::kIoError)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find(m.path), std::string::npos) << r.status().message();
}

TEST(LoaderFaults, FileReplacedBetweenOpenAndRead) {
  MemoryFixture m;
  // The real file: the checkpoint reads the MemoryEnv file it opened, and a MemoryEnv has no path
  // to stat (checkpoint_files_test.cc covers same-size replacements).
  auto loader = Loader::Open(m.path, {});
  ASSERT_TRUE(loader.ok());
  testing::WriteBytes(m.path, ReadBytes(m.path).substr(0, 100));  // rewritten shorter
  auto r = (*loader)->Load();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("changed since the checkpoint was opened"), std::string::npos)
      << r.status().ToString();
}

TEST(Loader, SeveralLoadersAtOnce) {
  Fixture f(6);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      LoadOptions o;
      o.threads = 2;
      o.budget = i % 2 ? 700 : 0;
      auto loader = Loader::Open(f.dir.path(), o);
      if (!loader.ok()) {
        ++failures;
        return;
      }
      for (int rep = 0; rep < 3; ++rep) {
        Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
          for (const Tensor& t : b.tensors) {
            if (HostBytes(t) != f.Full(t.name())) ++failures;
          }
          return Status::Ok();
        });
        if (!s.ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace tensorferry

#include "tensorferry/loader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <thread>

#include "io/mapped_file.h"
#include "io/read_engine.h"
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

std::string Bytes(const Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data()), t.size());
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
        EXPECT_EQ(Bytes(t), f.Full(t.name())) << t.name() << " chunk " << chunk;
        const TensorInfo* info = (*loader)->checkpoint()->Find(t.name());
        EXPECT_EQ(t.dtype(), info->dtype);
        EXPECT_EQ(t.shape(), info->shape);
      }
      EXPECT_EQ((*loader)->stats().tensors, f.tensors.size());
    }
  }
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
  for (const Tensor& t : kept) EXPECT_EQ(Bytes(t), f.Full(t.name()));
}

TEST(Loader, SelectionByNameMissingIsNotFound) {
  Fixture f;
  auto loader = Loader::Open(f.dir.path());
  ASSERT_TRUE(loader.ok());
  auto r = (*loader)->Load(Selection::Names({"nope"}));
  EXPECT_EQ(r.status().code(), Code::kNotFound);
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
      EXPECT_EQ(Bytes(t), f.Full(t.name()));
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
  for (const Tensor& t : hoard) EXPECT_EQ(Bytes(t), f.Full(t.name()));
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
            ASSERT_EQ(Bytes(t), f->Full(t.name()))
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
  const bool supported = io::DirectFile::Open(**any).ok();
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
  for (const Tensor& t : kept) EXPECT_EQ(Bytes(t), f.Full(t.name()));
}

// A file truncated after the mmap engine handed out views: touching the vanished pages must not
// kill the process (SIGBUS); they read as zeros, and a later populated load reports the change.
TEST(LoaderEngines, MmapSurvivesTruncationAfterLoad) {
  Fixture f(2, 1u << 30, 100);  // one file of ~100 KB
  const std::string path = f.dir.Join("model.safetensors");
  LoadOptions o;
  o.engine = Engine::kMmap;
  auto loader = Loader::Open(path, o);
  ASSERT_TRUE(loader.ok());
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok());
  const Tensor* last = nullptr;
  for (const Tensor& t : *tensors) {
    if (last == nullptr || t.data() > last->data()) last = &t;
  }
  ASSERT_NE(last, nullptr);
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  // Every byte of every tensor: the process survives, the vanished pages read zeros.
  uint64_t nonzero = 0;
  for (const Tensor& t : *tensors) {
    for (uint64_t i = 0; i < t.size(); ++i) nonzero += t.data()[i] != std::byte{0};
  }
  EXPECT_EQ(nonzero, 0u);
  o.populate = true;
  auto again = (*loader)->Load();
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(path), std::string::npos) << again.status().ToString();
}

TEST(LoaderEngines, MmapPopulateReportsAFileThatShrankUnderneath) {
  Fixture f(2, 1u << 30, 100);
  const std::string path = f.dir.Join("model.safetensors");
  auto file = Env::Default()->OpenRandomAccess(path);
  ASSERT_TRUE(file.ok());
  const uint64_t size = *(*file)->Size();
  auto map = io::MappedFile::Map(**file, size);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  ASSERT_TRUE((*map)->Populate(0, size).ok());
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  Status s = (*map)->Populate(0, size);
  EXPECT_EQ(s.code(), Code::kUnexpectedEof) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos);
  // Touch a vanished page directly: repaired with zeros and counted, not a crash.
  const volatile std::byte* p = (*map)->data();
  const std::byte last = p[size - 1];
  EXPECT_EQ(last, std::byte{0});
  EXPECT_GE((*map)->faults(), 1u);
  EXPECT_EQ((*map)->first_fault_offset() % 4096, 0u);
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
  for (const Tensor& t : *tensors) EXPECT_EQ(Bytes(t), m.f.Full(t.name()));
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
  auto loader = m.Open();
  ASSERT_TRUE(loader.ok());
  m.env.AddFile(m.path, ReadBytes(m.path).substr(0, 100));  // replaced by a shorter file
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
            if (Bytes(t) != f.Full(t.name())) ++failures;
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

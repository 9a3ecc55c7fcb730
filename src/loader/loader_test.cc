#include "tensorferry/loader.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <thread>

#include "tensorferry/writer.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::MemoryEnv;
using testing::ReadBytes;
using testing::TempDir;

// A sharded checkpoint of `layers` Llama-like layers with odd-sized tensors of several dtypes,
// filled with a pattern derived from the name.
struct Fixture {
  TempDir dir;
  std::vector<std::string> data;
  std::vector<TensorToWrite> tensors;

  explicit Fixture(int layers = 4, uint64_t shard = 4096) {
    auto add = [&](const std::string& name, DType dtype, std::vector<uint64_t> shape) {
      TensorToWrite t;
      t.name = name;
      t.dtype = dtype;
      t.shape = std::move(shape);
      const uint64_t n = TensorByteSize(t.dtype, t.shape).value();
      std::string bytes(n, '\0');
      const size_t h = std::hash<std::string>()(name);
      for (uint64_t i = 0; i < n; ++i) bytes[i] = static_cast<char>((i * 131 + h) & 0xff);
      data.push_back(std::move(bytes));
      tensors.push_back(std::move(t));
    };
    data.reserve(3 + 4 * static_cast<size_t>(layers));
    add("model.embed_tokens.weight", DType::kBF16, {33, 7});
    for (int l = 0; l < layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "self_attn.q_proj.weight", DType::kBF16, {13, 7});
      add(p + "mlp.up_proj.weight", DType::kF32, {5, 11});
      add(p + "input_layernorm.weight", DType::kF16, {7});
      add(p + "scalar", DType::kI8, {});
    }
    add("lm_head.weight", DType::kF64, {3, 5});
    add("model.norm.weight", DType::kU8, {0});
    for (size_t i = 0; i < tensors.size(); ++i) {
      tensors[i].data = std::as_bytes(std::span<const char>(data[i]));
    }
    ShardOptions so;
    so.max_shard_size = shard;
    so.write.sync = false;
    auto r = WriteSharded(dir.path(), tensors, {}, so);
    if (!r.ok()) throw std::runtime_error(r.status().ToString());
  }

  const std::string& Expected(const std::string& name) const {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].name == name) return data[i];
    }
    throw std::runtime_error("no tensor " + name);
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
        EXPECT_EQ(Bytes(t), f.Expected(t.name())) << t.name() << " chunk " << chunk;
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
  for (const Tensor& t : kept) EXPECT_EQ(Bytes(t), f.Expected(t.name()));
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
      EXPECT_EQ(Bytes(t), f.Expected(t.name()));
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
  for (const Tensor& t : hoard) EXPECT_EQ(Bytes(t), f.Expected(t.name()));
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

TEST(Loader, UnsupportedEngines) {
  Fixture f;
  for (Engine e : {Engine::kIoUring, Engine::kMmap}) {
    LoadOptions o;
    o.engine = e;
    EXPECT_EQ(Loader::Open(f.dir.path(), o).status().code(), Code::kUnsupported);
  }
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
  for (const Tensor& t : *tensors) EXPECT_EQ(Bytes(t), m.f.Expected(t.name()));
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
            if (Bytes(t) != f.Expected(t.name())) ++failures;
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

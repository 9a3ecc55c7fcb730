// Tensor-parallel loading: every rank's tensors equal slicing the full tensor, byte for byte, for
// every rule, world size, engine and gap setting; bytes read per rank; ties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "io/read_engine.h"
#include "tensorferry/loader.h"
#include "tensorferry/residency.h"
#include "tensorferry/shard.h"
#include "tensorferry/writer.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::NaiveSlice;
using testing::TempDir;

// A sliced checkpoint whose tensors exercise every rule: dim 0, dim 1, dim 2 of a 3-D tensor,
// fused unequal parts, equal parts, replicate, uneven sizes, and whole tensors between slices.
struct TpFixture : testing::TestCheckpoint {
  // `twin`: also "embed_twin.weight", a tensor of embed.weight's dtype and shape (a tie's
  // duplicate in the files).
  explicit TpFixture(uint64_t scale = 1, bool twin = false) {
    Add("embed.weight", DType::kBF16, {67 * scale, 24}, ShardRule::Split(0));
    if (twin) Add("embed_twin.weight", DType::kBF16, {67 * scale, 24}, ShardRule::Split(0));
    Add("layers.0.q.weight", DType::kF32, {40 * scale, 17}, ShardRule::Split(0));
    Add("layers.0.o.weight", DType::kBF16, {24, 41 * scale}, ShardRule::Split(1));
    Add("layers.0.o.bias", DType::kBF16, {24}, ShardRule::Replicate());
    Add("layers.0.norm.weight", DType::kF16, {24}, ShardRule::Replicate());
    Add("layers.0.conv.weight", DType::kF16, {5, 9, 16 * scale + 3}, ShardRule::Split(2));
    Add("layers.0.mid.weight", DType::kI32, {6, 19 * scale, 5}, ShardRule::Split(1));
    Add("layers.0.qkv.weight", DType::kBF16, {16 * scale + 16, 12},
        ShardRule::Split(0, {16 * scale, 8, 8}));
    Add("layers.0.c_attn.weight", DType::kF32, {10, 24 * scale}, ShardRule::SplitEqual(1, 3));
    Add("layers.0.scalar", DType::kI8, {}, ShardRule::Replicate());
    Add("layers.0.empty", DType::kF32, {0, 16}, ShardRule::Split(1));
    Add("head.weight", DType::kF64, {9 * scale, 8}, ShardRule::Split(0));
    Write(4096 * scale);
  }
};

using testing::HostBytes;

using testing::AvailableEngines;

// Loads rank `rank` of `world` and checks every tensor against the naive slice; returns the
// stats.
LoadStats CheckRank(const TpFixture& f, LoadOptions o, uint32_t rank, uint32_t world) {
  // exact_when_cached off: the freshly written files are cached, and every gap setting must run.
  o.tensor_parallel = TensorParallelOptions{
      f.spec, rank, world, o.tensor_parallel ? o.tensor_parallel->max_gap : 64u << 10, false};
  auto loader = Loader::Open(f.dir.path(), o).value();
  auto tensors = loader->Load();
  EXPECT_TRUE(tensors.ok()) << tensors.status().ToString();
  if (!tensors.ok()) return {};
  EXPECT_EQ(tensors->size(), f.tensors.size());
  const Checkpoint& ckpt = *loader->checkpoint();
  for (const Tensor& t : *tensors) {
    const TensorInfo& info = *ckpt.Find(t.name());
    const ShardRule rule = f.spec.RuleFor(t.name());
    const std::string want = NaiveSlice(info, rule, rank, world, f.Full(t.name()));
    EXPECT_EQ(HostBytes(t), want) << t.name() << " rank " << rank << "/" << world << " engine "
                                  << EngineName(o.engine);
    const TensorSlice slice = SliceOf(info, rule, rank, world).value();
    EXPECT_EQ(t.shape(), slice.shape) << t.name();
  }
  return loader->stats();
}

TEST(TensorParallelLoad, EveryRankEqualsSlicingTheFullTensor) {
  TpFixture f;
  for (Engine engine : AvailableEngines()) {
    for (uint64_t max_gap : {uint64_t{0}, uint64_t{64}, uint64_t{1} << 30}) {
      for (uint32_t world : {1u, 2u, 3u, 4u, 8u}) {
        for (uint32_t rank = 0; rank < world; ++rank) {
          LoadOptions o;
          o.engine = engine;
          o.threads = 2;
          o.chunk_size = 1000;  // many tasks per range: cuts inside strided segments too
          o.tensor_parallel = TensorParallelOptions{ShardSpec(), 0, 1, max_gap};
          const LoadStats st = CheckRank(f, o, rank, world);
          // Bytes delivered: the sum of the slices; bytes read: exactly that with exact strides.
          uint64_t want = 0;
          for (const TensorToWrite& t : f.tensors) {
            TensorInfo info;
            info.name = t.name;
            info.dtype = t.dtype;
            info.shape = t.shape;
            info.size = TensorByteSize(t.dtype, t.shape).value();
            want += SliceOf(info, f.spec.RuleFor(t.name), rank, world).value().bytes;
          }
          EXPECT_EQ(st.bytes, want);
          if (max_gap == 0 && engine != Engine::kMmap) {
            EXPECT_EQ(st.bytes_read, want);
          }
          EXPECT_GE(st.bytes_read, want);
        }
      }
    }
  }
}

TEST(TensorParallelLoad, DirectIoAndBudget) {
  TpFixture f(64);  // tensors of tens of KB: O_DIRECT middles and several batches
  for (Engine engine : AvailableEngines()) {
    if (engine == Engine::kMmap) continue;
    for (DirectIO d : {DirectIO::kOn, DirectIO::kOff}) {
      for (uint32_t world : {2u, 3u, 8u}) {
        for (uint32_t rank = 0; rank < world; rank += world - 1) {
          LoadOptions o;
          o.engine = engine;
          o.direct = d;
          o.threads = 3;
          o.chunk_size = 16 << 10;
          o.tensor_parallel = TensorParallelOptions{ShardSpec(), 0, 1, 4096};
          CheckRank(f, o, rank, world);
        }
      }
    }
  }
  // Under a budget, batch by batch (Stream), each batch's buffer holding at most the budget.
  for (uint32_t world : {2u, 4u}) {
    LoadOptions o;
    o.engine = Engine::kPread;
    o.budget = 256 << 10;
    o.tensor_parallel = TensorParallelOptions{f.spec, world - 1, world, 1 << 20, false};
    auto loader = Loader::Open(f.dir.path(), o).value();
    size_t seen = 0;
    Status s = loader->Stream(Selection::All(), [&](Batch batch) {
      for (const Tensor& t : batch.tensors) {
        const TensorInfo& info = *loader->checkpoint()->Find(t.name());
        EXPECT_EQ(HostBytes(t),
                  NaiveSlice(info, f.spec.RuleFor(t.name()), world - 1, world, f.Full(t.name())))
            << t.name();
        ++seen;
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(seen, f.tensors.size());
    EXPECT_GT(loader->stats().batches, 1u);
    EXPECT_LE(loader->stats().peak_budget_bytes, o.budget);
  }
}

// The budget counts what a batch's reads occupy: a strided slice read whole with its gaps holds
// the gaps too. A caller holding every batch is refused the next one before the buffers it holds
// pass the budget (they reached twice the budget when only the slices' bytes were counted).
TEST(TensorParallelLoad, BudgetCountsTheCoveredGaps) {
  TpFixture f(64);
  LoadOptions o;
  o.engine = Engine::kPread;
  o.budget = 400 << 10;
  o.tensor_parallel = TensorParallelOptions{f.spec, 1, 2, 1 << 20, false};
  auto loader = Loader::Open(f.dir.path(), o).value();
  auto plan = loader->MakePlan(Selection::All());
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  uint64_t gaps = 0;
  for (const PlanBatch& b : plan->batches)
    gaps += b.read_bytes - std::min(b.read_bytes, b.tensor_bytes);
  ASSERT_GT(gaps, 0u) << "no covered gaps: the test needs strided slices read whole";
  auto it = loader->Iterate(Selection::All());
  ASSERT_TRUE(it.ok()) << it.status().ToString();
  std::vector<Batch> held;
  uint64_t occupied = 0;
  for (;;) {
    auto next = it->Next();
    if (!next.ok()) {
      EXPECT_EQ(next.status().code(), Code::kBudgetExceeded) << next.status().ToString();
      break;
    }
    if (!*next) break;
    const PlanBatch& b = plan->batches[(*next)->index];
    occupied += std::max(b.read_bytes, b.tensor_bytes);
    EXPECT_LE(occupied, o.budget) << "holding " << held.size() + 1 << " batches";
    held.push_back(std::move(**next));
  }
  EXPECT_FALSE(held.empty());
  EXPECT_LE(loader->stats().peak_budget_bytes, o.budget);
}

TEST(TensorParallelLoad, BytesReadPerRankFollowTheSplit) {
  TpFixture f(32);
  uint64_t replicated = 0, split = 0;
  for (const TensorToWrite& t : f.tensors) {
    const uint64_t n = TensorByteSize(t.dtype, t.shape).value();
    (f.spec.RuleFor(t.name).is_split() ? split : replicated) += n;
  }
  for (uint32_t world : {2u, 4u, 8u}) {
    for (uint32_t rank = 0; rank < world; ++rank) {
      LoadOptions o;
      o.engine = Engine::kPread;
      o.tensor_parallel = TensorParallelOptions{f.spec, rank, world, 0};
      auto loader = Loader::Open(f.dir.path(), o).value();
      ASSERT_TRUE(loader->Load().ok());
      // Uneven splits give some ranks one more index per part: allow 1% over the even share.
      const double target = static_cast<double>(split) / world + static_cast<double>(replicated);
      EXPECT_LE(static_cast<double>(loader->stats().bytes_read), target * 1.01 + 4096)
          << rank << "/" << world;
      EXPECT_GE(static_cast<double>(loader->stats().bytes_read), target * 0.9);
    }
  }
}

TEST(TensorParallelLoad, MmapDimZeroSlicesAreViews) {
  TpFixture f(8);
  LoadOptions o;
  o.engine = Engine::kMmap;
  o.tensor_parallel = TensorParallelOptions{f.spec, 1, 2, 0};
  auto loader = Loader::Open(f.dir.path(), o).value();
  auto tensors = loader->Load().value();
  const Checkpoint& ckpt = *loader->checkpoint();
  auto same_owner = [](const Tensor& a, const Tensor& b) {
    return !a.owner().owner_before(b.owner()) && !b.owner().owner_before(a.owner());
  };
  size_t views = 0, gathered = 0;
  for (const Tensor& a : tensors) {
    for (const Tensor& b : tensors) {
      if (&a == &b || ckpt.Find(a.name())->file != ckpt.Find(b.name())->file) continue;
      const bool a_view =
          SliceRangeCount(*ckpt.Find(a.name()),
                          SliceOf(*ckpt.Find(a.name()), f.spec.RuleFor(a.name()), 1, 2).value()) <=
          1;
      const bool b_view =
          SliceRangeCount(*ckpt.Find(b.name()),
                          SliceOf(*ckpt.Find(b.name()), f.spec.RuleFor(b.name()), 1, 2).value()) <=
          1;
      if (a.size() == 0 || b.size() == 0) continue;
      // Views of one file share the mapping as owner; a gathered tensor has a pooled buffer.
      if (a_view && b_view) {
        EXPECT_TRUE(same_owner(a, b)) << a.name() << " " << b.name();
        ++views;
      } else if (a_view != b_view) {
        EXPECT_FALSE(same_owner(a, b)) << a.name() << " " << b.name();
        ++gathered;
      }
    }
  }
  EXPECT_GT(views, 0u);
  EXPECT_GT(gathered, 0u);
  EXPECT_EQ(tensors.size(), f.tensors.size());
}

// The mmap engine's copies of slices of several ranges (dim > 0 splits) hold their share of the
// budget until dropped, as a copying engine's batches do; views cost it nothing once made. A
// caller holding every tensor is refused the next batch before the copies pass the budget (they
// were not counted at all), one dropping the copies streams to the end, and Load is refused up
// front when the copies and a batch cannot fit together.
TEST(TensorParallelLoad, MmapCopiesHoldTheBudgetUntilDropped) {
  TpFixture f(64);
  LoadOptions o;
  o.engine = Engine::kMmap;
  o.budget = 128 << 10;
  o.tensor_parallel = TensorParallelOptions{f.spec, 1, 2, 0};
  auto loader = Loader::Open(f.dir.path(), o).value();
  const Checkpoint& ckpt = *loader->checkpoint();
  auto copied = [&](const Tensor& t) {
    const TensorInfo& info = *ckpt.Find(t.name());
    const TensorSlice slice = SliceOf(info, f.spec.RuleFor(t.name()), 1, 2).value();
    return SliceRangeCount(info, slice) > 1 ? t.size() : uint64_t{0};
  };
  uint64_t all_copies = 0;
  {
    LoadOptions unbudgeted = o;
    unbudgeted.budget = 0;
    auto whole = Loader::Open(f.dir.path(), unbudgeted).value()->Load().value();
    for (const Tensor& t : whole) all_copies += copied(t);
  }
  ASSERT_GT(all_copies, o.budget) << "the test needs more copies than the budget";

  std::vector<Tensor> held;
  uint64_t held_copies = 0;
  Status s = loader->Stream(Selection::All(), [&](Batch b) {
    for (Tensor& t : b.tensors) {
      held_copies += copied(t);
      held.push_back(std::move(t));
    }
    EXPECT_LE(held_copies, o.budget);
    return Status::Ok();
  });
  EXPECT_EQ(s.code(), Code::kBudgetExceeded) << s.ToString();
  EXPECT_NE(s.message().find("held by tensors of earlier batches"), std::string::npos)
      << s.message();
  for (const Tensor& t : held) {
    EXPECT_EQ(HostBytes(t),
              NaiveSlice(*ckpt.Find(t.name()), f.spec.RuleFor(t.name()), 1, 2, f.Full(t.name())))
        << t.name();
  }
  held.clear();

  // Keeping the views and dropping the copies: every batch comes.
  size_t seen = 0;
  s = loader->Stream(Selection::All(), [&](Batch b) {
    for (Tensor& t : b.tensors) {
      ++seen;
      if (copied(t) == 0) held.push_back(std::move(t));
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(seen, f.tensors.size());
  EXPECT_LE(loader->stats().peak_budget_bytes, o.budget);
  held.clear();

  auto refused = loader->Load();
  EXPECT_EQ(refused.status().code(), Code::kBudgetExceeded) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("copies of tensor-parallel slices"), std::string::npos)
      << refused.status().message();
  o.budget = all_copies + (128 << 10);
  auto fits = Loader::Open(f.dir.path(), o).value()->Load();
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ(fits->size(), f.tensors.size());
}

TEST(TensorParallelLoad, TiedAliasesShareTheTargetAndAreReadOnce) {
  TpFixture f(4, /*twin=*/true);
  for (Engine engine : AvailableEngines()) {
    // An alias the files lack (tie_word_embeddings) and one present as a duplicate of another
    // tensor (embed_twin.weight tied to embed.weight: its own bytes are not read).
    ShardSpec spec = f.spec;
    spec.Tie("lm_head.weight", "embed.weight").Tie("embed_twin.weight", "embed.weight");
    LoadOptions o;
    o.engine = engine;
    o.tensor_parallel = TensorParallelOptions{spec, 1, 2, 0};
    auto loader = Loader::Open(f.dir.path(), o).value();
    auto tensors = loader->Load().value();
    std::map<std::string, Tensor> by;
    for (const Tensor& t : tensors) by[t.name()] = t;
    ASSERT_TRUE(by.count("lm_head.weight"));
    ASSERT_TRUE(by.count("embed_twin.weight"));
    const Tensor& embed = by["embed.weight"];
    EXPECT_EQ(by["lm_head.weight"].data(), embed.data());
    EXPECT_EQ(by["embed_twin.weight"].data(), embed.data());
    EXPECT_EQ(by["lm_head.weight"].shape(), embed.shape());
    EXPECT_EQ(tensors.size(), f.tensors.size() + 1);
    const TensorInfo& info = *loader->checkpoint()->Find("embed.weight");
    EXPECT_EQ(HostBytes(embed),
              NaiveSlice(info, ShardRule::Split(0), 1, 2, f.Full("embed.weight")));
    // The alias right after its target in Load's order.
    EXPECT_EQ(tensors[0].name(), "embed.weight");
    if (engine != Engine::kMmap) {
      // embed_twin.weight's bytes were not read.
      uint64_t want = 0;
      for (const Tensor& t : tensors) {
        if (t.name() != "lm_head.weight" && t.name() != "embed_twin.weight") want += t.size();
      }
      EXPECT_EQ(loader->stats().bytes_read, want);
    }
    // By name: an absent alias resolves to its target.
    auto named = loader->Load(Selection::Names({"lm_head.weight"})).value();
    ASSERT_EQ(named.size(), 1u);
    EXPECT_EQ(named[0].name(), "lm_head.weight");
    EXPECT_EQ(HostBytes(named[0]), HostBytes(embed));
    // LoadInto of a target and its alias: each destination filled, the bytes counted once (as
    // Load counts them).
    const uint64_t load_bytes = [&] {
      auto pair = loader->Load(Selection::Names({"embed.weight", "lm_head.weight"}));
      EXPECT_TRUE(pair.ok()) << pair.status().ToString();
      return loader->stats().bytes;
    }();
    std::vector<std::byte> a(embed.size()), b(embed.size());
    const std::vector<Destination> into = {{"embed.weight", Device::CPU(), a.data(), a.size()},
                                           {"lm_head.weight", Device::CPU(), b.data(), b.size()}};
    const Status s = loader->LoadInto(into);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(a.data()), a.size()), HostBytes(embed));
    EXPECT_EQ(a, b);
    EXPECT_EQ(loader->stats().tensors, 2u);
    EXPECT_EQ(loader->stats().bytes, embed.size());
    EXPECT_EQ(loader->stats().bytes, load_bytes);
  }
}

// Describe is what Load delivers: the same names in the same order, the same dtypes, local shapes
// and sizes; tied aliases marked and pointing at their target; only the targets read.
TEST(TensorParallelLoad, DescribeIsWhatLoadDelivers) {
  TpFixture f(2, /*twin=*/true);
  ShardSpec spec = f.spec;
  spec.Tie("lm_head.weight", "embed.weight").Tie("embed_twin.weight", "embed.weight");
  for (const bool sliced : {false, true}) {
    LoadOptions o;
    o.engine = Engine::kPread;
    if (sliced) o.tensor_parallel = TensorParallelOptions{spec, 1, 2, 0};
    auto loader = Loader::Open(f.dir.path(), o).value();
    const Checkpoint& ckpt = *loader->checkpoint();
    const auto embed = static_cast<uint32_t>(ckpt.Find("embed.weight") - ckpt.tensors().data());
    const auto twin = static_cast<uint32_t>(ckpt.Find("embed_twin.weight") - ckpt.tensors().data());
    for (const Selection& selection :
         {Selection::All(), Selection::Names({"lm_head.weight", "layers.0.o.weight"}),
          Selection::Where([](const TensorInfo& t) {
            return t.name.find("head") == 0 || t.name.find("lm_") == 0;
          })}) {
      if (!sliced && !selection.Resolve(ckpt).ok()) continue;  // no alias without ties
      const Description d = loader->Describe(selection).value();
      const std::vector<Tensor> got = loader->Load(selection).value();
      ASSERT_EQ(d.outputs.size(), got.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const OutputInfo& out = d.outputs[i];
        EXPECT_EQ(out.name, got[i].name());
        EXPECT_EQ(out.dtype, got[i].dtype());
        EXPECT_EQ(out.shape, got[i].shape()) << out.name;
        EXPECT_EQ(out.bytes, got[i].size()) << out.name;
        EXPECT_EQ(out.alias, ckpt.tensors()[out.tensor].name != out.name) << out.name;
        if (out.alias) {
          EXPECT_EQ(out.tensor, embed) << out.name;
        }
        EXPECT_EQ(out.slice.has_value(),
                  sliced && spec.RuleFor(ckpt.tensors()[out.tensor].name).is_split());
      }
      EXPECT_TRUE(std::is_sorted(d.read.begin(), d.read.end()));
      EXPECT_EQ(d.bytes, loader->stats().bytes);
      if (sliced) {
        // The duplicate in the files is never read: its target is.
        EXPECT_EQ(std::count(d.read.begin(), d.read.end(), twin), 0);
      }
    }
    if (sliced) {
      const Description alias = loader->Describe(Selection::Names({"lm_head.weight"})).value();
      ASSERT_EQ(alias.outputs.size(), 1u);
      EXPECT_TRUE(alias.outputs[0].alias);
      EXPECT_EQ(alias.read, std::vector<uint32_t>{embed});
      // An absent alias right after its target.
      const Description all = loader->Describe(Selection::All()).value();
      ASSERT_GE(all.outputs.size(), 2u);
      EXPECT_EQ(all.outputs[0].name, "embed.weight");
      EXPECT_EQ(all.outputs[1].name, "lm_head.weight");
    }
    auto missing = loader->Describe(Selection::Names({"no.such.weight"}));
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.status().code(), Code::kNotFound);
  }
}

// A tie must describe this checkpoint: a target it lacks, or an alias in the files whose dtype or
// shape differs from its target's, is an error naming both (never another tensor's bytes, never a
// tie silently ignored).
TEST(TensorParallelLoad, TiesThatDoNotFitTheCheckpointAreErrors) {
  TpFixture f(4);
  const TensorInfo* embed = nullptr;
  const TensorInfo* other = nullptr;
  {
    auto probe = Loader::Open(f.dir.path(), LoadOptions()).value();
    embed = probe->checkpoint()->Find("embed.weight");
    ASSERT_NE(embed, nullptr);
    for (const TensorInfo& t : probe->checkpoint()->tensors()) {
      if (t.shape != embed->shape || t.dtype != embed->dtype) other = &t;
    }
    ASSERT_NE(other, nullptr);
    const std::string other_name = other->name;
    for (auto [alias, target, code, words] :
         std::vector<std::tuple<std::string, std::string, Code, std::string>>{
             {"lm_head.weight", "no.such.weight", Code::kInvalidArgument, "not in the checkpoint"},
             {other_name, "embed.weight", Code::kInvalidArgument, "a tie must name the same"}}) {
      ShardSpec spec = f.spec;
      spec.Tie(alias, target);
      LoadOptions o;
      o.tensor_parallel = TensorParallelOptions{spec, 0, 2, 0};
      auto loader = Loader::Open(f.dir.path(), o).value();
      for (const Selection& selection : {Selection::All(), Selection::Names({alias})}) {
        auto got = loader->Load(selection);
        ASSERT_FALSE(got.ok()) << alias << " -> " << target;
        EXPECT_EQ(got.status().code(), code) << got.status().ToString();
        const std::string message = got.status().message();
        EXPECT_NE(message.find("\"" + alias + "\" -> \"" + target + "\""), std::string::npos)
            << message;
        EXPECT_NE(message.find(words), std::string::npos) << message;
      }
    }
  }
}

// A slice of many tiny rows ([70000, 2] bytes split on dim 1) is read with its gaps under 4 KiB
// covered even with exact strides asked for: one read and one strided move entry, not a range,
// a task and a move per row. The bytes are the slice's.
TEST(TensorParallelLoad, ManyTinyRowsAreOneCoveringRead) {
  TempDir dir;
  std::vector<std::byte> bytes(140000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 7 + 3);
  const std::vector<TensorToWrite> tensors = {{"w", DType::kU8, {70000, 2}, bytes, nullptr}};
  ASSERT_TRUE(WriteFile(dir.Join("m.safetensors"), tensors, {}).ok());
  ShardSpec spec;
  spec.Add("w", ShardRule::Split(1));
  LoadOptions o;
  o.tensor_parallel = TensorParallelOptions{spec, 1, 2, 0};  // max_gap 0: exact strides
  auto loader = Loader::Open(dir.Join("m.safetensors"), o).value();
  const Plan plan = loader->MakePlan(Selection::All()).value();
  EXPECT_EQ(plan.num_ranges, 1u);
  EXPECT_EQ(plan.num_tasks, 1u);
  EXPECT_EQ(plan.num_moves, 69999u);  // the first row is in place
  ASSERT_EQ(plan.batches.size(), 1u);
  EXPECT_EQ(plan.batches[0].moves.size(), 1u);
  auto got = loader->Load(Selection::All()).value();
  ASSERT_EQ(got.size(), 1u);
  std::string want(70000, '\0');
  for (size_t r = 0; r < want.size(); ++r) want[r] = static_cast<char>(bytes[2 * r + 1]);
  EXPECT_EQ(testing::HostBytes(got[0]), want);
}

TEST(TensorParallelLoad, SliceErrorsNameTheTensor) {
  TpFixture f;
  LoadOptions o;
  ShardSpec spec;
  spec.Add("*.norm.weight", ShardRule::Split(1));
  o.tensor_parallel = TensorParallelOptions{spec, 0, 2, 0};
  auto loader = Loader::Open(f.dir.path(), o).value();
  auto r = loader->Load();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layers.0.norm.weight"), std::string::npos);
  o.tensor_parallel = TensorParallelOptions{ShardSpec(), 2, 2, 0};
  auto bad = Loader::Open(f.dir.path(), o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("rank 2 of 2"), std::string::npos);
  o.tensor_parallel = TensorParallelOptions{ShardSpec(), 0, 0, 0};
  EXPECT_FALSE(Loader::Open(f.dir.path(), o).ok());
  ShardSpec cycle;
  cycle.Tie("a", "b").Tie("b", "a");
  o.tensor_parallel = TensorParallelOptions{cycle, 0, 1, 0};
  EXPECT_FALSE(Loader::Open(f.dir.path(), o).ok());
}

TEST(TensorParallelLoad, ExplainShowsStridedRanges) {
  TpFixture f(4);
  LoadOptions o;
  o.tensor_parallel = TensorParallelOptions{f.spec, 1, 4, 0};
  auto loader = Loader::Open(f.dir.path(), o).value();
  const Plan plan = loader->MakePlan(Selection::Names({"layers.0.o.weight"})).value();
  EXPECT_EQ(plan.num_ranges, 24u);  // one per row: exact strides
  EXPECT_EQ(plan.read_bytes, plan.tensor_bytes);
  o.tensor_parallel->max_gap = 1 << 20;
  o.tensor_parallel->exact_when_cached = false;
  auto covering = Loader::Open(f.dir.path(), o).value();
  const Plan one = covering->MakePlan(Selection::Names({"layers.0.o.weight"})).value();
  EXPECT_EQ(one.num_ranges, 1u);  // one covering read
  EXPECT_GT(one.read_bytes, one.tensor_bytes);
  EXPECT_EQ(one.num_moves, 23u);
  ASSERT_EQ(one.batches.size(), 1u);
  EXPECT_EQ(one.batches[0].moves.size(), 1u);  // the 23 rows' moves: one strided entry
  EXPECT_EQ(one.batches[0].moves[0].count, 23u);
  const std::string text = one.Explain(*covering->checkpoint());
  EXPECT_NE(text.find("discarded"), std::string::npos) << text;
}

TEST(TensorParallelLoad, ExactStridesWhenCachedCoveringWhenCold) {
  TpFixture f(4);
  LoadOptions o;
  o.tensor_parallel = TensorParallelOptions{f.spec, 1, 4, 1 << 20, true};
  const Selection one = Selection::Names({"layers.0.o.weight"});
  auto loader = Loader::Open(f.dir.path(), o).value();
  const std::string& file =
      loader->checkpoint()->files()[loader->checkpoint()->Find("layers.0.o.weight")->file].path;
  // Just written: in the page cache, so exact strides despite the 1 MiB max_gap.
  if (CachedFraction(file).value() >= 0.5) {
    const Plan warm = loader->MakePlan(one).value();
    EXPECT_EQ(warm.num_ranges, 24u);
    EXPECT_EQ(warm.read_bytes, warm.tensor_bytes);
  }
  const TensorInfo& info = *loader->checkpoint()->Find("layers.0.o.weight");
  const std::string expected =
      NaiveSlice(info, ShardRule::Split(1), 1, 4, f.Full("layers.0.o.weight"));
  // The load reads correct bytes whichever plan it takes (checked on every file system, before
  // the skip below).
  auto loaded = loader->Load(one).value();
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(HostBytes(loaded[0]), expected);
  ASSERT_TRUE(DropFromPageCache(file).ok());
  if (CachedFraction(file).value() >= 0.5) {
    GTEST_SKIP() << "this file system keeps the pages cached (tmpfs?)";
  }
  const Plan cold = loader->MakePlan(one).value();
  EXPECT_EQ(cold.num_ranges, 1u);
  EXPECT_GT(cold.read_bytes, cold.tensor_bytes);
  // And with the covering read of the cold file.
  auto got = loader->Load(one).value();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(HostBytes(got[0]), expected);
}

}  // namespace
}  // namespace tensorferry

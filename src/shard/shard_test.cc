#include "tensorferry/shard.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "testing/shard_fixture.h"

namespace tensorferry {
namespace {

TensorInfo Info(std::string name, DType dtype, std::vector<uint64_t> shape) {
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.size = TensorByteSize(t.dtype, t.shape).ValueOrThrow();
  return t;
}

using testing::NaiveSlice;

std::vector<uint8_t> Pattern(uint64_t n) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 131) ^ (i >> 8) ^ (i >> 16));
  return v;
}

struct Case {
  DType dtype;
  std::vector<uint64_t> shape;
  ShardRule rule;
};

TEST(ShardTest, EveryWorldEveryDimMatchesNaiveReference) {
  std::vector<Case> cases;
  const std::vector<std::vector<uint64_t>> shapes = {{64},        {17},       {24, 8},      {9, 13},
                                                     {16, 10, 6}, {11, 8, 9}, {8, 3, 10, 2}};
  for (const auto& shape : shapes) {
    cases.push_back({DType::kF32, shape, ShardRule::Replicate()});
    for (uint32_t d = 0; d < shape.size(); ++d) {
      cases.push_back({DType::kBF16, shape, ShardRule::Split(d)});
      cases.push_back({DType::kU8, shape, ShardRule::Split(d)});
    }
  }
  // Fused parts (q, k, v of unequal sizes), on dim 0 and dim 1, and equal parts.
  cases.push_back({DType::kF16, {24, 6}, ShardRule::Split(0, {16, 8})});
  cases.push_back({DType::kF16, {6, 27}, ShardRule::Split(1, {16, 8, 3 + 0})});
  cases.push_back({DType::kF32, {8, 48}, ShardRule::SplitEqual(1, 3)});
  cases.push_back({DType::kF64, {48}, ShardRule::SplitEqual(0, 3)});
  cases.push_back({DType::kI64, {5, 40, 3}, ShardRule::Split(1, {8, 8, 24})});

  for (const Case& c : cases) {
    const TensorInfo t = Info("t", c.dtype, c.shape);
    const std::vector<uint8_t> full = Pattern(t.size);
    for (uint32_t world : {1u, 2u, 3u, 4u, 8u}) {
      uint64_t total_split = 0;
      for (uint32_t rank = 0; rank < world; ++rank) {
        SCOPED_TRACE("shape rank " + std::to_string(c.shape.size()) + " rule " + c.rule.ToString() +
                     " rank " + std::to_string(rank) + "/" + std::to_string(world));
        Result<TensorSlice> s = SliceOf(t, c.rule, rank, world);
        bool too_small = false;
        if (c.rule.is_split()) {
          std::vector<uint64_t> parts = c.rule.parts;
          if (parts.empty() && c.rule.equal_parts > 1) {
            parts.assign(c.rule.equal_parts, c.shape[c.rule.dim] / c.rule.equal_parts);
          }
          if (parts.empty()) parts.push_back(c.shape[c.rule.dim]);
          for (uint64_t p : parts) too_small |= p < world;
        }
        if (too_small) {
          ASSERT_FALSE(s.ok());
          EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
          EXPECT_NE(s.status().message().find("\"t\""), std::string::npos);
          continue;
        }
        ASSERT_TRUE(s.ok()) << s.status().ToString();
        const std::vector<uint8_t> want = NaiveSlice(t, c.rule, rank, world, full);
        EXPECT_EQ(s->bytes, want.size());
        uint64_t count = DTypeBits(t.dtype) / 8;
        for (uint64_t d : s->shape) count *= d;
        EXPECT_EQ(count, want.size());
        const auto ranges = SliceByteRanges(t, *s);
        EXPECT_EQ(SliceRangeCount(t, *s), ranges.size());
        std::vector<uint8_t> got;
        for (size_t i = 0; i < ranges.size(); ++i) {
          const auto [off, len] = ranges[i];
          ASSERT_LE(off + len, t.size);
          ASSERT_GT(len, 0u);
          if (i > 0) {
            // merged: never two adjacent ranges
            EXPECT_NE(ranges[i - 1].first + ranges[i - 1].second, off);
          }
          got.insert(got.end(), full.begin() + static_cast<ptrdiff_t>(off),
                     full.begin() + static_cast<ptrdiff_t>(off + len));
        }
        EXPECT_EQ(got, want);
        if (c.rule.is_split() && c.rule.dim == 0) {
          // dim 0: one range per non-adjacent block
          EXPECT_LE(ranges.size(), s->blocks.size());
        }
        total_split += s->bytes;
      }
      if (c.rule.is_split() && total_split != 0) {
        EXPECT_EQ(total_split, t.size);
      }
    }
  }
}

TEST(ShardTest, UnevenRuleIsArraySplit) {
  const TensorInfo t = Info("w", DType::kF32, {10, 4});
  // 10 over 4: 3, 3, 2, 2 at 0, 3, 6, 8
  const uint64_t want_off[] = {0, 3, 6, 8}, want_len[] = {3, 3, 2, 2};
  for (uint32_t r = 0; r < 4; ++r) {
    auto s = SliceOf(t, ShardRule::Split(0), r, 4).ValueOrThrow();
    ASSERT_EQ(s.blocks.size(), 1u);
    EXPECT_EQ(s.blocks[0].first, want_off[r]);
    EXPECT_EQ(s.blocks[0].second, want_len[r]);
    EXPECT_EQ(s.shape, (std::vector<uint64_t>{want_len[r], 4}));
    EXPECT_EQ(s.bytes, want_len[r] * 16);
  }
}

// A granule deals indices out in units: each rank's run starts on a unit (within each part), the
// uneven remainder by whole units, the last unit shorter; granule 0 and 1 are single indices, a
// granule above the dimension one unit.
TEST(ShardTest, GranuleDealsIndicesInUnits) {
  const TensorInfo t = Info("w", DType::kBF16, {100, 8});
  auto blocks = [&](const ShardRule& r, uint32_t world) {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (uint32_t rank = 0; rank < world; ++rank) {
      const TensorSlice s = SliceOf(t, r, rank, world).ValueOrThrow();
      out.insert(out.end(), s.blocks.begin(), s.blocks.end());
      uint64_t rows = 0;
      for (const auto& b : s.blocks) rows += b.second;
      EXPECT_EQ(s.bytes, rows * 16);
      EXPECT_EQ(s.shape, (std::vector<uint64_t>{rows, 8}));
    }
    return out;
  };
  using Blocks = std::vector<std::pair<uint64_t, uint64_t>>;
  ShardRule g16 = ShardRule::Split(0);
  g16.granule = 16;  // 100 rows: 7 units (6 of 16, then 4); over 3: 3, 2, 2 units
  EXPECT_EQ(blocks(g16, 3), (Blocks{{0, 48}, {48, 32}, {80, 20}}));
  EXPECT_EQ(blocks(g16, 7),
            (Blocks{{0, 16}, {16, 16}, {32, 16}, {48, 16}, {64, 16}, {80, 16}, {96, 4}}));
  for (uint64_t g : {0, 1}) {
    ShardRule r = ShardRule::Split(0);
    r.granule = g;
    EXPECT_EQ(blocks(r, 3), blocks(ShardRule::Split(0), 3));
  }
  // Fewer units than ranks: refused, naming the units.
  Result<TensorSlice> few = SliceOf(t, g16, 0, 8);
  ASSERT_FALSE(few.ok());
  EXPECT_NE(few.status().message().find("it has 100 indices along dim 0 (7 units of 16), fewer "
                                        "than the world size"),
            std::string::npos)
      << few.status().ToString();
  ShardRule huge = ShardRule::Split(0);
  huge.granule = ~uint64_t{0};  // one unit: whole for world 1, refused for more
  EXPECT_EQ(blocks(huge, 1), (Blocks{{0, 100}}));
  EXPECT_FALSE(SliceOf(t, huge, 0, 2).ok());
  // Per fused part, offset by the part's start.
  ShardRule fused = ShardRule::Split(0, {64, 36});
  fused.granule = 16;  // 4 units over 2: 2, 2; 3 units (16, 16, 4) over 2: 2, 1
  EXPECT_EQ(blocks(fused, 2), (Blocks{{0, 32}, {64, 32}, {32, 32}, {96, 4}}));
  EXPECT_EQ(g16.ToString(), "split(dim=0, granule=16)");
  // In JSON as "granule"; 0 refused there, and with "replicate".
  ShardSpec spec = ShardSpec::None();
  spec.Set("w", g16).Add("*.x", fused);
  const ShardSpec back = ShardSpec::FromJson(spec.ToJson()).ValueOrThrow();
  EXPECT_EQ(back, spec);
  EXPECT_EQ(back.RuleFor("w").granule, 16u);
  EXPECT_FALSE(ShardSpec::FromJson(R"({"overrides":{"w":{"split":0,"granule":0}}})").ok());
  EXPECT_FALSE(ShardSpec::FromJson(R"({"overrides":{"w":{"replicate":true,"granule":2}}})").ok());
}

TEST(ShardTest, FusedBlocksInDestinationOrder) {
  const TensorInfo t = Info("qkv", DType::kF16, {24, 2});
  auto s = SliceOf(t, ShardRule::Split(0, {16, 4, 4}), 1, 2).ValueOrThrow();
  EXPECT_EQ(s.blocks, (std::vector<std::pair<uint64_t, uint64_t>>{{8, 8}, {18, 2}, {22, 2}}));
  EXPECT_EQ(s.shape, (std::vector<uint64_t>{12, 2}));
  EXPECT_EQ(SliceByteRanges(t, s),
            (std::vector<std::pair<uint64_t, uint64_t>>{{32, 32}, {72, 8}, {88, 8}}));
  // Rank 0 of 1: the whole tensor, blocks adjacent -> one range.
  auto w1 = SliceOf(t, ShardRule::Split(0, {16, 4, 4}), 0, 1).ValueOrThrow();
  EXPECT_EQ(SliceByteRanges(t, w1), (std::vector<std::pair<uint64_t, uint64_t>>{{0, 96}}));
}

TEST(ShardTest, StridedRangesForDimOne) {
  const TensorInfo t = Info("o", DType::kBF16, {3, 8});
  auto s = SliceOf(t, ShardRule::Split(1), 1, 2).ValueOrThrow();
  EXPECT_EQ(SliceByteRanges(t, s),
            (std::vector<std::pair<uint64_t, uint64_t>>{{8, 8}, {24, 8}, {40, 8}}));
  EXPECT_EQ(SliceRangeCount(t, s), 3u);
}

TEST(ShardTest, Errors) {
  const TensorInfo t = Info("model.w", DType::kF32, {6, 4});
  auto msg = [&](const ShardRule& r, uint32_t rank, uint32_t world) {
    Result<TensorSlice> s = SliceOf(t, r, rank, world);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
    return s.status().message();
  };
  EXPECT_NE(msg(ShardRule::Split(0), 0, 0).find("world size is 0"), std::string::npos);
  EXPECT_NE(msg(ShardRule::Split(0), 2, 2).find("rank 2 of 2"), std::string::npos);
  EXPECT_NE(msg(ShardRule::Replicate(), 3, 2).find("rank is not below"), std::string::npos);
  const std::string dim = msg(ShardRule::Split(2), 0, 2);
  EXPECT_NE(dim.find("split dimension 2"), std::string::npos);
  EXPECT_NE(dim.find("\"model.w\""), std::string::npos);
  EXPECT_NE(dim.find("[6, 4]"), std::string::npos);
  EXPECT_NE(msg(ShardRule::Split(0, {4, 3}), 0, 2).find("parts sum to 7"), std::string::npos);
  EXPECT_NE(msg(ShardRule::Split(0, {6, 0}), 0, 2).find("size 0"), std::string::npos);
  EXPECT_NE(msg(ShardRule::SplitEqual(0, 4), 0, 2).find("do not divide"), std::string::npos);
  EXPECT_NE(msg(ShardRule::Split(1), 0, 8).find("fewer than the world size"), std::string::npos);
  EXPECT_NE(msg(ShardRule::Split(0, {4, 2}), 0, 3).find("part 1 has 2"), std::string::npos);
  // Sub-byte dtype: an index along the last dim is half a byte.
  const TensorInfo f4 = Info("f4", DType::kF4, {4, 6});
  EXPECT_FALSE(SliceOf(f4, ShardRule::Split(1), 0, 2).ok());
  EXPECT_TRUE(SliceOf(f4, ShardRule::Split(0), 1, 2).ok());
}

TEST(ShardTest, ZeroSizedTensor) {
  const TensorInfo t = Info("z", DType::kF32, {0, 8});
  auto s = SliceOf(t, ShardRule::Split(1), 1, 4).ValueOrThrow();
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.shape, (std::vector<uint64_t>{0, 2}));
  EXPECT_TRUE(SliceByteRanges(t, s).empty());
  EXPECT_EQ(SliceRangeCount(t, s), 0u);
  // Split along its empty dimension: a rank alone holds it (empty); among several, refused.
  auto alone = SliceOf(t, ShardRule::Split(0), 0, 1);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_EQ(alone->shape, (std::vector<uint64_t>{0, 8}));
  EXPECT_EQ(alone->bytes, 0u);
  EXPECT_FALSE(SliceOf(t, ShardRule::Split(0), 0, 2).ok());
}

TEST(ShardTest, GlobMatchCountsCharactersNotBytes) {
  // Found by a review: '?' matched one byte of a UTF-8 name, so "?" missed "é" and "??" hit it.
  EXPECT_TRUE(GlobMatch("?", "\xC3\xA9"));  // é
  EXPECT_FALSE(GlobMatch("??", "\xC3\xA9"));
  EXPECT_TRUE(GlobMatch("a?c",
                        "a\xE2\x82\xAC"
                        "c"));                       // a€c
  EXPECT_TRUE(GlobMatch("*?", "\xF0\x9F\x99\x82"));  // one 4-byte character
  EXPECT_TRUE(GlobMatch("*\xC3\xA9", "x\xC3\xA9"));
  EXPECT_FALSE(GlobMatch("*?\xA9", "\xC3\xA9"));  // '*' and '?' never split a character
}

TEST(ShardTest, ASplitOfAnEmptyTensorWithHugeDimensionsIsCheap) {
  // Found by a review: [3^30, 0, 3^30] split along its empty dimension (world 1) looped over
  // 3^30 leading indices.
  const uint64_t big = 205891132094649ull;  // 3^30
  const TensorInfo t = Info("z", DType::kU8, {big, 0, big});
  auto s = SliceOf(t, ShardRule::Split(1), 0, 1).ValueOrThrow();
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_TRUE(SliceByteRanges(t, s).empty());
  EXPECT_EQ(SliceRangeCount(t, s), 0u);
  auto last = SliceOf(t, ShardRule::Split(2), 0, 4).ValueOrThrow();
  EXPECT_TRUE(SliceByteRanges(t, last).empty());
  EXPECT_EQ(SliceRangeCount(t, last), 0u);
}

TEST(ShardTest, GlobMatch) {
  EXPECT_TRUE(GlobMatch("*", ""));
  EXPECT_TRUE(GlobMatch("*.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(GlobMatch("*.q_proj.weight", "model.layers.0.self_attn.q_proj.weight2"));
  EXPECT_FALSE(GlobMatch("*.q_proj.weight", "q_proj.weight"));
  EXPECT_TRUE(GlobMatch("a?c", "abc"));
  EXPECT_FALSE(GlobMatch("a?c", "ac"));
  EXPECT_TRUE(GlobMatch("a*b*c", "aXbYbZc"));
  EXPECT_FALSE(GlobMatch("a*b*c", "aXbYbZ"));
  EXPECT_TRUE(GlobMatch("layers.*.w", "layers.1.2.w"));
  EXPECT_TRUE(GlobMatch("exact", "exact"));
  EXPECT_FALSE(GlobMatch("exact", "exactly"));
  EXPECT_TRUE(GlobMatch("**x", "x"));
}

// Found by fuzz/shard_fuzz.cc: a '*' in the pattern met a '*' in the name and was taken as a
// literal, so the match could not backtrack past it.
TEST(ShardTest, GlobMatchStarInName) {
  EXPECT_TRUE(GlobMatch("*t", "*.q_proj`t"));
  EXPECT_TRUE(GlobMatch("*t", "*.norm.w:ight"));
  EXPECT_TRUE(GlobMatch("*.weight", "*.weight"));
  EXPECT_TRUE(GlobMatch("*.weight", "**.weight"));
  EXPECT_TRUE(GlobMatch("a*b", "a*xb"));
  EXPECT_TRUE(GlobMatch("*", "*"));
  EXPECT_FALSE(GlobMatch("*x", "*y"));
  auto spec = ShardSpec::FromJson(R"({"rules":[{"pattern":"*t","split":0}]})");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_TRUE(spec->RuleFor("*.weight").is_split());
}

TEST(ShardTest, RuleLookupOrder) {
  ShardSpec spec;
  spec.Add("*.weight", ShardRule::Split(0))
      .Add("*.o.weight", ShardRule::Split(1))  // never reached: the first match wins
      .Set("a.o.weight", ShardRule::Split(1))
      .Tie("lm_head.weight", "embed.weight")
      .Set("embed.weight", ShardRule::Split(0, {2, 2}));
  EXPECT_EQ(spec.RuleFor("x.o.weight"), ShardRule::Split(0));
  EXPECT_EQ(spec.RuleFor("a.o.weight"), ShardRule::Split(1));
  EXPECT_EQ(spec.RuleFor("norm.bias"), ShardRule::Replicate());
  EXPECT_EQ(spec.RuleFor("lm_head.weight"), ShardRule::Split(0, {2, 2}));
  EXPECT_EQ(spec.TieTarget("lm_head.weight"), std::optional<std::string>("embed.weight"));
  EXPECT_EQ(spec.TieTarget("embed.weight"), std::nullopt);
  EXPECT_TRUE(spec.Validate().ok());
  EXPECT_EQ(ShardSpec::None().RuleFor("anything"), ShardRule::Replicate());
}

TEST(ShardTest, BuiltinRules) {
  const ShardSpec b = ShardSpec::Builtin();
  const std::string l = "model.layers.3.";
  for (const char* p : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                        "mlp.up_proj"}) {
    EXPECT_EQ(b.RuleFor(l + p + ".weight"), ShardRule::Split(0)) << p;
    EXPECT_EQ(b.RuleFor(l + p + ".bias"), ShardRule::Split(0)) << p;
  }
  EXPECT_EQ(b.RuleFor(l + "self_attn.o_proj.weight"), ShardRule::Split(1));
  EXPECT_EQ(b.RuleFor(l + "mlp.down_proj.weight"), ShardRule::Split(1));
  EXPECT_EQ(b.RuleFor(l + "self_attn.o_proj.bias"), ShardRule::Replicate());
  EXPECT_EQ(b.RuleFor(l + "input_layernorm.weight"), ShardRule::Replicate());
  EXPECT_EQ(b.RuleFor("model.norm.weight"), ShardRule::Replicate());
  EXPECT_EQ(b.RuleFor("model.embed_tokens.weight"), ShardRule::Split(0));
  EXPECT_EQ(b.RuleFor("lm_head.weight"), ShardRule::Split(0));
  EXPECT_EQ(b.RuleFor("model.layers.0.block_sparse_moe.experts.5.w2.weight"), ShardRule::Split(1));
  EXPECT_EQ(b.RuleFor("model.layers.0.block_sparse_moe.gate.weight"), ShardRule::Replicate());
  // GPT-2 (no "transformer." prefix in the hub file, with it in others)
  EXPECT_EQ(b.RuleFor("h.0.attn.c_attn.weight"), ShardRule::SplitEqual(1, 3));
  EXPECT_EQ(b.RuleFor("transformer.h.0.attn.c_attn.bias"), ShardRule::SplitEqual(0, 3));
  EXPECT_EQ(b.RuleFor("h.0.attn.c_proj.weight"), ShardRule::Split(0));
  EXPECT_EQ(b.RuleFor("h.0.mlp.c_fc.weight"), ShardRule::Split(1));
  EXPECT_EQ(b.RuleFor("h.0.mlp.c_proj.bias"), ShardRule::Replicate());
  EXPECT_EQ(b.RuleFor("wte.weight"), ShardRule::Split(0));
  EXPECT_EQ(b.RuleFor("wpe.weight"), ShardRule::Replicate());
  // Falcon / BLOOM / NeoX
  EXPECT_EQ(b.RuleFor("transformer.h.1.self_attention.query_key_value.weight"),
            ShardRule::Split(0));
  EXPECT_EQ(b.RuleFor("transformer.h.1.self_attention.dense.weight"), ShardRule::Split(1));
  EXPECT_EQ(b.RuleFor("gpt_neox.layers.1.mlp.dense_4h_to_h.weight"), ShardRule::Split(1));
  EXPECT_EQ(b.RuleFor("transformer.word_embeddings.weight"), ShardRule::Split(0));
}

TEST(ShardTest, JsonRoundTrip) {
  ShardSpec spec = ShardSpec::Builtin();
  spec.Add("*.qkv.weight", ShardRule::Split(0, {64, 16, 16}))
      .Add("odd \"name\"\n*", ShardRule::Replicate())
      .Set("score.weight", ShardRule::Replicate())
      .Set("lm_head.weight", ShardRule::Split(1))
      .Tie("lm_head.weight", "model.embed_tokens.weight");
  const std::string text = spec.ToJson();
  Result<ShardSpec> back = ShardSpec::FromJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, spec);
  EXPECT_EQ(back->ToJson(), text);
  EXPECT_EQ(ShardSpec::FromJson(ShardSpec::None().ToJson()).ValueOrThrow(), ShardSpec::None());
  EXPECT_EQ(ShardSpec::FromJson("{}").ValueOrThrow(), ShardSpec::None());
  // "base": "builtin" appends Builtin()'s patterns after the file's own.
  auto based = ShardSpec::FromJson(
                   R"({"rules":[{"pattern":"*.q_proj.weight","replicate":true}],"base":"builtin"})")
                   .ValueOrThrow();
  EXPECT_EQ(based.patterns().size(), ShardSpec::Builtin().patterns().size() + 1);
  EXPECT_EQ(based.RuleFor("m.q_proj.weight"), ShardRule::Replicate());
  EXPECT_EQ(based.RuleFor("m.k_proj.weight"), ShardRule::Split(0));
}

TEST(ShardTest, JsonErrorsNameTheEntry) {
  auto err = [](std::string_view text) {
    Result<ShardSpec> r = ShardSpec::FromJson(text);
    EXPECT_FALSE(r.ok()) << text;
    if (r.ok()) return std::string();
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    return r.status().message();
  };
  auto has = [](const std::string& s, const std::string& part) {
    return s.find(part) != std::string::npos;
  };
  EXPECT_TRUE(has(err("[]"), "not an object"));
  EXPECT_TRUE(has(err("{"), "not valid JSON"));
  EXPECT_TRUE(has(err(R"({"rulez":[]})"), "unknown key \"rulez\""));
  EXPECT_TRUE(has(err(R"({"rules":{}})"), "rules: is an object"));
  EXPECT_TRUE(has(err(R"({"rules":[{"split":0}]})"), "rules[0]: no \"pattern\""));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","split":0},{"pattern":"b","split":"x"}]})"),
                  "rules[1]: \"split\" is a string"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a"}]})"), "rules[0]: a rule needs exactly one"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","split":0,"replicate":true}]})"), "exactly one"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","replicate":false}]})"), "must be true"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"","split":0}]})"), "empty pattern"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","split":0,"parts":[]}]})"), "empty"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","split":0,"parts":[1,0]}]})"), "zero size"));
  EXPECT_TRUE(
      has(err(R"({"rules":[{"pattern":"a","split":0,"parts":[2],"equal_parts":2}]})"), "exclude"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","replicate":true,"equal_parts":2}]})"),
                  "need \"split\""));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","split":-1}]})"), "rules[0]"));
  EXPECT_TRUE(has(err(R"({"rules":[{"pattern":"a","split":0,"dim":1}]})"), "unknown key \"dim\""));
  EXPECT_TRUE(has(err(R"({"overrides":{"x.w":{"split":"0"}}})"), "overrides[\"x.w\"]"));
  EXPECT_TRUE(has(err(R"({"overrides":{"x.w":1}})"), "overrides[\"x.w\"]: is a signed integer"));
  EXPECT_TRUE(has(err(R"({"overrides":{"a":{"split":0},"a":{"split":1}}})"), "duplicate"));
  EXPECT_TRUE(has(err(R"({"ties":{"a":1}})"), "ties[\"a\"]: is a signed integer"));
  EXPECT_TRUE(has(err(R"({"ties":{"a":"a"}})"), "tied to itself"));
  EXPECT_TRUE(has(err(R"({"ties":{"a":"b","b":"a"}})"), "tie cycle a -> b -> a"));
  EXPECT_TRUE(has(err(R"({"base":"llama"})"), "base"));
}

}  // namespace
}  // namespace tensorferry

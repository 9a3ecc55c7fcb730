// Selection and DescribeSelection alone (no Loader, no reads): which tensors, in what order, with
// which local shapes, and how tied aliases resolve. Over an in-memory checkpoint.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::MakeFile;
using testing::MemoryEnv;

// Three F32 tensors in file order: embed [4, 2] (32 bytes), layers.0.w [2, 2] (16), layers.1.w
// [2, 2] (16); no lm_head (tie_word_embeddings).
class SelectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.AddFile("/m/model.safetensors",
                 MakeFile(R"({"model.embed_tokens.weight":{"dtype":"F32","shape":[4,2],)"
                          R"("data_offsets":[0,32]},)"
                          R"("model.layers.0.w":{"dtype":"F32","shape":[2,2],)"
                          R"("data_offsets":[32,48]},)"
                          R"("model.layers.1.w":{"dtype":"F32","shape":[2,2],)"
                          R"("data_offsets":[48,64]}})",
                          64));
    OpenOptions options;
    options.env = &env_;
    ckpt_ = Checkpoint::Open("/m/model.safetensors", options).ValueOrThrow();
  }

  std::vector<std::string> Names(const Description& d) const {
    std::vector<std::string> out;
    for (const OutputInfo& o : d.outputs) out.push_back(o.name);
    return out;
  }

  MemoryEnv env_;
  std::shared_ptr<const Checkpoint> ckpt_;
};

TEST_F(SelectionTest, NamesResolveInCheckpointOrderOnceEach) {
  auto r = Selection::Names({"model.layers.1.w", "model.embed_tokens.weight", "model.layers.1.w"})
               .Resolve(*ckpt_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (std::vector<uint32_t>{0, 2}));
  auto missing = Selection::Names({"nope"}).Resolve(*ckpt_);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("\"nope\""), std::string::npos);
}

TEST_F(SelectionTest, LayersAndPredicates) {
  auto layer1 = Selection::Layers(1, 1).Resolve(*ckpt_);
  ASSERT_TRUE(layer1.ok());
  EXPECT_EQ(*layer1, (std::vector<uint32_t>{2}));
  auto two_dim = Selection::Where([](const TensorInfo& t) { return t.shape[0] == 2; });
  auto r = two_dim.Resolve(*ckpt_);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (std::vector<uint32_t>{1, 2}));
}

TEST_F(SelectionTest, DescriptionWithoutTensorParallelismIsTheSelection) {
  auto d = DescribeSelection(*ckpt_, Selection::All(), nullptr);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(Names(*d), (std::vector<std::string>{"model.embed_tokens.weight", "model.layers.0.w",
                                                 "model.layers.1.w"}));
  EXPECT_EQ(d->read, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(d->bytes, 64u);
  EXPECT_EQ(d->outputs[0].shape, (std::vector<uint64_t>{4, 2}));
  EXPECT_FALSE(d->outputs[0].slice.has_value());
}

// A tied alias the files lack comes right after its target, delivers its target's slice and is
// not read a second time; selected by name alone, only the target is read.
TEST_F(SelectionTest, TiedAliasFollowsItsTargetWithTheTargetsSlice) {
  ShardSpec spec;
  spec.Add("model.embed_tokens.weight", ShardRule::Split(0));
  spec.Tie("lm_head.weight", "model.embed_tokens.weight");
  const TensorParallelOptions tp{spec, 1, 2};
  auto all = DescribeSelection(*ckpt_, Selection::All(), &tp);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(Names(*all), (std::vector<std::string>{"model.embed_tokens.weight", "lm_head.weight",
                                                   "model.layers.0.w", "model.layers.1.w"}));
  EXPECT_EQ(all->read, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(all->bytes, 16u + 16u + 16u);  // half of the embedding, the layers whole
  const OutputInfo& alias = all->outputs[1];
  EXPECT_TRUE(alias.alias);
  EXPECT_EQ(alias.tensor, 0u);
  EXPECT_EQ(alias.shape, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(alias.bytes, 16u);

  auto by_name = DescribeSelection(*ckpt_, Selection::Names({"lm_head.weight"}), &tp);
  ASSERT_TRUE(by_name.ok()) << by_name.status().ToString();
  EXPECT_EQ(Names(*by_name), (std::vector<std::string>{"lm_head.weight"}));
  EXPECT_EQ(by_name->read, (std::vector<uint32_t>{0}));
}

TEST_F(SelectionTest, TieToATensorTheCheckpointLacksIsRefused) {
  ShardSpec spec;
  spec.Tie("lm_head.weight", "model.missing");
  const TensorParallelOptions tp{spec, 0, 1};
  auto d = DescribeSelection(*ckpt_, Selection::All(), &tp);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Code::kInvalidArgument);
  EXPECT_NE(d.status().message().find("model.missing"), std::string::npos);
}

}  // namespace
}  // namespace tensorferry

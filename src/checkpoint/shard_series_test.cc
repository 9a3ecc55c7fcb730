#include "checkpoint/shard_series.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "testing/test_util.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::Contains;

TEST(ShardSeries, ParsesTransformersNames) {
  auto s = ParseShardName("model-00002-of-00007.safetensors");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->prefix, "model");
  EXPECT_EQ(s->index, 2u);
  EXPECT_EQ(s->count, 7u);
  // Dashes inside the prefix, unpadded numbers, an empty prefix.
  s = ParseShardName("pytorch-model-fp16-3-of-12.safetensors");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->prefix, "pytorch-model-fp16");
  EXPECT_EQ(s->index, 3u);
  EXPECT_EQ(s->count, 12u);
  s = ParseShardName("-1-of-2.safetensors");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->prefix, "");
  // Numbered 0 or beyond the count: parsed; CheckShardSeries decides.
  s = ParseShardName("model-00000-of-00002.safetensors");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->index, 0u);
}

TEST(ShardSeries, OtherNamesAreNotSeries) {
  for (const char* name :
       {"model.safetensors", "model-00001-of-00002.safetensors.bak", "model-of-00002.safetensors",
        "model-00001-of-.safetensors", "model-00001-of-00000.safetensors",
        "model-x1-of-2.safetensors", "model-1-of-2x.safetensors", "model00001-of-00002.safetensors",
        "model-4294967296-of-2.safetensors", "model-1-of-4294967296.safetensors",
        "model--of-2.safetensors", "consolidated.00.safetensors", "-of-.safetensors", ""}) {
    EXPECT_FALSE(ParseShardName(name).has_value()) << name;
  }
}

TEST(ShardSeries, CompleteSeriesAndOtherFilesPass) {
  const std::vector<std::string> paths = {
      "/m/model-00002-of-00003.safetensors", "/m/model-00001-of-00003.safetensors",
      "/m/model-00003-of-00003.safetensors", "/m/adapter.safetensors",
      // Another prefix is another series, complete on its own.
      "/m/draft-1-of-1.safetensors"};
  EXPECT_TRUE(CheckShardSeries(paths, "/m").ok());
  EXPECT_TRUE(CheckShardSeries(std::vector<std::string>{}, "/m").ok());
  EXPECT_TRUE(
      CheckShardSeries(std::vector<std::string>{"s3://b/p/model.safetensors"}, "s3://b/p/").ok());
}

TEST(ShardSeries, MissingShardsAreNamed) {
  const std::vector<std::string> paths = {"/m/model-00001-of-00004.safetensors",
                                          "/m/model-00003-of-00004.safetensors"};
  const Status s = CheckShardSeries(paths, "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_EQ(s.message(),
            "/m: incomplete checkpoint: 2 of the 4 shards \"model-*-of-00004.safetensors\" are "
            "missing: \"model-00002-of-00004.safetensors\", \"model-00004-of-00004.safetensors\"");
  // Object URLs: the names are the keys' last components; unpadded numbers stay unpadded.
  const Status u = CheckShardSeries(
      std::vector<std::string>{"s3://bucket/llama/w-2-of-3.safetensors"}, "s3://bucket/llama/");
  EXPECT_EQ(u.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(u.message(), "s3://bucket/llama/: incomplete checkpoint: 2 of the 3 shards"))
      << u.message();
  EXPECT_TRUE(Contains(u.message(), "\"w-1-of-3.safetensors\", \"w-3-of-3.safetensors\""))
      << u.message();
}

TEST(ShardSeries, ManyMissingAreCounted) {
  const Status s =
      CheckShardSeries(std::vector<std::string>{"/m/model-00005-of-00100.safetensors"}, "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(s.message(), "99 of the 100 shards")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "\"model-00006-of-00100.safetensors\" and 94 more"))
      << s.message();
  EXPECT_FALSE(Contains(s.message(), "00007-of")) << s.message();
}

// The count comes from a name someone chose: it must cost neither memory nor time (the index
// fuzzer's smoke run found "model-00001-of-0000000000000000940238681.safetensors" allocating 7.5
// GB).
TEST(ShardSeries, HugeCountsCostNothing) {
  Status s = CheckShardSeries(
      std::vector<std::string>{"/m/model-00001-of-0000000000000000940238681.safetensors"}, "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(s.message(), "940238680 of the 940238681 shards")) << s.message();
  // (Numbers written as the first file found writes its own: unpadded here.)
  s = CheckShardSeries(std::vector<std::string>{"/m/w-3-of-4294967295.safetensors",
                                                "/m/w-4294967295-of-4294967295.safetensors"},
                       "/m");
  EXPECT_TRUE(Contains(s.message(), "4294967293 of the 4294967295 shards")) << s.message();
  EXPECT_TRUE(Contains(s.message(),
                       "missing: \"w-1-of-4294967295.safetensors\", "
                       "\"w-2-of-4294967295.safetensors\", "
                       "\"w-4-of-4294967295.safetensors\""))
      << s.message();
  s = CheckShardSeries(std::vector<std::string>{"/m/w-0-of-4294967295.safetensors",
                                                "/m/w-4294967294-of-4294967295.safetensors"},
                       "/m");
  EXPECT_TRUE(Contains(s.message(), "4294967293 of the 4294967295 shards")) << s.message();
}

TEST(ShardSeries, NumbersOutsideTheSeries) {
  Status s = CheckShardSeries(std::vector<std::string>{"/m/model-00001-of-00002.safetensors",
                                                       "/m/model-00002-of-00002.safetensors",
                                                       "/m/model-00003-of-00002.safetensors"},
                              "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(s.message(),
                       "\"model-00003-of-00002.safetensors\" is numbered 3 in a "
                       "series of 2 shards"))
      << s.message();
  // Numbered from 0 when one file is numbered 0: complete as 0..n-1, and n is outside it.
  EXPECT_TRUE(CheckShardSeries(std::vector<std::string>{"/m/model-0-of-2.safetensors",
                                                        "/m/model-1-of-2.safetensors"},
                               "/m")
                  .ok());
  s = CheckShardSeries(
      std::vector<std::string>{"/m/model-0-of-2.safetensors", "/m/model-2-of-2.safetensors"}, "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(s.message(), "whose numbers run from 0 to 1")) << s.message();
  s = CheckShardSeries(std::vector<std::string>{"/m/model-00000-of-00003.safetensors",
                                                "/m/model-00002-of-00003.safetensors"},
                       "/m");
  EXPECT_TRUE(Contains(s.message(), "missing: \"model-00001-of-00003.safetensors\""))
      << s.message();
  // The same number written twice.
  s = CheckShardSeries(
      std::vector<std::string>{"/m/model-1-of-2.safetensors", "/m/model-00001-of-00002.safetensors",
                               "/m/model-2-of-2.safetensors"},
      "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(s.message(), "are both shard 1 of 2")) << s.message();
}

TEST(ShardSeries, TwoSizesOfOnePrefix) {
  const Status s = CheckShardSeries(std::vector<std::string>{"/m/model-00001-of-00002.safetensors",
                                                             "/m/model-00002-of-00002.safetensors",
                                                             "/m/model-00001-of-00003.safetensors"},
                                    "/m");
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_TRUE(Contains(s.message(),
                       "files of two shard series: "
                       "\"model-00001-of-00002.safetensors\" is one of 2, "
                       "\"model-00001-of-00003.safetensors\" one of 3"))
      << s.message();
}

}  // namespace
}  // namespace tensorferry

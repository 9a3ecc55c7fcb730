#include "convert/convert.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/convert.h"
#include "testing/test_util.h"
#include "testing/torch_builder.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;
using testing::F32Bytes;
using testing::MakeTorchZip;
using testing::MemoryEnv;
using testing::PickleBuilder;
using testing::ReadBytes;
using testing::TempDir;
using testing::WriteBytes;

// Storage "0": 8 floats 0..7. "w" = [2,4] all of it; "tied" and "also" the same view; "half0" and
// "half1" its two rows as [4] views (not overlapping each other, both overlapping "w");
// "w_t" the transpose; storage "1": "solo" [3]; values "step" = 3 and "format" = "x".
std::string ModelZip() {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark();
  p.Str("w").Tensor("FloatStorage", "0", 8, 0, {2, 4}, {4, 1}).Put(1);
  p.Str("tied").Get(1);
  p.Str("also").Tensor("FloatStorage", "0", 8, 0, {2, 4}, {4, 1});
  p.Str("half0").Tensor("FloatStorage", "0", 8, 0, {4}, {1});
  p.Str("half1").Tensor("FloatStorage", "0", 8, 4, {4}, {1});
  p.Str("w_t").Tensor("FloatStorage", "0", 8, 0, {4, 2}, {1, 4});
  p.Str("solo").Tensor("FloatStorage", "1", 3, 0, {3}, {1});
  p.Str("step").Int(3).Str("format").Str("x").Str("blob").EmptyList().Put(9).Get(9).Append();
  p.SetItems().Stop();
  return MakeTorchZip(p.bytes(),
                      {{"0", F32Bytes({0, 1, 2, 3, 4, 5, 6, 7})}, {"1", F32Bytes({8, 9, 10})}});
}

TEST(PlanConversion, AliasesOverlapsAndMetadata) {
  MemoryEnv env;
  env.AddFile("m.pt", ModelZip());
  TorchOpenOptions options;
  options.env = &env;
  auto c = TorchCheckpoint::Open("m.pt", options);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const convert::ConversionPlan plan = convert::PlanConversion(**c, true);
  std::vector<std::string> written;
  for (size_t i : plan.write) written.push_back((*c)->tensors()[i].name);
  // "also" < "tied" < "w": "also" is kept, in source order.
  EXPECT_EQ(written, (std::vector<std::string>{"also", "half0", "half1", "w_t", "solo"}));
  EXPECT_EQ(plan.aliases,
            (std::vector<std::pair<std::string, std::string>>{{"tied", "also"}, {"w", "also"}}));
  std::vector<std::string> copied;
  for (const auto& [name, why] : plan.copied_views) copied.push_back(name);
  EXPECT_EQ(copied, (std::vector<std::string>{"also", "half0", "half1", "w_t"}));
  const std::map<std::string, std::string> meta(plan.metadata.begin(), plan.metadata.end());
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("tied"), "also");
  EXPECT_EQ(meta.at("w"), "also");
  EXPECT_EQ(meta.at("step"), "3");
  EXPECT_EQ(meta.size(), 4u);
  ASSERT_EQ(plan.skipped.size(), 2u);
  EXPECT_EQ(plan.skipped[0].first, "format");
  EXPECT_EQ(plan.skipped[1].first, "blob");

  const convert::ConversionPlan bare = convert::PlanConversion(**c, false);
  EXPECT_EQ(bare.kept_values.size(), 0u);
  EXPECT_EQ(bare.skipped.size(), 3u);
  EXPECT_EQ(bare.metadata.size(), 3u);
}

TEST(ConvertTorchCheckpoint, WritesVerifiesAndDetectsTampering) {
  TempDir dir;
  WriteBytes(dir.Join("m.pt"), ModelZip());
  ConvertOptions options;
  options.write.sync = false;
  auto report = ConvertTorchCheckpoint(dir.Join("m.pt"), dir.Join("m.safetensors"), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->sharded);
  EXPECT_EQ(report->tensors, 5u);
  EXPECT_EQ(report->tensor_bytes, 32u + 16 + 16 + 32 + 12);
  EXPECT_EQ(report->outputs, std::vector<std::string>{dir.Join("m.safetensors")});
  EXPECT_EQ(report->aliases.size(), 2u);

  auto out = Checkpoint::Open(dir.Join("m.safetensors"));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ((*out)->tensors().size(), 5u);
  const std::string bytes = ReadBytes(dir.Join("m.safetensors"));
  const TensorInfo* wt = (*out)->Find("w_t");
  ASSERT_NE(wt, nullptr);
  EXPECT_EQ(bytes.substr(wt->offset, wt->size), F32Bytes({0, 4, 1, 5, 2, 6, 3, 7}));
  EXPECT_EQ(wt->shape, (std::vector<uint64_t>{4, 2}));
  const TensorInfo* half1 = (*out)->Find("half1");
  EXPECT_EQ(bytes.substr(half1->offset, half1->size), F32Bytes({4, 5, 6, 7}));

  auto verified = VerifyConversion(dir.Join("m.pt"), dir.Join("m.safetensors"), options);
  ASSERT_TRUE(verified.ok()) << verified.status().ToString();
  EXPECT_EQ(verified->tensors, 7u);
  EXPECT_EQ(verified->bytes, 32u * 3 + 16 + 16 + 32 + 12);

  std::string tampered = bytes;
  tampered[half1->offset + 5] ^= 1;
  WriteBytes(dir.Join("m.safetensors"), tampered);
  auto bad = VerifyConversion(dir.Join("m.pt"), dir.Join("m.safetensors"), options);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kConvertVerifyMismatch);
  EXPECT_NE(bad.status().message().find("tensor \"half1\": byte 5 differs"), std::string::npos)
      << bad.status().message();
}

TEST(ConvertTorchCheckpoint, ShardsOnRequestAndIntoADirectory) {
  TempDir dir;
  WriteBytes(dir.Join("m.pt"), ModelZip());
  ConvertOptions options;
  options.write.sync = false;
  options.max_shard_size = 40;
  auto report = ConvertTorchCheckpoint(dir.Join("m.pt"), dir.Join("out"), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->sharded);
  ASSERT_GE(report->outputs.size(), 4u);
  EXPECT_EQ(fs::path(report->outputs.back()).filename(), "model.safetensors.index.json");
  auto verified = VerifyConversion(dir.Join("m.pt"), dir.Join("out"), options);
  ASSERT_TRUE(verified.ok()) << verified.status().ToString();
  // Into an existing directory without sharding: <dir>/model.safetensors.
  fs::create_directory(dir.Join("flat"));
  options.max_shard_size = 0;
  auto flat = ConvertTorchCheckpoint(dir.Join("m.pt"), dir.Join("flat"), options);
  ASSERT_TRUE(flat.ok()) << flat.status().ToString();
  EXPECT_EQ(flat->outputs, std::vector<std::string>{dir.Join("flat") + "/model.safetensors"});
  EXPECT_TRUE(VerifyConversion(dir.Join("m.pt"), dir.Join("flat"), options).ok());
}

TEST(ConvertTorchCheckpoint, NeverReplacesItsSource) {
  TempDir dir;
  WriteBytes(dir.Join("model.safetensors"), ModelZip());  // a torch file with that name
  auto r = ConvertTorchCheckpoint(dir.Join("model.safetensors"), dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ReadBytes(dir.Join("model.safetensors")), ModelZip());
  // A source named as a shard of an older sharded checkpoint in the directory: the single-file
  // output into it would remove that shard (it did, the sharded output refused).
  TempDir old;
  const std::string shard = old.Join("model-00001-of-00002.safetensors");
  WriteBytes(shard, ModelZip());
  WriteBytes(old.Join("model.safetensors.index.json"),
             R"({"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors"}})");
  for (uint64_t max_shard_size : {uint64_t{0}, uint64_t{1} << 20}) {
    ConvertOptions options;
    options.write.sync = false;
    options.max_shard_size = max_shard_size;
    auto into = ConvertTorchCheckpoint(shard, old.path(), options);
    ASSERT_FALSE(into.ok()) << max_shard_size;
    EXPECT_EQ(into.status().code(), Code::kInvalidArgument) << into.status().ToString();
    EXPECT_NE(into.status().message().find("could replace the source file"), std::string::npos)
        << into.status().ToString();
    EXPECT_EQ(ReadBytes(shard), ModelZip());
  }
}

TEST(ConvertTorchCheckpoint, RefusalsWriteNothing) {
  TempDir dir;
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().Str("w").Tensor("FloatStorage", "0", 1, 0, {1}, {1});
  p.Str("x").Global("builtins", "exec").Str("print(1)").Tuple(1).Reduce().SetItems().Stop();
  WriteBytes(dir.Join("bad.pt"), MakeTorchZip(p.bytes(), {{"0", F32Bytes({1})}}));
  auto r = ConvertTorchCheckpoint(dir.Join("bad.pt"), dir.Join("out.safetensors"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kPickleRefusedGlobal);
  EXPECT_FALSE(fs::exists(dir.Join("out.safetensors")));
}

TEST(ConvertTorchCheckpoint, ExpandingViewsAreBoundedByTheirStorage) {
  TempDir dir;
  // One float of storage viewed as 2^40 elements with stride 0: 4 TiB of output from 4 bytes.
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark();
  p.Str("small").Tensor("FloatStorage", "1", 2, 0, {2}, {1});
  p.Str("huge").Tensor("FloatStorage", "0", 1, 0, {int64_t{1} << 40}, {0});
  p.SetItems().Stop();
  WriteBytes(dir.Join("x.pt"),
             MakeTorchZip(p.bytes(), {{"0", F32Bytes({1})}, {"1", F32Bytes({2, 3})}}));
  ConvertOptions options;
  options.write.sync = false;
  auto r = ConvertTorchCheckpoint(dir.Join("x.pt"), dir.Join("out"), options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kTorchBadTensor) << r.status().ToString();
  for (const std::string& part : std::vector<std::string>{
           dir.Join("x.pt"), "tensor \"huge\"", "shape [1099511627776]", "stride [0]",
           "4398046511104 bytes", "of 4 bytes", "TorchLimits::max_view_expansion"}) {
    EXPECT_NE(r.status().message().find(part), std::string::npos)
        << part << " in " << r.status().message();
  }
  EXPECT_FALSE(fs::exists(dir.Join("out")));

  // A small expanded view (a broadcast bias) is within the allowance and materialized.
  PickleBuilder q;
  q.Proto(2).EmptyDict().Mark();
  q.Str("bias").Tensor("FloatStorage", "0", 1, 0, {2, 3}, {0, 0});
  q.SetItems().Stop();
  WriteBytes(dir.Join("b.pt"), MakeTorchZip(q.bytes(), {{"0", F32Bytes({7})}}));
  auto ok = ConvertTorchCheckpoint(dir.Join("b.pt"), dir.Join("b.safetensors"), options);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(VerifyConversion(dir.Join("b.pt"), dir.Join("b.safetensors"), options).ok());

  // The limit is the caller's: none at all refuses the same file.
  options.open.limits.max_view_expansion = 0;
  auto refused = ConvertTorchCheckpoint(dir.Join("b.pt"), dir.Join("c.safetensors"), options);
  EXPECT_EQ(refused.status().code(), Code::kTorchBadTensor) << refused.status().ToString();
}

TEST(ConvertTorchCheckpoint, IntoADirectoryReplacesAnOlderCheckpointWhole) {
  TempDir dir;
  WriteBytes(dir.Join("m.pt"), ModelZip());
  ConvertOptions options;
  options.write.sync = false;
  options.max_shard_size = 40;
  ASSERT_TRUE(ConvertTorchCheckpoint(dir.Join("m.pt"), dir.Join("out"), options).ok());
  // One file now: the older shards and their index (which would shadow it) are gone.
  options.max_shard_size = 0;
  auto flat = ConvertTorchCheckpoint(dir.Join("m.pt"), dir.Join("out"), options);
  ASSERT_TRUE(flat.ok()) << flat.status().ToString();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.Join("out"))) {
    names.push_back(e.path().filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{"model.safetensors"});
  EXPECT_TRUE(VerifyConversion(dir.Join("m.pt"), dir.Join("out"), options).ok());
}

}  // namespace
}  // namespace tensorferry

#include "tensorferry/hub.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tensorferry/checkpoint.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;
using ::tensorferry::testing::Contains;
using ::tensorferry::testing::ScopedEnv;
using ::tensorferry::testing::TempDir;
using ::tensorferry::testing::WriteBytes;

const std::string kMain(40, 'a');
const std::string kPr(40, 'b');
const std::string kOld = "0123456789abcdef0123456789abcdef01234567";

// A hub cache as huggingface_hub lays it out: models--org--llama with main, refs/pr/1 and an
// old commit, model files linked into blobs/; models--gpt2 without an owner;
// datasets--org--data.
class HubCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string repo = cache_.Join("models--org--llama");
    fs::create_directories(repo + "/blobs");
    fs::create_directories(repo + "/refs/refs/pr");
    WriteBytes(repo + "/refs/main", kMain);  // no newline, as the hub writes it
    WriteBytes(repo + "/refs/refs/pr/1", kPr + "\n");
    for (const std::string& commit : {kMain, kPr, kOld}) {
      fs::create_directories(repo + "/snapshots/" + commit + "/sub");
    }
    WriteBytes(repo + "/blobs/b1",
               testing::MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4));
    fs::create_symlink("../../blobs/b1", repo + "/snapshots/" + kMain + "/model.safetensors");
    fs::create_directories(cache_.Join("models--gpt2/refs"));
    WriteBytes(cache_.Join("models--gpt2/refs/main"), kOld);
    fs::create_directories(cache_.Join("models--gpt2/snapshots/" + kOld));
    fs::create_directories(cache_.Join("datasets--org--data/refs"));
    WriteBytes(cache_.Join("datasets--org--data/refs/main"), kMain);
    fs::create_directories(cache_.Join("datasets--org--data/snapshots/" + kMain));
  }

  std::string Snapshot(const std::string& folder, const std::string& commit) {
    return cache_.Join(folder + "/snapshots/" + commit);
  }
  Result<std::string> Resolve(const std::string& path) {
    return ResolveHubPath(path, cache_.path());
  }

  TempDir cache_;
};

TEST_F(HubCacheTest, RepositoriesRevisionsAndPaths) {
  const std::string llama = Snapshot("models--org--llama", kMain);
  EXPECT_EQ(Resolve("hf://org/llama").value(), llama);
  EXPECT_EQ(Resolve("HF://org/llama/").value(), llama);
  EXPECT_EQ(Resolve("hf://models/org/llama").value(), llama);
  EXPECT_EQ(Resolve("hf://org/llama@main").value(), llama);
  EXPECT_EQ(Resolve("hf://org/llama/model.safetensors").value(), llama + "/model.safetensors");
  EXPECT_EQ(Resolve("hf://org/llama/sub").value(), llama + "/sub");
  EXPECT_EQ(Resolve("hf://org/llama@" + kOld).value(), Snapshot("models--org--llama", kOld));
  EXPECT_EQ(Resolve("hf://org/llama@refs%2Fpr%2F1/sub").value(),
            Snapshot("models--org--llama", kPr) + "/sub");
  // Without an owner; "gpt2/x" is a path inside gpt2 when the cache has no models--gpt2--x.
  EXPECT_EQ(Resolve("hf://gpt2").value(), Snapshot("models--gpt2", kOld));
  EXPECT_EQ(Resolve("hf://gpt2@main").value(), Snapshot("models--gpt2", kOld));
  EXPECT_EQ(Resolve("hf://datasets/org/data").value(), Snapshot("datasets--org--data", kMain));
}

TEST_F(HubCacheTest, WhatIsNotCachedIsNotFoundSayingHowToFetchIt) {
  Result<std::string> r = Resolve("hf://org/other");
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(r.status().message(),
                       "hf://org/other: not in the Hugging Face hub cache \"" + cache_.path() +
                           "\" (no models--org--other nor models--org)"));
  EXPECT_TRUE(Contains(r.status().message(), "`hf download org/other --include"));
  r = Resolve("hf://datasets/org/nope");
  EXPECT_TRUE(Contains(r.status().message(), "`hf download org/nope --repo-type dataset"))
      << r.status().message();
  r = Resolve("hf://org/llama@v2");
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_TRUE(
      Contains(r.status().message(), "revision \"v2\" of org/llama is not in the hub cache"))
      << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "`hf download org/llama --revision v2`"));
  r = Resolve("hf://datasets/org/data@v3");
  EXPECT_TRUE(
      Contains(r.status().message(), "`hf download org/data --repo-type dataset --revision v3`"))
      << r.status().message();
  r = Resolve("hf://org/llama@" + std::string(40, 'c'));
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(r.status().message(), "commit " + std::string(40, 'c') + " of org/llama"));
  r = Resolve("hf://org/llama/missing.safetensors");
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_TRUE(
      Contains(r.status().message(), "\"missing.safetensors\" is not in the cached snapshot"));
  // A refs file that does not hold a commit.
  WriteBytes(cache_.Join("models--org--llama/refs/broken"), "not a hash");
  r = Resolve("hf://org/llama@broken");
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(r.status().message(), "does not hold a commit hash"));
}

TEST_F(HubCacheTest, MalformedPathsAreInvalid) {
  for (const char* bad :
       {"hf://", "hf:///", "hf://org//llama", "hf://org/ll--ama", "hf://org/..", "hf://org/llama@",
        "hf://org/llama/../x", "hf://org/llama/./x", "hf://org/llama@..%2F..%2Fx",
        "hf://org/lla ma", "hf://-org/llama", "hf://org/llama@%2F"}) {
    const Result<std::string> r = Resolve(bad);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad << ": " << r.status().ToString();
    EXPECT_TRUE(Contains(r.status().message(), bad)) << r.status().message();
  }
  EXPECT_EQ(Resolve("/local/path").status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(IsHubPath("Hf://x"));
  EXPECT_FALSE(IsHubPath("hf:/x"));
  EXPECT_FALSE(IsHubPath("s3://x"));
}

TEST_F(HubCacheTest, CheckpointOpenReadsTheSnapshot) {
  ScopedEnv cache("HF_HUB_CACHE", cache_.path());
  auto cp = Checkpoint::Open("hf://org/llama");
  ASSERT_TRUE(cp.ok()) << cp.status().ToString();
  ASSERT_EQ((*cp)->files().size(), 1u);
  EXPECT_EQ((*cp)->files()[0].path, Snapshot("models--org--llama", kMain) + "/model.safetensors");
  EXPECT_NE((*cp)->Find("w"), nullptr);
  const std::vector<std::string> files = {"hf://org/llama/model.safetensors"};
  cp = Checkpoint::OpenFiles(files);
  ASSERT_TRUE(cp.ok()) << cp.status().ToString();
  EXPECT_EQ((*cp)->tensors().size(), 1u);
  EXPECT_EQ(Checkpoint::Open("hf://org/nothing").status().code(), Code::kNotFound);
}

TEST(HubCacheDir, FromTheEnvironmentAsHuggingfaceHubDecides) {
  ScopedEnv hub("HF_HUB_CACHE", std::nullopt);
  ScopedEnv legacy("HUGGINGFACE_HUB_CACHE", std::nullopt);
  ScopedEnv hf_home("HF_HOME", std::nullopt);
  ScopedEnv xdg("XDG_CACHE_HOME", std::nullopt);
  ScopedEnv home("HOME", "/home/u");
  EXPECT_EQ(HubCacheDir(), "/home/u/.cache/huggingface/hub");
  {
    ScopedEnv x("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(HubCacheDir(), "/xdg/huggingface/hub");
    ScopedEnv h("HF_HOME", "~/hf-$USERX-${HOME}");
    EXPECT_EQ(HubCacheDir(), "/home/u/hf-$USERX-/home/u/hub");
    ScopedEnv l("HUGGINGFACE_HUB_CACHE", "/legacy");
    EXPECT_EQ(HubCacheDir(), "/legacy");
    ScopedEnv c("HF_HUB_CACHE", "$HOME/c");
    EXPECT_EQ(HubCacheDir(), "/home/u/c");
  }
}

}  // namespace
}  // namespace tensorferry

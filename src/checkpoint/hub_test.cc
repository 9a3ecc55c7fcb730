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
  // huggingface_hub's own unescaped form (parse_hf_uri): the ref's components are the revision's
  // (they were read as PATH: revision "refs", path "pr/1/sub").
  EXPECT_EQ(Resolve("hf://org/llama@refs/pr/1/sub").value(),
            Snapshot("models--org--llama", kPr) + "/sub");
  EXPECT_EQ(Resolve("hf://org/llama@refs/pr/1").value(), Snapshot("models--org--llama", kPr));
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

// An owner-less repository's files may have names no repository id may (spaces, '+', "--").
TEST_F(HubCacheTest, OwnerlessRepositoryFilesWithAnyName) {
  for (const std::string name : {"my model+v2.safetensors", "model--v2.safetensors"}) {
    WriteBytes(Snapshot("models--gpt2", kOld) + "/" + name, "x");
    const Result<std::string> r = Resolve("hf://gpt2/" + name);
    ASSERT_TRUE(r.ok()) << name << ": " << r.status().ToString();
    EXPECT_EQ(*r, Snapshot("models--gpt2", kOld) + "/" + name);
  }
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
  // A checkpoint in a subfolder of the snapshot (diffusers' transformer/): its links reach the
  // repository's blobs/ from one level deeper.
  fs::create_symlink("../../../blobs/b1",
                     Snapshot("models--org--llama", kMain) + "/sub/model.safetensors");
  auto sub = Checkpoint::Open("hf://org/llama/sub");
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  EXPECT_NE((*sub)->Find("w"), nullptr);
  const std::vector<std::string> files = {"hf://org/llama/model.safetensors"};
  cp = Checkpoint::OpenFiles(files);
  ASSERT_TRUE(cp.ok()) << cp.status().ToString();
  EXPECT_EQ((*cp)->tensors().size(), 1u);
  // Not cached, and offline: the hub is not asked, and the error says so.
  ScopedEnv offline("HF_HUB_OFFLINE", "1");
  const Status missing = Checkpoint::Open("hf://org/nothing").status();
  EXPECT_EQ(missing.code(), Code::kNotFound);
  EXPECT_TRUE(Contains(missing.message(), "not in the Hugging Face hub cache"))
      << missing.ToString();
  EXPECT_TRUE(Contains(missing.message(), "HF_HUB_OFFLINE is set, so the hub"))
      << missing.ToString();
  const std::vector<std::string> two = {"hf://org/llama/model.safetensors",
                                        "hf://org/nothing/model.safetensors"};
  const Status mixed = Checkpoint::OpenFiles(two).status();
  EXPECT_EQ(mixed.code(), Code::kNotFound);
  EXPECT_TRUE(Contains(mixed.message(), "HF_HUB_OFFLINE")) << mixed.ToString();
  // A cached snapshot without the checkpoint's files (only a config) is not the checkpoint.
  WriteBytes(Snapshot("models--org--llama", kPr) + "/config.json", "{}");
  const Status incomplete = Checkpoint::Open("hf://org/llama@refs%2Fpr%2F1").status();
  EXPECT_EQ(incomplete.code(), Code::kNotFound);
  EXPECT_TRUE(Contains(incomplete.message(), "is incomplete")) << incomplete.ToString();
}

TEST(HubRemote, UrlsPinnedToTheCommitAsTheHubNamesFiles) {
  ScopedEnv endpoint("HF_ENDPOINT", std::nullopt);
  const ObjectStoreOptions options;
  const auto url = [&](const std::string& path) {
    Result<std::string> r = HubUrl(path, options);
    return r.ok() ? *r : r.status().ToString();
  };
  EXPECT_EQ(HubEndpoint(), "https://huggingface.co");
  EXPECT_EQ(url("hf://org/llama@" + kOld), "https://huggingface.co/org/llama/resolve/" + kOld);
  EXPECT_EQ(url("hf://org/llama@" + kOld + "/sub/a b+c.safetensors"),
            "https://huggingface.co/org/llama/resolve/" + kOld + "/sub/a%20b%2Bc.safetensors");
  EXPECT_EQ(url("hf://datasets/org/data@" + kOld + "/x.safetensors"),
            "https://huggingface.co/datasets/org/data/resolve/" + kOld + "/x.safetensors");
  // Owner-less: one component, or the revision on the first.
  EXPECT_EQ(url("hf://gpt2@" + kOld), "https://huggingface.co/gpt2/resolve/" + kOld);
  EXPECT_EQ(url("hf://gpt2@" + kOld + "/model.safetensors"),
            "https://huggingface.co/gpt2/resolve/" + kOld + "/model.safetensors");
  {
    ScopedEnv custom("HF_ENDPOINT", "http://127.0.0.1:9/mirror//");
    EXPECT_EQ(HubEndpoint(), "http://127.0.0.1:9/mirror");
    EXPECT_EQ(url("hf://org/llama@" + kOld), "http://127.0.0.1:9/mirror/org/llama/resolve/" + kOld);
  }
  {
    ScopedEnv bad("HF_ENDPOINT", "ftp://mirror");
    const Status s = HubUrl("hf://org/llama@" + kOld, options).status();
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "HF_ENDPOINT \"ftp://mirror\"")) << s.ToString();
  }
  for (const char* bad : {"hf://org/llama/../x", "hf://org/llama@..%2Fx", "hf://org//x",
                          "hf://org/ll--ama", "s3://b/k"}) {
    EXPECT_EQ(HubUrl(bad, options).status().code(), Code::kInvalidArgument) << bad;
  }
}

TEST(HubRemote, OfflineAsHuggingfaceHubReadsIt) {
  ScopedEnv hub("HF_HUB_OFFLINE", std::nullopt);
  ScopedEnv transformers("TRANSFORMERS_OFFLINE", std::nullopt);
  EXPECT_FALSE(HubOffline());
  for (const char* yes : {"1", "on", "YES", "True"}) {
    ScopedEnv v("HF_HUB_OFFLINE", yes);
    EXPECT_TRUE(HubOffline()) << yes;
  }
  for (const char* no : {"0", "off", "", "2"}) {
    ScopedEnv v("HF_HUB_OFFLINE", no);
    EXPECT_FALSE(HubOffline()) << no;
  }
  ScopedEnv t("TRANSFORMERS_OFFLINE", "1");
  EXPECT_TRUE(HubOffline());
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

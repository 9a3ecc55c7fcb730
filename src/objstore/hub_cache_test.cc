// The hub cache's layout (hub_cache.h): resolve URLs read back as hub files, blob names, snapshot
// links and refs as huggingface_hub writes them.
#include "objstore/hub_cache.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "testing/test_util.h"

namespace tensorferry::objstore {
namespace {

namespace fs = std::filesystem;
using testing::ScopedEnv;

const std::string kCommit = "0123456789abcdef0123456789abcdef01234567";

TEST(HubFileOfUrl, ReadsRepositoryRevisionAndPath) {
  ScopedEnv endpoint("HF_ENDPOINT", "http://127.0.0.1:9/mirror/");
  const std::string base = "http://127.0.0.1:9/mirror/";
  std::optional<HubFile> f = HubFileOfUrl(base + "org/llama/resolve/" + kCommit + "/a%20b/x.json");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->folder, "models--org--llama");
  EXPECT_EQ(f->revision, kCommit);
  EXPECT_EQ(f->path, "a b/x.json");
  f = HubFileOfUrl(base + "datasets/org/data/resolve/refs%2Fpr%2F1/model.safetensors");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->folder, "datasets--org--data");
  EXPECT_EQ(f->revision, "refs/pr/1");
  f = HubFileOfUrl(base + "gpt2/resolve/main/model.safetensors");  // owner-less
  ASSERT_TRUE(f);
  EXPECT_EQ(f->folder, "models--gpt2");
  EXPECT_EQ(f->path, "model.safetensors");
  for (const std::string& bad : std::vector<std::string>{
           base + "api/models/org/llama/revision/main",               // the API
           base + "org/llama/resolve/main",                           // no PATH
           base + "org/llama/resolve/main/../../x",                   // leaves the snapshot
           base + "org/llama/resolve/main/a%2F..%2Fb",                // the same, encoded
           base + "org/llama/resolve/..%2F..%2Fx/model.safetensors",  // a revision that climbs
           base + "org/llama/resolve/main/a%zz",                      // a malformed escape
           base + "org/llama/resolve/main/a%00",                      // NUL
           base + "org/llama/resolve/main/a%0Ab",                     // a newline
           base + "org/llama/resolve/main/a b",                       // a raw space
           base + std::string("org/llama/resolve/main/a\0b", 26),     // a raw NUL
           base + "org/ll--ama/resolve/main/model.safetensors",       // not a repository id
           base + "org/llama/resolve/main/model.safetensors?x=1",     // a query
           std::string("http://127.0.0.1:9/org/llama/resolve/main/model.safetensors"),  // another
           std::string("https://huggingface.co/org/llama/resolve/main/model.safetensors"),
       }) {
    EXPECT_FALSE(HubFileOfUrl(bad)) << bad;
  }
  ScopedEnv none("HF_ENDPOINT", std::nullopt);
  EXPECT_TRUE(HubFileOfUrl("https://huggingface.co/org/llama/resolve/main/model.safetensors"));
}

TEST(HubBlobName, AsHuggingfaceHubNormalizesIt) {
  EXPECT_EQ(HubBlobName("\"abc123\"", "\"other\""), "abc123");  // X-Linked-Etag first
  EXPECT_EQ(HubBlobName("", "W/\"def\""), "def");
  EXPECT_EQ(HubBlobName("", "\"../../x\""), "");
  EXPECT_EQ(HubBlobName("", "\"a/b\""), "");
  EXPECT_EQ(HubBlobName("", "\"\""), "");
  EXPECT_EQ(HubBlobName("", "\".hidden\""), "");
}

TEST(HubCacheLayout, LinksAndRefsAreReplacedAtomically) {
  testing::TempDir tmp;
  const std::string root = tmp.Join("hub");
  ASSERT_TRUE(LinkHubSnapshot(root, "models--o--n", kCommit, "x/y.json", "b1").ok());
  const fs::path link = fs::path(root) / "models--o--n/snapshots" / kCommit / "x/y.json";
  EXPECT_EQ(fs::read_symlink(link), fs::path("../../../blobs/b1"));
  ASSERT_TRUE(LinkHubSnapshot(root, "models--o--n", kCommit, "x/y.json", "b2").ok());
  EXPECT_EQ(fs::read_symlink(link), fs::path("../../../blobs/b2"));
  ASSERT_TRUE(WriteHubRef(root, "models--o--n", "refs/pr/1", kCommit).ok());
  EXPECT_EQ(testing::ReadBytes(root + "/models--o--n/refs/refs/pr/1"), kCommit);
  ASSERT_TRUE(WriteHubRef(root, "models--o--n", "main", kCommit).ok());
  EXPECT_EQ(testing::ReadBytes(root + "/models--o--n/refs/main"), kCommit);
  EXPECT_EQ(WriteHubRef(root, "models--o--n", "../main", kCommit).code(), Code::kInvalidArgument);
  size_t leftovers = 0;  // nothing written aside is left
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    leftovers += e.path().filename().string().find(".tensorferry.") != std::string::npos;
  }
  EXPECT_EQ(leftovers, 0u);
  testing::WriteBytes(tmp.Join("file"), "x");
  const Status s = WriteHubRef(tmp.Join("file"), "models--o--n", "main", kCommit);
  EXPECT_EQ(s.code(), Code::kIoError);
  EXPECT_TRUE(testing::Contains(s.message(), tmp.Join("file") + "/models--o--n/refs/main"))
      << s.ToString();
}

}  // namespace
}  // namespace tensorferry::objstore

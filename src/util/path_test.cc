#include "util/path.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "testing/test_util.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;

TEST(PathSafety, NulBytesAreRefused) {
  EXPECT_TRUE(CheckPathString("a/b.safetensors").ok());
  const Status s = CheckPathString(std::string("a\0b", 3), "checkpoint path");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("checkpoint path"), std::string::npos) << s.ToString();
}

TEST(PathSafety, LexicalRule) {
  for (const char* ok : {"a.safetensors", "sub/a.safetensors", "./a", "a..b", "..a", "a/..b/c"}) {
    EXPECT_FALSE(RelativePathProblem(ok).has_value()) << ok;
  }
  EXPECT_EQ(RelativePathProblem("/etc/passwd"), "is an absolute path");
  EXPECT_EQ(RelativePathProblem("a\\b"), "contains a backslash");
  EXPECT_EQ(RelativePathProblem(std::string("a\0b", 3)), "contains a NUL byte");
  for (const char* escape : {"..", "../a", "a/../../b", "a/.."}) {
    ASSERT_TRUE(RelativePathProblem(escape).has_value()) << escape;
    EXPECT_NE(RelativePathProblem(escape)->find("\"..\""), std::string::npos) << escape;
  }
}

// A hub-cache repository: snapshots/<rev>/x -> ../../blobs/<sha> is inside; a symlink to
// another repository's blobs, or anywhere else, is not; without the snapshots/ layout blobs/ is
// nothing special.
TEST(PathSafety, SymlinksStayInsideOrInTheRepositorysBlobs) {
  testing::TempDir tmp;
  const fs::path root(tmp.path());
  const fs::path repo = root / "models--a--b";
  const fs::path snapshot = repo / "snapshots" / "rev1";
  fs::create_directories(snapshot);
  fs::create_directories(repo / "blobs");
  fs::create_directories(root / "models--c--d" / "blobs");
  testing::WriteBytes((repo / "blobs" / "sha").string(), "x");
  testing::WriteBytes((root / "models--c--d" / "blobs" / "sha").string(), "x");
  testing::WriteBytes((snapshot / "plain").string(), "x");
  testing::WriteBytes((root / "outside").string(), "x");
  fs::create_symlink("../../blobs/sha", snapshot / "hub");
  fs::create_symlink("../../../models--c--d/blobs/sha", snapshot / "other_repo");
  fs::create_symlink("../../../outside", snapshot / "outside");
  // Dangling symlinks are judged by where they point: outside, or into the blobs (a download
  // not finished: the open then says the file is missing).
  fs::create_symlink("../../../nothing_here", snapshot / "dangling_outside");
  fs::create_symlink("../../blobs/not_yet", snapshot / "dangling_blob");

  auto dir = CanonicalDirectory(snapshot, "index");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  EXPECT_TRUE(CheckContained(*dir, (snapshot / "plain").string(), "index", "file").ok());
  EXPECT_TRUE(CheckContained(*dir, (snapshot / "hub").string(), "index", "file").ok());
  EXPECT_TRUE(CheckContained(*dir, (snapshot / "dangling_blob").string(), "index", "file").ok());
  for (const char* name : {"other_repo", "outside", "dangling_outside"}) {
    const Status s = CheckContained(*dir, (snapshot / name).string(), "index", "file \"x\"");
    EXPECT_EQ(s.code(), Code::kIndexPathEscape) << name;
    EXPECT_NE(s.message().find("index: file \"x\" resolves to"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("outside the checkpoint directory"), std::string::npos);
  }
  const Status self = CheckContained(*dir, snapshot.string(), "index", "file");
  EXPECT_EQ(self.code(), Code::kIndexPathEscape);
  EXPECT_NE(self.message().find("itself"), std::string::npos) << self.ToString();

  // Not a snapshot directory: its blobs/ sibling is outside like anything else.
  fs::create_directories(repo / "notsnap" / "rev");
  fs::create_symlink("../../blobs/sha", repo / "notsnap" / "rev" / "hub");
  auto notsnap = CanonicalDirectory(repo / "notsnap" / "rev", "index");
  ASSERT_TRUE(notsnap.ok());
  EXPECT_EQ(
      CheckContained(*notsnap, (repo / "notsnap" / "rev" / "hub").string(), "index", "f").code(),
      Code::kIndexPathEscape);

  // A checkpoint in a subfolder of a snapshot (diffusers' transformer/, hf://OWNER/NAME/SUB):
  // its links reach the same blobs/ from deeper; another repository's stay outside.
  const fs::path sub = snapshot / "transformer" / "deeper";
  fs::create_directories(sub);
  fs::create_symlink("../../../../blobs/sha", sub / "hub");
  fs::create_symlink("../../../../../models--c--d/blobs/sha", sub / "other_repo");
  auto subdir = CanonicalDirectory(sub, "index");
  ASSERT_TRUE(subdir.ok());
  EXPECT_TRUE(CheckContained(*subdir, (sub / "hub").string(), "index", "file").ok());
  EXPECT_EQ(CheckContained(*subdir, (sub / "other_repo").string(), "index", "f").code(),
            Code::kIndexPathEscape);
}

// huggingface_hub's cache-wide store of Xet files: <repo>/blobs/<etag> links to
// <cache>/blobs/<2 hex>/<64 hex> in a store marked by .huggingface-shared-blobs. A snapshot's file
// reaching it is inside (it was refused: a model huggingface_hub downloaded could not be loaded);
// without the marker, under another name, or from a folder that is not a hub repository's, it is
// not.
TEST(PathSafety, TheHubsSharedStoreOfXetFilesIsInside) {
  testing::TempDir tmp;
  const fs::path cache(tmp.path());
  const std::string hash(64, 'a');
  const fs::path store = cache / "blobs" / "aa";
  fs::create_directories(store);
  testing::WriteBytes((store / hash).string(), "x");
  testing::WriteBytes((store / (hash + ".refs")).string(), "x");
  const auto link_all = [&](const fs::path& repo) {
    const fs::path snapshot = repo / "snapshots" / "rev1";
    fs::create_directories(snapshot);
    fs::create_directories(repo / "blobs");
    fs::create_symlink("../../blobs/aa/" + hash, repo / "blobs" / "etag");
    fs::create_symlink("../../blobs/aa/" + hash + ".refs", repo / "blobs" / "refs");
    fs::create_symlink("../../blobs/etag", snapshot / "model.safetensors");
    fs::create_symlink("../../blobs/refs", snapshot / "other.safetensors");
    return snapshot;
  };
  const fs::path snapshot = link_all(cache / "models--a--b");
  const fs::path not_hub = link_all(cache / "mine");
  auto dir = CanonicalDirectory(snapshot, "index");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  const std::string model = (snapshot / "model.safetensors").string();
  // No marker: not a store.
  EXPECT_EQ(CheckContained(*dir, model, "index", "file").code(), Code::kIndexPathEscape);
  testing::WriteBytes((cache / "blobs" / ".huggingface-shared-blobs").string(), "1\n");
  EXPECT_TRUE(CheckContained(*dir, model, "index", "file").ok());
  EXPECT_EQ(CheckContained(*dir, (snapshot / "other.safetensors").string(), "index", "file").code(),
            Code::kIndexPathEscape);
  auto mine = CanonicalDirectory(not_hub, "index");
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(CheckContained(*mine, (not_hub / "model.safetensors").string(), "index", "file").code(),
            Code::kIndexPathEscape);
}

// huggingface_hub before 0.23 downloaded with --local-dir as links into its cache: DIR/<file> ->
// <cache>/models--OWNER--NAME/blobs/<sha256>, or a git blob id (40 hex digits) for a small file.
// Such links leave DIR and are refused (accepting every hub blob would let an untrusted folder
// read any model of the machine's hub caches); the refusal says how to load the folder. Other
// links out are refused without that hint; a snapshot keeps its own rule (its repository's blobs
// only, not another repository's).
TEST(PathSafety, ALinkIntoAHubCachesBlobsFromElsewhereIsRefusedWithAHint) {
  testing::TempDir tmp;
  const fs::path root(tmp.path());
  const std::string sha256(64, 'e'), git(40, '0');
  const fs::path blobs = root / "hub" / "models--o--n" / "blobs";
  fs::create_directories(blobs);
  fs::create_directories(root / "hub" / "mine" / "blobs");
  for (const std::string& name : {sha256, git}) testing::WriteBytes((blobs / name).string(), "x");
  testing::WriteBytes((root / "hub" / "mine" / "blobs" / sha256).string(), "x");
  const fs::path local = root / "local";
  fs::create_directories(local);
  fs::create_symlink("../hub/models--o--n/blobs/" + sha256, local / "model.safetensors");
  fs::create_symlink(blobs / git, local / "model.safetensors.index.json");  // absolute
  fs::create_symlink("../hub/mine/blobs/" + sha256, local / "not_a_repo");
  auto dir = CanonicalDirectory(local, "index");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  for (const char* name : {"model.safetensors", "model.safetensors.index.json"}) {
    const Status s = CheckContained(*dir, (local / name).string(), "index", "file");
    EXPECT_EQ(s.code(), Code::kIndexPathEscape) << name;
    EXPECT_NE(s.message().find("outside the checkpoint directory"), std::string::npos);
    EXPECT_NE(s.message().find("huggingface_hub before 0.23"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("cp -rL"), std::string::npos) << s.message();
  }
  const Status other = CheckContained(*dir, (local / "not_a_repo").string(), "index", "file");
  EXPECT_EQ(other.code(), Code::kIndexPathEscape);
  EXPECT_EQ(other.message().find("huggingface_hub"), std::string::npos) << other.message();
  // A snapshot of another repository linking into these blobs: refused as before.
  const fs::path snapshot = root / "hub" / "models--x--y" / "snapshots" / "rev";
  fs::create_directories(snapshot);
  fs::create_symlink("../../../models--o--n/blobs/" + sha256, snapshot / "model.safetensors");
  auto snap = CanonicalDirectory(snapshot, "index");
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(CheckContained(*snap, (snapshot / "model.safetensors").string(), "index", "f").code(),
            Code::kIndexPathEscape);
}

// A link whose target climbs out of a directory symlink ("sub/../secret", "sub" a link to a
// directory elsewhere) points where the kernel goes: beside sub's target, outside, not at a
// "secret" beside the link. Read as text, it would look inside.
TEST(PathSafety, DotDotAfterADirectorySymlinkIsFollowedAsTheKernelDoes) {
  testing::TempDir tmp;
  const fs::path root(tmp.path());
  const fs::path ckpt = root / "ckpt";
  fs::create_directories(ckpt);
  fs::create_directories(root / "elsewhere" / "dir");
  testing::WriteBytes((root / "elsewhere" / "secret").string(), "outside");
  fs::create_symlink(root / "elsewhere" / "dir", ckpt / "sub");
  fs::create_symlink("sub/../secret", ckpt / "model.safetensors");
  ASSERT_EQ(testing::ReadBytes((ckpt / "model.safetensors").string()), "outside");
  // A file by that name inside does not change where the link leads.
  testing::WriteBytes((ckpt / "secret").string(), "inside");
  auto dir = CanonicalDirectory(ckpt, "index");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  const Status s =
      CheckContained(*dir, (ckpt / "model.safetensors").string(), "index", "file \"m\"");
  EXPECT_EQ(s.code(), Code::kIndexPathEscape) << s.ToString();
  EXPECT_NE(s.message().find("elsewhere/secret"), std::string::npos) << s.ToString();
  // The same shape kept inside is fine: a link through a directory link that stays in.
  fs::create_directories(ckpt / "a" / "b");
  testing::WriteBytes((ckpt / "a" / "x").string(), "x");
  fs::create_symlink(ckpt / "a" / "b", ckpt / "inner");
  fs::create_symlink("inner/../x", ckpt / "ok.safetensors");
  EXPECT_TRUE(CheckContained(*dir, (ckpt / "ok.safetensors").string(), "index", "f").ok());
}

// Checked by name, then opened by name: a link swapped in between is followed outside. Once the
// file is open, its descriptor must be the file the path resolves to inside.
TEST(PathSafety, TheOpenedFileMustBeTheOneThePathResolvesToInside) {
  testing::TempDir tmp;
  const fs::path root(tmp.path());
  const fs::path ckpt = root / "ckpt";
  fs::create_directories(ckpt);
  testing::WriteBytes((ckpt / "real").string(), "inside");
  testing::WriteBytes((root / "secret").string(), "outside");
  fs::create_symlink("real", ckpt / "model.safetensors");
  auto dir = CanonicalDirectory(ckpt, "index");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  const std::string link = (ckpt / "model.safetensors").string();

  const int inside = ::open((ckpt / "real").c_str(), O_RDONLY | O_CLOEXEC);
  const int outside = ::open((root / "secret").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(inside, 0);
  ASSERT_GE(outside, 0);
  EXPECT_TRUE(CheckOpenedContained(*dir, link, inside, "index", "file \"m\"").ok());
  EXPECT_TRUE(CheckOpenedContained(*dir, link, -1, "index", "file \"m\"").ok());
  // The open followed the link while it pointed outside; it points inside again at the check.
  const Status swapped = CheckOpenedContained(*dir, link, outside, "index", "file \"m\"");
  EXPECT_EQ(swapped.code(), Code::kIndexPathEscape) << swapped.ToString();
  EXPECT_TRUE(
      testing::Contains(swapped.message(), "index: file \"m\" was replaced while it was opened"));
  EXPECT_TRUE(testing::Contains(swapped.message(), (ckpt / "real").string()));
  // A name inside for the very file opened outside (a hard link: same device and inode): what
  // counts is where the open file lies, not what a name resolves to.
  fs::create_hard_link(root / "secret", ckpt / "secret-link");
  const Status linked =
      CheckOpenedContained(*dir, (ckpt / "secret-link").string(), outside, "index", "file \"m\"");
  EXPECT_EQ(linked.code(), Code::kIndexPathEscape) << linked.ToString();
  EXPECT_TRUE(testing::Contains(linked.message(), (root / "secret").string()));
  // The link points outside at the check: the name check's own error.
  fs::remove(ckpt / "model.safetensors");
  fs::create_symlink("../secret", ckpt / "model.safetensors");
  const Status out = CheckOpenedContained(*dir, link, outside, "index", "file \"m\"");
  EXPECT_EQ(out.code(), Code::kIndexPathEscape);
  EXPECT_TRUE(testing::Contains(out.message(), "outside the checkpoint directory"));
  ::close(inside);
  ::close(outside);
}

}  // namespace
}  // namespace tensorferry

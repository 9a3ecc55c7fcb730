#include "tensorferry/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "testing/test_util.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;
using testing::MakeFile;
using testing::MemoryEnv;
using testing::TempDir;
using testing::WriteBytes;

using ::tensorferry::testing::Contains;

size_t Count(const std::string& haystack, std::string_view needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size())) {
    ++n;
  }
  return n;
}

// The bytes of a safetensors file holding U8 tensors of the given sizes, tiled in the order given.
std::string Shard(const std::vector<std::pair<std::string, uint64_t>>& tensors) {
  std::string json = "{";
  uint64_t offset = 0;
  for (const auto& [name, size] : tensors) {
    if (json.size() > 1) json += ",";
    json += "\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(size) +
            "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + size) +
            "]}";
    offset += size;
  }
  json += "}";
  return MakeFile(json, offset);
}

std::string Index(const std::vector<std::pair<std::string, std::string>>& weight_map) {
  std::string json = "{\"metadata\":{\"total_size\":42},\"weight_map\":{";
  bool first = true;
  for (const auto& [tensor, file] : weight_map) {
    if (!first) json += ",";
    first = false;
    json += "\"" + tensor + "\":\"" + file + "\"";
  }
  return json + "}}";
}

using CheckpointPtr = std::shared_ptr<const Checkpoint>;

CheckpointPtr OpenOk(const std::string& path, const OpenOptions& options = {}) {
  auto r = Checkpoint::Open(path, options);
  EXPECT_TRUE(r.ok()) << path << ": " << r.status().ToString();
  return r.ok() ? *r : nullptr;
}

Status OpenError(const std::string& path, const OpenOptions& options = {}) {
  auto r = Checkpoint::Open(path, options);
  EXPECT_FALSE(r.ok()) << path;
  return r.status();
}

// A two-shard checkpoint in `dir`: a, b in shard 1; c in shard 2.
void WriteSharded(const TempDir& dir) {
  WriteBytes(dir.Join("model-00001-of-00002.safetensors"), Shard({{"b", 3}, {"a", 5}}));
  WriteBytes(dir.Join("model-00002-of-00002.safetensors"), Shard({{"c", 7}}));
  WriteBytes(dir.Join(std::string(kIndexFileName)),
             Index({{"a", "model-00001-of-00002.safetensors"},
                    {"b", "model-00001-of-00002.safetensors"},
                    {"c", "model-00002-of-00002.safetensors"}}));
}

TEST(CheckpointTest, SingleFile) {
  TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  WriteBytes(path, Shard({{"x", 4}, {"y", 0}, {"z", 2}}));
  CheckpointPtr cp = OpenOk(path);
  ASSERT_NE(cp, nullptr);
  ASSERT_EQ(cp->files().size(), 1u);
  const FileInfo& f = cp->files()[0];
  EXPECT_EQ(f.path, path);
  EXPECT_EQ(f.num_tensors, 3u);
  EXPECT_EQ(f.data_offset, 8 + f.header_size);
  EXPECT_EQ(f.file_size, fs::file_size(path));
  ASSERT_EQ(cp->tensors().size(), 3u);
  EXPECT_EQ(cp->tensors()[0].name, "x");
  EXPECT_EQ(cp->tensors()[0].offset, f.data_offset);
  EXPECT_EQ(cp->tensors()[0].size, 4u);
  EXPECT_EQ(cp->tensors()[0].dtype, DType::kU8);
  EXPECT_EQ(cp->tensors()[0].shape, std::vector<uint64_t>{4});
  EXPECT_EQ(cp->tensors()[2].name, "z");
  EXPECT_EQ(cp->tensors()[2].offset, f.data_offset + 4);
  EXPECT_EQ(cp->total_tensor_bytes(), 6u);
  EXPECT_TRUE(cp->index_path().empty());
  EXPECT_TRUE(cp->index_metadata().empty());
}

TEST(CheckpointTest, Find) {
  TempDir dir;
  WriteSharded(dir);
  CheckpointPtr cp = OpenOk(dir.path());
  ASSERT_NE(cp, nullptr);
  for (const char* name : {"a", "b", "c"}) {
    const TensorInfo* t = cp->Find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->name, name);
  }
  EXPECT_EQ(cp->Find("c")->file, 1u);
  EXPECT_EQ(cp->Find(""), nullptr);
  EXPECT_EQ(cp->Find("aa"), nullptr);
  EXPECT_EQ(cp->Find("d"), nullptr);
  EXPECT_EQ(cp->Find("0"), nullptr);
}

TEST(CheckpointTest, NotFound) {
  TempDir dir;
  Status s = OpenError(dir.Join("nope.safetensors"));
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_TRUE(Contains(s.message(), dir.Join("nope.safetensors")));
  EXPECT_EQ(OpenError(dir.Join("nope/model.safetensors")).code(), Code::kNotFound);
  EXPECT_EQ(OpenError(dir.Join("nope.json")).code(), Code::kNotFound);
}

// A URL of a scheme not read here is said to be one, not taken for a missing relative path.
TEST(CheckpointTest, AnUnreadUrlSchemeIsNamed) {
  for (const std::string url :
       {"file:///tmp/m.safetensors", "az://container/m", "ftp://h/m", "gcs://bucket/m"}) {
    const Status s = OpenError(url);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), url + ": not a URL tensorferry reads")) << s.ToString();
  }
  EXPECT_TRUE(Contains(OpenError("file:///tmp/m.safetensors").message(), "without \"file://\""));
  // A relative path that merely holds "://" later on stays a path.
  EXPECT_EQ(OpenError("dir/a://b.safetensors").code(), Code::kNotFound);
}

// A directory without an index: a FIFO or a link to a device named like a shard is refused,
// naming it, not left out of the checkpoint.
TEST(CheckpointTest, ASpecialFileNamedLikeAShardIsRefused) {
  for (const bool fifo : {true, false}) {
    TempDir dir;
    WriteBytes(dir.Join("a.safetensors"),
               MakeFile("{\"x\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4));
    const std::string odd = dir.Join("z.safetensors");
    if (fifo) {
      ASSERT_EQ(::mkfifo(odd.c_str(), 0600), 0) << std::strerror(errno);
    } else {
      std::filesystem::create_symlink("/dev/zero", odd);
    }
    const Status s = OpenError(dir.path());
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), odd + ": " + (fifo ? "a FIFO" : "a character device")))
        << s.ToString();
  }
}

TEST(CheckpointTest, ShardedDirectory) {
  TempDir dir;
  WriteSharded(dir);
  for (const std::string& path : {dir.path(), dir.Join(std::string(kIndexFileName))}) {
    CheckpointPtr cp = OpenOk(path);
    ASSERT_NE(cp, nullptr);
    EXPECT_EQ(cp->index_path(), dir.Join(std::string(kIndexFileName)));
    ASSERT_EQ(cp->index_metadata().size(), 1u);
    EXPECT_EQ(cp->index_metadata()[0].first, "total_size");
    EXPECT_EQ(cp->index_metadata()[0].second, "42");
    ASSERT_EQ(cp->files().size(), 2u);
    EXPECT_EQ(cp->files()[0].path, dir.Join("model-00001-of-00002.safetensors"));
    EXPECT_EQ(cp->files()[1].path, dir.Join("model-00002-of-00002.safetensors"));
    // (file, offset) order: b then a (file order), then c.
    ASSERT_EQ(cp->tensors().size(), 3u);
    EXPECT_EQ(cp->tensors()[0].name, "b");
    EXPECT_EQ(cp->tensors()[1].name, "a");
    EXPECT_EQ(cp->tensors()[1].offset, cp->files()[0].data_offset + 3);
    EXPECT_EQ(cp->tensors()[2].name, "c");
    EXPECT_EQ(cp->tensors()[2].file, 1u);
    EXPECT_EQ(cp->tensors()[2].offset, cp->files()[1].data_offset);
    EXPECT_EQ(cp->total_tensor_bytes(), 15u);
  }
}

TEST(CheckpointTest, IndexInSubdirectoryAndDotPaths) {
  TempDir dir;
  fs::create_directory(dir.Join("sub"));
  WriteBytes(dir.Join("sub/model.safetensors"), Shard({{"a", 1}, {"b", 1}}));
  WriteBytes(dir.Join(std::string(kIndexFileName)),
             Index({{"a", "sub/model.safetensors"}, {"b", "./sub//model.safetensors"}}));
  CheckpointPtr cp = OpenOk(dir.path());
  ASSERT_NE(cp, nullptr);
  ASSERT_EQ(cp->files().size(), 1u);  // "./sub//x" and "sub/x" are one file
  EXPECT_EQ(cp->files()[0].path, dir.Join("sub/model.safetensors"));
  EXPECT_EQ(cp->tensors().size(), 2u);
}

TEST(CheckpointTest, IndexErrorsArePrefixedWithTheIndexPath) {
  TempDir dir;
  const std::string index = dir.Join(std::string(kIndexFileName));
  WriteBytes(index, "{\"weight_map\": [}");
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexInvalidJson);
  EXPECT_EQ(s.message().rfind(index + ": ", 0), 0u) << s.message();
  EXPECT_EQ(Count(s.message(), index), 1u) << s.message();

  WriteBytes(index, "{\"metadata\": {}}");
  EXPECT_EQ(OpenError(index).code(), Code::kIndexNoWeightMap);

  WriteBytes(index, Index({{"a", ""}}));
  EXPECT_EQ(OpenError(index).code(), Code::kIndexBadEntry);

  WriteBytes(index, "{\"weight_map\":{\"a\":\"x\",\"a\":\"x\"}}");
  EXPECT_EQ(OpenError(index).code(), Code::kDuplicateKey);

  WriteBytes(index, Index({{"a", "model.safetensors"}}));
  OpenOptions options;
  options.index_limits.max_index_size = 16;
  s = OpenError(index, options);
  EXPECT_EQ(s.code(), Code::kIndexTooLarge);
  EXPECT_TRUE(Contains(s.message(), index));
}

TEST(CheckpointTest, MissingFile) {
  TempDir dir;
  WriteSharded(dir);
  fs::remove(dir.Join("model-00002-of-00002.safetensors"));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexMissingFile);
  EXPECT_TRUE(Contains(s.message(), "\"model-00002-of-00002.safetensors\""));
  EXPECT_TRUE(Contains(s.message(), "tensor \"c\""));
}

TEST(CheckpointTest, MissingTensor) {
  TempDir dir;
  WriteSharded(dir);
  WriteBytes(dir.Join(std::string(kIndexFileName)),
             Index({{"a", "model-00001-of-00002.safetensors"},
                    {"b", "model-00001-of-00002.safetensors"},
                    {"c", "model-00002-of-00002.safetensors"},
                    {"d", "model-00002-of-00002.safetensors"}}));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexMissingTensor);
  EXPECT_TRUE(Contains(s.message(), "tensor \"d\""));
  EXPECT_TRUE(Contains(s.message(), "model-00002-of-00002.safetensors"));

  // Listed for the wrong file.
  WriteBytes(dir.Join(std::string(kIndexFileName)),
             Index({{"a", "model-00002-of-00002.safetensors"},
                    {"b", "model-00001-of-00002.safetensors"},
                    {"c", "model-00002-of-00002.safetensors"}}));
  s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexMissingTensor);
  EXPECT_TRUE(Contains(s.message(), "tensor \"a\""));
  EXPECT_TRUE(Contains(s.message(), "(it is in"));
}

TEST(CheckpointTest, UnlistedTensor) {
  TempDir dir;
  WriteSharded(dir);
  WriteBytes(dir.Join(std::string(kIndexFileName)),
             Index({{"a", "model-00001-of-00002.safetensors"},
                    {"c", "model-00002-of-00002.safetensors"}}));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexUnlistedTensor);
  EXPECT_TRUE(Contains(s.message(), "tensor \"b\""));
  EXPECT_TRUE(Contains(s.message(), dir.Join("model-00001-of-00002.safetensors")));
}

TEST(CheckpointTest, DuplicateTensorWithIndex) {
  TempDir dir;
  WriteSharded(dir);
  WriteBytes(dir.Join("model-00002-of-00002.safetensors"), Shard({{"c", 7}, {"a", 1}}));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexDuplicateTensor);
  EXPECT_TRUE(Contains(s.message(), "tensor \"a\""));
  EXPECT_TRUE(Contains(s.message(), dir.Join("model-00001-of-00002.safetensors")));
  EXPECT_TRUE(Contains(s.message(), dir.Join("model-00002-of-00002.safetensors")));
}

TEST(CheckpointTest, DirectoryWithoutIndex) {
  TempDir dir;
  WriteBytes(dir.Join("b.safetensors"), Shard({{"y", 2}}));
  WriteBytes(dir.Join("a.safetensors"), Shard({{"x", 1}, {"w", 3}}));
  WriteBytes(dir.Join("notes.txt"), "ignored");
  WriteBytes(dir.Join("c.safetensors.bak"), "ignored");
  fs::create_directory(dir.Join("nested.safetensors"));  // a directory: ignored
  fs::create_directory(dir.Join("deeper"));
  WriteBytes(dir.Join("deeper/d.safetensors"), Shard({{"z", 1}}));  // not directly inside
  CheckpointPtr cp = OpenOk(dir.path());
  ASSERT_NE(cp, nullptr);
  ASSERT_EQ(cp->files().size(), 2u);
  EXPECT_EQ(cp->files()[0].path, dir.Join("a.safetensors"));
  EXPECT_EQ(cp->files()[1].path, dir.Join("b.safetensors"));
  ASSERT_EQ(cp->tensors().size(), 3u);
  EXPECT_EQ(cp->tensors()[0].name, "x");
  EXPECT_EQ(cp->tensors()[1].name, "w");
  EXPECT_EQ(cp->tensors()[2].name, "y");
  EXPECT_EQ(cp->tensors()[2].file, 1u);
  EXPECT_EQ(cp->Find("z"), nullptr);
  EXPECT_TRUE(cp->index_path().empty());
}

TEST(CheckpointTest, DirectoryWithoutIndexDuplicate) {
  TempDir dir;
  WriteBytes(dir.Join("a.safetensors"), Shard({{"x", 1}}));
  WriteBytes(dir.Join("b.safetensors"), Shard({{"x", 1}}));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIndexDuplicateTensor);
  EXPECT_TRUE(Contains(s.message(), dir.Join("a.safetensors")));
  EXPECT_TRUE(Contains(s.message(), dir.Join("b.safetensors")));
}

// Without an index, a listed directory's numbered shards must all be there (shard_series.h).
TEST(CheckpointTest, DirectoryWithoutIndexMissingShard) {
  TempDir dir;
  WriteBytes(dir.Join("model-00001-of-00003.safetensors"), Shard({{"a", 1}}));
  WriteBytes(dir.Join("model-00003-of-00003.safetensors"), Shard({{"c", 1}}));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_EQ(s.category(), Category::kCorrupt);
  EXPECT_EQ(s.message(), dir.path() +
                             ": incomplete checkpoint: 1 of the 3 shards "
                             "\"model-*-of-00003.safetensors\" is missing: "
                             "\"model-00002-of-00003.safetensors\"");
  // The files given one by one are what the caller asked for: no series rule.
  const std::vector<std::string> files = {dir.Join("model-00001-of-00003.safetensors")};
  auto r = Checkpoint::OpenFiles(files);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->tensors().size(), 1u);
  // With the index, the index decides (and names the missing file itself).
  WriteBytes(dir.Join(std::string(kIndexFileName)),
             Index({{"a", "model-00001-of-00003.safetensors"},
                    {"b", "model-00002-of-00003.safetensors"},
                    {"c", "model-00003-of-00003.safetensors"}}));
  EXPECT_EQ(OpenError(dir.path()).code(), Code::kIndexMissingFile);
}

// A *.safetensors entry that is a link to nothing (a hub snapshot whose blob is gone) is a
// missing file, not one to skip.
TEST(CheckpointTest, DirectoryWithoutIndexDanglingLink) {
  TempDir dir;
  WriteBytes(dir.Join("a.safetensors"), Shard({{"a", 1}}));
  fs::create_symlink(dir.Join("blobs/gone"), dir.Join("b.safetensors"));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete);
  EXPECT_EQ(s.message(), dir.Join("b.safetensors") + ": a symbolic link to \"" +
                             dir.Join("blobs/gone") +
                             "\", which does not exist (an incomplete download or copy?)");
  // A link that cannot be resolved at all is an I/O error naming it.
  fs::remove(dir.Join("b.safetensors"));
  fs::create_symlink("loop.safetensors", dir.Join("loop.safetensors"));
  s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kIoError);
  EXPECT_TRUE(Contains(s.message(), dir.Join("loop.safetensors") + ": cannot stat: "))
      << s.message();
}

// An index that is a link to nothing is missing, not absent: the folder's other files are not
// opened in its place (they may be more, or other, files than it selects).
TEST(CheckpointTest, DanglingIndexLinkIsIncomplete) {
  TempDir dir;
  WriteBytes(dir.Join("model.safetensors"), Shard({{"a", 1}}));
  WriteBytes(dir.Join("consolidated.safetensors"), Shard({{"b", 1}}));
  fs::create_symlink(dir.Join("blobs/gone"), dir.Join(std::string(kIndexFileName)));
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kCheckpointIncomplete) << s.ToString();
  EXPECT_EQ(s.message(), dir.Join(std::string(kIndexFileName)) + ": a symbolic link to \"" +
                             dir.Join("blobs/gone") +
                             "\", which does not exist (an incomplete download or copy?)");
}

TEST(CheckpointTest, EmptyDirectory) {
  TempDir dir;
  WriteBytes(dir.Join("readme.md"), "x");
  Status s = OpenError(dir.path());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "no .safetensors files"));
}

TEST(CheckpointTest, OpenFiles) {
  TempDir dir;
  WriteBytes(dir.Join("b.safetensors"), Shard({{"y", 2}}));
  WriteBytes(dir.Join("a.safetensors"), Shard({{"x", 1}}));
  WriteBytes(dir.Join("c.safetensors"), Shard({{"x", 1}}));
  std::vector<std::string> paths{dir.Join("b.safetensors"), dir.Join("a.safetensors")};
  auto r = Checkpoint::OpenFiles(paths);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ((*r)->files().size(), 2u);
  EXPECT_EQ((*r)->files()[0].path, dir.Join("a.safetensors"));  // sorted by path
  EXPECT_NE((*r)->Find("y"), nullptr);

  paths.push_back(dir.Join("c.safetensors"));
  r = Checkpoint::OpenFiles(paths);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kIndexDuplicateTensor);
  EXPECT_TRUE(Contains(r.status().message(), dir.Join("a.safetensors")));
  EXPECT_TRUE(Contains(r.status().message(), dir.Join("c.safetensors")));

  paths = {dir.Join("a.safetensors"), dir.Join("a.safetensors")};
  EXPECT_EQ(Checkpoint::OpenFiles(paths).status().code(), Code::kInvalidArgument);
  // One file under two spellings: given twice, not two files holding the same tensors.
  paths = {dir.Join("a.safetensors"), dir.path() + "/./a.safetensors"};
  r = Checkpoint::OpenFiles(paths);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
  EXPECT_TRUE(Contains(r.status().message(), "given more than once")) << r.status().ToString();
  EXPECT_EQ(Checkpoint::OpenFiles({}).status().code(), Code::kInvalidArgument);
  paths = {dir.Join("missing.safetensors")};
  EXPECT_EQ(Checkpoint::OpenFiles(paths).status().code(), Code::kNotFound);
}

TEST(CheckpointTest, HeaderErrorsKeepCodeAndOnePrefix) {
  TempDir dir;
  const std::string path = dir.Join("bad.safetensors");
  WriteBytes(path, MakeFile("{\"x\":{\"dtype\":\"Q8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1));
  Status s = OpenError(path);
  EXPECT_EQ(s.code(), Code::kUnknownDtype);
  EXPECT_EQ(s.message().rfind(path, 0), 0u) << s.message();
  EXPECT_EQ(Count(s.message(), path), 1u) << s.message();

  WriteBytes(path, "abc");
  EXPECT_EQ(OpenError(path).code(), Code::kFileTooSmall);
  // A length prefix larger than the file.
  std::string bytes = MakeFile("{}", 0);
  bytes[0] = 100;
  WriteBytes(path, bytes);
  EXPECT_EQ(OpenError(path).code(), Code::kHeaderOutOfBounds);
  // Data shorter than the tensors.
  WriteBytes(path, MakeFile("{\"x\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 2));
  EXPECT_EQ(OpenError(path).code(), Code::kDataTruncated);

  // The same through a shard of an index.
  WriteBytes(dir.Join(std::string(kIndexFileName)), Index({{"x", "bad.safetensors"}}));
  EXPECT_EQ(OpenError(dir.path()).code(), Code::kDataTruncated);
}

// --- path traversal --------------------------------------------------------------------------

class CheckpointTraversalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // root/ holds the checkpoint directory and, beside it, files it must not reach.
    fs::create_directory(root_.Join("ckpt"));
    fs::create_directory(root_.Join("outside"));
    WriteBytes(root_.Join("outside/x.safetensors"), Shard({{"t", 1}}));
    WriteBytes(root_.Join("x.safetensors"), Shard({{"t", 1}}));
  }
  std::string Dir() const { return root_.Join("ckpt"); }
  Status OpenWithFile(const std::string& file) {
    WriteBytes(Dir() + "/" + std::string(kIndexFileName), Index({{"t", file}}));
    return OpenError(Dir());
  }
  TempDir root_;
};

TEST_F(CheckpointTraversalTest, Lexical) {
  for (const std::string& file :
       {std::string("../x.safetensors"), std::string("a/../../x.safetensors"),
        std::string("../outside/x.safetensors"), root_.Join("x.safetensors")}) {
    Status s = OpenWithFile(file);
    EXPECT_EQ(s.code(), Code::kIndexPathEscape) << file << ": " << s.ToString();
  }
}

TEST_F(CheckpointTraversalTest, SymlinkToFileOutside) {
  fs::create_symlink(root_.Join("x.safetensors"), Dir() + "/link.safetensors");
  Status s = OpenWithFile("link.safetensors");
  EXPECT_EQ(s.code(), Code::kIndexPathEscape) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "\"link.safetensors\""));
  // A relative symlink too.
  fs::create_symlink("../outside/x.safetensors", Dir() + "/rel.safetensors");
  EXPECT_EQ(OpenWithFile("rel.safetensors").code(), Code::kIndexPathEscape);
}

TEST_F(CheckpointTraversalTest, SymlinkToDirectoryOutside) {
  fs::create_directory_symlink(root_.Join("outside"), Dir() + "/sub");
  Status s = OpenWithFile("sub/x.safetensors");
  EXPECT_EQ(s.code(), Code::kIndexPathEscape) << s.ToString();
}

TEST_F(CheckpointTraversalTest, SymlinkInsideAccepted) {
  fs::create_directory(Dir() + "/real");
  WriteBytes(Dir() + "/real/model.safetensors", Shard({{"t", 1}}));
  fs::create_symlink("real/model.safetensors", Dir() + "/link.safetensors");
  WriteBytes(Dir() + "/" + std::string(kIndexFileName), Index({{"t", "link.safetensors"}}));
  CheckpointPtr cp = OpenOk(Dir());
  ASSERT_NE(cp, nullptr);
  EXPECT_EQ(cp->files()[0].path, Dir() + "/link.safetensors");
}

// The link is checked, then swapped to a file outside just for the open, then back: the name
// check alone passes both times; the check of what was opened refuses it, for an index and for
// a directory listed without one.
TEST_F(CheckpointTraversalTest, LinkSwappedBetweenTheCheckAndTheOpen) {
  class SwappingSource : public Source {
   public:
    SwappingSource(std::string link, std::string inside, std::string outside)
        : link_(std::move(link)), inside_(std::move(inside)), outside_(std::move(outside)) {}
    Result<std::unique_ptr<SourceFile>> Open(const std::string& path,
                                             const FileIdentity* expected) override {
      if (path != link_) return env_->Open(path, expected);
      Point(outside_);
      auto opened = env_->Open(path, expected);
      Point(inside_);
      ++swaps;
      return opened;
    }
    int swaps = 0;

   private:
    void Point(const std::string& target) {
      fs::remove(link_);
      fs::create_symlink(target, link_);
    }
    std::string link_, inside_, outside_;
    std::unique_ptr<Source> env_ = MakeEnvSource();
  };
  fs::create_directory(Dir() + "/real");
  WriteBytes(Dir() + "/real/model.safetensors", Shard({{"t", 1}}));
  const std::string link = Dir() + "/link.safetensors";
  fs::create_symlink("real/model.safetensors", link);
  auto source =
      std::make_shared<SwappingSource>(link, "real/model.safetensors", "../outside/x.safetensors");
  OpenOptions options;
  options.source = source;
  WriteBytes(Dir() + "/" + std::string(kIndexFileName), Index({{"t", "link.safetensors"}}));
  Status s = OpenError(Dir(), options);
  EXPECT_EQ(source->swaps, 1);
  EXPECT_EQ(s.code(), Code::kIndexPathEscape) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "\"link.safetensors\" was replaced while it was opened"))
      << s.ToString();
  // The same directory without its index: the listed files are checked the same way.
  fs::remove(Dir() + "/" + std::string(kIndexFileName));
  s = OpenError(Dir(), options);
  EXPECT_EQ(source->swaps, 2);
  EXPECT_EQ(s.code(), Code::kIndexPathEscape) << s.ToString();
  // Unswapped, the same checkpoint opens.
  EXPECT_NE(OpenOk(Dir()), nullptr);
}

TEST_F(CheckpointTraversalTest, HuggingFaceHubCacheLayout) {
  // <repo>/snapshots/<rev>/model.safetensors -> ../../blobs/<hash>: accepted.
  const std::string repo = root_.Join("models--org--name");
  fs::create_directories(repo + "/blobs");
  fs::create_directories(repo + "/snapshots/abc123");
  WriteBytes(repo + "/blobs/0123abcd", Shard({{"t", 1}}));
  const std::string snap = repo + "/snapshots/abc123";
  fs::create_symlink("../../blobs/0123abcd", snap + "/model.safetensors");
  WriteBytes(snap + "/" + std::string(kIndexFileName), Index({{"t", "model.safetensors"}}));
  EXPECT_NE(OpenOk(snap), nullptr);
  // Anything else outside the snapshot is still refused: another repository's blobs...
  fs::create_directories(root_.Join("models--other/blobs"));
  WriteBytes(root_.Join("models--other/blobs/ff"), Shard({{"t", 1}}));
  fs::remove(snap + "/model.safetensors");
  fs::create_symlink("../../../models--other/blobs/ff", snap + "/model.safetensors");
  EXPECT_EQ(OpenError(snap).code(), Code::kIndexPathEscape);
  // ...and blobs/ of a directory not named snapshots/.
  const std::string other = root_.Join("r2");
  fs::create_directories(other + "/blobs");
  fs::create_directories(other + "/revs/x");
  WriteBytes(other + "/blobs/aa", Shard({{"t", 1}}));
  fs::create_symlink("../../blobs/aa", other + "/revs/x/model.safetensors");
  WriteBytes(other + "/revs/x/" + std::string(kIndexFileName), Index({{"t", "model.safetensors"}}));
  EXPECT_EQ(OpenError(other + "/revs/x").code(), Code::kIndexPathEscape);
}

TEST_F(CheckpointTraversalTest, LegitSubdirectory) {
  fs::create_directory(Dir() + "/sub");
  WriteBytes(Dir() + "/sub/model.safetensors", Shard({{"t", 1}}));
  WriteBytes(Dir() + "/" + std::string(kIndexFileName), Index({{"t", "sub/model.safetensors"}}));
  EXPECT_NE(OpenOk(Dir()), nullptr);
  // The checkpoint directory itself reached through a symlink is fine.
  fs::create_directory_symlink(Dir(), root_.Join("alias"));
  EXPECT_NE(OpenOk(root_.Join("alias")), nullptr);
}

TEST_F(CheckpointTraversalTest, IndexOpenedByRelativePath) {
  fs::create_directory(Dir() + "/sub");
  WriteBytes(Dir() + "/sub/model.safetensors", Shard({{"t", 1}}));
  WriteBytes(Dir() + "/" + std::string(kIndexFileName), Index({{"t", "sub/model.safetensors"}}));
  const fs::path cwd = fs::current_path();
  fs::current_path(Dir());
  const fs::path here = fs::current_path();  // Dir(), its symbolic links resolved
  auto r = Checkpoint::Open(std::string(kIndexFileName));
  fs::current_path(cwd);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // Made absolute when opened: a later chdir does not redirect the file's path.
  EXPECT_EQ((*r)->files()[0].path, (here / "sub/model.safetensors").string());
}

// ".//x" is "./x": the slashes after "./" do not make the rest absolute (a shell's "$DIR/x" with
// DIR=./ opened /x instead).
TEST_F(CheckpointTraversalTest, DotSlashSlashStaysRelative) {
  const fs::path cwd = fs::current_path();
  fs::current_path(Dir());
  const fs::path here = fs::current_path();
  EXPECT_EQ(AnchoredPath(".//x.safetensors"), (here / "x.safetensors").string());
  EXPECT_EQ(AnchoredPath(".///.//x.safetensors"), (here / "x.safetensors").string());
  EXPECT_EQ(AnchoredPath(".//tmp/x"), (here / "tmp/x").string());
  EXPECT_EQ(AnchoredPath("./x"), (here / "x").string());
  fs::current_path(cwd);
  EXPECT_EQ(AnchoredPath("/tmp/x"), "/tmp/x");
}

TEST_F(CheckpointTraversalTest, MissingShardOfIndexOpenedByBareRelativeName) {
  WriteBytes(Dir() + "/" + std::string(kIndexFileName), Index({{"t", "gone.safetensors"}}));
  const fs::path cwd = fs::current_path();
  fs::current_path(Dir());
  auto r = Checkpoint::Open(std::string(kIndexFileName));
  fs::current_path(cwd);
  EXPECT_EQ(r.status().code(), Code::kIndexMissingFile) << r.status().ToString();
}

// --- fault injection through MemoryEnv -----------------------------------------------------------

TEST(CheckpointEnvTest, ShortReadsStillParse) {
  MemoryEnv env;
  env.AddFile("/m/model.safetensors", Shard({{"a", 3}, {"b", 4}}));
  env.SetFaults("/m/model.safetensors", {.max_read = 1});
  OpenOptions options;
  options.env = &env;
  CheckpointPtr cp = OpenOk("/m/model.safetensors", options);
  ASSERT_NE(cp, nullptr);
  EXPECT_EQ(cp->tensors().size(), 2u);
  EXPECT_GT(env.reads("/m/model.safetensors"), 8u);
}

TEST(CheckpointEnvTest, EioNamesThePath) {
  MemoryEnv env;
  env.AddFile("/m/model.safetensors", Shard({{"a", 3}}));
  env.SetFaults("/m/model.safetensors", {.eio_at = 12});
  OpenOptions options;
  options.env = &env;
  Status s = OpenError("/m/model.safetensors", options);
  EXPECT_EQ(s.code(), Code::kIoError);
  EXPECT_TRUE(Contains(s.message(), "/m/model.safetensors"));
}

TEST(CheckpointEnvTest, FileShorterThanItsHeader) {
  MemoryEnv env;
  std::string bytes = Shard({{"a", 3}});
  env.AddFile("/m/cut.safetensors", bytes.substr(0, 20));
  env.AddFile("/m/tiny.safetensors", bytes.substr(0, 5));
  // Shrinks between the size query and the header read.
  env.AddFile("/m/shrinks.safetensors", bytes);
  env.SetFaults("/m/shrinks.safetensors", {.truncate_after_reads = 1, .truncate_to = 12});
  OpenOptions options;
  options.env = &env;
  EXPECT_EQ(OpenError("/m/cut.safetensors", options).code(), Code::kHeaderOutOfBounds);
  EXPECT_EQ(OpenError("/m/tiny.safetensors", options).code(), Code::kFileTooSmall);
  Status s = OpenError("/m/shrinks.safetensors", options);
  EXPECT_EQ(s.code(), Code::kUnexpectedEof) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "/m/shrinks.safetensors"));
}

TEST(CheckpointEnvTest, ShardedThroughEnv) {
  MemoryEnv env;
  env.AddFile("/m/model.safetensors.index.json",
              Index({{"a", "s1.safetensors"}, {"b", "sub/s2.safetensors"}}));
  env.AddFile("/m/s1.safetensors", Shard({{"a", 2}}));
  env.AddFile("/m/sub/s2.safetensors", Shard({{"b", 2}}));
  env.SetFaults("/m/sub/s2.safetensors", {.max_read = 1});
  OpenOptions options;
  options.env = &env;
  // A directory path the Env resolves to its index.
  CheckpointPtr cp = OpenOk("/m", options);
  ASSERT_NE(cp, nullptr);
  EXPECT_EQ(cp->index_path(), "/m/model.safetensors.index.json");
  ASSERT_EQ(cp->files().size(), 2u);
  EXPECT_EQ(cp->files()[1].path, "/m/sub/s2.safetensors");
  EXPECT_EQ(cp->Find("b")->file, 1u);

  // Lexical escape checks apply with a custom Env too.
  env.AddFile("/m/model.safetensors.index.json", Index({{"a", "../s1.safetensors"}}));
  EXPECT_EQ(OpenError("/m", options).code(), Code::kIndexPathEscape);
  // A missing shard.
  env.AddFile("/m/model.safetensors.index.json", Index({{"a", "s3.safetensors"}}));
  EXPECT_EQ(OpenError("/m/model.safetensors.index.json", options).code(), Code::kIndexMissingFile);
  // EIO in the index itself.
  env.AddFile("/m/model.safetensors.index.json", Index({{"a", "s1.safetensors"}}));
  env.SetFaults("/m/model.safetensors.index.json", {.eio_at = 3});
  Status s = OpenError("/m", options);
  EXPECT_EQ(s.code(), Code::kIoError);
  EXPECT_TRUE(Contains(s.message(), "/m/model.safetensors.index.json"));
  // Nothing there at all.
  EXPECT_EQ(OpenError("/nothing", options).code(), Code::kNotFound);
}

TEST(CheckpointEnvTest, ReadHeaderDirect) {
  MemoryEnv env;
  env.AddFile("f", Shard({{"a", 3}}));
  env.SetFaults("f", {.max_read = 1});
  auto file = env.OpenRandomAccess("f");
  ASSERT_TRUE(file.ok());
  auto h = ReadHeader(**file);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->tensors.size(), 1u);
  EXPECT_EQ(h->data_size, 3u);
}

}  // namespace
}  // namespace tensorferry

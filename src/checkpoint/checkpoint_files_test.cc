// The files a Checkpoint owns (checkpoint.h, "Files" and "Files that change"): each is opened
// once per checkpoint whatever the number of loads and loaders, a file opened again must be the
// same file, and a same-size replacement after Open is reported at the next load, for a single
// file, a directory and an index checkpoint.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "io/file_set.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/loader.h"
#include "tensorferry/source.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;
using testing::MakeFile;
using testing::TempDir;
using testing::WriteBytes;

// Env::Default() counting OpenRandomAccess per path.
class CountingEnv : public Env {
 public:
  Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++opens_[path];
    }
    return Env::Default()->OpenRandomAccess(path);
  }
  uint64_t opens(const std::string& path) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = opens_.find(path);
    return it == opens_.end() ? 0 : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> opens_;
};

// A shard holding U8 tensors "<prefix>0".."<prefix>3" of 4096 bytes each, every byte `fill`.
std::string Shard(const std::string& prefix, char fill) {
  std::string json = "{";
  for (int i = 0; i < 4; ++i) {
    if (i > 0) json += ",";
    json += "\"" + prefix + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[4096]," +
            "\"data_offsets\":[" + std::to_string(i * 4096) + "," +
            std::to_string(i * 4096 + 4096) + "]}";
  }
  std::string bytes = MakeFile(json + "}", 4 * 4096);
  const size_t data = bytes.size() - 4 * 4096;
  for (size_t i = data; i < bytes.size(); ++i) bytes[i] = fill;
  return bytes;
}

enum class Layout { kFile, kDirectory, kIndex };

// Writes a checkpoint of `layout` into `dir`: its path, and the paths of its shards.
std::string WriteCheckpoint(const TempDir& dir, Layout layout, std::vector<std::string>* shards) {
  const int n = layout == Layout::kFile ? 1 : 3;
  std::string weight_map;
  for (int s = 0; s < n; ++s) {
    const std::string name =
        std::string("model-0000").append(std::to_string(s)).append(".safetensors");
    const std::string prefix = std::string("s").append(std::to_string(s)).append(".t");
    WriteBytes(dir.Join(name), Shard(prefix, static_cast<char>('a' + s)));
    shards->push_back(dir.Join(name));
    for (int i = 0; i < 4; ++i) {
      if (!weight_map.empty()) weight_map += ",";
      weight_map += "\"" + prefix + std::to_string(i) + "\":\"" + name + "\"";
    }
  }
  if (layout == Layout::kFile) return shards->front();
  if (layout == Layout::kIndex) {
    WriteBytes(dir.Join(std::string(kIndexFileName)), "{\"weight_map\":{" + weight_map + "}}");
  }
  return dir.path();
}

Status LoadAll(const std::shared_ptr<const Checkpoint>& checkpoint, Engine engine) {
  LoadOptions options;
  options.engine = engine;
  Result<std::unique_ptr<Loader>> loader = Loader::Open(checkpoint, options);
  if (!loader.ok()) return loader.status();
  return (*loader)->Load().status();
}

TEST(CheckpointFiles, EachFileIsOpenedOncePerCheckpoint) {
  TempDir dir;
  std::vector<std::string> shards;
  const std::string path = WriteCheckpoint(dir, Layout::kIndex, &shards);
  CountingEnv env;
  OpenOptions open;
  open.env = &env;
  auto checkpoint = Checkpoint::Open(path, open);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();

  // Several loaders (every engine), each loading, streaming and loading into memory twice.
  for (Engine engine : {Engine::kPread, Engine::kIoUring, Engine::kMmap, Engine::kAuto}) {
    LoadOptions options;
    options.engine = engine;
    options.env = &env;
    auto loader = Loader::Open(*checkpoint, options);
    if (!loader.ok() && loader.status().code() == Code::kUnsupported) continue;  // no io_uring
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    for (int round = 0; round < 2; ++round) {
      auto tensors = (*loader)->Load();
      ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
      EXPECT_EQ(tensors->size(), 12u);
      size_t streamed = 0;
      ASSERT_TRUE((*loader)
                      ->Stream(Selection::All(),
                               [&](Batch b) {
                                 streamed += b.tensors.size();
                                 return Status::Ok();
                               })
                      .ok());
      EXPECT_EQ(streamed, 12u);
      std::vector<std::byte> memory(4096);
      const Destination into{"s2.t3", Device::CPU(), memory.data(), memory.size()};
      ASSERT_TRUE((*loader)->LoadInto(std::span<const Destination>(&into, 1)).ok());
      EXPECT_EQ(memory[17], std::byte{'c'});
    }
  }
  // Partial reads through the checkpoint's files (what the Python binding's get_slice uses).
  for (uint32_t f = 0; f < (*checkpoint)->files().size(); ++f) {
    auto file = (*checkpoint)->File(f);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    std::byte b{};
    ASSERT_TRUE(ReadFully(**file, (*checkpoint)->files()[f].data_offset, {&b, 1}).ok());
    EXPECT_EQ(b, static_cast<std::byte>('a' + f));
  }
  for (const std::string& shard : shards) EXPECT_EQ(env.opens(shard), 1u) << shard;
  EXPECT_EQ(env.opens(dir.Join(std::string(kIndexFileName))), 1u);
}

TEST(CheckpointFiles, AFileOpenedAgainMustBeTheSameFile) {
  TempDir dir;
  std::vector<std::string> shards;
  const std::string path = WriteCheckpoint(dir, Layout::kDirectory, &shards);
  OpenOptions open;
  open.max_open_files = 2;  // three shards: one is closed after Open and opened again when read
  auto checkpoint = Checkpoint::Open(path, open);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_TRUE(LoadAll(*checkpoint, Engine::kPread).ok());  // reopens, same files: fine

  // Replace every shard by a same-size copy with other bytes (rename over it).
  for (const std::string& shard : shards) {
    std::string bytes = testing::ReadBytes(shard);
    bytes.back() = 'z';
    WriteBytes(shard + ".new", bytes);
    fs::rename(shard + ".new", shard);
  }
  Status s = LoadAll(*checkpoint, Engine::kPread);
  ASSERT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_NE(s.message().find("file changed since the checkpoint was opened: replaced"),
            std::string::npos)
      << s.ToString();
  // Whichever file the check met first is named.
  bool named = false;
  for (const std::string& shard : shards) named |= s.message().find(shard) != std::string::npos;
  EXPECT_TRUE(named) << s.ToString();
}

// Env::Default()'s files without their descriptors (every read through Read, identity by size):
// once armed, the first read of `victim` appends a byte to it first (cp of a longer file over it,
// in place) and disarms.
class GrowOnReadEnv : public Env {
 public:
  class File : public RandomAccessFile {
   public:
    File(std::unique_ptr<RandomAccessFile> base, GrowOnReadEnv* env)
        : base_(std::move(base)), env_(env) {}
    Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
      if (path() == env_->victim && env_->armed.exchange(false)) {
        std::ofstream(path(), std::ios::binary | std::ios::app) << 'x';
        if (env_->after_growing) env_->after_growing();
      }
      return base_->Read(offset, dst);
    }
    Result<uint64_t> Size() const override { return base_->Size(); }
    const std::string& path() const noexcept override { return base_->path(); }

   private:
    std::unique_ptr<RandomAccessFile> base_;
    GrowOnReadEnv* env_;
  };
  Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) override {
    Result<std::unique_ptr<RandomAccessFile>> base = Env::Default()->OpenRandomAccess(path);
    if (!base.ok()) return base.status();
    return std::unique_ptr<RandomAccessFile>(std::make_unique<File>(std::move(*base), this));
  }
  std::string victim;
  std::atomic<bool> armed{false};
  std::function<void()> after_growing;  // run on the reading thread, after the append
};

// A batch reading more files than half the descriptor bound reads them in windows, and the files
// of an early window may be closed before the batch ends: a file changed while its window was
// read is still caught (checked at the window's end), not handed out mixed.
TEST(CheckpointFiles, AFileChangedWhileItsWindowIsReadFailsTheBatch) {
  TempDir dir;
  std::vector<std::string> shards;
  const std::string path = WriteCheckpoint(dir, Layout::kIndex, &shards);
  GrowOnReadEnv env;
  OpenOptions open;
  open.env = &env;
  open.max_open_files = 2;  // windows of one file: each closed when the third is opened
  auto checkpoint = Checkpoint::Open(path, open);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  LoadOptions options;
  options.engine = Engine::kPread;
  options.env = &env;
  options.budget = 0;  // one batch over the three files
  auto loader = Loader::Open(*checkpoint, options);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  ASSERT_TRUE((*loader)->Load().ok());  // nothing changed: fine
  env.victim = shards.front();
  env.armed = true;
  const auto loaded = (*loader)->Load();
  EXPECT_FALSE(env.armed.load()) << "the victim was not read";
  ASSERT_FALSE(loaded.ok()) << "a batch read across a change was handed out";
  EXPECT_EQ(loaded.status().code(), Code::kIoError) << loaded.status().ToString();
  EXPECT_NE(loaded.status().message().find(shards.front() +
                                           ": file changed since the checkpoint was opened"),
            std::string::npos)
      << loaded.status().ToString();
}

// One window, but its file closed before the batch's end: another loader of the same checkpoint
// opens files while the batch is read, and the file set (bound 2) evicts the file being read (a
// pin keeps it open for the read, not in the set). Changed during its read, it is still caught:
// checked after its reads, while pinned.
TEST(CheckpointFiles, AFileChangedAndEvictedDuringItsReadFailsTheBatch) {
  TempDir dir;
  std::vector<std::string> shards;
  const std::string path = WriteCheckpoint(dir, Layout::kIndex, &shards);
  ASSERT_GE(shards.size(), 3u);
  GrowOnReadEnv env;
  OpenOptions open;
  open.env = &env;
  open.max_open_files = 2;
  auto checkpoint = Checkpoint::Open(path, open);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  LoadOptions options;
  options.engine = Engine::kPread;
  options.env = &env;
  auto loader = Loader::Open(*checkpoint, options);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  const std::vector<FileInfo>& files = (*checkpoint)->files();
  const std::string victim = files[0].path;
  const Selection first_file =
      Selection::Where([&](const TensorInfo& t) { return t.file == 0 && t.size > 0; });
  ASSERT_TRUE((*loader)->Load(first_file).ok());  // nothing changed: fine
  env.victim = victim;
  env.after_growing = [&] {  // the other loader: opens the two other files
    for (uint32_t f = 1; f < files.size(); ++f) (void)(*checkpoint)->file_set()->Get(f);
  };
  env.armed = true;
  const auto loaded = (*loader)->Load(first_file);
  EXPECT_FALSE(env.armed.load()) << "the victim was not read";
  ASSERT_FALSE(loaded.ok()) << "a batch read across a change was handed out";
  EXPECT_EQ(loaded.status().code(), Code::kIoError) << loaded.status().ToString();
  EXPECT_NE(
      loaded.status().message().find(victim + ": file changed since the checkpoint was opened"),
      std::string::npos)
      << loaded.status().ToString();
}

class SameSizeReplacement : public ::testing::TestWithParam<Layout> {};

TEST_P(SameSizeReplacement, RenamedOverIsReportedAtTheNextLoad) {
  TempDir dir;
  std::vector<std::string> shards;
  const std::string path = WriteCheckpoint(dir, GetParam(), &shards);
  auto checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_TRUE(LoadAll(*checkpoint, Engine::kPread).ok());

  const std::string& victim = shards.back();
  std::string bytes = testing::ReadBytes(victim);
  bytes.back() = 'z';  // same size, other content
  WriteBytes(victim + ".tmp", bytes);
  fs::rename(victim + ".tmp", victim);

  EXPECT_EQ((*checkpoint)->CheckUnchanged().code(), Code::kIoError);
  for (Engine engine : {Engine::kPread, Engine::kMmap}) {
    Status s = LoadAll(*checkpoint, engine);
    ASSERT_EQ(s.code(), Code::kIoError) << s.ToString();
    EXPECT_NE(s.message().find(victim + ": file changed since the checkpoint was opened: replaced"),
              std::string::npos)
        << s.ToString();
  }
}

TEST_P(SameSizeReplacement, RewrittenInPlaceIsReportedAtTheNextLoad) {
  TempDir dir;
  std::vector<std::string> shards;
  const std::string path = WriteCheckpoint(dir, GetParam(), &shards);
  auto checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();

  const std::string& victim = shards.front();
  const auto mtime = fs::last_write_time(victim);
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('z');
  }
  fs::last_write_time(victim, mtime + std::chrono::seconds(2));  // a coarse clock still moves

  Status s = LoadAll(*checkpoint, Engine::kPread);
  ASSERT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_NE(s.message().find(victim + ": file changed since the checkpoint was opened: modified"),
            std::string::npos)
      << s.ToString();
}

INSTANTIATE_TEST_SUITE_P(Layouts, SameSizeReplacement,
                         ::testing::Values(Layout::kFile, Layout::kDirectory, Layout::kIndex),
                         [](const ::testing::TestParamInfo<Layout>& param) {
                           switch (param.param) {
                             case Layout::kFile: return std::string("SingleFile");
                             case Layout::kDirectory: return std::string("Directory");
                             case Layout::kIndex: return std::string("Index");
                           }
                           return std::string();
                         });

TEST(CheckpointFiles, FileOutOfRangeIsAnError) {
  TempDir dir;
  std::vector<std::string> shards;
  auto checkpoint = Checkpoint::Open(WriteCheckpoint(dir, Layout::kFile, &shards));
  ASSERT_TRUE(checkpoint.ok());
  EXPECT_EQ((*checkpoint)->File(1).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tensorferry

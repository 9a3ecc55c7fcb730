// The hidden temporaries and backups a dead writer left (a SIGKILL, a preempted job) are removed
// by the next write of the same files on the same machine; a live writer's, another machine's and
// other files' never are (util/writer_temporaries.h, writer.cc).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "tensorferry/integrity.h"
#include "tensorferry/writer.h"
#include "testing/test_util.h"
#include "util/writer_temporaries.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;
using ::tensorferry::testing::Pattern;
using ::tensorferry::testing::TempDir;
using ::tensorferry::testing::WriteBytes;

// Above every Linux pid_max (2^22): kill(pid, 0) fails with ESRCH, as for a writer that died.
constexpr const char* kDeadPid = "999999999";

// This machine's token, from a name this process makes.
std::string Token() {
  const std::string tag = util::WriterTag();
  return tag.substr(tag.find('@') + 1);
}

// A hidden name beside `base` of `kind`, as the process `pid` on the machine `token` makes it.
std::string Hidden(const std::string& base, std::string_view kind, const std::string& pid,
                   const std::string& token) {
  return "." + base + std::string(kind) + pid + "@" + token + "-0123456789abcdef";
}

std::set<std::string> Hidden(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(".")) out.insert(name);
  }
  return out;
}

TEST(WriterLeftovers, TagAndParse) {
  const std::string tag = util::WriterTag();
  EXPECT_TRUE(tag.starts_with(std::to_string(::getpid()) + "@")) << tag;
  EXPECT_EQ(Token().size(), 8u);
  const std::string mine = util::HiddenSibling("m.safetensors", util::kTemporaryKind);
  EXPECT_EQ(mine, ".m.safetensors.tmp-" + tag + "-");
  // This process is alive: its names are never a dead writer's.
  EXPECT_EQ(util::DeadWritersBase(mine + "0123456789abcdef", util::kTemporaryKind), "");
  const std::string dead = Hidden("m.safetensors", util::kTemporaryKind, kDeadPid, Token());
  EXPECT_EQ(util::DeadWritersBase(dead, util::kTemporaryKind), "m.safetensors");
  EXPECT_EQ(util::DeadWritersBase(dead, util::kBackupKind), "");
  const std::string other_machine = Token() == "00000000" ? "00000001" : "00000000";
  EXPECT_EQ(
      util::DeadWritersBase(Hidden("m.safetensors", util::kTemporaryKind, kDeadPid, other_machine),
                            util::kTemporaryKind),
      "");
  // The older format (no machine token) and malformed tails are never taken for ours.
  for (const std::string& bad :
       std::vector<std::string>{".m.safetensors.tmp-999999999-0123456789abcdef",
                                ".m.safetensors.tmp-@" + Token() + "-0123456789abcdef",
                                ".m.safetensors.tmp-999999999@" + Token() + "-0123456789ABCDEF",
                                ".m.safetensors.tmp-0@" + Token() + "-0123456789abcdef",
                                "m.safetensors.tmp-999999999@" + Token() + "-0123456789abcdef"}) {
    EXPECT_EQ(util::DeadWritersBase(bad, util::kTemporaryKind), "") << bad;
  }
}

// WriteFile (Python's save_file): a dead writer's temporary and backup of the same file go; a
// live writer's (this process, pid 1), another machine's, and another file's stay.
TEST(WriterLeftovers, WriteFileRemovesADeadWritersTemporariesOfItsFile) {
  TempDir dir;
  const std::string token = Token();
  const std::string other_machine = token == "00000000" ? "00000001" : "00000000";
  const std::string dead_tmp = Hidden("m.safetensors", util::kTemporaryKind, kDeadPid, token);
  const std::string dead_bak = Hidden("m.safetensors", util::kBackupKind, kDeadPid, token);
  const std::set<std::string> kept = {
      Hidden("m.safetensors", util::kTemporaryKind, std::to_string(::getpid()), token),
      Hidden("m.safetensors", util::kTemporaryKind, "1", token),
      Hidden("m.safetensors", util::kTemporaryKind, kDeadPid, other_machine),
      Hidden("n.safetensors", util::kTemporaryKind, kDeadPid, token),
      ".m.safetensors.tmp-999999999-0123456789abcdef",  // older format: no machine token
  };
  for (const std::string& name : kept) WriteBytes(dir.Join(name), "kept");
  WriteBytes(dir.Join(dead_tmp), std::string(4096, 'x'));
  WriteBytes(dir.Join(dead_bak), "old bytes");
  const auto data = Pattern(100, 1);
  const std::vector<TensorToWrite> tensors = {{"t", DType::kU8, {100}, data, nullptr}};
  WriteOptions options;
  options.sync = false;
  ASSERT_TRUE(WriteFile(dir.Join("m.safetensors"), tensors, {}, options).ok());
  EXPECT_EQ(Hidden(dir.path()), kept);
  EXPECT_TRUE(fs::exists(dir.Join("m.safetensors")));
}

// WriteSharded (gen, convert, reshard): a dead writer's temporaries and backups of the layout
// (of any shard count: "-of-00015" left, "-of-00002" written), of its index and manifest go.
TEST(WriterLeftovers, WriteShardedRemovesADeadWritersLayoutLeftovers) {
  TempDir dir;
  const std::string token = Token();
  std::set<std::string> dead;
  for (const std::string& base :
       std::vector<std::string>{"model-00003-of-00015.safetensors", "model.safetensors.index.json",
                                "model.safetensors", std::string(kChecksumManifestName)}) {
    dead.insert(Hidden(base, util::kTemporaryKind, kDeadPid, token));
    dead.insert(Hidden(base, util::kBackupKind, kDeadPid, token));
  }
  const std::set<std::string> kept = {
      Hidden("other-00001-of-00002.safetensors", util::kTemporaryKind, kDeadPid, token),
      Hidden("model-00001-of-00002.safetensors", util::kTemporaryKind, "1", token),
      Hidden("model-00001-of-00002.safetensors", util::kBackupKind, "1", token),
  };
  for (const std::string& name : dead) WriteBytes(dir.Join(name), "left");
  for (const std::string& name : kept) WriteBytes(dir.Join(name), "kept");
  const auto a = Pattern(5000, 1), b = Pattern(5000, 2);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr},
                                              {"b", DType::kU8, {5000}, b, nullptr}};
  ShardOptions options;
  options.max_shard_size = 6000;  // two shards
  options.write.sync = false;
  auto written = WriteSharded(dir.path(), tensors, {}, options);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_EQ(Hidden(dir.path()), kept);
}

// A failed sharded write keeps a dead writer's backups: until a write of those files succeeds,
// a backup may be the only copy of an older file. (Its temporaries go at the start.)
TEST(WriterLeftovers, AFailedWriteKeepsADeadWritersBackups) {
  TempDir dir;
  const std::string token = Token();
  const std::string bak = Hidden("model.safetensors", util::kBackupKind, kDeadPid, token);
  const std::string tmp = Hidden("model.safetensors", util::kTemporaryKind, kDeadPid, token);
  WriteBytes(dir.Join(bak), "the only copy");
  WriteBytes(dir.Join(tmp), "half");
  const auto a = Pattern(100, 1);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {100}, a, nullptr}};
  testing::FaultInjectionEnv failing({.fail_rename = 1});
  ShardOptions options;
  options.write.sync = false;
  options.write.env = &failing;
  ASSERT_FALSE(WriteSharded(dir.path(), tensors, {}, options).ok());
  EXPECT_EQ(Hidden(dir.path()), std::set<std::string>{bak});
}

}  // namespace
}  // namespace tensorferry

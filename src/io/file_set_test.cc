#include "io/file_set.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <span>
#include <string>
#include <vector>

#include "io/read_engine.h"
#include "tensorferry/env.h"
#include "testing/test_util.h"

namespace tensorferry::io {
namespace {

using testing::MemoryEnv;

std::vector<FileSet::FileSpec> AddFiles(MemoryEnv& env, size_t n) {
  std::vector<FileSet::FileSpec> specs;
  for (size_t i = 0; i < n; ++i) {
    const std::string path = "/m/f" + std::to_string(i);
    env.AddFile(path, std::string(100 + i, static_cast<char>('a' + i % 26)));
    FileIdentity id;
    id.size = 100 + i;  // a MemoryEnv file's identity is its size
    specs.push_back({path, id, nullptr});
  }
  return specs;
}

TEST(FileSet, KeepsAtMostMaxOpenAndReopensOnDemand) {
  MemoryEnv env;
  FileSet set(MakeEnvSource(&env), AddFiles(env, 50), 8);
  for (int round = 0; round < 3; ++round) {
    for (uint32_t f = 0; f < 50; ++f) {
      auto pin = set.Get(f);
      ASSERT_TRUE(pin.ok()) << pin.status().ToString();
      EXPECT_EQ(*(*pin).file->Size(), 100 + f);
      EXPECT_LE(set.open_descriptors(), 8u);
    }
  }
  EXPECT_EQ(set.opens(), 150u);  // every file reopened each round: 50 > 8
  // The most recently used files stay open: no reopening.
  const uint64_t before = set.opens();
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(set.Get(49 - i % 8).ok());
  EXPECT_EQ(set.opens(), before);
}

TEST(FileSet, APinOutlivesEviction) {
  MemoryEnv env;
  FileSet set(MakeEnvSource(&env), AddFiles(env, 10), 2);
  auto first = set.Get(0);
  ASSERT_TRUE(first.ok());
  for (uint32_t f = 1; f < 10; ++f) ASSERT_TRUE(set.Get(f).ok());  // evicts file 0 from the set
  std::string got(100, '\0');
  ASSERT_TRUE(ReadFully(*first->file, 0,
                        std::span<std::byte>(reinterpret_cast<std::byte*>(got.data()), 100))
                  .ok());
  EXPECT_EQ(got, std::string(100, 'a'));
}

TEST(FileSet, AFileThatChangedSizeIsReportedWhenOpened) {
  MemoryEnv env;
  std::vector<FileSet::FileSpec> specs = AddFiles(env, 3);
  env.AddFile("/m/f1", std::string(7, 'x'));  // replaced since the checkpoint was opened
  FileSet set(MakeEnvSource(&env), specs, 8);
  EXPECT_TRUE(set.Get(0).ok());
  auto changed = set.Get(1);
  ASSERT_FALSE(changed.ok());
  EXPECT_EQ(changed.status().code(), Code::kIoError);
  EXPECT_NE(changed.status().message().find("/m/f1: file changed since the checkpoint was opened"),
            std::string::npos)
      << changed.status().ToString();
  EXPECT_TRUE(set.CheckUnchanged().ok());  // file 0, the only one open, is unchanged
}

TEST(FileSet, FilesGivenOpenAreNotOpenedAgain) {
  MemoryEnv env;
  std::vector<FileSet::FileSpec> specs = AddFiles(env, 4);
  std::shared_ptr<Source> source = MakeEnvSource(&env);
  for (auto& spec : specs) spec.open = std::move(source->Open(spec.path).value());
  FileSet set(source, specs, 2);  // two of the four given open are closed at once
  EXPECT_EQ(set.open_descriptors(), 2u);
  for (uint32_t f = 2; f < 4; ++f) ASSERT_TRUE(set.Get(f).ok());
  EXPECT_EQ(set.opens(), 0u);  // the most recently given stayed open
  ASSERT_TRUE(set.Get(0).ok());
  EXPECT_EQ(set.opens(), 1u);
}

TEST(FileSet, DefaultBoundIsAQuarterOfTheDescriptorLimit) {
  const size_t n = FileSet::DefaultMaxOpen();
  EXPECT_GE(n, 8u);
  EXPECT_LE(n, 1024u);
}

// O_DIRECT wanted when no descriptor is left (EMFILE): the file is read buffered this time, not
// failed, and O_DIRECT is tried again later (the file system did not refuse it).
TEST(FileSet, WithNoDescriptorLeftADirectReadIsBufferedThisTime) {
#if defined(TF_UNDER_SANITIZER)
  GTEST_SKIP() << "sanitizer build: the test leaves the process no spare descriptors";
#endif
  testing::TempDir dir;
  const std::string path = dir.Join("f");
  testing::WriteBytes(path, std::string(8192, 'z'));
  {
    auto probe_file = Env::Default()->OpenRandomAccess(path);
    ASSERT_TRUE(probe_file.ok()) << probe_file.status().ToString();
    auto probe = DirectFile::Open(**probe_file);
    if (!probe.ok() || !*probe) GTEST_SKIP() << "no O_DIRECT on " << dir.path();
  }
  std::shared_ptr<Source> source = MakeEnvSource();
  auto opened = source->Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const FileIdentity id = (*opened)->identity();
  FileSet set(source, {{path, id, nullptr}}, 8);
  {
    auto buffered = set.Get(0);  // opened (one descriptor) before the limit is lowered
    ASSERT_TRUE(buffered.ok()) << buffered.status().ToString();
  }
  {
    testing::FewDescriptors none(0);
    ASSERT_TRUE(none.ok());
    auto pin = set.Get(0, /*want_direct=*/true);
    ASSERT_TRUE(pin.ok()) << pin.status().ToString();
    EXPECT_EQ(pin->direct, nullptr);
    EXPECT_EQ(pin->direct_fd(), -1);
    std::string got(8192, '\0');
    ASSERT_TRUE(ReadFully(*pin->file, 0,
                          std::span<std::byte>(reinterpret_cast<std::byte*>(got.data()), 8192))
                    .ok());
    EXPECT_EQ(got, std::string(8192, 'z'));
  }
  auto pin = set.Get(0, /*want_direct=*/true);
  ASSERT_TRUE(pin.ok()) << pin.status().ToString();
  EXPECT_NE(pin->direct, nullptr);  // descriptors again: O_DIRECT this time
}

}  // namespace
}  // namespace tensorferry::io

#include "util/file_lock.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "testing/test_util.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::Contains;
using ::tensorferry::testing::ReadBytes;
using ::tensorferry::testing::TempDir;
using ::tensorferry::testing::WriteBytes;

// Adds one to the decimal count in `path` by reading it and writing it back: increments lost
// unless every read-modify-write is alone.
bool IncrementCounterFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  const std::string next = std::to_string(std::stoul(std::string(buf, n > 0 ? n : 0)) + 1);
  const bool ok = ::ftruncate(fd, 0) == 0 &&
                  ::pwrite(fd, next.data(), next.size(), 0) == static_cast<ssize_t>(next.size());
  return ::close(fd) == 0 && ok;
}

// `rounds` times: take the lock (waiting), increment the counter, release.
bool CountUnderLock(const std::string& lock_path, bool directory, const std::string& counter,
                    int rounds) {
  for (int i = 0; i < rounds; ++i) {
    auto lock = directory ? FileLock::LockDirectory(lock_path, FileLock::Wait::kBlock, "test")
                          : FileLock::LockFile(lock_path, FileLock::Wait::kBlock, "test");
    if (!lock.ok() || !IncrementCounterFile(counter)) return false;
  }
  return true;
}

// Threads of this process and a child process take one lock, a directory's or a lock file's,
// many times each: every read-modify-write of a shared file stays whole (none is lost), and a
// lock file is gone once the last holder released it.
TEST(FileLock, ExcludesThreadsAndProcesses) {
  for (const bool directory : {true, false}) {
    TempDir dir;
    const std::string counter = dir.Join("counter");
    WriteBytes(counter, "0");
    const std::string lock_path = directory ? dir.path() : dir.Join(".lock");
    constexpr int kRounds = 40, kThreads = 3;
    // The child first, before this test starts a thread; it waits for the threads.
    int start[2];
    ASSERT_EQ(::pipe(start), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(start[1]);
      char go;
      (void)!::read(start[0], &go, 1);  // EOF: the threads run
      ::_exit(CountUnderLock(lock_path, directory, counter, kRounds) ? 0 : 1);
    }
    ::close(start[0]);
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        if (!CountUnderLock(lock_path, directory, counter, kRounds)) ++failures;
      });
    }
    ::close(start[1]);
    for (std::thread& t : threads) t.join();
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << directory;
    EXPECT_EQ(failures.load(), 0) << directory;
    EXPECT_EQ(ReadBytes(counter), std::to_string((kThreads + 1) * kRounds)) << directory;
    EXPECT_FALSE(std::filesystem::exists(dir.Join(".lock"))) << directory;
  }
}

// Failing at once: the refusal names the lock and its holder (here another thread of this
// process); released, the lock file is gone and the lock can be taken again.
TEST(FileLock, RefusedAtOnceNamingTheHolder) {
  TempDir dir;
  const std::string path = dir.Join(".lock");
  auto first = FileLock::LockFile(path, FileLock::Wait::kFail, "the first");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(first->cross_process());
  EXPECT_TRUE(Contains(ReadBytes(path), "pid " + std::to_string(::getpid())));
  EXPECT_TRUE(Contains(ReadBytes(path), ": the first\n"));
  bool busy = false;
  auto second = FileLock::LockFile(path, FileLock::Wait::kFail, "the second", &busy);
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(busy);
  EXPECT_EQ(second.status().code(), Code::kIoError);
  EXPECT_EQ(second.status().message(), path + " is held by another thread of this process (pid " +
                                           std::to_string(::getpid()) + ")");
  auto dir_lock = FileLock::LockDirectory(dir.path(), FileLock::Wait::kFail, "a directory");
  ASSERT_TRUE(dir_lock.ok()) << "another lock: " << dir_lock.status().ToString();
  auto dir_again = FileLock::LockDirectory(dir.path(), FileLock::Wait::kFail, "again", &busy);
  EXPECT_FALSE(dir_again.ok());
  EXPECT_TRUE(busy);

  first->Release();
  EXPECT_FALSE(std::filesystem::exists(path));
  first->Release();  // idempotent
  auto third = FileLock::LockFile(path, FileLock::Wait::kFail, "the third");
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  FileLock moved = std::move(*third);
  EXPECT_EQ(moved.path(), path);
  EXPECT_TRUE(std::filesystem::exists(path));
}

// A lock held by another process is refused with that process's pid and purpose; when that
// process dies without releasing it (a crash: its lock file stays), the lock is free again and
// its file taken over.
TEST(FileLock, AnotherProcessIsNamedAndACrashLeavesNoStaleLock) {
  TempDir dir;
  const std::string path = dir.Join(".lock");
  int ready[2], done[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    ::close(done[1]);
    auto lock = FileLock::LockFile(path, FileLock::Wait::kFail, "the child's write");
    const char c = lock.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &c, 1);
    char go;
    (void)!::read(done[0], &go, 1);
    ::_exit(0);  // no destructor runs: as a crash, the file stays
  }
  ::close(ready[1]);
  ::close(done[0]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  bool busy = false;
  auto refused = FileLock::LockFile(path, FileLock::Wait::kFail, "the parent", &busy);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(busy);
  EXPECT_TRUE(Contains(refused.status().message(),
                       path + " is held by pid " + std::to_string(child) + " ("));
  EXPECT_TRUE(Contains(refused.status().message(), ": the child's write"));
  ::close(done[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(std::filesystem::exists(path)) << "the crashed holder's file";
  auto taken = FileLock::LockFile(path, FileLock::Wait::kFail, "the parent");
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_TRUE(Contains(ReadBytes(path), "pid " + std::to_string(::getpid())));
  taken->Release();
  EXPECT_FALSE(std::filesystem::exists(path));
  ::close(ready[0]);
}

TEST(FileLock, ErrorsNameThePath) {
  TempDir dir;
  auto missing = FileLock::LockDirectory(dir.Join("missing"), FileLock::Wait::kBlock, "a test");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), dir.Join("missing") + ": cannot open"));
  // A symbolic link at a lock file's name is not followed: its target is never truncated.
  WriteBytes(dir.Join("precious"), "keep");
  std::filesystem::create_symlink("precious", dir.Join(".lock"));
  auto link = FileLock::LockFile(dir.Join(".lock"), FileLock::Wait::kFail, "a test");
  ASSERT_FALSE(link.ok());
  EXPECT_EQ(link.status().code(), Code::kIoError);
  EXPECT_TRUE(Contains(link.status().message(), dir.Join(".lock")));
  EXPECT_EQ(ReadBytes(dir.Join("precious")), "keep");
}

}  // namespace
}  // namespace tensorferry

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io/read_engine.h"
#include "tensorferry/residency.h"
#include "testing/test_util.h"

namespace tensorferry::io {
namespace {

using testing::MemoryEnv;

using ::tensorferry::testing::Contains;

// Bytes that differ per file and per position, so a read from the wrong place shows.
std::string Pattern(size_t size, unsigned seed) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i)
    s[i] = static_cast<char>((i * 131 + seed * 17 + (i >> 8)) & 0xff);
  return s;
}

// Several files, each opened from `env`, and many requests of odd sizes and offsets over them.
struct Workload {
  std::vector<std::string> contents;
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  std::vector<std::vector<std::byte>> dst;
  std::vector<ReadRequest> requests;
  std::vector<std::pair<size_t, uint64_t>> origin;  // (file index, offset) per request

  // Checks every destination against the file bytes it was read from.
  ::testing::AssertionResult Verify() const {
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& [f, off] = origin[i];
      if (dst[i].size() != 0 &&
          std::memcmp(dst[i].data(), contents[f].data() + off, dst[i].size()) != 0) {
        return ::testing::AssertionFailure() << "request " << i << " (file " << f << ", offset "
                                             << off << ", " << dst[i].size() << " bytes) differs";
      }
    }
    return ::testing::AssertionSuccess();
  }
};

Workload MakeWorkload(Env* env, const std::vector<std::string>& paths, size_t requests,
                      unsigned seed) {
  Workload w;
  std::mt19937_64 rng(seed);
  for (const std::string& path : paths) {
    auto file = env->OpenRandomAccess(path);
    EXPECT_TRUE(file.ok()) << file.status().ToString();
    auto size = (*file)->Size();
    EXPECT_TRUE(size.ok());
    w.contents.push_back(std::string(*size, '\0'));
    EXPECT_TRUE(
        ReadFully(**file, 0,
                  std::span<std::byte>(reinterpret_cast<std::byte*>(w.contents.back().data()),
                                       w.contents.back().size()))
            .ok());
    w.files.push_back(std::move(file).value());
  }
  w.dst.resize(requests);
  for (size_t i = 0; i < requests; ++i) {
    const size_t f = i % paths.size();  // interleave files, as the plan does
    const uint64_t size = w.contents[f].size();
    const uint64_t off = rng() % size;
    const uint64_t len = i % 7 == 0 ? 0 : rng() % (size - off + 1);
    w.dst[i].resize(static_cast<size_t>(len));
    w.origin.emplace_back(f, off);
    w.requests.push_back(ReadRequest{w.files[f].get(), off, w.dst[i]});
  }
  return w;
}

std::unique_ptr<ReadEngine> Engine(unsigned threads) {
  auto engine = MakePreadEngine(threads);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return std::move(engine).value();
}

// ReadRequest::cancel: requests not started when it is set are never started; Execute returns
// kCancelled once those in flight are done. A flag set by the env's read hook mid-way stops the
// rest.
TEST(PreadEngineTest, CancelledRequestsAreNotStarted) {
  MemoryEnv env;
  env.AddFile("a", Pattern(100000, 1));
  auto engine = Engine(2);
  Workload w = MakeWorkload(&env, {"a"}, 300, 5);
  std::atomic<bool> cancel{true};
  for (ReadRequest& r : w.requests) r.cancel = &cancel;
  const Status s = engine->Execute(w.requests);
  EXPECT_EQ(s.code(), Code::kCancelled) << s.ToString();
  EXPECT_EQ(engine->stats().requests, 0u);
  cancel.store(false);
  ASSERT_TRUE(engine->Execute(w.requests).ok());
  EXPECT_TRUE(w.Verify());
}

TEST(PreadEngineTest, ByteExactAcrossFilesAndThreadCounts) {
  MemoryEnv env;
  const std::vector<std::string> paths = {"a", "b", "c"};
  env.AddFile("a", Pattern(10007, 1));
  env.AddFile("b", Pattern(1, 2));
  env.AddFile("c", Pattern(65537, 3));
  env.SetFaults("c", {.max_read = 1000});  // short reads are continued
  for (unsigned threads = 1; threads <= 8; ++threads) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    auto engine = Engine(threads);
    EXPECT_EQ(engine->name(), "pread");
    Workload w = MakeWorkload(&env, paths, 200, threads);
    ASSERT_TRUE(engine->Execute(w.requests).ok());
    EXPECT_TRUE(w.Verify());
    uint64_t bytes = 0;
    for (const auto& d : w.dst) bytes += d.size();
    const EngineStats stats = engine->stats();
    EXPECT_EQ(stats.requests, 200u);
    EXPECT_EQ(stats.bytes_read, bytes);
    EXPECT_GE(stats.read_calls, 200u * 6 / 7);
  }
}

TEST(PreadEngineTest, ZeroThreadsMeansOnlineCpusAndEmptyJobIsOk) {
  auto engine = Engine(0);
  EXPECT_TRUE(engine->Execute({}).ok());
  EXPECT_EQ(engine->stats().requests, 0u);
}

TEST(PreadEngineTest, ShortReadsCountEveryCall) {
  MemoryEnv env;
  env.AddFile("f", Pattern(1000, 4));
  env.SetFaults("f", {.max_read = 7});
  auto file = env.OpenRandomAccess("f");
  ASSERT_TRUE(file.ok());
  std::vector<std::byte> dst(100);
  const ReadRequest request{file->get(), 13, dst};
  auto engine = Engine(2);
  ASSERT_TRUE(engine->Execute({&request, 1}).ok());
  EXPECT_EQ(std::memcmp(dst.data(), Pattern(1000, 4).data() + 13, 100), 0);
  EXPECT_EQ(engine->stats().read_calls, 15u);  // ceil(100 / 7)
  EXPECT_EQ(engine->stats().bytes_read, 100u);
}

// A file without a descriptor (an object store's, here a MemoryEnv's) is read whole even with a
// landed hook (its reads are ranged GETs of their own part size, which pieces would multiply): a
// file that does not report its bytes as they land (LandingScope) gets the hook once, at the end.
TEST(PreadEngineTest, LandedHookGetsFilesWithoutDescriptorWhole) {
  MemoryEnv env;
  const uint64_t size = 3 * kLandedPieceBytes + 5;
  env.AddFile("f", Pattern(size, 6));
  auto file = env.OpenRandomAccess("f");
  ASSERT_TRUE(file.ok());
  std::vector<std::byte> dst(size - 10);
  std::vector<std::pair<uint64_t, uint64_t>> seen;
  std::mutex mu;
  const std::function<Status(const ReadRequest&)> hook = [&](const ReadRequest& r) {
    std::lock_guard<std::mutex> lock(mu);
    seen.emplace_back(r.offset, r.dst.size());
    return Status::Ok();
  };
  const ReadRequest request{file->get(), 10, dst, -1, nullptr, &hook};
  auto engine = Engine(2);
  ASSERT_TRUE(engine->Execute({&request, 1}).ok());
  EXPECT_EQ(std::memcmp(dst.data(), Pattern(size, 6).data() + 10, dst.size()), 0);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], std::make_pair(uint64_t{10}, uint64_t{dst.size()}));
}

// A file without a descriptor that writes its bytes progressively and reports them
// (LandingScope::Landed, as an object store's GET does as its body arrives): the hook gets them in
// order while the read is still running, in pieces of at least kLandedPieceBytes (the last may be
// shorter), covering the request exactly once; a hook error fails the request after the read.
class ProgressiveFile final : public RandomAccessFile {
 public:
  explicit ProgressiveFile(std::string bytes) : bytes_(std::move(bytes)) {}
  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    in_read = true;
    constexpr size_t kStep = 100 << 10;  // a body arriving 100 KiB at a time
    for (size_t at = 0; at < dst.size(); at += kStep) {
      const size_t n = std::min(kStep, dst.size() - at);
      std::memcpy(dst.data() + at, bytes_.data() + offset + at, n);
      LandingScope::Landed(dst.data() + at + n);
    }
    in_read = false;
    return dst.size();
  }
  Result<uint64_t> Size() const override { return bytes_.size(); }
  const std::string& path() const noexcept override { return path_; }
  static thread_local bool in_read;

 private:
  std::string bytes_;
  std::string path_ = "progressive";
};
thread_local bool ProgressiveFile::in_read = false;

TEST(PreadEngineTest, LandedHookGetsProgressiveFilesAsTheyLand) {
  const uint64_t size = 5 * kLandedPieceBytes + 777;
  const std::string content = Pattern(size, 8);
  ProgressiveFile file(content);
  std::vector<std::byte> dst(size - 100);
  struct Piece {
    uint64_t offset, size;
    bool during_read;
  };
  std::vector<Piece> seen;
  int mismatches = 0;
  std::mutex mu;
  uint64_t refuse_at = UINT64_MAX;
  const std::function<Status(const ReadRequest&)> hook = [&](const ReadRequest& r) {
    std::lock_guard<std::mutex> lock(mu);
    if (std::memcmp(r.dst.data(), content.data() + r.offset, r.dst.size()) != 0) ++mismatches;
    seen.push_back({r.offset, r.dst.size(), ProgressiveFile::in_read});
    return r.offset >= refuse_at ? Status(Code::kChecksumMismatch, "bad piece") : Status::Ok();
  };
  const ReadRequest request{&file, 100, dst, -1, nullptr, &hook};
  auto engine = Engine(2);
  ASSERT_TRUE(engine->Execute({&request, 1}).ok());
  EXPECT_EQ(mismatches, 0);
  ASSERT_GE(seen.size(), 4u);
  uint64_t next = 100;
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].offset, next) << i;
    if (i + 1 < seen.size()) {
      EXPECT_GE(seen[i].size, kLandedPieceBytes) << i;
      EXPECT_TRUE(seen[i].during_read) << i;  // handed over before the read returned
    }
    next += seen[i].size;
  }
  EXPECT_EQ(next, 100 + dst.size());
  // A failing check fails the request (the read itself completes).
  seen.clear();
  refuse_at = 100 + kLandedPieceBytes;
  const Status s = engine->Execute({&request, 1});
  EXPECT_EQ(s.code(), Code::kChecksumMismatch) << s.ToString();
  EXPECT_EQ(seen.size(), 2u);  // nothing handed over after the first error
}

// A faulty file among healthy ones: the job fails with the fault's code and a message naming the
// file and the offset, and the same engine then completes a healthy job.
struct FaultCase {
  const char* name;
  MemoryEnv::Faults faults;
  Code code;
  const char* needle;  // expected in the message besides the path
};

class PreadEngineFaultTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(PreadEngineFaultTest, FailsWithCodeAndStaysUsable) {
  const FaultCase& c = GetParam();
  MemoryEnv env;
  env.AddFile("good.safetensors", Pattern(50000, 5));
  env.AddFile("bad.safetensors", Pattern(50000, 6));
  for (unsigned threads : {1u, 3u, 8u}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    env.AddFile("bad.safetensors", Pattern(50000, 6));  // undo a previous truncation
    auto engine = Engine(threads);
    Workload w = MakeWorkload(&env, {"good.safetensors", "bad.safetensors"}, 0, 0);
    env.SetFaults("bad.safetensors", c.faults);  // armed after MakeWorkload read the contents
    // Whole-file requests in 5000-byte pieces, so every fault is hit by some request.
    for (size_t f = 0; f < 2; ++f) {
      for (uint64_t off = 0; off < 50000; off += 5000) {
        w.dst.emplace_back(5000);
        w.origin.emplace_back(f, off);
      }
    }
    for (size_t i = 0; i < w.dst.size(); ++i) {
      w.requests.push_back(
          ReadRequest{w.files[w.origin[i].first].get(), w.origin[i].second, w.dst[i]});
    }
    const Status status = engine->Execute(w.requests);
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), c.code) << status.ToString();
    EXPECT_TRUE(Contains(status.message(), "bad.safetensors")) << status.ToString();
    EXPECT_TRUE(Contains(status.message(), c.needle)) << status.ToString();

    // Usable afterwards.
    Workload ok = MakeWorkload(&env, {"good.safetensors"}, 50, threads);
    ASSERT_TRUE(engine->Execute(ok.requests).ok());
    EXPECT_TRUE(ok.Verify());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, PreadEngineFaultTest,
    ::testing::Values(
        FaultCase{"Eio", {.eio_at = 23456}, Code::kIoError, "offset 23456"},
        FaultCase{
            "EioShortReads", {.max_read = 333, .eio_at = 40001}, Code::kIoError, "offset 40001"},
        // The file shrinks to 30000 bytes after its first reads: the request covering 30000 ends
        // early (offset 30000) and any later one finds nothing (at its own offset).
        FaultCase{"Truncated",
                  {.truncate_after_reads = 2, .truncate_to = 30000},
                  Code::kUnexpectedEof,
                  "unexpected end of file at offset "},
        FaultCase{"TruncatedShortReads",
                  {.max_read = 1000, .truncate_after_reads = 3, .truncate_to = 12345},
                  Code::kUnexpectedEof,
                  "unexpected end of file at offset "}),
    [](const ::testing::TestParamInfo<FaultCase>& p) { return std::string(p.param.name); });

TEST(PreadEngineTest, EofMessageNamesOffsetsAndCounts) {
  MemoryEnv env;
  env.AddFile("short.safetensors", Pattern(1000, 7));
  auto file = env.OpenRandomAccess("short.safetensors");
  ASSERT_TRUE(file.ok());
  std::vector<std::byte> dst(300);
  const ReadRequest request{file->get(), 900, dst};
  auto engine = Engine(2);
  const Status status = engine->Execute({&request, 1});
  EXPECT_EQ(status.code(), Code::kUnexpectedEof);
  EXPECT_EQ(status.message(),
            "short.safetensors: unexpected end of file at offset 1000: wanted 300 bytes at offset "
            "900, got 100");
}

TEST(PreadEngineTest, ErrorStopsHandingOutRequests) {
  MemoryEnv env;
  env.AddFile("f", Pattern(4096, 8));
  env.SetFaults("f", {.eio_at = 0});
  auto file = env.OpenRandomAccess("f");
  ASSERT_TRUE(file.ok());
  // One worker: the first request fails, so none of the other 999 may be started.
  std::vector<std::byte> dst(16);
  std::vector<ReadRequest> requests(1000, ReadRequest{file->get(), 0, dst});
  auto engine = Engine(1);
  EXPECT_EQ(engine->Execute(requests).code(), Code::kIoError);
  EXPECT_EQ(engine->stats().requests, 1u);
  EXPECT_EQ(env.reads("f"), 1u);
}

TEST(PreadEngineTest, ConcurrentExecuteFromFourThreads) {
  MemoryEnv env;
  env.AddFile("x", Pattern(30011, 9));
  env.AddFile("y", Pattern(20011, 10));
  env.AddFile("bad", Pattern(20011, 11));
  auto engine = Engine(3);
  std::vector<std::thread> callers;
  std::vector<int> failures(4, 0);
  for (unsigned t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        if (t == 3) {                // one caller keeps failing; the others must not notice
          env.SetFaults("bad", {});  // MakeWorkload reads the whole file first
          Workload w = MakeWorkload(&env, {"bad", "x"}, 40, 100 + static_cast<unsigned>(round));
          std::vector<std::byte> covering(100);  // [700, 800) holds the EIO
          w.requests.insert(w.requests.begin(), ReadRequest{w.files[0].get(), 700, covering});
          env.SetFaults("bad", {.eio_at = 777});
          if (engine->Execute(w.requests).code() == Code::kIoError) ++failures[t];
          continue;
        }
        Workload w = MakeWorkload(&env, {"x", "y"}, 60, t * 10 + static_cast<unsigned>(round));
        if (!engine->Execute(w.requests).ok() || !w.Verify()) ++failures[t];
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(failures[0] + failures[1] + failures[2], 0);
  EXPECT_EQ(failures[3], 5);
}

// --- real files through Env::Default() -----------------------------------------------------------

TEST(PreadEngineTest, RealFiles) {
  testing::TempDir dir;
  std::vector<std::string> paths;
  for (unsigned i = 0; i < 3; ++i) {
    paths.push_back(dir.Join("shard" + std::to_string(i) + ".safetensors"));
    testing::WriteBytes(paths.back(), Pattern(100003 + i * 4099, 20 + i));
  }
  auto engine = Engine(4);
  Workload w = MakeWorkload(Env::Default(), paths, 300, 42);
  ASSERT_TRUE(engine->Execute(w.requests).ok());
  EXPECT_TRUE(w.Verify());

  // Past the end of a real file.
  std::vector<std::byte> dst(10);
  const ReadRequest past{w.files[0].get(), 100000, dst};
  const Status status = engine->Execute({&past, 1});
  EXPECT_EQ(status.code(), Code::kUnexpectedEof);
  EXPECT_TRUE(Contains(status.message(), paths[0] + ": unexpected end of file at offset 100003"));
}

// --- CachedFraction ------------------------------------------------------------------------------

TEST(ResidencyTest, CachedFractionOfReadFileThenDropped) {
  testing::TempDir dir;
  const std::string path = dir.Join("cached.bin");
  testing::WriteBytes(path, Pattern(1 << 20, 30));
  (void)testing::ReadBytes(path);
  auto fraction = CachedFraction(path, 0, 1 << 20);
  ASSERT_TRUE(fraction.ok()) << fraction.status().ToString();
  EXPECT_GT(*fraction, 0.5);
  EXPECT_LE(*fraction, 1.0);

  // Ask the kernel to drop the pages. Eviction is not guaranteed (tmpfs, overlay filesystems), so
  // only the measurement itself is checked.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::fdatasync(fd), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  auto after = CachedFraction(path, 4096, 1 << 20);  // also runs past the end: clamped
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_GE(*after, 0.0);
  EXPECT_LE(*after, 1.0);
}

// Sampled residency agrees with the page-by-page count: a file whose first half alone was read
// back after dropping it (where the kernel drops pages at all), measured both ways.
TEST(ResidencyTest, SampledAgreesWithEveryPage) {
  testing::TempDir dir;
  const std::string path = dir.Join("half.bin");
  const size_t size = 8 << 20;
  testing::WriteBytes(path, Pattern(size, 32));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::fdatasync(fd), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);  // no readahead past the half
  std::vector<char> buf(size / 2);
  ASSERT_EQ(::pread(fd, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  io::ResidencySampling every;
  every.above_pages = UINT64_MAX;
  io::ResidencySampling sampled;
  sampled.above_pages = 0;
  sampled.samples = 64;
  sampled.pages_per_sample = 4;
  for (uint64_t offset : {uint64_t{0}, uint64_t{12345}, uint64_t{3} << 20}) {
    SCOPED_TRACE(offset);
    auto exact = io::CachedFraction(fd, path, offset, size, every);
    auto estimate = io::CachedFraction(fd, path, offset, size, sampled);
    ASSERT_TRUE(exact.ok()) << exact.status().ToString();
    ASSERT_TRUE(estimate.ok()) << estimate.status().ToString();
    EXPECT_NEAR(*estimate, *exact, 0.1);
  }
  // Samples as dense as the pages: the same count.
  sampled.samples = 2048;
  sampled.pages_per_sample = 1;
  // Compared only while the page-by-page count stays the same: the kernel may evict between counts.
  bool compared = false;
  for (int attempt = 0; attempt < 20 && !compared; ++attempt) {
    auto before = io::CachedFraction(fd, path, 0, size, every);
    auto dense = io::CachedFraction(fd, path, 0, size, sampled);
    auto after = io::CachedFraction(fd, path, 0, size, every);
    ASSERT_TRUE(before.ok() && dense.ok() && after.ok());
    if (*before != *after) continue;
    EXPECT_DOUBLE_EQ(*dense, *before);
    compared = true;
  }
  EXPECT_TRUE(compared) << "the page cache kept changing";
  ::close(fd);
}

// The range is mapped a window at a time: windows of a few pages, with sampled runs that cross
// their boundaries, count the same pages as one window over the whole file.
TEST(ResidencyTest, SmallWindowsCountTheSamePages) {
  testing::TempDir dir;
  const std::string path = dir.Join("windows.bin");
  const size_t size = 4 << 20;
  testing::WriteBytes(path, Pattern(size, 33));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::fdatasync(fd), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);
  // Every third 64 KiB stretch read back: residency that differs from window to window.
  std::vector<char> buf(64 << 10);
  for (size_t at = 0; at < size; at += 3 * buf.size()) {
    ASSERT_EQ(::pread(fd, buf.data(), buf.size(), static_cast<off_t>(at)),
              static_cast<ssize_t>(buf.size()));
  }
  for (bool sample : {false, true}) {
    io::ResidencySampling one;
    one.above_pages = sample ? 0 : UINT64_MAX;
    one.samples = 37;
    one.pages_per_sample = 7;
    for (uint64_t offset : {uint64_t{0}, uint64_t{5000}, uint64_t{1} << 20}) {
      SCOPED_TRACE(std::to_string(offset) + (sample ? " sampled" : " every page"));
      for (uint64_t window :
           {uint64_t{1}, uint64_t{3} << 12, uint64_t{5} << 12, uint64_t{1} << 20}) {
        io::ResidencySampling small = one;
        small.window_bytes = window;  // 1 byte: one page at a time
        // The kernel may evict pages between two counts (a loaded machine under memory
        // pressure): compare only counts taken while the whole-file count stayed the same.
        bool compared = false;
        for (int attempt = 0; attempt < 20 && !compared; ++attempt) {
          auto before = io::CachedFraction(fd, path, offset, size, one);
          auto windowed = io::CachedFraction(fd, path, offset, size, small);
          auto after = io::CachedFraction(fd, path, offset, size, one);
          ASSERT_TRUE(before.ok() && windowed.ok() && after.ok());
          if (*before != *after) continue;
          EXPECT_DOUBLE_EQ(*windowed, *before) << "window " << window;
          compared = true;
        }
        EXPECT_TRUE(compared) << "the page cache kept changing; window " << window;
      }
    }
  }
  ::close(fd);
}

TEST(ResidencyTest, EdgeCasesAndErrors) {
  testing::TempDir dir;
  const std::string path = dir.Join("small.bin");
  testing::WriteBytes(path, Pattern(5000, 31));
  auto empty = CachedFraction(path, 100, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, 1.0);
  auto beyond = CachedFraction(path, 10000, 100);
  ASSERT_TRUE(beyond.ok());
  EXPECT_EQ(*beyond, 1.0);
  auto odd = CachedFraction(path, 4097, 1);  // unaligned start, inside the second page
  ASSERT_TRUE(odd.ok());
  EXPECT_GE(*odd, 0.0);
  EXPECT_LE(*odd, 1.0);

  auto missing = CachedFraction(dir.Join("missing.bin"), 0, 10);
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "missing.bin"));
}

// The public calls take any path: a FIFO (or a directory) is refused at once, not waited on for a
// writer that never comes.
TEST(ResidencyTest, AFifoOrADirectoryIsRefusedWithoutWaiting) {
  testing::TempDir dir;
  const std::string fifo = dir.Join("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  const Result<double> cached = ::tensorferry::CachedFraction(fifo);
  EXPECT_EQ(cached.status().code(), Code::kInvalidArgument) << cached.status().ToString();
  EXPECT_EQ(cached.status().message(), fifo + ": not a regular file");
  const Status dropped = DropFromPageCache(fifo);
  EXPECT_EQ(dropped.code(), Code::kInvalidArgument) << dropped.ToString();
  EXPECT_EQ(dropped.message(), fifo + ": not a regular file");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  const Status directory = DropFromPageCache(dir.path());
  EXPECT_EQ(directory.code(), Code::kInvalidArgument) << directory.ToString();
  EXPECT_EQ(directory.message(), dir.path() + ": is a directory");
  EXPECT_EQ(DropFromPageCache(dir.Join("missing")).code(), Code::kNotFound);
  const std::string file = dir.Join("file.bin");
  testing::WriteBytes(file, Pattern(5000, 3));
  EXPECT_TRUE(DropFromPageCache(file).ok());
  EXPECT_TRUE(::tensorferry::CachedFraction(file).ok());
}

// A regular file another process holds a write lease on (Samba's oplocks, NFS delegations): the
// open waits for the lease's break, as `cat` does, where the non-blocking open (for FIFOs) failed
// at once with EAGAIN. Here the holder takes the break's SIGIO and dies, which ends its lease.
TEST(ResidencyTest, AFileUnderAnotherProcesssWriteLeaseIsOpenedAfterTheBreak) {
  testing::TempDir dir;
  const std::string file = dir.Join("leased.bin");
  testing::WriteBytes(file, Pattern(5000, 4));
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const int fd = ::open(file.c_str(), O_RDWR);
    const char ok = fd >= 0 && ::fcntl(fd, F_SETLEASE, F_WRLCK) == 0 ? '1' : '0';
    if (::write(ready[1], &ok, 1) != 1) ::_exit(1);
    ::pause();  // the break's SIGIO ends it
    ::_exit(0);
  }
  ::close(ready[1]);
  char ok = '0';
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ::close(ready[0]);
  if (ok != '1') {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    GTEST_SKIP() << "no write lease on this file system";
  }
  auto opened = Env::Default()->OpenRandomAccess(file);
  EXPECT_TRUE(opened.ok()) << opened.status().ToString();
  EXPECT_TRUE(::tensorferry::CachedFraction(file).ok());
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

}  // namespace
}  // namespace tensorferry::io

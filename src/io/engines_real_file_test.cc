// Both engines over real files (the io_uring engine only uses its ring for files with a
// descriptor, so MemoryEnv tests exercise its fallback; these exercise the ring), buffered and
// with O_DIRECT descriptors: random offsets and lengths, destinations congruent with the file
// offset (direct middle) or not (buffered fallback), EOF, concurrent callers.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io/engine_common.h"
#include "io/read_engine.h"
#include "testing/test_util.h"

namespace tensorferry::io {
namespace {

std::string Bytes(size_t size, unsigned seed) {
  std::string s(size, '\0');
  std::mt19937 rng(seed);
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

struct EngineParam {
  const char* name;
  bool uring;
  bool direct;
};

class RealFileEngineTest : public ::testing::TestWithParam<EngineParam> {
 protected:
  void SetUp() override {
    if (GetParam().uring && !IoUringAvailable().ok()) {
      GTEST_SKIP() << IoUringAvailable().ToString();
    }
  }
  std::unique_ptr<ReadEngine> Make(unsigned threads, unsigned depth = 4) {
    auto e = GetParam().uring ? MakeIoUringEngine(threads, depth) : MakePreadEngine(threads);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
};

// Page-aligned scratch memory, so destinations can be made congruent with file offsets.
struct Aligned {
  explicit Aligned(size_t n) : size(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = static_cast<std::byte*>(p);
  }
  ~Aligned() { ::munmap(data, size); }
  std::byte* data;
  size_t size;
};

TEST_P(RealFileEngineTest, RandomRequestsByteExact) {
  testing::TempDir dir;
  std::vector<std::string> contents, paths;
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  std::vector<std::unique_ptr<DirectFile>> direct;
  for (unsigned i = 0; i < 3; ++i) {
    std::string name = "f";
    name += std::to_string(i);
    paths.push_back(dir.Join(name));
    contents.push_back(Bytes(300007 + i * 40961, i));
    testing::WriteBytes(paths.back(), contents.back());
    files.push_back(Env::Default()->OpenRandomAccess(paths.back()).value());
    auto d = DirectFile::Open(*files.back());
    direct.push_back(d.ok() ? std::move(d).value() : nullptr);
  }
  for (unsigned threads : {1u, 2u, 5u}) {
    auto engine = Make(threads, threads == 1 ? 3 : 8);
    std::mt19937_64 rng(threads);
    // Each request gets its own slot of the scratch buffer, 1 MiB apart.
    const size_t n = 60;
    Aligned scratch(n << 20);
    std::vector<ReadRequest> requests;
    std::vector<std::pair<size_t, uint64_t>> origin;
    for (size_t i = 0; i < n; ++i) {
      const size_t f = i % 3;
      const uint64_t size = contents[f].size();
      const uint64_t off = rng() % size;
      const uint64_t len = std::min<uint64_t>(rng() % (size - off + 1), (1u << 20) - 8192);
      // Half the destinations congruent with the offset modulo 4096 (direct middle possible).
      const uint64_t shift = i % 2 ? off % 4096 : (off + 1) % 4096;
      std::byte* dst = scratch.data + (i << 20) + shift;
      const int fd = GetParam().direct && direct[f] ? direct[f]->fd() : -1;
      requests.push_back({files[f].get(), off, {dst, static_cast<size_t>(len)}, fd});
      origin.emplace_back(f, off);
    }
    ASSERT_TRUE(engine->Execute(requests).ok());
    for (size_t i = 0; i < n; ++i) {
      const auto& [f, off] = origin[i];
      ASSERT_EQ(
          std::memcmp(requests[i].dst.data(), contents[f].data() + off, requests[i].dst.size()), 0)
          << "request " << i;
    }
    const EngineStats s = engine->stats();
    if (GetParam().direct && direct[0]) {
      EXPECT_GT(s.direct_bytes, 0u);
    } else {
      EXPECT_EQ(s.direct_bytes, 0u);
    }
  }
}

TEST_P(RealFileEngineTest, EndOfFileNamesFileAndOffset) {
  testing::TempDir dir;
  const std::string path = dir.Join("short.safetensors");
  testing::WriteBytes(path, Bytes(20000, 9));
  auto file = Env::Default()->OpenRandomAccess(path).value();
  auto d = DirectFile::Open(*file);
  Aligned scratch(1 << 20);
  // Congruent destination, crossing the end: the direct middle or the tail hits EOF.
  const ReadRequest past{file.get(),
                         8192,
                         {scratch.data + 0, 16384},
                         GetParam().direct && d.ok() && *d ? (*d)->fd() : -1};
  auto engine = Make(2);
  const Status s = engine->Execute({&past, 1});
  EXPECT_EQ(s.code(), Code::kUnexpectedEof) << s.ToString();
  std::string expected = path;
  expected += ": unexpected end of file at offset";
  EXPECT_NE(s.message().find(expected), std::string::npos) << s.ToString();
  // Head, direct middle and tail all reach past the end (the tail starts past it): the offset
  // named is where the file ends, whichever piece finished first.
  for (int round = 0; round < 5; ++round) {
    const ReadRequest across{file.get(),
                             100,
                             {scratch.data + 100, 65536},
                             GetParam().direct && d.ok() ? (*d)->fd() : -1};
    const Status e = engine->Execute({&across, 1});
    EXPECT_EQ(e.code(), Code::kUnexpectedEof) << e.ToString();
    EXPECT_NE(e.message().find(path + ": unexpected end of file at offset 20000"),
              std::string::npos)
        << e.ToString();
  }
  // Usable afterwards.
  const ReadRequest ok{file.get(), 100, {scratch.data + 100, 5000}, -1};
  EXPECT_TRUE(engine->Execute({&ok, 1}).ok());
}

TEST_P(RealFileEngineTest, ConcurrentCallers) {
  testing::TempDir dir;
  const std::string path = dir.Join("shared");
  const std::string content = Bytes(1 << 20, 3);
  testing::WriteBytes(path, content);
  auto file = Env::Default()->OpenRandomAccess(path).value();
  auto engine = Make(3);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int round = 0; round < 10; ++round) {
        std::vector<std::vector<std::byte>> dst(20);
        std::vector<ReadRequest> requests;
        for (size_t i = 0; i < dst.size(); ++i) {
          const uint64_t off = (static_cast<uint64_t>(t) * 7919 + i * 104729 + round) % (1 << 19);
          dst[i].resize(1000 + i * 37);
          requests.push_back({file.get(), off, dst[i], -1});
        }
        if (!engine->Execute(requests).ok()) ++failures;
        for (size_t i = 0; i < dst.size(); ++i) {
          if (std::memcmp(dst[i].data(), content.data() + requests[i].offset, dst[i].size())) {
            ++failures;
          }
        }
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(failures.load(), 0);
}

// The landed hook (integrity checks as bytes land): a buffered request is handed over in pieces of
// at most kLandedPieceBytes, in order, each already holding the file's bytes when the hook runs;
// a request split for O_DIRECT is handed over whole once it landed. An error of the hook is the
// request's, and the engine stays usable.
TEST_P(RealFileEngineTest, LandedHookSeesEveryPieceAsItLands) {
  testing::TempDir dir;
  const std::string path = dir.Join("big");
  const std::string content = Bytes(5 * kLandedPieceBytes + 12345, 4);
  testing::WriteBytes(path, content);
  auto file = Env::Default()->OpenRandomAccess(path).value();
  auto d = DirectFile::Open(*file);
  const int direct_fd = GetParam().direct && d.ok() ? (*d)->fd() : -1;
  Aligned scratch(content.size() + (1 << 20));
  std::mutex mu;
  std::map<const std::byte*, std::vector<std::pair<uint64_t, uint64_t>>> seen;  // by request dst
  std::vector<const std::byte*> starts;
  int mismatches = 0;
  std::function<Status(const ReadRequest&)> hook = [&](const ReadRequest& piece) {
    std::lock_guard<std::mutex> lock(mu);
    if (std::memcmp(piece.dst.data(), content.data() + piece.offset, piece.dst.size()) != 0) {
      ++mismatches;
    }
    // The request this piece belongs to: the last start at or before it.
    const std::byte* owner = nullptr;
    for (const std::byte* s : starts) {
      if (s <= piece.dst.data() && (owner == nullptr || s > owner)) owner = s;
    }
    seen[owner].emplace_back(piece.offset, piece.dst.size());
    return Status::Ok();
  };
  // Three requests: congruent with the file (a direct middle when there is a descriptor), and two
  // buffered ones (no descriptor).
  const uint64_t lengths[] = {3 * kLandedPieceBytes + 4096 + 100, 2 * kLandedPieceBytes + 7, 999};
  const uint64_t offsets[] = {4096 * 3 + 100, 50, kLandedPieceBytes * 4};
  std::vector<ReadRequest> requests;
  std::byte* at = scratch.data + 100;  // congruent with offsets[0] modulo 4096
  for (int i = 0; i < 3; ++i) {
    requests.push_back(
        {file.get(), offsets[i], {at, lengths[i]}, i == 0 ? direct_fd : -1, nullptr, &hook});
    starts.push_back(at);
    at += (lengths[i] + 8191) / 4096 * 4096;
  }
  auto engine = Make(2, 6);
  ASSERT_TRUE(engine->Execute(requests).ok());
  EXPECT_EQ(mismatches, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& pieces = seen[starts[i]];
    ASSERT_FALSE(pieces.empty()) << i;
    if (i == 0 && direct_fd >= 0) {
      ASSERT_EQ(pieces.size(), 1u);  // direct: whole, once
      EXPECT_EQ(pieces[0], std::make_pair(offsets[0], lengths[0]));
      continue;
    }
    uint64_t next = offsets[i];
    for (const auto& [offset, size] : pieces) {
      EXPECT_EQ(offset, next) << "request " << i << ": pieces in order, none missing";
      EXPECT_GT(size, 0u);
      EXPECT_LE(size, kLandedPieceBytes);
      next = offset + size;
    }
    EXPECT_EQ(next, offsets[i] + lengths[i]) << i;
  }
  // A failing hook fails the request with its error.
  std::function<Status(const ReadRequest&)> refuse = [](const ReadRequest& piece) {
    return piece.offset >= 50 + kLandedPieceBytes
               ? Status(Code::kChecksumMismatch, "bad piece at " + std::to_string(piece.offset))
               : Status::Ok();
  };
  const ReadRequest bad{file.get(), 50,      {scratch.data, 2 * kLandedPieceBytes},
                        -1,         nullptr, &refuse};
  const Status s = engine->Execute({&bad, 1});
  EXPECT_EQ(s.code(), Code::kChecksumMismatch) << s.ToString();
  EXPECT_EQ(s.message(), "bad piece at " + std::to_string(50 + kLandedPieceBytes));
  const ReadRequest ok{file.get(), 100, {scratch.data + 100, 5000}, -1};
  EXPECT_TRUE(engine->Execute({&ok, 1}).ok());
}

// Requests read whole (O_DIRECT) with a landed hook, more of them than the engine keeps in flight:
// io_uring runs each hook after submitting the next reads, pread after each read. Every request is
// checked exactly once, after its bytes landed, and a failing check fails the load with its error.
TEST_P(RealFileEngineTest, LandedHookOfWholeRequestsRunsOncePerRequest) {
  testing::TempDir dir;
  const std::string path = dir.Join("direct");
  constexpr uint64_t kPiece = 8192;
  constexpr int kRequests = 24;
  const std::string content = Bytes(kRequests * 2 * kPiece, 9);
  testing::WriteBytes(path, content);
  auto file = Env::Default()->OpenRandomAccess(path).value();
  auto d = DirectFile::Open(*file);
  const int direct_fd = GetParam().direct && d.ok() ? (*d)->fd() : -1;
  Aligned scratch(kRequests * kPiece);
  std::mutex mu;
  std::map<uint64_t, int> calls;  // by request offset
  int mismatches = 0;
  uint64_t refused_offset = UINT64_MAX;
  std::function<Status(const ReadRequest&)> hook = [&](const ReadRequest& r) {
    std::lock_guard<std::mutex> lock(mu);
    if (std::memcmp(r.dst.data(), content.data() + r.offset, r.dst.size()) != 0) ++mismatches;
    ++calls[r.offset];
    return r.offset == refused_offset
               ? Status(Code::kChecksumMismatch, "bad request at " + std::to_string(r.offset))
               : Status::Ok();
  };
  std::vector<ReadRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    requests.push_back({file.get(),
                        2 * kPiece * i,
                        {scratch.data + kPiece * i, kPiece},
                        direct_fd,
                        nullptr,
                        &hook});
  }
  auto engine = Make(2, 6);
  ASSERT_TRUE(engine->Execute(requests).ok());
  EXPECT_EQ(mismatches, 0);
  for (const auto& r : requests) {
    // Whole when direct; a buffered request is handed over in one piece here (8 KiB).
    EXPECT_EQ(calls[r.offset], 1) << r.offset;
  }
  refused_offset = 2 * kPiece * 17;
  const Status s = engine->Execute(requests);
  EXPECT_EQ(s.code(), Code::kChecksumMismatch) << s.ToString();
  EXPECT_EQ(s.message(), "bad request at " + std::to_string(refused_offset));
  refused_offset = UINT64_MAX;
  calls.clear();
  ASSERT_TRUE(engine->Execute(requests).ok());
  EXPECT_EQ(calls.size(), static_cast<size_t>(kRequests));
}

INSTANTIATE_TEST_SUITE_P(Engines, RealFileEngineTest,
                         ::testing::Values(EngineParam{"pread", false, false},
                                           EngineParam{"pread_direct", false, true},
                                           EngineParam{"io_uring", true, false},
                                           EngineParam{"io_uring_direct", true, true}),
                         [](const auto& p) { return std::string(p.param.name); });

TEST(DirectSplitTest, HeadMiddleTail) {
  std::byte* base = reinterpret_cast<std::byte*>(uintptr_t{1} << 20);
  ReadRequest r{nullptr, 5000, {base + 5000 % 4096, 20000}, 3};
  DirectSplit s = SplitForDirect(r);
  EXPECT_TRUE(s.direct);
  EXPECT_EQ(s.head, 8192u - 5000u);
  EXPECT_EQ(s.middle, 24576u - 8192u);
  r.dst = {base + 1, 20000};  // not congruent
  EXPECT_FALSE(SplitForDirect(r).direct);
  r = ReadRequest{nullptr, 5000, {base + 5000 % 4096, 2000}, 3};  // no whole block inside
  EXPECT_FALSE(SplitForDirect(r).direct);
  r = ReadRequest{nullptr, 8192, {base, 8192}, -1};  // no descriptor
  EXPECT_FALSE(SplitForDirect(r).direct);
  r.direct_fd = 3;
  s = SplitForDirect(r);
  EXPECT_TRUE(s.direct);
  EXPECT_EQ(s.head, 0u);
  EXPECT_EQ(s.middle, 8192u);
}

// The O_DIRECT descriptor is the opened file's, not whatever its path names now (another inode
// under the same name; the load's own check reports the replacement).
TEST(DirectSplitTest, DirectFileOpensTheFileNotItsPath) {
  testing::TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  testing::WriteBytes(path, Bytes(10000, 1));
  auto file = Env::Default()->OpenRandomAccess(path).value();
  std::string old = path;
  old += ".old";
  ASSERT_EQ(std::rename(path.c_str(), old.c_str()), 0);
  testing::WriteBytes(path, Bytes(10000, 2));  // another inode under the same name
  auto d = DirectFile::Open(*file);
  if (!d.ok()) {  // tmpfs refuses O_DIRECT
    EXPECT_EQ(d.status().code(), Code::kUnsupported) << d.status().ToString();
    return;
  }
  struct stat opened, direct;
  ASSERT_EQ(::fstat(file->native_handle(), &opened), 0);
  ASSERT_EQ(::fstat((*d)->fd(), &direct), 0);
  EXPECT_EQ(direct.st_ino, opened.st_ino);
  EXPECT_EQ(direct.st_dev, opened.st_dev);
}

// --- EINTR and EAGAIN: retried, but not forever (TransientRetry, engine_common.h) -------------

TEST(TransientRetryTest, BoundedRetriesThatStartOverOnProgress) {
  TransientRetry retry;
  EXPECT_FALSE(retry.Again(EIO));
  EXPECT_FALSE(retry.Again(EINVAL));
  for (unsigned i = 0; i < TransientRetry::kMaxIntr; ++i) ASSERT_TRUE(retry.Again(EINTR)) << i;
  EXPECT_FALSE(retry.Again(EINTR));
  retry.Progress();
  EXPECT_TRUE(retry.Again(EINTR));
  const auto start = std::chrono::steady_clock::now();
  for (unsigned i = 0; i < TransientRetry::kMaxAgain; ++i) ASSERT_TRUE(retry.Again(EAGAIN)) << i;
  EXPECT_FALSE(retry.Again(EAGAIN));
  const auto waited = std::chrono::steady_clock::now() - start;
  // 100 us, 200 us, ... at most 10 ms each: 0.505 s in all; never a hang.
  EXPECT_GE(waited, std::chrono::milliseconds(500));
  EXPECT_LT(waited, std::chrono::seconds(10));
  EXPECT_EQ(TransientRetry::AgainBackoff(1), std::chrono::microseconds(100));
  EXPECT_EQ(TransientRetry::AgainBackoff(250), std::chrono::milliseconds(10));
  retry.Progress();
  EXPECT_TRUE(retry.Again(EAGAIN));
}

// A file system that answers EAGAIN (a FUSE daemon) or EINTR: the io_uring engine submits the
// read again a bounded number of times, then fails as the pread engine does (kIoError naming
// file, length, offset and errno); a cancelled load stops retrying. The engine's completions go
// through a filter that rewrites their results (the read itself happened).
struct UringFaultFixture {
  testing::TempDir dir;
  std::string path = dir.Join("eagain.safetensors");
  std::string content = Bytes(64 << 10, 5);
  std::unique_ptr<RandomAccessFile> file;
  std::vector<std::byte> dst = std::vector<std::byte>(4096);
  std::atomic<bool> cancel{false};
  std::atomic<unsigned> calls{0};

  UringFaultFixture() {
    testing::WriteBytes(path, content);
    file = Env::Default()->OpenRandomAccess(path).value();
  }
  ReadRequest Request() {
    ReadRequest r{file.get(), 8192, {dst.data(), dst.size()}, -1};
    r.cancel = &cancel;
    return r;
  }
  // An engine whose completions get `answer(call number from 1, real result)`.
  std::unique_ptr<ReadEngine> Engine(std::function<int(unsigned call, int res)> answer) {
    auto e = MakeIoUringEngineForTesting(
        1, 4, [this, answer](int res) { return answer(calls.fetch_add(1) + 1, res); });
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
};

TEST(UringEngineFaults, PersistentEagainFailsLikeAPreadInsteadOfHanging) {
  if (!IoUringAvailable().ok()) GTEST_SKIP() << IoUringAvailable().ToString();
  UringFaultFixture f;
  auto engine = f.Engine([](unsigned, int) { return -EAGAIN; });
  const ReadRequest r = f.Request();
  const auto start = std::chrono::steady_clock::now();
  const Status s = engine->Execute({&r, 1});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_EQ(s.message(), f.path +
                             ": read of 4096 bytes at offset 8192 failed: Resource temporarily "
                             "unavailable (errno 11)");
  EXPECT_EQ(f.calls.load(), TransientRetry::kMaxAgain + 1);
  EXPECT_EQ(engine->stats().read_calls, TransientRetry::kMaxAgain + 1);
}

TEST(UringEngineFaults, TransientEagainAndEintrAreRetried) {
  if (!IoUringAvailable().ok()) GTEST_SKIP() << IoUringAvailable().ToString();
  UringFaultFixture f;
  auto engine = f.Engine([](unsigned call, int res) {
    return call <= 3 ? -EAGAIN : call <= 6 ? -EINTR : res;
  });
  const ReadRequest r = f.Request();
  ASSERT_TRUE(engine->Execute({&r, 1}).ok());
  EXPECT_EQ(std::memcmp(f.dst.data(), f.content.data() + 8192, f.dst.size()), 0);
  EXPECT_EQ(f.calls.load(), 7u);
}

TEST(UringEngineFaults, PersistentEintrFailsToo) {
  if (!IoUringAvailable().ok()) GTEST_SKIP() << IoUringAvailable().ToString();
  UringFaultFixture f;
  auto engine = f.Engine([](unsigned, int) { return -EINTR; });
  const ReadRequest r = f.Request();
  const Status s = engine->Execute({&r, 1});
  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  EXPECT_EQ(s.message(), f.path +
                             ": read of 4096 bytes at offset 8192 failed: Interrupted system "
                             "call (errno 4)");
  EXPECT_EQ(f.calls.load(), TransientRetry::kMaxIntr + 1);
}

TEST(UringEngineFaults, CancelStopsTheRetries) {
  if (!IoUringAvailable().ok()) GTEST_SKIP() << IoUringAvailable().ToString();
  UringFaultFixture f;
  auto engine = f.Engine([&f](unsigned call, int) {
    if (call == 3) f.cancel.store(true);
    return -EAGAIN;
  });
  const ReadRequest r = f.Request();
  const Status s = engine->Execute({&r, 1});
  EXPECT_EQ(s.code(), Code::kCancelled) << s.ToString();
  EXPECT_EQ(f.calls.load(), 3u);
}

// Kernels 5.1-5.5 set up rings but have no IORING_OP_READ (nor the probe that lists operations):
// io_uring is reported unavailable there, with the reason, and auto reads with pread.
TEST(UringEngineFaults, AKernelWithoutIoringOpReadIsUnavailable) {
  EXPECT_TRUE(CheckIoUringOps({.listed = true, .read = true}).ok());
  const Status old = CheckIoUringOps({.listed = false, .read = false});
  EXPECT_EQ(old.code(), Code::kUnsupported);
  EXPECT_NE(old.message().find("IORING_REGISTER_PROBE"), std::string::npos) << old.ToString();
  EXPECT_NE(old.message().find("IORING_OP_READ (Linux 5.6+)"), std::string::npos) << old.ToString();
  const Status no_read = CheckIoUringOps({.listed = true, .read = false});
  EXPECT_EQ(no_read.code(), Code::kUnsupported);
  EXPECT_EQ(no_read.message(),
            "io_uring: the kernel does not support IORING_OP_READ (Linux 5.6+), which every read "
            "needs");
  // This kernel: where io_uring is available, the probe found IORING_OP_READ.
  const Status here = IoUringAvailable();
  if (here.ok()) {
    EXPECT_TRUE(MakeIoUringEngine(1, 4).ok());
  }
}

}  // namespace
}  // namespace tensorferry::io

// Transient mappings (MappedFile::Use::kTransient): read-only, no lease, and DropPages takes what
// was copied out of the process again. (The guarded copy-on-write mappings are tested through the
// Loader's mmap engine, src/loader/loader_test.cc "LoaderEngines".) Pages that cannot be read: an
// I/O error told from a file that shrank (Populate, the SIGBUS handler, CheckMappedFiles).
#include "io/mapped_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/userfaultfd.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "tensorferry/env.h"
#include "tensorferry/mapping.h"
#include "testing/test_util.h"

namespace tensorferry::io {
namespace {

constexpr uint64_t kPage = 4096;

using testing::MappedRss;

struct MappedFileFixture {
  testing::TempDir dir;
  std::string path = dir.Join("data.bin");
  std::string bytes;
  std::unique_ptr<RandomAccessFile> file;

  explicit MappedFileFixture(uint64_t size) {
    bytes.resize(size);
    for (uint64_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 131 + i / 4096) & 0xff);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(size));
    file = Env::Default()->OpenRandomAccess(path).value();
  }
  // Touches every page of `map` and checks its bytes are the file's.
  void ReadAll(const MappedFile& map) const {
    ASSERT_EQ(map.size(), bytes.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(map.data()), map.size()), bytes);
  }
};

TEST(MappedFileTransient, DropPagesTakesWholePagesOutOfTheProcessAndTheBytesStay) {
  MappedFileFixture f(64 * kPage);
  auto map = MappedFile::Map(*f.file, f.bytes.size(), MappedFile::Use::kTransient);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  const MappedFile& m = **map;
  EXPECT_FALSE(m.leased()) << "nothing handed out: no lease";
  f.ReadAll(m);
  EXPECT_EQ(MappedRss(m.data()), 64 * kPage);
  // A range that is not page aligned: only the whole pages inside it go (pages 2..9 of
  // [100 + 1 page, 100 + 10 pages)).
  m.DropPages(kPage + 100, 9 * kPage);
  EXPECT_EQ(MappedRss(m.data()), 56 * kPage);
  m.DropPages(0, f.bytes.size());
  EXPECT_EQ(MappedRss(m.data()), 0u);
  m.DropPages(f.bytes.size(), kPage);  // past the end: nothing
  // Touched again, the pages come back from the page cache with the file's bytes.
  f.ReadAll(m);
  EXPECT_EQ(MappedRss(m.data()), 64 * kPage);
  EXPECT_EQ(m.faults(), 0u);
}

TEST(MappedFileTransient, ViewMappingsKeepTheirPages) {
  MappedFileFixture f(16 * kPage);
  auto map = MappedFile::Map(*f.file, f.bytes.size());  // kViews: the caller's tensors
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  f.ReadAll(**map);
  (*map)->DropPages(0, f.bytes.size());
  EXPECT_EQ(MappedRss((*map)->data()), 16 * kPage) << "views' pages are never dropped";
}

// --- pages that cannot be read ----------------------------------------------------------------

// A file of `pages` pages on tmpfs (/dev/shm), all holes (ftruncate): no page is in memory until
// it is touched. Removed on destruction.
struct TmpfsFile {
  std::string dir;
  std::string path;
  std::unique_ptr<RandomAccessFile> file;
  explicit TmpfsFile(uint64_t pages) {
    char name[] = "/dev/shm/tensorferry-test-XXXXXX";
    if (::mkdtemp(name) == nullptr) return;
    dir = name;
    path = dir + "/model.safetensors";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    const bool sized = ::ftruncate(fd, static_cast<off_t>(pages * kPage)) == 0;
    ::close(fd);
    if (sized) file = Env::Default()->OpenRandomAccess(path).value();
  }
  ~TmpfsFile() {
    file.reset();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::remove_all(dir, ec);
  }
  TmpfsFile(const TmpfsFile&) = delete;
  TmpfsFile& operator=(const TmpfsFile&) = delete;
};

// Makes the pages of [addr, addr + length) of a tmpfs file's mapping fail to read while the file
// keeps its size, as the kernel fails a page it cannot read (EIO: a bad sector, an NFS or FUSE
// error): a userfaultfd with UFFD_FEATURE_SIGBUS answers each fault on a page not in memory with
// SIGBUS (MADV_POPULATE_READ: EFAULT). Where only user-mode faults may be registered
// (vm.unprivileged_userfaultfd = 0, not root), MADV_POPULATE_READ is not affected.
class UnreadablePages {
 public:
  UnreadablePages(const std::byte* addr, uint64_t length) {
    fd_ = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
#ifdef UFFD_USER_MODE_ONLY
    if (fd_ < 0 && errno == EPERM) {
      fd_ = static_cast<int>(
          ::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
      kernel_faults_ = false;
    }
#endif
    if (fd_ < 0) {
      why_ = std::string("userfaultfd: ") + std::strerror(errno);
      return;
    }
    uffdio_api api{};
    api.api = UFFD_API;
    api.features = UFFD_FEATURE_SIGBUS;
    if (::ioctl(fd_, UFFDIO_API, &api) != 0) {
      why_ = std::string("UFFDIO_API with UFFD_FEATURE_SIGBUS: ") + std::strerror(errno);
      return;
    }
    uffdio_register reg{};
    reg.range.start = reinterpret_cast<uintptr_t>(addr);
    reg.range.len = length;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (::ioctl(fd_, UFFDIO_REGISTER, &reg) != 0) {
      why_ = std::string("UFFDIO_REGISTER of a tmpfs mapping: ") + std::strerror(errno);
      return;
    }
    ok_ = true;
  }
  ~UnreadablePages() {
    if (fd_ >= 0) ::close(fd_);
  }
  UnreadablePages(const UnreadablePages&) = delete;
  UnreadablePages& operator=(const UnreadablePages&) = delete;
  bool ok() const {
    return ok_;
  }
  bool kernel_faults() const {
    return ok_ && kernel_faults_;
  }
  const std::string& why() const {
    return why_;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
  bool kernel_faults_ = true;
  std::string why_;
};

// MADV_POPULATE_READ fails with EFAULT for a page that could not be read as for one past the end
// of a file that shrank: the file, still long enough, says which (kIoError, not "past its end").
TEST(MappedFileFaults, PopulateTellsAnUnreadablePageFromAFileThatShrank) {
  TmpfsFile f(16);
  if (!f.file) GTEST_SKIP() << "no /dev/shm here";
  auto map = MappedFile::Map(*f.file, 16 * kPage);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  {
    UnreadablePages bad((*map)->data() + 3 * kPage, kPage);
    if (!bad.kernel_faults()) GTEST_SKIP() << (bad.ok() ? "user-mode faults only" : bad.why());
    const Status s = (*map)->Populate(100, 8 * kPage);
    EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
    EXPECT_EQ(s.message(), f.path +
                               ": could not read mapped bytes [0, 32868) (an I/O error; the file "
                               "still has 65536 bytes)");
  }
  EXPECT_TRUE((*map)->Populate(100, 8 * kPage).ok()) << "readable again";
  EXPECT_EQ((*map)->faults(), 0u) << "MADV_POPULATE_READ reports; nothing faulted";
  // A file that did shrink: the pages past its new end. (A mapping without a lease: with one,
  // the truncation first copies the mapping into private memory.)
  auto plain = MappedFile::Map(*f.file, 16 * kPage, MappedFile::Use::kTransient);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  ASSERT_EQ(::truncate(f.path.c_str(), 5000), 0);
  const Status shrank = (*plain)->Populate(0, 16 * kPage);
  EXPECT_EQ(shrank.code(), Code::kUnexpectedEof) << shrank.ToString();
  EXPECT_EQ(shrank.message(), f.path +
                                  ": file shrank while mapped: mapped bytes [0, 65536) reach past "
                                  "its end (it has 5000 bytes now)");
}

// A page touched through a mapping that the kernel cannot read raises SIGBUS as a vanished page
// does: the handler repairs it with zeros in both cases, but says which it was (the file still
// has the page: an I/O error), on stderr, in FaultError and in CheckMappedFiles (kIoError).
TEST(MappedFileFaults, SigbusOfAnUnreadablePageSaysIoErrorNotShrank) {
  (void)CheckMappedFiles();  // faults left unreported by earlier tests
  TmpfsFile f(16);
  if (!f.file) GTEST_SKIP() << "no /dev/shm here";
  auto map = MappedFile::Map(*f.file, 16 * kPage);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  UnreadablePages bad((*map)->data() + 5 * kPage, kPage);
  if (!bad.ok()) GTEST_SKIP() << bad.why();
  const volatile std::byte* p = (*map)->data();
  ::testing::internal::CaptureStderr();
  const std::byte got = p[5 * kPage + 7];
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(got, std::byte{0});
  const std::string what =
      "mapped bytes from offset 20480 could not be read (an I/O error; the file still has 65536 "
      "bytes) and ";
  EXPECT_EQ(said, "tensorferry: error: " + f.path + ": " + what + "now read as zeros\n");
  EXPECT_EQ((*map)->faults(), 1u);
  EXPECT_EQ((*map)->first_fault_offset(), 5 * kPage);
  const Status fault = (*map)->FaultError();
  EXPECT_EQ(fault.code(), Code::kIoError);
  EXPECT_EQ(fault.message(), f.path + ": " + what + "read as zeros");
  const Status checked = CheckMappedFiles();
  EXPECT_EQ(checked.code(), Code::kIoError);
  EXPECT_EQ(checked.message(),
            f.path + ": " + what + "read as zeros (1 mapping(s) affected); reload the tensors");
  EXPECT_TRUE(CheckMappedFiles().ok()) << "reported once";
}

// The file shrank under the mapping: said so, with its size then. And where the path no longer
// names the mapped file (renamed), the handler cannot ask it and says both causes.
TEST(MappedFileFaults, SigbusPastAShorterEndSaysShrankAndAnUnaskableFileSaysEither) {
  (void)CheckMappedFiles();
  TmpfsFile f(16);
  if (!f.file) GTEST_SKIP() << "no /dev/shm here";
  auto map = MappedFile::Map(*f.file, 16 * kPage, MappedFile::Use::kTransient);  // no lease
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  ASSERT_EQ(::truncate(f.path.c_str(), 100), 0);
  const volatile std::byte* p = (*map)->data();
  ::testing::internal::CaptureStderr();
  const std::byte past_end = p[9 * kPage];
  std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(said, "tensorferry: error: " + f.path +
                      ": file shrank while its tensors were mapped: bytes from offset 36864 now "
                      "read as zeros (the file has 100 bytes now)\n");
  EXPECT_EQ(past_end, std::byte{0});
  Status s = CheckMappedFiles();
  EXPECT_EQ(s.code(), Code::kUnexpectedEof);
  EXPECT_EQ(s.message(), f.path +
                             ": file shrank while its tensors were mapped: bytes from offset "
                             "36864 read as zeros (the file has 100 bytes now) (1 mapping(s) "
                             "affected); reload the tensors");
  EXPECT_EQ((*map)->FaultError().code(), Code::kUnexpectedEof);

  TmpfsFile g(16);
  ASSERT_TRUE(g.file);
  auto other = MappedFile::Map(*g.file, 16 * kPage, MappedFile::Use::kTransient);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  ASSERT_EQ(::rename(g.path.c_str(), (g.path + ".moved").c_str()), 0);
  ASSERT_EQ(::truncate((g.path + ".moved").c_str(), 0), 0);
  const volatile std::byte* q = (*other)->data();
  ::testing::internal::CaptureStderr();
  const std::byte unaskable = q[2 * kPage];
  said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(unaskable, std::byte{0});
  EXPECT_EQ(said, "tensorferry: error: " + g.path +
                      ": mapped bytes from offset 8192 could not be read (the file shrank, or an "
                      "I/O error) and now read as zeros\n");
  s = CheckMappedFiles();
  EXPECT_EQ(s.code(), Code::kUnexpectedEof);
  EXPECT_NE(s.message().find("(the file shrank, or an I/O error)"), std::string::npos)
      << s.ToString();
}

// CheckMappedFiles names the file that faulted even when its mapping is gone and its slot holds
// another file's mapping by the time of the report; while the faulted mapping lives, it names
// what the page held (the mapping's About, asked for the faulted page).
TEST(MappedFileFaults, TheReportNamesTheFaultedFileAfterItsSlotIsReusedAndWhatThePageHeld) {
  (void)CheckMappedFiles();
  TmpfsFile a(8);
  TmpfsFile b(8);
  if (!a.file || !b.file) GTEST_SKIP() << "no /dev/shm here";
  uint64_t asked_offset = UINT64_MAX;
  uint64_t asked_length = 0;
  auto about = [&](uint64_t offset, uint64_t length) {
    asked_offset = offset;
    asked_length = length;
    return std::string("tensor \"w\"");
  };
  {
    auto map = MappedFile::Map(*a.file, 8 * kPage, MappedFile::Use::kTransient, about);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    ASSERT_EQ(::truncate(a.path.c_str(), 2 * kPage), 0);
    const volatile std::byte* p = (*map)->data();
    ::testing::internal::CaptureStderr();
    const std::byte first = p[5 * kPage + 1];
    EXPECT_EQ(first, std::byte{0});
    ::testing::internal::GetCapturedStderr();
    // While the mapping lives: its file, and what the page held.
    const Status live = CheckMappedFiles();
    EXPECT_EQ(live.code(), Code::kUnexpectedEof);
    EXPECT_EQ(live.message(),
              a.path +
                  ": file shrank while its tensors were mapped: bytes from offset 20480 read as "
                  "zeros (the file has 8192 bytes now) (1 mapping(s) affected); reload the "
                  "tensors; the read held tensor \"w\"");
    EXPECT_EQ(asked_offset, 5 * kPage);
    EXPECT_EQ(asked_length, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
    // A second fault in the same mapping is not a new event.
    ::testing::internal::CaptureStderr();
    const std::byte second = p[6 * kPage];
    EXPECT_EQ(second, std::byte{0});
    ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(CheckMappedFiles().ok());
  }
  // A fault in a new mapping of a (in the slot the first one left: the lowest free one), then that
  // mapping dropped and b mapped in the same slot before the report: the report names a.
  asked_offset = UINT64_MAX;
  ASSERT_EQ(::truncate(a.path.c_str(), 8 * kPage), 0);
  {
    auto map = MappedFile::Map(*a.file, 8 * kPage, MappedFile::Use::kTransient, about);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    ASSERT_EQ(::truncate(a.path.c_str(), kPage), 0);
    const volatile std::byte* p = (*map)->data();
    ::testing::internal::CaptureStderr();
    const std::byte faulted = p[3 * kPage];
    EXPECT_EQ(faulted, std::byte{0});
    ::testing::internal::GetCapturedStderr();
  }
  auto reused = MappedFile::Map(*b.file, 8 * kPage, MappedFile::Use::kTransient,
                                [](uint64_t, uint64_t) { return std::string("tensor \"b\""); });
  ASSERT_TRUE(reused.ok()) << reused.status().ToString();
  const Status later = CheckMappedFiles();
  EXPECT_EQ(later.code(), Code::kUnexpectedEof);
  EXPECT_EQ(later.message(),
            a.path +
                ": file shrank while its tensors were mapped: bytes from offset 12288 read as "
                "zeros (the file has 4096 bytes now) (1 mapping(s) affected); reload the tensors")
      << "b's path or b's tensors: the slot's present owner is not the one that faulted";
  EXPECT_EQ(asked_offset, UINT64_MAX) << "a gone mapping's About is not asked";
}

}  // namespace
}  // namespace tensorferry::io

// CachedFraction: how much of a byte range is in the page cache, measured with mmap + mincore.
//
// Mapping a file reads nothing; mincore only reports which of the mapped pages are resident. The
// range is examined in windows so a checkpoint of hundreds of gigabytes needs neither that much
// address space at once nor a residency vector of one byte per page for the whole file.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "io/engine_common.h"
#include "tensorferry/residency.h"

namespace tensorferry::io {
namespace {

constexpr uint64_t kWindow = uint64_t{1} << 30;  // bytes mapped at once

// Owns a file descriptor.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Owns a mapping.
class Mapping {
 public:
  Mapping(void* addr, size_t length) : addr_(addr), length_(length) {}
  ~Mapping() { ::munmap(addr_, length_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

 private:
  void* addr_;
  size_t length_;
};

}  // namespace

Result<double> CachedFraction(const std::string& path, uint64_t offset, uint64_t length) {
  int raw_fd;
  do {
    raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (raw_fd < 0 && errno == EINTR);
  if (raw_fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                  path + ": cannot open: " + ErrnoText(err));
  }
  const Fd fd(raw_fd);
  return CachedFraction(fd.get(), path, offset, length);
}

Result<double> CachedFraction(int fd, const std::string& path, uint64_t offset, uint64_t length) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    return Status(Code::kIoError, path + ": fstat failed: " + ErrnoText(err));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  // Clamp to the file: pages past the end cannot be mapped (SIGBUS) and cannot be cached either.
  const uint64_t end = offset >= file_size ? offset : offset + std::min(length, file_size - offset);
  if (end <= offset) return 1.0;  // nothing to read is fully resident

  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t resident = 0;
  uint64_t total = 0;
  std::vector<unsigned char> vec;
  for (uint64_t start = offset / page * page; start < end; start += kWindow) {
    const uint64_t len = std::min(kWindow, end - start);
    void* addr = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
    if (addr == MAP_FAILED) {
      const int err = errno;
      return Status(Code::kIoError, path + ": mmap of " + std::to_string(len) +
                                        " bytes at offset " + std::to_string(start) +
                                        " failed: " + ErrnoText(err));
    }
    const Mapping mapping(addr, len);
    const uint64_t pages = (len + page - 1) / page;
    vec.resize(pages);
    if (::mincore(addr, len, vec.data()) != 0) {
      const int err = errno;
      return Status(Code::kIoError, path + ": mincore at offset " + std::to_string(start) +
                                        " failed: " + ErrnoText(err));
    }
    // Only the lowest bit is defined; the others are reserved.
    resident += static_cast<uint64_t>(
        std::count_if(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; }));
    total += pages;
  }
  return static_cast<double>(resident) / static_cast<double>(total);
}

}  // namespace tensorferry::io

namespace tensorferry {

Result<double> CachedFraction(const std::string& path, uint64_t offset, uint64_t length) {
  return io::CachedFraction(path, offset, length);
}

Status DropFromPageCache(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                  path + ": cannot open: " + io::ErrnoText(err));
  }
  ::fdatasync(fd);
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (rc != 0) {
    return Status(Code::kIoError, path + ": posix_fadvise(DONTNEED) failed: " + io::ErrnoText(rc));
  }
  return Status::Ok();
}

}  // namespace tensorferry

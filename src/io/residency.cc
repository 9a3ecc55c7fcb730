// CachedFraction: how much of a byte range is in the page cache, measured with mmap + mincore.
//
// Mapping a file reads nothing; mincore only reports which of the mapped pages are resident. The
// range is examined in windows so a checkpoint of hundreds of gigabytes needs neither that much
// address space at once nor a residency vector of one byte per page for the whole file. Large
// ranges are sampled (ResidencySampling, read_engine.h): mincore looks every page up in the page
// cache, and checking all 2M pages of an 8 GB checkpoint took a sizeable part of a load.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "io/engine_common.h"
#include "tensorferry/residency.h"
#include "util/unique_fd.h"

namespace tensorferry::io {
namespace {

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

Result<UniqueFd> OpenRegularFile(const std::string& path) {
  // Not waiting for a FIFO's writer (such files are refused below), waiting for a lease.
  const int raw_fd = OpenForReading(path);
  if (raw_fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                  path + ": cannot open: " + ErrnoText(err));
  }
  UniqueFd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    const int err = errno;
    return Status(Code::kIoError, path + ": fstat failed: " + ErrnoText(err));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status(Code::kInvalidArgument,
                  path + (S_ISDIR(st.st_mode) ? ": is a directory" : ": not a regular file"));
  }
  return fd;
}

Result<double> CachedFraction(const std::string& path, uint64_t offset, uint64_t length) {
  Result<UniqueFd> fd = OpenRegularFile(path);
  if (!fd.ok()) return fd.status();
  return CachedFraction(fd->get(), path, offset, length);
}

Result<double> CachedFraction(int fd, const std::string& path, uint64_t offset, uint64_t length,
                              const ResidencySampling& sampling) {
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
  const uint64_t first_page = offset / page;
  const uint64_t end_page = (end + page - 1) / page;
  const uint64_t pages = end_page - first_page;
  // The page runs looked at, ascending: the whole range, or evenly spread samples.
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  const uint64_t samples = std::max<uint64_t>(1, sampling.samples);
  if (pages <= sampling.above_pages || samples * sampling.pages_per_sample >= pages) {
    runs.emplace_back(first_page, end_page);
  } else {
    for (uint64_t s = 0; s < samples; ++s) {
      const uint64_t at = first_page + s * (pages / samples) + s * (pages % samples) / samples;
      runs.emplace_back(at,
                        std::min(at + std::max<uint64_t>(1, sampling.pages_per_sample), end_page));
    }
  }

  uint64_t resident = 0;
  uint64_t total = 0;
  std::vector<unsigned char> vec;
  size_t r = 0;  // the next run (or the rest of one a window boundary cut)
  const uint64_t window_pages = std::max<uint64_t>(1, sampling.window_bytes / page);
  for (uint64_t w0 = first_page; w0 < end_page && r < runs.size(); w0 += window_pages) {
    const uint64_t w1 = std::min(end_page, w0 + window_pages);
    if (runs[r].first >= w1) continue;  // no run here: nothing to map
    const uint64_t start = w0 * page;
    const uint64_t len = std::min(w1 * page, end) - start;
    void* addr = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
    if (addr == MAP_FAILED) {
      const int err = errno;
      return Status(Code::kIoError, path + ": mmap of " + std::to_string(len) +
                                        " bytes at offset " + std::to_string(start) +
                                        " failed: " + ErrnoText(err));
    }
    const Mapping mapping(addr, len);
    while (r < runs.size() && runs[r].first < w1) {
      const uint64_t a = std::max(runs[r].first, w0);
      const uint64_t b = std::min(runs[r].second, w1);
      vec.resize(b - a);
      if (::mincore(static_cast<char*>(addr) + (a - w0) * page, (b - a) * page, vec.data()) != 0) {
        const int err = errno;
        return Status(Code::kIoError, path + ": mincore at offset " + std::to_string(a * page) +
                                          " failed: " + ErrnoText(err));
      }
      // Only the lowest bit is defined; the others are reserved.
      resident += static_cast<uint64_t>(
          std::count_if(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; }));
      total += b - a;
      if (runs[r].second > w1) break;  // the run goes on in the next window
      ++r;
    }
  }
  return total == 0 ? 1.0 : static_cast<double>(resident) / static_cast<double>(total);
}

Status DropPages(int fd, const std::string& path) {
  ::fdatasync(fd);  // dirty pages are not dropped: write them first
  if (const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); rc != 0) {
    return Status(Code::kIoError, path + ": posix_fadvise(DONTNEED) failed: " + ErrnoText(rc));
  }
  return Status::Ok();
}

}  // namespace tensorferry::io

namespace tensorferry {

Result<double> CachedFraction(const std::string& path, uint64_t offset, uint64_t length) {
  return io::CachedFraction(path, offset, length);
}

Status DropFromPageCache(const std::string& path) {
  Result<UniqueFd> fd = io::OpenRegularFile(path);
  if (!fd.ok()) return fd.status();
  return io::DropPages(fd->get(), path);
}

}  // namespace tensorferry

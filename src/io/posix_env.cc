// The default Env: POSIX pread on file descriptors; the POSIX write operations every Env inherits.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "util/random.h"

#include "io/engine_common.h"
#include "tensorferry/env.h"
#include "util/macros.h"
#include "util/path.h"

namespace tensorferry {
namespace {

std::string ErrnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixFile() override { ::close(fd_); }
  PosixFile(const PosixFile&) = delete;
  PosixFile& operator=(const PosixFile&) = delete;

  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    // EINTR and EAGAIN (a FUSE daemon's) are retried, a bounded number of times, as the
    // io_uring engine does (engine_common.h): a file system that keeps answering EAGAIN fails
    // the read instead of hanging it.
    io::TransientRetry retry;
    for (;;) {
      ssize_t n = ::pread(fd_, dst.data(), dst.size(), static_cast<off_t>(offset));
      if (n >= 0) return static_cast<size_t>(n);
      const int err = errno;
      if (retry.Again(err)) continue;
      return Status(Code::kIoError, path_ + ": read of " + std::to_string(dst.size()) +
                                        " bytes at offset " + std::to_string(offset) +
                                        " failed: " + ErrnoText(err));
    }
  }

  Result<uint64_t> Size() const override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      return Status(Code::kIoError, path_ + ": fstat failed: " + ErrnoText(err));
    }
    return static_cast<uint64_t>(st.st_size);
  }

  const std::string& path() const noexcept override { return path_; }
  int native_handle() const noexcept override { return fd_; }

 private:
  std::string path_;
  int fd_;
};

class PosixEnv final : public Env {
 public:
  Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) override {
    TF_RETURN_IF_ERROR(CheckPathString(path));
    // Not waiting for a FIFO's writer (such files are refused below), waiting for a lease.
    const int fd = io::OpenForReading(path);
    if (fd < 0) {
      const int err = errno;
      std::string why = ErrnoText(err);
      if (err == EMFILE) {
        // Say which limit: the process's descriptors (ulimit -n), not the file.
        struct rlimit limit;
        if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
          why += "; this process may open " + std::to_string(limit.rlim_cur) +
                 " files at once (RLIMIT_NOFILE, `ulimit -n`)";
        }
      }
      return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                    path + ": cannot open: " + why);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return Status(Code::kIoError, path + ": fstat failed: " + ErrnoText(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      if (S_ISDIR(st.st_mode)) return Status(Code::kInvalidArgument, path + ": is a directory");
      return Status(Code::kInvalidArgument, path + ": not a regular file");
    }
    if (const int flags = ::fcntl(fd, F_GETFL); flags >= 0)
      ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    return std::unique_ptr<RandomAccessFile>(new PosixFile(path, fd));
  }
};

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  PosixWritableFile(const PosixWritableFile&) = delete;
  PosixWritableFile& operator=(const PosixWritableFile&) = delete;

  Status Append(std::span<const std::byte> data) override {
    while (!data.empty()) {
      // Linux writes at most 0x7ffff000 bytes per call anyway; asking for less keeps the count in
      // range of ssize_t everywhere.
      const size_t want = std::min<size_t>(data.size(), size_t{1} << 30);
      const ssize_t n = ::write(fd_, data.data(), want);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        return Status(Code::kIoError, path_ + ": write of " + std::to_string(data.size()) +
                                          " bytes at offset " + std::to_string(offset_) +
                                          " failed: " + ErrnoText(err));
      }
      if (n == 0) {  // not expected from a regular file; avoid spinning forever
        return Status(Code::kIoError,
                      path_ + ": write at offset " + std::to_string(offset_) + " made no progress");
      }
      data = data.subspan(static_cast<size_t>(n));
      offset_ += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    while (!data.empty()) {
      const size_t want = std::min<size_t>(data.size(), size_t{1} << 30);
      const ssize_t n = ::pwrite(fd_, data.data(), want, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        return Status(Code::kIoError, path_ + ": write of " + std::to_string(data.size()) +
                                          " bytes at offset " + std::to_string(offset) +
                                          " failed: " + ErrnoText(err));
      }
      if (n == 0) {
        return Status(Code::kIoError,
                      path_ + ": write at offset " + std::to_string(offset) + " made no progress");
      }
      data = data.subspan(static_cast<size_t>(n));
      offset += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  Status Sync() override {
    int rc;
    do {
      rc = ::fsync(fd_);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      const int err = errno;
      return Status(Code::kIoError, path_ + ": fsync after writing " + std::to_string(offset_) +
                                        " bytes failed: " + ErrnoText(err));
    }
    return Status::Ok();
  }

  Status Close() override {
    const int fd = fd_;
    fd_ = -1;
    // No retry on EINTR: Linux releases the descriptor even then, and it may be reused already.
    if (fd >= 0 && ::close(fd) != 0) {
      const int err = errno;
      return Status(Code::kIoError, path_ + ": close after writing " + std::to_string(offset_) +
                                        " bytes failed: " + ErrnoText(err));
    }
    return Status::Ok();
  }

  const std::string& path() const noexcept override { return path_; }

 private:
  std::string path_;
  int fd_;
  uint64_t offset_ = 0;
};

}  // namespace

Result<std::unique_ptr<WritableFile>> Env::NewTempFile(
    const std::string& dir, const std::string& stem,
    const std::function<void(const std::string& path)>& reserve) {
  for (uint64_t attempt = 0;; ++attempt) {
    std::string path = dir.empty() ? stem : (dir.back() == '/' ? dir : dir + "/") + stem;
    path += util::RandomHex(attempt);
    if (reserve) reserve(path);
    // 0666: the mode then comes from the umask, as for any file a program creates.
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666);
    if (fd >= 0) return std::unique_ptr<WritableFile>(new PosixWritableFile(std::move(path), fd));
    const int err = errno;
    if (reserve) reserve("");
    if (err == EINTR || (err == EEXIST && attempt < 100)) continue;
    return Status(Code::kIoError, "cannot create temporary file " + path + ": " + ErrnoText(err));
  }
}

Status Env::RenameFile(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) == 0) return Status::Ok();
  const int err = errno;
  return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                "cannot rename " + from + " to " + to + ": " + ErrnoText(err));
}

Status Env::RemoveFile(const std::string& path) {
  if (::unlink(path.c_str()) == 0) return Status::Ok();
  const int err = errno;
  return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                "cannot remove " + path + ": " + ErrnoText(err));
}

Status Env::SyncDirectory(const std::string& dir) {
  const std::string path = dir.empty() ? "." : dir;
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    return Status(Code::kIoError, path + ": cannot open directory to fsync it: " + ErrnoText(err));
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some filesystems cannot fsync a directory (EINVAL); there is nothing more to make durable.
  if (rc != 0 && err != EINVAL) {
    return Status(Code::kIoError, path + ": fsync of directory failed: " + ErrnoText(err));
  }
  return Status::Ok();
}

Env* Env::Default() {
  static PosixEnv* env = new PosixEnv();  // never destroyed: usable during static destruction
  return env;
}

Status ReadFully(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst,
                 const std::atomic<bool>* cancel) {
  std::optional<io::CancelScope>
      scope;  // with no flag, the caller's scope (if any) stays innermost
  if (cancel != nullptr) scope.emplace(cancel);
  const auto cancelled = [&] {
    return Status(Code::kCancelled, file.path() + ": read cancelled at offset " +
                                        std::to_string(offset) + " (" + std::to_string(dst.size()) +
                                        " bytes)");
  };
  size_t done = 0;
  while (done < dst.size()) {
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) return cancelled();
    auto n = file.Read(offset + done, dst.subspan(done));
    if (!n.ok()) {
      if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) return cancelled();
      return n.status();
    }
    if (*n == 0) {
      return Status(Code::kUnexpectedEof, file.path() + ": unexpected end of file at offset " +
                                              std::to_string(offset + done) + ": wanted " +
                                              std::to_string(dst.size()) + " bytes at offset " +
                                              std::to_string(offset) + ", got " +
                                              std::to_string(done));
    }
    done += *n;
  }
  return Status::Ok();
}

}  // namespace tensorferry

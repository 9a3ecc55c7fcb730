// The default Env: POSIX pread on file descriptors.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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
    for (;;) {
      ssize_t n = ::pread(fd_, dst.data(), dst.size(), static_cast<off_t>(offset));
      if (n >= 0) return static_cast<size_t>(n);
      if (errno == EINTR) continue;
      const int err = errno;
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
    int fd;
    do {
      // O_NONBLOCK: opening a FIFO (or some devices) for reading would otherwise block until a
      // writer appears; such files are refused below. It has no effect on regular files.
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    } while (fd < 0 && errno == EINTR);
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

}  // namespace

Env* Env::Default() {
  static PosixEnv* env = new PosixEnv();  // never destroyed: usable during static destruction
  return env;
}

Status ReadFully(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst) {
  size_t done = 0;
  while (done < dst.size()) {
    auto n = file.Read(offset + done, dst.subspan(done));
    if (!n.ok()) return n.status();
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

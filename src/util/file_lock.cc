// FileLock (file_lock.h): flock(2) on a descriptor of its own, behind an in-process table.
//
// A lock file is removed by its holder on release, while still held. A process that opened the
// old file before it went may then be granted the lock on an inode no longer in the directory, so
// every locker checks, once it holds the lock, that the path still names the inode it locked, and
// starts again otherwise. Nothing else ever removes a held lock file, so the check is enough on a
// local filesystem; docs/integrity.md says what NFS's caches weaken.
#include "util/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "util/unique_fd.h"

namespace tensorferry {
namespace {

// The locks this process holds, by inode: a second open(2) of a held lock by another thread
// waits (or fails) here rather than in flock, which would not exclude it where flock is emulated
// with per-process POSIX locks, and could not say who holds it.
struct Registry {
  std::mutex mu;
  std::condition_variable released;
  std::set<std::pair<dev_t, ino_t>> held;
  pid_t pid = 0;  // the process the table describes: a forked child starts with none held
};

Registry& Locks() {
  static Registry* registry = new Registry;  // never destroyed: locks may outlive static objects
  return *registry;
}

// REQUIRES: registry.mu held.
void ForThisProcess(Registry& registry) {
  const pid_t pid = ::getpid();
  if (registry.pid != pid) {
    registry.held.clear();
    registry.pid = pid;
  }
}

void Unregister(std::pair<dev_t, ino_t> key) {
  Registry& registry = Locks();
  {
    std::lock_guard<std::mutex> lock(registry.mu);
    if (registry.pid == ::getpid()) registry.held.erase(key);
  }
  registry.released.notify_all();
}

std::string ErrnoText(int e) {
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

// "pid <N> (<program>) on <host>: <purpose>", what a lock file's holder writes into it.
std::string HolderText(std::string_view purpose) {
  std::string out = "pid " + std::to_string(::getpid());
  char name[64] = {};
  const int fd = ::open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    const ssize_t n = ::read(fd, name, sizeof name - 1);
    ::close(fd);
    std::string_view program(name, n > 0 ? static_cast<size_t>(n) : 0);
    while (!program.empty() && program.back() == '\n') program.remove_suffix(1);
    if (!program.empty()) out += " (" + std::string(program) + ")";
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  if (host[0] != '\0') out += std::string(" on ") + host;
  out += ": ";
  out += purpose;
  return out;
}

// What the holder of a lock file wrote there: printable ASCII, at most 300 bytes.
std::string ReadHolder(int fd) {
  char buf[300];
  const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  std::string out;
  for (ssize_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(buf[i]);
    out.push_back(c >= 0x20 && c < 0x7f ? static_cast<char>(c) : ' ');
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  if (out.empty()) return "another process (which has not recorded its pid yet)";
  return out;
}

}  // namespace

Result<FileLock> FileLock::LockDirectory(const std::string& dir, Wait wait,
                                         std::string_view purpose, bool* busy) {
  return Acquire(dir.empty() ? std::string(".") : dir, /*directory=*/true, wait, purpose, busy);
}

Result<FileLock> FileLock::LockFile(const std::string& path, Wait wait, std::string_view purpose,
                                    bool* busy) {
  return Acquire(path, /*directory=*/false, wait, purpose, busy);
}

Result<FileLock> FileLock::Acquire(const std::string& path, bool directory, Wait wait,
                                   std::string_view purpose, bool* busy) {
  Registry& registry = Locks();
  if (busy != nullptr) *busy = false;
  const auto held_by = [&](const std::string& holder) {
    if (busy != nullptr) *busy = true;
    return Status(Code::kIoError, path + " is held by " + holder);
  };
  const std::string what = directory ? "directory" : "lock file";
  for (;;) {
    // O_NOFOLLOW: a symbolic link planted at a lock file's name must not get its target
    // truncated. O_CLOEXEC: a program this process starts does not hold the lock.
    const int flags = directory ? (O_RDONLY | O_DIRECTORY | O_CLOEXEC)
                                : (O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC);
    UniqueFd fd(::open(path.c_str(), flags, 0666));
    if (fd.get() < 0) {
      const int e = errno;
      return Status(e == ENOENT ? Code::kNotFound : Code::kIoError,
                    path + ": cannot open the " + what + " to lock it for " + std::string(purpose) +
                        ": " + ErrnoText(e));
    }
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) {
      return Status(Code::kIoError, path + ": fstat: " + ErrnoText(errno));
    }
    const std::pair<dev_t, ino_t> key(st.st_dev, st.st_ino);
    {
      std::unique_lock<std::mutex> lock(registry.mu);
      ForThisProcess(registry);
      if (registry.held.count(key) != 0) {
        if (wait == Wait::kFail) {
          return held_by("another thread of this process (pid " + std::to_string(::getpid()) + ")");
        }
        registry.released.wait(lock, [&] { return registry.held.count(key) == 0; });
        // The holder removed a lock file as it released it: open the name again.
        if (!directory) continue;
      }
      registry.held.insert(key);
    }
    int r;
    do {
      r = ::flock(fd.get(), LOCK_EX | (wait == Wait::kFail ? LOCK_NB : 0));
    } while (r != 0 && errno == EINTR);
    bool cross_process = true;
    if (r != 0) {
      const int e = errno;
      if (e == ENOLCK || e == EOPNOTSUPP) {
        cross_process = false;  // this process's threads are still excluded (the table)
      } else {
        Unregister(key);
        if (e == EWOULDBLOCK) {
          return held_by(directory ? std::string("another process") : ReadHolder(fd.get()));
        }
        return Status(Code::kIoError, path + ": cannot lock the " + what + ": " + ErrnoText(e));
      }
    }
    if (!directory) {
      struct stat now;
      if (::lstat(path.c_str(), &now) != 0) {
        const int e = errno;
        Unregister(key);
        if (e == ENOENT) continue;  // removed by its last holder: lock the new one
        return Status(Code::kIoError, path + ": lstat: " + ErrnoText(e));
      }
      if (now.st_dev != st.st_dev || now.st_ino != st.st_ino) {
        Unregister(key);
        continue;
      }
      // For a refused locker's message only: a failure here costs nothing else.
      const std::string holder = HolderText(purpose) + "\n";
      if (::ftruncate(fd.get(), 0) == 0) {
        (void)!::pwrite(fd.get(), holder.data(), holder.size(), 0);
      }
    }
    FileLock out;
    out.path_ = path;
    out.fd_ = fd.release();
    out.dev_ = st.st_dev;
    out.ino_ = st.st_ino;
    out.owner_ = ::getpid();
    out.remove_ = !directory;
    out.cross_process_ = cross_process;
    return out;
  }
}

FileLock::FileLock(FileLock&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      dev_(other.dev_),
      ino_(other.ino_),
      owner_(other.owner_),
      remove_(other.remove_),
      cross_process_(other.cross_process_) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    dev_ = other.dev_;
    ino_ = other.ino_;
    owner_ = other.owner_;
    remove_ = other.remove_;
    cross_process_ = other.cross_process_;
  }
  return *this;
}

void FileLock::Release() noexcept {
  if (fd_ < 0) return;
  const bool mine = owner_ == ::getpid();
  // Removed while still held: a process that opened it meanwhile finds the name gone once it
  // gets the lock, and starts again.
  if (mine && remove_) ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
  if (mine) Unregister({dev_, ino_});
}

}  // namespace tensorferry

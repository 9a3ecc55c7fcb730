// Internal: FileLock, an exclusive advisory lock that serializes writers of one directory across
// the threads of a process and across processes (docs/integrity.md, "Concurrent writers").
//
// The lock is flock(2) on a descriptor of its own, so:
//  - it is released by the kernel when the holder's last descriptor closes: a crash, SIGKILL or
//    power loss leaves no stale lock (a lock file left behind is reused, not believed);
//  - separate open(2)s exclude each other, so threads of one process are excluded too; an
//    in-process table lets a thread that would wait on its own process say so (kFail). Where
//    flock is emulated with per-process POSIX locks (NFS), another thread's open and close of a
//    held lock file can drop the process's lock: one process should not lock a file on NFS from
//    two threads at once;
//  - it works on every local filesystem (ext4, xfs, btrfs, tmpfs, overlayfs). On NFS, a lock on a
//    directory excludes the writers of one machine only (the client keeps directory locks
//    locally); a lock file is shared with the other clients through the NFS lock manager where the
//    mount has one (NFSv4, or v3 with lockd; not `nolock` or `local_lock=`), else local too. Where
//    the filesystem refuses locks altogether (ENOLCK), the lock excludes this process's threads
//    only: `cross_process()` says so.
//
// Thread-safety: Acquire may be called from any thread; one FileLock object is thread-compatible.
// A FileLock inherited through fork() is not the child's: its release there only closes the copy.
// But while the child keeps that copy open (it has not exec'd, and has not released it), the lock
// stays held: a child that asks for the same lock waits on its own copy (kBlock) or is refused.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "tensorferry/status.h"

namespace tensorferry {

class FileLock {
 public:
  enum class Wait : uint8_t {
    kBlock,  // wait until the holder releases it
    kFail,   // fail at once (kIoError naming the lock and its holder)
  };

  // Locks directory `dir` itself ("" is the working directory); nothing is created in it.
  // `purpose` says what the lock is for, in messages. Errors: kNotFound when `dir` does not exist,
  // kIoError naming `dir` and the OS error, or (kFail) "<dir> is held by <holder>"; `*busy`
  // (optional) is set to whether the error is that last one.
  static Result<FileLock> LockDirectory(const std::string& dir, Wait wait, std::string_view purpose,
                                        bool* busy = nullptr);

  // Locks the file `path`, created if missing (mode 0666 & ~umask; hidden names are the callers'
  // choice). The holder writes "pid <N> (<program>) on <host>: <purpose>" into it, which a
  // refused kFail locker quotes, and removes it on release. A file left by a holder that died is
  // taken over. Errors: kIoError naming `path` and the OS error, or (kFail) "<path> is held by
  // <holder>"; `*busy` as for LockDirectory.
  static Result<FileLock> LockFile(const std::string& path, Wait wait, std::string_view purpose,
                                   bool* busy = nullptr);

  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock() { Release(); }

  // Releases the lock (a lock file is removed first, while still held). Idempotent.
  void Release() noexcept;

  const std::string& path() const noexcept { return path_; }
  // False where the filesystem refused the lock (ENOLCK, EOPNOTSUPP): only this process's other
  // threads are excluded.
  bool cross_process() const noexcept { return cross_process_; }

 private:
  FileLock() = default;
  static Result<FileLock> Acquire(const std::string& path, bool directory, Wait wait,
                                  std::string_view purpose, bool* busy);

  std::string path_;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  pid_t owner_ = 0;  // the process that acquired it
  bool remove_ = false;
  bool cross_process_ = true;
};

}  // namespace tensorferry

// tf_slowfs: a read-only FUSE passthrough of a directory that waits a fixed time in each request,
// to model a network file system on one machine (docs/benchmarks.md, "Slow file systems").
//
//   tf_slowfs SOURCE_DIR MOUNT_POINT [--latency-us=N] [--eio-file=NAME --eio-at=OFFSET]
//             [FUSE options, e.g. -f -o max_threads=128]
//
// Every FUSE request that touches data or metadata (getattr, open, read, readdir) sleeps N
// microseconds (default 500: a round trip to a file server in the same region) before it is
// served from SOURCE_DIR. The loop is multi-threaded, so requests in flight at once overlap their
// waits, as on a real share: a reader that keeps many large reads in flight gets far more than
// one that waits for each (an mmap page fault, a single-threaded read loop). The file system
// type is "fuse.tf_slowfs". Unmount with `fusermount3 -u MOUNT_POINT` (or umount as root).
//
// A bad sector, for the tests of read errors on a real file system: with --eio-file and --eio-at,
// every read of the file NAME (a path under SOURCE_DIR, e.g. "single.safetensors") whose range
// holds byte OFFSET fails with EIO, as a disk's unreadable sector does; the kernel hands a reader
// the bytes before the failed request, then the error (a mapping's page fault: SIGBUS).
#define FUSE_USE_VERSION 31

#include <dirent.h>
#include <fcntl.h>
#include <fuse.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

struct Config {
  char* source = nullptr;
  unsigned latency_us = 500;
  char* eio_file = nullptr;  // relative to SOURCE_DIR
  unsigned long long eio_at = ~0ull;
};

Config g_config;
std::string g_source;

void Wait() {
  if (g_config.latency_us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(g_config.latency_us));
  }
}

std::string Real(const char* path) {
  return g_source + path;
}

void* Init(fuse_conn_info* /*conn*/, fuse_config* cfg) {
  cfg->use_ino = 1;
  // The source does not change under the mount: let the kernel cache attributes and pages.
  cfg->kernel_cache = 1;
  cfg->attr_timeout = 60;
  cfg->entry_timeout = 60;
  return nullptr;
}

int GetAttr(const char* path, struct stat* st, fuse_file_info* fi) {
  Wait();
  const int rc =
      fi != nullptr ? fstat(static_cast<int>(fi->fh), st) : lstat(Real(path).c_str(), st);
  return rc == 0 ? 0 : -errno;
}

int ReadDir(const char* path, void* buf, fuse_fill_dir_t fill, off_t /*offset*/,
            fuse_file_info* /*fi*/, fuse_readdir_flags /*flags*/) {
  Wait();
  DIR* dir = opendir(Real(path).c_str());
  if (dir == nullptr) return -errno;
  while (dirent* e = readdir(dir)) {
    struct stat st {};
    st.st_ino = e->d_ino;
    st.st_mode = static_cast<mode_t>(e->d_type) << 12;
    if (fill(buf, e->d_name, &st, 0, static_cast<fuse_fill_dir_flags>(0)) != 0) break;
  }
  closedir(dir);
  return 0;
}

int Open(const char* path, fuse_file_info* fi) {
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
  Wait();
  const int fd = open(Real(path).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -errno;
  fi->fh = static_cast<uint64_t>(fd);
  fi->keep_cache = 1;
  return 0;
}

int Read(const char* path, char* buf, size_t size, off_t offset, fuse_file_info* fi) {
  Wait();
  if (g_config.eio_file != nullptr && path[0] == '/' &&
      std::strcmp(path + 1, g_config.eio_file) == 0 &&
      static_cast<unsigned long long>(offset) <= g_config.eio_at &&
      g_config.eio_at - static_cast<unsigned long long>(offset) < size) {
    return -EIO;
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t n =
        pread(static_cast<int>(fi->fh), buf + done, size - done, offset + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<int>(done);
}

int Release(const char* /*path*/, fuse_file_info* fi) {
  close(static_cast<int>(fi->fh));
  return 0;
}

int StatFs(const char* path, struct statvfs* st) {
  return statvfs(Real(path).c_str(), st) == 0 ? 0 : -errno;
}

int Access(const char* path, int mask) {
  if ((mask & W_OK) != 0) return -EROFS;
  return access(Real(path).c_str(), mask) == 0 ? 0 : -errno;
}

constexpr fuse_opt kOptions[] = {
    {"--latency-us=%u", offsetof(Config, latency_us), 0},
    {"--eio-file=%s", offsetof(Config, eio_file), 0},
    {"--eio-at=%llu", offsetof(Config, eio_at), 0},
    FUSE_OPT_END,
};

int KeepOption(void* /*data*/, const char* arg, int key, fuse_args* /*out*/) {
  if (key == FUSE_OPT_KEY_NONOPT && g_config.source == nullptr) {
    g_config.source = strdup(arg);
    return 0;  // consumed: the mount point is the next non-option
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  fuse_args args = FUSE_ARGS_INIT(argc, argv);
  if (fuse_opt_parse(&args, &g_config, kOptions, KeepOption) != 0) return 2;
  if (g_config.source == nullptr) {
    std::fprintf(stderr,
                 "usage: %s SOURCE_DIR MOUNT_POINT [--latency-us=N] [--eio-file=NAME "
                 "--eio-at=OFFSET] [FUSE options]\n",
                 argv[0]);
    return 2;
  }
  if ((g_config.eio_file != nullptr) != (g_config.eio_at != ~0ull)) {
    std::fprintf(stderr, "%s: --eio-file and --eio-at go together\n", argv[0]);
    return 2;
  }
  char* real = realpath(g_config.source, nullptr);
  if (real == nullptr) {
    std::fprintf(stderr, "%s: %s: %s\n", argv[0], g_config.source, std::strerror(errno));
    return 2;
  }
  g_source = real;
  std::free(real);
  fuse_opt_add_arg(&args, "-osubtype=tf_slowfs,fsname=tf_slowfs,ro,default_permissions");
  fuse_operations ops{};
  ops.init = Init;
  ops.getattr = GetAttr;
  ops.readdir = ReadDir;
  ops.open = Open;
  ops.read = Read;
  ops.release = Release;
  ops.statfs = StatFs;
  ops.access = Access;
  const int rc = fuse_main(args.argc, args.argv, &ops, nullptr);
  fuse_opt_free_args(&args);
  return rc;
}

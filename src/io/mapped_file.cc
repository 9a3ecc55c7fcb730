// MappedFile and its SIGBUS guard (mapped_file.h).
#include "io/mapped_file.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "io/engine_common.h"
#include "tensorferry/mapping.h"
#include "util/macros.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace tensorferry::io {
namespace {

// Why a mapped page could not be read (SIGBUS, or MADV_POPULATE_READ's EFAULT). A page wholly
// past the end of a file that shrank faults; so does one the kernel could not read (EIO from the
// disk, an NFS or FUSE error), and the file still covers that one. What the file says at the
// fault tells them apart, when its path still names it.
enum FaultCause : int {
  kCauseUnknown = 0,  // the path no longer names the mapped file (or was cut): either
  kCauseShrank = 1,   // the file ends before the page
  kCauseIoError = 2,  // the file still covers the page: it could not be read
};

// One registered mapping. begin == 0 means free. Written by Map/~MappedFile under g_table_mu,
// read by the signal handler without locks (hence atomics).
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint64_t> faults{0};
  std::atomic<uint64_t> first_fault{UINT64_MAX};
  // What the first fault was (FaultCause) and the file's size then (if known).
  std::atomic<int> first_cause{kCauseUnknown};
  std::atomic<uint64_t> size_at_fault{0};
  // Bumped each time the slot is claimed: tells CheckMappedFiles whether the mapping that faulted
  // is the one in the slot now.
  std::atomic<uint64_t> generation{0};
  // The file's path for the handler's stderr line (cut to fit) and its identity when mapped (to
  // know that the path still names it), written before begin is published.
  char path[240] = {};
  bool path_whole = false;  // path is not cut, and identity is known
  dev_t dev = 0;
  ino_t ino = 0;
  // Views mapped without a read lease (the loud-failure guard): the file's size and mtime when
  // mapped, for CheckMappedFiles to see an in-place rewrite (which no fault shows: the new bytes
  // show through). Under g_table_mu; never read by the handler.
  bool watch = false;
  bool rewrite_reported = false;
  off_t size_at_map = 0;
  struct timespec mtime_at_map {};
};

// Process-wide fault accounting for CheckMappedFiles: every mapping's first fault bumps
// g_fault_events and leaves its file, offset and cause in g_last_fault, written by the handler
// (lock-free atomics only) and read by CheckMappedFiles.
std::atomic<uint64_t> g_fault_events{0};
std::atomic<uint64_t> g_fault_events_reported{0};

// The last recorded fault. A sequence lock: the handler claims it by making `seq` odd (and skips
// recording when another handler holds it: it never waits), writes, and makes it even again;
// readers retry until they copy it between two equal even values. The path is copied (not read
// from the slot later), since the slot may be reused by another file's mapping before the report.
struct FaultRecord {
  std::atomic<uint64_t> seq{0};
  std::atomic<size_t> slot{SIZE_MAX};
  std::atomic<uint64_t> generation{0};
  std::atomic<uint64_t> offset{0};
  std::atomic<int> cause{kCauseUnknown};
  std::atomic<uint64_t> size{0};
  std::atomic<char> path[240] = {};
};
FaultRecord g_last_fault;

// Async-signal-safe: records a mapping's first fault (slot i of `s`) unless another is being
// recorded at this moment.
void RecordFault(const Slot& s, size_t i, uint64_t offset, FaultCause cause, uint64_t size) {
  uint64_t seq = g_last_fault.seq.load(std::memory_order_relaxed);
  if ((seq & 1) != 0 ||
      !g_last_fault.seq.compare_exchange_strong(seq, seq + 1, std::memory_order_acquire)) {
    return;
  }
  // The odd value is visible before any field written below (a reader that sees a new field
  // sees the odd sequence, or a later one, on its second load).
  std::atomic_thread_fence(std::memory_order_release);
  g_last_fault.slot.store(i, std::memory_order_relaxed);
  g_last_fault.generation.store(s.generation.load(std::memory_order_relaxed),
                                std::memory_order_relaxed);
  g_last_fault.offset.store(offset, std::memory_order_relaxed);
  g_last_fault.cause.store(cause, std::memory_order_relaxed);
  g_last_fault.size.store(size, std::memory_order_relaxed);
  for (size_t k = 0; k < sizeof s.path; ++k) {
    g_last_fault.path[k].store(s.path[k], std::memory_order_relaxed);
    if (s.path[k] == '\0') break;
  }
  g_last_fault.seq.store(seq + 2, std::memory_order_release);
}

// A consistent copy of g_last_fault (outside the handler).
struct FaultCopy {
  size_t slot = SIZE_MAX;
  uint64_t generation = 0;
  uint64_t offset = 0;
  FaultCause cause = kCauseUnknown;
  uint64_t size = 0;
  std::string path;
};
FaultCopy CopyLastFault() {
  FaultCopy copy;
  for (;;) {
    const uint64_t before = g_last_fault.seq.load(std::memory_order_acquire);
    if ((before & 1) != 0) {
      std::this_thread::yield();  // a handler on another thread is writing it
      continue;
    }
    copy.slot = g_last_fault.slot.load(std::memory_order_relaxed);
    copy.generation = g_last_fault.generation.load(std::memory_order_relaxed);
    copy.offset = g_last_fault.offset.load(std::memory_order_relaxed);
    copy.cause = static_cast<FaultCause>(g_last_fault.cause.load(std::memory_order_relaxed));
    copy.size = g_last_fault.size.load(std::memory_order_relaxed);
    copy.path.clear();
    for (const std::atomic<char>& c : g_last_fault.path) {
      const char ch = c.load(std::memory_order_relaxed);
      if (ch == '\0') break;
      copy.path += ch;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (g_last_fault.seq.load(std::memory_order_relaxed) == before) return copy;
  }
}
std::atomic<uint64_t> g_live{0};
std::atomic<uint64_t> g_unleasable{0};
std::atomic<uint64_t> g_copied{0};
std::atomic<bool> g_leases_enabled{true};
std::atomic<bool> g_fail_lease_copies{false};  // FailLeaseCopiesForTesting

// Room for kMaxMappings slots (~20 MiB) reserved with mmap and never unmapped: untouched pages cost
// no memory, and a slot is constructed when first claimed (Map: the lowest free slot, so slots
// [0, g_high_water) are the constructed ones), so a process that maps a few files pays for a few
// slots, not for the whole table.
Slot* Table() {
  static Slot* table = [] {
    void* p = ::mmap(nullptr, sizeof(Slot) * MappedFile::kMaxMappings, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? nullptr : static_cast<Slot*>(p);
  }();
  return table;
}
std::atomic<size_t> g_high_water{0};  // slots [0, high water) may be in use
std::mutex g_table_mu;
// The live MappedFile of each slot (for its About), under g_table_mu; never read by the handler.
std::vector<const MappedFile*>& Owners() {
  static auto* owners = new std::vector<const MappedFile*>();  // never destroyed (as the table)
  return *owners;
}
struct sigaction g_previous;
std::once_flag g_install_once;
long g_page_size = 4096;

// Async-signal-safe: decimal digits of v into buf (no terminator); returns the count.
size_t FormatUnsigned(uint64_t v, char* buf) {
  char digits[20];
  size_t n = 0;
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  for (size_t i = 0; i < n; ++i) buf[i] = digits[n - 1 - i];
  return n;
}

// Async-signal-safe (stat is): why a page of the mapping in `s` could not be read, from what its
// file says now: an I/O error when the file still has at least `covered` bytes (it reaches into
// the page that faulted), else it shrank. *size is the file's size when known.
FaultCause CauseOf(const Slot& s, uint64_t covered, uint64_t* size) {
  if (!s.path_whole) return kCauseUnknown;
  struct stat st;
  if (::stat(s.path, &st) != 0 || st.st_dev != s.dev || st.st_ino != s.ino) return kCauseUnknown;
  *size = static_cast<uint64_t>(st.st_size);
  return *size >= covered ? kCauseIoError : kCauseShrank;
}

// Async-signal-safe: the text after "<path>: " saying why mapped bytes from `offset` read as
// zeros, for the handler's line and CheckMappedFiles ("now read" / "read").
template <typename Put>
void PutFaultText(Put&& put, FaultCause cause, uint64_t offset, uint64_t size, const char* read) {
  char number[24];
  auto put_number = [&](uint64_t v) {
    number[FormatUnsigned(v, number)] = '\0';
    put(number);
  };
  if (cause == kCauseShrank) {
    put("file shrank while its tensors were mapped: bytes from offset ");
    put_number(offset);
    put(" ");
    put(read);
    put(" as zeros (the file has ");
    put_number(size);
    put(" bytes now)");
    return;
  }
  put("mapped bytes from offset ");
  put_number(offset);
  if (cause == kCauseIoError) {
    put(" could not be read (an I/O error; the file still has ");
    put_number(size);
    put(" bytes) and ");
  } else {
    put(" could not be read (the file shrank, or an I/O error) and ");
  }
  put(read);
  put(" as zeros");
}

// Async-signal-safe: "tensorferry: error: <path>: <PutFaultText>\n" on stderr.
void ReportFaultOnStderr(const Slot& s, uint64_t offset, FaultCause cause, uint64_t size) {
  char line[512];
  size_t n = 0;
  auto put = [&](const char* text) {
    for (; *text != '\0' && n < sizeof line - 1; ++text) line[n++] = *text;
  };
  put("tensorferry: error: ");
  put(s.path);
  put(": ");
  PutFaultText(put, cause, offset, size, "now read");
  put("\n");
  ssize_t ignored = ::write(STDERR_FILENO, line, n);
  (void)ignored;
}

// The text of a fault for a Status (outside the handler).
std::string FaultText(FaultCause cause, uint64_t offset, uint64_t size) {
  std::string out;
  PutFaultText([&](const char* text) { out += text; }, cause, offset, size, "read");
  return out;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  Slot* table = Table();
  const size_t n = g_high_water.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    Slot& s = table[i];
    const uintptr_t begin = s.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= s.end.load(std::memory_order_acquire)) continue;
    const uintptr_t page = addr & ~static_cast<uintptr_t>(g_page_size - 1);
    const long rc = ::syscall(SYS_mmap, page, g_page_size, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (rc == -1) break;  // cannot repair: let the previous handler decide
    const bool first = s.faults.fetch_add(1, std::memory_order_relaxed) == 0;
    if (first || page - begin < s.first_fault.load(std::memory_order_relaxed)) {
      s.first_fault.store(page - begin, std::memory_order_relaxed);
    }
    if (first) {
      // A page past a shorter end faults only when it lies wholly past it: a file that still
      // has a byte of the page could not read it.
      uint64_t size = 0;
      const FaultCause cause = CauseOf(s, page - begin + 1, &size);
      s.first_cause.store(cause, std::memory_order_relaxed);
      s.size_at_fault.store(size, std::memory_order_relaxed);
      ReportFaultOnStderr(s, page - begin, cause, size);
      RecordFault(s, i, page - begin, cause, size);
      g_fault_events.fetch_add(1, std::memory_order_release);
    }
    return;  // the faulting access is retried and reads zeros
  }
  // Not ours: behave as if we were not installed.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it and return; the access faults again and terminates the process
  // with SIGBUS as it would have without us.
  signal(SIGBUS, SIG_DFL);
}

void InstallHandler() {
  g_page_size = ::sysconf(_SC_PAGESIZE);
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous);
}

// The read leases of live mappings and the one thread that answers their breaks.
class LeaseKeeper {
 public:
  static LeaseKeeper& Get() {
    static auto* keeper = new LeaseKeeper();  // never destroyed: its thread runs for the process
    return *keeper;
  }

  // Takes a read lease on a new descriptor for the file behind `fd` guarding [addr, addr + size).
  // Returns the lease's descriptor, or -1 when no lease can be had (the caller falls back on the
  // SIGBUS guard).
  int Acquire(int fd, std::byte* addr, uint64_t size, size_t slot, uint64_t generation) {
    if (!g_leases_enabled.load(std::memory_order_relaxed) || size == 0) return -1;
    if (!Start()) return -1;
    std::lock_guard<std::mutex> lock(mu_);
    if (leases_.size() >= max_leases_) return -1;
    const std::string self = "/proc/self/fd/" + std::to_string(fd);
    const int lease_fd = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (lease_fd < 0) return -1;
    struct f_owner_ex owner;
    owner.type = F_OWNER_TID;
    owner.pid = tid_;
    if (::fcntl(lease_fd, F_SETOWN_EX, &owner) != 0 || ::fcntl(lease_fd, F_SETSIG, signal_) != 0 ||
        ::fcntl(lease_fd, F_SETLEASE, F_RDLCK) != 0) {
      ::close(lease_fd);
      return -1;
    }
    leases_[lease_fd] = Lease{addr, size, slot, generation};
    return lease_fd;
  }

  // Ends the lease of the mapping at `addr` (if the thread has not already) before the mapping
  // goes. A broken lease's descriptor was closed, and its number may since name another
  // mapping's lease: only an entry for this mapping's address is this mapping's.
  void Release(int lease_fd, const std::byte* addr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(lease_fd);
    if (it == leases_.end() || it->second.addr != addr) return;
    leases_.erase(it);
    ::close(lease_fd);
  }

  bool Held(int lease_fd, const std::byte* addr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(lease_fd);
    return it != leases_.end() && it->second.addr == addr;
  }

  uint64_t count() {
    std::lock_guard<std::mutex> lock(mu_);
    return leases_.size();
  }

 private:
  struct Lease {
    std::byte* addr;
    uint64_t size;
    size_t slot;  // the mapping's slot in Table() and its generation then (Break)
    uint64_t generation;
  };

  // Starts the thread once; false if it cannot run (then no leases are taken).
  bool Start() {
    std::unique_lock<std::mutex> lock(mu_);
    if (started_) return tid_ > 0;
    started_ = true;
    signal_ = SIGRTMIN + 7;
    // One descriptor per lease: at most a quarter of the descriptors this process may open.
    struct rlimit limit;
    if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
      max_leases_ = std::min<size_t>(max_leases_, limit.rlim_cur / 4);
    }
    // How long the kernel waits for a lease's break before it takes the lease away (and lets the
    // writer go): a copy that takes longer may hold some of the writer's bytes.
    if (std::FILE* f = std::fopen("/proc/sys/fs/lease-break-time", "r")) {
      long seconds = 0;
      if (std::fscanf(f, "%ld", &seconds) == 1 && seconds > 0) {
        break_time_ = std::chrono::seconds(seconds);
      }
      std::fclose(f);
    }
    try {
      std::thread([this] { Run(); }).detach();
    } catch (const std::system_error&) {
      return false;
    }
    ready_.wait(lock, [this] { return tid_ != 0; });
    return tid_ > 0;
  }

  void Run() {
    // Block the lease signal (and SIGIO, which the kernel sends instead when it cannot queue the
    // real-time one) in this thread only: breaks are directed at this thread and taken here with
    // sigwaitinfo, so no handler is installed and other threads never see them.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, signal_);
    sigaddset(&set, SIGIO);
    const bool blocked = ::pthread_sigmask(SIG_BLOCK, &set, nullptr) == 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tid_ = blocked ? static_cast<pid_t>(::syscall(SYS_gettid)) : -1;
    }
    ready_.notify_all();
    if (!blocked) return;
    for (;;) {
      siginfo_t info;
      const int sig = ::sigwaitinfo(&set, &info);
      if (sig < 0) continue;
      std::lock_guard<std::mutex> lock(mu_);
      if (sig == signal_) {
        auto it = leases_.find(info.si_fd);
        if (it != leases_.end()) Break(it);
        continue;
      }
      // Plain SIGIO: no descriptor given; answer every lease the kernel is breaking.
      for (auto it = leases_.begin(); it != leases_.end();) {
        auto next = std::next(it);
        if (::fcntl(it->first, F_GETLEASE) == F_UNLCK) Break(it);
        it = next;
      }
    }
  }

  // Replaces the mapping with an anonymous copy at the same address, then lets the writer go.
  // Called under mu_. Copy-on-write is not enough: truncation unmaps even a private mapping's
  // copied pages (POSIX wants SIGBUS past the end), so the copy is made in anonymous memory and
  // moved over the mapping with one mremap, which other threads see atomically (their faults wait
  // for it, then find the copy). The file is intact while we copy: the writer waits for us.
  // When no copy takes the mapping's place (no memory for it, the mremap refused, or a copy slower
  // than the kernel's lease-break time, which may hold some of the writer's bytes), the mapping
  // stays the file's and is watched as one without a lease is (CheckMappedFiles reports an
  // in-place rewrite; a truncation faults loudly): never a silent change of the views' bytes.
  void Break(std::map<int, Lease>::iterator it) {
    const auto start = std::chrono::steady_clock::now();
    const Lease& lease = it->second;
    const uint64_t page = static_cast<uint64_t>(g_page_size);
    const uint64_t length = (lease.size + page - 1) / page * page;
    void* copy =
        g_fail_lease_copies.load(std::memory_order_relaxed)
            ? MAP_FAILED
            : ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    bool replaced = false;
    if (copy != MAP_FAILED) {
      std::memcpy(copy, lease.addr, lease.size);
      const bool in_time =
          std::chrono::steady_clock::now() - start < break_time_ - std::chrono::milliseconds(500);
      if (in_time &&
          ::mremap(copy, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, lease.addr) != MAP_FAILED) {
        replaced = true;
        g_copied.fetch_add(1, std::memory_order_relaxed);
      } else {
        ::munmap(copy, length);
      }
    }
    if (!replaced) {
      std::lock_guard<std::mutex> table(g_table_mu);
      Slot& s = Table()[lease.slot];
      if (s.generation.load(std::memory_order_relaxed) == lease.generation &&
          s.begin.load(std::memory_order_relaxed) == reinterpret_cast<uintptr_t>(lease.addr) &&
          s.path_whole) {
        s.watch = true;
      }
      g_unleasable.fetch_add(1, std::memory_order_relaxed);
    }
    ::fcntl(it->first, F_SETLEASE, F_UNLCK);
    ::close(it->first);
    leases_.erase(it);
  }

  std::mutex mu_;
  std::condition_variable ready_;
  bool started_ = false;
  pid_t tid_ = 0;  // the thread's id; -1 if it could not block the signal
  int signal_ = 0;
  size_t max_leases_ = MappedFile::kMaxLeases;
  std::chrono::milliseconds break_time_{45'000};  // /proc/sys/fs/lease-break-time
  std::map<int, Lease> leases_;                   // by lease descriptor
};

}  // namespace

Result<std::shared_ptr<MappedFile>> MappedFile::Map(const RandomAccessFile& file, uint64_t size,
                                                    Use use, About about) {
  const int fd = file.native_handle();
  if (fd < 0) {
    return Status(Code::kUnsupported, file.path() + ": no file descriptor to map");
  }
  std::call_once(g_install_once, InstallHandler);
  void* addr = nullptr;
  if (size > 0) {
    addr = use == Use::kTransient
               ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0)
               : ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      const int err = errno;
      return Status(Code::kIoError, file.path() + ": mmap of " + std::to_string(size) +
                                        " bytes failed: " + ErrnoText(err));
    }
  }
  size_t slot = kMaxMappings;
  if (addr != nullptr) {
    std::lock_guard<std::mutex> lock(g_table_mu);
    Slot* table = Table();
    const size_t constructed = g_high_water.load(std::memory_order_relaxed);
    for (size_t i = 0; table != nullptr && i < constructed; ++i) {
      if (table[i].begin.load(std::memory_order_relaxed) == 0) {
        slot = i;
        break;
      }
    }
    if (slot == kMaxMappings && table != nullptr && constructed < kMaxMappings) {
      slot = constructed;
      new (&table[slot]) Slot();  // published by g_high_water below
    }
    if (slot == kMaxMappings) {
      ::munmap(addr, size);
      return Status(Code::kUnsupported,
                    file.path() + ": more than " + std::to_string(kMaxMappings) +
                        " files mapped at once (or no room for their table); use a copying engine");
    }
    Slot& s = table[slot];
    const std::string& path = file.path();
    const size_t keep = std::min(path.size(), sizeof s.path - 1);
    std::memcpy(s.path, path.data(), keep);
    s.path[keep] = '\0';
    struct stat st;
    s.path_whole = keep == path.size() && ::fstat(fd, &st) == 0;
    s.dev = s.path_whole ? st.st_dev : 0;
    s.ino = s.path_whole ? st.st_ino : 0;
    s.watch = false;  // set below when no lease guards the views
    s.rewrite_reported = false;
    s.size_at_map = s.path_whole ? st.st_size : 0;
    s.mtime_at_map = s.path_whole ? st.st_mtim : timespec{};
    s.faults.store(0, std::memory_order_relaxed);
    s.first_fault.store(UINT64_MAX, std::memory_order_relaxed);
    s.first_cause.store(kCauseUnknown, std::memory_order_relaxed);
    s.size_at_fault.store(0, std::memory_order_relaxed);
    s.generation.fetch_add(1, std::memory_order_relaxed);
    s.end.store(reinterpret_cast<uintptr_t>(addr) + size, std::memory_order_release);
    s.begin.store(reinterpret_cast<uintptr_t>(addr), std::memory_order_release);
    if (slot + 1 > g_high_water.load(std::memory_order_relaxed)) {
      g_high_water.store(slot + 1, std::memory_order_release);
    }
  }
  int lease_fd = -1;
  if (use == Use::kViews) {
    const uint64_t generation =
        slot < kMaxMappings ? Table()[slot].generation.load(std::memory_order_relaxed) : 0;
    lease_fd =
        LeaseKeeper::Get().Acquire(fd, static_cast<std::byte*>(addr), size, slot, generation);
    if (lease_fd < 0 && size > 0) g_unleasable.fetch_add(1, std::memory_order_relaxed);
  }
  g_live.fetch_add(1, std::memory_order_relaxed);
  std::shared_ptr<MappedFile> map(new MappedFile(file.path(), static_cast<std::byte*>(addr), size,
                                                 slot, lease_fd, use, std::move(about)));
  if (slot < kMaxMappings) {
    std::lock_guard<std::mutex> lock(g_table_mu);
    std::vector<const MappedFile*>& owners = Owners();
    if (owners.size() <= slot) owners.resize(slot + 1, nullptr);
    owners[slot] = map.get();
    // (or'ed: a lease broken since Acquire without a copy set it already)
    Table()[slot].watch =
        Table()[slot].watch || (use == Use::kViews && lease_fd < 0 && Table()[slot].path_whole);
  }
  return map;
}

MappedFile::~MappedFile() {
  g_live.fetch_sub(1, std::memory_order_relaxed);
  if (lease_fd_ >= 0) LeaseKeeper::Get().Release(lease_fd_, data_);
  if (data_ == nullptr) return;
  {
    // Unregister first: once unmapped, the range may be reused by someone else's mapping.
    std::lock_guard<std::mutex> lock(g_table_mu);
    Table()[slot_].begin.store(0, std::memory_order_release);
    if (slot_ < Owners().size()) Owners()[slot_] = nullptr;
  }
  ::munmap(data_, size_);
}

void MappedFile::DropPages(uint64_t offset, uint64_t length) const {
  if (use_ != Use::kTransient || offset >= size_) return;
  const uint64_t page = static_cast<uint64_t>(g_page_size);
  const uint64_t end = offset + std::min(length, size_ - offset);
  // Whole pages inside the range only: a page it shares with a neighbour's rows stays mapped
  // for the neighbour (dropping it would be correct too, at the cost of a fault back).
  const uint64_t begin = (offset + page - 1) / page * page;
  const uint64_t stop = end / page * page;
  if (stop > begin) (void)::madvise(data_ + begin, stop - begin, MADV_DONTNEED);
}

Status MappedFile::Populate(uint64_t offset, uint64_t length) const {
  if (length == 0) return Status::Ok();
  if (offset > size_ || length > size_ - offset) {
    return Status(Code::kInvalidArgument, path_ + ": populate past the mapping");
  }
  const uint64_t page = static_cast<uint64_t>(g_page_size);
  const uint64_t begin = offset / page * page;
  const uint64_t end = offset + length;
  // Start reading the whole range at once (asynchronous readahead in large requests) before
  // faulting it in: populating alone reads a readahead window at a time, waiting for each.
  (void)::madvise(data_ + begin, end - begin, MADV_WILLNEED);
  if (::madvise(data_ + begin, end - begin, MADV_POPULATE_READ) == 0) return Status::Ok();
  const int err = errno;
  if (err == EINVAL) {
    // Kernel older than 5.14: touch one byte per page; a page that cannot be read is repaired
    // by the SIGBUS handler and shows up in faults().
    const uint64_t before = faults();
    volatile const std::byte* p = data_;
    for (uint64_t at = begin; at < end; at += page) (void)p[at];
    return faults() != before ? FaultError() : Status::Ok();
  }
  std::string range = "[";  // (appended: GCC 12 warns falsely about "[" + std::string)
  range += std::to_string(begin) + ", " + std::to_string(end) + ")";
  if (err == EFAULT) {
    // A page could not be read: past the end of a file that shrank, or an I/O error (the disk,
    // an NFS or FUSE error) where the file is still long enough. What the file says now tells.
    // (A shorter file explains it only when a page of the range lies wholly past its end.)
    uint64_t size = 0;
    switch (CauseOf(Table()[slot_], (end - 1) / page * page + 1, &size)) {
      case kCauseIoError:
        return Status(Code::kIoError, path_ + ": could not read mapped bytes " + range +
                                          " (an I/O error; the file still has " +
                                          std::to_string(size) + " bytes)");
      case kCauseShrank:
        return Status(Code::kUnexpectedEof, path_ + ": file shrank while mapped: mapped bytes " +
                                                range + " reach past its end (it has " +
                                                std::to_string(size) + " bytes now)");
      case kCauseUnknown: break;
    }
    return Status(Code::kUnexpectedEof, path_ + ": could not read mapped bytes " + range +
                                            " (the file shrank, or an I/O error)");
  }
  return Status(Code::kIoError,
                path_ + ": reading mapped bytes " + range + " failed: " + ErrnoText(err));
}

Status MappedFile::FaultError() const {
  if (faults() == 0) return Status::Ok();
  const Slot& s = Table()[slot_];
  const auto cause = static_cast<FaultCause>(s.first_cause.load(std::memory_order_relaxed));
  return Status(cause == kCauseIoError ? Code::kIoError : Code::kUnexpectedEof,
                path_ + ": " +
                    FaultText(cause, s.first_fault.load(std::memory_order_relaxed),
                              s.size_at_fault.load(std::memory_order_relaxed)));
}

uint64_t MappedFile::faults() const noexcept {
  return slot_ < kMaxMappings ? Table()[slot_].faults.load(std::memory_order_relaxed) : 0;
}

uint64_t MappedFile::first_fault_offset() const noexcept {
  return slot_ < kMaxMappings ? Table()[slot_].first_fault.load(std::memory_order_relaxed)
                              : UINT64_MAX;
}

bool MappedFile::leased() const noexcept {
  return lease_fd_ >= 0 && LeaseKeeper::Get().Held(lease_fd_, data_);
}

}  // namespace tensorferry::io

namespace tensorferry {

MappingStats GetMappingStats() {
  MappingStats s;
  s.live = io::g_live.load(std::memory_order_relaxed);
  s.leased = io::LeaseKeeper::Get().count();
  s.copied = io::g_copied.load(std::memory_order_relaxed);
  s.unleasable = io::g_unleasable.load(std::memory_order_relaxed);
  s.faults = io::g_fault_events.load(std::memory_order_acquire);
  return s;
}

void SetMappingLeases(bool enabled) noexcept {
  io::g_leases_enabled.store(enabled, std::memory_order_relaxed);
}

namespace io {
void FailLeaseCopiesForTesting(bool fail) {
  g_fail_lease_copies.store(fail, std::memory_order_relaxed);
}
}  // namespace io

namespace io {
namespace {

// A view mapping without a lease whose file was rewritten in place since it was mapped (the same
// inode, another size or mtime): its new bytes show through the tensors (MAP_PRIVATE keeps only
// pages written by this process). Each such mapping is reported once. At most every 200 ms: a
// stat per unleased mapping (a network file system's are the usual ones) per library call.
Status CheckRewrites() {
  static std::atomic<int64_t> last_ns{0};
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t before = last_ns.load(std::memory_order_relaxed);
  if (now - before < 200'000'000 || !last_ns.compare_exchange_strong(before, now)) {
    return Status::Ok();
  }
  struct Watched {
    size_t slot;
    uint64_t generation;
    std::string path;
    dev_t dev;
    ino_t ino;
    off_t size;
    timespec mtime;
  };
  std::vector<Watched> watched;
  {
    std::lock_guard<std::mutex> lock(g_table_mu);
    const size_t high = g_high_water.load(std::memory_order_acquire);
    Slot* table = Table();
    for (size_t i = 0; table != nullptr && i < high; ++i) {
      const Slot& s = table[i];
      // A mapping that faulted (the file shrank under it) is reported as such.
      if (s.begin.load(std::memory_order_acquire) == 0 || !s.watch || s.rewrite_reported ||
          s.faults.load(std::memory_order_relaxed) > 0) {
        continue;
      }
      watched.push_back({i, s.generation.load(std::memory_order_relaxed), s.path, s.dev, s.ino,
                         s.size_at_map, s.mtime_at_map});
    }
  }
  for (const Watched& w : watched) {
    struct stat st;
    if (::stat(w.path.c_str(), &st) != 0 || st.st_dev != w.dev || st.st_ino != w.ino) {
      continue;  // gone or renamed over: the mapping keeps the inode it mapped
    }
    if (st.st_size == w.size && st.st_mtim.tv_sec == w.mtime.tv_sec &&
        st.st_mtim.tv_nsec == w.mtime.tv_nsec) {
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(g_table_mu);
      Slot& s = Table()[w.slot];
      if (s.generation.load(std::memory_order_relaxed) != w.generation || s.rewrite_reported) {
        continue;
      }
      s.rewrite_reported = true;
    }
    return Status(Code::kIoError,
                  w.path +
                      ": file rewritten in place while its tensors were mapped without a read "
                      "lease (more than " +
                      std::to_string(MappedFile::kMaxLeases) +
                      " files mapped, leases off, or a file system without them): those tensors "
                      "may show the new bytes; reload them");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace io

Status CheckMappedFiles() {
  const uint64_t events = io::g_fault_events.load(std::memory_order_acquire);
  uint64_t reported = io::g_fault_events_reported.load(std::memory_order_relaxed);
  if (events == reported) return io::CheckRewrites();
  if (!io::g_fault_events_reported.compare_exchange_strong(reported, events)) {
    return Status::Ok();  // another caller reports these
  }
  const io::FaultCopy fault = io::CopyLastFault();
  // What the faulted page held, asked of the mapping when it is still the one in its slot (its
  // tensors are gone with it otherwise); called outside the lock.
  io::MappedFile::About about;
  {
    std::lock_guard<std::mutex> lock(io::g_table_mu);
    const std::vector<const io::MappedFile*>& owners = io::Owners();
    if (fault.slot < owners.size() && owners[fault.slot] != nullptr &&
        io::Table()[fault.slot].generation.load(std::memory_order_relaxed) == fault.generation) {
      about = owners[fault.slot]->about();
    }
  }
  Status status(fault.cause == io::kCauseIoError ? Code::kIoError : Code::kUnexpectedEof,
                (fault.path.empty() ? std::string("a mapped file") : fault.path) + ": " +
                    io::FaultText(fault.cause, fault.offset, fault.size) + " (" +
                    std::to_string(events - reported) +
                    " mapping(s) affected); reload the tensors");
  if (!about) return status;
  return io::WithReadHeld(std::move(status),
                          about(fault.offset, static_cast<uint64_t>(io::g_page_size)));
}

}  // namespace tensorferry

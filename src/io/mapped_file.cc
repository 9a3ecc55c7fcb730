// MappedFile and its SIGBUS guard (mapped_file.h).
#include "io/mapped_file.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "io/engine_common.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace tensorferry::io {
namespace {

// One registered mapping. begin == 0 means free. Written by Map/~MappedFile under g_table_mu,
// read by the signal handler without locks (hence atomics).
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint64_t> faults{0};
  std::atomic<uint64_t> first_fault{UINT64_MAX};
};

std::array<Slot, MappedFile::kMaxMappings>& Table() {
  static auto* table = new std::array<Slot, MappedFile::kMaxMappings>();  // never destroyed
  return *table;
}
std::atomic<size_t> g_high_water{0};  // slots [0, high water) may be in use
std::mutex g_table_mu;
struct sigaction g_previous;
std::once_flag g_install_once;
long g_page_size = 4096;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  auto& table = Table();
  const size_t n = g_high_water.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    Slot& s = table[i];
    const uintptr_t begin = s.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= s.end.load(std::memory_order_acquire)) continue;
    const uintptr_t page = addr & ~static_cast<uintptr_t>(g_page_size - 1);
    const long rc = ::syscall(SYS_mmap, page, g_page_size, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (rc == -1) break;  // cannot repair: let the previous handler decide
    if (s.faults.fetch_add(1, std::memory_order_relaxed) == 0 ||
        page - begin < s.first_fault.load(std::memory_order_relaxed)) {
      s.first_fault.store(page - begin, std::memory_order_relaxed);
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

}  // namespace

Result<std::shared_ptr<MappedFile>> MappedFile::Map(const RandomAccessFile& file, uint64_t size) {
  const int fd = file.native_handle();
  if (fd < 0) {
    return Status(Code::kUnsupported, file.path() + ": no file descriptor to map");
  }
  std::call_once(g_install_once, InstallHandler);
  void* addr = nullptr;
  if (size > 0) {
    addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      const int err = errno;
      return Status(Code::kIoError, file.path() + ": mmap of " + std::to_string(size) +
                                        " bytes failed: " + ErrnoText(err));
    }
  }
  size_t slot = kMaxMappings;
  if (addr != nullptr) {
    std::lock_guard<std::mutex> lock(g_table_mu);
    auto& table = Table();
    for (size_t i = 0; i < kMaxMappings; ++i) {
      if (table[i].begin.load(std::memory_order_relaxed) == 0) {
        slot = i;
        break;
      }
    }
    if (slot == kMaxMappings) {
      ::munmap(addr, size);
      return Status(Code::kUnsupported, file.path() + ": more than " +
                                            std::to_string(kMaxMappings) +
                                            " files mapped at once; use a copying engine");
    }
    Slot& s = table[slot];
    s.faults.store(0, std::memory_order_relaxed);
    s.first_fault.store(UINT64_MAX, std::memory_order_relaxed);
    s.end.store(reinterpret_cast<uintptr_t>(addr) + size, std::memory_order_release);
    s.begin.store(reinterpret_cast<uintptr_t>(addr), std::memory_order_release);
    if (slot + 1 > g_high_water.load(std::memory_order_relaxed)) {
      g_high_water.store(slot + 1, std::memory_order_release);
    }
  }
  return std::shared_ptr<MappedFile>(
      new MappedFile(file.path(), static_cast<std::byte*>(addr), size, slot));
}

MappedFile::~MappedFile() {
  if (data_ == nullptr) return;
  {
    // Unregister first: once unmapped, the range may be reused by someone else's mapping.
    std::lock_guard<std::mutex> lock(g_table_mu);
    Table()[slot_].begin.store(0, std::memory_order_release);
  }
  ::munmap(data_, size_);
}

Status MappedFile::Populate(uint64_t offset, uint64_t length) const {
  if (length == 0) return Status::Ok();
  if (offset > size_ || length > size_ - offset) {
    return Status(Code::kInvalidArgument, path_ + ": populate past the mapping");
  }
  const uint64_t page = static_cast<uint64_t>(g_page_size);
  const uint64_t begin = offset / page * page;
  const uint64_t end = offset + length;
  if (::madvise(data_ + begin, end - begin, MADV_POPULATE_READ) == 0) return Status::Ok();
  const int err = errno;
  if (err == EINVAL) {
    // Kernel older than 5.14: touch one byte per page; a vanished page is repaired by the SIGBUS
    // handler and shows up in faults().
    const uint64_t before = faults();
    volatile const std::byte* p = data_;
    for (uint64_t at = begin; at < end; at += page) (void)p[at];
    if (faults() != before) {
      return Status(Code::kUnexpectedEof, path_ + ": file shrank while mapped: page at offset " +
                                              std::to_string(first_fault_offset()) +
                                              " is past its end");
    }
    return Status::Ok();
  }
  if (err == EFAULT) {
    return Status(Code::kUnexpectedEof, path_ + ": file shrank while mapped: bytes in [" +
                                            std::to_string(begin) + ", " + std::to_string(end) +
                                            ") are past its end");
  }
  return Status(Code::kIoError, path_ + ": reading mapped bytes [" + std::to_string(begin) + ", " +
                                    std::to_string(end) + ") failed: " + ErrnoText(err));
}

uint64_t MappedFile::faults() const noexcept {
  return slot_ < kMaxMappings ? Table()[slot_].faults.load(std::memory_order_relaxed) : 0;
}

uint64_t MappedFile::first_fault_offset() const noexcept {
  return slot_ < kMaxMappings ? Table()[slot_].first_fault.load(std::memory_order_relaxed)
                              : UINT64_MAX;
}

}  // namespace tensorferry::io

// A fake CUDA runtime and cuFile for tests on machines without a GPU (docs/gpu.md, "The fake").
//
// It exports the C functions of libcudart and libcufile that tensorferry calls, with the same
// signatures, and models what matters for the loader's correctness:
//   - "Device memory" is host memory that the host cannot touch: cudaMalloc returns an address in
//     a PROT_NONE reservation, so dereferencing a device pointer on the host crashes at once; the
//     bytes live in a separate shadow mapping that only copies (and cuFileRead) reach. A host
//     pointer passed where a device pointer belongs (and vice versa) is refused and recorded.
//   - Streams are worker threads executing their queued operations in order, later than the call
//     that queued them (copy_delay_us widens the gap). Events complete when the worker reaches
//     them. With copy_bytes_per_second, copies share one bandwidth-limited copy engine, so a
//     pipeline's overlap of reads and copies can be measured.
//   - An async copy checksums its source when queued and again when it runs: a staging buffer
//     reused before its copy completed is caught as a violation (and as a data race under TSan).
//   - Async copies need pinned sources (cudaHostAlloc or cudaHostRegister); others are counted and,
//     with reject_pageable, refused.
//   - Freeing memory under a pending copy, unknown pointers, cuFile misuse: recorded violations.
//   - Faults on demand: device memory size, the n-th pinned allocation, the n-th copy (at once or
//     asynchronously on its stream), cudaGetDeviceCount errors, cuFile driver/handle/read errors.
//   - Accounting: bytes in use and peaks, live objects, copies, cuFile registrations and reads.
// Tests drive and read it through fake_cuda_control.h.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fake_cuda/fake_cuda_control.h"

#define TF_FAKE_EXPORT extern "C" __attribute__((visibility("default")))

// The handle and cuFile types under the names CUDA's headers give them, as callers declare them
// (tensorferry's shim does too), so the function types match exactly.
struct CUstream_st;
struct CUevent_st;
struct CUfileError {
  int err;
  int cu_err;
};
struct CUfileDescr_t {
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};

namespace {

using Error = int;
constexpr Error kSuccess = 0;
constexpr Error kInvalidValue = 1;
constexpr Error kMemoryAllocation = 2;
constexpr Error kInvalidPitchValue = 12;
constexpr Error kInvalidDevice = 101;
constexpr Error kNoDevice = 100;
constexpr Error kInvalidResourceHandle = 400;
constexpr Error kNotReady = 600;
constexpr Error kIllegalAddress = 700;
constexpr Error kHostMemoryAlreadyRegistered = 712;
constexpr Error kHostMemoryNotRegistered = 713;
constexpr Error kUnknown = 999;

constexpr int kMemcpyHostToHost = 0;
constexpr int kMemcpyHostToDevice = 1;
constexpr int kMemcpyDeviceToHost = 2;
constexpr int kMemcpyDeviceToDevice = 3;
constexpr int kMemcpyDefault = 4;

constexpr size_t kMaxViolations = 64;
constexpr unsigned char kFreshDeviceByte = 0xCD;  // uninitialized device memory reads as this

size_t PageRound(uint64_t n) {
  const uint64_t page = 4096;
  return static_cast<size_t>((n + page - 1) / page * page);
}

// One cudaMalloc: an address range nobody may touch, and the shadow bytes behind it. Unmapped when
// the last reference goes (a copy still queued keeps it alive after cudaFree).
struct DeviceAlloc {
  uintptr_t base = 0;
  uint64_t size = 0;
  int device = 0;
  std::byte* shadow = nullptr;
  size_t map_len = 0;
  bool cufile_registered = false;
  ~DeviceAlloc() {
    if (base != 0) ::munmap(reinterpret_cast<void*>(base), map_len);
    if (shadow != nullptr) ::munmap(shadow, map_len);
  }
};

// Pinned host memory: cudaHostAlloc'd (owned, unmapped with the last reference) or registered.
struct HostRegion {
  uintptr_t base = 0;
  uint64_t size = 0;
  bool owned = false;
  size_t map_len = 0;
  ~HostRegion() {
    if (owned && base != 0) ::munmap(reinterpret_cast<void*>(base), map_len);
  }
};

struct EventState {
  uint64_t recorded = 0;   // cudaEventRecord calls
  uint64_t completed = 0;  // the last record a stream has reached
  Error error = kSuccess;  // the error of that stream when it reached it
};

struct CopyOp {
  uint64_t id = 0;
  std::shared_ptr<DeviceAlloc> dst_alloc;
  std::shared_ptr<HostRegion> src_region;  // keeps an owned source mapped until the copy ran
  std::byte* dst = nullptr;                // in the shadow
  const std::byte* src = nullptr;
  uint64_t width = 0, height = 1, spitch = 0, dpitch = 0;
  uint64_t checksum = 0;
  std::string what;
};

struct Op {
  bool is_copy = true;
  CopyOp copy;
  std::shared_ptr<EventState> event;
  uint64_t generation = 0;
};

struct StreamState {
  std::deque<Op> queue;
  bool busy = false;
  bool stop = false;
  Error error = kSuccess;  // after a failed copy: reported by every later sync point
  std::condition_variable cv;
  std::thread worker;
};

struct Range {
  uintptr_t begin = 0, end = 0;
  bool Overlaps(uintptr_t b, uintptr_t e) const { return begin < e && b < end; }
};

struct PendingCopy {
  Range src, dst;
};

// A registered file: the fake reads through its own descriptor without O_DIRECT (the real library
// handles unaligned requests itself; pread on an O_DIRECT descriptor would refuse them).
struct CufileHandleState {
  int fd = -1;
  ~CufileHandleState() {
    if (fd >= 0) ::close(fd);
  }
};

struct State {
  std::mutex mu;
  std::condition_variable done_cv;  // an operation finished on some stream
  TfFakeCudaConfig config{};
  TfFakeCudaStats stats{};
  std::vector<std::string> violations;
  uint64_t violation_count = 0;
  std::map<uintptr_t, std::shared_ptr<DeviceAlloc>> device;
  std::map<uintptr_t, std::shared_ptr<HostRegion>> pinned;
  std::map<StreamState*, std::shared_ptr<StreamState>> streams;
  std::shared_ptr<StreamState> default_stream;
  std::map<EventState*, std::shared_ptr<EventState>> events;
  std::map<uint64_t, PendingCopy> pending;
  std::vector<uint64_t> device_in_use;
  std::map<void*, std::unique_ptr<CufileHandleState>> cufile_handles;
  uint64_t next_copy_id = 1;
  int64_t host_alloc_calls = 0;
  int64_t copy_enqueue_calls = 0;
  int64_t copies_started = 0;
  int64_t cufile_read_calls = 0;
  // With copy_bytes_per_second: when the shared copy engine finishes the copies started so far.
  std::chrono::steady_clock::time_point copy_engine_free{};
};

void DefaultConfig(TfFakeCudaConfig* c) {
  std::memset(c, 0, sizeof *c);
  c->device_count = 1;
  c->device_memory = 1ull << 30;
  c->reject_pageable = 1;
}

// Never destroyed: stream workers may still wait on it while the process exits.
State& S() {
  static State* state = [] {
    auto* s = new State;
    DefaultConfig(&s->config);
    return s;
  }();
  return *state;
}

// Per-thread CUDA state (current device, last error), as the real runtime keeps it. A table, not
// thread_local: this library is dlopen'ed, and LeakSanitizer's scan of a dlopen'ed library's
// dynamic TLS crashes ("Tracer caught signal 11" in ScanRangeForPointers, clang 14 with glibc
// 2.36) depending on the test binary's layout. Entries are never erased (a thread id reused by a
// later thread inherits its state; tests do not rely on a fresh thread's defaults).
struct ThreadState {
  int current_device = 0;
  Error last_error = kSuccess;
};
ThreadState& Self() {
  static std::mutex* mu = new std::mutex;
  static auto* table = new std::unordered_map<std::thread::id, ThreadState>;
  std::lock_guard<std::mutex> lock(*mu);
  return (*table)[std::this_thread::get_id()];  // nodes never move: the reference stays valid
}

Error Fail(Error e) {
  Self().last_error = e;
  return e;
}

// The calling thread's current device's primary context now exists. REQUIRES: S().mu held.
void TouchContext(int device) {
  if (device >= 0 && device < 64) S().stats.contexts_active_mask |= uint64_t{1} << device;
}

// REQUIRES: S().mu held.
void Violation(const std::string& what) {
  State& s = S();
  ++s.violation_count;
  ++s.stats.violations;
  if (s.violations.size() < kMaxViolations) s.violations.push_back(what);
}

std::string Hex(uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(p));
  return buf;
}

uintptr_t Addr(const void* p) {
  return reinterpret_cast<uintptr_t>(p);
}

// The allocation holding all of [p, p + n), or nullptr. REQUIRES: mu held.
std::shared_ptr<DeviceAlloc> FindDevice(uintptr_t p, uint64_t n) {
  State& s = S();
  auto it = s.device.upper_bound(p);
  if (it == s.device.begin()) return nullptr;
  --it;
  const DeviceAlloc& a = *it->second;
  if (p >= a.base && p - a.base <= a.size && n <= a.size - (p - a.base)) return it->second;
  return nullptr;
}

// True when any byte of [p, p + n) is device memory. REQUIRES: mu held.
bool TouchesDevice(uintptr_t p, uint64_t n) {
  State& s = S();
  const uint64_t len = std::max<uint64_t>(n, 1);
  auto it = s.device.upper_bound(p + len - 1);
  if (it == s.device.begin()) return false;
  --it;
  return Range{it->second->base, it->second->base + it->second->size}.Overlaps(p, p + len);
}

std::shared_ptr<HostRegion> FindPinned(uintptr_t p, uint64_t n) {
  State& s = S();
  auto it = s.pinned.upper_bound(p);
  if (it == s.pinned.begin()) return nullptr;
  --it;
  const HostRegion& r = *it->second;
  if (p >= r.base && p - r.base <= r.size && n <= r.size - (p - r.base)) return it->second;
  return nullptr;
}

// A pending copy reads or writes [b, e). REQUIRES: mu held.
bool PendingTouches(uintptr_t b, uintptr_t e, bool as_source) {
  for (const auto& [id, p] : S().pending) {
    if ((as_source ? p.src : p.dst).Overlaps(b, e)) return true;
  }
  return false;
}

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h *= 0xFF51AFD7ED558CCDull;
  return h ^ (h >> 33);
}

uint64_t Checksum(const std::byte* p, uint64_t width, uint64_t height, uint64_t pitch) {
  uint64_t h = 0x12345678;
  for (uint64_t r = 0; r < height; ++r) {
    const std::byte* row = p + r * pitch;
    uint64_t i = 0;
    for (; i + 8 <= width; i += 8) {
      uint64_t v;
      std::memcpy(&v, row + i, 8);
      h = Mix(h, v);
    }
    for (; i < width; ++i) h = Mix(h, static_cast<uint64_t>(row[i]));
  }
  return Mix(h, width * height);
}

void WorkerLoop(StreamState* st) {
  State& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    st->cv.wait(lock, [st] { return st->stop || !st->queue.empty(); });
    if (st->queue.empty()) return;  // stopped and drained
    Op op = std::move(st->queue.front());
    st->queue.pop_front();
    st->busy = true;
    if (op.is_copy) {
      CopyOp& c = op.copy;
      const bool skip = st->error != kSuccess;  // a failed stream performs no more work
      ++s.copies_started;
      const bool fail =
          s.config.fail_copy_execute_at > 0 && s.copies_started == s.config.fail_copy_execute_at;
      const uint32_t delay = s.config.copy_delay_us;
      // The copy engine's time for this copy: after the copies started before it on any stream.
      std::chrono::steady_clock::time_point engine_done{};
      const uint64_t bandwidth = s.config.copy_bytes_per_second;
      if (bandwidth > 0 && !skip && !fail) {
        const auto start = std::max(std::chrono::steady_clock::now(), s.copy_engine_free);
        engine_done = start + std::chrono::nanoseconds(
                                  static_cast<int64_t>(static_cast<double>(c.width * c.height) *
                                                       1e9 / static_cast<double>(bandwidth)));
        s.copy_engine_free = engine_done;
      }
      lock.unlock();
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      bool changed = false;
      if (!skip && !fail) {
        changed = Checksum(c.src, c.width, c.height, c.spitch) != c.checksum;
        for (uint64_t r = 0; r < c.height; ++r) {
          std::memcpy(c.dst + r * c.dpitch, c.src + r * c.spitch, c.width);
        }
        if (bandwidth > 0) std::this_thread::sleep_until(engine_done);
      }
      lock.lock();
      if (fail) st->error = kIllegalAddress;
      if (changed) {
        Violation(c.what +
                  ": the source bytes changed between cudaMemcpyAsync and the copy "
                  "(a staging buffer reused before its copy completed)");
      }
      if (!skip && !fail) {
        ++s.stats.copies_executed;
        s.stats.bytes_copied_to_device += c.width * c.height;
      }
      s.pending.erase(c.id);
    } else {
      EventState& e = *op.event;
      e.completed = std::max(e.completed, op.generation);
      e.error = st->error;
    }
    st->busy = false;
    s.done_cv.notify_all();
  }
}

std::shared_ptr<StreamState> StartStream() {
  auto st = std::make_shared<StreamState>();
  st->worker = std::thread(WorkerLoop, st.get());
  return st;
}

// REQUIRES: mu held. nullptr: the handle is unknown.
StreamState* LookupStream(void* handle) {
  State& s = S();
  if (handle == nullptr) {
    if (!s.default_stream) s.default_stream = StartStream();
    return s.default_stream.get();
  }
  auto it = s.streams.find(static_cast<StreamState*>(handle));
  return it == s.streams.end() ? nullptr : it->second.get();
}

// Validates and queues a host-to-device copy of `height` rows of `width` bytes.
Error EnqueueCopy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                  size_t height, int kind, void* stream, const char* fn) {
  const bool is_2d = height != 1 || dpitch != width || spitch != width;
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.copy_enqueue_calls;
  if (s.config.fail_copy_enqueue_at > 0 && s.copy_enqueue_calls == s.config.fail_copy_enqueue_at) {
    return Fail(kUnknown);
  }
  StreamState* st = LookupStream(stream);
  if (st == nullptr) return Fail(kInvalidResourceHandle);
  if (width == 0 || height == 0) return kSuccess;
  if (width > dpitch || width > spitch) return Fail(kInvalidPitchValue);
  const uint64_t dst_len = dpitch * (height - 1) + width;
  const uint64_t src_len = spitch * (height - 1) + width;
  const std::string what = std::string(fn) + "(dst " + Hex(Addr(dst)) + ", src " + Hex(Addr(src)) +
                           ", " + std::to_string(width * height) + " bytes)";
  if (kind != kMemcpyHostToDevice && kind != kMemcpyDefault) {
    Violation(what + ": the fake models host-to-device async copies only (kind " +
              std::to_string(kind) + ")");
    return Fail(kInvalidValue);
  }
  std::shared_ptr<DeviceAlloc> dst_alloc = FindDevice(Addr(dst), dst_len);
  if (!dst_alloc) {
    Violation(what + ": the destination is not (entirely) device memory");
    return Fail(kInvalidValue);
  }
  if (TouchesDevice(Addr(src), src_len)) {
    Violation(what + ": the source is device memory, not host memory");
    return Fail(kInvalidValue);
  }
  std::shared_ptr<HostRegion> region = FindPinned(Addr(src), src_len);
  if (!region) {
    ++s.stats.pageable_copies;
    if (s.config.reject_pageable) {
      Violation(what + ": the source is not pinned (cudaHostAlloc/cudaHostRegister)");
      return Fail(kInvalidValue);
    }
  }
  // Only now that the source is known to be host memory may it be read (in the caller's thread).
  const uint64_t sum = Checksum(static_cast<const std::byte*>(src), width, height, spitch);
  Op op;
  CopyOp& c = op.copy;
  c.id = s.next_copy_id++;
  c.dst = dst_alloc->shadow + (Addr(dst) - dst_alloc->base);
  c.dst_alloc = std::move(dst_alloc);
  if (region && region->owned) c.src_region = region;
  c.src = static_cast<const std::byte*>(src);
  c.width = width;
  c.height = height;
  c.spitch = spitch;
  c.dpitch = dpitch;
  c.checksum = sum;
  c.what = what;
  s.pending[c.id] = PendingCopy{{Addr(src), Addr(src) + src_len}, {Addr(dst), Addr(dst) + dst_len}};
  s.stats.max_copies_pending = std::max<uint64_t>(s.stats.max_copies_pending, s.pending.size());
  ++s.stats.copies_enqueued;
  if (is_2d) ++s.stats.copies_2d;
  st->queue.push_back(std::move(op));
  st->cv.notify_one();
  return kSuccess;
}

bool ValidDevice(int device) {
  return device >= 0 && device < S().config.device_count;
}

}  // namespace

// --- control -------------------------------------------------------------------------------------

TF_FAKE_EXPORT void tf_fake_cuda_default_config(TfFakeCudaConfig* config) {
  DefaultConfig(config);
}

TF_FAKE_EXPORT void tf_fake_cuda_reset(const TfFakeCudaConfig* config) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (config != nullptr) {
    s.config = *config;
  } else {
    DefaultConfig(&s.config);
  }
  // Keep the gauges of live objects; zero the rest.
  TfFakeCudaStats kept{};
  kept.device_bytes_in_use = s.stats.device_bytes_in_use;
  kept.peak_device_bytes = s.stats.device_bytes_in_use;
  kept.device_allocations_live = s.stats.device_allocations_live;
  kept.pinned_bytes_in_use = s.stats.pinned_bytes_in_use;
  kept.peak_pinned_bytes = s.stats.pinned_bytes_in_use;
  kept.pinned_allocations_live = s.stats.pinned_allocations_live;
  kept.streams_live = s.stats.streams_live;
  kept.events_live = s.stats.events_live;
  kept.cufile_drivers_open = s.stats.cufile_drivers_open;
  kept.cufile_handles_live = s.stats.cufile_handles_live;
  kept.cufile_buffers_registered_live = s.stats.cufile_buffers_registered_live;
  s.stats = kept;
  s.violations.clear();
  s.violation_count = 0;
  s.host_alloc_calls = 0;
  s.copy_enqueue_calls = 0;
  s.copies_started = 0;
  s.cufile_read_calls = 0;
  s.copy_engine_free = {};
}

TF_FAKE_EXPORT void tf_fake_cuda_stats(TfFakeCudaStats* stats) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  *stats = s.stats;
}

TF_FAKE_EXPORT size_t tf_fake_cuda_violations(char* buffer, size_t size) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  std::string all;
  for (const std::string& v : s.violations) all += v + "\n";
  if (buffer != nullptr && size > 0) {
    const size_t n = std::min(all.size(), size - 1);
    std::memcpy(buffer, all.data(), n);
    buffer[n] = '\0';
  }
  return s.violation_count;
}

// --- devices and versions ------------------------------------------------------------------------

TF_FAKE_EXPORT Error cudaGetDeviceCount(int* count) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  *count = 0;
  if (s.config.device_count_error != 0) return Fail(s.config.device_count_error);
  if (s.config.device_count <= 0) return Fail(kNoDevice);
  *count = s.config.device_count;
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaSetDevice(int device) {
  std::lock_guard<std::mutex> lock(S().mu);
  if (!ValidDevice(device)) return Fail(kInvalidDevice);
  Self().current_device = device;
  TouchContext(device);  // CUDA 12: cudaSetDevice creates the primary context
  return kSuccess;
}

// The driver's view of a primary context (libcuda's cuDeviceGet, cuDevicePrimaryCtxGetState).
TF_FAKE_EXPORT int cuDeviceGet(int* device, int ordinal) {
  std::lock_guard<std::mutex> lock(S().mu);
  if (!ValidDevice(ordinal)) return 101;  // CUDA_ERROR_INVALID_DEVICE
  *device = ordinal;
  return 0;
}

TF_FAKE_EXPORT int cuDevicePrimaryCtxGetState(int device, unsigned* flags, int* active) {
  std::lock_guard<std::mutex> lock(S().mu);
  if (!ValidDevice(device)) return 101;
  *flags = 0;
  *active = device < 64 && (S().stats.contexts_active_mask >> device & 1) != 0 ? 1 : 0;
  return 0;
}

TF_FAKE_EXPORT Error cudaGetDevice(int* device) {
  *device = Self().current_device;
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaDriverGetVersion(int* version) {
  *version = 13000;
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaRuntimeGetVersion(int* version) {
  *version = 13000;
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaDeviceGetAttribute(int* value, int attribute, int device) {
  std::lock_guard<std::mutex> lock(S().mu);
  if (!ValidDevice(device)) return Fail(kInvalidDevice);
  switch (attribute) {
    case 33: *value = 0x10 + device; break;  // PCI bus
    case 34: *value = 0; break;              // PCI device
    case 50: *value = 0; break;              // PCI domain
    case 75: *value = 9; break;              // compute capability major
    case 76: *value = 0; break;              // minor
    default: *value = 0; break;
  }
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaDeviceGetPCIBusId(char* pci_bus_id, int length, int device) {
  std::lock_guard<std::mutex> lock(S().mu);
  if (!ValidDevice(device)) return Fail(kInvalidDevice);
  if (length <= 0) return Fail(kInvalidValue);
  std::snprintf(pci_bus_id, static_cast<size_t>(length), "0000:%02x:00.0", 0x10 + device);
  return kSuccess;
}

// Fills the leading fields of cudaDeviceProp: name (offset 0) and totalGlobalMem (offset 288).
TF_FAKE_EXPORT Error cudaGetDeviceProperties(void* prop, int device) {
  std::lock_guard<std::mutex> lock(S().mu);
  if (!ValidDevice(device)) return Fail(kInvalidDevice);
  auto* bytes = static_cast<char*>(prop);
  std::memset(bytes, 0, 296);
  std::snprintf(bytes, 256, "tensorferry fake GPU %d", device);
  const size_t total = static_cast<size_t>(S().config.device_memory);
  std::memcpy(bytes + 288, &total, sizeof total);
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaMemGetInfo(size_t* free, size_t* total) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const uint64_t limit = s.config.device_memory;
  const auto d = static_cast<size_t>(Self().current_device);
  const uint64_t used = d < s.device_in_use.size() ? s.device_in_use[d] : 0;
  *total = static_cast<size_t>(limit);
  *free = static_cast<size_t>(used >= limit ? 0 : limit - used);
  return kSuccess;
}

TF_FAKE_EXPORT const char* cudaGetErrorName(Error error) {
  switch (error) {
    case kSuccess: return "cudaSuccess";
    case kInvalidValue: return "cudaErrorInvalidValue";
    case kMemoryAllocation: return "cudaErrorMemoryAllocation";
    case kInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case 35: return "cudaErrorInsufficientDriver";
    case kNoDevice: return "cudaErrorNoDevice";
    case kInvalidDevice: return "cudaErrorInvalidDevice";
    case kInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case kNotReady: return "cudaErrorNotReady";
    case kIllegalAddress: return "cudaErrorIllegalAddress";
    case kHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case kHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
    case kUnknown: return "cudaErrorUnknown";
    default: return "unrecognized error code";
  }
}

TF_FAKE_EXPORT const char* cudaGetErrorString(Error error) {
  switch (error) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case kMemoryAllocation: return "out of memory";
    case kInvalidPitchValue: return "invalid pitch argument";
    case 35: return "CUDA driver version is insufficient for CUDA runtime version";
    case kNoDevice: return "no CUDA-capable device is detected";
    case kInvalidDevice: return "invalid device ordinal";
    case kInvalidResourceHandle: return "invalid resource handle";
    case kNotReady: return "device not ready";
    case kIllegalAddress: return "an illegal memory access was encountered";
    case kHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case kHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case kUnknown: return "unknown error";
    default: return "unrecognized error code";
  }
}

TF_FAKE_EXPORT Error cudaGetLastError() {
  ThreadState& self = Self();
  const Error e = self.last_error;
  self.last_error = kSuccess;
  return e;
}

// --- memory --------------------------------------------------------------------------------------

TF_FAKE_EXPORT Error cudaMalloc(void** ptr, size_t size) {
  *ptr = nullptr;
  if (size == 0) return kSuccess;
  State& s = S();
  const int device = Self().current_device;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.device_in_use.size() <= static_cast<size_t>(device)) {
      s.device_in_use.resize(static_cast<size_t>(device) + 1, 0);
    }
    const uint64_t used = s.device_in_use[static_cast<size_t>(device)];
    if (size > s.config.device_memory || used > s.config.device_memory - size) {
      return Fail(kMemoryAllocation);
    }
    s.device_in_use[static_cast<size_t>(device)] += size;  // reserved; undone below on failure
    TouchContext(device);
  }
  auto a = std::make_shared<DeviceAlloc>();
  a->size = size;
  a->device = device;
  a->map_len = PageRound(size);
  void* reserved =
      ::mmap(nullptr, a->map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* shadow =
      ::mmap(nullptr, a->map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (reserved != MAP_FAILED) a->base = Addr(reserved);
  if (shadow != MAP_FAILED) a->shadow = static_cast<std::byte*>(shadow);
  std::lock_guard<std::mutex> lock(s.mu);
  if (reserved == MAP_FAILED || shadow == MAP_FAILED) {
    s.device_in_use[static_cast<size_t>(device)] -= size;
    return Fail(kMemoryAllocation);
  }
  std::memset(a->shadow, kFreshDeviceByte, size);
  s.device[a->base] = a;
  s.stats.device_bytes_in_use += size;
  s.stats.peak_device_bytes = std::max(s.stats.peak_device_bytes, s.stats.device_bytes_in_use);
  ++s.stats.device_allocations_live;
  ++s.stats.device_allocations_total;
  *ptr = reinterpret_cast<void*>(a->base);
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaFree(void* ptr) {
  if (ptr == nullptr) return kSuccess;
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  TouchContext(Self().current_device);  // the runtime initializes the current device's context
  auto it = s.device.find(Addr(ptr));
  if (it == s.device.end()) {
    Violation("cudaFree(" + Hex(Addr(ptr)) + "): not a pointer returned by cudaMalloc");
    return Fail(kInvalidValue);
  }
  const DeviceAlloc& a = *it->second;
  if (PendingTouches(a.base, a.base + a.size, /*as_source=*/false)) {
    Violation("cudaFree(" + Hex(a.base) + ") while a copy into it is still pending");
  }
  if (a.cufile_registered) {
    Violation("cudaFree(" + Hex(a.base) + ") while it is registered with cuFileBufRegister");
  }
  s.device_in_use[static_cast<size_t>(a.device)] -= a.size;
  s.stats.device_bytes_in_use -= a.size;
  --s.stats.device_allocations_live;
  s.device.erase(it);
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaHostAlloc(void** ptr, size_t size, unsigned flags) {
  (void)flags;
  *ptr = nullptr;
  State& s = S();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.host_alloc_calls;
    if (s.config.fail_host_alloc_at > 0 && s.host_alloc_calls == s.config.fail_host_alloc_at) {
      ++s.stats.host_alloc_failures;
      return Fail(kMemoryAllocation);
    }
  }
  if (size == 0) return kSuccess;
  auto r = std::make_shared<HostRegion>();
  r->size = size;
  r->owned = true;
  r->map_len = PageRound(size);
  void* p = ::mmap(nullptr, r->map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Fail(kMemoryAllocation);
  r->base = Addr(p);
  std::lock_guard<std::mutex> lock(s.mu);
  s.pinned[r->base] = r;
  s.stats.pinned_bytes_in_use += size;
  s.stats.peak_pinned_bytes = std::max(s.stats.peak_pinned_bytes, s.stats.pinned_bytes_in_use);
  ++s.stats.pinned_allocations_live;
  *ptr = p;
  return kSuccess;
}

namespace {

Error ReleasePinned(void* ptr, bool owned, const char* fn) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.pinned.find(Addr(ptr));
  if (it == s.pinned.end() || it->second->owned != owned) {
    Violation(std::string(fn) + "(" + Hex(Addr(ptr)) + "): not a pointer from " +
              (owned ? "cudaHostAlloc" : "cudaHostRegister"));
    return Fail(owned ? kInvalidValue : kHostMemoryNotRegistered);
  }
  const HostRegion& r = *it->second;
  if (PendingTouches(r.base, r.base + r.size, /*as_source=*/true)) {
    Violation(std::string(fn) + "(" + Hex(r.base) + ") while a copy from it is still pending");
  }
  s.stats.pinned_bytes_in_use -= r.size;
  --s.stats.pinned_allocations_live;
  s.pinned.erase(it);
  return kSuccess;
}

}  // namespace

TF_FAKE_EXPORT Error cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return kSuccess;
  return ReleasePinned(ptr, /*owned=*/true, "cudaFreeHost");
}

TF_FAKE_EXPORT Error cudaHostRegister(void* ptr, size_t size, unsigned flags) {
  (void)flags;
  if (ptr == nullptr || size == 0) return Fail(kInvalidValue);
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  for (const auto& [base, r] : s.pinned) {
    if (Range{r->base, r->base + r->size}.Overlaps(Addr(ptr), Addr(ptr) + size)) {
      return Fail(kHostMemoryAlreadyRegistered);
    }
  }
  if (TouchesDevice(Addr(ptr), size)) {
    Violation("cudaHostRegister(" + Hex(Addr(ptr)) + "): device memory is not host memory");
    return Fail(kInvalidValue);
  }
  auto r = std::make_shared<HostRegion>();
  r->base = Addr(ptr);
  r->size = size;
  s.pinned[r->base] = r;
  s.stats.pinned_bytes_in_use += size;
  s.stats.peak_pinned_bytes = std::max(s.stats.peak_pinned_bytes, s.stats.pinned_bytes_in_use);
  ++s.stats.pinned_allocations_live;
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaHostUnregister(void* ptr) {
  return ReleasePinned(ptr, /*owned=*/false, "cudaHostUnregister");
}

// Synchronous copies in any direction (tests read device memory back with it).
TF_FAKE_EXPORT Error cudaMemcpy(void* dst, const void* src, size_t count, int kind) {
  if (count == 0) return kSuccess;
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::string what = "cudaMemcpy(dst " + Hex(Addr(dst)) + ", src " + Hex(Addr(src)) + ", " +
                           std::to_string(count) + " bytes)";
  std::shared_ptr<DeviceAlloc> dst_dev = FindDevice(Addr(dst), count);
  std::shared_ptr<DeviceAlloc> src_dev = FindDevice(Addr(src), count);
  const bool dst_touches = TouchesDevice(Addr(dst), count);
  const bool src_touches = TouchesDevice(Addr(src), count);
  bool dst_is_device = false, src_is_device = false;
  switch (kind) {
    case kMemcpyHostToHost: break;
    case kMemcpyHostToDevice: dst_is_device = true; break;
    case kMemcpyDeviceToHost: src_is_device = true; break;
    case kMemcpyDeviceToDevice: dst_is_device = src_is_device = true; break;
    case kMemcpyDefault:
      dst_is_device = dst_touches;
      src_is_device = src_touches;
      break;
    default: return Fail(kInvalidValue);
  }
  if (dst_is_device ? !dst_dev : dst_touches) {
    Violation(what + ": destination " +
              (dst_is_device ? "is not device memory" : "is device memory"));
    return Fail(kInvalidValue);
  }
  if (src_is_device ? !src_dev : src_touches) {
    Violation(what + ": source " + (src_is_device ? "is not device memory" : "is device memory"));
    return Fail(kInvalidValue);
  }
  std::byte* d =
      dst_is_device ? dst_dev->shadow + (Addr(dst) - dst_dev->base) : static_cast<std::byte*>(dst);
  const std::byte* from = src_is_device ? src_dev->shadow + (Addr(src) - src_dev->base)
                                        : static_cast<const std::byte*>(src);
  std::memmove(d, from, count);
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaMemcpyAsync(void* dst, const void* src, size_t count, int kind,
                                     CUstream_st* stream) {
  return EnqueueCopy(dst, count, src, count, count, 1, kind, stream, "cudaMemcpyAsync");
}

TF_FAKE_EXPORT Error cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                                       size_t width, size_t height, int kind, CUstream_st* stream) {
  return EnqueueCopy(dst, dpitch, src, spitch, width, height, kind, stream, "cudaMemcpy2DAsync");
}

// --- streams and events --------------------------------------------------------------------------

TF_FAKE_EXPORT Error cudaStreamCreateWithFlags(CUstream_st** stream, unsigned flags) {
  (void)flags;
  std::shared_ptr<StreamState> st = StartStream();
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  TouchContext(Self().current_device);
  s.streams[st.get()] = st;
  ++s.stats.streams_live;
  *stream = reinterpret_cast<CUstream_st*>(st.get());
  return kSuccess;
}

// Work already queued still completes (as in CUDA); this call waits for it.
TF_FAKE_EXPORT Error cudaStreamDestroy(CUstream_st* stream) {
  State& s = S();
  std::shared_ptr<StreamState> st;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.streams.find(reinterpret_cast<StreamState*>(stream));
    if (it == s.streams.end()) return Fail(kInvalidResourceHandle);
    st = it->second;
    s.streams.erase(it);
    --s.stats.streams_live;
    st->stop = true;
    st->cv.notify_all();
  }
  st->worker.join();
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaStreamSynchronize(CUstream_st* stream) {
  State& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  StreamState* st = LookupStream(stream);
  if (st == nullptr) return Fail(kInvalidResourceHandle);
  s.done_cv.wait(lock, [st] { return st->queue.empty() && !st->busy; });
  return st->error == kSuccess ? kSuccess : Fail(st->error);
}

TF_FAKE_EXPORT Error cudaEventCreateWithFlags(CUevent_st** event, unsigned flags) {
  (void)flags;
  auto e = std::make_shared<EventState>();
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  TouchContext(Self().current_device);
  s.events[e.get()] = e;
  ++s.stats.events_live;
  *event = reinterpret_cast<CUevent_st*>(e.get());
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaEventDestroy(CUevent_st* event) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.events.find(reinterpret_cast<EventState*>(event));
  if (it == s.events.end()) return Fail(kInvalidResourceHandle);
  s.events.erase(it);  // a record still queued keeps the state alive
  --s.stats.events_live;
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaEventRecord(CUevent_st* event, CUstream_st* stream) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.events.find(reinterpret_cast<EventState*>(event));
  if (it == s.events.end()) return Fail(kInvalidResourceHandle);
  StreamState* st = LookupStream(stream);
  if (st == nullptr) return Fail(kInvalidResourceHandle);
  Op op;
  op.is_copy = false;
  op.event = it->second;
  op.generation = ++it->second->recorded;
  st->queue.push_back(std::move(op));
  st->cv.notify_one();
  return kSuccess;
}

TF_FAKE_EXPORT Error cudaEventQuery(CUevent_st* event) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.events.find(reinterpret_cast<EventState*>(event));
  if (it == s.events.end()) return Fail(kInvalidResourceHandle);
  const EventState& e = *it->second;
  if (e.completed < e.recorded) return kNotReady;
  return e.error == kSuccess ? kSuccess : Fail(e.error);
}

TF_FAKE_EXPORT Error cudaEventSynchronize(CUevent_st* event) {
  State& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  auto it = s.events.find(reinterpret_cast<EventState*>(event));
  if (it == s.events.end()) return Fail(kInvalidResourceHandle);
  std::shared_ptr<EventState> e = it->second;
  const uint64_t target = e->recorded;
  s.done_cv.wait(lock, [&e, target] { return e->completed >= target; });
  return e->error == kSuccess ? kSuccess : Fail(e->error);
}

// --- cuFile --------------------------------------------------------------------------------------

namespace {

using CufileError = ::CUfileError;
using CufileDescr = ::CUfileDescr_t;

constexpr int kCuFileDriverNotInitialized = 5001;
constexpr int kCuFileCudaPointerInvalid = 5012;
constexpr int kCuFileInvalidValue = 5022;
constexpr int kCuFileMemoryAlreadyRegistered = 5023;
constexpr int kCuFileMemoryNotRegistered = 5024;
constexpr int kCuFileHandleNotRegistered = 5027;

CufileError CufileResult(int err) {
  return CufileError{err, 0};
}

}  // namespace

// Declares this library a test double that needs no kernel support for GDS: cufile_api.cc skips
// GdsPlatformProblem for it (kPlatformFreeSymbol).
TF_FAKE_EXPORT int tensorferry_cufile_needs_no_platform() {
  return 1;
}

TF_FAKE_EXPORT CufileError cuFileDriverOpen() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.config.cufile_driver_open_error != 0) {
    return CufileResult(s.config.cufile_driver_open_error);
  }
  ++s.stats.cufile_drivers_open;
  return CufileResult(0);
}

TF_FAKE_EXPORT CufileError cuFileDriverClose_v2() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.stats.cufile_drivers_open == 0) {
    Violation("cuFileDriverClose without a matching cuFileDriverOpen");
    return CufileResult(kCuFileDriverNotInitialized);
  }
  --s.stats.cufile_drivers_open;
  return CufileResult(0);
}

TF_FAKE_EXPORT CufileError cuFileDriverClose() {
  return cuFileDriverClose_v2();
}

TF_FAKE_EXPORT CufileError cuFileHandleRegister(void** handle, CufileDescr* descr) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.stats.cufile_drivers_open == 0) return CufileResult(kCuFileDriverNotInitialized);
  struct stat st;
  if (descr == nullptr || descr->type != 1 || ::fstat(descr->handle.fd, &st) != 0) {
    return CufileResult(kCuFileInvalidValue);
  }
  if (s.config.cufile_handle_register_error != 0) {
    return CufileResult(s.config.cufile_handle_register_error);
  }
  auto h = std::make_unique<CufileHandleState>();
  const std::string self = "/proc/self/fd/" + std::to_string(descr->handle.fd);
  h->fd = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
  if (h->fd < 0) return CufileResult(kCuFileInvalidValue);
  *handle = h.get();
  s.cufile_handles[h.get()] = std::move(h);
  ++s.stats.cufile_handles_live;
  return CufileResult(0);
}

TF_FAKE_EXPORT void cuFileHandleDeregister(void* handle) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.cufile_handles.erase(handle) == 0) {
    Violation("cuFileHandleDeregister(" + Hex(Addr(handle)) + "): not a registered handle");
    return;
  }
  --s.stats.cufile_handles_live;
}

TF_FAKE_EXPORT CufileError cuFileBufRegister(const void* base, size_t length, int flags) {
  (void)flags;
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.stats.cufile_buf_register_calls;
  if (s.stats.cufile_drivers_open == 0) return CufileResult(kCuFileDriverNotInitialized);
  auto it = s.device.find(Addr(base));
  if (it == s.device.end() || length > it->second->size) {
    return CufileResult(kCuFileCudaPointerInvalid);
  }
  if (it->second->cufile_registered) return CufileResult(kCuFileMemoryAlreadyRegistered);
  it->second->cufile_registered = true;
  ++s.stats.cufile_buffers_registered_live;
  return CufileResult(0);
}

TF_FAKE_EXPORT CufileError cuFileBufDeregister(const void* base) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.device.find(Addr(base));
  if (it == s.device.end() || !it->second->cufile_registered) {
    return CufileResult(kCuFileMemoryNotRegistered);
  }
  it->second->cufile_registered = false;
  --s.stats.cufile_buffers_registered_live;
  return CufileResult(0);
}

TF_FAKE_EXPORT ssize_t cuFileRead(void* handle, void* base, size_t size, off_t file_offset,
                                  off_t base_offset) {
  State& s = S();
  std::shared_ptr<DeviceAlloc> alloc;
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.cufile_read_calls;
    ++s.stats.cufile_reads;
    auto h = s.cufile_handles.find(handle);
    if (h == s.cufile_handles.end()) return -kCuFileHandleNotRegistered;
    fd = h->second->fd;
    if (base_offset < 0 || file_offset < 0) return -kCuFileInvalidValue;
    const uintptr_t dst = Addr(base) + static_cast<uintptr_t>(base_offset);
    alloc = FindDevice(dst, size);
    if (!alloc) {
      Violation("cuFileRead into " + Hex(dst) + " (" + std::to_string(size) +
                " bytes): not device memory");
      return -kCuFileCudaPointerInvalid;
    }
    if (s.config.cufile_fail_read_at > 0 && s.cufile_read_calls == s.config.cufile_fail_read_at) {
      errno = EIO;
      return -1;
    }
  }
  std::byte* out = alloc->shadow + (Addr(base) + static_cast<uintptr_t>(base_offset) - alloc->base);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, size - done, file_offset + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.cufile_bytes_read += done;
  return static_cast<ssize_t>(done);
}

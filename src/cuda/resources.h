// Internal: move-only owners of CUDA resources (streams, events, pinned host memory), so every
// error path releases what it created. Each holds the Runtime it came from; destruction ignores
// errors (there is no one left to report them to, and a sticky CUDA error must not leak memory of
// ours).
//
// Thread-safety: an owner is used by one thread at a time; the CUDA objects themselves follow
// CUDA's rules (a stream may be used from several threads).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "cuda/cuda_api.h"
#include "tensorferry/status.h"

namespace tensorferry::cuda {

class UniqueStream {
 public:
  UniqueStream() = default;
  // A non-blocking stream (no implicit synchronization with the legacy default stream) on the
  // calling thread's current device. Errors: kCudaError.
  static Result<UniqueStream> Create(std::shared_ptr<const Runtime> runtime);
  UniqueStream(UniqueStream&& other) noexcept { *this = std::move(other); }
  UniqueStream& operator=(UniqueStream&& other) noexcept;
  ~UniqueStream() { Reset(); }
  Stream get() const noexcept { return stream_; }

 private:
  void Reset() noexcept;
  std::shared_ptr<const Runtime> runtime_;
  Stream stream_ = nullptr;
};

class UniqueEvent {
 public:
  UniqueEvent() = default;
  // An event without timing (cheaper to record and query). Errors: kCudaError.
  static Result<UniqueEvent> Create(std::shared_ptr<const Runtime> runtime);
  UniqueEvent(UniqueEvent&& other) noexcept { *this = std::move(other); }
  UniqueEvent& operator=(UniqueEvent&& other) noexcept;
  ~UniqueEvent() { Reset(); }
  Event get() const noexcept { return event_; }

 private:
  void Reset() noexcept;
  std::shared_ptr<const Runtime> runtime_;
  Event event_ = nullptr;
};

// Page-locked host memory from cudaHostAlloc (portable: usable from every device's context), freed
// with cudaFreeHost.
class PinnedHostBuffer {
 public:
  // Errors: kDeviceOutOfMemory ("cudaHostAlloc(N bytes): ...").
  static Result<std::unique_ptr<PinnedHostBuffer>> Allocate(std::shared_ptr<const Runtime> runtime,
                                                            uint64_t size);
  ~PinnedHostBuffer();
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;
  std::byte* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }

 private:
  PinnedHostBuffer(std::shared_ptr<const Runtime> runtime, std::byte* data, uint64_t size)
      : runtime_(std::move(runtime)), data_(data), size_(size) {}
  std::shared_ptr<const Runtime> runtime_;
  std::byte* data_;
  uint64_t size_;
};

}  // namespace tensorferry::cuda

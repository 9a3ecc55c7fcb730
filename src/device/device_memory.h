// Internal: device memory for loaded batches, under a device-memory budget.
//
// A DeviceBuffer is one cudaMalloc: the destination of one batch. Tensors are views into it that
// share its ownership (std::shared_ptr aliasing), so the memory is freed exactly when the last
// tensor of the batch goes, whatever happens to the loader. Its deleter calls cudaFree; if the
// buffer was registered with cuFile for GPUDirect Storage it is deregistered first (and keeps the
// cuFile driver open until then).
//
// DeviceAllocator counts the bytes of live buffers against a budget and never exceeds it: an
// allocation that would is refused (kBudgetExceeded) rather than waited for, because only the
// caller can free memory by dropping tensors (the host Loader's Stream behaves the same way).
//
// Thread-safety: DeviceAllocator is safe to use from several threads. A DeviceBuffer's accessors
// are const and thread-safe; RegisterWithCufile is serialized internally.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "tensorferry/status.h"

namespace tensorferry::device {

class DeviceAllocator;

class DeviceBuffer {
 public:
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // A device address: never dereference it on the host. nullptr for a 0-byte buffer.
  std::byte* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }
  int device() const noexcept { return device_; }

  // Registers the whole buffer with cuFile (cuFileBufRegister) so GDS reads into it need no
  // bounce buffer. Done once: later calls return the first call's result. The registration holds
  // `driver` open and is undone before cudaFree. Errors: kCufileError.
  Status RegisterWithCufile(const std::shared_ptr<cuda::CufileDriver>& driver);
  bool cufile_registered() const;

 private:
  friend class DeviceAllocator;
  struct Accounting;
  DeviceBuffer(std::shared_ptr<const cuda::Runtime> runtime, std::shared_ptr<Accounting> accounting,
               std::byte* data, uint64_t size, int device)
      : runtime_(std::move(runtime)),
        accounting_(std::move(accounting)),
        data_(data),
        size_(size),
        device_(device) {}

  std::shared_ptr<const cuda::Runtime> runtime_;
  std::shared_ptr<Accounting> accounting_;
  std::byte* data_;
  uint64_t size_;
  int device_;
  mutable std::mutex mu_;
  bool register_attempted_ = false;
  Status register_status_;
  std::shared_ptr<cuda::CufileDriver> cufile_driver_;  // set while registered
};

class DeviceAllocator {
 public:
  // Buffers on `device`, at most `budget` bytes live at once (0: unbounded).
  static std::shared_ptr<DeviceAllocator> Create(std::shared_ptr<const cuda::Runtime> runtime,
                                                 int device, uint64_t budget);

  // One allocation of `bytes` on the device (the caller's current device is left unchanged).
  // `oversized_alone`: a request larger than the whole budget is granted when nothing else is
  // live (LoadOptions::allow_oversized: a tensor larger than the budget in a batch of its own).
  // Errors: kBudgetExceeded (the live bytes plus `bytes` exceed the budget; the message gives
  // both), kDeviceOutOfMemory (cudaMalloc failed; the message gives the device's free and total
  // memory), kCudaError (cudaSetDevice).
  Result<std::shared_ptr<DeviceBuffer>> Allocate(uint64_t bytes, bool oversized_alone = false);

  int device() const noexcept { return device_; }
  uint64_t budget() const noexcept { return budget_; }
  uint64_t in_use() const;       // bytes of live buffers
  uint64_t peak() const;         // highest in_use() seen (since creation or ResetPeak)
  void ResetPeak();              // peak() restarts from in_use()
  uint64_t allocations() const;  // successful Allocate calls

 private:
  DeviceAllocator(std::shared_ptr<const cuda::Runtime> runtime, int device, uint64_t budget);
  std::shared_ptr<const cuda::Runtime> runtime_;
  int device_;
  uint64_t budget_;
  std::shared_ptr<DeviceBuffer::Accounting> accounting_;
};

}  // namespace tensorferry::device

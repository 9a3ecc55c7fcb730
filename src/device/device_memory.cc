#include "device/device_memory.h"

#include <algorithm>

#include "tensorferry/size.h"

namespace tensorferry::device {

// Shared by an allocator and its buffers, so a buffer outliving its allocator still returns its
// bytes somewhere valid.
struct DeviceBuffer::Accounting {
  std::mutex mu;
  uint64_t in_use = 0;
  uint64_t peak = 0;
  uint64_t allocations = 0;
};

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) {
    // On its own device, the deregistration too (cuFile wants a context on the buffer's device
    // current): a thread that never chose one (the last owner of a tensor, say) would otherwise
    // have the runtime create a context on device 0 for the calls.
    cuda::ScopedDevice scoped(*runtime_, device_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cufile_driver_) cufile_driver_->cufile().api().cuFileBufDeregister(data_);
      cufile_driver_.reset();
    }
    runtime_->api().cudaFree(data_);
  }
  std::lock_guard<std::mutex> lock(accounting_->mu);
  accounting_->in_use -= size_;
}

Status DeviceBuffer::RegisterWithCufile(const std::shared_ptr<cuda::CufileDriver>& driver) {
  std::lock_guard<std::mutex> lock(mu_);
  if (register_attempted_) return register_status_;
  register_attempted_ = true;
  if (data_ == nullptr) return register_status_;
  // On the buffer's device (a read-ahead thread new to CUDA, or a caller on another GPU).
  cuda::ScopedDevice scoped(*runtime_, device_);
  const cuda::CufileError error =
      driver->cufile().api().cuFileBufRegister(data_, static_cast<size_t>(size_), 0);
  if (error.err != cuda::kCufileSuccess) {
    register_status_ = Status(Code::kCufileError, "cuFileBufRegister(" + FormatBytes(size_) +
                                                      "): " + cuda::CufileErrorText(error));
  } else {
    cufile_driver_ = driver;
  }
  return register_status_;
}

bool DeviceBuffer::cufile_registered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cufile_driver_ != nullptr;
}

DeviceAllocator::DeviceAllocator(std::shared_ptr<const cuda::Runtime> runtime, int device,
                                 uint64_t budget)
    : runtime_(std::move(runtime)),
      device_(device),
      budget_(budget),
      accounting_(std::make_shared<DeviceBuffer::Accounting>()) {}

std::shared_ptr<DeviceAllocator> DeviceAllocator::Create(
    std::shared_ptr<const cuda::Runtime> runtime, int device, uint64_t budget) {
  return std::shared_ptr<DeviceAllocator>(new DeviceAllocator(std::move(runtime), device, budget));
}

Result<std::shared_ptr<DeviceBuffer>> DeviceAllocator::Allocate(uint64_t bytes,
                                                                bool oversized_alone) {
  {
    // Reserve first, so concurrent callers can never overshoot the budget together.
    std::lock_guard<std::mutex> lock(accounting_->mu);
    const bool alone = oversized_alone && bytes > budget_ && accounting_->in_use == 0;
    if (budget_ > 0 && !alone && (bytes > budget_ || accounting_->in_use > budget_ - bytes)) {
      return Status(Code::kBudgetExceeded, "device budget of " + FormatBytes(budget_) +
                                               " on device " + std::to_string(device_) +
                                               " exceeded: " + FormatBytes(accounting_->in_use) +
                                               " held, " + FormatBytes(bytes) + " more requested");
    }
    accounting_->in_use += bytes;
  }
  auto unreserve = [this, bytes] {
    std::lock_guard<std::mutex> lock(accounting_->mu);
    accounting_->in_use -= bytes;
  };
  void* p = nullptr;
  if (bytes > 0) {
    cuda::ScopedDevice scoped(*runtime_, device_);
    if (!scoped.status().ok()) {
      unreserve();
      return scoped.status();
    }
    const cuda::Error error = runtime_->api().cudaMalloc(&p, static_cast<size_t>(bytes));
    if (error != cuda::kSuccess) {
      runtime_->api().cudaGetLastError();  // out of memory is not sticky: clear it
      size_t free = 0, total = 0;
      std::string where;
      if (runtime_->api().cudaMemGetInfo(&free, &total) == cuda::kSuccess) {
        where = " (device " + std::to_string(device_) + ": " + FormatBytes(free) + " free of " +
                FormatBytes(total) + ")";
      }
      unreserve();
      return Status(
          error == cuda::kErrorMemoryAllocation ? Code::kDeviceOutOfMemory : Code::kCudaError,
          "cudaMalloc(" + FormatBytes(bytes) + ")" + where + ": " + runtime_->ErrorText(error));
    }
  }
  {
    std::lock_guard<std::mutex> lock(accounting_->mu);
    accounting_->peak = std::max(accounting_->peak, accounting_->in_use);
    ++accounting_->allocations;
  }
  return std::shared_ptr<DeviceBuffer>(
      new DeviceBuffer(runtime_, accounting_, static_cast<std::byte*>(p), bytes, device_));
}

uint64_t DeviceAllocator::in_use() const {
  std::lock_guard<std::mutex> lock(accounting_->mu);
  return accounting_->in_use;
}

uint64_t DeviceAllocator::peak() const {
  std::lock_guard<std::mutex> lock(accounting_->mu);
  return accounting_->peak;
}

void DeviceAllocator::ResetPeak() {
  std::lock_guard<std::mutex> lock(accounting_->mu);
  accounting_->peak = accounting_->in_use;
}

uint64_t DeviceAllocator::allocations() const {
  std::lock_guard<std::mutex> lock(accounting_->mu);
  return accounting_->allocations;
}

}  // namespace tensorferry::device

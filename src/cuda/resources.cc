#include "cuda/resources.h"

#include "tensorferry/size.h"

namespace tensorferry::cuda {

Result<UniqueStream> UniqueStream::Create(std::shared_ptr<const Runtime> runtime) {
  UniqueStream out;
  const Error error = runtime->api().cudaStreamCreateWithFlags(&out.stream_, kStreamNonBlocking);
  if (error != kSuccess) return runtime->Check(error, "cudaStreamCreateWithFlags");
  out.runtime_ = std::move(runtime);
  return out;
}

UniqueStream& UniqueStream::operator=(UniqueStream&& other) noexcept {
  if (this != &other) {
    Reset();
    runtime_ = std::move(other.runtime_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void UniqueStream::Reset() noexcept {
  if (stream_ != nullptr && runtime_) runtime_->api().cudaStreamDestroy(stream_);
  stream_ = nullptr;
  runtime_.reset();
}

Result<UniqueEvent> UniqueEvent::Create(std::shared_ptr<const Runtime> runtime) {
  UniqueEvent out;
  const Error error = runtime->api().cudaEventCreateWithFlags(&out.event_, kEventDisableTiming);
  if (error != kSuccess) return runtime->Check(error, "cudaEventCreateWithFlags");
  out.runtime_ = std::move(runtime);
  return out;
}

UniqueEvent& UniqueEvent::operator=(UniqueEvent&& other) noexcept {
  if (this != &other) {
    Reset();
    runtime_ = std::move(other.runtime_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void UniqueEvent::Reset() noexcept {
  if (event_ != nullptr && runtime_) runtime_->api().cudaEventDestroy(event_);
  event_ = nullptr;
  runtime_.reset();
}

Result<std::unique_ptr<PinnedHostBuffer>> PinnedHostBuffer::Allocate(
    std::shared_ptr<const Runtime> runtime, uint64_t size) {
  void* p = nullptr;
  const Error error =
      runtime->api().cudaHostAlloc(&p, static_cast<size_t>(size), kHostAllocPortable);
  if (error != kSuccess) {
    runtime->api().cudaGetLastError();  // not sticky: clear it
    return runtime->Check(error, "cudaHostAlloc(" + FormatBytes(size) + " of pinned memory)",
                          Code::kDeviceOutOfMemory);
  }
  return std::unique_ptr<PinnedHostBuffer>(
      new PinnedHostBuffer(std::move(runtime), static_cast<std::byte*>(p), size));
}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (data_ != nullptr) runtime_->api().cudaFreeHost(data_);
}

}  // namespace tensorferry::cuda

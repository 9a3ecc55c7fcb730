// tensorferry/device.h: where loaded tensors live (host or a CUDA device), and how bytes get there.
//
// A Device is a plain value: the host (kCPU) or CUDA device `index`. The Loader (loader.h) puts
// each tensor on the device LoadOptions says (one target for all, or a per-tensor placement);
// Tensor::device() tells where a loaded tensor's bytes are. A CUDA tensor's data() is a device
// address: never dereference it on the host; CopyToHost reads it back.
//
// GdsMode chooses GPUDirect Storage (cuFile reads straight into device memory, no staging) for
// device loads: kAuto where it really works (library, driver, file, alignment), else the pinned
// staging path, which also takes over a file's reads once a cuFileRead of it fails (for the
// device's pipeline's later loads too); kOn makes an unusable GDS an error (kGdsUnavailable) and a
// failed cuFileRead the load's (kCufileError); kOff never uses it (docs/gpu.md, "GDS selection").
//
// No CUDA type appears here: CUDA is loaded at run time (cuda.h).
//
// Thread-safety: values; CopyToHost may be called from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tensorferry/status.h"

namespace tensorferry {

enum class DeviceKind : uint8_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int index = 0;  // the CUDA device ordinal (0 for the host)

  static constexpr Device CPU() noexcept { return {}; }
  static constexpr Device CUDA(int index = 0) noexcept { return {DeviceKind::kCUDA, index}; }
  constexpr bool is_cpu() const noexcept { return kind == DeviceKind::kCPU; }
  constexpr bool is_cuda() const noexcept { return kind == DeviceKind::kCUDA; }
  friend constexpr bool operator==(const Device&, const Device&) = default;
  // Host first, then CUDA devices by index (the order batches of a placed load come in).
  friend constexpr bool operator<(const Device& a, const Device& b) noexcept {
    return a.kind != b.kind ? a.kind < b.kind : a.index < b.index;
  }
};

// "cpu", "cuda:0", "cuda:3".
std::string DeviceName(Device device);
// "cpu", "cuda" (device 0), "cuda:N" (also "gpu", "gpu:N"). Errors: kInvalidArgument naming the
// text.
Result<Device> ParseDevice(std::string_view text);

enum class GdsMode : uint8_t { kAuto, kOn, kOff };
std::string_view GdsModeName(GdsMode mode) noexcept;  // "auto", "on", "off"
Result<GdsMode> ParseGdsMode(std::string_view name);  // errors: kInvalidArgument

// Copies `dst.size()` bytes from `src` on `device` to host memory `dst` (a synchronous
// cudaMemcpy through the process's CUDA runtime; the caller's current device is left unchanged,
// unless it is one whose primary context does not exist yet, e.g. device 0 of a thread that never
// chose one: then `device` stays current rather than a context being made on the other GPU;
// docs/gpu.md, "Which GPUs get a context").
// For a kCPU device it is a memcpy. Errors: those of loading the runtime (kCudaNotFound, ...),
// kCudaNoDevice, kCudaError naming the address and size.
Status CopyToHost(Device device, const void* src, std::span<std::byte> dst);

// Frees the device pipelines Loaders left for reuse (LoadOptions::keep_staging): their pinned
// staging memory, CUDA streams and cuFile driver references. Returns how many were freed. Loaders
// open now keep theirs. Thread-safe; never fails.
size_t ReleaseIdleStaging();
// The pinned bytes those idle pipelines hold now.
uint64_t IdleStagingBytes();

}  // namespace tensorferry

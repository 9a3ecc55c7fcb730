// tensorferry/device.h: device names, GDS modes and the copy back to the host.
#include "tensorferry/device.h"

#include <cstdio>
#include <cstring>

#include "cuda/cuda_api.h"
#include "device/pipeline_shelf.h"
#include "tensorferry/size.h"
#include "util/decimal.h"
#include "util/macros.h"

namespace tensorferry {

std::string DeviceName(Device device) {
  if (device.is_cpu()) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

Result<Device> ParseDevice(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Status(Code::kInvalidArgument, "device \"" + std::string(text) +
                                              "\": " + std::string(why) + " (cpu, cuda or cuda:N)");
  };
  if (text == "cpu") return Device::CPU();
  std::string_view rest;
  if (text.rfind("cuda", 0) == 0) {
    rest = text.substr(4);
  } else if (text.rfind("gpu", 0) == 0) {
    rest = text.substr(3);
  } else {
    return bad("unknown device");
  }
  if (rest.empty()) return Device::CUDA(0);
  if (rest[0] != ':' || rest.size() < 2 || rest.size() > 6) return bad("expected cuda:N");
  const std::optional<uint64_t> index = ParseDecimal(rest.substr(1));
  if (!index) return bad("the index is not a number");
  return Device::CUDA(static_cast<int>(*index));  // at most 5 digits
}

std::string_view GdsModeName(GdsMode mode) noexcept {
  switch (mode) {
    case GdsMode::kAuto: return "auto";
    case GdsMode::kOn: return "on";
    case GdsMode::kOff: return "off";
  }
  return "unknown";
}

Result<GdsMode> ParseGdsMode(std::string_view name) {
  if (name == "auto") return GdsMode::kAuto;
  if (name == "on") return GdsMode::kOn;
  if (name == "off") return GdsMode::kOff;
  return Status(Code::kInvalidArgument,
                "GDS mode must be auto, on or off, got \"" + std::string(name) + "\"");
}

Status CopyToHost(Device device, const void* src, std::span<std::byte> dst) {
  if (dst.empty()) return Status::Ok();
  if (device.is_cpu()) {
    std::memcpy(dst.data(), src, dst.size());
    return Status::Ok();
  }
  TF_ASSIGN_OR_RETURN(std::shared_ptr<const cuda::Runtime> runtime, cuda::ProcessRuntime());
  TF_RETURN_IF_ERROR(runtime->CheckDevice(device.index));
  cuda::ScopedDevice scoped(*runtime, device.index);
  TF_RETURN_IF_ERROR(scoped.status());
  const cuda::Error error =
      runtime->api().cudaMemcpy(dst.data(), src, dst.size(), cuda::kMemcpyDeviceToHost);
  if (error != cuda::kSuccess) {
    char where[64];
    std::snprintf(where, sizeof where, "0x%llx",
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(src)));
    runtime->api().cudaGetLastError();
    return runtime->Check(error, "cudaMemcpy of " + FormatBytes(dst.size()) + " from " +
                                     DeviceName(device) + " address " + where + " to the host");
  }
  return Status::Ok();
}

size_t ReleaseIdleStaging() {
  return device::ReleaseIdlePipelines();
}

uint64_t IdleStagingBytes() {
  return device::IdlePinnedBytes();
}

}  // namespace tensorferry

#include "cuda/diagnose.h"

#include <cstring>
#include <exception>
#include <vector>

namespace tensorferry {
namespace cuda {
namespace {

void DescribeDevice(const Runtime& runtime, int index, const DiagnoseOptions& options,
                    CudaDeviceInfo& info) {
  const RuntimeApi& api = runtime.api();
  info.index = index;
  auto note = [&info, &runtime](Error error, const char* what) {
    if (error == kSuccess || !info.error.empty()) return;
    info.error = std::string(what) + ": " + runtime.ErrorText(error);
  };
  if (api.cudaGetDeviceProperties != nullptr) {
    std::vector<char> prop(kDevicePropBufferSize, 0);
    const Error error = api.cudaGetDeviceProperties(prop.data(), index);
    note(error, "cudaGetDeviceProperties");
    if (error == kSuccess) {
      info.name.assign(prop.data() + kDevicePropNameOffset,
                       strnlen(prop.data() + kDevicePropNameOffset, kDevicePropNameSize));
      size_t total = 0;
      std::memcpy(&total, prop.data() + kDevicePropTotalMemOffset, sizeof total);
      info.total_memory = total;
    }
  }
  char bus[32] = {};
  const Error bus_error = api.cudaDeviceGetPCIBusId(bus, sizeof bus, index);
  note(bus_error, "cudaDeviceGetPCIBusId");
  if (bus_error == kSuccess) info.pci_bus_id = bus;
  note(api.cudaDeviceGetAttribute(&info.compute_major, kAttrComputeCapabilityMajor, index),
       "cudaDeviceGetAttribute");
  note(api.cudaDeviceGetAttribute(&info.compute_minor, kAttrComputeCapabilityMinor, index),
       "cudaDeviceGetAttribute");
  if (options.query_free_memory) {
    ScopedDevice scoped(runtime, index);
    if (!scoped.status().ok()) {
      if (info.error.empty()) info.error = scoped.status().message();
      return;
    }
    size_t free = 0, total = 0;
    const Error error = api.cudaMemGetInfo(&free, &total);
    note(error, "cudaMemGetInfo");
    if (error == kSuccess) {
      info.free_memory = free;
      if (info.total_memory == 0) info.total_memory = total;
    }
  }
  api.cudaGetLastError();  // leave no error behind for the caller's next CUDA call
}

}  // namespace

CudaReport Diagnose(const Result<std::shared_ptr<const Runtime>>& runtime,
                    const Result<std::shared_ptr<const Cufile>>& cufile,
                    const DiagnoseOptions& options) {
  CudaReport report;
  if (runtime.ok()) {
    const Runtime& rt = **runtime;
    report.runtime_loaded = true;
    report.runtime_path = rt.path();
    report.runtime_version = rt.RuntimeVersion();
    report.driver_version = rt.DriverVersion();
    auto count = rt.DeviceCount();
    if (count.ok()) {
      report.devices.resize(static_cast<size_t>(*count));
      for (int i = 0; i < *count; ++i) {
        DescribeDevice(rt, i, options, report.devices[static_cast<size_t>(i)]);
      }
    } else {
      report.device_error = count.status().message();
    }
  } else {
    report.runtime_error = runtime.status().message();
    report.device_error = "no CUDA runtime";
  }

  if (cufile.ok()) {
    report.cufile_loaded = true;
    report.cufile_path = (*cufile)->path();
  } else {
    report.cufile_error = cufile.status().message();
  }
  if (report.cufile_loaded && report.cuda_usable() && options.open_cufile_driver) {
    // The driver needs a CUDA context, on device 0 like any first use would.
    ScopedDevice scoped(**runtime, 0);
    auto driver = CufileDriver::Open(*cufile);
    if (driver.ok()) {
      report.cufile_driver_opened = true;
    } else {
      report.cufile_driver_error = driver.status().message();
    }
  }

  if (!report.cuda_usable()) {
    report.gds_reason = "no usable CUDA device (" +
                        (report.runtime_loaded ? report.device_error : report.runtime_error) + ")";
  } else if (!report.cufile_loaded) {
    report.gds_reason =
        "cuFile is not installed (" + report.cufile_error + "); loads use pinned staging buffers";
  } else if (!options.open_cufile_driver) {
    report.gds_reason = "cuFile loaded; the driver was not opened (not checked)";
  } else if (!report.cufile_driver_opened) {
    report.gds_reason = "the cuFile driver did not open (" + report.cufile_driver_error +
                        "); loads use pinned staging buffers";
  } else {
    report.gds_usable = true;
    report.gds_reason =
        "cuFile driver opened; each file is still checked at load time (file system support, "
        "alignment), with fallback to pinned staging buffers";
  }
  return report;
}

}  // namespace cuda

bool CudaAvailable() noexcept {
  try {
    auto runtime = cuda::ProcessRuntime();
    return runtime.ok() && (*runtime)->DeviceCount().ok();
  } catch (const std::exception&) {
    return false;
  }
}

CudaReport DiagnoseDevices(const DiagnoseOptions& options) {
  auto runtime = cuda::ProcessRuntime();
  // cuFile is worth loading only next to a runtime.
  Result<std::shared_ptr<const cuda::Cufile>> cufile =
      runtime.ok() ? cuda::ProcessCufile()
                   : Result<std::shared_ptr<const cuda::Cufile>>(
                         Status(Code::kCudaNotFound, "not loaded (no CUDA runtime)"));
  return cuda::Diagnose(runtime, cufile, options);
}

}  // namespace tensorferry

// tensorferry/cuda.h: is a CUDA device usable from this process, and if not, why not.
//
// tensorferry does not link against CUDA. The CUDA runtime (libcudart) and cuFile (libcufile, for
// GPUDirect Storage) are loaded at run time the first time they are needed, found through the
// TENSORFERRY_CUDA_RUNTIME / TENSORFERRY_CUFILE_LIBRARY environment variables when set, else a
// runtime the process already loaded (e.g. torch's), else the usual library names
// (docs/runtime_settings.md, docs/gpu.md). Once loaded they stay loaded for the life of the
// process; the outcome of that first attempt, failure included, is kept.
//
// Nothing here mentions a CUDA type, and neither call changes the calling thread's current CUDA
// device (other calls of the library leave it changed only where restoring it would create a
// context on a GPU that has none: docs/gpu.md, "Which GPUs get a context").
//
// Thread-safety: both functions may be called from several threads at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tensorferry {

// True when the CUDA runtime loads and reports at least one device. Cheap after the first call
// (no CUDA context is created). Never throws.
bool CudaAvailable() noexcept;

struct CudaDeviceInfo {
  int index = 0;
  std::string name;        // e.g. "NVIDIA H100 80GB HBM3"
  std::string pci_bus_id;  // e.g. "0000:3b:00.0"
  int compute_major = 0;
  int compute_minor = 0;
  uint64_t total_memory = 0;  // bytes
  uint64_t free_memory = 0;   // bytes, when queried (DiagnoseOptions::query_free_memory)
  std::string error;          // a query that failed for this device, if any
};

struct CudaReport {
  // The CUDA runtime.
  bool runtime_loaded = false;
  std::string runtime_path;   // the library file loaded
  std::string runtime_error;  // why not loaded: every candidate tried, with the loader's reason
  int runtime_version = 0;    // 13000 means 13.0
  int driver_version = 0;     // 0: no driver
  std::vector<CudaDeviceInfo> devices;
  std::string device_error;  // why `devices` is empty (e.g. the cudaGetDeviceCount error)

  // GPUDirect Storage.
  bool cufile_loaded = false;
  std::string cufile_path;
  std::string cufile_error;
  bool cufile_driver_opened = false;
  std::string cufile_driver_error;
  bool gds_usable = false;  // library loaded, driver opened, a device present
  std::string gds_reason;   // always set: why GDS is, or is not, usable

  bool cuda_usable() const noexcept { return runtime_loaded && !devices.empty(); }
};

struct DiagnoseOptions {
  // cudaMemGetInfo per device: creates a CUDA context on each (slow, uses device memory).
  bool query_free_memory = true;
  // Opens (and closes) the cuFile driver to tell whether GDS works.
  bool open_cufile_driver = true;
};

// Everything that decides whether device loading (and GDS) can work here. Never fails: every
// problem is reported in the fields above. May take a second or more (context creation).
CudaReport DiagnoseDevices(const DiagnoseOptions& options = {});

}  // namespace tensorferry

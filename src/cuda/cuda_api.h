// Internal: the CUDA runtime, loaded at run time behind our own declarations.
//
// No CUDA header is included anywhere in tensorferry and nothing links against CUDA. The types and
// constants below are ours, ABI-compatible with the C API of libcudart (cuda_runtime_api.h,
// driver_types.h), and cover only what the device pipeline and the diagnostics call. A Runtime is
// a loaded library plus the resolved function pointers; every call goes through api().
//
// Search order (RuntimeSearch): the TENSORFERRY_CUDA_RUNTIME environment variable when set (a path;
// it is then the only candidate, e.g. the fake runtime of the tests), else RuntimeSearch::path when
// set (the only candidate), else a runtime already loaded into the process (e.g. torch's), then
// each of RuntimeSearch::directories (e.g. torch/lib) with each name, then the names through the
// dynamic linker: libcudart.so.13, libcudart.so.12, libcudart.so.
//
// Thread-safety: a Runtime is immutable after loading; its functions are the CUDA runtime's, which
// are thread-safe. ProcessRuntime() loads once (std::call_once) and never unloads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/status.h"

// The opaque handle types carry the names CUDA's headers give them (at global scope), so that the
// function types we call through are exactly the library's: UBSan's -fsanitize=function checks
// them on every call into an instrumented library (the fake runtime of the tests).
struct CUstream_st;
struct CUevent_st;

namespace tensorferry::cuda {

// --- our declarations of the runtime's C types (same size and values as CUDA's) ---------------
using Error = int;            // cudaError_t (a C enum: int-sized)
using Stream = CUstream_st*;  // cudaStream_t
using Event = CUevent_st*;    // cudaEvent_t

inline constexpr Error kSuccess = 0;
inline constexpr Error kErrorInvalidValue = 1;
inline constexpr Error kErrorMemoryAllocation = 2;
inline constexpr Error kErrorInsufficientDriver = 35;
inline constexpr Error kErrorNoDevice = 100;
inline constexpr Error kErrorInvalidDevice = 101;
inline constexpr Error kErrorNotReady = 600;

// cudaMemcpyKind
inline constexpr int kMemcpyHostToHost = 0;
inline constexpr int kMemcpyHostToDevice = 1;
inline constexpr int kMemcpyDeviceToHost = 2;
inline constexpr int kMemcpyDeviceToDevice = 3;
inline constexpr int kMemcpyDefault = 4;

inline constexpr unsigned kHostAllocDefault = 0x00;   // cudaHostAllocDefault
inline constexpr unsigned kHostAllocPortable = 0x01;  // cudaHostAllocPortable
inline constexpr unsigned kHostRegisterPortable = 0x01;
inline constexpr unsigned kStreamNonBlocking = 0x01;   // cudaStreamNonBlocking
inline constexpr unsigned kEventDisableTiming = 0x02;  // cudaEventDisableTiming

// cudaDeviceAttr values used by the diagnostics.
inline constexpr int kAttrPciBusId = 33;
inline constexpr int kAttrPciDeviceId = 34;
inline constexpr int kAttrPciDomainId = 50;
inline constexpr int kAttrComputeCapabilityMajor = 75;
inline constexpr int kAttrComputeCapabilityMinor = 76;

// cudaDeviceProp is large and versioned; only its first fields are read, whose layout has been the
// same since CUDA 10: char name[256], 16-byte uuid, char luid[8], unsigned luidDeviceNodeMask,
// size_t totalGlobalMem (offset 288). The buffer handed to cudaGetDeviceProperties is this big.
inline constexpr size_t kDevicePropBufferSize = 8192;
inline constexpr size_t kDevicePropNameOffset = 0;
inline constexpr size_t kDevicePropNameSize = 256;
inline constexpr size_t kDevicePropTotalMemOffset = 288;

// The runtime functions, named as in C so a search for a CUDA call finds every use.
struct RuntimeApi {
  Error (*cudaGetDeviceCount)(int* count) = nullptr;
  Error (*cudaSetDevice)(int device) = nullptr;
  Error (*cudaGetDevice)(int* device) = nullptr;
  Error (*cudaMalloc)(void** ptr, size_t size) = nullptr;
  Error (*cudaFree)(void* ptr) = nullptr;
  Error (*cudaHostAlloc)(void** ptr, size_t size, unsigned flags) = nullptr;
  Error (*cudaFreeHost)(void* ptr) = nullptr;
  Error (*cudaHostRegister)(void* ptr, size_t size, unsigned flags) = nullptr;
  Error (*cudaHostUnregister)(void* ptr) = nullptr;
  Error (*cudaMemcpy)(void* dst, const void* src, size_t count, int kind) = nullptr;
  Error (*cudaMemcpyAsync)(void* dst, const void* src, size_t count, int kind,
                           Stream stream) = nullptr;
  Error (*cudaMemcpy2DAsync)(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                             size_t height, int kind, Stream stream) = nullptr;
  Error (*cudaStreamCreateWithFlags)(Stream* stream, unsigned flags) = nullptr;
  Error (*cudaStreamDestroy)(Stream stream) = nullptr;
  Error (*cudaStreamSynchronize)(Stream stream) = nullptr;
  Error (*cudaEventCreateWithFlags)(Event* event, unsigned flags) = nullptr;
  Error (*cudaEventRecord)(Event event, Stream stream) = nullptr;
  Error (*cudaEventSynchronize)(Event event) = nullptr;
  Error (*cudaEventQuery)(Event event) = nullptr;
  Error (*cudaEventDestroy)(Event event) = nullptr;
  const char* (*cudaGetErrorName)(Error error) = nullptr;
  const char* (*cudaGetErrorString)(Error error) = nullptr;
  Error (*cudaGetLastError)() = nullptr;
  Error (*cudaMemGetInfo)(size_t* free, size_t* total) = nullptr;
  Error (*cudaDriverGetVersion)(int* version) = nullptr;
  Error (*cudaRuntimeGetVersion)(int* version) = nullptr;
  Error (*cudaDeviceGetAttribute)(int* value, int attribute, int device) = nullptr;
  Error (*cudaDeviceGetPCIBusId)(char* pci_bus_id, int length, int device) = nullptr;
  // Optional (nullptr when absent): cudaGetDeviceProperties_v2, else cudaGetDeviceProperties.
  Error (*cudaGetDeviceProperties)(void* prop, int device) = nullptr;
  // Optional, from the driver (libcuda.so.1; the runtime library itself for a fake): whether a
  // device's primary context exists, without creating it (CUdevice is an int, CUresult too).
  int (*cuDeviceGet)(int* device, int ordinal) = nullptr;
  int (*cuDevicePrimaryCtxGetState)(int device, unsigned* flags, int* active) = nullptr;
};

class Runtime {
 public:
  Runtime(std::string path, const RuntimeApi& api) : path_(std::move(path)), api_(api) {}

  const RuntimeApi& api() const noexcept { return api_; }
  // The file that was loaded.
  const std::string& path() const noexcept { return path_; }

  // "cudaErrorMemoryAllocation: out of memory" (name and description from the runtime).
  std::string ErrorText(Error error) const;
  // OK for kSuccess; otherwise Status(code, "<what>: <ErrorText(error)>"), and the calling
  // thread's last error (cudaGetLastError) is cleared: call it on the thread that made the call.
  Status Check(Error error, std::string_view what, Code code = Code::kCudaError) const;

  // Number of devices. Errors: kCudaNoDevice with the reason (the cudaGetDeviceCount error, e.g.
  // no driver, or "no CUDA device").
  Result<int> DeviceCount() const;
  // Errors: those of DeviceCount, kCudaNoDevice when `device` is not in [0, DeviceCount()).
  Status CheckDevice(int device) const;
  // cudaRuntimeGetVersion / cudaDriverGetVersion: 13000 means 13.0; 0 when unknown (no driver).
  int RuntimeVersion() const;
  int DriverVersion() const;
  // Whether `device`'s primary context exists (cuDevicePrimaryCtxGetState); nullopt when the
  // driver cannot be asked.
  std::optional<bool> PrimaryContextActive(int device) const;

 private:
  std::string path_;
  RuntimeApi api_;
};

// "13.0" from 13000; "none" for 0.
std::string VersionText(int version);

// Makes `device` the calling thread's current device and restores the previous one on
// destruction (the caller's CUDA state is not ours to change), but only when the previous
// device's primary context exists: since CUDA 12, cudaSetDevice creates it, and a thread that
// never chose a device reads device 0 as its current one, so "restoring" it would put a context
// (hundreds of MiB) on GPU 0 in every process that loads onto another GPU (a rank of torchrun).
class ScopedDevice {
 public:
  ScopedDevice(const Runtime& runtime, int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  // The cudaSetDevice result.
  const Status& status() const noexcept { return status_; }

 private:
  const Runtime& runtime_;
  int previous_ = -1;
  Status status_;
};

inline constexpr const char* kRuntimeEnvVar = "TENSORFERRY_CUDA_RUNTIME";

struct RuntimeSearch {
  // Read TENSORFERRY_CUDA_RUNTIME; when set (non-empty) it is the only candidate.
  bool use_environment = true;
  // When non-empty, the only candidate (after the environment variable).
  std::string path;
  // Searched first, each with every name (e.g. the torch/lib directory of a Python environment).
  std::vector<std::string> directories;
  // Names for the dynamic linker, in order of preference.
  std::vector<std::string> names = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
};

// Loads a runtime (not cached: each call resolves the symbols again; the library itself stays
// loaded for the life of the process). Errors: kCudaNotFound naming every candidate tried and the
// dynamic linker's reason; kCudaSymbolMissing naming the library and the first missing function.
Result<std::shared_ptr<const Runtime>> OpenRuntime(const RuntimeSearch& search);

// The process-wide runtime: loaded by the first call with that call's `search` (later arguments
// are ignored); the result, failure included, is kept for the life of the process.
Result<std::shared_ptr<const Runtime>> ProcessRuntime(const RuntimeSearch& search = {});

}  // namespace tensorferry::cuda

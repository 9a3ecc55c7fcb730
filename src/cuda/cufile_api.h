// Internal: cuFile (GPUDirect Storage), loaded at run time behind our own declarations.
//
// Like the runtime (cuda_api.h), libcufile is found with dlopen and called through function
// pointers whose types are declared here, ABI-compatible with cufile.h; no cuFile header is used.
//
// Search order (CufileSearch): TENSORFERRY_CUFILE_LIBRARY when set (the only candidate), else
// CufileSearch::path when set (the only candidate), else a libcufile already loaded into the
// process, then libcufile.so.0, libcufile.so.1, libcufile.so.
//
// GDS is usable only when the library loads AND the driver opens (CufileDriver), and then per file
// only when cuFileHandleRegister accepts it (file system support); the device pipeline records
// which of these failed (docs/gpu.md, "GDS selection").
//
// Thread-safety: a Cufile is immutable after loading; cuFile's functions are thread-safe.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "tensorferry/status.h"

// Our declarations of cufile.h's types, under its own names at global scope (as for the runtime's
// handles in cuda_api.h: the function types then match the library's exactly).
struct CUfileError {  // CUfileError_t: a CUfileOpError and a CUresult
  int err = 0;
  int cu_err = 0;
};
struct CUfileDescr_t {
  int type = 1;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD
  union {
    int fd;
    void* handle;
  } handle{};
  const void* fs_ops = nullptr;
};
static_assert(sizeof(CUfileDescr_t) == 24, "CUfileDescr_t layout");

namespace tensorferry::cuda {

using CufileError = ::CUfileError;
using CufileDescr = ::CUfileDescr_t;
using CufileHandle = void*;  // CUfileHandle_t
inline constexpr int kCufileSuccess = 0;
inline constexpr int kCufileIoNotSupported = 5008;   // CU_FILE_IO_NOT_SUPPORTED
inline constexpr int kCufileHandleTypeOpaqueFd = 1;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD

struct CufileApi {
  CufileError (*cuFileDriverOpen)() = nullptr;
  // cuFileDriverClose_v2 (reference-counted) when present; nullptr with an old library, whose
  // close would tear GDS down under every other user in the process, so it is then never closed.
  CufileError (*cuFileDriverClose)() = nullptr;
  CufileError (*cuFileHandleRegister)(CufileHandle* handle, CufileDescr* descr) = nullptr;
  void (*cuFileHandleDeregister)(CufileHandle handle) = nullptr;
  CufileError (*cuFileBufRegister)(const void* base, size_t length, int flags) = nullptr;
  CufileError (*cuFileBufDeregister)(const void* base) = nullptr;
  // Bytes read (short at end of file); negative: -1 with errno, or -CU_FILE_* code.
  ssize_t (*cuFileRead)(CufileHandle handle, void* base, size_t size, off_t file_offset,
                        off_t base_offset) = nullptr;
};

class Cufile {
 public:
  Cufile(std::string path, const CufileApi& api, std::string platform_root = "/")
      : path_(std::move(path)), api_(api), platform_root_(std::move(platform_root)) {}
  const CufileApi& api() const noexcept { return api_; }
  const std::string& path() const noexcept { return path_; }
  // Where GdsPlatformProblem looks ("/": this machine); empty: no platform check (a library that
  // exports tensorferry_cufile_needs_no_platform, i.e. the test double tests/fake_cuda).
  const std::string& platform_root() const noexcept { return platform_root_; }

 private:
  std::string path_;
  CufileApi api_;
  std::string platform_root_;
};

// Why GPUDirect Storage cannot move data on this machine, judged from the kernel alone ("" when it
// may): GDS needs the nvidia-fs kernel module (<root>/proc/driver/nvidia-fs) or, without it, NVMe
// devices for the P2PDMA mode of recent CUDA releases (<root>/sys/class/nvme not empty). Without
// either, cuFile refuses every file, and opening its driver costs about half a second (measured on
// an H100 machine, docs/benchmarks.md): GdsMode::kAuto does not try it then; kOn still does.
std::string GdsPlatformProblem(const std::string& root);

// "CU_FILE_IO_NOT_SUPPORTED (5008)"; the CUDA driver error too when err is
// CU_FILE_CUDA_DRIVER_ERROR.
std::string CufileErrorText(CufileError error);
// The text for a negative cuFileRead result: errno text for -1, the cuFile code otherwise.
std::string CufileReadErrorText(ssize_t result, int saved_errno);

inline constexpr const char* kCufileEnvVar = "TENSORFERRY_CUFILE_LIBRARY";

struct CufileSearch {
  bool use_environment = true;  // TENSORFERRY_CUFILE_LIBRARY, when set, is the only candidate
  std::string path;             // when non-empty, the only candidate
  std::vector<std::string> names = {"libcufile.so.0", "libcufile.so.1", "libcufile.so"};
  std::string platform_root = "/";  // Cufile::platform_root
};

// Errors: kCudaNotFound (candidates and reasons), kCudaSymbolMissing.
Result<std::shared_ptr<const Cufile>> OpenCufile(const CufileSearch& search);
// The process-wide cuFile: loaded by the first call, kept (failure included) for the process.
Result<std::shared_ptr<const Cufile>> ProcessCufile(const CufileSearch& search = {});

// An open cuFile driver: cuFileDriverOpen on Open, cuFileDriverClose (v2) when the last owner
// goes (the pipeline, and every DeviceBuffer registered with cuFile through it). Opening
// needs a CUDA context on the calling thread's device (call after cudaSetDevice).
class CufileDriver {
 public:
  // Errors: kGdsUnavailable "cuFileDriverOpen: <reason>".
  static Result<std::shared_ptr<CufileDriver>> Open(std::shared_ptr<const Cufile> cufile);
  ~CufileDriver();
  CufileDriver(const CufileDriver&) = delete;
  CufileDriver& operator=(const CufileDriver&) = delete;
  const Cufile& cufile() const noexcept { return *cufile_; }
  const std::shared_ptr<const Cufile>& cufile_ptr() const noexcept { return cufile_; }

 private:
  explicit CufileDriver(std::shared_ptr<const Cufile> cufile) : cufile_(std::move(cufile)) {}
  std::shared_ptr<const Cufile> cufile_;
};

}  // namespace tensorferry::cuda

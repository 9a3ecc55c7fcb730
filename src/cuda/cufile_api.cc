#include "cuda/cufile_api.h"

#include <dirent.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

#include "util/dynamic_library.h"
#include "util/macros.h"

namespace tensorferry::cuda {

using dynlib::FindOrOpen;
using dynlib::FindSymbol;
using dynlib::LoadedLibrary;
using dynlib::Resolve;
namespace {

const char* CufileErrorName(int err) {
  switch (err) {
    case 0: return "CU_FILE_SUCCESS";
    case 5001: return "CU_FILE_DRIVER_NOT_INITIALIZED";
    case 5002: return "CU_FILE_DRIVER_INVALID_PROPS";
    case 5003: return "CU_FILE_DRIVER_UNSUPPORTED_LIMIT";
    case 5004: return "CU_FILE_DRIVER_VERSION_MISMATCH";
    case 5005: return "CU_FILE_DRIVER_VERSION_READ_ERROR";
    case 5006: return "CU_FILE_DRIVER_CLOSING";
    case 5007: return "CU_FILE_PLATFORM_NOT_SUPPORTED";
    case 5008: return "CU_FILE_IO_NOT_SUPPORTED";
    case 5009: return "CU_FILE_DEVICE_NOT_SUPPORTED";
    case 5010: return "CU_FILE_NVFS_DRIVER_ERROR";
    case 5011: return "CU_FILE_CUDA_DRIVER_ERROR";
    case 5012: return "CU_FILE_CUDA_POINTER_INVALID";
    case 5013: return "CU_FILE_CUDA_MEMORY_TYPE_INVALID";
    case 5014: return "CU_FILE_CUDA_POINTER_RANGE_ERROR";
    case 5015: return "CU_FILE_CUDA_CONTEXT_MISMATCH";
    case 5016: return "CU_FILE_INVALID_MAPPING_SIZE";
    case 5017: return "CU_FILE_INVALID_MAPPING_RANGE";
    case 5018: return "CU_FILE_INVALID_FILE_TYPE";
    case 5019: return "CU_FILE_INVALID_FILE_OPEN_FLAG";
    case 5020: return "CU_FILE_DIO_NOT_SET";
    case 5022: return "CU_FILE_INVALID_VALUE";
    case 5023: return "CU_FILE_MEMORY_ALREADY_REGISTERED";
    case 5024: return "CU_FILE_MEMORY_NOT_REGISTERED";
    case 5025: return "CU_FILE_PERMISSION_DENIED";
    case 5026: return "CU_FILE_DRIVER_ALREADY_OPEN";
    case 5027: return "CU_FILE_HANDLE_NOT_REGISTERED";
    case 5028: return "CU_FILE_HANDLE_ALREADY_REGISTERED";
    case 5029: return "CU_FILE_DEVICE_NOT_FOUND";
    case 5030: return "CU_FILE_INTERNAL_ERROR";
    case 5031: return "CU_FILE_GETNEWFD_FAILED";
    case 5033: return "CU_FILE_NVFS_SETUP_ERROR";
    case 5034: return "CU_FILE_IO_DISABLED";
    default: return nullptr;
  }
}

}  // namespace

std::string CufileErrorText(CufileError error) {
  const char* name = CufileErrorName(error.err);
  std::string out = name != nullptr ? name : "cuFile error";
  out += " (" + std::to_string(error.err) + ")";
  if (error.err == 5011) out += ", CUDA driver error " + std::to_string(error.cu_err);
  return out;
}

std::string CufileReadErrorText(ssize_t result, int saved_errno) {
  if (result == -1) return std::strerror(saved_errno);
  return CufileErrorText(CufileError{static_cast<int>(-result), 0});
}

Result<std::shared_ptr<const Cufile>> OpenCufile(const CufileSearch& search) {
  std::vector<std::string> candidates;
  bool exclusive = true;
  const char* env = search.use_environment ? std::getenv(kCufileEnvVar) : nullptr;
  if (env != nullptr && *env != '\0') {
    candidates = {env};
  } else if (!search.path.empty()) {
    candidates = {search.path};
  } else {
    candidates = search.names;
    exclusive = false;
  }
  TF_ASSIGN_OR_RETURN(const LoadedLibrary library,
                      FindOrOpen(search.names, candidates, exclusive, "cuFile library (libcufile)",
                                 Code::kCudaNotFound));
  CufileApi api;
  TF_RETURN_IF_ERROR(Resolve(library, "cuFileDriverOpen", api.cuFileDriverOpen));
  api.cuFileDriverClose = reinterpret_cast<decltype(api.cuFileDriverClose)>(
      FindSymbol(library, "cuFileDriverClose_v2"));
  TF_RETURN_IF_ERROR(Resolve(library, "cuFileHandleRegister", api.cuFileHandleRegister));
  TF_RETURN_IF_ERROR(Resolve(library, "cuFileHandleDeregister", api.cuFileHandleDeregister));
  TF_RETURN_IF_ERROR(Resolve(library, "cuFileBufRegister", api.cuFileBufRegister));
  TF_RETURN_IF_ERROR(Resolve(library, "cuFileBufDeregister", api.cuFileBufDeregister));
  TF_RETURN_IF_ERROR(Resolve(library, "cuFileRead", api.cuFileRead));
  // A test double (tests/fake_cuda) declares that it needs no kernel support.
  const bool platform_free = FindSymbol(library, "tensorferry_cufile_needs_no_platform") != nullptr;
  return std::shared_ptr<const Cufile>(std::make_shared<Cufile>(
      library.path, api, platform_free ? std::string() : search.platform_root));
}

Result<std::shared_ptr<const Cufile>> ProcessCufile(const CufileSearch& search) {
  static std::once_flag once;
  static Result<std::shared_ptr<const Cufile>>* loaded = nullptr;  // never destroyed
  std::call_once(
      once, [&search] { loaded = new Result<std::shared_ptr<const Cufile>>(OpenCufile(search)); });
  return *loaded;
}

Result<std::shared_ptr<CufileDriver>> CufileDriver::Open(std::shared_ptr<const Cufile> cufile) {
  const CufileError error = cufile->api().cuFileDriverOpen();
  if (error.err != kCufileSuccess) {
    return Status(Code::kGdsUnavailable,
                  cufile->path() + ": cuFileDriverOpen: " + CufileErrorText(error));
  }
  return std::shared_ptr<CufileDriver>(new CufileDriver(std::move(cufile)));
}

CufileDriver::~CufileDriver() {
  if (cufile_->api().cuFileDriverClose != nullptr) cufile_->api().cuFileDriverClose();
}

std::string GdsPlatformProblem(const std::string& root) {
  std::string base = root;
  if (!base.empty() && base.back() == '/') base.pop_back();
  struct stat st {};
  if (::stat((base + "/proc/driver/nvidia-fs").c_str(), &st) == 0) return "";
  const std::string nvme = base + "/sys/class/nvme";
  if (DIR* dir = ::opendir(nvme.c_str())) {
    bool any = false;
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.') {
        any = true;
        break;
      }
    }
    ::closedir(dir);
    if (any) return "";
  }
  return "the nvidia-fs kernel module is not loaded (no " + base +
         "/proc/driver/nvidia-fs) and there is no NVMe device for P2PDMA (" + nvme +
         "): cuFile would refuse every file (gds=on tries it anyway)";
}

}  // namespace tensorferry::cuda

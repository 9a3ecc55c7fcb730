#include "cuda/cuda_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "util/dynamic_library.h"
#include "util/macros.h"

namespace tensorferry::cuda {

using dynlib::FindOrOpen;
using dynlib::FindSymbol;
using dynlib::LoadedLibrary;
using dynlib::Resolve;

std::string Runtime::ErrorText(Error error) const {
  const char* name = api_.cudaGetErrorName ? api_.cudaGetErrorName(error) : nullptr;
  const char* text = api_.cudaGetErrorString ? api_.cudaGetErrorString(error) : nullptr;
  std::string out = name != nullptr ? name : "cudaError " + std::to_string(error);
  if (text != nullptr && *text != '\0') {
    out += ": ";
    out += text;
  }
  return out;
}

Status Runtime::Check(Error error, std::string_view what, Code code) const {
  if (error == kSuccess) return Status::Ok();
  // The failed call also left its error in the calling thread's last-error slot, which the
  // caller's own next check (torch's after every kernel launch) would blame on its own work:
  // the error is reported here, so clear it (a sticky error stays, as it must).
  api_.cudaGetLastError();
  return Status(code, std::string(what) + ": " + ErrorText(error));
}

Result<int> Runtime::DeviceCount() const {
  int count = 0;
  const Error error = api_.cudaGetDeviceCount(&count);
  if (error != kSuccess) {
    // Not sticky: clear it so later calls are not reported with this error.
    api_.cudaGetLastError();
    return Status(Code::kCudaNoDevice, path_ + ": cudaGetDeviceCount: " + ErrorText(error));
  }
  if (count <= 0) return Status(Code::kCudaNoDevice, path_ + ": no CUDA device");
  return count;
}

Status Runtime::CheckDevice(int device) const {
  TF_ASSIGN_OR_RETURN(const int count, DeviceCount());
  if (device < 0 || device >= count) {
    return Status(Code::kCudaNoDevice, "CUDA device " + std::to_string(device) +
                                           " does not exist (" + std::to_string(count) +
                                           (count == 1 ? " device)" : " devices)"));
  }
  return Status::Ok();
}

int Runtime::RuntimeVersion() const {
  int version = 0;
  if (api_.cudaRuntimeGetVersion(&version) != kSuccess) return 0;
  return version;
}

int Runtime::DriverVersion() const {
  int version = 0;
  if (api_.cudaDriverGetVersion(&version) != kSuccess) return 0;
  return version;
}

std::string VersionText(int version) {
  if (version <= 0) return "none";
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

ScopedDevice::ScopedDevice(const Runtime& runtime, int device) : runtime_(runtime) {
  if (runtime_.api().cudaGetDevice(&previous_) != kSuccess) previous_ = -1;
  if (previous_ == device) return;
  status_ = runtime_.Check(runtime_.api().cudaSetDevice(device),
                           "cudaSetDevice(" + std::to_string(device) + ")");
}

std::optional<bool> Runtime::PrimaryContextActive(int device) const {
  if (api_.cuDeviceGet == nullptr || api_.cuDevicePrimaryCtxGetState == nullptr) {
    return std::nullopt;
  }
  int handle = 0;
  unsigned flags = 0;
  int active = 0;
  if (api_.cuDeviceGet(&handle, device) != 0 ||
      api_.cuDevicePrimaryCtxGetState(handle, &flags, &active) != 0) {
    return std::nullopt;
  }
  return active != 0;
}

ScopedDevice::~ScopedDevice() {
  int current = -1;
  if (previous_ >= 0 && runtime_.api().cudaGetDevice(&current) == kSuccess &&
      current != previous_ && runtime_.PrimaryContextActive(previous_).value_or(true)) {
    runtime_.api().cudaSetDevice(previous_);
  }
}

namespace {

// The candidates of `search`, in order, and whether they are exclusive (no already-loaded check).
std::vector<std::string> RuntimeCandidates(const RuntimeSearch& search, bool* exclusive) {
  *exclusive = true;
  if (search.use_environment) {
    const char* env = std::getenv(kRuntimeEnvVar);
    if (env != nullptr && *env != '\0') return {env};
  }
  if (!search.path.empty()) return {search.path};
  *exclusive = false;
  std::vector<std::string> out;
  for (const std::string& dir : search.directories) {
    if (dir.empty()) continue;
    for (const std::string& name : search.names) out.push_back(dir + "/" + name);
  }
  out.insert(out.end(), search.names.begin(), search.names.end());
  return out;
}

template <typename Fn>
void ResolveOptional(const LoadedLibrary& library, const char* symbol, Fn*& out) {
  out = reinterpret_cast<Fn*>(FindSymbol(library, symbol));
}

Status ResolveAll(const LoadedLibrary& library, RuntimeApi& api) {
#define TF_RESOLVE(fn) TF_RETURN_IF_ERROR(Resolve(library, #fn, api.fn))
  TF_RESOLVE(cudaGetDeviceCount);
  TF_RESOLVE(cudaSetDevice);
  TF_RESOLVE(cudaGetDevice);
  TF_RESOLVE(cudaMalloc);
  TF_RESOLVE(cudaFree);
  TF_RESOLVE(cudaHostAlloc);
  TF_RESOLVE(cudaFreeHost);
  TF_RESOLVE(cudaHostRegister);
  TF_RESOLVE(cudaHostUnregister);
  TF_RESOLVE(cudaMemcpy);
  TF_RESOLVE(cudaMemcpyAsync);
  TF_RESOLVE(cudaMemcpy2DAsync);
  TF_RESOLVE(cudaStreamCreateWithFlags);
  TF_RESOLVE(cudaStreamDestroy);
  TF_RESOLVE(cudaStreamSynchronize);
  TF_RESOLVE(cudaEventCreateWithFlags);
  TF_RESOLVE(cudaEventRecord);
  TF_RESOLVE(cudaEventSynchronize);
  TF_RESOLVE(cudaEventQuery);
  TF_RESOLVE(cudaEventDestroy);
  TF_RESOLVE(cudaGetErrorName);
  TF_RESOLVE(cudaGetErrorString);
  TF_RESOLVE(cudaGetLastError);
  TF_RESOLVE(cudaMemGetInfo);
  TF_RESOLVE(cudaDriverGetVersion);
  TF_RESOLVE(cudaRuntimeGetVersion);
  TF_RESOLVE(cudaDeviceGetAttribute);
  TF_RESOLVE(cudaDeviceGetPCIBusId);
#undef TF_RESOLVE
  // CUDA 12 headers map the name to the _v2 entry point (the current struct); CUDA 13 has only the
  // plain name. Only the leading fields are read, which both layouts share.
  ResolveOptional(library, "cudaGetDeviceProperties_v2", api.cudaGetDeviceProperties);
  if (api.cudaGetDeviceProperties == nullptr) {
    ResolveOptional(library, "cudaGetDeviceProperties", api.cudaGetDeviceProperties);
  }
  // The driver's context query: in the runtime library for a fake, else in libcuda.so.1 (which
  // the runtime loads anyway; absent without a driver).
  ResolveOptional(library, "cuDeviceGet", api.cuDeviceGet);
  ResolveOptional(library, "cuDevicePrimaryCtxGetState", api.cuDevicePrimaryCtxGetState);
  if (api.cuDeviceGet == nullptr || api.cuDevicePrimaryCtxGetState == nullptr) {
    if (void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); driver != nullptr) {
      api.cuDeviceGet = reinterpret_cast<decltype(api.cuDeviceGet)>(::dlsym(driver, "cuDeviceGet"));
      api.cuDevicePrimaryCtxGetState = reinterpret_cast<decltype(api.cuDevicePrimaryCtxGetState)>(
          ::dlsym(driver, "cuDevicePrimaryCtxGetState"));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::shared_ptr<const Runtime>> OpenRuntime(const RuntimeSearch& search) {
  bool exclusive = false;
  const std::vector<std::string> candidates = RuntimeCandidates(search, &exclusive);
  // A runtime the process already uses (torch's, say) is preferred to loading a second one.
  TF_ASSIGN_OR_RETURN(const LoadedLibrary library,
                      FindOrOpen(search.names, candidates, exclusive, "CUDA runtime (libcudart)",
                                 Code::kCudaNotFound));
  RuntimeApi api;
  TF_RETURN_IF_ERROR(ResolveAll(library, api));
  return std::shared_ptr<const Runtime>(std::make_shared<Runtime>(library.path, api));
}

Result<std::shared_ptr<const Runtime>> ProcessRuntime(const RuntimeSearch& search) {
  // Never destroyed: the runtime outlives every static that might still call into it at exit.
  static std::once_flag once;
  static Result<std::shared_ptr<const Runtime>>* loaded = nullptr;
  std::call_once(once, [&search] {
    loaded = new Result<std::shared_ptr<const Runtime>>(OpenRuntime(search));
  });
  return *loaded;
}

}  // namespace tensorferry::cuda

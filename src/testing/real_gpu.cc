#include "testing/real_gpu.h"

namespace tensorferry::testing {

Result<std::shared_ptr<const cuda::Runtime>> RealGpuRuntime() {
  auto runtime = cuda::ProcessRuntime();
  if (!runtime.ok()) return runtime.status();
  const Status device = (*runtime)->CheckDevice(0);
  if (!device.ok()) return device;
  return runtime;
}

}  // namespace tensorferry::testing

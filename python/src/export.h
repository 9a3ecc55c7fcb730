// Hand-off of loaded bytes to NumPy and PyTorch without copying (DLPack through nanobind).
//
// Every exported array co-owns a Keeper, which holds the C++ owner of the bytes (a loaded batch's
// buffer, a mapping, or a heap block). Arrays stay valid after the loader, the checkpoint or the
// file is closed; the bytes are released exactly when the last array (and every view of it) dies.
// Each exported tensor gets a storage of its own in PyTorch (one DLPack capsule per tensor), so
// torch.save of one tensor saves only that tensor and storage-sharing checks see distinct tensors.
//
// Writability: the memory handed out is private to this process (anonymous memory filled by the
// loader, or a copy-on-write private mapping), so arrays are exported writable and PyTorch never
// warns; writes change only the caller's copy, never the file.
//
// Keepers are counted (live_buffers / live_bytes) so tests can prove that memory is returned.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensorferry/device.h"
#include "tensorferry/format.h"
#include "tensorferry/loader.h"

namespace tensorferry::python {

// kDlpack: nanobind's array-API object (it has __dlpack__ and __dlpack_device__), for tests and
// for frameworks that take any DLPack producer.
enum class Framework : int { kNumpy = 0, kTorch = 1, kDlpack = 2 };

class Keeper {
 public:
  Keeper(std::shared_ptr<const void> owner, uint64_t bytes);
  ~Keeper();
  Keeper(const Keeper&) = delete;
  Keeper& operator=(const Keeper&) = delete;

  static int64_t live_buffers() noexcept;
  static int64_t live_bytes() noexcept;

 private:
  std::shared_ptr<const void> owner_;
  uint64_t bytes_;
};

// A heap block of `size` bytes aligned to 64 (at least one byte is allocated). Errors:
// kBudgetExceeded.
std::shared_ptr<std::byte> AllocateBytes(uint64_t size);

// Whether `dtype` is exported with its own DLPack type to `framework` (false: exported as bytes,
// uint8 with the last dimension scaled to bytes, and the Python layer views it as its type).
bool ExportsNatively(DType dtype, Framework framework) noexcept;

// The framework array over `size` bytes at `data` holding `dtype` elements of `shape`, co-owning
// `keeper`. REQUIRES: the GIL is held; `data` is valid while `keeper` lives. Copies (into a new
// aligned block) only when host `data` is not aligned to the element size.
//
// CUDA `device`: exported with DLPack device kDLCUDA and the device index (torch gets a CUDA
// tensor on that device sharing the memory; the DeviceBuffer is freed when the last such tensor
// goes). NumPy cannot hold device memory (kInvalidArgument); an element-misaligned device address
// is kUnsupported naming the tensor's dtype and address (device bytes are never copied here).
nanobind::object Export(Framework framework, const std::shared_ptr<Keeper>& keeper,
                        const std::byte* data, uint64_t size, DType dtype,
                        std::span<const uint64_t> shape, Device device = Device::CPU());

// `framework` as passed from Python (0 numpy, 1 torch, 2 dlpack). Throws StatusError otherwise.
Framework ToFramework(int framework);

// `shape` as a Python list of ints.
nanobind::list ShapeList(const std::vector<uint64_t>& shape);

// The dtype's header name as a Python string, made once per dtype.
nanobind::str DTypeStr(DType dtype);

// (name, dtype name, array) triples (kExportedArray: the array's index). Consecutive tensors with
// one owner (a batch's buffer) share one Keeper, so the live-buffer count follows the real buffers.
// REQUIRES: the GIL is held.
constexpr size_t kExportedArray = 2;
nanobind::list ExportTensors(Framework framework, std::vector<Tensor>& tensors);

}  // namespace tensorferry::python

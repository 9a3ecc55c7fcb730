#include "export.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "errors.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

std::atomic<int64_t> g_live_buffers{0};
std::atomic<int64_t> g_live_bytes{0};

// A valid, aligned address for zero-byte arrays (frameworks dislike null data pointers).
alignas(64) std::byte g_empty[64];

nb::dlpack::dtype NativeType(DType dtype) {
  using nb::dlpack::dtype_code;
  auto t = [](dtype_code code, uint8_t bits) {
    return nb::dlpack::dtype{static_cast<uint8_t>(code), bits, 1};
  };
  switch (dtype) {
    case DType::kBool: return t(dtype_code::Bool, 8);
    case DType::kU8: return t(dtype_code::UInt, 8);
    case DType::kI8: return t(dtype_code::Int, 8);
    case DType::kI16: return t(dtype_code::Int, 16);
    case DType::kU16: return t(dtype_code::UInt, 16);
    case DType::kI32: return t(dtype_code::Int, 32);
    case DType::kU32: return t(dtype_code::UInt, 32);
    case DType::kI64: return t(dtype_code::Int, 64);
    case DType::kU64: return t(dtype_code::UInt, 64);
    case DType::kF16: return t(dtype_code::Float, 16);
    case DType::kF32: return t(dtype_code::Float, 32);
    case DType::kF64: return t(dtype_code::Float, 64);
    case DType::kBF16: return t(dtype_code::Bfloat, 16);
    case DType::kC64: return t(dtype_code::Complex, 64);
    default: return t(dtype_code::UInt, 8);  // exported as bytes
  }
}

}  // namespace

Keeper::Keeper(std::shared_ptr<const void> owner, uint64_t bytes)
    : owner_(std::move(owner)), bytes_(bytes) {
  g_live_buffers.fetch_add(1, std::memory_order_relaxed);
  g_live_bytes.fetch_add(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
}

Keeper::~Keeper() {
  g_live_buffers.fetch_sub(1, std::memory_order_relaxed);
  g_live_bytes.fetch_sub(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
}

int64_t Keeper::live_buffers() noexcept {
  return g_live_buffers.load(std::memory_order_relaxed);
}
int64_t Keeper::live_bytes() noexcept {
  return g_live_bytes.load(std::memory_order_relaxed);
}

std::shared_ptr<std::byte> AllocateBytes(uint64_t size) {
  const uint64_t rounded = (size + 63) / 64 * 64;
  void* p = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
  if (size != 0 && p == nullptr) {
    throw StatusError(
        Status(Code::kBudgetExceeded, "cannot allocate " + std::to_string(size) + " bytes"));
  }
  if (p == nullptr) p = std::aligned_alloc(64, 64);
  if (p == nullptr) throw std::bad_alloc();
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* b) { std::free(b); });
}

bool ExportsNatively(DType dtype, Framework framework) noexcept {
  switch (dtype) {
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
    case DType::kI16:
    case DType::kU16:
    case DType::kI32:
    case DType::kU32:
    case DType::kI64:
    case DType::kU64:
    case DType::kF16:
    case DType::kF32:
    case DType::kF64:
    case DType::kC64: return true;
    case DType::kBF16: return framework == Framework::kTorch;
    default: return false;
  }
}

nb::object Export(Framework framework, const std::shared_ptr<Keeper>& keeper, const std::byte* data,
                  uint64_t size, DType dtype, std::span<const uint64_t> shape, Device device) {
  const bool native = ExportsNatively(dtype, framework);
  std::vector<size_t> dims(shape.begin(), shape.end());
  nb::dlpack::dtype type = NativeType(dtype);
  if (!native) {
    // Bytes: same dimensions, the last one counted in bytes (sub-byte types pack into bytes).
    type = NativeType(DType::kU8);
    const unsigned bits = DTypeBits(dtype);
    if (bits != 8) {
      if (!dims.empty() && (static_cast<uint64_t>(dims.back()) * bits) % 8 == 0) {
        dims.back() = static_cast<size_t>(static_cast<uint64_t>(dims.back()) * bits / 8);
      } else {
        dims.assign(1, static_cast<size_t>(size));  // packed across rows: flat bytes
      }
    }
  }

  std::shared_ptr<Keeper> owner = keeper;
  const std::byte* ptr = size == 0 ? g_empty : data;
  const unsigned element_bytes = native ? std::max(1u, DTypeBits(dtype) / 8) : 1u;
  if (device.is_cuda()) {
    if (framework == Framework::kNumpy) {
      throw StatusError(
          Status(Code::kInvalidArgument,
                 "numpy arrays live on the host: cannot export " + DeviceName(device) + " memory"));
    }
    if (size == 0) ptr = data;  // a 0-byte device tensor: no address is ever read
    if (size != 0 && reinterpret_cast<uintptr_t>(ptr) % element_bytes != 0) {
      throw StatusError(Status(Code::kUnsupported,
                               "a " + std::string(DTypeName(dtype)) + " tensor at " +
                                   DeviceName(device) +
                                   " address not aligned to its element size (the file places it "
                                   "so): load it to the cpu and move it"));
    }
    nb::capsule capsule(new std::shared_ptr<Keeper>(std::move(owner)),
                        [](void* p) noexcept { delete static_cast<std::shared_ptr<Keeper>*>(p); });
    void* device_ptr = const_cast<std::byte*>(ptr);
    const auto cuda = static_cast<int32_t>(nb::device::cuda::value);
    if (framework == Framework::kTorch) {
      nb::ndarray<nb::pytorch> array(device_ptr, dims.size(), dims.data(), capsule, nullptr, type,
                                     cuda, device.index);
      return nb::cast(array, nb::rv_policy::reference);
    }
    nb::ndarray<nb::array_api> array(device_ptr, dims.size(), dims.data(), capsule, nullptr, type,
                                     cuda, device.index);
    return nb::cast(array, nb::rv_policy::reference);
  }
  if (size != 0 && reinterpret_cast<uintptr_t>(ptr) % element_bytes != 0) {
    // A file whose tensor offsets are not multiples of the element size: frameworks expect
    // aligned elements, so this tensor (only) is copied.
    std::shared_ptr<std::byte> copy = AllocateBytes(size);
    std::memcpy(copy.get(), ptr, size);
    ptr = copy.get();
    owner = std::make_shared<Keeper>(std::shared_ptr<const void>(std::move(copy)), size);
  }

  nb::capsule capsule(new std::shared_ptr<Keeper>(std::move(owner)),
                      [](void* p) noexcept { delete static_cast<std::shared_ptr<Keeper>*>(p); });
  void* mutable_ptr = const_cast<std::byte*>(ptr);  // private memory: see the header comment
  if (framework == Framework::kTorch) {
    nb::ndarray<nb::pytorch, nb::device::cpu> array(mutable_ptr, dims.size(), dims.data(), capsule,
                                                    nullptr, type);
    return nb::cast(array, nb::rv_policy::reference);
  }
  if (framework == Framework::kDlpack) {
    nb::ndarray<nb::array_api, nb::device::cpu> array(mutable_ptr, dims.size(), dims.data(),
                                                      capsule, nullptr, type);
    return nb::cast(array, nb::rv_policy::reference);
  }
  nb::ndarray<nb::numpy, nb::device::cpu> array(mutable_ptr, dims.size(), dims.data(), capsule,
                                                nullptr, type);
  return nb::cast(array, nb::rv_policy::reference);
}

Framework ToFramework(int framework) {
  if (framework < 0 || framework > 2) {
    throw StatusError(
        Status(Code::kInvalidArgument, "framework must be 0 (numpy), 1 (torch) or 2 (dlpack)"));
  }
  return static_cast<Framework>(framework);
}

nb::list ShapeList(const std::vector<uint64_t>& shape) {
  nb::list out;
  for (uint64_t d : shape) out.append(d);
  return out;
}

nb::str DTypeStr(DType dtype) {
  static nb::str* names[kNumDTypes] = {};
  nb::str*& name = names[static_cast<int>(dtype)];
  if (name == nullptr) {
    const std::string_view n = DTypeName(dtype);
    name = new nb::str(n.data(), n.size());  // never freed: lives as long as the module
  }
  return *name;
}

nb::list ExportTensors(Framework framework, std::vector<Tensor>& tensors) {
  auto same_owner = [](const std::shared_ptr<const void>& a, const std::shared_ptr<const void>& b) {
    return !a.owner_before(b) && !b.owner_before(a);
  };
  nb::list out;
  size_t i = 0;
  while (i < tensors.size()) {
    size_t j = i + 1;
    uint64_t bytes = tensors[i].size();
    while (j < tensors.size() && same_owner(tensors[i].owner(), tensors[j].owner())) {
      bytes += tensors[j].size();
      ++j;
    }
    auto keeper = std::make_shared<Keeper>(tensors[i].owner(), bytes);
    for (; i < j; ++i) {
      const Tensor& t = tensors[i];
      out.append(nb::make_tuple(
          t.name(), DTypeStr(t.dtype()),
          Export(framework, keeper, t.data(), t.size(), t.dtype(), t.shape(), t.device())));
    }
  }
  return out;
}

}  // namespace tensorferry::python

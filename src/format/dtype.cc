#include <array>
#include <string>

#include "tensorferry/format.h"

namespace tensorferry {
namespace {

struct DTypeDesc {
  std::string_view name;
  unsigned bits;
};

constexpr std::array<DTypeDesc, kNumDTypes> kDTypes = {{
    {"BOOL", 8},        {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
    {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
    {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},    {"BF16", 16},
    {"I32", 32},        {"U32", 32},    {"F32", 32},    {"C64", 64},    {"F64", 64},
    {"I64", 64},        {"U64", 64},
}};

}  // namespace

std::string_view DTypeName(DType dtype) noexcept {
  const auto i = static_cast<size_t>(dtype);
  return i < kDTypes.size() ? kDTypes[i].name : std::string_view("?");
}

std::optional<DType> DTypeFromName(std::string_view name) noexcept {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (kDTypes[i].name == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

unsigned DTypeBits(DType dtype) noexcept {
  const auto i = static_cast<size_t>(dtype);
  return i < kDTypes.size() ? kDTypes[i].bits : 0;
}

std::optional<uint64_t> NumElements(std::span<const uint64_t> shape) noexcept {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

Result<uint64_t> TensorByteSize(DType dtype, std::span<const uint64_t> shape) {
  auto n = NumElements(shape);
  if (!n) return Status(Code::kOverflow, "element count of the shape overflows 64 bits");
  const uint64_t width = DTypeBits(dtype);
  // In bits for every dtype, as the safetensors package checks it (elements x bits): counting
  // bytes let shapes of 2^61 bytes and more through, which it refuses (never looser).
  uint64_t bits;
  if (__builtin_mul_overflow(*n, width, &bits)) {
    return Status(Code::kOverflow, "bit count (" + std::to_string(*n) + " elements of " +
                                       std::string(DTypeName(dtype)) + ") overflows 64 bits");
  }
  if (bits % 8 != 0) {
    return Status(Code::kPartialByte,
                  std::to_string(*n) + " elements of " + std::string(DTypeName(dtype)) + " take " +
                      std::to_string(bits) + " bits, not a whole number of bytes");
  }
  return bits / 8;
}

std::string ShapeText(std::span<const uint64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

}  // namespace tensorferry

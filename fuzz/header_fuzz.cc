// libFuzzer target: the bytes are a whole safetensors file (or its start). The parser must never
// crash, hang or read outside the input; whatever it accepts must tile the data buffer exactly.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "tensorferry/format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  tensorferry::ParseLimits limits;
  limits.max_header_size = 1 << 20;
  auto header = tensorferry::ParseHeader(bytes, size, limits, "fuzz");
  if (!header.ok()) {
    if (header.status().message().empty()) std::abort();
    return 0;
  }
  uint64_t end = 0;
  for (const auto& t : header->tensors) {
    if (t.begin != end || t.end < t.begin) std::abort();
    auto n = tensorferry::TensorByteSize(t.dtype, t.shape);
    if (!n.ok() || *n != t.end - t.begin) std::abort();
    end = t.end;
  }
  if (end != header->data_size || 8 + header->header_size + header->data_size != size) std::abort();
  return 0;
}

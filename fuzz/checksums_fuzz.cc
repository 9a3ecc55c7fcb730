// libFuzzer target: the bytes are a "tensorferry.checksums" metadata value or a sidecar manifest
// (tensorferry.checksums.json), both untrusted. The parsers must never crash, hang or read outside
// the input; what they accept must serialise and parse back to the same value, and every accepted
// digest must match its chunks.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tensorferry/integrity.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensorferry;
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  if (auto sums = ParseFileChecksums(text, "f"); sums.ok()) {
    for (const auto& [name, sum] : sums->tensors) {
      if (CombineChunkDigests(sum.chunks) != sum.digest) std::abort();
    }
    auto again = ParseFileChecksums(SerializeFileChecksums(*sums));
    if (!again.ok() || !(*again == *sums)) std::abort();
  } else if (sums.status().code() != Code::kChecksumsInvalid &&
             sums.status().code() != Code::kUnsupported) {
    std::abort();
  }

  if (auto manifest = ParseChecksumManifest(text, "m"); manifest.ok()) {
    auto again = ParseChecksumManifest(SerializeChecksumManifest(*manifest));
    if (!again.ok() || !(*again == *manifest)) std::abort();
  } else if (manifest.status().code() != Code::kChecksumsInvalid &&
             manifest.status().code() != Code::kUnsupported) {
    std::abort();
  }
  return 0;
}

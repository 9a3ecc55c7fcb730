// XXH3-64 compiled for AVX2 (CMakeLists.txt adds -mavx2 to this file alone, on x86-64): see
// xxh3_isa.h. Only xxHash's inline C code is compiled here (every function of it static), so
// no code built for AVX2 can be picked by the linker for use elsewhere.
#include "integrity/xxh3_isa.h"

#if defined(__x86_64__)
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tensorferry::integrity_internal {

uint64_t Xxh3Avx2(const void* data, size_t size) noexcept {
  return XXH3_64bits(data, size);
}
TF_XXH3_STREAM_DEFINE(Avx2)

}  // namespace tensorferry::integrity_internal
#endif

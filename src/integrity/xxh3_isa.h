// Internal: XXH3-64 of one buffer with the widest vectors this CPU has.
//
// xxHash compiled inline (XXH_INLINE_ALL) is limited to the instruction set the translation unit
// is compiled for (SSE2 on x86-64). xxh3_avx2.cc and xxh3_avx512.cc compile the same inline code
// with -mavx2 / -mavx512f (x86-64 only; elsewhere they compile to nothing), and Xxh3Widest picks
// one once per process from the CPU's features (__builtin_cpu_supports also checks that the OS
// saves the vector registers). Every variant returns the same hash for the same bytes.
//
// Why not libxxhash's own run-time dispatcher (XXH3_64bits_dispatch): that lives in the shared
// libxxhash.so.0, and loading our Python module first then makes every later library that asks
// for libxxhash.so.0 bind to our copy (one soname, one copy per process); on the GPU machine
// `import tensorferry, torch` aborted inside torch's import (free(): invalid pointer) while
// `import torch, tensorferry` did not. Nothing here is exported beyond the library.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tensorferry::integrity_internal {

// The generic build (the translation unit's own instruction set): checksums.cc.
uint64_t Xxh3Baseline(const void* data, size_t size) noexcept;
// Defined only on x86-64 (xxh3_avx2.cc, xxh3_avx512.cc); call only where the CPU has them.
uint64_t Xxh3Avx2(const void* data, size_t size) noexcept;
uint64_t Xxh3Avx512(const void* data, size_t size) noexcept;
// The widest of the above the CPU supports, chosen on first use; "avx512", "avx2" or "baseline".
uint64_t Xxh3Widest(const void* data, size_t size) noexcept;
const char* Xxh3WidestName() noexcept;

}  // namespace tensorferry::integrity_internal

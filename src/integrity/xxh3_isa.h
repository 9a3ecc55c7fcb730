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
// Streaming (Xxh3Stream): bytes that arrive in pieces, in order, hashed as each piece arrives
// (integrity checks as reads land, ChecksumBuilder); the digest equals the one-shot hash of the
// concatenated pieces.
//
// Thread-safety: pure functions; an Xxh3Stream is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tensorferry::integrity_internal {

// Storage for xxHash's XXH3_state_t (checksums.cc checks its size and alignment at compile time).
struct alignas(64) Xxh3State {
  unsigned char bytes[576];
};

// The generic build (the translation unit's own instruction set): checksums.cc.
uint64_t Xxh3Baseline(const void* data, size_t size) noexcept;
// Defined only on x86-64 (xxh3_avx2.cc, xxh3_avx512.cc); call only where the CPU has them.
uint64_t Xxh3Avx2(const void* data, size_t size) noexcept;
uint64_t Xxh3Avx512(const void* data, size_t size) noexcept;
// The widest of the above the CPU supports, chosen on first use; "avx512", "avx2" or "baseline".
uint64_t Xxh3Widest(const void* data, size_t size) noexcept;
const char* Xxh3WidestName() noexcept;

// The streaming functions of each variant (XXH3_64bits_reset/_update/_digest), same availability.
#define TF_XXH3_STREAM_DECLARE(Variant)                                                 \
  void Xxh3##Variant##Reset(Xxh3State* state) noexcept;                                 \
  void Xxh3##Variant##Update(Xxh3State* state, const void* data, size_t size) noexcept; \
  uint64_t Xxh3##Variant##Digest(const Xxh3State* state) noexcept;
TF_XXH3_STREAM_DECLARE(Baseline)
TF_XXH3_STREAM_DECLARE(Avx2)
TF_XXH3_STREAM_DECLARE(Avx512)
#undef TF_XXH3_STREAM_DECLARE

// Defines the above for one variant in a translation unit that included <xxhash.h> inline.
#define TF_XXH3_STREAM_DEFINE(Variant)                                                   \
  void Xxh3##Variant##Reset(Xxh3State* state) noexcept {                                 \
    XXH3_64bits_reset(reinterpret_cast<XXH3_state_t*>(state->bytes));                    \
  }                                                                                      \
  void Xxh3##Variant##Update(Xxh3State* state, const void* data, size_t size) noexcept { \
    XXH3_64bits_update(reinterpret_cast<XXH3_state_t*>(state->bytes), data, size);       \
  }                                                                                      \
  uint64_t Xxh3##Variant##Digest(const Xxh3State* state) noexcept {                      \
    return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state->bytes));      \
  }

// XXH3-64 of bytes given in order, in pieces of any size, with Xxh3Widest's variant.
class Xxh3Stream {
 public:
  Xxh3Stream() noexcept { Reset(); }
  void Reset() noexcept;
  void Update(const void* data, size_t size) noexcept;
  // The hash of every byte given since the last Reset (the stream may go on).
  uint64_t Digest() const noexcept;

 private:
  Xxh3State state_;
};

}  // namespace tensorferry::integrity_internal

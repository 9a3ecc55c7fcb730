// Random bits for unique file names (temporary files, backups). Not for cryptography.
#pragma once

#include <sys/random.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace tensorferry::util {

// 64 random bits, spread by `salt` (an attempt number) so retries differ even without entropy.
inline uint64_t RandomBits(uint64_t salt) {
  uint64_t v = 0;
  if (::getrandom(&v, sizeof(v), GRND_NONBLOCK) != static_cast<ssize_t>(sizeof(v))) {
    // Early boot without entropy: any varying value will do, O_EXCL guarantees uniqueness.
    v = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  // splitmix64 finalizer: spreads the salt over all bits.
  v += salt * 0x9e3779b97f4a7c15ull;
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  return v ^ (v >> 31);
}

// RandomBits(salt) as 16 lowercase hex digits.
inline std::string RandomHex(uint64_t salt) {
  const uint64_t r = RandomBits(salt);
  std::string hex(16, '0');
  for (int i = 0; i < 16; ++i) hex[i] = "0123456789abcdef"[(r >> (60 - 4 * i)) & 0xf];
  return hex;
}

}  // namespace tensorferry::util

// Internal: a non-negative decimal integer written as ASCII digits only, the one way every parser
// of ours reads such numbers (HTTP headers, S3 XML, /proc files, shard names, layer numbers).
//
// Pure, thread-safe.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>
#include <system_error>

namespace tensorferry {

// The value of `digits`: one or more of '0'-'9' and nothing else (no sign, no space, no "0x"),
// leading zeros allowed. nullopt when it is not such a string or the value exceeds `max`.
inline std::optional<uint64_t> ParseDecimal(std::string_view digits, uint64_t max = UINT64_MAX) {
  if (digits.empty() || digits.front() < '0' || digits.front() > '9') return std::nullopt;
  uint64_t value = 0;
  const char* end = digits.data() + digits.size();
  const auto [stop, ec] = std::from_chars(digits.data(), end, value);
  if (ec != std::errc() || stop != end || value > max) return std::nullopt;
  return value;
}

}  // namespace tensorferry

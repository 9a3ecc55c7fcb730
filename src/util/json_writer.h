// Internal: writing JSON text.
//
// AppendJsonString escapes exactly as serde_json does (the reference writer), so headers we write
// are byte-identical to the reference's: '"' and '\\' escaped, \b \f \n \r \t in short form, other
// control characters below 0x20 as \u00xx with lowercase hex; everything else (UTF-8, '/', DEL)
// copied as is.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tensorferry::json {

// Appends `s` as a quoted JSON string.
void AppendString(std::string& out, std::string_view s);

// Appends a decimal unsigned integer.
void AppendUint(std::string& out, uint64_t v);

// `s` as a quoted JSON string.
inline std::string Quote(std::string_view s) {
  std::string out;
  AppendString(out, s);
  return out;
}

// True when `s` is valid UTF-8 (no overlong forms, no surrogates, at most U+10FFFF).
bool IsValidUtf8(std::string_view s) noexcept;

}  // namespace tensorferry::json

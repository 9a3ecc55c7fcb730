// Internal: writing JSON text. The escaping and UTF-8 rules are the public ones
// (tensorferry/json.h); this adds the short forms the library's writers use.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tensorferry/json.h"

namespace tensorferry::json {

// Appends `s` as a quoted JSON string (bytes copied as they are: InvalidUtf8::kCopy).
inline void AppendString(std::string& out, std::string_view s) {
  AppendJsonString(out, s);
}

// Appends a decimal unsigned integer.
void AppendUint(std::string& out, uint64_t v);

// `s` as a quoted JSON string.
inline std::string Quote(std::string_view s) {
  std::string out;
  AppendString(out, s);
  return out;
}

using ::tensorferry::IsValidUtf8;

}  // namespace tensorferry::json

// tensorferry/json.h: JSON strings as tensorferry writes them (safetensors headers, index files,
// manifests, the CLI's --json documents).
//
// Escaping follows serde_json (the safetensors reference writer), so a header written with it is
// byte-identical to the reference's: '"' and '\\' escaped, \b \f \n \r \t in short form, other
// control characters below 0x20 as \u00xx with lowercase hex; everything else ('/', DEL, UTF-8)
// copied as is. Pure functions, thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tensorferry {

// What AppendJsonString does with bytes that are not valid UTF-8.
enum class InvalidUtf8 {
  kCopy,     // copied as they are: for text already checked (a header's names are checked first)
  kReplace,  // each such byte written as \ufffd: the output is valid JSON whatever `s` holds
             // (file names, which may hold any bytes)
};

// Appends `s` to `out` as one quoted JSON string.
void AppendJsonString(std::string& out, std::string_view s,
                      InvalidUtf8 invalid = InvalidUtf8::kCopy);

// The length (1-4) of the valid UTF-8 sequence `s` starts with, or 0 when it starts with none
// (an empty `s`, a stray continuation byte, an overlong form, a surrogate, above U+10FFFF, or a
// sequence cut short).
size_t Utf8SequenceLength(std::string_view s) noexcept;

// True when all of `s` is valid UTF-8 (by Utf8SequenceLength's rules).
bool IsValidUtf8(std::string_view s) noexcept;

}  // namespace tensorferry

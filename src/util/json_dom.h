// Internal: helpers shared by the parsers built on simdjson's DOM (the safetensors header and the
// sharded-checkpoint index), so both describe values and report duplicate keys the same way.
#pragma once

#include <simdjson.h>

#include <optional>
#include <string>
#include <string_view>

#include "tensorferry/status.h"

namespace tensorferry::json {

// "an array", "an object", "an integer", "a signed integer", "a floating-point number",
// "a string", "a boolean", "null": for messages.
const char* TypeName(simdjson::dom::element_type type) noexcept;

// The first key (in document order) that appears a second time in `object`, if any. The DOM keeps
// every duplicate, which is what lets the parsers refuse them.
std::optional<std::string_view> FindDuplicateKey(simdjson::dom::object object);

// Status(code, "<source>: <message>"), or just the message when `source` is empty.
Status WithSource(Code code, std::string_view source, std::string message);

}  // namespace tensorferry::json

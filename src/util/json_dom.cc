#include "util/json_dom.h"

#include <unordered_set>

namespace tensorferry::json {

const char* TypeName(simdjson::dom::element_type type) noexcept {
  using simdjson::dom::element_type;
  switch (type) {
    case element_type::ARRAY: return "an array";
    case element_type::OBJECT: return "an object";
    case element_type::INT64: return "a signed integer";
    case element_type::UINT64: return "an integer";
    case element_type::DOUBLE: return "a floating-point number";
    case element_type::STRING: return "a string";
    case element_type::BOOL: return "a boolean";
    case element_type::NULL_VALUE: return "null";
  }
  return "a value of unknown type";
}

std::optional<std::string_view> FindDuplicateKey(simdjson::dom::object object) {
  std::unordered_set<std::string_view> seen;
  seen.reserve(object.size());
  for (simdjson::dom::key_value_pair field : object) {
    if (!seen.insert(field.key).second) return field.key;
  }
  return std::nullopt;
}

Status WithSource(Code code, std::string_view source, std::string message) {
  if (source.empty()) return Status(code, std::move(message));
  std::string m(source);
  m += ": ";
  m += message;
  return Status(code, std::move(m));
}

}  // namespace tensorferry::json

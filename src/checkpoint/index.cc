// ParseIndexJson: the model.safetensors.index.json document of a sharded checkpoint.
//
// A pure function over the index text: simdjson's DOM parser on a padded copy, then a walk that
// checks every rule of checkpoint.h. The DOM keeps duplicate keys, so each object is checked for
// them here (a set of string_views into the parser's string buffer).
#include <simdjson.h>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "util/json_dom.h"
#include "util/json_writer.h"
#include "util/path.h"

namespace tensorferry {
namespace {

Status IndexError(Code code, std::string_view source, std::string message) {
  return json::WithSource(code, source, std::move(message));
}

// Rejects a file value that could name something outside the checkpoint directory (the lexical
// rule of util/path.h).
Status CheckRelativePath(std::string_view tensor, std::string_view file, std::string_view source) {
  if (std::optional<std::string> why = RelativePathProblem(file)) {
    return IndexError(
        Code::kIndexPathEscape, source,
        "weight_map[" + json::Quote(tensor) + "]: file " + json::Quote(file) + " " + *why);
  }
  return Status::Ok();
}

// Checks that no key of `object` appears twice. `where` names the object in messages.
Status CheckNoDuplicateKeys(simdjson::dom::object object, std::string_view where,
                            std::string_view source) {
  if (auto key = json::FindDuplicateKey(object)) {
    return IndexError(
        Code::kDuplicateKey, source,
        std::string(where) + ": key " + json::Quote(*key) + " appears more than once");
  }
  return Status::Ok();
}

// Checks the raw text before parsing: within the size limit, valid UTF-8, no byte-order mark.
Status CheckIndexText(std::string_view json, std::string_view source, const IndexLimits& limits) {
  if (json.size() > limits.max_index_size) {
    return IndexError(Code::kIndexTooLarge, source,
                      "index is " + std::to_string(json.size()) + " bytes, above the limit of " +
                          std::to_string(limits.max_index_size));
  }
  // simdjson validates UTF-8 too, but a separate check gives a precise message.
  if (!json::IsValidUtf8(json)) {
    return IndexError(Code::kIndexInvalidJson, source, "index is not valid UTF-8");
  }
  if (json.substr(0, 3) == "\xEF\xBB\xBF") {
    // JSON (RFC 8259) forbids it, and Python's json.loads refuses it too; say so rather than
    // report a syntax error at offset 0.
    return IndexError(Code::kIndexInvalidJson, source,
                      "index starts with a UTF-8 byte-order mark (EF BB BF), which JSON does not "
                      "allow: save it as UTF-8 without a BOM");
  }
  return Status::Ok();
}

// Parses `json` with `parser` into `top`, its top-level object without duplicate keys. `top`
// stays valid as long as `parser` lives and is not reused.
Status ParseTopObject(simdjson::dom::parser& parser, std::string_view json, std::string_view source,
                      const IndexLimits& limits, simdjson::dom::object& top) {
  // Room for the whole document: no reallocation inside parse(). simdjson counts the document
  // itself as one level: add it so max_depth counts containers, as ParseLimits::max_depth does.
  const size_t capacity = std::max<size_t>(json.size(), 64);
  const size_t max_depth = size_t{limits.max_depth} + 1;
  if (auto err = parser.allocate(capacity, max_depth); err != simdjson::SUCCESS) {
    return IndexError(Code::kIndexTooLarge, source,
                      "cannot allocate a JSON parser for " + std::to_string(json.size()) +
                          " bytes: " + simdjson::error_message(err));
  }
  const simdjson::padded_string padded(json.data(), json.size());
  simdjson::dom::element root;
  if (auto err = parser.parse(padded).get(root); err != simdjson::SUCCESS) {
    if (err == simdjson::DEPTH_ERROR) {
      return IndexError(Code::kIndexInvalidJson, source,
                        "index JSON nests deeper than the limit of " +
                            std::to_string(limits.max_depth) + " levels");
    }
    return IndexError(Code::kIndexInvalidJson, source,
                      std::string("index is not valid JSON: ") + simdjson::error_message(err));
  }
  if (root.get(top) != simdjson::SUCCESS) {
    return IndexError(
        Code::kIndexInvalidJson, source,
        "index top level is " + std::string(json::TypeName(root.type())) + ", not an object");
  }
  return CheckNoDuplicateKeys(top, "index top level", source);
}

// Reads "metadata" (optional, null as absent; any JSON values) into `out` as (key, minified JSON
// text), sorted.
Status ParseMetadata(simdjson::dom::object top, std::string_view source,
                     std::vector<std::pair<std::string, std::string>>& out) {
  simdjson::dom::element metadata_element;
  if (top.at_key("metadata").get(metadata_element) != simdjson::SUCCESS) return Status::Ok();
  if (metadata_element.is_null()) return Status::Ok();  // as absent (the header's rule too)
  simdjson::dom::object metadata;
  if (metadata_element.get(metadata) != simdjson::SUCCESS) {
    return IndexError(Code::kIndexInvalidJson, source,
                      "\"metadata\" is " + std::string(json::TypeName(metadata_element.type())) +
                          ", not an object");
  }
  if (auto s = CheckNoDuplicateKeys(metadata, "\"metadata\"", source); !s.ok()) return s;
  out.reserve(metadata.size());
  for (auto field : metadata) {
    out.emplace_back(std::string(field.key), simdjson::minify(field.value));
  }
  std::sort(out.begin(), out.end());
  return Status::Ok();
}

// Reads "weight_map" (required; tensor name -> relative file path) into `out`, sorted by name.
Status ParseWeightMap(simdjson::dom::object top, std::string_view source,
                      std::vector<std::pair<std::string, std::string>>& out) {
  simdjson::dom::element map_element;
  if (top.at_key("weight_map").get(map_element) != simdjson::SUCCESS) {
    return IndexError(Code::kIndexNoWeightMap, source, "index has no \"weight_map\"");
  }
  simdjson::dom::object weight_map;
  if (map_element.get(weight_map) != simdjson::SUCCESS) {
    return IndexError(
        Code::kIndexNoWeightMap, source,
        "\"weight_map\" is " + std::string(json::TypeName(map_element.type())) + ", not an object");
  }
  if (auto s = CheckNoDuplicateKeys(weight_map, "\"weight_map\"", source); !s.ok()) return s;
  out.reserve(weight_map.size());
  for (auto field : weight_map) {
    std::string_view file;
    if (field.value.get(file) != simdjson::SUCCESS) {
      return IndexError(Code::kIndexBadEntry, source,
                        "weight_map[" + json::Quote(field.key) + "] is " +
                            std::string(json::TypeName(field.value.type())) +
                            ", not a file name string");
    }
    if (file.empty()) {
      return IndexError(Code::kIndexBadEntry, source,
                        "weight_map[" + json::Quote(field.key) + "] is an empty file name");
    }
    if (auto s = CheckRelativePath(field.key, file, source); !s.ok()) return s;
    out.emplace_back(std::string(field.key), std::string(file));
  }
  std::sort(out.begin(), out.end());
  return Status::Ok();
}

}  // namespace

Result<IndexDocument> ParseIndexJson(std::string_view json, std::string_view source,
                                     const IndexLimits& limits) {
  if (auto s = CheckIndexText(json, source, limits); !s.ok()) return s;
  simdjson::dom::parser parser;
  simdjson::dom::object top;
  if (auto s = ParseTopObject(parser, json, source, limits, top); !s.ok()) return s;
  IndexDocument doc;
  if (auto s = ParseMetadata(top, source, doc.metadata); !s.ok()) return s;
  if (auto s = ParseWeightMap(top, source, doc.weight_map); !s.ok()) return s;
  return doc;
}

}  // namespace tensorferry

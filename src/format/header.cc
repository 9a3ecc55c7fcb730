// The safetensors header parser and validator: a pure function over bytes.
//
// Rules (docs/format.md lists them with their codes): the 8-byte length prefix is checked against
// the limit and the file size with checked arithmetic; the JSON must be BOM-free UTF-8, one object,
// no duplicate key anywhere, within the depth and tensor-count limits; each tensor entry has a
// known dtype, a shape of non-negative integers and exactly two offsets; its byte size (checked
// multiplication, whole bytes for sub-byte types) equals end - begin; and the tensors, sorted by
// offset, tile the data buffer exactly.
#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tensorferry/format.h"
#include "util/json_dom.h"
#include "util/json_writer.h"

namespace tensorferry {
namespace {

namespace dom = simdjson::dom;

// Names in messages are JSON-quoted (so control characters cannot break a one-line error) and
// cut to a readable length.
std::string QuoteName(std::string_view name) {
  constexpr size_t kMax = 200;
  if (name.size() <= kMax) return json::Quote(name);
  // Cut on a UTF-8 boundary.
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) --cut;
  return json::Quote(name.substr(0, cut)) + "...(" + std::to_string(name.size()) + " bytes)";
}

// Short rendering of a JSON value for messages.
std::string Render(dom::element e) {
  std::string s = simdjson::minify(e);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

class Parser {
 public:
  Parser(const ParseLimits& limits, std::string_view source) : limits_(limits), source_(source) {}

  Status Fail(Code code, std::string message) const {
    return json::WithSource(code, source_, std::move(message));
  }

  // simdjson reads the integer "-0" as 0, which would let a shape or offset written "-0" through;
  // the reference (serde_json) reads it as a float and refuses it. A '-' followed by '0' and a
  // delimiter, outside strings, is such a token. memchr finds candidates cheaply; only then is the
  // header scanned with string state to confirm one.
  Status RejectNegativeZero(std::string_view json) const {
    const char* p = json.data();
    const char* end = p + json.size();
    auto is_delim = [](char c) {
      return c == ',' || c == ']' || c == '}' || c == ' ' || c == '\t' || c == '\n' || c == '\r';
    };
    bool candidate = false;
    for (const char* q = p; (q = static_cast<const char*>(std::memchr(q, '-', end - q))) != nullptr;
         ++q) {
      if (end - q >= 2 && q[1] == '0' && (end - q == 2 || is_delim(q[2]))) {
        candidate = true;
        break;
      }
    }
    if (!candidate) return Status::Ok();
    bool in_string = false;
    for (const char* q = p; q < end; ++q) {
      if (in_string) {
        if (*q == '\\')
          ++q;
        else if (*q == '"')
          in_string = false;
      } else if (*q == '"') {
        in_string = true;
      } else if (*q == '-' && end - q >= 2 && q[1] == '0' && (end - q == 2 || is_delim(q[2]))) {
        return Fail(Code::kHeaderInvalidJson,
                    "the integer -0 at header byte " + std::to_string(q - p) + " (file offset " +
                        std::to_string(8 + (q - p)) +
                        ") is refused: a negative zero is not a valid shape, offset or count");
      }
    }
    return Status::Ok();
  }

  Status FailTensor(Code code, std::string_view name, const std::string& message) const {
    return Fail(code, "tensor " + QuoteName(name) + ": " + message);
  }

  // Rejects duplicate keys in `obj`. `where` names the object in the message.
  Status CheckUniqueKeys(dom::object obj, const std::string& where) const {
    if (auto key = json::FindDuplicateKey(obj)) {
      return Fail(Code::kDuplicateKey, "duplicate key " + QuoteName(*key) + " in " + where);
    }
    return Status::Ok();
  }

  // Duplicate keys are refused anywhere in the document, including unknown fields we ignore.
  Status CheckUniqueKeysDeep(dom::element e, const std::string& where) {
    if (e.type() == dom::element_type::OBJECT) {
      dom::object obj = e.get_object().value_unsafe();
      if (Status s = CheckUniqueKeys(obj, where); !s.ok()) return s;
      for (dom::key_value_pair kv : obj) {
        if (Status s = CheckUniqueKeysDeep(kv.value, where); !s.ok()) return s;
      }
    } else if (e.type() == dom::element_type::ARRAY) {
      dom::array arr = e.get_array().value_unsafe();
      for (dom::element child : arr) {
        if (Status s = CheckUniqueKeysDeep(child, where); !s.ok()) return s;
      }
    }
    return Status::Ok();
  }

  Status ParseMetadata(dom::element value, Header& header) {
    if (value.type() == dom::element_type::NULL_VALUE) return Status::Ok();  // as the reference
    if (value.type() != dom::element_type::OBJECT) {
      return Fail(Code::kMetadataNotObject,
                  std::string("\"__metadata__\" must be an object of strings, got ") +
                      json::TypeName(value.type()) + " " + Render(value));
    }
    dom::object obj = value.get_object().value_unsafe();
    if (obj.size() > limits_.max_metadata_entries) {
      return Fail(Code::kTooManyMetadataEntries,
                  "\"__metadata__\" holds " + std::to_string(obj.size()) + " entries, more than " +
                      std::to_string(limits_.max_metadata_entries) +
                      " (limit max_metadata_entries)");
    }
    if (Status s = CheckUniqueKeys(obj, "\"__metadata__\""); !s.ok()) return s;
    header.has_metadata = true;
    for (dom::key_value_pair kv : obj) {
      if (kv.value.type() != dom::element_type::STRING) {
        return Fail(Code::kMetadataNotString, "\"__metadata__\" value for key " +
                                                  QuoteName(kv.key) + " must be a string, got " +
                                                  json::TypeName(kv.value.type()) + " " +
                                                  Render(kv.value));
      }
      header.metadata.emplace_back(std::string(kv.key),
                                   std::string(kv.value.get_string().value_unsafe()));
    }
    std::sort(header.metadata.begin(), header.metadata.end());
    return Status::Ok();
  }

  // Parses a tensor's "dtype" field (rejecting a duplicate) into t.dtype.
  Status ParseDtypeField(std::string_view name, dom::element value, bool& have, TensorEntry& t) {
    if (have)
      return Fail(Code::kDuplicateKey, "duplicate key \"dtype\" in tensor " + QuoteName(name));
    have = true;
    std::string_view dt;
    if (value.get_string().get(dt) != simdjson::SUCCESS) {
      return FailTensor(Code::kUnknownDtype, name,
                        std::string("dtype must be a string, got ") + json::TypeName(value.type()) +
                            " " + Render(value));
    }
    auto d = DTypeFromName(dt);
    if (!d) {
      return FailTensor(Code::kUnknownDtype, name,
                        "unknown dtype " + QuoteName(dt) + " (dtype names are case-sensitive)");
    }
    t.dtype = *d;
    return Status::Ok();
  }

  // Parses a tensor's "shape" field (rejecting a duplicate, enforcing max_rank) into t.shape.
  Status ParseShapeField(std::string_view name, dom::element value, bool& have, TensorEntry& t) {
    if (have)
      return Fail(Code::kDuplicateKey, "duplicate key \"shape\" in tensor " + QuoteName(name));
    have = true;
    dom::array arr;
    if (value.get_array().get(arr) != simdjson::SUCCESS) {
      return FailTensor(Code::kInvalidShape, name,
                        std::string("shape must be an array of non-negative integers, got ") +
                            json::TypeName(value.type()) + " " + Render(value));
    }
    size_t rank = 0;
    for (dom::element d : arr) {
      if (++rank > limits_.max_rank) {
        return FailTensor(Code::kRankTooLarge, name,
                          "shape has more than " + std::to_string(limits_.max_rank) +
                              " dimensions (limit max_rank)");
      }
      uint64_t v;
      if (d.get_uint64().get(v) != simdjson::SUCCESS) {
        return FailTensor(Code::kInvalidShape, name,
                          "shape " + Render(value) + ": dimension " + std::to_string(rank - 1) +
                              " is " + Render(d) + ", not a non-negative 64-bit integer");
      }
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        // Only an empty tensor can have one (any other would not fit in memory); no framework
        // can describe it (torch's and NumPy's dimensions are signed 64-bit integers).
        return FailTensor(Code::kInvalidShape, name,
                          "shape " + Render(value) + ": dimension " + std::to_string(rank - 1) +
                              " is " + std::to_string(v) + ", more than 2^63-1");
      }
      t.shape.push_back(v);
    }
    return Status::Ok();
  }

  // Parses a tensor's "data_offsets" field (rejecting a duplicate) into t.begin and t.end.
  Status ParseOffsetsField(std::string_view name, dom::element value, bool& have, TensorEntry& t) {
    if (have) {
      return Fail(Code::kDuplicateKey,
                  "duplicate key \"data_offsets\" in tensor " + QuoteName(name));
    }
    have = true;
    dom::array arr;
    uint64_t v[2];
    size_t n = 0;
    bool ok = value.get_array().get(arr) == simdjson::SUCCESS;
    if (ok) {
      for (dom::element d : arr) {
        if (n == 2 || d.get_uint64().get(v[n]) != simdjson::SUCCESS) {
          ok = false;
          break;
        }
        ++n;
      }
    }
    if (!ok || n != 2) {
      return FailTensor(
          Code::kInvalidOffsets, name,
          "data_offsets must be exactly two non-negative 64-bit integers, got " + Render(value));
    }
    t.begin = v[0];
    t.end = v[1];
    return Status::Ok();
  }

  // Checks a parsed tensor: required fields present, offsets ordered, byte size matching.
  Status CheckTensorEntry(std::string_view name, bool have_dtype, bool have_shape,
                          bool have_offsets, const TensorEntry& t) {
    if (!have_dtype || !have_shape || !have_offsets) {
      std::string missing;
      for (auto [have, field] : {std::pair{have_dtype, "dtype"}, std::pair{have_shape, "shape"},
                                 std::pair{have_offsets, "data_offsets"}}) {
        if (!have) missing += std::string(missing.empty() ? "" : ", ") + field;
      }
      return FailTensor(Code::kMissingField, name, "missing required field(s): " + missing);
    }
    if (t.end < t.begin) {
      return FailTensor(Code::kOffsetsReversed, name,
                        "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                            "]: end is before begin");
    }
    auto bytes = TensorByteSize(t.dtype, t.shape);
    if (!bytes.ok()) {
      return FailTensor(bytes.status().code(), name,
                        "shape " + ShapeText(t.shape) + ": " + bytes.status().message());
    }
    if (*bytes != t.end - t.begin) {
      return FailTensor(Code::kSizeMismatch, name,
                        std::string(DTypeName(t.dtype)) + " " + ShapeText(t.shape) + " takes " +
                            std::to_string(*bytes) + " bytes but data_offsets [" +
                            std::to_string(t.begin) + ", " + std::to_string(t.end) + "] span " +
                            std::to_string(t.end - t.begin));
    }
    return Status::Ok();
  }

  // Parses one tensor entry (an object with dtype, shape and data_offsets) into `t`.
  Status ParseTensor(std::string_view name, dom::element value, TensorEntry& t) {
    if (value.type() != dom::element_type::OBJECT) {
      return FailTensor(Code::kTensorNotObject, name,
                        std::string("entry must be an object, got ") +
                            json::TypeName(value.type()) + " " + Render(value));
    }
    dom::object obj = value.get_object().value_unsafe();
    bool have_dtype = false, have_shape = false, have_offsets = false;
    size_t fields = 0;
    for (dom::key_value_pair kv : obj) {
      ++fields;
      Status s;
      if (kv.key == "dtype") {
        s = ParseDtypeField(name, kv.value, have_dtype, t);
      } else if (kv.key == "shape") {
        s = ParseShapeField(name, kv.value, have_shape, t);
      } else if (kv.key == "data_offsets") {
        s = ParseOffsetsField(name, kv.value, have_offsets, t);
      } else {
        // Unknown fields are ignored, as the reference does, but must still be well-formed.
        s = CheckUniqueKeysDeep(kv.value, "tensor " + QuoteName(name));
      }
      if (!s.ok()) return s;
    }
    if (fields > 3) {
      if (Status s = CheckUniqueKeys(obj, "tensor " + QuoteName(name)); !s.ok()) return s;
    }
    return CheckTensorEntry(name, have_dtype, have_shape, have_offsets, t);
  }

  // Rejects raw header bytes that are not plain JSON text: a BOM, invalid UTF-8, negative zero.
  Status CheckRawHeader(std::string_view json) {
    if (json.size() >= 3 && static_cast<unsigned char>(json[0]) == 0xEF &&
        static_cast<unsigned char>(json[1]) == 0xBB &&
        static_cast<unsigned char>(json[2]) == 0xBF) {
      return Fail(Code::kHeaderBom, "header starts with a UTF-8 byte-order mark (file offset 8)");
    }
    if (!simdjson::validate_utf8(json.data(), json.size())) {
      return Fail(
          Code::kHeaderNotUtf8,
          "header (file bytes 8 to " + std::to_string(8 + json.size()) + ") is not valid UTF-8");
    }
    if (Status s = RejectNegativeZero(json); !s.ok()) return s;
    return Status::Ok();
  }

  // Parses the header JSON with `parser` (bounded by max_depth) and gets its root object.
  Status ParseRootObject(std::string_view json, dom::parser& parser,
                         const simdjson::padded_string& padded, dom::object& root) {
    // simdjson counts the document itself as one level: add it so max_depth counts containers.
    if (parser.allocate(std::max<size_t>(json.size(), 64), size_t{limits_.max_depth} + 1) !=
        simdjson::SUCCESS) {
      return Fail(Code::kHeaderTooLarge, "cannot allocate a JSON parser for a header of " +
                                             std::to_string(json.size()) + " bytes");
    }
    dom::element doc;
    if (auto err = parser.parse(padded).get(doc); err != simdjson::SUCCESS) {
      if (err == simdjson::DEPTH_ERROR) {
        return Fail(Code::kHeaderTooDeep, "header JSON nests deeper than " +
                                              std::to_string(limits_.max_depth) +
                                              " levels (limit max_depth)");
      }
      if (err == simdjson::UTF8_ERROR)
        return Fail(Code::kHeaderNotUtf8, "header is not valid UTF-8");
      return Fail(Code::kHeaderInvalidJson,
                  std::string("header is not valid JSON: ") + simdjson::error_message(err));
    }
    if (doc.get_object().get(root) != simdjson::SUCCESS) {
      return Fail(Code::kHeaderNotObject,
                  std::string("header JSON must be an object, got ") + json::TypeName(doc.type()));
    }
    return Status::Ok();
  }

  // Reads __metadata__ into `header` and parses every other root entry into `entries`.
  Status ParseEntries(dom::object root, Header& header, std::vector<TensorEntry>& entries) {
    bool seen_metadata = false;
    size_t count = 0;
    for (dom::key_value_pair kv : root) {
      if (kv.key == "__metadata__") {
        if (seen_metadata) return Fail(Code::kDuplicateKey, "duplicate key \"__metadata__\"");
        seen_metadata = true;
        if (Status s = ParseMetadata(kv.value, header); !s.ok()) return s;
        continue;
      }
      if (++count > limits_.max_tensors) {
        return Fail(Code::kTooManyTensors, "header lists more than " +
                                               std::to_string(limits_.max_tensors) +
                                               " tensors (limit max_tensors)");
      }
    }
    entries.resize(count);
    size_t i = 0;
    for (dom::key_value_pair kv : root) {
      if (kv.key == "__metadata__") continue;
      TensorEntry& t = entries[i++];
      if (Status s = ParseTensor(kv.key, kv.value, t); !s.ok()) return s;
      t.name.assign(kv.key);
    }
    if (Status s = CheckUniqueKeys(root, "the header (tensor names must be unique)"); !s.ok()) {
      return s;
    }
    return Status::Ok();
  }

  // Checks that the tensors tile [0, data_size) exactly; `order` gets them sorted by position.
  Status CheckTiling(const std::vector<TensorEntry>& entries, uint64_t data_size, size_t json_size,
                     std::vector<uint32_t>& order) {
    // Tiling: sorted by (begin, end, name), the tensors must cover [0, data_size) exactly.
    order.resize(entries.size());
    for (uint32_t k = 0; k < order.size(); ++k) order[k] = k;
    const auto& ts = entries;
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      if (ts[a].begin != ts[b].begin) return ts[a].begin < ts[b].begin;
      if (ts[a].end != ts[b].end) return ts[a].end < ts[b].end;
      return ts[a].name < ts[b].name;
    });
    uint64_t expected = 0;
    const TensorEntry* prev = nullptr;
    for (uint32_t k : order) {
      const TensorEntry& t = ts[k];
      if (t.begin > expected) {
        return FailTensor(Code::kDataGap, t.name,
                          "starts at data offset " + std::to_string(t.begin) + " but " +
                              (prev ? "the previous tensor " + QuoteName(prev->name) + " ends at " +
                                          std::to_string(expected)
                                    : std::string("the data buffer starts at 0")) +
                              ": a hole of " + std::to_string(t.begin - expected) + " bytes");
      }
      if (t.begin < expected) {
        return FailTensor(Code::kDataOverlap, t.name,
                          "data_offsets [" + std::to_string(t.begin) + ", " +
                              std::to_string(t.end) + "] overlap tensor " + QuoteName(prev->name) +
                              ", which ends at " + std::to_string(expected));
      }
      expected = t.end;
      prev = &t;
    }
    if (expected < data_size) {
      return Fail(Code::kDataTrailing,
                  std::to_string(data_size - expected) + " bytes after the last tensor" +
                      (prev ? " (" + QuoteName(prev->name) + ", ends at data offset " +
                                  std::to_string(expected) + ")"
                            : std::string(" (there are no tensors)")) +
                      ": the data buffer is " + std::to_string(data_size) +
                      " bytes and must end where the last tensor ends");
    }
    if (expected > data_size) {
      return FailTensor(Code::kDataTruncated, prev->name,
                        "ends at data offset " + std::to_string(expected) +
                            " but the file's data "
                            "buffer (from file offset " +
                            std::to_string(8 + json_size) + ") is only " +
                            std::to_string(data_size) + " bytes: the file is truncated by " +
                            std::to_string(expected - data_size) + " bytes");
    }
    return Status::Ok();
  }

  // Parses and validates a whole header JSON text (file bytes from offset 8).
  Result<Header> Parse(std::string_view json, uint64_t data_size) {
    if (Status s = CheckRawHeader(json); !s.ok()) return s;
    dom::parser parser;
    simdjson::padded_string padded(json);
    dom::object root;  // points into `parser`, which outlives it
    if (Status s = ParseRootObject(json, parser, padded, root); !s.ok()) return s;

    Header header;
    header.header_size = json.size();
    header.data_size = data_size;
    std::vector<TensorEntry> entries;
    if (Status s = ParseEntries(root, header, entries); !s.ok()) return s;
    std::vector<uint32_t> order;
    if (Status s = CheckTiling(entries, data_size, json.size(), order); !s.ok()) return s;
    header.tensors.reserve(order.size());
    for (uint32_t k : order) header.tensors.push_back(std::move(entries[k]));
    return header;
  }

 private:
  const ParseLimits& limits_;
  std::string_view source_;
};

}  // namespace

namespace {

// What a file whose first 8 bytes are no plausible header length most likely is, for the error
// (empty when nothing is recognised): the usual ways a path names something else.
std::string WhatTheFileLooksLike(std::span<const std::byte> prefix) {
  const std::string_view head(reinterpret_cast<const char*>(prefix.data()),
                              std::min<size_t>(prefix.size(), 8));
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(head[i]); };
  if (head.starts_with("PK\x03\x04")) {
    return " (the file starts like a zip archive, as torch.save writes: a PyTorch checkpoint? "
           "`tensorferry convert` converts it to safetensors)";
  }
  if (byte(0) == 0x80 && byte(1) >= 2 && byte(1) <= 5) {
    return " (the file starts like a Python pickle: a PyTorch checkpoint? `tensorferry convert` "
           "converts it to safetensors)";
  }
  if (head.starts_with("GGUF")) return " (the file is GGUF, not safetensors)";
  if (head.starts_with("version ")) {
    return " (the file starts like a Git LFS pointer: the weights were not fetched; `git lfs "
           "pull` fetches them)";
  }
  if (head.starts_with("<")) return " (the file starts with '<': an HTML or XML page?)";
  return {};
}

}  // namespace

Result<uint64_t> ParseHeaderLength(std::span<const std::byte> prefix, uint64_t file_size,
                                   const ParseLimits& limits, std::string_view source) {
  Parser p(limits, source);
  if (file_size < 8) {
    return p.Fail(Code::kFileTooSmall, "file is " + std::to_string(file_size) +
                                           " bytes, too short for the 8-byte header length");
  }
  if (prefix.size() < 8) {
    return p.Fail(Code::kInvalidArgument,
                  "need the first 8 bytes of the file, got " + std::to_string(prefix.size()));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(prefix[static_cast<size_t>(i)]);
  if (n > limits.max_header_size) {
    return p.Fail(Code::kHeaderTooLarge, "header length " + std::to_string(n) +
                                             " (file bytes 0-7) exceeds the limit of " +
                                             std::to_string(limits.max_header_size) + " bytes" +
                                             WhatTheFileLooksLike(prefix));
  }
  if (n > file_size - 8) {
    return p.Fail(Code::kHeaderOutOfBounds, "header length " + std::to_string(n) +
                                                " (file bytes 0-7) runs past the end of the " +
                                                std::to_string(file_size) + "-byte file" +
                                                WhatTheFileLooksLike(prefix));
  }
  return n;
}

Result<Header> ParseHeaderJson(std::string_view json, uint64_t data_size, const ParseLimits& limits,
                               std::string_view source) {
  if (json.size() > limits.max_header_size) {
    return Parser(limits, source)
        .Fail(Code::kHeaderTooLarge, "header of " + std::to_string(json.size()) +
                                         " bytes exceeds the limit of " +
                                         std::to_string(limits.max_header_size));
  }
  return Parser(limits, source).Parse(json, data_size);
}

Result<Header> ParseHeader(std::span<const std::byte> file_start, uint64_t file_size,
                           const ParseLimits& limits, std::string_view source) {
  auto n = ParseHeaderLength(file_start, file_size, limits, source);
  if (!n.ok()) return n.status();
  if (file_start.size() - 8 < *n) {
    return Parser(limits, source)
        .Fail(Code::kInvalidArgument, "need the first " + std::to_string(8 + *n) +
                                          " bytes of the file to parse its header, got " +
                                          std::to_string(file_start.size()));
  }
  std::string_view json(reinterpret_cast<const char*>(file_start.data()) + 8, *n);
  return ParseHeaderJson(json, file_size - 8 - *n, limits, source);
}

}  // namespace tensorferry

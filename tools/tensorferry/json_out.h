// A tiny JSON emitter for the CLI's --json output.
//
// The tools use the public API only (STYLE.md), so this is a local helper rather than the
// library's internal json_writer. Strings are escaped like serde_json (quote, backslash, \b \f \n
// \r \t, other control characters as \u00xx); bytes that are not valid UTF-8 (file names may hold
// any bytes) become U+FFFD so the output is always a valid JSON document.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace tensorferry::cli {

// Length of the valid UTF-8 sequence at the start of `s`, or 0 when it is not one.
inline size_t Utf8SequenceLength(std::string_view s) noexcept {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t n = 0;
  uint32_t cp = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((b(i) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i) & 0x3F);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
  return n;
}

// Appends `s` as a quoted JSON string.
inline void AppendJsonString(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = Utf8SequenceLength(s.substr(i));
      if (n == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(s.substr(i, n));
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 15]);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
    ++i;
  }
  out.push_back('"');
}

// Builds one JSON document; inserts commas itself. Misuse (a value where a key is due) is a bug
// in the CLI, not something input can cause.
class JsonOut {
 public:
  JsonOut& BeginObject() { return Open('{'); }
  JsonOut& EndObject() { return Close('}'); }
  JsonOut& BeginArray() { return Open('['); }
  JsonOut& EndArray() { return Close(']'); }

  JsonOut& Key(std::string_view key) {
    Separate();
    AppendJsonString(out_, key);
    out_.push_back(':');
    after_key_ = true;
    return *this;
  }
  JsonOut& String(std::string_view v) {
    Separate();
    AppendJsonString(out_, v);
    return *this;
  }
  JsonOut& Uint(uint64_t v) {
    Separate();
    out_ += std::to_string(v);
    return *this;
  }
  JsonOut& Bool(bool v) {
    Separate();
    out_ += v ? "true" : "false";
    return *this;
  }
  // Non-finite values become null (JSON has no NaN).
  JsonOut& Double(double v) {
    Separate();
    if (!std::isfinite(v)) {
      out_ += "null";
      return *this;
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    out_ += buf;
    return *this;
  }
  // Appends text that is already one JSON value.
  JsonOut& Raw(std::string_view json) {
    Separate();
    out_.append(json);
    return *this;
  }

  // Key/value shorthands.
  JsonOut& Field(std::string_view key, std::string_view v) { return Key(key).String(v); }
  JsonOut& Field(std::string_view key, const char* v) { return Key(key).String(v); }
  JsonOut& Field(std::string_view key, uint64_t v) { return Key(key).Uint(v); }
  JsonOut& Field(std::string_view key, double v) { return Key(key).Double(v); }
  JsonOut& Field(std::string_view key, bool v) { return Key(key).Bool(v); }

  const std::string& str() const { return out_; }

 private:
  JsonOut& Open(char c) {
    Separate();
    out_.push_back(c);
    first_.push_back(true);
    return *this;
  }
  JsonOut& Close(char c) {
    out_.push_back(c);
    if (!first_.empty()) first_.pop_back();
    return *this;
  }
  void Separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_.push_back(',');
    first_.back() = false;
  }

  std::string out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

}  // namespace tensorferry::cli

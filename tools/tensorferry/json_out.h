// A tiny JSON emitter for the CLI's --json output.
//
// Strings are escaped by the library's public AppendJsonString (tensorferry/json.h) with bytes
// that are not valid UTF-8 (file names may hold any bytes) written as U+FFFD, so the output is
// always a valid JSON document.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/json.h"

namespace tensorferry::cli {

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
    AppendJsonString(out_, key, InvalidUtf8::kReplace);
    out_.push_back(':');
    after_key_ = true;
    return *this;
  }
  JsonOut& String(std::string_view v) {
    Separate();
    AppendJsonString(out_, v, InvalidUtf8::kReplace);
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

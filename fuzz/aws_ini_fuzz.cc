// libFuzzer target: the bytes are an AWS shared config or credentials file (~/.aws/config,
// ~/.aws/credentials), read by ParseAwsIni. It must never crash, hang or read outside the input;
// an error names the file and line; what it accepts has the documented shape (section names
// trimmed with whitespace collapsed, keys trimmed and top-level keys lower-cased, values trimmed).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "objstore/aws_config.h"

namespace {

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v';
}

bool Trimmed(std::string_view s) {
  return s.empty() || (!IsSpace(s.front()) && !IsSpace(s.back()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto ini = tensorferry::objstore::ParseAwsIni(text, "fuzz");
  if (!ini.ok()) {
    // "fuzz:<line>: <problem>", the line one of the input's.
    const std::string& m = ini.status().message();
    if (ini.status().code() != tensorferry::Code::kInvalidArgument || m.rfind("fuzz:", 0) != 0) {
      std::abort();
    }
    const size_t colon = m.find(": ", 5);
    if (colon == std::string::npos || colon == 5) std::abort();
    size_t line = 0;
    for (size_t i = 5; i < colon; ++i) {
      if (m[i] < '0' || m[i] > '9') std::abort();
      line = line * 10 + static_cast<size_t>(m[i] - '0');
      if (line > size + 1) std::abort();
    }
    size_t lines = 1;
    for (char c : text) lines += c == '\n';
    if (line == 0 || line > lines || colon + 2 >= m.size()) std::abort();
    return 0;
  }
  for (const auto& [section, properties] : *ini) {
    // One line's bracketed name: non-empty, trimmed, single spaces only, no ']'.
    if (section.empty() || section.front() == ' ' || section.back() == ' ' ||
        section.find("  ") != std::string::npos || section.find(']') != std::string::npos ||
        section.find('\n') != std::string::npos) {
      std::abort();
    }
    for (char c : section) {
      if (IsSpace(c) && c != ' ') std::abort();
    }
    for (const auto& [key, value] : properties) {
      if (key.empty() || !Trimmed(key) || key.find('\n') != std::string::npos ||
          key.find('=') != std::string::npos) {
        std::abort();
      }
      // A top-level key (no '.', so not a nested "parent.sub") is lower-cased.
      if (key.find('.') == std::string::npos) {
        for (char c : key) {
          if (c >= 'A' && c <= 'Z') std::abort();
        }
        if (value.empty()) std::abort();  // an empty value opens a nested section instead
      }
      // Values are trimmed, line by line for a multi-line value.
      size_t begin = 0;
      while (true) {
        const size_t eol = value.find('\n', begin);
        const std::string_view line = std::string_view(value).substr(begin, eol - begin);
        if (!Trimmed(line) || (eol != std::string::npos && line.empty() && begin > 0)) {
          std::abort();
        }
        if (eol == std::string::npos) break;
        begin = eol + 1;
      }
    }
  }
  return 0;
}

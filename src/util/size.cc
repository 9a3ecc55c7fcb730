// Byte sizes: parsing and formatting (tensorferry/size.h).
#include "tensorferry/size.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <string>

namespace tensorferry {

std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1000) return std::to_string(bytes) + " B";
  static constexpr const char* kUnits[] = {"KB", "MB", "GB", "TB", "PB", "EB"};
  double v = static_cast<double>(bytes) / 1000.0;
  size_t unit = 0;
  // Switch unit where the rounded value would print as 1000.00.
  while (v >= 999.995 && unit + 1 < std::size(kUnits)) {
    v /= 1000.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[unit]);
  return buf;
}

std::optional<uint64_t> ParseSize(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  const std::string number(text.substr(0, i));
  if (number.empty() || number == "." || number.find('.') != number.rfind('.')) return std::nullopt;
  std::string suffix;
  for (char c : text.substr(i)) {
    if (c == ' ') continue;
    suffix.push_back(static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c));
  }
  uint64_t base = 1;
  unsigned power = 0;
  if (!suffix.empty() && suffix != "B") {
    static constexpr std::string_view kPrefixes = "KMGTPE";
    const size_t p = kPrefixes.find(suffix[0]);
    if (p == std::string_view::npos) return std::nullopt;
    std::string_view rest = std::string_view(suffix).substr(1);
    const bool binary = !rest.empty() && rest[0] == 'I';
    if (binary) rest.remove_prefix(1);
    if (!rest.empty() && rest != "B") return std::nullopt;
    base = binary ? 1024 : 1000;
    power = static_cast<unsigned>(p + 1);
  }
  if (number.find('.') == std::string::npos) {
    // Integral sizes are computed exactly, up to UINT64_MAX.
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
    if (ec != std::errc() || end != number.data() + number.size()) return std::nullopt;
    for (unsigned k = 0; k < power; ++k) {
      if (v > UINT64_MAX / base) return std::nullopt;
      v *= base;
    }
    return v;
  }
  // A fractional one ("1.5GB") is rounded.
  const double value = std::strtod(number.c_str(), nullptr) *
                       std::pow(static_cast<double>(base), static_cast<double>(power));
  const double rounded = std::round(value);
  if (!std::isfinite(value) || value < 0 || rounded >= 18446744073709551616.0) return std::nullopt;
  // A size that is not zero does not round to nothing ("0.4" bytes is a mistake, not 0).
  if (value > 0 && rounded == 0) return std::nullopt;
  return static_cast<uint64_t>(rounded);
}

}  // namespace tensorferry

// tensorferry/size.h: byte sizes as people write them ("256MB", "1.5GiB") and as we print them.
//
// Pure functions, thread-safe, no allocation beyond the returned string.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tensorferry {

// Parses a size such as "1GB", "512MB", "2GiB", "4096", "1.5G" (case-insensitive; K/M/G/T/P/E with
// or without a trailing B are powers of 1000, KiB/MiB/... powers of 1024, a bare number is bytes;
// spaces before the unit are ignored; a fraction is rounded to the nearest byte). nullopt when it
// is not a size, does not fit 64 bits, or is a fraction of a byte above 0 ("0.4").
std::optional<uint64_t> ParseSize(std::string_view text);

// "4.29 GB", "512.00 KB", "17 B" (decimal units, as disk sizes are usually quoted).
std::string FormatBytes(uint64_t bytes);

}  // namespace tensorferry

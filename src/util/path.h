// Internal: checks of path strings before they reach the operating system.
#pragma once

#include <string>
#include <string_view>

#include "tensorferry/status.h"

namespace tensorferry {

// Ok, or kInvalidArgument when `path` holds a NUL byte: the C library would silently cut the path
// there and open another file (Python's open() refuses such paths with ValueError too). `what`
// names the role in the message ("checkpoint path", "output path").
Status CheckPathString(std::string_view path, std::string_view what = "path");

}  // namespace tensorferry

#include "util/path.h"

#include "util/json_writer.h"

namespace tensorferry {

Status CheckPathString(std::string_view path, std::string_view what) {
  if (const size_t nul = path.find('\0'); nul != std::string_view::npos) {
    return Status(Code::kInvalidArgument, std::string(what) + " " + json::Quote(path) +
                                              " holds a NUL byte at position " +
                                              std::to_string(nul) + ": no file can have that name");
  }
  return Status::Ok();
}

}  // namespace tensorferry

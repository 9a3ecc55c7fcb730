// Internal: loading shared libraries at run time (dlopen): the CUDA runtime, cuFile and libcurl.
//
// tensorferry never links against them: the libraries are found when first needed, so the same
// build runs on machines with and without a GPU (or libcurl). A library, once loaded, is never
// unloaded: the CUDA runtime starts threads and registers exit handlers that must not outlive its
// code.
//
// Thread-safety: all functions may be called from several threads at once (dlopen and dlsym are).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry::dynlib {

struct LoadedLibrary {
  void* handle = nullptr;  // from dlopen; never closed
  std::string name;        // the candidate that loaded, as given
  std::string path;        // the file the dynamic linker actually mapped (absolute when known)
};

// Tries each candidate in order with dlopen(RTLD_NOW | RTLD_LOCAL); the first that loads wins.
// A candidate is a file name searched by the dynamic linker ("libcudart.so.13") or a path.
// Errors: `not_found` ("<what> not found; tried: <candidate> (<dlerror>), ...").
Result<LoadedLibrary> OpenFirst(const std::vector<std::string>& candidates, std::string_view what,
                                Code not_found);

// The first candidate already loaded into the process (dlopen with RTLD_NOLOAD), e.g. a runtime
// that torch brought in; nullopt when none is.
std::optional<LoadedLibrary> FindLoaded(const std::vector<std::string>& candidates);

// The library a CUDA component uses: unless `exclusive` (the user named one file), the first of
// `names` the process already has (a runtime torch loaded, say), else OpenFirst(candidates).
Result<LoadedLibrary> FindOrOpen(const std::vector<std::string>& names,
                                 const std::vector<std::string>& candidates, bool exclusive,
                                 std::string_view what, Code not_found);

// The address of `symbol` in `library`, or nullptr.
void* FindSymbol(const LoadedLibrary& library, const char* symbol);

// Resolves `symbol` into the function pointer `out`.
// Errors: `missing` ("<path>: missing symbol <symbol>").
template <typename Fn>
Status Resolve(const LoadedLibrary& library, const char* symbol, Fn*& out,
               Code missing = Code::kCudaSymbolMissing) {
  out = reinterpret_cast<Fn*>(FindSymbol(library, symbol));
  if (out != nullptr) return Status::Ok();
  return Status(missing, library.path + ": missing symbol " + symbol);
}

}  // namespace tensorferry::dynlib

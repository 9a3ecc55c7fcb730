#include "util/dynamic_library.h"

#include <dlfcn.h>
#include <link.h>

namespace tensorferry::dynlib {

namespace {

LoadedLibrary Describe(void* handle, const std::string& candidate) {
  LoadedLibrary library{handle, candidate, candidate};
  struct link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    library.path = map->l_name;
  }
  return library;
}

}  // namespace

std::optional<LoadedLibrary> FindLoaded(const std::vector<std::string>& candidates) {
  for (const std::string& candidate : candidates) {
    if (candidate.empty()) continue;
    void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle != nullptr) return Describe(handle, candidate);
  }
  return std::nullopt;
}

Result<LoadedLibrary> OpenFirst(const std::vector<std::string>& candidates, std::string_view what,
                                Code not_found) {
  std::string tried;
  for (const std::string& candidate : candidates) {
    if (candidate.empty()) continue;
    void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) return Describe(handle, candidate);
    const char* error = ::dlerror();
    if (!tried.empty()) tried += "; ";
    tried += candidate;
    tried += " (";
    tried += error != nullptr ? error : "unknown dlopen error";
    tried += ")";
  }
  if (tried.empty()) tried = "no candidates";
  return Status(not_found, std::string(what) + " not found; tried: " + tried);
}

Result<LoadedLibrary> FindOrOpen(const std::vector<std::string>& names,
                                 const std::vector<std::string>& candidates, bool exclusive,
                                 std::string_view what, Code not_found) {
  if (!exclusive) {
    if (std::optional<LoadedLibrary> loaded = FindLoaded(names)) return *std::move(loaded);
  }
  return OpenFirst(candidates, what, not_found);
}

void* FindSymbol(const LoadedLibrary& library, const char* symbol) {
  if (library.handle == nullptr) return nullptr;
  return ::dlsym(library.handle, symbol);
}

}  // namespace tensorferry::dynlib

// The Hugging Face hub cache's layout and the hub's environment (hub_cache.h).
#include "objstore/hub_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>
#include <vector>

#include "tensorferry/hub.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;

std::optional<std::string> Getenv(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// Python's os.path.expanduser for "~" and "~/..." (not "~user").
std::string ExpandUser(const std::string& path) {
  if (path.empty() || path[0] != '~' || (path.size() > 1 && path[1] != '/')) return path;
  const std::optional<std::string> home = Getenv("HOME");
  return home ? *home + path.substr(1) : path;
}

// Python's os.path.expandvars: $NAME and ${NAME} replaced when NAME is set, else left as written.
std::string ExpandVars(const std::string& path) {
  std::string out;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] != '$') {
      out.push_back(path[i++]);
      continue;
    }
    const bool braced = i + 1 < path.size() && path[i + 1] == '{';
    size_t begin = i + (braced ? 2 : 1);
    size_t end = begin;
    if (braced) {
      end = path.find('}', begin);
      if (end == std::string::npos) {
        out += path.substr(i);
        break;
      }
    } else {
      while (end < path.size() &&
             (std::isalnum(static_cast<unsigned char>(path[end])) || path[end] == '_')) {
        ++end;
      }
    }
    const std::string name = path.substr(begin, end - begin);
    const size_t next = end + (braced ? 1 : 0);
    const std::optional<std::string> value = name.empty() ? std::nullopt : Getenv(name.c_str());
    out += value ? *value : path.substr(i, next - i);
    i = next;
  }
  return out;
}

std::string Expand(const std::string& path) {
  return ExpandVars(ExpandUser(path));
}

int Hex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool IsControl(char c) {
  const auto b = static_cast<unsigned char>(c);
  return b < 0x20 || b == 0x7f;
}

// %XX decoded; nullopt for a malformed escape or a control character (raw or decoded).
std::optional<std::string> PercentDecode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '%') {
      if (i + 2 >= s.size() || Hex(s[i + 1]) < 0 || Hex(s[i + 2]) < 0) return std::nullopt;
      c = static_cast<char>(Hex(s[i + 1]) * 16 + Hex(s[i + 2]));
      i += 2;
    }
    if (IsControl(c)) return std::nullopt;
    out.push_back(c);
  }
  return out;
}

// `target` written as `path` atomically: into a sibling first, then renamed over it (by `make`,
// which creates the sibling: a link or a file). Errors name `path`.
template <class Make>
Status ReplaceAtomically(const fs::path& path, const char* what, Make make) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) {
    return Status(Code::kIoError, "cannot create the folder of " + std::string(what) + " " +
                                      path.string() + ": " + ec.message());
  }
  static std::atomic<uint64_t> serial{0};
  const std::string aside = path.string() + ".tensorferry." + std::to_string(::getpid()) + "." +
                            std::to_string(serial.fetch_add(1));
  if (const int e = make(aside); e != 0) {
    ::unlink(aside.c_str());
    return Status(Code::kIoError, "cannot write " + std::string(what) + " " + path.string() + ": " +
                                      std::strerror(e));
  }
  if (::rename(aside.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(aside.c_str());
    return Status(Code::kIoError, "cannot write " + std::string(what) + " " + path.string() + ": " +
                                      std::strerror(e));
  }
  return Status::Ok();
}

}  // namespace

std::string HubCacheDir() {
  if (std::optional<std::string> v = Getenv("HF_HUB_CACHE")) return Expand(*v);
  if (std::optional<std::string> v = Getenv("HUGGINGFACE_HUB_CACHE")) return Expand(*v);
  std::string home;
  if (std::optional<std::string> v = Getenv("HF_HOME")) {
    home = Expand(*v);
  } else {
    const std::optional<std::string> xdg = Getenv("XDG_CACHE_HOME");
    home = Expand((xdg ? *xdg : ExpandUser("~") + "/.cache") + "/huggingface");
  }
  return (fs::path(home) / "hub").string();
}

std::string HubEndpoint() {
  std::string endpoint = Getenv("HF_ENDPOINT").value_or("");
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  return endpoint.empty() ? "https://huggingface.co" : endpoint;
}

bool HubOffline() {
  // huggingface_hub.constants: HF_HUB_OFFLINE, else TRANSFORMERS_OFFLINE, true when its upper-case
  // value is one of 1, ON, YES, TRUE.
  std::optional<std::string> v = Getenv("HF_HUB_OFFLINE");
  if (!v || v->empty()) v = Getenv("TRANSFORMERS_OFFLINE");
  if (!v) return false;
  std::string upper;
  for (char c : *v) upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  return upper == "1" || upper == "ON" || upper == "YES" || upper == "TRUE";
}

namespace objstore {

bool IsHubCommit(std::string_view s) {
  return s.size() == 40 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

bool IsHubIdPart(std::string_view s) {
  if (s.empty() || s.size() > 96) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return s.find("--") == std::string_view::npos && s.find("..") == std::string_view::npos &&
         s.front() != '-' && s.front() != '.';
}

std::vector<std::string_view> SplitHubPath(std::string_view s) {
  std::vector<std::string_view> parts;
  size_t begin = 0;
  while (true) {
    const size_t slash = s.find('/', begin);
    parts.push_back(s.substr(begin, slash == std::string_view::npos ? slash : slash - begin));
    if (slash == std::string_view::npos) return parts;
    begin = slash + 1;
  }
}

bool IsSafeRelative(std::string_view s) {
  for (std::string_view part : SplitHubPath(s)) {
    if (part.empty() || part == "." || part == "..") return false;
  }
  return true;
}

std::optional<HubFile> HubFileOfUrl(std::string_view url) {
  const std::string endpoint = HubEndpoint() + "/";
  if (url.size() <= endpoint.size() || url.substr(0, endpoint.size()) != endpoint) {
    return std::nullopt;
  }
  std::string_view rest = url.substr(endpoint.size());
  if (rest.find_first_of("?# ") != std::string_view::npos ||
      std::any_of(rest.begin(), rest.end(), IsControl)) {
    return std::nullopt;
  }
  HubFile file;
  std::string type = "models";
  for (std::string_view t : {"datasets", "spaces"}) {
    if (rest.size() > t.size() && rest.substr(0, t.size()) == t && rest[t.size()] == '/') {
      type = std::string(t);
      rest.remove_prefix(t.size() + 1);
      break;
    }
  }
  const std::vector<std::string_view> parts = SplitHubPath(rest);
  // REPO is one or two parts, then "resolve", REVISION and at least one part of PATH.
  for (size_t n : {size_t{2}, size_t{1}}) {
    if (parts.size() < n + 3 || parts[n] != "resolve") continue;
    file.folder = type;
    bool ok = true;
    for (size_t i = 0; i < n; ++i) {
      ok = ok && IsHubIdPart(parts[i]);
      file.folder += "--";
      file.folder += parts[i];
    }
    std::optional<std::string> revision = PercentDecode(parts[n + 1]);
    std::string path;
    for (size_t i = n + 2; i < parts.size(); ++i) {
      if (!path.empty()) path += '/';
      path += parts[i];
    }
    std::optional<std::string> decoded = PercentDecode(path);
    if (!ok || !revision || !decoded || revision->empty() || !IsSafeRelative(*revision) ||
        decoded->empty() || !IsSafeRelative(*decoded)) {
      return std::nullopt;
    }
    file.revision = std::move(*revision);
    file.path = std::move(*decoded);
    return file;
  }
  return std::nullopt;
}

std::string HubBlobName(std::string_view linked_etag, std::string_view etag) {
  std::string_view name = linked_etag.empty() ? etag : linked_etag;
  if (name.substr(0, 2) == "W/") name.remove_prefix(2);
  while (!name.empty() && name.front() == '"') name.remove_prefix(1);
  while (!name.empty() && name.back() == '"') name.remove_suffix(1);
  if (name.empty() || name.size() > 200 || name.front() == '.') return "";
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return "";
    }
  }
  return std::string(name);
}

Status LinkHubSnapshot(const std::string& root, const std::string& folder,
                       const std::string& commit, const std::string& path,
                       const std::string& blob) {
  // From snapshots/<commit>/<path>'s folder up to the repository's: two, and one per folder of
  // <path>.
  std::string target = "../../";
  for (char c : path) {
    if (c == '/') target += "../";
  }
  target += "blobs/" + blob;
  const fs::path link = fs::path(root) / folder / "snapshots" / commit / path;
  std::error_code ec;
  if (fs::is_symlink(link, ec) && fs::read_symlink(link, ec) == fs::path(target) && !ec) {
    return Status::Ok();  // already there
  }
  return ReplaceAtomically(link, "the hub cache's link", [&](const std::string& aside) {
    return ::symlink(target.c_str(), aside.c_str()) == 0 ? 0 : errno;
  });
}

Status WriteHubRef(const std::string& root, const std::string& folder, const std::string& revision,
                   const std::string& commit) {
  if (revision.empty() || !IsSafeRelative(revision)) {
    return Status(Code::kInvalidArgument,
                  "the revision \"" + revision + "\" cannot name a file under refs/");
  }
  const fs::path ref = fs::path(root) / folder / "refs" / revision;
  return ReplaceAtomically(ref, "the hub cache's ref", [&](const std::string& aside) {
    const int fd = ::open(aside.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return errno;
    // huggingface_hub writes the commit alone, without a newline.
    const ssize_t n = ::write(fd, commit.data(), commit.size());
    const int e = n == static_cast<ssize_t>(commit.size()) ? 0 : (n < 0 ? errno : EIO);
    ::close(fd);
    return e;
  });
}

}  // namespace objstore
}  // namespace tensorferry

// The writers' hidden names and the removal of a dead writer's (see writer_temporaries.h).
#include "util/writer_temporaries.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>

namespace tensorferry::util {
namespace {

// FNV-1a, 32 bits: the machine's (and pid namespace's) token, not a secret.
uint32_t Fnv1a(std::string_view text) {
  uint32_t h = 2166136261u;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 16777619u;
  }
  return h;
}

// 8 lowercase hex digits of a hash of the host name, the machine's identity (/etc/machine-id,
// made at installation: machines of one host name differ by it) and the pid namespace
// ("pid:[4026531836]", the same number on every machine's root namespace, hence the others).
const std::string& MachineToken() {
  static const std::string token = [] {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    char ns[64] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    std::string key(host);
    key += '\n';
    if (std::FILE* f = std::fopen("/etc/machine-id", "re")) {
      char id[64] = {};
      if (std::fgets(id, sizeof id, f) != nullptr) key += id;
      std::fclose(f);
    }
    key += '\n';
    if (n > 0) key.append(ns, static_cast<size_t>(n));
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", Fnv1a(key));
    return std::string(hex);
  }();
  return token;
}

bool IsHex(std::string_view s) {
  for (const char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

std::string WriterTag() {
  return std::to_string(::getpid()) + "@" + MachineToken();
}

std::string HiddenSibling(std::string_view base, std::string_view kind) {
  // Appended piece by piece: GCC 12 warns falsely, -Wrestrict, on "literal" + string.
  std::string out(".");
  out += base.substr(0, kHiddenBaseBytes);
  out += kind;
  out += WriterTag();
  out += '-';
  return out;
}

std::string DeadWritersBase(std::string_view name, std::string_view kind) {
  // ".<base><kind><pid>@<8 hex>-<16 hex>", read from the end.
  constexpr size_t kTail = 1 + 8 + 1 + 16;  // "@<8 hex>-<16 hex>"
  if (name.size() < 1 + kind.size() + 1 + kTail || name[0] != '.') return "";
  const std::string_view tail = name.substr(name.size() - kTail);
  if (tail[0] != '@' || tail[9] != '-' || !IsHex(tail.substr(1, 8)) || !IsHex(tail.substr(10))) {
    return "";
  }
  if (tail.substr(1, 8) != MachineToken()) return "";  // another machine's or container's
  const std::string_view head = name.substr(0, name.size() - kTail);
  size_t digits = 0;
  while (digits < head.size() && digits < 11 && head[head.size() - 1 - digits] >= '0' &&
         head[head.size() - 1 - digits] <= '9') {
    ++digits;
  }
  if (digits == 0 || digits > 10 || head.size() < 1 + kind.size() + digits) return "";
  const std::string_view before = head.substr(0, head.size() - digits);
  if (!before.ends_with(kind)) return "";
  const unsigned long long pid = std::stoull(std::string(head.substr(head.size() - digits)));
  if (pid == 0 || pid > static_cast<unsigned long long>(INT_MAX)) return "";
  // Only ESRCH proves the writer gone (EPERM: a live process of another user).
  if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return "";
  return std::string(before.substr(1, before.size() - 1 - kind.size()));
}

namespace {

// A dead writer's name found in a directory: the name, its kind and its (cut) base.
struct DeadName {
  std::string name;
  std::string_view kind;
  std::string base;
};

// The dead writers' names of each directory this process has looked in, listed once (a write of
// many files into one folder would otherwise list it once per file), kept until removed.
// Names that dead writers leave after that listing are left for the next process.
std::mutex g_dead_mu;
std::map<std::string, std::vector<DeadName>>& DeadNames() {
  static auto* names = new std::map<std::string, std::vector<DeadName>>();  // never destroyed
  return *names;
}

std::vector<DeadName> ListDeadNames(const std::string& dir) {
  std::vector<DeadName> out;
  DIR* d = ::opendir(dir.empty() ? "." : dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (name.empty() || name[0] != '.') continue;
    for (const std::string_view kind : {kTemporaryKind, kBackupKind}) {
      std::string base = DeadWritersBase(name, kind);
      if (base.empty()) continue;
      out.push_back({std::string(name), kind, std::move(base)});
      break;
    }
  }
  ::closedir(d);
  return out;
}

}  // namespace

std::vector<std::string> RemoveDeadWritersFiles(
    const std::string& dir, const std::vector<std::string_view>& kinds,
    const std::function<bool(std::string_view base)>& is_target) {
  std::vector<std::string> removed;
  std::lock_guard<std::mutex> lock(g_dead_mu);
  auto [it, listed_now] = DeadNames().try_emplace(dir);
  if (listed_now) it->second = ListDeadNames(dir);
  std::vector<DeadName>& names = it->second;
  const std::string prefix = dir.empty() ? std::string() : dir + "/";
  for (size_t i = 0; i < names.size();) {
    const DeadName& n = names[i];
    if (std::find(kinds.begin(), kinds.end(), n.kind) == kinds.end() || !is_target(n.base)) {
      ++i;
      continue;
    }
    const std::string path = prefix + n.name;
    if (::unlink(path.c_str()) == 0) removed.push_back(n.name);
    // Removed, gone already, or not removable (kept on disk; not tried again in this process).
    names.erase(names.begin() + static_cast<std::ptrdiff_t>(i));
  }
  return removed;
}

std::vector<std::string> RemoveDeadWritersFiles(const std::string& dir,
                                                const std::vector<std::string>& targets,
                                                const std::vector<std::string_view>& kinds) {
  return RemoveDeadWritersFiles(dir, kinds, [&](std::string_view base) {
    for (const std::string& t : targets) {
      if (std::string_view(t).substr(0, kHiddenBaseBytes) == base) return true;
    }
    return false;
  });
}

}  // namespace tensorferry::util

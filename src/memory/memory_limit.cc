// ReadMemoryLimit: the process's memory cgroup (v1 or v2) and MemAvailable (memory_limit.h).
#include "tensorferry/memory_limit.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

#include "io/filesystem.h"
#include "tensorferry/size.h"
#include "util/decimal.h"

namespace tensorferry {
namespace {

// Limits at or above this are "no limit" (v1 writes PAGE_COUNTER_MAX * page size, ~2^63).
constexpr uint64_t kUnlimited = 1ull << 62;

bool ReadText(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

std::vector<std::string_view> Split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = text.find(sep, start);
    out.push_back(text.substr(start, end == std::string_view::npos ? text.npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\t'))
    s.remove_suffix(1);
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  return s;
}

bool ParseU64(std::string_view s, uint64_t* out) {
  const std::optional<uint64_t> value = ParseDecimal(Trim(s));
  if (value) *out = *value;
  return value.has_value();
}

// A value file: a number, or "max" (v2's no limit: returned as UINT64_MAX).
bool ReadValue(const std::string& path, uint64_t* out) {
  std::string text;
  if (!ReadText(path, &text)) return false;
  if (Trim(text) == "max") {
    *out = UINT64_MAX;
    return true;
  }
  return ParseU64(text, out);
}

// "key value" lines (memory.stat, /proc/meminfo with its "kB").
bool ReadKey(const std::string& text, std::string_view key, uint64_t* out) {
  for (std::string_view line : Split(text, '\n')) {
    if (line.size() <= key.size() || line.substr(0, key.size()) != key) continue;
    std::string_view rest = line.substr(key.size());
    if (rest.front() != ' ' && rest.front() != ':') continue;
    rest = Trim(rest.substr(rest.front() == ':' ? 1 : 0));
    uint64_t scale = 1;
    if (rest.size() > 3 && rest.substr(rest.size() - 3) == " kB") {
      rest.remove_suffix(3);
      scale = 1024;
    }
    uint64_t v = 0;
    if (!ParseU64(rest, &v)) return false;
    *out = v * scale;
    return true;
  }
  return false;
}

struct Mount {
  std::string root;   // the cgroup path mounted there ("/" usually)
  std::string point;  // where
};

// The mount of the v1 hierarchy holding `controller`, or of the v2 hierarchy (controller "").
bool FindMount(const std::string& mountinfo, std::string_view controller, Mount* out) {
  for (std::string_view line : Split(mountinfo, '\n')) {
    const std::optional<io::MountEntry> e = io::ParseMountInfoLine(line);
    if (!e) continue;
    if (controller.empty() ? e->type != "cgroup2" : e->type != "cgroup") continue;
    if (!controller.empty()) {
      const std::vector<std::string_view> opts = Split(Trim(e->super_options), ',');
      if (std::find(opts.begin(), opts.end(), controller) == opts.end()) continue;
    }
    out->root = e->root;
    out->point = e->mount_point;
    return true;
  }
  return false;
}

std::string Parent(const std::string& dir) {
  const size_t slash = dir.find_last_of('/');
  return slash == std::string::npos || slash == 0 ? std::string("/") : dir.substr(0, slash);
}

}  // namespace

uint64_t MemoryLimit::DefaultLoadLimit() const noexcept {
  const uint64_t available = Available();
  if (available == UINT64_MAX) return 0;
  // Nothing left (a cgroup used up) is a limit too: 1 byte, not 0 (which means no check).
  return std::max<uint64_t>(available / 4 * 3, 1);
}

uint64_t MemoryLimit::Available() const noexcept {
  uint64_t available = mem_available > 0 ? mem_available : UINT64_MAX;
  if (cgroup_limit > 0) {
    const uint64_t pinned =
        cgroup_usage > cgroup_reclaimable ? cgroup_usage - cgroup_reclaimable : 0;
    available = std::min(available, cgroup_limit > pinned ? cgroup_limit - pinned : 0);
  }
  return available;
}

std::string MemoryLimit::Describe() const {
  std::string out;
  if (cgroup_limit > 0) {
    out = "memory cgroup " + cgroup_version + " limit " + FormatBytes(cgroup_limit) + " (" +
          cgroup_file + "), " + FormatBytes(cgroup_usage) + " used of which " +
          FormatBytes(cgroup_reclaimable) + " file cache";
  } else if (!cgroup_version.empty()) {
    out = "memory cgroup " + cgroup_version + ": no limit";
  } else {
    out = "no memory cgroup" + (cgroup_error.empty() ? std::string() : " (" + cgroup_error + ")");
  }
  out +=
      mem_available > 0 ? "; MemAvailable " + FormatBytes(mem_available) : "; MemAvailable unknown";
  const uint64_t a = Available();
  out += a == UINT64_MAX ? ": available unknown" : ": " + FormatBytes(a) + " available";
  return out;
}

MemoryLimit ReadMemoryLimit(const std::string& root) {
  MemoryLimit m;
  std::string text;
  if (ReadText(root + "/proc/meminfo", &text)) {
    ReadKey(text, "MemAvailable", &m.mem_available);
    ReadKey(text, "MemTotal", &m.mem_total);
  }
  std::string cgroups;
  if (!ReadText(root + "/proc/self/cgroup", &cgroups)) {
    m.cgroup_error = "cannot read /proc/self/cgroup";
    return m;
  }
  // The v1 memory controller's line when there is one (hybrid hierarchies put memory there),
  // else the v2 line.
  std::string path;
  for (std::string_view line : Split(cgroups, '\n')) {
    const size_t a = line.find(':');
    const size_t b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::vector<std::string_view> controllers = Split(line.substr(a + 1, b - a - 1), ',');
    if (std::find(controllers.begin(), controllers.end(), "memory") != controllers.end()) {
      m.cgroup_version = "v1";
      path = std::string(Trim(line.substr(b + 1)));
      break;
    }
    if (line.substr(0, b + 1) == "0::") {
      m.cgroup_version = "v2";
      path = std::string(Trim(line.substr(b + 1)));
    }
  }
  if (m.cgroup_version.empty()) return m;
  const bool v2 = m.cgroup_version == "v2";
  std::string mountinfo;
  Mount mount;
  if (!ReadText(root + "/proc/self/mountinfo", &mountinfo) ||
      !FindMount(mountinfo, v2 ? "" : "memory", &mount)) {
    m.cgroup_error = "the " + m.cgroup_version + " memory hierarchy is not mounted here";
    m.cgroup_version.clear();
    return m;
  }
  // The cgroup's path below the mount (a container sees its own cgroup as the mount's root).
  std::string rel = path;
  if (mount.root != "/" && rel.compare(0, mount.root.size(), mount.root) == 0) {
    rel = rel.substr(mount.root.size());
  }
  if (rel.empty()) rel = "/";
  const char* limit_name = v2 ? "memory.max" : "memory.limit_in_bytes";
  const char* usage_name = v2 ? "memory.current" : "memory.usage_in_bytes";
  uint64_t best_headroom = UINT64_MAX;
  for (std::string dir = rel;; dir = Parent(dir)) {
    const std::string base = root + mount.point + (dir == "/" ? "" : dir);
    uint64_t limit = 0;
    bool limited = ReadValue(base + "/" + limit_name, &limit) && limit < kUnlimited;
    std::string file = limit_name;
    // v2's memory.high (systemd's MemoryHigh=, Kubernetes' memory QoS) below memory.max: past it
    // the kernel throttles the cgroup hard, so it is the limit a budget must stay under.
    uint64_t high = 0;
    if (v2 && ReadValue(base + "/memory.high", &high) && high < kUnlimited &&
        (!limited || high < limit)) {
      limit = high;
      limited = true;
      file = "memory.high";
    }
    if (limited) {
      uint64_t usage = 0, reclaimable = 0;
      ReadValue(base + "/" + usage_name, &usage);
      std::string stat;
      if (ReadText(base + "/memory.stat", &stat)) {
        // The page cache, less its shared-memory pages (tmpfs, /dev/shm, a memory-backed
        // emptyDir holding a checkpoint): those are charged as cache but cannot be dropped.
        uint64_t shmem = 0;
        if (v2) {
          ReadKey(stat, "file", &reclaimable);
          ReadKey(stat, "shmem", &shmem);
        } else if (ReadKey(stat, "total_cache", &reclaimable)) {
          ReadKey(stat, "total_shmem", &shmem);
        } else {
          ReadKey(stat, "cache", &reclaimable);
          ReadKey(stat, "shmem", &shmem);
        }
        reclaimable -= std::min(shmem, reclaimable);
      }
      reclaimable = std::min(reclaimable, usage);
      const uint64_t pinned = usage - reclaimable;
      const uint64_t headroom = limit > pinned ? limit - pinned : 0;
      if (headroom < best_headroom) {
        best_headroom = headroom;
        m.cgroup_limit = limit;
        m.cgroup_usage = usage;
        m.cgroup_reclaimable = reclaimable;
        m.cgroup_file = mount.point + (dir == "/" ? "" : dir) + "/" + file;
      }
    }
    if (dir == "/") break;
  }
  return m;
}

}  // namespace tensorferry

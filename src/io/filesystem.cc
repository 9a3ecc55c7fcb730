#include "io/filesystem.h"

#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "util/decimal.h"

namespace tensorferry::io {
namespace {

constexpr uint32_t kFuseMagic = 0x65735546;
constexpr uint32_t kOverlayMagic = 0x794c7630;
constexpr int kMaxOverlayDepth = 4;

struct MagicRow {
  uint32_t magic;
  std::string_view type;
  FileSystemClass cls;
};

constexpr MagicRow kMagics[] = {
    // Local: block devices, memory, pseudo file systems.
    {0xEF53, "ext4", FileSystemClass::kLocal},
    {0x58465342, "xfs", FileSystemClass::kLocal},
    {0x9123683E, "btrfs", FileSystemClass::kLocal},
    {0x01021994, "tmpfs", FileSystemClass::kLocal},
    {0x858458f6, "ramfs", FileSystemClass::kLocal},
    {0x958458f6, "hugetlbfs", FileSystemClass::kLocal},
    {0x2fc12fc1, "zfs", FileSystemClass::kLocal},
    {0xF2F52010, "f2fs", FileSystemClass::kLocal},
    {0xca451a4e, "bcachefs", FileSystemClass::kLocal},
    {0x3153464a, "jfs", FileSystemClass::kLocal},
    {0x52654973, "reiserfs", FileSystemClass::kLocal},
    {0x73717368, "squashfs", FileSystemClass::kLocal},
    {0xE0F5E1E2, "erofs", FileSystemClass::kLocal},
    {0x7366746e, "ntfs3", FileSystemClass::kLocal},
    {0x4d44, "vfat", FileSystemClass::kLocal},
    {0x2011BAB0, "exfat", FileSystemClass::kLocal},
    {0x9660, "iso9660", FileSystemClass::kLocal},
    {0x9fa0, "proc", FileSystemClass::kLocal},
    {0x62656572, "sysfs", FileSystemClass::kLocal},
    {kOverlayMagic, "overlay", FileSystemClass::kLocal},  // refined from its layers
    // Network and cluster file systems.
    {0x6969, "nfs", FileSystemClass::kNetwork},
    {0x517B, "smb", FileSystemClass::kNetwork},
    {0xFF534D42, "cifs", FileSystemClass::kNetwork},
    {0xFE534D42, "smb2", FileSystemClass::kNetwork},
    {0x0BD00BD0, "lustre", FileSystemClass::kNetwork},
    {0x47504653, "gpfs", FileSystemClass::kNetwork},
    {0x00C36400, "ceph", FileSystemClass::kNetwork},
    {0x01021997, "9p", FileSystemClass::kNetwork},
    {0x5346414F, "afs", FileSystemClass::kNetwork},
    {0x6B414653, "afs", FileSystemClass::kNetwork},
    {0x19830326, "beegfs", FileSystemClass::kNetwork},
    {0xAAD7AAEA, "panfs", FileSystemClass::kNetwork},
    {0x20030528, "orangefs", FileSystemClass::kNetwork},
    {0x73757245, "coda", FileSystemClass::kNetwork},
    // User space: every page-cache miss is a request to the daemon (sshfs, s3fs, gcsfuse,
    // blobfuse, virtiofs, ...); the mount's type names it.
    {kFuseMagic, "fuse", FileSystemClass::kUserSpace},
};

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// Decodes mountinfo's octal escapes (\040 space, \011 tab, \012 newline, \134 backslash).
std::string Unescape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '3' && s[i + 2] >= '0' &&
        s[i + 2] <= '7' && s[i + 3] >= '0' && s[i + 3] <= '7') {
      out.push_back(
          static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

std::vector<std::string_view> Fields(std::string_view line) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ') ++j;
    if (j > i) out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

std::optional<uint32_t> ParseU32(std::string_view s) {
  const std::optional<uint64_t> v = ParseDecimal(s, UINT32_MAX);
  if (!v) return std::nullopt;
  return static_cast<uint32_t>(*v);
}

// The mountinfo entry of device `dev`; the last one listed wins (a later mount over the same
// device is the one the path sees).
std::optional<MountEntry> MountOf(dev_t dev) {
  std::ifstream in("/proc/self/mountinfo");
  std::optional<MountEntry> found;
  std::string line;
  while (std::getline(in, line)) {
    std::optional<MountEntry> e = ParseMountInfoLine(line);
    if (e && e->major == major(dev) && e->minor == minor(dev)) found = std::move(e);
  }
  return found;
}

Result<FileSystemInfo> Detect(const std::string& path, int depth) {
  struct statfs fs {};
  if (statfs(path.c_str(), &fs) != 0) {
    const int err = errno;
    return Status(Code::kIoError, path + ": statfs: " + std::strerror(err));
  }
  const auto magic = static_cast<uint32_t>(fs.f_type);
  FileSystemInfo info;
  const std::optional<MagicInfo> known = ClassifyMagic(magic);
  if (!known) {
    std::ostringstream hex;
    hex << "0x" << std::hex << magic;
    info.type = hex.str();
    info.cls = FileSystemClass::kUnknown;
    return info;
  }
  info.type = std::string(known->type);
  info.cls = known->cls;
  if (magic != kFuseMagic && magic != kOverlayMagic) return info;
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return info;
  const std::optional<MountEntry> mount = MountOf(st.st_dev);
  if (!mount) return info;
  if (magic == kFuseMagic) {
    if (!mount->type.empty()) info.type = mount->type;  // "fuse.sshfs", "virtiofs", "fuseblk"
    return info;
  }
  // Overlay: as slow as its slowest layer.
  if (depth >= kMaxOverlayDepth) return info;
  std::string layers;
  for (const std::string& dir : OverlayLayers(mount->super_options)) {
    Result<FileSystemInfo> layer = Detect(dir, depth + 1);
    if (!layer.ok()) continue;  // a layer this namespace cannot see
    if (layers.find(layer->type) == std::string::npos) {
      layers += (layers.empty() ? "" : ",") + layer->type;
    }
    if (layer->slow_faults() && !info.slow_faults()) info.cls = layer->cls;
  }
  if (!layers.empty()) info.type = "overlay(" + layers + ")";
  return info;
}

}  // namespace

std::optional<MagicInfo> ClassifyMagic(uint64_t magic) noexcept {
  for (const MagicRow& row : kMagics) {
    if (row.magic == magic) return MagicInfo{row.type, row.cls};
  }
  return std::nullopt;
}

FileSystemClass ClassifyType(std::string_view type) noexcept {
  if (StartsWith(type, "fuse") || type == "virtiofs") return FileSystemClass::kUserSpace;
  static constexpr std::string_view kNetwork[] = {
      "nfs", "nfs4", "cifs",   "smb",   "smb2",     "smb3",  "lustre", "gpfs",  "ceph",
      "9p",  "afs",  "beegfs", "panfs", "orangefs", "pvfs2", "coda",   "ncpfs", "glusterfs"};
  for (std::string_view n : kNetwork) {
    if (type == n) return FileSystemClass::kNetwork;
  }
  for (const MagicRow& row : kMagics) {
    if (row.type == type) return row.cls;
  }
  return FileSystemClass::kUnknown;
}

std::optional<MountEntry> ParseMountInfoLine(std::string_view line) {
  const std::vector<std::string_view> f = Fields(line);
  // id parent major:minor root mount-point options [optional...] - type source super-options
  if (f.size() < 10) return std::nullopt;
  size_t dash = 6;
  while (dash < f.size() && f[dash] != "-") ++dash;
  if (dash + 2 >= f.size()) return std::nullopt;
  const std::string_view dev = f[2];
  const size_t colon = dev.find(':');
  if (colon == std::string_view::npos) return std::nullopt;
  const std::optional<uint32_t> maj = ParseU32(dev.substr(0, colon));
  const std::optional<uint32_t> min = ParseU32(dev.substr(colon + 1));
  if (!maj || !min) return std::nullopt;
  MountEntry e;
  e.major = *maj;
  e.minor = *min;
  e.root = Unescape(f[3]);
  e.mount_point = Unescape(f[4]);
  e.type = Unescape(f[dash + 1]);
  e.source = Unescape(f[dash + 2]);
  if (dash + 3 < f.size()) e.super_options = Unescape(f[dash + 3]);
  return e;
}

std::vector<std::string> OverlayLayers(std::string_view super_options) {
  std::vector<std::string> out;
  // Options are comma-separated; a comma inside a path is escaped by the kernel as "\,".
  size_t i = 0;
  while (i <= super_options.size()) {
    size_t j = i;
    while (j < super_options.size() &&
           !(super_options[j] == ',' && (j == 0 || super_options[j - 1] != '\\')))
      ++j;
    const std::string_view opt = super_options.substr(i, j - i);
    const bool lower = StartsWith(opt, "lowerdir="), upper = StartsWith(opt, "upperdir=");
    if (lower || upper) {
      const std::string_view value = opt.substr(9);
      std::string dir;
      for (size_t k = 0; k < value.size(); ++k) {
        if (value[k] == '\\' && k + 1 < value.size()) {
          dir.push_back(value[++k]);
        } else if (value[k] == ':' && lower) {
          if (!dir.empty()) out.push_back(std::move(dir));
          dir.clear();
        } else {
          dir.push_back(value[k]);
        }
      }
      if (!dir.empty()) out.push_back(std::move(dir));
    }
    i = j + 1;
  }
  return out;
}

Result<FileSystemInfo> DetectFileSystem(const std::string& path) {
  return Detect(path, 0);
}

}  // namespace tensorferry::io

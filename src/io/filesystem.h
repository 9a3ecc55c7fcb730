// Internal: which file system a file lives on, and whether mmap page faults are slow there.
//
// A page fault on a mapped file is one synchronous read of at most the readahead window. On a
// local disk the kernel's readahead hides that; on a network file system (NFS, SMB, Lustre,
// GPFS, Ceph, ...) or a user-space one (FUSE: sshfs, s3fs, gcsfuse, virtiofs, ...) each miss
// waits for a round trip, and a loader that faults its way through a mapping runs at a small
// fraction of what large reads with many in flight get. The loader's automatic engine choice
// (LoadOptions::engine = kAuto, src/loader/loader.cc) asks DetectFileSystem for each file and
// never maps files that live on such a file system.
//
// Detection: statfs(2)'s f_type, and for FUSE and overlay mounts the mount's entry in
// /proc/self/mountinfo (the FUSE subtype, "fuse.sshfs"; the layers of an overlay, each statfs'd
// in turn, so an overlay on top of NFS counts as NFS).
//
// Thread-safety: free functions, reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry::io {

enum class FileSystemClass : uint8_t {
  kLocal,      // a block-device or memory file system (ext4, xfs, btrfs, tmpfs, ...)
  kNetwork,    // NFS, SMB/CIFS, Lustre, GPFS, Ceph, 9p, AFS, BeeGFS, ...
  kUserSpace,  // FUSE (including virtiofs): every page-cache miss is a request to a daemon
  kUnknown,    // an f_type this table does not know: treated as local
};

struct FileSystemInfo {
  std::string type;  // "ext4", "nfs", "fuse.sshfs", "overlay(nfs)", "0x1234abcd" when unknown
  FileSystemClass cls = FileSystemClass::kUnknown;
  // True where mmap page faults are slow (kNetwork, kUserSpace): the automatic engine reads.
  bool slow_faults() const noexcept {
    return cls == FileSystemClass::kNetwork || cls == FileSystemClass::kUserSpace;
  }
};

// The file system `path` lives on. Errors: kIoError naming the path when statfs fails.
Result<FileSystemInfo> DetectFileSystem(const std::string& path);

// What statfs's f_type `magic` says alone: the name and class, or nullopt for a magic the table
// does not know. FUSE (0x65735546) is "fuse", overlay "overlay" (their mounts say more).
struct MagicInfo {
  std::string_view type;
  FileSystemClass cls;
};
std::optional<MagicInfo> ClassifyMagic(uint64_t magic) noexcept;

// The class of a file system type as /proc/self/mountinfo names it ("nfs4", "fuse.sshfs",
// "virtiofs", "ext4"), or kUnknown.
FileSystemClass ClassifyType(std::string_view type) noexcept;

// One line of /proc/self/mountinfo (proc(5)): the fields DetectFileSystem uses, with octal
// escapes (\040 for a space) decoded. nullopt for a line that is not in that format. The one
// mountinfo parser: the memory cgroup's mounts (memory_limit.cc) are found through it too.
struct MountEntry {
  uint32_t major = 0, minor = 0;
  std::string root;  // the directory of the file system mounted there ("/" usually)
  std::string mount_point;
  std::string type;           // "fuse.sshfs", "overlay", ...
  std::string source;         // the mount source ("server:/export", "overlay")
  std::string super_options;  // "rw,lowerdir=/a:/b,upperdir=/c,workdir=/d"
};
std::optional<MountEntry> ParseMountInfoLine(std::string_view line);

// The directories of an overlay mount's layers, from its super options (lowerdir, a
// colon-separated list in which "\:" is a literal colon, and upperdir); empty if none.
std::vector<std::string> OverlayLayers(std::string_view super_options);

}  // namespace tensorferry::io

// tensorferry/memory_limit.h: the host memory this process may actually use.
//
// A container's limit is not the machine's memory: a process that allocates past its memory
// cgroup's limit is OOM-killed, whatever `free` says. ReadMemoryLimit finds the process's memory
// cgroup (cgroup v2: the "0::" line of /proc/self/cgroup; v1: the line naming the "memory"
// controller), where its hierarchy is mounted (/proc/self/mountinfo), and reads the limit of that
// cgroup and of every ancestor up to the mount (v2 memory.max, or memory.high when lower; v1
// memory.limit_in_bytes; the smallest applies) with what each uses (memory.current /
// memory.usage_in_bytes) and how much of that is reclaimable file cache (memory.stat "file" /
// "total_cache", less "shmem" / "total_shmem": tmpfs pages, a checkpoint in /dev/shm, are charged
// as cache but stay). With the machine's MemAvailable (/proc/meminfo) that gives Available(): the
// bytes a load may still allocate.
//
// Used by the loader (a whole load of more tensor bytes than Available() fails before reading,
// naming the limit; a streaming load with no budget gets one from it: loader.h), and by
// `tensorferry doctor`.
//
// Thread-safety: ReadMemoryLimit is reentrant; MemoryLimit is a value.
#pragma once

#include <cstdint>
#include <string>

#include "tensorferry/status.h"

namespace tensorferry {

struct MemoryLimit {
  // The memory cgroup's limit that binds (the smallest headroom over the cgroup and its
  // ancestors); 0 when no cgroup limits memory (or none could be read: `cgroup_error` says why).
  uint64_t cgroup_limit = 0;
  uint64_t cgroup_usage = 0;        // bytes charged to that cgroup now, page cache included
  uint64_t cgroup_reclaimable = 0;  // of them, file cache the kernel can drop (not shmem)
  std::string cgroup_file;          // the limit's file ("/sys/fs/cgroup/.../memory.max")
  std::string cgroup_version;       // "v2", "v1" or "" when no memory cgroup was found
  std::string cgroup_error;         // why the cgroup could not be read ("" when it could)
  uint64_t mem_available = 0;       // /proc/meminfo MemAvailable (0: unknown)
  uint64_t mem_total = 0;           // /proc/meminfo MemTotal (0: unknown)

  // Bytes this process may still allocate: the smaller of MemAvailable and the cgroup's limit
  // minus its unreclaimable usage; UINT64_MAX when neither is known.
  uint64_t Available() const noexcept;
  // One line: "memory cgroup v1 limit 1.00 GiB (/sys/fs/cgroup/memory/x/memory.limit_in_bytes),
  // 210 MiB used; MemAvailable 20.1 GiB: 814 MiB available".
  std::string Describe() const;
  // The host memory a load may fill when LoadOptions::memory_limit is 0 (the default): 3/4 of
  // Available(), at least 1 (a cgroup with nothing left: a whole load fails naming it, a stream
  // gets one tensor per batch); 0 (no check) when that is unknown.
  uint64_t DefaultLoadLimit() const noexcept;
};

// Reads the limits as the file comment says. `root` prefixes every path read ("" for this
// machine; tests pass a directory laid out like / with fake proc and sys files). Never fails:
// what cannot be read is left 0 and explained in cgroup_error.
MemoryLimit ReadMemoryLimit(const std::string& root = "");

}  // namespace tensorferry

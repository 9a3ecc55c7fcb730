#include "tensorferry/memory_limit.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::TempDir;

// A fake machine under a directory: /proc files and cgroup trees as the kernel lays them out.
class FakeRoot {
 public:
  void Write(const std::string& path, const std::string& text) {
    const std::string full = dir_.path() + path;
    std::filesystem::create_directories(std::filesystem::path(full).parent_path());
    testing::WriteBytes(full, text);
  }
  const std::string& path() const { return dir_.path(); }

 private:
  TempDir dir_;
};

constexpr char kMeminfo[] =
    "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n";

TEST(MemoryLimit, CgroupV1LimitOfTheProcessCgroup) {
  FakeRoot r;
  r.Write("/proc/meminfo", kMeminfo);
  r.Write("/proc/self/cgroup", "5:devices:/\n4:memory:/jobs/a\n0::/\n");
  r.Write("/proc/self/mountinfo",
          "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
          "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
          "36 31 0:33 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n");
  r.Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  r.Write("/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes", "9223372036854771712\n");
  r.Write("/sys/fs/cgroup/memory/jobs/a/memory.limit_in_bytes", "1073741824\n");
  r.Write("/sys/fs/cgroup/memory/jobs/a/memory.usage_in_bytes", "314572800\n");
  r.Write("/sys/fs/cgroup/memory/jobs/a/memory.stat",
          "cache 1\nrss 2\ntotal_cache 209715200\ntotal_rss 104857600\n");
  const MemoryLimit m = ReadMemoryLimit(r.path());
  EXPECT_EQ(m.cgroup_version, "v1");
  EXPECT_EQ(m.cgroup_limit, 1073741824u);
  EXPECT_EQ(m.cgroup_usage, 314572800u);
  EXPECT_EQ(m.cgroup_reclaimable, 209715200u);
  EXPECT_EQ(m.cgroup_file, "/sys/fs/cgroup/memory/jobs/a/memory.limit_in_bytes");
  EXPECT_EQ(m.mem_available, 20000000ull * 1024);
  EXPECT_EQ(m.mem_total, 24000000ull * 1024);
  // 1 GiB less the 100 MiB that cannot be reclaimed.
  EXPECT_EQ(m.Available(), 1073741824u - 104857600u);
  EXPECT_NE(m.Describe().find("limit 1"), std::string::npos) << m.Describe();
  EXPECT_NE(m.Describe().find("memory.limit_in_bytes"), std::string::npos) << m.Describe();
}

TEST(MemoryLimit, CgroupV2TheTightestAncestorBinds) {
  FakeRoot r;
  r.Write("/proc/meminfo", kMeminfo);
  r.Write("/proc/self/cgroup", "0::/pod/ctr\n");
  r.Write("/proc/self/mountinfo", "40 30 0:40 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  r.Write("/sys/fs/cgroup/pod/memory.max", "536870912\n");  // 512 MiB for the pod
  r.Write("/sys/fs/cgroup/pod/memory.current", "104857600\n");
  r.Write("/sys/fs/cgroup/pod/memory.stat", "anon 52428800\nfile 52428800\n");
  r.Write("/sys/fs/cgroup/pod/ctr/memory.max", "max\n");
  r.Write("/sys/fs/cgroup/pod/ctr/memory.current", "10\n");
  const MemoryLimit m = ReadMemoryLimit(r.path());
  EXPECT_EQ(m.cgroup_version, "v2");
  EXPECT_EQ(m.cgroup_limit, 536870912u);
  EXPECT_EQ(m.cgroup_file, "/sys/fs/cgroup/pod/memory.max");
  EXPECT_EQ(m.Available(), 536870912u - 52428800u);
  // memory.high below memory.max (systemd's MemoryHigh=, Kubernetes' memory QoS): past it the
  // kernel throttles, so it binds (it was not read).
  r.Write("/sys/fs/cgroup/pod/ctr/memory.high", "268435456\n");  // 256 MiB
  const MemoryLimit high = ReadMemoryLimit(r.path());
  EXPECT_EQ(high.cgroup_limit, 268435456u);
  EXPECT_EQ(high.cgroup_file, "/sys/fs/cgroup/pod/ctr/memory.high");
  r.Write("/sys/fs/cgroup/pod/ctr/memory.high", "max\n");
  EXPECT_EQ(ReadMemoryLimit(r.path()).cgroup_file, "/sys/fs/cgroup/pod/memory.max");
}

// Shared-memory pages (a checkpoint in /dev/shm or a memory-backed emptyDir) are charged as page
// cache but cannot be dropped: not counted as reclaimable, v2 and v1.
TEST(MemoryLimit, ShmemIsNotReclaimable) {
  for (const bool v2 : {true, false}) {
    FakeRoot r;
    r.Write("/proc/meminfo", kMeminfo);
    if (v2) {
      r.Write("/proc/self/cgroup", "0::/pod\n");
      r.Write("/proc/self/mountinfo", "40 30 0:40 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
      r.Write("/sys/fs/cgroup/pod/memory.max", "8589934592\n");
      r.Write("/sys/fs/cgroup/pod/memory.current", "7516192768\n");
      r.Write("/sys/fs/cgroup/pod/memory.stat",
              "anon 536870912\nfile 6979321856\nshmem 6442450944\n");
    } else {
      r.Write("/proc/self/cgroup", "4:memory:/pod\n");
      r.Write("/proc/self/mountinfo",
              "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n");
      r.Write("/sys/fs/cgroup/memory/pod/memory.limit_in_bytes", "8589934592\n");
      r.Write("/sys/fs/cgroup/memory/pod/memory.usage_in_bytes", "7516192768\n");
      r.Write("/sys/fs/cgroup/memory/pod/memory.stat",
              "total_cache 6979321856\ntotal_rss 536870912\ntotal_shmem 6442450944\n");
    }
    const MemoryLimit m = ReadMemoryLimit(r.path());
    EXPECT_EQ(m.cgroup_reclaimable, 6979321856u - 6442450944u) << v2;
    // 8 GiB less the anonymous and shared pages: 1.5 GiB, not the 7.5 GB it once reported.
    EXPECT_EQ(m.Available(), 8589934592u - (7516192768u - (6979321856u - 6442450944u))) << v2;
  }
}

TEST(MemoryLimit, CgroupV2NamespacedContainerSeesItsCgroupAsTheRoot) {
  FakeRoot r;
  r.Write("/proc/meminfo", "MemAvailable: 1000 kB\n");  // the machine is tighter than the cgroup
  r.Write("/proc/self/cgroup", "0::/\n");
  r.Write("/proc/self/mountinfo",
          "40 30 0:40 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw,nsdelegate\n");
  r.Write("/sys/fs/cgroup/memory.max", "2147483648\n");
  r.Write("/sys/fs/cgroup/memory.current", "0\n");
  const MemoryLimit m = ReadMemoryLimit(r.path());
  EXPECT_EQ(m.cgroup_limit, 2147483648u);
  EXPECT_EQ(m.cgroup_file, "/sys/fs/cgroup/memory.max");
  EXPECT_EQ(m.Available(), 1000u * 1024);
}

TEST(MemoryLimit, NoLimitAndNothingReadable) {
  FakeRoot r;
  r.Write("/proc/meminfo", kMeminfo);
  r.Write("/proc/self/cgroup", "0::/user.slice\n");
  r.Write("/proc/self/mountinfo", "40 30 0:40 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  r.Write("/sys/fs/cgroup/user.slice/memory.max", "max\n");
  MemoryLimit m = ReadMemoryLimit(r.path());
  EXPECT_EQ(m.cgroup_version, "v2");
  EXPECT_EQ(m.cgroup_limit, 0u);
  EXPECT_EQ(m.Available(), 20000000ull * 1024);
  EXPECT_NE(m.Describe().find("no limit"), std::string::npos) << m.Describe();

  FakeRoot empty;
  m = ReadMemoryLimit(empty.path());
  EXPECT_EQ(m.cgroup_limit, 0u);
  EXPECT_EQ(m.mem_available, 0u);
  EXPECT_EQ(m.Available(), UINT64_MAX);
  EXPECT_FALSE(m.cgroup_error.empty());

  FakeRoot unmounted;  // a v1 memory line but no such mount
  unmounted.Write("/proc/self/cgroup", "4:memory:/x\n");
  unmounted.Write("/proc/self/mountinfo", "1 0 0:1 / / rw - ext4 /dev/vda rw\n");
  m = ReadMemoryLimit(unmounted.path());
  EXPECT_EQ(m.cgroup_limit, 0u);
  EXPECT_NE(m.cgroup_error.find("not mounted"), std::string::npos) << m.cgroup_error;
}

TEST(MemoryLimit, UsageAboveTheLimitLeavesNothing) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "4:memory:/\n");
  r.Write("/proc/self/mountinfo",
          "35 31 0:32 / /sys/fs/cgroup/mem\\040ory rw - cgroup cgroup rw,memory\n");
  r.Write("/sys/fs/cgroup/mem ory/memory.limit_in_bytes", "1000\n");
  r.Write("/sys/fs/cgroup/mem ory/memory.usage_in_bytes", "5000\n");
  const MemoryLimit m = ReadMemoryLimit(r.path());
  EXPECT_EQ(m.cgroup_limit, 1000u);
  EXPECT_EQ(m.Available(), 0u);
  // Still a limit (0 would mean none: no check at all).
  EXPECT_EQ(m.DefaultLoadLimit(), 1u);
}

TEST(MemoryLimit, ThisMachineReadsWithoutErrors) {
  const MemoryLimit m = ReadMemoryLimit();
  EXPECT_GT(m.mem_total, 0u);
  EXPECT_GT(m.mem_available, 0u);
  EXPECT_LE(m.Available(), m.mem_available);
}

}  // namespace
}  // namespace tensorferry

#include "io/filesystem.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "testing/test_util.h"

namespace tensorferry::io {
namespace {

TEST(FileSystem, ClassifyMagic) {
  EXPECT_EQ(ClassifyMagic(0xEF53)->type, "ext4");
  EXPECT_EQ(ClassifyMagic(0xEF53)->cls, FileSystemClass::kLocal);
  EXPECT_EQ(ClassifyMagic(0x6969)->type, "nfs");
  EXPECT_EQ(ClassifyMagic(0x6969)->cls, FileSystemClass::kNetwork);
  EXPECT_EQ(ClassifyMagic(0xFF534D42)->type, "cifs");
  EXPECT_EQ(ClassifyMagic(0xFE534D42)->cls, FileSystemClass::kNetwork);
  EXPECT_EQ(ClassifyMagic(0x0BD00BD0)->type, "lustre");
  EXPECT_EQ(ClassifyMagic(0x47504653)->type, "gpfs");
  EXPECT_EQ(ClassifyMagic(0x00C36400)->type, "ceph");
  EXPECT_EQ(ClassifyMagic(0x01021997)->type, "9p");
  EXPECT_EQ(ClassifyMagic(0x65735546)->cls, FileSystemClass::kUserSpace);
  EXPECT_EQ(ClassifyMagic(0x794c7630)->type, "overlay");
  EXPECT_FALSE(ClassifyMagic(0x12345678).has_value());
}

TEST(FileSystem, ClassifyType) {
  EXPECT_EQ(ClassifyType("fuse.sshfs"), FileSystemClass::kUserSpace);
  EXPECT_EQ(ClassifyType("fuseblk"), FileSystemClass::kUserSpace);
  EXPECT_EQ(ClassifyType("virtiofs"), FileSystemClass::kUserSpace);
  EXPECT_EQ(ClassifyType("nfs4"), FileSystemClass::kNetwork);
  EXPECT_EQ(ClassifyType("smb3"), FileSystemClass::kNetwork);
  EXPECT_EQ(ClassifyType("xfs"), FileSystemClass::kLocal);
  EXPECT_EQ(ClassifyType("somethingelse"), FileSystemClass::kUnknown);
}

TEST(FileSystem, ParseMountInfoLine) {
  auto e = ParseMountInfoLine(
      "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 shared:2 - fuse.sshfs "
      "user@host:/data rw,user_id=0,group_id=0");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->major, 98u);
  EXPECT_EQ(e->minor, 0u);
  EXPECT_EQ(e->mount_point, "/mnt/with space");
  EXPECT_EQ(e->type, "fuse.sshfs");
  EXPECT_EQ(e->source, "user@host:/data");
  EXPECT_EQ(e->super_options, "rw,user_id=0,group_id=0");
  // No optional fields.
  e = ParseMountInfoLine("25 1 0:23 / /proc rw,nosuid - proc proc rw");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, "proc");
  EXPECT_EQ(e->minor, 23u);
  // Not mountinfo: no separator, too few fields, a bad device number.
  EXPECT_FALSE(ParseMountInfoLine("").has_value());
  EXPECT_FALSE(ParseMountInfoLine("1 2 3").has_value());
  EXPECT_FALSE(ParseMountInfoLine("25 1 0:23 / /proc rw a b c d e f g").has_value());
  EXPECT_FALSE(ParseMountInfoLine("25 1 0x23 / /proc rw,nosuid - proc proc rw").has_value());
  EXPECT_FALSE(ParseMountInfoLine("25 1 0:99999999999 / /p rw - proc proc rw").has_value());
  // A trailing escape that is not one is kept as is.
  e = ParseMountInfoLine("25 1 0:23 / /a\\04 rw - proc proc rw");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->mount_point, "/a\\04");
}

TEST(FileSystem, OverlayLayers) {
  EXPECT_EQ(OverlayLayers("rw,lowerdir=/l1:/l2,upperdir=/u,workdir=/w"),
            (std::vector<std::string>{"/l1", "/l2", "/u"}));
  EXPECT_EQ(OverlayLayers("ro,lowerdir=/a\\:b:/c"), (std::vector<std::string>{"/a:b", "/c"}));
  EXPECT_TRUE(OverlayLayers("rw,relatime").empty());
  EXPECT_TRUE(OverlayLayers("").empty());
  EXPECT_TRUE(OverlayLayers("lowerdir=").empty());
}

TEST(FileSystem, DetectsRealFileSystems) {
  auto proc = DetectFileSystem("/proc/self");
  ASSERT_TRUE(proc.ok()) << proc.status().ToString();
  EXPECT_EQ(proc->type, "proc");
  EXPECT_FALSE(proc->slow_faults());
  auto shm = DetectFileSystem("/dev/shm");
  if (shm.ok()) {
    EXPECT_EQ(shm->type, "tmpfs");
    EXPECT_EQ(shm->cls, FileSystemClass::kLocal);
  }
  auto missing = DetectFileSystem("/nonexistent/dir/x");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/dir/x: statfs"), std::string::npos)
      << missing.status().ToString();
}

// A path that is a symbolic link is the file it leads to: its file system, not the link's
// directory's (statfs and stat follow the link; the mount found for FUSE is the target's device).
TEST(FileSystem, DetectsTheFileASymlinkLeadsTo) {
  testing::ShmTempDir shm;
  testing::TempDir dir;
  if (shm.path().empty()) GTEST_SKIP() << "no /dev/shm here";
  const auto target_fs = DetectFileSystem(shm.path());
  const auto link_fs = DetectFileSystem(dir.path());
  ASSERT_TRUE(target_fs.ok() && link_fs.ok());
  if (target_fs->type == link_fs->type) {
    GTEST_SKIP() << "$TMPDIR and /dev/shm are both " << link_fs->type;
  }
  const std::string target = shm.path() + "/model.safetensors";
  testing::WriteBytes(target, "bytes");
  const std::string link = dir.Join("model.safetensors");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  auto found = DetectFileSystem(link);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->type, target_fs->type);
  EXPECT_EQ(found->cls, target_fs->cls);
}

}  // namespace
}  // namespace tensorferry::io

#include "io/filesystem.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

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

}  // namespace
}  // namespace tensorferry::io

// What the io layer tells Loader::Open's automatic engine choice (engine=auto, src/loader/
// loader.cc): the file system of each file (the file itself, through symbolic links), and whether
// the io_uring engine can be made here (not only whether the kernel allows io_uring).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "io/filesystem.h"
#include "io/read_engine.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/loader.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

// One small safetensors file: two F32 tensors.
std::string TinyCheckpoint() {
  return testing::MakeFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
                           24);
}

// A single-file checkpoint given as a symbolic link into another file system (a model cache's
// blob, a FUSE or NFS mount): the load reports, and auto chooses by, the file's file system, not
// the link's directory's.
TEST(EngineChoice, ASymlinkIsClassifiedByTheFileItLeadsTo) {
  testing::ShmTempDir shm;
  testing::TempDir dir;
  if (shm.path().empty()) GTEST_SKIP() << "no /dev/shm here";
  const std::string target_fs = io::DetectFileSystem(shm.path()).value().type;
  const std::string link_fs = io::DetectFileSystem(dir.path()).value().type;
  if (target_fs == link_fs) GTEST_SKIP() << "$TMPDIR and /dev/shm are both " << link_fs;
  const std::string target = shm.path() + "/model.safetensors";
  testing::WriteBytes(target, TinyCheckpoint());
  const std::string link = dir.Join("model.safetensors");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  LoadOptions o;
  o.prefer_mmap = true;
  auto loader = Loader::Open(link, o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  EXPECT_EQ((*loader)->stats().filesystem, target_fs) << "the link's directory is " << link_fs;
  auto tensors = (*loader)->Load();
  ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
  EXPECT_EQ(tensors->size(), 2u);
}

// The kernel allows io_uring (the probe ring), but one ring per worker does not fit the
// descriptor limit (`ulimit -n 40` with 64 threads): auto reads with pread and says why; an
// explicit io_uring still fails.
TEST(EngineChoice, AutoReadsWithPreadWhenTheRingsCannotBeMade) {
#if defined(TF_UNDER_SANITIZER)
  // The sanitizers need descriptors of their own (UBSan's vptr check tests memory through a
  // pipe): with none left they report the objects as invalid.
  GTEST_SKIP() << "sanitizer build: the test leaves the process no spare descriptors";
#endif
  if (!io::IoUringAvailable().ok()) GTEST_SKIP() << io::IoUringAvailable().ToString();
  testing::TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  testing::WriteBytes(path, TinyCheckpoint());
  auto checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  LoadOptions o;
  o.threads = 64;
  o.prefer_mmap = false;
  {
    testing::FewDescriptors few(16);
    ASSERT_TRUE(few.ok());
    auto loader = Loader::Open(*checkpoint, o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    const LoadStats stats = (*loader)->stats();
    EXPECT_EQ(stats.engine, "pread");
    EXPECT_EQ(stats.engine_reason.rfind("io_uring unavailable: io_uring_queue_init(", 0), 0u)
        << stats.engine_reason;
    EXPECT_NE(stats.engine_reason.find("Too many open files (errno 24)"), std::string::npos)
        << stats.engine_reason;
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    EXPECT_EQ(tensors->size(), 2u);

    o.engine = Engine::kIoUring;
    auto explicit_uring = Loader::Open(*checkpoint, o);
    ASSERT_FALSE(explicit_uring.ok());
    EXPECT_EQ(explicit_uring.status().code(), Code::kUnsupported);
    EXPECT_NE(explicit_uring.status().message().find("Too many open files"), std::string::npos)
        << explicit_uring.status().ToString();
  }
  // With descriptors again, auto reads with io_uring (a shortage is not remembered).
  o.engine = Engine::kAuto;
  auto loader = Loader::Open(*checkpoint, o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  EXPECT_EQ((*loader)->stats().engine, "io_uring") << (*loader)->stats().engine_reason;
}

}  // namespace
}  // namespace tensorferry

// What a failed read held, named for its error (read_labels.cc).
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "io/mapped_file.h"
#include "sink/sink.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/mapping.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry::sink {
namespace {

struct LabelledCheckpoint : testing::TestCheckpoint {
  LabelledCheckpoint()
      : TestCheckpoint([](uint64_t i, size_t h) { return static_cast<char>(i + h); }) {
    testing::AddLayeredModel(*this, 2, 1);
    Write(1u << 20);  // one file
  }
};

TEST(ReadLabels, TensorsInNamesWhatARangeHolds) {
  LabelledCheckpoint f;
  auto ckpt = Checkpoint::Open(f.dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const std::vector<TensorInfo>& ts = (*ckpt)->tensors();
  ASSERT_GE(ts.size(), 5u);
  auto q = [](const TensorInfo& t) { return "\"" + t.name + "\""; };
  // One byte inside a tensor, its first and its last byte.
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[1].offset + 1, 1), "tensor " + q(ts[1]));
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[1].offset, 1), "tensor " + q(ts[1]));
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[1].offset + ts[1].size - 1, 1), "tensor " + q(ts[1]));
  // Across a boundary; three; more than three.
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[1].offset + ts[1].size - 1, 2),
            "tensors " + q(ts[1]) + " and " + q(ts[2]));
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[0].offset, ts[2].offset + 1 - ts[0].offset),
            "tensors " + q(ts[0]) + ", " + q(ts[1]) + " and " + q(ts[2]));
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[0].offset, ts[4].offset + 1 - ts[0].offset),
            "tensors " + q(ts[0]) + ", " + q(ts[1]) + ", " + q(ts[2]) + " and 2 more");
  // The header, past the end, another file index, an empty range: nothing.
  EXPECT_EQ(TensorsIn(**ckpt, 0, 0, 8), "");
  EXPECT_EQ(TensorsIn(**ckpt, 0, (*ckpt)->files()[0].file_size, 100), "");
  EXPECT_EQ(TensorsIn(**ckpt, static_cast<uint32_t>((*ckpt)->files().size()), ts[1].offset, 1), "");
  EXPECT_EQ(TensorsIn(**ckpt, 0, ts[1].offset, 0), "");
  // To the end of the address space: no overflow; the empty tensor after the last bytes (the
  // fixture's "model.norm.weight") holds none, so it is not named.
  const TensorInfo* last = nullptr;
  for (const TensorInfo& t : ts) {
    if (t.size > 0) last = &t;
  }
  ASSERT_NE(last, &ts.back()) << "the fixture ends with an empty tensor";
  EXPECT_EQ(TensorsIn(**ckpt, last->file, last->offset, UINT64_MAX), "tensor " + q(*last));
}

// A page of a mapping that read as zeros (the file shrank under it, no lease guarding it): the
// error names the file and what the page held; so does a failed populate of a tensor's range.
TEST(ReadLabels, MappedFaultsNameWhatThePageHeld) {
  SetMappingLeases(false);
  LabelledCheckpoint f;
  auto ckpt = Checkpoint::Open(f.dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const std::string path = (*ckpt)->files()[0].path;
  const std::vector<TensorInfo>& ts = (*ckpt)->tensors();
  const TensorInfo& t = ts[ts.size() / 2];
  auto file = Env::Default()->OpenRandomAccess(path);
  ASSERT_TRUE(file.ok());
  const uint64_t size = *(*file)->Size();
  auto map = io::MappedFile::Map(**file, size);
  SetMappingLeases(true);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_TRUE(MappedFaultError(**ckpt, 0, **map).ok()) << "no fault yet";
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  const Status populate =
      LabelTensors((*map)->Populate(t.offset, t.size), **ckpt, 0, t.offset, t.size);
  ASSERT_FALSE(populate.ok());
  EXPECT_NE(populate.message().find(path), std::string::npos) << populate.ToString();
  EXPECT_NE(populate.message().find("; the read held tensor \"" + t.name + "\""), std::string::npos)
      << populate.ToString();
  // Touch the tensor's first byte: its page reads as zeros and is counted, not a crash.
  ::testing::internal::CaptureStderr();
  const volatile std::byte* p = (*map)->data();
  const std::byte first = p[t.offset];
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(first, std::byte{0});
  ASSERT_GE((*map)->faults(), 1u);
  const Status fault = MappedFaultError(**ckpt, 0, **map);
  EXPECT_EQ(fault.code(), Code::kUnexpectedEof) << fault.ToString();
  EXPECT_NE(fault.message().find(path), std::string::npos) << fault.ToString();
  // The tensors of the faulted page (a page of this small file holds several).
  const std::string held = TensorsIn(**ckpt, 0, (*map)->first_fault_offset(),
                                     static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  ASSERT_NE(held.find('"'), std::string::npos) << held;
  EXPECT_NE(fault.message().find("; the read held " + held), std::string::npos) << fault.ToString();
  (void)CheckMappedFiles();  // this test's fault is reported here, not in a later test
}

}  // namespace
}  // namespace tensorferry::sink

// The mapped sink's mapping tables (MapForViews, GatherMappingOf).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "io/mapped_file.h"
#include "sink/sink.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/mapping.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry::sink {
namespace {

// A mapping with a faulted page holds zeros there for good (the fault handler maps them over the
// page): after the file reads well again (an I/O error gone; here: truncated, then its bytes
// written back), neither table hands that mapping out again, so no later load reads those zeros
// without a fault to say so.
TEST(MappedSink, AFaultedMappingIsMappedAgain) {
  testing::TestCheckpoint f([](uint64_t i, size_t h) { return static_cast<char>(i * 7 + h); });
  testing::AddLayeredModel(f, 2, 1);
  f.Write(1u << 20);  // one file
  auto ckpt = Checkpoint::Open(f.dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const std::string path = (*ckpt)->files()[0].path;
  std::string original;
  {
    std::ifstream in(path, std::ios::binary);
    original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::vector<TensorInfo>& ts = (*ckpt)->tensors();
  ASSERT_GE(ts.size(), 3u);
  const TensorInfo& t = ts[1];
  ASSERT_GT(t.size, 0u);

  SetMappingLeases(false);  // (a lease would keep the pages: no fault)
  std::vector<std::shared_ptr<io::MappedFile>> maps(1), gather_maps(1);
  std::vector<std::unordered_set<uint32_t>> viewed(1);
  SinkContext c;
  c.checkpoint = ckpt->get();
  c.files = (*ckpt)->file_set().get();
  c.maps = &maps;
  c.viewed = &viewed;
  c.gather_maps = &gather_maps;
  PlanBatch first;
  first.tensors.emplace_back().tensor = 0;
  ASSERT_TRUE(MapForViews(c, first).ok());
  auto gathered = GatherMappingOf(c, 0);
  SetMappingLeases(true);
  ASSERT_TRUE(gathered.ok()) << gathered.status().ToString();
  const std::shared_ptr<io::MappedFile> old_views = maps[0], old_gather = gather_maps[0];
  ASSERT_TRUE(old_views && old_gather);

  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  ::testing::internal::CaptureStderr();
  const volatile std::byte* v = old_views->data();
  const volatile std::byte* g = old_gather->data();
  const std::byte from_views = v[t.offset];
  const std::byte from_gather = g[t.offset];
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(from_views, std::byte{0});
  EXPECT_EQ(from_gather, std::byte{0});
  ASSERT_GE(old_views->faults(), 1u);
  ASSERT_GE(old_gather->faults(), 1u);
  (void)CheckMappedFiles();  // this test's faults are reported here, not in a later test

  // The same file (the checkpoint holds it open) reads its bytes again.
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, original.data(), original.size(), 0),
            static_cast<ssize_t>(original.size()));
  ::close(fd);

  PlanBatch second;  // a tensor the faulted mapping gave no view of
  second.tensors.emplace_back().tensor = 1;
  ASSERT_TRUE(MapForViews(c, second).ok());
  auto again = GatherMappingOf(c, 0);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ASSERT_NE(maps[0].get(), old_views.get());
  ASSERT_NE(*again, old_gather.get());
  for (const io::MappedFile* m : std::vector<const io::MappedFile*>{maps[0].get(), *again}) {
    const std::string bytes(reinterpret_cast<const char*>(m->data()) + t.offset, t.size);
    EXPECT_EQ(bytes, original.substr(t.offset, t.size));
    EXPECT_EQ(m->faults(), 0u);
  }
}

}  // namespace
}  // namespace tensorferry::sink

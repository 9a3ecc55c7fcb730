// Transient mappings (MappedFile::Use::kTransient): read-only, no lease, and DropPages takes what
// was copied out of the process again. (The guarded copy-on-write mappings are tested through the
// Loader's mmap engine, src/loader/loader_test.cc "LoaderEngines".)
#include "io/mapped_file.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "tensorferry/env.h"
#include "testing/test_util.h"

namespace tensorferry::io {
namespace {

constexpr uint64_t kPage = 4096;

using testing::MappedRss;

struct MappedFileFixture {
  testing::TempDir dir;
  std::string path = dir.Join("data.bin");
  std::string bytes;
  std::unique_ptr<RandomAccessFile> file;

  explicit MappedFileFixture(uint64_t size) {
    bytes.resize(size);
    for (uint64_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 131 + i / 4096) & 0xff);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(size));
    file = Env::Default()->OpenRandomAccess(path).value();
  }
  // Touches every page of `map` and checks its bytes are the file's.
  void ReadAll(const MappedFile& map) const {
    ASSERT_EQ(map.size(), bytes.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(map.data()), map.size()), bytes);
  }
};

TEST(MappedFileTransient, DropPagesTakesWholePagesOutOfTheProcessAndTheBytesStay) {
  MappedFileFixture f(64 * kPage);
  auto map = MappedFile::Map(*f.file, f.bytes.size(), MappedFile::Use::kTransient);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  const MappedFile& m = **map;
  EXPECT_FALSE(m.leased()) << "nothing handed out: no lease";
  f.ReadAll(m);
  EXPECT_EQ(MappedRss(m.data()), 64 * kPage);
  // A range that is not page aligned: only the whole pages inside it go (pages 2..9 of
  // [100 + 1 page, 100 + 10 pages)).
  m.DropPages(kPage + 100, 9 * kPage);
  EXPECT_EQ(MappedRss(m.data()), 56 * kPage);
  m.DropPages(0, f.bytes.size());
  EXPECT_EQ(MappedRss(m.data()), 0u);
  m.DropPages(f.bytes.size(), kPage);  // past the end: nothing
  // Touched again, the pages come back from the page cache with the file's bytes.
  f.ReadAll(m);
  EXPECT_EQ(MappedRss(m.data()), 64 * kPage);
  EXPECT_EQ(m.faults(), 0u);
}

TEST(MappedFileTransient, ViewMappingsKeepTheirPages) {
  MappedFileFixture f(16 * kPage);
  auto map = MappedFile::Map(*f.file, f.bytes.size());  // kViews: the caller's tensors
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  f.ReadAll(**map);
  (*map)->DropPages(0, f.bytes.size());
  EXPECT_EQ(MappedRss((*map)->data()), 16 * kPage) << "views' pages are never dropped";
}

}  // namespace
}  // namespace tensorferry::io

#include "convert/zip_reader.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "testing/test_util.h"
#include "testing/torch_builder.h"

namespace tensorferry::convert {
namespace {

using testing::MakeZip;
using testing::MemoryEnv;
using testing::TempDir;
using testing::ZipSpec;

std::string Str(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + i / 251) & 0xff);
  return s;
}

Result<std::unique_ptr<ZipReader>> OpenBytes(MemoryEnv& env, const std::string& bytes,
                                             std::unique_ptr<RandomAccessFile>& file,
                                             uint64_t max_entries = 1000) {
  env.AddFile("a.zip", bytes);
  auto f = env.OpenRandomAccess("a.zip");
  if (!f.ok()) return f.status();
  file = std::move(*f);
  return ZipReader::Open(*file, max_entries);
}

TEST(ZipReader, ListsAndReadsStoredEntries) {
  const std::string big = Pattern(100000);
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto zip =
      OpenBytes(env, MakeZip({{"a/data.pkl", "pickle"}, {"a/data/0", big}, {"a/e", ""}}), file);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  ZipReader& z = **zip;
  ASSERT_EQ(z.entries().size(), 3u);
  EXPECT_EQ(z.entries()[1].name, "a/data/0");
  EXPECT_EQ(z.entries()[1].size, big.size());
  EXPECT_EQ(z.entries()[1].method, 0);
  EXPECT_EQ(z.Find("a/data/0"), 1u);
  EXPECT_FALSE(z.Find("a/data").has_value());
  auto all = z.ReadAll(0, 100);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, "pickle");
  auto empty = z.ReadAll(2, 100);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, "");
  auto limited = z.ReadAll(1, 10);
  EXPECT_EQ(limited.status().code(), Code::kZipBadEntry);
  // Ranges in any order, across the whole entry.
  std::vector<std::byte> buf(4096);
  for (uint64_t off : {uint64_t{50000}, uint64_t{0}, uint64_t{95904}, uint64_t{12345}}) {
    ASSERT_TRUE(z.ReadAt(1, off, buf).ok());
    EXPECT_EQ(Str(buf), big.substr(off, buf.size())) << off;
  }
  EXPECT_EQ(z.ReadAt(1, 99000, buf).code(), Code::kInvalidArgument);
}

TEST(ZipReader, DeflatedEntriesReadForwardAndBack) {
  TempDir dir;
  const std::string big = Pattern(300000);
  testing::WriteDeflatedZip(dir.Join("d.zip"), {{"x/data.pkl", "abc"}, {"x/data/0", big}});
  auto file = Env::Default()->OpenRandomAccess(dir.Join("d.zip"));
  ASSERT_TRUE(file.ok());
  auto zip = ZipReader::Open(**file, 100);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  ZipReader& z = **zip;
  EXPECT_EQ(z.entries()[1].method, 8);
  EXPECT_LT(z.entries()[1].compressed_size, big.size());
  EXPECT_EQ(*z.ReadAll(0, 10), "abc");
  std::vector<std::byte> buf(1000);
  for (uint64_t off : {uint64_t{1000}, uint64_t{200000}, uint64_t{5}, uint64_t{299000}}) {
    ASSERT_TRUE(z.ReadAt(1, off, buf).ok());
    EXPECT_EQ(Str(buf), big.substr(off, buf.size())) << off;
  }
}

// Reads going backwards through a compressed entry inflate it again from its start each time:
// bounded (8 x the compressed entries' sizes + 256 MiB of bytes inflated only to be skipped),
// then an error naming the entry, instead of work growing with reads x size.
TEST(ZipReader, ReadsBackwardsThroughACompressedEntryAreBounded) {
  TempDir dir;
  const std::string big = Pattern(uint64_t{4} << 20);
  testing::WriteDeflatedZip(dir.Join("d.zip"), {{"x/data/0", big}});
  auto file = Env::Default()->OpenRandomAccess(dir.Join("d.zip"));
  ASSERT_TRUE(file.ok());
  auto zip = ZipReader::Open(**file, 100);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  ZipReader& z = **zip;
  std::vector<std::byte> one(1);
  // Forward, byte after byte across the entry: no skipping charged but the gaps.
  for (uint64_t off = 0; off < big.size(); off += 4096) ASSERT_TRUE(z.ReadAt(0, off, one).ok());
  // Backwards from the end: each read starts the entry again (~4 MiB skipped each); the budget
  // (32 + 256 MiB) ends it within about 72 reads.
  Status last;
  int reads = 0;
  for (uint64_t off = big.size() - 1; reads < 200; off -= 1, ++reads) {
    last = z.ReadAt(0, off, one);
    if (!last.ok()) break;
    ASSERT_EQ(static_cast<char>(one[0]), big[off]);
  }
  ASSERT_FALSE(last.ok()) << "200 backward reads of a 4 MiB compressed entry were all allowed";
  EXPECT_LT(reads, 100);
  EXPECT_EQ(last.code(), Code::kZipBadEntry) << last.ToString();
  EXPECT_NE(last.message().find("zip entry \"x/data/0\": is compressed and read out of order"),
            std::string::npos)
      << last.ToString();
}

TEST(ZipReader, RefusesWhatIsNotAZip) {
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto r = OpenBytes(env, "PK\x03\x04 this is not a zip archive at all", file);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kZipInvalid);
  EXPECT_NE(r.status().message().find("a.zip: not a readable zip archive"), std::string::npos)
      << r.status().message();
}

TEST(ZipReader, RefusesDuplicateNamesAndTooManyEntries) {
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto dup = OpenBytes(env, MakeZip({{"a/data.pkl", "p"}, {"a/x", "1"}, {"a/x", "2"}}), file);
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), Code::kZipInvalid);
  // Not libzip's "File already exists": the archive, the fault and the name.
  EXPECT_EQ(dup.status().message().find("already exists"), std::string::npos)
      << dup.status().message();
  EXPECT_NE(dup.status().message().find(file->path() + ": the zip archive has a duplicate entry "
                                                       "\"a/x\""),
            std::string::npos)
      << dup.status().message();
  MemoryEnv env2;
  std::unique_ptr<RandomAccessFile> file2;
  auto many = OpenBytes(env2, MakeZip({{"a", "1"}, {"b", "2"}, {"c", "3"}}), file2, 2);
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.status().message().find("more than the limit of 2"), std::string::npos);
}

TEST(ZipReader, CrcMismatchIsAnEntryError) {
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  ZipSpec bad{"a/data.pkl", "some pickle bytes", true};
  auto zip = OpenBytes(env, MakeZip({bad}), file);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  auto all = (*zip)->ReadAll(0, 100);
  ASSERT_FALSE(all.ok());
  EXPECT_EQ(all.status().code(), Code::kZipBadEntry);
  EXPECT_NE(all.status().message().find("zip entry \"a/data.pkl\""), std::string::npos);
}

TEST(ZipReader, CrcIsCheckedWhenAnEntryIsReadInOrder) {
  const std::string data = Pattern(10000);
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto zip = OpenBytes(env, MakeZip({{"a/good", data}, {"a/bad", data, true}}), file);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  std::vector<std::byte> chunk(3000);
  for (size_t index : {size_t{0}, size_t{1}}) {
    Status last;
    for (uint64_t off = 0; off < data.size(); off += chunk.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), data.size() - off));
      last = (*zip)->ReadAt(index, off, std::span<std::byte>(chunk.data(), n));
      if (off + n < data.size()) {
        ASSERT_TRUE(last.ok()) << last.ToString();
      }
    }
    if (index == 0) {
      EXPECT_TRUE(last.ok()) << last.ToString();
    } else {
      EXPECT_EQ(last.code(), Code::kZipBadEntry) << last.ToString();
      EXPECT_NE(last.message().find("zip entry \"a/bad\""), std::string::npos);
    }
  }
}

// Entries read in part, or out of order (after a seek libzip has no CRC to compare), are checked
// by CheckEntriesRead, which reads each once more whole; an entry read whole in order needs none.
TEST(ZipReader, EntriesReadInPartOrOutOfOrderAreCheckedOnRequest) {
  const std::string data = Pattern(10000);
  for (const bool bad : {false, true}) {
    for (const std::string how : {"first half", "halves reversed", "whole in order"}) {
      MemoryEnv env;
      std::unique_ptr<RandomAccessFile> file;
      auto zip = OpenBytes(env, MakeZip({{"a/x", data, bad}}), file);
      ASSERT_TRUE(zip.ok()) << zip.status().ToString();
      ZipReader& z = **zip;
      std::vector<std::byte> half(5000);
      Status read;
      if (how == "first half") {
        read = z.ReadAt(0, 0, half);
      } else if (how == "halves reversed") {
        read = z.ReadAt(0, 5000, half);
        if (read.ok()) read = z.ReadAt(0, 0, half);
      } else {
        read = z.ReadAt(0, 0, half);
        if (read.ok()) read = z.ReadAt(0, 5000, half);
      }
      const Status checked = read.ok() ? z.CheckEntriesRead() : read;
      if (!bad) {
        EXPECT_TRUE(checked.ok()) << how << ": " << checked.ToString();
        continue;
      }
      // Whole and in order: the read reaching the end says so; else the check does.
      EXPECT_EQ(read.ok(), how != "whole in order") << how << ": " << read.ToString();
      EXPECT_EQ(checked.code(), Code::kZipBadEntry) << how << ": " << checked.ToString();
      EXPECT_NE(checked.message().find("zip entry \"a/x\""), std::string::npos)
          << checked.message();
    }
  }
}

// CheckEntryRead checks the one entry it is given: an entry read in part elsewhere stays
// unchecked (and its bad CRC unreported) until it is asked for; a checked entry is not read again.
TEST(ZipReader, CheckEntryReadChecksOneEntry) {
  const std::string data = Pattern(10000);
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto zip = OpenBytes(env, MakeZip({{"a/good", data}, {"a/bad", data, true}}), file);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  ZipReader& z = **zip;
  std::vector<std::byte> half(5000);
  ASSERT_TRUE(z.ReadAt(1, 0, half).ok());
  ASSERT_TRUE(z.ReadAt(0, 0, half).ok());
  EXPECT_TRUE(z.CheckEntryRead(0).ok());
  EXPECT_TRUE(z.CheckEntryRead(7).ok());  // out of range: nothing to check
  const Status bad = z.CheckEntryRead(1);
  EXPECT_EQ(bad.code(), Code::kZipBadEntry) << bad.ToString();
  EXPECT_NE(bad.message().find("zip entry \"a/bad\""), std::string::npos) << bad.message();
  // Entry 0 was checked: the whole check reads it no more and finds entry 1 still bad.
  EXPECT_EQ(z.CheckEntriesRead().code(), Code::kZipBadEntry);
}

// Entries whose data overlap: "a"'s data is "b"'s local header and data, so "b"'s bytes are read
// twice (each entry valid alone: its own local header, its CRC). Many such entries would let a
// small archive claim terabytes of storages: refused at open.
TEST(ZipReader, RefusesEntriesWhoseDataOverlap) {
  const auto le = [](std::string& out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  const auto local = [&](const std::string& name, const std::string& data) {
    std::string h;
    le(h, 0x04034b50, 4);
    le(h, 20, 2);
    le(h, 0, 2);
    le(h, 0, 2);  // stored
    le(h, 0, 4);  // time, date
    le(h, testing::Crc32(data), 4);
    le(h, data.size(), 4);
    le(h, data.size(), 4);
    le(h, name.size(), 2);
    le(h, 0, 2);
    return h + name;
  };
  const auto central = [&](const std::string& name, const std::string& data, uint64_t offset) {
    std::string c;
    le(c, 0x02014b50, 4);
    le(c, 20, 2);
    le(c, 20, 2);
    le(c, 0, 2);
    le(c, 0, 2);
    le(c, 0, 4);
    le(c, testing::Crc32(data), 4);
    le(c, data.size(), 4);
    le(c, data.size(), 4);
    le(c, name.size(), 2);
    le(c, 0, 2);
    le(c, 0, 2);
    le(c, 0, 2);
    le(c, 0, 2);
    le(c, 0, 4);
    le(c, offset, 4);
    return c + name;
  };
  const std::string b_data(4096, 'b');
  const std::string b = local("b", b_data) + b_data;  // at offset 31
  const std::string a_data = b;                       // a's data: b's header and data
  std::string zip = local("a", a_data) + b;
  const uint64_t cd_offset = zip.size();
  const std::string cd = central("a", a_data, 0) + central("b", b_data, 31);
  zip += cd;
  le(zip, 0x06054b50, 4);
  le(zip, 0, 2);
  le(zip, 0, 2);
  le(zip, 2, 2);
  le(zip, 2, 2);
  le(zip, cd.size(), 4);
  le(zip, cd_offset, 4);
  le(zip, 0, 2);
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto opened = OpenBytes(env, zip, file);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), Code::kZipInvalid) << opened.status().ToString();
  EXPECT_NE(opened.status().message().find("their data overlap"), std::string::npos)
      << opened.status().ToString();
}

// A set cancel flag stops the re-read with kCancelled and leaves the entry unchecked: a later
// check without the flag still reads it and finds its bad CRC.
TEST(ZipReader, CheckEntryReadStopsWhenCancelled) {
  const std::string data = Pattern(3 << 20);  // three of the check's 1 MiB steps
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  auto zip = OpenBytes(env, MakeZip({{"a/bad", data, true}}), file);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  ZipReader& z = **zip;
  std::vector<std::byte> part(5000);
  ASSERT_TRUE(z.ReadAt(0, 0, part).ok());
  const std::atomic<bool> cancel{true};
  const Status cancelled = z.CheckEntryRead(0, &cancel);
  EXPECT_EQ(cancelled.code(), Code::kCancelled) << cancelled.ToString();
  EXPECT_NE(cancelled.message().find("zip entry \"a/bad\": checking its CRC-32 cancelled"),
            std::string::npos)
      << cancelled.message();
  const std::atomic<bool> go_on{false};
  EXPECT_EQ(z.CheckEntryRead(0, &go_on).code(), Code::kZipBadEntry);
}

// Sizes an archive records that its bytes cannot hold are refused at open: a stored entry
// claiming more (or fewer) bytes than it holds, and a compressed one claiming more than deflate
// can expand to.
TEST(ZipReader, RefusesEntrySizesTheArchiveCannotHold) {
  MemoryEnv env;
  std::unique_ptr<RandomAccessFile> file;
  ZipSpec lying{"a/data/0", "sixteen bytes!!!"};
  lying.claimed_size = uint64_t{64} << 20;
  auto zip = OpenBytes(env, MakeZip({{"a/data.pkl", "p"}, lying}), file);
  ASSERT_FALSE(zip.ok());
  EXPECT_EQ(zip.status().code(), Code::kZipInvalid);
  EXPECT_NE(zip.status().message().find(file->path() + ": zip entry \"a/data/0\" records " +
                                        std::to_string(uint64_t{64} << 20) +
                                        " bytes, stored (not compressed) in 16"),
            std::string::npos)
      << zip.status().message();

  // A deflated entry whose recorded size is patched to 2000 times its compressed bytes, in both
  // of its headers (so that libzip's consistency check passes).
  TempDir dir;
  testing::WriteDeflatedZip(dir.Join("d.zip"), {{"x/data/0", std::string(100000, 'a')}});
  std::string bytes = testing::ReadBytes(dir.Join("d.zip"));
  uint32_t compressed = 0;
  for (const std::string_view sig :
       {std::string_view("PK\x01\x02", 4), std::string_view("PK\x03\x04", 4)}) {
    const size_t at = bytes.find(sig);
    ASSERT_NE(at, std::string::npos);
    const size_t sizes = at + (sig[2] == 1 ? 20 : 18);  // compressed, then uncompressed size
    std::memcpy(&compressed, bytes.data() + sizes, 4);
    const uint32_t claimed = compressed * 2000;
    std::memcpy(bytes.data() + sizes + 4, &claimed, 4);
  }
  MemoryEnv env2;
  std::unique_ptr<RandomAccessFile> file2;
  auto deflated = OpenBytes(env2, bytes, file2);
  ASSERT_FALSE(deflated.ok());
  EXPECT_EQ(deflated.status().code(), Code::kZipInvalid);
  EXPECT_NE(deflated.status().message().find("bytes compressed into " + std::to_string(compressed) +
                                             ", more than deflate's largest ratio (1032:1)"),
            std::string::npos)
      << deflated.status().message();
}

TEST(ZipReader, IoErrorsComeBackAsIoErrors) {
  MemoryEnv env;
  // Large enough that libzip's scan of the last 64 KiB for the end record misses the fault.
  const std::string bytes = MakeZip({{"a/data.pkl", Pattern(200000)}});
  env.AddFile("a.zip", bytes);
  MemoryEnv::Faults faults;
  faults.eio_at = 50000;
  env.SetFaults("a.zip", faults);
  auto f = env.OpenRandomAccess("a.zip");
  ASSERT_TRUE(f.ok());
  auto zip = ZipReader::Open(**f, 10);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  auto all = (*zip)->ReadAll(0, 300000);
  ASSERT_FALSE(all.ok());
  EXPECT_EQ(all.status().code(), Code::kIoError) << all.status().ToString();
}

TEST(ZipReader, ShortReadsAreContinued) {
  MemoryEnv env;
  const std::string data = Pattern(20000);
  env.AddFile("a.zip", MakeZip({{"a/b", data}}));
  MemoryEnv::Faults faults;
  faults.max_read = 7;
  env.SetFaults("a.zip", faults);
  auto f = env.OpenRandomAccess("a.zip");
  ASSERT_TRUE(f.ok());
  auto zip = ZipReader::Open(**f, 10);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  EXPECT_EQ(*(*zip)->ReadAll(0, data.size()), data);
}

TEST(ZipReader, EveryTruncationAndByteFlipEndsCleanly) {
  const std::string bytes = MakeZip({{"a/data.pkl", "pickle"}, {"a/data/0", Pattern(300)}});
  auto exercise = [](const std::string& b) {
    MemoryEnv env;
    std::unique_ptr<RandomAccessFile> file;
    auto zip = OpenBytes(env, b, file);
    if (!zip.ok()) {
      EXPECT_FALSE(zip.status().message().empty());
      return;
    }
    for (size_t i = 0; i < (*zip)->entries().size(); ++i) {
      auto all = (*zip)->ReadAll(i, 1000);
      std::vector<std::byte> buf(
          static_cast<size_t>(std::min<uint64_t>((*zip)->entries()[i].size, 64)));
      auto s = (*zip)->ReadAt(i, 0, buf);
      if (!all.ok()) {
        EXPECT_FALSE(all.status().message().empty());
      }
      (void)s;
    }
  };
  for (size_t n = 0; n < bytes.size(); ++n) exercise(bytes.substr(0, n));
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x41);
    exercise(flipped);
  }
}

}  // namespace
}  // namespace tensorferry::convert

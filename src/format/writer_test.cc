#include "tensorferry/writer.h"

#include "tensorferry/integrity.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "integrity/manifest_update.h"
#include "tensorferry/format.h"
#include "tensorferry/integrity.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::ReadBytes;
using ::tensorferry::testing::TempDir;
using ::tensorferry::testing::WriteBytes;

// prefix + decimal i. (Spelled out: GCC 12 warns falsely, -Wrestrict, on "literal" + string.)
std::string Numbered(std::string_view prefix, uint64_t i) {
  std::string out(prefix);
  out += std::to_string(i);
  return out;
}

std::vector<std::byte> FloatBytes(std::initializer_list<float> values) {
  std::vector<std::byte> v(values.size() * sizeof(float));
  std::memcpy(v.data(), std::data(values), v.size());
  return v;
}

// `n` bytes of a pattern that depends on `seed`, so tensors differ.
using ::tensorferry::testing::Pattern;

std::string Le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

std::string Str(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

// Names in `dir`, sorted (hidden files included: a leftover temporary file must show up).
std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TensorToWrite Tensor(std::string name, DType dtype, std::vector<uint64_t> shape,
                     std::span<const std::byte> data) {
  TensorToWrite t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = data;
  return t;
}

// A tensor whose bytes come from a generator producing Pattern(size, seed).
TensorToWrite Generated(std::string name, DType dtype, std::vector<uint64_t> shape, unsigned seed) {
  TensorToWrite t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.generate = [seed](uint64_t offset, std::span<std::byte> out) {
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<std::byte>(((offset + i) * 31 + seed * 17 + 5) & 0xff);
    }
    return Status::Ok();
  };
  return t;
}

// Also without checksums: these tests are about the reference's layout, byte for byte (the
// checksums entry is tested in writer_checksums_test.cc).
WriteOptions NoSync() {
  WriteOptions o;
  o.sync = false;
  o.checksums = false;
  return o;
}
ShardOptions Plain() {
  ShardOptions o;
  o.write = NoSync();
  return o;
}

// --- SerializeHeader: the reference's byte-exact vectors -----------------------------------------

TEST(WriterVectors, SingleF32Tensor) {
  const auto data = FloatBytes({0, 1, 2, 3, 4, 5});
  const std::vector<TensorToWrite> tensors = {Tensor("attn.0", DType::kF32, {1, 2, 3}, data)};
  auto h = SerializeHeader(tensors, {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->json, R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})");
  EXPECT_EQ(h->json.size(), 64u);
  EXPECT_EQ(h->order, std::vector<size_t>{0});
  EXPECT_EQ(h->data_size, 24u);

  TempDir dir;
  const std::string path = dir.Join("a.safetensors");
  ASSERT_TRUE(WriteFile(path, tensors, {}, NoSync()).ok());
  EXPECT_EQ(ReadBytes(path), Le64(64) + h->json + Str(data));
}

TEST(WriterVectors, Rank4PadsWithSpaces) {
  const auto data = FloatBytes({0, 1, 2, 3, 4, 5});
  const std::vector<TensorToWrite> tensors = {Tensor("attn0", DType::kF32, {1, 1, 2, 3}, data)};
  auto h = SerializeHeader(tensors, {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->json,
            std::string(R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})") +
                std::string(7, ' '));
  EXPECT_EQ(h->json.size(), 72u);

  TempDir dir;
  const std::string path = dir.Join("a.safetensors");
  ASSERT_TRUE(WriteFile(path, tensors, {}, NoSync()).ok());
  EXPECT_EQ(ReadBytes(path), Le64(72) + h->json + Str(data));
}

TEST(WriterVectors, EmptyDict) {
  auto h = SerializeHeader({}, {});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->json, "{}      ");
  EXPECT_TRUE(h->order.empty());
  EXPECT_EQ(h->data_size, 0u);

  TempDir dir;
  const std::string path = dir.Join("empty.safetensors");
  ASSERT_TRUE(WriteFile(path, {}, {}, NoSync()).ok());
  EXPECT_EQ(ReadBytes(path), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
}

TEST(WriterVectors, AnEmptyMetadataTableWhenAskedFor) {
  // The reference's metadata={}: "__metadata__":{}; with checksums the table has their entry.
  auto h = SerializeHeader({}, {}, /*metadata_table=*/true);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->json, R"({"__metadata__":{}})" + std::string(5, ' '));
  TempDir dir;
  const std::string path = dir.Join("t.safetensors");
  WriteOptions options = NoSync();
  options.metadata_table = true;
  ASSERT_TRUE(WriteFile(path, {}, {}, options).ok());
  EXPECT_EQ(ReadBytes(path), Le64(24) + h->json);
  options.metadata_table = false;
  ASSERT_TRUE(WriteFile(path, {}, {}, options).ok());
  EXPECT_EQ(ReadBytes(path), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
}

TEST(WriterVectors, EmptyDictWithMetadata) {
  const Metadata metadata = {{"framework", "pt"}};
  auto h = SerializeHeader({}, metadata);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->json, R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '));
  EXPECT_EQ(h->json.size(), 40u);

  TempDir dir;
  const std::string path = dir.Join("m.safetensors");
  ASSERT_TRUE(WriteFile(path, {}, metadata, NoSync()).ok());
  EXPECT_EQ(ReadBytes(path), Le64(40) + h->json);
}

// --- SerializeHeader: order, metadata, escaping --------------------------------------------------

TEST(WriterHeader, OrdersAllDtypesDescending) {
  // One tensor per dtype, given in a scrambled order; names chosen so that name order disagrees
  // with dtype order.
  std::vector<int> dtypes(kNumDTypes);
  std::iota(dtypes.begin(), dtypes.end(), 0);
  std::vector<int> scrambled;
  for (int i = 0; i < kNumDTypes; ++i)
    scrambled.push_back(dtypes[static_cast<size_t>((i * 7) % kNumDTypes)]);
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> tensors;
  for (int d : scrambled) {
    const auto dtype = static_cast<DType>(d);
    // Shape [24]: a whole number of bytes for every width (4 and 6 bits included).
    const uint64_t bytes = 24 * DTypeBits(dtype) / 8;
    storage.push_back(Pattern(bytes, static_cast<unsigned>(d)));
    tensors.push_back(Tensor(Numbered("t", 100 - d), dtype, {24}, storage.back()));
  }
  auto h = SerializeHeader(tensors, {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();

  ASSERT_EQ(h->order.size(), static_cast<size_t>(kNumDTypes));
  std::string expected = "{";
  uint64_t offset = 0;
  for (size_t i = 0; i < h->order.size(); ++i) {
    const TensorToWrite& t = tensors[h->order[i]];
    EXPECT_EQ(static_cast<int>(t.dtype), kNumDTypes - 1 - static_cast<int>(i)) << i;
    const uint64_t end = offset + 24 * DTypeBits(t.dtype) / 8;
    if (i > 0) expected += ",";
    expected += "\"" + t.name + "\":{\"dtype\":\"" + std::string(DTypeName(t.dtype)) +
                "\",\"shape\":[24],\"data_offsets\":[" + std::to_string(offset) + "," +
                std::to_string(end) + "]}";
    offset = end;
  }
  expected += "}";
  EXPECT_EQ(h->order.front(), static_cast<size_t>(std::find(scrambled.begin(), scrambled.end(),
                                                            static_cast<int>(DType::kU64)) -
                                                  scrambled.begin()));
  EXPECT_EQ(h->json.substr(0, expected.size()), expected);
  EXPECT_EQ(h->json.find_first_not_of(' ', expected.size()), std::string::npos);
  EXPECT_EQ(h->json.size() % 8, 0u);
  EXPECT_EQ(h->data_size, offset);
  EXPECT_NE(h->json.find(R"("U64","shape")"), std::string::npos);
  EXPECT_LT(h->json.find("\"U64\""), h->json.find("\"I64\""));
  EXPECT_LT(h->json.find("\"F4\""), h->json.find("\"BOOL\""));
}

TEST(WriterHeader, TiesSortedByNameBytewise) {
  const auto d = Pattern(2, 1);
  // Bytewise order: "" < "B" < "a" < "b" < "\xc3\xa9" (é).
  const std::vector<TensorToWrite> tensors = {
      Tensor("b", DType::kU8, {2}, d), Tensor("\xc3\xa9", DType::kU8, {2}, d),
      Tensor("a", DType::kU8, {2}, d), Tensor("", DType::kU8, {2}, d),
      Tensor("B", DType::kU8, {2}, d), Tensor("z", DType::kI8, {2}, d)};
  auto h = SerializeHeader(tensors, {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->order, (std::vector<size_t>{5, 3, 4, 2, 0, 1}));
  const std::string expected = R"({"z":{"dtype":"I8","shape":[2],"data_offsets":[0,2]},)"
                               R"("":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"B":{)";
  EXPECT_EQ(h->json.substr(0, expected.size()), expected);
}

TEST(WriterHeader, MetadataSortedAndEscaped) {
  const Metadata metadata = {{"z", "last"},
                             {"\xc3\xa9t\xc3\xa9", "\xe2\x82\xac"},
                             {"a", "q\"b\\s/\n\t\r\b\f\x01\x1f\x7f"},
                             {"M", ""}};
  auto h = SerializeHeader({}, metadata);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const std::string expected =
      "{\"__metadata__\":{\"M\":\"\",\"a\":\"q\\\"b\\\\s/\\n\\t\\r\\b\\f\\u0001\\u001f\x7f\","
      "\"z\":\"last\",\"\xc3\xa9t\xc3\xa9\":\"\xe2\x82\xac\"}}";
  EXPECT_EQ(h->json.substr(0, expected.size()), expected);
  EXPECT_EQ(h->json.size(), (expected.size() + 7) / 8 * 8);
}

// A checksum record in the caller's metadata (a file's metadata copied to a rewrite of its
// tensors) describes other bytes: the serialized header (Python's save() to bytes) leaves it out,
// as WriteFile does, and keeps the rest.
TEST(WriterHeader, SerializeLeavesOutACopiedChecksumRecord) {
  const Metadata metadata = {{"format", "pt"},
                             {std::string(kChecksumsMetadataKey), "{\"stale\":1}"}};
  auto h = SerializeHeader({}, metadata);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->json, R"({"__metadata__":{"format":"pt"}})");
}

TEST(WriterHeader, TensorNamesEscaped) {
  const auto d = Pattern(1, 0);
  const std::vector<TensorToWrite> tensors = {
      Tensor("q\"\\\n\x02", DType::kU8, {1}, d),
      Tensor("\xe6\x97\xa5\xe6\x9c\xac", DType::kU8, {1}, d)};
  auto h = SerializeHeader(tensors, {{"k", "v"}});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const std::string expected =
      "{\"__metadata__\":{\"k\":\"v\"},\"q\\\"\\\\\\n\\u0002\":{\"dtype\":\"U8\",\"shape\":[1],"
      "\"data_offsets\":[0,1]},\"\xe6\x97\xa5\xe6\x9c\xac\":{\"dtype\":\"U8\",\"shape\":[1],"
      "\"data_offsets\":[1,2]}}";
  EXPECT_EQ(h->json.substr(0, expected.size()), expected);
}

TEST(WriterHeader, ScalarZeroElementAndEmptyName) {
  const auto four = Pattern(4, 0);
  std::vector<TensorToWrite> tensors = {Tensor("", DType::kF32, {}, four),
                                        Tensor("zero", DType::kF32, {0, 5}, {}),
                                        Tensor("f4", DType::kF4, {2}, std::span(four).first(1))};
  auto h = SerializeHeader(tensors, {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const std::string expected = R"({"":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                               R"("zero":{"dtype":"F32","shape":[0,5],"data_offsets":[4,4]},)"
                               R"("f4":{"dtype":"F4","shape":[2],"data_offsets":[4,5]}})";
  EXPECT_EQ(h->json.substr(0, expected.size()), expected);
  EXPECT_EQ(h->data_size, 5u);
}

TEST(WriterHeader, GenerateTakesPrecedenceOverData) {
  const auto wrong = Pattern(3, 0);
  TensorToWrite t = Generated("g", DType::kF32, {2}, 1);
  t.data = wrong;  // wrong length, but generate is used
  auto h = SerializeHeader(std::span(&t, 1), {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->data_size, 8u);
}

// --- invalid input
// ---------------------------------------------------------------------------------

struct InvalidCase {
  std::string label;
  std::vector<TensorToWrite> tensors;
  Metadata metadata;
  Code code;
  std::vector<std::string> message_parts;
};

std::vector<InvalidCase> InvalidCases(const std::vector<std::byte>& four) {
  const std::span<const std::byte> d(four);
  std::vector<InvalidCase> cases;
  cases.push_back({"reserved name",
                   {Tensor("__metadata__", DType::kU8, {4}, d)},
                   {},
                   Code::kBadTensorName,
                   {"__metadata__", "reserved"}});
  cases.push_back({"duplicate",
                   {Tensor("w", DType::kU8, {4}, d), Tensor("x", DType::kU8, {4}, d),
                    Tensor("w", DType::kF32, {1}, d)},
                   {},
                   Code::kBadTensorName,
                   {"\"w\"", "duplicate", "0", "2"}});
  cases.push_back({"name not utf8",
                   {Tensor("bad\xff", DType::kU8, {4}, d)},
                   {},
                   Code::kBadTensorName,
                   {"UTF-8"}});
  cases.push_back({"surrogate name",
                   {Tensor("\xed\xa0\x80", DType::kU8, {4}, d)},
                   {},
                   Code::kBadTensorName,
                   {"UTF-8"}});
  cases.push_back({"short data",
                   {Tensor("w", DType::kF32, {1, 2}, d)},
                   {},
                   Code::kBadTensorData,
                   {"\"w\"", "4 bytes", "expected 8", "F32", "[1,2]"}});
  cases.push_back({"long data",
                   {Tensor("w", DType::kU8, {3}, d)},
                   {},
                   Code::kBadTensorData,
                   {"\"w\"", "4 bytes", "expected 3"}});
  cases.push_back({"no data",
                   {Tensor("w", DType::kU8, {4}, {})},
                   {},
                   Code::kBadTensorData,
                   {"\"w\"", "neither data nor generate", "4 bytes"}});
  cases.push_back({"data for empty tensor",
                   {Tensor("w", DType::kU8, {0}, d)},
                   {},
                   Code::kBadTensorData,
                   {"\"w\"", "expected 0"}});
  cases.push_back({"element overflow",
                   {Tensor("big", DType::kU8, {1ull << 32, 1ull << 32}, d)},
                   {},
                   Code::kOverflow,
                   {"\"big\""}});
  cases.push_back({"bit overflow",
                   {Tensor("big", DType::kF64, {1ull << 62}, d)},
                   {},
                   Code::kOverflow,
                   {"\"big\""}});
  cases.push_back({"partial byte",
                   {Tensor("f4", DType::kF4, {3}, d)},
                   {},
                   Code::kPartialByte,
                   {"\"f4\"", "12 bits"}});
  cases.push_back({"partial byte f6",
                   {Tensor("f6", DType::kF6_E2M3, {2}, d)},
                   {},
                   Code::kPartialByte,
                   {"\"f6\""}});
  cases.push_back({"duplicate metadata key",
                   {Tensor("w", DType::kU8, {4}, d)},
                   {{"k", "1"}, {"j", "2"}, {"k", "1"}},
                   Code::kInvalidArgument,
                   {"\"k\"", "more than once"}});
  // Files no reader would open (ParseLimits' defaults): not written.
  Metadata many;
  for (int i = 0; i <= 65536; ++i) many.emplace_back("k" + std::to_string(i), "v");
  cases.push_back({"too many metadata entries",
                   {Tensor("w", DType::kU8, {4}, d)},
                   many,
                   Code::kTooManyMetadataEntries,
                   {"65537 entries", "65536"}});
  cases.push_back({"header too large",
                   {Tensor("w", DType::kU8, {4}, d)},
                   {{"big", std::string(100'000'000, 'x')}},
                   Code::kHeaderTooLarge,
                   {"100000", "bytes, more than the 100000000", "1 tensors, 1 metadata entries"}});
  cases.push_back({"rank 65",
                   {Tensor("w", DType::kU8, std::vector<uint64_t>(65, 1), d.first(1))},
                   {},
                   Code::kRankTooLarge,
                   {"\"w\"", "65 dimensions", "64"}});
  cases.push_back({"dimension above 2^63-1",
                   {Tensor("e", DType::kU8, {uint64_t{1} << 63, 0}, {})},
                   {},
                   Code::kInvalidShape,
                   {"\"e\"", "dimension 0", "2^63-1"}});
  cases.push_back(
      {"metadata key not utf8", {}, {{"k\xc0\x80", "v"}}, Code::kInvalidArgument, {"UTF-8"}});
  cases.push_back({"metadata value not utf8",
                   {},
                   {{"k", "v\xf8"}},
                   Code::kInvalidArgument,
                   {"\"k\"", "UTF-8"}});
  return cases;
}

void ExpectMessageHas(const Status& s, const std::vector<std::string>& parts,
                      const std::string& label) {
  for (const auto& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos)
        << label << ": message \"" << s.message() << "\" lacks \"" << p << "\"";
  }
}

TEST(WriterValidation, SerializeHeaderRefusesInvalidInput) {
  const auto four = Pattern(4, 0);
  for (const auto& c : InvalidCases(four)) {
    auto h = SerializeHeader(c.tensors, c.metadata);
    ASSERT_FALSE(h.ok()) << c.label;
    EXPECT_EQ(h.status().code(), c.code) << c.label << ": " << h.status().ToString();
    ExpectMessageHas(h.status(), c.message_parts, c.label);
  }
}

TEST(WriterValidation, WriteFileRefusesBeforeCreatingAnything) {
  const auto four = Pattern(4, 0);
  for (const auto& c : InvalidCases(four)) {
    TempDir dir;
    const Status s = WriteFile(dir.Join("x.safetensors"), c.tensors, c.metadata);
    EXPECT_EQ(s.code(), c.code) << c.label << ": " << s.ToString();
    EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{}) << c.label;
  }
}

TEST(WriterValidation, WriteShardedRefusesBeforeCreatingAnything) {
  const auto four = Pattern(4, 0);
  for (const auto& c : InvalidCases(four)) {
    TempDir dir;
    ShardOptions options;
    options.max_shard_size = 4;  // "duplicate": the two "w" would land in different shards
    options.write = NoSync();
    auto r = WriteSharded(dir.Join("ckpt"), c.tensors, c.metadata, options);
    ASSERT_FALSE(r.ok()) << c.label;
    EXPECT_EQ(r.status().code(), c.code) << c.label << ": " << r.status().ToString();
    // Not even the checkpoint directory is created.
    EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{}) << c.label;
  }
}

// --- WriteFile
// ---------------------------------------------------------------------------------------

TEST(WriterFile, GeneratorEqualsDataSpans) {
  // Sizes that straddle the small buffers used below.
  const std::vector<std::pair<DType, std::vector<uint64_t>>> specs = {
      {DType::kF32, {3, 5}}, {DType::kBF16, {7}}, {DType::kU8, {1}},    {DType::kU8, {0}},
      {DType::kI64, {2, 2}}, {DType::kF4, {10}},  {DType::kBool, {33}}, {DType::kF16, {100}}};
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> from_data;
  std::vector<TensorToWrite> from_generate;
  std::vector<TensorToWrite> mixed;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& [dtype, shape] = specs[i];
    const uint64_t size = TensorByteSize(dtype, shape).value();
    storage.push_back(Pattern(size, static_cast<unsigned>(i)));
    const std::string name = Numbered("t", i);
    from_data.push_back(Tensor(name, dtype, shape, storage.back()));
    from_generate.push_back(Generated(name, dtype, shape, static_cast<unsigned>(i)));
    mixed.push_back(i % 2 ? from_data.back() : from_generate.back());
  }
  const Metadata metadata = {{"format", "pt"}};
  TempDir dir;
  ASSERT_TRUE(WriteFile(dir.Join("ref"), from_data, metadata).ok());
  const std::string expected = ReadBytes(dir.Join("ref"));
  for (size_t buffer : {size_t{1}, size_t{3}, size_t{7}, size_t{64}, size_t{0}, size_t{8} << 20}) {
    WriteOptions options;
    options.buffer_size = buffer;
    ASSERT_TRUE(WriteFile(dir.Join("gen"), from_generate, metadata, options).ok()) << buffer;
    EXPECT_EQ(ReadBytes(dir.Join("gen")), expected) << "buffer " << buffer;
    ASSERT_TRUE(WriteFile(dir.Join("mixed"), mixed, metadata, options).ok()) << buffer;
    EXPECT_EQ(ReadBytes(dir.Join("mixed")), expected) << "buffer " << buffer;
    ASSERT_TRUE(WriteFile(dir.Join("data"), from_data, metadata, options).ok()) << buffer;
    EXPECT_EQ(ReadBytes(dir.Join("data")), expected) << "buffer " << buffer;
  }
  EXPECT_EQ(ListDir(dir.path()), (std::vector<std::string>{"data", "gen", "mixed", "ref"}));
}

TEST(WriterFile, GeneratorCalledWithIncreasingContiguousOffsets) {
  std::vector<std::pair<uint64_t, size_t>> calls;
  TensorToWrite t;
  t.name = "g";
  t.dtype = DType::kU8;
  t.shape = {100};
  t.generate = [&](uint64_t offset, std::span<std::byte> out) {
    calls.emplace_back(offset, out.size());
    std::fill(out.begin(), out.end(), std::byte{0x5a});
    return Status::Ok();
  };
  TempDir dir;
  WriteOptions options = NoSync();
  options.buffer_size = 16;
  ASSERT_TRUE(WriteFile(dir.Join("f"), std::span(&t, 1), {}, options).ok());
  uint64_t next = 0;
  for (const auto& [offset, size] : calls) {
    EXPECT_EQ(offset, next);
    EXPECT_GT(size, 0u);
    EXPECT_LE(size, 16u);
    next = offset + size;
  }
  EXPECT_EQ(next, 100u);
  const std::string bytes = ReadBytes(dir.Join("f"));
  EXPECT_EQ(bytes.substr(bytes.size() - 100), std::string(100, 'Z'));
}

TEST(WriterFile, FailingGeneratorLeavesNoFile) {
  const auto d = Pattern(64, 0);
  std::vector<TensorToWrite> tensors = {Tensor("a", DType::kU8, {64}, d),
                                        Generated("b", DType::kU8, {1000}, 0)};
  tensors[1].generate = [](uint64_t offset, std::span<std::byte> out) {
    if (offset >= 500) return Status(Code::kNotFound, "source shard vanished");
    std::fill(out.begin(), out.end(), std::byte{1});
    return Status::Ok();
  };
  TempDir dir;
  WriteOptions options;
  options.buffer_size = 100;
  const Status s = WriteFile(dir.Join("x.safetensors"), tensors, {}, options);
  EXPECT_EQ(s.code(), Code::kNotFound) << s.ToString();
  ExpectMessageHas(s, {"\"b\"", "source shard vanished", "generating bytes"}, "generator");
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{});
}

TEST(WriterFile, ThrowingGeneratorIsAnErrorNotAnException) {
  TensorToWrite t = Generated("boom", DType::kU8, {10}, 0);
  t.generate = [](uint64_t, std::span<std::byte>) -> Status {
    throw std::runtime_error("bad things");
  };
  TempDir dir;
  Status s;
  EXPECT_NO_THROW(s = WriteFile(dir.Join("x"), std::span(&t, 1)));
  EXPECT_EQ(s.code(), Code::kInternal);
  ExpectMessageHas(s, {"\"boom\"", "bad things"}, "throw");
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{});
}

TEST(WriterFile, ExistingDestinationUntouchedOnFailure) {
  TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  WriteBytes(path, "original contents");
  TensorToWrite t = Generated("g", DType::kU8, {10}, 0);
  t.generate = [](uint64_t, std::span<std::byte>) { return Status(Code::kIoError, "nope"); };
  EXPECT_EQ(WriteFile(path, std::span(&t, 1)).code(), Code::kIoError);
  // Refused input too.
  const auto d = Pattern(3, 0);
  const TensorToWrite bad = Tensor("w", DType::kU8, {4}, d);
  EXPECT_EQ(WriteFile(path, std::span(&bad, 1)).code(), Code::kBadTensorData);
  EXPECT_EQ(ReadBytes(path), "original contents");
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"model.safetensors"});
}

// A file replaced keeps its permission bits (a private one stays private); a new one gets
// 0666 & ~umask.
TEST(WriterFile, AReplacedFileKeepsItsMode) {
  TempDir dir;
  const auto d = Pattern(4, 0);
  const TensorToWrite t = Tensor("w", DType::kU8, {4}, d);
  const mode_t mask = ::umask(022);
  const std::string fresh = dir.Join("new.safetensors");
  ASSERT_TRUE(WriteFile(fresh, std::span(&t, 1)).ok());
  struct stat st {};
  ASSERT_EQ(::stat(fresh.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  for (const mode_t mode : {mode_t{0600}, mode_t{0640}, mode_t{0664}}) {
    const std::string path = dir.Join("old.safetensors");
    WriteBytes(path, "old");
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
    ASSERT_TRUE(WriteFile(path, std::span(&t, 1)).ok());
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, mode) << std::oct << mode;
  }
  ::umask(mask);
}

TEST(WriterFile, ReplacesExistingDestination) {
  TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  WriteBytes(path, std::string(1000, 'x'));
  ASSERT_TRUE(WriteFile(path, {}, {}, NoSync()).ok());
  EXPECT_EQ(ReadBytes(path), Le64(8) + "{}      ");
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"model.safetensors"});
}

// Sets the umask for the lifetime of the object.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(::umask(mask)) {}
  ~ScopedUmask() { ::umask(old_); }

 private:
  mode_t old_;
};

TEST(WriterFile, ModeIs0666MinusUmask) {
  TempDir dir;
  for (mode_t mask : {mode_t{022}, mode_t{077}, mode_t{0}, mode_t{027}}) {
    const std::string path = dir.Join(Numbered("m", mask));
    {
      ScopedUmask scoped(mask);
      ASSERT_TRUE(WriteFile(path, {}).ok());
    }
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0666 & ~mask) << "umask " << std::oct << mask;
  }
}

TEST(WriterFile, MissingDirectoryIsIoError) {
  TempDir dir;
  const std::string path = dir.Join("no/such/dir/x.safetensors");
  const Status s = WriteFile(path, {});
  EXPECT_EQ(s.code(), Code::kIoError);
  ExpectMessageHas(s, {path, "No such file or directory"}, "missing dir");
}

// One generated tensor of 1000 ones; `generated` is set once a byte of it is produced.
std::vector<TensorToWrite> GeneratedOnes(bool& generated) {
  return {{"w", DType::kU8, {1000}, {}, [&generated](uint64_t, std::span<std::byte> out) {
             generated = true;
             std::fill(out.begin(), out.end(), std::byte{1});
             return Status::Ok();
           }}};
}

TEST(WriterFile, DestinationIsADirectory) {
  TempDir dir;
  const std::string path = dir.Join("sub");
  std::filesystem::create_directory(path);
  // Refused before a byte is produced (the rename over it would fail after the whole file).
  bool generated = false;
  const Status s = WriteFile(path, GeneratedOnes(generated));
  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  ExpectMessageHas(s, {path, ": is a directory"}, "dir");
  EXPECT_FALSE(generated);
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"sub"});
  EXPECT_EQ(ListDir(path), std::vector<std::string>{});
}

// A FIFO or socket (or a device: `convert x.pt /dev/null` as root) at the path is refused before
// a byte is produced, and stays: the rename of the new file would have replaced it.
TEST(WriterFile, DestinationThatIsNotARegularFileStays) {
  TempDir dir;
  const std::string fifo = dir.Join("fifo"), sock = dir.Join("sock");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(sock.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  close(fd);
  for (const auto& [path, what] : {std::pair{fifo, "a FIFO"}, std::pair{sock, "a socket"}}) {
    bool generated = false;
    const Status s = WriteFile(path, GeneratedOnes(generated));
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    ExpectMessageHas(s, {path, std::string(": is ") + what, "not a regular file"}, what);
    EXPECT_FALSE(generated);
  }
  struct stat st {};
  ASSERT_EQ(lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(lstat(sock.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(ListDir(dir.path()), (std::vector<std::string>{"fifo", "sock"}));
}

TEST(WriterFile, PathWithoutFileNameIsRefused) {
  TempDir dir;
  EXPECT_EQ(WriteFile(dir.path() + "/", {}).code(), Code::kInvalidArgument);
  EXPECT_EQ(WriteFile("", {}).code(), Code::kInvalidArgument);
}

TEST(WriterFile, RelativePathInCurrentDirectory) {
  TempDir dir;
  const auto old = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  const Status s = WriteFile("rel.safetensors", {});
  std::filesystem::current_path(old);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"rel.safetensors"});
}

TEST(WriterFile, LongFileNameStillGetsATemporary) {
  TempDir dir;
  const std::string path = dir.Join(std::string(250, 'n'));
  ASSERT_TRUE(WriteFile(path, {}).ok());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{std::string(250, 'n')});
}

// A write error from the kernel: RLIMIT_FSIZE makes write() fail with EFBIG (once SIGXFSZ is
// ignored) after a short write up to the limit.
TEST(WriterFile, WriteErrorNamesPathOffsetAndErrno) {
  TempDir dir;
  const std::string path = dir.Join("big.safetensors");
  WriteBytes(path, "keep me");
  const auto data = Pattern(1 << 16, 3);
  const TensorToWrite t = Tensor("w", DType::kU8, {1 << 16}, data);
  WriteOptions options;
  options.buffer_size = 4096;

  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  struct sigaction ignore = {}, old_action = {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old_action), 0);
  struct rlimit small = old_limit;
  small.rlim_cur = 10000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status s = WriteFile(path, std::span(&t, 1), {}, options);
  // Restore before any assertion can print.
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::sigaction(SIGXFSZ, &old_action, nullptr);

  EXPECT_EQ(s.code(), Code::kIoError) << s.ToString();
  ExpectMessageHas(s, {path, "offset 10000", "File too large"}, "efbig");
  EXPECT_EQ(ReadBytes(path), "keep me");
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"big.safetensors"});
}

// --- WriteSharded
// ------------------------------------------------------------------------------------

// Tensors of the given byte sizes named w0, w1, ... (U8, shape [size]).
struct ShardInput {
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> tensors;
};

ShardInput MakeShardInput(const std::vector<uint64_t>& sizes) {
  ShardInput in;
  in.storage.reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    in.storage.push_back(Pattern(sizes[i], static_cast<unsigned>(i)));
    in.tensors.push_back(Tensor(Numbered("w", i), DType::kU8, {sizes[i]}, in.storage.back()));
  }
  return in;
}

// The file WriteFile makes from the tensors at `indices`.
std::string ExpectedShard(const std::vector<TensorToWrite>& all, const std::vector<size_t>& indices,
                          const Metadata& metadata) {
  std::vector<TensorToWrite> subset;
  for (size_t i : indices) subset.push_back(all[i]);
  TempDir dir;
  EXPECT_TRUE(WriteFile(dir.Join("x"), subset, metadata, NoSync()).ok());
  return ReadBytes(dir.Join("x"));
}

TEST(WriterShard, SplitPoints) {
  const ShardInput in = MakeShardInput({4, 4, 4, 4, 12, 4, 0});
  const Metadata metadata = {{"format", "pt"}};
  struct SplitCase {
    uint64_t max;
    std::vector<std::vector<size_t>> shards;
  };
  const std::vector<SplitCase> cases = {
      {8, {{0, 1}, {2, 3}, {4}, {5, 6}}},     {12, {{0, 1, 2}, {3}, {4}, {5, 6}}},
      {11, {{0, 1}, {2, 3}, {4}, {5, 6}}},    {16, {{0, 1, 2, 3}, {4, 5, 6}}},
      {4, {{0}, {1}, {2}, {3}, {4}, {5, 6}}}, {0, {{0}, {1}, {2}, {3}, {4}, {5}, {6}}},
      {32, {{0, 1, 2, 3, 4, 5, 6}}},
  };
  for (const auto& c : cases) {
    TempDir dir;
    ShardOptions options;
    options.max_shard_size = c.max;
    options.write = NoSync();
    auto r = WriteSharded(dir.path(), in.tensors, metadata, options);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const size_t n = c.shards.size();
    std::vector<std::string> expected_paths;
    for (size_t s = 0; s < n; ++s) {
      char name[64];
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, n);
      expected_paths.push_back(dir.Join(n == 1 ? "model.safetensors" : name));
      EXPECT_EQ(ReadBytes(expected_paths.back()), ExpectedShard(in.tensors, c.shards[s], metadata))
          << "max " << c.max << " shard " << s;
    }
    expected_paths.push_back(dir.Join("model.safetensors.index.json"));
    EXPECT_EQ(*r, expected_paths) << "max " << c.max;
    EXPECT_EQ(ListDir(dir.path()).size(), n + 1) << "max " << c.max;
  }
}

TEST(WriterShard, IndexContentExact) {
  // Names out of order, one needing escapes, one non-ASCII (kept as UTF-8).
  std::vector<std::vector<std::byte>> storage = {Pattern(8, 0), Pattern(8, 1), Pattern(4, 2),
                                                 Pattern(4, 3)};
  const std::vector<TensorToWrite> tensors = {Tensor("zeta", DType::kF32, {2}, storage[0]),
                                              Tensor("alpha\"q", DType::kF32, {2}, storage[1]),
                                              Tensor("\xc3\xa9", DType::kU8, {4}, storage[2]),
                                              Tensor("beta", DType::kI16, {2}, storage[3])};
  TempDir dir;
  ShardOptions options;
  options.max_shard_size = 10;
  options.write = NoSync();
  auto r = WriteSharded(dir.path(), tensors, {}, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // Shards: [zeta], [alpha"q], [é, beta].
  EXPECT_EQ(ReadBytes(dir.Join("model.safetensors.index.json")),
            "{\n"
            "  \"metadata\": {\n"
            "    \"total_size\": 24\n"
            "  },\n"
            "  \"weight_map\": {\n"
            "    \"alpha\\\"q\": \"model-00002-of-00003.safetensors\",\n"
            "    \"beta\": \"model-00003-of-00003.safetensors\",\n"
            "    \"zeta\": \"model-00001-of-00003.safetensors\",\n"
            "    \"\xc3\xa9\": \"model-00003-of-00003.safetensors\"\n"
            "  }\n"
            "}\n");
}

TEST(WriterShard, OneShardNaming) {
  const ShardInput in = MakeShardInput({4, 4});
  TempDir dir;
  ShardOptions options;
  options.prefix = "adapter_model";
  options.write = NoSync();
  auto r = WriteSharded(dir.path(), in.tensors, {}, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (std::vector<std::string>{dir.Join("adapter_model.safetensors"),
                                          dir.Join("adapter_model.safetensors.index.json")}));
  EXPECT_EQ(ReadBytes(dir.Join("adapter_model.safetensors")),
            ExpectedShard(in.tensors, {0, 1}, {}));
  EXPECT_EQ(ReadBytes(dir.Join("adapter_model.safetensors.index.json")),
            "{\n  \"metadata\": {\n    \"total_size\": 8\n  },\n  \"weight_map\": {\n"
            "    \"w0\": \"adapter_model.safetensors\",\n"
            "    \"w1\": \"adapter_model.safetensors\"\n  }\n}\n");

  TempDir dir2;
  options.always_write_index = false;
  r = WriteSharded(dir2.path(), in.tensors, {}, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, std::vector<std::string>{dir2.Join("adapter_model.safetensors")});
  EXPECT_EQ(ListDir(dir2.path()), std::vector<std::string>{"adapter_model.safetensors"});
}

// Two writers of one layout at once: the one that commits second replaces the layout the first
// put in place, whole. It reads which files that layout has under the manifest's lock, which every
// writer holds to its commit: read before (as it was), the other writer's five shards, committed
// meanwhile, stayed beside this one's two (orphans its index does not name).
TEST(WriterShard, ALayoutCommittedMeanwhileByAnotherWriterIsReplacedWhole) {
  TempDir dir;
  TempDir other;
  ShardOptions options;
  options.max_shard_size = 4;
  options.write = NoSync();
  const ShardInput five = MakeShardInput({4, 4, 4, 4, 4});
  ASSERT_TRUE(WriteSharded(other.path(), five.tensors, {}, options).ok());
  const ShardInput two = MakeShardInput({4, 4});
  auto held = internal::LockManifest(dir.path());
  ASSERT_TRUE(held.ok() && held->has_value()) << "a real directory has the lock";
  std::atomic<bool> at_commit{false};
  ShardOptions mine = options;
  mine.write.before_commit = [&] {
    at_commit = true;
    return Status::Ok();
  };
  Result<std::vector<std::string>> written = Status(Code::kInternal, "not run");
  std::thread writer([&] { written = WriteSharded(dir.path(), two.tensors, {}, mine); });
  for (int i = 0; i < 20000 && !at_commit; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the writer waits for the lock
  // The other writer's commit, made under the lock this test holds.
  for (const std::string& name : ListDir(other.path())) {
    WriteBytes(dir.Join(name), ReadBytes(other.Join(name)));
  }
  held->reset();
  writer.join();
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_EQ(ListDir(dir.path()), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors",
                                                           "model.safetensors.index.json"}));
}

TEST(WriterShard, SeveralShardsWriteIndexEvenWhenNotAlways) {
  const ShardInput in = MakeShardInput({4, 4});
  TempDir dir;
  ShardOptions options;
  options.max_shard_size = 4;
  options.always_write_index = false;
  options.write = NoSync();
  auto r = WriteSharded(dir.path(), in.tensors, {}, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ListDir(dir.path()), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors",
                                                           "model.safetensors.index.json"}));
}

TEST(WriterShard, EmptyTensorListGivesOneEmptyShard) {
  TempDir dir;
  auto r = WriteSharded(dir.path(), {}, {{"format", "pt"}}, Plain());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ReadBytes(dir.Join("model.safetensors")),
            Le64(32) + R"({"__metadata__":{"format":"pt"}})");
  EXPECT_EQ(ReadBytes(dir.Join("model.safetensors.index.json")),
            "{\n  \"metadata\": {\n    \"total_size\": 0\n  },\n  \"weight_map\": {}\n}\n");
}

TEST(WriterShard, CreatesMissingDirectories) {
  TempDir dir;
  const std::string target = dir.Join("a/b/c");
  const ShardInput in = MakeShardInput({1});
  auto r = WriteSharded(target, in.tensors);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ListDir(target),
            (std::vector<std::string>{"model.safetensors", "model.safetensors.index.json"}));
}

TEST(WriterShard, DirectoryThatIsAFileIsIoError) {
  TempDir dir;
  WriteBytes(dir.Join("file"), "x");
  auto r = WriteSharded(dir.Join("file"), {});
  EXPECT_EQ(r.status().code(), Code::kIoError) << r.status().ToString();
}

TEST(WriterShard, BadPrefixRefused) {
  for (const std::string& prefix :
       std::vector<std::string>{"", "a/b", ".", "..", std::string("a\0b", 3), "bad\xff"}) {
    TempDir dir;
    ShardOptions options;
    options.prefix = prefix;
    auto r = WriteSharded(dir.Join("out"), {}, {}, options);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << ::testing::PrintToString(prefix);
    EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{});
  }
}

TEST(WriterShard, FailingShardRemovesShardsAlreadyWritten) {
  ShardInput in = MakeShardInput({4, 4, 4});
  in.tensors[2] = Generated("w2", DType::kU8, {4}, 0);
  in.tensors[2].generate = [](uint64_t, std::span<std::byte>) {
    return Status(Code::kIoError, "source gone");
  };
  TempDir dir;
  ShardOptions options;
  options.max_shard_size = 4;
  options.write = NoSync();
  auto r = WriteSharded(dir.path(), in.tensors, {}, options);
  EXPECT_EQ(r.status().code(), Code::kIoError);
  ExpectMessageHas(r.status(), {"\"w2\"", "source gone"}, "shard");
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{});
}

// --- WriteSharded: all or nothing
// -----------------------------------------------------------------------------------

// Every file of `dir` (hidden ones included) with its bytes.
std::vector<std::pair<std::string, std::string>> Snapshot(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& name : ListDir(dir)) out.emplace_back(name, ReadBytes(dir + "/" + name));
  return out;
}

// An older checkpoint in `dir`: tensors w0..w5 of 4 bytes in 3 shards with an index, written
// with seed 100 (other bytes than MakeShardInput's), and an unrelated file of the user.
void WriteOldLayout(const std::string& dir) {
  std::vector<TensorToWrite> old;
  for (unsigned i = 0; i < 6; ++i)
    old.push_back(Generated(Numbered("w", i), DType::kU8, {4}, 100 + i));
  ShardOptions options;
  options.max_shard_size = 8;
  options.write = NoSync();
  auto r = WriteSharded(dir, old, {}, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 4u);
  WriteBytes(dir + "/notes.txt", "the user's own file");
}

// The new layout: 2 shards of 8 bytes (w0..w3), with sync so directory fsyncs happen too.
ShardOptions TwoShards(Env* env) {
  ShardOptions options;
  options.max_shard_size = 8;
  options.write.env = env;
  options.write.buffer_size = 4;    // several appends per file
  options.write.checksums = false;  // compared with the reference layout byte for byte
  return options;
}

TEST(WriterShardAtomic, SuccessReplacesTheOlderLayoutAndNothingElse) {
  TempDir dir;
  WriteOldLayout(dir.path());
  const ShardInput in = MakeShardInput({4, 4, 4, 4});
  auto r = WriteSharded(dir.path(), in.tensors, {}, TwoShards(nullptr));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ListDir(dir.path()),
            (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors",
                                      "model.safetensors.index.json", "notes.txt"}));
  EXPECT_EQ(ReadBytes(dir.Join("notes.txt")), "the user's own file");
  EXPECT_EQ(ReadBytes(dir.Join("model-00001-of-00002.safetensors")),
            ExpectedShard(in.tensors, {0, 1}, {}));
}

TEST(WriterShardAtomic, SingleFileAndShardedLayoutsReplaceEachOther) {
  TempDir dir;
  const ShardInput in = MakeShardInput({4, 4, 4, 4});
  ShardOptions single;
  single.always_write_index = false;
  single.write = NoSync();
  ASSERT_TRUE(WriteSharded(dir.path(), in.tensors, {}, single).ok());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"model.safetensors"});
  ASSERT_TRUE(WriteSharded(dir.path(), in.tensors, {}, TwoShards(nullptr)).ok());
  // The old single file would shadow nothing, but is the same checkpoint's stale copy: removed.
  EXPECT_EQ(ListDir(dir.path()), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors",
                                                           "model.safetensors.index.json"}));
  ASSERT_TRUE(WriteSharded(dir.path(), in.tensors, {}, single).ok());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"model.safetensors"});
}

TEST(WriterShardAtomic, OnlyFilesTheOldIndexNamesAreRemoved) {
  TempDir dir;
  WriteBytes(
      dir.Join("model.safetensors.index.json"),
      R"({"weight_map": {"a": "keep.txt", "b": "old.safetensors", "c": "sub/x.safetensors"}})");
  WriteBytes(dir.Join("keep.txt"), "k");
  WriteBytes(dir.Join("old.safetensors"), "o");
  const ShardInput in = MakeShardInput({4});
  ShardOptions options;
  options.write = NoSync();
  ASSERT_TRUE(WriteSharded(dir.path(), in.tensors, {}, options).ok());
  EXPECT_EQ(ListDir(dir.path()), (std::vector<std::string>{"keep.txt", "model.safetensors",
                                                           "model.safetensors.index.json"}));
}

TEST(WriterShardAtomic, NoSpaceOnAnyWriteLeavesTheDirectoryExactlyAsBefore) {
  // How many appends a successful write makes.
  const ShardInput in = MakeShardInput({4, 4, 4, 4});
  testing::FaultInjectionEnv counting;
  {
    TempDir probe;
    ASSERT_TRUE(WriteSharded(probe.path(), in.tensors, {}, TwoShards(&counting)).ok());
  }
  const uint64_t appends = counting.appends();
  ASSERT_GE(appends, 6u);
  for (uint64_t k = 1; k <= appends; ++k) {
    TempDir dir;
    WriteOldLayout(dir.path());
    const auto before = Snapshot(dir.path());
    testing::FaultInjectionEnv env({.fail_append = k});
    auto r = WriteSharded(dir.path(), in.tensors, {}, TwoShards(&env));
    ASSERT_FALSE(r.ok()) << "append " << k;
    EXPECT_EQ(r.status().code(), Code::kIoError);
    ExpectMessageHas(r.status(), {dir.path(), "No space left on device", "offset"}, "enospc");
    EXPECT_EQ(Snapshot(dir.path()), before) << "append " << k;
  }
}

TEST(WriterShardAtomic, FailingRenameOrSyncAtAnyStepIsUndone) {
  const ShardInput in = MakeShardInput({4, 4, 4, 4});
  testing::FaultInjectionEnv counting;
  {
    TempDir probe;
    WriteOldLayout(probe.path());
    ASSERT_TRUE(WriteSharded(probe.path(), in.tensors, {}, TwoShards(&counting)).ok());
  }
  // 7 names to move aside (the 3 new ones, the single-file name, the 3 old shards; the index is
  // both), of which 3 do not exist, then 3 new files renamed in.
  const uint64_t renames = counting.renames();
  ASSERT_EQ(renames, 10u);
  std::vector<testing::FaultInjectionEnv::Faults> faults;
  for (uint64_t k = 1; k <= renames; ++k) faults.push_back({.fail_rename = k});
  for (uint64_t k = 1; k <= 3; ++k) faults.push_back({.fail_sync = k});
  faults.push_back({.fail_sync_directory = 1});
  for (size_t i = 0; i < faults.size(); ++i) {
    TempDir dir;
    WriteOldLayout(dir.path());
    const auto before = Snapshot(dir.path());
    testing::FaultInjectionEnv env(faults[i]);
    auto r = WriteSharded(dir.path(), in.tensors, {}, TwoShards(&env));
    ASSERT_FALSE(r.ok()) << "case " << i;
    EXPECT_EQ(r.status().code(), Code::kIoError) << r.status().ToString();
    EXPECT_EQ(Snapshot(dir.path()), before) << "case " << i << ": " << r.status().ToString();
  }
}

TEST(WriterShardAtomic, FailureRemovesTheDirectoryItCreated) {
  TempDir dir;
  const ShardInput in = MakeShardInput({4, 4});
  testing::FaultInjectionEnv env({.fail_append = 2});
  auto r = WriteSharded(dir.Join("new"), in.tensors, {}, TwoShards(&env));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{});
}

TEST(WriterShardAtomic, FailureRemovesEveryFolderLevelItCreated) {
  TempDir dir;
  const ShardInput in = MakeShardInput({4, 4});
  testing::FaultInjectionEnv env({.fail_append = 2});
  auto r = WriteSharded(dir.Join("a/b/c/"), in.tensors, {}, TwoShards(&env));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{});
}

// Two folders written as one unit, each complete: until Commit() they go together, by the
// destructor or by the signal path, with the levels of the root the transaction made; a folder
// that existed, and files the transaction was not given, stay.
TEST(DirectoryTransaction, UncommittedFoldersGoWithTheLevelsItCreated) {
  for (const bool by_signal : {false, true}) {
    TempDir dir;
    const std::string root = dir.Join("x/y");
    {
      auto t = DirectoryTransaction::Create(root);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      ASSERT_TRUE(std::filesystem::is_directory(root));
      for (const std::string rank : {"r0", "r1"}) {
        std::filesystem::create_directories(root + "/" + rank);
        WriteBytes(root + "/" + rank + "/m.safetensors", "bytes");
        t->Add(root + "/" + rank, {root + "/" + rank + "/m.safetensors"});
      }
      if (by_signal) {
        AbandonWritesInProgress();
        EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{}) << "by the signal path";
      }
    }
    EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{}) << by_signal;
  }
  // Committed: kept. In a folder that existed: the folder stays, and so does a foreign file.
  TempDir dir;
  {
    auto t = DirectoryTransaction::Create(dir.path());
    ASSERT_TRUE(t.ok());
    std::filesystem::create_directories(dir.Join("r0"));
    WriteBytes(dir.Join("r0/m.safetensors"), "bytes");
    WriteBytes(dir.Join("r0/notes.txt"), "mine");
    t->Add(dir.Join("r0"), {dir.Join("r0/m.safetensors")});
  }
  EXPECT_EQ(ListDir(dir.Join("r0")), std::vector<std::string>{"notes.txt"});
  {
    auto t = DirectoryTransaction::Create(dir.Join("k"));
    ASSERT_TRUE(t.ok());
    WriteBytes(dir.Join("k/m.safetensors"), "bytes");
    t->Add(dir.Join("k"), {dir.Join("k/m.safetensors")});
    t->Commit();
  }
  EXPECT_EQ(ReadBytes(dir.Join("k/m.safetensors")), "bytes");
  // The path as the write will use it: "link/../x" is x beside the link's target.
  std::filesystem::create_directories(dir.Join("real/sub"));
  std::filesystem::create_directory_symlink("real/sub", dir.Join("link"));
  {
    auto t = DirectoryTransaction::Create(dir.Join("link/../x"));
    ASSERT_TRUE(t.ok());
    EXPECT_TRUE(std::filesystem::is_directory(dir.Join("real/x")));
    EXPECT_FALSE(std::filesystem::exists(dir.Join("x")));
  }
  EXPECT_FALSE(std::filesystem::exists(dir.Join("real/x")));
  // A level that cannot be made is an error naming the root.
  WriteBytes(dir.Join("file"), "x");
  auto bad = DirectoryTransaction::Create(dir.Join("file/sub"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kIoError);
  EXPECT_NE(bad.status().message().find(dir.Join("file/sub")), std::string::npos)
      << bad.status().ToString();
}

// Found by a review: the levels a sharded write (or a transaction) made were never synced into
// the directories holding them, so a crash after the write reported success could lose the whole
// new folder. Now each is, innermost first, with the folder itself; without sync, none is.
TEST(DirectoryTransaction, TheLevelsItMadeAreSyncedIntoTheirParents) {
  TempDir dir;
  const ShardInput in = MakeShardInput({4, 4});
  for (const bool sync : {true, false}) {
    SCOPED_TRACE(sync);
    const std::string root = dir.Join(sync ? "a" : "n");
    testing::FaultInjectionEnv env;
    ShardOptions o = TwoShards(&env);
    o.write.sync = sync;
    auto r = WriteSharded(root + "/b/c/", in.tensors, {}, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const std::vector<std::string> synced = env.synced_directories();
    for (const std::string& d : {root + "/b", root, dir.path()}) {
      EXPECT_EQ(std::count(synced.begin(), synced.end(), d), sync ? 1 : 0) << d;
    }
    if (!sync) {
      EXPECT_EQ(synced, std::vector<std::string>{});
    }
  }
  // A failing fsync of a level fails the write, naming that directory (as a file's directory
  // fsync does, after the rename: the files are in place).
  testing::FaultInjectionEnv env;
  ShardOptions o = TwoShards(&env);
  auto r = WriteSharded(dir.Join("f/g"), in.tensors, {}, o);
  ASSERT_TRUE(r.ok());
  const size_t syncs = env.synced_directories().size();
  env.SetFaults({.fail_sync_directory = syncs});  // the last of the next write's (counts restart)
  r = WriteSharded(dir.Join("h/i"), in.tensors, {}, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(dir.path() + ": fsync of directory failed"),
            std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(ListDir(dir.Join("h/i")), ListDir(dir.Join("f/g")));
  EXPECT_FALSE(ListDir(dir.Join("h/i")).empty());
  // The transaction alone: each level made, and the folder holding the outermost.
  auto t = DirectoryTransaction::Create(dir.Join("t/u"));
  ASSERT_TRUE(t.ok());
  testing::FaultInjectionEnv counting;
  ASSERT_TRUE(t->SyncCreated(&counting).ok());
  EXPECT_EQ(counting.synced_directories(), (std::vector<std::string>{dir.Join("t"), dir.path()}));
}

// Found by a review: a rank folder whose rename into place failed (the name taken meanwhile by
// something else) was still the transaction's, so its cleanup removed files it never wrote.
// Forget() hands an added folder back: the destructor and the signal path leave it.
TEST(DirectoryTransaction, AForgottenFolderIsLeftAsItIs) {
  for (const bool by_signal : {false, true}) {
    TempDir dir;
    {
      auto t = DirectoryTransaction::Create(dir.Join("root"));
      ASSERT_TRUE(t.ok());
      std::filesystem::create_directories(dir.Join("root/theirs"));
      WriteBytes(dir.Join("root/theirs/model.safetensors"), "not ours");
      std::filesystem::create_directories(dir.Join("root/ours"));
      WriteBytes(dir.Join("root/ours/model.safetensors"), "ours");
      t->Add(dir.Join("root/ours"), {dir.Join("root/ours/model.safetensors")});
      t->Add(dir.Join("root/theirs"), {dir.Join("root/theirs/model.safetensors")});
      t->Forget(dir.Join("root/theirs"));
      if (by_signal) AbandonWritesInProgress();
    }
    EXPECT_EQ(ReadBytes(dir.Join("root/theirs/model.safetensors")), "not ours") << by_signal;
    EXPECT_FALSE(std::filesystem::exists(dir.Join("root/ours"))) << by_signal;
  }
}

// One writer of a root at a time (two `reshard --tp` into one destination would write the same
// hidden partial folders and remove each other's): a second transaction is refused at once,
// naming the root and the holder, and touches nothing; the lock goes with Commit().
TEST(DirectoryTransaction, ASecondWriterOfTheRootIsRefusedAtOnce) {
  TempDir dir;
  const std::string root = dir.Join("out");
  const std::string lock_file = root + "/" + std::string(kDirectoryLockName);
  auto first = DirectoryTransaction::Create(root);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(std::filesystem::exists(lock_file));
  std::filesystem::create_directories(root + "/.rank-00000-of-00002.partial");
  WriteBytes(root + "/.rank-00000-of-00002.partial/m.safetensors", "bytes");

  auto second = DirectoryTransaction::Create(root);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kIoError);
  EXPECT_EQ(second.status().message(),
            root + ": another writer is writing this directory (" + lock_file +
                " is held by another thread of this process (pid " + std::to_string(::getpid()) +
                ")); nothing was written: wait for it to finish, or choose another destination");
  EXPECT_EQ(ReadBytes(root + "/.rank-00000-of-00002.partial/m.safetensors"), "bytes");
  // Another thread is refused the same way.
  Status from_thread;
  std::thread([&] { from_thread = DirectoryTransaction::Create(root).status(); }).join();
  EXPECT_EQ(from_thread.message(), second.status().message());
  // A sharded write inside the locked root (reshard without --tp) takes no lock of its own.
  const std::vector<std::byte> bytes(16, std::byte{1});
  const std::vector<TensorToWrite> tensors = {{"w", DType::kU8, {16}, bytes, nullptr}};
  ASSERT_TRUE(WriteSharded(root, tensors).ok());

  first->Commit();
  EXPECT_FALSE(std::filesystem::exists(lock_file));
  EXPECT_EQ(ListDir(root),
            (std::vector<std::string>{".rank-00000-of-00002.partial", "model.safetensors",
                                      "model.safetensors.index.json"}));
  auto third = DirectoryTransaction::Create(root);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
}

// Another process's transaction is refused with its pid; when that process dies holding it (its
// lock file stays), the next transaction takes the root over, and leaves no lock file behind.
TEST(DirectoryTransaction, AnotherProcessIsNamedAndItsCrashLeavesNoStaleLock) {
  TempDir dir;
  const std::string root = dir.Join("out");
  int ready[2], done[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    ::close(done[1]);
    auto t = DirectoryTransaction::Create(root);
    const char c = t.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &c, 1);
    char go;
    (void)!::read(done[0], &go, 1);
    ::_exit(0);  // no destructor runs: as a crash
  }
  ::close(ready[1]);
  ::close(done[0]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  auto refused = DirectoryTransaction::Create(root);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(testing::Contains(refused.status().message(),
                                root + ": another writer is writing this directory (" + root + "/" +
                                    std::string(kDirectoryLockName) + " is held by pid " +
                                    std::to_string(child) + " ("));
  EXPECT_TRUE(testing::Contains(refused.status().message(),
                                ": writing " + root + " as one unit (DirectoryTransaction))"));
  EXPECT_TRUE(std::filesystem::is_directory(root)) << "the holder's folder stays";
  ::close(done[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(ready[0]);
  EXPECT_EQ(ListDir(root), std::vector<std::string>{std::string(kDirectoryLockName)});
  {
    auto t = DirectoryTransaction::Create(root);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
  }
  EXPECT_EQ(ListDir(root), std::vector<std::string>{});
}

TEST(WriterShardAtomic, AbandonWritesInProgressRemovesTemporaries) {
  // What the CLI's signal handler does, called from inside the write: the first shard's complete
  // temporary and the second's partial one disappear at once; the old layout is untouched.
  TempDir dir;
  WriteOldLayout(dir.path());
  const auto before = Snapshot(dir.path());
  ShardInput in = MakeShardInput({4, 4, 4, 4});
  std::vector<std::string> seen_during;
  bool had_temporaries = false;
  in.tensors[2] = Generated("w2", DType::kU8, {4}, 0);
  in.tensors[2].generate = [&](uint64_t, std::span<std::byte>) {
    for (const std::string& name : ListDir(dir.path())) {
      had_temporaries = had_temporaries || name.find(".tmp-") != std::string::npos;
    }
    AbandonWritesInProgress();
    seen_during = ListDir(dir.path());
    return Status(Code::kIoError, "interrupted");
  };
  auto r = WriteSharded(dir.path(), in.tensors, {}, TwoShards(nullptr));
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(had_temporaries);
  std::vector<std::string> before_names;
  for (const auto& [name, bytes] : before) before_names.push_back(name);
  EXPECT_EQ(seen_during, before_names);
  EXPECT_EQ(Snapshot(dir.path()), before);
}

// --- against files written by the reference (tests/data/reference, safetensors 0.8)
// ----------------

std::vector<std::byte> FromHex(std::string_view hex) {
  std::vector<std::byte> out(hex.size() / 2);
  const auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::byte>(nibble(hex[2 * i]) * 16 + nibble(hex[2 * i + 1]));
  }
  return out;
}

TEST(WriterReference, ByteIdenticalToReferenceFiles) {
  const std::string ref_dir = std::string(TENSORFERRY_SOURCE_DIR) + "/tests/data/reference";
  simdjson::dom::parser parser;
  simdjson::dom::element manifest;
  ASSERT_EQ(parser.load(ref_dir + "/manifest.json").get(manifest), simdjson::SUCCESS);
  simdjson::dom::object files;
  ASSERT_EQ(manifest["files"].get(files), simdjson::SUCCESS);
  size_t checked = 0;
  TempDir dir;
  for (auto [file_key, file] : files) {
    const std::string name(file_key);
    std::vector<std::vector<std::byte>> storage;
    std::vector<TensorToWrite> tensors;
    simdjson::dom::array entries;
    ASSERT_EQ(file["tensors"].get(entries), simdjson::SUCCESS) << name;
    storage.reserve(entries.size());
    for (simdjson::dom::element e : entries) {
      std::string_view tname, dtype, hex;
      ASSERT_EQ(e["name"].get(tname), simdjson::SUCCESS);
      ASSERT_EQ(e["dtype"].get(dtype), simdjson::SUCCESS);
      ASSERT_EQ(e["data"].get(hex), simdjson::SUCCESS);
      std::vector<uint64_t> shape;
      for (simdjson::dom::element d : e["shape"].get_array()) shape.push_back(d.get_uint64());
      const auto dt = DTypeFromName(dtype);
      ASSERT_TRUE(dt.has_value()) << dtype;
      storage.push_back(FromHex(hex));
      tensors.push_back(Tensor(std::string(tname), *dt, shape, storage.back()));
    }
    Metadata metadata;
    for (auto [k, v] : file["metadata"].get_object()) {
      metadata.emplace_back(std::string(k), std::string(v.get_string().value()));
    }
    const std::string expected = ReadBytes(ref_dir + "/" + name + ".safetensors");
    auto h = SerializeHeader(tensors, metadata);
    ASSERT_TRUE(h.ok()) << name << ": " << h.status().ToString();
    EXPECT_EQ(Le64(h->json.size()) + h->json, expected.substr(0, 8 + h->json.size())) << name;
    const std::string path = dir.Join(name);
    ASSERT_TRUE(WriteFile(path, tensors, metadata, NoSync()).ok()) << name;
    EXPECT_EQ(ReadBytes(path), expected) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 7u);
}

// --- round trips through the parser
// -----------------------------------------------------------------

Header ParseFile(const std::string& path) {
  const std::string bytes = ReadBytes(path);
  const auto span = std::as_bytes(std::span<const char>(bytes.data(), bytes.size()));
  auto h = ParseHeader(span, bytes.size(), {}, path);
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  return h.ok() ? std::move(h).value() : Header{};
}

TEST(WriterRoundTrip, ParsesBackEveryDtypeNameAndMetadata) {
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> tensors;
  for (int d = 0; d < kNumDTypes; ++d) {
    const auto dtype = static_cast<DType>(d);
    const std::vector<uint64_t> shape = {2, 12};
    storage.push_back(Pattern(TensorByteSize(dtype, shape).value(), static_cast<unsigned>(d)));
    tensors.push_back(
        Tensor(Numbered("layer.", static_cast<uint64_t>(d)), dtype, shape, storage.back()));
  }
  storage.push_back({});
  tensors.push_back(Tensor("", DType::kF32, {0}, {}));
  storage.push_back(Pattern(8, 99));
  tensors.push_back(Tensor("q\"\\\n\x01\xe2\x82\xac", DType::kF64, {}, storage.back()));
  tensors.push_back(Generated("gen", DType::kBF16, {3, 5}, 7));
  const Metadata metadata = {{"z", "1"}, {"a\n", "\"v\""}, {"\xc3\xa9", ""}};

  TempDir dir;
  const std::string path = dir.Join("rt.safetensors");
  ASSERT_TRUE(WriteFile(path, tensors, metadata, NoSync()).ok());
  const std::string bytes = ReadBytes(path);
  const Header h = ParseFile(path);
  ASSERT_EQ(h.tensors.size(), tensors.size());
  EXPECT_EQ(h.header_size % 8, 0u);
  EXPECT_TRUE(h.has_metadata);
  EXPECT_EQ(h.metadata, (Metadata{{"a\n", "\"v\""}, {"z", "1"}, {"\xc3\xa9", ""}}));

  auto serialized = SerializeHeader(tensors, metadata);
  ASSERT_TRUE(serialized.ok());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const TensorEntry& e = h.tensors[i];
    const TensorToWrite& t = tensors[serialized->order[i]];
    EXPECT_EQ(e.name, t.name);
    EXPECT_EQ(e.dtype, t.dtype) << t.name;
    EXPECT_EQ(e.shape, t.shape) << t.name;
    const std::string written = bytes.substr(h.data_offset() + e.begin, e.byte_size());
    if (t.generate) {
      EXPECT_EQ(written, Str(Pattern(e.byte_size(), 7))) << t.name;
    } else {
      EXPECT_EQ(written, Str(t.data)) << t.name;
    }
  }
}

TEST(WriterRoundTrip, EmptyMetadataIsAbsent) {
  TempDir dir;
  ASSERT_TRUE(WriteFile(dir.Join("e"), {}, {}, NoSync()).ok());
  const Header h = ParseFile(dir.Join("e"));
  EXPECT_FALSE(h.has_metadata);
  EXPECT_TRUE(h.tensors.empty());
  EXPECT_EQ(h.header_size, 8u);
}

TEST(WriterRoundTrip, EveryShardParsesAndIndexCoversAllTensors) {
  const ShardInput in = MakeShardInput({100, 3, 50, 50, 0, 200, 7});
  TempDir dir;
  ShardOptions options;
  options.max_shard_size = 100;
  options.write = NoSync();
  auto r = WriteSharded(dir.path(), in.tensors, {{"format", "pt"}}, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 6u);  // [w0], [w1 w2], [w3 w4], [w5], [w6] and the index
  std::vector<std::string> seen;
  for (size_t s = 0; s + 1 < r->size(); ++s) {
    const Header h = ParseFile((*r)[s]);
    EXPECT_EQ(h.metadata, (Metadata{{"format", "pt"}}));
    EXPECT_LE(h.data_size, std::max<uint64_t>(100, h.tensors.size() == 1 ? h.data_size : 0));
    for (const auto& e : h.tensors) seen.push_back(e.name);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<std::string>{"w0", "w1", "w2", "w3", "w4", "w5", "w6"}));

  simdjson::dom::parser parser;
  simdjson::dom::element index;
  ASSERT_EQ(parser.load(r->back()).get(index), simdjson::SUCCESS);
  EXPECT_EQ(index["metadata"]["total_size"].get_uint64().value(), 410u);
  EXPECT_EQ(std::string(index["weight_map"]["w4"].get_string().value()),
            "model-00003-of-00005.safetensors");
}

}  // namespace
}  // namespace tensorferry

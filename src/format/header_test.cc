#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "tensorferry/format.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::MakeFile;
using testing::ToBytes;

Result<Header> ParseJson(const std::string& json, uint64_t data_size,
                         const ParseLimits& limits = {}) {
  return ParseHeaderJson(json, data_size, limits, "m.safetensors");
}

Result<Header> ParseBytes(const std::string& file, const ParseLimits& limits = {}) {
  auto bytes = ToBytes(file);
  return ParseHeader(bytes, bytes.size(), limits, "m.safetensors");
}

#define EXPECT_CODE(expr, expected_code)                                      \
  do {                                                                        \
    auto r_ = (expr);                                                         \
    ASSERT_FALSE(r_.ok()) << "expected " << CodeName(expected_code);          \
    EXPECT_EQ(r_.status().code(), expected_code) << r_.status().ToString();   \
    EXPECT_EQ(r_.status().category(), CategoryOf(expected_code));             \
    EXPECT_NE(r_.status().message().find("m.safetensors"), std::string::npos) \
        << r_.status().message();                                             \
  } while (0)

const std::string kOne = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";

TEST(DType, NamesBitsAndRoundTrip) {
  EXPECT_EQ(DTypeBits(DType::kF4), 4u);
  EXPECT_EQ(DTypeBits(DType::kF6_E2M3), 6u);
  EXPECT_EQ(DTypeBits(DType::kF6_E3M2), 6u);
  EXPECT_EQ(DTypeBits(DType::kBool), 8u);
  EXPECT_EQ(DTypeBits(DType::kF8_E8M0), 8u);
  EXPECT_EQ(DTypeBits(DType::kF8_E5M2FNUZ), 8u);
  EXPECT_EQ(DTypeBits(DType::kBF16), 16u);
  EXPECT_EQ(DTypeBits(DType::kC64), 64u);
  EXPECT_EQ(DTypeBits(DType::kU64), 64u);
  for (int i = 0; i < kNumDTypes; ++i) {
    auto d = static_cast<DType>(i);
    auto back = DTypeFromName(DTypeName(d));
    ASSERT_TRUE(back.has_value()) << DTypeName(d);
    EXPECT_EQ(*back, d);
  }
  EXPECT_FALSE(DTypeFromName("f32").has_value());
  EXPECT_FALSE(DTypeFromName("FLOAT").has_value());
  EXPECT_FALSE(DTypeFromName("").has_value());
}

TEST(DType, ByteSizes) {
  const uint64_t s23[] = {2, 3};
  EXPECT_EQ(*TensorByteSize(DType::kBF16, s23), 12u);
  EXPECT_EQ(*TensorByteSize(DType::kF4, s23), 3u);
  const uint64_t s3[] = {3};
  EXPECT_EQ(TensorByteSize(DType::kF4, s3).status().code(), Code::kPartialByte);
  EXPECT_EQ(TensorByteSize(DType::kF6_E2M3, std::span<const uint64_t>(s23, 1)).status().code(),
            Code::kPartialByte)
      << "2 elements of 6 bits is 12 bits";
  const uint64_t s4[] = {4};
  EXPECT_EQ(*TensorByteSize(DType::kF6_E3M2, s4), 3u);
  EXPECT_EQ(*TensorByteSize(DType::kF32, {}), 4u) << "a scalar has one element";
  // The bit count must fit 64 bits, as the reference checks it (elements x bits).
  const uint64_t big[] = {1ull << 59, 2};
  EXPECT_EQ(*TensorByteSize(DType::kU8, big), 1ull << 60) << "2^63 bits fit";
  const uint64_t huge[] = {1ull << 60, 2};
  EXPECT_EQ(TensorByteSize(DType::kU8, huge).status().code(), Code::kOverflow) << "2^64 bits";
  const uint64_t f64[] = {1ull << 58};
  EXPECT_EQ(TensorByteSize(DType::kF64, f64).status().code(), Code::kOverflow);
  const uint64_t bits_overflow[] = {1ull << 61, 2};
  EXPECT_EQ(TensorByteSize(DType::kF64, bits_overflow).status().code(), Code::kOverflow);
  const uint64_t zero[] = {0, 1ull << 63, 5};
  EXPECT_EQ(*TensorByteSize(DType::kF64, zero), 0u);
}

TEST(Header, ValidMinimal) {
  auto h = ParseBytes(MakeFile(kOne, 16));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->header_size, kOne.size());
  EXPECT_EQ(h->data_offset(), 8 + kOne.size());
  EXPECT_EQ(h->data_size, 16u);
  ASSERT_EQ(h->tensors.size(), 1u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[0].dtype, DType::kF32);
  EXPECT_EQ(h->tensors[0].shape, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(h->tensors[0].begin, 0u);
  EXPECT_EQ(h->tensors[0].end, 16u);
  EXPECT_FALSE(h->has_metadata);
}

TEST(Header, EmptyHeaderAndWhitespaceAccepted) {
  ASSERT_TRUE(ParseJson("{}", 0).ok());
  ASSERT_TRUE(ParseJson("{}      ", 0).ok());
  ASSERT_TRUE(ParseJson(" \n\t{ } \r\n", 0).ok());
}

TEST(Header, SortsByOffsetAndKeepsMetadataSorted) {
  const std::string j = R"({"z":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                        R"("__metadata__":{"b":"2","a":"1"},)"
                        R"("a":{"dtype":"U8","shape":[3],"data_offsets":[2,5]},)"
                        R"("e0":{"dtype":"F32","shape":[0,4],"data_offsets":[5,5]},)"
                        R"("s":{"dtype":"I16","shape":[],"data_offsets":[5,7]},)"
                        R"("":{"dtype":"BOOL","shape":[1],"data_offsets":[7,8]}})";
  auto h = ParseJson(j, 8);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 5u);
  EXPECT_EQ(h->tensors[0].name, "z");
  EXPECT_EQ(h->tensors[1].name, "a");
  EXPECT_EQ(h->tensors[2].name, "e0");
  EXPECT_EQ(h->tensors[3].name, "s");
  EXPECT_EQ(h->tensors[4].name, "") << "an empty name is valid";
  EXPECT_TRUE(h->has_metadata);
  ASSERT_EQ(h->metadata.size(), 2u);
  EXPECT_EQ(h->metadata[0].first, "a");
  EXPECT_EQ(h->metadata[1].second, "2");
}

TEST(Header, NullMetadataIsAbsentAsInTheReference) {
  auto h = ParseJson(R"({"__metadata__":null})", 0);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_FALSE(h->has_metadata);
}

TEST(Header, UnknownFieldsIgnored) {
  auto h = ParseJson(
      R"({"a":{"dtype":"U8","extra":{"x":[1,2,{"y":null}]},"shape":[1],"data_offsets":[0,1],"more":1.5}})",
      1);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 1u);
  const TensorEntry& t = h->tensors[0];
  EXPECT_EQ(t.name, "a");
  EXPECT_EQ(t.dtype, DType::kU8);
  EXPECT_EQ(t.shape, (std::vector<uint64_t>{1}));
  EXPECT_EQ(t.begin, 0u);
  EXPECT_EQ(t.end, 1u);
}

TEST(Header, SubByteDtypes) {
  ASSERT_TRUE(ParseJson(R"({"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}})", 3).ok());
  ASSERT_TRUE(ParseJson(R"({"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}})", 3).ok());
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2),
              Code::kPartialByte);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"F6_E3M2","shape":[1],"data_offsets":[0,1]}})", 1),
              Code::kPartialByte);
}

TEST(Header, EveryDtypeParses) {
  for (int i = 0; i < kNumDTypes; ++i) {
    auto d = static_cast<DType>(i);
    uint64_t bytes = 8 * DTypeBits(d) / 8;  // shape [8]
    std::string j = R"({"t":{"dtype":")" + std::string(DTypeName(d)) +
                    R"(","shape":[8],"data_offsets":[0,)" + std::to_string(bytes) + "]}}";
    auto h = ParseJson(j, bytes);
    ASSERT_TRUE(h.ok()) << DTypeName(d) << ": " << h.status().ToString();
    EXPECT_EQ(h->tensors[0].dtype, d);
  }
}

// --- the length prefix ---------------------------------------------------------------------------

TEST(HeaderLength, FileTooSmall) {
  for (size_t n = 0; n < 8; ++n) EXPECT_CODE(ParseBytes(std::string(n, '\0')), Code::kFileTooSmall);
}

TEST(HeaderLength, TooLarge) {
  std::string f = MakeFile(kOne, 16);
  ParseLimits small;
  small.max_header_size = 10;
  EXPECT_CODE(ParseBytes(f, small), Code::kHeaderTooLarge);
  std::string g(16, '\0');
  g[0] = 0x01;
  g[3] = 0x10;  // 268435457 > 100 MB
  EXPECT_CODE(ParseBytes(g), Code::kHeaderTooLarge);
  std::string h(16, '\xff');  // 2^64 - 1: must not overflow 8 + N
  EXPECT_CODE(ParseBytes(h), Code::kHeaderTooLarge);
  ParseLimits unlimited;
  unlimited.max_header_size = UINT64_MAX;
  EXPECT_CODE(ParseBytes(h, unlimited), Code::kHeaderOutOfBounds);
}

TEST(HeaderShape, DimensionsBeyondSignedSixtyFourBitsAreRefused) {
  // An empty tensor may have any dimension the bytes allow; none beyond 2^63-1, which no
  // framework can describe.
  const std::string ok = R"({"a":{"dtype":"F32","shape":[0,9223372036854775807],)"
                         R"("data_offsets":[0,0]}})";
  EXPECT_TRUE(ParseBytes(MakeFile(ok, 0)).ok());
  const std::string big = R"({"a":{"dtype":"F32","shape":[0,9223372036854775808],)"
                          R"("data_offsets":[0,0]}})";
  auto r = ParseBytes(MakeFile(big, 0));
  EXPECT_CODE(r, Code::kInvalidShape);
  EXPECT_NE(r.status().message().find("dimension 1 is 9223372036854775808, more than 2^63-1"),
            std::string::npos)
      << r.status().message();
}

TEST(HeaderLength, NamesWhatTheFileLooksLike) {
  // The usual ways a path names something other than safetensors, each named in the error.
  const struct {
    std::string start;
    const char* said;
  } cases[] = {
      {std::string("PK\x03\x04\x00\x00\x08\x00", 8), "zip archive"},
      {std::string("\x80\x02\x8a\x0al\xfc\x9c"
                   "F",
                   8),
       "Python pickle"},
      {"GGUF\x03\x00\x00\x00", "GGUF"},
      {"version https://git-lfs.github.com/spec/v1\noid sha256:", "Git LFS pointer"},
      {"<!DOCTYPE html><html>", "HTML"},
  };
  for (const auto& c : cases) {
    const std::string file = c.start + std::string(64, ' ');
    auto r = ParseBytes(file);
    ASSERT_FALSE(r.ok()) << c.said;
    EXPECT_NE(r.status().message().find(c.said), std::string::npos) << r.status().message();
  }
  // A plain out-of-bounds length says nothing more.
  std::string f = MakeFile(kOne, 16);
  f[0] = static_cast<char>(f.size() - 7);
  auto r = ParseBytes(f);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find(" (the file "), std::string::npos) << r.status().message();
}

TEST(HeaderLength, OutOfBounds) {
  std::string f = MakeFile(kOne, 16);
  f[0] = static_cast<char>(f.size() - 7);  // one byte past the end
  EXPECT_CODE(ParseBytes(f), Code::kHeaderOutOfBounds);
  std::string exact = MakeFile("{}", 0);
  ASSERT_TRUE(ParseBytes(exact).ok());
  exact.pop_back();
  EXPECT_CODE(ParseBytes(exact), Code::kHeaderOutOfBounds);
}

TEST(HeaderLength, NeedsEnoughBytes) {
  std::string f = MakeFile(kOne, 16);
  auto bytes = ToBytes(f);
  auto r =
      ParseHeader(std::span<const std::byte>(bytes).first(20), bytes.size(), {}, "m.safetensors");
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
}

// --- JSON-level errors
// -------------------------------------------------------------------------------

TEST(Header, Bom) {
  EXPECT_CODE(ParseJson("\xEF\xBB\xBF{}", 0), Code::kHeaderBom);
}

TEST(Header, NotUtf8) {
  EXPECT_CODE(ParseJson("{\"\xff\":{}}", 0), Code::kHeaderNotUtf8);
  EXPECT_CODE(ParseJson("{\"\xc0\xaf\":1}", 0), Code::kHeaderNotUtf8);      // overlong
  EXPECT_CODE(ParseJson("{\"\xed\xa0\x80\":1}", 0), Code::kHeaderNotUtf8);  // surrogate
}

TEST(Header, InvalidJson) {
  EXPECT_CODE(ParseJson("", 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson("   ", 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson("{", 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson("{}x", 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson("{} {}", 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson(std::string("{}\0\0\0\0\0\0", 8), 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson("{'a':1}", 0), Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],}})", 1),
              Code::kHeaderInvalidJson);
  EXPECT_CODE(
      ParseJson(R"({"a":{"dtype":"U8","shape":[99999999999999999999],"data_offsets":[0,1]}})", 1),
      Code::kHeaderInvalidJson);
}

TEST(Header, NotObject) {
  EXPECT_CODE(ParseJson("[]", 0), Code::kHeaderNotObject);
  EXPECT_CODE(ParseJson("\"x\"", 0), Code::kHeaderNotObject);
  EXPECT_CODE(ParseJson("3", 0), Code::kHeaderNotObject);
  EXPECT_CODE(ParseJson("null", 0), Code::kHeaderNotObject);
}

TEST(Header, DepthLimit) {
  ParseLimits limits;
  limits.max_depth = 8;
  auto nest = [](int levels) {
    std::string v = std::string(static_cast<size_t>(levels), '[') + "1" +
                    std::string(static_cast<size_t>(levels), ']');
    return R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":)" + v + "}}";
  };
  // Levels: root object, tensor object, then `levels` arrays.
  EXPECT_TRUE(ParseJson(nest(6), 1, limits).ok());
  EXPECT_CODE(ParseJson(nest(7), 1, limits), Code::kHeaderTooDeep);
  EXPECT_CODE(ParseJson(nest(100000), 1), Code::kHeaderTooDeep);  // the default limit holds
}

TEST(Header, TooManyTensors) {
  ParseLimits limits;
  limits.max_tensors = 2;
  const std::string two =
      R"({"__metadata__":{},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_TRUE(ParseJson(two, 2, limits).ok()) << "metadata does not count";
  const std::string three =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"c":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})";
  EXPECT_CODE(ParseJson(three, 2, limits), Code::kTooManyTensors);
}

TEST(Header, DuplicateKeys) {
  const std::string t = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  // Identical duplicates are refused too.
  EXPECT_CODE(ParseJson("{\"a\":" + t + ",\"a\":" + t + "}", 1), Code::kDuplicateKey);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
              Code::kDuplicateKey);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}})", 1),
              Code::kDuplicateKey);
  EXPECT_CODE(
      ParseJson(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"data_offsets":[0,1]}})", 1),
      Code::kDuplicateKey);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1,"x":2}})", 1),
              Code::kDuplicateKey);
  EXPECT_CODE(
      ParseJson(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[{"k":1,"k":1}]}})", 1),
      Code::kDuplicateKey);
  EXPECT_CODE(ParseJson(R"({"__metadata__":{"k":"1","k":"1"}})", 0), Code::kDuplicateKey);
  EXPECT_CODE(ParseJson(R"({"__metadata__":{},"__metadata__":{}})", 0), Code::kDuplicateKey);
}

TEST(Header, Metadata) {
  EXPECT_CODE(ParseJson(R"({"__metadata__":[]})", 0), Code::kMetadataNotObject);
  EXPECT_CODE(ParseJson(R"({"__metadata__":"x"})", 0), Code::kMetadataNotObject);
  EXPECT_CODE(ParseJson(R"({"__metadata__":{"a":1}})", 0), Code::kMetadataNotString);
  EXPECT_CODE(ParseJson(R"({"__metadata__":{"a":null}})", 0), Code::kMetadataNotString);
  EXPECT_CODE(ParseJson(R"({"__metadata__":{"a":{"b":"c"}}})", 0), Code::kMetadataNotString);
  auto h = ParseJson(R"({"__metadata__":{"format":"pt","\n":"\u00e9"}})", 0);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->metadata[0].first, "\n");
  EXPECT_EQ(h->metadata[0].second, "\xc3\xa9");
}

TEST(Header, TensorEntryErrors) {
  EXPECT_CODE(ParseJson(R"({"a":[1]})", 0), Code::kTensorNotObject);
  EXPECT_CODE(ParseJson(R"({"a":"x"})", 0), Code::kTensorNotObject);
  EXPECT_CODE(ParseJson(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1), Code::kMissingField);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1), Code::kMissingField);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[1]}})", 1), Code::kMissingField);
  EXPECT_CODE(ParseJson(R"({"a":{}})", 0), Code::kMissingField);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4),
              Code::kUnknownDtype);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", 4),
              Code::kUnknownDtype);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", 4),
              Code::kUnknownDtype);
  for (const char* shape : {"[-1]", "[1.0]", "[\"1\"]", "[null]", "1", "{}", "[[1]]", "[1e2]",
                            "[18446744073709551616]"}) {
    auto r = ParseJson(
        std::string(R"({"a":{"dtype":"U8","shape":)") + shape + R"(,"data_offsets":[0,1]}})", 1);
    ASSERT_FALSE(r.ok()) << shape;
    EXPECT_TRUE(r.status().code() == Code::kInvalidShape ||
                r.status().code() == Code::kHeaderInvalidJson)
        << shape << " " << r.status().ToString();
  }
  for (const char* off : {"[0]", "[0,1,2]", "[-1,0]", "[0,1.5]", "\"0,1\"", "null", "[]", "{}"}) {
    auto r =
        ParseJson(std::string(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":)") + off + "}}", 1);
    EXPECT_EQ(r.status().code(), Code::kInvalidOffsets) << off << " " << r.status().ToString();
  }
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", 1),
              Code::kOffsetsReversed);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
              Code::kSizeMismatch);
  EXPECT_CODE(
      ParseJson(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
      Code::kOverflow);
}

TEST(Header, NegativeZeroRefusedAsTheReferenceDoes) {
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}})", 0),
              Code::kHeaderInvalidJson);
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[-0, 0]}})", 0),
              Code::kHeaderInvalidJson);
  // Not a -0 token: inside a string, a float, or another number.
  EXPECT_TRUE(
      ParseJson(
          R"({"a-0":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":[-0.5,-0e1,-1,"-0"]}})", 0)
          .ok());
}

TEST(Header, RankLimit) {
  std::string shape = "[";
  for (int i = 0; i < 65; ++i) shape += i ? ",1" : "1";
  shape += "]";
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,1]}})", 1),
              Code::kRankTooLarge);
  ParseLimits l;
  l.max_rank = 65;
  EXPECT_TRUE(
      ParseJson(R"({"a":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,1]}})", 1, l)
          .ok());
}

// --- tiling of the data buffer
// -------------------------------------------------------------------------

TEST(Header, Tiling) {
  // Hole at the start.
  EXPECT_CODE(ParseJson(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2),
              Code::kDataGap);
  // Hole between tensors.
  EXPECT_CODE(
      ParseJson(
          R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
          3),
      Code::kDataGap);
  // Overlap.
  EXPECT_CODE(
      ParseJson(
          R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
          2),
      Code::kDataOverlap);
  // Same range twice (aliasing) is an overlap.
  EXPECT_CODE(
      ParseJson(
          R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
          2),
      Code::kDataOverlap);
  // Trailing bytes.
  EXPECT_CODE(ParseJson(kOne, 17), Code::kDataTrailing);
  EXPECT_CODE(ParseJson("{}", 1), Code::kDataTrailing);
  // Past the end of the file.
  EXPECT_CODE(ParseJson(kOne, 15), Code::kDataTruncated);
  // Zero-size tensors may share an offset.
  EXPECT_TRUE(
      ParseJson(
          R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
          1)
          .ok());
  // Huge offsets near 2^64 must not wrap.
  EXPECT_CODE(
      ParseJson(
          R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}})",
          0),
      Code::kDataGap);
}

TEST(Header, MessagesNameTensorAndValues) {
  auto r = ParseJson(R"({"layers.0.w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4);
  ASSERT_FALSE(r.ok());
  const std::string m = r.status().message();
  EXPECT_NE(m.find("m.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("\"layers.0.w\""), std::string::npos) << m;
  EXPECT_NE(m.find("[0, 4]"), std::string::npos) << m;
  EXPECT_NE(m.find("8 bytes"), std::string::npos) << m;
  // A name with a newline stays on one line.
  auto r2 = ParseJson("{\"a\\nb\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().message().find('\n'), std::string::npos) << r2.status().message();
}

// --- corruption: mutate every byte of the prefix and many bytes of the JSON of a valid file
// ---------

TEST(HeaderCorruption, SingleByteMutationsNeverCrash) {
  const std::string j =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[3,4],"data_offsets":[0,24]},"b":{"dtype":"F32","shape":[4],"data_offsets":[24,40]}})";
  const std::string base = MakeFile(j, 40);
  ASSERT_TRUE(ParseBytes(base).ok());
  int rejected = 0;
  const unsigned char values[] = {0x00, 0x01, 0x22, 0x2c, 0x30, 0x39,
                                  0x5b, 0x5d, 0x7b, 0x7d, 0x80, 0xff};
  for (size_t pos = 0; pos < 8 + j.size(); ++pos) {
    for (unsigned char v : values) {
      std::string f = base;
      if (static_cast<unsigned char>(f[pos]) == v) continue;
      f[pos] = static_cast<char>(v);
      auto r = ParseBytes(f);
      if (!r.ok()) {
        ++rejected;
        EXPECT_FALSE(r.status().message().empty());
        EXPECT_EQ(r.status().category(), r.status().code() == Code::kInvalidArgument
                                             ? Category::kInvalidArgument
                                             : Category::kCorrupt)
            << r.status().ToString();
      } else {
        // Anything accepted must still tile the buffer.
        uint64_t end = 0;
        for (const auto& t : r->tensors) {
          EXPECT_EQ(t.begin, end);
          end = t.end;
        }
        EXPECT_EQ(end, r->data_size);
      }
    }
  }
  EXPECT_GT(rejected, 500);
}

TEST(HeaderCorruption, OffsetsMutated) {
  // Every pair of a set of offsets around the right ones (0, 24) and the file's ends: only the
  // right pair parses (the others overlap b, leave a gap, are inverted or run past the data).
  const uint64_t offsets[] = {0, 1, 2, 3, 12, 22, 23, 24, 25, 26, 39, 40, 41, 48, 1u << 20};
  int accepted = 0;
  for (uint64_t a : offsets) {
    for (uint64_t b : offsets) {
      std::string j = R"({"w":{"dtype":"BF16","shape":[3,4],"data_offsets":[)" + std::to_string(a) +
                      "," + std::to_string(b) +
                      R"(]},"b":{"dtype":"F32","shape":[4],"data_offsets":[24,40]}})";
      auto r = ParseBytes(MakeFile(j, 40));
      EXPECT_EQ(r.ok(), a == 0 && b == 24) << a << "," << b << " " << r.status().ToString();
      accepted += r.ok() ? 1 : 0;
    }
  }
  EXPECT_EQ(accepted, 1);
}

TEST(HeaderCorruption, LengthPrefixMutated) {
  const std::string base = MakeFile(kOne, 16);
  for (uint64_t n = 0; n < base.size() + 4; ++n) {
    std::string f = base;
    for (int i = 0; i < 8; ++i)
      f[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
    auto r = ParseBytes(f);
    EXPECT_EQ(r.ok(), n == kOne.size()) << n << " " << r.status().ToString();
  }
}

}  // namespace
}  // namespace tensorferry

#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "integrity/xxh3_isa.h"
#include "tensorferry/integrity.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

std::vector<std::byte> Bytes(size_t n, uint8_t seed = 1) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<uint8_t>(i * 31 + seed));
  return v;
}

std::span<const std::byte> Span(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// Every instruction-set variant of XXH3 the CPU can run gives the baseline's hash, for sizes around
// XXH3's internal boundaries (16, 128, 240 bytes, its 1 KiB stripes and 64-byte blocks) and for
// unaligned starts; the dispatcher's choice is one of them.
TEST(Checksums, InstructionSetVariantsAgree) {
  using namespace integrity_internal;
  std::vector<uint64_t (*)(const void*, size_t) noexcept> variants = {&Xxh3Widest};
  std::vector<std::string> names = {std::string("widest (") + Xxh3WidestName() + ")"};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx2")) {
    variants.push_back(&Xxh3Avx2);
    names.push_back("avx2");
  }
  if (__builtin_cpu_supports("avx512f")) {
    variants.push_back(&Xxh3Avx512);
    names.push_back("avx512");
  }
#endif
  const std::vector<std::byte> data = Bytes(70000, 7);
  for (size_t size : {0, 1, 3, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4096, 65536, 69990}) {
    for (size_t start : {0, 1, 7}) {
      const uint64_t want = Xxh3Baseline(data.data() + start, size);
      for (size_t v = 0; v < variants.size(); ++v) {
        EXPECT_EQ(variants[v](data.data() + start, size), want)
            << names[v] << ", " << size << " bytes at +" << start;
      }
    }
  }
  const std::string widest = Xxh3WidestName();
  EXPECT_TRUE(widest == "avx512" || widest == "avx2" || widest == "baseline") << widest;
}

// Streaming XXH3 (every variant's reset/update/digest, and Xxh3Stream) gives the one-shot hash of
// the concatenated pieces, whatever the piece sizes (across xxHash's 256-byte internal buffer and
// its 1 KiB stripes), and a stream may be digested, continued and reset.
TEST(Checksums, StreamingMatchesOneShot) {
  using namespace integrity_internal;
  struct Variant {
    const char* name;
    void (*reset)(Xxh3State*) noexcept;
    void (*update)(Xxh3State*, const void*, size_t) noexcept;
    uint64_t (*digest)(const Xxh3State*) noexcept;
  };
  std::vector<Variant> variants = {
      {"baseline", &Xxh3BaselineReset, &Xxh3BaselineUpdate, &Xxh3BaselineDigest}};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx2"))
    variants.push_back({"avx2", &Xxh3Avx2Reset, &Xxh3Avx2Update, &Xxh3Avx2Digest});
  if (__builtin_cpu_supports("avx512f"))
    variants.push_back({"avx512", &Xxh3Avx512Reset, &Xxh3Avx512Update, &Xxh3Avx512Digest});
#endif
  const std::vector<std::byte> data = Bytes(300000, 11);
  for (size_t size : {0, 1, 240, 241, 1024, 4097, 300000}) {
    const uint64_t want = Xxh3Baseline(data.data(), size);
    for (size_t piece : {1, 7, 255, 256, 1024, 65536, 300000}) {
      if (piece < 64 && size > 5000) continue;  // byte-sized pieces over small sizes only
      for (const Variant& v : variants) {
        Xxh3State state;
        v.reset(&state);
        for (size_t at = 0; at < size; at += piece) {
          v.update(&state, data.data() + at, std::min(piece, size - at));
        }
        EXPECT_EQ(v.digest(&state), want) << v.name << ", " << size << " bytes by " << piece;
      }
      Xxh3Stream stream;
      for (size_t at = 0; at < size; at += piece) {
        stream.Update(data.data() + at, std::min(piece, size - at));
        EXPECT_EQ(stream.Digest(), Xxh3Baseline(data.data(), std::min(at + piece, size)));
      }
      EXPECT_EQ(stream.Digest(), want) << "Xxh3Stream, " << size << " bytes by " << piece;
      stream.Reset();
      EXPECT_EQ(stream.Digest(), Xxh3Baseline(nullptr, 0));
    }
  }
}

TEST(Checksums, KnownValues) {
  // XXH3-64 of the empty input (xxHash's published test vector).
  EXPECT_EQ(ChecksumChunk({}), 0x2d06800538d394c2ull);
  EXPECT_EQ(DigestHex(0x2d06800538d394c2ull), "2d06800538d394c2");
  // A tensor of 0 bytes has no chunk: its digest is XXH3-64 of nothing.
  const TensorChecksum empty = ComputeTensorChecksum({}, 1024);
  EXPECT_TRUE(empty.chunks.empty());
  EXPECT_EQ(empty.digest, 0x2d06800538d394c2ull);
  // The worked example of docs/integrity.md.
  const TensorChecksum abc = ComputeTensorChecksum(Span("abc"), 1024);
  ASSERT_EQ(abc.chunks.size(), 1u);
  EXPECT_EQ(abc.chunks[0], 0x78af5f94892f3950ull);  // XXH3_64bits("abc")
  EXPECT_EQ(abc.digest, CombineChunkDigests(abc.chunks));
  EXPECT_EQ(DigestHex(abc.digest), "5758ca032005f7ac");
  std::vector<std::byte> w(1500);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::byte(static_cast<uint8_t>(i % 251));
  const TensorChecksum sum = ComputeTensorChecksum(w, 1024);
  ASSERT_EQ(sum.chunks.size(), 2u);
  EXPECT_EQ(DigestHex(sum.chunks[0]), "e5d78bafa45b2aa5");
  EXPECT_EQ(DigestHex(sum.chunks[1]), "def3f17b16472ef4");
  EXPECT_EQ(DigestHex(sum.digest), "59bd0d55303d0030");
}

TEST(Checksums, ChunkCount) {
  EXPECT_EQ(ChecksumChunkCount(0, 1024), 0u);
  EXPECT_EQ(ChecksumChunkCount(1, 1024), 1u);
  EXPECT_EQ(ChecksumChunkCount(1024, 1024), 1u);
  EXPECT_EQ(ChecksumChunkCount(1025, 1024), 2u);
}

TEST(Checksums, TwoLevelDefinition) {
  const auto data = Bytes(5000);
  const TensorChecksum sum = ComputeTensorChecksum(data, 1024);
  ASSERT_EQ(sum.chunks.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const size_t len = std::min<size_t>(1024, data.size() - i * 1024);
    EXPECT_EQ(sum.chunks[i], ChecksumChunk(std::span(data).subspan(i * 1024, len)));
  }
  // The digest is XXH3 over the big-endian chunk digests.
  std::vector<std::byte> concatenated;
  for (uint64_t c : sum.chunks) {
    for (int b = 7; b >= 0; --b) concatenated.push_back(std::byte((c >> (8 * b)) & 0xff));
  }
  EXPECT_EQ(sum.digest, ChecksumChunk(concatenated));
}

TEST(Checksums, ThreadsAndStreamingAgree) {
  const auto data = Bytes(100'000);
  const TensorChecksum one = ComputeTensorChecksum(data, 4096, 1);
  EXPECT_EQ(ComputeTensorChecksum(data, 4096, 4), one);
  EXPECT_EQ(ComputeTensorChecksum(data, 4096, 1000), one);
  ChecksumBuilder builder(4096);
  size_t at = 0;
  for (size_t piece : {1u, 4095u, 4096u, 7000u, 3u}) {
    builder.Update(std::span(data).subspan(at, piece));
    at += piece;
  }
  builder.Update(std::span(data).subspan(at));
  EXPECT_EQ(builder.Finish(), one);
  // Finish starts again empty.
  EXPECT_EQ(builder.Finish(), ComputeTensorChecksum({}, 4096));
  ChecksumBuilder moved = std::move(builder);
  moved.Update(data);
  EXPECT_EQ(moved.Finish(), one);
}

TEST(Checksums, SerializeParseRoundTrip) {
  FileChecksums sums;
  sums.chunk_size = 1024;
  sums.tensors["b"] = ComputeTensorChecksum(Bytes(3000), 1024);
  sums.tensors["a\"x"] = ComputeTensorChecksum(Bytes(10), 1024);
  sums.tensors["empty"] = ComputeTensorChecksum({}, 1024);
  const std::string text = SerializeFileChecksums(sums);
  EXPECT_EQ(text.find('\n'), std::string::npos);
  EXPECT_EQ(text.rfind("{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{", 0),
            0u);
  auto parsed = ParseFileChecksums(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, sums);

  std::vector<std::pair<std::string, std::string>> metadata = {{"format", "pt"}};
  auto none = EmbeddedChecksums(metadata);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  metadata.emplace_back(std::string(kChecksumsMetadataKey), text);
  auto some = EmbeddedChecksums(metadata);
  ASSERT_TRUE(some.ok());
  ASSERT_TRUE(some->has_value());
  EXPECT_EQ(**some, sums);
}

TEST(Checksums, HostileMetadataIsRefusedCleanly) {
  const std::string good_digest = DigestHex(ComputeTensorChecksum(Span("abc"), 1024).digest);
  const std::string good_chunk = DigestHex(ChecksumChunk(Span("abc")));
  auto entry = [&](const std::string& digest, const std::string& chunks) {
    return "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{\"t\":{\"digest\":"
           "\"" +
           digest + "\",\"chunks\":\"" + chunks + "\"}}}";
  };
  ASSERT_TRUE(ParseFileChecksums(entry(good_digest, good_chunk)).ok());
  const std::vector<std::string> bad = {
      "",
      "[]",
      "{",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{},\"x\":1}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"chunk_size\":1024,\"tensors\":{}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":0,\"tensors\":{}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":-5,\"tensors\":{}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1.5,\"tensors\":{}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":99999999999999,\"tensors\":{}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":[]}",
      "{\"algorithm\":7,\"chunk_size\":1024,\"tensors\":{}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{\"t\":1}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{\"t\":{}}}",
      entry(good_digest, good_chunk + "0"),
      entry(good_digest, good_chunk + good_chunk),  // digest does not match the chunks
      entry("0000000000000000", good_chunk),
      entry(good_digest.substr(0, 15), good_chunk),
      entry("ABCDEF0123456789", good_chunk),
      entry(good_digest, "zzzzzzzzzzzzzzzz"),
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{\"t\":{\"digest\":\"" +
          good_digest + "\",\"chunks\":\"" + good_chunk + "\",\"extra\":\"\"}}}",
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":1024,\"tensors\":{\"t\":{\"digest\":\"" +
          good_digest + "\",\"chunks\":\"" + good_chunk + "\"},\"t\":{\"digest\":\"" + good_digest +
          "\",\"chunks\":\"" + good_chunk + "\"}}}",
      std::string(100'000, '['),
  };
  for (const std::string& text : bad) {
    auto parsed = ParseFileChecksums(text, "m.safetensors");
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), Code::kChecksumsInvalid) << text;
    EXPECT_EQ(parsed.status().message().rfind("m.safetensors: ", 0), 0u)
        << parsed.status().message();
  }
  auto unknown = ParseFileChecksums("{\"algorithm\":\"sha1\",\"chunk_size\":1024,\"tensors\":{}}");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), Code::kUnsupported);
  EXPECT_NE(unknown.status().message().find("\"sha1\""), std::string::npos);
}

TEST(Checksums, VerifyNamesFileTensorChunkAndRange) {
  auto data = Bytes(5000);
  const TensorChecksum sum = ComputeTensorChecksum(data, 1024);
  EXPECT_TRUE(VerifyTensor(sum, 1024, data, "f.safetensors", "w", 80, 3).ok());
  data[2100] ^= std::byte{1};  // chunk 2
  const Status s = VerifyTensor(sum, 1024, data, "f.safetensors", "w", 80, 3);
  ASSERT_EQ(s.code(), Code::kChecksumMismatch);
  EXPECT_EQ(s.message().rfind("f.safetensors: tensor \"w\": checksum mismatch in chunk 2 of 5 "
                              "(tensor bytes [2048, 3072), file bytes [2128, 3152)): xxh3 ",
                              0),
            0u)
      << s.message();
  EXPECT_NE(s.message().find(", expected " + DigestHex(sum.chunks[2])), std::string::npos);
  // The wrong size for the checksum is a checksum problem, not a data one.
  const Status shape = VerifyTensor(sum, 1024, std::span(data).first(1000), "f", "w", 0);
  EXPECT_EQ(shape.code(), Code::kChecksumsInvalid);
  EXPECT_EQ(VerifyChunk(sum, 1024, 5000, 9, std::span(data).first(1024), "f", "w", 0).code(),
            Code::kChecksumsInvalid);
  EXPECT_EQ(VerifyChunk(sum, 1024, 5000, 4, std::span(data).first(1024), "f", "w", 0).code(),
            Code::kChecksumsInvalid);  // the last chunk is 904 bytes
  // A chunk size of 0 (no record holds one) is refused, not divided by.
  EXPECT_EQ(CheckChecksumShape(sum, 0, 5000, "f", "w").code(), Code::kChecksumsInvalid);
  EXPECT_EQ(VerifyTensor(sum, 0, data, "f", "w", 0).code(), Code::kChecksumsInvalid);
  EXPECT_EQ(VerifyChunk(sum, 0, 5000, 0, std::span(data).first(1024), "f", "w", 0).code(),
            Code::kChecksumsInvalid);
  EXPECT_EQ(CheckChunkDigest(sum, 0, 5000, 0, 1024, 0, "f", "w", 0).code(),
            Code::kChecksumsInvalid);
}

// A partial read (a block of rows) is checked over the chunks inside it: those cut by its ends
// are left out, and a flipped byte is found only where a checked chunk holds it.
TEST(Checksums, ARangeIsCheckedOverTheChunksItHoldsWhole) {
  auto data = Bytes(5000);  // chunks of 1024: [0, 1024), ..., [4096, 5000)
  const TensorChecksum sum = ComputeTensorChecksum(data, 1024);
  auto range = [&](uint64_t begin, uint64_t end) {
    return VerifyTensorRange(sum, 1024, 5000, begin,
                             std::span<const std::byte>(data).subspan(begin, end - begin), "f", "w",
                             80);
  };
  struct Case {
    uint64_t begin, end, checked;
  };
  for (const Case& c :
       {Case{0, 5000, 5000}, Case{0, 1024, 1024}, Case{1, 1024, 0}, Case{0, 1023, 0},
        Case{1000, 4100, 3072}, Case{1024, 5000, 3976}, Case{4096, 5000, 904}, Case{4097, 5000, 0},
        Case{5000, 5000, 0}, Case{2048, 2048, 0}}) {
    SCOPED_TRACE(std::to_string(c.begin) + ".." + std::to_string(c.end));
    const Result<uint64_t> got = range(c.begin, c.end);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, c.checked);
  }
  data[2100] ^= std::byte{1};  // chunk 2: [2048, 3072)
  const Result<uint64_t> bad = range(1000, 4100);
  ASSERT_EQ(bad.status().code(), Code::kChecksumMismatch);
  EXPECT_NE(bad.status().message().find("chunk 2 of 5 (tensor bytes [2048, 3072), file bytes "
                                        "[2128, 3152))"),
            std::string::npos)
      << bad.status().message();
  EXPECT_TRUE(range(2100, 4100).ok()) << "chunk 2 is cut by the range: not checked";
  EXPECT_TRUE(range(0, 2048).ok());
  // A range past the tensor's end, and a checksum of another size, are refused.
  EXPECT_EQ(VerifyTensorRange(sum, 1024, 5000, 4000, std::span<const std::byte>(data).first(1001),
                              "f", "w", 0)
                .status()
                .code(),
            Code::kInvalidArgument);
  EXPECT_EQ(
      VerifyTensorRange(sum, 1024, 6000, 0, std::span<const std::byte>(data).first(10), "f", "w", 0)
          .status()
          .code(),
      Code::kChecksumsInvalid);
  EXPECT_EQ(
      VerifyTensorRange(sum, 0, 5000, 0, std::span<const std::byte>(data).first(10), "f", "w", 0)
          .status()
          .code(),
      Code::kChecksumsInvalid);
}

// A mismatch in a file of a Hugging Face hub cache's snapshot (a link into blobs/) names the blob
// and how to get it again; another link, or a blob-like name that is not one, adds nothing.
TEST(Checksums, AMismatchInAHubCacheSnapshotNamesTheBlob) {
  testing::TempDir dir;
  const std::string digest(64, 'a');
  std::filesystem::create_directories(dir.Join("blobs"));
  std::filesystem::create_directories(dir.Join("snapshots/c0ffee"));
  testing::WriteBytes(dir.Join("blobs/" + digest), "x");
  std::filesystem::create_symlink("../../blobs/" + digest,
                                  dir.Join("snapshots/c0ffee/m.safetensors"));
  const std::string link = dir.Join("snapshots/c0ffee/m.safetensors");
  auto data = Bytes(100);
  const TensorChecksum sum = ComputeTensorChecksum(data, 1024);
  data[5] ^= std::byte{1};
  const Status s = VerifyTensor(sum, 1024, data, link, "w", 8, 1);
  ASSERT_EQ(s.code(), Code::kChecksumMismatch);
  const std::string blob = std::filesystem::canonical(link).string();
  EXPECT_NE(s.message().find("; the file is the hub cache's blob " + blob +
                             ": remove it and the link to download it again"),
            std::string::npos)
      << s.message();
  // A plain file, and a link to a file outside a blobs/ folder: no advice.
  testing::WriteBytes(dir.Join("plain"), "x");
  std::filesystem::create_symlink("plain", dir.Join("other-link"));
  for (const std::string& f : {dir.Join("plain"), dir.Join("other-link")}) {
    const Status other = VerifyTensor(sum, 1024, data, f, "w", 8, 1);
    ASSERT_EQ(other.code(), Code::kChecksumMismatch);
    EXPECT_EQ(other.message().find("hub cache"), std::string::npos) << other.message();
  }
}

TEST(Checksums, ManifestRoundTripAndHostileNames) {
  ChecksumManifest manifest;
  manifest.chunk_size = 2048;
  ManifestFile file;
  file.size = 4242;
  file.checksums.chunk_size = 2048;
  file.checksums.tensors["x"] = ComputeTensorChecksum(Bytes(5000), 2048);
  manifest.files["model-00001-of-00002.safetensors"] = file;
  manifest.files["sub/model-00002-of-00002.safetensors"] = file;
  const std::string text = SerializeChecksumManifest(manifest);
  EXPECT_EQ(text.back(), '\n');
  auto parsed = ParseChecksumManifest(text, "m.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, manifest);
  EXPECT_TRUE(ParseChecksumManifest(SerializeChecksumManifest(ChecksumManifest{})).ok());

  for (const char* name : {"", "/etc/passwd", "../x", "a/../../x", "a\\\\b", "a//b", "./a"}) {
    const std::string hostile =
        "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":2048,\"files\":{\"" + std::string(name) +
        "\":{\"size\":1,\"tensors\":{}}}}";
    auto r = ParseChecksumManifest(hostile, "m.json");
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.status().code(), Code::kChecksumsInvalid) << name;
  }
  auto no_size = ParseChecksumManifest(
      "{\"algorithm\":\"xxh3-64-chunked\",\"chunk_size\":2048,\"files\":{\"a\":{\"tensors\":{}}}}");
  EXPECT_EQ(no_size.status().code(), Code::kChecksumsInvalid);
}

}  // namespace
}  // namespace tensorferry

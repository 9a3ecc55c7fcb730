// Load-time checksums (LoadOptions::verify, src/loader/verify.cc): every engine checks whole host
// tensors before a batch is delivered; mismatches name file, tensor, chunk and ranges.
#include <gtest/gtest.h>
#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tensorferry/integrity.h"
#include "tensorferry/loader.h"
#include "tensorferry/writer.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"
#include "util/macros.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::ReadBytes;
using ::tensorferry::testing::TempDir;
using ::tensorferry::testing::WriteBytes;

struct VerifyFixture {
  TempDir dir;
  std::vector<std::byte> a = Bytes(20'000, 1), b = Bytes(64 * 32, 2), c = Bytes(10, 3);
  std::string path = dir.Join("m.safetensors");

  static std::vector<std::byte> Bytes(size_t n, unsigned seed) {
    std::vector<std::byte> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<uint8_t>(i * 13 + seed));
    return v;
  }

  void Write(bool checksums) {
    std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {20'000}, a, nullptr},
                                          {"b", DType::kU8, {64, 32}, b, nullptr},
                                          {"c", DType::kU8, {10}, c, nullptr}};
    WriteOptions options;
    options.checksums = checksums;
    options.checksum_chunk_size = 4096;
    ASSERT_TRUE(WriteFile(path, tensors, {}, options).ok());
  }

  // Flips a bit of tensor a's byte `at` (a is stored first: same dtype, first by name).
  void Corrupt(uint64_t at) {
    auto ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok());
    std::string bytes = ReadBytes(path);
    bytes[(*ckpt)->files()[0].data_offset + at] ^= 0x40;
    WriteBytes(path, bytes);
  }
};

Result<LoadStats> LoadWith(const std::string& path, Engine engine, VerifyMode verify,
                           uint64_t budget = 0) {
  LoadOptions options;
  options.engine = engine;
  options.verify = verify;
  options.budget = budget;
  options.threads = 3;
  options.populate = engine == Engine::kMmap;  // lazy mappings are checked only with kOn
  TF_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::Open(path, options));
  TF_ASSIGN_OR_RETURN(std::vector<Tensor> tensors, loader->Load());
  (void)tensors;
  return loader->stats();
}

using testing::AvailableEngines;

TEST(LoaderVerify, EveryEngineChecksWholeTensors) {
  VerifyFixture f;
  f.Write(true);
  for (Engine engine : AvailableEngines()) {
    auto stats = LoadWith(f.path, engine, VerifyMode::kAuto);
    if (!stats.ok() && stats.status().code() == Code::kUnsupported) continue;  // no io_uring
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->verified_tensors, 3u);
    EXPECT_EQ(stats->verified_bytes, 20'000u + 64 * 32 + 10);
    EXPECT_EQ(stats->verify_skipped_tensors, 0u);
    auto off = LoadWith(f.path, engine, VerifyMode::kOff);
    ASSERT_TRUE(off.ok());
    EXPECT_EQ(off->verified_tensors, 0u);
  }
  // Lazily mapped tensors (mmap without populate) stay lazy under auto; on checks them.
  for (VerifyMode mode : {VerifyMode::kAuto, VerifyMode::kOn}) {
    LoadOptions options;
    options.engine = Engine::kMmap;
    options.verify = mode;
    auto loader = Loader::Open(f.path, options);
    ASSERT_TRUE(loader.ok());
    ASSERT_TRUE((*loader)->Load().ok());
    EXPECT_EQ((*loader)->stats().verified_tensors, mode == VerifyMode::kOn ? 3u : 0u);
    EXPECT_EQ((*loader)->stats().verify_skipped_tensors, mode == VerifyMode::kOn ? 0u : 3u);
  }
}

TEST(LoaderVerify, MismatchFailsTheBatchNamingFileTensorChunkAndRange) {
  VerifyFixture f;
  f.Write(true);
  f.Corrupt(9000);  // chunk 2 of tensor a: bytes [8192, 12288)
  for (Engine engine : AvailableEngines()) {
    for (uint64_t budget : {uint64_t{0}, uint64_t{41'000}}) {
      if (engine == Engine::kMmap && budget > 0) continue;
      auto stats = LoadWith(f.path, engine, VerifyMode::kAuto, budget);
      if (!stats.ok() && stats.status().code() == Code::kUnsupported) continue;
      ASSERT_FALSE(stats.ok());
      EXPECT_EQ(stats.status().code(), Code::kChecksumMismatch);
      EXPECT_NE(stats.status().message().find(
                    f.path + ": tensor \"a\": checksum mismatch in chunk 2 of 5 (tensor bytes "
                             "[8192, 12288), file bytes ["),
                std::string::npos)
          << stats.status().message();
    }
    // Streaming: no batch holding the bad tensor is ever handed out.
    LoadOptions options;
    options.engine = engine;
    options.populate = true;
    options.budget = 41'000;
    auto loader = Loader::Open(f.path, options);
    if (!loader.ok() && loader.status().code() == Code::kUnsupported) continue;  // no io_uring
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    std::vector<std::string> delivered;
    const Status s = (*loader)->Stream(Selection::All(), [&](Batch batch) {
      for (const Tensor& t : batch.tensors) delivered.push_back(t.name());
      return Status::Ok();
    });
    EXPECT_EQ(s.code(), Code::kChecksumMismatch);
    EXPECT_EQ(std::count(delivered.begin(), delivered.end(), "a"), 0);
  }
  EXPECT_TRUE(LoadWith(f.path, Engine::kPread, VerifyMode::kOff).ok());
}

TEST(LoaderVerify, OnRequiresChecksumsAutoLoadsFilesWithout) {
  VerifyFixture f;
  f.Write(false);
  auto on = LoadWith(f.path, Engine::kPread, VerifyMode::kOn);
  ASSERT_FALSE(on.ok());
  EXPECT_EQ(on.status().code(), Code::kChecksumsInvalid);
  EXPECT_NE(on.status().message().find("has no checksums"), std::string::npos);
  auto autod = LoadWith(f.path, Engine::kPread, VerifyMode::kAuto);
  ASSERT_TRUE(autod.ok());
  EXPECT_EQ(autod->verified_tensors, 0u);

  // A manifest beside it makes them checkable.
  auto ckpt = Checkpoint::Open(f.path);
  ASSERT_TRUE(ckpt.ok());
  auto manifest = ComputeChecksumManifest(**ckpt, 4096, 2);
  ASSERT_TRUE(manifest.ok());
  ASSERT_TRUE(WriteChecksumManifest(**ckpt, *manifest).ok());
  auto with = LoadWith(f.path, Engine::kPread, VerifyMode::kOn);
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  EXPECT_EQ(with->verified_tensors, 3u);
}

// A file of `tensors` (their spans) whose metadata carries `record` as the checksum entry, as
// another writer could make it (our writers, SerializeHeader included, leave out a record they
// did not compute): serialized under a key of the same length, then renamed in the JSON.
void WriteWithRecord(const std::string& path, const std::vector<TensorToWrite>& tensors,
                     const std::string& record) {
  std::string stand_in(kChecksumsMetadataKey);
  stand_in.back() = '~';
  auto header = SerializeHeader(tensors, {{stand_in, record}});
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  const size_t at = header->json.find('"' + stand_in + '"');
  ASSERT_NE(at, std::string::npos) << header->json;
  header->json.replace(at + 1, stand_in.size(), kChecksumsMetadataKey);
  std::string bytes(8, '\0');
  const uint64_t n = header->json.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes += header->json;
  for (size_t i : header->order) {
    bytes.append(reinterpret_cast<const char*>(tensors[i].data.data()), tensors[i].data.size());
  }
  testing::WriteBytes(path, bytes);
}

TEST(LoaderVerify, UnknownAlgorithmIgnoredInAutoRefusedWhenOn) {
  VerifyFixture f;
  std::vector<TensorToWrite> tensors = {{"c", DType::kU8, {10}, f.c, nullptr}};
  WriteWithRecord(f.path, tensors, "{\"algorithm\":\"blake3\",\"chunk_size\":4096,\"tensors\":{}}");
  auto autod = LoadWith(f.path, Engine::kPread, VerifyMode::kAuto);
  ASSERT_TRUE(autod.ok()) << autod.status().ToString();
  EXPECT_EQ(autod->verified_tensors, 0u);
  auto on = LoadWith(f.path, Engine::kPread, VerifyMode::kOn);
  EXPECT_EQ(on.status().code(), Code::kUnsupported);
  // A malformed record is an error even in auto mode (the header itself is damaged).
  WriteWithRecord(f.path, tensors, "{");
  const auto malformed = LoadWith(f.path, Engine::kPread, VerifyMode::kAuto);
  EXPECT_EQ(malformed.status().code(), Code::kChecksumsInvalid);
  // Named as the metadata entry it is, not as a broken header.
  EXPECT_NE(malformed.status().message().find("__metadata__[\"tensorferry.checksums\"]"),
            std::string::npos)
      << malformed.status().ToString();
  // A well-formed record of other tensors (copied with another file's metadata by a writer that
  // does not update it): auto loads the file unchecked, as the safetensors package does; on
  // refuses it, naming the record.
  const std::string other = f.path + ".other";
  const std::vector<TensorToWrite> others = {{"zzz", DType::kU8, {10}, f.c, nullptr}};
  ASSERT_TRUE(WriteFile(other, others).ok());
  const std::string written = testing::ReadBytes(other);
  uint64_t n = 0;
  std::memcpy(&n, written.data(), 8);
  simdjson::dom::parser parser;
  std::string_view text;
  ASSERT_EQ(parser.parse(written.substr(8, n))["__metadata__"][kChecksumsMetadataKey].get(text),
            simdjson::SUCCESS);
  const std::string record(text);
  WriteWithRecord(f.path, tensors, record);
  auto copied = LoadWith(f.path, Engine::kPread, VerifyMode::kAuto);
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  EXPECT_EQ(copied->verified_tensors, 0u);
  const auto refused = LoadWith(f.path, Engine::kPread, VerifyMode::kOn);
  EXPECT_EQ(refused.status().code(), Code::kChecksumsInvalid) << refused.status().ToString();
  // A record of the same names (other sizes: other chunk counts) is this file's tensors
  // rewritten, or damaged: refused in auto mode too.
  const std::vector<TensorToWrite> bigger = {{"c", DType::kU8, {20'000}, f.a, nullptr}};
  WriteOptions chunked;
  chunked.checksum_chunk_size = 4096;
  ASSERT_TRUE(WriteFile(other, bigger, {}, chunked).ok());
  const std::string rewritten = testing::ReadBytes(other);
  std::memcpy(&n, rewritten.data(), 8);
  ASSERT_EQ(parser.parse(rewritten.substr(8, n))["__metadata__"][kChecksumsMetadataKey].get(text),
            simdjson::SUCCESS);
  WriteWithRecord(f.path, tensors, std::string(text));
  const auto same_names = LoadWith(f.path, Engine::kPread, VerifyMode::kAuto);
  EXPECT_EQ(same_names.status().code(), Code::kChecksumsInvalid) << same_names.status().ToString();
}

TEST(LoaderVerify, TensorParallelSlicesAreSkippedAndCounted) {
  VerifyFixture f;
  f.Write(true);
  LoadOptions options;
  options.engine = Engine::kPread;
  TensorParallelOptions tp;
  tp.spec = ShardSpec::None();
  tp.spec.Set("b", ShardRule::Split(1));
  tp.rank = 0;
  tp.world = 2;
  options.tensor_parallel = tp;
  auto loader = Loader::Open(f.path, options);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  ASSERT_TRUE((*loader)->Load().ok());
  EXPECT_EQ((*loader)->stats().verified_tensors, 2u);
  EXPECT_EQ((*loader)->stats().verify_skipped_tensors, 1u);
}

// LoadInto: whole host destinations are checked as their bytes land (a large tensor in several
// reads: chunk_size below its size), on every copying engine; a flipped byte is the same error as
// a load's; slices are skipped and counted; verify=off reads without checking.
TEST(LoaderVerify, LoadIntoChecksHostDestinations) {
  VerifyFixture f;
  f.Write(true);
  auto load_into = [&](Engine engine, VerifyMode verify,
                       std::optional<TensorParallelOptions> tp) -> Result<LoadStats> {
    LoadOptions options;
    options.engine = engine;
    options.verify = verify;
    options.threads = 3;
    options.chunk_size = 4096 + 1000;  // a's 20,000 bytes in four reads, across its chunks
    options.tensor_parallel = tp;
    TF_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::Open(f.path, options));
    std::vector<std::vector<std::byte>> memory;
    std::vector<Destination> dsts;
    for (const char* name : {"a", "b", "c"}) {
      memory.emplace_back(30'000);
      dsts.push_back({name, Device::CPU(), memory.back().data(), memory.back().size()});
    }
    TF_RETURN_IF_ERROR(loader->LoadInto(dsts));
    if (!tp && (std::memcmp(memory[0].data(), f.a.data(), f.a.size()) != 0 ||
                std::memcmp(memory[1].data(), f.b.data(), f.b.size()) != 0)) {
      return Status(Code::kInternal, "wrong bytes");
    }
    return loader->stats();
  };
  for (Engine engine : {Engine::kPread, Engine::kIoUring}) {
    auto stats = load_into(engine, VerifyMode::kAuto, std::nullopt);
    if (!stats.ok() && stats.status().code() == Code::kUnsupported) continue;  // no io_uring
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->verified_tensors, 3u);
    EXPECT_EQ(stats->verified_bytes, 20'000u + 64 * 32 + 10);
    EXPECT_EQ(stats->verify_skipped_tensors, 0u);
    TensorParallelOptions tp;
    tp.spec = ShardSpec::None();
    tp.spec.Set("b", ShardRule::Split(1));
    tp.rank = 1;
    tp.world = 2;
    auto sliced = load_into(engine, VerifyMode::kAuto, tp);
    ASSERT_TRUE(sliced.ok()) << sliced.status().ToString();
    EXPECT_EQ(sliced->verified_tensors, 2u);
    EXPECT_EQ(sliced->verify_skipped_tensors, 1u);
  }
  f.Corrupt(20'000 - 1);  // the last byte of a: chunk 4, bytes [16384, 20000)
  for (Engine engine : {Engine::kPread, Engine::kIoUring}) {
    auto stats = load_into(engine, VerifyMode::kAuto, std::nullopt);
    if (!stats.ok() && stats.status().code() == Code::kUnsupported) continue;
    ASSERT_FALSE(stats.ok());
    EXPECT_EQ(stats.status().code(), Code::kChecksumMismatch);
    EXPECT_NE(stats.status().message().find(
                  f.path + ": tensor \"a\": checksum mismatch in chunk 4 of 5 (tensor bytes "
                           "[16384, 20000), file bytes ["),
              std::string::npos)
        << stats.status().message();
    auto off = load_into(engine, VerifyMode::kOff, std::nullopt);
    ASSERT_FALSE(off.ok());  // the bytes differ from the fixture's, unchecked
    EXPECT_EQ(off.status().message(), "wrong bytes");
  }
}

// Tensor-parallel slices are checked over the checksum chunks they hold whole, on every engine,
// by Load and by LoadInto: a's 20,000 bytes in chunks of 4096, split along dim 0 in two. Rank 0
// holds [0, 10000) (chunks 0 and 1 whole), rank 1 [10000, 20000) (chunks 3 and 4, the short last
// one). A flipped byte in a chunk a rank holds fails that rank's load only; one in chunk 2 (cut
// between the ranks) is in neither's check. b's dim-1 halves hold no whole chunk: skipped.
TEST(LoaderVerify, SlicesAreCheckedOverTheChunksTheyHoldWhole) {
  VerifyFixture f;
  f.Write(true);
  auto load = [&](Engine engine, uint32_t rank, bool into) -> Result<LoadStats> {
    LoadOptions options;
    options.engine = engine;
    options.verify = VerifyMode::kAuto;
    options.threads = 3;
    options.populate = engine == Engine::kMmap;
    options.chunk_size = 4096 + 1000;  // reads that cut across checksum chunks
    TensorParallelOptions tp;
    tp.spec = ShardSpec::None();
    tp.spec.Set("a", ShardRule::Split(0));
    tp.spec.Set("b", ShardRule::Split(1));
    tp.rank = rank;
    tp.world = 2;
    options.tensor_parallel = tp;
    TF_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::Open(f.path, options));
    if (into) {
      std::vector<std::byte> a(10'000), b(64 * 16), c(10);
      std::vector<Destination> dsts = {{"a", Device::CPU(), a.data(), a.size()},
                                       {"b", Device::CPU(), b.data(), b.size()},
                                       {"c", Device::CPU(), c.data(), c.size()}};
      TF_RETURN_IF_ERROR(loader->LoadInto(dsts));
    } else {
      TF_ASSIGN_OR_RETURN(std::vector<Tensor> tensors, loader->Load());
      (void)tensors;
    }
    return loader->stats();
  };
  for (Engine engine : AvailableEngines()) {
    for (bool into : {false, true}) {
      if (into && engine == Engine::kMmap) continue;  // LoadInto copies: pread or io_uring
      SCOPED_TRACE(std::string(EngineName(engine)) + (into ? " LoadInto" : " Load"));
      auto zero = load(engine, 0, into);
      if (!zero.ok() && zero.status().code() == Code::kUnsupported) continue;  // no io_uring
      ASSERT_TRUE(zero.ok()) << zero.status().ToString();
      EXPECT_EQ(zero->verified_tensors, 1u);  // c (replicated)
      EXPECT_EQ(zero->verify_partial_tensors, 1u);
      EXPECT_EQ(zero->verify_skipped_tensors, 1u);
      EXPECT_EQ(zero->verified_bytes, 10u + 2 * 4096);
      auto one = load(engine, 1, into);
      ASSERT_TRUE(one.ok()) << one.status().ToString();
      EXPECT_EQ(one->verify_partial_tensors, 1u);
      EXPECT_EQ(one->verified_bytes, 10u + 4096 + (20'000 - 4 * 4096));
    }
  }
  f.Corrupt(8192 + 100);  // chunk 2: held whole by neither rank
  for (Engine engine : AvailableEngines()) {
    auto zero = load(engine, 0, false);
    if (!zero.ok() && zero.status().code() == Code::kUnsupported) continue;
    EXPECT_TRUE(zero.ok()) << zero.status().ToString();
    EXPECT_TRUE(load(engine, 1, false).ok());
  }
  f.Corrupt(8192 + 100);  // undone
  f.Corrupt(20'000 - 1);  // chunk 4: rank 1's
  for (Engine engine : AvailableEngines()) {
    for (bool into : {false, true}) {
      if (into && engine == Engine::kMmap) continue;
      SCOPED_TRACE(std::string(EngineName(engine)) + (into ? " LoadInto" : " Load"));
      auto zero = load(engine, 0, into);
      if (!zero.ok() && zero.status().code() == Code::kUnsupported) continue;
      EXPECT_TRUE(zero.ok()) << zero.status().ToString();
      auto one = load(engine, 1, into);
      ASSERT_FALSE(one.ok());
      EXPECT_EQ(one.status().code(), Code::kChecksumMismatch);
      EXPECT_NE(one.status().message().find("tensor \"a\": checksum mismatch in chunk 4 of 5"),
                std::string::npos)
          << one.status().message();
    }
  }
}

// A fused split (two blocks per rank: gathered from two ranges, not a view) is checked over the
// chunks its blocks hold whole, on every engine: a's parts of 10,000 bytes halved, rank 0 holds
// [0, 5000) and [10000, 15000): chunk 0 whole, nothing else. A flipped byte in chunk 0 fails it.
TEST(LoaderVerify, FusedSlicesAreCheckedOverTheChunksTheirBlocksHold) {
  VerifyFixture f;
  f.Write(true);
  auto load = [&](Engine engine) -> Result<LoadStats> {
    LoadOptions options;
    options.engine = engine;
    options.threads = 2;
    options.populate = engine == Engine::kMmap;
    TensorParallelOptions tp;
    tp.spec = ShardSpec::None();
    tp.spec.Set("a", ShardRule::Split(0, {10'000, 10'000}));
    tp.rank = 0;
    tp.world = 2;
    options.tensor_parallel = tp;
    TF_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::Open(f.path, options));
    TF_ASSIGN_OR_RETURN(std::vector<Tensor> tensors, loader->Load());
    for (const Tensor& t : tensors) {
      if (t.name() != "a") continue;
      const auto* got = static_cast<const std::byte*>(t.data());
      if (t.size() != 10'000 || std::memcmp(got, f.a.data(), 5000) != 0 ||
          std::memcmp(got + 5000, f.a.data() + 10'000, 5000) != 0) {
        return Status(Code::kInternal, "wrong bytes");
      }
    }
    return loader->stats();
  };
  for (Engine engine : AvailableEngines()) {
    SCOPED_TRACE(std::string(EngineName(engine)));
    auto stats = load(engine);
    if (!stats.ok() && stats.status().code() == Code::kUnsupported) continue;
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->verify_partial_tensors, 1u);
    EXPECT_EQ(stats->verified_tensors, 2u);  // b and c, whole
    EXPECT_EQ(stats->verified_bytes, 4096u + 64 * 32 + 10);
  }
  f.Corrupt(4000);  // chunk 0
  for (Engine engine : AvailableEngines()) {
    SCOPED_TRACE(std::string(EngineName(engine)));
    auto stats = load(engine);
    if (!stats.ok() && stats.status().code() == Code::kUnsupported) continue;
    ASSERT_FALSE(stats.ok());
    EXPECT_EQ(stats.status().code(), Code::kChecksumMismatch) << stats.status().ToString();
  }
}

}  // namespace
}  // namespace tensorferry

// The writers' checksums (WriteOptions::checksums, integrity.h): what they store, that files stay
// the reference's bytes except that one metadata entry, and streamed (generated) tensors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "tensorferry/writer.h"
#include "testing/test_util.h"
#include "util/macros.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::ReadBytes;
using ::tensorferry::testing::TempDir;

using ::tensorferry::testing::Pattern;

// A generator over `bytes` (borrowed).
std::function<Status(uint64_t, std::span<std::byte>)> Generator(const std::vector<std::byte>& b) {
  return [&b](uint64_t offset, std::span<std::byte> out) {
    std::memcpy(out.data(), b.data() + offset, out.size());
    return Status::Ok();
  };
}

FileChecksums ReadChecksums(const std::string& path) {
  auto ckpt = Checkpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto sums = EmbeddedChecksums((*ckpt)->files()[0].metadata, path);
  EXPECT_TRUE(sums.ok()) << sums.status().ToString();
  EXPECT_TRUE(sums->has_value());
  return sums->value_or(FileChecksums{});
}

// Files whose WriteAt is unsupported (the default of WritableFile): the writer hashes first.
class NoWriteAtFile final : public WritableFile {
 public:
  explicit NoWriteAtFile(std::unique_ptr<WritableFile> base) : base_(std::move(base)) {}
  Status Append(std::span<const std::byte> data) override { return base_->Append(data); }
  Status Sync() override { return base_->Sync(); }
  Status Close() override { return base_->Close(); }
  const std::string& path() const noexcept override { return base_->path(); }

 private:
  std::unique_ptr<WritableFile> base_;
};
class NoWriteAtEnv final : public Env {
 public:
  Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) override {
    return Env::Default()->OpenRandomAccess(path);
  }
  Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& dir, const std::string& stem,
      const std::function<void(const std::string& path)>& reserve) override {
    auto file = Env::Default()->NewTempFile(dir, stem, reserve);
    if (!file.ok()) return file.status();
    return std::unique_ptr<WritableFile>(new NoWriteAtFile(std::move(*file)));
  }
};

TEST(WriterChecksums, StoredPerTensorAndOnlyTheMetadataDiffers) {
  TempDir dir;
  const auto a = Pattern(10'000, 1), b = Pattern(3, 2), empty = Pattern(0, 3);
  std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {10'000}, a, nullptr},
                                        {"b", DType::kI8, {3}, b, nullptr},
                                        {"e", DType::kF32, {0}, empty, nullptr}};
  const Metadata metadata = {{"format", "pt"}, {std::string(kChecksumsMetadataKey), "stale"}};
  WriteOptions with;
  with.checksum_chunk_size = 4096;
  ASSERT_TRUE(WriteFile(dir.Join("with.safetensors"), tensors, metadata, with).ok());

  const FileChecksums sums = ReadChecksums(dir.Join("with.safetensors"));
  EXPECT_EQ(sums.chunk_size, 4096u);
  ASSERT_EQ(sums.tensors.size(), 3u);
  EXPECT_EQ(sums.tensors.at("a"), ComputeTensorChecksum(a, 4096));
  EXPECT_EQ(sums.tensors.at("a").chunks.size(), 3u);
  EXPECT_EQ(sums.tensors.at("b"), ComputeTensorChecksum(b, 4096));
  EXPECT_TRUE(sums.tensors.at("e").chunks.empty());

  // Without checksums: the reference's bytes, and a record the caller passed is dropped (it
  // would describe other bytes).
  WriteOptions without;
  without.checksums = false;
  ASSERT_TRUE(WriteFile(dir.Join("without.safetensors"), tensors, metadata, without).ok());
  ASSERT_TRUE(WriteFile(dir.Join("plain.safetensors"), tensors, {{"format", "pt"}}, without).ok());
  EXPECT_EQ(ReadBytes(dir.Join("without.safetensors")), ReadBytes(dir.Join("plain.safetensors")));
  // With them, the only difference is the record: the plain header with the record (a JSON
  // string) after "format", padded to a multiple of 8 again.
  const std::string checked = ReadBytes(dir.Join("with.safetensors"));
  const std::string plain = ReadBytes(dir.Join("plain.safetensors"));
  const auto header_size = [](const std::string& file) {
    uint64_t n = 0;
    std::memcpy(&n, file.data(), 8);
    return static_cast<size_t>(n);
  };
  std::string record = "\"";
  for (const char c : SerializeFileChecksums(sums)) {
    if (c == '"' || c == '\\') record += '\\';
    record += c;
  }
  record += '"';
  const std::string plain_header = plain.substr(8, header_size(plain));
  const std::string format = R"("format":"pt")";
  const size_t at = plain_header.find(format);
  ASSERT_NE(at, std::string::npos) << plain_header;
  std::string expected = plain_header.substr(0, at + format.size()) + ",\"" +
                         std::string(kChecksumsMetadataKey) + "\":" + record +
                         plain_header.substr(at + format.size());
  while (!expected.empty() && expected.back() == ' ') expected.pop_back();
  expected.resize((expected.size() + 7) / 8 * 8, ' ');
  EXPECT_EQ(checked.substr(8, header_size(checked)), expected);
  EXPECT_EQ(checked.substr(8 + header_size(checked)), plain.substr(8 + header_size(plain)));
}

TEST(WriterChecksums, GeneratedTensorsHashedWhileStreamingOrFirst) {
  TempDir dir;
  const auto big = Pattern(50'000, 4), small = Pattern(100, 5);
  std::vector<TensorToWrite> tensors = {{"big", DType::kU8, {50'000}, {}, Generator(big)},
                                        {"small", DType::kU8, {100}, small, nullptr}};
  WriteOptions options;
  options.checksum_chunk_size = 1024;
  options.buffer_size = 3000;  // many generator calls, not aligned to chunks
  ASSERT_TRUE(WriteFile(dir.Join("g.safetensors"), tensors, {}, options).ok());
  NoWriteAtEnv env;
  options.env = &env;
  ASSERT_TRUE(WriteFile(dir.Join("h.safetensors"), tensors, {}, options).ok());
  // Same bytes either way, and the same as from spans.
  EXPECT_EQ(ReadBytes(dir.Join("g.safetensors")), ReadBytes(dir.Join("h.safetensors")));
  tensors[0].generate = nullptr;
  tensors[0].data = big;
  options.env = nullptr;
  ASSERT_TRUE(WriteFile(dir.Join("s.safetensors"), tensors, {}, options).ok());
  EXPECT_EQ(ReadBytes(dir.Join("g.safetensors")), ReadBytes(dir.Join("s.safetensors")));
  EXPECT_EQ(ReadChecksums(dir.Join("g.safetensors")).tensors.at("big"),
            ComputeTensorChecksum(big, 1024));
  // buffer_size 0 acts as 1 when the generator is run to hash first, too (it never advanced).
  const auto tiny = Pattern(300, 6);
  const std::vector<TensorToWrite> one = {{"tiny", DType::kU8, {300}, {}, Generator(tiny)}};
  options.buffer_size = 0;
  options.env = &env;
  ASSERT_TRUE(WriteFile(dir.Join("t.safetensors"), one, {}, options).ok());
  EXPECT_EQ(ReadChecksums(dir.Join("t.safetensors")).tensors.at("tiny"),
            ComputeTensorChecksum(tiny, 1024));
}

TEST(WriterChecksums, EveryShardCarriesItsOwnTensors) {
  TempDir dir;
  const auto a = Pattern(5000, 1), b = Pattern(5000, 2), c = Pattern(5000, 3);
  std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr},
                                        {"b", DType::kU8, {5000}, {}, Generator(b)},
                                        {"c", DType::kU8, {5000}, c, nullptr}};
  ShardOptions options;
  options.max_shard_size = 6000;
  options.write.checksum_chunk_size = 2048;
  auto written = WriteSharded(dir.path(), tensors, {{"k", "v"}}, options);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  ASSERT_EQ(written->size(), 4u);  // three shards and the index
  for (size_t s = 0; s < 3; ++s) {
    const FileChecksums sums = ReadChecksums((*written)[s]);
    ASSERT_EQ(sums.tensors.size(), 1u);
    const std::string name(1, static_cast<char>('a' + s));
    EXPECT_EQ(sums.tensors.at(name), ComputeTensorChecksum(Pattern(5000, unsigned(s + 1)), 2048));
  }
}

// A sidecar manifest (`tensorferry checksum`) of the checkpoint a sharded write replaces describes
// files that go: it goes with them. One that records none of them (another checkpoint's) stays.
TEST(WriterChecksums, AManifestOfTheReplacedCheckpointGoesWithIt) {
  namespace fs = std::filesystem;
  TempDir dir;
  const auto a = Pattern(5000, 1), b = Pattern(5000, 2), c = Pattern(5000, 3);
  std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr},
                                        {"b", DType::kU8, {5000}, b, nullptr},
                                        {"c", DType::kU8, {5000}, c, nullptr}};
  ShardOptions options;
  options.max_shard_size = 6000;  // three shards
  options.write.checksums = false;
  ASSERT_TRUE(WriteSharded(dir.path(), tensors, {}, options).ok());
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto manifest = ComputeChecksumManifest(**ckpt, 2048, 2);
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  ASSERT_TRUE(WriteChecksumManifest(**ckpt, *manifest).ok());
  const std::string sidecar = dir.Join(std::string(kChecksumManifestName));
  ASSERT_TRUE(fs::exists(sidecar));
  ckpt->reset();

  options.max_shard_size = 20000;  // one file now, unchecked: no stale record may apply to it
  auto written = WriteSharded(dir.path(), tensors, {}, options);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_FALSE(fs::exists(sidecar));
  auto again = Checkpoint::Open(dir.path());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  auto none = ReadChecksumManifest(**again);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_FALSE(none->has_value());

  // Another checkpoint's manifest in the same folder (its files are not the ones replaced).
  ChecksumManifest other;
  other.chunk_size = 2048;
  ManifestFile entry;
  entry.size = 1;
  entry.checksums.chunk_size = 2048;
  other.files.emplace("other.safetensors", entry);
  testing::WriteBytes(sidecar, SerializeChecksumManifest(other));
  ASSERT_TRUE(WriteSharded(dir.path(), tensors, {}, options).ok());
  EXPECT_TRUE(fs::exists(sidecar));
}

// A manifest shared with another checkpoint of the folder: a sharded write drops the entries of
// the files it replaces and keeps the other file's (as part of its commit: a failed write leaves
// the manifest as it was).
// Verifies the single file `path` (every check must pass) and says where its checksums came from.
ChecksumSource VerifiedFrom(const std::string& path) {
  ChecksumSource source = ChecksumSource::kNone;
  auto ckpt = Checkpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  if (!ckpt.ok()) return source;
  const Status s = VerifyCheckpointChecksums(
      **ckpt, 1, [&](uint32_t, ChecksumSource got, uint64_t) { source = got; });
  EXPECT_TRUE(s.ok()) << s.ToString();
  return source;
}

TEST(WriterChecksums, AShardedWriteKeepsTheOtherFilesEntries) {
  TempDir dir;
  const auto a = Pattern(5000, 1), b = Pattern(5000, 2);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr},
                                              {"b", DType::kU8, {5000}, b, nullptr}};
  ShardOptions options;
  options.max_shard_size = 6000;  // two shards
  options.write.checksums = false;
  ASSERT_TRUE(WriteSharded(dir.path(), tensors, {}, options).ok());
  ASSERT_TRUE(
      WriteFile(dir.Join("other.safetensors"), std::span(tensors).first(1), {}, options.write)
          .ok());
  for (const std::string& path : {dir.path(), dir.Join("other.safetensors")}) {
    auto ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    auto manifest = ComputeChecksumManifest(**ckpt, 2048, 1);
    ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
    ASSERT_TRUE(WriteChecksumManifest(**ckpt, *manifest).ok());
  }
  const std::string sidecar = dir.Join(std::string(kChecksumManifestName));
  const std::string before = ReadBytes(sidecar);
  ASSERT_EQ(ParseChecksumManifest(before)->files.size(), 3u);

  options.max_shard_size = 20000;  // one file now
  testing::FaultInjectionEnv failing({.fail_rename = 2});
  options.write.env = &failing;
  ASSERT_FALSE(WriteSharded(dir.path(), tensors, {}, options).ok());
  EXPECT_EQ(ReadBytes(sidecar), before) << "a failed write leaves the manifest as it was";

  options.write.env = nullptr;
  ASSERT_TRUE(WriteSharded(dir.path(), tensors, {}, options).ok());
  auto left = ParseChecksumManifest(ReadBytes(sidecar));
  ASSERT_TRUE(left.ok()) << left.status().ToString();
  ASSERT_EQ(left->files.size(), 1u);
  EXPECT_EQ(left->files.count("other.safetensors"), 1u);
  EXPECT_EQ(VerifiedFrom(dir.Join("other.safetensors")), ChecksumSource::kManifest);
  auto model = Checkpoint::Open(dir.path());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_TRUE(VerifyCheckpointChecksums(**model, 1).ok());
}

// Writes `names` (in `dir`, each holding `tensors`) without checksums and returns a manifest of
// them all (chunks of 2048 bytes), as `tensorferry checksum` records them.
ChecksumManifest WriteAndRecord(const TempDir& dir, const std::vector<std::string>& names,
                                const std::vector<TensorToWrite>& tensors) {
  WriteOptions options;
  options.checksums = false;
  ChecksumManifest shared;
  shared.chunk_size = 2048;
  for (const std::string& name : names) {
    EXPECT_TRUE(WriteFile(dir.Join(name), tensors, {}, options).ok());
    auto ckpt = Checkpoint::Open(dir.Join(name));
    EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    if (!ckpt.ok()) continue;
    auto manifest = ComputeChecksumManifest(**ckpt, 2048, 1);
    EXPECT_TRUE(manifest.ok()) << manifest.status().ToString();
    if (manifest.ok()) shared.files.merge(manifest->files);
  }
  return shared;
}

// A rewrite whose rename fails leaves the old file, and its manifest entry with it (the entry is
// dropped before the rename): whether the manifest holds other entries or only that one.
TEST(WriterChecksums, ARewriteWhoseRenameFailsKeepsTheOldFilesEntry) {
  for (const bool alone : {false, true}) {
    SCOPED_TRACE(alone ? "the only entry" : "beside another");
    TempDir dir;
    const auto a = Pattern(5000, 1);
    const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr}};
    WriteOptions options;
    options.checksums = false;
    const ChecksumManifest shared =
        alone ? WriteAndRecord(dir, {"one.safetensors"}, tensors)
              : WriteAndRecord(dir, {"one.safetensors", "two.safetensors"}, tensors);
    ASSERT_EQ(shared.files.size(), alone ? 1u : 2u);
    const std::string sidecar = dir.Join(std::string(kChecksumManifestName));
    const std::string before = SerializeChecksumManifest(shared);
    testing::WriteBytes(sidecar, before);
    const std::string old_bytes = ReadBytes(dir.Join("one.safetensors"));

    const auto b = Pattern(5000, 2);
    const std::vector<TensorToWrite> rewrite = {{"a", DType::kU8, {5000}, b, nullptr}};
    // The file's rename: after the manifest's (its rewrite without the entry) when it keeps
    // another entry; the first when it goes. Or (found by a review) the fsync of the directory
    // after the manifest's edit, which left the edit in place and the old file without its entry.
    const std::vector<testing::FaultInjectionEnv::Faults> faults = {
        {.fail_rename = alone ? 1u : 2u}, {.fail_sync_directory = 1}};
    for (const testing::FaultInjectionEnv::Faults& fault : faults) {
      SCOPED_TRACE(fault.fail_rename != 0 ? "the rename fails" : "the fsync fails");
      testing::FaultInjectionEnv failing(fault);
      WriteOptions faulty = options;
      faulty.env = &failing;
      const Status s = WriteFile(dir.Join("one.safetensors"), rewrite, {}, faulty);
      ASSERT_FALSE(s.ok());
      if (fault.fail_rename != 0) {
        EXPECT_NE(s.message().find(dir.Join("one.safetensors")), std::string::npos) << s.ToString();
      }
      EXPECT_EQ(ReadBytes(dir.Join("one.safetensors")), old_bytes);
      auto left = ParseChecksumManifest(ReadBytes(sidecar));
      ASSERT_TRUE(left.ok()) << left.status().ToString();
      EXPECT_EQ(*left, shared);
      EXPECT_EQ(VerifiedFrom(dir.Join("one.safetensors")), ChecksumSource::kManifest);
    }
  }
}

// A single file written over one a shared manifest records: that entry goes (before the file
// is replaced), the other files' stay; the last entry takes the manifest with it.
TEST(WriterChecksums, ASingleFileRewriteDropsItsManifestEntry) {
  namespace fs = std::filesystem;
  TempDir dir;
  const auto a = Pattern(5000, 1);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr}};
  WriteOptions options;
  options.checksums = false;
  const ChecksumManifest shared =
      WriteAndRecord(dir, {"one.safetensors", "two.safetensors"}, tensors);
  ASSERT_EQ(shared.files.size(), 2u);
  const auto b = Pattern(5000, 2);  // the rewrites hold other bytes: the digests are stale
  const std::vector<TensorToWrite> rewrite = {{"a", DType::kU8, {5000}, b, nullptr}};
  const std::string sidecar = dir.Join(std::string(kChecksumManifestName));
  testing::WriteBytes(sidecar, SerializeChecksumManifest(shared));

  ASSERT_TRUE(WriteFile(dir.Join("one.safetensors"), rewrite, {}, options).ok());
  auto left = ParseChecksumManifest(ReadBytes(sidecar));
  ASSERT_TRUE(left.ok()) << left.status().ToString();
  EXPECT_EQ(left->files.count("one.safetensors"), 0u);
  EXPECT_EQ(left->files.count("two.safetensors"), 1u);
  EXPECT_EQ(left->chunk_size, 2048u);
  auto one = Checkpoint::Open(dir.Join("one.safetensors"));
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_TRUE(VerifyCheckpointChecksums(**one, 1).ok());

  ASSERT_TRUE(WriteFile(dir.Join("two.safetensors"), rewrite, {}, options).ok());
  EXPECT_FALSE(fs::exists(sidecar));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"one.safetensors", "two.safetensors"}));
}

// One writer's share of a folder of single-file checkpoints: files "<tag>-<i>.safetensors", each
// written without embedded checksums and recorded in the folder's shared manifest; then file 0
// rewritten with other bytes (its stale entry goes, WriteFile) and recorded again.
Status WriteAndRecordEach(const std::string& dir, const std::string& tag, unsigned seed,
                          int files) {
  WriteOptions options;
  options.checksums = false;
  options.sync = false;
  for (int round = 0; round <= files; ++round) {
    const int i = round < files ? round : 0;
    const std::string path = dir + "/" + tag + "-" + std::to_string(i) + ".safetensors";
    const auto bytes = Pattern(3000 + 7 * static_cast<size_t>(round), seed + unsigned(round));
    const std::vector<TensorToWrite> tensors = {{"t", DType::kU8, {bytes.size()}, bytes, nullptr}};
    TF_RETURN_IF_ERROR(WriteFile(path, tensors, {}, options));
    TF_ASSIGN_OR_RETURN(const std::shared_ptr<const Checkpoint> ckpt, Checkpoint::Open(path));
    TF_ASSIGN_OR_RETURN(const ChecksumManifest manifest, ComputeChecksumManifest(*ckpt, 1024, 1));
    TF_RETURN_IF_ERROR(WriteChecksumManifest(*ckpt, manifest));
  }
  return Status::Ok();
}

// Several threads and two other processes write different files into one folder at once, each
// recording them in the one manifest there (and dropping and re-adding an entry on a rewrite):
// the read-modify-write of the manifest is serialized, so no writer loses another's entries.
TEST(WriterChecksums, ConcurrentWritersKeepEveryManifestEntry) {
  TempDir dir;
  constexpr int kFiles = 6, kThreads = 4, kProcesses = 2;
  // The processes first, before this test starts a thread; they wait for the threads to run.
  int start[2];
  ASSERT_EQ(::pipe(start), 0);
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(start[1]);
      char go;
      (void)!::read(start[0], &go, 1);  // returns at EOF: the parent's threads are running
      const Status s = WriteAndRecordEach(dir.path(), "proc" + std::to_string(p), 100 * p, kFiles);
      if (!s.ok()) std::fprintf(stderr, "child %d: %s\n", p, s.ToString().c_str());
      ::_exit(s.ok() ? 0 : 1);
    }
    children.push_back(child);
  }
  ::close(start[0]);
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      results[t] =
          WriteAndRecordEach(dir.path(), "thread" + std::to_string(t), 1000 + 100 * t, kFiles);
    });
  }
  ::close(start[1]);  // the processes start
  for (std::thread& t : threads) t.join();
  for (const pid_t child : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << child;
  }
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.ToString();

  auto manifest = ParseChecksumManifest(ReadBytes(dir.Join(std::string(kChecksumManifestName))));
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_EQ(manifest->files.size(), size_t{(kThreads + kProcesses) * kFiles});
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    const std::string name = entry.path().filename().string();
    if (!name.ends_with(".safetensors")) {
      EXPECT_EQ(name, kChecksumManifestName) << "left behind";
      continue;
    }
    EXPECT_EQ(manifest->files.count(name), 1u) << name << " lost its entry";
    auto ckpt = Checkpoint::Open(entry.path().string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    ChecksumSource source = ChecksumSource::kNone;
    EXPECT_TRUE(VerifyCheckpointChecksums(**ckpt, 1,
                                          [&](uint32_t, ChecksumSource s, uint64_t) { source = s; })
                    .ok())
        << name;
    EXPECT_EQ(source, ChecksumSource::kManifest) << name;
  }
}

// `tensorferry checksum` over a file that carries its own checksums checks them first: digests of
// damaged bytes are never recorded (the manifest would bless them for every later check).
TEST(WriterChecksums, AManifestIsNotComputedOverBytesTheirEmbeddedChecksumsRefuse) {
  TempDir dir;
  const auto a = Pattern(10'000, 1), b = Pattern(3000, 2);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {10'000}, a, nullptr},
                                              {"b", DType::kU8, {3000}, b, nullptr}};
  WriteOptions with;
  with.checksum_chunk_size = 4096;
  const std::string path = dir.Join("model.safetensors");
  ASSERT_TRUE(WriteFile(path, tensors, {}, with).ok());
  {
    auto ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    // Intact: computed, in this chunk size or another.
    for (uint64_t chunk : {uint64_t{4096}, uint64_t{1024}}) {
      auto manifest = ComputeChecksumManifest(**ckpt, chunk, 2);
      ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
      EXPECT_EQ(manifest->files.at("model.safetensors").checksums.tensors.at("b"),
                ComputeTensorChecksum(b, chunk));
    }
  }
  // One byte of "b" changed in place (same size, same header).
  std::string bytes = ReadBytes(path);
  auto ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const TensorInfo* t = (*ckpt)->Find("b");
  ASSERT_NE(t, nullptr);
  const uint64_t at = t->offset + 2500;  // (t goes with the checkpoint)
  ckpt->reset();
  bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
  testing::WriteBytes(path, bytes);
  auto damaged = Checkpoint::Open(path);
  ASSERT_TRUE(damaged.ok()) << damaged.status().ToString();
  for (uint64_t chunk : {uint64_t{4096}, uint64_t{1024}}) {
    auto manifest = ComputeChecksumManifest(**damaged, chunk, 2);
    ASSERT_FALSE(manifest.ok());
    EXPECT_EQ(manifest.status().code(), Code::kChecksumMismatch);
    EXPECT_NE(manifest.status().message().find(path + ": tensor \"b\": checksum mismatch"),
              std::string::npos)
        << manifest.status().ToString();
    EXPECT_NE(manifest.status().message().find("against the checksums embedded in the file"),
              std::string::npos)
        << manifest.status().ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.Join(std::string(kChecksumManifestName))));
}

// A read that fails while verifying (or computing) checksums names the tensor it was reading.
TEST(WriterChecksums, AReadErrorWhileVerifyingNamesTheTensor) {
  TempDir dir;
  const auto a = Pattern(10'000, 1), b = Pattern(3000, 2);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {10'000}, a, nullptr},
                                              {"b", DType::kU8, {3000}, b, nullptr}};
  const std::string path = dir.Join("model.safetensors");
  ASSERT_TRUE(WriteFile(path, tensors, {}, {}).ok());
  testing::MemoryEnv env;
  env.AddFile(path, ReadBytes(path));
  OpenOptions open;
  open.env = &env;
  auto ckpt = Checkpoint::Open(path, open);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const TensorInfo* t = (*ckpt)->Find("b");
  ASSERT_NE(t, nullptr);
  testing::MemoryEnv::Faults faults;
  faults.eio_at = static_cast<int64_t>(t->offset + 100);
  env.SetFaults(path, faults);
  const Status verified = VerifyCheckpointChecksums(**ckpt, 2);
  EXPECT_EQ(verified.code(), Code::kIoError) << verified.ToString();
  EXPECT_NE(verified.message().find("; the read held tensor \"b\""), std::string::npos)
      << verified.ToString();
  auto manifest = ComputeChecksumManifest(**ckpt, 4096, 2);
  ASSERT_FALSE(manifest.ok());
  EXPECT_NE(manifest.status().message().find("; the read held tensor \"b\""), std::string::npos)
      << manifest.status().ToString();
}

TEST(WriterChecksums, BadChunkSizeRefusedBeforeWriting) {
  TempDir dir;
  WriteOptions options;
  options.checksum_chunk_size = 10;
  const Status s = WriteFile(dir.Join("x.safetensors"), {}, {}, options);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir.Join("x.safetensors")));
}

}  // namespace
}  // namespace tensorferry

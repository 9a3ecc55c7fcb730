// The sidecar manifest against files replaced while their checksums are computed
// (checkpoint_checksums.cc, WriteChecksumManifest).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "integrity/manifest_update.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "tensorferry/writer.h"
#include "testing/test_util.h"
#include "util/macros.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::Contains;
using ::tensorferry::testing::Pattern;
using ::tensorferry::testing::ReadBytes;
using ::tensorferry::testing::TempDir;

Status WriteOne(const std::string& path, size_t bytes, unsigned seed,
                const std::string& name = "w") {
  const auto data = Pattern(bytes, seed);
  const std::vector<TensorToWrite> tensors = {{name, DType::kU8, {bytes}, data, nullptr}};
  WriteOptions options;
  options.checksums = false;  // a third-party file: only the manifest can describe it
  options.sync = false;
  return WriteFile(path, tensors, {}, options);
}

// A save replaces a file between `checksum`'s hashing and its merge into the manifest (the race
// of `tensorferry checksum` with `save_file`): the digests of the old bytes are not recorded under
// the new file's name; the manifest stays as it was and the new file verifies and loads.
TEST(ChecksumManifestRace, AFileReplacedAfterHashingIsNotRecorded) {
  for (const size_t new_size : {size_t{3000}, size_t{6000}}) {  // same size, and another size
    SCOPED_TRACE(new_size);
    TempDir dir;
    const std::string other = dir.Join("other.safetensors");
    const std::string path = dir.Join("part1.safetensors");
    ASSERT_TRUE(WriteOne(other, 2000, 7).ok());
    ASSERT_TRUE(WriteOne(path, 3000, 1).ok());
    {  // the folder's manifest records both
      for (const std::string& p : {other, path}) {
        auto ckpt = Checkpoint::Open(p);
        ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
        auto m = ComputeChecksumManifest(**ckpt, 1024, 1);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        ASSERT_TRUE(WriteChecksumManifest(**ckpt, *m).ok());
      }
    }
    const std::string sidecar = dir.Join(std::string(kChecksumManifestName));

    auto ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    auto hashed = ComputeChecksumManifest(**ckpt, 1024, 1);
    ASSERT_TRUE(hashed.ok()) << hashed.status().ToString();
    // The save lands now: it drops the old file's entry (under the manifest's lock) and renames.
    ASSERT_TRUE(WriteOne(path, new_size, 2).ok());
    const std::string before = ReadBytes(sidecar);

    const Status written = WriteChecksumManifest(**ckpt, *hashed);
    ASSERT_FALSE(written.ok());
    EXPECT_EQ(written.code(), Code::kIoError);
    EXPECT_TRUE(Contains(written.message(), path + ": file changed"));
    EXPECT_TRUE(Contains(written.message(), "nothing was written"));
    EXPECT_TRUE(Contains(written.message(), "run the checksum again"));
    EXPECT_EQ(ReadBytes(sidecar), before);

    // The new file is good: without an entry it verifies (unchecked) and the other file's stays.
    ckpt->reset();
    auto fresh = Checkpoint::Open(path);
    ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
    EXPECT_TRUE(VerifyCheckpointChecksums(**fresh).ok());
    auto manifest = ReadChecksumManifest(**fresh);
    ASSERT_TRUE(manifest.ok() && manifest->has_value());
    EXPECT_EQ((*manifest)->files.count("part1.safetensors"), 0u);
    EXPECT_EQ((*manifest)->files.count("other.safetensors"), 1u);

    // Run again, it records the new file.
    auto again = ComputeChecksumManifest(**fresh, 1024, 1);
    ASSERT_TRUE(again.ok());
    ASSERT_TRUE(WriteChecksumManifest(**fresh, *again).ok());
    ASSERT_TRUE(VerifyCheckpointChecksums(**fresh).ok());
    manifest = ReadChecksumManifest(**fresh);
    ASSERT_TRUE(manifest.ok() && manifest->has_value());
    EXPECT_EQ((*manifest)->files.at("part1.safetensors").size, std::filesystem::file_size(path));
  }
}

// The writer's side of the same race, where no manifest names the file yet (a first `checksum`
// of a folder): the save renames only under the manifest's lock, so a `checksum` that merges its
// digests of the old file (under that lock) either finishes before the rename, whose entry the
// save then drops, or sees the new file and refuses. Here the lock is held while a save runs: the
// save writes its temporary but leaves the old file in place until the lock is let go.
TEST(ChecksumManifestRace, ASaveRenamesOnlyUnderTheManifestLock) {
  TempDir dir;
  const std::string path = dir.Join("part1.safetensors");
  ASSERT_TRUE(WriteOne(path, 3000, 1).ok());
  const std::string old_bytes = ReadBytes(path);
  auto held = internal::LockManifest(dir.path());
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_TRUE(held->has_value()) << "a real directory has the lock";
  std::atomic<bool> done{false};
  Status saved;
  std::thread saver([&] {
    saved = WriteOne(path, 3000, 2);
    done = true;
  });
  // Until the save's temporary is complete (its size), or the save is over (without the lock).
  const auto temporary_written = [&] {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir.path(), ec)) {
      const std::string name = e.path().filename().string();
      if (name.starts_with(".part1.safetensors.tmp-") && e.file_size(ec) == old_bytes.size()) {
        return true;
      }
    }
    return false;
  };
  for (int i = 0; i < 20000 && !done && !temporary_written(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (int i = 0; i < 200 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(done) << "the save finished while the manifest's lock was held";
  EXPECT_EQ(ReadBytes(path), old_bytes) << "renamed while the manifest's lock was held";
  held->reset();  // let go
  saver.join();
  ASSERT_TRUE(saved.ok()) << saved.ToString();
  EXPECT_NE(ReadBytes(path), old_bytes);
}

// A file saved without embedded checksums is protected by its manifest entry only: a `checksum`
// run after its bytes were damaged must not record the damaged bytes over that entry (which made
// `verify` pass again). The file is checked against its entry, in the manifest's chunk size (as
// the digests are computed) or in another (a pass of its own); RecordedChecksums::kReplace
// records a file changed on purpose.
// Files given one by one from two folders: the manifest beside the first records none of the
// other folder's files, and its entry for a file of the same name there is not theirs.
TEST(ChecksumManifestCheck, FilesOfAnotherFolderAreNotTheManifests) {
  TempDir root;
  std::filesystem::create_directories(root.Join("a"));
  std::filesystem::create_directories(root.Join("b"));
  const std::string ax = root.Join("a/x.safetensors"), ay = root.Join("a/y.safetensors");
  const std::string by = root.Join("b/y.safetensors");
  ASSERT_TRUE(WriteOne(ax, 3000, 1, "x").ok());
  ASSERT_TRUE(WriteOne(ay, 5000, 2, "y").ok());
  ASSERT_TRUE(WriteOne(by, 5000, 3, "y").ok());  // the same names and size, other bytes
  {
    auto a = Checkpoint::OpenFiles(std::vector<std::string>{ax, ay}).ValueOrThrow();
    ASSERT_TRUE(WriteChecksumManifest(*a, ComputeChecksumManifest(*a).ValueOrThrow()).ok());
  }
  const std::string sidecar = root.Join("a/" + std::string(kChecksumManifestName));
  const std::string recorded = ReadBytes(sidecar);
  auto mixed = Checkpoint::OpenFiles(std::vector<std::string>{ax, by}).ValueOrThrow();
  ASSERT_EQ(mixed->files()[0].path, ax);
  const Result<ChecksumManifest> m = ComputeChecksumManifest(*mixed);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), Code::kInvalidArgument) << m.status().ToString();
  EXPECT_TRUE(Contains(m.status().message(), by + ": not in \"" + root.Join("a") + "\""))
      << m.status().ToString();
  EXPECT_EQ(ReadBytes(sidecar), recorded);
  // b/y is checked against nothing (a/y's entry is not its), a/x against its entry.
  ChecksumSource source = ChecksumSource::kEmbedded;
  const auto manifest = ReadChecksumManifest(*mixed).ValueOrThrow();
  ASSERT_TRUE(manifest.has_value());
  auto for_by = ChecksumsForFile(*mixed, 1, &*manifest, &source);
  ASSERT_TRUE(for_by.ok()) << for_by.status().ToString();
  EXPECT_FALSE(for_by->has_value());
  EXPECT_EQ(source, ChecksumSource::kNone);
  auto for_ax = ChecksumsForFile(*mixed, 0, &*manifest, &source);
  ASSERT_TRUE(for_ax.ok() && for_ax->has_value());
  EXPECT_EQ(source, ChecksumSource::kManifest);
  EXPECT_TRUE(VerifyCheckpointChecksums(*mixed).ok());
}

TEST(ChecksumManifestCheck, AFileTheManifestRecordsIsCheckedAgainstItsEntry) {
  TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  const std::string sidecar = dir.Join(std::string(kChecksumManifestName));
  ASSERT_TRUE(WriteOne(path, 5000, 3).ok());
  const auto record = [&](RecordedChecksums recorded, uint64_t chunk) -> Status {
    TF_ASSIGN_OR_RETURN(const std::shared_ptr<const Checkpoint> ckpt, Checkpoint::Open(path));
    TF_ASSIGN_OR_RETURN(const ChecksumManifest m,
                        ComputeChecksumManifest(*ckpt, chunk, 2, recorded));
    return WriteChecksumManifest(*ckpt, m);
  };
  const auto verify = [&]() -> Status {
    TF_ASSIGN_OR_RETURN(const std::shared_ptr<const Checkpoint> ckpt, Checkpoint::Open(path));
    return VerifyCheckpointChecksums(*ckpt);
  };
  ASSERT_TRUE(record(RecordedChecksums::kCheck, 1024).ok());
  ASSERT_TRUE(record(RecordedChecksums::kCheck, 1024).ok()) << "a good file is recorded again";
  const std::string good = ReadBytes(path);
  const std::string recorded = ReadBytes(sidecar);

  std::string bad = good;
  bad[bad.size() - 1500] ^= 0x10;  // chunk 3 of the tensor's 5 (its last 5000 bytes)
  testing::WriteBytes(path, bad);
  ASSERT_EQ(verify().code(), Code::kChecksumMismatch);
  for (const uint64_t chunk : {uint64_t{1024}, uint64_t{2048}}) {
    SCOPED_TRACE(chunk);
    const Status again = record(RecordedChecksums::kCheck, chunk);
    EXPECT_EQ(again.code(), Code::kChecksumMismatch) << again.ToString();
    EXPECT_TRUE(
        Contains(again.message(), path + ": tensor \"w\": checksum mismatch in chunk 3 of 5"))
        << again.ToString();
    EXPECT_TRUE(Contains(again.message(), "against the checksums the manifest records for it"))
        << again.ToString();
    EXPECT_TRUE(Contains(again.message(), "--replace")) << again.ToString();
    EXPECT_EQ(ReadBytes(sidecar), recorded);
    EXPECT_EQ(verify().code(), Code::kChecksumMismatch);
  }
  // Changed on purpose: replaced, it verifies.
  ASSERT_TRUE(record(RecordedChecksums::kReplace, 1024).ok());
  EXPECT_TRUE(verify().ok());
  EXPECT_NE(ReadBytes(sidecar), recorded);

  // Another file put in its place by a tool that does not know the manifest (not a tensorferry
  // writer, which drops the entry): of another size, or of other tensors.
  ASSERT_TRUE(WriteOne(dir.Join("bigger.safetensors"), 6000, 4).ok());
  testing::WriteBytes(path, ReadBytes(dir.Join("bigger.safetensors")));
  Status replaced = record(RecordedChecksums::kCheck, 1024);
  EXPECT_EQ(replaced.code(), Code::kChecksumMismatch) << replaced.ToString();
  EXPECT_TRUE(Contains(replaced.message(),
                       "the checksum manifest records " + std::to_string(bad.size()) + " bytes"))
      << replaced.ToString();
  EXPECT_TRUE(Contains(replaced.message(), "not what the manifest recorded"))
      << replaced.ToString();
  ASSERT_TRUE(record(RecordedChecksums::kReplace, 1024).ok());
  std::string renamed = ReadBytes(path);
  const size_t at = renamed.find("\"w\"");
  ASSERT_NE(at, std::string::npos);
  renamed[at + 1] = 'v';  // same size, another tensor name
  testing::WriteBytes(path, renamed);
  replaced = record(RecordedChecksums::kCheck, 1024);
  EXPECT_EQ(replaced.code(), Code::kChecksumsInvalid) << replaced.ToString();
  EXPECT_TRUE(Contains(replaced.message(), "not what the manifest recorded"))
      << replaced.ToString();
  EXPECT_TRUE(record(RecordedChecksums::kReplace, 1024).ok());
  EXPECT_TRUE(verify().ok());
}

// A manifest that cannot be parsed cannot say what the files should hold: the checksum refuses
// (remove it to record the files anew), unless asked to replace (then the write refuses it).
TEST(ChecksumManifestCheck, AManifestThatCannotBeReadIsNotSkipped) {
  TempDir dir;
  const std::string path = dir.Join("model.safetensors");
  ASSERT_TRUE(WriteOne(path, 3000, 5).ok());
  testing::WriteBytes(dir.Join(std::string(kChecksumManifestName)), "{not json");
  auto ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto m = ComputeChecksumManifest(**ckpt, 1024, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(Contains(m.status().message(), "remove it to record the files as they are"))
      << m.status().ToString();
  m = ComputeChecksumManifest(**ckpt, 1024, 1, RecordedChecksums::kReplace);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_FALSE(WriteChecksumManifest(**ckpt, *m).ok());
}

}  // namespace
}  // namespace tensorferry

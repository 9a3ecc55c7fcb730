// tensorferry/writer.h: writing safetensors files and sharded checkpoints.
//
// Output is byte-for-byte the reference's layout: tensors sorted by dtype (descending, in the
// order of DType) then by name (bytewise), compact JSON header with "__metadata__" first, its keys
// sorted so output is deterministic, header padded with spaces to a multiple of 8 bytes, data
// contiguous in header order.
//
// Writes are atomic: bytes go to a temporary file in the destination directory, which is
// fsynced, then renamed over the destination (and the directory fsynced). On any error the
// temporary file is removed and the destination is untouched. A sharded write is atomic as a
// whole (WriteSharded). File operations go through WriteOptions::env (env.h), so tests can inject
// failures (ENOSPC on the Nth write, a failing rename). Files are created with mode
// 0666 & ~umask. Invalid input (bad names, duplicate names, data of the wrong size) is refused
// before anything is written.
//
// Ownership: the writer borrows TensorToWrite::data for the duration of the call only.
// Thread-safety: reentrant; concurrent calls writing to different paths are safe, also in one
// folder whose sidecar checksum manifest (integrity.h) they change: every change of a manifest
// holds its directory's lock (WriteChecksumManifest). Concurrent sharded writes of one prefix into
// one folder are not serialized (last one wins, but may mix); DirectoryTransaction is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/env.h"
#include "tensorferry/format.h"
#include "tensorferry/status.h"

namespace tensorferry {

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  // The bytes, little-endian, row-major; exactly TensorByteSize(dtype, shape) long. Borrowed.
  std::span<const std::byte> data;
  // Alternative to `data` for tensors too large to hold at once: called with increasing offsets
  // to fill `out` with the tensor's bytes [offset, offset + out.size()). Used when set.
  std::function<Status(uint64_t offset, std::span<std::byte> out)> generate;
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

struct WriteOptions {
  // fsync the file and its directory before returning. Turn off only for scratch files.
  bool sync = true;
  // Size of the buffer used to stream data to disk (at most the file's size is allocated; 0 acts
  // as 1). Data spans at least this large are written straight from the caller's memory.
  size_t buffer_size = 8u << 20;
  // Creates, renames, removes and fsyncs files (and reads an existing index). nullptr:
  // Env::Default(). Borrowed for the duration of the call.
  Env* env = nullptr;
  // Per-tensor checksums (integrity.h, docs/integrity.md) stored in each file's "__metadata__"
  // under kChecksumsMetadataKey (replacing a value the caller passed under that key; off, such a
  // value is dropped: a record the writer did not compute would describe other bytes, e.g. a
  // file's metadata copied to a rewrite of its tensors). The only difference from the reference's
  // bytes is that metadata entry; turn off for byte-identical output. Spans are hashed before
  // writing, their chunks on up to `checksum_threads` threads (0: the hardware's count, at most 8);
  // generated tensors are hashed as they stream, and the header (same length, placeholder digests)
  // is rewritten at the end with WritableFile::WriteAt, or, where the Env's files cannot, the
  // generators are run twice (once to hash).
  bool checksums = true;
  uint64_t checksum_chunk_size = 4u << 20;  // kDefaultChecksumChunkSize; >= 1024 and <= 1 GiB
  unsigned checksum_threads = 0;
  // WriteFile writes "__metadata__":{} when `metadata` is empty (and there are no checksums), as
  // the reference does for metadata={} (none without: its metadata=None).
  bool metadata_table = false;
  // Called once every byte is written (and synced), before anything is put in place: an error
  // abandons the write as any other does (the temporaries removed, the destination untouched),
  // with the path as prefix. For what only the caller can tell, e.g. that the tensors written
  // were views of a mapped file that shrank meanwhile (mapping.h: CheckMappedFiles), whose pages
  // read as zeros. Empty: none. Called on the writing thread.
  std::function<Status()> before_commit;
};

// The header bytes (JSON plus padding, without the 8-byte length prefix) that WriteFile would
// write, and the order in which tensor data follows it. Pure; for tests and tools.
// Errors: kBadTensorName (empty names are allowed; "__metadata__" and duplicates are not),
// kBadTensorData (a data span of the wrong length, or neither data nor generate on a tensor with
// bytes), kOverflow, kPartialByte, kInvalidArgument (duplicate metadata key).
struct SerializedHeader {
  std::string json;           // padded to a multiple of 8 bytes
  std::vector<size_t> order;  // order[i] = index into the input of the i-th tensor written
  uint64_t data_size = 0;
};
// A kChecksumsMetadataKey entry in `metadata` is left out (as WriteFile leaves it out): a record
// the writer did not compute for these bytes would fail every later load that checks it.
// With `metadata_table`, "__metadata__":{} is written when `metadata` is empty
// (WriteOptions::metadata_table).
Result<SerializedHeader> SerializeHeader(std::span<const TensorToWrite> tensors,
                                         const Metadata& metadata, bool metadata_table = false);

// Writes one safetensors file at `path`. Errors: those of SerializeHeader; kInvalidArgument when
// `path` names no file (empty, ends in '/'); kIoError "<path>: is a directory" before anything is
// written (through Env::Default()); kIoError naming the path, the byte offset and errno;
// kBudgetExceeded when the write buffer cannot be allocated; any status returned by a generate
// callback, prefixed with the tensor's name (kInternal if it throws). The temporary file is
// "." + file name + ".tmp-<pid>@<host>-<random>" in the destination's directory (<host>: 8 hex
// digits, a hash of the machine's name and pid namespace). Leftovers of a writer killed where no
// handler ran (SIGKILL, OOM, power loss) are removed by the next write of the same file on the
// same machine: before writing, the dead writer's temporaries of `path`; once the new file is in
// place, its backups (WriteSharded's) of `path`. "Dead" means kill(pid, 0) fails with ESRCH and
// the name's <host> is this machine's and namespace's: a live writer's names, and another
// machine's on a shared filesystem, are never touched (src/util/writer_temporaries.h). If only the
// final fsync of the directory fails, the new file is already in place and kIoError is still
// returned. A sidecar checksum manifest beside `path` (integrity.h) that records the file being
// replaced loses that entry first (under the manifest's lock; the manifest goes with its last
// entry): its digests are of the old bytes. kIoError when that update fails (nothing is replaced
// then).
Status WriteFile(const std::string& path, std::span<const TensorToWrite> tensors,
                 const Metadata& metadata = {}, const WriteOptions& options = {});

struct ShardOptions {
  // Largest data buffer of one shard. A tensor larger than this gets a shard of its own. The
  // default is transformers' "5GB" (decimal, as it parses sizes).
  uint64_t max_shard_size = 5'000'000'000;
  // Shards are named "<prefix>-00001-of-00003.safetensors" (one shard: "<prefix>.safetensors");
  // the index is "<prefix>.safetensors.index.json" (written only for several shards unless
  // always_write_index).
  std::string prefix = "model";
  bool always_write_index = true;
  WriteOptions write;
};

// Writes a sharded checkpoint into directory `dir` (created if missing). Tensors fill shards in
// the caller's order (so layer 0 lands in the first shard, as transformers does); within a shard
// the layout is WriteFile's. Each shard gets `metadata`; the index gets
// {"metadata": {"total_size": <bytes>}, "weight_map": {<name>: <file>, ... sorted by name}}.
// Name checks (duplicates across shards included) run before any file is written. The index is
// json.dumps(index, indent=2, sort_keys=True) + "\n" except that non-ASCII characters are kept as
// UTF-8 rather than \u-escaped.
//
// All or nothing: every shard and the index are written to temporary names first. Only when all
// are complete (and fsynced) are the files they replace, and the files of the layout already there
// that the new one does not have, moved aside to hidden backups
// (".<name>.bak-<pid>@<host>-<random>"); then the new files are renamed in, the directory is
// fsynced and the backups removed. On any failure, and on a signal handled by
// AbandonWritesInProgress(), the temporaries are removed and the backups put back: the directory is
// exactly as before (a directory this call created is removed again). "The layout already there" is
// the files "<prefix>.safetensors",
// "<prefix>.safetensors.index.json" and the "*.safetensors" files that index names in `dir`; no
// other file is touched, except a sidecar checksum manifest (integrity.h) that records one of the
// files replaced or written: those entries describe other bytes and go, as part of the same
// commit (the manifest rewritten with the other files' entries, or removed when none is left),
// under the manifest's lock. The layout already there is read under that lock too, held to the
// commit: of two writers of one layout in one directory at once (on one machine), the later
// commit replaces the earlier's files whole, whatever their shard count. Only a crash (power loss,
// SIGKILL) during the renames can leave the hidden backups behind, from which the old files can be
// restored by hand until the next successful write of that layout on this machine removes them (as
// WriteFile: the dead writer's temporaries of "<prefix>.safetensors",
// "<prefix>-NNNNN-of-MMMMM.safetensors" of any count, the index, the files the old index names and
// the checksum manifest go before writing, its backups of them after the commit; a failed write
// keeps them). Errors: those of WriteFile; kInvalidArgument for a prefix that is empty, ".", "..",
// or holds '/', NUL or invalid UTF-8, or when a file to replace is a directory; kOverflow when the
// total size exceeds 64 bits; kIoError naming a backup that could not be removed after the new
// files are in place, or one that could not be put back after a failure. Returns the paths written
// (shards then index).
Result<std::vector<std::string>> WriteSharded(const std::string& dir,
                                              std::span<const TensorToWrite> tensors,
                                              const Metadata& metadata = {},
                                              const ShardOptions& options = {});

// Whether DirectoryTransaction::Create takes its root's write lock.
enum class DirectoryLock : uint8_t {
  kExclusive,  // the lock file kDirectoryLockName in the root, held until Commit() or destruction
  kNone,       // no lock (a caller that holds it already, or writes where no one else can)
};

// The lock file of a directory being written as one unit (DirectoryTransaction): hidden, it exists
// only while a transaction holds it (or after a crash, when the next transaction takes it over).
inline constexpr std::string_view kDirectoryLockName = ".tensorferry.lock";

// Directories written as one unit: the rank folders of `tensorferry reshard --tp`, each
// complete on its own (WriteSharded) but meaningful only together. Create() makes `root` and its
// missing parents; Add() hands over a complete directory and the files in it. Until Commit(), the
// destructor, and a signal handled by AbandonWritesInProgress(), remove every added file, every
// added directory and the directories Create() made, directories only once empty (so nothing the
// transaction did not write is ever removed): an interrupted or failed write of N folders leaves
// none of them. After Commit() nothing is removed.
//
// One writer at a time: with DirectoryLock::kExclusive (the default), Create() takes an exclusive
// lock on `root` (flock(2) on "<root>/.tensorferry.lock", in which it writes its pid, program and
// host) and fails at once if another transaction, in this process or another, holds it. Two
// `tensorferry reshard` runs into one destination would otherwise write the same hidden
// ".rank-...partial" folders, remove each other's as leftovers of an interrupted run, and undo
// each other's ranks. The lock is released (its file removed) by Commit() or the destructor, and
// the signal path removes the file too; the kernel releases it if the process dies, so a crash
// leaves no stale lock. Where it holds (local filesystems; NFS with a lock manager), what it
// does not: docs/integrity.md, "Concurrent writers". A caller that checks the state of `root`
// (e.g. that no rank folder exists) should do so after Create(), under the lock.
// Errors: kIoError naming the directory that could not be created; kIoError "<root>: another
// writer is writing this directory (<root>/.tensorferry.lock is held by pid N (program) on host:
// ...)" when the lock is held, or naming the lock file and the OS error when it cannot be made.
// Thread-compatible (one thread at a time); the signal path is async-signal-safe.
class DirectoryTransaction {
 public:
  static Result<DirectoryTransaction> Create(const std::string& root,
                                             DirectoryLock lock = DirectoryLock::kExclusive);
  DirectoryTransaction(DirectoryTransaction&&) noexcept;
  DirectoryTransaction& operator=(DirectoryTransaction&&) noexcept;
  DirectoryTransaction(const DirectoryTransaction&) = delete;
  DirectoryTransaction& operator=(const DirectoryTransaction&) = delete;
  ~DirectoryTransaction();

  // `dir` (complete, in place) and `files`, the paths of what was written in it.
  void Add(const std::string& dir, const std::vector<std::string>& files);
  // What Add(dir, ...) handed over is the caller's again: neither the destructor nor the signal
  // path removes it (a rename into `dir` that failed: `dir` may be someone else's).
  void Forget(const std::string& dir);
  // Makes the directories Create() made durable: fsyncs the directory holding each of them,
  // innermost first (`env`: nullptr for Env::Default()). Call before Commit() when the write is
  // synced; the folders and files added are the caller's to sync. Errors: kIoError naming the
  // directory whose fsync failed.
  Status SyncCreated(Env* env = nullptr) const;
  // Keeps everything added, and releases the lock.
  void Commit() noexcept;

 private:
  struct Rep;
  explicit DirectoryTransaction(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

// For a SIGINT/SIGTERM handler that is about to end the process: removes the temporary files of
// every write in progress in this process and undoes the renames of sharded writes not yet
// committed (backups renamed back, new names removed), so destinations are as before those
// writes; the backups of committed writes are removed. Async-signal-safe: it uses only unlink(2),
// rename(2) and lock-free atomics. Writes still running on other threads fail afterwards; the
// caller must not return to them (end the process, e.g. by re-raising the signal with its default
// disposition).
void AbandonWritesInProgress() noexcept;

}  // namespace tensorferry

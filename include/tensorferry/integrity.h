// tensorferry/integrity.h: per-tensor checksums (docs/integrity.md has the exact definition and a
// worked example).
//
// The hash is two-level so that large tensors never serialise it: a tensor's bytes are cut into
// fixed-size chunks (chunk_size bytes each, the last one shorter; a tensor of 0 bytes has no
// chunk), each chunk is hashed with XXH3-64 (seed 0) independently, and the tensor digest is
// XXH3-64 (seed 0) over the chunk digests, each written as 8 big-endian bytes, concatenated. A
// digest is written as 16 lowercase hex digits (big-endian: XXH64_canonical's byte order).
//
// Where checksums live:
//  - embedded: the writers put them in the file's "__metadata__" under kChecksumsMetadataKey, as a
//    compact JSON string (metadata values are strings, so every safetensors reader still reads the
//    file): {"algorithm":"xxh3-64-chunked","chunk_size":4194304,
//            "tensors":{"<name>":{"digest":"<16 hex>","chunks":"<16 hex per chunk>"},...}}
//  - a sidecar manifest, kChecksumManifestName beside a third-party checkpoint (`tensorferry
//    checksum PATH`), covering every file: {"algorithm":...,"chunk_size":...,"files":{"<file name
//    relative to the manifest>":{"size":<bytes>,"tensors":{...as above...}},...}}
//
// Parsers here take untrusted text: they never crash, refuse malformed input with
// kChecksumsInvalid naming what is wrong, and an algorithm they do not know with kUnsupported (so a
// reader may ignore checksums of a newer version, with that reason). Every digest is checked
// against its chunks when parsed (corrupt metadata is reported as such, not as corrupt data).
//
// Thread-safety: every function is reentrant; values are plain data. WriteChecksumManifest
// serializes with every other change of the same manifest, in this process and others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/env.h"
#include "tensorferry/status.h"

namespace tensorferry {

inline constexpr std::string_view kChecksumsMetadataKey = "tensorferry.checksums";
inline constexpr std::string_view kChecksumAlgorithm = "xxh3-64-chunked";
inline constexpr std::string_view kChecksumManifestName = "tensorferry.checksums.json";
inline constexpr uint64_t kDefaultChecksumChunkSize = 4u << 20;
// Chunk sizes a parser accepts: [kMinChecksumChunkSize, kMaxChecksumChunkSize].
inline constexpr uint64_t kMinChecksumChunkSize = 1024;
inline constexpr uint64_t kMaxChecksumChunkSize = 1ull << 30;

struct TensorChecksum {
  uint64_t digest = 0;           // XXH3-64 over the chunk digests (big-endian, concatenated)
  std::vector<uint64_t> chunks;  // one digest per chunk, in order
  bool operator==(const TensorChecksum&) const = default;
};

// The checksums of one file's tensors.
struct FileChecksums {
  uint64_t chunk_size = kDefaultChecksumChunkSize;
  std::map<std::string, TensorChecksum> tensors;  // by tensor name
  bool operator==(const FileChecksums&) const = default;
};

// Number of chunks of a tensor of `size` bytes: ceil(size / chunk_size). REQUIRES: chunk_size > 0.
uint64_t ChecksumChunkCount(uint64_t size, uint64_t chunk_size) noexcept;
// XXH3-64 (seed 0) of one chunk's bytes.
uint64_t ChecksumChunk(std::span<const std::byte> chunk) noexcept;
// The tensor digest from its chunk digests.
uint64_t CombineChunkDigests(std::span<const uint64_t> chunks) noexcept;
// The checksum of a tensor's bytes; chunks are hashed on up to `threads` threads (1: this thread).
// REQUIRES: chunk_size > 0.
TensorChecksum ComputeTensorChecksum(std::span<const std::byte> bytes, uint64_t chunk_size,
                                     unsigned threads = 1);

// Accumulates a tensor's checksum from its bytes given in order, in pieces of any size (for
// writers that stream a tensor). REQUIRES: chunk_size > 0.
class ChecksumBuilder {
 public:
  explicit ChecksumBuilder(uint64_t chunk_size);
  ~ChecksumBuilder();
  ChecksumBuilder(const ChecksumBuilder&) = delete;
  ChecksumBuilder& operator=(const ChecksumBuilder&) = delete;
  ChecksumBuilder(ChecksumBuilder&&) noexcept;
  ChecksumBuilder& operator=(ChecksumBuilder&&) noexcept;

  void Update(std::span<const std::byte> bytes);
  // The checksum of every byte given so far; the builder starts again empty.
  TensorChecksum Finish();

 private:
  struct State;
  uint64_t chunk_size_;
  uint64_t in_chunk_ = 0;  // bytes of the current chunk hashed so far
  std::vector<uint64_t> chunks_;
  State* state_;  // XXH3 streaming state (owned)
};

// "0123456789abcdef": the 16 lowercase hex digits of a digest.
std::string DigestHex(uint64_t digest);

// The compact JSON text stored under kChecksumsMetadataKey (tensors sorted by name).
std::string SerializeFileChecksums(const FileChecksums& checksums);
// Parses that text. Errors: kChecksumsInvalid (not JSON, wrong types, duplicate or unknown keys,
// a bad hex digest, a chunk size out of range, a digest that does not match its chunks);
// kUnsupported (an algorithm other than kChecksumAlgorithm). Messages start with `source`.
Result<FileChecksums> ParseFileChecksums(std::string_view text, std::string_view source = {});

// Returns the checksums embedded in a file's metadata (FileInfo::metadata), nullopt when the file
// has none. Errors: those of ParseFileChecksums.
Result<std::optional<FileChecksums>> EmbeddedChecksums(
    std::span<const std::pair<std::string, std::string>> metadata, std::string_view source = {});

// Checks that `expected` fits a tensor of `size` bytes (its chunk count). Errors: kChecksumsInvalid
// "<file>: tensor '<name>': checksum has C chunks, the tensor's N bytes make K", and for a
// chunk_size of 0 (here and in the three below).
Status CheckChecksumShape(const TensorChecksum& expected, uint64_t chunk_size, uint64_t size,
                          std::string_view file, std::string_view tensor);

// Verifies chunk `index` of a tensor whose bytes [index*chunk_size, ...) are `bytes`.
// Errors: kChecksumMismatch "<file>: tensor '<name>': checksum mismatch in chunk I of K (tensor
// bytes [a, b), file bytes [a+o, b+o)): xxh3 <got>, expected <want>" where o = file_offset (the
// tensor's first byte in the file); kChecksumsInvalid when the index or length does not fit.
Status VerifyChunk(const TensorChecksum& expected, uint64_t chunk_size, uint64_t tensor_size,
                   uint64_t index, std::span<const std::byte> bytes, std::string_view file,
                   std::string_view tensor, uint64_t file_offset);
// The same for a chunk of `length` bytes whose XXH3-64 `got` was computed elsewhere (hashed as
// its bytes arrived). Same errors.
Status CheckChunkDigest(const TensorChecksum& expected, uint64_t chunk_size, uint64_t tensor_size,
                        uint64_t index, uint64_t length, uint64_t got, std::string_view file,
                        std::string_view tensor, uint64_t file_offset);
// Verifies a whole tensor's bytes, its chunks on up to `threads` threads. Errors: those of
// CheckChecksumShape and VerifyChunk (the first mismatching chunk).
Status VerifyTensor(const TensorChecksum& expected, uint64_t chunk_size,
                    std::span<const std::byte> bytes, std::string_view file,
                    std::string_view tensor, uint64_t file_offset, unsigned threads = 1);
// Verifies the chunks of a tensor of `tensor_size` bytes that lie wholly inside its bytes
// [begin, begin + bytes.size()), which `bytes` holds (a partial read: one block of rows); the
// chunks cut by the range's ends are not checked. Returns the bytes of the chunks checked (0 when
// the range holds none; tensor_size for the whole tensor). Errors: those of CheckChecksumShape
// and VerifyChunk (the first mismatching chunk); kInvalidArgument when the range passes the
// tensor's end.
Result<uint64_t> VerifyTensorRange(const TensorChecksum& expected, uint64_t chunk_size,
                                   uint64_t tensor_size, uint64_t begin,
                                   std::span<const std::byte> bytes, std::string_view file,
                                   std::string_view tensor, uint64_t file_offset);

// --- the sidecar manifest ---------------------------------------------------------------------
struct ManifestFile {
  uint64_t size = 0;  // the file's size in bytes
  FileChecksums checksums;
  bool operator==(const ManifestFile&) const = default;
};
struct ChecksumManifest {
  uint64_t chunk_size = kDefaultChecksumChunkSize;
  // By file name relative to the manifest's directory (no "..", not absolute).
  std::map<std::string, ManifestFile> files;
  bool operator==(const ChecksumManifest&) const = default;
};

// JSON text (indented, files and tensors sorted, ending in a newline).
std::string SerializeChecksumManifest(const ChecksumManifest& manifest);
// Errors: those of ParseFileChecksums, and kChecksumsInvalid for a file name that is empty,
// absolute, holds "..", a backslash or NUL.
Result<ChecksumManifest> ParseChecksumManifest(std::string_view text, std::string_view source = {});

// --- checkpoints ------------------------------------------------------------------------------
class Checkpoint;

// Where a checkpoint's sidecar manifest lives: kChecksumManifestName in the directory of its
// index (of its file, for a single file; "" for a checkpoint of no file). Manifest file names
// are relative to that directory ("a/model-00001-of-00002.safetensors" for a shard the index
// keeps in a subfolder).
std::string ChecksumManifestPath(const Checkpoint& ckpt);
// The manifest beside `ckpt`, nullopt when there is none. Errors: those of
// ParseChecksumManifest; kIoError when it exists but cannot be read.
Result<std::optional<ChecksumManifest>> ReadChecksumManifest(const Checkpoint& ckpt);
// What ComputeChecksumManifest does with the manifest already beside a checkpoint.
enum class RecordedChecksums : uint8_t {
  // A file it records is checked against its entry (kChecksumMismatch when they differ).
  kCheck,
  // Its entries are not read: the files are recorded as they are (a file changed on purpose).
  kReplace,
};
// Reads every tensor of every file of `ckpt` and computes its checksums (chunks hashed on up to
// `threads` threads). Digests of damaged bytes are never recorded as the truth about a file: one
// with embedded checksums is checked against them, and with kCheck one that the manifest beside a
// local `ckpt` records (a file saved without embedded checksums, which only the manifest protects)
// against its entry. A record in `chunk_size` is compared with the digests as they are computed;
// one in another chunk size is checked in a pass of its own (the file is read twice). (A record of
// an unknown algorithm is not checked.) Errors: kChecksumMismatch naming file, tensor and chunk
// ("... (against the checksums embedded in the file ...)" or "... (against the checksums the
// manifest records for it: the file is not what the manifest recorded (damaged, or changed on
// purpose: then ask to replace its entry ...))"), also for a file whose size differs from its
// entry's; kChecksumsInvalid for an entry whose tensors are not the file's; those of
// ReadChecksumManifest (with kCheck), of EmbeddedChecksums but kUnsupported, and the read errors
// of the checkpoint's files; kInvalidArgument, before any read, for files outside the manifest's
// folder (files given one by one from several folders: a manifest records its own folder's; the
// manifest of that folder is never consulted for a file outside it, either).
Result<ChecksumManifest> ComputeChecksumManifest(
    const Checkpoint& ckpt, uint64_t chunk_size = kDefaultChecksumChunkSize, unsigned threads = 1,
    RecordedChecksums recorded = RecordedChecksums::kCheck);
// Writes `manifest` to ChecksumManifestPath(ckpt) atomically (temporary file, fsync, rename,
// fsync of the directory) through `env` (nullptr: Env::Default()). A manifest already there keeps
// its entries of files that are not `ckpt`'s (several single-file checkpoints in one folder share
// it); `ckpt`'s are replaced. The read, merge and rename hold an exclusive lock on the directory
// (flock(2) on the directory itself, waited for; nothing is created), which every change of the
// manifest by this library takes (this call, and the writers of writer.h dropping the entries of
// files they replace): threads and processes writing different files into one folder at once
// keep each other's entries. Across machines on NFS the lock is per machine (docs/integrity.md,
// "Concurrent writers"; a directory only `env` has, in memory, is not locked). Errors: kIoError
// (the directory cannot be opened to lock it, or the
// write fails); kInvalidArgument when the manifest there holds other files' entries in another
// chunk size; those of ReadChecksumManifest for one that cannot be read or parsed (nothing is
// written: remove it to start anew); kIoError "<path>: file changed since the checkpoint was
// opened: <what>; it changed while its checksums were computed ...: nothing was written (the
// manifest is as it was); run the checksum again" when, checked under the lock, a file of `ckpt`
// is no longer the one it opened (SourceFile::CheckUnchanged: device, inode, size, mtime in ns,
// and that its path still names it): `manifest` (REQUIRES: computed from `ckpt`) would record the
// digests of its old bytes under the new file's name (a `save_file` racing `tensorferry
// checksum`). Nothing is recorded then, for any file: a manifest that covers only part of what
// was asked would look complete.
Status WriteChecksumManifest(const Checkpoint& ckpt, const ChecksumManifest& manifest,
                             Env* env = nullptr);

// Where a file's checksums came from.
enum class ChecksumSource : uint8_t { kNone, kEmbedded, kManifest };
std::string_view ChecksumSourceName(ChecksumSource source) noexcept;  // "none", "embedded", ...

// The checksums that apply to file `f` of `ckpt`: those embedded in it, else the manifest's entry
// for it (whose size must be the file's), else none (`*source` says which). Errors: those of
// EmbeddedChecksums; kChecksumMismatch when the manifest records another size for the file;
// kChecksumsInvalid when the record and the file's tensors differ (a tensor without a checksum, a
// checksum for a tensor the file lacks, or one of the wrong chunk count).
Result<std::optional<FileChecksums>> ChecksumsForFile(const Checkpoint& ckpt, uint32_t f,
                                                      const ChecksumManifest* manifest,
                                                      ChecksumSource* source);
// Reads every tensor of file `f` and verifies its chunks (on up to `threads` threads).
// `*bytes_verified` (optional) counts the tensor bytes checked. Errors: kChecksumMismatch naming
// file, tensor, chunk and byte ranges; the read errors of the file.
Status VerifyFileChecksums(const Checkpoint& ckpt, uint32_t f, const FileChecksums& checksums,
                           unsigned threads = 1, uint64_t* bytes_verified = nullptr);
// VerifyFileChecksums for every file of `ckpt` that has checksums (embedded, or in the sidecar
// manifest beside a local checkpoint); a file without passes. `on_file` (optional) is told, per
// file in order, where its checksums came from and the tensor bytes it verified. Errors: those of
// ReadChecksumManifest, ChecksumsForFile and VerifyFileChecksums (the first file at fault).
Status VerifyCheckpointChecksums(
    const Checkpoint& ckpt, unsigned threads = 1,
    const std::function<void(uint32_t f, ChecksumSource source, uint64_t bytes)>& on_file = {});

enum class VerifyMode : uint8_t;  // options.h: LoadOptions::verify

// The checksums a load of `ckpt` checks under `verify` (LoadOptions::verify), per file: for each
// file those ChecksumsForFile finds (the embedded ones, else the manifest's entry beside a local
// checkpoint), nullopt for a file without; an empty vector when no file has any, or with kOff.
// Records of an algorithm this version does not know are ignored with kAuto. Errors: those of
// ReadChecksumManifest and ChecksumsForFile (kUnsupported only with kOn); kChecksumsInvalid
// naming the file when kOn finds a file without checksums. The Loader and the cooperative
// planner both take the checksums they check from here.
Result<std::vector<std::optional<FileChecksums>>> ChecksumsForLoad(const Checkpoint& ckpt,
                                                                   VerifyMode verify);

// --- Hugging Face hub caches ------------------------------------------------------------------
// SHA-256 of a whole file, as 64 lowercase hex digits (OpenSSL's EVP). Errors: kNotFound,
// kIoError naming the path and offset.
Result<std::string> Sha256OfFile(const std::string& path);
// If `path` (a file inside a hub-cache snapshot, "<repo>/snapshots/<rev>/<name>") resolves to a
// blob "<repo>/blobs/<64 hex digits>", returns that blob's path and expected SHA-256; nullopt
// otherwise (not a symlink into blobs/, or a blob named by a git SHA-1, as small text files are).
std::optional<std::pair<std::string, std::string>> HubCacheBlob(const std::string& path);

}  // namespace tensorferry

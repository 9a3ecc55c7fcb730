// tensorferry/checkpoint.h: one immutable table of every tensor of a checkpoint.
//
// A checkpoint is one safetensors file, an explicit list of them, or a directory. A directory
// with "model.safetensors.index.json" (or an index file given directly) is a sharded checkpoint:
// every tensor named in its weight_map must exist in the file it names, every tensor of those
// files must be in the map, no tensor may live in two files, and no path may leave the directory
// (no "..", no absolute path, no symlink resolving outside). A directory without an index holds
// the union of its *.safetensors files (names must be unique across them); since nothing else
// says which files make it, a numbered series "<prefix>-<i>-of-<n>.safetensors" among them must
// be whole, and an entry that is a link to nothing is a missing file, not one to skip
// (kCheckpointIncomplete; the same for an object-store prefix listed without an index).
//
// Opening reads and validates every header (format.h) but no tensor data.
//
// Path safety of an index (the rules live in src/util/path.h, shared with the PyTorch .bin index
// of convert.h): the lexical checks (no absolute path, no ".." component, no NUL, no
// backslash) always apply. The symlink check (each file's std::filesystem::weakly_canonical path
// must lie inside the canonical directory of the index) needs the real file system, so it runs
// only when OpenOptions::env is nullptr (the default Env). One exception keeps the Hugging Face hub
// cache working: when the checkpoint directory is <repo>/snapshots/<rev> or a folder inside it
// (diffusers' transformer/, hf://OWNER/NAME/SUBFOLDER), a symlink resolving into <repo>/blobs/
// (that repository's own blobs, where the hub cache keeps the bytes) is accepted.
//
// Files: Open opens each file once, through OpenOptions::source (source.h), reads its header
// through that open file, and keeps it: the Checkpoint owns its files, and every Loader made from
// it, every load, stream and partial read (File()) reads through them; no path is opened again
// while the file is held. A checkpoint with more files than OpenOptions::max_open_files keeps at
// most that many open (least recently used closed first) and opens the others again when read;
// a file opened again must have the identity (device, inode, size, mtime) it had at Open, else
// kIoError "<path>: file changed since the checkpoint was opened: <what changed>".
//
// Files that change after Open: CheckUnchanged() compares, for every file held open, the fstat of
// its descriptor (an in-place rewrite: size or mtime) and the stat of its path (a file renamed
// over, or removed) with the identity taken at Open: two system calls per held file, no reads.
// Every load of a Loader calls it before reading (the files not held are checked when opened
// again), so a shard replaced by one of the same size, for a single file, a directory or an index
// checkpoint alike, is reported at the next load rather than read.
//
// Ownership and lifetime: Open returns a shared_ptr to an immutable Checkpoint; hold it as long
// as you use its tables or files. Its files close when the last holder (the Checkpoint, a Loader,
// a SourceFile handed out by File()) lets go.
// Thread-safety: a Checkpoint is immutable after Open and safe to read from any thread (its file
// table synchronizes internally).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/env.h"
#include "tensorferry/format.h"
#include "tensorferry/object_store.h"
#include "tensorferry/source.h"
#include "tensorferry/status.h"

namespace tensorferry {

namespace io {
class FileSet;  // internal: src/io/file_set.h
}

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
// The single file of an unsharded model folder (what an HTTP prefix without an index names).
inline constexpr std::string_view kSingleFileName = "model.safetensors";

// The parsed content of a model.safetensors.index.json, before any file is opened.
struct IndexDocument {
  // (tensor name, file path as written in the index), sorted by tensor name.
  std::vector<std::pair<std::string, std::string>> weight_map;
  // The "metadata" object, each value as its JSON text (e.g. total_size -> "123"); sorted by key.
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct IndexLimits {
  uint64_t max_index_size = 256u << 20;  // bytes of index JSON
  // Deepest JSON nesting in containers, counted as ParseLimits::max_depth is: a valid index
  // needs 2 ({"weight_map":{"a":"f"}}). Deeper documents are kIndexInvalidJson.
  uint32_t max_depth = 64;
};

// Parses the text of an index file. Pure: no I/O. Path safety is checked here too: a file value
// that is absolute or has a ".." component is kIndexPathEscape.
// Errors: kIndexTooLarge, kIndexInvalidJson, kIndexNoWeightMap, kIndexBadEntry, kDuplicateKey,
// kIndexPathEscape.
Result<IndexDocument> ParseIndexJson(std::string_view json, std::string_view source = "",
                                     const IndexLimits& limits = {});

struct FileInfo {
  std::string path;  // as opened (the directory joined with the index's relative path); a
                     // relative local path is made absolute when the checkpoint is opened
  uint64_t file_size = 0;
  uint64_t header_size = 0;                                   // N
  uint64_t data_offset = 0;                                   // 8 + N
  std::vector<std::pair<std::string, std::string>> metadata;  // "__metadata__", sorted by key
  uint64_t num_tensors = 0;
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint32_t file = 0;    // index into Checkpoint::files()
  uint64_t offset = 0;  // absolute byte offset of the first byte in the file
  uint64_t size = 0;    // bytes
};

struct OpenOptions {
  // Where files are read from. nullptr means Env::Default(). Not owned; must outlive the
  // Checkpoint (files not held open are opened again through it).
  Env* env = nullptr;
  // Where files are read from, when set (env then only decides what a path is); nullptr:
  // MakeEnvSource(env).
  std::shared_ptr<Source> source;
  // Settings of the object Source made for "s3://" and "http(s)://" paths when `source` is unset
  // (object_store.h).
  ObjectStoreOptions object_store;
  // Files held open at once; 0: a quarter of the soft RLIMIT_NOFILE, between 8 and 1024.
  size_t max_open_files = 0;
  ParseLimits parse_limits;
  IndexLimits index_limits;
  // Bounds on the whole checkpoint, so that many files within the per-file limits cannot add up
  // to unbounded memory: tensors of all files, and bytes of all headers' JSON
  // (kCheckpointTooLarge).
  uint64_t max_total_tensors = 2'000'000;
  uint64_t max_total_header_bytes = 512ull << 20;
  // Once *cancel is true, the open's object-store requests (header GETs, listings, hub lookups,
  // credential fetches) are abandoned and their retries' waits cut short, and the open fails
  // with kCancelled; local files are read to the end of the step they are in. nullptr: never.
  // Not owned; must outlive the call.
  const std::atomic<bool>* cancel = nullptr;
};

// The path Checkpoint::Open names a local checkpoint by: a relative path made absolute against
// the working directory of now (its files are found again by path later, which a chdir in
// between must not redirect; a leading "./" dropped, nothing else rewritten: a ".." may cross a
// symbolic link). URLs, hf:// paths and absolute paths are returned as given.
std::string AnchoredPath(const std::string& path);

class Checkpoint {
 public:
  // Opens a .safetensors file, a model.safetensors.index.json file, or a directory; or the same
  // in object storage or on an HTTP server, by URL (object_store.h says how a URL is decided);
  // or, by an hf:// path, in the local Hugging Face hub cache, else on the hub itself (hub.h:
  // the cached snapshot opened as a local path, else the hub's URL pinned to a commit opened as a
  // URL; ResolveHubPath's and HubUrl's errors).
  // What `path` is comes from the real file system: a directory is read through its index when
  // kIndexFileName is inside, else as every regular "*.safetensors" file directly inside (sorted
  // by name); any other path ending in ".json" is an index; anything else a safetensors file.
  // With a custom OpenOptions::env, a path the real file system does not have is decided by name
  // (".json": an index; else a file), and when the Env has no such file but has
  // "<path>/model.safetensors.index.json", that index is opened.
  // Errors: kNotFound, kIoError, kUnexpectedEof, every header error of ParseHeader and every
  // index error of ParseIndexJson (messages prefixed with the file), kIndexMissingFile,
  // kIndexMissingTensor, kIndexUnlistedTensor, kIndexDuplicateTensor, kIndexPathEscape,
  // kCheckpointIncomplete (a directory or prefix without an index: a shard of a numbered series
  // absent, numbered twice or beyond the series, two series sizes of one prefix, or a dangling
  // link), kInvalidArgument (a directory with no safetensors file).
  static Result<std::shared_ptr<const Checkpoint>> Open(const std::string& path,
                                                        const OpenOptions& options = {});

  // Opens an explicit list of safetensors files as one checkpoint (no index). files() is the
  // list sorted by path.
  // Errors: as Open, plus kIndexDuplicateTensor when a name appears in two files, and
  // kInvalidArgument for an empty list or a path given twice.
  static Result<std::shared_ptr<const Checkpoint>> OpenFiles(std::span<const std::string> paths,
                                                             const OpenOptions& options = {});

  // Files in the order tensors reference them (index order: sorted by path).
  const std::vector<FileInfo>& files() const noexcept { return files_; }
  // Every tensor, ordered by (file, offset).
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  // nullptr when absent.
  const TensorInfo* Find(std::string_view name) const noexcept;
  // The index document's metadata (empty without an index).
  const std::vector<std::pair<std::string, std::string>>& index_metadata() const noexcept {
    return index_metadata_;
  }
  // The index file path, or empty.
  const std::string& index_path() const noexcept { return index_path_; }
  // Sum of all tensors' sizes.
  uint64_t total_tensor_bytes() const noexcept { return total_tensor_bytes_; }

  // File `f` of files(), open: the one Open read the header of, or, when it was closed under
  // max_open_files, the path opened again and checked to be the same file. Holding the result
  // keeps the file open. Errors: kInvalidArgument for f out of range, those of Source::Open,
  // "file changed since the checkpoint was opened".
  Result<std::shared_ptr<const SourceFile>> File(uint32_t f) const;
  // Ok while every file held open is still the file Open read (see "Files that change").
  // Errors: kIoError "<path>: file changed since the checkpoint was opened: ...".
  Status CheckUnchanged() const;
  // Internal (src/io/file_set.h): the file table File() reads, which loaders pin files through.
  const std::shared_ptr<io::FileSet>& file_set() const noexcept { return file_set_; }

  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

 private:
  Checkpoint() = default;
  friend class CheckpointBuilder;

  std::vector<FileInfo> files_;
  std::vector<TensorInfo> tensors_;
  std::vector<uint32_t> by_name_;  // indices into tensors_, sorted by name
  std::vector<std::pair<std::string, std::string>> index_metadata_;
  std::string index_path_;
  uint64_t total_tensor_bytes_ = 0;
  std::shared_ptr<io::FileSet> file_set_;
};

// Reads a file's header from `file` and validates it (ParseHeader with I/O).
Result<Header> ReadHeader(const RandomAccessFile& file, const ParseLimits& limits = {});

}  // namespace tensorferry

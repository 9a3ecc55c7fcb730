// Writing safetensors files and sharded checkpoints (see tensorferry/writer.h).
//
// Layout: everything is validated and the whole header is built in memory first (SerializeHeader),
// so a bad input is refused before a file exists. Bytes then go through a FileSink (one reusable
// buffer) into a temporary file that the Env creates with O_EXCL beside the destination; the
// temporary is renamed over the destination only once every byte is written (and fsynced when
// asked). A sharded write renames all its files in together (ShardedCommit), after moving the old
// layout aside. Ownership of the file and of the temporary name lives in small RAII types
// (WritableFile, TempFile, ShardedCommit), so every early return, and even an exception thrown by
// a caller's generator, closes the file, removes the temporary and puts back what was moved; and
// each name is registered in the rollback registry so a signal handler can do the same.
#include "tensorferry/writer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "format/rollback_registry.h"
#include "integrity/manifest_update.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "util/file_lock.h"
#include "util/json_writer.h"
#include "util/macros.h"
#include "util/path.h"
#include "util/random.h"
#include "util/writer_temporaries.h"

namespace tensorferry {
namespace {

// "tensor \"name\"": names are quoted JSON-style so control characters and odd bytes in a name
// cannot garble a message.
std::string TensorLabel(std::string_view name) {
  return "tensor " + json::Quote(name);
}

// Runs a tensor's generator for the bytes at `offset`, `out.size()` of them. The generator is the
// caller's code: an exception from it must not escape the library; an error names the tensor and
// the byte range (`why` is appended to the range).
Status Generate(const TensorToWrite& t, uint64_t offset, std::span<std::byte> out,
                std::string_view why) {
  Status s;
  try {
    s = t.generate(offset, out);
  } catch (const std::exception& e) {
    s = Status(Code::kInternal, std::string("generate threw an exception: ") + e.what());
  } catch (...) {
    s = Status(Code::kInternal, "generate threw an exception");
  }
  if (s.ok()) return s;
  return s.WithPrefix(TensorLabel(t.name) + ": generating bytes [" + std::to_string(offset) + ", " +
                      std::to_string(offset + out.size()) + ")" + std::string(why));
}

std::string JsonShape(std::span<const uint64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ',';
    json::AppendUint(out, shape[i]);
  }
  out += ']';
  return out;
}

// --- validation and the header ------------------------------------------------------------------

// Checks one tensor (name rules other than uniqueness, and its data source) and returns its size.
Result<uint64_t> CheckTensor(const TensorToWrite& t) {
  if (!json::IsValidUtf8(t.name)) {
    return Status(Code::kBadTensorName, TensorLabel(t.name) + ": name is not valid UTF-8");
  }
  // The reference writer accepts this name but then cannot read its own file back.
  if (t.name == "__metadata__") {
    return Status(Code::kBadTensorName,
                  TensorLabel(t.name) + ": name is reserved for the header's metadata");
  }
  auto size = TensorByteSize(t.dtype, t.shape);
  if (!size.ok()) return size.status().WithPrefix(TensorLabel(t.name));
  if (t.generate) return size;  // the generator is trusted to produce exactly `size` bytes
  if (*size > 0 && t.data.empty()) {
    return Status(Code::kBadTensorData,
                  TensorLabel(t.name) + ": neither data nor generate given for " +
                      std::to_string(*size) + " bytes (" + std::string(DTypeName(t.dtype)) + " " +
                      JsonShape(t.shape) + ")");
  }
  if (t.data.size() != *size) {
    return Status(Code::kBadTensorData,
                  TensorLabel(t.name) + ": data is " + std::to_string(t.data.size()) +
                      " bytes, expected " + std::to_string(*size) + " (" +
                      std::string(DTypeName(t.dtype)) + " " + JsonShape(t.shape) + ")");
  }
  return size;
}

// Sorted (by key) pointers to the metadata entries, after checking them.
Result<std::vector<const std::pair<std::string, std::string>*>> SortedMetadata(
    const Metadata& metadata) {
  std::vector<const std::pair<std::string, std::string>*> sorted;
  sorted.reserve(metadata.size());
  for (const auto& kv : metadata) {
    if (!json::IsValidUtf8(kv.first)) {
      return Status(Code::kInvalidArgument,
                    "metadata key " + json::Quote(kv.first) + " is not valid UTF-8");
    }
    if (!json::IsValidUtf8(kv.second)) {
      return Status(Code::kInvalidArgument,
                    "metadata value of key " + json::Quote(kv.first) + " is not valid UTF-8");
    }
    sorted.push_back(&kv);
  }
  // std::string's operator< compares bytes as unsigned char, i.e. by code point for UTF-8.
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i - 1]->first == sorted[i]->first) {
      return Status(Code::kInvalidArgument,
                    "metadata key " + json::Quote(sorted[i]->first) + " appears more than once");
    }
  }
  return sorted;
}

// Validates `tensors` (all of them, including uniqueness of names) and returns their byte sizes.
Result<std::vector<uint64_t>> CheckTensors(std::span<const TensorToWrite> tensors) {
  std::vector<uint64_t> sizes(tensors.size());
  std::unordered_map<std::string_view, size_t> seen;
  seen.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TF_ASSIGN_OR_RETURN(sizes[i], CheckTensor(tensors[i]));
    auto [it, inserted] = seen.emplace(tensors[i].name, i);
    if (!inserted) {
      return Status(Code::kBadTensorName,
                    TensorLabel(tensors[i].name) + ": duplicate name (inputs " +
                        std::to_string(it->second) + " and " + std::to_string(i) + ")");
    }
  }
  return sizes;
}

// The header of the file holding tensors[subset[0]], tensors[subset[1]], ...; `sizes` and the
// metadata are already checked. SerializedHeader::order indexes into `tensors`.
Result<SerializedHeader> BuildHeader(
    std::span<const TensorToWrite> tensors, std::span<const uint64_t> sizes,
    std::span<const size_t> subset,
    const std::vector<const std::pair<std::string, std::string>*>& metadata,
    bool metadata_table = false) {
  SerializedHeader out;
  out.order.assign(subset.begin(), subset.end());
  // The reference's order: dtype descending, then name ascending. Names are unique, so the order
  // is total and the output does not depend on the input order.
  std::sort(out.order.begin(), out.order.end(), [&](size_t a, size_t b) {
    if (tensors[a].dtype != tensors[b].dtype) return tensors[a].dtype > tensors[b].dtype;
    return tensors[a].name < tensors[b].name;
  });

  std::string& json = out.json;
  json.push_back('{');
  bool first = true;
  // Matches the reference: "__metadata__" is written only when there is metadata, or an empty
  // table was asked for (the reference's metadata={}).
  if (!metadata.empty() || metadata_table) {
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i > 0) json.push_back(',');
      json::AppendString(json, metadata[i]->first);
      json.push_back(':');
      json::AppendString(json, metadata[i]->second);
    }
    json.push_back('}');
    first = false;
  }
  const ParseLimits limits;  // a file no reader opens is not written
  uint64_t offset = 0;
  for (size_t index : out.order) {
    const TensorToWrite& t = tensors[index];
    if (t.shape.size() > limits.max_rank) {
      return Status(Code::kRankTooLarge,
                    TensorLabel(t.name) + ": " + std::to_string(t.shape.size()) +
                        " dimensions, more than the " + std::to_string(limits.max_rank) +
                        " a reader accepts (ParseLimits::max_rank)");
    }
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shape[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Status(Code::kInvalidShape, TensorLabel(t.name) + ": shape " + JsonShape(t.shape) +
                                               ": dimension " + std::to_string(d) +
                                               " is more than 2^63-1, which a reader refuses");
      }
    }
    uint64_t end;
    if (__builtin_add_overflow(offset, sizes[index], &end)) {
      return Status(Code::kOverflow,
                    TensorLabel(t.name) + ": data offsets of the file overflow 64 bits");
    }
    if (!first) json.push_back(',');
    first = false;
    json::AppendString(json, t.name);
    json += ":{\"dtype\":\"";
    json += DTypeName(t.dtype);
    json += "\",\"shape\":";
    json += JsonShape(t.shape);
    json += ",\"data_offsets\":[";
    json::AppendUint(json, offset);
    json.push_back(',');
    json::AppendUint(json, end);
    json += "]}";
    offset = end;
  }
  json.push_back('}');
  // Spaces, as the reference pads, so the data buffer starts 8-byte aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  out.data_size = offset;
  // The parser's default limits (the reference's header size among them) are refused here,
  // before any file exists.
  if (json.size() > limits.max_header_size) {
    return Status(
        Code::kHeaderTooLarge,
        "the header would be " + std::to_string(json.size()) + " bytes, more than the " +
            std::to_string(limits.max_header_size) +
            " any reader accepts (the reference's limit): " + std::to_string(subset.size()) +
            " tensors, " + std::to_string(metadata.size()) +
            " metadata entries; split the tensors " + "into shards, or shorten the metadata");
  }
  if (metadata.size() > limits.max_metadata_entries) {
    return Status(Code::kTooManyMetadataEntries,
                  "\"__metadata__\" would hold " + std::to_string(metadata.size()) +
                      " entries, more than the " + std::to_string(limits.max_metadata_entries) +
                      " a reader accepts (ParseLimits::max_metadata_entries)");
  }
  if (subset.size() > limits.max_tensors) {
    return Status(Code::kTooManyTensors,
                  "the file would hold " + std::to_string(subset.size()) +
                      " tensors, more than the " + std::to_string(limits.max_tensors) +
                      " a reader accepts (ParseLimits::max_tensors); split them into shards");
  }
  return out;
}

// --- files
// ----------------------------------------------------------------------------------------

// Writes bytes to a WritableFile through one reusable buffer. Small pieces (the prefix, the
// header, small tensors) are gathered so a file of many small tensors costs few system calls;
// pieces at least as large as the buffer go to the file straight from the caller's memory, with
// no copy.
class FileSink {
 public:
  // REQUIRES: `buffer` holds `buffer_size` > 0 bytes; `file` outlives the sink.
  FileSink(WritableFile& file, std::unique_ptr<std::byte[]> buffer, size_t buffer_size)
      : file_(file), buffer_(std::move(buffer)), capacity_(buffer_size) {}

  uint64_t offset() const { return flushed_ + used_; }

  Status Append(std::span<const std::byte> bytes) {
    // An empty span may carry a null pointer, which memcpy must not see even for 0 bytes.
    if (bytes.empty()) return Status::Ok();
    if (bytes.size() <= capacity_ - used_) {
      std::memcpy(buffer_.get() + used_, bytes.data(), bytes.size());
      used_ += bytes.size();
      return Status::Ok();
    }
    TF_RETURN_IF_ERROR(Flush());
    if (bytes.size() >= capacity_) return WriteAll(bytes);
    std::memcpy(buffer_.get(), bytes.data(), bytes.size());
    used_ = bytes.size();
    return Status::Ok();
  }

  // Streams `size` bytes produced by `generate(offset, out)`, in increasing offsets, directly
  // into the free part of the buffer.
  // `builder`, when given, hashes the bytes as they are generated.
  Status AppendGenerated(const TensorToWrite& t, uint64_t size,
                         ChecksumBuilder* builder = nullptr) {
    uint64_t done = 0;
    while (done < size) {
      if (used_ == capacity_) TF_RETURN_IF_ERROR(Flush());
      const size_t n = static_cast<size_t>(std::min<uint64_t>(size - done, capacity_ - used_));
      std::span<std::byte> out(buffer_.get() + used_, n);
      TF_RETURN_IF_ERROR(Generate(t, done, out, ""));
      if (builder != nullptr) builder->Update(out);
      used_ += n;
      done += n;
    }
    return Status::Ok();
  }

  // Overwrites bytes already written (buffered bytes are flushed first).
  Status OverwriteAt(uint64_t offset, std::span<const std::byte> bytes) {
    TF_RETURN_IF_ERROR(Flush());
    return file_.WriteAt(offset, bytes);
  }
  // Whether the file takes positioned writes (probed with an empty one).
  bool CanOverwrite() { return file_.WriteAt(0, {}).code() != Code::kUnsupported; }

  Status Flush() {
    if (used_ == 0) return Status::Ok();
    const size_t n = used_;
    used_ = 0;
    return WriteAll({buffer_.get(), n});
  }

 private:
  Status WriteAll(std::span<const std::byte> bytes) {
    TF_RETURN_IF_ERROR(file_.Append(bytes));
    flushed_ += bytes.size();
    return Status::Ok();
  }

  WritableFile& file_;
  std::unique_ptr<std::byte[]> buffer_;
  size_t capacity_;
  size_t used_ = 0;
  uint64_t flushed_ = 0;  // bytes handed to the file so far
};

using util::HiddenSibling;

// A complete temporary file beside its destination, not yet renamed into place. Owns the name:
// the file is removed on destruction unless Release()d, and it is registered for removal if the
// process is ended by a signal meanwhile (rollback_registry.h).
class TempFile {
 public:
  TempFile(Env* env, std::string target) : env_(env), target_(std::move(target)) {}
  ~TempFile() {
    if (!path_.empty()) (void)env_->RemoveFile(path_);
  }
  TempFile(TempFile&& other) noexcept
      : env_(other.env_),
        target_(std::move(other.target_)),
        path_(std::move(other.path_)),
        entry_(std::move(other.entry_)) {
    other.path_.clear();
  }
  TempFile& operator=(TempFile&&) = delete;
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& target() const { return target_; }

  // Creates the file: "." + file name + ".tmp-<pid>@<host>-<random>" (util/writer_temporaries.h)
  // in the target's directory, so the final rename stays within one filesystem. The target's
  // name is cut so the temporary name
  // stays within NAME_MAX (255) even for a long target name.
  Result<std::unique_ptr<WritableFile>> Create() {
    namespace fs = std::filesystem;
    const fs::path target(target_);
    const std::string base = target.filename().string();
    const std::string dir = target.has_parent_path() ? target.parent_path().string() : "";
    const std::string stem = HiddenSibling(base, util::kTemporaryKind);
    auto file = env_->NewTempFile(dir, stem, [this](const std::string& p) {
      // Registered before the file exists, so no signal can leave it behind unregistered.
      entry_ = p.empty() ? internal::RollbackEntry()
                         : internal::RollbackEntry(internal::RollbackEntry::Kind::kTemporary, p);
    });
    if (!file.ok()) return file.status().WithPrefix(target_);
    path_ = (*file)->path();
    // A file replaced keeps its permissions (a private 0600 file does not become readable by
    // all with the umask's 0644); a new one gets 0666 & ~umask. Best effort: a temporary this
    // process cannot chmod (none it created) keeps the umask's.
    struct stat old {};
    if (::stat(target_.c_str(), &old) == 0 && S_ISREG(old.st_mode)) {
      (void)::chmod(path_.c_str(), old.st_mode & 07777 & ~mode_t{S_ISUID | S_ISGID});
    }
    return file;
  }

  // The file has been renamed into place: nothing to remove any more.
  void Release() {
    path_.clear();
    entry_.Reset();
  }

 private:
  Env* env_;
  std::string target_;
  std::string path_;
  internal::RollbackEntry entry_;
};

Env* EnvOf(const WriteOptions& options) {
  return options.env != nullptr ? options.env : Env::Default();
}

// Writes a temporary file beside `path`: `body(sink)` produces the content of `size` bytes (a
// hint for the buffer size); the file is fsynced (when asked) and closed.
template <typename Body>
Result<TempFile> WriteTemp(const std::string& path, uint64_t size, const WriteOptions& options,
                           Body&& body) {
  namespace fs = std::filesystem;
  const std::string base = fs::path(path).filename().string();
  if (base.empty() || base == "." || base == "..") {
    return Status(Code::kInvalidArgument, "\"" + path + "\" does not name a file");
  }
  TempFile temp(EnvOf(options), path);
  TF_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, temp.Create());

  // The buffer never needs to exceed the file; small files then cost a small allocation.
  const size_t buffer_size = static_cast<size_t>(
      std::max<uint64_t>(1, std::min<uint64_t>(std::max<size_t>(options.buffer_size, 1), size)));
  // Not zero-filled (the bytes are overwritten before use), and sized by the caller's options, so
  // failing to get it is reported rather than thrown.
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[buffer_size]);
  if (buffer == nullptr) {
    return Status(Code::kBudgetExceeded, path + ": cannot allocate a write buffer of " +
                                             std::to_string(buffer_size) + " bytes");
  }
  FileSink sink(*file, std::move(buffer), buffer_size);
  TF_RETURN_IF_ERROR(body(sink).WithPrefix(path));
  TF_RETURN_IF_ERROR(sink.Flush().WithPrefix(path));
  if (options.sync) TF_RETURN_IF_ERROR(file->Sync().WithPrefix(path));
  TF_RETURN_IF_ERROR(file->Close().WithPrefix(path));
  return temp;
}

Result<std::optional<ChecksumManifest>> ForgetInManifest(Env* env, const std::string& path,
                                                         const WriteOptions& options);
Status RestoreInManifest(Env* env, const std::string& path, const WriteOptions& options,
                         const ChecksumManifest& forgotten);
std::optional<FileLock> LockManifestIfPossible(const std::string& dir);

// The directory of `path` ("" for a plain name) and its file name.
std::pair<std::string, std::string> SplitPath(const std::string& path) {
  const std::filesystem::path p(path);
  return {p.has_parent_path() ? p.parent_path().string() : std::string(), p.filename().string()};
}

// Writes `path` atomically: WriteTemp, then a rename over `path` and an fsync of its directory.
// The hidden temporaries a dead writer of this machine left beside `path` go first (their room
// may be needed), its backups once the new file is in place (until then a backup may be the only
// copy of an older file): util/writer_temporaries.h.
template <typename Body>
Status AtomicWrite(const std::string& path, uint64_t size, const WriteOptions& options,
                   Body&& body) {
  const auto [dir, name] = SplitPath(path);
  Env* env = EnvOf(options);
  // The rename over a directory would fail only after the whole file was written. (A path
  // without a file name, "a/", is refused as such by WriteTemp.)
  std::error_code ec;
  using std::filesystem::file_type;
  const file_type type = env == Env::Default() && !name.empty()
                             ? std::filesystem::symlink_status(path, ec).type()
                             : file_type::not_found;
  if (type == file_type::directory) {
    return Status(Code::kIoError, path + ": is a directory, not a file's path (errno " +
                                      std::to_string(EISDIR) + ")");
  }
  // A device, FIFO or socket would be replaced by the rename (`convert x.pt /dev/null` as root
  // put a regular file in place of /dev/null): refused before anything is written.
  if (type == file_type::block || type == file_type::character || type == file_type::fifo ||
      type == file_type::socket || type == file_type::unknown) {
    const char* what = type == file_type::block       ? "a block device"
                       : type == file_type::character ? "a character device"
                       : type == file_type::fifo      ? "a FIFO"
                       : type == file_type::socket    ? "a socket"
                                                      : "not a regular file";
    return Status(Code::kInvalidArgument,
                  path + ": is " + what +
                      ", not a regular file: the output is written beside it and renamed over "
                      "the path, which would replace it (give a file's path)");
  }
  (void)util::RemoveDeadWritersFiles(dir, {name}, {util::kTemporaryKind});
  TF_ASSIGN_OR_RETURN(TempFile temp, WriteTemp(path, size, options, std::forward<Body>(body)));
  if (options.before_commit) TF_RETURN_IF_ERROR(options.before_commit().WithPrefix(path));
  {
    // The entry dropped and the file renamed under the manifest's lock: a `checksum` of the old
    // file merging meanwhile sees the new file (and refuses) or finishes before it is renamed
    // (and its entry is dropped here).
    const std::optional<FileLock> lock = LockManifestIfPossible(dir);
    TF_ASSIGN_OR_RETURN(const std::optional<ChecksumManifest> forgotten,
                        ForgetInManifest(env, path, options));
    const Status renamed = env->RenameFile(temp.path(), path).WithPrefix(path);
    if (!renamed.ok()) {
      // The old file stays: so does its entry (its digests still describe it).
      if (forgotten) (void)RestoreInManifest(env, path, options, *forgotten);
      return renamed;
    }
  }
  temp.Release();
  (void)util::RemoveDeadWritersFiles(dir, {name}, {util::kBackupKind});
  // After the rename the new file is in place; a failure here only means its directory entry may
  // not survive a crash, which the caller should still hear about.
  if (options.sync) {
    const std::filesystem::path target(path);
    TF_RETURN_IF_ERROR(
        env->SyncDirectory(target.has_parent_path() ? target.parent_path().string() : "")
            .WithPrefix(path));
  }
  return Status::Ok();
}

// The file's first bytes: the header's length (8 bytes, little-endian), then the header.
Status AppendHeader(FileSink& sink, const SerializedHeader& header) {
  const uint64_t json_size = header.json.size();
  std::byte prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<std::byte>((json_size >> (8 * i)) & 0xff);
  TF_RETURN_IF_ERROR(sink.Append(prefix));
  return sink.Append(std::as_bytes(std::span<const char>(header.json.data(), header.json.size())));
}

// The content of the file whose header is `header` (built from `tensors` and `sizes`).
Status WriteBody(FileSink& sink, std::span<const TensorToWrite> tensors,
                 std::span<const uint64_t> sizes, const SerializedHeader& header) {
  TF_RETURN_IF_ERROR(AppendHeader(sink, header));
  for (size_t index : header.order) {
    const TensorToWrite& t = tensors[index];
    if (t.generate) {
      TF_RETURN_IF_ERROR(sink.AppendGenerated(t, sizes[index]));
    } else {
      TF_RETURN_IF_ERROR(sink.Append(t.data));
    }
  }
  return Status::Ok();
}

// --- checksums (integrity.h) --------------------------------------------------------------------

// What one file's checksums need: its tensors (indices into the caller's), the caller's metadata
// and the options; the header is rebuilt with the digests once they are known.
struct ChecksummedFile {
  std::span<const TensorToWrite> tensors;
  std::span<const uint64_t> sizes;
  std::vector<size_t> members;
  const Metadata* metadata;
  FileChecksums sums;  // placeholder digests (zeros) until computed
};

// The file's header with `sums` as the kChecksumsMetadataKey entry (replacing the caller's).
Result<SerializedHeader> HeaderWithChecksums(const ChecksummedFile& file) {
  Metadata metadata = *file.metadata;  // without a record of its own (WithoutChecksumRecord)
  metadata.emplace_back(std::string(kChecksumsMetadataKey), SerializeFileChecksums(file.sums));
  TF_ASSIGN_OR_RETURN(const auto sorted, SortedMetadata(metadata));
  return BuildHeader(file.tensors, file.sizes, file.members, sorted);
}

// Checksums of the right shape with zero digests: the header they give has the final length.
ChecksummedFile PlaceholderChecksums(std::span<const TensorToWrite> tensors,
                                     std::span<const uint64_t> sizes, std::vector<size_t> members,
                                     const Metadata& metadata, const WriteOptions& options) {
  ChecksummedFile file{tensors, sizes, std::move(members), &metadata, {}};
  file.sums.chunk_size = options.checksum_chunk_size;
  for (size_t i : file.members) {
    TensorChecksum& sum = file.sums.tensors[tensors[i].name];
    sum.chunks.assign(ChecksumChunkCount(sizes[i], options.checksum_chunk_size), 0);
  }
  return file;
}

unsigned HashThreads(const WriteOptions& options) {
  if (options.checksum_threads > 0) return options.checksum_threads;
  return std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
}

Status CheckChecksumOptions(const WriteOptions& options) {
  if (options.checksums && (options.checksum_chunk_size < kMinChecksumChunkSize ||
                            options.checksum_chunk_size > kMaxChecksumChunkSize)) {
    return Status(Code::kInvalidArgument,
                  "checksum chunk size " + std::to_string(options.checksum_chunk_size) +
                      " is outside [" + std::to_string(kMinChecksumChunkSize) + ", " +
                      std::to_string(kMaxChecksumChunkSize) + "]");
  }
  return Status::Ok();
}

// Hashes a generated tensor by running its generator over a scratch buffer (for files that cannot
// take the header back at the end, so the digests must be known before it is written).
Status HashGenerated(const TensorToWrite& t, uint64_t size, size_t buffer_size, uint64_t chunk_size,
                     TensorChecksum& out) {
  ChecksumBuilder builder(chunk_size);
  // (buffer_size 0 acts as 1, as for the file's buffer: a scratch of none would never advance)
  std::vector<std::byte> scratch(
      static_cast<size_t>(std::min<uint64_t>(std::max<size_t>(buffer_size, 1), size)));
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size - done, scratch.size()));
    std::span<std::byte> piece(scratch.data(), n);
    TF_RETURN_IF_ERROR(Generate(t, done, piece, " to hash them"));
    builder.Update(piece);
    done += n;
  }
  out = builder.Finish();
  return Status::Ok();
}

// The content of a file with checksums. Spans are hashed first (chunks in parallel); generated
// tensors are hashed while they stream and the header, written first with placeholder digests of
// the same length, is overwritten at the end (or, when the file cannot, hashed in a first pass).
Status WriteChecksummedBody(FileSink& sink, ChecksummedFile& file, const WriteOptions& options) {
  const unsigned threads = HashThreads(options);
  const uint64_t chunk = options.checksum_chunk_size;
  bool generated = false;
  for (size_t i : file.members) {
    const TensorToWrite& t = file.tensors[i];
    if (t.generate) {
      generated = true;
      continue;
    }
    file.sums.tensors[t.name] = ComputeTensorChecksum(t.data, chunk, threads);
  }
  const bool overwrite = generated && sink.CanOverwrite();
  if (generated && !overwrite) {
    for (size_t i : file.members) {
      const TensorToWrite& t = file.tensors[i];
      if (!t.generate) continue;
      TF_RETURN_IF_ERROR(
          HashGenerated(t, file.sizes[i], options.buffer_size, chunk, file.sums.tensors[t.name]));
    }
  }
  // Without generated tensors (or hashed already) this is the final header.
  TF_ASSIGN_OR_RETURN(const SerializedHeader header, HeaderWithChecksums(file));
  const uint64_t json_size = header.json.size();
  TF_RETURN_IF_ERROR(AppendHeader(sink, header));
  for (size_t index : header.order) {
    const TensorToWrite& t = file.tensors[index];
    if (t.generate) {
      ChecksumBuilder builder(chunk);
      TF_RETURN_IF_ERROR(
          sink.AppendGenerated(t, file.sizes[index], overwrite ? &builder : nullptr));
      if (overwrite) file.sums.tensors[t.name] = builder.Finish();
    } else {
      TF_RETURN_IF_ERROR(sink.Append(t.data));
    }
  }
  if (!overwrite) return Status::Ok();
  TF_ASSIGN_OR_RETURN(const SerializedHeader final_header, HeaderWithChecksums(file));
  if (final_header.json.size() != json_size) {
    return Status(Code::kInternal, "checksummed header changed length (" +
                                       std::to_string(json_size) + " -> " +
                                       std::to_string(final_header.json.size()) + " bytes)");
  }
  return sink.OverwriteAt(
      8, std::as_bytes(std::span<const char>(final_header.json.data(), final_header.json.size())));
}

uint64_t FileSize(const SerializedHeader& header) {
  uint64_t total = 8 + header.json.size();
  if (__builtin_add_overflow(total, header.data_size, &total)) total = UINT64_MAX;
  return total;
}

// transformers' index: json.dumps(index, indent=2, sort_keys=True) + "\n".
std::string IndexJson(std::span<const TensorToWrite> tensors,
                      const std::vector<std::string>& file_of, uint64_t total_size) {
  std::vector<size_t> by_name(tensors.size());
  std::iota(by_name.begin(), by_name.end(), size_t{0});
  std::sort(by_name.begin(), by_name.end(),
            [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  std::string out = "{\n  \"metadata\": {\n    \"total_size\": ";
  json::AppendUint(out, total_size);
  out += "\n  },\n  \"weight_map\": {";
  for (size_t i = 0; i < by_name.size(); ++i) {
    out += i == 0 ? "\n    " : ",\n    ";
    json::AppendString(out, tensors[by_name[i]].name);
    out += ": ";
    json::AppendString(out, file_of[by_name[i]]);
  }
  // Python prints an empty object as "{}".
  out += by_name.empty() ? "}\n}\n" : "\n  }\n}\n";
  return out;
}

// `name` inside `dir` ("" being the current directory).
std::string JoinDir(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : (std::filesystem::path(dir) / name).string();
}

// The whole text of the file `name` in `dir`, unless it is missing, unreadable or larger than
// `limit` bytes.
std::optional<std::string> ReadSmallFile(Env* env, const std::string& dir, const std::string& name,
                                         uint64_t limit) {
  const std::string path = JoinDir(dir, name);
  auto file = env->OpenRandomAccess(path);
  if (!file.ok()) return std::nullopt;
  auto size = (*file)->Size();
  if (!size.ok() || *size > limit) return std::nullopt;
  std::string text(static_cast<size_t>(*size), '\0');
  if (!ReadFully(**file, 0, std::as_writable_bytes(std::span<char>(text.data(), text.size())))
           .ok()) {
    return std::nullopt;
  }
  return text;
}

// A sidecar checksum manifest beside `path` (integrity.h) that records the file about to be
// replaced loses that entry first (the manifest goes when it was the only one): a digest of the
// old bytes would fail every later check of the new file that carries no checksums of its own.
// Done before the rename, so that a crash between the two leaves the old file without an entry,
// never the new one with the old file's. A manifest that cannot be read or parsed is left as is.
// The caller holds the manifest's lock (manifest_update.h) from before this to after its rename, so
// entries other writers add meanwhile stay and a `checksum` cannot merge the old file's digests
// in between.
// Returns the entry removed (in a manifest of its own, with the chunk size), for
// RestoreInManifest.
Result<std::optional<ChecksumManifest>> ForgetInManifest(Env* env, const std::string& path,
                                                         const WriteOptions& options) {
  const std::filesystem::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : "";
  const std::string name = target.filename().string();
  using internal::ManifestEdit;
  std::optional<ChecksumManifest> forgotten;
  const Status updated = internal::UpdateManifestLocked(
      env, dir, options.sync,
      [&](const Result<std::optional<ChecksumManifest>>& now) -> Result<ManifestEdit> {
        ManifestEdit edit;  // kKeep
        if (!now.ok() || !*now) return edit;
        edit.manifest = **now;
        const auto it = edit.manifest.files.find(name);
        if (it == edit.manifest.files.end()) return edit;
        forgotten.emplace();
        forgotten->chunk_size = edit.manifest.chunk_size;
        forgotten->files.emplace(name, it->second);
        edit.manifest.files.erase(it);
        edit.action = edit.manifest.files.empty() ? ManifestEdit::Action::kRemove
                                                  : ManifestEdit::Action::kWrite;
        return edit;
      });
  if (!updated.ok()) {
    // The edit may be in place (only the directory's fsync failed): the old file stays, and so
    // does its entry.
    if (forgotten) (void)RestoreInManifest(env, path, options, *forgotten);
    return updated;
  }
  return forgotten;
}

// Puts back the entry ForgetInManifest removed when the rename it preceded failed (the old file
// is still there, and the entry still describes it); the caller still holds the manifest's lock.
// A manifest of another chunk size there meanwhile (none can be: the lock) is kept as it is.
Status RestoreInManifest(Env* env, const std::string& path, const WriteOptions& options,
                         const ChecksumManifest& forgotten) {
  const std::filesystem::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : "";
  const std::string name = target.filename().string();
  if (forgotten.files.count(name) == 0) return Status::Ok();
  using internal::ManifestEdit;
  return internal::UpdateManifestLocked(
      env, dir, options.sync,
      [&](const Result<std::optional<ChecksumManifest>>& now) -> Result<ManifestEdit> {
        ManifestEdit edit;  // kKeep
        if (!now.ok()) return edit;
        edit.manifest = *now ? **now : forgotten;
        if (*now && (edit.manifest.chunk_size != forgotten.chunk_size ||
                     !edit.manifest.files.emplace(name, forgotten.files.at(name)).second)) {
          return edit;
        }
        edit.action = ManifestEdit::Action::kWrite;
        return edit;
      });
}

// The file names (in `dir`) of the layout with this prefix already there: the single-file name,
// the index, and the files the index names (plain names ending in ".safetensors" only: never a
// path elsewhere, never a file of another kind). An index that cannot be read or parsed names
// nothing; it is itself still listed.
std::vector<std::string> OldLayout(Env* env, const std::string& dir, const std::string& prefix) {
  const std::string index_name = prefix + ".safetensors.index.json";
  std::vector<std::string> names = {prefix + ".safetensors", index_name};
  const IndexLimits limits;
  const std::optional<std::string> text =
      ReadSmallFile(env, dir, index_name, limits.max_index_size);
  if (!text) return names;
  auto doc = ParseIndexJson(*text, index_name, limits);
  if (!doc.ok()) return names;
  for (const auto& [tensor, file_name] : doc->weight_map) {
    if (file_name.find('/') != std::string::npos || !file_name.ends_with(".safetensors") ||
        file_name.starts_with(".")) {
      continue;
    }
    if (std::find(names.begin(), names.end(), file_name) == names.end()) {
      names.push_back(file_name);
    }
  }
  return names;
}

// Puts a sharded write's complete temporary files in place all together, or not at all.
//
// Run() first moves every file it will replace or make obsolete aside to a hidden backup name
// (".<name>.bak-<pid>-<random>"), then renames the new files in (index last) and fsyncs the
// directory. Any failure undoes what was done, in reverse: created names removed, backups renamed
// back, so the directory is as before. Every step is registered in the rollback registry first,
// so a signal handler can undo it too (RunRegisteredRollbacks). After Run() succeeds the backups
// are only garbage, removed by RemoveBackups().
class ShardedCommit {
 public:
  ShardedCommit(Env* env, std::string dir, bool sync)
      : env_(env), dir_(std::move(dir)), sync_(sync) {}
  ~ShardedCommit() {
    if (!done_) (void)Rollback();
  }
  ShardedCommit(const ShardedCommit&) = delete;
  ShardedCommit& operator=(const ShardedCommit&) = delete;

  // REQUIRES: every temporary is complete and closed. Renamed temporaries are Release()d.
  Status Run(std::vector<TempFile>& temps, const std::vector<std::string>& old_names) {
    Status s = Apply(temps, old_names);
    if (s.ok()) {
      group_.Commit();
      done_ = true;
      return s;
    }
    Status undo = Rollback();
    done_ = true;
    if (undo.ok()) return s;
    return Status(s.code(), s.message() + "; undoing it: " + undo.message());
  }

  // Removes the backups of a committed write. Errors: kIoError naming each backup left behind.
  Status RemoveBackups() {
    std::string problems;
    for (Moved& m : moved_) {
      Status s = env_->RemoveFile(m.backup);
      if (!s.ok() && s.code() != Code::kNotFound) {
        if (!problems.empty()) problems += "; ";
        problems += s.message();
      }
      m.entry.Reset();
    }
    moved_.clear();
    created_.clear();
    if (problems.empty()) return Status::Ok();
    return Status(Code::kIoError,
                  "the new files are in place, but old ones moved aside remain: " + problems);
  }

 private:
  struct Moved {
    std::string original;
    std::string backup;
    internal::RollbackEntry entry;
  };
  struct Created {
    std::string path;
    internal::RollbackEntry entry;
  };

  std::string Join(const std::string& name) const {
    return dir_.empty() ? name : (std::filesystem::path(dir_) / name).string();
  }

  Status Apply(std::vector<TempFile>& temps, const std::vector<std::string>& old_names) {
    namespace fs = std::filesystem;
    std::vector<std::string> targets;
    for (const TempFile& t : temps) targets.push_back(t.target());
    for (const std::string& name : old_names) {
      std::string path = Join(name);
      if (std::find(targets.begin(), targets.end(), path) == targets.end()) {
        targets.push_back(std::move(path));
      }
    }
    for (const std::string& target : targets) {
      std::error_code ec;
      if (fs::is_directory(fs::symlink_status(target, ec))) {
        return Status(Code::kInvalidArgument,
                      target + ": is a directory; the checkpoint's file cannot replace it");
      }
      const std::string base = fs::path(target).filename().string();
      Moved m;
      m.original = target;
      m.backup = Join(HiddenSibling(base, util::kBackupKind) + util::RandomHex(moved_.size()));
      m.entry = internal::RollbackEntry(internal::RollbackEntry::Kind::kBackup, m.backup,
                                        m.original, &group_);
      Status s = env_->RenameFile(target, m.backup);
      if (s.code() == Code::kNotFound) continue;  // nothing there to keep
      if (!s.ok()) return s.WithPrefix(target + ": cannot move the existing file aside");
      moved_.push_back(std::move(m));
    }
    for (TempFile& t : temps) {
      const bool existed = std::any_of(moved_.begin(), moved_.end(),
                                       [&](const Moved& m) { return m.original == t.target(); });
      Created c;
      if (!existed) {
        c.path = t.target();
        c.entry =
            internal::RollbackEntry(internal::RollbackEntry::Kind::kCreated, c.path, {}, &group_);
      }
      TF_RETURN_IF_ERROR(env_->RenameFile(t.path(), t.target()).WithPrefix(t.target()));
      t.Release();
      if (!existed) created_.push_back(std::move(c));
    }
    if (sync_) TF_RETURN_IF_ERROR(env_->SyncDirectory(dir_));
    return Status::Ok();
  }

  // Removes the names created and renames the backups back, newest first. Errors: kIoError
  // naming what could not be undone (a backup that could not be put back keeps its name).
  Status Rollback() {
    std::string problems;
    const auto note = [&](const std::string& what) {
      if (!problems.empty()) problems += "; ";
      problems += what;
    };
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
      Status s = env_->RemoveFile(it->path);
      if (!s.ok() && s.code() != Code::kNotFound) note(s.message());
    }
    created_.clear();
    for (auto it = moved_.rbegin(); it != moved_.rend(); ++it) {
      Status s = env_->RenameFile(it->backup, it->original);
      if (!s.ok())
        note(it->original + " could not be put back and remains as " + it->backup + ": " +
             s.message());
    }
    const bool any = !moved_.empty();
    moved_.clear();
    if (any && sync_) (void)env_->SyncDirectory(dir_);
    if (problems.empty()) return Status::Ok();
    return Status(Code::kIoError, problems);
  }

  Env* env_;
  std::string dir_;
  bool sync_;
  internal::RollbackGroup group_;
  std::vector<Moved> moved_;
  std::vector<Created> created_;
  bool done_ = false;
};

// Checks that a shard prefix is a plain file name: non-empty UTF-8, not "." or "..", no '/' or NUL.
Status CheckShardPrefix(const std::string& prefix) {
  if (prefix.empty() || prefix == "." || prefix == ".." ||
      prefix.find_first_of(std::string_view("/\0", 2)) != std::string::npos ||
      !json::IsValidUtf8(prefix)) {
    return Status(Code::kInvalidArgument,
                  "shard prefix " + json::Quote(prefix) +
                      " must be a non-empty UTF-8 file name without '/' or NUL");
  }
  return Status::Ok();
}

// Tensors cut into shards (indices into the tensors, in order) and the checkpoint's total size.
struct ShardCut {
  std::vector<std::vector<size_t>> shards;
  uint64_t total_size = 0;
};

// Cuts the tensors into shards in the caller's order: a new shard starts when the next tensor
// would push the current one past the limit, so a tensor above the limit ends up alone.
Result<ShardCut> CutIntoShards(std::span<const TensorToWrite> tensors,
                               std::span<const uint64_t> sizes, uint64_t max_shard_size) {
  ShardCut cut;
  cut.shards.resize(1);
  uint64_t shard_size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (__builtin_add_overflow(cut.total_size, sizes[i], &cut.total_size)) {
      return Status(Code::kOverflow, TensorLabel(tensors[i].name) +
                                         ": total size of the checkpoint overflows 64 bits");
    }
    uint64_t grown;
    const bool overflow = __builtin_add_overflow(shard_size, sizes[i], &grown);
    if (!cut.shards.back().empty() && (overflow || grown > max_shard_size)) {
      cut.shards.emplace_back();
      grown = sizes[i];
    }
    cut.shards.back().push_back(i);
    shard_size = grown;
  }
  return cut;
}

// The header of every shard, or the first error one of them gives.
Result<std::vector<SerializedHeader>> BuildShardHeaders(
    std::span<const TensorToWrite> tensors, std::span<const uint64_t> sizes,
    const std::vector<std::vector<size_t>>& shards,
    const std::vector<const std::pair<std::string, std::string>*>& metadata) {
  std::vector<SerializedHeader> headers;
  headers.reserve(shards.size());
  for (const auto& shard : shards) {
    TF_ASSIGN_OR_RETURN(SerializedHeader h, BuildHeader(tensors, sizes, shard, metadata));
    headers.push_back(std::move(h));
  }
  return headers;
}

// The shards' file names: "<prefix>.safetensors" alone, else transformers'
// f"{prefix}-{i:05d}-of-{n:05d}.safetensors".
std::vector<std::string> ShardNames(const std::string& prefix, size_t n) {
  std::vector<std::string> names(n);
  for (size_t s = 0; s < n; ++s) {
    if (n == 1) {
      names[s] = prefix + ".safetensors";
      break;
    }
    std::string index = std::to_string(s + 1);
    std::string count = std::to_string(n);
    index.insert(0, index.size() < 5 ? 5 - index.size() : 0, '0');
    count.insert(0, count.size() < 5 ? 5 - count.size() : 0, '0');
    names[s] = prefix + "-" + index + "-of-" + count + ".safetensors";
  }
  return names;
}

// Whether `base` (a file name, possibly cut to util::kHiddenBaseBytes) is one of the layout of
// `prefix` for some shard count: "<prefix>.safetensors", its index, or
// "<prefix>-NNNNN-of-MMMMM.safetensors".
bool InShardFamily(std::string_view base, const std::string& prefix) {
  const auto cut = [](const std::string& n) {
    return n.substr(0, std::min(n.size(), util::kHiddenBaseBytes));
  };
  if (base == cut(prefix + ".safetensors") || base == cut(prefix + ".safetensors.index.json")) {
    return true;
  }
  constexpr std::string_view kShape = "-00000-of-00000.safetensors";
  if (base.size() != prefix.size() + kShape.size() || !base.starts_with(prefix)) return false;
  const std::string_view rest = base.substr(prefix.size());
  for (size_t i = 0; i < kShape.size(); ++i) {
    const bool digit = rest[i] >= '0' && rest[i] <= '9';
    if (kShape[i] == '0' ? !digit : rest[i] != kShape[i]) return false;
  }
  return true;
}

// Writes every shard to a temporary file beside its name in `dir`; room is kept for the index.
Result<std::vector<TempFile>> WriteShardTemps(
    const std::string& dir, std::span<const TensorToWrite> tensors, std::span<const uint64_t> sizes,
    const std::vector<SerializedHeader>& headers, const std::vector<std::string>& names,
    std::vector<ChecksummedFile>& checksummed, const WriteOptions& options) {
  const size_t n = names.size();
  std::vector<TempFile> temps;
  temps.reserve(n + 1);
  for (size_t s = 0; s < n; ++s) {
    TF_ASSIGN_OR_RETURN(
        TempFile temp,
        WriteTemp(JoinDir(dir, names[s]), FileSize(headers[s]), options, [&](FileSink& sink) {
          if (!checksummed.empty()) return WriteChecksummedBody(sink, checksummed[s], options);
          return WriteBody(sink, tensors, sizes, headers[s]);
        }));
    temps.push_back(std::move(temp));
  }
  return temps;
}

// Writes the index ("<prefix>.safetensors.index.json", naming each tensor's shard) to a
// temporary file in `dir`.
Result<TempFile> WriteIndexTemp(const std::string& dir, std::span<const TensorToWrite> tensors,
                                const ShardCut& cut, const std::vector<std::string>& names,
                                const ShardOptions& options) {
  const std::string index_name = options.prefix + ".safetensors.index.json";
  std::vector<std::string> file_of(tensors.size());
  for (size_t s = 0; s < names.size(); ++s) {
    for (size_t i : cut.shards[s]) file_of[i] = names[s];
  }
  const std::string index = IndexJson(tensors, file_of, cut.total_size);
  return WriteTemp(JoinDir(dir, index_name), index.size(), options.write, [&](FileSink& sink) {
    return sink.Append(std::as_bytes(std::span<const char>(index.data(), index.size())));
  });
}

// What a sharded write does to a sidecar checksum manifest in its directory (integrity.h).
struct ManifestChange {
  std::optional<FileLock> lock;       // the manifest's, held until the commit is done
  std::optional<TempFile> rewritten;  // the manifest without the stale entries
  bool remove = false;                // no other file's entry left: the manifest goes
};

// The manifest's lock of `dir` (manifest_update.h), or nullopt where it cannot be had (an Env of
// its own; a directory that cannot be opened or locked): the writers hold it over their renames,
// a serialization with `checksum` that is worth waiting for but not worth failing a write for.
std::optional<FileLock> LockManifestIfPossible(const std::string& dir) {
  Result<std::optional<FileLock>> lock = internal::LockManifest(dir);
  if (!lock.ok() || !*lock) return std::nullopt;
  return std::move(**lock);
}

// The entries of a manifest in `dir` that record files the write replaces or makes obsolete
// (`stale`) describe bytes that go: they go with them, all or nothing as the files do, as part of
// the commit (a rewritten manifest among its files, or the manifest among the old ones). Other
// files' entries stay. Decided under the manifest's lock (manifest_update.h), kept until the
// commit is done, so entries other writers add meanwhile are neither lost nor kept stale. A
// manifest that cannot be read or parsed is left as is.
Result<ManifestChange> DropManifestEntries(Env* env, const std::string& dir,
                                           const std::vector<std::string>& stale,
                                           const WriteOptions& options,
                                           std::optional<FileLock> lock) {
  ManifestChange change;
  // `lock` (LockManifestIfPossible(dir), taken by the caller before it listed `stale`) is held
  // even when the manifest names none of the files (or there is none yet): a `checksum` of the
  // old files merging its digests meanwhile would record them under the new files' names
  // (WriteChecksumManifest checks under this lock that the files it hashed are still there).
  change.lock = std::move(lock);
  auto current = internal::ReadManifestIn(env, dir);
  if (!current.ok() || !*current) return change;
  ChecksumManifest kept = std::move(**current);
  size_t dropped = 0;
  for (const std::string& name : stale) dropped += kept.files.erase(name);
  if (dropped == 0) return change;
  if (kept.files.empty()) {
    change.remove = true;
    return change;
  }
  const std::string text = SerializeChecksumManifest(kept);
  TF_ASSIGN_OR_RETURN(TempFile temp,
                      WriteTemp(JoinDir(dir, std::string(kChecksumManifestName)), text.size(),
                                options, [&](FileSink& sink) {
                                  return sink.Append(std::as_bytes(
                                      std::span<const char>(text.data(), text.size())));
                                }));
  change.rewritten.emplace(std::move(temp));
  return change;
}

}  // namespace

struct DirectoryTransaction::Rep {
  std::vector<std::string> created;              // by Create(), outermost first
  std::vector<internal::RollbackEntry> entries;  // the created levels'
  struct Added {
    std::string dir;
    std::vector<std::string> files;
    std::vector<internal::RollbackEntry> entries;  // the files', then the directory's
  };
  std::vector<Added> added;
  std::optional<FileLock> lock;        // kDirectoryLockName in the root
  internal::RollbackEntry lock_entry;  // its file, for the signal path
  bool committed = false;

  // The lock file goes first (unregistered before it is removed, so the signal path never
  // removes a file another transaction may have made by then).
  void ReleaseLock() noexcept {
    lock_entry.Reset();
    lock.reset();
  }
};

DirectoryTransaction::DirectoryTransaction(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}
DirectoryTransaction::DirectoryTransaction(DirectoryTransaction&&) noexcept = default;
DirectoryTransaction& DirectoryTransaction::operator=(DirectoryTransaction&&) noexcept = default;

Result<DirectoryTransaction> DirectoryTransaction::Create(const std::string& root,
                                                          DirectoryLock lock) {
  namespace fs = std::filesystem;
  auto rep = std::make_unique<Rep>();
  // The path as given, not lexically normalized: "link/../x" is x beside the link's target.
  fs::path p(root);
  if (!p.empty() && !p.has_filename()) p = p.parent_path();  // "a/b/" is "a/b"
  std::error_code ec;
  for (fs::path q = p; !q.empty() && !fs::exists(q, ec); q = q.parent_path()) {
    rep->created.insert(rep->created.begin(), q.string());
    if (q == q.parent_path()) break;
  }
  // Registered before they exist, so a signal in between removes what was made.
  for (const std::string& d : rep->created) {
    rep->entries.emplace_back(internal::RollbackEntry::Kind::kDirectory, d);
  }
  DirectoryTransaction t(std::move(rep));
  if (!t.rep_->created.empty()) {
    fs::create_directories(p, ec);
    if (ec) return Status(Code::kIoError, root + ": cannot create directory: " + ec.message());
  }
  if (lock == DirectoryLock::kExclusive) {
    // Failing, `t` removes the directories it made (none, when another holds the lock: its file
    // is in the root).
    const std::string lock_path = (p / kDirectoryLockName).string();
    bool busy = false;
    auto held =
        FileLock::LockFile(lock_path, FileLock::Wait::kFail,
                           "writing " + root + " as one unit (DirectoryTransaction)", &busy);
    if (!held.ok()) {
      if (!busy) return held.status().WithPrefix(root);
      return Status(held.status().code(),
                    root + ": another writer is writing this directory (" +
                        held.status().message() +
                        "); nothing was written: wait for it to finish, or choose another "
                        "destination");
    }
    t.rep_->lock.emplace(std::move(held).value());
    // The signal path removes the file; the kernel releases the lock with the process.
    t.rep_->lock_entry =
        internal::RollbackEntry(internal::RollbackEntry::Kind::kTemporary, lock_path);
  }
  return t;
}

void DirectoryTransaction::Add(const std::string& dir, const std::vector<std::string>& files) {
  Rep::Added added{dir, files, {}};
  added.entries.reserve(files.size() + 1);
  for (const std::string& f : files) {
    added.entries.emplace_back(internal::RollbackEntry::Kind::kTemporary, f);
  }
  added.entries.emplace_back(internal::RollbackEntry::Kind::kDirectory, dir);
  rep_->added.push_back(std::move(added));
}

void DirectoryTransaction::Forget(const std::string& dir) {
  std::erase_if(rep_->added, [&](const Rep::Added& a) { return a.dir == dir; });
}

Status DirectoryTransaction::SyncCreated(Env* env) const {
  if (env == nullptr) env = Env::Default();
  for (auto d = rep_->created.rbegin(); d != rep_->created.rend(); ++d) {
    const std::filesystem::path holder = std::filesystem::path(*d).parent_path();
    TF_RETURN_IF_ERROR(env->SyncDirectory(holder.empty() ? "." : holder.string()));
  }
  return Status::Ok();
}

void DirectoryTransaction::Commit() noexcept {
  if (rep_ == nullptr) return;
  rep_->committed = true;
  rep_->entries.clear();
  rep_->added.clear();
  rep_->ReleaseLock();
}

DirectoryTransaction::~DirectoryTransaction() {
  if (rep_ == nullptr || rep_->committed) return;
  for (const Rep::Added& a : rep_->added) {
    for (const std::string& f : a.files) ::unlink(f.c_str());
  }
  for (auto a = rep_->added.rbegin(); a != rep_->added.rend(); ++a) ::rmdir(a->dir.c_str());
  // Before the levels Create() made, the root among them: its lock file is in it.
  rep_->ReleaseLock();
  for (auto d = rep_->created.rbegin(); d != rep_->created.rend(); ++d) ::rmdir(d->c_str());
}

void AbandonWritesInProgress() noexcept {
  internal::RunRegisteredRollbacks();
}

namespace {

// The caller's metadata without a kChecksumsMetadataKey entry: the writer's own record replaces
// it, and without checksums a record it did not compute would describe other bytes (a file's
// metadata copied to a rewrite of its tensors), failing every later load.
Metadata WithoutChecksumRecord(const Metadata& metadata) {
  Metadata out;
  out.reserve(metadata.size());
  for (const auto& entry : metadata) {
    if (entry.first != kChecksumsMetadataKey) out.push_back(entry);
  }
  return out;
}

}  // namespace

Result<SerializedHeader> SerializeHeader(std::span<const TensorToWrite> tensors,
                                         const Metadata& metadata, bool metadata_table) {
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, CheckTensors(tensors));
  const Metadata kept = WithoutChecksumRecord(metadata);  // sorted_metadata points into it
  TF_ASSIGN_OR_RETURN(const auto sorted_metadata, SortedMetadata(kept));
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), size_t{0});
  return BuildHeader(tensors, sizes, all, sorted_metadata, metadata_table);
}

Status WriteFile(const std::string& path, std::span<const TensorToWrite> tensors,
                 const Metadata& caller_metadata, const WriteOptions& options) {
  const Metadata metadata = WithoutChecksumRecord(caller_metadata);
  TF_RETURN_IF_ERROR(CheckPathString(path, "output path"));
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, CheckTensors(tensors));
  TF_ASSIGN_OR_RETURN(const auto sorted_metadata, SortedMetadata(metadata));
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), size_t{0});
  if (options.checksums) {
    TF_RETURN_IF_ERROR(CheckChecksumOptions(options));
    ChecksummedFile file = PlaceholderChecksums(tensors, sizes, all, metadata, options);
    // Every error the input can cause surfaces here, before a file exists.
    TF_ASSIGN_OR_RETURN(const SerializedHeader header, HeaderWithChecksums(file));
    return AtomicWrite(path, FileSize(header), options,
                       [&](FileSink& sink) { return WriteChecksummedBody(sink, file, options); });
  }
  TF_ASSIGN_OR_RETURN(const SerializedHeader header,
                      BuildHeader(tensors, sizes, all, sorted_metadata, options.metadata_table));
  return AtomicWrite(path, FileSize(header), options,
                     [&](FileSink& sink) { return WriteBody(sink, tensors, sizes, header); });
}

Result<std::vector<std::string>> WriteSharded(const std::string& dir,
                                              std::span<const TensorToWrite> tensors,
                                              const Metadata& caller_metadata,
                                              const ShardOptions& options) {
  const Metadata metadata = WithoutChecksumRecord(caller_metadata);
  TF_RETURN_IF_ERROR(CheckPathString(dir, "output directory"));
  TF_RETURN_IF_ERROR(CheckShardPrefix(options.prefix));
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, CheckTensors(tensors));
  TF_ASSIGN_OR_RETURN(const auto sorted_metadata, SortedMetadata(metadata));
  TF_ASSIGN_OR_RETURN(const ShardCut cut, CutIntoShards(tensors, sizes, options.max_shard_size));
  // Headers first: every error the input can cause surfaces before a file is written.
  std::vector<SerializedHeader> headers;
  std::vector<ChecksummedFile> checksummed;
  if (options.write.checksums) {
    TF_RETURN_IF_ERROR(CheckChecksumOptions(options.write));
    for (const auto& shard : cut.shards) {
      checksummed.push_back(PlaceholderChecksums(tensors, sizes, shard, metadata, options.write));
      TF_ASSIGN_OR_RETURN(SerializedHeader h, HeaderWithChecksums(checksummed.back()));
      headers.push_back(std::move(h));
    }
  } else {
    TF_ASSIGN_OR_RETURN(headers, BuildShardHeaders(tensors, sizes, cut.shards, sorted_metadata));
  }
  const std::vector<std::string> names = ShardNames(options.prefix, cut.shards.size());

  Env* env = EnvOf(options.write);
  // The directories this call creates are removed again if the write fails or a signal ends it
  // (the CLI's handler), once the temporaries in them are gone.
  // No lock: a caller writing a whole folder as one unit (reshard) holds it already.
  TF_ASSIGN_OR_RETURN(DirectoryTransaction created_dirs,
                      DirectoryTransaction::Create(dir, DirectoryLock::kNone));

  // The hidden temporaries that dead writers of this machine left for this layout (any shard
  // count) or the manifest go first; their backups once the new files are in place.
  const std::vector<std::string> layout_names = OldLayout(env, dir, options.prefix);
  const auto ours = [&](std::string_view base) {
    return InShardFamily(base, options.prefix) || base == kChecksumManifestName ||
           std::any_of(layout_names.begin(), layout_names.end(), [&](const std::string& n) {
             return std::string_view(n).substr(0, util::kHiddenBaseBytes) == base;
           });
  };
  (void)util::RemoveDeadWritersFiles(dir, {util::kTemporaryKind}, ours);

  // Every file goes to a temporary name first; nothing visible changes until all are complete.
  TF_ASSIGN_OR_RETURN(
      std::vector<TempFile> temps,
      WriteShardTemps(dir, tensors, sizes, headers, names, checksummed, options.write));
  if (names.size() > 1 || options.always_write_index) {
    TF_ASSIGN_OR_RETURN(TempFile index, WriteIndexTemp(dir, tensors, cut, names, options));
    temps.push_back(std::move(index));
  }

  // The files of the layout already there that the new one replaces or makes obsolete.
  if (options.write.before_commit) {
    TF_RETURN_IF_ERROR(options.write.before_commit().WithPrefix(dir.empty() ? "." : dir));
  }
  // Read under the manifest's lock, which every writer of this directory holds from here to its
  // commit: read before it, a layout another writer put in place meanwhile (another shard count)
  // would be left behind beside this one, its shards orphans.
  std::optional<FileLock> lock = LockManifestIfPossible(dir);
  std::vector<std::string> old_names = OldLayout(env, dir, options.prefix);
  std::vector<std::string> stale = old_names;
  stale.insert(stale.end(), names.begin(), names.end());
  TF_ASSIGN_OR_RETURN(ManifestChange manifest,
                      DropManifestEntries(env, dir, stale, options.write, std::move(lock)));
  if (manifest.remove) old_names.emplace_back(kChecksumManifestName);
  std::vector<TempFile> commit_files;
  commit_files.reserve(temps.size() + 1);
  // The manifest first: a crash part way leaves files without entries, never entries that
  // describe the files that replaced theirs.
  const bool with_manifest = manifest.rewritten.has_value();
  if (with_manifest) commit_files.push_back(std::move(*manifest.rewritten));
  for (TempFile& t : temps) commit_files.push_back(std::move(t));
  ShardedCommit commit(env, dir, options.write.sync);
  TF_RETURN_IF_ERROR(commit.Run(commit_files, old_names));
  manifest.lock.reset();
  // The levels of `dir` this call made (commit.Run synced `dir` itself): without this, a crash
  // could lose the whole new folder after the call reported it written. As for AtomicWrite's
  // directory fsync, a failure here leaves the files in place and is still the caller's error.
  const Status levels = options.write.sync ? created_dirs.SyncCreated(env) : Status::Ok();
  created_dirs.Commit();
  std::vector<std::string> written;
  written.reserve(temps.size());
  for (size_t i = with_manifest ? 1 : 0; i < commit_files.size(); ++i) {
    written.push_back(commit_files[i].target());
  }
  // Only the backups' removal can fail now; the new checkpoint is complete either way.
  const Status backups = commit.RemoveBackups();
  if (backups.ok()) (void)util::RemoveDeadWritersFiles(dir, {util::kBackupKind}, ours);
  TF_RETURN_IF_ERROR(levels.WithPrefix(dir));  // (both said: the folder's durability first)
  TF_RETURN_IF_ERROR(backups);
  return written;
}

}  // namespace tensorferry

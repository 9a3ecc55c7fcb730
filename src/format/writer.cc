// Writing safetensors files and sharded checkpoints (see tensorferry/writer.h).
//
// Layout: everything is validated and the whole header is built in memory first (SerializeHeader),
// so a bad input is refused before a file exists. Bytes then go through a FileSink (one reusable
// buffer, write loops that survive short writes and EINTR) into a temporary file created with
// O_EXCL beside the destination; the temporary is renamed over the destination only once every
// byte is written (and fsynced when asked). Ownership of the fd and of the temporary file's name
// lives in small RAII types, so every early return, and even an exception thrown by a caller's
// generator, closes the fd and unlinks the temporary.
#include "tensorferry/writer.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <new>
#include <numeric>
#include <string_view>
#include <unordered_map>

#include "util/json_writer.h"
#include "util/macros.h"
#include "util/path.h"

namespace tensorferry {
namespace {

std::string ErrnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

// "tensor \"name\"": names are quoted JSON-style so control characters and odd bytes in a name
// cannot garble a message.
std::string TensorLabel(std::string_view name) {
  return "tensor " + json::Quote(name);
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
    const std::vector<const std::pair<std::string, std::string>*>& metadata) {
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
  // Matches the reference: "__metadata__" is written only when there is metadata.
  if (!metadata.empty()) {
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
  uint64_t offset = 0;
  for (size_t index : out.order) {
    const TensorToWrite& t = tensors[index];
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
  return out;
}

// --- files
// ----------------------------------------------------------------------------------------

// Owns a file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  // Closes now, reporting the error: on NFS and some other filesystems write errors surface only
  // at close. After this the object owns nothing, whatever the result.
  int Close() {
    const int fd = fd_;
    fd_ = -1;
    // No retry on EINTR: Linux releases the descriptor even then, and it may be reused already.
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

// Owns the name of a temporary file: unlinks it on destruction unless Release()d.
class TempFileGuard {
 public:
  explicit TempFileGuard(std::string path) : path_(std::move(path)) {}
  ~TempFileGuard() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;

  const std::string& path() const { return path_; }
  void Release() { path_.clear(); }

 private:
  std::string path_;
};

uint64_t RandomBits(uint64_t salt) {
  uint64_t v = 0;
  if (::getrandom(&v, sizeof(v), GRND_NONBLOCK) != static_cast<ssize_t>(sizeof(v))) {
    // Early boot without entropy: any varying value will do, O_EXCL guarantees uniqueness.
    v = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  // splitmix64 finalizer: spreads the salt (attempt number) over all bits.
  v += salt * 0x9e3779b97f4a7c15ull;
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  return v ^ (v >> 31);
}

// Writes bytes to a file descriptor through one reusable buffer; tracks the file offset for
// error messages. Small pieces (the prefix, the header, small tensors) are gathered so a file of
// many small tensors costs few system calls; pieces at least as large as the buffer go to the
// kernel straight from the caller's memory, with no copy.
class FileSink {
 public:
  // REQUIRES: `buffer` holds `buffer_size` > 0 bytes; `path` outlives the sink.
  FileSink(int fd, const std::string& path, std::unique_ptr<std::byte[]> buffer, size_t buffer_size)
      : fd_(fd), path_(path), buffer_(std::move(buffer)), capacity_(buffer_size) {}

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
  Status AppendGenerated(const TensorToWrite& t, uint64_t size) {
    uint64_t done = 0;
    while (done < size) {
      if (used_ == capacity_) TF_RETURN_IF_ERROR(Flush());
      const size_t n = static_cast<size_t>(std::min<uint64_t>(size - done, capacity_ - used_));
      std::span<std::byte> out(buffer_.get() + used_, n);
      Status s;
      // The generator is the caller's code: an exception from it must not escape the library.
      try {
        s = t.generate(done, out);
      } catch (const std::exception& e) {
        s = Status(Code::kInternal, std::string("generate threw an exception: ") + e.what());
      } catch (...) {
        s = Status(Code::kInternal, "generate threw an exception");
      }
      if (!s.ok()) {
        return s.WithPrefix(TensorLabel(t.name) + ": generating bytes [" + std::to_string(done) +
                            ", " + std::to_string(done + n) + ")");
      }
      used_ += n;
      done += n;
    }
    return Status::Ok();
  }

  Status Flush() {
    if (used_ == 0) return Status::Ok();
    const size_t n = used_;
    used_ = 0;
    return WriteAll({buffer_.get(), n});
  }

 private:
  Status WriteAll(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      // Linux writes at most 0x7ffff000 bytes per call anyway; asking for less keeps the count in
      // range of ssize_t everywhere.
      const size_t want = std::min<size_t>(bytes.size(), size_t{1} << 30);
      const ssize_t n = ::write(fd_, bytes.data(), want);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        return Status(Code::kIoError, path_ + ": write of " + std::to_string(bytes.size()) +
                                          " bytes at offset " + std::to_string(flushed_) +
                                          " failed: " + ErrnoText(err));
      }
      if (n == 0) {  // not expected from a regular file; avoid spinning forever
        return Status(Code::kIoError, path_ + ": write at offset " + std::to_string(flushed_) +
                                          " made no progress");
      }
      bytes = bytes.subspan(static_cast<size_t>(n));
      flushed_ += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  int fd_;
  const std::string& path_;
  std::unique_ptr<std::byte[]> buffer_;
  size_t capacity_;
  size_t used_ = 0;
  uint64_t flushed_ = 0;  // bytes handed to the kernel so far
};

Status SyncDirectory(const std::string& dir) {
  int fd;
  do {
    fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    return Status(Code::kIoError, dir + ": cannot open directory to fsync it: " + ErrnoText(err));
  }
  UniqueFd dir_fd(fd);
  if (::fsync(dir_fd.get()) != 0) {
    const int err = errno;
    // Some filesystems cannot fsync a directory (EINVAL); there is nothing more to make durable.
    if (err != EINVAL) {
      return Status(Code::kIoError, dir + ": fsync of directory failed: " + ErrnoText(err));
    }
  }
  return Status::Ok();
}

// Writes `path` atomically: `body(sink)` produces the content of `size` bytes (a hint for the
// buffer size) into a temporary file in the same directory, which then replaces `path`.
template <typename Body>
Status AtomicWrite(const std::string& path, uint64_t size, const WriteOptions& options,
                   Body&& body) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const std::string base = target.filename().string();
  if (base.empty() || base == "." || base == "..") {
    return Status(Code::kInvalidArgument, "\"" + path + "\" does not name a file");
  }
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";

  // A name unique to this call, hidden (leading dot), in the destination's directory so the final
  // rename stays within one filesystem. The destination's name is cut so the temporary name stays
  // within NAME_MAX (255) even for a long destination name.
  const std::string stem = "." + base.substr(0, 200) + ".tmp-" + std::to_string(::getpid()) + "-";
  std::string temp_path;
  int fd = -1;
  for (uint64_t attempt = 0; fd < 0; ++attempt) {
    char hex[17];
    const uint64_t r = RandomBits(attempt);
    for (int i = 0; i < 16; ++i) hex[i] = "0123456789abcdef"[(r >> (60 - 4 * i)) & 0xf];
    hex[16] = '\0';
    temp_path =
        target.has_parent_path() ? (target.parent_path() / (stem + hex)).string() : stem + hex;
    // 0666: the mode then comes from the umask, as for any file a program creates.
    fd = ::open(temp_path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666);
    if (fd >= 0) break;
    const int err = errno;
    if (err == EINTR || (err == EEXIST && attempt < 100)) continue;
    return Status(Code::kIoError,
                  path + ": cannot create temporary file " + temp_path + ": " + ErrnoText(err));
  }
  UniqueFd file(fd);
  TempFileGuard guard(temp_path);

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
  FileSink sink(file.get(), path, std::move(buffer), buffer_size);
  TF_RETURN_IF_ERROR(body(sink));
  TF_RETURN_IF_ERROR(sink.Flush());

  if (options.sync) {
    int rc;
    do {
      rc = ::fsync(file.get());
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      const int err = errno;
      return Status(Code::kIoError, path + ": fsync after writing " +
                                        std::to_string(sink.offset()) +
                                        " bytes failed: " + ErrnoText(err));
    }
  }
  if (const int err = file.Close(); err != 0) {
    return Status(Code::kIoError, path + ": close after writing " + std::to_string(sink.offset()) +
                                      " bytes failed: " + ErrnoText(err));
  }
  if (::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int err = errno;
    return Status(Code::kIoError, path + ": cannot rename temporary file " + temp_path +
                                      " over it: " + ErrnoText(err));
  }
  guard.Release();
  // After the rename the new file is in place; a failure here only means its directory entry may
  // not survive a crash, which the caller should still hear about.
  if (options.sync) TF_RETURN_IF_ERROR(SyncDirectory(dir).WithPrefix(path));
  return Status::Ok();
}

// Writes the file whose header is `header` (built from `tensors` and `sizes`).
Status WriteWithHeader(const std::string& path, std::span<const TensorToWrite> tensors,
                       std::span<const uint64_t> sizes, const SerializedHeader& header,
                       const WriteOptions& options) {
  const uint64_t json_size = header.json.size();
  uint64_t total = 8 + json_size;
  if (__builtin_add_overflow(total, header.data_size, &total)) total = UINT64_MAX;
  return AtomicWrite(path, total, options, [&](FileSink& sink) -> Status {
    std::byte prefix[8];
    for (int i = 0; i < 8; ++i) prefix[i] = static_cast<std::byte>((json_size >> (8 * i)) & 0xff);
    TF_RETURN_IF_ERROR(sink.Append(prefix));
    TF_RETURN_IF_ERROR(
        sink.Append(std::as_bytes(std::span<const char>(header.json.data(), header.json.size()))));
    for (size_t index : header.order) {
      const TensorToWrite& t = tensors[index];
      if (t.generate) {
        TF_RETURN_IF_ERROR(sink.AppendGenerated(t, sizes[index]));
      } else {
        TF_RETURN_IF_ERROR(sink.Append(t.data));
      }
    }
    return Status::Ok();
  });
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

}  // namespace

Result<SerializedHeader> SerializeHeader(std::span<const TensorToWrite> tensors,
                                         const Metadata& metadata) {
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, CheckTensors(tensors));
  TF_ASSIGN_OR_RETURN(const auto sorted_metadata, SortedMetadata(metadata));
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), size_t{0});
  return BuildHeader(tensors, sizes, all, sorted_metadata);
}

Status WriteFile(const std::string& path, std::span<const TensorToWrite> tensors,
                 const Metadata& metadata, const WriteOptions& options) {
  TF_RETURN_IF_ERROR(CheckPathString(path, "output path"));
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, CheckTensors(tensors));
  TF_ASSIGN_OR_RETURN(const auto sorted_metadata, SortedMetadata(metadata));
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), size_t{0});
  TF_ASSIGN_OR_RETURN(const SerializedHeader header,
                      BuildHeader(tensors, sizes, all, sorted_metadata));
  return WriteWithHeader(path, tensors, sizes, header, options);
}

Result<std::vector<std::string>> WriteSharded(const std::string& dir,
                                              std::span<const TensorToWrite> tensors,
                                              const Metadata& metadata,
                                              const ShardOptions& options) {
  TF_RETURN_IF_ERROR(CheckPathString(dir, "output directory"));
  namespace fs = std::filesystem;
  const std::string& prefix = options.prefix;
  if (prefix.empty() || prefix == "." || prefix == ".." ||
      prefix.find_first_of(std::string_view("/\0", 2)) != std::string::npos ||
      !json::IsValidUtf8(prefix)) {
    return Status(Code::kInvalidArgument,
                  "shard prefix " + json::Quote(prefix) +
                      " must be a non-empty UTF-8 file name without '/' or NUL");
  }
  TF_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, CheckTensors(tensors));
  TF_ASSIGN_OR_RETURN(const auto sorted_metadata, SortedMetadata(metadata));

  // Shards in the caller's order: a new shard starts when the next tensor would push the current
  // one past the limit, so a tensor above the limit ends up alone.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_size = 0;
  uint64_t total_size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (__builtin_add_overflow(total_size, sizes[i], &total_size)) {
      return Status(Code::kOverflow, TensorLabel(tensors[i].name) +
                                         ": total size of the checkpoint overflows 64 bits");
    }
    uint64_t grown;
    const bool overflow = __builtin_add_overflow(shard_size, sizes[i], &grown);
    if (!shards.back().empty() && (overflow || grown > options.max_shard_size)) {
      shards.emplace_back();
      grown = sizes[i];
    }
    shards.back().push_back(i);
    shard_size = grown;
  }

  // Headers first: every error the input can cause surfaces before a file is written.
  std::vector<SerializedHeader> headers;
  headers.reserve(shards.size());
  for (const auto& shard : shards) {
    TF_ASSIGN_OR_RETURN(SerializedHeader h, BuildHeader(tensors, sizes, shard, sorted_metadata));
    headers.push_back(std::move(h));
  }

  const size_t n = shards.size();
  std::vector<std::string> names(n);
  for (size_t s = 0; s < n; ++s) {
    if (n == 1) {
      names[s] = prefix + ".safetensors";
      break;
    }
    // transformers: f"{prefix}-{i:05d}-of-{n:05d}.safetensors".
    std::string index = std::to_string(s + 1);
    std::string count = std::to_string(n);
    index.insert(0, index.size() < 5 ? 5 - index.size() : 0, '0');
    count.insert(0, count.size() < 5 ? 5 - count.size() : 0, '0');
    names[s] = prefix + "-" + index + "-of-" + count + ".safetensors";
  }

  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      return Status(Code::kIoError, dir + ": cannot create directory: " + ec.message());
    }
  }
  const auto join = [&](const std::string& name) {
    return dir.empty() ? name : (fs::path(dir) / name).string();
  };

  std::vector<std::string> written;
  // If a later shard fails, remove the ones this call already wrote: a half-written checkpoint
  // (with, possibly, an older index beside it) would otherwise look loadable.
  struct Cleanup {
    std::vector<std::string>* paths;
    bool armed = true;
    ~Cleanup() {
      if (!armed) return;
      for (const auto& p : *paths) ::unlink(p.c_str());
    }
  } cleanup{&written};

  for (size_t s = 0; s < n; ++s) {
    std::string path = join(names[s]);
    TF_RETURN_IF_ERROR(WriteWithHeader(path, tensors, sizes, headers[s], options.write));
    written.push_back(std::move(path));
  }
  if (n > 1 || options.always_write_index) {
    std::vector<std::string> file_of(tensors.size());
    for (size_t s = 0; s < n; ++s) {
      for (size_t i : shards[s]) file_of[i] = names[s];
    }
    const std::string index = IndexJson(tensors, file_of, total_size);
    std::string path = join(prefix + ".safetensors.index.json");
    TF_RETURN_IF_ERROR(AtomicWrite(path, index.size(), options.write, [&](FileSink& sink) {
      return sink.Append(std::as_bytes(std::span<const char>(index.data(), index.size())));
    }));
    written.push_back(std::move(path));
  }
  cleanup.armed = false;
  return written;
}

}  // namespace tensorferry

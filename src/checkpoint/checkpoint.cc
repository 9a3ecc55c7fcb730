// Checkpoint::Open: one validated table of every tensor of a file, a file list, a directory or a
// sharded checkpoint described by model.safetensors.index.json.
//
// Opening is three steps: decide what the path is (file, index, directory), open every file and
// validate its header (ReadHeader), then cross-check the files against each other and against
// the index, and build the immutable tables and the file table (io::FileSet) that keeps the
// files opened here.
#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "checkpoint/shard_series.h"
#include "io/file_set.h"
#include "io/read_engine.h"
#include "objstore/checkpoint_objects.h"
#include "objstore/url.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/hub.h"
#include "util/json_writer.h"
#include "util/macros.h"
#include "util/parallel.h"
#include "util/path.h"

namespace tensorferry {

namespace fs = std::filesystem;

Result<Header> ReadHeader(const RandomAccessFile& file, const ParseLimits& limits) {
  TF_ASSIGN_OR_RETURN(const uint64_t file_size, file.Size());
  std::array<std::byte, 8> prefix{};
  const size_t prefix_len = static_cast<size_t>(std::min<uint64_t>(file_size, prefix.size()));
  TF_RETURN_IF_ERROR(ReadFully(file, 0, std::span<std::byte>(prefix.data(), prefix_len)));
  TF_ASSIGN_OR_RETURN(const uint64_t header_size,
                      ParseHeaderLength(std::span<const std::byte>(prefix.data(), prefix_len),
                                        file_size, limits, file.path()));
  // ParseHeaderLength guarantees 8 + header_size <= file_size and header_size <= the limit.
  std::vector<std::byte> buffer(static_cast<size_t>(8 + header_size));
  TF_RETURN_IF_ERROR(ReadFully(file, 0, buffer));
  return ParseHeader(buffer, file_size, limits, file.path());
}

namespace {

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

// Opens files, validates headers and builds a Checkpoint. One builder per Open call.
class CheckpointBuilder {
 public:
  explicit CheckpointBuilder(const OpenOptions& options)
      : options_(options),
        source_(options.source ? options.source : MakeEnvSource(options.env)),
        max_open_(options.max_open_files > 0 ? options.max_open_files
                                             : io::FileSet::DefaultMaxOpen()) {}

  // A checkpoint of the given safetensors files (no index): names must be unique across them.
  Result<std::shared_ptr<const Checkpoint>> FromFiles(std::vector<std::string> paths) {
    if (paths.empty()) return Status(Code::kInvalidArgument, "no safetensors files given");
    std::sort(paths.begin(), paths.end());
    // One file under two spellings ("/m/a" and "/m/./a") too; keys of a store are names as they
    // are.
    std::map<std::string, const std::string*> spelled;
    for (const std::string& p : paths) {
      const std::string key = IsObjectUrl(p) ? p : fs::path(p).lexically_normal().string();
      const auto [it, added] = spelled.emplace(key, &p);
      if (!added) {
        return Status(Code::kInvalidArgument,
                      p + ": file given more than once" +
                          (*it->second == p ? "" : " (also as " + *it->second + ")"));
      }
    }
    size_t failed = 0;
    TF_RETURN_IF_ERROR(AddFiles(paths, failed));
    TF_RETURN_IF_ERROR(CheckNoDuplicateTensors());
    return Build();
  }

  // A sharded checkpoint described by the index file at `index_path`.
  // `opened`: the index, when the caller already opened it (a URL's probe), else null.
  Result<std::shared_ptr<const Checkpoint>> FromIndex(
      const std::string& index_path, std::unique_ptr<SourceFile> opened = nullptr) {
    IndexDocument index;
    TF_ASSIGN_OR_RETURN(index, ReadIndex(index_path, std::move(opened)));
    // Every tensor with its file's normalized relative path ("./a" and "a" are one file).
    std::vector<std::pair<std::string, std::string>> tensor_file;  // (tensor, normalized path)
    tensor_file.reserve(index.weight_map.size());
    for (const auto& [tensor, file] : index.weight_map) {
      tensor_file.emplace_back(tensor, fs::path(file).lexically_normal().string());
    }
    // The distinct files in path order; the canonical checks need the real file system: only
    // with the default Env.
    // The canonical checks need the real file system: only with the default Env, and not for
    // URLs (whose lexical rule ParseIndexJson applied: no key leaves the index's prefix).
    const bool on_disk = options_.env == nullptr && !IsObjectUrl(index_path);
    TF_ASSIGN_OR_RETURN(const std::vector<IndexedFile> indexed,
                        IndexedFiles(index.weight_map, index_path, on_disk));
    if (on_disk) {
      TF_ASSIGN_OR_RETURN(const fs::path canonical_dir,
                          CanonicalDirectory(fs::path(index_path).parent_path(), index_path));
      contain_ = Containment{canonical_dir, index_path};
    }
    // A URL's files are keys under the index's prefix: objstore::Join percent-encodes a name
    // for http(s) (so that ' ', '#', '?' and '%' in a file name stay part of that name), where
    // IndexedFiles' path join puts it into the URL raw.
    std::optional<objstore::ObjectUrl> url_dir;
    if (IsObjectUrl(index_path)) {
      TF_ASSIGN_OR_RETURN(const objstore::ObjectUrl index_url,
                          objstore::ParseObjectUrl(index_path));
      url_dir = objstore::Parent(index_url);
      // The names are joined as normalized paths ("sub//x" as "sub/x"), which on a store is
      // another key: such a name is refused rather than read as another object.
      for (const auto& [tensor, file] : index.weight_map) {
        if (file.find("//") != std::string::npos || file.ends_with('/')) {
          return Status(Code::kIndexPathEscape,
                        RedactUrl(index_path) + ": weight_map[" + json::Quote(tensor) + "]: file " +
                            json::Quote(file) +
                            " has an empty path segment: in an object store that names another "
                            "key than the one without it");
        }
      }
    }
    std::vector<std::string> paths;
    for (const IndexedFile& f : indexed) {
      paths.push_back(url_dir ? objstore::Join(*url_dir, f.rel).ToString() : f.path);
    }
    size_t failed = 0;
    if (Status s = AddFiles(paths, failed); !s.ok()) {
      if (s.code() != Code::kNotFound) return s;
      return Status(Code::kIndexMissingFile,
                    index_path + ": file " + json::Quote(indexed[failed].rel) + " (of tensor " +
                        json::Quote(indexed[failed].tensor) + ") does not exist: " + s.message());
    }
    std::map<std::string, uint32_t> file_index;  // normalized relative path -> files_ index
    for (size_t i = 0; i < indexed.size(); ++i) {
      file_index[indexed[i].rel] = static_cast<uint32_t>(i);
    }

    TF_RETURN_IF_ERROR(CheckNoDuplicateTensors());

    // Every weight_map tensor is in the file the map names.
    for (const auto& [tensor, rel] : tensor_file) {
      const uint32_t expected = file_index.at(rel);
      auto it = where_.find(tensor);
      if (it == where_.end() || it->second != expected) {
        std::string message = index_path + ": weight_map maps tensor " + json::Quote(tensor) +
                              " to " + json::Quote(files_[expected].path) +
                              ", which does not contain it";
        if (it != where_.end())
          message += " (it is in " + json::Quote(files_[it->second].path) + ")";
        return Status(Code::kIndexMissingTensor, std::move(message));
      }
    }
    // Every tensor of every file is in the weight_map. A tensor listed for another file was
    // caught above (that file lacks it, since no tensor is in two files).
    if (where_.size() != tensor_file.size()) {
      for (size_t f = 0; f < headers_.size(); ++f) {
        for (const auto& t : headers_[f].tensors) {
          auto it = std::lower_bound(
              tensor_file.begin(), tensor_file.end(), t.name,
              [](const auto& entry, const std::string& name) { return entry.first < name; });
          if (it == tensor_file.end() || it->first != t.name) {
            return Status(Code::kIndexUnlistedTensor,
                          files_[f].path + ": tensor " + json::Quote(t.name) +
                              " is not listed in the weight_map of " + index_path);
          }
        }
      }
    }

    index_metadata_ = std::move(index.metadata);
    index_path_ = index_path;
    return Build();
  }

  // A directory: its index when present, else every *.safetensors file directly inside.
  Result<std::shared_ptr<const Checkpoint>> FromDirectory(const std::string& dir) {
    const std::string index_path = (fs::path(dir) / kIndexFileName).string();
    std::error_code ec;
    if (fs::exists(index_path, ec)) return FromIndex(index_path);
    if (ec) return Status(Code::kIoError, index_path + ": " + ec.message());
    // An index that is a link to nothing (a hub snapshot whose blob is gone) is a missing file,
    // not an absent index: the folder's *.safetensors are not what it selects.
    std::error_code index_link_ec;
    if (fs::is_symlink(fs::symlink_status(index_path, index_link_ec))) {
      const fs::path target = fs::read_symlink(index_path, index_link_ec);
      return Status(Code::kCheckpointIncomplete,
                    index_path + ": a symbolic link to " + json::Quote(target.string()) +
                        ", which does not exist (an incomplete download or copy?)");
    }

    std::vector<std::string> paths;
    fs::directory_iterator it(dir, ec);
    if (ec) return Status(Code::kIoError, dir + ": cannot list: " + ec.message());
    for (; it != fs::directory_iterator(); it.increment(ec)) {
      const auto& entry = *it;
      if (entry.path().extension() != ".safetensors") continue;
      // Followed through symlinks. Directories are not checkpoint files, other special files
      // are refused; a link to nothing is one that is missing (a hub snapshot whose blob is
      // gone).
      std::error_code type_ec;
      const fs::file_status st = entry.status(type_ec);
      if (st.type() == fs::file_type::not_found) {
        std::error_code link_ec;
        const fs::path target = fs::read_symlink(entry.path(), link_ec);
        if (link_ec) {
          return Status(Code::kNotFound, entry.path().string() +
                                             ": listed, then gone (removed while the "
                                             "checkpoint was being opened?)");
        }
        return Status(Code::kCheckpointIncomplete,
                      entry.path().string() + ": a symbolic link to " +
                          json::Quote(target.string()) +
                          ", which does not exist (an incomplete download or copy?)");
      }
      if (type_ec) {
        return Status(Code::kIoError,
                      entry.path().string() + ": cannot stat: " + type_ec.message());
      }
      if (fs::is_regular_file(st)) {
        paths.push_back(entry.path().string());
      } else if (!fs::is_directory(st)) {
        // A FIFO, socket or device named like a shard (or a link to one): not silently left
        // out, which would load the others without it (or call a present shard missing).
        const char* what = fs::is_fifo(st)             ? "a FIFO"
                           : fs::is_socket(st)         ? "a socket"
                           : fs::is_character_file(st) ? "a character device"
                           : fs::is_block_file(st)     ? "a block device"
                                                       : "not a regular file";
        return Status(Code::kInvalidArgument,
                      entry.path().string() + ": " + what +
                          (entry.is_symlink() ? " (through a symbolic link)" : "") +
                          ", not a regular file: a checkpoint's .safetensors files must be");
      }
    }
    if (ec) return Status(Code::kIoError, dir + ": cannot list: " + ec.message());
    if (paths.empty()) return Status(Code::kInvalidArgument, dir + ": no .safetensors files");
    TF_RETURN_IF_ERROR(CheckShardSeries(paths, dir));
    // The index's path rule applies to the files found by listing too: a symlink that leaves the
    // directory (other than a hub snapshot's into its blobs/) is refused.
    TF_ASSIGN_OR_RETURN(const fs::path canonical_dir, CanonicalDirectory(dir, dir));
    for (const std::string& path : paths) {
      TF_RETURN_IF_ERROR(CheckContained(canonical_dir, path, dir,
                                        "file " + json::Quote(fs::path(path).filename().string())));
    }
    contain_ = Containment{canonical_dir, dir};
    return FromFiles(std::move(paths));
  }

 private:
  Result<IndexDocument> ReadIndex(const std::string& index_path, std::unique_ptr<SourceFile> file) {
    if (file == nullptr) {
      TF_ASSIGN_OR_RETURN(file, source_->Open(index_path));
    }
    const uint64_t size = file->identity().size;
    // Checked before reading, so a huge file is never loaded into memory.
    if (size > options_.index_limits.max_index_size) {
      return Status(Code::kIndexTooLarge, index_path + ": index is " + std::to_string(size) +
                                              " bytes, above the limit of " +
                                              std::to_string(options_.index_limits.max_index_size));
    }
    std::string text(static_cast<size_t>(size), '\0');
    TF_RETURN_IF_ERROR(ReadFully(
        *file, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(text.data()), text.size())));
    return ParseIndexJson(text, index_path, options_.index_limits);
  }

  // A file opened, its header read and validated: the first step of adding it.
  struct Opened {
    std::shared_ptr<const SourceFile> file;
    Header header;
  };

  Result<Opened> OpenFile(const std::string& path) const {
    TF_ASSIGN_OR_RETURN(std::shared_ptr<const SourceFile> file, source_->Open(path));
    if (contain_) {
      // Checked by name before the open (for an early error), and again on what was opened: a
      // symlink swapped in between would otherwise be followed outside the directory. Later
      // opens of the path (the file table's) must find this identity.
      TF_RETURN_IF_ERROR(
          CheckOpenedContained(contain_->dir, path, file->native_handle(), contain_->where,
                               "file " + json::Quote(fs::path(path).filename().string())));
    }
    TF_ASSIGN_OR_RETURN(Header header, ReadHeader(*file, options_.parse_limits));
    if (file->identity().size != header.data_offset() + header.data_size) {
      // Changed between the identity and the header reads: the size read is not the size now.
      TF_ASSIGN_OR_RETURN(const uint64_t now, file->Size());
      FileIdentity then = file->identity();
      FileIdentity later = then;
      later.size = now;
      return FileChangedError(path, then, later);
    }
    return Opened{std::move(file), std::move(header)};
  }

  // Opens `paths` and appends them to the tables, in order. A local file's open costs a few
  // system calls, so local files are opened one at a time; an object's costs at least a round
  // trip to the store (and, with a local cache, possibly its download), so objects are opened
  // kRemoteOpens at a time, each window appended in order before the next is opened (the limits
  // on the totals stop the open at the same file either way). On error, `failed` is the index of
  // the file whose error it is.
  Status AddFiles(const std::vector<std::string>& paths, size_t& failed) {
    constexpr size_t kRemoteOpens = 16;
    const size_t window = source_->hints().concurrency > 0 ? kRemoteOpens : 1;
    for (size_t begin = 0; begin < paths.size(); begin += window) {
      const size_t n = std::min(window, paths.size() - begin);
      std::vector<std::optional<Opened>> opened(n);
      // The error of the first file in order that failed; every file before it was opened, so
      // the first one without an entry in `opened` is that file.
      const Status error = ParallelForUntilError(n, static_cast<unsigned>(n), [&](size_t i) {
        const io::CancelScope cancel(options_.cancel);  // on each helper thread too
        TF_ASSIGN_OR_RETURN(Opened o, OpenFile(paths[begin + i]));
        opened[i] = std::move(o);
        return Status::Ok();
      });
      for (size_t i = 0; i < n; ++i) {
        failed = begin + i;
        if (!opened[i]) return error;
        TF_RETURN_IF_ERROR(Append(paths[begin + i], std::move(*opened[i])));
      }
    }
    return Status::Ok();
  }

  // Appends an opened file to the tables; the file stays open (up to max_open_ files) for the
  // file table.
  Status Append(const std::string& path, Opened opened) {
    std::shared_ptr<const SourceFile> file = std::move(opened.file);
    Header header = std::move(opened.header);
    io::FileSet::FileSpec spec{path, file->identity(), nullptr};
    if (specs_.size() < max_open_) spec.open = std::move(file);
    total_tensors_ += header.tensors.size();
    total_header_bytes_ += header.header_size;
    if (total_tensors_ > options_.max_total_tensors) {
      return Status(Code::kCheckpointTooLarge,
                    path + ": with this file the checkpoint holds " +
                        std::to_string(total_tensors_) + " tensors, more than " +
                        std::to_string(options_.max_total_tensors) + " (limit max_total_tensors)");
    }
    if (total_header_bytes_ > options_.max_total_header_bytes) {
      return Status(Code::kCheckpointTooLarge,
                    path + ": with this file the checkpoint's headers take " +
                        std::to_string(total_header_bytes_) + " bytes, more than " +
                        std::to_string(options_.max_total_header_bytes) +
                        " (limit max_total_header_bytes)");
    }
    FileInfo info;
    info.path = path;
    // The size the header was validated against: 8 + N + data.
    info.file_size = header.data_offset() + header.data_size;
    info.header_size = header.header_size;
    info.data_offset = header.data_offset();
    info.metadata = header.metadata;
    info.num_tensors = header.tensors.size();
    files_.push_back(std::move(info));
    headers_.push_back(std::move(header));
    specs_.push_back(std::move(spec));
    return Status::Ok();
  }

  // Fills where_ (tensor name -> file); kIndexDuplicateTensor when a name is in two files.
  Status CheckNoDuplicateTensors() {
    for (size_t f = 0; f < headers_.size(); ++f) {
      for (const auto& t : headers_[f].tensors) {
        auto [it, inserted] = where_.emplace(t.name, static_cast<uint32_t>(f));
        if (!inserted) {
          return Status(Code::kIndexDuplicateTensor,
                        "tensor " + json::Quote(t.name) +
                            " is in two files: " + json::Quote(files_[it->second].path) + " and " +
                            json::Quote(files_[f].path));
        }
      }
    }
    return Status::Ok();
  }

  Result<std::shared_ptr<const Checkpoint>> Build() {
    std::shared_ptr<Checkpoint> cp(new Checkpoint());
    size_t total = 0;
    for (const auto& h : headers_) total += h.tensors.size();
    cp->tensors_.reserve(total);
    where_.clear();  // its keys view the header names moved from below
    for (size_t f = 0; f < headers_.size(); ++f) {
      const uint64_t base = files_[f].data_offset;
      // Header tensors are sorted by data offset already: (file, offset) order.
      for (auto& t : headers_[f].tensors) {
        TensorInfo info;
        info.name = std::move(t.name);
        info.dtype = t.dtype;
        info.shape = std::move(t.shape);
        info.file = static_cast<uint32_t>(f);
        info.offset = base + t.begin;
        info.size = t.end - t.begin;
        cp->total_tensor_bytes_ += info.size;
        cp->tensors_.push_back(std::move(info));
      }
    }
    cp->by_name_.resize(cp->tensors_.size());
    for (size_t i = 0; i < cp->by_name_.size(); ++i) cp->by_name_[i] = static_cast<uint32_t>(i);
    const auto& tensors = cp->tensors_;
    std::sort(cp->by_name_.begin(), cp->by_name_.end(),
              [&](uint32_t a, uint32_t b) { return tensors[a].name < tensors[b].name; });
    cp->files_ = std::move(files_);
    cp->index_metadata_ = std::move(index_metadata_);
    cp->index_path_ = std::move(index_path_);
    cp->file_set_ = std::make_shared<io::FileSet>(source_, std::move(specs_), max_open_);
    return std::shared_ptr<const Checkpoint>(std::move(cp));
  }

  const OpenOptions& options_;
  std::shared_ptr<Source> source_;
  const size_t max_open_;
  std::vector<io::FileSet::FileSpec> specs_;  // parallel to files_
  uint64_t total_tensors_ = 0;                // over the files added so far
  uint64_t total_header_bytes_ = 0;
  std::vector<FileInfo> files_;
  std::vector<Header> headers_;                           // parallel to files_
  std::unordered_map<std::string_view, uint32_t> where_;  // tensor name -> file
  std::vector<std::pair<std::string, std::string>> index_metadata_;
  std::string index_path_;
  // A checkpoint directory on the real file system, whose files must stay inside it (the path
  // rule of util/path.h): checked on each file once it is open. Unset for files given one by one
  // and for object-store URLs.
  struct Containment {
    fs::path dir;       // canonical
    std::string where;  // the index or the directory, for messages
  };
  std::optional<Containment> contain_;
};

namespace {

// `options` with its source set: the object source when unset (object_store.h).
Result<OpenOptions> WithObjectSource(const OpenOptions& given) {
  OpenOptions options = given;
  if (!options.source) {
    TF_ASSIGN_OR_RETURN(options.source, MakeObjectSource(options.object_store));
  }
  return options;
}

// A URL: an index (".json"), a file (".safetensors"), or a prefix holding an index, else (S3, GCS)
// the *.safetensors objects directly under it, else (HTTP) its model.safetensors: resolved by
// objstore::FindCheckpointObjects, which `tensorferry doctor` asks through too.
Result<std::shared_ptr<const Checkpoint>> OpenUrl(const std::string& path,
                                                  const OpenOptions& given) {
  TF_ASSIGN_OR_RETURN(const objstore::ObjectUrl url, objstore::ParseObjectUrl(path));
  TF_ASSIGN_OR_RETURN(const OpenOptions options, WithObjectSource(given));
  TF_ASSIGN_OR_RETURN(objstore::CheckpointObjects found,
                      objstore::FindCheckpointObjects(*options.source, url));
  CheckpointBuilder builder(options);
  if (!found.index.empty()) return builder.FromIndex(found.index, std::move(found.opened));
  if (found.listed) TF_RETURN_IF_ERROR(CheckShardSeries(found.files, url.ToString()));
  return builder.FromFiles(std::move(found.files));
}

// A not-cached hf:// path's error, with why the hub was not asked or what it answered.
Status NotOnHub(const Status& cached, const Status& hub) {
  if (hub.ok()) {
    return Status(cached.code(), cached.message() + "; HF_HUB_OFFLINE is set, so the hub " +
                                     RedactUrl(HubEndpoint()) + " was not asked");
  }
  return Status(hub.code(), cached.message() + "; and from the hub " + RedactUrl(HubEndpoint()) +
                                ": " + hub.message());
}

// Where HubUrl writes the refs of the branches it pins: the hub cache the source fills.
std::string RefCache(const OpenOptions& options) {
  return options.object_store.hub_cache ? HubCacheDir() : std::string();
}

// An hf:// path (hub.h): its snapshot in the local hub cache, else (unless HF_HUB_OFFLINE) the
// hub's URL for it, pinned to a commit.
Result<std::shared_ptr<const Checkpoint>> OpenHub(const std::string& path,
                                                  const OpenOptions& options) {
  Result<std::string> local = ResolveHubPath(path);
  Status cached = local.status();
  if (local.ok()) {
    // A snapshot holding some of the repository's files but not the checkpoint's (a cache that
    // only config.json was fetched into, a shard missing): read the hub instead.
    const auto incomplete = [&](const std::string& why) {
      return Status(Code::kNotFound, path + ": the cached snapshot " + json::Quote(*local) +
                                         " is incomplete: " + why);
    };
    std::error_code ec;
    bool holds = !fs::is_directory(*local, ec);
    for (fs::directory_iterator it(*local, ec), end; !holds && !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      holds = name == kIndexFileName || EndsWith(name, ".safetensors");
    }
    if (!holds) {
      cached = incomplete("no " + std::string(kIndexFileName) + " or .safetensors file in it");
    } else {
      Result<std::shared_ptr<const Checkpoint>> opened = Checkpoint::Open(*local, options);
      const Code code = opened.status().code();
      if (opened.ok() || (code != Code::kNotFound && code != Code::kCheckpointIncomplete &&
                          code != Code::kIndexMissingFile)) {
        return opened;
      }
      cached = incomplete(opened.status().message());
    }
  }
  if (cached.code() != Code::kNotFound) return cached;
  if (HubOffline()) return NotOnHub(cached, Status());
  // One source for the API's request and the reads: their connections to the hub are shared.
  TF_ASSIGN_OR_RETURN(const OpenOptions with_source, WithObjectSource(options));
  Result<std::string> url = HubUrl(path, *with_source.source, RefCache(with_source));
  if (!url.ok()) return NotOnHub(cached, url.status());
  Result<std::shared_ptr<const Checkpoint>> remote = OpenUrl(*url, with_source);
  if (!remote.ok() && remote.status().code() == Code::kNotFound) {
    return NotOnHub(cached, remote.status());
  }
  return remote;
}

}  // namespace

std::string AnchoredPath(const std::string& path) {
  if (path.empty() || path.front() == '/' || IsObjectUrl(path) || IsHubPath(path)) return path;
  // "./", ".//", "././": what follows is relative ("./" + "/tmp/x" is not "/tmp/x").
  std::string_view rest = path;
  while (rest.size() > 2 && rest.substr(0, 2) == "./") {
    rest.remove_prefix(2);
    while (!rest.empty() && rest.front() == '/') rest.remove_prefix(1);
  }
  std::error_code ec;
  const fs::path cwd = fs::current_path(ec);
  if (ec) return path;  // no working directory to anchor to: as given
  return (cwd / fs::path(rest)).string();
}

namespace {

// Paths of a custom Env are its own names and stay as they are.
std::string Anchored(const std::string& path, const OpenOptions& options) {
  return options.env != nullptr ? path : AnchoredPath(path);
}

}  // namespace

Result<std::shared_ptr<const Checkpoint>> Checkpoint::Open(const std::string& given,
                                                           const OpenOptions& options) {
  TF_RETURN_IF_ERROR(CheckPathString(given, "checkpoint path"));
  const io::CancelScope cancel(options.cancel);  // the object store's requests on this thread
  if (IsObjectUrl(given)) return OpenUrl(given, options);
  if (IsHubPath(given)) return OpenHub(given, options);
  const std::string path = Anchored(given, options);
  CheckpointBuilder builder(options);
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (fs::is_directory(st)) return builder.FromDirectory(path);
  if (!fs::exists(st) && options.env == nullptr) {
    // "file:///x", "az://...", "ftp://...": a URL of a scheme not read here, rather than a
    // relative path that happens to be missing.
    const size_t colon = given.find("://");
    const std::string_view scheme = std::string_view(given).substr(0, colon);
    if (colon != std::string::npos && colon > 0 &&
        std::all_of(scheme.begin(), scheme.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '+' || c == '-' ||
                 c == '.';
        })) {
      return Status(
          Code::kInvalidArgument,
          given + ": not a URL tensorferry reads (s3://, gs://, http://, https:// or " + "hf://)" +
              (scheme == "file" ? ": give the local path without \"file://\"" : std::string()));
    }
  }
  if (fs::exists(st) || options.env != nullptr) {
    // A custom Env may hold files the real file system does not: decide by name, and let a
    // missing non-.json path stand for a directory holding an index.
    if (EndsWith(path, ".json")) return builder.FromIndex(path);
    if (options.env != nullptr && !fs::exists(st)) {
      auto probe = options.env->OpenRandomAccess(path);
      if (!probe.ok() && probe.status().code() == Code::kNotFound) {
        const std::string index_path = (fs::path(path) / kIndexFileName).string();
        if (options.env->OpenRandomAccess(index_path).ok()) return builder.FromIndex(index_path);
        return probe.status();
      }
    }
    std::vector<std::string> one{path};
    return builder.FromFiles(std::move(one));
  }
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
    return Status(Code::kIoError, path + ": cannot stat: " + ec.message());
  }
  return Status(Code::kNotFound, path + ": no such file or directory");
}

Result<std::shared_ptr<const Checkpoint>> Checkpoint::OpenFiles(std::span<const std::string> paths,
                                                                const OpenOptions& options) {
  const io::CancelScope cancel(options.cancel);
  // hf:// paths as their files in the hub cache; else, when one is not cached, every hf:// path
  // as its URL on the hub (a checkpoint's files come from one place).
  std::vector<std::string> resolved;
  Status not_cached;
  for (const std::string& path : paths) {
    TF_RETURN_IF_ERROR(CheckPathString(path, "checkpoint path"));
    if (!IsHubPath(path)) {
      resolved.push_back(Anchored(path, options));
      continue;
    }
    Result<std::string> local = ResolveHubPath(path);
    if (!local.ok() && local.status().code() != Code::kNotFound) return local.status();
    if (!local.ok() && not_cached.ok()) not_cached = local.status();
    resolved.push_back(local.ok() ? *local : path);
  }
  OpenOptions with_source = options;
  if (!not_cached.ok()) {
    if (HubOffline()) return NotOnHub(not_cached, Status());
    TF_ASSIGN_OR_RETURN(with_source, WithObjectSource(options));
    std::vector<std::string> hub_paths;
    for (const std::string& path : paths) {
      if (IsHubPath(path)) hub_paths.push_back(path);
    }
    Result<std::vector<std::string>> urls =
        HubUrls(hub_paths, *with_source.source, RefCache(with_source));
    if (!urls.ok()) return NotOnHub(not_cached, urls.status());
    size_t next = 0;
    for (size_t i = 0; i < paths.size(); ++i) {
      if (IsHubPath(paths[i])) resolved[i] = std::move((*urls)[next++]);
    }
  }
  size_t urls = 0;
  for (const std::string& path : resolved) urls += IsObjectUrl(path) ? 1 : 0;
  if (urls > 0 && urls < resolved.size()) {
    return Status(Code::kInvalidArgument,
                  "a checkpoint's files are all local or all URLs, not a mix of both");
  }
  if (urls > 0 && !with_source.source) {
    TF_ASSIGN_OR_RETURN(with_source, WithObjectSource(options));
  }
  CheckpointBuilder builder(with_source);
  return builder.FromFiles(std::move(resolved));
}

Result<std::shared_ptr<const SourceFile>> Checkpoint::File(uint32_t f) const {
  if (f >= files_.size()) {
    return Status(Code::kInvalidArgument, "file index " + std::to_string(f) + " out of range (" +
                                              std::to_string(files_.size()) + " files)");
  }
  TF_ASSIGN_OR_RETURN(io::FileSet::Pin pin, file_set_->Get(f));
  return std::move(pin.file);
}

Status Checkpoint::CheckUnchanged() const {
  return file_set_->CheckUnchanged();
}

const TensorInfo* Checkpoint::Find(std::string_view name) const noexcept {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [&](uint32_t i, std::string_view n) { return tensors_[i].name < n; });
  if (it == by_name_.end() || tensors_[*it].name != name) return nullptr;
  return &tensors_[*it];
}

}  // namespace tensorferry

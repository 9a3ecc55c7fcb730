// TorchCheckpoint: torch.save files (zip and legacy) and pytorch_model.bin.index.json, read with
// the restricted unpickler (pickle_vm.h); the object tree is flattened into dotted names.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "convert/pickle_vm.h"
#include "convert/py_repr.h"
#include "convert/zip_reader.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/convert.h"
#include "util/json_writer.h"
#include "util/macros.h"
#include "util/path.h"

namespace tensorferry {

namespace fs = std::filesystem;
using convert::Kind;
using convert::Object;
using convert::PickleResult;
using convert::Tag;
using convert::Value;

std::string_view TorchFormatName(TorchFormat format) noexcept {
  return format == TorchFormat::kZip ? "zip" : "legacy";
}

namespace {

// Where one storage's bytes are: an entry of the file's zip, or a byte offset of a legacy file.
struct StorageLocation {
  size_t zip_entry = 0;
  uint64_t offset = 0;
};

struct OpenFile {
  std::unique_ptr<RandomAccessFile> file;
  std::unique_ptr<convert::ZipReader> zip;  // null for legacy files
  bool big_endian = false;
};

// The magic number that starts a legacy file: 0x1950a86a20f9469cfc6c, little-endian.
constexpr std::array<uint8_t, 10> kLegacyMagic = {0x6c, 0xfc, 0x9c, 0x46, 0xf9,
                                                  0x20, 0x6a, 0xa8, 0x50, 0x19};
constexpr int64_t kLegacyProtocol = 1001;
// Text of all kept values together (the safetensors header holds them).
constexpr size_t kMaxTotalValueText = 16u << 20;

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\n')) ++i;
  return s.substr(i);
}

bool IsRowMajor(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& stride) {
  uint64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) return true;  // no elements: any layout is contiguous
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

}  // namespace

struct TorchCheckpoint::Impl {
  std::vector<TorchFileInfo> files;
  std::vector<TorchStorage> storages;
  std::vector<TorchTensor> tensors;
  std::vector<TorchValue> values;
  std::vector<uint32_t> by_name;  // tensor indices sorted by name
  std::string index_path;
  std::vector<std::pair<std::string, std::string>> index_metadata;

  std::vector<OpenFile> open_files;
  std::vector<StorageLocation> locations;  // parallel to storages

  // ReadTensor state: one storage span cached for strided or byte-swapped views.
  mutable std::mutex mu;
  mutable size_t span_tensor = SIZE_MAX;
  mutable uint64_t span_begin = 0;  // storage byte of span[0]
  mutable std::vector<std::byte> span;

  Status ReadStorage(uint32_t storage, uint64_t offset, std::span<std::byte> out) const;
  Status ReadStrided(size_t index, uint64_t offset, std::span<std::byte> out) const;
};

// --- opening
// ---------------------------------------------------------------------------------------

class TorchCheckpointOpener {
 public:
  TorchCheckpointOpener(TorchCheckpoint::Impl& impl, const TorchOpenOptions& options)
      : impl_(impl), options_(options), env_(options.env ? options.env : Env::Default()) {}

  Status OpenPath(const std::string& path) {
    if (options_.env == nullptr) {
      std::error_code ec;
      if (fs::is_directory(path, ec)) {
        const fs::path dir(path);
        if (fs::exists(dir / kTorchIndexFileName, ec)) {
          return OpenIndex((dir / kTorchIndexFileName).string());
        }
        if (fs::exists(dir / kTorchFileName, ec)) return OpenOne((dir / kTorchFileName).string());
        return Status(Code::kNotFound, path + ": directory has neither " +
                                           std::string(kTorchIndexFileName) + " nor " +
                                           std::string(kTorchFileName));
      }
    }
    if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) return OpenIndex(path);
    return OpenOne(path);
  }

  Status Finish() {
    impl_.by_name.resize(impl_.tensors.size());
    for (uint32_t i = 0; i < impl_.by_name.size(); ++i) impl_.by_name[i] = i;
    std::sort(impl_.by_name.begin(), impl_.by_name.end(), [&](uint32_t a, uint32_t b) {
      return impl_.tensors[a].name < impl_.tensors[b].name;
    });
    // Names are unique across tensors and values (and across shards).
    std::map<std::string_view, std::string_view> seen;  // name -> file
    auto check = [&](const std::string& name, uint32_t file, bool tensor) -> Status {
      auto [it, inserted] = seen.emplace(name, impl_.files[file].path);
      if (inserted) return Status::Ok();
      if (tensor && !impl_.index_path.empty() && it->second != impl_.files[file].path) {
        return Status(Code::kIndexDuplicateTensor,
                      impl_.index_path + ": tensor " + json::Quote(name) + " is in both " +
                          std::string(it->second) + " and " + impl_.files[file].path);
      }
      return Status(Code::kTorchNameConflict,
                    impl_.files[file].path + ": two entries are both named " + json::Quote(name) +
                        " once nested keys are joined with '.'");
    };
    for (const TorchTensor& t : impl_.tensors) {
      TF_RETURN_IF_ERROR(check(t.name, impl_.storages[t.storage].file, true));
    }
    for (size_t i = 0; i < impl_.values.size(); ++i) {
      TF_RETURN_IF_ERROR(check(impl_.values[i].name, value_file_[i], false));
    }
    return Status::Ok();
  }

 private:
  // --- sharded ---------------------------------------------------------------------------------
  Status OpenIndex(const std::string& index_path) {
    TF_ASSIGN_OR_RETURN(auto index_file, env_->OpenRandomAccess(index_path));
    TF_ASSIGN_OR_RETURN(const uint64_t size, index_file->Size());
    if (size > options_.limits.max_index_size) {
      return Status(Code::kIndexTooLarge, index_path + ": " + std::to_string(size) +
                                              " bytes, more than TorchLimits::max_index_size (" +
                                              std::to_string(options_.limits.max_index_size) + ")");
    }
    std::string text(static_cast<size_t>(size), '\0');
    TF_RETURN_IF_ERROR(ReadFully(
        *index_file, 0, std::as_writable_bytes(std::span<char>(text.data(), text.size()))));
    IndexLimits index_limits;
    index_limits.max_index_size = options_.limits.max_index_size;
    TF_ASSIGN_OR_RETURN(IndexDocument index, ParseIndexJson(text, index_path, index_limits));
    impl_.index_path = index_path;
    impl_.index_metadata = index.metadata;

    std::map<std::string, std::string> file_of_tensor;  // tensor -> normalized relative path
    for (const auto& [tensor, file] : index.weight_map) {
      file_of_tensor.emplace(tensor, fs::path(file).lexically_normal().string());
    }
    // The distinct files; the path rule of every index (util/path.h), hub-cache snapshots
    // included, on the real file system only.
    const bool on_disk = options_.env == nullptr;
    TF_ASSIGN_OR_RETURN(const std::vector<IndexedFile> indexed,
                        IndexedFiles(index.weight_map, index_path, on_disk));
    if (on_disk) {
      // Checked by name above; each file again once open (OpenOne), so that a symlink swapped
      // in between is not followed outside the directory.
      TF_ASSIGN_OR_RETURN(contain_dir_,
                          CanonicalDirectory(fs::path(index_path).parent_path(), index_path));
      contain_where_ = index_path;
    }
    std::map<std::string, uint32_t> file_number;  // relative path -> files index
    for (const IndexedFile& f : indexed) {
      const std::string& rel = f.rel;
      const std::string& tensor = f.tensor;
      const std::string& joined = f.path;
      std::error_code ec;
      if (on_disk && !fs::exists(joined, ec)) {
        return Status(Code::kIndexMissingFile, index_path + ": file " + json::Quote(rel) +
                                                   " (of tensor " + json::Quote(tensor) +
                                                   ") does not exist");
      }
      file_number[rel] = static_cast<uint32_t>(impl_.files.size());
      Status s = OpenOne(joined);
      if (s.code() == Code::kNotFound) {
        return Status(Code::kIndexMissingFile, index_path + ": file " + json::Quote(rel) +
                                                   " (of tensor " + json::Quote(tensor) +
                                                   "): " + s.message());
      }
      TF_RETURN_IF_ERROR(s);
    }
    // Every listed tensor is in its file; every tensor of the files is listed there.
    std::map<std::string_view, uint32_t> tensor_file;
    for (const TorchTensor& t : impl_.tensors) {
      tensor_file.emplace(t.name, impl_.storages[t.storage].file);
    }
    for (const auto& [tensor, rel] : file_of_tensor) {
      auto it = tensor_file.find(tensor);
      if (it == tensor_file.end() || it->second != file_number[rel]) {
        return Status(Code::kIndexMissingTensor, index_path + ": tensor " + json::Quote(tensor) +
                                                     " is listed in " + json::Quote(rel) +
                                                     " but that file does not hold it");
      }
    }
    for (const TorchTensor& t : impl_.tensors) {
      if (!file_of_tensor.contains(t.name)) {
        return Status(Code::kIndexUnlistedTensor, impl_.files[impl_.storages[t.storage].file].path +
                                                      ": tensor " + json::Quote(t.name) +
                                                      " is not listed in " + index_path);
      }
    }
    return Status::Ok();
  }

  // --- one file ----------------------------------------------------------------------------------
  Status OpenOne(const std::string& path) {
    TF_ASSIGN_OR_RETURN(auto file, env_->OpenRandomAccess(path));
    if (!contain_where_.empty()) {
      TF_RETURN_IF_ERROR(
          CheckOpenedContained(contain_dir_, path, file->native_handle(), contain_where_,
                               "file " + json::Quote(fs::path(path).filename().string())));
    }
    TF_ASSIGN_OR_RETURN(const uint64_t size, file->Size());
    std::array<std::byte, 512> head{};
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size, head.size()));
    TF_RETURN_IF_ERROR(ReadFully(*file, 0, std::span<std::byte>(head.data(), n)));
    auto at = [&](size_t i) { return static_cast<uint8_t>(head[i]); };

    TorchFileInfo info;
    info.path = path;
    info.file_size = size;
    const auto file_index = static_cast<uint32_t>(impl_.files.size());
    OpenFile open;
    open.file = std::move(file);
    if (n >= 4 && at(0) == 'P' && at(1) == 'K' && at(2) == 3 && at(3) == 4) {
      info.format = TorchFormat::kZip;
      TF_RETURN_IF_ERROR(OpenZip(open, info, file_index));
    } else if (n >= 2 && at(0) == 0x80) {
      info.format = TorchFormat::kLegacy;
      TF_RETURN_IF_ERROR(OpenLegacy(open, info, file_index));
    } else if (n >= 262 && std::memcmp(head.data() + 257, "ustar", 5) == 0) {
      return Status(Code::kUnsupported,
                    path +
                        ": a tar-based checkpoint (torch.save before 0.4); load and save it "
                        "again with a recent torch");
    } else if (n >= 4 && at(0) == 'P' && at(1) == 'K') {
      return Status(Code::kZipInvalid, path +
                                           ": a zip archive that does not start with a file "
                                           "entry: not written by torch.save");
    } else {
      return Status(Code::kTorchBadArchive,
                    path + ": not a torch checkpoint: neither a zip archive nor a pickle");
    }
    impl_.files.push_back(std::move(info));
    impl_.open_files.push_back(std::move(open));
    return Status::Ok();
  }

  Status OpenZip(OpenFile& open, TorchFileInfo& info, uint32_t file_index) {
    const std::string& path = info.path;
    TF_ASSIGN_OR_RETURN(open.zip,
                        convert::ZipReader::Open(*open.file, options_.limits.max_zip_entries));
    convert::ZipReader& zip = *open.zip;
    TF_ASSIGN_OR_RETURN(const ZipEntryRef pkl, FindDataPkl(zip, path));
    info.archive = pkl.name.substr(0, pkl.name.size() - 9);
    const std::string prefix = info.archive + "/";
    TF_RETURN_IF_ERROR(ReadByteorder(zip, prefix, info));
    open.big_endian = info.big_endian;
    TF_RETURN_IF_ERROR(ReadVersion(zip, prefix, info));
    const std::string source = path + ": " + pkl.name;
    TF_ASSIGN_OR_RETURN(PickleResult result, RunZipPickle(zip, pkl, source, info));
    const uint32_t first_storage = static_cast<uint32_t>(impl_.storages.size());
    TF_RETURN_IF_ERROR(AddZipStorages(zip, result, prefix, path, file_index));
    return Flatten(result, info, file_index, first_storage);
  }

  struct ZipEntryRef {
    size_t index;
    std::string name;
  };

  // The one "<archive>/data.pkl" entry of the zip; an error if there is none or several.
  Result<ZipEntryRef> FindDataPkl(convert::ZipReader& zip, const std::string& path) {
    std::vector<size_t> candidates;
    for (size_t i = 0; i < zip.entries().size(); ++i) {
      const std::string& name = zip.entries()[i].name;
      const size_t slash = name.find('/');
      if (slash != std::string::npos && slash > 0 && name.size() == slash + 9 &&
          name.compare(slash, 9, "/data.pkl") == 0) {
        candidates.push_back(i);
      }
    }
    if (candidates.empty()) {
      return Status(Code::kTorchBadArchive,
                    path + ": no \"<archive>/data.pkl\" entry: not written by torch.save");
    }
    if (candidates.size() > 1) {
      return Status(Code::kTorchBadArchive,
                    path + ": several \"<archive>/data.pkl\" entries (" +
                        json::Quote(zip.entries()[candidates[0]].name) + ", " +
                        json::Quote(zip.entries()[candidates[1]].name) + ")");
    }
    return ZipEntryRef{candidates[0], zip.entries()[candidates[0]].name};
  }

  // Sets info.big_endian from the optional "<archive>/byteorder" entry ("little" or "big").
  Status ReadByteorder(convert::ZipReader& zip, const std::string& prefix, TorchFileInfo& info) {
    const std::string& path = info.path;
    if (auto bo = zip.Find(prefix + "byteorder")) {
      TF_ASSIGN_OR_RETURN(std::string text, zip.ReadAll(*bo, 64));
      text = Trim(std::move(text));
      if (text == "big") {
        info.big_endian = true;
      } else if (text != "little") {
        return Status(Code::kTorchBadArchive,
                      path + ": entry " + json::Quote(prefix + "byteorder") + " holds " +
                          json::Quote(text) + ", not \"little\" or \"big\"");
      }
    }
    return Status::Ok();
  }

  // Sets info.version from the optional "version" (or ".data/version") entry, a decimal number.
  Status ReadVersion(convert::ZipReader& zip, const std::string& prefix, TorchFileInfo& info) {
    const std::string& path = info.path;
    auto version = zip.Find(prefix + "version");
    if (!version) version = zip.Find(prefix + ".data/version");
    if (version) {
      TF_ASSIGN_OR_RETURN(std::string text, zip.ReadAll(*version, 64));
      text = Trim(std::move(text));
      if (text.empty() ||
          !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        return Status(Code::kTorchBadArchive,
                      path + ": entry " + json::Quote(zip.entries()[*version].name) + " holds " +
                          json::Quote(text) + ", not a version number");
      }
      info.version = text;
    }
    return Status::Ok();
  }

  // Reads data.pkl (within max_pickle_size), runs it, and rejects bytes after STOP.
  Result<PickleResult> RunZipPickle(convert::ZipReader& zip, const ZipEntryRef& pkl,
                                    const std::string& source, TorchFileInfo& info) {
    const uint64_t pkl_size = zip.entries()[pkl.index].size;
    if (pkl_size > options_.limits.pickle.max_pickle_size) {
      return Status(Code::kPickleLimitExceeded,
                    source + ": " + std::to_string(pkl_size) +
                        " bytes, more than PickleLimits::max_pickle_size (" +
                        std::to_string(options_.limits.pickle.max_pickle_size) + ")");
    }
    TF_ASSIGN_OR_RETURN(const std::string pickle, zip.ReadAll(pkl.index, pkl_size));
    info.pickle_size = pickle.size();
    TF_ASSIGN_OR_RETURN(
        PickleResult result,
        convert::RunPickle(std::as_bytes(std::span<const char>(pickle.data(), pickle.size())),
                           options_.limits.pickle, convert::PersistentIds::kZip, source));
    if (result.end != pickle.size()) {
      return Status(Code::kPickleMalformed,
                    source + ": " + std::to_string(pickle.size() - result.end) +
                        " bytes after STOP at pickle offset " + std::to_string(result.end));
    }
    return result;
  }

  // Matches each pickled storage to its "<archive>/data/<key>" entry (present, right size)
  // and adds it.
  Status AddZipStorages(convert::ZipReader& zip, const PickleResult& result,
                        const std::string& prefix, const std::string& path, uint32_t file_index) {
    for (const convert::StorageRecord& s : result.storages) {
      const std::string entry = prefix + "data/" + s.key;
      auto index = zip.Find(entry);
      if (!index) {
        return Status(Code::kTorchMissingStorage,
                      path + ": storage " + json::Quote(s.key) + " (pickle offset " +
                          std::to_string(s.pickle_offset) + ") has no entry " + json::Quote(entry));
      }
      if (zip.entries()[*index].size != s.nbytes) {
        return Status(
            Code::kTorchMissingStorage,
            path + ": entry " + json::Quote(entry) + " holds " +
                std::to_string(zip.entries()[*index].size) + " bytes but its storage (" +
                std::to_string(s.numel) + " x " +
                std::string(s.untyped || convert::TorchDtypes()[s.dtype].storage_name.empty()
                                ? "UntypedStorage"
                                : convert::TorchDtypes()[s.dtype].storage_name) +
                ") needs " + std::to_string(s.nbytes));
      }
      AddStorage(s, file_index);
      impl_.locations.push_back({*index, 0});
    }
    return Status::Ok();
  }

  void AddStorage(const convert::StorageRecord& s, uint32_t file_index) {
    TorchStorage st;
    st.key = s.key;
    const auto& d = convert::TorchDtypes()[s.dtype];
    st.type = s.untyped ? "UntypedStorage" : std::string(d.storage_name);
    if (st.type.empty()) st.type = std::string(d.name);
    st.location = s.location;
    st.nbytes = s.nbytes;
    st.file = file_index;
    impl_.storages.push_back(std::move(st));
  }

  // Runs the five pickles of a legacy file over `buf` (a prefix of the file). Sets *end to the
  // offset after the storage-key list.
  Status ParseLegacy(std::span<const std::byte> buf, const std::string& path, PickleResult& main,
                     std::vector<std::string>& keys, uint64_t& end) {
    static constexpr std::array<std::string_view, 5> kWhat = {
        "magic number", "protocol version", "system info", "objects", "storage keys"};
    uint64_t pos = 0;
    PickleResult results[5];
    for (size_t i = 0; i < 5; ++i) {
      // Pickle offsets in messages are relative to the pickle's start, which is named.
      const std::string source = path + ": legacy pickle " + std::to_string(i + 1) + " (" +
                                 std::string(kWhat[i]) + ", at file offset " + std::to_string(pos) +
                                 ")";
      PickleLimits limits = options_.limits.pickle;
      limits.max_pickle_size = options_.limits.pickle.max_pickle_size -
                               std::min(pos, options_.limits.pickle.max_pickle_size);
      auto r = convert::RunPickle(
          buf.subspan(static_cast<size_t>(pos)), limits,
          i == 3 ? convert::PersistentIds::kLegacy : convert::PersistentIds::kNone, source);
      if (!r.ok()) return r.status();
      results[i] = std::move(r).value();
      pos += results[i].end;
      const PickleResult& x = results[i];
      if (i == 0) {
        const Object* magic = x.As(x.root, Kind::kBigInt);
        if (magic == nullptr || magic->str.size() != kLegacyMagic.size() ||
            std::memcmp(magic->str.data(), kLegacyMagic.data(), kLegacyMagic.size()) != 0) {
          return Status(Code::kTorchLegacyInvalid,
                        path +
                            ": starts with a pickle but not with torch's magic number: not a "
                            "torch.save file");
        }
      } else if (i == 1) {
        if (x.root.tag != Tag::kInt || x.root.i != kLegacyProtocol) {
          return Status(Code::kTorchLegacyInvalid, path + ": legacy protocol version is not " +
                                                       std::to_string(kLegacyProtocol));
        }
      } else if (i == 2) {
        const Object* d = x.As(x.root, Kind::kDict);
        if (d == nullptr) {
          return Status(Code::kTorchLegacyInvalid, path + ": legacy system info is not a dict");
        }
        bool little_endian = false;  // torch always writes it: a file without is not read
        for (size_t k = 0; k + 1 < d->items.size(); k += 2) {
          const Object* key = x.As(d->items[k], Kind::kStr);
          if (key != nullptr && key->str == "little_endian") {
            if (d->items[k + 1].tag != Tag::kBool || !d->items[k + 1].b) {
              return Status(Code::kTorchLegacyInvalid,
                            path +
                                ": saved on a big-endian machine in the legacy format; not "
                                "supported");
            }
            little_endian = true;
          }
        }
        if (!little_endian) {
          return Status(Code::kTorchLegacyInvalid,
                        path + ": the legacy system info does not say little_endian: True");
        }
      } else if (i == 4) {
        const Object* list = x.As(x.root, Kind::kList);
        if (list == nullptr) {
          return Status(Code::kTorchLegacyInvalid, path + ": legacy storage keys are not a list");
        }
        for (const Value& v : list->items) {
          const Object* k = x.As(v, Kind::kStr);
          if (k == nullptr) {
            return Status(Code::kTorchLegacyInvalid, path + ": a legacy storage key is not a str");
          }
          keys.push_back(k->str);
        }
      }
    }
    main = std::move(results[3]);
    end = pos;
    return Status::Ok();
  }

  Status OpenLegacy(OpenFile& open, TorchFileInfo& info, uint32_t file_index) {
    const std::string& path = info.path;
    const uint64_t size = info.file_size;
    const uint64_t cap = options_.limits.pickle.max_pickle_size;
    // The pickles' length is known only by running them: read a prefix, and a longer one when
    // they run past it.
    uint64_t want = std::min<uint64_t>(size, 1u << 20);
    PickleResult main;
    std::vector<std::string> keys;
    uint64_t end = 0;
    while (true) {
      std::vector<std::byte> buf(static_cast<size_t>(want));
      TF_RETURN_IF_ERROR(ReadFully(*open.file, 0, buf));
      keys.clear();
      Status s = ParseLegacy(buf, path, main, keys, end);
      if (s.ok()) break;
      if (s.code() == Code::kPickleTruncated && want < size && want <= cap) {
        want = std::min<uint64_t>({size, want * 4, cap + 1});
        continue;
      }
      return s;
    }
    info.pickle_size = end;
    info.version = std::to_string(kLegacyProtocol);

    // Storage records follow in key order: an 8-byte little-endian element count, then bytes.
    std::map<std::string_view, size_t> by_key;
    for (size_t i = 0; i < main.storages.size(); ++i) by_key.emplace(main.storages[i].key, i);
    std::vector<uint64_t> offset_of(main.storages.size(), UINT64_MAX);
    uint64_t pos = end;
    for (const std::string& key : keys) {
      auto it = by_key.find(key);
      if (it == by_key.end()) {
        return Status(Code::kTorchLegacyInvalid, path + ": storage key " + json::Quote(key) +
                                                     " is listed but no tensor refers to it");
      }
      if (offset_of[it->second] != UINT64_MAX) {
        return Status(Code::kTorchLegacyInvalid,
                      path + ": storage key " + json::Quote(key) + " is listed twice");
      }
      const convert::StorageRecord& s = main.storages[it->second];
      std::array<std::byte, 8> count_bytes{};
      if (size - std::min(pos, size) < 8) {
        return Status(Code::kTorchMissingStorage, path + ": storage " + json::Quote(key) +
                                                      ": the file ends at " + std::to_string(size) +
                                                      " before its record at offset " +
                                                      std::to_string(pos));
      }
      TF_RETURN_IF_ERROR(ReadFully(*open.file, pos, count_bytes));
      uint64_t count = 0;
      for (int b = 0; b < 8; ++b) count |= static_cast<uint64_t>(count_bytes[b]) << (8 * b);
      if (count != s.numel) {
        return Status(Code::kTorchLegacyInvalid,
                      path + ": storage " + json::Quote(key) + " at offset " + std::to_string(pos) +
                          " records " + std::to_string(count) + " elements but the pickle says " +
                          std::to_string(s.numel));
      }
      pos += 8;
      if (size - pos < s.nbytes) {
        return Status(Code::kTorchMissingStorage,
                      path + ": storage " + json::Quote(key) + " needs " +
                          std::to_string(s.nbytes) + " bytes at offset " + std::to_string(pos) +
                          " but the file ends at " + std::to_string(size));
      }
      offset_of[it->second] = pos;
      pos += s.nbytes;
    }
    const uint32_t first_storage = static_cast<uint32_t>(impl_.storages.size());
    for (size_t i = 0; i < main.storages.size(); ++i) {
      if (offset_of[i] == UINT64_MAX) {
        return Status(Code::kTorchMissingStorage, path + ": storage " +
                                                      json::Quote(main.storages[i].key) +
                                                      " is not in the legacy storage list");
      }
      AddStorage(main.storages[i], file_index);
      impl_.locations.push_back({0, offset_of[i]});
    }
    return Flatten(main, info, file_index, first_storage);
  }

  // --- flattening ----------------------------------------------------------------------------
  Status Flatten(const PickleResult& r, const TorchFileInfo& info, uint32_t file_index,
                 uint32_t first_storage) {
    const Object* root_dict = r.As(r.root, Kind::kDict);
    const Object* root_seq = r.As(r.root, Kind::kList);
    if (root_seq == nullptr) root_seq = r.As(r.root, Kind::kTuple);
    if (root_dict == nullptr && root_seq == nullptr) {
      return Status(Code::kTorchNotStateDict,
                    info.path + ": the checkpoint holds a " + convert::PyTypeName(r, r.root) +
                        ", not a dict of tensors (a state dict); nothing to name its tensors by");
    }
    const TorchLimits& limits = options_.limits;
    uint64_t budget;
    if (__builtin_mul_overflow(limits.flatten_per_pickle_byte, info.pickle_size, &budget) ||
        __builtin_add_overflow(budget, limits.flatten_base, &budget)) {
      budget = UINT64_MAX;
    }
    Walker w{*this,
             r,
             info,
             file_index,
             first_storage,
             std::vector<uint8_t>(r.objects.size(), 0),
             convert::HoldersOfTensorsOrDicts(r),
             budget,
             0,
             {}};
    return w.Walk(r.root, "", 0);
  }

  struct Walker {
    TorchCheckpointOpener& o;
    const PickleResult& r;
    const TorchFileInfo& info;
    uint32_t file_index;
    uint32_t first_storage;
    std::vector<uint8_t> on_path;
    std::vector<uint8_t> holds;  // HoldersOfTensorsOrDicts
    uint64_t budget;             // TorchLimits::flatten_base + flatten_per_pickle_byte x size
    uint64_t cost = 0;           // charged so far: name length + 64 per visit
    // The decimal text of each big integer used as a key, made once per object (a key fetched
    // from the memo thousands of times is one object).
    std::unordered_map<uint32_t, std::string> big_keys;

    // The name a dict key gives its value (PyKeyText), nullopt when it has none.
    std::optional<std::string> KeyText(const Value& key) {
      if (key.tag == Tag::kRef && r.objects[key.ref].kind == Kind::kBigInt) {
        auto [it, added] = big_keys.try_emplace(key.ref);
        if (added) it->second = convert::BigIntToDecimal(r.objects[key.ref].str);
        return it->second;
      }
      return convert::PyKeyText(r, key);
    }

    // What Python compares dict keys by: 1, True, 1.0 and a big integer of value 1 are one key,
    // 0.0 and -0.0 too; strings by content. nullopt for keys never merged here (NaN, tuples...).
    std::optional<std::string> KeyIdentity(const Value& key) {
      const auto tagged = [](char kind, std::string_view text) {
        std::string out(1, kind);
        out += text;
        return out;
      };
      switch (key.tag) {
        case Tag::kNone: return std::string("none");
        case Tag::kBool: return std::string(key.b ? "n1" : "n0");
        case Tag::kInt: return tagged('n', std::to_string(key.i));
        case Tag::kFloat: {
          const double f = key.f;
          if (std::isnan(f)) return std::nullopt;  // NaN equals nothing, itself included
          if (f == 0) return std::string("n0");
          if (std::isinf(f) || f != std::trunc(f)) return tagged('f', convert::PythonFloatRepr(f));
          char exact[400];  // an integral double's exact decimal value (glibc prints it exactly)
          std::snprintf(exact, sizeof exact, "%.0f", f);
          return tagged('n', exact);
        }
        case Tag::kRef: break;
      }
      const Object& obj = r.objects[key.ref];
      if (obj.kind == Kind::kStr) return tagged('s', obj.str);
      if (obj.kind == Kind::kBigInt) return tagged('n', *KeyText(key));
      return std::nullopt;
    }

    static std::string Join(const std::string& prefix, std::string_view key) {
      if (prefix.empty()) return std::string(key);
      std::string s = prefix;
      s += '.';
      s += key;
      return s;
    }

    Status Walk(const Value& v, const std::string& name, uint32_t depth) {
      TF_RETURN_IF_ERROR(Charge(name));
      if (depth > o.options_.limits.max_depth) {
        return Status(Code::kPickleLimitExceeded,
                      info.path + ": " + json::Quote(name) +
                          " is nested deeper than TorchLimits::max_depth (" +
                          std::to_string(o.options_.limits.max_depth) + ")");
      }
      return WalkCharged(v, name, depth);
    }

    // Counts one name that flattening makes (a value walked, or an entry recorded for an item
    // whose key has no name) against TorchLimits::max_entries and the names' byte budget.
    Status Charge(const std::string& name) {
      // Shared sub-dicts are walked once per name that reaches them, which a crafted DAG could
      // make exponential: every visit counts.
      if (++o.visits_ > o.options_.limits.max_entries) {
        return Status(Code::kPickleLimitExceeded,
                      info.path + ": more than TorchLimits::max_entries (" +
                          std::to_string(o.options_.limits.max_entries) +
                          ") names and containers to flatten, at " + json::Quote(name));
      }
      // The names are what flattening holds in memory: a shared container multiplies them, so
      // they are bounded by the pickle's size, not only counted.
      cost += name.size() + 64;
      if (cost > budget) {
        return Status(Code::kPickleLimitExceeded,
                      info.path + ": flattening the " + std::to_string(info.pickle_size) +
                          "-byte pickle makes more than " + std::to_string(budget) +
                          " bytes of names (TorchLimits::flatten_base + flatten_per_pickle_byte x "
                          "the pickle's size; a container shared under many names?), at " +
                          json::Quote(name.substr(0, 200)));
      }
      return Status::Ok();
    }

    Status WalkCharged(const Value& v, const std::string& name, uint32_t depth) {
      if (v.tag == Tag::kRef) {
        const Object& obj = r.objects[v.ref];
        if (obj.kind == Kind::kTensor) return AddTensor(obj, name);
        const bool dict = obj.kind == Kind::kDict;
        const bool seq = obj.kind == Kind::kList || obj.kind == Kind::kTuple;
        if ((dict && !obj.items.empty()) || (seq && holds[v.ref])) {
          if (on_path[v.ref]) {
            o.AddValue(name, convert::PyTypeName(r, v), "", "it contains itself", file_index);
            return Status::Ok();
          }
          on_path[v.ref] = 1;
          if (dict) {
            // Keys that compare equal are one key in Python: the first one given, holding the
            // last value given (torch.load's dict). value_of[i]: the item whose value key i
            // holds; items whose key came earlier are skipped.
            std::unordered_map<std::string, size_t> first;
            std::vector<size_t> value_of(obj.items.size(), 0);
            for (size_t i = 0; i + 1 < obj.items.size(); i += 2) {
              value_of[i] = i + 1;
              if (auto id = KeyIdentity(obj.items[i])) {
                // Each key's text is held and hashed: charged as a name is, so that one long
                // key given as every key of a dict costs the budget, not time squared.
                cost += id->size();
                if (cost > budget) {
                  return Status(Code::kPickleLimitExceeded,
                                info.path + ": flattening the " + std::to_string(info.pickle_size) +
                                    "-byte pickle makes more "
                                    "than " +
                                    std::to_string(budget) +
                                    " bytes of names and keys (TorchLimits::flatten_base + "
                                    "flatten_per_pickle_byte x the pickle's size), at the keys "
                                    "of " +
                                    json::Quote(name.substr(0, 200)));
                }
                auto [it, added] = first.try_emplace(*std::move(id), i);
                if (!added) {
                  value_of[it->second] = i + 1;
                  value_of[i] = 0;
                }
              }
            }
            for (size_t i = 0; i + 1 < obj.items.size(); i += 2) {
              if (value_of[i] == 0) continue;
              auto key = KeyText(obj.items[i]);
              if (!key) {
                const std::string key_type = convert::PyTypeName(r, obj.items[i]);
                std::string label = "<";
                label += key_type;
                label += " key>";
                std::string why = "its key is a ";
                why += key_type;
                why += ", which has no name";
                // An entry made per visit, as a walked value is: charged the same (a dict of
                // such items shared under many names would make entries without bound).
                std::string entry = Join(name, label);
                TF_RETURN_IF_ERROR(Charge(entry));
                o.AddValue(std::move(entry), convert::PyTypeName(r, obj.items[value_of[i]]), "",
                           std::move(why), file_index);
                continue;
              }
              TF_RETURN_IF_ERROR(Walk(obj.items[value_of[i]], Join(name, *key), depth + 1));
            }
          } else {
            for (size_t i = 0; i < obj.items.size(); ++i) {
              TF_RETURN_IF_ERROR(Walk(obj.items[i], Join(name, std::to_string(i)), depth + 1));
            }
          }
          on_path[v.ref] = 0;
          return Status::Ok();
        }
      }
      std::string note;
      std::optional<std::string> text;
      if (o.text_left_ == 0) {
        note = "the checkpoint's values exceed " + std::to_string(kMaxTotalValueText) +
               " bytes of text in all";
      } else {
        // Failed attempts are charged too: they did the work.
        size_t produced = 0;
        text = convert::PyStr(r, v, o.options_.limits.max_depth, note,
                              std::min(convert::kMaxValueText, o.text_left_), &produced);
        o.text_left_ -= std::min(o.text_left_, produced + name.size());
      }
      o.AddValue(name, convert::PyTypeName(r, v), text ? *text : "", text ? "" : note, file_index);
      return Status::Ok();
    }

    Status AddTensor(const Object& obj, const std::string& name) {
      const convert::TensorRecord& tr = r.tensors[obj.index];
      const convert::TorchDtypeInfo& d = convert::TorchDtypes()[tr.dtype];
      if (!d.dtype) {
        return Status(Code::kTorchUnsupportedDtype,
                      info.path + ": tensor " + json::Quote(name) + " (pickle offset " +
                          std::to_string(tr.pickle_offset) + ") is torch." + std::string(d.name) +
                          ", which safetensors cannot store");
      }
      TorchTensor t;
      t.name = name;
      t.dtype = *d.dtype;
      t.torch_dtype = std::string(d.name);
      t.shape = tr.shape;
      t.stride = tr.stride;
      t.storage_offset = tr.offset;
      t.storage = first_storage + tr.storage;
      t.parameter = tr.parameter;
      t.contiguous = IsRowMajor(t.shape, t.stride);
      auto bytes = TensorByteSize(t.dtype, t.shape);
      if (!bytes.ok()) {
        return Status(Code::kTorchBadTensor, info.path + ": tensor " + json::Quote(name) + ": " +
                                                 bytes.status().message());
      }
      t.byte_size = *bytes;
      o.impl_.tensors.push_back(std::move(t));
      return Status::Ok();
    }
  };

  void AddValue(const std::string& name, std::string type, std::string text, std::string note,
                uint32_t file_index) {
    TorchValue v;
    v.name = name;
    v.type = std::move(type);
    v.representable = note.empty();
    v.text = std::move(text);
    v.note = std::move(note);
    impl_.values.push_back(std::move(v));
    value_file_.push_back(file_index);
  }

  TorchCheckpoint::Impl& impl_;
  const TorchOpenOptions& options_;
  Env* env_;
  std::vector<uint32_t> value_file_;
  uint64_t visits_ = 0;
  size_t text_left_ = kMaxTotalValueText;
  // An index's directory on the real file system, which its files must stay inside (util/path.h);
  // contain_where_ (the index, for messages) is empty when files are not checked.
  fs::path contain_dir_;
  std::string contain_where_;
};

Result<std::unique_ptr<TorchCheckpoint>> TorchCheckpoint::Open(const std::string& path,
                                                               const TorchOpenOptions& options) {
  auto impl = std::make_unique<Impl>();
  TorchCheckpointOpener opener(*impl, options);
  TF_RETURN_IF_ERROR(opener.OpenPath(path));
  TF_RETURN_IF_ERROR(opener.Finish());
  return std::unique_ptr<TorchCheckpoint>(new TorchCheckpoint(std::move(impl)));
}

TorchCheckpoint::TorchCheckpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TorchCheckpoint::~TorchCheckpoint() = default;

const std::vector<TorchFileInfo>& TorchCheckpoint::files() const noexcept {
  return impl_->files;
}
const std::vector<TorchStorage>& TorchCheckpoint::storages() const noexcept {
  return impl_->storages;
}
const std::vector<TorchTensor>& TorchCheckpoint::tensors() const noexcept {
  return impl_->tensors;
}
const std::vector<TorchValue>& TorchCheckpoint::values() const noexcept {
  return impl_->values;
}
const std::string& TorchCheckpoint::index_path() const noexcept {
  return impl_->index_path;
}
const std::vector<std::pair<std::string, std::string>>& TorchCheckpoint::index_metadata()
    const noexcept {
  return impl_->index_metadata;
}

const TorchTensor* TorchCheckpoint::Find(std::string_view name) const noexcept {
  auto it =
      std::lower_bound(impl_->by_name.begin(), impl_->by_name.end(), name,
                       [&](uint32_t i, std::string_view n) { return impl_->tensors[i].name < n; });
  if (it == impl_->by_name.end() || impl_->tensors[*it].name != name) return nullptr;
  return &impl_->tensors[*it];
}

// --- reading
// ---------------------------------------------------------------------------------------

Status TorchCheckpoint::Impl::ReadStorage(uint32_t storage, uint64_t offset,
                                          std::span<std::byte> out) const {
  const TorchStorage& s = storages[storage];
  const OpenFile& f = open_files[s.file];
  if (f.zip) return f.zip->ReadAt(locations[storage].zip_entry, offset, out);
  return ReadFully(*f.file, locations[storage].offset + offset, out);
}

// Gathers a strided (or byte-swapped) view. A view whose storage span is at most twice its bytes
// plus kDenseSlack (transposes, permutes, every other column) is gathered from a copy of that
// span held while the tensor is written; a sparser one (a diagonal, or two elements at the ends
// of a huge storage) element by element through a window of at most kSparseWindow bytes, so
// memory never follows the span.
Status TorchCheckpoint::Impl::ReadStrided(size_t index, uint64_t offset,
                                          std::span<std::byte> out) const {
  constexpr uint64_t kDenseSlack = uint64_t{64} << 20;
  constexpr uint64_t kSparseWindow = uint64_t{64} << 10;
  const TorchTensor& t = tensors[index];
  const uint64_t elem = DTypeBits(t.dtype) / 8;
  const size_t rank = t.shape.size();
  // Byte range of the storage the view touches: [begin, last element + 1).
  uint64_t last = t.storage_offset;
  for (size_t i = 0; i < rank; ++i) last += (t.shape[i] - 1) * t.stride[i];
  const uint64_t begin = t.storage_offset * elem;
  const uint64_t end = (last + 1) * elem;
  const bool dense = end - begin <= 2 * t.byte_size + kDenseSlack;
  if (!dense && span_tensor != index) {
    // Element by element, a compressed entry is inflated again from its start whenever the walk
    // moves backwards: refused unless the walk only moves forwards (strides in row-major order).
    const OpenFile& f = open_files[storages[t.storage].file];
    const StorageLocation& loc = locations[t.storage];
    if (f.zip && f.zip->entries()[loc.zip_entry].method != 0) {
      uint64_t after = 1;  // elements spanned by the dimensions after i
      for (size_t i = rank; i-- > 0;) {
        if (t.shape[i] == 1) continue;
        if (t.stride[i] < after) {
          return Status(Code::kTorchBadTensor,
                        files[storages[t.storage].file].path + ": tensor " + json::Quote(t.name) +
                            ": a sparse view (" + std::to_string(t.byte_size) + " bytes over " +
                            std::to_string(end - begin) +
                            " bytes of its storage) whose elements are not in storage order, "
                            "of a compressed zip entry; save the checkpoint uncompressed "
                            "(torch.save does) or save a contiguous copy of the tensor");
        }
        after += (t.shape[i] - 1) * t.stride[i];
      }
    }
    span_tensor = index;  // the window: [span_begin, + span.size())
    span_begin = begin;
    span.clear();
    span.shrink_to_fit();
  }
  if (dense && span_tensor != index) {
    span_tensor = SIZE_MAX;
    span.clear();
    span.shrink_to_fit();
    span.resize(static_cast<size_t>(end - begin));
    TF_RETURN_IF_ERROR(ReadStorage(t.storage, begin, span));
    span_begin = begin;
    span_tensor = index;
  }
  // The bytes of the element at storage byte `pos`, in the span or in a refilled window.
  auto element = [&](uint64_t pos) -> Result<const std::byte*> {
    if (pos < span_begin || pos + elem > span_begin + span.size()) {
      span.resize(static_cast<size_t>(std::min(kSparseWindow, end - pos)));
      span_begin = pos;
      if (Status s = ReadStorage(t.storage, pos, span); !s.ok()) {
        span_tensor = SIZE_MAX;
        span.clear();
        return s;
      }
    }
    return span.data() + (pos - span_begin);
  };
  const bool swap = open_files[storages[t.storage].file].big_endian;
  const uint64_t unit = t.dtype == DType::kC64 ? 4 : elem;  // complex: two floats
  // Walk elements from the one holding `offset`, with a row-major multi-index.
  uint64_t e = offset / elem;
  uint64_t skip = offset % elem;
  std::vector<uint64_t> idx(rank, 0);
  {
    uint64_t rem = e;
    for (size_t i = rank; i-- > 0;) {
      idx[i] = rem % t.shape[i];
      rem /= t.shape[i];
    }
  }
  size_t done = 0;
  std::byte tmp[16];
  while (done < out.size()) {
    uint64_t pos = t.storage_offset;
    for (size_t i = 0; i < rank; ++i) pos += idx[i] * t.stride[i];
    TF_ASSIGN_OR_RETURN(const std::byte* src, element(pos * elem));
    std::memcpy(tmp, src, elem);
    if (swap) {
      for (uint64_t u = 0; u < elem; u += unit) std::reverse(tmp + u, tmp + u + unit);
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(elem - skip, out.size() - done));
    std::memcpy(out.data() + done, tmp + skip, n);
    done += n;
    skip = 0;
    for (size_t i = rank; i-- > 0;) {
      if (++idx[i] < t.shape[i]) break;
      idx[i] = 0;
    }
  }
  if (offset + out.size() == t.byte_size) {  // the last chunk: free the span
    span_tensor = SIZE_MAX;
    span.clear();
    span.shrink_to_fit();
  }
  return Status::Ok();
}

Status TorchCheckpoint::ReadTensor(size_t index, uint64_t offset, std::span<std::byte> out) const {
  if (index >= impl_->tensors.size()) {
    return Status(Code::kInvalidArgument,
                  "tensor index " + std::to_string(index) + " out of range");
  }
  const TorchTensor& t = impl_->tensors[index];
  if (offset > t.byte_size || out.size() > t.byte_size - offset) {
    return Status(Code::kInvalidArgument, "tensor " + json::Quote(t.name) + ": range [" +
                                              std::to_string(offset) + ", +" +
                                              std::to_string(out.size()) + ") outside its " +
                                              std::to_string(t.byte_size) + " bytes");
  }
  if (out.empty()) return Status::Ok();
  std::lock_guard<std::mutex> lock(impl_->mu);
  const bool swap =
      impl_->open_files[impl_->storages[t.storage].file].big_endian && DTypeBits(t.dtype) > 8;
  if (t.contiguous && !swap) {
    const uint64_t elem = DTypeBits(t.dtype) / 8;
    return impl_->ReadStorage(t.storage, t.storage_offset * elem + offset, out);
  }
  return impl_->ReadStrided(index, offset, out);
}

Status TorchCheckpoint::CheckStoragesRead() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& f : impl_->open_files) {
    if (f.zip) TF_RETURN_IF_ERROR(f.zip->CheckEntriesRead());
  }
  return Status::Ok();
}

Status TorchCheckpoint::CheckTensorRead(size_t index, const std::atomic<bool>* cancel) const {
  if (index >= impl_->tensors.size()) {
    return Status(Code::kInvalidArgument,
                  "tensor index " + std::to_string(index) + " out of range");
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  const uint32_t storage = impl_->tensors[index].storage;
  const OpenFile& f = impl_->open_files[impl_->storages[storage].file];
  if (!f.zip) return Status::Ok();
  return f.zip->CheckEntryRead(impl_->locations[storage].zip_entry, cancel);
}

}  // namespace tensorferry

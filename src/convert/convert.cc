// ConvertTorchCheckpoint and VerifyConversion: TorchCheckpoint in, writer.h out, tensor bytes
// streamed through TensorToWrite::generate (one chunk of the writer's buffer at a time).
#include "convert/convert.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/convert.h"
#include "tensorferry/integrity.h"
#include "tensorferry/writer.h"
#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry {

namespace fs = std::filesystem;

namespace convert {

namespace {

constexpr std::string_view kFormatKey = "format";

struct ViewKey {
  uint32_t storage;
  DType dtype;
  uint64_t offset;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> stride;
  auto operator<=>(const ViewKey&) const = default;
};

// [first byte, last byte + 1) of the storage a non-empty view touches.
std::pair<uint64_t, uint64_t> Extent(const TorchTensor& t) {
  const uint64_t elem = DTypeBits(t.dtype) / 8;
  uint64_t last = t.storage_offset;
  for (size_t i = 0; i < t.shape.size(); ++i) last += (t.shape[i] - 1) * t.stride[i];
  return {t.storage_offset * elem, (last + 1) * elem};
}

// Marks identical views of one storage as aliases of the smallest-named one; fills
// plan.aliases, plan.copied_views (for "format") and plan.write.
void PlanAliases(const TorchCheckpoint& checkpoint, ConversionPlan& plan) {
  const auto& tensors = checkpoint.tensors();
  // Group identical views; the smallest name is kept.
  std::map<ViewKey, std::vector<size_t>> groups;
  std::vector<bool> is_alias(tensors.size(), false);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TorchTensor& t = tensors[i];
    if (t.byte_size == 0 || checkpoint.storages()[t.storage].nbytes == 0) continue;
    groups[ViewKey{t.storage, t.dtype, t.storage_offset, t.shape, t.stride}].push_back(i);
  }
  for (auto& [key, members] : groups) {
    if (members.size() < 2) continue;
    const size_t kept = *std::min_element(members.begin(), members.end(), [&](size_t a, size_t b) {
      return tensors[a].name < tensors[b].name;
    });
    for (size_t m : members) {
      if (m == kept) continue;
      // An alias is a metadata entry: not under a key the output's metadata holds already.
      if (tensors[m].name == kFormatKey || tensors[m].name == kChecksumsMetadataKey) {
        plan.copied_views.emplace_back(
            tensors[m].name, "same view as " + json::Quote(tensors[kept].name) +
                                 ", but the metadata key " + json::Quote(tensors[m].name) +
                                 " is taken");
        continue;
      }
      is_alias[m] = true;
      plan.aliases.emplace_back(tensors[m].name, tensors[kept].name);
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!is_alias[i]) plan.write.push_back(i);
  }
}

// Adds to plan.copied_views the overlapping, non-identical views of one storage among the
// written tensors.
void PlanOverlaps(const TorchCheckpoint& checkpoint, ConversionPlan& plan) {
  const auto& tensors = checkpoint.tensors();
  std::map<uint32_t, std::vector<std::tuple<uint64_t, uint64_t, size_t>>> by_storage;
  for (size_t i : plan.write) {
    if (tensors[i].byte_size == 0) continue;
    auto [b, e] = Extent(tensors[i]);
    by_storage[tensors[i].storage].emplace_back(b, e, i);
  }
  std::map<std::string, std::string> overlaps;
  for (auto& [storage, views] : by_storage) {
    std::sort(views.begin(), views.end());
    size_t reach_owner = std::get<2>(views[0]);
    uint64_t reach = std::get<1>(views[0]);
    for (size_t k = 1; k < views.size(); ++k) {
      const auto [b, e, i] = views[k];
      if (b < reach) {
        overlaps.emplace(tensors[i].name, "overlaps " + json::Quote(tensors[reach_owner].name) +
                                              " in storage " +
                                              json::Quote(checkpoint.storages()[storage].key));
        overlaps.emplace(tensors[reach_owner].name,
                         "overlaps " + json::Quote(tensors[i].name) + " in storage " +
                             json::Quote(checkpoint.storages()[storage].key));
      }
      if (e > reach) {
        reach = e;
        reach_owner = i;
      }
    }
  }
  for (auto& [name, why] : overlaps) plan.copied_views.emplace_back(name, why);
}

// Fills plan.metadata ("format", aliases, kept values), plan.kept_values and plan.skipped.
void PlanMetadata(const TorchCheckpoint& checkpoint, bool keep_values, ConversionPlan& plan) {
  std::map<std::string, std::string> metadata;
  metadata.emplace(kFormatKey, "pt");
  for (const auto& [alias, kept] : plan.aliases) metadata.emplace(alias, kept);
  for (const TorchValue& v : checkpoint.values()) {
    if (!keep_values) {
      plan.skipped.emplace_back(v.name, "a " + v.type + " (values are not kept)");
    } else if (!v.representable) {
      plan.skipped.emplace_back(v.name, "a " + v.type + ": " + v.note);
    } else if (v.name == kFormatKey) {
      plan.skipped.emplace_back(v.name,
                                "a " + v.type + ": the metadata key \"format\" holds \"pt\"");
    } else if (v.name == kChecksumsMetadataKey) {
      plan.skipped.emplace_back(v.name, "a " + v.type + ": the metadata key \"" +
                                            std::string(kChecksumsMetadataKey) +
                                            "\" holds the output's checksums");
    } else {
      plan.kept_values.emplace_back(v.name, v.text);
      metadata.emplace(v.name, v.text);
    }
  }
  plan.metadata.assign(metadata.begin(), metadata.end());
}

}  // namespace

ConversionPlan PlanConversion(const TorchCheckpoint& checkpoint, bool keep_values) {
  ConversionPlan plan;
  PlanAliases(checkpoint, plan);
  PlanOverlaps(checkpoint, plan);
  std::sort(plan.copied_views.begin(), plan.copied_views.end());
  std::sort(plan.aliases.begin(), plan.aliases.end());
  PlanMetadata(checkpoint, keep_values, plan);
  return plan;
}

}  // namespace convert

namespace {

bool SameFile(const std::string& a, const std::string& b) {
  std::error_code ec;
  return fs::exists(a, ec) && fs::exists(b, ec) && fs::equivalent(a, b, ec);
}

std::string DimsText(const std::vector<uint64_t>& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

// The output is bounded by the input: at most twice the bytes of the storages the written tensors
// view, plus `expansion` (TorchLimits::max_view_expansion). A view with stride 0 or overlapping
// strides can otherwise describe terabytes over a few bytes of storage.
Status CheckOutputSize(const TorchCheckpoint& ckpt, const convert::ConversionPlan& plan,
                       uint64_t expansion) {
  const auto& tensors = ckpt.tensors();
  const auto& storages = ckpt.storages();
  std::vector<bool> counted(storages.size(), false);
  uint64_t storage_bytes = 0;
  for (size_t i : plan.write) {
    const uint32_t s = tensors[i].storage;
    if (!counted[s]) {
      counted[s] = true;
      storage_bytes += storages[s].nbytes;  // each within a file: no overflow
    }
  }
  uint64_t limit;
  if (__builtin_mul_overflow(storage_bytes, uint64_t{2}, &limit) ||
      __builtin_add_overflow(limit, expansion, &limit)) {
    return Status::Ok();
  }
  uint64_t total = 0;
  for (size_t i : plan.write) {
    const TorchTensor& t = tensors[i];
    if (!__builtin_add_overflow(total, t.byte_size, &total) && total <= limit) continue;
    const TorchStorage& st = storages[t.storage];
    return Status(Code::kTorchBadTensor,
                  ckpt.files()[st.file].path + ": tensor " + json::Quote(t.name) + " (" +
                      t.torch_dtype + ", shape " + DimsText(t.shape) + ", stride " +
                      DimsText(t.stride) + ", " + std::to_string(t.byte_size) +
                      " bytes) views storage " + json::Quote(st.key) + " of " +
                      std::to_string(st.nbytes) + " bytes; with it the output would exceed " +
                      std::to_string(limit) +
                      " bytes, twice the storages' bytes plus TorchLimits::max_view_expansion (" +
                      std::to_string(expansion) +
                      "): views that expand or overlap their storage this much are refused");
  }
  return Status::Ok();
}

// The path VerifyConversion opens for what ConvertTorchCheckpoint wrote at `dst`.
std::string OutputPath(const std::string& dst) {
  std::error_code ec;
  if (!fs::is_directory(dst, ec)) return dst;
  if (fs::exists(fs::path(dst) / kIndexFileName, ec)) return dst;
  return (fs::path(dst) / kSingleFileName).string();
}

// The report's fields known before writing: the source's bytes and what the plan decided.
ConvertReport StartReport(const TorchCheckpoint& ckpt, const convert::ConversionPlan& plan) {
  ConvertReport report;
  for (const TorchFileInfo& f : ckpt.files()) report.source_bytes += f.file_size;
  report.aliases = plan.aliases;
  report.copied_views = plan.copied_views;
  report.kept_values = plan.kept_values;
  report.skipped = plan.skipped;
  report.metadata = plan.metadata;
  return report;
}

// The tensors the plan writes, each streamed from `ckpt` (which must outlive them); counts them
// in `report` and their bytes per source file in `file_bytes`.
std::vector<TensorToWrite> TensorsToWrite(const TorchCheckpoint& ckpt,
                                          const convert::ConversionPlan& plan,
                                          ConvertReport& report,
                                          std::vector<uint64_t>& file_bytes) {
  const TorchCheckpoint* reader = &ckpt;
  std::vector<TensorToWrite> to_write;
  to_write.reserve(plan.write.size());
  for (size_t index : plan.write) {
    const TorchTensor& t = ckpt.tensors()[index];
    TensorToWrite w;
    w.name = t.name;
    w.dtype = t.dtype;
    w.shape = t.shape;
    w.generate = [reader, index](uint64_t offset, std::span<std::byte> out) {
      return reader->ReadTensor(index, offset, out);
    };
    to_write.push_back(std::move(w));
    report.tensors += 1;
    report.tensor_bytes += t.byte_size;
    file_bytes[ckpt.storages()[t.storage].file] += t.byte_size;
  }
  return to_write;
}

// Refuses a directory `dst` holding a file named like WriteSharded's output ("model*") that is
// one of the source files, before anything is written.
Status CheckNoSourceInDir(const TorchCheckpoint& ckpt, const std::string& dst) {
  std::error_code ec;
  if (!fs::is_directory(dst, ec)) return Status::Ok();
  for (const auto& entry : fs::directory_iterator(dst, ec)) {
    for (const TorchFileInfo& f : ckpt.files()) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("model") && SameFile(entry.path().string(), f.path)) {
        return Status(Code::kInvalidArgument, entry.path().string() +
                                                  ": writing the output here could replace the "
                                                  "source file " +
                                                  f.path);
      }
    }
  }
  return Status::Ok();
}

// Writes a sharded output into `dst` (shards no larger than the largest source file unless
// max_shard_size says otherwise); `outputs` gets the files written.
Status WriteShardedOutput(const TorchCheckpoint& ckpt, const std::string& dst,
                          std::span<const TensorToWrite> to_write,
                          const convert::ConversionPlan& plan, const ConvertOptions& options,
                          const std::vector<uint64_t>& file_bytes,
                          std::vector<std::string>& outputs) {
  ShardOptions shard;
  shard.max_shard_size = options.max_shard_size;
  if (shard.max_shard_size == 0) {
    shard.max_shard_size =
        std::max<uint64_t>(1, *std::max_element(file_bytes.begin(), file_bytes.end()));
  }
  shard.prefix = "model";
  shard.always_write_index = true;
  shard.write = options.write;
  // The names WriteSharded will use, checked against the source before anything is written.
  TF_RETURN_IF_ERROR(CheckNoSourceInDir(ckpt, dst));
  TF_ASSIGN_OR_RETURN(outputs, WriteSharded(dst, to_write, plan.metadata, shard));
  return Status::Ok();
}

// Writes one file: `dst`, or model.safetensors in it when it is a directory; `outputs` gets the
// files written.
Status WriteSingleOutput(const TorchCheckpoint& ckpt, const std::string& dst,
                         std::span<const TensorToWrite> to_write,
                         const convert::ConversionPlan& plan, const ConvertOptions& options,
                         std::vector<std::string>& outputs) {
  std::error_code ec;
  const bool into_dir = fs::is_directory(dst, ec);
  const std::string path = into_dir ? (fs::path(dst) / kSingleFileName).string() : dst;
  for (const TorchFileInfo& f : ckpt.files()) {
    if (SameFile(path, f.path)) {
      return Status(Code::kInvalidArgument,
                    path + ": the output would replace the source file " + f.path);
    }
  }
  // Into a directory, an older sharded checkpoint there is replaced (its shards removed): none of
  // them may be the source, as for a sharded output.
  if (into_dir) TF_RETURN_IF_ERROR(CheckNoSourceInDir(ckpt, dst));
  if (into_dir) {
    // One file, but through WriteSharded so that an older sharded checkpoint in the directory
    // (whose index would shadow the new file) is replaced all or nothing.
    ShardOptions single;
    single.max_shard_size = UINT64_MAX;
    single.prefix = "model";
    single.always_write_index = false;
    single.write = options.write;
    TF_ASSIGN_OR_RETURN(outputs, WriteSharded(dst, to_write, plan.metadata, single));
  } else {
    TF_RETURN_IF_ERROR(WriteFile(path, to_write, plan.metadata, options.write));
    outputs.push_back(path);
  }
  return Status::Ok();
}

}  // namespace

Result<ConvertReport> ConvertTorchCheckpoint(const std::string& src, const std::string& dst,
                                             const ConvertOptions& options) {
  TF_ASSIGN_OR_RETURN(std::unique_ptr<TorchCheckpoint> ckpt,
                      TorchCheckpoint::Open(src, options.open));
  const convert::ConversionPlan plan = convert::PlanConversion(*ckpt, options.keep_values);
  ConvertReport report = StartReport(*ckpt, plan);
  TF_RETURN_IF_ERROR(CheckOutputSize(*ckpt, plan, options.open.limits.max_view_expansion));

  std::vector<uint64_t> file_bytes(ckpt->files().size(), 0);
  const std::vector<TensorToWrite> to_write = TensorsToWrite(*ckpt, plan, report, file_bytes);
  report.sharded = options.max_shard_size > 0 || !ckpt->index_path().empty();
  // Nothing is put in place before every storage read was checked against its CRC-32 (a tensor
  // viewing part of its storage reads no whole entry), besides what the caller checks.
  ConvertOptions checked = options;
  checked.write.before_commit = [&ckpt, &options]() -> Status {
    TF_RETURN_IF_ERROR(ckpt->CheckStoragesRead());
    return options.write.before_commit ? options.write.before_commit() : Status::Ok();
  };
  if (report.sharded) {
    TF_RETURN_IF_ERROR(
        WriteShardedOutput(*ckpt, dst, to_write, plan, checked, file_bytes, report.outputs));
  } else {
    TF_RETURN_IF_ERROR(WriteSingleOutput(*ckpt, dst, to_write, plan, checked, report.outputs));
  }
  return report;
}

namespace {

Status Mismatch(const std::string& what) {
  return Status(Code::kConvertVerifyMismatch, what);
}

// Compares the source tensor `index` with `out_tensor` of the output, chunk by chunk.
Status CompareBytes(const TorchCheckpoint& source, size_t index, const Checkpoint& output,
                    const TensorInfo& out_tensor,
                    std::vector<std::unique_ptr<RandomAccessFile>>& out_files,
                    std::vector<std::byte>& a, std::vector<std::byte>& b, uint64_t& compared) {
  const TorchTensor& t = source.tensors()[index];
  const std::string label =
      "tensor " + json::Quote(t.name) +
      (t.name == out_tensor.name ? std::string()
                                 : " (stored as " + json::Quote(out_tensor.name) + ")");
  if (out_tensor.dtype != t.dtype || out_tensor.shape != t.shape) {
    return Mismatch(label + ": the output has another dtype or shape");
  }
  if (out_tensor.size != t.byte_size) {
    return Mismatch(label + ": the output holds " + std::to_string(out_tensor.size) +
                    " bytes, the source " + std::to_string(t.byte_size));
  }
  auto& file = out_files[out_tensor.file];
  if (!file) {
    TF_ASSIGN_OR_RETURN(file,
                        Env::Default()->OpenRandomAccess(output.files()[out_tensor.file].path));
  }
  for (uint64_t off = 0; off < t.byte_size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(a.size(), t.byte_size - off));
    std::span<std::byte> sa(a.data(), n), sb(b.data(), n);
    TF_RETURN_IF_ERROR(source.ReadTensor(index, off, sa));
    TF_RETURN_IF_ERROR(ReadFully(*file, out_tensor.offset + off, sb));
    if (std::memcmp(sa.data(), sb.data(), n) != 0) {
      size_t k = 0;
      while (sa[k] == sb[k]) ++k;
      return Mismatch(label + ": byte " + std::to_string(off + k) + " differs (source " +
                      std::to_string(static_cast<int>(sa[k])) + ", output " +
                      std::to_string(static_cast<int>(sb[k])) + ")");
    }
    off += n;
    compared += n;
  }
  return Status::Ok();
}

}  // namespace

Result<VerifyConversionReport> VerifyConversion(const std::string& src, const std::string& dst,
                                                const ConvertOptions& options) {
  TF_ASSIGN_OR_RETURN(std::unique_ptr<TorchCheckpoint> source,
                      TorchCheckpoint::Open(src, options.open));
  TF_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> output, Checkpoint::Open(OutputPath(dst)));
  std::map<std::string, std::string> metadata;
  for (const FileInfo& f : output->files()) {
    for (const auto& [k, v] : f.metadata) metadata.emplace(k, v);
  }

  VerifyConversionReport report;
  std::vector<std::unique_ptr<RandomAccessFile>> out_files(output->files().size());
  std::vector<std::byte> a(4u << 20), b(4u << 20);
  std::set<std::string_view> used;
  for (size_t i = 0; i < source->tensors().size(); ++i) {
    const TorchTensor& t = source->tensors()[i];
    const TensorInfo* out = output->Find(t.name);
    if (out == nullptr) {
      auto it = metadata.find(t.name);
      if (it != metadata.end()) out = output->Find(it->second);
      if (out == nullptr) {
        return Mismatch(dst + ": tensor " + json::Quote(t.name) +
                        " is neither in the output nor recorded as an alias of one of its tensors");
      }
    }
    used.insert(out->name);
    TF_RETURN_IF_ERROR(
        CompareBytes(*source, i, *output, *out, out_files, a, b, report.bytes).WithPrefix(dst));
    report.tensors += 1;
  }
  for (const TensorInfo& t : output->tensors()) {
    if (!used.contains(t.name)) {
      return Mismatch(dst + ": tensor " + json::Quote(t.name) +
                      " of the output is not in the source");
    }
  }
  TF_RETURN_IF_ERROR(source->CheckStoragesRead());  // the source's bytes compared were its own
  if (options.keep_values) {
    for (const TorchValue& v : source->values()) {
      // Skipped as PlanMetadata skips them: those keys hold the format and the checksums.
      if (!v.representable || v.name == "format" || v.name == kChecksumsMetadataKey) continue;
      auto it = metadata.find(v.name);
      if (it == metadata.end() || it->second != v.text) {
        return Mismatch(dst + ": value " + json::Quote(v.name) +
                        " is not in the output's metadata as " + json::Quote(v.text));
      }
    }
  }
  return report;
}

}  // namespace tensorferry

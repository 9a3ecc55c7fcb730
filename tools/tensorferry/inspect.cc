// tensorferry inspect PATH: the tensor table, totals, dtype histogram and metadata of a
// safetensors file, a checkpoint directory or an index file. Reads headers only.
#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/format.h"

namespace tensorferry::cli {
namespace {

constexpr size_t kDefaultRows = 50;

struct InspectArgs {
  std::string path;
  bool json = false;
  bool all = false;
};

struct DTypeStats {
  uint64_t count = 0;
  uint64_t bytes = 0;
};

// Length of the longest prefix, ending with '/', shared by every file path: the checkpoint
// directory, stripped when file names are shown in tables.
size_t CommonDirLength(const std::vector<std::string>& paths) {
  if (paths.empty()) return 0;
  std::string_view prefix = paths[0];
  const size_t slash = prefix.rfind('/');
  prefix = slash == std::string_view::npos ? std::string_view() : prefix.substr(0, slash + 1);
  for (const std::string& p : paths) {
    while (!prefix.empty() && !std::string_view(p).starts_with(prefix)) {
      const size_t s = prefix.substr(0, prefix.size() - 1).rfind('/');
      prefix = s == std::string_view::npos ? std::string_view() : prefix.substr(0, s + 1);
    }
  }
  return prefix.size();
}

// Terminal columns taken by UTF-8 text (code points; good enough for names and paths).
size_t DisplayWidth(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// Rows of cells printed with each column padded to its widest cell; columns listed in
// `right_aligned` are right-aligned (numbers).
class Table {
 public:
  explicit Table(std::vector<bool> right_aligned) : right_(std::move(right_aligned)) {}
  void Add(std::vector<std::string> row) {
    for (auto& cell : row) cell = OneLine(cell);
    if (widths_.size() < row.size()) widths_.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) widths_[i] = std::max(widths_[i], DisplayWidth(row[i]));
    rows_.push_back(std::move(row));
  }
  void Print(std::string& out, std::string_view indent = "") const {
    for (const auto& row : rows_) {
      std::string line(indent);
      for (size_t i = 0; i < row.size(); ++i) {
        const size_t pad = widths_[i] - DisplayWidth(row[i]);
        const bool right = i < right_.size() && right_[i];
        if (right) line.append(pad, ' ');
        line += row[i];
        if (i + 1 < row.size()) {
          if (!right) line.append(pad, ' ');
          line += "  ";
        }
      }
      out += line;
      out += '\n';
    }
  }

 private:
  std::vector<bool> right_;
  std::vector<size_t> widths_;
  std::vector<std::vector<std::string>> rows_;
};

// Metadata values longer than this are shown abbreviated in the text report (the checksums of
// tensorferry.checksums run to kilobytes per file); --all and --json print them whole.
constexpr size_t kLongValue = 160;
constexpr size_t kLongValueShown = 96;

std::string MetadataValue(std::string_view v, bool all) {
  if (all || v.size() <= kLongValue) return OneLine(v);
  size_t cut = kLongValueShown;
  while (cut > 0 && (static_cast<unsigned char>(v[cut]) & 0xC0) == 0x80) --cut;  // UTF-8
  return OneLine(v.substr(0, cut)) + "... (" + FormatBytes(v.size()) +
         "; --all or --json prints it whole)";
}

void AppendMetadata(std::string& out, const std::vector<std::pair<std::string, std::string>>& md,
                    std::string_view indent, bool all) {
  for (const auto& [k, v] : md) {
    out += std::string(indent) + OneLine(k) + " = " + MetadataValue(v, all) + "\n";
  }
}

std::string HumanReport(const InspectArgs& args, const Checkpoint& ckpt,
                        const std::array<DTypeStats, kNumDTypes>& dtypes, uint64_t file_bytes) {
  const auto& files = ckpt.files();
  const auto& tensors = ckpt.tensors();
  std::vector<std::string> paths;  // the files' paths as shown (a URL redacted)
  paths.reserve(files.size());
  for (const FileInfo& f : files) paths.push_back(Shown(f.path));
  const size_t dir_len = CommonDirLength(paths);
  const auto short_name = [&](const FileInfo& f) {
    const std::string& p = paths[static_cast<size_t>(&f - files.data())];
    return p.size() > dir_len ? p.substr(dir_len) : p;
  };

  std::string out;
  out += OneLine(Shown(args.path)) + ": " + Plural(tensors.size(), "tensor") + ", " +
         FormatBytes(ckpt.total_tensor_bytes()) + " in " + Plural(files.size(), "file");
  if (!ckpt.index_path().empty()) out += " (index " + OneLine(Shown(ckpt.index_path())) + ")";
  out += "\n\n";

  Table file_table({false, true, true, true});
  file_table.Add({"FILE", "SIZE", "HEADER", "TENSORS"});
  for (const FileInfo& f : files) {
    file_table.Add({short_name(f), FormatBytes(f.file_size), FormatBytes(f.header_size),
                    std::to_string(f.num_tensors)});
  }
  file_table.Print(out);
  out += "\n";

  const size_t shown = args.all ? tensors.size() : std::min(tensors.size(), kDefaultRows);
  Table tensor_table({false, false, false, true, false});
  tensor_table.Add({"NAME", "DTYPE", "SHAPE", "SIZE", "FILE"});
  for (size_t i = 0; i < shown; ++i) {
    const TensorInfo& t = tensors[i];
    const std::string file = t.file < files.size() ? short_name(files[t.file]) : "?";
    tensor_table.Add(
        {t.name, std::string(DTypeName(t.dtype)), ShapeText(t.shape), FormatBytes(t.size), file});
  }
  tensor_table.Print(out);
  if (shown < tensors.size()) {
    out += "... " + std::to_string(tensors.size() - shown) + " more (use --all)\n";
  }
  out += "\n";

  std::vector<int> order;
  for (int d = 0; d < kNumDTypes; ++d) {
    if (dtypes[d].count) order.push_back(d);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return dtypes[a].bytes > dtypes[b].bytes; });
  Table dtype_table({false, true, true});
  dtype_table.Add({"DTYPE", "TENSORS", "BYTES"});
  for (int d : order) {
    dtype_table.Add({std::string(DTypeName(static_cast<DType>(d))), std::to_string(dtypes[d].count),
                     FormatBytes(dtypes[d].bytes)});
  }
  dtype_table.Print(out);
  out += "\n";

  out += "totals: " + Plural(tensors.size(), "tensor") + ", " +
         FormatBytes(ckpt.total_tensor_bytes()) + " of tensor data, " +
         Plural(files.size(), "file") + " of " + FormatBytes(file_bytes) + "\n";

  // Metadata: once when every file carries the same, else per file.
  bool same = true;
  for (const FileInfo& f : files) same = same && f.metadata == files[0].metadata;
  if (!files.empty() && same) {
    if (!files[0].metadata.empty()) {
      out += files.size() == 1 ? "metadata:\n" : "metadata (every file):\n";
      AppendMetadata(out, files[0].metadata, "  ", args.all);
    }
  } else {
    out += "metadata:\n";
    for (const FileInfo& f : files) {
      out += "  " + OneLine(short_name(f)) + (f.metadata.empty() ? ": (none)\n" : ":\n");
      AppendMetadata(out, f.metadata, "    ", args.all);
    }
  }
  if (!ckpt.index_metadata().empty()) {
    out += "index metadata:\n";
    AppendMetadata(out, ckpt.index_metadata(), "  ", args.all);
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

std::string JsonReport(const InspectArgs& args, const Checkpoint& ckpt,
                       const std::array<DTypeStats, kNumDTypes>& dtypes, uint64_t file_bytes) {
  const auto& files = ckpt.files();
  JsonOut j;
  j.BeginObject();
  j.Field("path", Shown(args.path)).Field("ok", true);
  j.Key("index");
  if (ckpt.index_path().empty()) {
    j.Raw("null");
  } else {
    j.String(Shown(ckpt.index_path()));
  }
  j.Key("files").BeginArray();
  for (const FileInfo& f : files) {
    j.BeginObject()
        .Field("path", Shown(f.path))
        .Field("size", f.file_size)
        .Field("header_size", f.header_size)
        .Field("data_offset", f.data_offset)
        .Field("num_tensors", f.num_tensors);
    j.Key("metadata").BeginObject();
    for (const auto& [k, v] : f.metadata) j.Field(k, v);
    j.EndObject().EndObject();
  }
  j.EndArray();
  j.Key("tensors").BeginArray();
  for (const TensorInfo& t : ckpt.tensors()) {
    j.BeginObject().Field("name", t.name).Field("dtype", DTypeName(t.dtype));
    j.Key("shape").BeginArray();
    for (uint64_t d : t.shape) j.Uint(d);
    j.EndArray();
    j.Field("offset", t.offset).Field("size", t.size);
    j.Field("file", t.file < files.size() ? std::string_view(files[t.file].path) : "");
    j.EndObject();
  }
  j.EndArray();
  j.Key("totals")
      .BeginObject()
      .Field("tensors", static_cast<uint64_t>(ckpt.tensors().size()))
      .Field("bytes", ckpt.total_tensor_bytes())
      .Field("files", static_cast<uint64_t>(files.size()))
      .Field("file_bytes", file_bytes)
      .EndObject();
  j.Key("dtypes").BeginObject();
  for (int d = 0; d < kNumDTypes; ++d) {
    if (!dtypes[d].count) continue;
    j.Key(DTypeName(static_cast<DType>(d)))
        .BeginObject()
        .Field("count", dtypes[d].count)
        .Field("bytes", dtypes[d].bytes)
        .EndObject();
  }
  j.EndObject();
  // Values are kept as their JSON text by the index parser, so they are copied as they are.
  j.Key("index_metadata").BeginObject();
  for (const auto& [k, v] : ckpt.index_metadata()) {
    j.Key(k);
    if (v.empty()) {
      j.Raw("null");
    } else {
      j.Raw(v);
    }
  }
  j.EndObject();
  j.EndObject();
  return j.str();
}

int RunInspect(const InspectArgs& args) {
  Result<std::shared_ptr<const Checkpoint>> opened = OpenCheckpoint(args.path);
  if (!opened.ok()) return Failed(args.json, args.path, opened.status());
  const Checkpoint& ckpt = **opened;
  std::array<DTypeStats, kNumDTypes> dtypes{};
  for (const TensorInfo& t : ckpt.tensors()) {
    const auto d = static_cast<size_t>(t.dtype);
    if (d >= dtypes.size()) continue;
    dtypes[d].count++;
    dtypes[d].bytes += t.size;
  }
  uint64_t file_bytes = 0;
  for (const FileInfo& f : ckpt.files()) file_bytes += f.file_size;

  const std::string report = args.json ? JsonReport(args, ckpt, dtypes, file_bytes)
                                       : HumanReport(args, ckpt, dtypes, file_bytes);
  return PrintReport(report);
}

}  // namespace

Command AddInspectCommand(CLI::App& parent) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* app = parent.add_subcommand(
      "inspect", "List the tensors, totals, dtypes and metadata of a checkpoint (headers only)");
  AddCheckpointPath(*app, args->path);
  app->add_flag("--json", args->json, "Print one JSON document instead of tables");
  app->add_flag("--all", args->all,
                "List every tensor (default: the first 50) and long metadata values whole");
  return {app, [args] { return RunInspect(*args); }};
}

}  // namespace tensorferry::cli

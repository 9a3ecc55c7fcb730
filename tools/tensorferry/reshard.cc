// tensorferry reshard SRC DST --tp N: writes one complete checkpoint per tensor-parallel rank,
// DST/rank-RRRRR-of-NNNNN/, each holding that rank's slice of every tensor (shard.h rules) with
// its own model.safetensors.index.json, so a rank loads its directory directly with no slicing.
// With --max-shard-size alone, DST is the same checkpoint re-split into files of that size.
//
// Streaming: tensors are never held whole. The writer asks each tensor for its bytes in buffer
// sized pieces (TensorToWrite::generate), which are read from the source's slice ranges with
// positional reads; memory stays at about twice the writer's buffer. Nothing is half-written: each
// rank is written into "DST/.rank-...partial" (each file itself atomic) and renamed into place when
// complete. The ranks are one unit (DirectoryTransaction): a failure, or SIGINT/SIGTERM/SIGHUP
// (handled), removes every rank written and the folders the command created, so a rerun starts
// clean. A death no handler sees (SIGKILL, the OOM killer, a power loss) at any moment after the
// first rank's folder was renamed into place leaves the ranks completed so far, the
// ".rank-...partial" folder of the one in progress and DST/.tensorferry.lock (taken over by the
// next run): an incomplete set. An existing rank directory is refused before anything is written;
// when the set it belongs to is incomplete the refusal says so and names the folders to remove.
// Without --tp, DST may not be the source's own directory (compared by device and inode), which
// would replace the source; any other existing checkpoint in DST is replaced all or nothing
// (WriteSharded).
//
// Prints one line, or with --json one document: src, dst, tp_size, tensors, max_shard_size,
// bytes (of the .safetensors files written), seconds, and per rank its dir, tensors, bytes, index
// and files (name, bytes); a failure is {"src", "dst", "ok": false, "error"} (Failed).
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/integrity.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/writer.h"

namespace tensorferry::cli {
namespace {

namespace fs = std::filesystem;

struct ReshardArgs {
  std::string src;
  std::string dst;
  unsigned tp = 0;
  std::string rules;
  std::string max_shard_size;
  bool no_sync = false;
  bool no_verify = false;
  bool json = false;
};

// The bytes of one tensor's slice, read on demand: `pieces` are (offset in the file, length), and
// `starts` their offsets in the local tensor. Pieces the same request needs whose gaps are at
// most kMaxGap are read with one read and scattered (a strided slice has a piece per row: one
// read each would be a ranged GET each from an object store).
struct SliceSource {
  static constexpr uint64_t kMaxGap = 64u << 10;  // as the loader's default max_gap
  static constexpr uint64_t kMinCover = 1u << 20;

  std::shared_ptr<const RandomAccessFile> file;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  std::vector<uint64_t> starts;

  Status ReadAll(uint64_t at, std::span<std::byte> out) const {
    for (uint64_t got = 0; got < out.size();) {
      auto r = file->Read(at + got, out.subspan(got));
      if (!r.ok()) return r.status();
      if (*r == 0) {
        return Status(Code::kUnexpectedEof,
                      file->path() + ": ends before offset " + std::to_string(at + got));
      }
      got += *r;
    }
    return Status::Ok();
  }

  Status Fill(uint64_t offset, std::span<std::byte> out) const {
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), offset) -
                                   starts.begin()) -
               1;
    uint64_t done = 0;
    // A read's span (the gaps included) is at most max(out, kMinCover): memory stays at about
    // twice the writer's buffer however many ranks' rows lie between this one's (a split on
    // dim 1 over `world` ranks reads `world` bytes per byte kept).
    const uint64_t max_cover = std::max<uint64_t>(out.size(), kMinCover);
    std::vector<std::byte> cover;
    while (done < out.size()) {
      if (i >= pieces.size()) {
        return Status(Code::kInternal, "reshard: read past the end of a slice");
      }
      const uint64_t within = offset + done - starts[i];
      const uint64_t begin = pieces[i].first + within;
      uint64_t end = begin + std::min<uint64_t>(pieces[i].second - within, out.size() - done);
      uint64_t total = end - begin;
      size_t j = i + 1;  // pieces [i, j) in one read
      for (; j < pieces.size() && done + total < out.size(); ++j) {
        const auto [poff, plen] = pieces[j];
        if (poff < end || poff - end > kMaxGap) break;
        const uint64_t take = std::min<uint64_t>(plen, out.size() - done - total);
        if (poff + take - begin > max_cover) break;
        end = poff + take;
        total += take;
      }
      if (j == i + 1) {
        if (Status s = ReadAll(begin, out.subspan(done, total)); !s.ok()) return s;
      } else {
        cover.resize(end - begin);
        if (Status s = ReadAll(begin, cover); !s.ok()) return s;
        uint64_t at = done;
        for (size_t k = i; k < j; ++k) {
          const uint64_t from = k == i ? begin : pieces[k].first;
          const uint64_t n = std::min<uint64_t>(
              k == i ? pieces[i].second - within : pieces[k].second, done + total - at);
          std::memcpy(out.data() + at, cover.data() + (from - begin), n);
          at += n;
        }
      }
      done += total;
      i = j;
    }
    return Status::Ok();
  }
};

Result<std::vector<std::string>> WriteRank(
    const Checkpoint& ckpt, const std::vector<std::shared_ptr<const RandomAccessFile>>& files,
    const ShardSpec& spec, uint32_t rank, uint32_t world, const std::string& dir,
    const ShardOptions& so, const Metadata& metadata) {
  // What rank `rank` of `world` loads from the source with these rules (DescribeSelection, the
  // one resolution of slices and ties every load uses): a tied alias the files hold gets its
  // target's bytes, as a load of the source gives it; one the files lack is not written (a load
  // of the rank folder with the same rules gives it, as from the source); a tie the loader
  // refuses fails here too. `spec` is ShardSpec::None() for a plain re-split (no --tp): every
  // tensor as it is, no ties; with --tp, even --tp 1, the rules apply (their ties included).
  TensorParallelOptions tp;
  tp.spec = spec;
  tp.rank = rank;
  tp.world = world;
  Result<Description> description = DescribeSelection(ckpt, Selection::All(), &tp);
  if (!description.ok()) return description.status();
  const Description& described = *description;
  std::unordered_set<std::string> in_files;
  in_files.reserve(ckpt.tensors().size());
  for (const TensorInfo& t : ckpt.tensors()) in_files.insert(t.name);
  std::vector<TensorToWrite> tensors;
  tensors.reserve(described.outputs.size());
  // Source order is file order, so layer 0 stays in the first shard as the source had it.
  for (const OutputInfo& out : described.outputs) {
    if (out.alias && !in_files.contains(out.name)) continue;
    const TensorInfo& t = ckpt.tensors()[out.tensor];
    auto source = std::make_shared<SliceSource>();
    source->file = files[t.file];
    uint64_t at = 0;
    const auto add = [&](uint64_t off, uint64_t len) {
      source->pieces.emplace_back(t.offset + off, len);
      source->starts.push_back(at);
      at += len;
    };
    if (out.slice) {
      for (const auto& [off, len] : SliceByteRanges(t, *out.slice)) add(off, len);
    } else if (t.size > 0) {
      add(0, t.size);
    }
    TensorToWrite w;
    w.name = out.name;
    w.dtype = out.dtype;
    w.shape = out.shape;
    w.generate = [source](uint64_t offset, std::span<std::byte> bytes) {
      return source->Fill(offset, bytes);
    };
    tensors.push_back(std::move(w));
  }
  return WriteSharded(dir, tensors, metadata, so);
}

std::string RankDirName(uint32_t rank, uint32_t world) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05u-of-%05u", rank, world);
  return name;
}

// A failure of the command: the path it is about ("error: <path>: <reason>", or the error of the
// --json document) and why.
struct Failure {
  std::string path;
  Status status;
};

// Records `status` about `path` in `failure` and returns false.
bool Fail(Failure& failure, std::string path, Status status) {
  failure = {std::move(path), std::move(status)};
  return false;
}

// What one rank (or, without --tp, the re-split checkpoint) was written as.
struct RankOutput {
  uint32_t rank = 0;
  std::string dir;
  std::vector<std::pair<std::string, uint64_t>> files;  // .safetensors files in `dir`, bytes
  std::string index;                                    // the index file's name in `dir`
  uint64_t tensors = 0;
  uint64_t bytes = 0;  // of `files`
};

// What the command wrote, for its report.
struct ReshardOutput {
  uint64_t tensors = 0;  // of the source (each rank holds a slice of every one)
  uint32_t world = 1;
  uint64_t max_shard_size = 0;
  std::vector<RankOutput> ranks;
  uint64_t Bytes() const {
    uint64_t total = 0;
    for (const RankOutput& r : ranks) total += r.bytes;
    return total;
  }
};

// Parses --max-shard-size, --no-sync and --rules; the usage error's text on failure.
std::optional<std::string> ParseReshardOptions(const ReshardArgs& a, ShardOptions& so,
                                               ShardSpec& spec) {
  if (!a.max_shard_size.empty()) {
    auto size = ParseSize(a.max_shard_size);
    if (!size || *size == 0) return "--max-shard-size: not a size: " + a.max_shard_size;
    so.max_shard_size = *size;
  }
  so.write.sync = !a.no_sync;
  spec = ShardSpec::Builtin();
  if (!a.rules.empty()) {
    auto r = ReadShardRules(a.rules);
    if (!r.ok()) return ErrorText(a.rules, r.status());
    spec = std::move(r).value();
  }
  return std::nullopt;
}

// The checkpoint's own files (opened and identified at Checkpoint::Open; local or remote), for
// positional reads.
bool OpenSourceFiles(const Checkpoint& ckpt,
                     std::vector<std::shared_ptr<const RandomAccessFile>>& files,
                     Failure& failure) {
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    auto file = ckpt.File(f);
    if (!file.ok()) return Fail(failure, ckpt.files()[f].path, file.status());
    files.push_back(std::move(file).value());
  }
  return true;
}

// Sets metadata key `k` to `v`, replacing an existing value or appending.
void SetMetadata(Metadata& m, const std::string& k, const std::string& v) {
  for (auto& [key, value] : m) {
    if (key == k) {
      value = v;
      return;
    }
  }
  m.emplace_back(k, v);
}

// Fails if DST is the directory of a source file: the directory its path names, or the one it
// lies in once links are followed (a link to a file in DST given as the source: the write would
// move that file aside and remove it). Re-splitting into the source's own directory would replace
// (and obsolete) the files being read. The same directory is recognized by device and inode,
// whatever path leads there (symlinks, "..", bind mounts).
bool CheckDstIsNotSource(const ReshardArgs& a, const Checkpoint& ckpt, Failure& failure) {
  struct stat dst_st;
  if (::stat(a.dst.c_str(), &dst_st) != 0) return true;
  for (const FileInfo& f : ckpt.files()) {
    std::error_code ec;
    const fs::path resolved = fs::canonical(f.path, ec);
    for (const fs::path& file : {fs::path(f.path), ec ? fs::path(f.path) : resolved}) {
      const fs::path parent = file.parent_path();
      struct stat src_st;
      if (::stat(parent.empty() ? "." : parent.c_str(), &src_st) == 0 &&
          src_st.st_dev == dst_st.st_dev && src_st.st_ino == dst_st.st_ino) {
        return Fail(failure, a.dst,
                    Status(Code::kInvalidArgument,
                           "is the directory of the source file " + file.string() +
                               "; writing there would replace the checkpoint being read (choose "
                               "another output directory)"));
      }
    }
  }
  return true;
}

// `text` as one word of a POSIX shell command: as it is when it holds only safe characters, else
// in single quotes (a quote inside as '\''), so that the advice below can be pasted as it is.
std::string ShellWord(const std::string& text) {
  const bool plain = !text.empty() && text.find_first_not_of(
                                          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                          "0123456789_-./+,:@%") == std::string::npos;
  if (plain) return text;
  std::string out = "'";
  for (const char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// When DST holds a hidden ".rank-R-of-N.partial" folder of the set of `world` ranks (a run killed
// where no handler could clean up: an incomplete set), what to do about it, starting with "; ";
// "" otherwise (rank folders a user made are not taken for an interrupted run's).
std::string IncompleteSetAdvice(const std::string& dst, uint32_t world) {
  std::vector<std::string> present, partial;
  for (uint32_t rank = 0; rank < world; ++rank) {
    const std::string name = RankDirName(rank, world);
    std::error_code ec;
    if (fs::exists(fs::path(dst) / name, ec)) present.push_back(name);
    if (fs::exists(fs::path(dst) / ("." + name + ".partial"), ec)) {
      partial.push_back("." + name + ".partial");
    }
  }
  if (partial.empty()) return "";
  std::string folders;
  for (const auto* names : {&present, &partial}) {
    for (const std::string& n : *names) {
      folders += folders.empty() ? "" : " ";
      folders += ShellWord((fs::path(dst) / n).string());
    }
  }
  return "; an interrupted reshard (killed before it finished) left an incomplete set: " +
         std::to_string(present.size()) + " of the " + std::to_string(world) +
         " rank folders, and " + std::to_string(partial.size()) +
         " unfinished; remove them (rm -r " + folders + ") and run again";
}

// Creates DST (and its missing parents) as a transaction, holding its write lock (a second
// reshard into DST is refused at once), then refuses existing rank directories, under the lock:
// the rank directories written and the directories created go again unless it is committed.
// nullopt on failure.
std::optional<DirectoryTransaction> PrepareDestination(const ReshardArgs& a, uint32_t world,
                                                       Failure& failure) {
  Result<DirectoryTransaction> t = DirectoryTransaction::Create(a.dst);
  if (!t.ok()) {
    Fail(failure, a.dst, t.status());
    return std::nullopt;
  }
  // Refused before anything is written: no rank directory is ever overwritten. (Checked under the
  // lock: a reshard that finished just before is seen, so its ranks are neither overwritten nor
  // removed by this one's cleanup.)
  for (uint32_t rank = 0; a.tp > 0 && rank < world; ++rank) {
    const fs::path final_dir = fs::path(a.dst) / RankDirName(rank, world);
    std::error_code ec;
    const bool exists = fs::exists(final_dir, ec);
    if (ec) {
      Fail(failure, final_dir.string(),
           Status(Code::kIoError, "cannot be checked: " + ec.message()));
      return std::nullopt;
    }
    if (exists) {
      Fail(failure, final_dir.string(),
           Status(Code::kInvalidArgument,
                  "already exists; not overwritten" + IncompleteSetAdvice(a.dst, world)));
      return std::nullopt;
    }
  }
  return std::move(t).value();
}

// Writes one rank (or the whole re-split checkpoint without --tp) and describes it in `out`.
bool WriteOneRank(const ReshardArgs& a, const Checkpoint& ckpt,
                  const std::vector<std::shared_ptr<const RandomAccessFile>>& files,
                  const ShardSpec& spec, const ShardOptions& so, const Metadata& base,
                  uint32_t rank, uint32_t world, DirectoryTransaction& dst, RankOutput& out,
                  Failure& failure) {
  std::error_code ec;
  Metadata metadata = base;
  if (a.tp > 0) {
    SetMetadata(metadata, "tensorferry.tp_rank", std::to_string(rank));
    SetMetadata(metadata, "tensorferry.tp_size", std::to_string(world));
    SetMetadata(metadata, "tensorferry.shard_rules", spec.ToJson());
  }
  const std::string final_dir =
      a.tp > 0 ? (fs::path(a.dst) / RankDirName(rank, world)).string() : a.dst;
  // A rank directory appears complete or not at all.
  const std::string partial =
      a.tp > 0 ? (fs::path(a.dst) / ("." + RankDirName(rank, world) + ".partial")).string() : a.dst;
  if (a.tp > 0) fs::remove_all(partial, ec);  // left by an interrupted run
  // Without --tp, a plain re-split: no rules apply. With --tp (1 included), the rules do.
  const ShardSpec rules = a.tp > 0 ? spec : ShardSpec::None();
  auto paths = WriteRank(ckpt, files, rules, rank, world, partial, so, metadata);
  if (!paths.ok()) {
    if (a.tp > 0) fs::remove_all(partial, ec);
    return Fail(failure, SubjectOf(paths.status(), a.src, a.dst), paths.status());
  }
  std::vector<std::string> placed;
  if (a.tp > 0) {
    // A rank folder is complete, but the ranks are one unit: it goes if a later one fails or a
    // signal ends the command. Registered under both names before the rename.
    std::vector<std::string> temporary;
    for (const std::string& p : *paths) {
      temporary.push_back((fs::path(partial) / fs::path(p).filename()).string());
      placed.push_back((fs::path(final_dir) / fs::path(p).filename()).string());
    }
    dst.Add(partial, temporary);
    dst.Add(final_dir, placed);
    fs::rename(partial, final_dir, ec);
    if (ec) {
      // The rank folder is not ours (made by something else since PrepareDestination checked):
      // left as it is.
      dst.Forget(final_dir);
      fs::remove_all(partial, ec);
      return Fail(failure, final_dir, Status(Code::kIoError, "rename failed: " + ec.message()));
    }
  }
  out = RankOutput{rank, final_dir, {}, {}, ckpt.tensors().size(), 0};
  for (const std::string& p : *paths) {
    const std::string name = fs::path(p).filename().string();
    if (!name.ends_with(".safetensors")) {
      out.index = name;
      continue;
    }
    const std::string placed_path = (fs::path(final_dir) / name).string();
    const uintmax_t size = fs::file_size(placed_path, ec);
    if (ec) {
      return Fail(failure, placed_path,
                  Status(Code::kIoError, "cannot be read back: " + ec.message()));
    }
    out.files.emplace_back(name, size);
    out.bytes += size;
  }
  return true;
}

// Opens the source, checks it and the destination, and writes every rank as one unit.
bool Reshard(const ReshardArgs& a, const ShardOptions& so, const ShardSpec& spec,
             ReshardOutput& out, Failure& failure) {
  Result<std::shared_ptr<const Checkpoint>> opened = OpenCheckpoint(a.src);
  if (!opened.ok()) return Fail(failure, a.src, opened.status());
  const Checkpoint& ckpt = **opened;
  std::vector<std::shared_ptr<const RandomAccessFile>> files;
  if (!OpenSourceFiles(ckpt, files, failure)) return false;
  Metadata base;
  if (!ckpt.files().empty()) base = ckpt.files()[0].metadata;
  // The destination first: refusing it must not wait for the whole source to be read.
  if (a.tp == 0 && !CheckDstIsNotSource(a, ckpt, failure)) return false;
  out.tensors = ckpt.tensors().size();
  out.world = a.tp == 0 ? 1 : a.tp;
  out.max_shard_size = so.max_shard_size;
  if (a.tp > 0) {
    // Rules that cannot split the checkpoint this many ways fail here, before the destination's
    // rank folders are checked one by one (a --tp of billions would check for ever).
    TensorParallelOptions first;
    first.spec = spec;
    first.rank = 0;
    first.world = out.world;
    if (Result<Description> d = DescribeSelection(ckpt, Selection::All(), &first); !d.ok()) {
      return Fail(failure, a.src, d.status());
    }
  }
  std::optional<DirectoryTransaction> dst = PrepareDestination(a, out.world, failure);
  if (!dst) return false;
  // The writer computes new checksums over what it reads: a corrupt source would come out
  // "verified". The source's own checksums (embedded, or its manifest) are checked before any
  // byte is written (folders the transaction created go again).
  if (!a.no_verify) {
    if (Status s = VerifyCheckpointChecksums(ckpt, HashThreads()); !s.ok()) {
      return Fail(failure, a.src, s);
    }
  }
  out.ranks.resize(out.world);
  for (uint32_t rank = 0; rank < out.world; ++rank) {
    if (!WriteOneRank(a, ckpt, files, spec, so, base, rank, out.world, *dst, out.ranks[rank],
                      failure)) {
      return false;
    }
  }
  // The rank folders' renames, and the levels of the destination the command made, made durable
  // before the set counts as written (without --tp, the writer synced the destination itself).
  if (!a.no_sync) {
    if (a.tp > 0) {
      if (Status s = Env::Default()->SyncDirectory(a.dst); !s.ok()) {
        return Fail(failure, a.dst, s);
      }
    }
    if (Status s = dst->SyncCreated(); !s.ok()) return Fail(failure, a.dst, s);
  }
  dst->Commit();
  return true;
}

// The --json report: what was written, rank by rank.
std::string JsonReport(const ReshardArgs& a, const ReshardOutput& out, double seconds) {
  JsonOut j;
  j.BeginObject()
      .Field("src", Shown(a.src))
      .Field("dst", Shown(a.dst))
      .Field("ok", true)
      .Field("tp_size", uint64_t{out.world})
      .Field("tensors", out.tensors)
      .Field("max_shard_size", out.max_shard_size)
      .Field("source_checksums_checked", !a.no_verify)
      .Field("bytes", out.Bytes())
      .Field("seconds", seconds)
      .Key("ranks")
      .BeginArray();
  for (const RankOutput& r : out.ranks) {
    j.BeginObject()
        .Field("rank", uint64_t{r.rank})
        .Field("dir", r.dir)
        .Field("tensors", r.tensors)
        .Field("bytes", r.bytes)
        .Field("index", r.index)
        .Key("files")
        .BeginArray();
    for (const auto& [name, bytes] : r.files) {
      j.BeginObject().Field("name", name).Field("bytes", bytes).EndObject();
    }
    j.EndArray().EndObject();
  }
  j.EndArray().EndObject();
  return j.str();
}

int RunReshard(const ReshardArgs& a) {
  if (a.tp == 0 && a.max_shard_size.empty()) {
    return UsageError("reshard: give --tp N, --max-shard-size SIZE, or both");
  }
  if (a.tp == 0 && !a.rules.empty()) {  // --tp 0 is no tensor parallelism: the rules would be
                                        // ignored
    return UsageError("reshard: --rules needs --tp of at least 1 (--tp 0 splits no tensor)");
  }
  ShardOptions so;
  ShardSpec spec = ShardSpec::Builtin();
  if (std::optional<std::string> usage = ParseReshardOptions(a, so, spec)) {
    return UsageError(*usage);
  }
  const int64_t start = NowNs();
  ReshardOutput out;
  Failure failure;
  if (!Reshard(a, so, spec, out, failure)) {
    return Failed(a.json, a.src, a.dst, failure.path, failure.status);
  }
  if (a.json) return PrintReport(JsonReport(a, out, SecondsSince(start)));
  const std::string line = "resharded " + Plural(out.tensors, "tensor") + " of " + a.src +
                           " into " + (a.tp > 0 ? Plural(out.world, "rank") + " under " : "") +
                           a.dst + ": " + FormatBytes(out.Bytes()) + " written";
  return PrintReport(line);
}

}  // namespace

Command AddReshardCommand(CLI::App& parent) {
  auto args = std::make_shared<ReshardArgs>();
  CLI::App* app = parent.add_subcommand(
      "reshard",
      "Write one checkpoint per tensor-parallel rank (DST/rank-RRRRR-of-NNNNN/), or re-split "
      "files with --max-shard-size");
  AddCheckpointPath(*app, args->src, "src");
  app->add_option("dst", args->dst, "Output directory")->required();
  CLI::Option* tp =
      app->add_option("--tp", args->tp, "Number of tensor-parallel ranks (a folder each)")
          ->check(CLI::Range(0u, 65536u));
  // Rules apply only to a tensor-parallel reshard: without --tp they would be read and ignored.
  app->add_option("--rules", args->rules,
                  "Shard rules, a JSON file (shard.h schema; default: the builtin rules); "
                  "needs --tp")
      ->needs(tp);
  app->add_option("--max-shard-size", args->max_shard_size,
                  "Largest data size of one output file (default 5GB)");
  app->add_flag("--no-sync", args->no_sync, "Skip fsync (scratch output)");
  app->add_flag("--json", args->json,
                "Print one JSON document: what was written, rank by rank (files, tensors, bytes)");
  app->add_flag("--no-verify", args->no_verify,
                "Skip checking the source's checksums first (the output gets checksums of what "
                "was read, whatever it is)");
  return {app, [args] { return RunReshard(*args); }};
}

}  // namespace tensorferry::cli

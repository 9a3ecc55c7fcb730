// tensorferry reshard SRC DST --tp N: writes one complete checkpoint per tensor-parallel rank,
// DST/rank-RRRRR-of-NNNNN/, each holding that rank's slice of every tensor (shard.h rules) with
// its own model.safetensors.index.json, so a rank loads its directory directly with no slicing.
// With --max-shard-size alone, DST is the same checkpoint re-split into files of that size.
//
// Streaming: tensors are never held whole. The writer asks each tensor for its bytes in buffer
// sized pieces (TensorToWrite::generate), which are read from the source's slice ranges with
// positional reads; memory stays at the writer's buffer. Nothing is half-written: each rank is
// written into "DST/.rank-...partial" (each file itself atomic) and renamed into place when
// complete. The ranks are one unit (DirectoryTransaction): a failure, or a signal, removes every
// rank written and the folders the command created, so a rerun starts clean (only a signal in
// the microseconds between a rank's commit and its registration can leave that rank's folder).
// An existing rank directory is refused before anything is written. Without --tp, DST may not be
// the source's own directory (compared by device and inode), which would replace the source; any
// other existing checkpoint in DST is replaced all or nothing (WriteSharded).
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/integrity.h"
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
};

// The bytes of one tensor's slice, read on demand: `pieces` are (offset in the file, length), and
// `starts` their offsets in the local tensor.
struct SliceSource {
  std::shared_ptr<const RandomAccessFile> file;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  std::vector<uint64_t> starts;

  Status Fill(uint64_t offset, std::span<std::byte> out) const {
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), offset) -
                                   starts.begin()) -
               1;
    uint64_t done = 0;
    while (done < out.size()) {
      if (i >= pieces.size()) {
        return Status(Code::kInternal, "reshard: read past the end of a slice");
      }
      const auto [poff, plen] = pieces[i];
      const uint64_t within = offset + done - starts[i];
      const uint64_t n = std::min<uint64_t>(plen - within, out.size() - done);
      for (uint64_t got = 0; got < n;) {
        auto r = file->Read(poff + within + got, out.subspan(done + got, n - got));
        if (!r.ok()) return r.status();
        if (*r == 0) {
          return Status(Code::kUnexpectedEof, file->path() + ": ends before offset " +
                                                  std::to_string(poff + within + got));
        }
        got += *r;
      }
      done += n;
      ++i;
    }
    return Status::Ok();
  }
};

Result<std::vector<std::string>> WriteRank(
    const Checkpoint& ckpt, const std::vector<std::shared_ptr<const RandomAccessFile>>& files,
    const ShardSpec& spec, uint32_t rank, uint32_t world, const std::string& dir,
    const ShardOptions& so, const Metadata& metadata) {
  std::vector<TensorToWrite> tensors;
  tensors.reserve(ckpt.tensors().size());
  // Source order is file order, so layer 0 stays in the first shard as the source had it.
  for (const TensorInfo& t : ckpt.tensors()) {
    const ShardRule rule = world > 1 ? spec.RuleFor(t.name) : ShardRule::Replicate();
    Result<TensorSlice> sliced = SliceOf(t, rule, rank, world);
    if (!sliced.ok()) return sliced.status();
    const TensorSlice& slice = *sliced;
    auto source = std::make_shared<SliceSource>();
    source->file = files[t.file];
    uint64_t at = 0;
    for (const auto& [off, len] : SliceByteRanges(t, slice)) {
      source->pieces.emplace_back(t.offset + off, len);
      source->starts.push_back(at);
      at += len;
    }
    TensorToWrite w;
    w.name = t.name;
    w.dtype = t.dtype;
    w.shape = slice.shape;
    w.generate = [source](uint64_t offset, std::span<std::byte> out) {
      return source->Fill(offset, out);
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

// Parses --max-shard-size, --no-sync and --rules; prints the error and returns false if invalid.
bool ParseReshardOptions(const ReshardArgs& a, ShardOptions& so, ShardSpec& spec) {
  if (!a.max_shard_size.empty()) {
    auto size = ParseSize(a.max_shard_size);
    if (!size || *size == 0) {
      PrintError("--max-shard-size: not a size: " + a.max_shard_size);
      return false;
    }
    so.max_shard_size = *size;
  }
  so.write.sync = !a.no_sync;
  spec = ShardSpec::Builtin();
  if (!a.rules.empty()) {
    auto r = ReadShardRules(a.rules);
    if (!r.ok()) {
      PrintError(a.rules, r.status());
      return false;
    }
    spec = std::move(r).value();
  }
  return true;
}

// The checkpoint's own files (opened and identified at Checkpoint::Open; local or remote), for
// positional reads; prints the error and returns false.
bool OpenSourceFiles(const Checkpoint& ckpt,
                     std::vector<std::shared_ptr<const RandomAccessFile>>& files) {
  for (uint32_t f = 0; f < ckpt.files().size(); ++f) {
    auto file = ckpt.File(f);
    if (!file.ok()) {
      PrintError(ckpt.files()[f].path, file.status());
      return false;
    }
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

// Returns false (with the error printed) if DST is the directory of a source file.
// Re-splitting into the source's own directory would replace (and obsolete) the files being
// read. The same directory is recognized by device and inode, whatever path leads there
// (symlinks, "..", bind mounts).
bool CheckDstIsNotSource(const ReshardArgs& a, const Checkpoint& ckpt) {
  struct stat dst_st;
  if (::stat(a.dst.c_str(), &dst_st) != 0) return true;
  for (const FileInfo& f : ckpt.files()) {
    const fs::path parent = fs::path(f.path).parent_path();
    struct stat src_st;
    if (::stat(parent.empty() ? "." : parent.c_str(), &src_st) == 0 &&
        src_st.st_dev == dst_st.st_dev && src_st.st_ino == dst_st.st_ino) {
      PrintError(a.dst, Status(Code::kInvalidArgument,
                               "is the directory of the source file " + f.path +
                                   "; writing there would replace the checkpoint being "
                                   "read (choose another output directory)"));
      return false;
    }
  }
  return true;
}

// Refuses existing rank directories, then creates DST (and its missing parents), as a
// transaction: the rank directories written and the directories created go again unless it is
// committed. Prints the error and returns nullopt.
std::optional<DirectoryTransaction> PrepareDestination(const ReshardArgs& a, uint32_t world) {
  // Refused before anything is written: no rank directory is ever overwritten.
  for (uint32_t rank = 0; a.tp > 0 && rank < world; ++rank) {
    const fs::path final_dir = fs::path(a.dst) / RankDirName(rank, world);
    std::error_code ec;
    const bool exists = fs::exists(final_dir, ec);
    if (ec) {
      PrintError(final_dir.string(), Status(Code::kIoError, "cannot be checked: " + ec.message()));
      return std::nullopt;
    }
    if (exists) {
      PrintError(final_dir.string(),
                 Status(Code::kInvalidArgument, "already exists; not overwritten"));
      return std::nullopt;
    }
  }
  Result<DirectoryTransaction> t = DirectoryTransaction::Create(a.dst);
  if (!t.ok()) {
    PrintError(a.dst, t.status());
    return std::nullopt;
  }
  return std::move(t).value();
}

// Writes one rank (or the whole re-split checkpoint without --tp) and adds the bytes of its
// .safetensors files to `written`; prints the error and returns false on failure.
bool WriteOneRank(const ReshardArgs& a, const Checkpoint& ckpt,
                  const std::vector<std::shared_ptr<const RandomAccessFile>>& files,
                  const ShardSpec& spec, const ShardOptions& so, const Metadata& base,
                  uint32_t rank, uint32_t world, DirectoryTransaction& dst, uint64_t& written) {
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
  auto paths = WriteRank(ckpt, files, spec, rank, world, partial, so, metadata);
  if (!paths.ok()) {
    if (a.tp > 0) fs::remove_all(partial, ec);
    PrintError(SubjectOf(paths.status(), a.src, a.dst), paths.status());
    return false;
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
      fs::remove_all(partial, ec);
      PrintError(final_dir, Status(Code::kIoError, "rename failed: " + ec.message()));
      return false;
    }
  }
  for (const std::string& p : *paths) {
    if (p.ends_with(".safetensors")) {
      written += fs::file_size(fs::path(final_dir) / fs::path(p).filename(), ec);
    }
  }
  return true;
}

int RunReshard(const ReshardArgs& a) {
  if (a.tp == 0 && a.max_shard_size.empty()) {
    PrintError("reshard: give --tp N, --max-shard-size SIZE, or both");
    return kExitUsage;
  }
  ShardOptions so;
  ShardSpec spec = ShardSpec::Builtin();
  if (!ParseReshardOptions(a, so, spec)) return kExitUsage;
  const std::shared_ptr<const Checkpoint> ckpt = OpenOrPrintError(a.src);
  if (!ckpt) return kExitError;
  std::vector<std::shared_ptr<const RandomAccessFile>> files;
  if (!OpenSourceFiles(*ckpt, files)) return kExitError;
  Metadata base;
  if (!ckpt->files().empty()) base = ckpt->files()[0].metadata;
  // The destination first: refusing it must not wait for the whole source to be read.
  if (a.tp == 0 && !CheckDstIsNotSource(a, *ckpt)) return kExitError;
  const uint32_t world = a.tp == 0 ? 1 : a.tp;
  std::optional<DirectoryTransaction> dst = PrepareDestination(a, world);
  if (!dst) return kExitError;
  // The writer computes new checksums over what it reads: a corrupt source would come out
  // "verified". The source's own checksums (embedded, or its manifest) are checked before any
  // byte is written (folders the transaction created go again).
  if (!a.no_verify) {
    if (Status s = VerifyCheckpointChecksums(*ckpt, HashThreads()); !s.ok()) {
      PrintError(a.src, s);
      return kExitError;
    }
  }
  uint64_t written = 0;
  for (uint32_t rank = 0; rank < world; ++rank) {
    if (!WriteOneRank(a, *ckpt, files, spec, so, base, rank, world, *dst, written)) {
      return kExitError;
    }
  }
  dst->Commit();
  const std::string line = "resharded " + Plural(ckpt->tensors().size(), "tensor") + " of " +
                           a.src + " into " + (a.tp > 0 ? Plural(world, "rank") + " under " : "") +
                           a.dst + ": " + FormatBytes(written) + " written";
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
  app->add_option("--tp", args->tp, "Number of tensor-parallel ranks");
  app->add_option("--rules", args->rules,
                  "Shard rules, a JSON file (shard.h schema; default: the builtin rules)");
  app->add_option("--max-shard-size", args->max_shard_size,
                  "Largest data size of one output file (default 5GB)");
  app->add_flag("--no-sync", args->no_sync, "Skip fsync (scratch output)");
  app->add_flag("--no-verify", args->no_verify,
                "Skip checking the source's checksums first (the output gets checksums of what "
                "was read, whatever it is)");
  return {app, [args] { return RunReshard(*args); }};
}

}  // namespace tensorferry::cli

// tensorferry load PATH: loads the tensors of a checkpoint into host memory (or, with --device
// cuda:N, into GPU memory) with the Loader, batch by batch under an optional budget, and prints the
// throughput, the peak resident memory of the process and a checksum of the loaded bytes (CRC32C
// per tensor, combined in name order, so the same tensors give the same checksum whatever the
// engine, batching, budget or device). Device tensors are checksummed after a copy back to the host
// (cudaMemcpy), so equal checksums prove the bytes in device memory are the file's.
#include <algorithm>
#include <array>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/device.h"
#include "tensorferry/loader.h"
#include "tensorferry/mapping.h"
#include "tensorferry/options.h"
#include "tensorferry/shard.h"
#include "tensorferry/stats.h"

namespace tensorferry::cli {
namespace {

// A load option as a flag: its value (empty: not given) and the flag's spelling for messages.
struct OptionFlag {
  std::string flag;
  std::string value;
};

// Options left empty keep the defaults of LoadOptions::FromEnvironment() (TENSORFERRY_* variables,
// else the library's defaults).
struct LoadArgs {
  std::string path;
  std::map<std::string, OptionFlag> options;  // by LoadOptions::Set key
  bool populate = false;
  bool prefer_mmap = false;
  bool drop_cache = false;
  bool touch = false;
  unsigned repeat = 1;
  std::string layers;  // "A-B"
  bool allow_oversized = false;
  // The switches above that are LoadOptions (populate, prefer_mmap, drop_cache, allow_oversized)
  // as given: "--populate=false" sets 0 over a TENSORFERRY_POPULATE=1 (not given: the
  // environment's). Their CLI11 options, which outlive the run.
  std::map<std::string, std::pair<CLI::Option*, bool*>> switches;
  bool explain = false;
  bool json = false;
  bool no_checksum = false;
  std::string rules;  // --rules FILE: the shard spec of --tp-rank/--tp-size
};

// Peak resident set size of this process (VmHWM), in bytes; 0 when unknown.
// A "Vm...:" line of /proc/self/status in bytes (0 when absent).
uint64_t ProcStatusBytes(std::string_view key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(key.size())) * 1024;
  }
  return 0;
}
uint64_t PeakRss() {
  return ProcStatusBytes("VmHWM:");
}

// The load options: the environment's (LoadOptions::FromEnvironment), every flag set over them
// (LoadOptions::Set, the checks of options.h), then Validate. A failure is reported by
// InvalidSetting as the environment's when the variables are invalid on their own (a value, or a
// contradiction they have without any flag), else as the command line's; returns the exit code
// then, nullopt when the options are valid.
std::optional<int> MakeOptions(const LoadArgs& a, LoadOptions& out) {
  const auto invalid = [&a](Origin origin, const Status& s) {
    return InvalidSetting(origin, a.json, a.path, s);
  };
  Result<LoadOptions> env = LoadOptions::FromEnvironment();
  if (!env.ok()) return invalid(Origin::kEnvironment, env.status());
  LoadOptions o = *env;
  Status s;
  for (const auto& [key, flag] : a.options) {
    if (s.ok() && !flag.value.empty()) s = SetContext(o, key, flag.value, flag.flag);
  }
  for (const auto& [key, given] : a.switches) {
    if (s.ok() && given.first->count() > 0) s = o.Set(key, *given.second ? "1" : "0");
  }
  if (s.ok() && !a.rules.empty()) {
    Result<ShardSpec> spec = ReadShardRules(a.rules);
    if (!spec.ok()) return invalid(Origin::kCommandLine, spec.status());
    o.SetShardSpec(std::move(spec).value());
  }
  if (!s.ok()) return invalid(Origin::kCommandLine, s);
  if (s = o.Validate(); !s.ok()) {
    // The variables' own contradiction, which no flag changed: e.g. TENSORFERRY_DROP_CACHE=1 with
    // TENSORFERRY_ENGINE=mmap (and no --engine to override it).
    if (const Status alone = env->Validate(); !alone.ok() && alone.message() == s.message()) {
      return invalid(Origin::kEnvironment, alone.WithPrefix("TENSORFERRY_* environment variables"));
    }
    return invalid(Origin::kCommandLine, s);
  }
  out = std::move(o);
  return std::nullopt;
}

// --layers N or A-B, A <= B (layer numbers as LayerOf reads them: any 64-bit number).
Result<Selection> MakeSelection(const LoadArgs& a) {
  if (a.layers.empty()) return Selection::All();
  const std::string_view text = a.layers;
  auto number = [](std::string_view s) -> std::optional<uint64_t> {
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
    return v;
  };
  const size_t dash = text.find('-');
  const std::optional<uint64_t> first = number(text.substr(0, dash));
  const std::optional<uint64_t> last =
      dash == std::string_view::npos ? first : number(text.substr(dash + 1));
  if (!first || !last) {
    return Status(Code::kInvalidArgument, "--layers: expected N or A-B, got \"" + a.layers + "\"");
  }
  if (*first > *last) {
    return Status(Code::kInvalidArgument, "--layers " + a.layers + ": the range is reversed (" +
                                              std::to_string(*first) + " > " +
                                              std::to_string(*last) + ")");
  }
  return Selection::Layers(*first, *last);
}

// What the --repeat runs of a load measured.
struct Runs {
  std::vector<std::pair<std::string, uint32_t>> sums;  // (name, CRC32C) of the last run
  double checksum_seconds = 0;  // of the last run (its checksum is the one reported)
  std::vector<double> gbps;     // per run
  double wall_seconds = 0;      // of the last run
  // The last run's time behind its GB/s: the loader's own, or with --touch the wall time less
  // the checksum (the touching is part of the load; the checksum is not).
  double seconds = 0;
  // Loader::Open (the index, every shard header) and describing the selection: not in
  // wall_seconds, which a comparison with loaders that open as they load must add.
  double open_seconds = 0;
};

// The per-batch work of `load`: checksums (device tensors through a copy back to the host) and,
// with --touch, one byte per page.
Status ConsumeBatch(const Batch& batch, const LoadArgs& args, Runs& runs,
                    std::vector<std::byte>& staging) {
  if (batch.device.is_cuda()) {
    if (args.no_checksum) return Status::Ok();
    const int64_t t0 = NowNs();
    const Status summed = AppendTensorSums(batch.tensors, runs.sums, staging);
    runs.checksum_seconds += SecondsSince(t0);
    return summed;
  }
  if (args.touch) {
    // One byte per page of every tensor, as a user of lazily mapped tensors would pay.
    static volatile unsigned char sink = 0;
    unsigned char x = 0;
    for (const Tensor& t : batch.tensors) {
      const auto* p = reinterpret_cast<const unsigned char*>(t.data());
      for (uint64_t i = 0; i < t.size(); i += 4096) x ^= p[i];
    }
    sink = sink ^ x;
  }
  if (!args.no_checksum) {
    const int64_t t0 = NowNs();
    const Status summed = AppendTensorSums(batch.tensors, runs.sums, staging);
    if (!summed.ok()) return summed;
    runs.checksum_seconds += SecondsSince(t0);
  }
  return Status::Ok();
}

// --repeat: the same loader loads again; later runs reuse the pooled buffers of earlier ones
// (the warm, reused-memory case), the first pays for fresh memory.
Status LoadRepeatedly(Loader& loader, const Selection& selection, const LoadArgs& args,
                      Runs& runs) {
  std::vector<std::byte> staging;  // device tensors are copied back here to be checksummed
  const int64_t describe0 = NowNs();
  const Result<Description> described = loader.Describe(selection);
  runs.open_seconds += SecondsSince(describe0);
  uint64_t total = 0;
  if (described.ok()) {
    for (const OutputInfo& o : described->outputs) total += o.bytes;
  }
  for (unsigned run = 0; run < args.repeat; ++run) {
    runs.sums.clear();
    runs.checksum_seconds = 0;
    const int64_t wall0 = NowNs();
    Progress progress(0);
    uint64_t done = 0;
    const Status status = loader.Stream(selection, [&](Batch batch) {
      done += batch.bytes;
      progress.Bytes(done, total, SecondsSince(wall0));
      return ConsumeBatch(batch, args, runs, staging);
    });
    if (!status.ok()) return status;
    runs.wall_seconds = SecondsSince(wall0);
    const LoadStats s = loader.stats();
    // With --touch the figure is wall time (the touching is part of the load) less the
    // checksum, which runs in the same callback; otherwise the loader's own time.
    const double secs =
        args.touch ? std::max(0.0, runs.wall_seconds - runs.checksum_seconds) : s.seconds;
    runs.seconds = secs;
    runs.gbps.push_back(secs > 0 ? static_cast<double>(s.bytes) / secs / 1e9 : 0);
  }
  return Status::Ok();
}

// Everything `load` prints.
struct Report {
  const LoadArgs& args;
  const LoadOptions& options;
  const LoadStats& stats;
  const Runs& runs;
  std::string checksum;  // "" with --no-checksum
  uint64_t total_tensor_bytes = 0;
  uint64_t rss_before = 0;
  uint64_t peak_rss = 0;
  std::string explain;   // --explain with --json: the plan's text, a member of the document
  double Gbps() const {  // the last run's, as runs_gb_per_s counts it (--touch included)
    return runs.seconds > 0 ? static_cast<double>(stats.bytes) / runs.seconds / 1e9 : 0;
  }
};

// One JSON document: every LoadStats field (VisitLoadStats) plus the run's own figures.
std::string JsonReport(const Report& r) {
  const LoadOptions& o = r.options;
  JsonOut j;
  j.BeginObject().Field("path", Shown(r.args.path)).Field("ok", true);
  VisitLoadStats(r.stats, [&j](std::string_view name, const auto& value) { j.Field(name, value); });
  if (!r.explain.empty()) j.Field("explain", r.explain);
  j.Field("wall_seconds", r.runs.wall_seconds)
      .Field("open_seconds", r.runs.open_seconds)
      .Field("gb_per_s", r.Gbps())
      .Field("budget", o.budget)
      .Field("peak_rss_bytes", r.peak_rss)
      .Field("tp_rank", o.tensor_parallel ? uint64_t{o.tensor_parallel->rank} : uint64_t{0})
      .Field("tp_size", o.tensor_parallel ? uint64_t{o.tensor_parallel->world} : uint64_t{1})
      .Field("rss_before_bytes", r.rss_before)
      .Field("device_budget", o.device_budget)
      .Field("gds", GdsModeName(o.gds))
      .Key("runs_gb_per_s")
      .BeginArray();
  for (double g : r.runs.gbps) j.Double(g);
  j.EndArray()
      .Field("checksum", r.checksum)
      .Field("checksum_seconds", r.runs.checksum_seconds)
      .EndObject();
  return j.str();
}

// One line (two with device tensors).
std::string TextReport(const Report& r) {
  const LoadStats& stats = r.stats;
  const LoadOptions& o = r.options;
  char line[512];
  std::snprintf(
      line, sizeof line,
      "loaded %s in %s: %s in %.3f s (%.2f GB/s, %s%s); peak RSS %s; peak held %s%s; "
      "checksum %s",
      Plural(stats.tensors, "tensor").c_str(),
      (std::to_string(stats.batches) + (stats.batches == 1 ? " batch" : " batches")).c_str(),
      FormatBytes(stats.bytes).c_str(), r.runs.seconds, r.Gbps(), stats.engine.c_str(),
      stats.direct_files ? (", O_DIRECT on " + Plural(stats.direct_files, "file")).c_str() : "",
      FormatBytes(r.peak_rss).c_str(), FormatBytes(stats.peak_budget_bytes).c_str(),
      o.budget                       ? (" of a " + FormatBytes(o.budget) + " budget").c_str()
      : !stats.memory_budget.empty() ? (" of a budget of " + stats.memory_budget).c_str()
                                     : "",
      r.checksum.empty() ? "(skipped)" : r.checksum.c_str());
  std::string text = line;
  if (stats.remote_requests > 0) {
    text += "; remote: " + Plural(stats.remote_requests, "request") + " (" +
            std::to_string(stats.remote_retries) +
            (stats.remote_retries == 1 ? " retry), " : " retries), ") +
            FormatBytes(stats.remote_bytes) + " received";
  }
  if (stats.cache_hits + stats.cache_fills + stats.cache_errors > 0) {
    text += "; cache: " + Plural(stats.cache_hits, "file") + " read from it, " +
            Plural(stats.cache_fills, "file") + " (" + FormatBytes(stats.cache_fill_bytes) +
            ") downloaded into it";
    if (stats.cache_refetch_bytes > 0) {
      text += " (" + FormatBytes(stats.cache_refetch_bytes) +
              " to fetch again after the load: the local disk could not take them in time)";
    }
    // The cache failed them (a full disk, an unwritable directory, a stopped filler): said
    // here, not only in --json's engine_reason.
    if (stats.cache_errors > 0) {
      text += ", " + Plural(stats.cache_errors, "file") +
              " not cached (read from the store): " + stats.cache_error;
    }
  }
  if (stats.verified_tensors > 0 || stats.verify_partial_tensors > 0 ||
      stats.verify_skipped_tensors > 0) {
    text += "; checksums verified: " + Plural(stats.verified_tensors, "tensor");
    if (stats.verify_partial_tensors > 0) {
      text += " and the whole chunks of " + Plural(stats.verify_partial_tensors, "slice");
    }
    text += ", " + FormatBytes(stats.verified_bytes);
    if (stats.verify_skipped_tensors > 0) {
      // Why, as far as the load's settings tell: lazily mapped tensors (mmap without populate,
      // verify auto), or slices holding no whole chunk and tensors read to a device with GDS.
      const bool lazy = stats.engine == "mmap" && !o.populate;
      text += " (" + Plural(stats.verify_skipped_tensors, "tensor") + " not checked: " +
              (lazy ? "mapped lazily (mmap without --populate; --verify on checks them)"
                    : "slices holding no whole chunk, or read to a device with GDS") +
              ")";
    }
  }
  if (o.tensor_parallel) {
    text += "; tp rank " + std::to_string(o.tensor_parallel->rank) + " of " +
            std::to_string(o.tensor_parallel->world) + ": read " + FormatBytes(stats.bytes_read) +
            " of " + FormatBytes(r.total_tensor_bytes);
  }
  if (stats.device_tensors == 0) return text;
  std::snprintf(
      line, sizeof line,
      "device %s: %s in %llu batches; peak device memory %s%s; staged %s, GDS %s "
      "(%s); pinned staging %s",
      stats.device.c_str(), FormatBytes(stats.device_bytes).c_str(),
      static_cast<unsigned long long>(stats.device_batches),
      FormatBytes(stats.peak_device_bytes).c_str(),
      o.device_budget ? (" of a " + FormatBytes(o.device_budget) + " device budget").c_str() : "",
      FormatBytes(stats.staged_bytes).c_str(), FormatBytes(stats.gds_bytes).c_str(),
      stats.gds_reason.empty() ? "every read" : OneLine(stats.gds_reason).c_str(),
      FormatBytes(stats.pinned_bytes).c_str());
  return text + "\n" + line;
}

int RunLoad(const LoadArgs& args) {
  const uint64_t rss_before = ProcStatusBytes("VmRSS:");
  LoadOptions options;
  if (const std::optional<int> invalid = MakeOptions(args, options)) return *invalid;
  auto selection = MakeSelection(args);
  if (!selection.ok())
    return InvalidSetting(Origin::kCommandLine, args.json, args.path, selection.status());
  Runs runs;
  const int64_t open0 = NowNs();
  auto loader = Loader::Open(args.path, options);
  if (!loader.ok()) return Failed(args.json, args.path, loader.status());
  runs.open_seconds = SecondsSince(open0);
  if (!args.layers.empty()) {
    // A layer range that selects nothing is a mistake (a model of fewer layers), not a load.
    auto described = (*loader)->Describe(*selection);
    if (!described.ok()) return Failed(args.json, args.path, described.status());
    if (described->outputs.empty()) {
      return Failed(args.json, args.path,
                    Status(Code::kInvalidArgument,
                           "--layers " + args.layers + " selects no tensor of the checkpoint"));
    }
  }
  std::string explain;
  if (args.explain) {
    auto plan = (*loader)->MakePlan(*selection);
    if (!plan.ok()) return Failed(args.json, args.path, plan.status());
    const LoadStats chosen = (*loader)->stats();  // what Open decided
    std::string head = "engine " + chosen.engine + ": " + chosen.engine_reason;
    if (!chosen.filesystem.empty()) head += "; file system: " + chosen.filesystem;
    explain = head + "\n" + plan->Explain(*(*loader)->checkpoint());
    // With --json, stdout holds the one document only: the plan goes into it.
    if (!args.json && !WriteStdout(explain)) return kExitError;
  }
  if (const Status s = LoadRepeatedly(**loader, *selection, args, runs); !s.ok()) {
    return Failed(args.json, args.path, s);
  }
  // A mapped file that shrank under the tensors (no lease could guard it) left zeros in what was
  // summed: the report would be wrong, so it is the error ("ok": false) instead.
  if (const Status mapped = CheckMappedFiles(); !mapped.ok()) {
    return Failed(args.json, args.path, mapped);
  }
  const LoadStats stats = (*loader)->stats();
  const Report report{args,
                      options,
                      stats,
                      runs,
                      args.no_checksum ? std::string() : CombinedChecksum(runs.sums),
                      (*loader)->checkpoint()->total_tensor_bytes(),
                      rss_before,
                      PeakRss(),
                      args.json ? explain : std::string()};
  return PrintReport(args.json ? JsonReport(report) : TextReport(report));
}

}  // namespace

Command AddLoadCommand(CLI::App& parent) {
  auto args = std::make_shared<LoadArgs>();
  CLI::App* app = parent.add_subcommand(
      "load", "Load a checkpoint into host or GPU memory; print GB/s, peak memory and a checksum");
  AddCheckpointPath(*app, args->path);
  // Load options: each flag is --KEY (with '-' for '_') of LoadOptions::Set, checked there.
  auto option = [&](const std::string& key, const std::string& help) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    OptionFlag& slot = args->options[key];
    slot.flag = flag;
    app->add_option(flag, slot.value, help);
  };
  option("engine", "auto, pread, io_uring or mmap (default auto)");
  option("direct", "O_DIRECT: auto (when the files are not cached), on or off (default auto)");
  option("threads", "I/O threads (default: one per CPU; pread: at least 8)");
  option("queue_depth", "io_uring reads in flight per thread");
  option("chunk_size", "Bytes per read task (default 8MiB)");
  option("budget",
         "Most bytes of tensors held at once (default 0: unbounded, unless the checkpoint exceeds "
         "--memory-limit)");
  option("memory_limit",
         "Host memory the tensors may use without --budget: a size, or off (default: 3/4 of what "
         "this process may use: the memory cgroup's limit and MemAvailable)");
  option("device",
         "Where tensors go: cpu (default), cuda or cuda:N (the checksum is then computed on a copy "
         "back to the host)");
  option("gds", "GPUDirect Storage for --device cuda: auto, on or off");
  option("staging_bytes", "Pinned staging memory for --device cuda (default 64MiB)");
  option("staging_slot", "Bytes per staging slot, i.e. per read and per copy (default 8MiB)");
  option("device_budget", "Most bytes of device batch buffers held at once (default 0: unbounded)");
  option("order", "Delivery order: file or layer");
  option("verify",
         "Check per-tensor checksums (embedded, or tensorferry.checksums.json): auto (when "
         "present), on (required) or off (default auto)");
  option("tp_rank", "Tensor parallelism: this rank (with --tp-size)");
  option("tp_size", "Tensor parallelism: number of ranks");
  // Object storage (s3://, gs:// and http(s):// paths): docs/object_storage.md.
  option("s3_endpoint",
         "S3 endpoint URL (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, profile, AWS; for "
         "gs:// URLs https://storage.googleapis.com)");
  option("s3_region", "S3 region (default: AWS_REGION, profile, us-east-1)");
  option("s3_profile",
         "AWS profile of ~/.aws/credentials and ~/.aws/config (default: AWS_DEFAULT_PROFILE, else "
         "AWS_PROFILE, else \"default\")");
  option("s3_anonymous", "Unsigned S3 requests (public buckets): 1/0");
  option("s3_path_style", "S3 path-style addressing: 1, 0 or auto (auto: path-style off AWS)");
  option("object_concurrency",
         "Ranged GETs in flight (default: 8 when the store is on this host, else 32)");
  option("object_part_size",
         "Bytes per ranged GET (default: 32MiB when the store is on this host, else 8MiB)");
  option("object_retries", "Retries per request after the first (default 6)");
  option("object_timeout_ms", "A request receiving nothing this long is retried (default 30000)");
  option("object_cache_dir",
         "Keep a copy of each remote file in this directory and read it there on later loads "
         "(default: none)");
  option("object_cache_max",
         "Most bytes the cache directory may hold; least recently used files go first "
         "(default 0: unbounded)");
  option("object_cache_write_behind",
         "Memory holding fetched bytes until the cache's writer writes them; what it has no room "
         "for is fetched again after the load (default 32MiB)");
  option("object_cache_fetch_once",
         "Wait for the local disk rather than fetch again what the cache's writer could not "
         "take: 1/0 (default 0)");
  option("object_hub_cache",
         "Keep the files of hf:// paths streamed from the hub in the Hugging Face hub cache, "
         "as `hf download` would: 1/0 (default 1)");
  const auto load_switch = [&](const std::string& key, const std::string& flag, bool& value,
                               const std::string& what) {
    args->switches[key] = {
        app->add_flag(flag, value, what + " (=false: off, over the environment)"), &value};
  };
  load_switch("populate", "--populate", args->populate,
              "mmap engine: read every page during the load");
  load_switch("prefer_mmap", "--prefer-mmap", args->prefer_mmap,
              "--engine auto: map the files when they are on local file systems");
  load_switch("drop_cache", "--drop-cache", args->drop_cache,
              "Drop the files read from the page cache after the load (not with --engine mmap)");
  app->add_flag("--touch", args->touch,
                "Read one byte per page of every tensor; GB/s then counts that time too");
  app->add_option("--repeat", args->repeat,
                  "Load N times with the same loader (later runs reuse its buffers)")
      ->check(CLI::Range(1u, 1000000u));
  app->add_option("--layers", args->layers, "Only layers N or A-B");
  load_switch("allow_oversized", "--allow-oversized", args->allow_oversized,
              "Load a tensor larger than the budget in a batch of its own");
  app->add_flag("--explain", args->explain,
                "Print the read plan first (with --json: as the document's \"explain\" text)");
  app->add_flag("--no-checksum", args->no_checksum, "Skip the checksum");
  app->add_flag("--json", args->json, "Print one JSON document");
  app->add_option("--rules", args->rules,
                  "Shard rules, a JSON file (docs/python.md schema; default: the builtin rules)");
  {
    OptionFlag& gap = args->options["shard_max_gap"];
    gap.flag = "--max-gap";
    app->add_option("--max-gap", gap.value,
                    "Strided slices: gaps up to this size are read and discarded, in every file "
                    "(default: exact strides for files in the page cache, 64KiB for the others; "
                    "0: exact strides)");
  }
  app->footer(
      "Defaults come from the TENSORFERRY_* environment variables when set "
      "(docs/runtime_settings.md).");
  return {app, [args] { return RunLoad(*args); }};
}

}  // namespace tensorferry::cli

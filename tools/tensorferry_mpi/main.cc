// tensorferry-mpi: tensor-parallel loading over MPI, one process per rank (docs/distributed.md).
//
//   mpirun -np 4 tensorferry-mpi load PATH [--mode cooperative|sliced|full]
//          [--shard-rules builtin|none|FILE] (--shard: the same, the former name)
//          [--engine auto|pread|io_uring|mmap] [--direct auto|on|off] [--budget 256MB]
//          [--threads N] [--repeat N] [--cold] [--json] [--checksum]
//          [--exchange auto|all|none] [--storage-rate 2GB] [--network-rate 1.25GB] [--explain]
//          [--timeout-ms 300000]
//
// Modes: cooperative: LoadCooperative; the tensors it exchanges (--exchange: auto, the cost model
// of --storage-rate and --network-rate, bytes per second per host; all; none) are read once, in
// byte-balanced shares, and their slices travel over MPI, the others are read by every rank for
// itself; --explain prints its plan (rank 0) and loads nothing. sliced: every rank reads only its
// own slices from the files, independently (LoadOptions::tensor_parallel); full: every rank reads
// every selected tensor whole (what a tensor-parallel job without sliced loading does). cooperative
// and sliced end with the rank's slices resident in memory; full drops each batch after reading it
// (a lower bound of its cost). Rank 0 prints, per repetition, the wall time (from a common barrier
// to the last rank's end), the bytes every rank read, sent and received; --json one document with
// every repetition. --cold: before each repetition the first rank of every host evicts the
// checkpoint's files from its host's page cache (DropFromPageCache) and checks they are out.
// --checksum: each rank's checksum of its tensors, the one `tensorferry load` prints (CRC32C per
// tensor, combined in name order), so that sliced and cooperative can be compared rank by rank
// (computed after the rank's own clock, inside the wall time; not for full, which keeps nothing).
#include <signal.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tensorferry/cooperative.h"
#include "tensorferry/json.h"
#include "tensorferry/mpi.h"
#include "tensorferry/options.h"
#include "tensorferry/residency.h"
#include "tensorferry/size.h"

// The shared CLI helpers (tools/tensorferry/util.cc, compiled into this tool too).
#include "commands.h"

namespace tensorferry {
namespace {

struct Args {
  std::string path;
  std::string mode = "cooperative";
  std::string shard_rules = "builtin";
  std::string engine;
  std::string direct;
  std::string budget;
  std::string threads;  // empty: TENSORFERRY_THREADS, else one per CPU
  unsigned repeat = 1;
  bool cold = false;
  bool json = false;
  bool checksum = false;     // --checksum: each rank's checksum of its tensors (the `load` one)
  std::string exchange;      // --exchange: LoadOptions key coop_exchange
  std::string storage_rate;  // --storage-rate: coop_storage_rate
  std::string network_rate;  // --network-rate: coop_network_rate
  std::string timeout_ms;    // --timeout-ms: coop_timeout_ms
  bool explain = false;      // --explain: print the cooperative plan, load nothing
};

struct RankFigures {
  double seconds = 0;
  uint64_t bytes = 0;  // bytes this rank ends with
  uint64_t read = 0;
  uint64_t sent = 0;
  uint64_t received = 0;
  double read_seconds = 0;       // cooperative: inside the Loader
  double exchange_seconds = 0;   // cooperative: inside the collectives
  double network_seconds = 0;    // cooperative: of those, inside the rounds' AllToAllv
  double local_seconds = 0;      // cooperative: the local tensors' reads (CooperativeStats)
  uint64_t remote_requests = 0;  // object storage: requests and bytes received (0 for files)
  uint64_t remote_bytes = 0;
  uint64_t checksum = 0;           // with --checksum (sliced, cooperative): CombineTensorSums
  uint64_t exchanged_tensors = 0;  // cooperative: the plan's choice
  uint64_t local_tensors = 0;
  uint64_t measured_network_rate = 0;  // cooperative: the probe's rate (0: none ran)
  double probe_seconds = 0;
};

// The `load` checksum of a rank's tensors (after the load's clock: see --checksum), as a number.
Result<uint64_t> RankChecksum(std::span<const Tensor> tensors) {
  cli::TensorSums sums;
  std::vector<std::byte> staging;
  const Status s = cli::AppendTensorSums(tensors, sums, staging);
  if (!s.ok()) return s;
  return cli::CombineTensorSums(std::move(sums));
}

Result<RankFigures> RunOnce(Collective& c, const std::shared_ptr<const Checkpoint>& checkpoint,
                            const ShardSpec& spec, const LoadOptions& options,
                            const std::string& mode, bool checksum) {
  RankFigures f;
  const auto start = std::chrono::steady_clock::now();
  if (mode == "cooperative") {
    CooperativeStats stats;
    auto tensors = LoadCooperative(checkpoint, Selection::All(), spec, options, c, &stats);
    if (!tensors.ok()) return tensors.status();
    f.bytes = stats.bytes;
    f.read = stats.bytes_read;
    f.sent = stats.bytes_sent;
    f.received = stats.bytes_received;
    f.read_seconds = stats.read_seconds;
    f.exchanged_tensors = stats.exchanged_tensors;
    f.local_tensors = stats.local_tensors;
    f.measured_network_rate = stats.measured_network_rate;
    f.probe_seconds = stats.probe_seconds;
    f.exchange_seconds = stats.exchange_seconds;
    f.network_seconds = stats.network_seconds;
    f.local_seconds = stats.local_seconds;
    f.remote_requests = stats.remote_requests;
    f.remote_bytes = stats.remote_bytes;
    f.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (checksum) {
      auto sum = RankChecksum(*tensors);
      if (!sum.ok()) return sum.status();
      f.checksum = *sum;
    }
    return f;
  } else {
    LoadOptions o = options;
    if (mode == "sliced") {
      o.tensor_parallel = TensorParallelOptions{spec, c.rank(), c.size()};
      o.budget = 0;  // it keeps everything
    }
    auto loader = Loader::Open(checkpoint, o);
    if (!loader.ok()) return loader.status();
    // sliced holds its slices to the end, as cooperative does (the result resident in memory);
    // full drops each batch (holding every tensor whole on every rank would not fit here), so
    // its figure is a lower bound.
    std::vector<Tensor> held;
    Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
      f.bytes += b.bytes;
      if (mode == "sliced") held.insert(held.end(), b.tensors.begin(), b.tensors.end());
      return Status::Ok();
    });
    if (!s.ok()) return s;
    f.read = (*loader)->stats().bytes_read;
    f.remote_requests = (*loader)->stats().remote_requests;
    f.remote_bytes = (*loader)->stats().remote_bytes;
    f.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (checksum && mode == "sliced") {
      auto sum = RankChecksum(held);
      if (!sum.ok()) return sum.status();
      f.checksum = *sum;
    }
  }
  return f;
}

// Defines the `load` subcommand and its options, bound to `args`.
void DefineLoadCommand(CLI::App& app, Args& args) {
  CLI::App* load = app.add_subcommand("load", "Load this rank's slices of a checkpoint");
  load->add_option("path", args.path, "Checkpoint file, directory or index")->required();
  load->add_option("--mode", args.mode, "cooperative | sliced | full")
      ->check(CLI::IsMember({"cooperative", "sliced", "full"}));
  load->add_option("--shard-rules,--shard", args.shard_rules,
                   "builtin | none | a ShardSpec JSON file");
  load->add_option("--engine", args.engine, "auto | pread | io_uring | mmap");
  load->add_option("--direct", args.direct, "auto | on | off");
  load->add_option("--budget", args.budget, "Bytes per rank per round (cooperative) or held");
  load->add_option("--threads", args.threads, "I/O threads per rank (0: one per CPU)");
  load->add_option("--repeat", args.repeat, "Repetitions")->check(CLI::PositiveNumber);
  load->add_flag("--cold", args.cold, "Evict the files from the page cache before each run");
  load->add_flag("--json", args.json, "One JSON document on rank 0's stdout");
  load->add_option("--exchange", args.exchange,
                   "cooperative: which tensors are read once and exchanged: auto (the cost "
                   "model) | all | none");
  load->add_option("--storage-rate", args.storage_rate,
                   "cooperative cost model: bytes per second one host reads (default 2GB)");
  load->add_option("--network-rate", args.network_rate,
                   "cooperative cost model: bytes per second one host receives (default 1.25GB)");
  load->add_option("--timeout-ms", args.timeout_ms,
                   "cooperative: the longest a rank waits for the others in one step before it "
                   "aborts the job naming itself and the step (default 300000; 0: forever)");
  load->add_flag("--explain", args.explain,
                 "cooperative: print the plan (which tensors are exchanged, the estimates) and "
                 "load nothing");
  load->add_flag("--checksum", args.checksum,
                 "Each rank's checksum of its tensors, as `tensorferry load` computes it "
                 "(sliced and cooperative; inside the wall time)");
}

// Prints the error and aborts the job: a rank that fails cannot leave the others waiting in a
// collective.
int Fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

// A setting refused before anything is loaded: its error and the exit code by the CLI's rule
// (commands.h): the command line's is a usage error (2), the environment's a failure (1).
struct Refusal {
  Status status;
  int exit_code = cli::kExitUsage;
};

// The environment's load options with the flags applied and validated, or what refused them.
Result<LoadOptions> ResolveLoadOptions(const Args& args, int& exit_code) {
  exit_code = cli::kExitError;
  auto options_or = LoadOptions::FromEnvironment();
  if (!options_or.ok()) {
    return options_or.status().WithPrefix("TENSORFERRY_* environment variables");
  }
  exit_code = cli::kExitUsage;
  LoadOptions options = *options_or;
  // The flags go through LoadOptions::Set, as every edge's options do (options.h).
  for (const auto& [key, flag, value] :
       {std::tuple{"engine", "--engine", args.engine},
        std::tuple{"direct", "--direct", args.direct},
        std::tuple{"budget", "--budget", args.budget},
        std::tuple{"threads", "--threads", args.threads},
        std::tuple{"coop_exchange", "--exchange", args.exchange},
        std::tuple{"coop_storage_rate", "--storage-rate", args.storage_rate},
        std::tuple{"coop_network_rate", "--network-rate", args.network_rate},
        std::tuple{"coop_timeout_ms", "--timeout-ms", args.timeout_ms}}) {
    if (value.empty()) continue;
    if (Status s = SetContext(options, key, value, flag); !s.ok()) return s;
  }
  if (Status s = options.Validate(); !s.ok()) {
    // The variables' own contradiction, which no flag changed, is the environment's.
    if (const Status alone = options_or->Validate();
        !alone.ok() && alone.message() == s.message()) {
      exit_code = cli::kExitError;
      return alone.WithPrefix("TENSORFERRY_* environment variables");
    }
    return s;
  }
  return options;
}

// What every rank checks before its first collective step: the options, the shard rules, the
// combination of flags. Null when all is well.
std::optional<Refusal> CheckSettings(const Args& args, LoadOptions& options, ShardSpec& spec) {
  if (args.explain && args.mode != "cooperative") {
    return Refusal{
        Status(Code::kInvalidArgument,
               "--explain prints the cooperative mode's plan: not with --mode " + args.mode),
        cli::kExitUsage};
  }
  int exit_code = cli::kExitUsage;
  Result<LoadOptions> resolved = ResolveLoadOptions(args, exit_code);
  if (!resolved.ok()) return Refusal{resolved.status(), exit_code};
  options = std::move(resolved).value();
  Result<ShardSpec> rules = cli::ReadShardRules(args.shard_rules);
  if (!rules.ok()) return Refusal{rules.status().WithPrefix("--shard-rules"), cli::kExitUsage};
  spec = std::move(rules).value();
  return std::nullopt;
}

// Every rank learns whether any refused its settings (the ranks of one job normally agree, but
// each has its own environment) or could not open the checkpoint (a path missing on one host):
// each then ends with the exit code of the first rank that refused, which alone prints its error,
// so that no rank goes on alone into a collective step and the job does not end in MPI_Abort for
// a wrong flag or path. Null when every rank accepted.
std::optional<int> AgreeToGoOn(Collective& group, const std::optional<Refusal>& mine) {
  auto all = group.AllGather(mine ? static_cast<uint64_t>(mine->exit_code) : 0);
  if (!all.ok()) return Fail(all.status());
  for (uint32_t r = 0; r < all->size(); ++r) {
    if ((*all)[r] == 0) continue;
    if (r == group.rank()) {
      std::fprintf(stderr, "error: %s\n", mine->status.ToString().c_str());
      if (mine->exit_code == cli::kExitUsage) {
        std::fprintf(stderr, "Run with --help for more information.\n");
      }
      std::fflush(stderr);
    }
    return static_cast<int>((*all)[r]);
  }
  return std::nullopt;
}

// --cold: the first rank of each host (HostsOfRanks) evicts the files from that host's page cache
// (on separate machines each host has its own); every rank learns whether that worked.
Status EvictIfCold(Collective& group, const Checkpoint& checkpoint, bool cold) {
  if (!cold) return Status::Ok();
  auto hosts = HostsOfRanks(group);
  if (!hosts.ok()) return hosts.status();
  const uint32_t me = group.rank();
  const bool first_of_host =
      std::find((*hosts).begin(), (*hosts).end(), (*hosts)[me]) - (*hosts).begin() == me;
  uint64_t evict_failed = 0;
  if (first_of_host) {
    for (const FileInfo& file : checkpoint.files()) {
      Status s = DropFromPageCache(file.path);
      auto cached = CachedFraction(file.path);
      if (!s.ok() || !cached.ok() || *cached > 0.01) evict_failed = 1;
    }
  }
  auto evicted = group.AllGather(evict_failed);
  if (!evicted.ok()) return evicted.status();
  for (uint32_t r = 0; r < (*evicted).size(); ++r) {
    if ((*evicted)[r] != 0) {
      return Status(Code::kUnsupported, "--cold: the files could not be evicted on rank " +
                                            std::to_string(r) + "'s host");
    }
  }
  return Status::Ok();
}

// Every rank's figures to everyone (microseconds for the times), one column per figure.
Result<std::vector<std::vector<uint64_t>>> GatherFigures(Collective& group,
                                                         const RankFigures& figures) {
  std::vector<std::vector<uint64_t>> columns;
  for (uint64_t v :
       {static_cast<uint64_t>(figures.seconds * 1e6), figures.bytes, figures.read, figures.sent,
        figures.received, static_cast<uint64_t>(figures.read_seconds * 1e6),
        static_cast<uint64_t>(figures.exchange_seconds * 1e6), figures.remote_requests,
        figures.remote_bytes, figures.checksum, figures.exchanged_tensors, figures.local_tensors,
        figures.measured_network_rate, static_cast<uint64_t>(figures.probe_seconds * 1e6),
        static_cast<uint64_t>(figures.network_seconds * 1e6),
        static_cast<uint64_t>(figures.local_seconds * 1e6)}) {
    auto all = group.AllGather(v);
    if (!all.ok()) return all.status();
    columns.push_back(std::move(*all));
  }
  return columns;
}

// Appends one repetition's JSON object to `json`.
void AppendRunJson(std::string& json, unsigned run, double wall, uint64_t total_read,
                   const std::vector<std::vector<uint64_t>>& columns, uint32_t world,
                   bool checksum) {
  json += std::string(run ? ", " : "") + "{\"wall_seconds\": " + std::to_string(wall) +
          ", \"bytes_read_total\": " + std::to_string(total_read) + ", \"per_rank\": [";
  for (uint32_t r = 0; r < world; ++r) {
    json += std::string(r ? ", " : "") + "{\"rank\": " + std::to_string(r) +
            ", \"seconds\": " + std::to_string(static_cast<double>(columns[0][r]) / 1e6) +
            ", \"bytes\": " + std::to_string(columns[1][r]) +
            ", \"bytes_read\": " + std::to_string(columns[2][r]) +
            ", \"bytes_sent\": " + std::to_string(columns[3][r]) +
            ", \"bytes_received\": " + std::to_string(columns[4][r]) +
            ", \"read_seconds\": " + std::to_string(static_cast<double>(columns[5][r]) / 1e6) +
            ", \"exchange_seconds\": " + std::to_string(static_cast<double>(columns[6][r]) / 1e6) +
            ", \"remote_requests\": " + std::to_string(columns[7][r]) +
            ", \"remote_bytes\": " + std::to_string(columns[8][r]) +
            ", \"exchanged_tensors\": " + std::to_string(columns[10][r]) +
            ", \"local_tensors\": " + std::to_string(columns[11][r]) +
            ", \"measured_network_rate\": " + std::to_string(columns[12][r]) +
            ", \"probe_seconds\": " + std::to_string(static_cast<double>(columns[13][r]) / 1e6) +
            ", \"network_seconds\": " + std::to_string(static_cast<double>(columns[14][r]) / 1e6) +
            ", \"local_seconds\": " + std::to_string(static_cast<double>(columns[15][r]) / 1e6);
    if (checksum) json += ", \"checksum\": \"" + cli::ChecksumHex(columns[9][r]) + "\"";
    json += "}";
  }
  json += "]}";
}

// Prints one repetition's summary line and one line per rank.
void PrintRunText(const Args& args, unsigned run, double wall, uint64_t total_read,
                  const std::vector<std::vector<uint64_t>>& columns, uint32_t world) {
  std::printf("run %u: %s, %u ranks%s: %.3f s wall, %s read in all (%.2f GB/s)\n", run + 1,
              args.mode.c_str(), world, args.cold ? ", cold" : "", wall,
              FormatBytes(total_read).c_str(), static_cast<double>(total_read) / wall / 1e9);
  for (uint32_t r = 0; r < world; ++r) {
    std::printf(
        "  rank %u: %.3f s (reads %.3f s, exchange %.3f s), slices %s, read %s, sent %s, "
        "received %s%s%s\n",
        r, static_cast<double>(columns[0][r]) / 1e6, static_cast<double>(columns[5][r]) / 1e6,
        static_cast<double>(columns[6][r]) / 1e6, FormatBytes(columns[1][r]).c_str(),
        FormatBytes(columns[2][r]).c_str(), FormatBytes(columns[3][r]).c_str(),
        FormatBytes(columns[4][r]).c_str(),
        args.mode == "cooperative"
            ? (", " + std::to_string(columns[10][r]) + " tensors exchanged, " +
               std::to_string(columns[11][r]) + " local")
                  .c_str()
            : "",
        args.checksum && args.mode != "full"
            ? (", checksum " + cli::ChecksumHex(columns[9][r])).c_str()
            : "");
  }
}

// One repetition: evict if cold, load between two barriers, gather and report the figures (rank
// 0 prints, or appends to `json` with --json).
Status RunRepetition(Collective& group, CollectiveWatchdog& watchdog,
                     const std::shared_ptr<const Checkpoint>& checkpoint, const ShardSpec& spec,
                     const LoadOptions& options, const Args& args, unsigned run,
                     std::string& json) {
  const uint32_t world = group.size();
  const bool root = group.rank() == 0;
  const std::string repetition = "repetition " + std::to_string(run + 1);
  Status s = watchdog.Watch(repetition + " (start)", [&] {
    Status evicted = EvictIfCold(group, *checkpoint, args.cold);
    return evicted.ok() ? group.Barrier() : evicted;
  });
  if (!s.ok()) return s;
  const auto start = std::chrono::steady_clock::now();
  auto figures = RunOnce(group, checkpoint, spec, options, args.mode, args.checksum);
  if (!figures.ok()) return figures.status();
  s = watchdog.Watch(repetition + " (end of the load)", [&] { return group.Barrier(); });
  if (!s.ok()) return s;
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto columns = watchdog.Watch(repetition + " (gathering the figures)",
                                [&] { return GatherFigures(group, *figures); });
  if (!columns.ok()) return columns.status();
  uint64_t total_read = 0;
  for (uint64_t v : (*columns)[2]) total_read += v;
  if (!root) return Status::Ok();
  if (args.json) {
    AppendRunJson(json, run, wall, total_read, *columns, world,
                  args.checksum && args.mode != "full");
  } else {
    PrintRunText(args, run, wall, total_read, *columns, world);
    std::fflush(stdout);  // each repetition as it ends (through mpirun's output forwarding)
  }
  return Status::Ok();
}

int Main(int argc, char** argv) {
  CLI::App app("tensorferry-mpi: tensor-parallel loading over MPI (run under mpirun)");
  app.require_subcommand(1);
  Args args;
  DefineLoadCommand(app, args);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) app.exit(e);
    return e.get_exit_code() == 0 ? 0 : 2;
  }

  auto c = MpiCollective::Create(MPI_COMM_WORLD);
  if (!c.ok()) return Fail(c.status());
  Collective& group = **c;
  LoadOptions load_options;
  ShardSpec rules;
  if (const std::optional<int> refused =
          AgreeToGoOn(group, CheckSettings(args, load_options, rules))) {
    return *refused;
  }
  // With the object-store settings of the environment, as `tensorferry load` opens a URL.
  auto checkpoint = cli::OpenCheckpoint(args.path);
  if (const std::optional<int> refused = AgreeToGoOn(
          group, checkpoint.ok() ? std::nullopt
                                 : std::optional<Refusal>(Refusal{checkpoint.status(), 1}))) {
    return *refused;
  }

  // The tool's own collective steps (the load's are watched inside LoadCooperative).
  CollectiveWatchdog watchdog(group, load_options.cooperative.timeout_ms, "tensorferry-mpi");
  const uint32_t world = group.size();
  const bool root = group.rank() == 0;
  if (root) {  // a misspelt setting (TENSORFERRY_BUGDET) would otherwise be ignored silently
    for (const std::string& unknown : UnknownEnvironmentVariables()) {
      std::fprintf(stderr, "tensorferry-mpi: warning: %s\n", unknown.c_str());
    }
  }
  std::string json = "{\"mode\": \"" + args.mode + "\", \"ranks\": " + std::to_string(world) +
                     ", \"cold\": " + (args.cold ? "true" : "false");
  if (args.mode == "cooperative" || args.explain) {
    // The plan every rank will make (LoadCooperative makes the same one itself).
    auto hosts = watchdog.Watch("the start (learning every rank's host)",
                                [&] { return HostsOfRanks(group); });
    if (!hosts.ok()) return Fail(hosts.status());
    // With the network rate measured as LoadCooperative measures it (each load measures again).
    NetworkMeasurement measured;
    auto planned = watchdog.Watch("the network probe", [&] {
      return WithMeasuredNetworkRate(group, *hosts, load_options, &measured);
    });
    if (!planned.ok()) return Fail(planned.status());
    auto plan =
        PlanCooperative(**checkpoint, Selection::All(), rules, *planned, *hosts, measured.seconds);
    if (!plan.ok()) return Fail(plan.status());
    if (args.explain && !args.json) {
      if (root) std::printf("%s", plan->ToString(**checkpoint).c_str());
      return 0;
    }
    uint64_t split = 0;  // tensors split among the readers by rows
    for (const CooperativeTensorPlan& t : plan->tensors) split += t.readers > 1 ? 1 : 0;
    json += ", \"hosts\": " + std::to_string(plan->hosts) +
            ", \"rounds\": " + std::to_string(plan->rounds) +
            ", \"split_tensors\": " + std::to_string(split) + ", \"exchange\": \"" +
            std::string(ExchangeChoiceName(plan->choice)) +
            "\", \"storage_rate\": " + std::to_string(plan->storage_rate) +
            ", \"network_rate\": " + std::to_string(plan->network_rate) +
            ", \"network_rate_measured\": " + (measured.rate > 0 ? "true" : "false") +
            ", \"probe_seconds\": " + std::to_string(plan->probe_seconds) + ", \"estimate\": {";
    const std::pair<const char*, const CooperativePlan::Estimate*> estimates[] = {
        {"chosen", &plan->chosen},
        {"all_local", &plan->all_local},
        {"all_exchanged", &plan->all_exchanged}};
    for (size_t i = 0; i < 3; ++i) {
      const auto& [name, e] = estimates[i];
      json += std::string(i ? ", " : "") + "\"" + name +
              "\": {\"seconds\": " + std::to_string(e->seconds) +
              ", \"read\": " + std::to_string(e->read) +
              ", \"network\": " + std::to_string(e->network) + "}";
    }
    json += "}";
    if (args.explain) {  // with --json: the plan's text in the document, nothing loaded
      if (root) {
        json += ", \"explain\": ";
        AppendJsonString(json, plan->ToString(**checkpoint), InvalidUtf8::kReplace);
        std::printf("%s}\n", json.c_str());
      }
      return 0;
    }
  }
  json += ", \"runs\": [";
  for (unsigned run = 0; run < args.repeat; ++run) {
    Status s = RunRepetition(group, watchdog, *checkpoint, rules, load_options, args, run, json);
    if (!s.ok()) return Fail(s);
  }
  if (root && args.json) std::printf("%s]}\n", json.c_str());
  return 0;
}

}  // namespace
}  // namespace tensorferry

int main(int argc, char** argv) {
  // A file past the file-size limit (an object cache's copy) fails its write with EFBIG, and
  // is removed, instead of SIGXFSZ killing the rank.
  ::signal(SIGXFSZ, SIG_IGN);
  // MPI_THREAD_MULTIPLE: the watchdog (coop_timeout_ms) calls MPI_Abort from its own thread while
  // the main thread waits in a collective (MpiCollective::Abort ends the rank itself below it).
  int provided = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int rc = tensorferry::Main(argc, argv);
  MPI_Finalize();
  return rc;
}

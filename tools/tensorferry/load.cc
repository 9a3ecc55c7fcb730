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
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/device.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"

namespace tensorferry::cli {
namespace {

// Options left empty keep the defaults of LoadOptions::FromEnvironment() (TENSORFERRY_* variables,
// else the library's defaults).
struct LoadArgs {
  std::string path;
  std::string threads;
  std::string chunk_size;
  std::string budget;
  std::string order;
  std::string engine;
  std::string direct;
  std::string queue_depth;
  std::string device;
  std::string gds;
  std::string staging_bytes;
  std::string staging_slot;
  std::string device_budget;
  bool populate = false;
  bool touch = false;
  unsigned repeat = 1;
  std::string layers;  // "A-B"
  bool allow_oversized = false;
  bool explain = false;
  bool json = false;
  bool no_checksum = false;
  // Tensor parallelism: --tp-rank/--tp-size with the builtin rules or --rules FILE.
  int tp_rank = -1;
  unsigned tp_size = 0;
  std::string rules;
  std::string max_gap;
};

// --- CRC32C (Castagnoli), hardware when the CPU has SSE4.2
// ----------------------------------------

uint32_t Crc32cSoftware(uint32_t crc, const unsigned char* p, size_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc, const unsigned char* p,
                                                          size_t n) {
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
}
#endif

uint32_t Crc32c(const std::byte* data, size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw) return Crc32cHardware(0, p, n);
#endif
  return Crc32cSoftware(0, p, n);
}

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

Result<unsigned> ParseCount(const std::string& flag, const std::string& text) {
  unsigned long v = 0;
  if (text.empty() || text.size() > 6 ||
      text.find_first_not_of("0123456789") != std::string::npos) {
    return Status(Code::kInvalidArgument, flag + ": not a count: " + text);
  }
  v = std::stoul(text);
  return static_cast<unsigned>(v);
}

Result<LoadOptions> MakeOptions(const LoadArgs& a) {
  auto seeded = LoadOptions::FromEnvironment();
  if (!seeded.ok()) return seeded.status();
  LoadOptions o = *seeded;
  if (!a.threads.empty()) {
    auto n = ParseCount("--threads", a.threads);
    if (!n.ok()) return n.status();
    o.threads = *n;
  }
  if (!a.chunk_size.empty()) {
    auto chunk = ParseSize(a.chunk_size);
    if (!chunk || *chunk == 0) {
      return Status(Code::kInvalidArgument, "--chunk-size: not a size: " + a.chunk_size);
    }
    o.chunk_size = *chunk;
  }
  if (!a.budget.empty()) {
    auto budget = ParseSize(a.budget);
    if (!budget) return Status(Code::kInvalidArgument, "--budget: not a size: " + a.budget);
    o.budget = *budget;
  }
  if (!a.engine.empty()) {
    auto e = ParseEngine(a.engine);
    if (!e.ok()) return Status(Code::kInvalidArgument, "--engine: " + e.status().message());
    o.engine = *e;
  }
  if (!a.direct.empty()) {
    auto d = ParseDirectIO(a.direct);
    if (!d.ok()) return Status(Code::kInvalidArgument, "--direct: " + d.status().message());
    o.direct = *d;
  }
  if (!a.queue_depth.empty()) {
    auto n = ParseCount("--queue-depth", a.queue_depth);
    if (!n.ok()) return n.status();
    if (*n == 0) return Status(Code::kInvalidArgument, "--queue-depth must be > 0");
    o.queue_depth = *n;
  }
  if (!a.device.empty()) {
    auto d = ParseDevice(a.device);
    if (!d.ok()) return Status(Code::kInvalidArgument, "--device: " + d.status().message());
    o.device = *d;
  }
  if (!a.gds.empty()) {
    auto g = ParseGdsMode(a.gds);
    if (!g.ok()) return Status(Code::kInvalidArgument, "--gds: " + g.status().message());
    o.gds = *g;
  }
  if (!a.staging_bytes.empty()) {
    auto v = ParseSize(a.staging_bytes);
    if (!v || *v == 0) {
      return Status(Code::kInvalidArgument, "--staging-bytes: not a size: " + a.staging_bytes);
    }
    o.staging_bytes = *v;
  }
  if (!a.staging_slot.empty()) {
    auto v = ParseSize(a.staging_slot);
    if (!v || *v == 0) {
      return Status(Code::kInvalidArgument, "--staging-slot: not a size: " + a.staging_slot);
    }
    o.staging_slot = *v;
  }
  if (!a.device_budget.empty()) {
    auto v = ParseSize(a.device_budget);
    if (!v)
      return Status(Code::kInvalidArgument, "--device-budget: not a size: " + a.device_budget);
    o.device_budget = *v;
  }
  if (a.populate) o.populate = true;
  if (a.allow_oversized) o.allow_oversized = true;
  if (!a.order.empty()) o.order = a.order == "layer" ? DeliveryOrder::kLayer : DeliveryOrder::kFile;
  if (a.tp_size > 0 || a.tp_rank >= 0 || !a.rules.empty() || !a.max_gap.empty()) {
    if (a.tp_size == 0 || a.tp_rank < 0) {
      return Status(Code::kInvalidArgument, "--tp-rank and --tp-size go together");
    }
    if (static_cast<unsigned>(a.tp_rank) >= a.tp_size) {
      return Status(Code::kInvalidArgument, "--tp-rank " + std::to_string(a.tp_rank) +
                                                " is not below --tp-size " +
                                                std::to_string(a.tp_size));
    }
    TensorParallelOptions tp;
    tp.rank = static_cast<uint32_t>(a.tp_rank);
    tp.world = a.tp_size;
    tp.spec = ShardSpec::Builtin();
    if (!a.rules.empty()) {
      auto spec = ReadShardRules(a.rules);
      if (!spec.ok()) return spec.status();
      tp.spec = std::move(spec).value();
    }
    if (!a.max_gap.empty()) {
      auto gap = ParseSize(a.max_gap);
      if (!gap) return Status(Code::kInvalidArgument, "--max-gap: not a size: " + a.max_gap);
      tp.max_gap = *gap;
      tp.exact_when_cached = false;  // an explicit gap applies to every file
    }
    o.shard = std::move(tp);
  }
  return o;
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

int RunLoad(const LoadArgs& args) {
  const uint64_t rss_before = ProcStatusBytes("VmRSS:");
  auto options = MakeOptions(args);
  if (!options.ok()) {
    PrintError(options.status().message());
    return kExitUsage;
  }
  auto selection = MakeSelection(args);
  if (!selection.ok()) {
    PrintError(selection.status().message());
    return kExitUsage;
  }
  auto loader = Loader::Open(args.path, *options);
  if (!loader.ok()) {
    PrintError(args.path, loader.status());
    return kExitError;
  }
  if (args.explain) {
    auto plan = (*loader)->MakePlan(*selection);
    if (!plan.ok()) {
      PrintError(args.path, plan.status());
      return kExitError;
    }
    if (!WriteStdout(plan->Explain(*(*loader)->checkpoint()))) return kExitError;
  }

  // --repeat: the same loader loads again; later runs reuse the pooled buffers of earlier ones
  // (the warm, reused-memory case), the first pays for fresh memory.
  std::vector<std::pair<std::string, uint32_t>> sums;
  double checksum_seconds = 0;
  std::vector<double> runs;
  double wall_seconds = 0;
  volatile unsigned char sink = 0;
  std::vector<std::byte> staging;  // device tensors are copied back here to be checksummed
  for (unsigned run = 0; run < args.repeat; ++run) {
    sums.clear();
    const int64_t wall0 = NowNs();
    const Status status = (*loader)->Stream(*selection, [&](Batch batch) -> Status {
      if (batch.device.is_cuda()) {
        if (args.no_checksum) return Status::Ok();
        const int64_t t0 = NowNs();
        for (const Tensor& t : batch.tensors) {
          if (staging.size() < t.size()) staging.resize(t.size());
          const std::span<std::byte> host(staging.data(), t.size());
          const Status copied = CopyToHost(t.device(), t.data(), host);
          if (!copied.ok()) return copied;
          sums.emplace_back(t.name(), Crc32c(host.data(), host.size()));
        }
        checksum_seconds += SecondsSince(t0);
        return Status::Ok();
      }
      if (args.touch) {
        // One byte per page of every tensor, as a user of lazily mapped tensors would pay.
        unsigned char x = 0;
        for (const Tensor& t : batch.tensors) {
          const auto* p = reinterpret_cast<const unsigned char*>(t.data());
          for (uint64_t i = 0; i < t.size(); i += 4096) x ^= p[i];
        }
        sink = sink ^ x;
      }
      if (!args.no_checksum) {
        const int64_t t0 = NowNs();
        for (const Tensor& t : batch.tensors) {
          sums.emplace_back(t.name(), Crc32c(t.data(), t.size()));
        }
        checksum_seconds += SecondsSince(t0);
      }
      return Status::Ok();
    });
    if (!status.ok()) {
      PrintError(args.path, status);
      return kExitError;
    }
    wall_seconds = SecondsSince(wall0);
    const LoadStats s = (*loader)->stats();
    // With --touch the figure is wall time (the touching is part of the load); otherwise the
    // loader's own time (the checksum callback excluded).
    const double secs = args.touch ? wall_seconds : s.seconds;
    runs.push_back(secs > 0 ? static_cast<double>(s.bytes) / secs / 1e9 : 0);
  }
  const LoadStats stats = (*loader)->stats();
  std::sort(sums.begin(), sums.end());
  uint64_t combined = 0xcbf29ce484222325ull;  // FNV-1a over (name, crc) in name order
  for (const auto& [name, crc] : sums) {
    for (unsigned char c : name) combined = (combined ^ c) * 0x100000001b3ull;
    for (int i = 0; i < 4; ++i)
      combined = (combined ^ ((crc >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  }
  char checksum[32];
  std::snprintf(checksum, sizeof checksum, "%016llx", static_cast<unsigned long long>(combined));
  const double gbps =
      stats.seconds > 0 ? static_cast<double>(stats.bytes) / stats.seconds / 1e9 : 0;
  const uint64_t peak_rss = PeakRss();

  if (args.json) {
    JsonOut j;
    j.BeginObject()
        .Field("path", args.path)
        .Field("tensors", stats.tensors)
        .Field("bytes", stats.bytes)
        .Field("batches", stats.batches)
        .Field("seconds", stats.seconds)
        .Field("wall_seconds", wall_seconds)
        .Field("gb_per_s", gbps)
        .Field("budget", options->budget)
        .Field("peak_budget_bytes", stats.peak_budget_bytes)
        .Field("peak_rss_bytes", peak_rss)
        .Field("buffers_reused", stats.buffers_reused)
        .Field("buffers_allocated", stats.buffers_allocated)
        .Field("engine", stats.engine)
        .Field("direct_files", stats.direct_files)
        .Field("buffered_files", stats.buffered_files)
        .Field("direct_bytes", stats.direct_bytes)
        .Field("bytes_read", stats.bytes_read)
        .Field("tp_rank", options->shard ? uint64_t{options->shard->rank} : uint64_t{0})
        .Field("tp_size", options->shard ? uint64_t{options->shard->world} : uint64_t{1})
        .Field("rss_before_bytes", rss_before)
        .Field("device", stats.device)
        .Field("device_tensors", stats.device_tensors)
        .Field("device_bytes", stats.device_bytes)
        .Field("device_batches", stats.device_batches)
        .Field("device_buffer_bytes", stats.device_buffer_bytes)
        .Field("device_budget", options->device_budget)
        .Field("peak_device_bytes", stats.peak_device_bytes)
        .Field("staged_bytes", stats.staged_bytes)
        .Field("gds", GdsModeName(options->gds))
        .Field("gds_bytes", stats.gds_bytes)
        .Field("gds_reason", stats.gds_reason)
        .Field("pinned_bytes", stats.pinned_bytes)
        .Key("runs_gb_per_s")
        .BeginArray();
    for (double r : runs) j.Double(r);
    j.EndArray()
        .Field("checksum", args.no_checksum ? std::string_view("") : std::string_view(checksum))
        .Field("checksum_seconds", checksum_seconds)
        .EndObject();
    return WriteStdout(j.str()) ? kExitOk : kExitError;
  }
  char line[512];
  std::snprintf(
      line, sizeof line,
      "loaded %s in %s: %s in %.3f s (%.2f GB/s, %s%s); peak RSS %s; peak held %s%s; "
      "checksum %s",
      Plural(stats.tensors, "tensor").c_str(),
      (std::to_string(stats.batches) + (stats.batches == 1 ? " batch" : " batches")).c_str(),
      FormatBytes(stats.bytes).c_str(), stats.seconds, gbps, stats.engine.c_str(),
      stats.direct_files ? (", O_DIRECT on " + Plural(stats.direct_files, "file")).c_str() : "",
      FormatBytes(peak_rss).c_str(), FormatBytes(stats.peak_budget_bytes).c_str(),
      options->budget ? (" of a " + FormatBytes(options->budget) + " budget").c_str() : "",
      args.no_checksum ? "(skipped)" : checksum);
  std::string text = line;
  if (options->shard) {
    text += "; tp rank " + std::to_string(options->shard->rank) + " of " +
            std::to_string(options->shard->world) + ": read " + FormatBytes(stats.bytes_read) +
            " of " + FormatBytes((*loader)->checkpoint()->total_tensor_bytes());
  }
  if (!WriteStdout(text)) return kExitError;
  if (stats.device_tensors > 0) {
    std::snprintf(line, sizeof line,
                  "device %s: %s in %llu batches; peak device memory %s%s; staged %s, GDS %s "
                  "(%s); pinned staging %s",
                  stats.device.c_str(), FormatBytes(stats.device_bytes).c_str(),
                  static_cast<unsigned long long>(stats.device_batches),
                  FormatBytes(stats.peak_device_bytes).c_str(),
                  options->device_budget
                      ? (" of a " + FormatBytes(options->device_budget) + " device budget").c_str()
                      : "",
                  FormatBytes(stats.staged_bytes).c_str(), FormatBytes(stats.gds_bytes).c_str(),
                  stats.gds_reason.empty() ? "every read" : OneLine(stats.gds_reason).c_str(),
                  FormatBytes(stats.pinned_bytes).c_str());
    if (!WriteStdout(line)) return kExitError;
  }
  return kExitOk;
}

}  // namespace

Command AddLoadCommand(CLI::App& parent) {
  auto args = std::make_shared<LoadArgs>();
  CLI::App* app = parent.add_subcommand(
      "load", "Load a checkpoint into host or GPU memory; print GB/s, peak memory and a checksum");
  app->add_option("path", args->path, "A .safetensors file, a checkpoint directory or an index")
      ->required();
  app->add_option("--engine", args->engine, "auto, pread, io_uring or mmap (default auto)");
  app->add_option("--direct", args->direct,
                  "O_DIRECT: auto (when the files are not cached), on or off (default auto)");
  app->add_option("--threads", args->threads, "I/O threads (default: one per CPU)");
  app->add_option("--queue-depth", args->queue_depth, "io_uring reads in flight per thread");
  app->add_option("--chunk-size", args->chunk_size, "Bytes per read task (default 8MiB)");
  app->add_option("--budget", args->budget,
                  "Most bytes of tensors held at once (default 0: unbounded)");
  app->add_option("--device", args->device,
                  "Where tensors go: cpu (default), cuda or cuda:N (the checksum is then computed "
                  "on a copy back to the host)");
  app->add_option("--gds", args->gds, "GPUDirect Storage for --device cuda: auto, on or off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app->add_option("--staging-bytes", args->staging_bytes,
                  "Pinned staging memory for --device cuda (default 64MiB)");
  app->add_option("--staging-slot", args->staging_slot,
                  "Bytes per staging slot, i.e. per read and per copy (default 8MiB)");
  app->add_option("--device-budget", args->device_budget,
                  "Most bytes of device batch buffers held at once (default 0: unbounded)");
  app->add_flag("--populate", args->populate, "mmap engine: read every page during the load");
  app->add_flag("--touch", args->touch,
                "Read one byte per page of every tensor; GB/s then counts that time too");
  app->add_option("--repeat", args->repeat,
                  "Load N times with the same loader (later runs reuse its buffers)")
      ->check(CLI::PositiveNumber);
  app->add_option("--order", args->order, "Delivery order: file or layer")
      ->check(CLI::IsMember({"file", "layer"}));
  app->add_option("--layers", args->layers, "Only layers N or A-B");
  app->add_flag("--allow-oversized", args->allow_oversized,
                "Load a tensor larger than the budget in a batch of its own");
  app->add_flag("--explain", args->explain, "Print the read plan first");
  app->add_flag("--no-checksum", args->no_checksum, "Skip the checksum");
  app->add_flag("--json", args->json, "Print one JSON document");
  app->add_option("--tp-rank", args->tp_rank, "Tensor parallelism: this rank (with --tp-size)");
  app->add_option("--tp-size", args->tp_size, "Tensor parallelism: number of ranks");
  app->add_option("--rules", args->rules,
                  "Shard rules, a JSON file (docs/python.md schema; default: the builtin rules)");
  app->add_option("--max-gap", args->max_gap,
                  "Strided slices: gaps up to this size are read and discarded, in every file "
                  "(default: exact strides for files in the page cache, 64KiB for the others; "
                  "0: exact strides)");
  app->footer(
      "Defaults come from the TENSORFERRY_* environment variables when set "
      "(docs/runtime_settings.md).");
  return {app, [args] { return RunLoad(*args); }};
}

}  // namespace tensorferry::cli

// tensorferry load PATH: loads the tensors of a checkpoint into host memory with the Loader, batch
// by batch under an optional budget, and prints the throughput, the peak resident memory of the
// process and a checksum of the loaded bytes (CRC32C per tensor, combined in name order, so the
// same tensors give the same checksum whatever the engine, batching or budget).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/loader.h"

namespace tensorferry::cli {
namespace {

struct LoadArgs {
  std::string path;
  unsigned threads = 0;
  std::string chunk_size = "8MiB";
  std::string budget = "0";
  std::string order = "file";
  std::string layers;  // "A-B"
  bool allow_oversized = false;
  bool explain = false;
  bool json = false;
  bool no_checksum = false;
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
uint64_t PeakRss() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

Result<LoadOptions> MakeOptions(const LoadArgs& a) {
  LoadOptions o;
  o.threads = a.threads;
  auto chunk = ParseSize(a.chunk_size);
  if (!chunk || *chunk == 0)
    return Status(Code::kInvalidArgument, "--chunk-size: not a size: " + a.chunk_size);
  o.chunk_size = *chunk;
  auto budget = ParseSize(a.budget);
  if (!budget) return Status(Code::kInvalidArgument, "--budget: not a size: " + a.budget);
  o.budget = *budget;
  o.allow_oversized = a.allow_oversized;
  o.order = a.order == "layer" ? DeliveryOrder::kLayer : DeliveryOrder::kFile;
  return o;
}

Result<Selection> MakeSelection(const LoadArgs& a) {
  if (a.layers.empty()) return Selection::All();
  unsigned first = 0, last = 0;
  char dash = 0;
  if (std::sscanf(a.layers.c_str(), "%u%c%u", &first, &dash, &last) == 3 && dash == '-' &&
      first <= last) {
    return Selection::Layers(first, last);
  }
  if (std::sscanf(a.layers.c_str(), "%u", &first) == 1) return Selection::Layers(first, first);
  return Status(Code::kInvalidArgument, "--layers: expected N or A-B, got " + a.layers);
}

int RunLoad(const LoadArgs& args) {
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

  std::vector<std::pair<std::string, uint32_t>> sums;
  double checksum_seconds = 0;
  const Status status = (*loader)->Stream(*selection, [&](Batch batch) {
    if (!args.no_checksum) {
      const int64_t t0 = NowNs();
      for (const Tensor& t : batch.tensors) sums.emplace_back(t.name(), Crc32c(t.data(), t.size()));
      checksum_seconds += SecondsSince(t0);
    }
    return Status::Ok();
  });
  if (!status.ok()) {
    PrintError(args.path, status);
    return kExitError;
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
        .Field("gb_per_s", gbps)
        .Field("budget", options->budget)
        .Field("peak_budget_bytes", stats.peak_budget_bytes)
        .Field("peak_rss_bytes", peak_rss)
        .Field("buffers_reused", stats.buffers_reused)
        .Field("buffers_allocated", stats.buffers_allocated)
        .Field("checksum", args.no_checksum ? std::string_view("") : std::string_view(checksum))
        .Field("checksum_seconds", checksum_seconds)
        .EndObject();
    return WriteStdout(j.str()) ? kExitOk : kExitError;
  }
  char line[512];
  std::snprintf(
      line, sizeof line,
      "loaded %s in %s: %s in %.3f s (%.2f GB/s); peak RSS %s; peak held %s%s; "
      "checksum %s",
      Plural(stats.tensors, "tensor").c_str(),
      (std::to_string(stats.batches) + (stats.batches == 1 ? " batch" : " batches")).c_str(),
      FormatBytes(stats.bytes).c_str(), stats.seconds, gbps, FormatBytes(peak_rss).c_str(),
      FormatBytes(stats.peak_budget_bytes).c_str(),
      options->budget ? (" of a " + FormatBytes(options->budget) + " budget").c_str() : "",
      args.no_checksum ? "(skipped)" : checksum);
  return WriteStdout(line) ? kExitOk : kExitError;
}

}  // namespace

Command AddLoadCommand(CLI::App& parent) {
  auto args = std::make_shared<LoadArgs>();
  CLI::App* app = parent.add_subcommand(
      "load", "Load a checkpoint into host memory; print GB/s, peak memory and a checksum");
  app->add_option("path", args->path, "A .safetensors file, a checkpoint directory or an index")
      ->required();
  app->add_option("--threads", args->threads, "I/O threads (default: one per CPU)");
  app->add_option("--chunk-size", args->chunk_size, "Bytes per read task (default 8MiB)");
  app->add_option("--budget", args->budget,
                  "Most bytes of tensors held at once (default 0: unbounded)");
  app->add_option("--order", args->order, "Delivery order: file or layer")
      ->check(CLI::IsMember({"file", "layer"}));
  app->add_option("--layers", args->layers, "Only layers N or A-B");
  app->add_flag("--allow-oversized", args->allow_oversized,
                "Load a tensor larger than the budget in a batch of its own");
  app->add_flag("--explain", args->explain, "Print the read plan first");
  app->add_flag("--no-checksum", args->no_checksum, "Skip the checksum");
  app->add_flag("--json", args->json, "Print one JSON document");
  return {app, [args] { return RunLoad(*args); }};
}

}  // namespace tensorferry::cli

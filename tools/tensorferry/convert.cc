// tensorferry convert SRC DST: converts a PyTorch checkpoint (torch.save zip or legacy file,
// pytorch_model.bin.index.json, or a directory with either) to safetensors without running its
// pickle (convert.h). --verify then re-reads both sides and compares every tensor byte for byte.
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/convert.h"

namespace tensorferry::cli {
namespace {

constexpr size_t kMaxListed = 20;  // aliases/skipped entries printed in text mode

struct ConvertArgs {
  std::string src;
  std::string dst;
  std::string max_shard_size;
  bool verify = false;
  bool skip_values = false;
  bool no_sync = false;
  bool json = false;
};

void ListPairs(std::string& out, const char* label,
               const std::vector<std::pair<std::string, std::string>>& items, const char* sep) {
  for (size_t i = 0; i < items.size() && i < kMaxListed; ++i) {
    out += "\n  ";
    out += label;
    out += ": ";
    out += OneLine(items[i].first);
    out += sep;
    out += OneLine(items[i].second);
  }
  if (items.size() > kMaxListed) {
    out += "\n  ... and " + std::to_string(items.size() - kMaxListed) + " more " + label;
  }
}

void JsonPairs(JsonOut& j, std::string_view key, std::string_view first, std::string_view second,
               const std::vector<std::pair<std::string, std::string>>& items) {
  j.Key(key).BeginArray();
  for (const auto& [a, b] : items) j.BeginObject().Field(first, a).Field(second, b).EndObject();
  j.EndArray();
}

int RunConvert(const ConvertArgs& args) {
  ConvertOptions options;
  if (!args.max_shard_size.empty()) options.max_shard_size = *ParseSize(args.max_shard_size);
  options.keep_values = !args.skip_values;
  options.write.sync = !args.no_sync;

  const int64_t start = NowNs();
  Result<ConvertReport> report = ConvertTorchCheckpoint(args.src, args.dst, options);
  const double seconds = SecondsSince(start);
  Status status = report.status();
  Result<VerifyConversionReport> verified = Status(Code::kInternal, "not verified");
  double verify_seconds = 0;
  if (status.ok() && args.verify) {
    const int64_t vstart = NowNs();
    verified = VerifyConversion(args.src, args.dst, options);
    verify_seconds = SecondsSince(vstart);
    status = verified.status();
  }
  // Errors about the output name the destination; the rest the source.
  const std::string& error_path = report.ok() ? args.dst : SubjectOf(status, args.src, args.dst);
  const double gbps =
      report.ok() && seconds > 0 ? static_cast<double>(report->source_bytes) / seconds / 1e9 : 0;

  if (args.json) {
    JsonOut j;
    j.BeginObject()
        .Field("src", Shown(args.src))
        .Field("dst", Shown(args.dst))
        .Field("ok", status.ok());
    if (report.ok()) {
      const ConvertReport& r = *report;
      j.Key("outputs").BeginArray();
      for (const auto& o : r.outputs) j.String(o);
      j.EndArray();
      j.Field("sharded", r.sharded)
          .Field("tensors", r.tensors)
          .Field("tensor_bytes", r.tensor_bytes)
          .Field("source_bytes", r.source_bytes)
          .Field("seconds", seconds)
          .Field("gb_per_s", gbps);
      JsonPairs(j, "aliases", "name", "of", r.aliases);
      JsonPairs(j, "copied_views", "name", "why", r.copied_views);
      JsonPairs(j, "values", "name", "text", r.kept_values);
      JsonPairs(j, "skipped", "name", "why", r.skipped);
      if (args.verify && verified.ok()) {
        j.Key("verify")
            .BeginObject()
            .Field("tensors", verified->tensors)
            .Field("bytes", verified->bytes)
            .Field("seconds", verify_seconds)
            .EndObject();
      }
    }
    if (!status.ok()) JsonError(j, error_path, status);
    j.EndObject();
    return PrintReport(j.str(), status);
  }

  if (!status.ok()) {
    PrintError(error_path, status);
    return kExitError;
  }
  const ConvertReport& r = *report;
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.2f s (%.2f GB/s)", seconds, gbps);
  std::string out = "ok: " + Plural(r.tensors, "tensor") + ", " + FormatBytes(r.tensor_bytes) +
                    " written to " + Plural(r.outputs.size(), "file") + " in " + rate;
  out += "; " + std::to_string(r.aliases.size()) +
         (r.aliases.size() == 1 ? " alias, " : " aliases, ") +
         Plural(r.kept_values.size(), "value") + " kept in metadata, " +
         std::to_string(r.skipped.size()) + " skipped";
  for (const auto& o : r.outputs) out += "\n  wrote: " + OneLine(o);
  ListPairs(out, "alias", r.aliases, " -> ");
  ListPairs(out, "copied", r.copied_views, ": ");
  ListPairs(out, "skipped", r.skipped, ": ");
  if (args.verify) {
    char vr[64];
    std::snprintf(vr, sizeof vr, "%.2f s", verify_seconds);
    out += "\nverified: " + Plural(verified->tensors, "tensor") + ", " +
           FormatBytes(verified->bytes) + " identical in " + vr;
  }
  return PrintReport(out);
}

}  // namespace

Command AddConvertCommand(CLI::App& parent) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* app = parent.add_subcommand(
      "convert",
      "Convert a PyTorch checkpoint (.bin/.pt, zip or legacy, sharded or not) to safetensors "
      "without running its pickle");
  app->add_option("src", args->src,
                  "A torch.save file, a pytorch_model.bin.index.json, or a directory with one")
      ->required();
  app->add_option("dst", args->dst,
                  "Output .safetensors file, or a directory when the output is sharded")
      ->required();
  app->add_option("--max-shard-size", args->max_shard_size,
                  "Write shards of at most SIZE data bytes plus model.safetensors.index.json "
                  "(512MB, 2GiB, ...)")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            const auto size = ParseSize(s);
            if (!size) return "not a size: '" + s + "' (e.g. 1GB, 512MB, 2GiB)";
            if (*size == 0) return "shard size must be positive";
            return "";
          },
          "SIZE"));
  app->add_flag("--verify", args->verify,
                "Re-read source and output and compare every tensor byte for byte");
  app->add_flag("--skip-values", args->skip_values,
                "Do not keep non-tensor values (numbers, strings) as metadata");
  app->add_flag("--no-sync", args->no_sync, "Do not fsync the output (scratch output)");
  app->add_flag("--json", args->json, "Print the result as one JSON document");
  return {app, [args] { return RunConvert(*args); }};
}

}  // namespace tensorferry::cli

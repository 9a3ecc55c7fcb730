// tensorferry cache DIR: what a local cache of object-store files (--object-cache-dir,
// docs/object_storage.md "Local cache") holds, and, with --prune SIZE, removing its least recently
// used files until the rest fit in SIZE (0: all).
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/object_store.h"

namespace tensorferry::cli {
namespace {

struct CacheArgs {
  std::string dir;
  std::string prune;  // "" = list only
  bool json = false;
};

uint64_t TotalBytes(const std::vector<ObjectCacheEntry>& entries) {
  uint64_t total = 0;
  for (const ObjectCacheEntry& e : entries) total += e.size;
  return total;
}

// "2026-11-28 05:14:03" (UTC).
std::string TimeText(int64_t seconds) {
  const std::time_t t = static_cast<std::time_t>(seconds);
  std::tm tm{};
  if (::gmtime_r(&t, &tm) == nullptr) return "?";
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

void EntriesJson(JsonOut& j, std::string_view key, const std::vector<ObjectCacheEntry>& entries) {
  j.Key(key).BeginArray();
  for (const ObjectCacheEntry& e : entries) {
    j.BeginObject()
        .Field("url", e.url)
        .Field("etag", e.etag)
        .Field("size", e.size)
        .Key("last_used")
        .Raw(std::to_string(e.last_used))
        .Field("key", e.key)
        .EndObject();
  }
  j.EndArray();
}

std::string EntriesText(const std::vector<ObjectCacheEntry>& entries) {
  std::string out;
  for (const ObjectCacheEntry& e : entries) {
    out += "\n  " + FormatBytes(e.size) + "  " + TimeText(e.last_used) + "  " +
           OneLine(e.url.empty() ? "(no description) " + e.key : e.url);
    if (!e.etag.empty()) out += "  " + OneLine(e.etag);
  }
  return out;
}

int RunCache(const CacheArgs& args) {
  std::optional<uint64_t> prune;
  if (!args.prune.empty()) {
    prune = ParseSize(args.prune);
    if (!prune) {
      return UsageError("--prune: not a size: " + args.prune);
    }
  }
  std::vector<ObjectCacheEntry> removed;
  Status status;
  if (prune) {
    Result<std::vector<ObjectCacheEntry>> r = PruneObjectCache(args.dir, *prune);
    if (r.ok()) {
      removed = *std::move(r);
    } else {
      status = r.status();
    }
  }
  std::vector<ObjectCacheEntry> entries;
  if (status.ok()) {
    Result<std::vector<ObjectCacheEntry>> r = ListObjectCache(args.dir);
    if (r.ok()) {
      entries = *std::move(r);
    } else {
      status = r.status();
    }
  }
  // What tmp/ holds besides: a tmp/ that cannot be read costs the report that line, not the
  // listing (nor what a prune removed).
  ObjectCacheDownloads downloads;
  Status downloads_status;
  if (status.ok()) {
    Result<ObjectCacheDownloads> r = ObjectCacheDownloadsIn(args.dir);
    if (r.ok()) {
      downloads = *r;
    } else {
      downloads_status = r.status();
    }
  }
  if (args.json) {
    JsonOut j;
    j.BeginObject().Field("dir", args.dir).Field("ok", status.ok());
    if (status.ok()) {
      j.Field("files", static_cast<uint64_t>(entries.size())).Field("bytes", TotalBytes(entries));
      EntriesJson(j, "entries", entries);
      if (downloads_status.ok()) {
        j.Key("downloads")
            .BeginObject()
            .Field("running", downloads.running)
            .Field("running_bytes", downloads.running_bytes)
            .Field("left_over", downloads.left_over)
            .Field("left_over_bytes", downloads.left_over_bytes)
            .EndObject();
      } else {
        j.Field("downloads_error", downloads_status.message());
      }
      if (prune) {
        j.Field("removed_bytes", TotalBytes(removed));
        EntriesJson(j, "removed", removed);
      }
    } else {
      JsonError(j, args.dir, status);
    }
    j.EndObject();
    return PrintReport(j.str(), status);
  }
  if (!status.ok()) {
    PrintError(status.message());
    return kExitError;
  }
  std::string text;
  if (prune) {
    text = "removed " + Plural(removed.size(), "file") + " (" + FormatBytes(TotalBytes(removed)) +
           ")" + EntriesText(removed) + "\n";
  }
  text += args.dir + ": " + Plural(entries.size(), "file") + ", " +
          FormatBytes(TotalBytes(entries)) + " (most recently used first)" + EntriesText(entries);
  // tmp/: what downloads in progress, and interrupted ones, take of the local disk besides.
  if (!downloads_status.ok())
    text += "\nwarning: downloads in tmp/ not counted: " + downloads_status.message();
  if (downloads.running > 0) {
    text += "\n" + Plural(downloads.running, "download") + " in progress in tmp/ (" +
            FormatBytes(downloads.running_bytes) + " reserved)";
  }
  if (downloads.left_over > 0) {
    text += "\n" + Plural(downloads.left_over, "file") +
            " left in tmp/ by interrupted downloads (" + FormatBytes(downloads.left_over_bytes) +
            "; --prune removes them)";
  }
  return PrintReport(text, status);
}

}  // namespace

Command AddCacheCommand(CLI::App& parent) {
  auto args = std::make_shared<CacheArgs>();
  CLI::App* app = parent.add_subcommand(
      "cache",
      "List a local cache of object-store files (--object-cache-dir); --prune SIZE removes its "
      "least recently used files until the rest fit");
  app->add_option("dir", args->dir, "The cache directory")->required();
  app->add_option("--prune", args->prune,
                  "Remove least recently used files until the rest hold at most SIZE (0: all); "
                  "files other processes are downloading are kept, and files being loaded stay "
                  "readable to their loaders");
  app->add_flag("--json", args->json, "Print one JSON document");
  return {app, [args] { return RunCache(*args); }};
}

}  // namespace tensorferry::cli

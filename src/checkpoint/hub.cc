// ResolveHubPath: hf:// paths to snapshot folders of the local Hugging Face hub cache (hub.h).
//
// The cache layout is huggingface_hub's: <cache>/<type>s--<owner>--<name>/ holding refs/<revision>
// (a file with the commit a branch or tag points to), snapshots/<commit>/ (the files, as links
// into blobs/) and blobs/. tests/python/test_hub.py checks the resolution against
// huggingface_hub's own (snapshot_download with local_files_only).
#include "tensorferry/hub.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <vector>

#include <simdjson.h>

#include "objstore/hub_cache.h"
#include "objstore/url.h"
#include "tensorferry/object_store.h"
#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kScheme = "hf://";

Status Invalid(std::string_view hub_path, const std::string& why) {
  return Status(Code::kInvalidArgument, std::string(hub_path) + ": " + why +
                                            " (the form is hf://[datasets/|spaces/]OWNER/NAME"
                                            "[@REVISION][/PATH])");
}

// "%2F" (either case) as '/', the way HfFileSystem writes a revision such as refs/pr/1.
std::string DecodeRevision(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && s[i + 1] == '2' &&
        (s[i + 2] == 'F' || s[i + 2] == 'f')) {
      out.push_back('/');
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// The parts of an hf:// path: its repository type and its '/'-separated components.
struct Parsed {
  std::string type = "models";  // "models", "datasets" or "spaces"
  std::vector<std::string_view> parts;
};

Result<Parsed> Parse(std::string_view hub_path) {
  if (!IsHubPath(hub_path)) return Invalid(hub_path, "not an hf:// path");
  Parsed p;
  std::string_view rest = hub_path.substr(kScheme.size());
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  for (std::string_view t : {"datasets", "spaces", "models"}) {
    if (rest.size() > t.size() && rest.substr(0, t.size()) == t && rest[t.size()] == '/') {
      p.type = std::string(t);
      rest.remove_prefix(t.size() + 1);
      break;
    }
  }
  if (rest.empty()) return Invalid(hub_path, "no repository");
  p.parts = objstore::SplitHubPath(rest);
  for (std::string_view part : p.parts) {
    if (part.empty()) return Invalid(hub_path, "an empty path component");
  }
  return p;
}

// The repository of an hf:// path read as its first `n` (1 or 2) components.
struct Candidate {
  std::string id;         // "owner/name" or "name"
  std::string folder;     // <type>--owner--name
  std::string revision;   // as written, "" for main
  size_t path_begin = 0;  // first component of PATH
};

Result<Candidate> MakeCandidate(std::string_view hub_path, const Parsed& p, size_t n) {
  Candidate c;
  std::string_view last = p.parts[n - 1];
  const size_t at = last.find('@');
  if (at != std::string_view::npos) {
    c.revision = DecodeRevision(last.substr(at + 1));
    if (c.revision.empty()) return Invalid(hub_path, "an empty revision after '@'");
    last = last.substr(0, at);
  }
  c.folder = p.type;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view part = i + 1 == n ? last : p.parts[i];
    if (!objstore::IsHubIdPart(part)) {
      return Invalid(hub_path, "the repository id part " + json::Quote(std::string(part)) +
                                   " is not one the hub allows ([A-Za-z0-9._-], no '--' or "
                                   "'..')");
    }
    if (i > 0) c.id += '/';
    c.id += part;
    c.folder += "--";
    c.folder += part;
  }
  c.path_begin = n;
  // huggingface_hub's own form of a pull request's or a conversion's ref: "@refs/pr/1" and
  // "@refs/convert/parquet" unescaped (parse_hf_uri reads them so): the ref's components are
  // the revision's, not PATH's.
  if (c.revision == "refs" && n + 1 < p.parts.size()) {
    const std::string_view kind = p.parts[n], name = p.parts[n + 1];
    const bool pr =
        kind == "pr" && !name.empty() &&
        std::all_of(name.begin(), name.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    const bool convert = kind == "convert" && objstore::IsHubIdPart(name);
    if (pr || convert) {
      c.revision += "/" + std::string(kind) + "/" + std::string(name);
      c.path_begin = n + 2;
    }
  }
  return c;
}

// PATH: the components after the repository, '/'-joined ("" for none).
std::string Inside(const Parsed& p, size_t begin) {
  std::string inside;
  for (size_t i = begin; i < p.parts.size(); ++i) {
    if (!inside.empty()) inside += '/';
    inside += p.parts[i];
  }
  return inside;
}

// The commit `revision` of repository `id` points to now, from the hub's API (`api`: its URL).
Result<std::string> AskCommit(const std::string& api, const std::string& what, Source& source) {
  Result<std::vector<std::byte>> answer = ReadObject(source, api, 16u << 20);
  if (!answer.ok()) {
    return Status(answer.status().code(), what + ": " + answer.status().message());
  }
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  std::string_view sha;
  if (parser.parse(reinterpret_cast<const char*>(answer->data()), answer->size()).get(doc) !=
          simdjson::SUCCESS ||
      doc["sha"].get(sha) != simdjson::SUCCESS || !objstore::IsHubCommit(sha)) {
    return Status(Code::kIoError, what + ": " + api +
                                      " did not answer a JSON object with the commit (\"sha\": 40 "
                                      "hex digits) as the hub's API does");
  }
  return std::string(sha);
}

}  // namespace

bool IsHubPath(std::string_view path) {
  if (path.size() < kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(path[i])) != kScheme[i]) return false;
  }
  return true;
}

Result<std::string> ResolveHubPath(std::string_view hub_path, const std::string& cache_dir) {
  TF_ASSIGN_OR_RETURN(const Parsed parsed, Parse(hub_path));
  const std::string cache = cache_dir.empty() ? HubCacheDir() : cache_dir;
  const std::string& type = parsed.type;
  const std::vector<std::string_view>& parts = parsed.parts;
  const auto candidate = [&](size_t n) { return MakeCandidate(hub_path, parsed, n); };

  // The repository: "owner/name" when the cache has it (or the name carries the revision),
  // else the owner-less "name".
  std::optional<Candidate> chosen;
  std::string tried;
  const bool owner_has_revision = parts[0].find('@') != std::string_view::npos;
  // A second part the hub would not allow in a repository id ("my model.safetensors" under an
  // owner-less repository) is a file path when the cache holds that owner-less repository; else
  // the id is refused as the hub would refuse it.
  Status two_problem;
  if (parts.size() >= 2 && !owner_has_revision) {
    Result<Candidate> two = candidate(2);
    if (two.ok()) {
      std::error_code ec;
      if (fs::is_directory(fs::path(cache) / two->folder, ec)) chosen = *two;
      tried = two->folder;
    } else {
      two_problem = two.status();
    }
  }
  if (!chosen) {
    Result<Candidate> one_or = candidate(1);
    if (!one_or.ok()) return two_problem.ok() ? one_or.status() : two_problem;
    const Candidate& one = *one_or;
    std::error_code ec;
    if (fs::is_directory(fs::path(cache) / one.folder, ec)) {
      chosen = one;
    } else if (!two_problem.ok()) {
      return two_problem;  // not an owner-less repository in the cache either: the id is wrong
    } else {
      tried = tried.empty() ? one.folder : tried + " nor " + one.folder;
    }
  }
  // `hf download` arguments besides the repository, for the messages of what is not cached.
  const std::string type_flag =
      type == "models" ? "" : " --repo-type " + type.substr(0, type.size() - 1);
  if (!chosen) {
    const std::string id =
        parts.size() >= 2 && !owner_has_revision
            ? std::string(parts[0]) + "/" + std::string(parts[1].substr(0, parts[1].find('@')))
            : std::string(parts[0].substr(0, parts[0].find('@')));
    return Status(Code::kNotFound, std::string(hub_path) + ": not in the Hugging Face hub cache " +
                                       json::Quote(cache) + " (no " + tried +
                                       "); fetch it with `hf download " + id + type_flag +
                                       " --include '*.safetensors' '*.json'`");
  }
  const fs::path repo = fs::path(cache) / chosen->folder;

  // The commit.
  std::string commit;
  const std::string revision = chosen->revision.empty() ? "main" : chosen->revision;
  if (objstore::IsHubCommit(revision)) {
    commit = revision;
  } else {
    if (!objstore::IsSafeRelative(revision)) {
      return Invalid(hub_path, "the revision " + json::Quote(revision) +
                                   " has an empty, '.' or '..' component");
    }
    const fs::path ref = repo / "refs" / revision;
    std::ifstream in(ref);
    if (!in) {
      std::error_code ec;
      if (!fs::exists(ref, ec)) {
        return Status(Code::kNotFound,
                      std::string(hub_path) + ": revision " + json::Quote(revision) + " of " +
                          chosen->id + " is not in the hub cache (no " + json::Quote(ref.string()) +
                          "); fetch it with `hf download " + chosen->id + type_flag +
                          " --revision " + revision + "`, or name a commit the cache holds (" +
                          json::Quote((repo / "snapshots").string()) + ")");
      }
      return Status(Code::kIoError, ref.string() + ": cannot read");
    }
    std::stringstream text;
    text << in.rdbuf();
    commit = text.str();
    while (!commit.empty() && std::isspace(static_cast<unsigned char>(commit.back()))) {
      commit.pop_back();
    }
    if (!objstore::IsHubCommit(commit)) {
      return Status(Code::kNotFound,
                    ref.string() + ": does not hold a commit hash (40 hex digits)");
    }
  }
  fs::path local = repo / "snapshots" / commit;
  std::error_code ec;
  if (!fs::is_directory(local, ec)) {
    return Status(Code::kNotFound, std::string(hub_path) + ": commit " + commit + " of " +
                                       chosen->id + " is not in the hub cache (no " +
                                       json::Quote(local.string()) + ")");
  }
  const std::string inside = Inside(parsed, chosen->path_begin);
  if (!inside.empty()) {
    if (!objstore::IsSafeRelative(inside)) {
      return Invalid(hub_path, "the path " + json::Quote(inside) + " has a '.' or '..' component");
    }
    local /= inside;
    if (!fs::exists(local, ec)) {
      return Status(Code::kNotFound, std::string(hub_path) + ": " + json::Quote(inside) +
                                         " is not in the cached snapshot " + commit + " of " +
                                         chosen->id + " (" + json::Quote(local.string()) + ")");
    }
  }
  return local.string();
}

namespace {

Result<std::string> PinnedUrl(std::string_view hub_path, Source& source,
                              std::map<std::string, std::string>& commits,
                              const std::string& ref_cache) {
  TF_ASSIGN_OR_RETURN(const Parsed parsed, Parse(hub_path));
  const std::string endpoint = HubEndpoint();
  if (endpoint.rfind("https://", 0) != 0 && endpoint.rfind("http://", 0) != 0) {
    return Status(Code::kInvalidArgument,
                  "HF_ENDPOINT " + json::Quote(endpoint) + ": not an http:// or https:// URL");
  }
  // The repository: "owner/name", unless there is one component, the first carries the revision,
  // or the second names a file (then the owner-less "name", like gpt2).
  const std::vector<std::string_view>& parts = parsed.parts;
  const bool one = parts.size() == 1 || parts[0].find('@') != std::string_view::npos ||
                   parts[1].ends_with(".safetensors") || parts[1].ends_with(".json");
  const size_t n = one ? 1 : 2;
  TF_ASSIGN_OR_RETURN(const Candidate repo, MakeCandidate(hub_path, parsed, n));
  const std::string inside = Inside(parsed, n);
  if (!inside.empty() && !objstore::IsSafeRelative(inside)) {
    return Invalid(hub_path, "the path " + json::Quote(inside) + " has a '.' or '..' component");
  }
  const std::string revision = repo.revision.empty() ? "main" : repo.revision;
  if (!objstore::IsSafeRelative(revision)) {
    return Invalid(
        hub_path, "the revision " + json::Quote(revision) + " has an empty, '.' or '..' component");
  }
  const std::string type_path = parsed.type == "models" ? "" : parsed.type + "/";
  std::string commit = revision;
  if (!objstore::IsHubCommit(revision)) {
    // Pinned to the commit the branch or tag points to now: every file of the checkpoint comes
    // from it, even if the branch moves during the load. Asked once per repository and revision
    // however many of its files are named.
    const std::string api = endpoint + "/api/" + parsed.type + "/" + repo.id + "/revision/" +
                            objstore::PercentEncode(revision, false);
    const auto known = commits.find(api);
    if (known != commits.end()) {
      commit = known->second;
    } else {
      TF_ASSIGN_OR_RETURN(
          commit, AskCommit(api,
                            "the commit of " + repo.id + " at revision " + json::Quote(revision) +
                                " on the hub " + RedactUrl(endpoint),
                            source));
      commits.emplace(api, commit);
      if (!ref_cache.empty()) {  // a cache: best effort
        static_cast<void>(objstore::WriteHubRef(ref_cache, repo.folder, revision, commit));
      }
    }
  }
  return endpoint + "/" + type_path + repo.id + "/resolve/" + commit +
         (inside.empty() ? "" : "/" + objstore::PercentEncode(inside, true));
}

}  // namespace

Result<std::string> HubUrl(std::string_view hub_path, const ObjectStoreOptions& options) {
  TF_ASSIGN_OR_RETURN(const std::shared_ptr<Source> source, MakeObjectSource(options));
  return HubUrl(hub_path, *source);
}

Result<std::string> HubUrl(std::string_view hub_path, Source& source,
                           const std::string& ref_cache) {
  const std::string path(hub_path);
  TF_ASSIGN_OR_RETURN(std::vector<std::string> urls,
                      HubUrls(std::span(&path, 1), source, ref_cache));
  return std::move(urls.front());
}

Result<std::vector<std::string>> HubUrls(std::span<const std::string> hub_paths, Source& source,
                                         const std::string& ref_cache) {
  std::map<std::string, std::string> commits;  // the API's URL -> the commit it answered
  std::vector<std::string> urls;
  for (const std::string& hub_path : hub_paths) {
    TF_ASSIGN_OR_RETURN(std::string url, PinnedUrl(hub_path, source, commits, ref_cache));
    urls.push_back(std::move(url));
  }
  return urls;
}

}  // namespace tensorferry

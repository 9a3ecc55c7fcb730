// tensorferry/hub.h: checkpoints named by their Hugging Face hub repository
// ("hf://meta-llama/Llama-3.1-8B"), read from the local hub cache, else from the hub itself.
//
// Serving stacks name models by repository id and keep the files in the hub cache that
// huggingface_hub fills (`hf download`, snapshot_download, transformers, vLLM). An "hf://" path
// names a file or folder of one revision of such a repository:
//
//   hf://[datasets/|spaces/]REPO[@REVISION][/PATH]
//
// REPO is "owner/name" or, for the hub's few repositories without an owner, "name"; REVISION a
// branch or tag name (a '/' in it written %2F, as huggingface_hub's HfFileSystem writes it) or a
// 40-hex-digit commit, default "main"; PATH a file or folder inside the snapshot (no "..").
//
// Checkpoint::Open (and so every edge: the CLI, the Python package) reads such a path from where
// it is first found:
//   1. the local hub cache (ResolveHubPath): the snapshot folder, where the hub-cache rules of
//      checkpoint.h (snapshot links into the repository's blobs/) and of integrity.h (a blob's
//      name is the SHA-256 of its bytes) apply; a cached snapshot that lacks the checkpoint's
//      files (only config.json was fetched, or a shard is missing) counts as not cached;
//   2. unless HubOffline(), the hub at HubEndpoint(), streamed like any https:// prefix
//      (object_store.h: redirects to the CDN remembered, HF_TOKEN sent to the hub only, ranged
//      GETs into the load's buffers): HubUrl pins a branch or tag to the commit it names when the
//      load opens, so every file comes from that one commit. Unless ObjectStoreOptions::hub_cache
//      is off, the files read are also kept in the local hub cache as huggingface_hub keeps them
//      (written beside the load, each linked into the commit's snapshot once whole, the branch's
//      refs/ file written), so that the next start finds them in step 1.
// A path found in neither is kNotFound naming both places (and the `hf download` command that
// would fill the cache); with HF_HUB_OFFLINE set, it says the hub was not asked.
//
// Pure functions of their arguments, the environment, the file system and (HubUrl) the hub's
// answer; thread-safe.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/object_store.h"
#include "tensorferry/status.h"

namespace tensorferry {

// True when `path` starts with "hf://" (case-insensitive scheme).
bool IsHubPath(std::string_view path);

// The hub cache folder huggingface_hub uses, from the environment as it decides it: HF_HUB_CACHE,
// else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
// ~/.cache/huggingface/hub ("~" and $VARIABLES expanded in HF_HOME and HF_HUB_CACHE as it does).
std::string HubCacheDir();

// The local path of `hub_path` in the cache at `cache_dir` ("" : HubCacheDir()):
// <cache>/<type>s--<owner>--<name>/snapshots/<commit>[/PATH]. A branch or tag is looked up in the
// repository's refs/ folder. "owner/name/..." is read as that repository when the cache has it,
// else as repository "owner" with PATH "name/...".
// Errors: kInvalidArgument (not an hf:// path, an empty or malformed part, a PATH with ".." or a
// revision with ".."), kNotFound (repository, revision, snapshot or PATH not in the cache),
// kIoError (a refs file that cannot be read).
Result<std::string> ResolveHubPath(std::string_view hub_path, const std::string& cache_dir = "");

// --- the hub itself ---

// The hub's address as huggingface_hub decides it: HF_ENDPOINT (trailing '/' removed), else
// "https://huggingface.co".
std::string HubEndpoint();

// True when the hub must not be asked: HF_HUB_OFFLINE (else TRANSFORMERS_OFFLINE) set to 1, ON,
// YES or TRUE (any case), as huggingface_hub reads them.
bool HubOffline();

// The URL of `hub_path` on the hub at HubEndpoint(), pinned to one commit:
//   <endpoint>/[datasets/|spaces/]<REPO>/resolve/<commit>[/<PATH, percent-encoded>]
// A branch or tag is resolved to the commit it names now with one GET of the hub's API
// (<endpoint>/api/<type>/<REPO>/revision/<REVISION>, the answer's "sha"), read with `options`
// (the hub's token, TLS settings, retries: object_store.h); a commit is used as written. Without
// the cache to tell, "a/b/..." is repository "a/b", except that a second component ending in
// ".safetensors" or ".json" makes "a" an owner-less repository and the rest its PATH.
// Errors: kInvalidArgument (a malformed path; HF_ENDPOINT not http(s)://), kNotFound (the hub
// has no such repository or revision: its 404, or 401 RepositoryNotFound), kIoError (an answer
// without a commit) and ReadObject's errors, each naming the repository, revision and hub.
Result<std::string> HubUrl(std::string_view hub_path, const ObjectStoreOptions& options);

// The same, the API's GET through `source` (a Source from MakeObjectSource; Checkpoint::Open
// passes the one the checkpoint's files are then read through, so that the API's request and the
// reads share their connections to the hub: one TLS handshake, not two). With `ref_cache` (a hub
// cache folder: Checkpoint::Open passes HubCacheDir() when ObjectStoreOptions::hub_cache is on),
// the commit a branch or tag was pinned to is also written to its refs/<REVISION> there, so that
// the snapshot the load fills is found by the revision next time (a failure to write it is
// ignored: a cache never fails a load).
Result<std::string> HubUrl(std::string_view hub_path, Source& source,
                           const std::string& ref_cache = "");

// HubUrl of each of `hub_paths`, in order, the hub's API asked once per repository and revision:
// files of one repository named by a branch all come from the one commit it named.
Result<std::vector<std::string>> HubUrls(std::span<const std::string> hub_paths, Source& source,
                                         const std::string& ref_cache = "");

}  // namespace tensorferry

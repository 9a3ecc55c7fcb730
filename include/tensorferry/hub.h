// tensorferry/hub.h: checkpoints named by their Hugging Face hub repository, read from the local
// hub cache ("hf://meta-llama/Llama-3.1-8B").
//
// Serving stacks name models by repository id and keep the files in the hub cache that
// huggingface_hub fills (`hf download`, snapshot_download, transformers, vLLM). An "hf://" path
// names a file or folder of one revision of such a repository; Checkpoint::Open (and so every
// edge: the CLI, the Python package) resolves it to its snapshot folder in the cache and opens
// that, where the hub-cache rules of checkpoint.h (snapshot links into the repository's blobs/)
// and of integrity.h (a blob's name is the SHA-256 of its bytes) apply.
//
//   hf://[datasets/|spaces/]REPO[@REVISION][/PATH]
//
// REPO is "owner/name" or, for the hub's few repositories without an owner, "name"; REVISION a
// branch or tag name (a '/' in it written %2F, as huggingface_hub's HfFileSystem writes it) or a
// 40-hex-digit commit, default "main"; PATH a file or folder inside the snapshot (no "..").
//
// Only the cache is read: nothing is downloaded. A repository or revision that is not in the cache
// is kNotFound, naming the cache folder and the command that downloads it.
//
// Pure functions of their arguments, the environment and the file system; thread-safe.
#pragma once

#include <string>
#include <string_view>

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

}  // namespace tensorferry

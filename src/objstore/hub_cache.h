// Internal: the Hugging Face hub cache as huggingface_hub lays it out, for the object Source that
// keeps the files it streams from the hub there (ObjectStoreOptions::hub_cache), and for the
// hub's environment (HubCacheDir, HubEndpoint, HubOffline of tensorferry/hub.h are defined here:
// the transport reads them too).
//
// The layout, under the cache folder (HubCacheDir()):
//   <type>s--<owner>--<name>/blobs/<blob>     a file's bytes; <blob> is what huggingface_hub
//                                             names it by: the X-Linked-Etag of the hub's answer
//                                             (a weight file's SHA-256), else its ETag, without
//                                             W/ and quotes
//   <...>/snapshots/<commit>/<path>           a relative link to ../../blobs/<blob> (one more
//                                             ../ per folder in <path>)
//   <...>/refs/<revision>                     the commit a branch or tag named (written by
//                                             Checkpoint::Open when it pins an hf:// path)
//   .locks/<type>s--<owner>--<name>/<blob>.lock
//                                             the flock(2) that huggingface_hub's downloads of
//                                             the blob take too (filelock on Linux): one writer
// A blob appears whole (written beside it under a name huggingface_hub ignores, fsync'd, then
// renamed), then its link, so that a crash leaves no partial file under a name huggingface_hub
// trusts. Links and refs are replaced atomically (written aside, renamed over).
//
// Thread-safety: pure functions of their arguments, the environment and the file system.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry::objstore {

// A file of the hub named by its resolve URL.
struct HubFile {
  std::string folder;    // "models--owner--name" (datasets--..., spaces--...)
  std::string revision;  // as the URL names it, decoded: a commit, "main", "refs/pr/1"
  std::string path;      // the file in the repository, decoded ("model-00001-of-00002.safetensors")
};

// The hub file `url` names when it is <HubEndpoint()>/[datasets/|spaces/]REPO/resolve/REV/PATH
// (REPO "owner/name" or "name", parts the hub allows; PATH without empty, "." or ".."
// components; no control character, raw or percent-encoded); nullopt for any other URL (the
// hub's API, another origin, a malformed one).
std::optional<HubFile> HubFileOfUrl(std::string_view url);

// True for a commit id: 40 lower-case hex digits.
bool IsHubCommit(std::string_view s);

// True for a part of a repository id the hub allows ([A-Za-z0-9._-], at most 96, no "--" or
// "..", not starting with '-' or '.'), which also keeps it one folder name.
bool IsHubIdPart(std::string_view s);

// True for a relative '/'-separated path without an empty, "." or ".." component.
bool IsSafeRelative(std::string_view s);

// `s` split at every '/' (empty parts kept: "a//b" is "a", "", "b").
std::vector<std::string_view> SplitHubPath(std::string_view s);

// The name huggingface_hub gives a file's blob: `linked_etag` (X-Linked-Etag) when set, else
// `etag`, without a leading W/ and the quotes; "" when that is not a plain name ([0-9A-Za-z._-],
// not starting with '.': what the hub sends, and nothing that could leave blobs/).
std::string HubBlobName(std::string_view linked_etag, std::string_view etag);

// <root>/<folder>/snapshots/<commit>/<path> made a relative link to the blob `blob` (replacing
// what was there). Errors: kIoError naming the link.
Status LinkHubSnapshot(const std::string& root, const std::string& folder,
                       const std::string& commit, const std::string& path, const std::string& blob);

// <root>/<folder>/refs/<revision> holding `commit` (replacing what was there). Errors: kIoError
// naming the file; kInvalidArgument for a revision with an empty, "." or ".." component.
Status WriteHubRef(const std::string& root, const std::string& folder, const std::string& revision,
                   const std::string& commit);

}  // namespace tensorferry::objstore

// Internal: path safety, the one module for every path tensorferry takes from a file or a user
// before it reaches the operating system.
//
// Two layers, used by every index reader (the safetensors index in src/checkpoint/ and the
// PyTorch .bin index in src/convert/) and by directory listings:
//   * lexical (RelativePathProblem): a path written in an index must be relative and stay below
//     its directory: no absolute path, no ".." component, no NUL byte, no backslash (a Windows
//     separator, or an escape such as "..\\x" some consumers would read as one);
//   * resolved (CheckContained, and CheckOpenedContained once the file is open, so that a link
//     swapped between the check and the open is caught): with symlinks followed, the file must
//     lie strictly inside the
//     checkpoint directory, with one exception that keeps the Hugging Face hub cache working:
//     when the directory is <repo>/snapshots/<rev>, a file resolving into <repo>/blobs/ (that
//     repository's own blobs, where the hub cache keeps the bytes: snapshots/<rev>/x ->
//     ../../blobs/<sha>) is accepted. A link from elsewhere into a hub repository's blobs/ (a
//     folder huggingface_hub before 0.23 downloaded with --local-dir) is refused with a hint
//     saying how to load it. This layer needs the real file system.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry {

// Ok, or kInvalidArgument when `path` holds a NUL byte: the C library would silently cut the path
// there and open another file (Python's open() refuses such paths with ValueError too). `what`
// names the role in the message ("checkpoint path", "output path").
Status CheckPathString(std::string_view path, std::string_view what = "path");

// Why the relative path `file` (as written in an index) could leave its directory, e.g. "is an
// absolute path", or nullopt when it cannot. An empty path is not checked here.
std::optional<std::string> RelativePathProblem(std::string_view file);

// The canonical form of checkpoint directory `dir` ("" is the working directory).
// Errors: kIoError "<where>: cannot resolve the checkpoint directory: <why>".
Result<std::filesystem::path> CanonicalDirectory(const std::filesystem::path& dir,
                                                 std::string_view where);

// Ok when `path` resolves, symlinks followed, to a file strictly inside `canonical_dir` (from
// CanonicalDirectory), or inside the repository's blobs/ for a hub-cache snapshot. Otherwise
// kIndexPathEscape "<where>: <what> resolves to ..., outside the checkpoint directory ...".
Status CheckContained(const std::filesystem::path& canonical_dir, const std::string& path,
                      std::string_view where, std::string_view what);

// The check after the open that closes the race of CheckContained (checked by name, opened by
// name later: a symlink swapped between the two would be followed outside): Ok when `path`
// resolves inside `canonical_dir` as CheckContained says AND the file open on descriptor `fd`
// lies inside it too (its path by /proc/self/fd, which no later swap of a link or directory
// changes; without /proc, the file the path names now must be the one open: same device and
// inode, by fstat and stat). A descriptor of another file (the path changed since it was opened)
// is kIndexPathEscape "<where>: <what> was replaced while it was opened ...". `fd` < 0 (a file
// without a descriptor): CheckContained alone.
Status CheckOpenedContained(const std::filesystem::path& canonical_dir, const std::string& path,
                            int fd, std::string_view where, std::string_view what);

// One distinct file an index names: its lexically normalized relative path, the path to open
// (joined with the index's directory) and one tensor the index maps to it (for messages).
struct IndexedFile {
  std::string rel;
  std::string path;
  std::string tensor;
};

// The distinct files of `weight_map` (tensor -> relative path, as an index lists them; "./a" and
// "a" are one file), sorted by relative path, for the index at `index_path`. With `on_disk` (the
// real file system), each must resolve inside the index's directory (CheckContained, hub-cache
// snapshots included). The lexical rule (RelativePathProblem) is the index parser's.
// Errors: those of CanonicalDirectory and CheckContained.
Result<std::vector<IndexedFile>> IndexedFiles(
    const std::vector<std::pair<std::string, std::string>>& weight_map,
    const std::string& index_path, bool on_disk);

}  // namespace tensorferry

// Path safety (path.h).
#include "util/path.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <system_error>

#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry {

namespace fs = std::filesystem;

namespace {

// True when `child` (canonical) lies strictly inside `dir` (canonical).
bool IsInside(const fs::path& dir, const fs::path& child) {
  auto d = dir.begin();
  auto c = child.begin();
  for (; d != dir.end(); ++d, ++c) {
    if (c == child.end() || *d != *c) return false;
  }
  return c != child.end();
}

bool IsHex(std::string_view name) {
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A hub cache's repository folder: models--OWNER--NAME, datasets--..., spaces--....
bool IsHubRepoFolder(const std::string& name) {
  return name.starts_with("models--") || name.starts_with("datasets--") ||
         name.starts_with("spaces--");
}

// huggingface_hub's cache-wide store of Xet files (on by default since huggingface_hub 1.x):
// <cache>/blobs/<first 2 hex digits>/<64 hex digits>, a regular file the repositories'
// blobs/<etag> links lead to, in a store marked by <cache>/blobs/.huggingface-shared-blobs.
bool IsInSharedHubStore(const fs::path& cache, const fs::path& target) {
  const std::string name = target.filename().string();
  const fs::path prefix = target.parent_path();
  if (name.size() != 64 || prefix.filename().string() != name.substr(0, 2) ||
      prefix.parent_path() != cache / "blobs" || !IsHex(name)) {
    return false;
  }
  std::error_code ec;
  return fs::is_regular_file(fs::symlink_status(cache / "blobs" / ".huggingface-shared-blobs", ec));
}

// huggingface_hub before 0.23 downloaded into a local folder (`--local-dir`, with
// local_dir_use_symlinks "auto", its default, or True) as links into its cache: DIR/<file> ->
// <cache>/models--OWNER--NAME/blobs/<sha256>, or a 40-digit git blob id for a small file. Such a
// link is refused like any other that leaves the folder (accepting every hub blob would let an
// untrusted folder read any model of the machine's hub caches, private ones included); its
// refusal says how to make the folder loadable.
bool IsHubRepoBlob(const fs::path& target) {
  const std::string name = target.filename().string();
  const fs::path blobs = target.parent_path();
  return (name.size() == 64 || name.size() == 40) && IsHex(name) && blobs.filename() == "blobs" &&
         IsHubRepoFolder(blobs.parent_path().filename().string());
}

// The hub cache keeps a checkpoint as <repo>/snapshots/<revision>/<file>, or in a subfolder of
// the snapshot (<revision>/transformer/<file>: diffusers' layout, hf://OWNER/NAME/SUBFOLDER), each
// file a symlink to <repo>/blobs/<hash>, which may itself lead to the cache's shared store of Xet
// files: a target inside that repository's own blobs/, or in that store (IsInSharedHubStore), is
// accepted, for a checkpoint folder at any depth below a revision.
bool IsInsideHubBlobs(const fs::path& canonical_dir, const fs::path& target) {
  for (fs::path revision = canonical_dir; revision.has_relative_path();
       revision = revision.parent_path()) {
    const fs::path snapshots = revision.parent_path();
    if (snapshots.filename() == "snapshots") {
      const fs::path repo = snapshots.parent_path();
      return IsInside(repo / "blobs", target) || (IsHubRepoFolder(repo.filename().string()) &&
                                                  IsInSharedHubStore(repo.parent_path(), target));
    }
    if (snapshots == revision) break;  // the root
  }
  return false;
}

}  // namespace

Status CheckPathString(std::string_view path, std::string_view what) {
  if (const size_t nul = path.find('\0'); nul != std::string_view::npos) {
    return Status(Code::kInvalidArgument, std::string(what) + " " + json::Quote(path) +
                                              " holds a NUL byte at position " +
                                              std::to_string(nul) + ": no file can have that name");
  }
  return Status::Ok();
}

std::optional<std::string> RelativePathProblem(std::string_view file) {
  if (file.find('\0') != std::string_view::npos) return "contains a NUL byte";
  if (file.find('\\') != std::string_view::npos) return "contains a backslash";
  if (!file.empty() && file.front() == '/') return "is an absolute path";
  size_t start = 0;
  while (start <= file.size()) {
    size_t end = file.find('/', start);
    if (end == std::string_view::npos) end = file.size();
    if (file.substr(start, end - start) == "..") {
      return "has a \"..\" component: it leaves the checkpoint directory";
    }
    start = end + 1;
  }
  return std::nullopt;
}

Result<fs::path> CanonicalDirectory(const fs::path& dir, std::string_view where) {
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(dir.empty() ? fs::path(".") : dir, ec);
  if (ec) {
    return Status(Code::kIoError, std::string(where) +
                                      ": cannot resolve the checkpoint directory: " + ec.message());
  }
  return canonical;
}

namespace {

// The path `path` resolves to, symlinks followed. weakly_canonical alone would keep a dangling
// symlink as it is written (inside the directory) whatever it points at: its target is followed
// here first (a chain of at most 40 links, as the kernel allows).
fs::path Resolve(const std::string& path, std::error_code& ec) {
  // Absolute first: weakly_canonical leaves a relative path to a missing file relative.
  fs::path p = fs::absolute(path, ec);
  for (int links = 0; !ec && links < 40; ++links) {
    std::error_code missing;  // a path that does not exist is no symlink: not an error here
    if (!fs::is_symlink(fs::symlink_status(p, missing))) break;
    const fs::path target = fs::read_symlink(p, ec);
    // Relative to the link's directory as the kernel sees it (its own symlinks resolved first).
    // Not lexically normalized: "sub/../x" is the parent of where the symlink "sub" points, not
    // "x" beside it; weakly_canonical (below, and on the next link's parent) lets the kernel
    // resolve each ".." after the links before it.
    const fs::path base =
        target.is_absolute() ? fs::path() : fs::weakly_canonical(p.parent_path(), ec);
    p = base / target;
  }
  return ec ? p : fs::weakly_canonical(p, ec);
}

}  // namespace

namespace {

// CheckContained, with the resolved path in `canonical` when it is Ok.
Status CheckContainedAt(const fs::path& canonical_dir, const std::string& path,
                        std::string_view where, std::string_view what, fs::path& canonical) {
  std::error_code ec;
  canonical = Resolve(path, ec);
  if (!ec && (IsInside(canonical_dir, canonical) || IsInsideHubBlobs(canonical_dir, canonical))) {
    return Status::Ok();
  }
  const std::string prefix = std::string(where) + ": " + std::string(what) + " ";
  if (!ec && canonical == canonical_dir) {
    return Status(Code::kIndexPathEscape, prefix + "names the checkpoint directory " +
                                              json::Quote(canonical_dir.string()) +
                                              " itself, not a file in it");
  }
  const std::string why = ec ? "resolves to an unresolvable path: " + ec.message()
                             : "resolves to " + json::Quote(canonical.string());
  const std::string hint =
      !ec && IsHubRepoBlob(canonical)
          ? " (a link into a hub cache, as huggingface_hub before 0.23 downloaded with "
            "--local-dir: load the model by its hf://OWNER/NAME path, download it again with a "
            "current huggingface_hub, or replace the links by their files: cp -rL)"
          : "";
  return Status(Code::kIndexPathEscape, prefix + why + ", outside the checkpoint directory " +
                                            json::Quote(canonical_dir.string()) + hint);
}

}  // namespace

Status CheckContained(const fs::path& canonical_dir, const std::string& path,
                      std::string_view where, std::string_view what) {
  fs::path canonical;
  return CheckContainedAt(canonical_dir, path, where, what, canonical);
}

Status CheckOpenedContained(const fs::path& canonical_dir, const std::string& path, int fd,
                            std::string_view where, std::string_view what) {
  fs::path canonical;
  TF_RETURN_IF_ERROR(CheckContainedAt(canonical_dir, path, where, what, canonical));
  if (fd < 0) return Status::Ok();
  const std::string prefix = std::string(where) + ": " + std::string(what) + " ";
  // Where the kernel says the open file lies (the descriptor's own path: the file's current name,
  // links resolved): no name is resolved again, so no link or directory swapped after the open
  // can pass this check.
  std::error_code ec;
  const fs::path opened = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  if (!ec && opened.is_absolute() && !opened.string().ends_with(" (deleted)")) {
    if (IsInside(canonical_dir, opened) || IsInsideHubBlobs(canonical_dir, opened)) {
      return Status::Ok();
    }
    return Status(Code::kIndexPathEscape,
                  prefix + "was replaced while it was opened: the file opened, " +
                      json::Quote(opened.string()) + ", lies outside the checkpoint directory " +
                      json::Quote(canonical_dir.string()) + ", though the path resolves to " +
                      json::Quote(canonical.string()) +
                      " inside it now (a symbolic link changed between the check and the open?)");
  }
  // Without /proc (or a file removed since): the file the name resolves to now must be the one
  // open (same device and inode).
  struct stat open_st {};
  struct stat named_st {};
  if (::fstat(fd, &open_st) != 0) {
    return Status(Code::kIoError,
                  prefix + "cannot be checked once opened: fstat: " + std::strerror(errno));
  }
  if (::stat(canonical.c_str(), &named_st) != 0) {
    return Status(Code::kIndexPathEscape,
                  prefix + "was replaced while it was opened: " + json::Quote(canonical.string()) +
                      ", where it resolves, is gone (" + std::strerror(errno) +
                      "): the file opened may lie outside the checkpoint directory " +
                      json::Quote(canonical_dir.string()));
  }
  if (open_st.st_dev != named_st.st_dev || open_st.st_ino != named_st.st_ino) {
    return Status(Code::kIndexPathEscape,
                  prefix + "was replaced while it was opened: the file opened (inode " +
                      std::to_string(open_st.st_ino) + " on device " +
                      std::to_string(open_st.st_dev) + ") is not " +
                      json::Quote(canonical.string()) + " (inode " +
                      std::to_string(named_st.st_ino) + "), where the path resolves inside " +
                      "the checkpoint directory " + json::Quote(canonical_dir.string()) +
                      " (a symbolic link changed between the check and the open?)");
  }
  return Status::Ok();
}

Result<std::vector<IndexedFile>> IndexedFiles(
    const std::vector<std::pair<std::string, std::string>>& weight_map,
    const std::string& index_path, bool on_disk) {
  std::map<std::string, std::string> first_tensor;  // normalized relative path -> tensor
  for (const auto& [tensor, file] : weight_map) {
    first_tensor.emplace(fs::path(file).lexically_normal().string(), tensor);
  }
  const fs::path dir = fs::path(index_path).parent_path();
  fs::path canonical_dir;
  if (on_disk) {
    TF_ASSIGN_OR_RETURN(canonical_dir, CanonicalDirectory(dir, index_path));
  }
  std::vector<IndexedFile> out;
  out.reserve(first_tensor.size());
  for (const auto& [rel, tensor] : first_tensor) {
    std::string joined = dir.empty() ? rel : (dir / rel).string();
    if (on_disk) {
      TF_RETURN_IF_ERROR(
          CheckContained(canonical_dir, joined, index_path,
                         "file " + json::Quote(rel) + " (of tensor " + json::Quote(tensor) + ")"));
    }
    out.push_back(IndexedFile{rel, std::move(joined), tensor});
  }
  return out;
}

}  // namespace tensorferry

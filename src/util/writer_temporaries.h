// Internal: the hidden names the writers make beside a file (writer.h: ".<name>.tmp-<tag>-<random>"
// while it is written, ".<name>.bak-<tag>-<random>" for an old file moved aside; the checksum
// manifest's temporaries too), and the removal of those a dead writer left behind (a SIGKILL, an
// OOM kill, a power loss: no handler ran to remove them).
//
// The tag is "<pid>@<8 hex digits>": the writing process's pid and a hash of this machine's host
// name, its /etc/machine-id and the pid namespace (/proc/self/ns/pid). A pid identifies a process
// only on the machine, and in the pid namespace (container), that wrote it: on NFS another
// machine's pid means nothing here, nor a neighbouring container's. So a name is removed only
// when its hash is this process's and kill(pid, 0) fails with ESRCH: its writer is certainly
// gone. A live pid (the writer, or a process that reused its pid) keeps it; a name of another
// machine or namespace, or of an older version (no hash), is never touched. Limits: machines
// that share a host name and a machine-id (clones of one image that were not given their own,
// containers of one image with one host name) and whose pid namespaces have the same number
// (every root namespace does), or whose hashes collide (1 in 2^32), take each other's names for
// their own: their writers should not share a folder.
//
// Thread-safety: every function is reentrant.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace tensorferry::util {

// "<pid>@<8 hex digits>" of this process (the pid read at each call: a forked child has its own).
std::string WriterTag();

// The kinds of hidden names a writer makes beside a file.
inline constexpr std::string_view kTemporaryKind = ".tmp-";  // a file being written
inline constexpr std::string_view kBackupKind = ".bak-";     // an old file moved aside

// "." + the first kHiddenBaseBytes bytes of `base` + `kind` + WriterTag() + "-": the start of a
// hidden name beside the file `base`, within NAME_MAX (255) with the 16 random hex digits that
// follow.
inline constexpr size_t kHiddenBaseBytes = 200;
std::string HiddenSibling(std::string_view base, std::string_view kind);

// When `name` is HiddenSibling(base, kind) + 16 hex digits written by a process of this machine
// and pid namespace that is no longer running (kill(pid, 0): ESRCH), the (cut) `base`; else "".
std::string DeadWritersBase(std::string_view name, std::string_view kind);

// Removes from directory `dir` ("" is the working directory), on the real file system, every
// hidden name of one of `kinds` that a dead writer (DeadWritersBase) left beside a file whose
// name `is_target` accepts (given the name as cut to kHiddenBaseBytes). A directory is listed
// once per process (by the spelling of `dir`; names a dead writer leaves after that are the next
// process's to remove). Best effort: a directory that cannot be listed, or a name that cannot be
// removed, stays as it is. Returns the names removed.
std::vector<std::string> RemoveDeadWritersFiles(
    const std::string& dir, const std::vector<std::string_view>& kinds,
    const std::function<bool(std::string_view base)>& is_target);

// The same for the files named in `targets` (plain names in `dir`).
std::vector<std::string> RemoveDeadWritersFiles(const std::string& dir,
                                                const std::vector<std::string>& targets,
                                                const std::vector<std::string_view>& kinds);

}  // namespace tensorferry::util

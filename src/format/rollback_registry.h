// The process-wide list of what to undo if the process is ended by a signal while it writes.
//
// A write registers each temporary file it creates, and a sharded write each file it moved aside
// (a backup of a file it replaces or makes obsolete) and each new name it created. Writers undo
// their own work on errors in ordinary code; this list exists for the one case ordinary code
// cannot handle: a signal handler (the CLI's, on SIGINT/SIGTERM) calling RunRegisteredRollbacks(),
// which only uses unlink(2), rename(2), rmdir(2) and lock-free atomics, so it is
// async-signal-safe.
//
// Nodes are allocated on first need and never freed (they are reused), so a handler may walk the
// list while another thread registers or unregisters entries. Memory is bounded by about the
// largest number of entries alive at once.
#pragma once

#include <string_view>

namespace tensorferry::internal {

struct RollbackNode;

// A group of entries that commit together: before Commit(), a signal puts backups back and
// removes created names; after it, a signal removes the backups and keeps the new files.
class RollbackGroup {
 public:
  RollbackGroup();
  ~RollbackGroup();
  RollbackGroup(const RollbackGroup&) = delete;
  RollbackGroup& operator=(const RollbackGroup&) = delete;

  // Atomically switches every entry of the group to its committed action.
  void Commit() noexcept;
  RollbackNode* node() const noexcept { return node_; }

 private:
  RollbackNode* node_;
};

// One registered action; unregistered on destruction (or Reset()). Move-only.
class RollbackEntry {
 public:
  enum class Kind : int {
    kTemporary = 1,  // a temporary file: removed
    kBackup = 2,     // `path` is a backup of `original`: renamed back (removed once committed)
    kCreated = 3,    // a name the write created: removed unless committed
    kDirectory = 4,  // a directory the write created: removed if empty, after every file entry
  };

  RollbackEntry() = default;
  // REQUIRES: `group` outlives the entry (for kBackup and kCreated; nullptr for kTemporary).
  RollbackEntry(Kind kind, std::string_view path, std::string_view original = {},
                const RollbackGroup* group = nullptr);
  ~RollbackEntry() { Reset(); }
  RollbackEntry(RollbackEntry&& other) noexcept : node_(other.node_) { other.node_ = nullptr; }
  RollbackEntry& operator=(RollbackEntry&& other) noexcept;
  RollbackEntry(const RollbackEntry&) = delete;
  RollbackEntry& operator=(const RollbackEntry&) = delete;

  void Reset() noexcept;

 private:
  RollbackNode* node_ = nullptr;
};

// Runs the action of every registered entry. Async-signal-safe.
void RunRegisteredRollbacks() noexcept;

}  // namespace tensorferry::internal

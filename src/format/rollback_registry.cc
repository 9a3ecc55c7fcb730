// The rollback registry (rollback_registry.h): a lock-free, grow-only list of nodes.
#include "format/rollback_registry.h"

#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace tensorferry::internal {

enum NodeState : int { kFree = 0, kClaimed = 1, kActive = 2 };

struct RollbackNode {
  std::atomic<int> state{kClaimed};
  int kind = 0;                         // RollbackEntry::Kind, or 0 for a group
  const RollbackNode* group = nullptr;  // for kBackup and kCreated
  std::atomic<bool> committed{false};   // groups only
  size_t capacity = 0;                  // of each of path and original, NUL included
  char* path = nullptr;
  char* original = nullptr;
  RollbackNode* next = nullptr;  // fixed before the node is published
};

namespace {

std::atomic<RollbackNode*> g_head{nullptr};
// About how many nodes are free: none, and the list is not walked (a write registering thousands
// of entries, `reshard --tp` of many ranks, would walk every live one per entry: quadratic).
// A race can only make Claim allocate a node where a free one appeared meanwhile.
std::atomic<int64_t> g_free{0};  // may dip below 0 between a claim and its Free's count

void Free(RollbackNode* n) noexcept {
  n->state.store(kFree, std::memory_order_seq_cst);
  g_free.fetch_add(1, std::memory_order_release);
}

// A node with room for `need` bytes per path, in state kClaimed.
RollbackNode* Claim(size_t need) {
  if (g_free.load(std::memory_order_acquire) > 0) {
    for (RollbackNode* n = g_head.load(std::memory_order_acquire); n != nullptr; n = n->next) {
      if (n->capacity < need) continue;
      int expected = kFree;
      if (n->state.compare_exchange_strong(expected, kClaimed, std::memory_order_acquire)) {
        g_free.fetch_sub(1, std::memory_order_relaxed);
        return n;
      }
    }
  }
  auto* n = new RollbackNode;
  n->capacity = std::max<size_t>(need, 256);
  n->path = new char[n->capacity];
  n->original = new char[n->capacity];
  n->path[0] = n->original[0] = '\0';
  RollbackNode* head = g_head.load(std::memory_order_relaxed);
  do {
    n->next = head;
  } while (
      !g_head.compare_exchange_weak(head, n, std::memory_order_release, std::memory_order_relaxed));
  return n;
}

void Copy(char* dst, std::string_view s) {
  if (!s.empty()) std::memcpy(dst, s.data(), s.size());  // an empty view's data() may be null
  dst[s.size()] = '\0';
}

}  // namespace

RollbackGroup::RollbackGroup() : node_(Claim(1)) {
  node_->kind = 0;
  node_->committed.store(false, std::memory_order_relaxed);
  node_->state.store(kActive, std::memory_order_release);
}

RollbackGroup::~RollbackGroup() {
  Free(node_);
}

void RollbackGroup::Commit() noexcept {
  node_->committed.store(true, std::memory_order_seq_cst);
}

RollbackEntry::RollbackEntry(Kind kind, std::string_view path, std::string_view original,
                             const RollbackGroup* group)
    : node_(Claim(std::max(path.size(), original.size()) + 1)) {
  node_->kind = static_cast<int>(kind);
  node_->group = group != nullptr ? group->node() : nullptr;
  Copy(node_->path, path);
  Copy(node_->original, original);
  node_->state.store(kActive, std::memory_order_seq_cst);
}

RollbackEntry& RollbackEntry::operator=(RollbackEntry&& other) noexcept {
  if (this != &other) {
    Reset();
    node_ = other.node_;
    other.node_ = nullptr;
  }
  return *this;
}

void RollbackEntry::Reset() noexcept {
  if (node_ == nullptr) return;
  Free(node_);
  node_ = nullptr;
}

void RunRegisteredRollbacks() noexcept {
  for (RollbackNode* n = g_head.load(std::memory_order_acquire); n != nullptr; n = n->next) {
    if (n->state.load(std::memory_order_seq_cst) != kActive) continue;
    if (n->kind == static_cast<int>(RollbackEntry::Kind::kDirectory)) continue;  // below
    const bool committed =
        n->group != nullptr && n->group->committed.load(std::memory_order_seq_cst);
    switch (static_cast<RollbackEntry::Kind>(n->kind)) {
      case RollbackEntry::Kind::kTemporary: ::unlink(n->path); break;
      case RollbackEntry::Kind::kBackup:
        if (committed) {
          ::unlink(n->path);
        } else {
          ::rename(n->path, n->original);
        }
        break;
      case RollbackEntry::Kind::kCreated:
        if (!committed) ::unlink(n->path);
        break;
      case RollbackEntry::Kind::kDirectory: break;
    }
  }
  // Directories last, once the files in them are gone; one still holding files (a committed
  // write's, or someone else's) stays: rmdir(2) removes only empty ones. Nested ones empty in
  // turn, innermost first: passes repeat while one removes something.
  for (bool removed = true; removed;) {
    removed = false;
    for (RollbackNode* n = g_head.load(std::memory_order_acquire); n != nullptr; n = n->next) {
      if (n->state.load(std::memory_order_seq_cst) != kActive) continue;
      if (n->kind != static_cast<int>(RollbackEntry::Kind::kDirectory)) continue;
      if (::rmdir(n->path) == 0) removed = true;
    }
  }
}

}  // namespace tensorferry::internal

#include "device/pipeline_shelf.h"

#include <deque>
#include <mutex>
#include <utility>
#include <vector>

namespace tensorferry::device {
namespace {

struct Shelf {
  std::mutex mu;
  std::deque<std::unique_ptr<DevicePipeline>> idle;  // oldest first
};

Shelf& TheShelf() {
  static Shelf* shelf = new Shelf;  // never destroyed: see the header
  return *shelf;
}

}  // namespace

std::unique_ptr<DevicePipeline> TakeIdlePipeline(
    const std::shared_ptr<const cuda::Runtime>& runtime, const DevicePipelineOptions& options) {
  Shelf& shelf = TheShelf();
  std::unique_ptr<DevicePipeline> taken;
  {
    std::lock_guard<std::mutex> lock(shelf.mu);
    for (auto it = shelf.idle.begin(); it != shelf.idle.end(); ++it) {
      if ((*it)->Matches(*runtime, options)) {
        taken = std::move(*it);
        shelf.idle.erase(it);
        break;
      }
    }
  }
  if (taken) taken->ResetCounters();
  return taken;
}

void KeepIdlePipeline(std::unique_ptr<DevicePipeline> pipeline) {
  if (!pipeline || pipeline->slots_in_use() != 0) return;  // destroyed here
  Shelf& shelf = TheShelf();
  std::vector<std::unique_ptr<DevicePipeline>> dropped;  // destroyed after the lock
  {
    std::lock_guard<std::mutex> lock(shelf.mu);
    for (auto it = shelf.idle.begin(); it != shelf.idle.end();) {
      if ((*it)->SameConfiguration(*pipeline)) {
        dropped.push_back(std::move(*it));
        it = shelf.idle.erase(it);
      } else {
        ++it;
      }
    }
    shelf.idle.push_back(std::move(pipeline));
    while (shelf.idle.size() > kMaxIdlePipelines) {
      dropped.push_back(std::move(shelf.idle.front()));
      shelf.idle.pop_front();
    }
  }
}

size_t ReleaseIdlePipelines() {
  Shelf& shelf = TheShelf();
  std::deque<std::unique_ptr<DevicePipeline>> dropped;
  {
    std::lock_guard<std::mutex> lock(shelf.mu);
    dropped.swap(shelf.idle);
  }
  return dropped.size();
}

size_t IdlePipelines() {
  Shelf& shelf = TheShelf();
  std::lock_guard<std::mutex> lock(shelf.mu);
  return shelf.idle.size();
}

uint64_t IdlePinnedBytes() {
  Shelf& shelf = TheShelf();
  std::lock_guard<std::mutex> lock(shelf.mu);
  uint64_t bytes = 0;
  for (const auto& p : shelf.idle) bytes += p->stats().pinned_bytes;
  return bytes;
}

}  // namespace tensorferry::device

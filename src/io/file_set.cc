// FileSet (file_set.h).
#include "io/file_set.h"

#include <sys/resource.h>

#include <algorithm>

#include "util/macros.h"

namespace tensorferry::io {

FileSet::FileSet(std::shared_ptr<Source> source, std::vector<FileSpec> files, size_t max_open)
    : source_(std::move(source)), max_open_(std::max<size_t>(max_open, 2)) {
  files_.reserve(files.size());
  for (FileSpec& f : files) {
    const bool open = f.open != nullptr;
    files_.push_back(Entry{std::move(f), nullptr, false, open ? ++tick_ : 0});
    if (open) ++open_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  EvictLocked(static_cast<uint32_t>(files_.size()));
}

size_t FileSet::DefaultMaxOpen() {
  struct rlimit limit;
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1024;
  // (at least 2, FileSet's own minimum: a floor of 8 took more than a quarter of small limits)
  return std::clamp<size_t>(limit.rlim_cur / 4, 2, 1024);
}

Result<FileSet::Pin> FileSet::Get(uint32_t f, bool want_direct) {
  std::lock_guard<std::mutex> lock(mu_);
  if (f >= files_.size()) {
    return Status(Code::kInternal, "file index " + std::to_string(f) + " out of range");
  }
  Entry& e = files_[f];
  e.last_use = ++tick_;
  if (!e.spec.open) {
    TF_ASSIGN_OR_RETURN(e.spec.open, source_->Open(e.spec.path, &e.spec.identity));
    ++open_;
    ++opens_;
  }
  if (want_direct && !e.direct && !e.direct_refused && e.spec.open->native_handle() >= 0) {
    Result<std::unique_ptr<DirectFile>> d = DirectFile::Open(*e.spec.open);
    if (d.ok()) {
      if (*d) {  // (null: not now, e.g. descriptors exhausted: buffered this time)
        e.direct = std::move(d).value();
        ++open_;
      }
    } else if (d.status().code() == Code::kUnsupported) {
      e.direct_refused = true;  // the file system refuses O_DIRECT: buffered from now on
    } else {
      return d.status();  // e.g. the file was replaced
    }
  }
  Pin pin{e.spec.open, want_direct ? e.direct : nullptr};
  EvictLocked(f);
  return pin;
}

void FileSet::EvictLocked(uint32_t keep) {
  while (open_ > max_open_) {
    // The least recently used open file other than `keep`. Linear: evictions happen only past
    // max_open, once per file opened then.
    Entry* victim = nullptr;
    for (uint32_t i = 0; i < files_.size(); ++i) {
      Entry& e = files_[i];
      if (i == keep || !e.spec.open) continue;
      if (victim == nullptr || e.last_use < victim->last_use) victim = &e;
    }
    if (victim == nullptr) return;
    open_ -= 1 + (victim->direct ? 1 : 0);
    victim->spec.open.reset();  // closed once no pin holds it
    victim->direct.reset();
  }
}

Status FileSet::CheckUnchanged() {
  std::vector<std::shared_ptr<const SourceFile>> open;  // checked outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : files_) {
      if (e.spec.open) open.push_back(e.spec.open);
    }
  }
  for (const auto& file : open) TF_RETURN_IF_ERROR(file->CheckUnchanged());
  return Status::Ok();
}

size_t FileSet::open_descriptors() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_;
}

uint64_t FileSet::opens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opens_;
}

}  // namespace tensorferry::io

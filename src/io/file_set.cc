// FileSet (file_set.h).
#include "io/file_set.h"

#include <sys/resource.h>

#include <algorithm>

#include "tensorferry/checkpoint.h"

#include "util/macros.h"

namespace tensorferry::io {

FileSet::FileSet(Env* env, std::vector<FileSpec> files, size_t max_open)
    : env_(env != nullptr ? env : Env::Default()), max_open_(std::max<size_t>(max_open, 2)) {
  files_.reserve(files.size());
  for (FileSpec& f : files) files_.push_back(Entry{std::move(f), nullptr, nullptr, false, 0});
}

size_t FileSet::DefaultMaxOpen() {
  struct rlimit limit;
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1024;
  return std::clamp<size_t>(limit.rlim_cur / 4, 8, 1024);
}

Result<FileSet::Pin> FileSet::Get(uint32_t f, bool want_direct) {
  std::lock_guard<std::mutex> lock(mu_);
  if (f >= files_.size()) {
    return Status(Code::kInternal, "file index " + std::to_string(f) + " out of range");
  }
  Entry& e = files_[f];
  e.last_use = ++tick_;
  if (!e.file) {
    TF_ASSIGN_OR_RETURN(e.file, ReopenCheckpointFile(e.spec.path, e.spec.size, env_));
    ++open_;
    ++opens_;
  }
  if (want_direct && !e.direct && !e.direct_refused && e.file->native_handle() >= 0) {
    Result<std::unique_ptr<DirectFile>> d = DirectFile::Open(*e.file);
    if (d.ok()) {
      e.direct = std::move(d).value();
      ++open_;
    } else if (d.status().code() == Code::kUnsupported) {
      e.direct_refused = true;  // the file system refuses O_DIRECT: buffered from now on
    } else {
      return d.status();  // e.g. the file was replaced
    }
  }
  Pin pin{e.file, want_direct ? e.direct : nullptr};
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
      if (i == keep || !e.file) continue;
      if (victim == nullptr || e.last_use < victim->last_use) victim = &e;
    }
    if (victim == nullptr) return;
    open_ -= 1 + (victim->direct ? 1 : 0);
    victim->file.reset();  // closed once no pin holds it
    victim->direct.reset();
  }
}

Status FileSet::CheckOpenSizes() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Entry& e : files_) {
    if (e.file) TF_RETURN_IF_ERROR(CheckCheckpointFileSize(*e.file, e.spec.size));
  }
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

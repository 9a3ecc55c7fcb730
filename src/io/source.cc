// The Env-backed Source (tensorferry/source.h): POSIX identity by fstat/stat.
#include "tensorferry/source.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "io/read_engine.h"
#include "util/macros.h"

namespace tensorferry {

namespace {

std::string Seconds(int64_t ns) {
  std::string frac = std::to_string(ns % 1'000'000'000);
  frac.insert(0, 9 - frac.size(), '0');
  return std::to_string(ns / 1'000'000'000) + "." + frac;
}

FileIdentity FromStat(const struct stat& st) {
  FileIdentity id;
  id.device = static_cast<uint64_t>(st.st_dev);
  id.inode = static_cast<uint64_t>(st.st_ino);
  id.size = static_cast<uint64_t>(st.st_size);
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  return id;
}

// A file of an Env, with the identity it had when opened.
class EnvSourceFile final : public SourceFile {
 public:
  EnvSourceFile(std::unique_ptr<RandomAccessFile> file, FileIdentity identity)
      : file_(std::move(file)), identity_(identity) {}

  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    return file_->Read(offset, dst);
  }
  Result<uint64_t> Size() const override { return file_->Size(); }
  const std::string& path() const noexcept override { return file_->path(); }
  int native_handle() const noexcept override { return file_->native_handle(); }
  const FileIdentity& identity() const noexcept override { return identity_; }

  Status CheckUnchanged() const override {
    TF_ASSIGN_OR_RETURN(const FileIdentity now, Identify(*file_));
    if (now != identity_) return FileChangedError(path(), identity_, now);
    if (file_->native_handle() < 0) return Status::Ok();  // no file system to ask about the path
    struct stat st;
    if (::stat(path().c_str(), &st) != 0) {
      const int err = errno;
      return Status(Code::kIoError, path() +
                                        ": file changed since the checkpoint was opened: the path "
                                        "no longer names it (" +
                                        std::strerror(err) + ")");
    }
    const FileIdentity named = FromStat(st);
    if (named != identity_) return FileChangedError(path(), identity_, named);
    return Status::Ok();
  }

  // fstat of the descriptor, or the size alone without one.
  static Result<FileIdentity> Identify(const RandomAccessFile& file) {
    FileIdentity id;
    if (file.native_handle() < 0) {
      TF_ASSIGN_OR_RETURN(id.size, file.Size());
      return id;
    }
    struct stat st;
    if (::fstat(file.native_handle(), &st) != 0) {
      const int err = errno;
      return Status(Code::kIoError, file.path() + ": fstat: " + std::strerror(err));
    }
    return FromStat(st);
  }

 private:
  std::unique_ptr<RandomAccessFile> file_;
  const FileIdentity identity_;
};

class EnvSource final : public Source {
 public:
  explicit EnvSource(Env* env) : env_(env != nullptr ? env : Env::Default()) {}

  Result<std::unique_ptr<SourceFile>> Open(const std::string& path,
                                           const FileIdentity* expected) override {
    TF_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, env_->OpenRandomAccess(path));
    TF_ASSIGN_OR_RETURN(const FileIdentity id, EnvSourceFile::Identify(*file));
    if (expected != nullptr && id != *expected) return FileChangedError(path, *expected, id);
    return std::unique_ptr<SourceFile>(new EnvSourceFile(std::move(file), id));
  }

 private:
  Env* env_;
};

}  // namespace

std::string DescribeIdentityChange(const FileIdentity& then, const FileIdentity& now) {
  if (then == now) return "";
  if (then.device != now.device || then.inode != now.inode) {
    return "replaced: inode " + std::to_string(then.inode) + " on device " +
           std::to_string(then.device) + " then, inode " + std::to_string(now.inode) +
           " on device " + std::to_string(now.device) + " now";
  }
  if (then.size != now.size) {
    return std::to_string(then.size) + " bytes then, " + std::to_string(now.size) + " now";
  }
  return "modified in place: mtime " + Seconds(then.mtime_ns) + " then, " + Seconds(now.mtime_ns) +
         " now";
}

Status FileChangedError(const std::string& path, const FileIdentity& then,
                        const FileIdentity& now) {
  return Status(Code::kIoError, path + ": file changed since the checkpoint was opened: " +
                                    DescribeIdentityChange(then, now));
}

namespace {
thread_local SourceCounters* current_source_counters = nullptr;
}  // namespace

SourceStats SourceCounters::Snapshot() const {
  SourceStats s;
  s.requests = requests.load(std::memory_order_relaxed);
  s.retries = retries.load(std::memory_order_relaxed);
  s.bytes = bytes.load(std::memory_order_relaxed);
  return s;
}

SourceStatsScope::SourceStatsScope(SourceCounters* counters) noexcept
    : previous_(current_source_counters) {
  current_source_counters = counters;
}

SourceStatsScope::~SourceStatsScope() {
  current_source_counters = previous_;
}

SourceCounters* SourceStatsScope::Current() noexcept {
  return current_source_counters;
}

Status SourceFile::ReadMany(std::span<const SourceRead> reads) const {
  for (const SourceRead& r : reads) TF_RETURN_IF_ERROR(ReadFully(*this, r.offset, r.dst));
  return Status::Ok();
}

Status SourceFile::DropFromPageCache() const {
  return native_handle() < 0 ? Status::Ok() : io::DropPages(native_handle(), path());
}

Result<std::vector<std::string>> Source::List(const std::string& dir, std::string_view) {
  return Status(Code::kUnsupported, dir + ": this source cannot list files");
}

std::unique_ptr<Source> MakeEnvSource(Env* env) {
  return std::make_unique<EnvSource>(env);
}

}  // namespace tensorferry

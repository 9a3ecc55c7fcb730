#include "testing/test_util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "util/macros.h"

namespace tensorferry::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/tensorferry-test-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

FewDescriptors::FewDescriptors(unsigned long spare) {
  struct rlimit limit;
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  saved_cur_ = limit.rlim_cur;
  // The limit bounds descriptor numbers, and an open takes the lowest free one: from the lowest
  // free number on, `spare` more (descriptors open above it, inherited ones, stay usable).
  const int lowest = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (lowest < 0) return;
  ::close(lowest);
  limit.rlim_cur = std::min<rlim_t>(limit.rlim_cur, static_cast<rlim_t>(lowest) + spare);
  ok_ = ::setrlimit(RLIMIT_NOFILE, &limit) == 0;
}

FewDescriptors::~FewDescriptors() {
  struct rlimit limit;
  if (ok_ && ::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    limit.rlim_cur = saved_cur_;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

ShmTempDir::ShmTempDir() {
  char name[] = "/dev/shm/tensorferry-test-XXXXXX";
  if (::mkdtemp(name) != nullptr) path_ = name;
}

ShmTempDir::~ShmTempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

std::vector<std::byte> Pattern(size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 31 + seed * 17 + 5) & 0xff);
  return v;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::byte> ToBytes(const std::string& s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}

std::string MakeFile(const std::string& header_json, uint64_t data_size) {
  std::string out(8, '\0');
  uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header_json;
  for (uint64_t i = 0; i < data_size; ++i) out.push_back(static_cast<char>((i * 131 + 7) & 0xff));
  return out;
}

class MemoryFile final : public RandomAccessFile {
 public:
  MemoryFile(std::string path, std::shared_ptr<MemoryEnv::Entry> entry, std::mutex* mu)
      : path_(std::move(path)), entry_(std::move(entry)), mu_(mu) {}

  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    uint32_t delay_us = 0;
    {
      std::lock_guard<std::mutex> lock(*mu_);
      delay_us = entry_->faults.delay_us;
    }
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    std::lock_guard<std::mutex> lock(*mu_);
    auto& e = *entry_;
    const auto& f = e.faults;
    ++e.reads;
    if (f.truncate_after_reads >= 0 && e.reads > static_cast<uint64_t>(f.truncate_after_reads) &&
        e.bytes.size() > f.truncate_to) {
      e.bytes.resize(f.truncate_to);
    }
    size_t want = dst.size();
    if (f.max_read > 0) want = std::min(want, f.max_read);
    if (f.eio_at >= 0 && static_cast<uint64_t>(f.eio_at) >= offset &&
        static_cast<uint64_t>(f.eio_at) < offset + std::max<size_t>(want, 1)) {
      // As a disk with a bad sector answers: the bytes before it, then an error for a read that
      // starts at it.
      if (static_cast<uint64_t>(f.eio_at) == offset) {
        return Status(Code::kIoError,
                      path_ + ": injected EIO at offset " + std::to_string(f.eio_at));
      }
      want = static_cast<size_t>(static_cast<uint64_t>(f.eio_at) - offset);
    }
    if (offset >= e.bytes.size()) return size_t{0};
    size_t n = std::min<uint64_t>(want, e.bytes.size() - offset);
    std::memcpy(dst.data(), e.bytes.data() + offset, n);
    return n;
  }

  Result<uint64_t> Size() const override {
    std::lock_guard<std::mutex> lock(*mu_);
    return static_cast<uint64_t>(entry_->bytes.size());
  }

  const std::string& path() const noexcept override { return path_; }

 private:
  std::string path_;
  std::shared_ptr<MemoryEnv::Entry> entry_;
  std::mutex* mu_;
};

void MemoryEnv::AddFile(const std::string& path, std::string bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_shared<Entry>();
  e->bytes = std::move(bytes);
  files_[path] = std::move(e);
}

void MemoryEnv::SetFaults(const std::string& path, Faults faults) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it == files_.end()) throw std::runtime_error("MemoryEnv: no file " + path);
  it->second->faults = faults;
}

uint64_t MemoryEnv::reads(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  return it == files_.end() ? 0 : it->second->reads;
}

Result<std::unique_ptr<RandomAccessFile>> MemoryEnv::OpenRandomAccess(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return Status(Code::kNotFound, path + ": cannot open: no such file");
  return std::unique_ptr<RandomAccessFile>(new MemoryFile(path, it->second, &mu_));
}

class FaultyWritableFile final : public WritableFile {
 public:
  FaultyWritableFile(FaultInjectionEnv* env, std::unique_ptr<WritableFile> base)
      : env_(env), base_(std::move(base)) {}

  Status Append(std::span<const std::byte> data) override {
    {
      std::lock_guard<std::mutex> lock(env_->mu_);
      if (env_->Hit(env_->appends_, env_->faults_.fail_append)) {
        return Status(Code::kIoError, path() + ": write of " + std::to_string(data.size()) +
                                          " bytes at offset " + std::to_string(offset_) +
                                          " failed: No space left on device (errno 28)");
      }
    }
    TF_RETURN_IF_ERROR(base_->Append(data));
    offset_ += data.size();
    return Status::Ok();
  }
  Status Sync() override {
    {
      std::lock_guard<std::mutex> lock(env_->mu_);
      if (env_->Hit(env_->syncs_, env_->faults_.fail_sync)) {
        return Status(Code::kIoError, path() + ": fsync failed: Input/output error (errno 5)");
      }
    }
    return base_->Sync();
  }
  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    return base_->WriteAt(offset, data);
  }
  Status Close() override { return base_->Close(); }
  const std::string& path() const noexcept override { return base_->path(); }

 private:
  FaultInjectionEnv* env_;
  std::unique_ptr<WritableFile> base_;
  uint64_t offset_ = 0;
};

void FaultInjectionEnv::SetFaults(Faults faults) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_ = faults;
  appends_ = syncs_ = renames_ = dir_syncs_ = 0;
}

uint64_t FaultInjectionEnv::appends() const {
  std::lock_guard<std::mutex> lock(mu_);
  return appends_;
}

uint64_t FaultInjectionEnv::renames() const {
  std::lock_guard<std::mutex> lock(mu_);
  return renames_;
}

bool FaultInjectionEnv::Hit(uint64_t& counter, uint64_t fail_at) {
  ++counter;
  return fail_at != 0 && counter == fail_at;
}

Result<std::unique_ptr<RandomAccessFile>> FaultInjectionEnv::OpenRandomAccess(
    const std::string& path) {
  return Env::Default()->OpenRandomAccess(path);
}

Result<std::unique_ptr<WritableFile>> FaultInjectionEnv::NewTempFile(
    const std::string& dir, const std::string& stem,
    const std::function<void(const std::string& path)>& reserve) {
  TF_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> base,
                      Env::Default()->NewTempFile(dir, stem, reserve));
  return std::unique_ptr<WritableFile>(new FaultyWritableFile(this, std::move(base)));
}

Status FaultInjectionEnv::RenameFile(const std::string& from, const std::string& to) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (Hit(renames_, faults_.fail_rename)) {
      return Status(Code::kIoError,
                    "cannot rename " + from + " to " + to + ": Input/output error (errno 5)");
    }
  }
  return Env::Default()->RenameFile(from, to);
}

std::vector<std::string> FaultInjectionEnv::synced_directories() const {
  std::lock_guard<std::mutex> lock(mu_);
  return synced_dirs_;
}

Status FaultInjectionEnv::SyncDirectory(const std::string& dir) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    synced_dirs_.push_back(dir);
    if (Hit(dir_syncs_, faults_.fail_sync_directory)) {
      return Status(Code::kIoError,
                    dir + ": fsync of directory failed: Input/output error (errno 5)");
    }
  }
  return Env::Default()->SyncDirectory(dir);
}

ScopedEnv::ScopedEnv(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
  if (const char* old = std::getenv(name_.c_str())) old_ = old;
  if (value) {
    ::setenv(name_.c_str(), value->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

ScopedEnv::~ScopedEnv() {
  if (old_) {
    ::setenv(name_.c_str(), old_->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

uint64_t MappedRss(const void* start) {
  std::ifstream smaps("/proc/self/smaps");
  std::ostringstream head;
  head << std::hex << reinterpret_cast<uintptr_t>(start) << "-";
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    if (line.rfind(head.str(), 0) == 0) {
      inside = true;
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      std::istringstream in(line.substr(4));
      uint64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  return UINT64_MAX;
}

}  // namespace tensorferry::testing

// Test-only helpers shared by every *_test.cc: temporary directories, file helpers, and an
// in-memory Env with fault injection (short reads, EIO, truncation, bit flips).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "tensorferry/env.h"

// TF_UNDER_SANITIZER: defined in ASan, TSan and (with clang) UBSan builds, for tests that cannot
// run under them (e.g. ones that leave the process no spare descriptors).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TF_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(undefined_behavior_sanitizer)
#define TF_UNDER_SANITIZER 1
#endif
#endif

namespace tensorferry::testing {

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Lowers this process's soft descriptor limit to the lowest free descriptor number plus `spare`
// (so at most `spare` more can be opened), and restores it. ok(): whether it could (tests skip
// otherwise). Process-wide: for tests that open nothing on other threads meanwhile; sanitizer
// builds need spare descriptors of their own (TF_UNDER_SANITIZER).
class FewDescriptors {
 public:
  explicit FewDescriptors(unsigned long spare);
  ~FewDescriptors();
  FewDescriptors(const FewDescriptors&) = delete;
  FewDescriptors& operator=(const FewDescriptors&) = delete;
  bool ok() const { return ok_; }

 private:
  unsigned long saved_cur_ = 0;
  bool ok_ = false;
};

// A directory under /dev/shm (tmpfs where it exists), removed with its contents; path() is empty
// when none could be made (no /dev/shm): tests skip then.
class ShmTempDir {
 public:
  ShmTempDir();
  ~ShmTempDir();
  ShmTempDir(const ShmTempDir&) = delete;
  ShmTempDir& operator=(const ShmTempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Sets (or, with nullopt, unsets) an environment variable and restores the old value on
// destruction.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, std::optional<std::string> value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Passes when `haystack` contains `needle`; the failure prints both.
inline ::testing::AssertionResult Contains(const std::string& haystack, std::string_view needle) {
  if (haystack.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << haystack << "\" lacks \"" << needle << "\"";
}

// `n` bytes of a pattern that differs with `seed`: byte i is (31 i + 17 seed + 5) mod 256.
std::vector<std::byte> Pattern(size_t n, unsigned seed);

void WriteBytes(const std::string& path, const std::string& bytes);
std::string ReadBytes(const std::string& path);
// The resident bytes ("Rss:" in /proc/self/smaps) of this process's mapping that starts at
// `start`; UINT64_MAX when there is none (so that no expectation on it passes by accident).
uint64_t MappedRss(const void* start);
std::vector<std::byte> ToBytes(const std::string& s);

// Builds the bytes of a safetensors file from a raw header JSON and a data buffer of `data_size`
// bytes (filled with a pattern). The JSON is not validated or padded.
std::string MakeFile(const std::string& header_json, uint64_t data_size);

// An Env whose files live in memory. Faults can be armed per path.
class MemoryEnv : public Env {
 public:
  struct Faults {
    size_t max_read = 0;  // >0: every read returns at most this many bytes
    // >=0: a bad sector: a read that starts there fails with kIoError ("injected EIO at offset
    // N"), one that starts before it returns only the bytes before it (a short read).
    int64_t eio_at = -1;
    int64_t truncate_after_reads =
        -1;  // >=0: after this many reads, the file shrinks to `truncate_to`
    uint64_t truncate_to = 0;
    uint32_t delay_us = 0;  // >0: every read first waits this long (a slow disk; reads overlap)
  };

  void AddFile(const std::string& path, std::string bytes);
  void SetFaults(const std::string& path, Faults faults);
  // Number of Read calls on `path` so far.
  uint64_t reads(const std::string& path) const;

  Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) override;

 private:
  friend class MemoryFile;
  struct Entry {
    std::string bytes;
    Faults faults;
    uint64_t reads = 0;
  };
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> files_;
};

// An Env over real files (it forwards to Env::Default()) whose write operations fail on demand,
// as a full disk or a failing rename would: counts are over all files, 1-based, 0 = never.
class FaultInjectionEnv : public Env {
 public:
  struct Faults {
    uint64_t fail_append = 0;  // the Nth WritableFile::Append fails with ENOSPC
    uint64_t fail_sync = 0;    // the Nth WritableFile::Sync fails with EIO
    uint64_t fail_rename = 0;  // the Nth RenameFile fails with EIO (after nothing was renamed)
    uint64_t fail_sync_directory = 0;  // the Nth SyncDirectory fails with EIO
  };

  FaultInjectionEnv() = default;
  explicit FaultInjectionEnv(Faults faults) : faults_(faults) {}
  void SetFaults(Faults faults);

  uint64_t appends() const;
  uint64_t renames() const;
  std::vector<std::string> synced_directories() const;  // SyncDirectory's arguments, in order

  Result<std::unique_ptr<RandomAccessFile>> OpenRandomAccess(const std::string& path) override;
  Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& dir, const std::string& stem,
      const std::function<void(const std::string& path)>& reserve) override;
  Status RenameFile(const std::string& from, const std::string& to) override;
  Status SyncDirectory(const std::string& dir) override;

 private:
  friend class FaultyWritableFile;
  // True when this call is the one that should fail.
  bool Hit(uint64_t& counter, uint64_t fail_at);

  mutable std::mutex mu_;
  Faults faults_;
  uint64_t appends_ = 0, syncs_ = 0, renames_ = 0, dir_syncs_ = 0;
  std::vector<std::string> synced_dirs_;
};

}  // namespace tensorferry::testing

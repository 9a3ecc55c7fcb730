// Test-only helpers shared by every *_test.cc: temporary directories, file helpers, and an
// in-memory Env with fault injection (short reads, EIO, truncation, bit flips).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensorferry/env.h"

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

void WriteBytes(const std::string& path, const std::string& bytes);
std::string ReadBytes(const std::string& path);
std::vector<std::byte> ToBytes(const std::string& s);

// Builds the bytes of a safetensors file from a raw header JSON and a data buffer of `data_size`
// bytes (filled with a pattern). The JSON is not validated or padded.
std::string MakeFile(const std::string& header_json, uint64_t data_size);

// An Env whose files live in memory. Faults can be armed per path.
class MemoryEnv : public Env {
 public:
  struct Faults {
    size_t max_read = 0;  // >0: every read returns at most this many bytes
    int64_t eio_at = -1;  // >=0: a read covering this offset fails with kIoError
    int64_t truncate_after_reads =
        -1;  // >=0: after this many reads, the file shrinks to `truncate_to`
    uint64_t truncate_to = 0;
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

}  // namespace tensorferry::testing

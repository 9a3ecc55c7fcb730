// Internal: the files of a checkpoint, owned by the Checkpoint and shared by every loader and
// partial read made from it, with a bounded number of descriptors.
//
// A checkpoint may have thousands of files while a process may open 1024 descriptors
// (RLIMIT_NOFILE's usual soft limit). Checkpoint::Open hands the set the files it opened to read
// their headers (up to `max_open` of them stay open); a file not open is opened again through
// the Source when a read needs it, and must have the identity it had at Checkpoint::Open
// (device, inode, size, mtime: FileChangedError otherwise, source.h). The set keeps at most
// `max_open` descriptors of its own (a file's buffered descriptor, plus its O_DIRECT one when
// used): beyond that the least recently used files are closed. A Pin keeps its file (and O_DIRECT
// descriptor) open while the caller reads through it, even if the set closes it meanwhile, so
// closing never races a read; callers pin only the files of the batches in flight.
//
// O_DIRECT: Get(f, true) opens the file's O_DIRECT descriptor (io::DirectFile) too; a file system
// that refuses O_DIRECT is remembered and the file is read buffered from then on (Pin::direct is
// null).
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/read_engine.h"
#include "tensorferry/source.h"
#include "tensorferry/status.h"

namespace tensorferry::io {

class FileSet {
 public:
  struct FileSpec {
    std::string path;
    FileIdentity identity;                   // what every later open must find
    std::shared_ptr<const SourceFile> open;  // the file while still open, or null
  };
  struct Pin {
    std::shared_ptr<const SourceFile> file;
    std::shared_ptr<const DirectFile> direct;  // null: read buffered
    int direct_fd() const noexcept { return direct ? direct->fd() : -1; }
  };

  // `max_open`: descriptors kept open at once (at least 2); DefaultMaxOpen() for the process.
  // Files of `files` given open count against it at once (the least recently given are closed).
  FileSet(std::shared_ptr<Source> source, std::vector<FileSpec> files, size_t max_open);
  // The source the files come from (its stats() and hints() describe remote reads).
  const std::shared_ptr<Source>& source() const noexcept { return source_; }

  // A quarter of the soft RLIMIT_NOFILE, at most 1024 and at least 8 (256 under the usual 1024):
  // the rest stays for the application, sockets and mappings' leases.
  static size_t DefaultMaxOpen();

  size_t size() const noexcept { return files_.size(); }
  const std::string& path(uint32_t f) const noexcept { return files_[f].spec.path; }
  // The identity file `f` had at Checkpoint::Open (fixed from then on).
  const FileIdentity& identity(uint32_t f) const noexcept { return files_[f].spec.identity; }

  // File `f`, open (and with want_direct, its O_DIRECT descriptor where the file system allows).
  // Errors: those of Source::Open (FileChangedError for a file replaced since the checkpoint was
  // opened) and DirectFile::Open (a replaced file).
  Result<Pin> Get(uint32_t f, bool want_direct = false);

  // SourceFile::CheckUnchanged of every file open now (fstat + stat of the path); the files not
  // open are checked when opened again.
  Status CheckUnchanged();

  // Descriptors the set holds now (pins may hold more while in use).
  size_t open_descriptors() const;
  size_t max_open() const noexcept { return max_open_; }
  // Files opened again after Checkpoint::Open closed them or eviction did (tests).
  uint64_t opens() const;

 private:
  struct Entry {
    FileSpec spec;
    std::shared_ptr<const DirectFile> direct;
    bool direct_refused = false;
    uint64_t last_use = 0;
  };
  void EvictLocked(uint32_t keep);

  std::shared_ptr<Source> source_;
  const size_t max_open_;
  mutable std::mutex mu_;
  std::vector<Entry> files_;
  size_t open_ = 0;  // descriptors held by entries
  uint64_t tick_ = 0;
  uint64_t opens_ = 0;
};

}  // namespace tensorferry::io

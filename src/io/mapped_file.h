// Internal: read-only-by-contract, copy-on-write mappings of whole files, guarded against changes
// of the file (include/tensorferry/mapping.h says what a user sees).
//
// A MappedFile maps a file MAP_PRIVATE with PROT_READ|PROT_WRITE: views into it read the page cache
// with no copy, and a caller who writes into a view gets a private copy of that page (the file is
// never modified). It is unmapped when the last reference goes.
//
// Read lease: Map opens the file again (through /proc/self/fd, so the same inode) and takes a read
// lease on that descriptor, with the lease-break signal directed (F_SETOWN_EX, F_OWNER_TID) at one
// process-wide thread that blocks it and waits for it. A break (someone opens the file for writing
// or truncates it) makes that thread copy the whole mapping into anonymous memory moved over it
// with one mremap (copy-on-write pages would not do: truncation unmaps them too), release the
// lease and close the descriptor: the writer then proceeds and the views keep their bytes. No
// process-wide handler is involved, so nothing else in the process is affected. Leases are held by
// at most kMaxLeases mappings at once (one descriptor each; at most a quarter of RLIMIT_NOFILE).
//
// SIGBUS (no lease, or the copy was too late): touching a page of a mapping whose file has shrunk
// raises SIGBUS, and so does a page the kernel could not read (EIO: a bad sector, an NFS or FUSE
// error); the handler tells them apart by the file's size then (stat of its path, when the path
// still names the mapped inode), and says "could not be read (the file shrank, or an I/O error)"
// when it cannot. Each MappedFile registers its address range in a fixed, lock-free table read by a
// process-wide SIGBUS handler, installed on first use with sigaction (SA_SIGINFO | SA_ONSTACK,
// keeping the previous handler). For a fault inside a registered range the handler maps an
// anonymous zero page over the faulting page, counts the fault, writes one line naming the file and
// offset to stderr (the first fault of each mapping), and returns: the access is retried and reads
// zeros, and CheckMappedFiles() reports it: the handler copies the file's path, the offset and the
// mapping's generation into a process-wide record (a sequence lock the handler never waits on), so
// the report names the right file after the mapping is gone and its slot reused, and names what
// the page held (About) while the mapping lives. Faults at other addresses go to the previous
// handler (or the default action). Populate() does not even fault: it uses MADV_POPULATE_READ,
// which reports a vanished page as an error.
//
// Transient mappings (Use::kTransient), for bytes this library copies out at once (tensor-parallel
// rows gathered for a device): PROT_READ, MAP_SHARED, no read lease (nothing handed out outlives
// the copy, and a concurrent writer is the same hazard as for a pread), and DropPages takes the
// pages already copied out of the process again. The SIGBUS guard is the same.
//
// Limits: the table holds kMaxMappings live mappings (Map returns kUnsupported beyond that, and the
// loader reports it).
//
// Thread-safety: all members may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tensorferry/env.h"
#include "tensorferry/status.h"

namespace tensorferry::io {

// Test-only: while set, a broken lease finds no memory for its copy (as when mmap of the copy
// fails), so the mapping stays the file's and is watched (mapped_file.cc, LeaseKeeper::Break).
void FailLeaseCopiesForTesting(bool fail);

class MappedFile {
 public:
  static constexpr size_t kMaxMappings = 65536;
  static constexpr size_t kMaxLeases = 256;

  enum class Use : uint8_t {
    kViews,      // copy-on-write views handed out, guarded by a read lease
    kTransient,  // read-only, copied from by this library and dropped (DropPages), no lease
  };

  // What the bytes [offset, offset + length) of the file hold (the tensors, for an error), or
  // empty. Called by CheckMappedFiles outside the handler, on any thread, possibly after the
  // MappedFile is gone (a copy of it is taken while it is alive): it must own what it reads.
  using About = std::function<std::string(uint64_t offset, uint64_t length)>;

  // Maps all `size` bytes of `file` (which must have a native handle; the descriptor may be closed
  // afterwards); for kViews, takes a read lease on it where it can. `about`, when set, names what
  // a faulted page held in CheckMappedFiles' report while this mapping lives. Errors:
  // kUnsupported (no descriptor, table full), kIoError (mmap failed).
  static Result<std::shared_ptr<MappedFile>> Map(const RandomAccessFile& file, uint64_t size,
                                                 Use use = Use::kViews, About about = {});
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }

  // Reads every page of [offset, offset + length) into the page cache and maps it (parallel
  // callers may populate disjoint ranges). Errors: kUnexpectedEof naming the file and range when
  // the file no longer covers the range (or when it cannot be asked: "the file shrank, or an I/O
  // error"), kIoError when a page could not be read although the file covers it ("an I/O error;
  // the file still has N bytes") and for any other failure.
  Status Populate(uint64_t offset, uint64_t length) const;

  // OK without faults(); else the first fault as an error naming the file and offset:
  // kUnexpectedEof where the file had shrunk past the page, kIoError where it still covered it
  // (the page could not be read), kUnexpectedEof saying "the file shrank, or an I/O error" where
  // the file could not be asked.
  Status FaultError() const;

  // kTransient only (a no-op otherwise): unmaps the whole pages inside [offset, offset + length)
  // from this process (MADV_DONTNEED; the page cache keeps them, and a later touch maps them
  // again), so the process does not hold what it has already copied out.
  void DropPages(uint64_t offset, uint64_t length) const;

  // Pages replaced with zeros by the SIGBUS handler so far (0 unless the file shrank or a page
  // could not be read).
  uint64_t faults() const noexcept;
  // The file offset of the first such page, if any.
  uint64_t first_fault_offset() const noexcept;
  // Whether a read lease guards the mapping now.
  bool leased() const noexcept;
  // The `about` given to Map (may be empty).
  const About& about() const noexcept { return about_; }

 private:
  MappedFile(std::string path, std::byte* data, uint64_t size, size_t slot, int lease_fd, Use use,
             About about)
      : path_(std::move(path)),
        about_(std::move(about)),
        data_(data),
        size_(size),
        slot_(slot),
        lease_fd_(lease_fd),
        use_(use) {}
  std::string path_;
  About about_;
  std::byte* data_;
  uint64_t size_;
  size_t slot_;
  int lease_fd_;  // the read lease's descriptor, -1 without one
  Use use_;
};

}  // namespace tensorferry::io

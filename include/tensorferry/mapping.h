// Tensors that view mapped files (the mmap engine), and what happens when those files change.
//
// The mmap engine hands out tensors that are views into MAP_PRIVATE mappings of the checkpoint's
// files. A plain mapping silently follows the file: rewritten bytes show through, and pages past a
// new, shorter end raise SIGBUS. tensorferry guards every mapping twice (docs/runtime_settings.md,
// "mmap and files that change"):
//
//  1. Read lease (the normal case). Each mapping holds a read lease (fcntl F_SETLEASE) on its file.
//     When any process, this one included, opens the file for writing or truncates it, the kernel
//     holds that open back and notifies tensorferry, which copies the mapping into anonymous
//     memory put in its place (one mremap) and then releases the lease; the writer proceeds and
//     the tensors keep their bytes. Cost: the mapping's size in anonymous memory, paid only then.
//  2. Loud failure (no lease could be taken: a file this user does not own without CAP_LEASE, a
//     file already open for writing, a filesystem without leases, more than kMaxLeases mappings;
//     or a lease broken without a copy in the mapping's place: no memory for the copy, or a copy
//     slower than the kernel's lease-break-time, which is dropped). A page that vanished reads as
//     zeros instead of killing the process, and then: a line naming the file and offset is written
//     to stderr at once, every later batch from that mapping is refused, CheckMappedFiles() (called
//     by every Loader entry point, every Python call and the CLI at exit) reports it as an error,
//     and the CLI exits 1. A file rewritten in place without shrinking (no page vanishes; the new
//     bytes show through) is seen by its size or mtime: CheckMappedFiles reports it once.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>

#include "tensorferry/status.h"

namespace tensorferry {

struct MappingStats {
  uint64_t live = 0;        // mappings alive now
  uint64_t leased = 0;      // of them, guarded by a read lease now
  uint64_t copied = 0;      // mappings copied into private memory because a writer came (ever)
  uint64_t faults = 0;      // pages that read as zeros because their file shrank (ever)
  uint64_t unleasable = 0;  // mappings made without a lease (ever): guarded by failing loudly
};

// The process-wide figures above.
MappingStats GetMappingStats();

// Ok, or kUnexpectedEof naming the file and the first vanished offset if a mapped file shrank
// under its tensors since the last call that reported it (each fault event is reported once);
// kIoError when the file still covers the page that could not be read (an I/O error), and
// kIoError "<path>: file rewritten in place while its tensors were mapped without a read lease"
// for a file mapped without a lease whose size or mtime changed (the same inode; looked at most
// every 200 ms, a stat per such mapping; each reported once). While the
// Loader that mapped the file (or its Checkpoint) lives, the message also names the tensors of
// that page ("; the read held tensor ..."). Reports the last fault recorded; the count says how
// many mappings faulted since the last report.
Status CheckMappedFiles();

// Whether mappings made from now on take read leases (default: on). Off, only the loud-failure
// guard remains: for a process that rewrites files it has mapped and wants neither the private
// copy nor the writer's wait for it. Process-wide.
void SetMappingLeases(bool enabled) noexcept;

}  // namespace tensorferry

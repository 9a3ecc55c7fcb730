// tensorferry/residency.h: how much of a file is in the page cache, and evicting it.
//
// Used by the loader to choose O_DIRECT (DirectIO::kAuto) and by benchmarks to make cold runs
// cold. Nothing is read: residency is measured with mmap + mincore.
//
// Thread-safety: both functions are reentrant.
#pragma once

#include <cstdint>
#include <string>

#include "tensorferry/status.h"

namespace tensorferry {

// Fraction in [0, 1] of the pages of [offset, offset + length) (clamped to the file) that are in
// the page cache; 1 for an empty range. Errors: kNotFound, kIoError, kInvalidArgument (a
// directory, a FIFO or any other file that is not a regular file: refused without waiting),
// each naming the path.
Result<double> CachedFraction(const std::string& path, uint64_t offset = 0,
                              uint64_t length = UINT64_MAX);

// Asks the kernel to drop the file's clean pages from the page cache (posix_fadvise
// POSIX_FADV_DONTNEED). Dirty pages are written first (fdatasync). Pages mapped by a process stay.
// Errors: kNotFound, kIoError, kInvalidArgument (not a regular file, as above), naming the path.
Status DropFromPageCache(const std::string& path);

}  // namespace tensorferry

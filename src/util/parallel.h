// Internal: the one parallel loop of the library (hashing chunks, checking them, populating
// mappings): items taken one at a time by up to `threads` threads, the caller's among them.
//
// Contract: fn(i) runs at most once for each i in [0, n), on the calling thread or on a helper
// thread started for this call and joined before it returns; fn must be thread-safe. Items are
// taken in increasing order, each by the next thread free (uneven items balance). The first item
// that fails stops the loop from taking more; the items already running finish. If a helper thread
// cannot be started, the loop runs on the threads it has (never fewer than the caller's).
#pragma once

#include <cstddef>
#include <functional>

#include "tensorferry/status.h"

namespace tensorferry {

// Returns the error of the lowest-numbered failing item (every item before it ran, so this is
// the first failure in item order), or Ok.
Status ParallelForUntilError(size_t n, unsigned threads, const std::function<Status(size_t)>& fn);

// For items that cannot fail.
void ParallelFor(size_t n, unsigned threads, const std::function<void(size_t)>& fn);

}  // namespace tensorferry

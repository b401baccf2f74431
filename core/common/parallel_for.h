// Runs independent items on a few threads pulling from one counter (the caller is one of them):
// the host-side loops of the offline tools (checksums of a snapshot's tensors, a conversion's
// reads and writes). kernels/reference.cc keeps its own: kernels include nothing above them.
#pragma once

#include <cstddef>
#include <functional>

#include "absl/status/status.h"

namespace wpub {

// fn(i) for i in [0, n) on `threads` threads (<= 0: the hardware's), never more than n.
void ParallelFor(size_t n, int threads, const std::function<void(size_t)>& fn);

// The same for work that may fail: every item still runs; the first error is returned.
absl::Status ParallelForStatus(size_t n, int threads,
                               const std::function<absl::Status(size_t)>& fn);

}  // namespace wpub

// Idle device pipelines kept for reuse within the process (LoadOptions::keep_staging).
//
// Making a DevicePipeline pins its staging ring (cudaHostAlloc, a slot at a time as loads need
// them), creates a CUDA stream per producer and may open the cuFile driver; destroying it frees
// them. A Loader per file (tensorferry.torch.load_file per shard, safe_open on a CUDA device)
// would pay that for every file. A Loader going away instead puts its idle pipelines on this
// process-wide shelf, and the next Loader that needs a pipeline of the same configuration takes
// one from it, its ring already pinned.
//
// Bounded: at most one pipeline per configuration (runtime, device, slot size, staging bytes,
// producers, GDS mode and alignment) and kMaxIdlePipelines in all (the oldest goes first); what is
// kept holds at most the staging bytes of each, pinned. ReleaseIdlePipelines() frees them all;
// at process exit they are left to the operating system (the shelf is never destroyed, so no
// CUDA call runs during static destruction, when the driver may be gone).
//
// Thread-safety: every function may be called from any thread. A pipeline on the shelf is used
// by nobody; one taken belongs to the caller alone.
#pragma once

#include <cstddef>
#include <memory>

#include "cuda/cuda_api.h"
#include "device/pipeline.h"

namespace tensorferry::device {

inline constexpr size_t kMaxIdlePipelines = 8;

// A kept pipeline made for `runtime` with `options` (DevicePipeline::Matches), its counters
// zeroed (DevicePipeline::ResetCounters), or nullptr when none is kept.
std::unique_ptr<DevicePipeline> TakeIdlePipeline(
    const std::shared_ptr<const cuda::Runtime>& runtime, const DevicePipelineOptions& options);

// Keeps `pipeline` for a later TakeIdlePipeline. REQUIRES: nothing in flight (no Run running, no
// slot in use); a pipeline with slots in use is destroyed instead. When one of the same
// configuration is kept already, `pipeline` replaces it (the older is destroyed, outside the lock).
void KeepIdlePipeline(std::unique_ptr<DevicePipeline> pipeline);

// Destroys every kept pipeline (pinned memory, streams, cuFile driver); returns how many.
size_t ReleaseIdlePipelines();

// How many pipelines are kept now, and the pinned bytes they hold.
size_t IdlePipelines();
uint64_t IdlePinnedBytes();

}  // namespace tensorferry::device

// tensorferry/stats.h: what a load did (LoadStats), and the one list of its fields that every edge
// (the CLI's --json, the Python stats dict) prints from.
//
// Thread-safety: values; VisitLoadStats calls `visit` on the calling thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tensorferry {

struct LoadStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;  // tensor bytes delivered (tied aliases not counted twice)
  // Bytes read from files: `bytes` plus the gaps of covering reads (LoadOptions::tensor_parallel).
  // With mmap, the bytes of the ranges it populates or gathers (views read on first touch count
  // too).
  uint64_t bytes_read = 0;
  uint64_t batches = 0;
  double seconds = 0;              // wall time inside the loader (callbacks excluded)
  uint64_t peak_budget_bytes = 0;  // highest bytes held against the budget
  uint64_t buffers_reused = 0;
  uint64_t buffers_allocated = 0;
  std::string engine;  // the engine that ran ("pread", "io_uring", "mmap")
  // Why that engine: "set by the caller", or what Engine::kAuto found ("files on fuse.sshfs
  // (user space): mmap page faults would wait on the daemon; io_uring, 64 reads in flight").
  std::string engine_reason;
  // The file systems the checkpoint's files are on ("ext4", "nfs", "overlay(nfs)", several
  // comma-separated); "" for object storage.
  std::string filesystem;
  // The budget the loader set itself because no budget was given and the checkpoint exceeds the
  // host memory this process may use (LoadOptions::memory_limit), with where that limit came
  // from; "" when the caller's budget (or none) applied.
  std::string memory_budget;
  uint64_t direct_files = 0;    // files read with O_DIRECT
  uint64_t direct_bytes = 0;    // bytes read with O_DIRECT (the rest went through the page cache)
  uint64_t buffered_files = 0;  // files read through the page cache

  // Object storage and HTTP (zero for local files): requests sent (retries included), requests
  // that retried a failed one, and bytes received, by this load's reads (not those of other
  // loaders of the same checkpoint reading at the same time: source.h, SourceStatsScope).
  uint64_t remote_requests = 0;
  uint64_t remote_retries = 0;
  uint64_t remote_bytes = 0;
  // The local cache of object-store files (ObjectStoreOptions::cache_dir), as the checkpoint's
  // source counted them since the checkpoint was opened (a missing file's download into the
  // cache begins at its first read beyond the header, and runs beside the loads): files read
  // from a copy in the cache, downloads into it begun, and their objects' bytes. Zero without a
  // cache. engine_reason ends with the same in words, and why files read the store if the cache
  // failed.
  uint64_t cache_hits = 0;
  uint64_t cache_fills = 0;
  uint64_t cache_fill_bytes = 0;
  // Of the bytes received for those downloads, those the local disk could not take in time: the
  // cache fetches them again after the load (ObjectStoreOptions::cache_write_behind; 0 with
  // cache_fetch_once, which makes the load wait for the disk instead).
  uint64_t cache_refetch_bytes = 0;
  // Files that read the store because the cache failed them (a full disk, an unwritable
  // directory, a download by another process that made no progress), and the latest reason.
  uint64_t cache_errors = 0;
  std::string cache_error;

  // Device loading (zero for host-only loads).
  std::string device;                // "cpu", "cuda:0", or "mixed" (a placement used several)
  uint64_t device_tensors = 0;       // tensors delivered to CUDA devices
  uint64_t device_bytes = 0;         // their bytes
  uint64_t device_batches = 0;       // batches bound for CUDA devices
  uint64_t device_buffer_bytes = 0;  // device memory allocated for them (tensors plus padding)
  uint64_t staged_bytes = 0;         // bytes through the pinned staging ring
  // Of staged_bytes: rows of tensor-parallel slices gathered from the page cache (a mapping of
  // their file, for files mostly cached: TensorParallelOptions::exact_when_cached) instead of
  // read as covering ranges; counted in bytes_read too.
  uint64_t gathered_bytes = 0;
  uint64_t gds_bytes = 0;     // bytes read by cuFile straight into device memory
  std::string gds_reason;     // why GDS was not used (for some or all bytes); "" if it was
  uint64_t pinned_bytes = 0;  // pinned staging memory the loader holds now (all devices)
  // Highest bytes of device batch buffers live at once during the load (summed over devices;
  // buffers still held from earlier loads included): what device_budget bounds.
  uint64_t peak_device_bytes = 0;

  // Integrity checksums (LoadOptions::verify, docs/integrity.md).
  uint64_t verified_tensors = 0;  // tensors (or slices) whose every delivered byte was checked
  // Tensor-parallel slices of which only the checksum chunks they hold whole were checked: the
  // bytes at their edges (less than a chunk on each side of a block) were delivered unchecked.
  uint64_t verify_partial_tensors = 0;
  uint64_t verified_bytes = 0;  // bytes checked: the verified tensors' and the partial ones' chunks
  // Tensors delivered unchecked although their file has checksums (tensor-parallel slices that
  // hold no whole chunk, such as most strided splits; tensors read to a CUDA device with GDS;
  // lazily mapped tensors under verify auto).
  uint64_t verify_skipped_tensors = 0;
  double verify_seconds = 0;  // wall time spent hashing (summed over batches)
};

// Calls visit(name, value) once per field of `s`, in declaration order; `value` is a
// const uint64_t&, const double& or const std::string&. The names are the field names: they are
// the keys of `tensorferry load --json` and of the Python stats dict. A field added to LoadStats
// is added here, and every edge shows it.
template <class Visit>
void VisitLoadStats(const LoadStats& s, Visit&& visit) {
  visit("tensors", s.tensors);
  visit("bytes", s.bytes);
  visit("bytes_read", s.bytes_read);
  visit("batches", s.batches);
  visit("seconds", s.seconds);
  visit("peak_budget_bytes", s.peak_budget_bytes);
  visit("buffers_reused", s.buffers_reused);
  visit("buffers_allocated", s.buffers_allocated);
  visit("engine", s.engine);
  visit("engine_reason", s.engine_reason);
  visit("filesystem", s.filesystem);
  visit("memory_budget", s.memory_budget);
  visit("direct_files", s.direct_files);
  visit("direct_bytes", s.direct_bytes);
  visit("buffered_files", s.buffered_files);
  visit("remote_requests", s.remote_requests);
  visit("remote_retries", s.remote_retries);
  visit("remote_bytes", s.remote_bytes);
  visit("cache_hits", s.cache_hits);
  visit("cache_fills", s.cache_fills);
  visit("cache_fill_bytes", s.cache_fill_bytes);
  visit("cache_refetch_bytes", s.cache_refetch_bytes);
  visit("cache_errors", s.cache_errors);
  visit("cache_error", s.cache_error);
  visit("device", s.device);
  visit("device_tensors", s.device_tensors);
  visit("device_bytes", s.device_bytes);
  visit("device_batches", s.device_batches);
  visit("device_buffer_bytes", s.device_buffer_bytes);
  visit("staged_bytes", s.staged_bytes);
  visit("gathered_bytes", s.gathered_bytes);
  visit("gds_bytes", s.gds_bytes);
  visit("gds_reason", s.gds_reason);
  visit("pinned_bytes", s.pinned_bytes);
  visit("peak_device_bytes", s.peak_device_bytes);
  visit("verified_tensors", s.verified_tensors);
  visit("verify_partial_tensors", s.verify_partial_tensors);
  visit("verified_bytes", s.verified_bytes);
  visit("verify_skipped_tensors", s.verify_skipped_tensors);
  visit("verify_seconds", s.verify_seconds);
}

}  // namespace tensorferry

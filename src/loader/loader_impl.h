// Loader::Impl: the state a Loader keeps between loads (checkpoint, options, engines, files,
// mappings, pool, budget, device slots, statistics) and the steps every load shares. Internal to
// src/loader/: loader.cc defines the methods; batch_iterator.cc and load_into.cc run loads on it.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "cuda/cuda_api.h"
#include "io/file_set.h"
#include "io/mapped_file.h"
#include "io/read_engine.h"
#include "loader/groups.h"
#include "memory/host_buffer.h"
#include "sink/sink.h"
#include "tensorferry/integrity.h"
#include "tensorferry/loader.h"

namespace tensorferry {

using Clock = std::chrono::steady_clock;

struct Loader::Impl {
  // Puts the device pipelines on the process's shelf (LoadOptions::keep_staging).
  ~Impl();
  std::shared_ptr<const Checkpoint> checkpoint;
  LoadOptions options;
  // Set when options.budget came from the memory this process may use (LoadOptions::memory_limit):
  // the limit and where it came from, for Load's error.
  std::string memory_note;
  Engine engine_kind = Engine::kPread;  // resolved (never kAuto)
  std::string engine_reason;            // why (LoadStats::engine_reason)
  std::string filesystems;              // LoadStats::filesystem
  std::unique_ptr<io::ReadEngine> engine;
  std::shared_ptr<memory::BufferPool> pool;
  std::shared_ptr<memory::Budget> budget;
  // The checkpoint's files (Checkpoint::file_set(): opened once, shared by its loaders).
  std::shared_ptr<io::FileSet> files;
  // Per file, for the mmap engine's views: the mapping, created on first use and kept for the
  // loader's later loads until one of them asks again for a tensor it has given a view of
  // (sink::MapForViews); and the tensors (indices into checkpoint->tensors()) it has.
  std::vector<std::shared_ptr<io::MappedFile>> maps;
  std::vector<std::unordered_set<uint32_t>> viewed;
  // Per file: the transient mapping tensor-parallel rows are gathered from for a device, created
  // on first use and released at the end of each load that reaches it
  // (sink::ReleaseGatherMappings; else when the loader goes).
  std::vector<std::shared_ptr<io::MappedFile>> gather_maps;
  LoadStats stats;
  // Device loading: the runtime (loaded on first use), one sink per CUDA device used, and the
  // engine device batches read through (the loader's engine; a pread engine for kMmap, which has
  // none).
  std::shared_ptr<const cuda::Runtime> runtime;
  std::map<int, sink::DeviceSlot> slots;
  std::unique_ptr<io::ReadEngine> own_copy_engine;
  io::ReadEngine* copy_engine = nullptr;

  // Starts a load's statistics: zero, with what Open found (engine, why, file systems).
  void ResetStats();

  // The sink of CUDA device `index`, created on first use. REQUIRES: not called while a batch is
  // being read on the helper thread.
  Result<sink::DeviceSlot*> Slot(int index);

  // The engine that copies bytes into memory (host destinations of LoadInto, device batches).
  Result<io::ReadEngine*> CopyEngine();

  // Takes the checkpoint's files once per loader, and checks that the files it holds open are
  // still those seen at Checkpoint::Open (the others are checked when opened again): a file
  // replaced or rewritten since then is reported before a read of it.
  Status OpenFiles();
  // After reads, before their bytes are handed out: the files held open still those Open saw
  // (an in-place rewrite during a load, such as `cp` over a shard, changes the mtime; the bytes
  // read may then mix both versions). The mapped engine's leased pages need no check, but it
  // costs two system calls per held file and is made for every engine.
  Status CheckFilesAfterReads() const { return checkpoint->CheckUnchanged(); }
  // LoadOptions::drop_cache: the files marked in `read` dropped from the page cache (through
  // the file the load read: an object-store file's copy in the cache, if any). Nothing with the
  // mmap engine, whose tensors are those pages.
  Status DropReadFiles(const std::vector<bool>& read);

  // Runs `run` over windows of the files in `used` (distinct file indices), each window at most
  // half the file set's descriptor bound, with the window's files pinned: pins[f].file is set for
  // exactly the files of the window. One window unless a batch reads hundreds of files. Each
  // window's files are checked unchanged after its reads, while pinned (once unpinned they may be
  // closed to make room for the next window's files or another loader's, which would hide them
  // from CheckFilesAfterReads).
  Status InFileWindows(const std::vector<uint32_t>& used, const std::vector<bool>& want_direct,
                       const std::function<Status(const std::vector<io::FileSet::Pin>&)>& run);

  // What a selection means for one load (Describe), indexed for batches: the tensors to read,
  // which of them go to the caller under their own name, and the tied aliases
  // (LoadOptions::tensor_parallel ties) delivered sharing their target's data.
  struct Resolved {
    std::vector<uint32_t> read;                    // indices into tensors(), ascending
    std::vector<bool> deliver;                     // per tensor index; empty: every read tensor
    std::multimap<uint32_t, std::string> aliases;  // target index -> alias name
  };

  Result<Resolved> Resolve(const Selection& selection) const;

  Result<Description> Describe(const Selection& selection) const;

  static Resolved Index(Description d);

  // Applies `resolved` to a batch made from `planned`: tied aliases added after their target
  // (sharing its bytes and owner), tensors read only for an alias dropped.
  static void Deliver(const Resolved& resolved, const PlanBatch& planned, Batch& batch);

  Result<std::vector<Group>> MakeGroups(const std::vector<uint32_t>& read) const;

  // Decides, per file the plan reads, whether its reads use O_DIRECT: returns the descriptor per
  // file index (-1: buffered) and counts the choices into stats.
  // `reads`: the (file, offset, length) ranges the load reads; `skip_host_mapped`: the mmap
  // engine's host batches read nothing (only its device batches count).
  Result<std::vector<bool>> ChooseDirect(std::span<const Group> groups, bool skip_host_mapped);

  // Per file, whether its reads within [lo, hi) use O_DIRECT (hi 0: not read). The O_DIRECT
  // descriptor is opened here, so a file system that refuses it is known (and counted) now.
  Result<std::vector<bool>> ChooseDirect(
      const std::pair<std::vector<uint64_t>, std::vector<uint64_t>>& spans);

  // Every device slot of `groups` (its peak reset) and the copy engine when a group is bound for a
  // device: whether one is.
  Result<bool> PrepareDevices(const std::vector<Group>& groups);

  // The engine whose counters a load reports (it reads host and device batches alike).
  const io::ReadEngine* Counted() const;

  // What the sinks of one load borrow.
  sink::SinkContext Context(std::vector<bool> want_direct, io::ReadEngine* reader);

  // The device figures of the load that just ended: pipeline totals since `before`, the pinned
  // memory held, the peak of device buffers.
  void CollectDeviceStats(const std::map<int, device::DevicePipelineStats>& before);
  // Integrity checksums (LoadOptions::verify, src/loader/verify.cc): per file, those loads check
  // (none for a file without, and for every file when verify is off). Read once by Open.
  std::vector<std::optional<FileChecksums>> checksums;
  Status LoadChecksums();
  // Threads that hash a batch's chunks after its reads: options.threads, else every CPU.
  unsigned VerifyThreads() const;
  // What the checks counted; summed into stats.verified_* / verify_* at the end of a load.
  using VerifyCounts = sink::VerifyCounts;
  // Checks every whole host tensor of `batch` (made from `planned`, before tied aliases are added)
  // whose file has checksums, chunks hashed in parallel: for the mapped sink's batches (the host
  // sink checks its own as bytes land, sink/landing_check.h), and counts device tensors as
  // skipped. Errors: kChecksumMismatch.
  Status VerifyBatch(const PlanBatch& planned, const Batch& batch, VerifyCounts& counts) const;
  // stats.verified_* / verify_* from what a load's checks counted (Load/Stream, LoadInto).
  void CollectVerifyStats(const VerifyCounts& counts);
  // The source requests this loader's engines made so far (SourceStatsScope: not those of other
  // loaders of the checkpoint), and stats.remote_* as their growth since `before`.
  SourceStats SourceNow() const {
    SourceStats s;
    for (const io::ReadEngine* e : {engine.get(), own_copy_engine.get()}) {
      if (e == nullptr) continue;
      const SourceStats c = e->stats().source;
      s.requests += c.requests;
      s.retries += c.retries;
      s.bytes += c.bytes;
    }
    return s;
  }
  void CollectSourceStats(const SourceStats& before) {
    const SourceStats now = SourceNow();
    stats.remote_requests = now.requests - before.requests;
    stats.remote_retries = now.retries - before.retries;
    stats.remote_bytes = now.bytes - before.bytes;
    // The cache's counts are the checkpoint's source's since it was made (a file's download
    // begins at its first read beyond the header, in whichever load reads it first).
    const SourceStats source = checkpoint->file_set()->source()->stats();
    stats.cache_hits = source.cache_hits;
    stats.cache_fills = source.cache_fills;
    stats.cache_fill_bytes = source.cache_fill_bytes;
    stats.cache_refetch_bytes = source.cache_refetch_bytes;
    stats.cache_errors = source.cache_errors;
    stats.cache_error = source.cache_last_error;
    if (!source.cache_summary.empty())
      stats.engine_reason = engine_reason + "; " + source.cache_summary;
  }
};

}  // namespace tensorferry

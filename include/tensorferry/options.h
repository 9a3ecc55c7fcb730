// tensorferry/options.h: LoadOptions, every setting of a Loader, and the one way to set them from
// text (the environment, the CLI, the Python binding and tensorferry-mpi all go through it).
//
// A LoadOptions is a plain value: fields may be assigned directly from C++. Edges that receive
// text (a TENSORFERRY_* variable, a --flag, a Python keyword) call Set(key, value) with the key
// naming scheme below, so that every edge accepts the same values and reports the same errors;
// Validated() (Loader::Open calls it) applies the cross-field checks and the clamps.
//
// Keys (Set, LoadOptionKeys): engine, threads, chunk_size, direct, queue_depth, budget,
// allow_oversized, order, pool_bytes, populate, prefer_mmap, device, gds, staging_bytes,
// staging_slot, device_producers, device_budget, tp_rank, tp_size, shard_rules, shard_max_gap,
// verify, coop_exchange, coop_storage_rate, coop_network_rate, coop_probe_bytes, coop_timeout_ms,
// and for object
// storage
// (object_store.h) s3_endpoint, s3_region, s3_profile, s3_access_key_id, s3_secret_access_key,
// s3_session_token, s3_anonymous, s3_path_style (no variables: the AWS_* variables apply),
// object_concurrency, object_part_size, object_retries, object_timeout_ms, object_header_bytes,
// object_verify_tls, object_ca_bundle, object_cache_dir, object_cache_max, object_hub_cache,
// object_cache_write_behind, object_cache_fetch_once. Each edge spells a key
// its own way: the environment as TENSORFERRY_<KEY> (upper case; `direct` is TENSORFERRY_DIRECT_IO;
// tp_*, shard_rules, shard_max_gap and allow_oversized have no variable), the CLI as --key with '-'
// for '_' (tensorferry-mpi drops the coop_ prefix), Python as key=. docs/runtime_settings.md lists
// them.
//
// Thread-safety: a value; no shared state.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/device.h"
#include "tensorferry/env.h"
#include "tensorferry/plan.h"
#include "tensorferry/shard.h"
#include "tensorferry/status.h"

namespace tensorferry {

// Integrity checksums checked at load (integrity.h, docs/integrity.md): the digests embedded in a
// file's metadata, else those of the sidecar manifest beside the checkpoint.
//   kAuto: check the files that have checksums, load the others unchecked.
//   kOn:   every file must have them (Loader::Open fails with kChecksumsInvalid naming the first
//          file without), and every whole tensor delivered is checked.
//   kOff:  nothing is checked (nor are the records read).
enum class VerifyMode : uint8_t { kAuto, kOn, kOff };
// "auto" / "on" / "off". Errors: kInvalidArgument naming the value.
std::string_view VerifyModeName(VerifyMode mode) noexcept;
Result<VerifyMode> ParseVerifyMode(std::string_view name);

// Cooperative tensor-parallel loading (cooperative.h, docs/distributed.md): which tensors are
// read once by one rank and exchanged over the collective, the others being read by every rank
// for itself (its slice, or the whole of a replicated tensor).
//   kAuto: the cost model decides per tensor from the storage and network rates (PlanCooperative).
//   kAll:  every tensor is exchanged.
//   kNone: none is (the independent sliced load, through LoadCooperative).
enum class ExchangeChoice : uint8_t { kAuto, kAll, kNone };
// "auto" / "all" / "none". Errors: kInvalidArgument naming the value.
std::string_view ExchangeChoiceName(ExchangeChoice choice) noexcept;
Result<ExchangeChoice> ParseExchangeChoice(std::string_view name);

// Rates the cooperative cost model assumes when none is given: one host's storage (2 GB/s, a
// local NVMe drive or a fast network file system) and one host's network link (10 Gbit/s).
inline constexpr uint64_t kDefaultStorageRate = 2'000'000'000;
inline constexpr uint64_t kDefaultNetworkRate = 1'250'000'000;

// Settings of LoadCooperative only (a Loader ignores them).
struct CooperativeOptions {
  ExchangeChoice exchange = ExchangeChoice::kAuto;  // TENSORFERRY_COOP_EXCHANGE
  // Bytes per second one host reads from its storage (all its ranks together); 0: the default
  // above (TENSORFERRY_COOP_STORAGE_RATE).
  uint64_t storage_rate = 0;
  // Bytes per second one host receives from the other hosts; 0: measured by the probe below when
  // it runs, else the default above (TENSORFERRY_COOP_NETWORK_RATE). Ranks on one host exchange
  // through memory, at no cost.
  uint64_t network_rate = 0;
  // Bytes each rank sends to the ranks on other hosts, through the group's own collective, to
  // measure the network rate LoadCooperative plans with: only with exchange kAuto, network_rate
  // 0 and ranks on more than one host; 0: no probe (TENSORFERRY_COOP_PROBE_BYTES). The nominal
  // rate of a link is not what an exchange achieves over it (docs/distributed.md).
  uint64_t probe_bytes = 16u << 20;
  // The longest a rank waits in one step of the load for the other ranks (a round's reads, an
  // exchange) before it gives up, in milliseconds; 0: forever; at most kMaxCoopTimeoutMs
  // (TENSORFERRY_COOP_TIMEOUT_MS). A
  // rank that died or hangs, or a link that went down, then ends every waiting rank with an error
  // naming the rank and the step (Collective::Abort: an MPI job is aborted).
  uint64_t timeout_ms = 300'000;
};

// How bytes get from the files into memory.
//   kAuto:    kIoUring where the kernel allows it and its rings can be made (one per worker:
//             a low descriptor limit may refuse them), else kPread (engine_reason says why);
//             kMmap instead when LoadOptions::prefer_mmap and every file is on a local file
//             system (each file's own, through symbolic links). Files on a network (NFS, SMB,
//             Lustre, GPFS, Ceph, 9p, ...) or user-space (FUSE, virtiofs) file system, or on an
//             overlay of one, are never mapped by kAuto: a page-cache miss
//             there is a synchronous round trip per readahead window, and large reads with many
//             in flight are several times faster (docs/benchmarks.md, "Slow file systems"). On
//             those file systems kAuto also keeps more reads in flight (kSlowFsInFlight: io_uring
//             queue_depth, or pread threads) where threads and queue_depth are left at their
//             defaults. LoadStats::filesystem and ::engine_reason say what was found and chosen.
//   kPread:   a pool of threads issuing pread(2) (preadv2 with O_DIRECT when direct I/O is used).
//   kIoUring: one ring per worker thread through liburing, queue_depth reads in flight each.
//   kMmap:    zero-copy: each file is mapped read-only once per loader and every Tensor is a view
//             into the mapping (owner() keeps the mapping alive after the loader is gone). Pages
//             are read on first touch unless LoadOptions::populate. No budget applies (the page
//             cache owns the memory; so do the host buffers that tensor-parallel slices of more
//             than one range, split on a dimension past the first, are gathered into). Files that
//             change under their tensors (include/tensorferry/mapping.h): each mapping holds a read
//             lease, and a writer that opens or truncates the file makes tensorferry copy the
//             mapping into private memory first, so tensors keep their bytes; where no lease can be
//             had, a page that vanished reads as zeros, is reported on stderr at once and by
//             CheckMappedFiles (every Stream, Load and LoadInto starts with it), and a batch from
//             that mapping is refused with kUnexpectedEof naming the file and offset
//             (docs/runtime_settings.md, "mmap and files that change").
enum class Engine : uint8_t { kAuto, kPread, kIoUring, kMmap };

// O_DIRECT (bypassing the page cache) for the copying engines.
//   kAuto: per file, direct when less than half of the file's bytes to read are in the page cache
//          (measured with mincore) and the file system accepts O_DIRECT; buffered otherwise.
//   kOn:   direct for every file whose file system accepts it (buffered fallback reported in
//          LoadStats::direct_files / buffered_files).
//   kOff:  always buffered.
enum class DirectIO : uint8_t { kAuto, kOn, kOff };

// "auto", "pread", "io_uring", "mmap" / "auto", "on", "off". Parse* errors: kInvalidArgument.
std::string_view EngineName(Engine engine) noexcept;
Result<Engine> ParseEngine(std::string_view name);
std::string_view DirectIOName(DirectIO direct) noexcept;
Result<DirectIO> ParseDirectIO(std::string_view name);

// Every option with its default. Environment variables (TENSORFERRY_*) seed these defaults only
// through LoadOptions::FromEnvironment(); a default-constructed LoadOptions ignores the
// environment. docs/runtime_settings.md lists the variables.
// Limits LoadOptions::Validated (so Loader::Open) applies (clamping, not failing):
// docs/runtime_settings.md.
inline constexpr uint64_t kMinChunkSize = 4096;  // chunk_size below it reads as 4 KiB (a page)
inline constexpr unsigned kMaxThreads = 256;     // more threads start 256
inline constexpr unsigned kMaxQueueDepth = 4096;
inline constexpr uint64_t kMaxCoopTimeoutMs = 1'000'000'000'000;  // cooperative.timeout_ms
// Reads kAuto keeps in flight on a network or user-space file system (Engine::kAuto).
inline constexpr unsigned kSlowFsInFlight = 64;  // io_uring's own bound on a ring's entries
// The pread engine's workers when `threads` is 0: one per online CPU, at least this many. Its
// reads block, one in flight per worker: with a worker per core, a worker that checks what it
// just read (verify) leaves the disk one read short (docs/benchmarks.md, "The pread engine's
// workers").
inline constexpr unsigned kPreadMinThreads = 8;
// LoadOptions::tensor_parallel->rank after Set("tp_size") alone: not a rank (Validated refuses it).
inline constexpr uint32_t kUnsetTpRank = UINT32_MAX;

struct LoadOptions {
  Engine engine = Engine::kAuto;  // TENSORFERRY_ENGINE
  // I/O workers; 0 = one per online CPU (pread: at least kPreadMinThreads) (TENSORFERRY_THREADS)
  unsigned threads = 0;
  uint64_t chunk_size = 8ull << 20;   // bytes per read task (TENSORFERRY_CHUNK_SIZE)
  DirectIO direct = DirectIO::kAuto;  // TENSORFERRY_DIRECT_IO
  unsigned queue_depth = 8;  // io_uring reads in flight per worker (TENSORFERRY_QUEUE_DEPTH)
  uint64_t budget = 0;  // bytes of tensor data held at once; 0 = unbounded (TENSORFERRY_BUDGET)
  bool allow_oversized = false;  // a tensor larger than the budget loads alone instead of failing
  DeliveryOrder order = DeliveryOrder::kFile;  // TENSORFERRY_ORDER = file | layer
  // Released batch buffers kept for reuse by later batches and loads (TENSORFERRY_POOL_BYTES).
  uint64_t pool_bytes = 4ull << 30;
  // mmap engine: pre-fault every mapped page during the load (MAP_POPULATE-like, in parallel) so
  // first access costs nothing; false: pages are read on first touch.
  bool populate = false;
  // Engine::kAuto may choose kMmap (with `populate` as set) when every file is on a local file
  // system (TENSORFERRY_PREFER_MMAP). The Python package's whole-file defaults set it: mapping is
  // the fastest way to tensors in host memory from the page cache or a local disk.
  bool prefer_mmap = false;
  // Host memory the copying engines may fill with tensor data (TENSORFERRY_MEMORY_LIMIT): 0
  // (default) = 3/4 of what this process may still allocate when the Loader opens
  // (memory_limit.h: the memory cgroup's limit less its unreclaimable usage, and MemAvailable);
  // a size = that many bytes; "off" (UINT64_MAX) = no check. Applies when `budget` is 0 and the
  // host is the target: a selection larger than the limit is then loaded under a budget of the
  // limit (allow_oversized), so Stream completes and Load fails before reading anything with
  // kBudgetExceeded naming the limit and suggesting a budget. The mmap engine is exempt (its
  // tensors are page-cache pages the kernel can reclaim), as are device targets.
  uint64_t memory_limit = 0;
  // After each load, ask the kernel to drop the files it read from the page cache
  // (posix_fadvise DONTNEED; TENSORFERRY_DROP_CACHE), for servers that want that memory back.
  // Not with the mmap engine, whose tensors are those pages (a mapped page is not dropped): refused
  // with Engine::kMmap; Engine::kAuto then reads (never maps, whatever prefer_mmap says).
  // Through SourceFile::DropFromPageCache: an object-store file drops its copy in the object
  // cache (a download in progress: when committed).
  bool drop_cache = false;
  Env* env = nullptr;  // nullptr: Env::Default(). Not owned. Direct I/O and mmap need the default.
  // Cancellation: a flag the caller may set from any thread while a load runs. Host reads not yet
  // started are not started (those in flight finish: at most one chunk per worker), no further
  // batch is delivered, and the call returns kCancelled. The flag is the caller's: a load that
  // starts with it set returns kCancelled at once; clear it before the next load.
  std::shared_ptr<const std::atomic<bool>> cancel;
  // Tensor parallelism: when set, every tensor is delivered as the slice rank
  // `tensor_parallel->rank` of `tensor_parallel->world` holds under `tensor_parallel->spec`
  // (shard.h): Tensor::shape() is the local shape, only the slice's bytes are read (plus gaps up to
  // tensor_parallel->max_gap inside covering reads), and LoadStats::bytes_read shows it. Dim-0
  // slices are one contiguous read (with mmap, a view into the mapping); other slices are strided
  // reads packed into pooled buffers. Under a budget a tensor counts the bytes its reads occupy
  // (its slice plus covered gaps). On a CUDA device (device/placement) the slice lands in the
  // batch's device buffer holding exactly the local bytes: dim-0 slices as contiguous device tasks
  // (GDS-eligible), other dims as strided tasks the pipeline copies with cudaMemcpy2DAsync from the
  // staged covering range (rows are staged together only as far as they fit one staging slot;
  // with exact_when_cached, files mostly in the page cache have those rows gathered from a
  // mapping instead, staging only the slices' bytes; max_gap shapes host reads only: see
  // docs/gpu.md, "Tensor-parallel slices"). Ties of the spec: an alias is delivered sharing its
  // target's data (one read), also when the alias is absent from the files (tie_word_embeddings) or
  // present as a duplicate (then its own bytes are not read).
  std::optional<TensorParallelOptions> tensor_parallel;
  // LoadCooperative's choices (cooperative.h); the Loader ignores them.
  CooperativeOptions cooperative;

  // Checkpoints at "s3://" and "http(s)://" URLs (object_store.h): credentials, endpoint and
  // transport. Their reads are requests issued by the pread engine's workers, whatever `engine`
  // says (it is about local files), at least object_store.concurrency of them, each read at most
  // object_store.part_size bytes; on the way to a GPU, one request per staging slot
  // (device_producers, unless set, is staging_bytes / staging_slot).
  ObjectStoreOptions object_store;

  // --- device loading (see loader.h's file comment and docs/gpu.md) ---
  // Where tensors go: the host (default) or a CUDA device (TENSORFERRY_DEVICE = cpu, cuda, cuda:N).
  // A CUDA target is checked at Loader::Open (kCudaNotFound, kCudaNoDevice with the reason).
  Device device = Device::CPU();
  // Per-tensor placement (like accelerate's device_map): when set, called once per selected tensor
  // at the start of each load and overrides `device` (Placement() builds one from name prefixes).
  // Host tensors take the host path, device tensors the device pipeline; batches never mix devices.
  std::function<Device(const TensorInfo&)> placement;
  // Pinned host memory of the staging ring, per device used (TENSORFERRY_STAGING_BYTES): at least
  // two slots' worth. Pinned a slot at a time as the first load needs them (one slot when the
  // Loader opens), kept per Loader and device and reused by every load.
  uint64_t staging_bytes = 64ull << 20;
  // Bytes per staging slot: per read and per host-to-device copy (TENSORFERRY_STAGING_SLOT).
  uint64_t staging_slot = 8ull << 20;
  // Producer threads of the pipeline, each with its own CUDA stream; 0: min(8, slots); at most
  // kMaxThreads (Set refuses more).
  unsigned device_producers = 0;
  // Keep the device pipeline (pinned staging ring, streams, cuFile driver) when the Loader goes,
  // for the next Loader in this process with the same device and staging options
  // (TENSORFERRY_KEEP_STAGING): a Loader per file then pins its ring once, not once per file. At
  // most one is kept per configuration and 8 in all, each holding at most staging_bytes pinned,
  // until ReleaseIdleStaging() (device.h) or the process ends.
  bool keep_staging = true;
  // Bytes of device batch buffers (tensors plus padding) live at once per device; 0 = unbounded
  // (TENSORFERRY_DEVICE_BUDGET). See "Device memory, precisely" in loader.h's file comment.
  uint64_t device_budget = 0;
  // GPUDirect Storage: auto, on, off (TENSORFERRY_GDS; device.h).
  GdsMode gds = GdsMode::kAuto;
  // Checksums checked at load (TENSORFERRY_VERIFY = auto | on | off; VerifyMode above). A batch
  // is delivered only after every whole tensor in it matched; a mismatch fails the load with
  // kChecksumMismatch naming file, tensor, chunk and byte ranges. Checked: whole tensors on the
  // host (copying engines: each piece as it lands in the batch buffer; mmap: the mapped range,
  // which reads it; without populate only with kOn) and on a CUDA device (in the pinned staging
  // slots, before each copy). Tensor-parallel slices: the checksum chunks a slice holds whole
  // (verify_partial_tensors when bytes at its edges are left out). Not checked
  // (verify_skipped_tensors): slices that hold no whole chunk (most strided splits), and under
  // kAuto tensors read with GDS (never in host memory) and lazily mapped tensors (no populate).
  // Under kOn tensors with checksums are staged through host memory, not read with GDS (with
  // gds=on the load fails saying so); a GDS read that fails over to the staging ring is staged
  // whole, so its bytes are checked.
  VerifyMode verify = VerifyMode::kAuto;

  // Sets the option `key` (see the file comment) from text. Values: engine/direct/order/device/gds
  // as their Parse* functions read them; counts (threads, queue_depth, device_producers, tp_rank,
  // tp_size) as decimal digits; verify as auto/on/off; sizes (chunk_size, budget, pool_bytes,
  // staging_bytes, staging_slot, device_budget, shard_max_gap, coop_probe_bytes, and the rates
  // coop_storage_rate and coop_network_rate in bytes per second) as ParseSize reads them ("256MB",
  // "1GiB", "4096"); memory_limit as a size or "off"; booleans (allow_oversized, populate,
  // prefer_mmap, drop_cache, keep_staging) as 1/0, on/off, true/false, yes/no; shard_rules as
  // "builtin", "none" or ShardSpec JSON. A tp_* or shard_* key creates `tensor_parallel` (builtin
  // rules) when unset; tp_rank and tp_size must both be set (Validated checks). shard_max_gap also
  // turns exact_when_cached off (an explicit gap applies to every file). An empty value is an
  // error. Errors: kInvalidArgument "<key> = <value> <why>" (unknown key, bad value, a value out of
  // the field's range, 0 for chunk_size, queue_depth, staging_bytes, staging_slot); the edge adds
  // its own spelling of the key as context (SetContext). On error the options are unchanged.
  Status Set(std::string_view key, std::string_view value);
  // For typed edges: the shard spec itself (creates `tensor_parallel` as the tp_* keys do).
  void SetShardSpec(ShardSpec spec);

  // These options checked and clamped, as Loader::Open uses them. Clamped, not refused:
  // chunk_size below kMinChunkSize reads kMinChunkSize; threads above kMaxThreads, queue_depth
  // above kMaxQueueDepth start that many. Errors: kInvalidArgument for chunk_size 0, queue_depth 0,
  // staging_bytes 0, staging_slot 0, an enumeration (engine, direct, order, gds, verify,
  // cooperative.exchange) holding no value of its type, drop_cache with engine mmap, a
  // `tensor_parallel` without both tp_rank and tp_size (Set leaves rank at kUnsetTpRank and world
  // at 0 until both are given), tp_rank not below tp_size, an invalid shard spec
  // (ShardSpec::Validate).
  Result<LoadOptions> Validated() const;
  Status Validate() const { return Validated().status(); }

  // Defaults overridden by the TENSORFERRY_* environment variables that are set (Set for each).
  // Errors: kInvalidArgument "TENSORFERRY_X=\"value\": <Set's message>".
  static Result<LoadOptions> FromEnvironment();
};

// The keys Set accepts, in the order of the file comment.
std::span<const std::string_view> LoadOptionKeys() noexcept;
// The environment variable of `key` ("TENSORFERRY_CHUNK_SIZE"), "" for a key without one.
std::string LoadOptionVariable(std::string_view key);

// The TENSORFERRY_* variables of this process's environment that nothing of tensorferry reads,
// sorted by name, each in words: "NAME is not a tensorferry setting: it is ignored", followed by
// " (did you mean KNOWN?)" when a known name is at most 3 edits away (the nearest):
// a misspelt TENSORFERRY_BUGDET is otherwise ignored without a word, and the load it was meant
// to bound runs without a budget. Known: the variables of LoadOptionKeys, the library's others
// (TENSORFERRY_CUDA_RUNTIME, TENSORFERRY_CUFILE_LIBRARY, TENSORFERRY_CURL_LIBRARY) and those of
// its test suite and scripts (UnknownEnvironmentVariables's list, options.cc). The CLI prints
// them as warnings before a command runs; the Python package logs them at import. Not an error:
// another version's variable must not break this one. Reads `environ`: call it while no other
// thread changes the environment.
std::vector<std::string> UnknownEnvironmentVariables();

// options.Set(key, value) with the edge's spelling of the key (e.g. "--budget",
// "TENSORFERRY_BUDGET=\"1x\"") put in front of an error message: "<where>: <Set's message>".
Status SetContext(LoadOptions& options, std::string_view key, std::string_view value,
                  std::string_view where);

// "file" / "layer". Errors: kInvalidArgument naming the value.
std::string_view DeliveryOrderName(DeliveryOrder order) noexcept;
Result<DeliveryOrder> ParseDeliveryOrder(std::string_view name);
// "1"/"0", "on"/"off", "true"/"false", "yes"/"no". Errors: kInvalidArgument naming the value.
Result<bool> ParseBool(std::string_view text);

}  // namespace tensorferry

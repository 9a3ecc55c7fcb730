// Load-time integrity checks (LoadOptions::verify, docs/integrity.md): the checksums of each file
// are read once when the Loader opens (embedded in the file's metadata, else the sidecar manifest
// beside the checkpoint), and every batch's whole host tensors are hashed chunk by chunk, on
// several threads, after its reads and before it is delivered (for a batch read ahead, on the
// helper thread, overlapping the caller's work on the previous batch).
#include <algorithm>
#include <chrono>
#include <thread>

#include "loader/loader_impl.h"
#include "util/macros.h"
#include "util/parallel.h"

namespace tensorferry {

unsigned Loader::Impl::VerifyThreads() const {
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  return options.threads > 0 ? std::min(options.threads, cpus) : cpus;
}

Status Loader::Impl::LoadChecksums() {
  checksums.clear();
  TF_ASSIGN_OR_RETURN(checksums, ChecksumsForLoad(*checkpoint, options.verify));
  return Status::Ok();
}

void Loader::Impl::CollectVerifyStats(const VerifyCounts& counts) {
  stats.verified_tensors = counts.tensors.load();
  stats.verified_bytes = counts.bytes.load();
  stats.verify_partial_tensors = counts.partial.load();
  stats.verify_skipped_tensors = counts.skipped.load();
  stats.verify_seconds = static_cast<double>(counts.nanos.load()) / 1e9;
}

Status Loader::Impl::VerifyBatch(const PlanBatch& planned, const Batch& batch,
                                 VerifyCounts& counts) const {
  const auto start = std::chrono::steady_clock::now();
  const auto& infos = checkpoint->tensors();
  struct Work {
    const TensorChecksum* expected;
    uint64_t chunk_size;
    const TensorInfo* info;
    const std::byte* data;  // the chunk's first byte
    uint64_t chunk;
  };
  std::vector<Work> work;
  uint64_t tensors = 0, bytes = 0, partial = 0, skipped = 0;
  // Lazily mapped tensors (mmap without populate) are read on first touch, part by part; hashing
  // them would read them whole now. Checked only when asked for explicitly (verify=on).
  const bool lazy =
      engine_kind == Engine::kMmap && !options.populate && options.verify != VerifyMode::kOn;
  for (size_t i = 0; i < planned.tensors.size() && i < batch.tensors.size(); ++i) {
    const PlannedTensor& pt = planned.tensors[i];
    const TensorInfo& info = infos[pt.tensor];
    const std::optional<FileChecksums>& sums = checksums[info.file];
    if (!sums) continue;
    const Tensor& tensor = batch.tensors[i];
    // Bytes on a device cannot be hashed here (device loads are checked in the staging slots).
    if (!tensor.device().is_cpu() || tensor.name() != info.name || tensor.size() != pt.size(info) ||
        (lazy && batch.device.is_cpu())) {
      ++skipped;
      continue;
    }
    auto it = sums->tensors.find(info.name);
    if (it == sums->tensors.end()) {  // ChecksumsForFile made sure every tensor has one
      return Status(Code::kInternal, info.name + ": no checksum");
    }
    const uint64_t size = sums->chunk_size;
    const auto* data = static_cast<const std::byte*>(tensor.data());
    const size_t before = work.size();
    const uint64_t covered =
        sink::ForEachHeldChunk(info, pt, size, [&](uint64_t index, uint64_t local) {
          work.push_back({&it->second, size, &info, data + local, index});
        });
    if (pt.slice && work.size() == before) {  // no whole chunk: a digest needs bytes it lacks
      ++skipped;
      continue;
    }
    (covered == pt.size(info) ? tensors : partial) += 1;
    bytes += covered;
  }
  const Status checked = ParallelForUntilError(work.size(), VerifyThreads(), [&](size_t w) {
    const Work& job = work[w];
    const uint64_t len = std::min(job.chunk_size, job.info->size - job.chunk * job.chunk_size);
    return VerifyChunk(*job.expected, job.chunk_size, job.info->size, job.chunk,
                       std::span<const std::byte>(job.data, len),
                       checkpoint->files()[job.info->file].path, job.info->name, job.info->offset);
  });
  counts.nanos += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  TF_RETURN_IF_ERROR(checked);
  counts.tensors += tensors;
  counts.bytes += bytes;
  counts.partial += partial;
  counts.skipped += skipped;
  return Status::Ok();
}

}  // namespace tensorferry

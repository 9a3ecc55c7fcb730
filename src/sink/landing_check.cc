// LandingCheck (landing_check.h): per chunk, a streaming hash of the bytes landed in order from its
// start and a count of the bytes landed; the worker that lands the last byte checks the chunk.
#include "sink/landing_check.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "io/file_set.h"
#include "util/macros.h"
#include "util/parallel.h"

namespace tensorferry::sink {

LandingCheck::LandingCheck(const Checkpoint& checkpoint, const std::byte* base,
                           VerifyCounts& counts)
    : checkpoint_(checkpoint), base_(reinterpret_cast<uintptr_t>(base)), counts_(counts) {
  hook_ = [this](const io::ReadRequest& r) {
    const uint64_t begin = reinterpret_cast<uintptr_t>(r.dst.data()) - base_;
    return Landed(begin, begin + r.dst.size());
  };
  passed_hook_ = [this](const std::byte* dst, std::span<const std::byte> bytes) {
    const uint64_t begin = reinterpret_cast<uintptr_t>(dst) - base_;
    return Passed(begin, begin + bytes.size(), bytes.data());
  };
}

std::vector<std::pair<uint64_t, uint64_t>> SliceWholeChunks(const TensorInfo& info,
                                                            const TensorSlice& slice,
                                                            uint64_t chunk_size) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (chunk_size == 0 || info.size == 0) return out;
  // A strided split has a range per row: thousands, each usually far shorter than a chunk.
  const uint64_t ranges = SliceRangeCount(info, slice);
  if (ranges == 0 || (ranges > 1024 && slice.bytes / ranges < chunk_size)) return out;
  uint64_t local = 0;
  for (const auto& [offset, length] : SliceByteRanges(info, slice)) {
    // The chunks that start inside the range and end inside it (the last chunk may be short).
    for (uint64_t i = (offset + chunk_size - 1) / chunk_size; i * chunk_size < offset + length;
         ++i) {
      if (std::min((i + 1) * chunk_size, info.size) > offset + length) break;
      out.emplace_back(i, local + (i * chunk_size - offset));
    }
    local += length;
  }
  return out;
}

std::unique_ptr<LandingCheck> LandingCheck::Make(
    const Checkpoint& checkpoint, std::span<const PlannedTensor> batch_tensors,
    const std::vector<std::optional<FileChecksums>>& sums, const std::byte* base,
    VerifyCounts& counts) {
  struct Planned {
    uint64_t begin;
    uint64_t index;
    const TensorChecksum* expected;
    uint64_t chunk_size;
    const TensorInfo* info;
    uint32_t entry;
  };
  std::vector<Planned> planned;
  std::vector<Entry> entries;
  uint64_t skipped = 0, empty = 0;
  const auto& infos = checkpoint.tensors();
  for (const PlannedTensor& pt : batch_tensors) {
    const TensorInfo& info = infos[pt.tensor];
    if (info.file >= sums.size() || !sums[info.file]) continue;
    const FileChecksums& file = *sums[info.file];
    auto it = file.tensors.find(info.name);
    if (it == file.tensors.end()) continue;  // ChecksumsForFile made sure every tensor has one
    const uint64_t size = file.chunk_size;
    const auto entry = static_cast<uint32_t>(entries.size());
    const size_t before = planned.size();
    const uint64_t covered = ForEachHeldChunk(info, pt, size, [&](uint64_t index, uint64_t local) {
      planned.push_back({pt.buffer_offset + local, index, &it->second, size, &info, entry});
    });
    if (planned.size() == before) {
      // A slice holding no whole chunk (a digest of the rest needs bytes it lacks), or an empty
      // tensor: nothing to hash, checked as soon as its digest was (ChecksumsForFile).
      ++(pt.slice ? skipped : empty);
      continue;
    }
    entries.push_back({pt.size(info), covered});
  }
  counts.skipped += skipped;
  if (planned.empty() && empty == 0) return nullptr;
  std::sort(planned.begin(), planned.end(),
            [](const Planned& a, const Planned& b) { return a.begin < b.begin; });
  std::unique_ptr<LandingCheck> check(new LandingCheck(checkpoint, base, counts));
  check->chunks_ = std::make_unique<Chunk[]>(planned.size());
  check->num_chunks_ = planned.size();
  for (size_t i = 0; i < planned.size(); ++i) {
    const Planned& p = planned[i];
    Chunk& c = check->chunks_[i];
    c.begin = p.begin;
    c.end = p.begin + std::min(p.chunk_size, p.info->size - p.index * p.chunk_size);
    c.index = p.index;
    c.expected = p.expected;
    c.chunk_size = p.chunk_size;
    c.info = p.info;
    c.entry = p.entry;
    c.hashed_to = c.begin;
  }
  check->entries_ = std::move(entries);
  check->empty_tensors_ = empty;
  return check;
}

namespace {

uint64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

}  // namespace

void LandingCheck::Extend(Chunk& c, uint64_t from, uint64_t to, const std::byte* data) {
  const auto start = std::chrono::steady_clock::now();
  if (!c.hash) c.hash = std::make_unique<integrity_internal::Xxh3Stream>();
  c.hash->Update(data, to - from);
  c.hashed_to = to;
  counts_.nanos += NanosSince(start);
}

uint64_t LandingCheck::HashWhole(const Chunk& c, const std::byte* data) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t got = ChecksumChunk(std::span<const std::byte>(
      data != nullptr ? data : reinterpret_cast<const std::byte*>(base_ + c.begin),
      c.end - c.begin));
  counts_.nanos += NanosSince(start);
  return got;
}

Status LandingCheck::Compare(const Chunk& c, uint64_t got) const {
  Status st =
      CheckChunkDigest(*c.expected, c.chunk_size, c.info->size, c.index, c.end - c.begin, got,
                       checkpoint_.files()[c.info->file].path, c.info->name, c.info->offset);
  if (st.code() == Code::kChecksumMismatch) {
    // A copy the source keeps of the file (the object cache's) is dropped: the next open fetches
    // the file again instead of failing the same way.
    if (Result<io::FileSet::Pin> pin = checkpoint_.file_set()->Get(c.info->file); pin.ok()) {
      if (const std::string dropped = pin->file->Distrust(); !dropped.empty()) {
        st = Status(st.code(), st.message() + "; " + dropped);
      }
    }
  }
  return st;
}

Status LandingCheck::Landed(uint64_t begin, uint64_t end) {
  return Arrived(begin, end, nullptr);
}

Status LandingCheck::Passed(uint64_t begin, uint64_t end, const std::byte* data) {
  return Arrived(begin, end, data);
}

Status LandingCheck::Arrived(uint64_t begin, uint64_t end, const std::byte* data) {
  const bool in_buffer = data == nullptr;
  // Where byte `at` of [begin, end) is now.
  auto at = [&](uint64_t offset) {
    return in_buffer ? reinterpret_cast<const std::byte*>(base_ + offset) : data + (offset - begin);
  };
  // The first chunk ending after `begin`.
  Chunk* const first = chunks_.get();
  Chunk* const last = first + num_chunks_;
  Chunk* c = std::upper_bound(
      first, last, begin, [](uint64_t offset, const Chunk& chunk) { return offset < chunk.end; });
  for (; c != last && c->begin < end; ++c) {
    const uint64_t from = std::max(begin, c->begin), to = std::min(end, c->end);
    if (from >= to) continue;
    uint64_t got = 0;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      if (c->done) {
        if (in_buffer) continue;  // VerifyAll got there first
        return Status(Code::kInternal, c->info->name + ": checksum chunk " +
                                           std::to_string(c->index) + " passed twice");
      }
      c->landed += to - from;
      if (from == c->begin && to == c->end) {
        c->done = true;  // landed in one piece: hashed in one call, straight from the cache
        got = HashWhole(*c, at(from));
      } else if (from == c->hashed_to) {
        Extend(*c, from, to, at(from));  // in the cache of the worker that just copied it
        // Pieces that landed ahead and now follow on (hashed from memory).
        for (size_t i = 0; i < c->waiting.size();) {
          Chunk::Waiting& w = c->waiting[i];
          if (w.from == c->hashed_to) {
            Extend(*c, w.from, w.to,
                   w.copy ? w.copy.get() : reinterpret_cast<const std::byte*>(base_ + w.from));
            w = std::move(c->waiting.back());
            c->waiting.pop_back();
            i = 0;
          } else {
            ++i;
          }
        }
      } else {
        Chunk::Waiting w{from, to, nullptr};
        if (!in_buffer) {  // the bytes will be gone after this call
          w.copy = std::make_unique<std::byte[]>(to - from);
          std::memcpy(w.copy.get(), at(from), to - from);
        }
        c->waiting.push_back(std::move(w));
      }
      if (!c->done) {
        if (c->landed < c->end - c->begin) continue;
        c->done = true;
        if (c->hash && c->hashed_to == c->end) {
          got = c->hash->Digest();
        } else if (in_buffer) {
          // Pieces that do not tile the chunk (a byte landed twice) would leave a gap in the
          // streamed hash: then hash it whole rather than trust the count.
          got = HashWhole(*c);
        } else {
          return Status(Code::kInternal, c->info->name + ": checksum chunk " +
                                             std::to_string(c->index) +
                                             " passed in pieces that do not tile it");
        }
      }
    }
    TF_RETURN_IF_ERROR(Compare(*c, got));
  }
  return Status::Ok();
}

Status LandingCheck::VerifyAll(unsigned threads) {
  return ParallelForUntilError(num_chunks_, threads, [this](size_t i) {
    // A chunk not checked yet (none is, unless the engine's workers hashed as bytes landed):
    // hashed whole, whatever landed through Landed.
    Chunk& c = chunks_[i];
    uint64_t got = 0;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.done) return Status::Ok();
      c.done = true;
      got = HashWhole(c);
    }
    return Compare(c, got);
  });
}

void LandingCheck::Count() {
  std::vector<char> all(entries_.size(), 1);
  for (size_t i = 0; i < num_chunks_; ++i) {
    std::lock_guard<std::mutex> lock(chunks_[i].mu);
    if (!chunks_[i].done) all[chunks_[i].entry] = 0;
  }
  uint64_t tensors = empty_tensors_, bytes = 0, partial = 0, skipped = 0;
  for (size_t e = 0; e < entries_.size(); ++e) {
    const Entry& entry = entries_[e];
    if (!all[e]) {
      ++skipped;
    } else if (entry.covered_bytes == entry.local_bytes) {
      ++tensors;
      bytes += entry.local_bytes;
    } else {
      ++partial;
      bytes += entry.covered_bytes;
    }
  }
  counts_.tensors += tensors;
  counts_.bytes += bytes;
  counts_.partial += partial;
  counts_.skipped += skipped;
}

}  // namespace tensorferry::sink

// LandingCheck (integrity checks as bytes land): whatever order and sizes the pieces land in, from
// one thread or several, every chunk is checked once all of its bytes landed; a flipped byte
// anywhere (in a piece hashed as it landed, in one that landed ahead and waited, in a chunk that
// landed whole) fails with the chunk's index; chunks left over are checked by VerifyAll.
#include "sink/landing_check.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tensorferry/writer.h"
#include "testing/test_util.h"

namespace tensorferry::sink {
namespace {

constexpr uint64_t kChunk = 64 << 10;

struct Fixture {
  testing::TempDir dir;
  std::string path = dir.Join("m.safetensors");
  std::shared_ptr<const Checkpoint> checkpoint;
  std::vector<std::optional<FileChecksums>> sums;
  PlanBatch batch;
  std::vector<std::byte> buffer;  // the batch buffer: each tensor at its buffer_offset

  Fixture() {
    // "big": 3.5 chunks; "small": inside one chunk; "whole": exactly one chunk.
    std::vector<std::vector<std::byte>> data = {Bytes(3 * kChunk + kChunk / 2, 1), Bytes(1000, 2),
                                                Bytes(kChunk, 3)};
    const char* names[] = {"big", "small", "whole"};
    std::vector<TensorToWrite> tensors;
    for (int i = 0; i < 3; ++i) {
      tensors.push_back({names[i], DType::kU8, {data[i].size()}, data[i], nullptr});
    }
    WriteOptions options;
    options.checksums = true;
    options.checksum_chunk_size = kChunk;
    EXPECT_TRUE(WriteFile(path, tensors, {}, options).ok());
    checkpoint = Checkpoint::Open(path).value();
    auto embedded = EmbeddedChecksums(checkpoint->files()[0].metadata, path);
    EXPECT_TRUE(embedded.ok() && embedded->has_value());
    sums.push_back(std::move(embedded).value());
    // Laid out in the buffer in tensor order with a gap of 100 bytes between them.
    uint64_t at = 0;
    for (uint32_t t = 0; t < checkpoint->tensors().size(); ++t) {
      const TensorInfo& info = checkpoint->tensors()[t];
      batch.tensors.push_back({t, at, std::nullopt});
      at += info.size + 100;
    }
    buffer.resize(at);
    for (const PlannedTensor& pt : batch.tensors) {
      const TensorInfo& info = checkpoint->tensors()[pt.tensor];
      for (int i = 0; i < 3; ++i) {
        if (info.name == names[i]) {
          std::memcpy(buffer.data() + pt.buffer_offset, data[i].data(), info.size);
        }
      }
    }
  }

  static std::vector<std::byte> Bytes(size_t n, unsigned seed) {
    std::vector<std::byte> v(n);
    std::mt19937 rng(seed);
    for (std::byte& b : v) b = std::byte(static_cast<uint8_t>(rng()));
    return v;
  }

  // Where tensor `name`'s byte `at` is in the buffer.
  uint64_t At(const std::string& name, uint64_t at) const {
    for (const PlannedTensor& pt : batch.tensors) {
      if (checkpoint->tensors()[pt.tensor].name == name) return pt.buffer_offset + at;
    }
    ADD_FAILURE() << name;
    return 0;
  }
};

// The buffer cut into pieces: fixed-size, or of random sizes.
std::vector<std::pair<uint64_t, uint64_t>> Pieces(uint64_t size, uint64_t piece, unsigned seed) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  std::mt19937_64 rng(seed);
  for (uint64_t at = 0; at < size;) {
    const uint64_t n = std::min(size - at, piece > 0 ? piece : 1 + rng() % (3 * kChunk / 2));
    out.emplace_back(at, at + n);
    at += n;
  }
  return out;
}

// Lands `pieces` in the given order on `threads` threads (piece i on thread i % threads), then
// VerifyAll; the errors seen, in no particular order.
std::vector<Status> Land(Fixture& f, const std::vector<std::pair<uint64_t, uint64_t>>& pieces,
                         unsigned threads, VerifyCounts& counts, size_t land_only = SIZE_MAX) {
  auto check = LandingCheck::Make(*f.checkpoint, f.batch.tensors, f.sums, f.buffer.data(), counts);
  EXPECT_NE(check, nullptr);
  std::vector<std::vector<Status>> errors(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i = t; i < std::min(pieces.size(), land_only); i += threads) {
        Status s = check->Landed(pieces[i].first, pieces[i].second);
        if (!s.ok()) errors[t].push_back(std::move(s));
      }
    });
  }
  for (std::thread& t : pool) t.join();
  std::vector<Status> all;
  for (auto& e : errors) all.insert(all.end(), e.begin(), e.end());
  Status rest = check->VerifyAll(2);
  if (!rest.ok()) all.push_back(rest);
  if (all.empty()) check->Count();
  return all;
}

std::vector<std::vector<std::pair<uint64_t, uint64_t>>> Orders(uint64_t size) {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> orders;
  orders.push_back({{0, size}});                // one piece
  orders.push_back(Pieces(size, 16 << 10, 0));  // in order
  auto reversed = Pieces(size, 16 << 10, 0);    // every piece ahead of its gap
  std::reverse(reversed.begin(), reversed.end());
  orders.push_back(reversed);
  for (unsigned seed = 1; seed <= 3; ++seed) {  // random sizes, shuffled
    auto shuffled = Pieces(size, 0, seed);
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(seed));
    orders.push_back(shuffled);
  }
  return orders;
}

TEST(LandingCheck, EveryOrderChecksEveryChunk) {
  Fixture f;
  for (unsigned threads : {1u, 3u}) {
    for (const auto& order : Orders(f.buffer.size())) {
      VerifyCounts counts;
      const std::vector<Status> errors = Land(f, order, threads, counts);
      EXPECT_TRUE(errors.empty()) << errors[0].ToString();
      EXPECT_EQ(counts.tensors.load(), 3u);
      EXPECT_EQ(counts.bytes.load(), 3 * kChunk + kChunk / 2 + 1000 + kChunk);
    }
  }
}

TEST(LandingCheck, FlippedByteFailsItsChunkInEveryOrder) {
  struct Flip {
    const char* tensor;
    uint64_t at;
    uint64_t chunk;
  };
  const Flip flips[] = {{"big", 0, 0},
                        {"big", kChunk + 20000, 1},
                        {"big", 2 * kChunk - 1, 1},
                        {"big", 3 * kChunk + kChunk / 2 - 1, 3},
                        {"small", 999, 0},
                        {"whole", kChunk / 2, 0}};
  for (const Flip& flip : flips) {
    Fixture f;
    f.buffer[f.At(flip.tensor, flip.at)] ^= std::byte{0x10};
    for (unsigned threads : {1u, 2u}) {
      for (const auto& order : Orders(f.buffer.size())) {
        VerifyCounts counts;
        const std::vector<Status> errors = Land(f, order, threads, counts);
        ASSERT_EQ(errors.size(), 1u) << flip.tensor << " byte " << flip.at;
        EXPECT_EQ(errors[0].code(), Code::kChecksumMismatch);
        const std::string want = std::string("tensor \"") + flip.tensor +
                                 "\": checksum mismatch in chunk " + std::to_string(flip.chunk) +
                                 " of ";
        EXPECT_NE(errors[0].message().find(want), std::string::npos) << errors[0].ToString();
        EXPECT_EQ(counts.tensors.load(), 0u);
      }
    }
  }
}

TEST(LandingCheck, VerifyAllChecksChunksNotFullyLanded) {
  for (bool corrupt : {false, true}) {
    Fixture f;
    if (corrupt) f.buffer[f.At("big", kChunk + 100)] ^= std::byte{1};
    const auto pieces = Pieces(f.buffer.size(), 16 << 10, 0);
    // Only the first half of the pieces land through the hook; the rest are checked whole.
    VerifyCounts counts;
    const std::vector<Status> errors = Land(f, pieces, 1, counts, pieces.size() / 2);
    if (!corrupt) {
      EXPECT_TRUE(errors.empty()) << errors[0].ToString();
      EXPECT_EQ(counts.tensors.load(), 3u);
    } else {
      ASSERT_EQ(errors.size(), 1u);
      EXPECT_NE(errors[0].message().find("checksum mismatch in chunk 1 of 4"), std::string::npos)
          << errors[0].ToString();
    }
  }
}

// Passes `pieces` (in the given order, piece i on thread i % threads) the way the device
// pipeline does: each copied into a slot of its thread, handed over, and the slot scribbled over
// at once. `base` is a stand-in for device memory, filled with other bytes: reading it would fail
// the checks. The errors seen, in no particular order.
std::vector<Status> Pass(Fixture& f, const std::vector<std::pair<uint64_t, uint64_t>>& pieces,
                         unsigned threads, VerifyCounts& counts, size_t pass_only = SIZE_MAX) {
  std::vector<std::byte> device(f.buffer.size(), std::byte{0x5a});
  auto check = LandingCheck::Make(*f.checkpoint, f.batch.tensors, f.sums, device.data(), counts);
  EXPECT_NE(check, nullptr);
  std::vector<std::vector<Status>> errors(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::vector<std::byte> slot;
      for (size_t i = t; i < std::min(pieces.size(), pass_only); i += threads) {
        const auto [begin, end] = pieces[i];
        slot.assign(f.buffer.begin() + static_cast<ptrdiff_t>(begin),
                    f.buffer.begin() + static_cast<ptrdiff_t>(end));
        Status s = (*check->passed_hook())(device.data() + begin, slot);
        if (!s.ok()) errors[t].push_back(std::move(s));
        std::fill(slot.begin(), slot.end(), std::byte{0xa5});  // the slot is reused
      }
    });
  }
  for (std::thread& t : pool) t.join();
  std::vector<Status> all;
  for (auto& e : errors) all.insert(all.end(), e.begin(), e.end());
  if (all.empty()) check->Count();
  return all;
}

TEST(LandingCheck, PassedPiecesAreHashedBeforeTheirSlotIsReused) {
  Fixture f;
  for (unsigned threads : {1u, 3u}) {
    for (const auto& order : Orders(f.buffer.size())) {
      VerifyCounts counts;
      const std::vector<Status> errors = Pass(f, order, threads, counts);
      EXPECT_TRUE(errors.empty()) << errors[0].ToString();
      EXPECT_EQ(counts.tensors.load(), 3u);
      EXPECT_EQ(counts.bytes.load(), 3 * kChunk + kChunk / 2 + 1000 + kChunk);
      EXPECT_EQ(counts.skipped.load(), 0u);
    }
  }
  for (const char* tensor : {"big", "small"}) {
    Fixture bad;
    bad.buffer[bad.At(tensor, 999)] ^= std::byte{0x04};
    for (const auto& order : Orders(bad.buffer.size())) {
      VerifyCounts counts;
      const std::vector<Status> errors = Pass(bad, order, 2, counts);
      ASSERT_EQ(errors.size(), 1u) << tensor;
      EXPECT_EQ(errors[0].code(), Code::kChecksumMismatch);
      EXPECT_NE(errors[0].message().find(std::string("tensor \"") + tensor +
                                         "\": checksum mismatch in chunk 0 of "),
                std::string::npos)
          << errors[0].ToString();
    }
  }
}

// Bytes that never pass (read with GDS straight into device memory) leave their tensors
// unchecked: counted as skipped, never as verified; and a chunk passed twice is an error.
TEST(LandingCheck, TensorsWhoseBytesDidNotPassAreSkipped) {
  Fixture f;
  const uint64_t big = f.checkpoint->tensors()[f.batch.tensors[0].tensor].size;
  ASSERT_EQ(big, 3 * kChunk + kChunk / 2);  // "big" is first in the buffer
  VerifyCounts counts;
  // Everything but big's last 1000 bytes.
  std::vector<std::pair<uint64_t, uint64_t>> pieces = {{0, big - 1000}, {big, f.buffer.size()}};
  EXPECT_TRUE(Pass(f, pieces, 1, counts).empty());
  EXPECT_EQ(counts.tensors.load(), 2u);
  EXPECT_EQ(counts.bytes.load(), 1000 + kChunk);
  EXPECT_EQ(counts.skipped.load(), 1u);

  VerifyCounts twice;
  // Its count reaches the chunk's size with a gap in the hash, which device memory cannot fill.
  std::vector<std::pair<uint64_t, uint64_t>> again = {{0, kChunk - 100}, {0, kChunk - 100}};
  const std::vector<Status> errors = Pass(f, again, 1, twice);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].code(), Code::kInternal);
}

// The chunks a slice holds whole, against every byte: for splits of either dimension (fused parts
// included), every rank, and chunk sizes from 1 byte to beyond the tensor, a chunk is held when
// its bytes are all in the slice and adjacent in the local tensor, at the local offset returned.
TEST(SliceWholeChunks, AgreeWithTheSliceByteByByte) {
  for (const auto& [rows, cols] :
       std::vector<std::pair<uint64_t, uint64_t>>{{12, 7}, {64, 32}, {33, 100}, {1, 50}}) {
    TensorInfo info;
    info.name = "t";
    info.shape = {rows, cols};
    info.size = rows * cols;
    std::vector<ShardRule> rules = {ShardRule::Split(0), ShardRule::Split(1)};
    if (rows % 4 == 0) rules.push_back(ShardRule::Split(0, {rows / 4, 3 * rows / 4}));
    for (const ShardRule& rule : rules) {
      for (uint32_t world : {1u, 2u, 3u, 4u}) {
        for (uint32_t rank = 0; rank < world; ++rank) {
          auto slice = SliceOf(info, rule, rank, world);
          if (!slice.ok()) continue;  // a split this shape does not allow
          std::vector<uint64_t> at;   // local byte -> tensor byte
          for (const auto& [offset, length] : SliceByteRanges(info, *slice)) {
            for (uint64_t k = 0; k < length; ++k) at.push_back(offset + k);
          }
          for (uint64_t chunk : {1ull, 5ull, 7ull, 64ull, 100ull, 1000ull, 100000ull}) {
            std::vector<std::pair<uint64_t, uint64_t>> want;
            for (uint64_t i = 0; i * chunk < info.size; ++i) {
              const uint64_t begin = i * chunk, end = std::min(begin + chunk, info.size);
              auto p = std::find(at.begin(), at.end(), begin);
              if (p == at.end()) continue;
              const auto local = static_cast<uint64_t>(p - at.begin());
              bool whole = local + (end - begin) <= at.size();
              for (uint64_t k = 0; whole && k < end - begin; ++k)
                whole = at[local + k] == begin + k;
              if (whole) want.emplace_back(i, local);
            }
            EXPECT_EQ(SliceWholeChunks(info, *slice, chunk), want)
                << rows << "x" << cols << " dim " << rule.dim << " rank " << rank << "/" << world
                << " chunk " << chunk;
          }
        }
      }
    }
  }
}

// A batch holding a dim-0 slice: the chunks it holds whole are checked as they land (a flipped
// byte in one fails with its index), bytes at its edges are not, and it counts as partial.
TEST(LandingCheck, ASliceIsCheckedOverItsWholeChunks) {
  Fixture f;
  // "big" (3.5 chunks) split in two along dim 0: rank 1 holds bytes [1.75, 3.5) chunks of it,
  // so chunks 2 and 3 (the short last one) whole, and a quarter chunk before them.
  const TensorInfo* big = nullptr;
  uint32_t index = 0;
  for (uint32_t t = 0; t < f.checkpoint->tensors().size(); ++t) {
    if (f.checkpoint->tensors()[t].name == "big") big = &f.checkpoint->tensors()[index = t];
  }
  ASSERT_NE(big, nullptr);
  auto slice = SliceOf(*big, ShardRule::Split(0), 1, 2);
  ASSERT_TRUE(slice.ok());
  const uint64_t first = big->size - slice->bytes;  // the slice's first byte in the tensor
  for (uint64_t flip : {uint64_t{0}, 2 * kChunk - first + 7, uint64_t{1}}) {  // none, chunk 2, edge
    PlanBatch batch;
    batch.tensors.push_back({index, 0, *slice});
    std::vector<std::byte> buffer(slice->bytes);
    std::memcpy(buffer.data(), f.buffer.data() + f.At("big", first), slice->bytes);
    if (flip > 0) buffer[flip] ^= std::byte{0x40};
    VerifyCounts counts;
    auto check = LandingCheck::Make(*f.checkpoint, batch.tensors, f.sums, buffer.data(), counts);
    ASSERT_NE(check, nullptr);
    Status s = Status::Ok();
    for (const auto& [begin, end] : Pieces(buffer.size(), 3000, 1)) {
      Status landed = check->Landed(begin, end);
      if (s.ok()) s = landed;
    }
    if (flip == 2 * kChunk - first + 7) {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), Code::kChecksumMismatch);
      EXPECT_NE(s.message().find("chunk 2 of 4"), std::string::npos) << s.message();
      continue;
    }
    ASSERT_TRUE(s.ok()) << s.ToString();
    check->Count();
    EXPECT_EQ(counts.partial.load(), 1u);
    EXPECT_EQ(counts.tensors.load(), 0u);
    EXPECT_EQ(counts.bytes.load(), big->size - 2 * kChunk);
  }
}

}  // namespace
}  // namespace tensorferry::sink

// Test-only: a small sharded checkpoint for tensor-parallel tests, the ShardSpec that goes with
// it, and an oracle that slices a tensor's bytes element by element (numpy.array_split rule per
// fused part), written independently of SliceOf so that tests compare two implementations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/status.h"
#include "tensorferry/writer.h"
#include "testing/test_util.h"

namespace tensorferry::testing {

// The bytes of a host tensor.
std::string HostBytes(const Tensor& t);

// The read engines this machine has: pread and mmap, and io_uring where the kernel allows it.
std::vector<Engine> AvailableEngines();

// Writes the checkpoint into `dir` (several shards of at most `shard_size` bytes). Tensors: 1-D
// and 2-D of several dtypes with uneven sizes (every split part has at least 8 indices, so any
// world size up to 8 works), a scalar and empty tensors; bytes depend on name and position.
Status WriteShardFixture(const std::string& dir, uint64_t shard_size = 4096);

// Splits embeddings, q/qkv projections and biases on dim 0 (qkv in fused parts [40, 12, 12]),
// o_proj on dim 1; everything else replicated.
ShardSpec ShardFixtureSpec();

// The bytes rank `rank` of `world` holds of a tensor of `shape` (rank <= 2), `elem_size` bytes per
// element, whose full row-major bytes are `full`, under `rule` (parts given explicitly, or one).
std::string OracleSlice(const std::string& full, const std::vector<uint64_t>& shape,
                        uint64_t elem_size, const ShardRule& rule, uint32_t rank, uint32_t world);

// Expected local bytes of `t` (any rank) on `rank` of `world` under `rule`, built element by
// element from the full tensor's bytes `full` (independent of SliceOf's byte ranges and of the
// loader's layouts): walk the local row-major multi-index, map the split coordinate through the
// parts (given, equal, or one; numpy.array_split per part), copy the element.
std::string NaiveSlice(const TensorInfo& t, const ShardRule& rule, uint32_t rank, uint32_t world,
                       const std::string& full);
std::vector<uint8_t> NaiveSlice(const TensorInfo& t, const ShardRule& rule, uint32_t rank,
                                uint32_t world, const std::vector<uint8_t>& full);

// Byte `i` of a test tensor whose name hashes (std::hash) to `h`.
using BytePattern = char (*)(uint64_t i, size_t h);
// The pattern of the tensor-parallel tests: i * 131 + (i >> 9) + h.
char TpByte(uint64_t i, size_t h);

// Tensors to write as a test checkpoint, built one by one (bytes from `pattern`), each with its
// rule in `spec` where one is given. Add every tensor, then write.
struct TestTensors {
  explicit TestTensors(BytePattern byte_pattern = TpByte) : pattern(byte_pattern) {}
  TestTensors(const TestTensors&) = delete;
  TestTensors& operator=(const TestTensors&) = delete;

  void Add(const std::string& name, DType dtype, std::vector<uint64_t> shape);
  void Add(const std::string& name, DType dtype, std::vector<uint64_t> shape, ShardRule rule);
  // Writes the tensors into `dir` in shards of at most `max_shard_size` bytes.
  Status WriteTo(const std::string& dir, uint64_t max_shard_size);
  // The full bytes of tensor `name`; throws if there is none.
  const std::string& Full(const std::string& name) const;

  BytePattern pattern;
  std::vector<std::string> data;
  std::vector<TensorToWrite> tensors;
  ShardSpec spec;
  uint64_t total = 0;                       // bytes of every tensor
  uint64_t checksum_chunk_size = 4u << 20;  // WriteOptions::checksum_chunk_size
};

// TestTensors written into a temporary directory of their own.
struct TestCheckpoint : TestTensors {
  explicit TestCheckpoint(BytePattern byte_pattern = TpByte) : TestTensors(byte_pattern) {}
  // Writes into `dir`; throws on failure.
  void Write(uint64_t max_shard_size);

  TempDir dir;
};

// The model-like tensors of the loader tests: an embedding, `layers` layers of a q projection, an
// up projection, a norm and a scalar, a head and an empty tensor; `rows` scales the leading
// dimension of the matrices.
void AddLayeredModel(TestTensors& t, int layers, uint64_t rows);

}  // namespace tensorferry::testing

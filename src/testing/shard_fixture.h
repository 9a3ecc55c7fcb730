// Test-only: a small sharded checkpoint for tensor-parallel tests, the ShardSpec that goes with
// it, and an oracle that slices a tensor's bytes element by element (numpy.array_split rule per
// fused part), written independently of SliceOf so that tests compare two implementations.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensorferry/shard.h"
#include "tensorferry/status.h"

namespace tensorferry::testing {

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

}  // namespace tensorferry::testing

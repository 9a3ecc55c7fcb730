#include "testing/shard_fixture.h"

#include <functional>
#include <span>

#include "tensorferry/writer.h"

namespace tensorferry::testing {

Status WriteShardFixture(const std::string& dir, uint64_t shard_size) {
  std::vector<std::string> data;
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, DType dtype, std::vector<uint64_t> shape) {
    TensorToWrite t;
    t.name = name;
    t.dtype = dtype;
    t.shape = std::move(shape);
    const uint64_t n = TensorByteSize(t.dtype, t.shape).value();
    std::string bytes(n, '\0');
    const size_t h = std::hash<std::string>()(name);
    for (uint64_t i = 0; i < n; ++i) bytes[i] = static_cast<char>((i * 131 + h + i / 251) & 0xff);
    data.push_back(std::move(bytes));
    tensors.push_back(std::move(t));
  };
  data.reserve(64);
  add("model.embed_tokens.weight", DType::kBF16, {67, 12});
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", DType::kF32, {37, 20});
    add(p + "self_attn.q_proj.bias", DType::kI8, {29});
    add(p + "self_attn.qkv.weight", DType::kF16, {64, 9});
    add(p + "self_attn.o_proj.weight", DType::kBF16, {20, 37});
    add(p + "input_layernorm.weight", DType::kF32, {20});
    add(p + "scalar", DType::kI64, {});
  }
  add("model.norm.weight", DType::kF32, {0});
  add("model.empty", DType::kU8, {0, 4});
  add("lm_head.weight", DType::kBF16, {67, 12});
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].data = std::as_bytes(std::span<const char>(data[i]));
  }
  ShardOptions so;
  so.max_shard_size = shard_size;
  so.write.sync = false;
  return WriteSharded(dir, tensors, {}, so).status();
}

ShardSpec ShardFixtureSpec() {
  ShardSpec spec = ShardSpec::None();
  spec.Add("*.qkv.weight", ShardRule::Split(0, {40, 12, 12}));
  spec.Add("*.q_proj.*", ShardRule::Split(0));
  spec.Add("*.o_proj.weight", ShardRule::Split(1));
  spec.Add("model.embed_tokens.weight", ShardRule::Split(0));
  spec.Add("lm_head.weight", ShardRule::Split(0));
  return spec;
}

std::string OracleSlice(const std::string& full, const std::vector<uint64_t>& shape,
                        uint64_t elem_size, const ShardRule& rule, uint32_t rank, uint32_t world) {
  if (!rule.is_split()) return full;
  const uint64_t rows = shape.empty() ? 1 : shape[0];
  const uint64_t cols = shape.size() == 2 ? shape[1] : 1;
  const uint64_t extent = rule.dim == 0 ? rows : cols;
  std::vector<uint64_t> parts = rule.parts;
  if (parts.empty()) parts.push_back(extent);
  // Indices along the split dimension this rank holds, in destination order.
  std::vector<uint64_t> mine;
  uint64_t part_start = 0;
  for (uint64_t n : parts) {
    const uint64_t base = n / world;
    const uint64_t extra = n % world;
    const uint64_t start = part_start + rank * base + std::min<uint64_t>(rank, extra);
    const uint64_t length = base + (rank < extra ? 1 : 0);
    for (uint64_t i = 0; i < length; ++i) mine.push_back(start + i);
    part_start += n;
  }
  std::string out;
  if (rule.dim == 0) {
    for (uint64_t r : mine) out += full.substr(r * cols * elem_size, cols * elem_size);
  } else {
    for (uint64_t r = 0; r < rows; ++r) {
      for (uint64_t c : mine) out += full.substr((r * cols + c) * elem_size, elem_size);
    }
  }
  return out;
}

}  // namespace tensorferry::testing

#include "testing/shard_fixture.h"

#include <functional>
#include <span>
#include <stdexcept>

#include "io/read_engine.h"
#include "tensorferry/writer.h"

namespace tensorferry::testing {

std::string HostBytes(const Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data()), t.size());
}

std::vector<Engine> AvailableEngines() {
  std::vector<Engine> e = {Engine::kPread, Engine::kMmap};
  if (io::IoUringAvailable().ok()) e.push_back(Engine::kIoUring);
  return e;
}

Status WriteShardFixture(const std::string& dir, uint64_t shard_size) {
  TestTensors t(
      [](uint64_t i, size_t h) { return static_cast<char>((i * 131 + h + i / 251) & 0xff); });
  t.Add("model.embed_tokens.weight", DType::kBF16, {67, 12});
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.Add(p + "self_attn.q_proj.weight", DType::kF32, {37, 20});
    t.Add(p + "self_attn.q_proj.bias", DType::kI8, {29});
    t.Add(p + "self_attn.qkv.weight", DType::kF16, {64, 9});
    t.Add(p + "self_attn.o_proj.weight", DType::kBF16, {20, 37});
    t.Add(p + "input_layernorm.weight", DType::kF32, {20});
    t.Add(p + "scalar", DType::kI64, {});
  }
  t.Add("model.norm.weight", DType::kF32, {0});
  t.Add("model.empty", DType::kU8, {0, 4});
  t.Add("lm_head.weight", DType::kBF16, {67, 12});
  return t.WriteTo(dir, shard_size);
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

namespace {

// The local bytes as a list of full-tensor element indices, in local row-major order.
std::vector<uint64_t> NaiveSliceElements(const TensorInfo& t, const ShardRule& rule, uint32_t rank,
                                         uint32_t world) {
  std::vector<uint64_t> parts = rule.parts;
  if (parts.empty() && rule.equal_parts > 1) {
    parts.assign(rule.equal_parts, t.shape[rule.dim] / rule.equal_parts);
  }
  if (parts.empty()) parts.push_back(t.shape[rule.dim]);
  std::vector<uint64_t> map;  // local index along dim -> full index
  uint64_t base = 0;
  for (uint64_t p : parts) {
    const uint64_t q = p / world, rem = p % world;
    uint64_t off = 0;
    for (uint32_t i = 0; i < rank; ++i) off += q + (i < rem ? 1 : 0);
    const uint64_t len = q + (rank < rem ? 1 : 0);
    for (uint64_t i = 0; i < len; ++i) map.push_back(base + off + i);
    base += p;
  }
  std::vector<uint64_t> local = t.shape;
  local[rule.dim] = map.size();
  uint64_t count = 1;
  for (uint64_t d : local) count *= d;
  std::vector<uint64_t> out;
  out.reserve(count);
  std::vector<uint64_t> idx(local.size(), 0);
  for (uint64_t e = 0; e < count; ++e) {
    uint64_t flat = 0;
    for (size_t d = 0; d < local.size(); ++d) {
      flat = flat * t.shape[d] + (d == rule.dim ? map[idx[d]] : idx[d]);
    }
    out.push_back(flat);
    for (size_t d = local.size(); d-- > 0;) {
      if (++idx[d] < local[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

}  // namespace

std::string NaiveSlice(const TensorInfo& t, const ShardRule& rule, uint32_t rank, uint32_t world,
                       const std::string& full) {
  if (!rule.is_split()) return full;
  const uint64_t elem = DTypeBits(t.dtype) / 8;
  std::string out;
  for (uint64_t flat : NaiveSliceElements(t, rule, rank, world))
    out.append(full, flat * elem, elem);
  return out;
}

std::vector<uint8_t> NaiveSlice(const TensorInfo& t, const ShardRule& rule, uint32_t rank,
                                uint32_t world, const std::vector<uint8_t>& full) {
  if (!rule.is_split()) return full;
  const uint64_t elem = DTypeBits(t.dtype) / 8;
  std::vector<uint8_t> out;
  for (uint64_t flat : NaiveSliceElements(t, rule, rank, world)) {
    for (uint64_t b = 0; b < elem; ++b) out.push_back(full[flat * elem + b]);
  }
  return out;
}

char TpByte(uint64_t i, size_t h) {
  return static_cast<char>((i * 131 + (i >> 9) + h));
}

void TestTensors::Add(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  TensorToWrite t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const uint64_t n = TensorByteSize(t.dtype, t.shape).value();
  std::string bytes(n, '\0');
  const size_t h = std::hash<std::string>()(name);
  for (uint64_t i = 0; i < n; ++i) bytes[i] = pattern(i, h);
  total += n;
  data.push_back(std::move(bytes));
  tensors.push_back(std::move(t));
}

void TestTensors::Add(const std::string& name, DType dtype, std::vector<uint64_t> shape,
                      ShardRule rule) {
  Add(name, dtype, std::move(shape));
  spec.Set(name, std::move(rule));
}

Status TestTensors::WriteTo(const std::string& dir, uint64_t max_shard_size) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].data = std::as_bytes(std::span<const char>(data[i]));
  }
  ShardOptions so;
  so.max_shard_size = max_shard_size;
  so.write.sync = false;
  so.write.checksum_chunk_size = checksum_chunk_size;
  return WriteSharded(dir, tensors, {}, so).status();
}

const std::string& TestTensors::Full(const std::string& name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return data[i];
  }
  throw std::runtime_error("no tensor " + name);
}

void TestCheckpoint::Write(uint64_t max_shard_size) {
  const Status s = WriteTo(dir.path(), max_shard_size);
  if (!s.ok()) throw std::runtime_error(s.ToString());
}

void AddLayeredModel(TestTensors& t, int layers, uint64_t rows) {
  t.Add("model.embed_tokens.weight", DType::kBF16, {33 * rows, 7});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.Add(p + "self_attn.q_proj.weight", DType::kBF16, {13 * rows, 7});
    t.Add(p + "mlp.up_proj.weight", DType::kF32, {5 * rows, 11});
    t.Add(p + "input_layernorm.weight", DType::kF16, {7});
    t.Add(p + "scalar", DType::kI8, {});
  }
  t.Add("lm_head.weight", DType::kF64, {3, 5});
  t.Add("model.norm.weight", DType::kU8, {0});
}

}  // namespace tensorferry::testing

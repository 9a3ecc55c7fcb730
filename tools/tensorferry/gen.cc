// tensorferry gen OUT: writes a deterministic synthetic checkpoint with a Llama-style layout
// (names, shapes, layer order) through WriteSharded. Tensor bytes are produced on demand by
// TensorToWrite::generate callbacks, so memory use does not grow with the model.
//
// Values are a pure function of (seed, tensor name, byte offset / 8): each 8-byte block is one
// splitmix64 output, mapped per dtype to realistic values: weights uniform in +-0.0346 (standard
// deviation 0.02), norms uniform in 1 +- 0.05, never NaN or Inf. Integer tensors get raw bits,
// BOOL 0/1, sub-byte floats (F4, F6_*) raw bits (every code of those formats is finite).
#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/format.h"
#include "tensorferry/integrity.h"
#include "tensorferry/json.h"
#include "tensorferry/writer.h"

namespace tensorferry::cli {
namespace {

// --- model shapes ---------------------------------------------------------------------------

struct ModelConfig {
  uint64_t layers = 32;
  uint64_t hidden = 2048;
  uint64_t intermediate = 8192;
  uint64_t heads = 16;
  uint64_t kv_heads = 4;
  uint64_t vocab = 32000;
};

// BF16 sizes: tiny ~0.2 MB, small ~0.49 GB, default ~4.15 GB, large ~4.73 GB.
const std::map<std::string, ModelConfig>& Presets() {
  static const std::map<std::string, ModelConfig> presets = {
      {"tiny", {2, 64, 128, 4, 2, 256}},
      {"small", {16, 1024, 2816, 16, 4, 32000}},
      {"default", {32, 2048, 8192, 16, 4, 32000}},
      {"large", {32, 2560, 6912, 20, 4, 32000}},
  };
  return presets;
}

enum class Kind { kWeight, kNorm };

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> shape;
  Kind kind = Kind::kWeight;
};

// In layer order, so that shards fill layer by layer.
std::vector<TensorSpec> LlamaLayout(const ModelConfig& c, bool tie_embeddings) {
  const uint64_t head_dim = c.hidden / c.heads;
  const uint64_t kv_dim = c.kv_heads * head_dim;
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab, c.hidden}, Kind::kWeight});
  for (uint64_t i = 0; i < c.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    specs.push_back({p + "self_attn.q_proj.weight", {c.hidden, c.hidden}, Kind::kWeight});
    specs.push_back({p + "self_attn.k_proj.weight", {kv_dim, c.hidden}, Kind::kWeight});
    specs.push_back({p + "self_attn.v_proj.weight", {kv_dim, c.hidden}, Kind::kWeight});
    specs.push_back({p + "self_attn.o_proj.weight", {c.hidden, c.hidden}, Kind::kWeight});
    specs.push_back({p + "mlp.gate_proj.weight", {c.intermediate, c.hidden}, Kind::kWeight});
    specs.push_back({p + "mlp.up_proj.weight", {c.intermediate, c.hidden}, Kind::kWeight});
    specs.push_back({p + "mlp.down_proj.weight", {c.hidden, c.intermediate}, Kind::kWeight});
    specs.push_back({p + "input_layernorm.weight", {c.hidden}, Kind::kNorm});
    specs.push_back({p + "post_attention_layernorm.weight", {c.hidden}, Kind::kNorm});
  }
  specs.push_back({"model.norm.weight", {c.hidden}, Kind::kNorm});
  if (!tie_embeddings) specs.push_back({"lm_head.weight", {c.vocab, c.hidden}, Kind::kWeight});
  return specs;
}

// --- values -----------------------------------------------------------------------------------

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64's output function: a bijective mix of a counter.
inline uint64_t Mix(uint64_t z) {
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t TensorKey(uint64_t seed, std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
  return Mix(seed ^ Mix(h));
}

constexpr double kWeightHalfRange = 0.034641016151377546;  // sqrt(3) * 0.02: std 0.02
constexpr double kNormHalfRange = 0.05;

// The value of table slot `i` out of `n`: uniform over the kind's range.
double SlotValue(Kind kind, size_t i, size_t n) {
  const double u = (static_cast<double>(i) + 0.5) / static_cast<double>(n) * 2.0 - 1.0;
  return kind == Kind::kNorm ? 1.0 + u * kNormHalfRange : u * kWeightHalfRange;
}

uint16_t FloatToBf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // nearest even
}

// IEEE binary16, round to nearest even; |v| is small here (no overflow handling needed beyond
// a clamp to the largest finite value).
uint16_t DoubleToF16(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (a == 0) return sign;
  int e = 0;
  std::frexp(a, &e);
  const int exponent = e - 1;  // a = 1.f * 2^exponent
  if (exponent < -14) {
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24))));
  }
  const auto q = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, 10 - exponent)));
  const uint32_t bits = (static_cast<uint32_t>(exponent + 15) << 10) + (q - 1024);
  return static_cast<uint16_t>(sign | std::min<uint32_t>(bits, 0x7BFF));
}

// Decodes an 8-bit float code; NaN for codes that are NaN or Inf (never chosen).
double DecodeFp8(DType dtype, uint8_t code) {
  int exp_bits = 4, man_bits = 3, bias = 7;
  switch (dtype) {
    case DType::kF8_E4M3: break;
    case DType::kF8_E4M3FNUZ: bias = 8; break;
    case DType::kF8_E5M2: exp_bits = 5, man_bits = 2, bias = 15; break;
    case DType::kF8_E5M2FNUZ: exp_bits = 5, man_bits = 2, bias = 16; break;
    case DType::kF8_E8M0: return code == 0xFF ? std::nan("") : std::ldexp(1.0, code - 127);
    default: return std::nan("");
  }
  const double nan = std::nan("");
  const bool fnuz = dtype == DType::kF8_E4M3FNUZ || dtype == DType::kF8_E5M2FNUZ;
  if (fnuz && code == 0x80) return nan;
  const int e = (code >> man_bits) & ((1 << exp_bits) - 1);
  const int f = code & ((1 << man_bits) - 1);
  const int e_max = (1 << exp_bits) - 1;
  if (dtype == DType::kF8_E5M2 && e == e_max) return nan;                              // Inf, NaN
  if (dtype == DType::kF8_E4M3 && e == e_max && f == (1 << man_bits) - 1) return nan;  // NaN
  const double mag = e == 0 ? std::ldexp(f, 1 - bias - man_bits)
                            : std::ldexp(1.0 + std::ldexp(f, -man_bits), e - bias);
  return (code & 0x80) ? -mag : mag;
}

uint8_t NearestFp8(DType dtype, double v) {
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int code = 0; code < 256; ++code) {
    const double d = DecodeFp8(dtype, static_cast<uint8_t>(code));
    if (std::isnan(d)) continue;
    const double err = std::fabs(d - v);
    if (err < best_err) best = code, best_err = err;
  }
  return static_cast<uint8_t>(best);
}

// Produces the bytes of one tensor: block b (bytes [8b, 8b + 8)) is a function of (key, b).
class ValueGenerator {
 public:
  enum class Mode { kRaw, kBool, kTable16, kF32, kF64 };

  ValueGenerator(DType dtype, Kind kind) : kind_(kind) {
    switch (dtype) {
      case DType::kBool: mode_ = Mode::kBool; break;
      case DType::kF16:
      case DType::kBF16:
        mode_ = Mode::kTable16;
        table16_.resize(1 << 16);
        for (size_t i = 0; i < table16_.size(); ++i) {
          const double v = SlotValue(kind, i, table16_.size());
          table16_[i] = dtype == DType::kBF16 ? FloatToBf16(static_cast<float>(v)) : DoubleToF16(v);
        }
        break;
      case DType::kF8_E4M3:
      case DType::kF8_E5M2:
      case DType::kF8_E4M3FNUZ:
      case DType::kF8_E5M2FNUZ:
      case DType::kF8_E8M0: {
        std::array<uint8_t, 256> table8;
        for (size_t i = 0; i < table8.size(); ++i) {
          if (dtype == DType::kF8_E8M0) {  // a power-of-two scale: 2^-7 .. 1, norms exactly 1
            table8[i] = static_cast<uint8_t>(kind == Kind::kNorm ? 127 : 120 + i % 8);
          } else {
            table8[i] = NearestFp8(dtype, SlotValue(kind, i, table8.size()));
          }
        }
        // Two elements per lookup: 16 random bits pick a pair of codes.
        mode_ = Mode::kTable16;
        table16_.resize(1 << 16);
        for (size_t i = 0; i < table16_.size(); ++i) {
          table16_[i] = static_cast<uint16_t>(table8[i & 0xFF] | table8[i >> 8] << 8);
        }
        break;
      }
      case DType::kF32:
      case DType::kC64: mode_ = Mode::kF32; break;
      case DType::kF64: mode_ = Mode::kF64; break;
      default: mode_ = Mode::kRaw; break;  // integers, F4, F6_*
    }
  }

  // Fills `out` with the tensor's bytes [offset, offset + out.size()).
  void Fill(uint64_t key, uint64_t offset, std::span<std::byte> out) const {
    switch (mode_) {
      case Mode::kRaw: return FillWith(key, offset, out, [](uint64_t r) { return r; });
      case Mode::kBool:
        return FillWith(key, offset, out, [](uint64_t r) { return r & 0x0101010101010101ull; });
      case Mode::kTable16:
        return FillWith(key, offset, out, [t = table16_.data()](uint64_t r) {
          return uint64_t{t[r & 0xFFFF]} | uint64_t{t[(r >> 16) & 0xFFFF]} << 16 |
                 uint64_t{t[(r >> 32) & 0xFFFF]} << 32 | uint64_t{t[r >> 48]} << 48;
        });
      case Mode::kF32: {
        const float center = kind_ == Kind::kNorm ? 1.0f : 0.0f;
        const auto half =
            static_cast<float>(kind_ == Kind::kNorm ? kNormHalfRange : kWeightHalfRange);
        return FillWith(key, offset, out, [center, half](uint64_t r) {
          const auto one = [&](uint32_t x) {
            // 24 random bits -> [-1, 1) exactly representable in a float.
            const float u = static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
            return uint64_t{std::bit_cast<uint32_t>(center + u * half)};
          };
          return one(static_cast<uint32_t>(r)) | one(static_cast<uint32_t>(r >> 32)) << 32;
        });
      }
      case Mode::kF64: {
        const double center = kind_ == Kind::kNorm ? 1.0 : 0.0;
        const double half = kind_ == Kind::kNorm ? kNormHalfRange : kWeightHalfRange;
        return FillWith(key, offset, out, [center, half](uint64_t r) {
          const double u = static_cast<double>(r >> 11) * (2.0 / 9007199254740992.0) - 1.0;
          return std::bit_cast<uint64_t>(center + u * half);
        });
      }
    }
  }

 private:
  template <typename BlockFn>
  static void FillWith(uint64_t key, uint64_t offset, std::span<std::byte> out, BlockFn fn) {
    const auto block = [&](uint64_t b) {
      uint64_t v = fn(Mix(key + b * kGolden));
      if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
      return v;
    };
    uint64_t b = offset / 8;
    size_t pos = 0;
    if (const size_t skip = offset % 8; skip != 0) {  // head: the end of a block
      const uint64_t v = block(b++);
      pos = std::min(out.size(), 8 - skip);
      std::memcpy(out.data(), reinterpret_cast<const std::byte*>(&v) + skip, pos);
    }
    for (; out.size() - pos >= 8; pos += 8) {
      const uint64_t v = block(b++);
      std::memcpy(out.data() + pos, &v, 8);
    }
    if (pos < out.size()) {  // tail: the start of a block
      const uint64_t v = block(b);
      std::memcpy(out.data() + pos, &v, out.size() - pos);
    }
  }

  Kind kind_;
  Mode mode_ = Mode::kRaw;
  std::vector<uint16_t> table16_;  // 16 random bits -> one 16-bit value or two 8-bit codes
};

// --- the command --------------------------------------------------------------------------------

struct GenArgs {
  std::string out;
  std::string preset = "default";
  ModelConfig config;
  std::string dtype = "BF16";
  std::string shard_size = "1GB";
  uint64_t seed = 0;
  bool tie_embeddings = false;
  bool no_sync = false;
  bool json = false;
  std::vector<std::string> metadata;
  // To tell options given on the command line from preset values.
  CLI::Option* layers = nullptr;
  CLI::Option* hidden = nullptr;
  CLI::Option* intermediate = nullptr;
  CLI::Option* heads = nullptr;
  CLI::Option* kv_heads = nullptr;
  CLI::Option* vocab = nullptr;
};

// The preset with explicit options on top, checked; returns the usage error text, or "" if valid.
std::string ResolveConfig(const GenArgs& args, ModelConfig& c) {
  c = Presets().at(args.preset);
  if (args.layers->count()) c.layers = args.config.layers;
  if (args.hidden->count()) c.hidden = args.config.hidden;
  if (args.intermediate->count()) c.intermediate = args.config.intermediate;
  if (args.heads->count()) c.heads = args.config.heads;
  if (args.kv_heads->count()) c.kv_heads = args.config.kv_heads;
  if (args.vocab->count()) c.vocab = args.config.vocab;
  if (c.hidden == 0 || c.intermediate == 0 || c.heads == 0 || c.kv_heads == 0 || c.vocab == 0) {
    return "--hidden, --intermediate, --heads, --kv-heads and --vocab must be positive";
  }
  if (c.hidden % c.heads != 0) return "--hidden must be a multiple of --heads";
  if (c.heads % c.kv_heads != 0) return "--heads must be a multiple of --kv-heads";
  if (c.layers > 100000) return "--layers: at most 100000";
  return "";
}

// {"format": "pt"} with the --metadata KEY=VALUE pairs applied in order (later ones replace).
Metadata BuildMetadata(const GenArgs& args) {
  Metadata metadata = {{"format", "pt"}};
  for (const std::string& kv : args.metadata) {
    const size_t eq = kv.find('=');
    const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
    auto it = std::find_if(metadata.begin(), metadata.end(),
                           [&](const auto& entry) { return entry.first == key; });
    if (it != metadata.end()) {
      it->second = value;
    } else {
      metadata.emplace_back(key, value);
    }
  }
  return metadata;
}

// Sums the byte and parameter counts of `specs`; returns the usage error text, or "" if valid.
std::string SumSizes(const std::vector<TensorSpec>& specs, DType dtype, uint64_t& total_bytes,
                     uint64_t& total_params) {
  for (const TensorSpec& s : specs) {
    auto bytes = TensorByteSize(dtype, s.shape);
    if (!bytes.ok()) return s.name + ": " + bytes.status().message();
    if (total_bytes + *bytes < total_bytes) return "total size overflows 64 bits";
    total_bytes += *bytes;
    total_params += NumElements(s.shape).value_or(0);
  }
  return "";
}

// The tensors to write, each generating its deterministic values on demand.
std::vector<TensorToWrite> MakeTensors(const std::vector<TensorSpec>& specs, DType dtype,
                                       uint64_t seed) {
  const auto weights = std::make_shared<const ValueGenerator>(dtype, Kind::kWeight);
  const auto norms = std::make_shared<const ValueGenerator>(dtype, Kind::kNorm);
  std::vector<TensorToWrite> tensors;
  tensors.reserve(specs.size());
  for (const TensorSpec& s : specs) {
    TensorToWrite t;
    t.name = s.name;
    t.dtype = dtype;
    t.shape = s.shape;
    auto gen = s.kind == Kind::kNorm ? norms : weights;
    t.generate = [gen, key = TensorKey(seed, s.name)](uint64_t offset, std::span<std::byte> out) {
      gen->Fill(key, offset, out);
      return Status::Ok();
    };
    tensors.push_back(std::move(t));
  }
  return tensors;
}

// What gen wrote, for the report.
struct GenResult {
  std::vector<std::string> written;
  std::vector<uint64_t> sizes;
  uint64_t tensors = 0;
  uint64_t total_params = 0;
  uint64_t total_bytes = 0;
  double seconds = 0;
  double gbps = 0;
};

// The sizes of the written files (0 where unreadable).
std::vector<uint64_t> FileSizes(const std::vector<std::string>& written) {
  std::vector<uint64_t> sizes;
  for (const std::string& path : written) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    sizes.push_back(ec ? 0 : static_cast<uint64_t>(size));
  }
  return sizes;
}

// The --json report.
std::string JsonReport(const GenArgs& args, const ModelConfig& c, DType dtype, uint64_t shard_size,
                       const Metadata& metadata, const GenResult& r) {
  JsonOut j;
  j.BeginObject().Field("path", args.out).Field("ok", true);
  j.Key("files").BeginArray();
  for (size_t i = 0; i < r.written.size(); ++i) {
    j.BeginObject().Field("path", r.written[i]).Field("size", r.sizes[i]).EndObject();
  }
  j.EndArray();
  j.Field("tensors", r.tensors)
      .Field("params", r.total_params)
      .Field("bytes", r.total_bytes)
      .Field("seconds", r.seconds)
      .Field("gb_per_s", r.gbps);
  j.Key("config")
      .BeginObject()
      .Field("preset", args.preset)
      .Field("layers", c.layers)
      .Field("hidden", c.hidden)
      .Field("intermediate", c.intermediate)
      .Field("heads", c.heads)
      .Field("kv_heads", c.kv_heads)
      .Field("vocab", c.vocab)
      .Field("dtype", DTypeName(dtype))
      .Field("tie_embeddings", args.tie_embeddings)
      .Field("shard_size", shard_size)
      .Field("seed", args.seed)
      .EndObject();
  j.Key("metadata").BeginObject();
  for (const auto& [k, v] : metadata) j.Field(k, v);
  j.EndObject().EndObject();
  return j.str();
}

// The human-readable report: a summary line, then one line per written file.
std::string TextReport(const GenArgs& args, DType dtype, const GenResult& r) {
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.2f s (%.2f GB/s)", r.seconds, r.gbps);
  const uint64_t shards = static_cast<uint64_t>(
      std::count_if(r.written.begin(), r.written.end(),
                    [](const std::string& p) { return p.ends_with(".safetensors"); }));
  std::string report = "wrote " + OneLine(args.out) + ": " + Plural(shards, "shard") +
                       (shards < r.written.size() ? " + index" : "") + ", " +
                       Plural(r.tensors, "tensor") + " (" + std::to_string(r.total_params) +
                       " parameters, " + std::string(DTypeName(dtype)) + "), " +
                       FormatBytes(r.total_bytes) + " in " + rate;
  for (size_t i = 0; i < r.written.size(); ++i) {
    report += "\n  " + OneLine(r.written[i]) + "  " + FormatBytes(r.sizes[i]);
  }
  return report;
}

int RunGen(const GenArgs& args) {
  ModelConfig c;
  if (std::string err = ResolveConfig(args, c); !err.empty()) return UsageError(err);
  const std::optional<DType> named = DTypeFromName(args.dtype);  // upper-cased by --dtype
  if (!named) return UsageError("unknown dtype '" + args.dtype + "'");
  const DType dtype = *named;
  const uint64_t shard_size = *ParseSize(args.shard_size);
  const Metadata metadata = BuildMetadata(args);
  const std::vector<TensorSpec> specs = LlamaLayout(c, args.tie_embeddings);
  GenResult r;
  if (std::string err = SumSizes(specs, dtype, r.total_bytes, r.total_params); !err.empty()) {
    return UsageError(err);
  }
  const std::vector<TensorToWrite> tensors = MakeTensors(specs, dtype, args.seed);
  r.tensors = tensors.size();

  ShardOptions options;
  options.max_shard_size = shard_size;
  options.write.sync = !args.no_sync;
  const int64_t start = NowNs();
  auto written = WriteSharded(args.out, tensors, metadata, options);
  r.seconds = SecondsSince(start);
  if (!written.ok()) return Failed(args.json, args.out, written.status());
  r.gbps = r.seconds > 0 ? static_cast<double>(r.total_bytes) / r.seconds / 1e9 : 0.0;
  r.written = std::move(written).value();
  r.sizes = FileSizes(r.written);
  return PrintReport(args.json ? JsonReport(args, c, dtype, shard_size, metadata, r)
                               : TextReport(args, dtype, r));
}

}  // namespace

Command AddGenCommand(CLI::App& parent) {
  auto args = std::make_shared<GenArgs>();
  CLI::App* app = parent.add_subcommand(
      "gen",
      "Write a deterministic synthetic checkpoint with a Llama layout (for tests and "
      "benchmarks)");
  app->add_option("out", args->out, "Output directory (created if missing)")->required();
  app->add_option("--preset", args->preset,
                  "Model size: tiny (~0.2 MB), small (~0.5 GB), default (~4.2 GB), large "
                  "(~4.7 GB); explicit options override it")
      ->check(CLI::IsMember({"tiny", "small", "default", "large"}))
      ->capture_default_str();
  args->layers = app->add_option("--layers", args->config.layers, "Decoder layers (default 32)");
  args->hidden = app->add_option("--hidden", args->config.hidden, "Hidden size (default 2048)");
  args->intermediate =
      app->add_option("--intermediate", args->config.intermediate, "MLP size (default 8192)");
  args->heads = app->add_option("--heads", args->config.heads, "Attention heads (default 16)");
  args->kv_heads =
      app->add_option("--kv-heads", args->config.kv_heads, "Key/value heads (default 4)");
  args->vocab = app->add_option("--vocab", args->config.vocab, "Vocabulary size (default 32000)");
  app->add_option("--dtype", args->dtype, "Element type: BF16, F16, F32, F8_E4M3, I8, ...")
      ->capture_default_str()
      // A transform, not a check: CLI11 discards what a check's validator writes back, and the
      // upper-cased name is what RunGen needs.
      ->transform(CLI::Validator(
          [](std::string& s) -> std::string {
            if (DTypeFromName(s)) return "";
            std::string upper = s;
            for (char& ch : upper)
              ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
            if (DTypeFromName(upper)) {
              s = upper;
              return "";
            }
            return "unknown dtype '" + s + "'";
          },
          "DTYPE"));
  app->add_option("--shard-size", args->shard_size,
                  "Largest shard data size: bytes or with a suffix (512MB, 2GiB)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            const auto size = ParseSize(s);
            if (!size) return "not a size: '" + s + "' (e.g. 1GB, 512MB, 2GiB)";
            if (*size == 0) return "shard size must be positive";
            return "";
          },
          "SIZE"));
  app->add_option("--seed", args->seed, "Seed of the values (0 to 2^64-1)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& value) {
            return !value.empty() && value.front() == '-' ? std::string("not negative")
                                                          : std::string();
          },
          "", "NON_NEGATIVE"));
  app->add_flag("--tie-embeddings", args->tie_embeddings, "No lm_head.weight");
  app->add_option("--metadata", args->metadata,
                  "KEY=VALUE for __metadata__ (repeatable; default format=pt)")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            const size_t eq = s.find('=');
            if (eq == std::string::npos || eq == 0) return "expected KEY=VALUE, got '" + s + "'";
            if (std::string_view(s).substr(0, eq) == kChecksumsMetadataKey) {
              return "'" + std::string(kChecksumsMetadataKey) +
                     "' is the writer's own checksum record, not a key to set";
            }
            if (!IsValidUtf8(s)) return "not valid UTF-8 (a header holds JSON text)";
            return "";
          },
          "KEY=VALUE"))
      ->allow_extra_args(false);
  app->add_flag("--no-sync", args->no_sync, "Do not fsync the files (scratch output)");
  app->add_flag("--json", args->json, "Print the summary as one JSON document");
  return {app, [args] { return RunGen(*args); }};
}

}  // namespace tensorferry::cli

#include "tensorferry/shard.h"

#include <simdjson.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "util/json_dom.h"
#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry {

// --- ShardRule ----------------------------------------------------------------------------------

ShardRule ShardRule::Replicate() {
  return ShardRule{};
}

ShardRule ShardRule::Split(uint32_t dim, std::vector<uint64_t> parts) {
  ShardRule r;
  r.kind = Kind::kSplit;
  r.dim = dim;
  r.parts = std::move(parts);
  return r;
}

ShardRule ShardRule::SplitEqual(uint32_t dim, uint32_t equal_parts) {
  ShardRule r = Split(dim);
  r.equal_parts = equal_parts;
  return r;
}

namespace {

std::string UintList(const std::vector<uint64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(v[i]);
  }
  return out + "]";
}

}  // namespace

std::string ShardRule::ToString() const {
  if (!is_split()) return "replicate";
  std::string out = "split(dim=" + std::to_string(dim);
  if (!parts.empty()) {
    out += ", parts=" + UintList(parts);
  } else if (equal_parts > 1) {
    out += ", equal_parts=" + std::to_string(equal_parts);
  }
  if (granule > 1) out += ", granule=" + std::to_string(granule);
  return out + ")";
}

// --- globs --------------------------------------------------------------------------------------

bool GlobMatch(std::string_view pattern, std::string_view name) noexcept {
  // Iterative matcher with one backtrack point (the last '*'): linear in practice, never
  // exponential, no recursion. '?' and '*' count characters (UTF-8 sequences: a name is UTF-8),
  // not bytes: "?" matches "é".
  const auto next_char = [&](size_t i) {
    ++i;
    while (i < name.size() && (static_cast<unsigned char>(name[i]) & 0xC0) == 0x80) ++i;
    return i;
  };
  size_t p = 0, n = 0;
  size_t star = std::string_view::npos, star_n = 0;
  while (n < name.size()) {
    // '*' first: a '*' in the pattern is always a wildcard, also where the name has a '*' (taken
    // as a literal there, the match could not backtrack past it: "*t" failed on "*.weight").
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (p < pattern.size() && pattern[p] == '?') {
      ++p;
      n = next_char(n);
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = star_n = next_char(star_n);
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

// --- ShardSpec ----------------------------------------------------------------------------------

std::optional<ShardSpec> ShardSpec::Named(std::string_view name) {
  if (name == "builtin") return Builtin();
  if (name == "none") return None();
  return std::nullopt;
}

ShardSpec ShardSpec::None() {
  return ShardSpec();
}

ShardSpec ShardSpec::Builtin() {
  ShardSpec s;
  const ShardRule col = ShardRule::Split(0);
  const ShardRule row = ShardRule::Split(1);
  const ShardRule rep = ShardRule::Replicate();
  // LLaMA / Mistral / Qwen / Gemma / Phi-3 (Hugging Face names). Column parallel: the output
  // dimension (dim 0 of an nn.Linear weight [out, in]) is split, and so is the bias. Row parallel:
  // the input dimension (dim 1); the bias is added after the all-reduce, so every rank holds it.
  for (const char* proj : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"}) {
    s.Add(std::string("*.") + proj + ".weight", col);
    s.Add(std::string("*.") + proj + ".bias", col);
  }
  for (const char* proj : {"o_proj", "down_proj", "w2"}) {
    s.Add(std::string("*.") + proj + ".weight", row);
    s.Add(std::string("*.") + proj + ".bias", rep);
  }
  s.Add("*.gate_up_proj.weight", ShardRule::SplitEqual(0, 2));  // Phi-3: [gate; up]
  s.Add("*.gate_up_proj.bias", ShardRule::SplitEqual(0, 2));
  // Embeddings are vocab parallel (rows split), as is the output projection.
  s.Add("embed_tokens.weight", col);
  s.Add("*.embed_tokens.weight", col);
  s.Add("lm_head.weight", col);
  s.Add("*.lm_head.weight", col);
  // GPT-2: Conv1D stores weights [in, out], so column parallel is dim 1 and row parallel dim 0.
  // c_attn packs q, k, v (equal sizes) along the output dimension.
  s.Add("*attn.c_attn.weight", ShardRule::SplitEqual(1, 3));
  s.Add("*attn.c_attn.bias", ShardRule::SplitEqual(0, 3));
  s.Add("*attn.c_proj.weight", ShardRule::Split(0));
  s.Add("*attn.c_proj.bias", rep);
  s.Add("*mlp.c_fc.weight", ShardRule::Split(1));
  s.Add("*mlp.c_fc.bias", col);
  s.Add("*mlp.c_proj.weight", ShardRule::Split(0));
  s.Add("*mlp.c_proj.bias", rep);
  s.Add("wte.weight", col);
  s.Add("*.wte.weight", col);
  // BLOOM / GPT-NeoX / Falcon: query_key_value interleaves q, k, v per head (or kv group), so a
  // contiguous split of dim 0 gives each rank whole heads when world divides the head count.
  s.Add("*.query_key_value.weight", col);
  s.Add("*.query_key_value.bias", col);
  s.Add("*.dense_h_to_4h.weight", col);
  s.Add("*.dense_h_to_4h.bias", col);
  s.Add("*.dense_4h_to_h.weight", row);
  s.Add("*.dense_4h_to_h.bias", rep);
  s.Add("*.dense.weight", row);
  s.Add("*.dense.bias", rep);
  s.Add("word_embeddings.weight", col);
  s.Add("*.word_embeddings.weight", col);
  s.Add("embed_out.weight", col);
  s.Add("*.embed_out.weight", col);
  return s;
}

ShardSpec& ShardSpec::Add(std::string pattern, ShardRule rule) {
  patterns_.emplace_back(std::move(pattern), std::move(rule));
  return *this;
}

namespace {

template <typename V>
void SetSorted(std::vector<std::pair<std::string, V>>& v, std::string key, V value) {
  auto it = std::lower_bound(v.begin(), v.end(), key,
                             [](const auto& e, const std::string& k) { return e.first < k; });
  if (it != v.end() && it->first == key) {
    it->second = std::move(value);
  } else {
    v.emplace(it, std::move(key), std::move(value));
  }
}

template <typename V>
const V* FindSorted(const std::vector<std::pair<std::string, V>>& v, std::string_view key) {
  auto it = std::lower_bound(v.begin(), v.end(), key,
                             [](const auto& e, std::string_view k) { return e.first < k; });
  if (it != v.end() && it->first == key) return &it->second;
  return nullptr;
}

}  // namespace

ShardSpec& ShardSpec::Set(std::string name, ShardRule rule) {
  SetSorted(overrides_, std::move(name), std::move(rule));
  return *this;
}

ShardSpec& ShardSpec::Tie(std::string alias, std::string target) {
  SetSorted(ties_, std::move(alias), std::move(target));
  return *this;
}

std::optional<std::string> ShardSpec::TieTarget(std::string_view name) const {
  const std::string* next = FindSorted(ties_, name);
  if (next == nullptr) return std::nullopt;
  // A chain longer than the number of ties is a cycle.
  std::string_view cur = *next;
  for (size_t steps = 0; steps <= ties_.size(); ++steps) {
    const std::string* further = FindSorted(ties_, cur);
    if (further == nullptr) return std::string(cur);
    cur = *further;
  }
  return std::nullopt;
}

ShardRule ShardSpec::RuleFor(std::string_view name) const {
  std::string resolved;
  if (FindSorted(ties_, name) != nullptr) {
    std::optional<std::string> target = TieTarget(name);
    if (!target) return ShardRule::Replicate();
    resolved = std::move(*target);
    name = resolved;
  }
  if (const ShardRule* r = FindSorted(overrides_, name)) return *r;
  for (const auto& [pattern, rule] : patterns_) {
    if (GlobMatch(pattern, name)) return rule;
  }
  return ShardRule::Replicate();
}

Status ShardSpec::Validate() const {
  for (size_t i = 0; i < patterns_.size(); ++i) {
    if (patterns_[i].first.empty()) {
      return Status(Code::kInvalidArgument, "rules[" + std::to_string(i) + "]: empty pattern");
    }
  }
  for (const auto& [alias, target] : ties_) {
    if (alias == target) {
      return Status(Code::kInvalidArgument,
                    "ties[" + json::Quote(alias) + "]: a tensor cannot be tied to itself");
    }
    if (!TieTarget(alias)) {
      std::string chain = alias;
      std::string_view cur = alias;
      for (size_t steps = 0; steps <= ties_.size(); ++steps) {
        cur = *FindSorted(ties_, cur);
        chain += " -> " + std::string(cur);
        if (cur == alias) break;
      }
      return Status(Code::kInvalidArgument, "ties[" + json::Quote(alias) + "]: tie cycle " + chain);
    }
  }
  return Status::Ok();
}

// --- JSON ---------------------------------------------------------------------------------------

namespace {

void AppendRule(std::string& out, const ShardRule& r) {
  if (!r.is_split()) {
    out += "\"replicate\":true";
    return;
  }
  out += "\"split\":";
  json::AppendUint(out, r.dim);
  if (!r.parts.empty()) {
    out += ",\"parts\":" + UintList(r.parts);
  } else if (r.equal_parts != 0) {
    out += ",\"equal_parts\":";
    json::AppendUint(out, r.equal_parts);
  }
  if (r.granule != 0) {
    out += ",\"granule\":";
    json::AppendUint(out, r.granule);
  }
}

Status SpecError(const std::string& where, const std::string& message) {
  return Status(Code::kInvalidArgument, "shard spec: " + where + ": " + message);
}

std::string Describe(simdjson::dom::element e) {
  return json::TypeName(e.type());
}

Result<uint64_t> GetUint(simdjson::dom::element e, const std::string& where, std::string_view key) {
  uint64_t v = 0;
  if (e.get(v) != simdjson::SUCCESS) {
    return SpecError(
        where, "\"" + std::string(key) + "\" is " + Describe(e) + ", not a non-negative integer");
  }
  return v;
}

Result<ShardRule> ParseRule(simdjson::dom::object obj, const std::string& where,
                            bool allow_pattern) {
  if (auto dup = json::FindDuplicateKey(obj)) {
    return SpecError(where, "duplicate key " + json::Quote(*dup));
  }
  bool has_split = false, has_replicate = false;
  ShardRule rule;
  bool has_parts = false, has_equal = false, has_granule = false;
  for (auto field : obj) {
    const std::string_view key = field.key;
    if (key == "pattern" && allow_pattern) continue;
    if (key == "split") {
      TF_ASSIGN_OR_RETURN(uint64_t dim, GetUint(field.value, where, key));
      if (dim > UINT32_MAX) return SpecError(where, "\"split\" dimension too large");
      rule.kind = ShardRule::Kind::kSplit;
      rule.dim = static_cast<uint32_t>(dim);
      has_split = true;
    } else if (key == "replicate") {
      bool b = false;
      if (field.value.get(b) != simdjson::SUCCESS || !b) {
        return SpecError(where, "\"replicate\" must be true");
      }
      has_replicate = true;
    } else if (key == "parts") {
      simdjson::dom::array arr;
      if (field.value.get(arr) != simdjson::SUCCESS) {
        return SpecError(where, "\"parts\" is " + Describe(field.value) + ", not an array");
      }
      for (auto v : arr) {
        TF_ASSIGN_OR_RETURN(uint64_t n, GetUint(v, where, "parts"));
        if (n == 0) return SpecError(where, "\"parts\" holds a zero size");
        rule.parts.push_back(n);
      }
      if (rule.parts.empty()) return SpecError(where, "\"parts\" is empty");
      has_parts = true;
    } else if (key == "equal_parts") {
      TF_ASSIGN_OR_RETURN(uint64_t n, GetUint(field.value, where, key));
      if (n == 0 || n > UINT32_MAX) return SpecError(where, "\"equal_parts\" must be >= 1");
      rule.equal_parts = static_cast<uint32_t>(n);
      has_equal = true;
    } else if (key == "granule") {
      TF_ASSIGN_OR_RETURN(uint64_t n, GetUint(field.value, where, key));
      if (n == 0) return SpecError(where, "\"granule\" must be >= 1");
      rule.granule = n;
      has_granule = true;
    } else {
      return SpecError(where, "unknown key " + json::Quote(key));
    }
  }
  if (has_split == has_replicate) {
    return SpecError(where, "a rule needs exactly one of \"split\" or \"replicate\"");
  }
  if (has_replicate && (has_parts || has_equal || has_granule)) {
    return SpecError(where, "\"parts\"/\"equal_parts\"/\"granule\" need \"split\"");
  }
  if (has_parts && has_equal) {
    return SpecError(where, "\"parts\" and \"equal_parts\" exclude each other");
  }
  return rule;
}

// Parses `text` with `parser` into `top`: valid UTF-8 and JSON, an object without duplicate keys.
// `top` stays valid as long as `parser` lives and is not reused.
Status ParseSpecDocument(simdjson::dom::parser& parser, std::string_view text,
                         simdjson::dom::object& top) {
  if (!json::IsValidUtf8(text)) return SpecError("document", "not valid UTF-8");
  const simdjson::padded_string padded(text.data(), text.size());
  simdjson::dom::element root;
  if (auto err = parser.parse(padded).get(root); err != simdjson::SUCCESS) {
    return SpecError("document", std::string("not valid JSON: ") + simdjson::error_message(err));
  }
  if (root.get(top) != simdjson::SUCCESS) {
    return SpecError("document", "top level is " + Describe(root) + ", not an object");
  }
  if (auto dup = json::FindDuplicateKey(top)) {
    return SpecError("document", "duplicate key " + json::Quote(*dup));
  }
  return Status::Ok();
}

// "base": true for "builtin", false for "none"; anything else is an error.
Result<bool> ParseBase(simdjson::dom::element value) {
  std::string_view base;
  if (value.get(base) != simdjson::SUCCESS || (base != "builtin" && base != "none")) {
    return SpecError("base", "must be \"builtin\" or \"none\"");
  }
  return base == "builtin";
}

// "rules": adds each {"pattern": ..., rule} of the array to `spec`, in order.
Status AddRules(simdjson::dom::element value, ShardSpec& spec) {
  simdjson::dom::array arr;
  if (value.get(arr) != simdjson::SUCCESS) {
    return SpecError("rules", "is " + Describe(value) + ", not an array");
  }
  size_t i = 0;
  for (auto item : arr) {
    const std::string where = "rules[" + std::to_string(i++) + "]";
    simdjson::dom::object obj;
    if (item.get(obj) != simdjson::SUCCESS) {
      return SpecError(where, "is " + Describe(item) + ", not an object");
    }
    std::string_view pattern;
    simdjson::dom::element pe;
    if (obj.at_key("pattern").get(pe) != simdjson::SUCCESS) {
      return SpecError(where, "no \"pattern\"");
    }
    if (pe.get(pattern) != simdjson::SUCCESS) {
      return SpecError(where, "\"pattern\" is " + Describe(pe) + ", not a string");
    }
    if (pattern.empty()) return SpecError(where, "empty pattern");
    TF_ASSIGN_OR_RETURN(ShardRule rule, ParseRule(obj, where, /*allow_pattern=*/true));
    spec.Add(std::string(pattern), std::move(rule));
  }
  return Status::Ok();
}

// "overrides": sets the rule of each exact tensor name of the object in `spec`.
Status SetOverrides(simdjson::dom::element value, ShardSpec& spec) {
  simdjson::dom::object obj;
  if (value.get(obj) != simdjson::SUCCESS) {
    return SpecError("overrides", "is " + Describe(value) + ", not an object");
  }
  if (auto dup = json::FindDuplicateKey(obj)) {
    return SpecError("overrides", "duplicate name " + json::Quote(*dup));
  }
  for (auto entry : obj) {
    const std::string where = "overrides[" + json::Quote(entry.key) + "]";
    simdjson::dom::object robj;
    if (entry.value.get(robj) != simdjson::SUCCESS) {
      return SpecError(where, "is " + Describe(entry.value) + ", not an object");
    }
    TF_ASSIGN_OR_RETURN(ShardRule rule, ParseRule(robj, where, /*allow_pattern=*/false));
    spec.Set(std::string(entry.key), std::move(rule));
  }
  return Status::Ok();
}

// "ties": ties each alias of the object to its target name in `spec`.
Status AddTies(simdjson::dom::element value, ShardSpec& spec) {
  simdjson::dom::object obj;
  if (value.get(obj) != simdjson::SUCCESS) {
    return SpecError("ties", "is " + Describe(value) + ", not an object");
  }
  if (auto dup = json::FindDuplicateKey(obj)) {
    return SpecError("ties", "duplicate alias " + json::Quote(*dup));
  }
  for (auto entry : obj) {
    std::string_view target;
    if (entry.value.get(target) != simdjson::SUCCESS) {
      return SpecError("ties[" + json::Quote(entry.key) + "]",
                       "is " + Describe(entry.value) + ", not a string");
    }
    spec.Tie(std::string(entry.key), std::string(target));
  }
  return Status::Ok();
}

}  // namespace

std::string ShardSpec::ToJson() const {
  std::string out = "{\"rules\":[";
  for (size_t i = 0; i < patterns_.size(); ++i) {
    if (i) out += ',';
    out += "{\"pattern\":";
    json::AppendString(out, patterns_[i].first);
    out += ',';
    AppendRule(out, patterns_[i].second);
    out += '}';
  }
  out += "],\"overrides\":{";
  for (size_t i = 0; i < overrides_.size(); ++i) {
    if (i) out += ',';
    json::AppendString(out, overrides_[i].first);
    out += ":{";
    AppendRule(out, overrides_[i].second);
    out += '}';
  }
  out += "},\"ties\":{";
  for (size_t i = 0; i < ties_.size(); ++i) {
    if (i) out += ',';
    json::AppendString(out, ties_[i].first);
    out += ':';
    json::AppendString(out, ties_[i].second);
  }
  out += "}}";
  return out;
}

Result<ShardSpec> ShardSpec::FromJson(std::string_view text) {
  simdjson::dom::parser parser;
  simdjson::dom::object top;
  TF_RETURN_IF_ERROR(ParseSpecDocument(parser, text, top));
  ShardSpec spec;
  bool builtin = false;
  for (auto field : top) {
    const std::string_view key = field.key;
    if (key == "base") {
      TF_ASSIGN_OR_RETURN(builtin, ParseBase(field.value));
    } else if (key == "rules") {
      TF_RETURN_IF_ERROR(AddRules(field.value, spec));
    } else if (key == "overrides") {
      TF_RETURN_IF_ERROR(SetOverrides(field.value, spec));
    } else if (key == "ties") {
      TF_RETURN_IF_ERROR(AddTies(field.value, spec));
    } else {
      return SpecError("document", "unknown key " + json::Quote(key));
    }
  }
  if (builtin) {
    for (auto& [pattern, rule] : Builtin().patterns_) spec.Add(std::move(pattern), std::move(rule));
  }
  if (Status s = spec.Validate(); !s.ok()) {
    return Status(Code::kInvalidArgument, "shard spec: " + s.message());
  }
  return spec;
}

// --- slices -------------------------------------------------------------------------------------

namespace {

Status SliceError(const TensorInfo& t, const ShardRule& rule, uint32_t rank, uint32_t world,
                  const std::string& why) {
  return Status(Code::kInvalidArgument,
                "tensor " + json::Quote(t.name) + " (shape " + ShapeText(t.shape) + ", " +
                    std::string(DTypeName(t.dtype)) + "), rule " + rule.ToString() + ", rank " +
                    std::to_string(rank) + " of " + std::to_string(world) + ": " + why);
}

// Product of shape[begin, end); callers know it fits (the tensor's byte size did).
uint64_t Product(const std::vector<uint64_t>& shape, size_t begin, size_t end) {
  uint64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= shape[i];
  return p;
}

// Bytes of one index along `dim` (the product of the trailing dimensions times the element size).
uint64_t RowBytes(const TensorInfo& t, uint32_t dim) {
  return Product(t.shape, dim + 1, t.shape.size()) * DTypeBits(t.dtype) / 8;
}

}  // namespace

Result<TensorSlice> SliceOf(const TensorInfo& tensor, const ShardRule& rule, uint32_t rank,
                            uint32_t world) {
  if (world == 0) return SliceError(tensor, rule, rank, world, "world size is 0");
  if (rank >= world) return SliceError(tensor, rule, rank, world, "rank is not below world size");
  TensorSlice slice;
  slice.rule = rule;
  if (!rule.is_split()) {
    slice.rule = ShardRule::Replicate();
    slice.shape = tensor.shape;
    slice.bytes = tensor.size;
    return slice;
  }
  if (rule.dim >= tensor.shape.size()) {
    return SliceError(tensor, rule, rank, world,
                      "split dimension " + std::to_string(rule.dim) + " is not below the rank " +
                          std::to_string(tensor.shape.size()) + " of the tensor");
  }
  const uint64_t n = tensor.shape[rule.dim];
  std::vector<uint64_t> parts = rule.parts;
  if (!parts.empty()) {
    uint64_t sum = 0;
    for (uint64_t p : parts) {
      if (p == 0) return SliceError(tensor, rule, rank, world, "a fused part has size 0");
      if (sum + p < sum) return SliceError(tensor, rule, rank, world, "parts overflow");
      sum += p;
    }
    if (sum != n) {
      return SliceError(tensor, rule, rank, world,
                        "parts sum to " + std::to_string(sum) + ", not to shape[" +
                            std::to_string(rule.dim) + "] = " + std::to_string(n));
    }
  } else if (rule.equal_parts > 1) {
    if (n % rule.equal_parts != 0) {
      return SliceError(tensor, rule, rank, world,
                        std::to_string(rule.equal_parts) + " equal parts do not divide shape[" +
                            std::to_string(rule.dim) + "] = " + std::to_string(n));
    }
    parts.assign(rule.equal_parts, n / rule.equal_parts);
  } else {
    parts.push_back(n);
  }
  const unsigned bits = DTypeBits(tensor.dtype);
  if (bits % 8 != 0 && (Product(tensor.shape, rule.dim + 1, tensor.shape.size()) * bits) % 8 != 0) {
    return SliceError(tensor, rule, rank, world,
                      "one index along the split dimension is not a whole number of bytes");
  }
  uint64_t start = 0, local = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const uint64_t p = parts[i];
    // Units of g indices (one unit when g exceeds the part). A run's end is the part's end or a
    // unit's start, below p: no product overflows.
    const uint64_t g = std::clamp<uint64_t>(rule.granule, 1, std::max<uint64_t>(p, 1));
    const uint64_t units = p / g + (p % g != 0 ? 1 : 0);
    if (units < world && world > 1) {  // alone, a rank holds even an empty dimension whole
      return SliceError(
          tensor, rule, rank, world,
          (parts.size() > 1 ? "part " + std::to_string(i) + " has " : "it has ") +
              std::to_string(p) + " indices along dim " + std::to_string(rule.dim) +
              (g > 1 ? " (" + std::to_string(units) + " units of " + std::to_string(g) + ")"
                     : std::string()) +
              ", fewer than the world size: some rank would get nothing (replicate it instead)");
    }
    const uint64_t q = units / world, rem = units % world;
    const uint64_t first = rank * q + std::min<uint64_t>(rank, rem);
    const uint64_t count = q + (rank < rem ? 1 : 0);
    const uint64_t off = first * g;
    const uint64_t end = first + count == units ? p : (first + count) * g;
    slice.blocks.emplace_back(start + off, end - off);
    local += end - off;
    start += p;
  }
  slice.shape = tensor.shape;
  slice.shape[rule.dim] = local;
  slice.bytes = Product(tensor.shape, 0, rule.dim) * local * RowBytes(tensor, rule.dim);
  return slice;
}

std::vector<std::pair<uint64_t, uint64_t>> SliceByteRanges(const TensorInfo& tensor,
                                                           const TensorSlice& slice) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (!slice.rule.is_split()) {
    if (tensor.size > 0) out.emplace_back(0, tensor.size);
    return out;
  }
  const uint32_t dim = slice.rule.dim;
  const uint64_t outer = Product(tensor.shape, 0, dim);
  const uint64_t row = RowBytes(tensor, dim);
  const uint64_t stride = tensor.shape[dim] * row;  // bytes per index of the leading dimensions
  // Nothing to read (a size-0 dimension, split or not): no loop over the leading indices, which
  // may number 2^60 when a later dimension is 0.
  if (row == 0 || outer == 0 || slice.bytes == 0 || tensor.shape[dim] == 0) return out;
  for (uint64_t o = 0; o < outer; ++o) {
    for (const auto& [start, len] : slice.blocks) {
      const uint64_t off = o * stride + start * row;
      const uint64_t bytes = len * row;
      if (bytes == 0) continue;
      if (!out.empty() && out.back().first + out.back().second == off) {
        out.back().second += bytes;
      } else {
        out.emplace_back(off, bytes);
      }
    }
  }
  return out;
}

uint64_t SliceRangeCount(const TensorInfo& tensor, const TensorSlice& slice) {
  if (!slice.rule.is_split()) return tensor.size > 0 ? 1 : 0;
  const uint32_t dim = slice.rule.dim;
  const uint64_t outer = Product(tensor.shape, 0, dim);
  const uint64_t row = RowBytes(tensor, dim);
  if (row == 0 || outer == 0 || slice.blocks.empty() || slice.bytes == 0 ||
      tensor.shape[dim] == 0) {
    return 0;
  }
  // Blocks adjacent to each other within one leading index merge; so do the last block of index
  // o and the first of o + 1 when together they cover everything (world 1).
  uint64_t per = 1;
  for (size_t i = 1; i < slice.blocks.size(); ++i) {
    const auto& prev = slice.blocks[i - 1];
    if (prev.first + prev.second != slice.blocks[i].first) ++per;
  }
  const bool wraps = slice.blocks.back().first + slice.blocks.back().second == tensor.shape[dim] &&
                     slice.blocks.front().first == 0;
  if (wraps) return per == 1 ? 1 : outer * per - (outer - 1);
  return outer * per;
}

}  // namespace tensorferry

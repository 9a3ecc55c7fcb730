// libFuzzer target: the bytes are a shard rules document (ShardSpec::FromJson: the shard_rules
// option, the CLIs' rule files). FromJson must never crash, hang or read outside the input; an
// error is kInvalidArgument and says it is about the shard spec; an accepted spec validates,
// survives ToJson/FromJson unchanged, its globs match as a reference matcher does, and every rule
// in it slices tensors consistently: over all ranks the slices tile the tensor (SliceOf,
// SliceByteRanges and SliceRangeCount agree).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/shard.h"

namespace {

using tensorferry::DType;
using tensorferry::ShardRule;
using tensorferry::TensorInfo;

// A tensor the rule can apply to: shape[dim] is what the rule's parts need (their sum, or a
// multiple of equal_parts), the other dimensions small, so the slices can be checked byte by byte.
TensorInfo TensorFor(const ShardRule& rule, DType dtype, uint64_t scale) {
  TensorInfo t;
  t.name = "t";
  t.dtype = dtype;
  const uint32_t ndim = std::min<uint32_t>(rule.dim + 1 + static_cast<uint32_t>(scale % 2), 4);
  t.shape.assign(ndim, 2 + scale % 3);
  if (rule.is_split() && rule.dim < ndim) {
    uint64_t n = 0;
    for (uint64_t p : rule.parts) n += p;
    if (rule.parts.empty()) n = std::max<uint64_t>(rule.equal_parts, 1) * (1 + scale % 5);
    t.shape[rule.dim] = n;
  }
  uint64_t elements = 1;
  for (uint64_t d : t.shape) elements *= d;
  t.size = elements * tensorferry::DTypeBits(dtype) / 8;
  return t;
}

// Every rank's slice of `t`: the byte ranges, counted right, inside the tensor, totalling the
// slice's bytes, and the ranks' ranges together covering every byte exactly once.
void CheckSlices(const ShardRule& rule, const TensorInfo& t, uint32_t world) {
  std::vector<std::pair<uint64_t, uint64_t>> all;
  uint64_t total = 0;
  for (uint32_t rank = 0; rank < world; ++rank) {
    auto slice = tensorferry::SliceOf(t, rule, rank, world);
    if (!slice.ok()) {
      if (slice.status().code() != tensorferry::Code::kInvalidArgument ||
          slice.status().message().empty()) {
        std::abort();
      }
      if (rank > 0) std::abort();  // whether a rule applies does not depend on the rank
      return;
    }
    if (slice->rule.is_split() != rule.is_split() || slice->shape.size() != t.shape.size()) {
      std::abort();
    }
    const auto ranges = tensorferry::SliceByteRanges(t, *slice);
    if (ranges.size() != tensorferry::SliceRangeCount(t, *slice)) std::abort();
    uint64_t bytes = 0;
    for (const auto& [offset, length] : ranges) {
      if (length == 0 || offset > t.size || length > t.size - offset) std::abort();
      bytes += length;
      all.emplace_back(offset, length);
    }
    if (bytes != slice->bytes) std::abort();
    total += bytes;
    if (!rule.is_split()) return;  // replicated: every rank holds the whole tensor
  }
  if (total != t.size) std::abort();
  if (all.size() > 4096) return;  // sorting more would cost more than the rest of the run
  std::sort(all.begin(), all.end());
  uint64_t end = 0;
  for (const auto& [offset, length] : all) {
    if (offset != end) std::abort();  // a gap or an overlap between ranks
    end = offset + length;
  }
  if (end != t.size) std::abort();
}

// GlobMatch by dynamic programming over (pattern prefix, name prefix): slow, obviously right.
// '?' and '*' take whole UTF-8 characters (they start and end at character boundaries); other
// pattern bytes match name bytes.
bool ReferenceGlob(std::string_view pattern, std::string_view name) {
  const auto boundary = [&](size_t j) {
    return j == 0 || j == name.size() || (static_cast<unsigned char>(name[j]) & 0xC0) != 0x80;
  };
  const auto char_start = [&](size_t j) {  // the start of the character ending at j
    size_t i = j - 1;
    while (i > 0 && (static_cast<unsigned char>(name[i]) & 0xC0) == 0x80) --i;
    return i;
  };
  std::vector<char> row(name.size() + 1, 0), next(name.size() + 1, 0);
  row[0] = 1;
  for (size_t j = 1; j <= name.size(); ++j) row[j] = 0;
  for (char pc : pattern) {
    next[0] = pc == '*' && row[0];
    for (size_t j = 1; j <= name.size(); ++j) {
      if (pc == '*') {
        next[j] = boundary(j) && (row[j] || next[char_start(j)]);
      } else if (pc == '?') {
        next[j] = boundary(j) && row[char_start(j)];
      } else {
        next[j] = row[j - 1] && pc == name[j - 1];
      }
    }
    std::swap(row, next);
  }
  return row[name.size()] != 0;
}

// The pattern with its wildcards filled in matches; GlobMatch agrees with ReferenceGlob on the
// names the spec holds.
void CheckGlob(std::string_view pattern, const std::vector<std::string_view>& names) {
  std::string filled, stretched;
  for (char c : pattern) {
    filled += c == '*' ? std::string() : c == '?' ? std::string("q") : std::string(1, c);
    stretched += c == '*' ? std::string("a*?b") : c == '?' ? std::string("?") : std::string(1, c);
  }
  if (!tensorferry::GlobMatch(pattern, filled) || !tensorferry::GlobMatch(pattern, stretched)) {
    std::abort();
  }
  for (std::string_view name : names) {
    if (pattern.size() * name.size() > 4096) continue;
    if (tensorferry::GlobMatch(pattern, name) != ReferenceGlob(pattern, name)) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  auto spec = tensorferry::ShardSpec::FromJson(json);
  if (!spec.ok()) {
    if (spec.status().code() != tensorferry::Code::kInvalidArgument ||
        spec.status().message().rfind("shard spec: ", 0) != 0) {
      std::abort();
    }
    return 0;
  }
  if (!spec->Validate().ok()) std::abort();
  // ToJson's document reads back as the same spec (builtin patterns expanded).
  const std::string text = spec->ToJson();
  auto again = tensorferry::ShardSpec::FromJson(text);
  if (!again.ok() || !(*again == *spec) || again->ToJson() != text) std::abort();

  // Overrides and ties sorted without duplicates; every alias resolves (no cycles accepted).
  const auto& overrides = spec->overrides();
  for (size_t i = 1; i < overrides.size(); ++i) {
    if (!(overrides[i - 1].first < overrides[i].first)) std::abort();
  }
  const auto& ties = spec->ties();
  for (size_t i = 0; i < ties.size(); ++i) {
    if (i > 0 && !(ties[i - 1].first < ties[i].first)) std::abort();
    auto target = spec->TieTarget(ties[i].first);
    if (!target || spec->TieTarget(*target)) std::abort();
    if (!(spec->RuleFor(ties[i].first) == spec->RuleFor(*target))) std::abort();
  }
  for (const auto& [name, rule] : overrides) {
    if (!spec->TieTarget(name) && !(spec->RuleFor(name) == rule)) std::abort();
  }
  // Globs: checked against the names and patterns of the spec (the first 8 of each).
  std::vector<std::string_view> names;
  for (const auto& [pattern, rule] : spec->patterns()) {
    if (names.size() < 8) names.push_back(pattern);
  }
  for (const auto& [name, rule] : overrides) {
    if (names.size() < 16) names.push_back(name);
  }
  for (size_t i = 0; i < spec->patterns().size() && i < 8; ++i) {
    CheckGlob(spec->patterns()[i].first, names);
  }

  // The rules slice consistently (the first few, on a few tensors and world sizes).
  std::vector<ShardRule> rules;
  for (const auto& [pattern, rule] : spec->patterns()) rules.push_back(rule);
  for (const auto& [name, rule] : overrides) rules.push_back(rule);
  if (rules.size() > 8) rules.resize(8);
  uint64_t scale = size;
  for (const ShardRule& rule : rules) {
    uint64_t sum = 0;
    for (uint64_t p : rule.parts) {
      if (p > 4096 || sum > 4096) sum = UINT64_MAX;
      if (sum != UINT64_MAX) sum += p;
    }
    if (rule.dim > 3 || sum > 4096 || rule.parts.size() > 64 || rule.equal_parts > 64) {
      continue;  // too big to check quickly
    }
    for (DType dtype : {DType::kBF16, DType::kF4, DType::kF32}) {
      const TensorInfo t = TensorFor(rule, dtype, scale++);
      for (uint32_t world : {1u, 2u, 3u, 8u}) CheckSlices(rule, t, world);
    }
  }
  return 0;
}

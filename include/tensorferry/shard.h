// tensorferry/shard.h: tensor parallelism: how each tensor is distributed over `world` ranks,
// and which part of it (elements, bytes) one rank holds.
//
// A ShardSpec maps tensor names to ShardRules: replicate (every rank holds the whole tensor) or
// split along one dimension (each rank holds a contiguous run of indices along it; a fused tensor,
// e.g. a packed q/k/v projection, is split part by part and the rank's pieces concatenated).
// SliceOf turns (tensor, rule, rank, world) into a TensorSlice (local shape, blocks along the
// split dimension); SliceByteRanges turns that into byte ranges of the tensor's data. Everything
// here is pure: no I/O, no globals.
//
// Uneven sizes: n indices over w ranks (numpy.array_split / torch.tensor_split): rank r gets
// n / w indices, plus one if r < n % w, starting at r * (n / w) + min(r, n % w). With fused parts
// the rule applies to each part separately, offset by the part's start. With a granule g, the
// same over the part's ceil(n / g) units of g indices (the last unit holds what is left).
//
// A split that would leave some rank with nothing of a part (a part of fewer than `world`
// indices, or units with a granule) is
// refused (kInvalidArgument) rather than handing out empty slices: tensor-parallel layers assume
// every rank holds a piece of every split tensor, so an empty piece is a rule error (replicate
// small tensors instead), and refusing it early names the tensor instead of failing in a matmul.
//
// Thread-safety: ShardRule, ShardSpec and TensorSlice are values; const methods may be called from
// any thread at once. Builders (Add/Set/Tie) need exclusive access.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/status.h"

namespace tensorferry {

// How one tensor is distributed over the ranks.
struct ShardRule {
  enum class Kind : uint8_t { kReplicate, kSplit };
  Kind kind = Kind::kReplicate;
  uint32_t dim = 0;  // split dimension (kSplit)
  // Fused tensors (e.g. packed qkv): sizes of the sub-blocks along `dim`, summing to shape[dim],
  // each split separately and the rank's pieces concatenated in order. Empty: one block (or
  // `equal_parts` blocks).
  std::vector<uint64_t> parts;
  // When `parts` is empty and equal_parts > 1: shape[dim] is cut into that many equal blocks
  // (it must divide shape[dim]); for fused tensors whose sizes depend on the model (GPT-2's
  // c_attn: 3 equal blocks). 0 or 1: one block. Ignored when `parts` is given.
  uint32_t equal_parts = 0;
  // kSplit: indices along `dim` are dealt out in units of `granule` (0 or 1: single indices):
  // each rank's run of each part starts on a multiple of `granule` within the part, and the
  // uneven remainder goes by whole units (the part's last unit may be shorter). A part needs at
  // least `world` units. Cooperative loads use it to cut row pieces on checksum chunks.
  uint64_t granule = 0;

  static ShardRule Replicate();
  static ShardRule Split(uint32_t dim, std::vector<uint64_t> parts = {});
  static ShardRule SplitEqual(uint32_t dim, uint32_t equal_parts);

  bool is_split() const noexcept { return kind == Kind::kSplit; }
  // "replicate", "split(dim=1)", "split(dim=0, parts=[4096,1024,1024])",
  // "split(dim=1, equal_parts=3)", "split(dim=0, granule=64)": for messages and `load --explain`.
  std::string ToString() const;
  friend bool operator==(const ShardRule&, const ShardRule&) = default;
};

// Name -> rule. Lookup order of RuleFor(name):
//   1. a tie (Tie(alias, target)): the alias gets its target's rule (ties followed to the end);
//   2. an exact-name override (Set);
//   3. the first added pattern (Add) whose glob matches the whole name;
//   4. replicate.
// Globs: '*' matches any run of characters (dots included, possibly empty), '?' exactly one (a
// UTF-8 character, not a byte); every other character matches itself. No escapes, no character
// classes.
//
// JSON schema (FromJson / ToJson), every key optional, unknown keys refused:
//   {
//     "base": "builtin" | "none",            // patterns of Builtin() appended after "rules"
//     "rules": [ {"pattern": "*.q_proj.weight", "split": 0},
//                {"pattern": "*.c_attn.weight", "split": 1, "equal_parts": 3},
//                {"pattern": "*.qkv.weight", "split": 0, "parts": [4096, 1024, 1024]},
//                {"pattern": "*.norm.weight", "replicate": true} ],
//     "overrides": { "lm_head.weight": {"split": 0}, "score.weight": {"replicate": true} },
//     "ties": { "lm_head.weight": "model.embed_tokens.weight" }
//   }
// A rule object has exactly one of "split" (dimension, an integer) or "replicate" (true), and
// with "split" optionally "parts" (array of positive integers) or "equal_parts" (integer >= 1),
// and "granule" (integer >= 1, ShardRule::granule).
// ToJson writes "rules" (the patterns in order, Builtin's expanded), "overrides" and "ties"
// (sorted by name); FromJson(ToJson()) equals the original.
class ShardSpec {
 public:
  // Everything replicated.
  static ShardSpec None();
  // Rules by name pattern for common architectures (documented rule by rule in src/shard/shard.cc
  // and docs/architecture.md):
  //   LLaMA / Mistral / Mixtral / Qwen / Gemma / Phi-3 style (Hugging Face names):
  //     q_proj, k_proj, v_proj, gate_proj, up_proj, w1, w3 (experts), embed_tokens, lm_head:
  //       weight split on dim 0 (column parallel; embeddings vocab parallel); biases on dim 0;
  //     o_proj, down_proj, w2 (experts): weight split on dim 1 (row parallel); biases replicated;
  //     gate_up_proj (Phi-3): dim 0 in 2 equal parts;
  //   GPT-2 (Conv1D weights are stored [in, out]): c_attn weight dim 1 in 3 equal parts, its
  //     bias dim 0 in 3 equal parts; c_fc weight dim 1, bias dim 0; c_proj weight dim 0 (row),
  //     bias replicated; wte dim 0;
  //   BLOOM / GPT-NeoX / Falcon: query_key_value weight and bias dim 0 (these interleave q, k, v
  //     per head or per kv group, so a contiguous split hands each rank whole heads/groups when
  //     world divides their count), dense_h_to_4h dim 0 (+bias), dense and dense_4h_to_h dim 1,
  //     word_embeddings dim 0, embed_out dim 0.
  //   Everything else (norms, position embeddings, routers, row-parallel biases): replicated.
  // No ties: whether lm_head is tied depends on the model's config (tie_word_embeddings).
  static ShardSpec Builtin();
  // The spec a name stands for where rules are given as text (the shard_rules option, the CLIs'
  // rule flags): "builtin" (Builtin()) or "none" (None()); nullopt for any other text.
  static std::optional<ShardSpec> Named(std::string_view name);
  // Parses the schema above. Errors (kInvalidArgument) name the offending entry, e.g.
  // `rules[2]: "split" is a string, not an integer`, `ties["a"]: tie cycle a -> b -> a`.
  static Result<ShardSpec> FromJson(std::string_view json);
  std::string ToJson() const;

  // Glob on the whole name; the first added pattern that matches wins.
  ShardSpec& Add(std::string pattern, ShardRule rule);
  // Exact-name override: wins over patterns (a parameter's own metadata).
  ShardSpec& Set(std::string name, ShardRule rule);
  // Tied/shared parameter: `alias` is the same tensor as `target` (one read, shared data).
  ShardSpec& Tie(std::string alias, std::string target);

  // Replicate when nothing matches. A tie cycle (which Validate and FromJson refuse) resolves to
  // replicate.
  ShardRule RuleFor(std::string_view name) const;
  // The end of the tie chain starting at `name`, or nullopt when `name` is not an alias (or the
  // chain is a cycle).
  std::optional<std::string> TieTarget(std::string_view name) const;

  // OK, or kInvalidArgument naming an empty pattern, a tie of a name to itself or a tie cycle.
  Status Validate() const;

  const std::vector<std::pair<std::string, ShardRule>>& patterns() const noexcept {
    return patterns_;
  }
  // Sorted by name.
  const std::vector<std::pair<std::string, ShardRule>>& overrides() const noexcept {
    return overrides_;
  }
  // (alias, target), sorted by alias.
  const std::vector<std::pair<std::string, std::string>>& ties() const noexcept { return ties_; }

  friend bool operator==(const ShardSpec&, const ShardSpec&) = default;

 private:
  std::vector<std::pair<std::string, ShardRule>> patterns_;
  std::vector<std::pair<std::string, ShardRule>> overrides_;
  std::vector<std::pair<std::string, std::string>> ties_;
};

// True when the glob `pattern` matches the whole of `name` (syntax: see ShardSpec).
bool GlobMatch(std::string_view pattern, std::string_view name) noexcept;

// The part of one tensor a rank holds.
struct TensorSlice {
  ShardRule rule;
  std::vector<uint64_t> shape;  // the rank's local shape
  // (start, length) along rule.dim of the full tensor, in destination order: one per fused part
  // (one for an unfused split). Empty for a replicated tensor.
  std::vector<std::pair<uint64_t, uint64_t>> blocks;
  uint64_t bytes = 0;  // bytes of the local tensor
  // True when the rank holds the whole tensor (replicate, or world == 1); blocks is then empty.
  bool whole() const noexcept { return !rule.is_split(); }
  friend bool operator==(const TensorSlice&, const TensorSlice&) = default;
};

// The slice of `tensor` that rank `rank` of `world` holds under `rule`. With world == 1 a split
// rule yields the whole tensor as one block (still kSplit, so callers see the rule).
// Errors (kInvalidArgument, naming the tensor, its shape, the rule and rank/world): world 0,
// rank >= world, dim >= ndim, parts not summing to shape[dim] (or a zero part), equal_parts not
// dividing shape[dim], a part smaller than world (some rank would get nothing of it), and a
// split of a sub-byte dtype (F4, F6_*) where one index along dim is not a whole number of bytes.
Result<TensorSlice> SliceOf(const TensorInfo& tensor, const ShardRule& rule, uint32_t rank,
                            uint32_t world);

// The slice's bytes as (offset, length) relative to the tensor's first byte, in destination
// order (the local tensor's row-major bytes are the concatenation of the ranges), adjacent ranges
// merged: a dim-0 split gives one range per non-adjacent block; other dims give strided ranges
// (one per index of the leading dimensions and block). A whole slice gives one range.
// REQUIRES: `slice` came from SliceOf(tensor, ...).
std::vector<std::pair<uint64_t, uint64_t>> SliceByteRanges(const TensorInfo& tensor,
                                                           const TensorSlice& slice);

// Number of ranges SliceByteRanges would return, without building them.
uint64_t SliceRangeCount(const TensorInfo& tensor, const TensorSlice& slice);

// Tensor-parallel loading settings (PlanOptions::tensor_parallel, LoadOptions::tensor_parallel):
// which rank of how many this process is, the spec, and how strided slices are read.
struct TensorParallelOptions {
  ShardSpec spec;
  uint32_t rank = 0;
  uint32_t world = 1;
  // Strided slices (splits of dim > 0, fused parts): consecutive byte ranges of one tensor whose
  // gap is at most max_gap bytes are read as one covering read into the batch buffer (the gap
  // bytes are read, then the wanted pieces moved together in place); larger gaps end the read
  // (exact strides). 0: exact strides only (every range its own read, nothing discarded). A slice
  // of more than 65,536 pieces (rows of a few bytes) covers gaps under 4 KiB whatever max_gap and
  // exact_when_cached say: a read per row would cost more than the plan is worth.
  // Default 64 KiB; docs/benchmarks.md ("Tensor parallel") measures the trade-off.
  uint64_t max_gap = 64u << 10;
  // When true, a file at least half of whose tensor bytes are in the page cache (mincore) is read
  // with exact strides whatever max_gap says: copies from the page cache cost little per request,
  // so covered gaps are pure extra copying there, while from storage every strided piece would be
  // its own read (measured in docs/benchmarks.md). Files that cannot be checked use max_gap. On a
  // CUDA device the same files have their strided rows gathered from a mapping into the staging
  // ring (docs/gpu.md). Setting max_gap through the options' text form turns this off.
  bool exact_when_cached = true;
};

}  // namespace tensorferry

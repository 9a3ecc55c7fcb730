// Selection (which tensors) and DescribeSelection (what a load of it delivers): the one
// resolution of tied aliases and output order (loader.h).
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "tensorferry/format.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "util/macros.h"

namespace tensorferry {

// --- Selection ---------------------------------------------------------------------------------

Selection Selection::All() {
  return Selection();
}

Selection Selection::Names(std::vector<std::string> names) {
  Selection s;
  s.names_ = std::move(names);
  s.by_name_ = true;
  return s;
}

Selection Selection::Where(std::function<bool(const TensorInfo&)> predicate) {
  Selection s;
  s.predicate_ = std::move(predicate);
  return s;
}

Selection Selection::Layers(uint64_t first, uint64_t last) {
  return Where([first, last](const TensorInfo& t) {
    auto layer = LayerOf(t.name);
    return layer && *layer >= first && *layer <= last;
  });
}

Result<std::vector<uint32_t>> Selection::Resolve(const Checkpoint& checkpoint) const {
  const auto& all = checkpoint.tensors();
  std::vector<uint32_t> out;
  if (by_name_) {
    out.reserve(names_.size());
    for (const auto& name : names_) {
      const TensorInfo* t = checkpoint.Find(name);
      if (t == nullptr) {
        return Status(Code::kNotFound, "tensor \"" + name + "\" is not in the checkpoint");
      }
      out.push_back(static_cast<uint32_t>(t - all.data()));
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }
  out.reserve(all.size());
  for (uint32_t i = 0; i < all.size(); ++i) {
    if (!predicate_ || predicate_(all[i])) out.push_back(i);
  }
  return out;
}

namespace {

// Every tie must name a tensor the checkpoint has, and an alias the files hold must be that
// tensor's twin: otherwise the spec does not describe this checkpoint, and following it would
// silently hand out another tensor's bytes (or ignore the tie).
Status CheckTies(const Checkpoint& ckpt, const ShardSpec& spec) {
  for (const auto& [alias, ignored] : spec.ties()) {
    const std::optional<std::string> target = spec.TieTarget(alias);
    if (!target) continue;  // a cycle: ShardSpec::Validate refuses it
    const TensorInfo* t = ckpt.Find(*target);
    if (t == nullptr) {
      return Status(Code::kInvalidArgument, "tie \"" + alias + "\" -> \"" + *target +
                                                "\": the target is not in the checkpoint");
    }
    const TensorInfo* a = ckpt.Find(alias);
    if (a != nullptr && (a->dtype != t->dtype || a->shape != t->shape)) {
      return Status(Code::kInvalidArgument,
                    "tie \"" + alias + "\" -> \"" + *target + "\": the alias is " +
                        std::string(DTypeName(a->dtype)) + " " + ShapeText(a->shape) +
                        " in the files but its target is " + std::string(DTypeName(t->dtype)) +
                        " " + ShapeText(t->shape) + "; a tie must name the same tensor");
    }
  }
  return Status::Ok();
}

// A selection resolved: per tensor index, read and delivered under its own name; tied aliases
// (alias name -> target index).
struct Resolution {
  std::vector<bool> read, deliver;
  std::map<std::string, uint32_t> alias_target;
};

// REQUIRES: CheckTies(ckpt, spec) passed.
Result<Resolution> ResolveTied(const Checkpoint& ckpt, const std::vector<std::string>* names,
                               const std::function<bool(const TensorInfo&)>& predicate,
                               const ShardSpec& spec) {
  const auto& all = ckpt.tensors();
  Resolution r;
  r.read.assign(all.size(), false);
  r.deliver.assign(all.size(), false);
  auto index_of = [&](const TensorInfo* t) { return static_cast<uint32_t>(t - all.data()); };
  // The target an alias stands for, when the spec ties it to a tensor the checkpoint has.
  auto target_of = [&](std::string_view name) -> const TensorInfo* {
    std::optional<std::string> target = spec.TieTarget(name);
    return target ? ckpt.Find(*target) : nullptr;
  };
  auto add_alias = [&](const std::string& alias, const TensorInfo* target) {
    r.read[index_of(target)] = true;
    r.alias_target.emplace(alias, index_of(target));
  };
  if (names != nullptr) {
    for (const std::string& name : *names) {
      if (const TensorInfo* target = target_of(name)) {
        add_alias(name, target);  // present or not, the alias's own bytes are not read
        continue;
      }
      const TensorInfo* t = ckpt.Find(name);
      if (t == nullptr) {
        return Status(Code::kNotFound, "tensor \"" + name + "\" is not in the checkpoint");
      }
      r.read[index_of(t)] = r.deliver[index_of(t)] = true;
    }
    return r;
  }
  for (uint32_t i = 0; i < all.size(); ++i) {
    if (predicate && !predicate(all[i])) continue;
    if (const TensorInfo* target = target_of(all[i].name)) {
      add_alias(all[i].name, target);  // a duplicate of its target: read once
    } else {
      r.read[i] = r.deliver[i] = true;
    }
  }
  // Aliases the files do not hold (tie_word_embeddings): selected as their target would be under
  // the alias's name.
  for (const auto& [alias, ignored] : spec.ties()) {
    if (ckpt.Find(alias) != nullptr) continue;
    const TensorInfo* target = target_of(alias);
    if (target == nullptr) continue;
    TensorInfo as_alias = *target;
    as_alias.name = alias;
    if (!predicate || predicate(as_alias)) add_alias(alias, target);
  }
  return r;
}

// Outputs in Loader::Load's order. Keys: 2 * index for a tensor of the files, 2 * target + 1 for
// an alias the files lack.
std::vector<OutputInfo> OrderOutputs(const Checkpoint& ckpt, const Resolution& r) {
  const auto& all = ckpt.tensors();
  std::vector<std::pair<size_t, OutputInfo>> keyed;
  for (uint32_t i = 0; i < all.size(); ++i) {
    if (r.deliver[i])
      keyed.emplace_back(2 * size_t{i}, OutputInfo{all[i].name, {}, {}, 0, i, false, {}});
  }
  for (const auto& [alias, target] : r.alias_target) {
    const TensorInfo* present = ckpt.Find(alias);
    const size_t key =
        present != nullptr ? 2 * static_cast<size_t>(present - all.data()) : 2 * size_t{target} + 1;
    keyed.emplace_back(key, OutputInfo{alias, {}, {}, 0, target, true, {}});
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<OutputInfo> out;
  out.reserve(keyed.size());
  for (auto& [key, o] : keyed) out.push_back(std::move(o));
  return out;
}

}  // namespace

Result<Description> DescribeSelection(const Checkpoint& ckpt, const Selection& selection,
                                      const TensorParallelOptions* tensor_parallel) {
  const auto& all = ckpt.tensors();
  Description d;
  if (tensor_parallel == nullptr || tensor_parallel->spec.ties().empty()) {
    TF_ASSIGN_OR_RETURN(d.read, selection.Resolve(ckpt));
    d.outputs.reserve(d.read.size());
    for (uint32_t i : d.read) d.outputs.push_back(OutputInfo{all[i].name, {}, {}, 0, i, false, {}});
  } else {
    TF_RETURN_IF_ERROR(CheckTies(ckpt, tensor_parallel->spec));
    TF_ASSIGN_OR_RETURN(Resolution r,
                        ResolveTied(ckpt, selection.by_name_ ? &selection.names_ : nullptr,
                                    selection.predicate_, tensor_parallel->spec));
    for (uint32_t i = 0; i < all.size(); ++i) {
      if (r.read[i]) d.read.push_back(i);
    }
    d.outputs = OrderOutputs(ckpt, r);
  }
  // Dtypes, local shapes and bytes: a tensor's slice under its own rule (an alias delivers its
  // target's slice).
  std::vector<std::optional<TensorSlice>> slices(all.size());
  for (uint32_t i : d.read) {
    const TensorInfo& t = all[i];
    const ShardRule rule = tensor_parallel ? tensor_parallel->spec.RuleFor(t.name) : ShardRule();
    if (rule.is_split()) {
      TF_ASSIGN_OR_RETURN(slices[i],
                          SliceOf(t, rule, tensor_parallel->rank, tensor_parallel->world));
    }
    d.bytes += slices[i] ? slices[i]->bytes : t.size;
  }
  for (OutputInfo& o : d.outputs) {
    const TensorInfo& t = all[o.tensor];
    o.dtype = t.dtype;
    o.slice = slices[o.tensor];
    o.shape = o.slice ? o.slice->shape : t.shape;
    o.bytes = o.slice ? o.slice->bytes : t.size;
  }
  return d;
}

}  // namespace tensorferry

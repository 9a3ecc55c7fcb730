#include "shard.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "errors.h"
#include "export.h"
#include "tensorferry/format.h"
#include "tensorferry/shard.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

// A rule as the JSON schema's dict: {"replicate": True} or {"split": dim[, "parts": [...] |
// "equal_parts": k][, "granule": g]}.
nb::dict RuleDict(const ShardRule& rule) {
  nb::dict d;
  if (!rule.is_split()) {
    d["replicate"] = true;
    return d;
  }
  d["split"] = rule.dim;
  if (!rule.parts.empty()) {
    d["parts"] = ShapeList(rule.parts);
  } else if (rule.equal_parts != 0) {
    d["equal_parts"] = rule.equal_parts;
  }
  if (rule.granule != 0) d["granule"] = rule.granule;
  return d;
}

// What rank `rank` of `world` holds of a tensor (name, dtype name, full shape) under `rule`:
// {"rule": dict, "dim": int or None, "blocks": [(start, length), ...], "shape": [...],
// "bytes": int}. With ranges=True also "ranges": [(offset, length), ...] relative to the tensor's
// first byte (SliceByteRanges).
nb::dict SliceDict(const ShardRule& rule, const std::string& name, const std::string& dtype,
                   const std::vector<uint64_t>& shape, uint32_t rank, uint32_t world, bool ranges) {
  TensorInfo t;
  t.name = name;
  const std::optional<DType> d = DTypeFromName(dtype);
  if (!d) throw StatusError(Status(Code::kInvalidArgument, "unknown dtype \"" + dtype + "\""));
  t.dtype = *d;
  t.shape = shape;
  t.size = Unwrap(TensorByteSize(t.dtype, t.shape));
  const TensorSlice slice = Unwrap(SliceOf(t, rule, rank, world));
  nb::dict out;
  out["rule"] = RuleDict(slice.rule);
  out["dim"] = slice.rule.is_split() ? nb::cast(slice.rule.dim) : nb::none();
  nb::list blocks;
  for (const auto& [start, length] : slice.blocks) blocks.append(nb::make_tuple(start, length));
  out["blocks"] = blocks;
  out["shape"] = ShapeList(slice.shape);
  out["bytes"] = slice.bytes;
  if (ranges) {
    nb::list r;
    for (const auto& [offset, length] : SliceByteRanges(t, slice)) {
      r.append(nb::make_tuple(offset, length));
    }
    out["ranges"] = r;
  }
  return out;
}

ShardRule RuleFromJson(const std::string& json) {
  // One override entry parsed by the spec's own parser: the same checks and messages.
  const ShardSpec spec = Unwrap(ShardSpec::FromJson("{\"overrides\":{\"rule\":" + json + "}}"));
  return spec.overrides().front().second;
}

}  // namespace

void RegisterShard(nb::module_& m) {
  nb::class_<ShardSpec>(m, "ShardSpec", "tensorferry::ShardSpec: tensor name -> shard rule")
      .def_static("none", &ShardSpec::None)
      .def_static("builtin", &ShardSpec::Builtin)
      .def_static("from_json",
                  [](const std::string& json) { return Unwrap(ShardSpec::FromJson(json)); })
      .def("to_json", &ShardSpec::ToJson)
      .def("rule_for",
           [](const ShardSpec& s, const std::string& name) { return RuleDict(s.RuleFor(name)); })
      .def("tie_target",
           [](const ShardSpec& s, const std::string& name) { return s.TieTarget(name); })
      .def("ties", [](const ShardSpec& s) { return s.ties(); })
      .def(
          "slice",
          [](const ShardSpec& s, const std::string& name, const std::string& dtype,
             const std::vector<uint64_t>& shape, uint32_t rank, uint32_t world, bool ranges) {
            return SliceDict(s.RuleFor(name), name, dtype, shape, rank, world, ranges);
          },
          nb::arg("name"), nb::arg("dtype"), nb::arg("shape"), nb::arg("rank"), nb::arg("world"),
          nb::arg("ranges") = false)
      .def("__eq__", [](const ShardSpec& a, const ShardSpec& b) { return a == b; })
      .def("__repr__", [](const ShardSpec& s) { return "ShardSpec(" + s.ToJson() + ")"; });
  m.def(
      "slice_of_rule",
      [](const std::string& rule_json, const std::string& name, const std::string& dtype,
         const std::vector<uint64_t>& shape, uint32_t rank, uint32_t world, bool ranges) {
        return SliceDict(RuleFromJson(rule_json), name, dtype, shape, rank, world, ranges);
      },
      nb::arg("rule_json"), nb::arg("name"), nb::arg("dtype"), nb::arg("shape"), nb::arg("rank"),
      nb::arg("world"), nb::arg("ranges") = false);
}

}  // namespace tensorferry::python

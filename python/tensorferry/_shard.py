"""Tensor parallelism: shard specifications and slices (tensorferry::ShardSpec, SliceOf;
include/tensorferry/shard.h). The slice of every tensor comes from the C++ library, so any
process (a cooperative loader, a test, a serving engine) computes exactly the slices the loader
reads."""
import dataclasses
import json
import os

from . import _core
from ._core import InvalidArgumentError, ShardSpec

_SCHEMA_KEYS = {"base", "rules", "overrides", "ties"}


def _rule(value, where):
    """A rule in the JSON schema's form from its Python forms: None or "replicate"; an int (split
    on that dim); a dict {"split": dim, "parts": [...] | "equal_parts": k} or {"replicate": True}."""
    if value is None or value == "replicate":
        return {"replicate": True}
    if isinstance(value, bool):
        raise InvalidArgumentError(f"shard rules: {where}: {value!r} is not a rule")
    if isinstance(value, int):
        return {"split": value}
    if isinstance(value, dict):
        return dict(value)
    raise InvalidArgumentError(
        f"shard rules: {where}: {value!r} is not a rule (None/\"replicate\", a dim, or a dict "
        f"such as {{\"split\": 0, \"parts\": [4096, 1024, 1024]}})")


def shard_spec(rules=None):
    """A ShardSpec from any of the shapes `shard_rules=` accepts (docs/python.md):

    - None or "builtin": ShardSpec.builtin() (what a Loader with tp_size and no shard_rules
      uses); "none": everything replicated;
    - a ShardSpec (returned as is);
    - a JSON string of the documented schema, or a path (str or os.PathLike) to such a file;
    - a dict of that schema ({"base", "rules", "overrides", "ties"}), or a dict {pattern: rule};
    - a list of (pattern, rule) pairs, first match wins.

    A rule is None/"replicate", an int (split on that dim) or a dict of the schema. Errors:
    InvalidArgumentError naming the entry."""
    if rules is None:
        return ShardSpec.builtin()
    if isinstance(rules, ShardSpec):
        return rules
    if isinstance(rules, str) and rules in ("none", "builtin"):
        return ShardSpec.builtin() if rules == "builtin" else ShardSpec.none()
    if isinstance(rules, str) and rules.lstrip().startswith("{"):
        return ShardSpec.from_json(rules)
    if isinstance(rules, (str, os.PathLike)):
        with open(rules, encoding="utf-8") as f:
            return ShardSpec.from_json(f.read())
    if isinstance(rules, dict):
        if rules and set(rules) <= _SCHEMA_KEYS:
            return ShardSpec.from_json(json.dumps(rules))
        pairs = list(rules.items())
    elif isinstance(rules, (list, tuple)):
        pairs = list(rules)
    else:
        raise InvalidArgumentError(f"shard rules: {rules!r} is not a spec")
    doc = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str):
            raise InvalidArgumentError(f"shard rules: rules[{i}]: {pair!r} is not (pattern, rule)")
        doc.append({"pattern": pair[0], **_rule(pair[1], f"rules[{i}]")})
    return ShardSpec.from_json(json.dumps({"rules": doc}))


@dataclasses.dataclass
class TensorSlice:
    """What one rank holds of a tensor (tensorferry::TensorSlice)."""
    name: str
    rule: dict  # {"replicate": True} or {"split": dim, ...}
    dim: int  # the split dimension, None when replicated
    blocks: list  # [(start, length)] along dim of the full tensor, in destination order
    shape: tuple  # the rank's local shape
    bytes: int
    ranges: list = None  # [(offset, length)] of the tensor's bytes, with ranges=True

    @property
    def replicated(self):
        return self.dim is None

    def index(self):
        """The slice as a tuple of Python indices: narrow a full tensor to this rank's part with
        torch.cat([full[idx] for idx in slice.index()], dim) (one index per block)."""
        if self.dim is None:
            return [tuple()]
        return [(slice(None),) * self.dim + (slice(s, s + n),) for s, n in self.blocks]


def tensor_slice(name, dtype, shape, rank, world, rules=None, *, ranges=False):
    """The slice of tensor `name` (a safetensors dtype name such as "BF16", and its full shape)
    that rank `rank` of `world` holds under `rules` (any shard_spec() form, or a ShardSpec; None:
    the built-in rules, as a Loader's).
    Uneven sizes follow torch.tensor_split / numpy.array_split. Errors: InvalidArgumentError
    (rank >= world, world 0, a split dim beyond the tensor, parts not summing to the dim, a part
    smaller than world)."""
    spec = shard_spec(rules)
    d = spec.slice(name, dtype, [int(x) for x in shape], rank, world, ranges)
    return TensorSlice(name=name, rule=d["rule"], dim=d["dim"],
                       blocks=[tuple(b) for b in d["blocks"]], shape=tuple(d["shape"]),
                       bytes=d["bytes"],
                       ranges=[tuple(r) for r in d["ranges"]] if ranges else None)


def rule_slice(rule, name, dtype, shape, rank, world, *, ranges=False):
    """As tensor_slice, for one rule given directly (any rule form of shard_spec)."""
    d = _core.slice_of_rule(json.dumps(_rule(rule, "rule")), name, dtype,
                            [int(x) for x in shape], rank, world, ranges)
    return TensorSlice(name=name, rule=d["rule"], dim=d["dim"],
                       blocks=[tuple(b) for b in d["blocks"]], shape=tuple(d["shape"]),
                       bytes=d["bytes"],
                       ranges=[tuple(r) for r in d["ranges"]] if ranges else None)

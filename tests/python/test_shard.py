"""Tensor parallelism from Python: shard specs in every accepted shape, and slices that equal
torch.tensor_split-based slicing of the full tensor."""
import json

import pytest
import torch
from conftest import reference_slice

import tensorferry
import tensorferry.torch
from tensorferry import InvalidArgumentError, ShardSpec, shard_spec, tensor_slice


def apply(full, s):
    if s.dim is None:
        return full
    return torch.cat([full[idx] for idx in s.index()], s.dim)


def via_ranges(full, s):
    raw = full.contiguous().view(torch.uint8).reshape(-1)
    pieces = [raw[o:o + n] for o, n in s.ranges]
    flat = torch.cat(pieces) if pieces else raw[:0]
    return flat.view(full.dtype).reshape(s.shape)


CASES = [
    ((13,), {"split": 0}),
    ((24, 8), {"split": 0}),
    ((9, 20), {"split": 1}),
    ((16, 10, 11), {"split": 2}),
    ((16, 10, 11), {"split": 1}),
    ((24, 6), {"split": 0, "parts": [16, 8]}),
    ((6, 30), {"split": 1, "equal_parts": 3}),
    ((8, 8), {"replicate": True}),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape,rule", CASES)
def test_slices_equal_tensor_split(shape, rule, world):
    n = 1
    for d in shape:
        n *= d
    full = torch.arange(n, dtype=torch.float32).reshape(shape).to(torch.bfloat16)
    spec = shard_spec([("w", rule)])
    for rank in range(world):
        try:
            want = reference_slice(full, rule, rank, world)
        except Exception:  # noqa: BLE001
            want = None
        parts = rule.get("parts") or ([shape[rule["split"]] // rule["equal_parts"]] * rule[
            "equal_parts"] if "equal_parts" in rule else [shape[rule.get("split", 0)]])
        if not rule.get("replicate") and min(parts) < world:
            with pytest.raises(InvalidArgumentError, match="fewer than the world size"):
                tensor_slice("w", "BF16", shape, rank, world, spec)
            continue
        s = tensor_slice("w", "BF16", shape, rank, world, spec, ranges=True)
        assert s.shape == tuple(want.shape)
        assert s.bytes == want.numel() * 2
        assert torch.equal(apply(full, s), want)
        assert torch.equal(via_ranges(full, s), want)


def test_spec_shapes():
    builtin = ShardSpec.builtin()
    assert shard_spec("builtin") == builtin
    assert shard_spec(None) == builtin  # what a Loader with tp_size and no shard_rules uses
    assert tensor_slice("model.layers.0.self_attn.o_proj.weight", "F32", (8, 8), 1, 2).shape \
        == (8, 4)
    assert shard_spec("none") == ShardSpec.none()
    assert shard_spec(builtin) is builtin
    assert shard_spec(builtin.to_json()) == builtin
    doc = {"rules": [{"pattern": "*.qkv.weight", "split": 0, "parts": [8, 4, 4]}],
           "overrides": {"head.weight": {"split": 1}},
           "ties": {"lm_head.weight": "embed.weight"},
           "base": "builtin"}
    spec = shard_spec(doc)
    assert spec.rule_for("a.qkv.weight") == {"split": 0, "parts": [8, 4, 4]}
    assert spec.rule_for("head.weight") == {"split": 1}
    assert spec.rule_for("model.layers.0.mlp.down_proj.weight") == {"split": 1}
    assert spec.tie_target("lm_head.weight") == "embed.weight"
    assert spec.ties() == [("lm_head.weight", "embed.weight")]
    pairs = shard_spec([("*.w", 0), ("*.b", None), ("*.c", {"split": 1, "equal_parts": 2})])
    assert pairs.rule_for("x.w") == {"split": 0}
    assert pairs.rule_for("x.b") == {"replicate": True}
    assert pairs.rule_for("x.c") == {"split": 1, "equal_parts": 2}
    assert pairs.rule_for("x.unknown") == {"replicate": True}
    assert shard_spec({"*.w": 1}).rule_for("a.w") == {"split": 1}
    assert json.loads(pairs.to_json())["rules"][0] == {"pattern": "*.w", "split": 0}


def test_spec_from_file(tmp_path):
    p = tmp_path / "rules.json"
    p.write_text(json.dumps({"rules": [{"pattern": "*", "split": 0}]}))
    assert shard_spec(p).rule_for("anything") == {"split": 0}
    assert shard_spec(str(p)).rule_for("anything") == {"split": 0}


def test_spec_errors():
    with pytest.raises(InvalidArgumentError, match=r"rules\[1\]"):
        shard_spec([("a", 0), ("b", "sideways")])
    with pytest.raises(InvalidArgumentError, match=r"rules\[0\]: \"split\" is a string"):
        shard_spec({"rules": [{"pattern": "a", "split": "0"}]})
    with pytest.raises(InvalidArgumentError, match="tie cycle"):
        shard_spec({"ties": {"a": "b", "b": "a"}})
    with pytest.raises(InvalidArgumentError, match="rank 2 of 2"):
        tensor_slice("w", "F32", (4, 4), 2, 2, [("w", 0)])
    with pytest.raises(InvalidArgumentError, match="split dimension 2"):
        tensor_slice("w", "F32", (4, 4), 0, 2, [("w", 2)])
    with pytest.raises(InvalidArgumentError, match="parts sum to 5"):
        tensor_slice("w", "F32", (4, 4), 0, 2, [("w", {"split": 0, "parts": [3, 2]})])


def test_rule_slice_and_builtin_names():
    s = tensorferry.rule_slice(1, "o", "F16", (4, 10), 3, 4)
    assert s.blocks == [(8, 2)] and s.shape == (4, 2) and s.dim == 1
    q = tensor_slice("model.layers.0.self_attn.q_proj.weight", "BF16", (4096, 4096), 1, 8,
                     "builtin")
    assert q.dim == 0 and q.blocks == [(512, 512)] and q.shape == (512, 4096)
    o = tensor_slice("model.layers.0.self_attn.o_proj.weight", "BF16", (4096, 4096), 1, 8,
                     "builtin")
    assert o.dim == 1 and o.shape == (4096, 512)
    n = tensor_slice("model.norm.weight", "BF16", (4096,), 5, 8, "builtin")
    assert n.replicated and n.shape == (4096,) and n.blocks == []


@pytest.fixture(scope="module")
def full_tensors(tiny_checkpoint):
    import os

    import safetensors.torch as ref_pt
    out = {}
    for shard in sorted(os.listdir(tiny_checkpoint)):
        if shard.endswith(".safetensors"):
            out.update(ref_pt.load_file(os.path.join(tiny_checkpoint, shard)))
    return out


@pytest.mark.parametrize("engine", ["pread", "mmap", "auto"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_loader_rank_equals_tensor_split(tiny_checkpoint, full_tensors, engine, world):
    spec = ShardSpec.builtin()
    total = sum(t.numel() * t.element_size() for t in full_tensors.values())
    split_bytes = sum(t.numel() * t.element_size() for n, t in full_tensors.items()
                      if "split" in spec.rule_for(n))
    for rank in range(world):
        with tensorferry.Loader(tiny_checkpoint, engine=engine, tp_rank=rank, tp_size=world,
                                shard_max_gap=0) as loader:
            got = loader.load()
            stats = loader.stats
            assert loader.total_bytes == sum(t.numel() * t.element_size() for t in got.values())
        assert set(got) == set(full_tensors)
        for name, full in full_tensors.items():
            want = reference_slice(full, spec.rule_for(name), rank, world)
            assert got[name].shape == want.shape, name
            assert torch.equal(got[name], want), name
        if engine == "pread":
            # Exact strides: the rank's share of the split tensors plus every replicated one.
            share = split_bytes / world + (total - split_bytes)
            assert stats.bytes_read <= share * 1.01 + 4096
            assert stats.bytes_read >= share * 0.9


def test_loader_custom_rules_and_ties(tiny_checkpoint, full_tensors):
    rules = {"rules": [{"pattern": "*.o_proj.weight", "split": 1}],
             "ties": {"lm_head.weight": "model.embed_tokens.weight"}}
    name = next(n for n in full_tensors if n.endswith("o_proj.weight"))
    with tensorferry.Loader(tiny_checkpoint, engine="pread", tp_rank=1,
                            tp_size=2, shard_rules=rules, shard_max_gap="1MiB") as loader:
        got = loader.load()
        opts = loader.options
    assert opts["tp_size"] == 2 and opts["shard_max_gap"] == 1 << 20
    assert torch.equal(got[name], torch.tensor_split(full_tensors[name], 2, 1)[1])
    # Everything else is replicated under these rules; lm_head is the embedding's data.
    emb = "model.embed_tokens.weight"
    if emb in full_tensors:
        assert torch.equal(got["lm_head.weight"], full_tensors[emb])
        assert got["lm_head.weight"].data_ptr() == got[emb].data_ptr()
    with pytest.raises(InvalidArgumentError, match="tp_rank 2 is not below"):
        tensorferry.Loader(tiny_checkpoint, tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgumentError):
        tensorferry.Loader(tiny_checkpoint, shard_rules="builtin")


def test_a_predicate_select_is_asked_of_tied_aliases_the_files_lack(tmp_path):
    # It was asked of the stored names only: the alias never came (select=None delivers it).
    path = str(tmp_path / "m.safetensors")
    g = torch.Generator().manual_seed(4)
    full = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "model.layers.0.w": torch.randn(4, 4, generator=g)}
    tensorferry.torch.save_file(full, path)
    rules = {"rules": [], "ties": {"lm_head.weight": "model.embed_tokens.weight"}}
    with tensorferry.Loader(path, tp_rank=0, tp_size=1, shard_rules=rules) as loader:
        everything = sorted(loader.keys())
    assert "lm_head.weight" in everything
    with tensorferry.Loader(path, tp_rank=0, tp_size=1, shard_rules=rules,
                            select=lambda n: n.startswith("lm_head")) as loader:
        assert loader.keys() == ["lm_head.weight"]
        only = loader.load()
    assert torch.equal(only["lm_head.weight"], full["model.embed_tokens.weight"])
    with tensorferry.Loader(path, tp_rank=0, tp_size=1, shard_rules=rules,
                            select=lambda n: True) as loader:
        assert sorted(loader.keys()) == everything
    # A tensor the rules cannot split for this world, left out by the predicate: not a failure
    # (describing every tensor to offer the aliases failed on it).
    odd = str(tmp_path / "odd.safetensors")
    tensorferry.torch.save_file({"a.weight": torch.ones(2, 4), "b.weight": torch.ones(8, 4)}, odd)
    split = {"rules": [{"pattern": "*", "split": 0}]}
    with tensorferry.Loader(odd, tp_rank=1, tp_size=4, shard_rules=split,
                            select=lambda n: n.startswith("b")) as loader:
        assert loader.keys() == ["b.weight"]
        assert loader.load()["b.weight"].shape == (2, 4)


def test_load_file_shards(tmp_path):
    import numpy as np

    import tensorferry.numpy
    import tensorferry.torch
    full = {"a.q_proj.weight": torch.arange(70, dtype=torch.float32).reshape(10, 7),
            "a.o_proj.weight": torch.arange(60, dtype=torch.float32).reshape(6, 10),
            "a.norm.weight": torch.arange(6, dtype=torch.float32)}
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file(full, path)
    for world in (2, 3):
        for rank in range(world):
            got = tensorferry.torch.load_file(path, tp_rank=rank, tp_size=world)
            assert torch.equal(got["a.q_proj.weight"],
                               torch.tensor_split(full["a.q_proj.weight"], world, 0)[rank])
            assert torch.equal(got["a.o_proj.weight"],
                               torch.tensor_split(full["a.o_proj.weight"], world, 1)[rank])
            assert torch.equal(got["a.norm.weight"], full["a.norm.weight"])
            arrays = tensorferry.numpy.load_file(path, tp_rank=rank, tp_size=world,
                                                 shard_rules=[("*", 0)])
            assert np.array_equal(arrays["a.o_proj.weight"],
                                  np.array_split(full["a.o_proj.weight"].numpy(), world, 0)[rank])


def test_tied_alias_absent_from_files(tmp_path):
    import subprocess

    from conftest import CLI
    out = str(tmp_path / "tied")
    r = subprocess.run([CLI, "gen", out, "--preset", "tiny", "--tie-embeddings", "--no-sync"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rules = {"base": "builtin", "ties": {"lm_head.weight": "model.embed_tokens.weight"}}
    for engine in ("pread", "mmap"):
        with tensorferry.Loader(out, engine=engine, tp_rank=1, tp_size=2,
                                shard_rules=rules) as loader:
            got = loader.load()
        emb = got["model.embed_tokens.weight"]
        assert "lm_head.weight" in got
        assert got["lm_head.weight"].data_ptr() == emb.data_ptr()
        assert torch.equal(got["lm_head.weight"], emb)
        # Selected by name: the alias stands for its target (read once, shared), as in C++.
        with tensorferry.Loader(out, engine=engine, tp_rank=1, tp_size=2, shard_rules=rules,
                                select=["lm_head.weight", "model.norm.weight"]) as loader:
            assert loader.total_bytes == emb.nbytes + got["model.norm.weight"].nbytes
            picked = loader.load()
        assert sorted(picked) == ["lm_head.weight", "model.norm.weight"]
        assert torch.equal(picked["lm_head.weight"], emb)


def _tied_checkpoint(tmp_path):
    """A checkpoint whose output head is tied to the embeddings and absent from the files
    (tie_word_embeddings), with rules splitting the embeddings on dim 0."""
    full = {"model.embed_tokens.weight": torch.arange(96, dtype=torch.float32).reshape(12, 8),
            "model.layers.0.o_proj.weight": torch.arange(48, dtype=torch.float32).reshape(6, 8),
            "model.norm.weight": torch.arange(8, dtype=torch.float32)}
    path = str(tmp_path / "tied.safetensors")
    tensorferry.torch.save_file(full, path)
    rules = {"rules": [{"pattern": "*embed_tokens.weight", "split": 0},
                       {"pattern": "*o_proj.weight", "split": 1}],
             "ties": {"lm_head.weight": "model.embed_tokens.weight"}}
    return path, full, rules


@pytest.mark.parametrize("engine", ["pread", "mmap"])
def test_tied_alias_through_every_edge(tmp_path, engine):
    """Issue 12: an alias the files lack, selected by name, goes through iter_tensors, load_into
    and progress=True as through load() (one Describe for every edge)."""
    import tensorferry.torch  # noqa: F401
    path, full, rules = _tied_checkpoint(tmp_path)
    want = torch.tensor_split(full["model.embed_tokens.weight"], 2, 0)[1]
    kw = dict(engine=engine, tp_rank=1, tp_size=2, shard_rules=rules)
    with tensorferry.Loader(path, select=["lm_head.weight"], **kw) as loader:
        assert loader.keys() == ["lm_head.weight"]
        assert len(loader) == 1
        assert loader.total_bytes == want.nbytes
        loaded = loader.load()
        streamed = dict(loader.iter_tensors())
        batches = [b.tensors for b in loader.iter_batches()]
    assert list(loaded) == ["lm_head.weight"] and torch.equal(loaded["lm_head.weight"], want)
    assert list(streamed) == ["lm_head.weight"] and torch.equal(streamed["lm_head.weight"], want)
    assert [list(b) for b in batches] == [["lm_head.weight"]]

    # progress=True (a callable here; True takes the same path with tqdm) over load() and
    # iter_tensors(): the alias is loaded and the progress reaches its total.
    seen = []
    with tensorferry.Loader(path, select=["lm_head.weight", "model.norm.weight"],
                            progress=lambda done, total: seen.append((done, total)), **kw) as loader:
        got = loader.load()
        assert list(got) == ["lm_head.weight", "model.norm.weight"]
        assert seen and seen[-1][0] == seen[-1][1] == want.nbytes + full["model.norm.weight"].nbytes
        seen.clear()
        assert sorted(dict(loader.iter_tensors())) == ["lm_head.weight", "model.norm.weight"]
        assert seen[-1][0] == seen[-1][1]
    assert torch.equal(got["lm_head.weight"], want)
    with tensorferry.Loader(path, progress=True, **kw) as loader:
        every = loader.load()
    # The absent alias right after its target, as without progress.
    assert list(every)[:2] == ["model.embed_tokens.weight", "lm_head.weight"]

    # load_into: the alias's destination receives its target's slice.
    dst = torch.full_like(want, -1.0)
    with tensorferry.Loader(path, **kw) as loader:
        loader.load_into({"lm_head.weight": dst})
    assert torch.equal(dst, want)
    with tensorferry.Loader(path, **kw) as loader:
        with pytest.raises(tensorferry.SafetensorError, match="does not contain tensor no.such"):
            loader.load_into({"no.such": torch.empty(1)})

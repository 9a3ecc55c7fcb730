"""tensorferry.torch.load_checkpoint_and_dispatch against accelerate's function of the same name,
with the real accelerate package: a small Llama-shaped model built on the meta device, loaded by
both; identical parameters and outputs; ties kept; dtype conversion; device maps from accelerate's
own placement; missing and unexpected tensors; tensor-parallel materialization whose column- and
row-parallel matmuls recombine to the full model's."""
import os
import subprocess

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate import init_empty_weights  # noqa: E402
from conftest import CLI  # noqa: E402

import tensorferry  # noqa: E402
import tensorferry.torch as tft  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 32, 48, 64, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=True)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = MLP()
        self.norm = nn.LayerNorm(HIDDEN)
        self.register_buffer("scale", torch.full((HIDDEN,), 0.5), persistent=False)

    def forward(self, x):
        a = self.self_attn
        h = self.norm(x)
        attn = torch.softmax(a.q_proj(h) @ a.k_proj(h).transpose(-1, -2) / HIDDEN ** 0.5, -1)
        x = x + a.o_proj(attn @ a.v_proj(h))
        return x + self.mlp(x) * self.scale


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.tie_weights()
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def tie_weights(self):
        """As transformers' tie_word_embeddings: init_empty_weights re-creates each parameter it
        registers, which unties them, so the tie is declared here and redone after."""
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def _reference(seed=0):
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():
        m.steps.copy_(torch.tensor([3, 1, 4]))
    return m


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The reference model saved as a sharded checkpoint (index + 2 files) and as one file; the
    tied lm_head.weight is not stored (save_model drops it, as transformers does)."""
    from safetensors.torch import save_model
    d = tmp_path_factory.mktemp("dispatch")
    ref = _reference()
    single = str(d / "model.safetensors")
    save_model(ref, single, metadata={"format": "pt"})
    sharded = d / "sharded"
    sharded.mkdir()
    r = subprocess.run([CLI, "reshard", single, str(sharded), "--max-shard-size", "20KB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) >= 2
    return {"single": single, "sharded": str(sharded), "ref": ref, "dir": d}


def _meta_model(tie=True):
    with init_empty_weights():
        m = Tiny()
    if tie:  # what transformers does after building on the meta device
        m.tie_weights()
    return m


def _assert_same_model(got, want, forward=True):
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert list(g) == list(w)
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert g[name].device == w[name].device, name
        assert torch.equal(g[name], w[name]), name
    for name, b in want.named_buffers():
        assert torch.equal(dict(got.named_buffers())[name], b), name
    if not forward:
        return
    ids = torch.arange(10).reshape(2, 5)
    with torch.no_grad():
        assert torch.equal(got(ids), want(ids))


@pytest.mark.parametrize("form", ["single", "sharded"])
@pytest.mark.parametrize("device_map", [None, "auto", "sequential", {"": "cpu"}, "cpu",
                                        {"embed_tokens": "cpu", "layers": "cpu", "lm_head": "cpu",
                                         "steps": "cpu"}])
def test_equals_accelerate(checkpoint, form, device_map):
    path = checkpoint[form]
    ours = tft.load_checkpoint_and_dispatch(_meta_model(), path, device_map=device_map)
    # accelerate takes no single device: the same placement as a dict.
    theirs = accelerate.load_checkpoint_and_dispatch(
        _meta_model(), path, device_map={"": "cpu"} if device_map in (None, "cpu") else device_map)
    _assert_same_model(ours, theirs)
    _assert_same_model(ours, checkpoint["ref"])
    # The tie is kept: one parameter, read once.
    assert ours.lm_head.weight is ours.embed_tokens.weight


def test_the_models_own_tie_declaration_is_applied(checkpoint):
    """A meta model whose tie was undone by init_empty_weights: tie_weights() is the model's own
    declaration, applied before the tensors are matched with the files."""
    m = _meta_model(tie=False)
    assert m.lm_head.weight is not m.embed_tokens.weight
    ours = tft.load_checkpoint_and_dispatch(m, checkpoint["single"])
    assert ours.lm_head.weight is ours.embed_tokens.weight
    _assert_same_model(ours, checkpoint["ref"])
    assert ours.layers[0].scale.device.type == "cpu"  # the non-persistent buffer, materialized


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "float16"])
def test_dtype_converts_floats_and_keeps_integers(checkpoint, dtype):
    ours = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["sharded"], device_map="cpu",
                                            dtype=dtype, budget="8KB")
    theirs = accelerate.load_checkpoint_and_dispatch(_meta_model(), checkpoint["sharded"],
                                                     device_map={"": "cpu"}, dtype=dtype)
    # No forward: the float32 non-persistent buffer mixes dtypes on the CPU (for both).
    _assert_same_model(ours, theirs, forward=False)
    assert ours.steps.dtype == torch.int64
    assert ours.layers[1].mlp.up_proj.weight.dtype == getattr(torch, str(dtype).split(".")[-1])


def test_materialized_model_is_filled_in_place_of_its_values(checkpoint):
    torch.manual_seed(123)
    model = Tiny()  # real, random weights
    tft.load_checkpoint_and_dispatch(model, checkpoint["single"])
    _assert_same_model(model, checkpoint["ref"])


def test_missing_tensor_is_an_error_naming_it_unless_initialised(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.1.mlp.up_proj.weight"]
    path = str(tmp_path / "missing.safetensors")
    save_file(sd, path)
    with pytest.raises(tensorferry.InvalidArgumentError, match="layers.1.mlp.up_proj.weight"):
        tft.load_checkpoint_and_dispatch(_meta_model(), path)

    seen = []

    def fill(name, tensor):
        seen.append(name)
        tensor.fill_(0.25)

    m = tft.load_checkpoint_and_dispatch(_meta_model(), path, init_missing=fill)
    assert seen == ["layers.1.mlp.up_proj.weight"]
    assert torch.all(m.layers[1].mlp.up_proj.weight == 0.25)
    assert torch.equal(m.layers[1].mlp.gate_proj.weight, checkpoint["ref"].layers[1].mlp.gate_proj.weight)

    with pytest.raises(tensorferry.InvalidArgumentError, match=r"\(Linear\) has no init_fn"):
        tft.load_checkpoint_and_dispatch(_meta_model(), path, init_missing="init_fn")


def test_reset_parameters_initialises_before_the_reads(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.0.norm.weight"]  # LayerNorm.reset_parameters sets weight 1, bias 0
    path = str(tmp_path / "norm.safetensors")
    save_file(sd, path)
    m = tft.load_checkpoint_and_dispatch(_meta_model(), path, init_missing="reset_parameters")
    assert torch.all(m.layers[0].norm.weight == 1.0)
    # The bias is the file's, not reset_parameters' zeros.
    assert torch.equal(m.layers[0].norm.bias, checkpoint["ref"].layers[0].norm.bias)


def test_dtype_rule_is_accelerates_for_integers_and_booleans(tmp_path):
    """accelerate's set_module_tensor_to_device: without dtype, every value takes the model
    tensor's dtype (a U8 mask into a bool buffer, I32 counts into an int64 one); with dtype,
    values stored as integers or booleans keep the file's and the others take dtype."""
    from safetensors.torch import save_file

    class Masks(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))
            self.register_buffer("flags", torch.zeros(2, dtype=torch.bool))
            self.register_buffer("counts", torch.zeros(2, dtype=torch.int64))

    path = str(tmp_path / "masks.safetensors")
    save_file({"w": torch.arange(4, dtype=torch.bfloat16),
               "flags": torch.tensor([0, 1], dtype=torch.uint8),
               "counts": torch.tensor([7, 2**31 - 1], dtype=torch.int32)}, path,
              metadata={"format": "pt"})
    for dtype in (None, torch.float16):
        def meta():
            with init_empty_weights():
                return Masks()
        ours = tft.load_checkpoint_and_dispatch(meta(), path, device_map="cpu", dtype=dtype)
        theirs = accelerate.load_checkpoint_and_dispatch(meta(), path, device_map={"": "cpu"},
                                                         dtype=dtype)
        for name in ("w", "flags", "counts"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (dtype, name, a, b)
        if dtype is None:
            assert ours.flags.dtype == torch.bool and torch.equal(~ours.flags,
                                                                 torch.tensor([True, False]))


def test_parameters_keep_their_class_and_a_materialized_model_its_objects(checkpoint, tmp_path):
    """A torch.nn.Parameter subclass stays one (as accelerate keeps it); with no device map, a
    materialized model's parameters are filled in place: references held elsewhere (an
    optimizer's) see the loaded values."""
    class Tagged(nn.Parameter):
        pass

    m = _meta_model()
    m.layers[0].mlp.up_proj.weight = Tagged(m.layers[0].mlp.up_proj.weight)
    ours = tft.load_checkpoint_and_dispatch(m, checkpoint["single"], device_map="cpu")
    assert type(ours.layers[0].mlp.up_proj.weight) is Tagged
    _assert_same_model(ours, checkpoint["ref"])

    torch.manual_seed(5)
    model = Tiny()
    # A non-contiguous parameter (a transposed view) too: filled in place, strides kept.
    down = model.layers[0].mlp.down_proj
    down.weight = nn.Parameter(down.weight.detach().t().contiguous().t())
    assert not down.weight.is_contiguous()
    strides = down.weight.stride()
    held = dict(model.named_parameters())
    tft.load_checkpoint_and_dispatch(model, checkpoint["sharded"])
    for name, p in model.named_parameters():
        assert p is held[name], name
    assert down.weight.stride() == strides
    # The reference with the same layout: a matmul over a transposed weight may sum in another
    # order (it does with AVX-512 here), so the logits of differently laid out weights differ.
    import copy
    ref = copy.deepcopy(checkpoint["ref"])
    ref_down = ref.layers[0].mlp.down_proj
    ref_down.weight = nn.Parameter(ref_down.weight.detach().t().contiguous().t())
    _assert_same_model(model, ref)
    # A buffer whose elements share memory (expand()ed) cannot be filled: it is replaced, and
    # the rest still filled in place.
    torch.manual_seed(5)
    model = Tiny()
    model.register_buffer("pos", torch.arange(8.0).expand(2, -1))
    weight = model.layers[0].mlp.up_proj.weight
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    sd["pos"] = torch.ones(2, 8)
    path = str(tmp_path / "with-pos.safetensors")
    save_file(sd, path)
    tft.load_checkpoint_and_dispatch(model, path)
    assert torch.equal(model.pos, torch.ones(2, 8))
    assert model.layers[0].mlp.up_proj.weight is weight
    _assert_same_model(model, checkpoint["ref"])


def test_accelerates_state_dict_options_and_a_model_of_dtensors(checkpoint):
    """full_state_dict and broadcast_from_rank0 (what accelerate passes to torch's
    set_model_state_dict): a model of plain tensors loads whole with any of them (each rank
    reads); a model holding DTensors is an error naming one."""
    for kw in ({}, {"full_state_dict": False}, {"broadcast_from_rank0": True}):
        m = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"],
                                             device_map="cpu", **kw)
        _assert_same_model(m, checkpoint["ref"])
    dist_tensor = pytest.importorskip("torch.distributed.tensor")

    class Sharded(nn.Parameter):  # stands for DTensor (a real one needs a process group)
        pass

    model = _meta_model()
    model.layers[0].mlp.up_proj.weight = Sharded(model.layers[0].mlp.up_proj.weight)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist_tensor, "DTensor", Sharded)
        with pytest.raises(tensorferry.InvalidArgumentError,
                           match=r"layers.0.mlp.up_proj.weight: a DTensor"):
            tft.load_checkpoint_and_dispatch(model, checkpoint["single"])


def test_unexpected_and_mismatched_tensors(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    sd["extra.weight"] = torch.zeros(2)
    path = str(tmp_path / "extra.safetensors")
    save_file(sd, path)
    with pytest.raises(tensorferry.InvalidArgumentError, match="extra.weight"):
        tft.load_checkpoint_and_dispatch(_meta_model(), path)
    with pytest.warns(UserWarning, match="extra.weight"):
        m = tft.load_checkpoint_and_dispatch(_meta_model(), path, strict=False)
    _assert_same_model(m, checkpoint["ref"])

    sd = load_file(checkpoint["single"])
    sd["layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER + 1)
    path = str(tmp_path / "shape.safetensors")
    save_file(sd, path)
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match=r"size mismatch for layers.0.mlp.down_proj.weight.*\[32, 49\]"):
        tft.load_checkpoint_and_dispatch(_meta_model(), path)
    # With tensor parallelism too: the model's full shape against the stored one (the rank's
    # slice would otherwise be cut from the wrong tensor).
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match=r"size mismatch for layers.0.mlp.down_proj.weight.*\[32, 49\]"
                             r".*rank 1's slice"):
        tft.load_checkpoint_and_dispatch(_meta_model(), path, tp_rank=1, tp_size=2)


def test_disk_offload_is_refused_naming_it(checkpoint, tmp_path):
    with pytest.raises(tensorferry.InvalidArgumentError, match="disk"):
        tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"],
                                         device_map={"": "disk"}, offload_folder=str(tmp_path))
    # Without "disk" in the map, offload_folder is unused, as accelerate's is.
    m = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"], device_map="auto",
                                         offload_folder=str(tmp_path))
    _assert_same_model(m, checkpoint["ref"])
    assert os.listdir(tmp_path) == []


def test_a_folder_means_its_model_safetensors_first(checkpoint, tmp_path):
    """As accelerate and transformers: a folder's model.safetensors wins over a stale index and
    the shards beside it; without it, the folder's one index."""
    from safetensors.torch import save_file
    folder = tmp_path / "m"
    folder.mkdir()
    with open(checkpoint["single"], "rb") as f:
        (folder / "model.safetensors").write_bytes(f.read())
    stale = {n: torch.zeros_like(t) for n, t in checkpoint["ref"].state_dict().items()
             if n != "lm_head.weight"}
    save_file(stale, str(folder / "old-1.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {%s}}' % ", ".join(f'"{n}": "old-1.safetensors"'
                                                          for n in stale))
    _assert_same_model(tft.load_checkpoint_and_dispatch(_meta_model(), str(folder)),
                       checkpoint["ref"])
    (folder / "model.safetensors").unlink()
    got = tft.load_checkpoint_and_dispatch(_meta_model(), str(folder))
    assert torch.all(got.layers[0].mlp.up_proj.weight == 0)  # what the index names
    _assert_same_model(tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["sharded"]),
                       checkpoint["ref"])


def test_strict_false_keeps_the_values_of_a_materialized_model(checkpoint, tmp_path):
    """strict=False: tensors the files lack keep a materialized model's values, with a warning
    naming them (torch's and accelerate's behaviour); on the meta device they stay an error."""
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.1.norm.weight"]
    path = str(tmp_path / "nonorm.safetensors")
    save_file(sd, path, metadata={"format": "pt"})
    model = _reference(seed=5)
    own = model.layers[1].norm.weight.detach().clone()
    for device_map in (None, {"": "cpu"}):
        with pytest.warns(UserWarning, match=r"1 tensor\(s\) .* keep the model's values: "
                                             r"layers.1.norm.weight"):
            got = tft.load_checkpoint_and_dispatch(model, path, device_map=device_map,
                                                   strict=False)
        assert torch.equal(got.layers[1].norm.weight, own)
        assert torch.equal(got.layers[0].norm.weight, checkpoint["ref"].layers[0].norm.weight)
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match=r"1 tensor\(s\) are not in .* on the meta device: "
                             r"layers.1.norm.weight"):
        tft.load_checkpoint_and_dispatch(_meta_model(), path, strict=False)
    with pytest.raises(tensorferry.InvalidArgumentError, match="Missing key"):
        tft.load_checkpoint_and_dispatch(_reference(seed=5), path)  # strict=True


def test_a_dict_map_need_not_place_non_persistent_buffers(checkpoint):
    """Buffers outside state dicts (no file holds them) stay where they are when a dict device
    map names no prefix of them, as accelerate leaves them."""
    device_map = {"embed_tokens": "cpu", "lm_head": "cpu", "steps": "cpu"}
    device_map.update({f"layers.{i}.{part}": "cpu" for i in range(LAYERS)
                       for part in ("self_attn", "mlp", "norm")})  # not layers.i.scale
    m = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"],
                                         device_map=device_map)
    _assert_same_model(m, checkpoint["ref"])


def test_tensor_parallel_strict_false_slices_the_models_own_values(checkpoint, tmp_path):
    """A materialized model at the full shapes, strict=False and tensor parallelism: a tensor the
    files lack becomes the rank's slice of the model's own values, never uninitialised memory."""
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.0.self_attn.q_proj.weight"]  # column parallel: dim 0
    del sd["layers.0.self_attn.o_proj.weight"]  # row parallel: dim 1
    path = str(tmp_path / "noq.safetensors")
    save_file(sd, path, metadata={"format": "pt"})
    model = _reference(seed=9)
    q = model.layers[0].self_attn.q_proj.weight.detach().clone()
    o = model.layers[0].self_attn.o_proj.weight.detach().clone()
    with pytest.warns(UserWarning, match="keep the model's values"):
        got = tft.load_checkpoint_and_dispatch(model, path, tp_rank=1, tp_size=2, strict=False)
    attn = got.layers[0].self_attn
    assert torch.equal(attn.q_proj.weight, torch.tensor_split(q, 2, 0)[1])
    assert torch.equal(attn.o_proj.weight, torch.tensor_split(o, 2, 1)[1])
    assert torch.equal(attn.k_proj.weight,
                       torch.tensor_split(checkpoint["ref"].layers[0].self_attn.k_proj.weight,
                                          2, 0)[1])


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_materialization_recombines_to_the_full_layers(checkpoint, world):
    """Each rank's parameters have rank-local shapes; column-parallel outputs concatenate and
    row-parallel partial products sum to the full model's layer outputs."""
    full = checkpoint["ref"]
    ranks = [tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["sharded"], tp_rank=r,
                                              tp_size=world) for r in range(world)]
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7))
    for i in range(LAYERS):
        fa, fm = full.layers[i].self_attn, full.layers[i].mlp
        parts = [m.layers[i] for m in ranks]
        assert parts[0].self_attn.q_proj.weight.shape == (HIDDEN // world, HIDDEN)
        assert parts[0].self_attn.o_proj.weight.shape == (HIDDEN, HIDDEN // world)
        assert parts[0].self_attn.o_proj.bias.shape == (HIDDEN,)  # replicated
        with torch.no_grad():
            for proj in ("q_proj", "k_proj", "v_proj"):
                got = torch.cat([getattr(p.self_attn, proj)(x) for p in parts], -1)
                assert torch.allclose(got, getattr(fa, proj)(x), atol=1e-6), proj
            # Row parallel: each rank multiplies its slice of the input; the sum is the full
            # product, and the bias is added once.
            h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(i))
            pieces = torch.tensor_split(h, world, -1)
            partial = sum(p.self_attn.o_proj.weight @ s.T for p, s in zip(parts, pieces)).T
            assert torch.allclose(partial + fa.o_proj.bias, fa.o_proj(h), atol=1e-5)
            # The whole MLP: gate/up column parallel, down row parallel.
            mlp = sum(p.mlp(x) for p in parts)
            assert torch.allclose(mlp, fm(x), atol=1e-5)
    # Vocab-parallel embedding, tied to the vocab-parallel lm_head: still one parameter.
    assert ranks[1].embed_tokens.weight.shape == (VOCAB // world, HIDDEN)
    assert ranks[1].lm_head.weight is ranks[1].embed_tokens.weight
    assert torch.equal(ranks[1].embed_tokens.weight,
                       torch.tensor_split(full.embed_tokens.weight, world, 0)[1])


def test_host_parameters_are_writable_without_touching_the_file(checkpoint):
    """Host tensors that keep the file's dtype are copy-on-write views of the file's mapping:
    writing them changes the model, never the file."""
    with open(checkpoint["single"], "rb") as f:
        before = f.read()
    m = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"], device_map="cpu")
    with torch.no_grad():
        m.layers[0].mlp.up_proj.weight.mul_(2)
        m.embed_tokens.weight.zero_()
    assert torch.equal(m.layers[0].mlp.up_proj.weight,
                       checkpoint["ref"].layers[0].mlp.up_proj.weight * 2)
    assert torch.all(m.lm_head.weight == 0)  # still tied
    with open(checkpoint["single"], "rb") as f:
        assert f.read() == before
    again = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"])
    _assert_same_model(again, checkpoint["ref"])


@pytest.mark.parametrize("device_map", ["sequential", "auto", "balanced"])
def test_device_map_strategies_place_the_tied_model(checkpoint, device_map):
    """The model's tie_weights() comes before accelerate's placement: a model whose tie was undone
    by init_empty_weights is placed as the tied model it is (the tied tensor counted once, its
    names on one device). max_memory fits the tied model and not the untied one, whose map would
    spill to 'disk'."""
    from accelerate.utils import compute_module_sizes
    untied = compute_module_sizes(_meta_model(tie=False))[""]
    tied = compute_module_sizes(_meta_model(tie=True))[""]
    assert tied < untied
    max_memory = {"cpu": (tied + untied) // 2}
    m = _meta_model(tie=False)
    ours = tft.load_checkpoint_and_dispatch(m, checkpoint["single"], device_map=device_map,
                                            max_memory=max_memory)
    assert ours.hf_device_map == {"": "cpu"}
    assert ours.lm_head.weight is ours.embed_tokens.weight
    _assert_same_model(ours, checkpoint["ref"])


def test_tensor_parallel_missing_tensors_get_the_rank_local_shape(checkpoint, tmp_path):
    """init_missing's tensors are allocated at the rank-local shape of their slice under the shard
    rules, as the loaded ones; a model built at rank-local shapes keeps its own shape for them."""
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.0.self_attn.q_proj.weight"]  # column parallel: split on dim 0
    del sd["layers.0.self_attn.o_proj.weight"]  # row parallel: split on dim 1
    path = str(tmp_path / "noq.safetensors")
    save_file(sd, path, metadata={"format": "pt"})
    seen = {}

    def fill(name, tensor):
        seen[name] = tuple(tensor.shape)
        tensor.fill_(0.5)

    m = tft.load_checkpoint_and_dispatch(_meta_model(), path, tp_rank=1, tp_size=2,
                                         init_missing=fill)
    attn = m.layers[0].self_attn
    assert seen == {"layers.0.self_attn.q_proj.weight": (HIDDEN // 2, HIDDEN),
                    "layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN // 2)}
    assert attn.q_proj.weight.shape == m.layers[1].self_attn.q_proj.weight.shape
    assert attn.o_proj.weight.shape == m.layers[1].self_attn.o_proj.weight.shape
    assert torch.all(attn.q_proj.weight == 0.5) and torch.all(attn.o_proj.weight == 0.5)
    assert torch.equal(attn.k_proj.weight,
                       torch.tensor_split(checkpoint["ref"].layers[0].self_attn.k_proj.weight,
                                          2, 0)[1])

    # A model already at the rank-local shapes: its missing tensors are not cut again.
    local = _meta_model()
    for layer in local.layers:
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, proj).weight = nn.Parameter(
                torch.empty(HIDDEN // 2, HIDDEN, device="meta"))
        layer.self_attn.o_proj.weight = nn.Parameter(torch.empty(HIDDEN, HIDDEN // 2,
                                                                 device="meta"))
        for proj, shape in (("gate_proj", (INTER // 2, HIDDEN)), ("up_proj", (INTER // 2, HIDDEN)),
                            ("down_proj", (HIDDEN, INTER // 2))):
            getattr(layer.mlp, proj).weight = nn.Parameter(torch.empty(shape, device="meta"))
    local.embed_tokens.weight = nn.Parameter(torch.empty(VOCAB // 2, HIDDEN, device="meta"))
    local.tie_weights()
    seen.clear()
    m = tft.load_checkpoint_and_dispatch(local, path, tp_rank=1, tp_size=2, init_missing=fill)
    assert seen == {"layers.0.self_attn.q_proj.weight": (HIDDEN // 2, HIDDEN),
                    "layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN // 2)}


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"),
                    reason="this torch has no float4_e2m1fn_x2 (F4 tensors)")
def test_float4_tensors_have_torchs_packed_shape(tmp_path):
    """An F4 header counts 4-bit values ([2, 8]); torch's float4_e2m1fn_x2 counts packed pairs
    ([2, 4]): the shape checks and allocations use torch's, and the bytes are the file's. With
    tensor parallelism too, for loaded and init_missing tensors."""
    f4 = torch.float4_e2m1fn_x2
    packed = torch.arange(8, dtype=torch.uint8).view(f4).reshape(2, 4)
    path = str(tmp_path / "f4.safetensors")
    tensorferry.torch.save_file({"w": packed, "x": torch.arange(4.0)}, path)
    with tensorferry.safe_open(path, "pt") as f:
        assert f.get_slice("w").get_shape() == [2, 8]

    class M(nn.Module):
        def __init__(self, missing=False):
            super().__init__()
            self.register_buffer("w", torch.zeros(8, dtype=torch.uint8).view(f4).reshape(2, 4))
            if missing:
                self.register_buffer("v",
                                     torch.zeros(8, dtype=torch.uint8).view(f4).reshape(2, 4))
            self.x = nn.Parameter(torch.zeros(4))

    for device_map in (None, "cpu", {"": "cpu"}):
        for model in (M(), _on_meta(M)):
            m = tft.load_checkpoint_and_dispatch(model, path, device_map=device_map)
            assert m.w.dtype == f4 and tuple(m.w.shape) == (2, 4), device_map
            assert torch.equal(m.w.view(torch.uint8), packed.view(torch.uint8)), device_map
            assert torch.equal(m.x, torch.arange(4.0))

    # The model's full torch shape (2, 4) is the file's [2, 8]; rank 1 holds the second row.
    m = tft.load_checkpoint_and_dispatch(_on_meta(M, missing=True), path, tp_rank=1, tp_size=2,
                                         shard_rules={"w": 0, "v": 0},
                                         init_missing=lambda name, t: t.view(torch.uint8).fill_(9))
    assert tuple(m.w.shape) == (1, 4) and tuple(m.v.shape) == (1, 4)
    assert torch.equal(m.w.view(torch.uint8), packed.view(torch.uint8)[1:])
    assert torch.all(m.v.view(torch.uint8) == 9)


def _on_meta(cls, *args, **kwargs):
    with init_empty_weights(include_buffers=True):
        return cls(*args, **kwargs)


def test_a_materialized_models_missing_tensors_keep_their_values(checkpoint, tmp_path):
    """A tensor the files lack starts from the model's own values (accelerate keeps them), not
    from uninitialised memory, whatever init_missing then does to it."""
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.1.mlp.up_proj.weight"]
    path = str(tmp_path / "missing.safetensors")
    save_file(sd, path)
    for device_map, dtype in [(None, None), ("cpu", None), (None, torch.float64)]:
        torch.manual_seed(5)
        model = Tiny()
        before = model.layers[1].mlp.up_proj.weight.detach().clone()
        with pytest.raises(tensorferry.InvalidArgumentError, match="keep their values"):
            tft.load_checkpoint_and_dispatch(model, path, device_map=device_map, dtype=dtype)
        m = tft.load_checkpoint_and_dispatch(model, path, device_map=device_map, dtype=dtype,
                                             init_missing=lambda name, tensor: None)
        kept = m.layers[1].mlp.up_proj.weight
        # Its dtype too: accelerate leaves the tensors the files lack as they are.
        assert kept.dtype == before.dtype and torch.equal(kept, before), (device_map, dtype)
        got = m.layers[1].mlp.gate_proj.weight
        want = checkpoint["ref"].layers[1].mlp.gate_proj.weight
        assert torch.equal(got.to(want.dtype), want), (device_map, dtype)


def test_tensor_parallel_refuses_to_cut_attention_heads(tmp_path):
    """With a transformers model, a tp_size that does not divide its attention or key/value head
    count is refused before anything is read, naming the tensor and the count: a contiguous
    split would hand a rank part of a head (vLLM replicates key/value heads there instead).
    shard_rules that replicate those projections, or a tp_size dividing the counts, load."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    full = LlamaForCausalLM(config)
    path = str(tmp_path / "llama.safetensors")
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, path,
              metadata={"format": "pt"})

    def meta():
        with init_empty_weights():
            return LlamaForCausalLM(config)

    k_proj = "model.layers.0.self_attn.k_proj.weight"
    for world in (3, 4):  # 2 key/value heads: neither splits them whole
        with pytest.raises(tensorferry.InvalidArgumentError) as refused:
            tft.load_checkpoint_and_dispatch(meta(), path, tp_rank=0, tp_size=world)
        text = str(refused.value)
        assert f"tp_size={world}: {k_proj} holds 2 key/value heads" in text, text
        assert "LlamaForCausalLM" in text and "replicate k_proj" in text, text
    # Two ranks: one key/value head and two attention heads each.
    m = tft.load_checkpoint_and_dispatch(meta(), path, tp_rank=1, tp_size=2)
    head_dim = 64 // 4
    assert m.get_parameter(k_proj).shape == (head_dim, 64)
    assert torch.equal(m.get_parameter(k_proj), full.get_parameter(k_proj)[head_dim:])
    # Four ranks with the key/value projections replicated: every rank holds both kv heads and
    # one attention head.
    rules = {"base": "builtin", "rules": [{"pattern": "*.k_proj.weight", "replicate": True},
                                          {"pattern": "*.v_proj.weight", "replicate": True}]}
    m = tft.load_checkpoint_and_dispatch(meta(), path, tp_rank=3, tp_size=4, shard_rules=rules)
    assert torch.equal(m.get_parameter(k_proj), full.get_parameter(k_proj))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(m.get_parameter(q_proj), full.get_parameter(q_proj)[3 * head_dim:])


def test_dispatch_arguments_reach_dispatch_model_and_parameter_attributes_stay(checkpoint):
    """accelerate's dispatch-only arguments are passed to its dispatch_model (force_hooks puts
    hooks on a one-device map, as accelerate's function does); attributes set on the model's
    parameters (transformers' _is_hf_initialized, an engine's weight_loader) survive the
    replacement of the parameter."""
    import accelerate
    for load in (tft.load_checkpoint_and_dispatch, accelerate.load_checkpoint_and_dispatch):
        m = _meta_model()
        m.layers[0].mlp.up_proj.weight._is_hf_initialized = True
        m.layers[0].mlp.up_proj.weight.weight_loader = print
        got = load(m, checkpoint["single"], device_map={"": "cpu"}, force_hooks=True,
                   skip_keys=["steps"], preload_module_classes=["MLP"], offload_buffers=False,
                   offload_state_dict=False)
        assert hasattr(got, "_hf_hook"), load
        weight = got.layers[0].mlp.up_proj.weight
        assert getattr(weight, "_is_hf_initialized", None) is True, load
        if load is tft.load_checkpoint_and_dispatch:
            assert weight.weight_loader is print
        _assert_same_model(got, checkpoint["ref"])


def test_a_refused_load_leaves_the_model_as_it_was(checkpoint, tmp_path):
    """Every refusal comes before the model is changed: an init_missing its modules cannot run
    and a non-persistent buffer on the meta device leave every parameter object in place."""
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoint["single"])
    del sd["layers.1.mlp.up_proj.weight"]
    path = str(tmp_path / "missing.safetensors")
    save_file(sd, path)

    def objects(model):
        return {n: id(t) for n, t in list(model.named_parameters()) + list(model.named_buffers())}

    for init_missing, match in (("init_fn", r"\(Linear\) has no init_fn"),
                                ("reset", r"init_missing: 'reset': a callable")):
        for model in (_meta_model(), _reference(seed=3)):
            before = objects(model)
            values = {n: t.detach().clone() for n, t in model.state_dict().items()
                      if t.device.type != "meta"}
            with pytest.raises(tensorferry.InvalidArgumentError, match=match):
                tft.load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"},
                                                 init_missing=init_missing)
            assert objects(model) == before
            for n, v in values.items():
                assert torch.equal(model.state_dict()[n], v), n

    model = _on_meta(Tiny)  # its non-persistent buffers on the meta device too
    model.tie_weights()
    before = objects(model)
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match=r"layers.0.scale: a non-persistent buffer on the meta device"):
        tft.load_checkpoint_and_dispatch(model, checkpoint["single"], device_map={"": "cpu"})
    assert objects(model) == before
    assert all(p.device.type == "meta" for p in model.parameters())


def test_converting_reads_are_bounded_by_default(checkpoint, monkeypatch):
    """Without a budget, the reads that change dtype stream under the default budget (twice the
    largest tensor converted when that is more), not the whole checkpoint in one batch."""
    import tensorferry._dispatch as dispatch
    seen = []
    real = dispatch.Loader

    class Spy(real):
        def iter_batches(self, *args, **kwargs):
            for batch in super().iter_batches(*args, **kwargs):
                seen.append(sum(t.numel() * t.element_size() for t in batch.tensors.values()))
                yield batch

    monkeypatch.setattr(dispatch, "Loader", Spy)
    monkeypatch.setattr(dispatch, "_CONVERT_BUDGET", 1024)
    largest = VOCAB * HIDDEN * 4  # the embedding, float32 in the file
    m = tft.load_checkpoint_and_dispatch(_meta_model(), checkpoint["single"], dtype=torch.float64)
    assert len(seen) > 1 and max(seen) <= 2 * largest, seen
    for name, p in checkpoint["ref"].named_parameters():
        assert m.get_parameter(name).dtype == torch.float64, name
        assert torch.equal(m.get_parameter(name), p.double()), name


def _fused_qkv_checkpoint(tmp_path, model):
    from safetensors.torch import save_file
    path = str(tmp_path / f"{type(model).__name__}.safetensors")
    save_file({k: v.clone() for k, v in model.state_dict().items()}, path,  # (tied: copies)
              metadata={"format": "pt"})
    return path


def test_tensor_parallel_refuses_to_cut_fused_qkv_heads(tmp_path):
    """GPT-NeoX and BLOOM interleave q, k and v per head in query_key_value, Falcon's new
    decoder architecture per key/value group: a tp_size that does not divide that count is
    refused naming the first tensor it would cut, the attention output (dense) or
    query_key_value (and a dividing one loads whole heads); Falcon's multi_query
    layout, all query heads then one key and one value head, is refused for any tp_size."""
    transformers = pytest.importorskip("transformers")
    from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM,
                              GPTNeoXConfig, GPTNeoXForCausalLM)
    cases = [
        (GPTNeoXForCausalLM, GPTNeoXConfig(hidden_size=64, intermediate_size=96,
                                           num_hidden_layers=1, num_attention_heads=4,
                                           vocab_size=128),
         3, "gpt_neox.layers.0.attention.dense.weight", 4, "attention heads"),
        (BloomForCausalLM, BloomConfig(hidden_size=64, n_layer=1, n_head=4, vocab_size=128),
         3, "transformer.h.0.self_attention.dense.weight", 4, "attention heads"),
        (FalconForCausalLM, FalconConfig(hidden_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_kv_heads=2,
                                         new_decoder_architecture=True, vocab_size=128),
         4, "transformer.h.0.self_attention.query_key_value.weight", 2, "key/value groups"),
    ]
    for cls, config, world, name, count, what in cases:
        torch.manual_seed(0)
        full = cls(config)
        path = _fused_qkv_checkpoint(tmp_path, full)

        def meta():
            with init_empty_weights():
                return cls(config)

        with pytest.raises(tensorferry.InvalidArgumentError) as refused:
            tft.load_checkpoint_and_dispatch(meta(), path, tp_rank=0, tp_size=world,
                                             strict=False)
        assert f"tp_size={world}: {name} holds {count} {what}" in str(refused.value), \
            refused.value
        m = tft.load_checkpoint_and_dispatch(meta(), path, tp_rank=1, tp_size=2, strict=False)
        qkv = name.replace("dense", "query_key_value")
        rows = full.get_parameter(qkv).shape[0] // 2
        assert torch.equal(m.get_parameter(qkv), full.get_parameter(qkv)[rows:]), cls

    config = FalconConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                          multi_query=True, new_decoder_architecture=False, vocab_size=128)
    path = _fused_qkv_checkpoint(tmp_path, FalconForCausalLM(config))
    with init_empty_weights():
        model = FalconForCausalLM(config)
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match=r"tp_size=2: transformer.h.0.self_attention.query_key_value.weight "
                             r"of FalconForCausalLM \(multi_query\) holds all its query heads"):
        tft.load_checkpoint_and_dispatch(model, path, tp_rank=0, tp_size=2, strict=False)


@pytest.mark.parametrize("route", ["mapped", "in_place", "converted"])
def test_a_file_replaced_during_the_call_is_never_read_under_the_shapes_checked(tmp_path, route):
    """Found by a review: the reads opened the checkpoint again by its name after the shapes were
    checked, so a file replaced meanwhile put its tensors into the model whatever their shape
    (a (2, 8) weight into Linear(4, 4)). Every read derives from the one open: the old bytes, or
    an error saying the file was replaced."""
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file({"a.weight": torch.zeros(4, 4)}, path, metadata={"format": "pt"})

    def concurrent_writer(name, t):  # init_missing runs after the check, before the reads
        tensorferry.torch.save_file({"a.weight": torch.ones(2, 8)}, path + ".new",
                                    metadata={"format": "pt"})
        os.replace(path + ".new", path)
        t.zero_()

    if route == "mapped":
        with init_empty_weights():
            model = nn.ModuleDict({"a": nn.Linear(4, 4, bias=True)})
        kw = dict(device_map="cpu")
    else:
        model = nn.ModuleDict({"a": nn.Linear(4, 4, bias=True)})
        kw = dict(dtype=torch.float64) if route == "converted" else {}
    try:
        got = tft.load_checkpoint_and_dispatch(model, path, init_missing=concurrent_writer, **kw)
    except OSError as e:
        assert "replaced" in str(e) and path in str(e), str(e)
    else:
        assert got["a"].weight.shape == (4, 4)
        assert torch.equal(got["a"].weight, torch.zeros(4, 4, dtype=got["a"].weight.dtype))


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}])
def test_tied_names_stored_apart_load_as_one_only_when_equal(checkpoint, tmp_path, device_map):
    """The model ties lm_head.weight to embed_tokens.weight, the checkpoint stores both: as equal
    copies they load as the one tied tensor; with different values (a fine-tune that untied the
    head) only embed_tokens.weight was read and lm_head.weight's values were dropped without a
    word. That is an error naming both, before the model is changed."""
    from safetensors.torch import load_file, save_file
    ref = checkpoint["ref"]
    stored = load_file(checkpoint["single"])
    assert "lm_head.weight" not in stored
    both = dict(stored, **{"lm_head.weight": stored["embed_tokens.weight"].clone()})
    save_file(both, str(tmp_path / "same.safetensors"))
    got = tft.load_checkpoint_and_dispatch(_meta_model(), str(tmp_path / "same.safetensors"),
                                           device_map=device_map)
    assert got.lm_head.weight is got.embed_tokens.weight
    _assert_same_model(got, ref)
    untied = dict(stored, **{"lm_head.weight": stored["embed_tokens.weight"] + 1})
    save_file(untied, str(tmp_path / "untied.safetensors"))
    m = _meta_model()
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match="ties embed_tokens.weight and lm_head.weight .* different values"):
        tft.load_checkpoint_and_dispatch(m, str(tmp_path / "untied.safetensors"),
                                         device_map=device_map)
    assert all(p.device.type == "meta" for p in m.parameters())  # unchanged



def test_tied_copies_are_compared_whole_by_every_tensor_parallel_rank(checkpoint, tmp_path):
    """With tensor parallelism the copies are compared whole, not as this rank's slices: copies
    differing only in rank 1's rows are refused by both ranks (a rank that went on while another
    failed would hang the job's next collective), equal copies load on both."""
    from safetensors.torch import load_file, save_file
    stored = load_file(checkpoint["single"])
    head = stored["embed_tokens.weight"].clone()
    head[VOCAB - 1] += 1  # a row of the last rank's slice only
    save_file(dict(stored, **{"lm_head.weight": head}), str(tmp_path / "untied.safetensors"))
    save_file(dict(stored, **{"lm_head.weight": stored["embed_tokens.weight"].clone()}),
              str(tmp_path / "same.safetensors"))
    for rank in range(2):
        with pytest.raises(tensorferry.InvalidArgumentError, match="different values"):
            tft.load_checkpoint_and_dispatch(_meta_model(), str(tmp_path / "untied.safetensors"),
                                             tp_rank=rank, tp_size=2)
        got = tft.load_checkpoint_and_dispatch(_meta_model(), str(tmp_path / "same.safetensors"),
                                               tp_rank=rank, tp_size=2)
        assert got.lm_head.weight is got.embed_tokens.weight
        assert torch.equal(got.embed_tokens.weight,
                           torch.tensor_split(stored["embed_tokens.weight"], 2, 0)[rank])


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}])
def test_an_integer_tensor_for_a_parameter_that_requires_grad_is_refused_first(
        checkpoint, tmp_path, device_map):
    """A checkpoint that stores a parameter as integers: torch refuses an integer parameter that
    requires gradients. That RuntimeError came half way through the model (some of its tensors
    put in, empty and never read) and named no tensor; it is an InvalidArgumentError naming it,
    before the model is changed."""
    from safetensors.torch import load_file, save_file
    stored = load_file(checkpoint["single"])
    stored["layers.0.norm.weight"] = torch.ones(HIDDEN, dtype=torch.int32)
    path = str(tmp_path / "int.safetensors")
    save_file(stored, path)
    m = _meta_model()
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match=r"layers.0.norm.weight: the checkpoint stores it as I32.* cannot "
                             r"require gradients"):
        tft.load_checkpoint_and_dispatch(m, path, dtype=torch.bfloat16, device_map=device_map)
    assert all(p.device.type == "meta" for p in m.parameters())

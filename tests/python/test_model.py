"""Weights loaded by tensorferry drive a real torch.nn.Module exactly as weights loaded by the
reference do: a small transformer (embedding, two pre-norm decoder blocks with causal attention
and a gated MLP, tied output head), in float32 and bfloat16."""
import pytest
import safetensors.torch as ref_pt
import torch
from torch import nn

import tensorferry
import tensorferry.torch as tf_pt


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.post_attention_layernorm = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLM(nn.Module):
    def __init__(self, vocab=97, dim=64, heads=4, hidden=160, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def fresh(dtype):
    with torch.device("meta"):
        return TinyLM().to(dtype)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def saved(request, tmp_path):
    torch.manual_seed(0)
    model = TinyLM().to(request.param).eval()
    for p in model.parameters():  # non-trivial norms and biases too
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.05)
    path = str(tmp_path / "model.safetensors")
    ref_pt.save_model(model, path)
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    return request.param, path, ids, want


def run(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids)


def load_into(dtype, state_dict):
    model = fresh(dtype)
    state_dict = dict(state_dict)
    state_dict.setdefault("lm_head.weight", state_dict["embed_tokens.weight"])
    model.load_state_dict(state_dict, assign=True, strict=True)
    model.lm_head.weight = model.embed_tokens.weight
    return model


def test_outputs_match_the_reference(saved):
    dtype, path, ids, want = saved
    reference = run(load_into(dtype, ref_pt.load_file(path)), ids)
    assert torch.equal(reference, want)
    for state_dict in (
        tf_pt.load_file(path),
        tf_pt.load_file(path, backend="pread"),
        tensorferry.Loader(path).load(),
        {n: t.clone() for n, t in tensorferry.Loader(path, budget="128KB").iter_tensors()},
    ):
        got = run(load_into(dtype, state_dict), ids)
        assert got.dtype == dtype and torch.equal(got, reference)


def test_streamed_into_the_module_tensor_by_tensor(saved):
    # The serving-engine pattern: the model exists, each weight is copied in as it arrives and
    # the loaded tensor is dropped; the budget bounds what is held meanwhile.
    dtype, path, ids, want = saved
    torch.manual_seed(123)
    model = TinyLM().to(dtype)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded = set()
    with tensorferry.Loader(path, budget="128KB", allow_oversized=True) as loader:
        for name, tensor in loader.iter_tensors():
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        assert loader.stats.peak_budget_bytes <= max(128_000, 97 * 64 * dtype.itemsize)
    assert loaded == set(ref_pt.load_file(path))
    assert torch.equal(run(model, ids), want)


def test_save_model_and_load_model_with_tied_weights(saved, tmp_path):
    dtype, path, ids, want = saved
    torch.manual_seed(0)
    model = load_into(dtype, ref_pt.load_file(path))
    ours, ref = str(tmp_path / "ours.safetensors"), str(tmp_path / "ref.safetensors")
    tf_pt.save_model(model, ours, checksums=False)  # the reference's bytes (no checksums entry)
    ref_pt.save_model(model, ref)
    with open(ours, "rb") as a, open(ref, "rb") as b:
        assert a.read() == b.read()
    target = TinyLM().to(dtype)
    missing, unexpected = tf_pt.load_model(target, ref)
    assert not missing and not unexpected
    assert torch.equal(run(target, ids), want)

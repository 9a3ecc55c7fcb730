"""The vLLM half of test_vllm.py: run with the Python of .venv-vllm (the real vLLM from PyPI,
requirements-vllm.txt), tensorferry on PYTHONPATH (with its dist-info, so vLLM finds the entry
point). Prints one JSON object of findings on its last line; test_vllm.py asserts on them.

    python vllm_scenarios.py single WORKDIR         registration, load, budget, errors (world 1)
    python vllm_scenarios.py tp WORKDIR WORLD PORT [URL]
                                                    tensor parallelism, one process per rank
                                                    (URL: weights from object storage)
    python vllm_scenarios.py remote WORKDIR URL     weights read from object storage (`weights`)

vLLM runs on its CPU platform (VLLM_TARGET_DEVICE=cpu, set by the caller): its PyPI wheel is
built for CUDA and has no compiled CPU kernels (vllm._C_AVX2/_C_AVX512 are missing), which
does not matter here: models are built and filled, never run."""
import collections
import json
import os
import sys
import traceback


def without_missing_cpu_kernels():
    """vLLM's CPU platform packs small BF16/FP16 weights for AMX after loading them
    (layers/utils.py check_cpu_sgl_kernel, on CPUs with AMX tiles) with
    torch.ops._C.convert_weight_packed, a kernel its PyPI wheel (built for CUDA) does not have: on
    such a CPU, building any model fails after its weights are loaded, whatever loader filled
    them. Where the kernel is missing, vLLM is told not to pack (its path for CPUs without AMX)."""
    import torch
    import vllm.model_executor.layers.utils as layer_utils
    original = layer_utils.check_cpu_sgl_kernel
    if getattr(original, "kernel_checked", False):
        return

    def check(n, k, dtype):
        return hasattr(torch.ops._C, "convert_weight_packed") and original(n, k, dtype)

    check.kernel_checked = True
    layer_utils.check_cpu_sgl_kernel = check


def random_llama(seed, **config):
    """transformers' LlamaForCausalLM (hidden size 64, 2 layers, 4 heads; `config` sets the
    rest) in BF16 with every tensor random (norms are ones at init: every tensor distinct)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=128, tie_word_embeddings=False, **config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def make_checkpoints(workdir):
    """A tiny Llama (transformers' LlamaForCausalLM, BF16) saved twice: sharded with an index,
    and as one model.safetensors. Same weights."""
    sharded = os.path.join(workdir, "llama-sharded")
    single = os.path.join(workdir, "llama-single")
    if os.path.exists(os.path.join(single, "config.json")):
        return sharded, single
    model = random_llama(0, intermediate_size=128, num_key_value_heads=2, vocab_size=256)
    model.save_pretrained(sharded, max_shard_size="60KB")
    model.save_pretrained(single, max_shard_size="100MB")
    return sharded, single


def make_kv_checkpoint(workdir):
    """A tiny Llama whose q, k, v, o, embedding and lm_head tensors are all the largest (64x64
    BF16, 8 KiB): vLLM's Llama keeps two of them alive while it asks for the next, and a
    layerwise load (online quantization, in-place reload) keeps the whole q/k/v layer."""
    path = os.path.join(workdir, "llama-kv")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    model = random_llama(1, intermediate_size=32, num_key_value_heads=4, vocab_size=64)
    model.save_pretrained(path, max_shard_size="100MB")
    return path


def make_newer(workdir, single):
    """A copy of the single-file checkpoint with every weight changed (+1): what an in-place
    reload from another path reads."""
    import shutil

    from safetensors.torch import load_file, save_file
    newer = os.path.join(workdir, "llama-newer")
    if not os.path.exists(os.path.join(newer, "model.safetensors")):
        shutil.copytree(single, newer, dirs_exist_ok=True)
        tensors = {k: v + 1 for k, v in load_file(os.path.join(single,
                                                               "model.safetensors")).items()}
        save_file(tensors, os.path.join(newer, "model.safetensors"), metadata={"format": "pt"})
    return newer


def vllm_config(path, load_format, extra=None, tp=1):
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=path, load_format=load_format, skip_tokenizer_init=True,
                      dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      tensor_parallel_size=tp, model_loader_extra_config=extra or {})
    return args.create_engine_config()


def init_distributed(path, rank, world, port):
    """vLLM's distributed state as a worker sets it up: gloo, `world` ranks, one TP group."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    with set_current_vllm_config(vllm_config(path, "safetensors", tp=world)):
        init_distributed_environment(world_size=world, rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)


def build(path, load_format, extra=None, tp=1):
    """(model, loader) built and filled by vLLM's own get_model path, as a worker does."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    without_missing_cpu_kernels()
    config = vllm_config(path, load_format, extra, tp)
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        model = loader.load_model(vllm_config=config, model_config=config.model_config)
    return model, loader


def raw(t):
    import torch
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def differences(a, b):
    """Names whose bytes, dtype or shape differ between two models (parameters and buffers)."""
    sa = dict(a.named_parameters())
    sa.update(a.named_buffers())
    sb = dict(b.named_parameters())
    sb.update(b.named_buffers())
    diff = sorted(set(sa) ^ set(sb))
    for name in sorted(set(sa) & set(sb)):
        x, y = sa[name], sb[name]
        if x.dtype != y.dtype or x.shape != y.shape or raw(x) != raw(y):
            diff.append(name)
    return diff, len(sa)


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the findings name the type
        return {"type": type(e).__name__, "message": str(e)}
    return None


def single(workdir):
    import torch
    from importlib.metadata import entry_points
    out = {}
    sharded, single_file = make_checkpoints(workdir)

    import tensorferry.vllm as tfv
    out["vllm_imported_by_tensorferry_vllm"] = "vllm" in sys.modules
    import vllm
    out["vllm_version"] = vllm.__version__
    out["torch_version"] = torch.__version__
    from vllm.platforms import current_platform
    out["platform"] = type(current_platform).__name__

    # Registration through the entry point, as vLLM does it in each process.
    out["entry_points"] = sorted(f"{e.name} = {e.value}"
                                 for e in entry_points(group="vllm.general_plugins"))
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    loader = get_model_loader(LoadConfig(load_format="tensorferry"))
    cls = type(loader)
    out["loader_class"] = f"{cls.__module__}.{cls.__qualname__}"
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    out["is_base_model_loader"] = isinstance(loader, BaseModelLoader)
    out["same_class_as_module"] = cls is tfv.TensorferryModelLoader

    init_distributed(sharded, 0, 1, int(os.environ.get("TF_TEST_PORT", "29531")))

    # The reference: vLLM's DefaultModelLoader ("safetensors").
    reference, _ = build(sharded, "safetensors")
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    out["model_class"] = f"{type(reference).__module__}.{type(reference).__qualname__}"

    # Independent measure of what is held: tensorferry's live batch buffers, sampled as the
    # model's load_weights takes each weight.
    import tensorferry._core as core
    cls_model = type(reference)
    original = cls_model.load_weights
    peak = [0]

    def measured(self, weights):
        def gen():
            for item in weights:  # (tensors are freed by reference counting: no gc needed)
                peak[0] = max(peak[0], core.live_buffers()[1])
                yield item
        return original(self, gen())

    # A model folder whose shards are links to files elsewhere (a --local-dir download linked
    # into a cache, a model store made with ln -s): read file by file, as vLLM reads it.
    import shutil
    linked = os.path.join(workdir, "llama-linked")
    if not os.path.isdir(linked):
        os.makedirs(linked)
        for name in os.listdir(sharded):
            source = os.path.join(sharded, name)
            if name.endswith(".safetensors"):
                os.symlink(source, os.path.join(linked, name))
            else:
                shutil.copy(source, linked)
    cases = {
        "sharded_linked": (linked, {}),
        "sharded_default": (sharded, {}),
        "sharded_budget": (sharded, {"budget": 131072, "threads": 2, "engine": "pread"}),
        "single_budget": (single_file, {"budget": "128KiB"}),
        "sharded_unbounded": (sharded, {"budget": 0}),
        "sharded_cpu_mmap": (sharded, {"device": "cpu", "engine": "mmap", "budget": None}),
    }
    out["loads"] = {}
    # The plugin hands the staging rings its loads kept back after each load.
    releases = [0]
    release = core.release_idle_staging

    def counting_release():
        releases[0] += 1
        return release()

    core.release_idle_staging = counting_release
    largest = max(p.numel() * p.element_size() for p in reference.parameters())
    out["largest_tensor_bytes"] = largest
    for key, (path, extra) in cases.items():
        peak[0] = 0
        cls_model.load_weights = measured
        try:
            model, ldr = build(path, "tensorferry", extra)
        finally:
            cls_model.load_weights = original
        diff, count = differences(model, reference)
        out["loads"][key] = {"differences": diff, "compared": count, "stats": ldr.stats,
                             "live_peak": peak[0],
                             "model_bytes": total}
        del model
    out["staging_releases"] = releases[0]

    # Errors: the extra config, the budget, a missing tensor.
    out["errors"] = {
        "unknown_key": error_of(lambda: get_model_loader(
            LoadConfig(load_format="tensorferry", model_loader_extra_config={"budgt": "1GB"}))),
        "bad_budget": error_of(lambda: get_model_loader(
            LoadConfig(load_format="tensorferry", model_loader_extra_config={"budget": "lots"}))),
        "bad_engine": error_of(lambda: get_model_loader(
            LoadConfig(load_format="tensorferry", model_loader_extra_config={"engine": "dma"}))),
        "budget_below_four_tensors": error_of(
            lambda: build(sharded, "tensorferry", {"budget": 3 * largest})),
    }
    # A model whose load_weights keeps every tensor it is given: over the budget, an error.
    def hoarding(self, weights):
        return original(self, list(weights))
    cls_model.load_weights = hoarding
    try:
        out["errors"]["hoarding_model"] = error_of(
            lambda: build(sharded, "tensorferry", {"budget": 4 * largest}))
    finally:
        cls_model.load_weights = original
    # A checkpoint lacking one tensor: both loaders must refuse it, with vLLM's message.
    import shutil
    from safetensors.torch import load_file, save_file
    broken = os.path.join(workdir, "llama-missing")
    if not os.path.exists(broken):
        shutil.copytree(single_file, broken)
        tensors = load_file(os.path.join(broken, "model.safetensors"))
        del tensors["model.layers.1.post_attention_layernorm.weight"]
        save_file(tensors, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    out["errors"]["missing_tensor"] = error_of(lambda: build(broken, "tensorferry"))
    out["errors"]["missing_tensor_vllm"] = error_of(lambda: build(broken, "safetensors"))
    empty = os.path.join(workdir, "llama-no-safetensors")
    if not os.path.exists(empty):
        os.makedirs(empty)
        shutil.copy(os.path.join(single_file, "config.json"), empty)
    out["errors"]["no_safetensors"] = error_of(lambda: build(empty, "tensorferry"))
    out.update(torch_files(workdir, single_file, reference, empty, out["errors"]))

    # A model whose load_weights holds every weight (BERT-style list(weights)) under the
    # automatic budget (4 x the largest tensor here, as for a model of 256 MiB tensors): the
    # budget grows, and load_weights is called once (each weight given once).
    saved_default = tfv.DEFAULT_BUDGET
    tfv.DEFAULT_BUDGET = 0
    calls = [0]

    def hoarding_counted(self, weights):
        calls[0] += 1
        return original(self, list(weights))

    cls_model.load_weights = hoarding_counted
    try:
        model, ldr = build(sharded, "tensorferry")
        out["hoarding_auto"] = {"differences": differences(model, reference)[0],
                                "budget": ldr.stats["budget"], "calls": calls[0],
                                "tensors": ldr.stats["tensors"]}
        del model
    except Exception as e:  # noqa: BLE001 - the test reads it
        out["hoarding_auto"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        cls_model.load_weights = original
        tfv.DEFAULT_BUDGET = saved_default
    out.update(layerwise(workdir, single_file, tfv, releases))

    # The loader's other entry points: download_model with `weights` naming one file (nothing
    # to download), get_all_weights (vLLM's in-place reload asks for it).
    file_weights = os.path.join(single_file, "model.safetensors")
    config = vllm_config(sharded, "tensorferry", {"weights": file_weights})
    ldr = get_model_loader(config.load_config)
    out["download_file_weights"] = error_of(lambda: ldr.download_model(config.model_config))
    out["all_weights"] = sorted(name for name, _ in ldr.get_all_weights(config.model_config,
                                                                         reference))
    # A speculative-decoding draft built with the served model's load config reads its own
    # weights, not the `weights` option's.
    import types

    import vllm.config as vc
    draft_config = vllm_config(single_file, "tensorferry").model_config
    current = vc.get_current_vllm_config_or_none
    vc.get_current_vllm_config_or_none = lambda: types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(draft_model_config=draft_config))
    try:
        out["primary"] = {"draft": ldr._primary(draft_config),
                          "served": ldr._primary(config.model_config)}
    finally:
        vc.get_current_vllm_config_or_none = current
    out["held_across"] = held_across(workdir, tfv)
    return out


def held_across(workdir, tfv):
    """An explicit budget bounds every weight load_weights still holds, whatever read it: a
    model keeping its weights across two weight sources (a secondary_weights folder), or every
    tensor of a .bin file, is refused once they pass the budget; "auto" grows instead."""
    import types

    import torch
    from vllm.config.load import LoadConfig
    base = os.path.join(workdir, "held-across")
    for sub, names in (("A", range(0, 4)), ("B", range(4, 8))):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
        tfv_save = __import__("tensorferry.torch", fromlist=["save_file"]).save_file
        tfv_save({f"t{i}": torch.full((256, 256), float(i)) for i in names},
                 os.path.join(base, sub, "model.safetensors"))
    os.makedirs(os.path.join(base, "bin"), exist_ok=True)
    torch.save({f"t{i}": torch.full((256, 256), float(i)) for i in range(8)},
               os.path.join(base, "bin", "pytorch_model.bin"))

    class Model(torch.nn.Module):
        def __init__(self, secondary):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))
            self.secondary_weights = [types.SimpleNamespace(
                model_or_path=secondary, revision=None, prefix="")] if secondary else []

    def hoard(folder, secondary, budget, keep=lambda t: t):
        cls = tfv.loader_class()
        ldr = cls(LoadConfig(load_format="tensorferry",
                             model_loader_extra_config={"budget": budget, "engine": "pread"}))
        ldr._reset_stats()
        mc = types.SimpleNamespace(model=folder, revision=None, quantization=None,
                                   model_weights="")
        held = []
        error = error_of(lambda: held.extend(keep(t) for _, t in ldr.weights(Model(secondary),
                                                                              mc)))
        return {"error": error, "held": sum(t.untyped_storage().nbytes() for t in held),
                "tensors": len(held)}

    a, b, binary = (os.path.join(base, x) for x in ("A", "B", "bin"))
    one = 256 * 256 * 4
    return {"tensor_bytes": one,
            "parts": hoard(a, b, 5 * one), "bin": hoard(binary, None, 5 * one),
            "parts_auto": hoard(a, b, "auto"), "parts_fit": hoard(a, b, 8 * one),
            # a model keeping views of what it was given (narrow, slices of stacked experts)
            "parts_views": hoard(a, b, 5 * one, lambda t: t[:1])}


def make_torch_checkpoints(workdir, single_file):
    """The single-file Llama's weights as torch.save files: one pytorch_model.bin (beside a
    training_args.bin no reader may unpickle: it names a global tensorferry refuses), two
    shards with their index, one legacy-format file, and a .pt file (for the weights option)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file
    state = load_file(os.path.join(single_file, "model.safetensors"))
    paths = {k: os.path.join(workdir, "llama-" + k) for k in ("bin", "bin-sharded", "bin-legacy")}
    if os.path.exists(os.path.join(paths["bin-legacy"], "pytorch_model.bin")):
        return paths
    for folder in paths.values():
        os.makedirs(folder, exist_ok=True)
        shutil.copy(os.path.join(single_file, "config.json"), folder)
    torch.save(state, os.path.join(paths["bin"], "pytorch_model.bin"))
    torch.save({"args": collections.Counter(a=1)}, os.path.join(paths["bin"], "training_args.bin"))
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        file = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({n: state[n] for n in chunk}, os.path.join(paths["bin-sharded"], file))
        weight_map.update({n: file for n in chunk})
    with open(os.path.join(paths["bin-sharded"], "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    torch.save(state, os.path.join(paths["bin-legacy"], "pytorch_model.bin"),
               _use_new_zipfile_serialization=False)
    torch.save(state, os.path.join(workdir, "llama-weights.pt"))
    return paths


def torch_files(workdir, single_file, reference, config_only, errors):
    """Loads of .bin/.pt checkpoints (read without running their pickles) compared with the
    reference; their errors (a byte flipped in a storage, a pickle naming os.system) go into
    `errors`."""
    import torch
    paths = make_torch_checkpoints(workdir, single_file)
    out = {"torch_loads": {}}
    cases = {
        "bin": (paths["bin"], {}),
        "bin_sharded_budget": (paths["bin-sharded"], {"budget": "128KiB"}),
        "bin_legacy": (paths["bin-legacy"], {}),
        "pt_weights_option": (config_only,
                              {"weights": os.path.join(workdir, "llama-weights.pt")}),
        "bin_index_weights_option": (config_only, {"weights": os.path.join(
            paths["bin-sharded"], "pytorch_model.bin.index.json")}),
    }
    for key, (path, extra) in cases.items():
        try:
            model, ldr = build(path, "tensorferry", extra)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["torch_loads"][key] = {"error": f"{type(e).__name__}: {e}"}
            continue
        diff, count = differences(model, reference)
        out["torch_loads"][key] = {"differences": diff, "compared": count, "stats": ldr.stats}
        del model
    # vLLM's own loader reads the same folder to the same weights (the reference for "auto").
    model, _ = build(paths["bin"], "auto")
    out["torch_loads"]["bin_vllm_auto"] = {"differences": differences(model, reference)[0]}
    del model
    # One byte flipped inside a tensor's storage (the zip stores storages uncompressed).
    import shutil
    flipped = os.path.join(workdir, "llama-bin-flipped")
    if not os.path.exists(flipped):
        shutil.copytree(paths["bin"], flipped)
        os.remove(os.path.join(flipped, "training_args.bin"))
        file = os.path.join(flipped, "pytorch_model.bin")
        data = bytearray(open(file, "rb").read())
        needle = raw(dict(reference.named_parameters())["model.norm.weight"])
        at = data.find(needle)
        assert at > 0 and data.find(needle, at + 1) < 0, "the norm's bytes once in the file"
        data[at + 5] ^= 0x01
        open(file, "wb").write(bytes(data))
    errors["bin_flipped"] = error_of(lambda: build(flipped, "tensorferry"))
    # A pickle naming os.system: refused before anything runs.
    evil = os.path.join(workdir, "llama-bin-evil")
    if not os.path.exists(evil):
        shutil.copytree(paths["bin"], evil)
        os.remove(os.path.join(evil, "training_args.bin"))
    marker = os.path.join(workdir, "evil-ran")
    torch.save({"w": torch.ones(2), "x": Evil(marker)}, os.path.join(evil, "pytorch_model.bin"))
    errors["bin_evil"] = error_of(lambda: build(evil, "tensorferry"))
    errors["bin_evil_ran"] = os.path.exists(marker)
    return out


class Evil:
    """Pickles as a call of os.system creating `marker` (torch.save writes its __reduce__)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def zero(model):
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0)


def outcome(fn):
    """fn()'s dict, or {"error": "Type: message"}."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {e}"}


def layerwise(workdir, single_file, tfv, releases):
    """The automatic budget against a model keeping several of its largest tensors (vLLM's
    Llama) and whole layers (vLLM's layerwise loading: online quantization, in-place reload),
    in-place reloads with the `weights` option, torchao-serialized checkpoints. `releases`: the
    count of release_idle_staging calls (single())."""
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    out = {}
    kv = make_kv_checkpoint(workdir)
    kv_reference, _ = build(kv, "safetensors")
    cls_model = type(kv_reference)
    original = cls_model.load_weights
    calls = [0]

    def counted(self, weights):
        calls[0] += 1
        return original(self, weights)

    saved = tfv.DEFAULT_BUDGET
    tfv.DEFAULT_BUDGET = 0  # "auto": its multiple of the largest tensor, as for big tensors
    cls_model.load_weights = counted
    try:
        def auto():
            model, ldr = build(kv, "tensorferry")
            return {"differences": differences(model, kv_reference)[0], "calls": calls[0],
                    "budget": ldr.stats["budget"], "tensors": ldr.stats["tensors"]}
        out["kv_auto"] = outcome(auto)

        def layerwise_load():  # what online quantization does at the first load
            model, ldr = build(kv, "safetensors")
            zero(model)
            config = vllm_config(kv, "tensorferry")
            ldr = get_model_loader(config.load_config)
            calls[0] = 0
            with set_current_vllm_config(config):
                initialize_layerwise_reload(model)
                ldr.load_weights(model, config.model_config)
                finalize_layerwise_reload(model, config.model_config)
            return {"differences": differences(model, kv_reference)[0], "calls": calls[0],
                    "budget": ldr.stats["budget"], "tensors": ldr.stats["tensors"]}
        out["layerwise_load"] = outcome(layerwise_load)

        def layerwise_reload():  # vLLM's in-place reload: get_all_weights, layer by layer
            model, _ = build(kv, "tensorferry")
            zero(model)
            config = vllm_config(kv, "tensorferry")
            calls[0] = 0
            before = releases[0]
            with set_current_vllm_config(config):
                reload_weights(config, model, None, None, True)
            return {"differences": differences(model, kv_reference)[0], "calls": calls[0],
                    "staging_releases": releases[0] - before}
        out["layerwise_reload"] = outcome(layerwise_reload)
    finally:
        cls_model.load_weights = original
        tfv.DEFAULT_BUDGET = saved

    # In-place reloads of a model served with --model SHARDED and the `weights` option naming
    # the single-file copy (same weights): from another path, that path's weights; from the
    # model's own, the option's.
    sharded, _ = make_checkpoints(workdir)
    newer = make_newer(workdir, single_file)
    old_reference, _ = build(sharded, "safetensors")
    new_reference, _ = build(newer, "safetensors")
    extra = {"weights": single_file}

    def reload(path, same_config):
        config = vllm_config(sharded, "tensorferry", extra)
        with set_current_vllm_config(config):  # as a worker: load, then reload, one config
            ldr = get_model_loader(config.load_config)
            model = ldr.load_model(vllm_config=config, model_config=config.model_config)
        if not same_config:
            config = vllm_config(sharded, "tensorferry", extra)
        zero(model)
        with set_current_vllm_config(config):
            reload_weights(config, model, None, path, True)
        return {"new": differences(model, new_reference)[0],
                "old": differences(model, old_reference)[0]}
    out["reload_new_path"] = outcome(lambda: reload(newer, True))
    out["reload_new_path_fresh_config"] = outcome(lambda: reload(newer, False))
    out["reload_same"] = outcome(lambda: reload(None, True))

    # torchao-serialized checkpoints: refused, naming the setting.
    config = vllm_config(kv, "tensorferry")
    config.model_config.quantization = "torchao"
    ldr = get_model_loader(config.load_config)
    strategy = get_model_loader(LoadConfig(load_format="tensorferry",
                                           safetensors_load_strategy="torchao"))
    plain = vllm_config(kv, "tensorferry").model_config
    out["torchao"] = {
        "quantization": error_of(lambda: ldr.download_model(config.model_config)),
        "strategy": error_of(lambda: strategy.load_weights(kv_reference, plain)),
        "strategy_reload": error_of(lambda: list(strategy.get_all_weights(plain,
                                                                          kv_reference))),
    }
    # Decided as vLLM's default loader decides (torchao is not installed here: its quantization
    # config is stood in for): a checkpoint whose quant_method names torchao is refused; online
    # quantization of a plain checkpoint (quantized after loading) is streamed.
    import types

    import vllm.model_executor.model_loader.weight_utils as weight_utils
    real = weight_utils.get_quant_config
    try:
        for serialized in (False, True):
            weight_utils.get_quant_config = lambda mc, lc, _s=serialized: types.SimpleNamespace(
                is_checkpoint_torchao_serialized=_s)
            out["torchao"]["serialized" if serialized else "online"] = error_of(
                lambda: ldr.download_model(config.model_config))
    finally:
        weight_utils.get_quant_config = real
    return out


def remote(workdir, url):
    """Weights read straight from object storage (the `weights` option): `url` is the sharded
    checkpoint's S3 prefix (uploaded by the test; AWS_* variables name the server), vLLM's
    --model a folder holding only config.json."""
    import shutil

    import tensorferry

    sharded, _ = make_checkpoints(workdir)
    config_only = os.path.join(workdir, "llama-config-only")
    if not os.path.exists(config_only):
        os.makedirs(config_only)
        shutil.copy(os.path.join(sharded, "config.json"), config_only)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    init_distributed(sharded, 0, 1, int(os.environ.get("TF_TEST_PORT", "29532")))
    reference, _ = build(sharded, "safetensors")
    out = {"loads": {}}
    cache = os.path.join(workdir, "object-cache")
    cases = {
        "prefix": {"weights": url, "budget": 131072},
        "index": {"weights": url + "/model.safetensors.index.json", "budget": "auto"},
        "cached": {"weights": url, "storage_options": {"object_cache_dir": cache,
                                                       "object_header_bytes": 4096}},
    }
    if os.environ.get("TF_TEST_HF_PATH"):  # a hub at HF_ENDPOINT, not in the local hub cache
        cases["hub"] = {"weights": os.environ["TF_TEST_HF_PATH"], "budget": 131072}
    for key, extra in cases.items():
        model, ldr = build(config_only, "tensorferry", extra)
        diff, count = differences(model, reference)
        out["loads"][key] = {"differences": diff, "compared": count, "stats": ldr.stats}
        del model
    hub_id = os.environ.get("TF_TEST_HF_ID")
    if hub_id:
        # --model a hub id (its configuration too from the hub at HF_ENDPOINT): the weights
        # streamed as hf://<id> and kept in the hub cache (the `hub` option's default), then read
        # from that cache with the hub offline; and with hub="download", vLLM's download first.
        repo_dir = os.path.join(os.environ["HF_HUB_CACHE"], "models--" + hub_id.replace("/", "--"))
        for key, extra, offline in (("hub_id", {"budget": 131072}, False),
                                    ("hub_id_offline", {"budget": 131072}, True),
                                    ("hub_id_download", {"budget": 131072, "hub": "download"},
                                     False)):
            if key != "hub_id_offline":
                shutil.rmtree(repo_dir, ignore_errors=True)  # (the "hub" case above filled it)
            if offline:
                os.environ["HF_HUB_OFFLINE"] = "1"
            try:
                model, ldr = build(hub_id, "tensorferry", extra)
            finally:
                os.environ.pop("HF_HUB_OFFLINE", None)
            diff, count = differences(model, reference)
            out["loads"][key] = {"differences": diff, "compared": count, "stats": ldr.stats}
            del model
            tensorferry.wait_for_caches()  # the copies into the hub cache finish after the load
            snapshots = os.path.join(repo_dir, "snapshots")
            out["loads"][key]["snapshot"] = sorted(
                f for d in (os.listdir(snapshots) if os.path.isdir(snapshots) else [])
                for f in os.listdir(os.path.join(snapshots, d)))
    tensorferry.wait_for_caches()
    blobs = os.path.join(cache, "blobs")
    out["cached_files"] = sorted(f for f in os.listdir(blobs) if not f.endswith(".json")) \
        if os.path.isdir(blobs) else []
    out["errors"] = {
        "missing": error_of(lambda: build(config_only, "tensorferry",
                                          {"weights": url + "-nothing-here/"})),
        "az": error_of(lambda: build(config_only, "tensorferry",
                                     {"weights": "az://container/model/"})),
        "missing_local": error_of(lambda: build(config_only, "tensorferry",
                                                {"weights": "/nonexistent/llama"})),
        "missing_relative": error_of(lambda: build(config_only, "tensorferry",
                                                   {"weights": "ckpts/llama/"})),
        "bad_storage_option": error_of(lambda: build(config_only, "tensorferry",
                                                     {"weights": url,
                                                      "storage_options": {"endpoint": "x"}})),
    }
    return out


def tp(workdir, world, port, url=None):
    """With `url` (the sharded checkpoint's S3 prefix): the weights read from there (the
    `weights` option), vLLM's --model the folder holding only config.json."""
    rank = int(os.environ["TF_TEST_RANK"])
    sharded, _ = make_checkpoints(workdir)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    init_distributed(sharded, rank, world, port)
    from vllm.distributed import get_tp_group
    out = {"rank": rank, "tp_rank": get_tp_group().rank_in_group,
           "tp_world": get_tp_group().world_size}
    reference, _ = build(sharded, "safetensors", tp=world)
    out["local_bytes"] = sum(p.numel() * p.element_size() for p in reference.parameters())
    out["loads"] = {}
    model_path, where = sharded, {}
    if url is not None:
        model_path = os.path.join(workdir, "llama-config-only")  # written by remote()
        where = {"weights": url}
    for key, extra in (("cooperative", {"cooperative": True, "budget": 131072}),
                       ("cooperative_unbounded", {"cooperative": True, "budget": 0}),
                       ("plain", {"budget": 131072})):
        model, ldr = build(model_path, "tensorferry", dict(extra, **where), tp=world)
        diff, count = differences(model, reference)
        out["loads"][key] = {"differences": diff, "compared": count, "stats": ldr.stats}
        del model
    return out


def tp_hub(workdir, world, port, path):
    """Every rank reads the weights of `path` (an hf:// path of a branch, or a hub id, on the hub
    at HF_ENDPOINT, the local hub cache empty) at one commit, while the branch moves between the
    single-file checkpoint and its changed copy (llama-newer) at every question asked of the
    hub's API: each rank's weights are compared with both."""
    rank = int(os.environ["TF_TEST_RANK"])
    _, single_file = make_checkpoints(workdir)
    newer = make_newer(workdir, single_file)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    init_distributed(single_file, rank, world, port)
    references = {"old": build(single_file, "safetensors", tp=world)[0],
                  "new": build(newer, "safetensors", tp=world)[0]}
    out = {"rank": rank, "loads": {}}
    for key, extra in (("plain", {"budget": 131072}), ("cooperative", {"cooperative": True})):
        if path.startswith("hf://"):
            model, ldr = build(single_file, "tensorferry", dict(extra, weights=path), tp=world)
        else:  # a hub id: vLLM's configuration from the hub too
            model, ldr = build(path, "tensorferry", extra, tp=world)
        out["loads"][key] = {
            "matches": sorted(k for k, ref in references.items()
                              if differences(model, ref)[0] == []),
            "stats": ldr.stats}
        del model
    return out


def main():
    what, workdir = sys.argv[1], sys.argv[2]
    try:
        if what == "single":
            result = single(workdir)
        elif what == "remote":
            result = remote(workdir, sys.argv[3])
        elif what == "tp_hub":
            result = tp_hub(workdir, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        else:
            result = tp(workdir, int(sys.argv[3]), int(sys.argv[4]),
                        sys.argv[5] if len(sys.argv) > 5 else None)
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"crash": traceback.format_exc()}
    sys.stdout.flush()
    print("\nRESULT " + json.dumps(result, default=str), flush=True)
    os._exit(0)  # vLLM's distributed state has no clean shutdown here


if __name__ == "__main__":
    main()

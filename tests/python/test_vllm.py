"""The vLLM loader plugin (tensorferry.vllm) against the real vLLM from PyPI.

vLLM pins its own transformers (and numpy), so it lives in .venv-vllm, a layer over .venv that
shares its torch (scripts/install_vllm.sh, requirements-vllm.txt). The tests here run in the suite's Python; everything that needs vLLM runs
in vllm_scenarios.py under .venv-vllm's Python, with the tensorferry package under test (the one
this suite imports) and its dist-info on PYTHONPATH, so vLLM finds the plugin through the
`vllm.general_plugins` entry point exactly as a pip-installed tensorferry provides it.

What runs in vLLM: its CpuPlatform (VLLM_TARGET_DEVICE=cpu) builds the real
vllm.model_executor.models.llama.LlamaForCausalLM from a tiny transformers checkpoint, through
vLLM's own get_model_loader / load_model path, once with vLLM's DefaultModelLoader and once with
the plugin, and every parameter is compared byte for byte; with tensor parallelism (two
processes, vLLM's distributed state over gloo) each rank's shards are compared the same way.
The model is never run: the PyPI wheel is built for CUDA and carries no CPU kernels
(docs/models.md, "vLLM", says what could not run and why)."""
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

import tensorferry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.environ.get("TENSORFERRY_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin",
                                                                         "python")
SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_scenarios.py")
ENTRY_POINT = "tensorferry = tensorferry.vllm:register"


# --- without vLLM --------------------------------------------------------------------------------


def test_importing_the_plugin_module_imports_neither_vllm_nor_torch():
    code = ("import sys, tensorferry, tensorferry.vllm as v; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules)); "
            "print(v.LOAD_FORMAT, callable(v.register))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "tensorferry True"]


def test_pyproject_declares_the_entry_point():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "tensorferry": "tensorferry.vllm:register"}


def test_options_defaults_and_values():
    from tensorferry.vllm import Options, parse_options
    assert parse_options({}) == Options()
    assert parse_options(None).budget == "auto"
    o = parse_options({"budget": "2GB", "cooperative": True, "device": "cpu", "threads": 4,
                       "engine": "io_uring", "gds": "off", "enable_weights_track": False})
    assert (o.budget, o.cooperative, o.device, o.threads, o.engine, o.gds,
            o.enable_weights_track) == (2_000_000_000, True, "cpu", 4, "io_uring", "off", False)
    assert parse_options({"budget": 0}).budget is None
    assert parse_options({"budget": None}).budget is None
    assert parse_options({"budget": 4096}).budget == 4096


@pytest.mark.parametrize("extra, words", [
    ({"budgt": 1}, ["unknown key 'budgt'", "did you mean 'budget'", "known keys: budget"]),
    ({"num_threads": 4}, ["unknown key 'num_threads'", "did you mean 'threads'"]),
    ({"budget": "lots"}, ["['budget']", "not a size"]),
    ({"budget": -1}, ["['budget']"]),
    ({"budget": True}, ["['budget']", "True is not a size"]),
    ({"budget": False}, ["['budget']", "False is not a size"]),
    ({"budget": 0.0}, ["['budget']", "0.0 is not a size"]),
    ({"cooperative": "yes"}, ["['cooperative']", "'yes' is not true or false"]),
    ({"threads": 0}, ["['threads']", "0 is not a positive integer"]),
    ({"engine": "dma"}, ["['engine']", "'dma' is not one of 'auto', 'pread', 'io_uring', 'mmap'"]),
    ({"gds": True}, ["['gds']", "not one of 'auto', 'on', 'off'"]),
    ({"device": "cuda:0"}, ["['device']", "'cuda:0' is not one of 'auto', 'cpu'"]),
    ("budget=1GB", ["must be a dict, not str"]),
])
def test_bad_options_are_value_errors_naming_the_key(extra, words):
    from tensorferry.vllm import parse_options
    with pytest.raises(ValueError) as e:
        parse_options(extra)
    for w in words:
        assert w in str(e.value)
    assert "'tensorferry'" in str(e.value)


def _save(path, names):
    import numpy as np
    from tensorferry.numpy import save_file
    save_file({n: np.full((4,), i, dtype=np.float32) for i, n in enumerate(names)}, path)


def test_plan_parts_uses_the_index_and_selects_the_kept_files(tmp_path):
    from tensorferry.vllm import INDEX_NAME, Part, plan_parts
    _save(tmp_path / "a.safetensors", ["x", "y"])
    _save(tmp_path / "b.safetensors", ["z"])
    with open(tmp_path / INDEX_NAME, "w") as f:
        json.dump({"weight_map": {"x": "a.safetensors", "y": "a.safetensors",
                                  "z": "b.safetensors"}}, f)
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    index = str(tmp_path / INDEX_NAME)
    assert plan_parts(str(tmp_path), [a, b]) == [Part(index, None)]
    assert plan_parts(str(tmp_path), [b]) == [Part(index, ["z"])]
    assert plan_parts(str(tmp_path), [a, b], lambda n: n == "y") == [Part(index, ["x", "z"])]
    # A file the index does not name (e.g. a consolidated file beside the shards): per file.
    _save(tmp_path / "c.safetensors", ["w"])
    c = str(tmp_path / "c.safetensors")
    assert plan_parts(str(tmp_path), [c, a]) == [Part(a, None), Part(c, None)]
    # And the parts load what they say.
    with tensorferry.Loader(index, select=["z"]) as loader:
        assert loader.keys() == ["z"]


def test_plan_parts_without_an_index_reads_the_folder(tmp_path):
    from tensorferry.vllm import plan_parts
    _save(tmp_path / "m1.safetensors", ["x"])
    _save(tmp_path / "m0.safetensors", ["y"])
    files = [str(tmp_path / "m1.safetensors"), str(tmp_path / "m0.safetensors")]
    # All of the folder's files: the folder, one Loader.
    parts = plan_parts(str(tmp_path), files, lambda n: n == "y")
    assert [p.checkpoint for p in parts] == [str(tmp_path)]
    with tensorferry.Loader(parts[0].checkpoint, select=parts[0].select) as loader:
        assert loader.keys() == ["x"]
    # Some of them (vLLM filtered the others out): one part per file.
    parts = plan_parts(str(tmp_path), files[:1])
    assert [(p.checkpoint, p.select) for p in parts] == [(files[0], None)]


def test_plan_parts_refuses_an_incomplete_shard_series(tmp_path):
    from tensorferry.vllm import plan_parts
    _save(tmp_path / "model-00001-of-00003.safetensors", ["x"])
    _save(tmp_path / "model-00003-of-00003.safetensors", ["z"])
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    parts = plan_parts(str(tmp_path), files)
    assert [p.checkpoint for p in parts] == [str(tmp_path)]
    with pytest.raises(tensorferry.SafetensorError, match="model-00002-of-00003.safetensors") as e:
        tensorferry.Loader(parts[0].checkpoint)
    assert e.value.code == "checkpoint_incomplete"


def test_a_checkpoint_refused_whole_is_read_file_by_file_as_vllm_reads_it(tmp_path):
    """Found by a review: vLLM's own loader reads each selected file whole and uses the index
    only to choose them, so shards that are links out of the folder (a --local-dir download, a
    model store made with ln -s), an index that leaves out a tensor, or one name in two files of
    a folder without an index load there; opened as one checkpoint, tensorferry refused them.
    Such a Part is now one Part per file (with a warning); other errors are still raised."""
    from tensorferry.vllm import INDEX_NAME, Part, natural_order, openable_parts, plan_parts
    store = tmp_path / "store"
    store.mkdir()
    _save(store / "a.safetensors", ["x", "y"])
    _save(store / "b.safetensors", ["z"])
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        os.symlink(store / name, linked / name)
    index = {"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}
    (linked / INDEX_NAME).write_text(json.dumps(index))
    stale = tmp_path / "stale"  # the index leaves out "y"
    stale.mkdir()
    _save(stale / "a.safetensors", ["x", "y"])
    _save(stale / "b.safetensors", ["z"])
    (stale / INDEX_NAME).write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "z": "b.safetensors"}}))
    twice = tmp_path / "twice"  # no index; "x" in both files
    twice.mkdir()
    _save(twice / "model.safetensors", ["x", "y"])
    _save(twice / "model.fp16.safetensors", ["x"])
    for folder, code in ((linked, "index_path_escape"), (stale, "index_unlisted_tensor"),
                         (twice, "index_duplicate_tensor")):
        files = sorted(str(p) for p in folder.glob("*.safetensors"))
        parts = plan_parts(str(folder), files)
        assert len(parts) == 1
        with pytest.raises(tensorferry.SafetensorError) as e:
            tensorferry.Loader(parts[0].checkpoint)
        assert e.value.code == code
        said = []
        per_file = openable_parts(parts, files, None, said.append)
        assert per_file == [Part(f, None) for f in files], folder
        assert len(said) == 1 and str(folder) in said[0] and str(e.value) in said[0]
        got = {}
        for part in per_file:
            with tensorferry.Loader(part.checkpoint) as loader:
                got.update(loader.load())
        assert sorted(got) == (["x", "y"] if folder == twice else ["x", "y", "z"])
    # A shard the index names but the folder lacks is still an error (vLLM's loader would say
    # only at the end which weights it did not initialize).
    missing = tmp_path / "missing"
    missing.mkdir()
    _save(missing / "model-00001-of-00002.safetensors", ["x"])
    (missing / INDEX_NAME).write_text(json.dumps({"weight_map": {
        "x": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}}))
    files = [str(missing / "model-00001-of-00002.safetensors")]
    with pytest.raises(tensorferry.SafetensorError) as e:
        openable_parts(plan_parts(str(missing), files), files)
    assert e.value.code == "index_missing_file"
    # Per file, in vLLM's order (numbers in names compared as numbers).
    assert natural_order(["/m/w-10.safetensors", "/m/w-2.safetensors", "/m/a.safetensors"]) == \
        ["/m/a.safetensors", "/m/w-2.safetensors", "/m/w-10.safetensors"]
    # A whole checkpoint that opens is kept whole; a damaged one is still an error.
    _save(tmp_path / "ok.safetensors", ["x"])
    ok = [Part(str(linked / "a.safetensors"), None)]
    assert openable_parts(ok, []) == ok
    os.truncate(stale / "b.safetensors", 20)
    (stale / INDEX_NAME).write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}))
    files = sorted(str(p) for p in stale.glob("*.safetensors"))
    with pytest.raises(tensorferry.SafetensorError):
        openable_parts(plan_parts(str(stale), files), files)


# --- with the real vLLM (in .venv-vllm) -----------------------------------------------------------


def _overlay(tmp_path_factory):
    """A PYTHONPATH folder holding the tensorferry package this suite imports and a dist-info
    carrying its entry points: the installed one (pip install . writes them from pyproject.toml)
    when the package comes from an installed distribution, else one written from
    pyproject.toml (a build tree on PYTHONPATH)."""
    root = tmp_path_factory.mktemp("vllm-path")
    package = os.path.dirname(os.path.abspath(tensorferry.__file__))
    os.symlink(package, root / "tensorferry")
    info = root / "tensorferry-0.1.0.dist-info"
    info.mkdir()
    entry_points = None
    try:
        dist = importlib.metadata.distribution("tensorferry")
        installed = os.path.join(str(dist.locate_file("")), "tensorferry")
        if os.path.realpath(installed) == os.path.realpath(package):
            # The installed package: its own entry points, or none (and the test fails).
            entry_points = dist.read_text("entry_points.txt") or ""
    except importlib.metadata.PackageNotFoundError:
        pass
    if entry_points is None:
        entry_points = "[vllm.general_plugins]\n" + ENTRY_POINT + "\n"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorferry\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return str(root), entry_points


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(path):
    env = dict(os.environ)
    env.update(PYTHONPATH=path, VLLM_TARGET_DEVICE="cpu", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("VLLM_PLUGINS", None)
    return env


def _result(text, what):
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"{what}: no result from vllm_scenarios.py; its output:\n{text[-6000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert "crash" not in result, f"{what}:\n{result['crash']}"
    return result


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory):
    if not os.path.exists(VLLM_PYTHON):
        if os.environ.get("TENSORFERRY_TESTS_OFFLINE") == "1":  # an offline kit: cannot install it
            pytest.skip(f"TENSORFERRY_TESTS_OFFLINE=1 and not installed: {VLLM_PYTHON}")
        skipped = os.path.join(ROOT, ".venv-vllm.skipped")  # scripts/install_deps.sh, short of disk
        if "TENSORFERRY_VLLM_PYTHON" not in os.environ and os.path.exists(skipped):
            with open(skipped) as f:
                pytest.skip(f"scripts/install_deps.sh left .venv-vllm out: {f.read().strip()}")
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/install_vllm.sh "
                    f"(scripts/install_deps.sh does)", pytrace=False)
    path, entry_points = _overlay(tmp_path_factory)
    work = str(tmp_path_factory.mktemp("vllm-work"))
    return {"path": path, "entry_points": entry_points, "work": work}


@pytest.fixture(scope="session")
def single(vllm_env):
    env = _env(vllm_env["path"])
    env["TF_TEST_PORT"] = str(_free_port())
    r = subprocess.run([VLLM_PYTHON, SCENARIOS, "single", vllm_env["work"]], env=env,
                       capture_output=True, text=True, timeout=900)
    return _result(r.stdout + r.stderr, "vllm_scenarios.py single")


def _tensor_parallel(vllm_env, world, url=None, more_env=None, scenario="tp"):
    """The `tp` scenario (or `scenario`) in `world` processes; their results by rank."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = _env(vllm_env["path"])
        for name, value in (more_env or {}).items():  # None: unset
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        env["TF_TEST_RANK"] = str(rank)
        procs.append(subprocess.Popen(
            [VLLM_PYTHON, SCENARIOS, scenario, vllm_env["work"], str(world), str(port)]
            + ([url] if url else []), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results, crashes = [], []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"tensor-parallel rank {rank} did not finish in 900 s")
        try:  # every rank's failure shown: the first rank's is often "the other one crashed"
            results.append(_result(out, f"vllm_scenarios.py {scenario} rank {rank}"))
        except AssertionError as e:
            crashes.append(str(e))
    if crashes:
        pytest.fail("\n".join(crashes))
    return results


@pytest.fixture(scope="session")
def tp2(vllm_env, single):  # after `single`: it writes the checkpoints
    return _tensor_parallel(vllm_env, 2)


def test_vllm_finds_the_plugin_through_its_entry_point(single, vllm_env):
    assert ENTRY_POINT.replace(" ", "") in vllm_env["entry_points"].replace(" ", "")
    assert single["vllm_version"] == "0.33.0"  # requirements-vllm.txt
    assert single["vllm_imported_by_tensorferry_vllm"] is False
    assert ENTRY_POINT in single["entry_points"]


def test_get_model_loader_returns_the_plugin(single):
    assert single["loader_class"] == "tensorferry.vllm.TensorferryModelLoader"
    assert single["is_base_model_loader"] and single["same_class_as_module"]


@pytest.mark.parametrize("case", ["sharded_default", "sharded_budget", "single_budget",
                                  "sharded_unbounded", "sharded_cpu_mmap", "sharded_linked"])
def test_vllm_llama_gets_the_same_weights_as_from_vllms_default_loader(single, case):
    assert single["model_class"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    load = single["loads"][case]
    assert load["compared"] == 24  # 21 checkpoint tensors, fused by vLLM into its parameters
    assert load["differences"] == []
    assert load["stats"]["tensors"] == 21
    assert load["stats"]["bytes"] == load["model_bytes"]


@pytest.mark.parametrize("case", ["sharded_budget", "single_budget"])
def test_the_budget_bounds_what_is_held(single, case):
    load = single["loads"][case]
    budget = load["stats"]["budget"]
    assert budget == 131072 == 4 * single["largest_tensor_bytes"]
    # Measured independently: the bytes of tensorferry's live buffers as load_weights takes
    # each tensor; and the loader's own account.
    assert 0 < load["live_peak"] <= budget
    assert load["stats"]["peak_held_bytes"] <= budget
    assert load["stats"]["rounds"] > 1


def test_each_load_hands_the_kept_staging_rings_back(single):
    # Once per load (the CPU platform keeps none: nothing to free, but it was asked).
    assert single["staging_releases"] == len(single["loads"])
    assert all(load["stats"]["staging_released"] == 0 for load in single["loads"].values())


def test_budget_auto_holds_the_whole_small_model_in_one_batch(single):
    stats = single["loads"]["sharded_default"]["stats"]
    assert stats["budget"] == 1 << 30
    assert stats["rounds"] == 1


def test_unknown_extra_config_key_is_a_value_error_naming_it(single):
    e = single["errors"]["unknown_key"]
    assert e["type"] == "ValueError"
    assert "unknown key 'budgt' (did you mean 'budget'?)" in e["message"]
    assert single["errors"]["bad_budget"]["type"] == "ValueError"
    assert "['budget']" in single["errors"]["bad_budget"]["message"]
    assert "'dma' is not one of" in single["errors"]["bad_engine"]["message"]


def test_a_budget_below_four_of_the_largest_tensor_names_it(single):
    e = single["errors"]["budget_below_four_tensors"]
    assert e["type"] == "ValueError"
    assert "less than four times the largest tensor" in e["message"]
    assert "'model.embed_tokens.weight'" in e["message"] or "'lm_head.weight'" in e["message"]
    assert "use at least 131072 bytes" in e["message"]


def test_a_model_keeping_its_weights_exceeds_the_budget_with_an_error_saying_so(single):
    e = single["errors"]["hoarding_model"]
    assert e["type"] == "BudgetExceededError"
    assert "keeps more weights alive than model_loader_extra_config['budget']" in e["message"]
    assert "do not fit after '" in e["message"]  # the last tensor given
    assert "or 0 (unbounded)" in e["message"]


def test_a_model_holding_every_weight_grows_the_automatic_budget_giving_each_weight_once(
        single):
    # (BERT-style models call list(weights); a budget given explicitly still fails, above.)
    # The automatic budget here is 4 x the largest tensor, as for a model of 256 MiB tensors.
    h = single["hoarding_auto"]
    assert "error" not in h, h
    assert h["differences"] == [] and h["calls"] == 1 and h["tensors"] == 21, h
    assert h["budget"] > 4 * single["largest_tensor_bytes"], h


def test_the_automatic_budget_holds_llamas_stacked_parameters(single):
    # vLLM's Llama keeps earlier q/k/v (gate/up) tensors alive while it asks for the next: with
    # every one of them the largest tensor, 4 x the largest tensor is enough, without growing.
    k = single["kv_auto"]
    assert "error" not in k, k
    assert k["differences"] == [] and k["calls"] == 1, k
    assert k["budget"] == 4 * 8192, k


@pytest.mark.parametrize("case", ["layerwise_load", "layerwise_reload"])
def test_layerwise_loading_keeping_a_whole_layer_gets_every_weight_once(single, case):
    # vLLM's layerwise loading (online quantization, in-place reload) keeps a layer's tensors
    # until the layer is complete: the automatic budget holds them, or grows, instead of
    # restarting (a restart gave load_weights weights it had already consumed).
    r = single[case]
    assert "error" not in r, r
    assert r["differences"] == [] and r["calls"] == 1, r
    if case == "layerwise_reload":
        assert r["staging_releases"] == 1, r  # get_all_weights hands the staging back
    else:
        assert r["tensors"] == 21 and r["budget"] >= 4 * 8192, r


@pytest.mark.parametrize("case", ["reload_new_path", "reload_new_path_fresh_config"])
def test_an_in_place_reload_from_another_path_reads_that_path_not_the_weights_option(single,
                                                                                     case):
    r = single[case]
    assert "error" not in r, r
    assert r["new"] == [] and r["old"] != [], r


def test_an_in_place_reload_of_the_same_model_reads_the_weights_option(single):
    r = single["reload_same"]
    assert "error" not in r, r
    assert r["old"] == [] and r["new"] != [], r


@pytest.mark.parametrize("case", ["quantization", "strategy", "strategy_reload"])
def test_torchao_serialized_checkpoints_are_refused_naming_the_setting(single, case):
    e = single["torchao"][case]
    assert e["type"] == "ValueError", e
    assert "does not read torchao-serialized checkpoints" in e["message"], e
    setting = "quantization='torchao'" if case == "quantization" else \
        "safetensors_load_strategy='torchao'"
    assert setting in e["message"], e


def test_online_torchao_quantization_is_streamed(single):
    """Found by a review: --quantization torchao was refused whatever the checkpoint, but vLLM's
    default loader treats only a checkpoint whose quantization config names torchao as serialized
    (online quantization of a plain checkpoint loads plain tensors)."""
    assert single["torchao"]["online"] is None, single["torchao"]["online"]
    serialized = single["torchao"]["serialized"]
    assert serialized["type"] == "ValueError", serialized
    assert "quantization='torchao'" in serialized["message"], serialized


def test_an_explicit_budget_bounds_what_is_held_across_files_and_sources(single):
    """Found by a review: each Loader's budget counted only its own tensors, so a model keeping
    weights across two weight sources, or every tensor of a .bin file, held twice an explicit
    budget without an error. Every tensor given and still alive counts now."""
    r = single["held_across"]
    one = r["tensor_bytes"]
    for case in ("parts", "bin", "parts_views"):
        e = r[case]["error"]
        assert e is not None and e["type"] == "BudgetExceededError", (case, r[case])
        assert "keeps" in e["message"] and "alive" in e["message"], e
        assert r[case]["held"] <= 5 * one, (case, r[case])
    for case in ("parts_auto", "parts_fit"):
        assert r[case]["error"] is None, (case, r[case])
        assert r[case]["tensors"] == 8 and r[case]["held"] == 8 * one, (case, r[case])


def test_download_get_all_weights_and_a_draft_model(single):
    assert single["download_file_weights"] is None, single["download_file_weights"]
    assert len(single["all_weights"]) == 21 and "lm_head.weight" in single["all_weights"]
    primary = single["primary"]
    assert primary["served"].endswith("llama-single/model.safetensors"), primary
    assert primary["draft"].endswith("llama-single") and primary["draft"] != primary["served"]


def test_a_missing_tensor_is_refused_as_vllm_refuses_it(single):
    ours, theirs = single["errors"]["missing_tensor"], single["errors"]["missing_tensor_vllm"]
    assert ours == theirs
    assert ours["type"] == "ValueError"
    assert "Following weights were not initialized from checkpoint" in ours["message"]
    assert "model.layers.1.post_attention_layernorm.weight" in ours["message"]


def test_a_model_without_weights_is_an_error_saying_so(single):
    e = single["errors"]["no_safetensors"]
    assert e["type"] == "RuntimeError"
    assert "Cannot find any model weights" in e["message"]
    assert "*.safetensors, *.bin, *.pt" in e["message"]


@pytest.mark.parametrize("case", ["bin", "bin_sharded_budget", "bin_legacy", "pt_weights_option",
                                  "bin_index_weights_option"])
def test_torch_save_weights_are_read_without_unpickling_to_vllms_weights(single, case):
    load = single["torch_loads"][case]
    assert "error" not in load, load["error"]
    assert load["compared"] == 24 and load["differences"] == []
    assert load["stats"]["tensors"] == 21
    assert load["stats"]["bytes"] == single["loads"]["sharded_default"]["model_bytes"]
    assert load["stats"]["cooperative"] is False


def test_vllms_own_loader_reads_the_bin_folder_to_the_same_weights(single):
    # (the reference the torch.save cases are compared with is the safetensors model; vLLM's
    # --load-format auto reading the .bin folder agrees with it)
    assert single["torch_loads"]["bin_vllm_auto"]["differences"] == []


def test_a_byte_flipped_in_a_bin_file_is_an_error_naming_file_and_tensor(single):
    e = single["errors"]["bin_flipped"]
    assert e is not None, "the load of a corrupted .bin succeeded"
    assert e["type"] == "SafetensorError", e
    assert "CRC" in e["message"] and "llama-bin-flipped/pytorch_model.bin" in e["message"]
    assert '(reading tensor "model.norm.weight")' in e["message"]


def test_a_bin_whose_pickle_calls_os_system_is_refused_before_it_runs(single):
    e = single["errors"]["bin_evil"]
    assert e is not None and e["type"] == "UnsupportedError", e  # tensorferry's refusal
    assert "llama-bin-evil/pytorch_model.bin: pytorch_model/data.pkl: refused global " \
        "posix.system at pickle offset" in e["message"], e
    assert single["errors"]["bin_evil_ran"] is False


@pytest.mark.parametrize("case", ["cooperative", "cooperative_unbounded", "plain"])
def test_tensor_parallel_ranks_get_vllms_shards(tp2, case):
    for rank, result in enumerate(tp2):
        assert (result["tp_rank"], result["tp_world"]) == (rank, 2)
        load = result["loads"][case]
        assert load["compared"] == 24
        assert load["differences"] == [], f"rank {rank}"
        assert load["stats"]["cooperative"] == case.startswith("cooperative")
        assert load["stats"]["tensors"] == 21


@pytest.mark.parametrize("case", ["cooperative", "cooperative_unbounded"])
def test_cooperative_ranks_read_every_byte_once(tp2, case):
    stats = [r["loads"][case]["stats"] for r in tp2]
    total = stats[0]["bytes"]
    read = [s["bytes_read"] for s in stats]
    assert sum(read) == total
    assert all(0 < r < total for r in read)
    if case == "cooperative_unbounded":  # one round: the byte-balanced split
        assert max(read) - min(read) <= 1024
    else:  # rounds of at most half the budget
        assert all(s["peak_held_bytes"] <= s["budget"] // 2 for s in stats)
        assert all(s["rounds"] > 1 for s in stats)
    plain = [r["loads"]["plain"]["stats"]["bytes_read"] for r in tp2]
    assert plain == [total, total]


# --- weights in object storage (the `weights` option), against SeaweedFS ------------------------


REMOTE_PREFIX = "vllm-tests/llama-sharded"


@pytest.fixture(scope="session")
def remote(vllm_env, single, seaweed):  # after `single`: it writes the checkpoints
    """The remote scenario: weights from SeaweedFS, and (the "hub" case) from a model hub on
    loopback by an hf:// path that the (empty) local hub cache lacks."""
    from hub_server import ModelHub
    sharded = os.path.join(vllm_env["work"], "llama-sharded")
    seaweed.upload_dir(seaweed.BUCKET, REMOTE_PREFIX, sharded)
    env = _env(vllm_env["path"])
    env.update(seaweed.env())
    env["TF_TEST_PORT"] = str(_free_port())
    with ModelHub() as hub:
        hub.add_repo("org/llama", sharded)
        # Online, with the hub on loopback as HF_ENDPOINT: nothing leaves the machine.
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.pop(name)
        env.update(HF_ENDPOINT=hub.endpoint, TF_TEST_HF_PATH="hf://org/llama",
                   TF_TEST_HF_ID="org/llama",
                   HF_HUB_CACHE=os.path.join(vllm_env["work"], "empty-hf-cache"))
        r = subprocess.run([VLLM_PYTHON, SCENARIOS, "remote", vllm_env["work"],
                            seaweed.url(REMOTE_PREFIX)], env=env, capture_output=True, text=True,
                           timeout=900)
        hub_files = sorted({x[3] for x in hub.log if x[0] == "resolve"})
        weights = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    result = _result(r.stdout + r.stderr, "vllm_scenarios.py remote")
    result["hub_files"] = hub_files
    result["weights"] = weights
    return result


@pytest.fixture(scope="session")
def remote_tp2(vllm_env, remote, seaweed):  # after `remote`: the upload, the config-only folder
    return _tensor_parallel(vllm_env, 2, seaweed.url(REMOTE_PREFIX), seaweed.env())


@pytest.mark.parametrize("case", ["prefix", "index", "cached", "hub", "hub_id", "hub_id_offline",
                                  "hub_id_download"])
def test_weights_read_from_object_storage_are_vllms_weights(remote, case):
    # vLLM's --model holds only config.json: every weight came from the bucket (or the hub).
    load = remote["loads"][case]
    assert load["compared"] == 24
    assert load["differences"] == []
    assert load["stats"]["tensors"] == 21
    assert load["stats"]["bytes_read"] == load["stats"]["bytes"]
    if case in ("prefix", "hub", "hub_id", "hub_id_offline", "hub_id_download"):
        assert load["stats"]["rounds"] > 1 and load["stats"]["peak_held_bytes"] <= 131072
    if case == "hub":  # streamed from the hub: the index and every shard asked of it
        assert "model.safetensors.index.json" in remote["hub_files"]
        assert sum(f.endswith(".safetensors") for f in remote["hub_files"]) >= 2


def test_a_hub_id_is_streamed_into_the_hub_cache_then_read_from_it_offline(remote):
    """--model org/llama, not in the local hub cache: the weights streamed from the hub (the
    `hub` option's default) and kept in the hub cache, where the next start finds them with the
    hub offline; hub="download" leaves what vLLM's own download leaves."""
    want = ["config.json", "model.safetensors.index.json"] + remote["weights"]
    for case in ("hub_id", "hub_id_offline", "hub_id_download"):
        snapshot = remote["loads"][case]["snapshot"]
        assert [f for f in snapshot if f in want] == sorted(want), (case, snapshot)


def test_weights_from_object_storage_fill_the_object_cache(remote):
    assert len(remote["cached_files"]) >= 2  # the shards the open's first GET did not hold whole


@pytest.mark.parametrize("case", ["cooperative", "plain"])
def test_tensor_parallel_ranks_get_vllms_shards_from_object_storage(remote_tp2, case):
    for rank, result in enumerate(remote_tp2):
        load = result["loads"][case]
        assert load["differences"] == [], f"rank {rank}"
        assert load["compared"] == 24 and load["stats"]["tensors"] == 21
    read = [r["loads"][case]["stats"]["bytes_read"] for r in remote_tp2]
    total = remote_tp2[0]["loads"][case]["stats"]["bytes"]
    if case == "cooperative":  # the group fetched each byte from the bucket once
        assert sum(read) == total and all(0 < r < total for r in read)
    else:
        assert read == [total, total]


@pytest.mark.parametrize("how", ["hf_path", "hub_id"])
def test_tensor_parallel_ranks_read_one_commit_of_a_moving_branch(vllm_env, single, how):
    """--model a hub id (or the `weights` option an hf:// path) of a branch that moves to another
    commit, with other weights, at every question asked of the hub's API: every rank reads the
    commit the first rank found (one question per load, not one per rank), plain and
    cooperative."""
    from hub_server import ModelHub
    work = vllm_env["work"]
    with ModelHub() as hub:
        commits = [hub.add_repo("org/moving", os.path.join(work, "llama-newer")),
                   hub.add_repo("org/moving", os.path.join(work, "llama-single"))]

        def move():  # after each answer of the API: main names the other commit
            hub._refs[("org/moving", "main")] = commits[0] \
                if hub._refs[("org/moving", "main")] == commits[1] else commits[1]

        hub.on_api = move
        # The hf:// path with nothing kept in the hub cache: each load asks the hub (the count
        # below). The hub id as by default: the first rank keeps what it streams in the hub
        # cache, where the other rank (same host) may find the commit it was sent.
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None,
               "HF_HUB_CACHE": os.path.join(work, f"moving-hf-cache-{how}"),
               "TENSORFERRY_OBJECT_HUB_CACHE": "0" if how == "hf_path" else None}
        shutil.rmtree(env["HF_HUB_CACHE"], ignore_errors=True)
        path = "hf://org/moving" if how == "hf_path" else "org/moving"
        results = _tensor_parallel(vllm_env, 2, path, env, scenario="tp_hub")
        questions = [x for x in hub.log if x[0] == "api"]
    for case in ("plain", "cooperative"):
        matches = [r["loads"][case]["matches"] for r in results]
        assert matches[0] in (["old"], ["new"]) and matches[1] == matches[0], (case, matches)
    if how == "hf_path":  # vLLM asks nothing of the hub (its --model is a local folder)
        assert len(questions) == 2, questions  # one per load, by the first rank


def test_weights_option_errors_name_what_is_wrong(remote):
    e = remote["errors"]
    assert e["missing"]["type"] in ("NotFoundError", "FileNotFoundError")
    assert "vllm-tests/llama-sharded-nothing-here" in e["missing"]["message"]
    assert e["missing_local"]["type"] == "FileNotFoundError"
    assert "['weights']" in e["missing_local"]["message"]
    assert "'/nonexistent/llama' does not exist" in e["missing_local"]["message"]
    # A relative path that is not shaped like a hub id is a path too.
    assert e["missing_relative"]["type"] == "FileNotFoundError"
    assert "'ckpts/llama/' does not exist" in e["missing_relative"]["message"]
    assert e["az"]["type"] == "ValueError"  # gs:// is read (test_object_store_gcs.py); az:// not
    assert "['weights']" in e["az"]["message"] and "not az://" in e["az"]["message"]
    assert e["bad_storage_option"]["type"] == "ValueError"
    assert "unknown setting 'endpoint'" in e["bad_storage_option"]["message"]


def test_a_hub_id_is_streamed_as_its_hf_path_unless_vllms_download_applies(tmp_path,
                                                                         monkeypatch):
    from tensorferry.vllm import hub_path, parse_options
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    monkeypatch.chdir(tmp_path)
    stream = parse_options({})
    assert stream.hub == "stream"
    assert hub_path("org/llama", None, None, stream) == "hf://org/llama"
    assert hub_path("gpt2", "main", None, stream, None, ["original/**/*"]) == "hf://gpt2"
    assert hub_path("org/llama", "refs/pr/1", "sub/", stream) == "hf://org/llama@refs%2Fpr%2F1/sub"
    assert hub_path("org/llama", "0" * 40, None, stream) == "hf://org/llama@" + "0" * 40
    # vLLM's download: asked for, a download folder, other ignore patterns, ModelScope.
    assert hub_path("org/llama", None, None, parse_options({"hub": "download"})) is None
    assert hub_path("org/llama", None, None, stream, str(tmp_path)) is None
    assert hub_path("org/llama", None, None, stream, None, ["*.pt"]) is None
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "True")
    assert hub_path("org/llama", None, None, stream) is None
    monkeypatch.delenv("VLLM_USE_MODELSCOPE")
    # Not hub ids: paths, URLs, a folder that exists under the name.
    for name in ("/models/llama", "./llama", "a/b/c", "org/../x", "s3://b/k", "hf://org/llama",
                 "org/ llama", "orgé/llama", ""):
        assert hub_path(name, None, None, stream) is None, name
    (tmp_path / "org" / "llama").mkdir(parents=True)
    assert hub_path("org/llama", None, None, stream) is None
    with pytest.raises(ValueError, match="'hub'.*'upload' is not one of 'stream', 'download'"):
        parse_options({"hub": "upload"})


def test_matching_files_takes_the_first_pattern_that_matches():
    from tensorferry.vllm import matching_files
    shards = ["https://h/o/n/resolve/" + "a" * 40 + f"/model-0000{i}-of-00002.safetensors"
              for i in (1, 2)]
    assert matching_files(shards, ["consolidated*.safetensors"]) == []  # vLLM's download, then
    assert matching_files(shards, ["consolidated*.safetensors", "*.safetensors"]) == shards
    assert matching_files(shards, ["model-00002*"]) == shards[1:]


def test_plan_remote_keeps_the_url_unless_patterns_leave_files_out():
    from tensorferry.vllm import Part, plan_remote
    url = "s3://b/m"
    files = [f"{url}/model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert plan_remote(url, files) == [Part(url, None)]
    assert plan_remote(url, files, ["*.safetensors"]) == [Part(url, None)]
    assert plan_remote(url, files, ["model-00002-*.safetensors", "*.safetensors"]) == \
        [Part(files[1], None)]
    with pytest.raises(RuntimeError, match="matching the model's allow_patterns_overrides"):
        plan_remote(url, files, ["consolidated*.safetensors"])

"""Cooperative tensor-parallel loading over torch.distributed (gloo, CPU): each rank's tensors
equal torch.tensor_split slices of the full tensors (per fused part), byte for byte, and the ranks
together read every byte once."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

# Fused parts of "*.qkv.weight" along dim 0.
QKV_PARTS = [40, 12, 12]
SPEC = {
    "rules": [
        {"pattern": "*.qkv.weight", "split": 0, "parts": QKV_PARTS},
        {"pattern": "*.q_proj.*", "split": 0},
        {"pattern": "*.o_proj.weight", "split": 1},
        {"pattern": "embed.weight", "split": 0},
    ]
}


def _rule(name):
    if name.endswith(".qkv.weight"):
        return 0, QKV_PARTS
    if ".q_proj." in name or name == "embed.weight":
        return 0, None
    if name.endswith(".o_proj.weight"):
        return 1, None
    return None, None


def _expected(full, name, rank, world):
    dim, parts = _rule(name)
    if dim is None:
        return full
    if parts is None:
        return torch.tensor_split(full, world, dim)[rank]
    pieces = [torch.tensor_split(p, world, dim)[rank] for p in torch.split(full, parts, dim)]
    return torch.cat(pieces, dim)


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _make_checkpoint(directory):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(5)
    tensors = {"embed.weight": torch.randn(67, 12, generator=g).to(torch.bfloat16)}
    for layer in range(3):
        p = f"layers.{layer}."
        tensors[p + "q_proj.weight"] = torch.randn(37, 20, generator=g)
        tensors[p + "q_proj.bias"] = torch.randint(-100, 100, (29,), generator=g).to(torch.int8)
        tensors[p + "qkv.weight"] = torch.randn(64, 9, generator=g).to(torch.float16)
        tensors[p + "o_proj.weight"] = torch.randn(20, 37, generator=g).to(torch.bfloat16)
        tensors[p + "norm.weight"] = torch.randn(20, generator=g)
        tensors[p + "step"] = torch.tensor(layer, dtype=torch.int64)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.uint8)
    # Two files with an index, so reads span files.
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, os.path.join(directory, fname))
        weight_map.update({n: fname for n in chunk})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


def _rank_main(rank, world, path, init, configs, results):
    import tensorferry
    from safetensors.torch import load_file
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        pg = dist.new_group(list(range(world)))
        full = {}
        for fname in sorted(os.listdir(path)):
            if fname.endswith(".safetensors"):
                full.update(load_file(os.path.join(path, fname)))  # the reference reader
        # The independent per-rank sliced path.
        independent = tensorferry.Loader(path, tp_rank=rank, tp_size=world,
                                         shard_rules=json.dumps(SPEC)).load()
        for i, (budget, engine, exchange) in enumerate(configs):
            loader = tensorferry.Loader(path, budget=budget, engine=engine, tp_rank=rank,
                                        tp_size=world, shard_rules=json.dumps(SPEC),
                                        process_group=pg, coop_exchange=exchange)
            got = loader.load()
            stats = loader.cooperative_stats
            assert list(got) == list(loader.keys()) == list(independent)
            for name, t in got.items():
                want = _expected(full[name], name, rank, world)
                assert t.dtype == want.dtype, name
                assert list(t.shape) == list(want.shape), (name, t.shape, want.shape)
                assert _bytes(t) == _bytes(want), name
                assert _bytes(t) == _bytes(independent[name]), name
                # A storage of its own, as every loaded tensor (docs/python.md): not this rank's
                # rows of a tensor it read whole, nor a slice of a round's receive buffer.
                assert t.untyped_storage().nbytes() == t.nbytes, (name, exchange)
            # safetensors' save_file refuses tensors that share memory.
            from safetensors.torch import save as ref_save
            ref_save(dict(got))
            assert loader.stats.bytes_read == stats["bytes_read"]
            # The time inside the exchanges' collectives is part of the exchange's time.
            assert 0 <= stats["network_seconds"] <= stats["exchange_seconds"]
            if stats["bytes_sent"] or stats["bytes_received"]:
                assert stats["network_seconds"] > 0
            read = torch.tensor([stats["bytes_read"]], dtype=torch.int64)
            dist.all_reduce(read)
            total = sum(t.nbytes for t in full.values())
            if exchange != "none":
                # Every byte read once (auto on one host exchanges whatever saves reads).
                assert read.item() == total, (read.item(), total)
            else:
                # Each rank reads its own slices and every replicated tensor.
                replicated = sum(t.nbytes for n, t in full.items() if _rule(n)[0] is None)
                assert read.item() == total + (world - 1) * replicated, (read.item(), total)
            with open(f"{results}.{i}.{rank}", "w") as f:
                json.dump(stats, f)
            # Round by round: the same tensors as load(), one batch per round, in order.
            streamed, indices = {}, []
            for batch in loader.iter_batches():
                indices.append(batch.index)
                assert batch.count == len(batch.tensors) and batch.device == "cpu"
                assert batch.bytes == sum(t.nbytes for t in batch.tensors.values())
                streamed.update(batch.tensors)
            assert indices == list(range(stats["rounds"])), (indices, stats["rounds"])
            assert loader.stats.batches == stats["rounds"]
            assert loader.stats.bytes_read == stats["bytes_read"]
            pairs = list(loader.iter_tensors())
            assert sorted(streamed) == sorted(n for n, _ in pairs) == sorted(got)
            for name, t in pairs:
                assert _bytes(t) == _bytes(got[name]) == _bytes(streamed[name]), name
            seen = []
            loader.stream(lambda b: seen.append(sorted(b.tensors)))
            assert sum(len(names) for names in seen) == len(got)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cooperative_gloo_matches_tensor_split(tmp_path, world):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _make_checkpoint(str(ckpt))
    # Everything exchanged in several rounds (a budget far below a rank's share and below the
    # larger tensors, which are then split among the readers by rows: dim-0, fused dim-0 and
    # dim-1 ones) with the copying engine; the cost model's choice in one round with the default
    # engine; nothing exchanged.
    configs = [(1000, "pread", "all"), (None, None, None), (None, None, "none")]
    results = str(tmp_path / "stats")
    mp.spawn(_rank_main, args=(world, str(ckpt), f"file://{tmp_path}/init", configs, results),
             nprocs=world, join=True)
    for i, (budget, _, exchange) in enumerate(configs):
        stats = []
        for r in range(world):
            with open(f"{results}.{i}.{r}") as f:
                stats.append(json.load(f))
        if budget:
            assert all(s["rounds"] >= 2 for s in stats if s["bytes_read"]), stats
        if exchange == "all":
            assert all(s["local_tensors"] == 0 for s in stats), stats
        if exchange == "none" or (exchange is None and world == 1):
            # Nothing exchanged: asked for, or the model's choice for one rank (no read saved).
            assert all(s["bytes_sent"] == 0 and s["exchanged_tensors"] == 0 for s in stats), stats
        if world == 1:
            assert all(s["bytes_sent"] == 0 for s in stats), stats
        if exchange is None and world > 1:
            # One host: the network is free, so everything that saves reads is exchanged (the
            # fused and dim-1 slices, the replicated tensors) and exact dim-0 slices stay local.
            assert all(s["exchanged_tensors"] > 0 and s["local_tensors"] > 0 for s in stats), stats
        assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)


def test_process_group_needs_matching_tp_arguments(tmp_path):
    import tensorferry
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _make_checkpoint(str(ckpt))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        with pytest.raises(tensorferry.InvalidArgumentError, match="tp_rank=0, tp_size=2"):
            tensorferry.Loader(str(ckpt), tp_rank=0, tp_size=2, process_group=dist.group.WORLD)
        with pytest.raises(tensorferry.InvalidArgumentError, match="needs tp_rank and tp_size"):
            tensorferry.Loader(str(ckpt), process_group=dist.group.WORLD)
        # A tied alias the files lack: the target is read once and the alias shares it, in the
        # independent Loader's order.
        rules = dict(SPEC, ties={"lm": "embed.weight"})
        coop = tensorferry.Loader(str(ckpt), tp_rank=0, tp_size=1, process_group=dist.group.WORLD,
                                  shard_rules=rules).load()
        alone = tensorferry.Loader(str(ckpt), tp_rank=0, tp_size=1, shard_rules=rules).load()
        assert list(coop) == list(alone)
        assert "lm" in coop
        assert coop["lm"].data_ptr() == coop["embed.weight"].data_ptr()
        # Round by round too: the alias comes with its target, sharing its memory.
        streamed = dict(tensorferry.Loader(str(ckpt), tp_rank=0, tp_size=1,
                                           process_group=dist.group.WORLD,
                                           shard_rules=rules).iter_tensors())
        assert sorted(streamed) == sorted(alone)
        assert streamed["lm"].data_ptr() == streamed["embed.weight"].data_ptr()
        for name in coop:
            assert _bytes(coop[name]) == _bytes(alone[name]), name
    finally:
        dist.destroy_process_group()


def test_cooperative_rounds_follow_tensorferry_budget(tmp_path, monkeypatch):
    """TENSORFERRY_BUDGET sizes the rounds as budget= does; the readers of each round hold no
    budget of their own (under the variable's 1000 bytes they would refuse every round larger
    than it, and the larger tensors are)."""
    import tensorferry
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    full = _make_checkpoint(str(ckpt))
    assert max(t.nbytes for t in full.values()) > 1000
    monkeypatch.setenv("TENSORFERRY_BUDGET", "1000")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        loader = tensorferry.Loader(str(ckpt), tp_rank=0, tp_size=1, shard_rules=json.dumps(SPEC),
                                    process_group=dist.group.WORLD, coop_exchange="all")
        got = loader.load()
        assert loader.cooperative_stats["rounds"] >= 2, loader.cooperative_stats
        assert sorted(got) == sorted(full)
        for name, t in got.items():
            assert _bytes(t) == _bytes(full[name]), name
    finally:
        dist.destroy_process_group()


def test_assign_readers_is_the_cpp_rule():
    import tensorferry._core as core
    sizes = [5, 1, 1, 1, 1, 9, 2, 2, 3, 0, 4]
    assert core.assign_readers(sizes, 1) == [0] * len(sizes)
    readers = core.assign_readers(sizes, 3)
    assert readers == sorted(readers) and set(readers) == {0, 1, 2}
    loads = [sum(s for s, r in zip(sizes, readers) if r == q) for q in range(3)]
    assert max(loads) == 11
    # Rank 0 reads 12 bytes besides (its pieces): the runs minimize the most a rank reads in all,
    # as the best of every contiguous assignment does.
    import itertools
    loaded = [12, 0, 0]
    readers = core.assign_readers(sizes, 3, loaded)

    def most(assignment):
        return max(loaded[q] + sum(s for s, r in zip(sizes, assignment) if r == q)
                   for q in range(3))
    best = min(most(a) for a in itertools.combinations_with_replacement(range(3), len(sizes)))
    assert readers == sorted(readers) and most(readers) == best, readers


def _stalled_main(rank, path, init, results, timeout_option=True, polled=False):
    import time
    import traceback

    import tensorferry
    import tensorferry._distributed
    if polled:  # gloo waited for as NCCL is: Work.is_completed() polled against the deadline
        tensorferry._distributed._POLLED_BACKENDS = ("gloo",)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:
        time.sleep(8)  # never takes part: a hung rank, as far as rank 0 can tell
        dist.destroy_process_group()
        return
    start = time.monotonic()
    try:
        loader = tensorferry.Loader(path, tp_rank=0, tp_size=2, shard_rules=json.dumps(SPEC),
                                    process_group=dist.group.WORLD,
                                    coop_timeout_ms=1500 if timeout_option else None)
        loader.load()
        outcome = {"error": None}
    except Exception as e:  # the test checks the type
        outcome = {"error": str(e), "type": type(e).__name__, "trace": traceback.format_exc()}
    outcome["seconds"] = time.monotonic() - start
    with open(results, "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the group is unusable after a failed collective: no orderly teardown


@pytest.mark.parametrize("given_as", ["argument", "environment", "argument, polled"])
def test_cooperative_gloo_times_out_naming_rank_and_step(tmp_path, monkeypatch, given_as):
    """A rank that never takes part: the other gives up after coop_timeout_ms (the argument, or
    TENSORFERRY_COOP_TIMEOUT_MS) with an OSError naming itself, the step and the rank that never
    reached it, instead of waiting forever; also when the wait polls Work.is_completed() (as for
    NCCL, whose Work.wait(timeout) does not block)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _make_checkpoint(str(ckpt))
    results = str(tmp_path / "outcome.json")
    if given_as == "environment":
        monkeypatch.setenv("TENSORFERRY_COOP_TIMEOUT_MS", "1500")
    mp.spawn(_stalled_main,
             args=(str(ckpt), f"file://{tmp_path}/init", results, given_as != "environment",
                   given_as.endswith("polled")),
             nprocs=2, join=True)
    with open(results) as f:
        outcome = json.load(f)
    assert outcome["error"] is not None and outcome["type"] == "OSError", outcome
    # The first collective: the all-gather of every rank's host.
    assert "cooperative load: rank 0 gave up in the start (learning every rank's host)" in \
        outcome["error"], outcome
    # The roll call in the store: rank 1 never set its key of that step.
    assert "(rank 1 never reached this step (died or hangs?))" in outcome["error"], outcome
    assert outcome["seconds"] < 8, outcome


def _reloads_main(rank, path, init, results):
    import hashlib
    import time

    import tensorferry
    import tensorferry._distributed
    # (every collective waited for by polling, as NCCL's are: loads that succeed that way)
    tensorferry._distributed._POLLED_BACKENDS = ("gloo",)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        store = dist.distributed_c10d._get_default_store()
        digest = hashlib.sha256(b"0,1").hexdigest()[:16]

        def keys(load):  # the steps whose roll-call key of `load` is in the store
            return [k for k in range(1, 200)
                    if store.check([f"tensorferry/roll/{digest}/{load}/{k}"])]
        seen = []
        for _ in range(3):
            loader = tensorferry.Loader(path, tp_rank=rank, tp_size=2,
                                        shard_rules=json.dumps(SPEC),
                                        process_group=dist.group.WORLD)
            loader.load()
            loader.close()
            dist.barrier()
            deadline = time.monotonic() + 5  # the roll call's thread deletes in the background
            while True:
                now = [keys(load) for load in (1, 2, 3)]
                if sum(map(len, now)) <= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            seen.append(now)
            dist.barrier()
        with open(f"{results}.{rank}", "w") as f:
            json.dump({"seen": seen}, f)
    finally:
        dist.destroy_process_group()


def test_cooperative_gloo_reloads_leave_two_roll_call_keys(tmp_path):
    """A process that loads again and again keeps at most the last load's two roll-call keys in
    the store: the next load deletes them once every rank has left the earlier one. (The
    collectives are waited for by polling Work.is_completed(), NCCL's way here.)"""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _make_checkpoint(str(ckpt))
    results = str(tmp_path / "outcome")
    mp.spawn(_reloads_main, args=(str(ckpt), f"file://{tmp_path}/init", results), nprocs=2,
             join=True)
    for outcome in _outcomes(results, 2):
        first, second, third = outcome["seen"]
        steps = first[0]
        assert len(steps) == 2 and steps[1] == steps[0] + 1, outcome
        assert second[0] == [] and len(second[1]) == 2, outcome
        assert third[0] == [] and third[1] == [] and third[2] == second[1], outcome


def _corrupt_round_main(rank, world, path, init, results):
    import tensorferry
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        pg = dist.new_group(list(range(world)))
        # Every tensor replicated and exchanged, one per rank and round (the budget holds one).
        loader = tensorferry.Loader(path, budget=5000, tp_rank=rank, tp_size=world,
                                    shard_rules="none", process_group=pg, coop_exchange="all")
        batches, names = [], []
        outcome = {"error": None}
        try:
            for batch in loader.iter_batches():
                batches.append(batch.index)
                names.extend(batch.tensors)
        except Exception as e:  # the test checks the type and message
            outcome = {"error": str(e), "type": type(e).__name__}
        outcome.update({"batches": batches, "names": names})
        with open(f"{results}.{rank}", "w") as f:
            json.dump(outcome, f)
    finally:
        dist.destroy_process_group()


def _unallocatable_main(rank, path, init, results, where):
    import time

    import tensorferry
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:
        # Rank 1 cannot allocate (out of memory), after its reads: the exchange's buffers
        # (torch.empty in _exchange), or the copy of a tensor it keeps (torch.empty_like in _own).
        caller, function = where
        real = getattr(torch, function)

        def failing(*args, **kwargs):
            if sys._getframe(1).f_code.co_name == caller:
                raise RuntimeError("injected: out of memory for the exchange")
            return real(*args, **kwargs)
        setattr(torch, function, failing)
    start = time.monotonic()
    try:
        loader = tensorferry.Loader(path, tp_rank=rank, tp_size=2, shard_rules="none",
                                    process_group=dist.group.WORLD, coop_exchange="all",
                                    coop_timeout_ms=60000)
        loader.load()
        outcome = {"error": None}
    except Exception as e:  # the test checks the message
        outcome = {"error": str(e), "type": type(e).__name__}
    outcome["seconds"] = time.monotonic() - start
    with open(f"{results}.{rank}", "w") as f:
        json.dump(outcome, f)
    os._exit(0)


@pytest.mark.parametrize("where", [("_exchange", "empty"), ("_own", "empty_like")])
def test_a_rank_that_cannot_allocate_the_exchange_stops_every_rank(tmp_path, where):
    """A rank whose exchange buffers cannot be allocated (after every rank's reads were agreed
    on) says so to the others, which stop at once naming it, instead of waiting in the exchange
    until the timeout (60 s here)."""
    import tensorferry.torch
    path = str(tmp_path / "m.safetensors")
    g = torch.Generator().manual_seed(9)
    tensorferry.torch.save_file({n: torch.randn(8, 8, generator=g) for n in "abcd"}, path)
    results = str(tmp_path / "outcome")
    mp.spawn(_unallocatable_main, args=(path, f"file://{tmp_path}/init", results, where),
             nprocs=2, join=True)
    outcomes = _outcomes(results, 2)
    for r, o in enumerate(outcomes):
        assert o["seconds"] < 30, (r, o)
    assert "injected: out of memory for the exchange" in outcomes[1]["error"], outcomes[1]
    assert "rank 1 failed reading its share" in outcomes[0]["error"], outcomes[0]


def _outcomes(results, world):
    """What each rank of a spawned test wrote to `results`.<rank> (JSON), in rank order."""
    outcomes = []
    for r in range(world):
        with open(f"{results}.{r}") as f:
            outcomes.append(json.load(f))
    return outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_cooperative_gloo_corrupt_tensor_in_a_later_round(tmp_path, world):
    """Rounds are read ahead (round k + 1 while round k is exchanged): a corrupt tensor in the
    last round fails its reader with the checksum error naming it and every other rank with an
    error naming that rank, after the earlier rounds were delivered (identically on every rank),
    and no rank hands out the corrupt tensor."""
    import tensorferry.torch
    from test_integrity import corrupt

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    g = torch.Generator().manual_seed(11)
    tensors = {f"t{i:02d}": torch.randn(1000, generator=g) for i in range(4 * world)}
    path = str(ckpt / "model.safetensors")
    tensorferry.torch.save_file(tensors, path)  # with checksums
    bad = sorted(tensors)[-1]  # read in the last round
    corrupt(path, bad)
    results = str(tmp_path / "outcome")
    mp.spawn(_corrupt_round_main,
             args=(world, path, f"file://{tmp_path}/init", results), nprocs=world, join=True)
    outcomes = _outcomes(results, world)
    failing = [r for r, o in enumerate(outcomes) if bad in (o["error"] or "")]
    assert len(failing) == 1, outcomes
    culprit = failing[0]
    assert "checksum" in outcomes[culprit]["error"], outcomes[culprit]
    for r, o in enumerate(outcomes):
        assert o["error"] is not None, (r, o)
        assert bad not in o["names"], (r, o)
        # Four rounds, one tensor per rank each: the first three arrived everywhere.
        assert o["batches"] == [0, 1, 2], (r, o)
        if r != culprit:
            assert o["type"] == "SafetensorError", (r, o)
            assert f"cooperative load: rank {culprit} failed reading its share" in o["error"], o


def _disagreeing_main(rank, paths, init, specs, results, options=({}, {})):
    import time

    import tensorferry
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    start = time.monotonic()
    try:
        loader = tensorferry.Loader(paths[rank], tp_rank=rank, tp_size=2, shard_rules=specs[rank],
                                    process_group=dist.group.WORLD, coop_exchange="all",
                                    coop_timeout_ms=60000, **options[rank])
        got = loader.load()
        outcome = {"error": None, "sums": {n: float(t.sum()) for n, t in got.items()}}
    except Exception as e:  # the test checks the type and message
        outcome = {"error": str(e), "type": type(e).__name__}
    outcome["seconds"] = time.monotonic() - start
    with open(f"{results}.{rank}", "w") as f:
        json.dump(outcome, f)
    os._exit(0)


@pytest.mark.parametrize("case", ["rows_vs_columns", "one_rank_cannot_plan", "stale_copy",
                                  "shifted_copy"])
def test_ranks_that_plan_differently_fail_at_once_and_say_so(tmp_path, case):
    """Rules that split square tensors along another dimension on each rank give equal byte
    counts (an exchange would hand each rank another's bytes); a rule only one rank cannot apply
    would leave the other waiting in a collective; a copy of the checkpoint with the same layout
    and other bytes on one rank (a stale copy) plans alike, and only the checksum records tell it
    apart; a copy without records whose header is longer (metadata: every tensor at another
    offset) and one tensor other bytes was loaded, each rank's rows from another version (the
    ranks compared no files or offsets). Both ranks fail at once, saying which."""
    import tensorferry.torch
    path = str(tmp_path / "m.safetensors")
    g = torch.Generator().manual_seed(3)
    tensorferry.torch.save_file({n: torch.randn(8, 8, generator=g) for n in "abcd"}, path)
    paths = [path, path]
    rows = json.dumps({"rules": [{"pattern": "*", "split": 0}]})
    other = json.dumps({"rules": [{"pattern": "*", "split": 1 if case == "rows_vs_columns"
                                   else 2}]})
    if case == "stale_copy":
        paths[1] = str(tmp_path / "stale.safetensors")
        tensorferry.torch.save_file({n: torch.randn(8, 8, generator=g) for n in "abcd"},
                                    paths[1])
        other = rows
    if case == "shifted_copy":
        import safetensors.torch
        g = torch.Generator().manual_seed(3)
        tensors = {n: torch.randn(8, 8, generator=g) for n in "abcd"}
        safetensors.torch.save_file(tensors, path)  # no checksum records
        tensors["b"] = tensors["b"] + 1
        paths[1] = str(tmp_path / "shifted.safetensors")
        safetensors.torch.save_file(tensors, paths[1], metadata={"note": "x" * 100})
        other = rows
    results = str(tmp_path / "outcome")
    mp.spawn(_disagreeing_main, args=(paths, f"file://{tmp_path}/init", [rows, other], results),
             nprocs=2, join=True)
    outcomes = _outcomes(results, 2)
    for r, o in enumerate(outcomes):
        assert o["error"] is not None, (r, o)
        assert o["seconds"] < 30, (r, o)
    if case in ("rows_vs_columns", "stale_copy", "shifted_copy"):
        for o in outcomes:
            assert o["type"] == "InvalidArgumentError", o
            assert "disagree on planning (slices and options)" in o["error"], o
    else:
        assert outcomes[1]["type"] == "InvalidArgumentError", outcomes[1]
        assert "cooperative load: rank 1 failed planning" in outcomes[0]["error"], outcomes[0]


@pytest.mark.parametrize("case", ["spelled_differently", "other_budget", "other_verify"])
def test_ranks_compare_their_options_as_parsed(tmp_path, case):
    """The ranks compare the options they plan with as parsed, not as written: a storage rate of
    "2GB" on one rank and 2000000000 on the other is one rate, "64KiB" and 65536 one shard_max_gap
    (which a cooperative load refused before: the core wanted tp_rank and tp_size beside it), and
    the load goes on (each rank's own slice); two budgets that differ (rounds planned apart), or
    two verify settings (pieces cut on other granules), fail at once on both ranks."""
    import tensorferry.torch
    path = str(tmp_path / "m.safetensors")
    g = torch.Generator().manual_seed(5)
    tensors = {n: torch.randn(8, 8, generator=g) for n in "abcd"}
    tensorferry.torch.save_file(tensors, path)
    rows = json.dumps({"rules": [{"pattern": "*", "split": 0}]})
    options = [{"budget": "64MB", "coop_storage_rate": "2GB", "shard_max_gap": "64KiB"},
               {"budget": 32000000 if case == "other_budget" else 64000000,
                "coop_storage_rate": 2000000000, "shard_max_gap": 65536}]
    if case == "other_verify":  # the pieces' granule and the records compared differ
        options[0]["verify"], options[1]["verify"] = "on", "off"
    results = str(tmp_path / "outcome")
    mp.spawn(_disagreeing_main,
             args=([path, path], f"file://{tmp_path}/init", [rows, rows], results, options),
             nprocs=2, join=True)
    outcomes = _outcomes(results, 2)
    for r, o in enumerate(outcomes):
        assert o["seconds"] < 30, (r, o)
        if case == "spelled_differently":
            assert o["error"] is None, (r, o)
            want = {n: float(t[4 * r:4 * r + 4].sum()) for n, t in tensors.items()}
            assert o["sums"] == pytest.approx(want), (r, o)
        else:
            assert o["type"] == "InvalidArgumentError", (r, o)
            assert "disagree on planning (slices and options)" in o["error"], (r, o)


def _split_corrupt_main(rank, world, path, init, results):
    import tensorferry
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        loader = tensorferry.Loader(path, tp_rank=rank, tp_size=world, shard_rules="none",
                                    process_group=dist.group.WORLD, coop_exchange="all",
                                    coop_timeout_ms=60000)
        out = loader.load()
        outcome = {"error": None, "bytes_read": loader.cooperative_stats["bytes_read"],
                   "tensors": {n: t.numpy().tobytes().hex() for n, t in out.items()}}
    except Exception as e:  # the test checks the message
        outcome = {"error": str(e), "type": type(e).__name__}
    with open(f"{results}.{rank}", "w") as f:
        json.dump(outcome, f)
    os._exit(0)


@pytest.mark.parametrize("world", [2, 3])
def test_cooperative_gloo_checks_a_tensor_split_among_the_readers(tmp_path, world):
    """A replicated tensor over half the exchanged bytes is split among the readers by rows, and
    a piece's reader checks the checksum chunks the piece holds whole: pieces that would cut the
    tensor's one chunk are not made (it is read whole), so a corrupt byte is found, not handed
    out (it was, silently, with pieces smaller than a chunk)."""
    import tensorferry.torch
    from test_integrity import corrupt

    path = str(tmp_path / "m.safetensors")
    g = torch.Generator().manual_seed(5)
    tensorferry.torch.save_file({"norm.weight": torch.randn(16384, generator=g),
                                 "bias": torch.randn(16, generator=g)}, path)  # checksums
    corrupt(path, "norm.weight")
    results = str(tmp_path / "outcome")
    mp.spawn(_split_corrupt_main, args=(world, path, f"file://{tmp_path}/init", results),
             nprocs=world, join=True)
    outcomes = _outcomes(results, world)
    assert all(o["error"] is not None for o in outcomes), outcomes
    assert any("checksum" in o["error"] and "norm.weight" in o["error"] for o in outcomes), outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_cooperative_gloo_cuts_pieces_on_checksum_chunks(tmp_path, world):
    """A tensor split among the readers is cut in units of rows that fill whole checksum chunks
    (rows of 40 bytes, chunks of 4 KiB recorded by the manifest: units of 512 rows), so every
    piece starts on a chunk and its reader checks the chunks it holds: the ranks share the reads
    (each reads about 1/world of it, where single-row pieces would have cut chunks and the tensor
    was read whole by one rank), the bytes are the file's, and a corrupt byte in the last piece is
    found."""
    from safetensors.torch import save_file as ref_save_file
    from conftest import CLI

    g = torch.Generator().manual_seed(11)
    tensors = {"w": torch.randn(3000, 10, generator=g), "bias": torch.arange(6.0)}
    path = str(tmp_path / "m.safetensors")
    ref_save_file(tensors, path)  # no embedded records: the manifest's chunks count
    subprocess.run([CLI, "checksum", str(tmp_path), "--chunk-size", "4KiB"], check=True,
                   capture_output=True)
    results = str(tmp_path / "outcome")
    mp.spawn(_split_corrupt_main, args=(world, path, f"file://{tmp_path}/init", results),
             nprocs=world, join=True)
    outcomes = _outcomes(results, world)
    size = 3000 * 40
    for r, o in enumerate(outcomes):
        assert o["error"] is None, (r, o)
        for name, t in tensors.items():
            assert bytes.fromhex(o["tensors"][name]) == t.numpy().tobytes(), (r, name)
    reads = sorted(o["bytes_read"] for o in outcomes)
    # Pieces of whole 512-row units (3000 rows: 6 units, the last of 440 rows); bias (24 bytes)
    # read whole by one rank.
    assert reads[-1] <= (6 // world + (6 % world > 0)) * 512 * 40 + 24, reads
    assert sum(reads) == size + 24, reads
    # One byte of row 2900 (the last piece's) flipped: its reader's check finds it.
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        at = 8 + n + header["w"]["data_offsets"][0] + 2900 * 40 + 3
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    mp.spawn(_split_corrupt_main, args=(world, path, f"file://{tmp_path}/init2", results),
             nprocs=world, join=True)
    outcomes = _outcomes(results, world)
    assert all(o["error"] is not None for o in outcomes), outcomes
    assert any("checksum" in o["error"] and '"w"' in o["error"] for o in outcomes), outcomes

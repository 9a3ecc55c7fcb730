"""Cooperative tensor-parallel loading over torch.distributed (docs/distributed.md).

Every rank of a process group learns which ranks share its host (an all-gather of host-name
hashes) and computes the same plan as the C++ ranks do (tensorferry::PlanCooperative through
Reader.cooperative_plan): which tensors are exchanged and which each rank reads for itself (the
cost model of LoadOptions' coop_exchange, coop_storage_rate and coop_network_rate), the readers
and budget-bounded rounds of the exchanged ones, and the large ones split among the readers by
rows. Each rank reads with the C++ loader: its exchanged tensors whole, its row pieces (a
row-sliced reader), and its own slices of the local tensors (a sliced reader, on a helper thread:
those no exchange saves reads of while the network probe runs, when it runs, the others once the
rank's reads of the first round are done; the plan counts the probe's time), round k + 1 on a
round reader thread while round k is exchanged. Each round is one all-to-all (_all_to_all: one
all_to_all_single on a GPU, pairwise steps on the CPU): every reader sends every other rank
that rank's part of what it read (its slice, the blocks SliceOf gives concatenated along the split
dimension: the bytes SliceByteRanges names, in the same order; the whole tensor; or its part of
a row piece), each part padded to 64 bytes.

gloo exchanges CPU tensors; with device="cuda" (NCCL) the readers load straight to the GPU and
every buffer lives on the GPU. The result on each rank equals the independent per-rank
sliced load byte for byte. A read error on any rank is made known to all (an all-reduce of a flag
per round, and one for the local reads at the end), so every rank raises instead of waiting in a
collective. Every collective waits at
most coop_timeout_ms (LoadOptions' key, default 300000; 0: forever): a rank that died or hangs, or
a link that went down, ends the waiting ranks with an OSError naming the rank, the step and the
ranks that never reached it (_Wait's roll call; the process group is unusable afterwards, as
after any failed collective).
"""
import datetime
import errno
import functools
import hashlib
import json
import queue
import threading
import time

from . import _core

# Options of the per-rank sliced path: the cooperative reader reads whole tensors.
_TP_KEYS = ("tp_rank", "tp_size", "shard_rules", "shard_max_gap")
# Options of the plan (PlanCooperative's cost model and covering reads).
# verify: the pieces' granule (whole checksum chunks) and the records the ranks compare.
_PLAN_KEYS = ("coop_exchange", "coop_storage_rate", "coop_network_rate", "coop_probe_bytes",
              "shard_max_gap", "verify")


class Cooperative:
    """The cooperative mode of one tensorferry.Loader (Loader(..., process_group=pg))."""

    def __init__(self, reader, process_group, options, fw, device):
        """reader: the Loader's _core.Reader, whose checkpoint (and open files) this mode reads:
        the checkpoint is opened once per Loader."""
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise _core.InvalidArgumentError(
                "process_group= needs an initialized torch.distributed")
        world = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise _core.InvalidArgumentError("this process is not a member of process_group")
        tp_rank, tp_size = options.get("tp_rank"), options.get("tp_size")
        if tp_size is None or tp_rank is None:
            raise _core.InvalidArgumentError("process_group= needs tp_rank and tp_size")
        if (tp_rank, tp_size) != (rank, world):
            raise _core.InvalidArgumentError(
                f"tp_rank={tp_rank}, tp_size={tp_size} but this process is rank {rank} of "
                f"{world} in process_group")
        spec = options.get("shard_rules")
        # Without shard_rules the per-rank path uses the builtin rules: so does this one.
        self._spec_json = spec.to_json() if spec is not None else "builtin"
        self._base = reader
        self._group = process_group
        self._fw = fw
        self._device = device
        # The budget (the bytes each rank reads per round) and the timeout as the core read
        # them: the arguments, else their TENSORFERRY_* variables, else the defaults.
        resolved = reader.options()
        self._budget = int(resolved["budget"])
        self._timeout_ms = int(resolved["coop_timeout_ms"])
        self._reader_options = {k: v for k, v in options.items()
                                if v is not None and k not in _TP_KEYS and k != "budget"}
        self._plan_options = {k: options.get(k) for k in _PLAN_KEYS if options.get(k) is not None}
        self.stats = {}

    @property
    def device(self):
        """The torch device the tensors are delivered on."""
        return self._device

    def load(self, names, stats_type):
        """({name: tensor}, LoadStats) of this rank's shard."""
        figures = {}
        out = load_cooperative(self._base, process_group=self._group, shard_spec=self._spec_json,
                               fw=self._fw, device=self._device, names=names,
                               budget=self._budget, reader_options=self._reader_options,
                               plan_options=self._plan_options, stats=figures,
                               timeout_ms=self._timeout_ms)
        return out, self._stats(figures, stats_type)

    def iter_rounds(self, names, stats_type, on_stats):
        """Yields (round, {name: tensor}) of this rank's shard, round by round (the tensors whose
        exchange ended in that round, aliases with their target; the tensors split among the
        readers and those this rank read for itself come with the last round);
        on_stats(LoadStats) is called when the iteration ends, however it ends. Every rank of
        the group must iterate to the end (a rank that stops early leaves the others waiting:
        the timeout ends them)."""
        figures = {}
        try:
            yield from iter_cooperative(
                self._base, process_group=self._group, shard_spec=self._spec_json, fw=self._fw,
                device=self._device, names=names, budget=self._budget,
                reader_options=self._reader_options, plan_options=self._plan_options,
                stats=figures, timeout_ms=self._timeout_ms)
        finally:
            if figures:
                on_stats(self._stats(figures, stats_type))

    def _stats(self, figures, stats_type):
        self.stats = figures
        stats = stats_type(tensors=figures["tensors"], bytes=figures["bytes"],
                           batches=figures["rounds"], seconds=figures["seconds"])
        stats.bytes_read = figures["bytes_read"]
        stats.remote_requests = figures["remote_requests"]
        stats.remote_retries = figures["remote_retries"]
        stats.remote_bytes = figures["remote_bytes"]
        return stats


def _global_rank(dist, group, rank):
    return dist.get_global_rank(group, rank) if group is not None else rank


def _as_bytes(torch, tensor):
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


# Cooperative loads this process started per group (its global ranks): the roll call's keys.
_LOADS = {}
# Per group, the keys the last load's roll call left in the store (its last two steps').
_LEFT = {}

# Backends whose collectives are waited for by polling Work.is_completed() (_wait_polling).
_POLLED_BACKENDS = ("nccl",)

# The longest a rank that gave up waits for the store to say which ranks are missing.
_ROLL_CHECK_SECONDS = 5.0


class _Wait:
    """How long a collective step may wait (`timeout`: a timedelta; None: forever), and the roll
    call that names the ranks missing when a step of the whole group fails: before each such
    step a rank appends its number to the step's key in the default process group's store (one
    key per step, under a hash of the group's global ranks and this process's count of
    cooperative loads on it, the same on every rank), and a rank whose step failed reads the
    key (one get: its own append went first) and names the ranks absent from it. A rank at
    step N has seen step N - 1 complete, so every rank reached N - 1 and finished N - 2: it
    deletes the key of N - 2 (a rank still waiting in N - 1, its link stalled, still finds every
    number there). The store is used from a thread of its own (a store call blocks while its
    host is unreachable: the steps never wait for it) and asked at most _ROLL_CHECK_SECONDS.
    Best effort: without a default store (or Store.append), or when the store fails or does not
    answer, errors say what they said without it. close() ends the thread; the load's last two
    keys stay (another rank may still be reading them) until the next load on the group reaches
    its step 2: step 1 done means every rank left this load, and that rank deletes them (each
    rank deletes what it left; deleting a key twice is harmless), so a process that loads
    again and again (weight reloads) keeps at most two keys per group in the store."""

    def __init__(self, timeout, dist, group, rank, world):
        self.timeout, self._rank, self._world = timeout, rank, world
        try:  # the backends whose Work.wait(timeout) may return before the work is done
            self.poll = str(dist.get_backend(group)).lower() in _POLLED_BACKENDS
        except Exception:  # noqa: BLE001 - a group without a backend name: wait(timeout)
            self.poll = False
        self._store = self._prefix = self._thread = None
        self._step = 0
        try:
            ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
            store = dist.distributed_c10d._get_default_store()
            if not callable(getattr(store, "append", None)):
                raise AttributeError("Store.append")
            digest = hashlib.sha256(ranks.encode()).hexdigest()[:16]
            _LOADS[digest] = _LOADS.get(digest, 0) + 1
            self._store, self._prefix = store, f"tensorferry/roll/{digest}/{_LOADS[digest]}/"
            self._digest = digest
        except Exception:  # noqa: BLE001 - no roll call: the errors stay as they were
            self._store = None
        self._jobs = queue.Queue()
        self._broken = False  # a store call failed: no roll call from then on
        self._closed = False

    def _run(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                if not self._broken:
                    fn()
            except Exception:  # noqa: BLE001 - see the class comment
                self._broken = True
            if done is not None:
                done.set()

    def _submit(self, fn, done=None):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tensorferry-roll",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((fn, done))

    def arrive(self):
        """Marks this rank at the next step of the whole group (on the roll call's thread): the
        step's key, or None."""
        if self._store is None or self._broken:
            return None
        self._step += 1
        key = f"{self._prefix}{self._step}"
        old = [f"{self._prefix}{self._step - 2}"] if self._step > 2 else []
        if self._step == 2:  # every rank left the group's previous load: its keys can go
            old = _LEFT.pop(self._digest, [])
        mine = f"{self._rank},"

        def mark():
            self._store.append(key, mine)
            for k in old:
                self._store.delete_key(k)
        self._submit(mark)
        return key

    def missing(self, key):
        """The ranks absent from `key` (arrive()'s); None when the store cannot tell within
        _ROLL_CHECK_SECONDS."""
        if key is None or self._store is None or self._broken:
            return None
        found, done = [], threading.Event()

        def check():
            found.append(self._store.get(key))
        self._submit(check, done)
        if not done.wait(_ROLL_CHECK_SECONDS) or not found:
            return None
        text = found[0].decode() if isinstance(found[0], bytes) else str(found[0])
        present = {int(r) for r in text.split(",") if r.strip().isdigit()}
        return [q for q in range(self._world) if q not in present]

    def close(self):
        """Ends the roll call's thread once its queued store calls are done (not waited for)."""
        if self._store is not None and self._step > 0 and not self._closed:
            self._closed = True
            # (added to what an earlier load left when this one never reached its step 2)
            _LEFT.setdefault(self._digest, []).extend(
                f"{self._prefix}{k}" for k in range(max(1, self._step - 1), self._step + 1))
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


def _collective(step, rank, wait, start, everyone=True):
    """Runs start() (a torch.distributed call with async_op=True) and waits for it at most
    wait.timeout (None: forever); its failure as an OSError naming this rank and `step`, and
    with `everyone` (a step of the whole group, not a pairwise one) the ranks that never
    reached it (wait's roll call)."""
    arrived = wait.arrive() if everyone else None
    try:
        work = start()
        if work is not None:
            if wait.timeout is None:
                work.wait()
            elif wait.poll and everyone:  # (the pairwise steps are gloo's: never polled)
                _wait_polling(work, wait.timeout)
            elif not work.wait(timeout=wait.timeout):
                raise TimeoutError(f"not done after {wait.timeout.total_seconds():g} s")
    except Exception as e:
        raise _gave_up(step, rank, e, wait.missing(arrived)) from e


def _wait_polling(work, timeout):
    """Waits for `work` at most `timeout` (a timedelta) by asking is_completed(), for backends
    whose Work.wait(timeout) does not block the thread: NCCL's (without TORCH_NCCL_BLOCKING_WAIT)
    only makes the current CUDA stream wait and returns at once, and the next .item() would then
    wait without a bound. The pauses grow from 50 us to 5 ms (a collective done within
    microseconds is seen at once; a long one costs a poll every 5 ms)."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 50e-6
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not done after {timeout.total_seconds():g} s")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    work.wait()  # (raises the collective's error, if any; makes the stream wait for NCCL)


def _gave_up(step, rank, e, missing=None):
    """The OSError of a collective step that failed or timed out with `e`; `missing`: the ranks
    that never reached it (None: not known)."""
    if missing:
        who = ", ".join(f"rank {q}" for q in missing)
        why = f"{who} never reached this step (died or hangs?)"
    elif missing is not None:
        why = "every rank reached this step (a link is down, or a rank died in it?)"
    else:
        why = "a rank died or hangs, or a link is down?"
    return OSError(errno.EIO, f"cooperative load: rank {rank} gave up in {step}: {e} ({why})")


def _all_to_all(torch, dist, group, rank, world, comm_device, wait, step, recv, send,
                recv_splits, send_splits):
    """All-to-all of flat uint8 buffers (all_to_all_single's layout: rank q's block of `send` goes
    to q, q's block for this rank lands in `recv`, blocks in rank order); every rank of `group`
    calls it with matching splits. On a GPU (NCCL), one all_to_all_single. On the CPU (gloo, over
    TCP), world - 1 pairwise steps (step i: send to rank + i, receive from rank - i, both at once;
    empty blocks skipped on both sides): with every rank sending to all at once, the flows into a
    host met in one link queue and a loss stalled the whole exchange for seconds now and then (the
    multi-host rehearsal: docs/benchmarks.md); pairwise, a host receives a few flows at a time.
    Each wait is bounded by wait.timeout and named `step`, as _collective does."""
    if comm_device.type != "cpu":
        _collective(step, rank, wait,
                    lambda: dist.all_to_all_single(recv, send, list(recv_splits),
                                                   list(send_splits), group=group, async_op=True))
        return
    send_at, recv_at = [0] * world, [0] * world
    for q in range(1, world):
        send_at[q] = send_at[q - 1] + send_splits[q - 1]
        recv_at[q] = recv_at[q - 1] + recv_splits[q - 1]
    if send_splits[rank]:  # this rank's own block, if any (the probe and the exchange have none)
        recv[recv_at[rank]:recv_at[rank] + recv_splits[rank]].copy_(
            send[send_at[rank]:send_at[rank] + send_splits[rank]])
    for i in range(1, world):
        to, source = (rank + i) % world, (rank - i) % world
        ops = []
        if recv_splits[source]:
            ops.append(dist.P2POp(dist.irecv,
                                  recv[recv_at[source]:recv_at[source] + recv_splits[source]],
                                  _global_rank(dist, group, source), group))
        if send_splits[to]:
            ops.append(dist.P2POp(dist.isend, send[send_at[to]:send_at[to] + send_splits[to]],
                                  _global_rank(dist, group, to), group))
        if ops:
            # The peers this rank waits on, named in its error: the rank that died or hangs.
            peers = " and ".join(
                ([f"sending to rank {to}"] if send_splits[to] else [])
                + ([f"receiving from rank {source}"] if recv_splits[source] else []))
            paired = f"{step}, {peers}"
            try:
                works = dist.batch_isend_irecv(ops)
            except Exception as e:
                raise _gave_up(paired, rank, e) from e
            for work in works:
                _collective(paired, rank, wait, lambda work=work: work, everyone=False)


def load_cooperative(base, *, process_group, shard_spec, fw, device, names=None, budget=0,
                     reader_options=None, plan_options=None, stats=None, timeout_ms=300000):
    """Loads this rank's shard of `names` (None: all) cooperatively; returns {name: tensor} in
    the Loader's order, local shapes. base: a _core.Reader of the checkpoint (its files are read;
    nothing is opened again). shard_spec: "builtin", "none" or ShardSpec JSON text.
    fw: the torch framework of _frameworks. plan_options: the cost model's settings
    (coop_exchange, coop_storage_rate, coop_network_rate, shard_max_gap; PlanCooperative).
    stats: a dict to fill with this rank's figures."""
    order = []
    out = {}
    for _, tensors in iter_cooperative(base, process_group=process_group, shard_spec=shard_spec,
                                       fw=fw, device=device, names=names, budget=budget,
                                       reader_options=reader_options,
                                       plan_options=plan_options, stats=stats,
                                       timeout_ms=timeout_ms, order=order):
        out.update(tensors)
    return {name: out[name] for name in order}


def _hosts(torch, dist, group, rank, world, comm_device, wait):
    """Host index of every rank of `group` (dense, in order of first appearance): an all-gather of
    a hash of each rank's host name (FNV-1a, as tensorferry::HostsOfRanks)."""
    import socket
    h = 1469598103934665603
    for b in socket.gethostname().encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    mine = torch.tensor([h - (1 << 64) if h >= 1 << 63 else h], dtype=torch.int64,
                        device=comm_device)
    every = [torch.empty(1, dtype=torch.int64, device=comm_device) for _ in range(world)]
    _collective("the start (learning every rank's host)", rank, wait,
                lambda: dist.all_gather(every, mine, group=group, async_op=True))
    seen = {}
    return [seen.setdefault(int(t.item()), len(seen)) for t in every]


def _measure_network_rate(torch, dist, group, rank, comm_device, wait, hosts, nbytes):
    """(rate, seconds): the network rate the plan is made with, measured as
    tensorferry::MeasureNetworkRate measures it (the same NetworkProbe exchange and arithmetic,
    through _all_to_all, as the rounds exchange), bytes per second per host, and the probe's
    time, the slowest rank's; the same on every rank; (0, 0.0) when nbytes is 0 (no probe)."""
    if not nbytes:
        return 0, 0.0
    probe_start = time.perf_counter_ns()

    def exchange(size, warmup, step):
        send, recv = _core.network_probe_counts(hosts, size, rank, warmup)
        out = torch.full((sum(send),), 0x5A, dtype=torch.uint8, device=comm_device)
        into = torch.empty(sum(recv), dtype=torch.uint8, device=comm_device)
        _all_to_all(torch, dist, group, rank, len(hosts), comm_device, wait, step, into, out,
                    recv, send)

    exchange(1, True, "the network probe (opening the connections)")
    rate = 0
    size = _core.network_probe_first_bytes(nbytes)
    while size:
        _collective("the network probe (barrier)", rank, wait,
                    lambda: dist.barrier(group=group, async_op=True))
        t0 = time.perf_counter_ns()
        exchange(size, False, "the network probe")
        if comm_device.type != "cpu":
            torch.cuda.synchronize(comm_device)
        mine = torch.tensor([time.perf_counter_ns() - t0], dtype=torch.int64, device=comm_device)
        every = [torch.empty(1, dtype=torch.int64, device=comm_device)
                 for _ in range(len(hosts))]
        _collective("the network probe (gathering the times)", rank, wait,
                    lambda: dist.all_gather(every, mine, group=group, async_op=True))
        slowest = max(int(t.item()) for t in every)
        rate = _core.network_probe_rate(hosts, size, slowest)
        size = _core.network_probe_next_bytes(size, slowest, nbytes)
    # The probe's time, the slowest rank's: the plan's clock starts after it on every rank.
    mine = torch.tensor([time.perf_counter_ns() - probe_start], dtype=torch.int64,
                        device=comm_device)
    every = [torch.empty(1, dtype=torch.int64, device=comm_device) for _ in range(len(hosts))]
    _collective("the network probe (gathering the times)", rank, wait,
                lambda: dist.all_gather(every, mine, group=group, async_op=True))
    return rate, max(1, max(int(t.item()) for t in every)) / 1e9


def _align(n):
    """Parts start at multiples of 64 bytes in the exchange buffers (a typed view needs it)."""
    return (n + 63) // 64 * 64


class _Unit:
    """One unit of the rounds' reading: a tensor read whole by its reader, or one row piece of a
    tensor split among the readers (rows [row0, row0 + rows))."""
    __slots__ = ("entry", "reader", "round", "row0", "rows")

    def __init__(self, entry, reader, rnd, row0=None, rows=None):
        self.entry, self.reader, self.round, self.row0, self.rows = entry, reader, rnd, row0, rows

    @property
    def piece(self):
        return self.row0 is not None


class _Entry:
    """A plan entry of Reader.cooperative_plan (python/src/distributed.h)."""
    __slots__ = ("name", "st_dtype", "shape", "nbytes", "exchanged", "reader", "round",
                 "piece_rows", "piece_rounds", "dim", "parts", "saves_reads", "piece_granule")

    def __init__(self, t):
        (self.name, self.st_dtype, self.shape, self.nbytes, self.exchanged, self.reader,
         self.round, self.piece_rows, self.piece_rounds, self.dim, self.parts,
         self.saves_reads, self.piece_granule) = t

    def part_bytes(self, q):
        return self.nbytes if self.dim < 0 else self.parts[q][2]

    def piece_spans(self, unit, q):
        """Rank q's part of piece `unit` as (row in the piece, row in q's part, rows) for a
        replicated or dim-0 tensor; None for dims > 0 (every row of the piece, q's columns)."""
        if self.dim < 0:
            return [(0, unit.row0, unit.rows)]
        if self.dim > 0:
            return None
        spans, base = [], 0
        end = unit.row0 + unit.rows
        for start, length in self.parts[q][1]:
            lo, hi = max(start, unit.row0), min(start + length, end)
            if lo < hi:
                spans.append((lo - unit.row0, base + lo - start, hi - lo))
            base += length
        return spans

    def piece_bytes(self, unit, q):
        rows = self.shape[0]
        if self.dim > 0:
            return unit.rows * (self.parts[q][2] // rows)
        return sum(n for _, _, n in self.piece_spans(unit, q)) * (self.nbytes // rows)

    def unit_bytes(self, unit, q):
        return self.piece_bytes(unit, q) if unit.piece else self.part_bytes(q)


def iter_cooperative(base, *, process_group, shard_spec, fw, device, names=None, budget=0,
                     reader_options=None, plan_options=None, stats=None, timeout_ms=300000,
                     order=None):
    """Yields (round, {name: tensor}): this rank's shard of `names` (None: all), round by round as
    the exchange delivers it, each round's tensors in the Loader's order (a tied alias with its
    target); the tensors each rank reads for itself (the plan's local ones) come with the last
    round. Arguments as load_cooperative's; plan_options: the cost model's settings
    (coop_exchange, coop_storage_rate, coop_network_rate, shard_max_gap); `order`, when a list,
    receives every output name in the Loader's order before the first round. stats: a dict kept
    up to date with this rank's figures (also when the iteration stops early). The generator
    keeps no reference to a round it has yielded."""
    import concurrent.futures

    import torch
    import torch.distributed as dist

    if fw.name != "torch":
        raise _core.InvalidArgumentError("process_group= needs framework=\"pt\" (torch)")
    group = process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise _core.InvalidArgumentError("this process is not a member of process_group")
    start = time.perf_counter()
    wait = _Wait(datetime.timedelta(milliseconds=timeout_ms) if timeout_ms else None, dist,
                 group, rank, world)
    on_gpu = device.type != "cpu"
    # NCCL needs every buffer on the GPU, gloo on the CPU.
    comm_device = device if on_gpu else torch.device("cpu")
    try:
        hosts = _hosts(torch, dist, group, rank, world, comm_device, wait)
    except BaseException:
        wait.close()
        raise
    options = {k: v for k, v in (plan_options or {}).items() if v is not None}
    options["budget"] = budget or 0
    # shard_max_gap is an option of tensor parallelism, which needs a rank and a world: without
    # them the core refused the options (the plan reads only the gap of them).
    options.update(tp_rank=rank, tp_size=world)
    # The readers of the rounds, pieces and local tensors each read what the plan gave them at
    # once: no budget of theirs (not even a TENSORFERRY_BUDGET or TENSORFERRY_DEVICE_BUDGET,
    # which would refuse a round larger than it); `budget` sized the rounds.
    base_options = dict(reader_options or {})
    base_options["budget"] = 0
    base_options.setdefault("device_budget", 0)
    figures = {"tensors": 0, "bytes": 0, "bytes_read": 0, "bytes_sent": 0,
               "bytes_received": 0, "rounds": 0, "read_seconds": 0.0, "exchange_seconds": 0.0,
               "local_seconds": 0.0, "network_seconds": 0.0, "remote_requests": 0,
               "remote_retries": 0, "remote_bytes": 0, "hosts": len(set(hosts)),
               "exchanged_tensors": 0, "local_tensors": 0, "measured_network_rate": 0,
               "probe_seconds": 0.0}
    reader = piece_reader = local_reader = pool = None
    local_jobs = []  # the local reads on the helper thread, in order
    units = []
    round_pool = ahead = None  # the round reader: round k + 1 read while round k is exchanged

    def account(core, key):
        figures["bytes_read"] += core[key]
        for k in ("remote_requests", "remote_retries", "remote_bytes"):
            figures[k] += core[k]

    def read_local(which):
        """On the helper thread: this rank's part of the local tensors `which`, its reader's
        stats and when it started and ended (the figures are updated by the main thread, which
        owns them)."""
        t0 = time.perf_counter()
        triples = local_reader.load(which, fw.code)
        got = dict(fw.finish_all(triples, comm_device))
        return got, local_reader.stats(), t0, time.perf_counter()

    def read_round(k):
        """This rank's units of round k (whole tensors, then row pieces), on the main thread
        (round 0) or the round reader's (round k + 1 while round k is exchanged): (loaded, the
        readers' stats, seconds, error); the main thread updates the figures."""
        mine = [u for u in units if u.round == k and u.reader == rank]
        loaded, cores, error = {}, [], None
        if not mine:
            return loaded, cores, 0.0, error
        t0 = time.perf_counter()
        try:
            for rdr, want in ((reader, [u.entry.name for u in mine if not u.piece]),
                              (piece_reader, [u.entry.name for u in mine if u.piece])):
                if want:
                    triples = rdr.load(want, fw.code)
                    loaded.update(fw.finish_all(triples, comm_device))
                    del triples
                    cores.append(rdr.stats())
        except Exception as e:  # re-raised in the round, after the others know
            error = e
        return loaded, cores, time.perf_counter() - t0, error

    def start_local(which):
        nonlocal local_reader, pool
        if not which:
            return
        if local_reader is None:
            local_reader = _core.Reader(base, dict(base_options, tp_rank=rank, tp_size=world,
                                                   shard_rules=shard_spec,
                                                   shard_max_gap=options.get("shard_max_gap")))
            pool = concurrent.futures.ThreadPoolExecutor(1)
        local_jobs.append(pool.submit(read_local, which))

    try:
        # With a network probe ahead (auto, no rate given, several hosts), the tensors that no
        # exchange saves reads of are local whatever it measures: read while it runs.
        # Every rank's slices and per-tensor figures first, before any I/O or other
        # collective: the ranks agree on them and on the options, or every rank fails at once.
        error = fingerprint = None
        try:
            nbytes = _core.network_probe_bytes(hosts, options)
            raw, _, planned = base.cooperative_plan(names, shard_spec, hosts,
                                                    dict(options, coop_exchange="none"))
            # The plan's fingerprint (CooperativePlan::fingerprint: the tensors' files and
            # offsets, and the content digest of checksum records, hub commits and ETags, which
            # tells two copies of one layout with other bytes apart); the names as a set (the
            # load's order is the files' whatever the order given); the options as parsed
            # ("64MB" and 64000000 agree).
            fingerprint = _fingerprint(raw, sorted(names) if names else names,
                                       _core.cooperative_options_digest(options), planned)
        except Exception as e:  # re-raised by _agree_plan, after the others know
            error = e
        _agree_plan(torch, dist, group, rank, world, comm_device, wait, error, fingerprint,
                    "the plan's inputs", "planning (slices and options)")
        preread = set()
        if nbytes:
            first = [e.name for e in map(_Entry, raw) if not e.saves_reads]
            preread = set(first)
            start_local(first)
        measured, probe_seconds = _measure_network_rate(torch, dist, group, rank, comm_device,
                                                        wait, hosts, nbytes)
        if measured:
            options["coop_network_rate"] = measured
        error = fingerprint = None
        try:
            raw_plan, outputs, planned = base.cooperative_plan(names, shard_spec, hosts,
                                                               options, probe_seconds)
            fingerprint = _fingerprint(raw_plan, outputs, planned)
            plan = [_Entry(t) for t in raw_plan]
            if any(e.exchanged for e in plan if e.name in preread):
                raise _core.SafetensorError(
                    "cooperative load: the plan exchanges a tensor read during the network probe")
            figures.update({"tensors": len(outputs),
                            "exchanged_tensors": sum(1 for e in plan if e.exchanged),
                            "local_tensors": sum(1 for e in plan if not e.exchanged),
                            "measured_network_rate": measured, "probe_seconds": probe_seconds})
            for e in plan:
                if not e.exchanged:
                    continue
                if not e.piece_rows:
                    units.append(_Unit(e, e.reader, e.round))
                else:
                    units.extend(_Unit(e, p, e.piece_rounds[p], row0, rows)
                                 for p, (row0, rows) in enumerate(e.piece_rows))
            rounds = max((u.round for u in units), default=-1) + 1
            if order is not None:
                order.extend(name for name, _ in outputs)
            # Outputs by the tensor read for them (a tied alias shares its target's).
            outputs_of = {}
            for name, source in outputs:
                outputs_of.setdefault(source, []).append(name)
            # The rounds are the budget: the readers under them have none of their own. Whole
            # tensors, row pieces (every split tensor by rows over the ranks), and the local tensors
            # (this rank's own slices, as the independent sliced load reads them): those not read
            # during the probe once this rank's reads of the first round are done.
            reader = _core.Reader(base, base_options)
            pieced = [e for e in plan if e.exchanged and e.piece_rows]
            local = [e.name for e in plan if not e.exchanged and e.name not in preread]
            if stats is not None:
                stats.update(figures)
            fw.check(reader, [e.name for e in plan])
            if pieced:
                # The rows the plan cut the pieces at (whole checksum chunks: piece_granule).
                spec = json.dumps({"base": "none", "overrides": {
                    e.name: {"split": 0, "granule": e.piece_granule} for e in pieced}})
                piece_reader = _core.Reader(base, dict(base_options, tp_rank=rank, tp_size=world,
                                                       shard_rules=spec))
        except Exception as e:  # re-raised by _agree_plan, after the others know
            error = e
        _agree_plan(torch, dist, group, rank, world, comm_device, wait, error, fingerprint,
                    "the plan", "the plan")
        if not rounds:
            start_local(local)
        mine_parts = {}  # tensors split among the readers: this rank's part, filled piece by piece
        # The rounds overlap as in the core: round k + 1 is read on the round reader while round
        # k is exchanged, so a rank holds the reads of two rounds at most.
        current = read_round(0) if rounds else ({}, [], 0.0, None)
        for k in range(max(rounds, 1 if local or preread else 0)):
            if ahead is not None:
                current, ahead = ahead.result(), None
            loaded, cores, seconds, error = current
            current = None
            for core in cores:
                account(core, "bytes")
            figures["read_seconds"] += seconds
            if k == 0 and rounds and error is None:
                start_local(local)
            if k + 1 < rounds and error is None:
                if round_pool is None:
                    round_pool = concurrent.futures.ThreadPoolExecutor(1)
                ahead = round_pool.submit(read_round, k + 1)
            t0 = time.perf_counter()
            step = f"round {k} of {rounds}"
            def agree(failure, step=step):
                _agree(torch, dist, group, rank, world, comm_device, wait, failure,
                       f"{step} (every rank's reads)", "reading its share")

            got = {}  # this round's whole tensors and completed parts, by name
            if rounds:
                # (agrees once this rank's reads are in and its buffers allocated)
                _exchange(torch, dist, group, rank, world, comm_device, wait, fw, step,
                          [u for u in units if u.round == k], loaded, got, mine_parts, figures,
                          agree, error)
            else:
                agree(error)
            del loaded
            if k == rounds - 1 or rounds == 0:
                # The last round: every piece has arrived, and the local tensors come too.
                got.update(mine_parts)
                mine_parts = {}
                local_got, error, spans = {}, None, []
                for job in local_jobs:
                    try:
                        part, core, t_start, t_end = job.result()
                        local_got.update(part)
                        account(core, "bytes_read")
                        spans.append((t_start, t_end))
                    except Exception as e:
                        error = error or e
                if spans:  # from the start of the first local read to the end of the last
                    figures["local_seconds"] = (max(e for _, e in spans)
                                                - min(b for b, _ in spans))
                _agree(torch, dist, group, rank, world, comm_device, wait, error,
                       "the end (every rank's local reads)", "reading its local tensors")
                got.update(local_got)
                del local_got
            figures["exchange_seconds"] += time.perf_counter() - t0
            figures["rounds"] += 1  # batches delivered (a load of local tensors only: one)
            # The outputs of this round's tensors, in the Loader's order (the plan's, checkpoint
            # order); tied aliases share their target's tensor, tensors read only for an alias
            # are dropped.
            batch = {}
            for e in plan:
                t = got.get(e.name)
                if t is None:
                    continue
                for output in outputs_of.get(e.name, ()):
                    batch[output] = t
            del got
            if on_gpu and device != comm_device:
                moved = {}  # a tied alias stays its target's tensor on the device too
                for n, t in batch.items():
                    if id(t) not in moved:
                        moved[id(t)] = t.to(device)
                    batch[n] = moved[id(t)]
                del moved
            # Each stored tensor once: a tied alias shares its target's bytes (LoadStats::bytes).
            figures["bytes"] += sum({id(t): t.nbytes for t in batch.values()}.values())
            figures["seconds"] = time.perf_counter() - start
            if stats is not None:
                stats.update(figures)
            yield k, batch
            del batch
    finally:
        if round_pool is not None:
            # A round read ahead when the load stopped (an error, or an early close): not
            # started, it never starts; started, it is cancelled like the local reads, and
            # waited for before its readers close.
            if ahead is not None and not ahead.cancel():
                for r in (reader, piece_reader):
                    if r is not None:
                        r.cancel()
            round_pool.shutdown(wait=True)
        if pool is not None:
            # On an error or an early close the local reads still queued or running are
            # cancelled (after a complete load there are none left), so the error comes out
            # within a chunk per worker rather than after every local read.
            for job in local_jobs:
                job.cancel()
            local_reader.cancel()
            pool.shutdown(wait=True)
        for r in (reader, piece_reader, local_reader):
            if r is not None:
                r.close()
        wait.close()
        figures["seconds"] = time.perf_counter() - start
        if stats is not None:
            stats.update(figures)


def _agree(torch, dist, group, rank, world, comm_device, wait, error, step, what):
    """Every rank's read status to every rank: raises this rank's own error, or names the first
    rank that failed, so that no rank waits in a collective for one that gave up."""
    flags = torch.zeros(world, dtype=torch.int32, device=comm_device)
    flags[rank] = 1 if error is not None else 0
    _collective(step, rank, wait,
                lambda: dist.all_reduce(flags, group=group, async_op=True))
    if error is not None:
        raise error
    failed = [q for q in range(world) if flags[q].item()]
    if failed:
        raise _core.SafetensorError(
            f"cooperative load: rank {failed[0]} failed {what}; see its error")


def _fingerprint(*parts):
    """63 bits of a hash of `parts` (plain values, lists and tuples): equal on ranks that planned
    alike."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _agree_plan(torch, dist, group, rank, world, comm_device, wait, error, fingerprint, step,
                what):
    """Every rank's planning outcome to every rank: raises this rank's own error, or names a rank
    that failed, or two ranks whose fingerprints differ (another checkpoint, selection, shard
    rules or options), instead of a wait in the next collective or, when the byte counts happen
    to agree, another rank's bytes taken for this rank's."""
    table = torch.zeros((world, 2), dtype=torch.int64, device=comm_device)
    table[rank, 0] = 1 if error is not None else 0
    table[rank, 1] = 0 if error is not None else fingerprint
    _collective(step, rank, wait,
                lambda: dist.all_reduce(table, group=group, async_op=True))
    if error is not None:
        raise error
    rows = table.cpu().tolist()
    failed = [q for q in range(world) if rows[q][0]]
    if failed:
        raise _core.SafetensorError(
            f"cooperative load: rank {failed[0]} failed {what}; see its error")
    other = [q for q in range(world) if rows[q][1] != fingerprint]
    if other:
        raise _core.InvalidArgumentError(
            f"cooperative load: rank {other[0]} and rank {rank} disagree on {what}: every rank "
            "needs the same checkpoint (the same bytes, where checksum records, a hub commit or "
            "an ETag tell), selection, shard rules and cooperative options")


def _blocks(e, full, q):
    """Rank q's part of the whole tensor `full` (its slice, or all of it) as (dim, views): the
    part is the views concatenated along dim (no copy made)."""
    if e.dim < 0:
        return 0, [full]
    return e.dim, [full.narrow(e.dim, s, n) for s, n in e.parts[q][1]]


def _piece_blocks(e, unit, piece, q):
    """Rank q's part of row piece `piece` (rows unit.row0 ...) as (dim, views), as _blocks."""
    spans = e.piece_spans(unit, q)
    if spans is None:  # dims > 0: every row of the piece, q's columns
        return _blocks(e, piece, q)
    return 0, [piece.narrow(0, src, n) for src, _, n in spans] or [piece.narrow(0, 0, 0)]


def _assign(torch, dst, src):
    """dst[...] = src (the same shape and dtype). Host memory is copied by numpy, on this thread
    only: torch's copy_ runs a large copy on its OpenMP pool, whose threads spin-wait for one
    another, and where ranks share few cores (eight ranks on two vCPUs in the multi-host
    rehearsal) packing a round of 5 MB took up to 0.26 s instead of 1-10 ms, while every rank's
    all_to_all waited for the slowest packer (docs/benchmarks.md). Device memory: copy_."""
    np = _numpy()

    def unit(t):  # whether t's bytes can be viewed as uint8 (unit stride in its last dimension)
        return t.dim() == 0 or t.stride(-1) == 1

    if dst.device.type != "cpu" or np is None or not (unit(dst) and unit(src)):
        dst.copy_(src)
        return

    def raw(t):  # the bytes of t, as numpy's
        return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8).numpy()

    np.copyto(raw(dst), raw(src))


@functools.cache
def _numpy():
    """numpy, imported at the first exchange; None without it (an optional dependency: _assign
    copies with torch then)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _joined_shape(dim, views):
    shape = list(views[0].shape)
    if len(views) > 1:
        shape[dim] = sum(v.shape[dim] for v in views)
    return shape


def _fill(torch, dim, views, target):
    """Copies the views, concatenated along dim, into `target` (of their joined shape)."""
    if len(views) == 1:  # also a scalar (no dimension to concatenate along)
        _assign(torch, target, views[0])
        return
    at = 0
    for v in views:
        _assign(torch, target.narrow(dim, at, v.shape[dim]), v)
        at += v.shape[dim]


def _joined(torch, dim, views):
    """The views concatenated along dim, contiguous (a view itself when there is one)."""
    if len(views) == 1 and views[0].is_contiguous():
        return views[0]
    out = torch.empty(_joined_shape(dim, views), dtype=views[0].dtype, device=views[0].device)
    _fill(torch, dim, views, out)
    return out


def _own(torch, t, shared=False):
    """`t`, or a copy of it when it is a view of a larger storage (this rank's rows of a
    tensor it read whole, a tensor received in a round's buffer) or `shared` (a tensor of a
    reader's batch of several: its storage is its own bytes, but what owns it holds the whole
    batch): a result holds no more memory than its own bytes. Copied as _assign copies (not on
    torch's thread pool)."""
    if not shared and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    _assign(torch, out, t)
    return out


def _copy_blocks(torch, dim, views, into):
    """Copies the views, concatenated along dim, into `into` (a flat uint8 tensor of exactly
    their bytes): one copy, no intermediate tensor."""
    _fill(torch, dim, views, into.view(views[0].dtype).view(_joined_shape(dim, views)))


def _place_piece(torch, e, unit, target, rows, rank):
    """Copies `rows` (rank's part of piece `unit`, as _piece_blocks gives it) into `target`, the
    rank's part of the whole tensor."""
    spans = e.piece_spans(unit, rank)
    if spans is None:
        _assign(torch, target.narrow(0, unit.row0, unit.rows), rows)
        return
    at = 0
    for _, dst, n in spans:
        _assign(torch, target.narrow(0, dst, n), rows.narrow(0, at, n))
        at += n


def _exchange(torch, dist, group, rank, world, comm_device, wait, fw, step, units, loaded,
              got, mine_parts, figures, agree, error):
    """One round's exchange in one _all_to_all: every rank sends each other rank that
    rank's parts of what it read this round (unit order, each padded to 64 bytes) and receives
    its own from every reader. Whole tensors land in `got` (copies of their own); parts of row
    pieces are copied into mine_parts[name]. agree(failure) is the ranks' agreement on the
    round's outcome (raises when any rank failed): called with this rank's read `error`, or
    once its buffers are allocated and packed, so that no rank waits in the exchange for one
    that could not allocate them."""
    if error is not None:
        agree(error)
    send_splits = [0] * world
    recv_splits = [0] * world
    # The sizes first, so the parts are copied once, straight into one send buffer: per unit,
    # every rank's part when this rank reads it, else this rank's.
    sizes = []
    for u in units:
        if u.reader == rank:
            sizes.append([u.entry.unit_bytes(u, q) for q in range(world)])
            for q in range(world):
                if q != rank:
                    send_splits[q] += _align(sizes[-1][q])
        else:
            sizes.append(u.entry.unit_bytes(u, rank))
            recv_splits[u.reader] += _align(sizes[-1])
    # What this rank read this round came in batches of several tensors (the readers' whole
    # batch is what a tensor of it keeps alive): a whole tensor it keeps is copied out of them.
    batched = len(loaded) > 1
    try:
        # Everything this rank allocates before the exchange (the buffers, this rank's kept
        # copies and parts, joined views), before the ranks agree: an out-of-memory here is told
        # to the others instead of leaving them in the exchange until the timeout.
        send_buf = torch.empty(sum(send_splits), dtype=torch.uint8, device=comm_device)
        recv_buf = torch.empty(sum(recv_splits), dtype=torch.uint8, device=comm_device)
        cursor, at = [], 0
        for n in send_splits:
            cursor.append(at)
            at += n
        for u, size in zip(units, sizes):
            e = u.entry
            if u.reader != rank:
                figures["bytes_received"] += size
                continue
            src = loaded.pop(e.name) if not u.piece else loaded[e.name]
            for q in range(world):
                dim, views = _piece_blocks(e, u, src, q) if u.piece else _blocks(e, src, q)
                if q == rank:
                    part = _joined(torch, dim, views)
                    if u.piece:
                        _place_piece(torch, e, u, _target(torch, fw, e, rank, mine_parts,
                                                          comm_device), part, rank)
                    else:
                        got[e.name] = _own(torch, part, shared=batched)
                    continue
                n = size[q]
                _copy_blocks(torch, dim, views, send_buf[cursor[q]:cursor[q] + n])
                if _align(n) > n:  # the padding zeroed: no stale memory goes over the network
                    send_buf[cursor[q] + n:cursor[q] + _align(n)].zero_()
                cursor[q] += _align(n)
                figures["bytes_sent"] += n
            if u.piece:
                loaded.pop(e.name, None)
    except Exception as e:  # (torch.OutOfMemoryError, RuntimeError): the others are told
        agree(e)
    agree(None)
    # On a GPU the exchange is one all_to_all_single of the whole group: every rank takes part,
    # with nothing to send or receive too (a rank that skipped it left the others waiting in it;
    # the plan's rounds can hold only pieces other ranks read and need). gloo's pairwise steps
    # skip empty blocks on both sides.
    if comm_device.type != "cpu" or sum(send_splits) or sum(recv_splits):
        t0 = time.perf_counter()
        _all_to_all(torch, dist, group, rank, world, comm_device, wait,
                    f"{step} (the exchange)", recv_buf, send_buf, recv_splits, send_splits)
        figures["network_seconds"] += time.perf_counter() - t0
    del send_buf
    cursor, at = [], 0
    for n in recv_splits:
        cursor.append(at)
        at += n
    for u, n in zip(units, sizes):
        if u.reader == rank:
            continue
        e = u.entry
        data = recv_buf[cursor[u.reader]:cursor[u.reader] + n]
        cursor[u.reader] += _align(n)
        tdtype = fw.dtype(e.st_dtype)
        if not u.piece:
            shape = e.parts[rank][0] if e.dim >= 0 else e.shape
            # A storage of its own (docs/python.md), not a view of the round's buffer: torch.save
            # of it saves it alone, safetensors' save_file sees no shared memory, and the round's
            # buffer goes at the end of the round.
            got[e.name] = _own(torch, data.view(tdtype).reshape(
                fw.shape(e.st_dtype, shape, e.name)))
            continue
        target = _target(torch, fw, e, rank, mine_parts, comm_device)
        row_shape = list(target.shape[1:])
        _place_piece(torch, e, u, target, data.view(tdtype).reshape([-1] + row_shape), rank)


def _target(torch, fw, e, rank, mine_parts, comm_device):
    """This rank's part of tensor e (split among the readers), allocated at its first piece."""
    t = mine_parts.get(e.name)
    if t is None:
        shape = e.parts[rank][0] if e.dim >= 0 else e.shape
        t = torch.empty(fw.shape(e.st_dtype, shape, e.name), dtype=fw.dtype(e.st_dtype),
                        device=comm_device)
        mine_parts[e.name] = t
    return t

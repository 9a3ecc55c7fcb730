"""Cooperative tensor-parallel loading over torch.distributed (docs/distributed.md).

Every rank of a process group computes the same schedule (tensorferry::AssignReaders and
AssignRounds through Reader.cooperative_plan: contiguous, byte-balanced runs of tensors in
checkpoint order, in budget-bounded rounds), reads only its own tensors with the C++ loader, and
the slices reach their owners through torch.distributed collectives:

  * replicated tensors: broadcast from the reader;
  * split tensors: the reader cuts every rank's slice (the blocks SliceOf gives, concatenated
    along the split dimension: the bytes SliceByteRanges names, in the same order), pads them to
    one length as uint8 and scatters them; each rank keeps its own length.

gloo exchanges CPU tensors; with device="cuda" (NCCL) the reader moves its tensors to its GPU
first and every buffer lives on the GPU. The result on each rank equals the independent per-rank
sliced load byte for byte. A read error on any rank is made known to all (an all-reduce of a flag
per round), so every rank raises instead of waiting in a collective. Every collective waits at
most coop_timeout_ms (LoadOptions' key, default 300000; 0: forever): a rank that died or hangs, or
a link that went down, ends the waiting ranks with an OSError naming the rank and the step (and
the process group is unusable afterwards, as after any failed collective).
"""
import datetime
import errno
import time

from . import _core

# Options of the per-rank sliced path: the cooperative reader reads whole tensors.
_TP_KEYS = ("tp_rank", "tp_size", "shard_rules", "shard_max_gap")


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
        self._budget = options.get("budget") or 0
        timeout_ms = options.get("coop_timeout_ms")
        self._timeout_ms = 300000 if timeout_ms is None else int(timeout_ms)
        self._reader_options = {k: v for k, v in options.items()
                                if v is not None and k not in _TP_KEYS and k != "budget"}
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
                               stats=figures, timeout_ms=self._timeout_ms)
        return out, self._stats(figures, stats_type)

    def iter_rounds(self, names, stats_type, on_stats):
        """Yields (round, {name: tensor}) of this rank's shard, round by round (the tensors whose
        exchange ended in that round, aliases with their target); on_stats(LoadStats) is called
        when the iteration ends, however it ends. Every rank of the group must iterate to the
        end (a rank that stops early leaves the others waiting: the timeout ends them)."""
        figures = {}
        try:
            yield from iter_cooperative(
                self._base, process_group=self._group, shard_spec=self._spec_json, fw=self._fw,
                device=self._device, names=names, budget=self._budget,
                reader_options=self._reader_options, stats=figures,
                timeout_ms=self._timeout_ms)
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


def _collective(step, rank, timeout, start):
    """Runs start() (a torch.distributed call with async_op=True) and waits for it at most
    `timeout` (a timedelta; None: forever); its failure as an OSError naming this rank and
    `step`."""
    try:
        work = start()
        if work is not None:
            if timeout is None:
                work.wait()
            elif not work.wait(timeout=timeout):
                raise TimeoutError(f"not done after {timeout.total_seconds():g} s")
    except Exception as e:
        raise OSError(errno.EIO, f"cooperative load: rank {rank} gave up in {step}: {e} (a rank "
                                 "died or hangs, or a link is down?)") from e


def load_cooperative(base, *, process_group, shard_spec, fw, device, names=None, budget=0,
                     reader_options=None, stats=None, timeout_ms=300000):
    """Loads this rank's shard of `names` (None: all) cooperatively; returns {name: tensor} in
    the Loader's order, local shapes. base: a _core.Reader of the checkpoint (its files are read;
    nothing is opened again). shard_spec: "builtin", "none" or ShardSpec JSON text.
    fw: the torch framework of _frameworks. stats: a dict to fill with this rank's figures."""
    order = []
    out = {}
    for _, tensors in iter_cooperative(base, process_group=process_group, shard_spec=shard_spec,
                                       fw=fw, device=device, names=names, budget=budget,
                                       reader_options=reader_options, stats=stats,
                                       timeout_ms=timeout_ms, order=order):
        out.update(tensors)
    return {name: out[name] for name in order}


def iter_cooperative(base, *, process_group, shard_spec, fw, device, names=None, budget=0,
                     reader_options=None, stats=None, timeout_ms=300000, order=None):
    """Yields (round, {name: tensor}): this rank's shard of `names` (None: all), round by round as
    the exchange delivers it, each round's tensors in the Loader's order (a tied alias with its
    target). Arguments as load_cooperative's; `order`, when a list, receives every output name in
    the Loader's order before the first round. stats: a dict kept up to date with this rank's
    figures (also when the iteration stops early). The generator keeps no reference to a round it
    has yielded."""
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
    timeout = datetime.timedelta(milliseconds=timeout_ms) if timeout_ms else None
    plan, outputs = base.cooperative_plan(names, shard_spec, world, budget or 0)
    on_gpu = device.type != "cpu"
    # NCCL needs every buffer on the GPU, gloo on the CPU.
    comm_device = device if on_gpu else torch.device("cpu")
    figures = {"tensors": len(outputs), "bytes": 0, "bytes_read": 0, "bytes_sent": 0,
               "bytes_received": 0, "rounds": 0, "read_seconds": 0.0, "exchange_seconds": 0.0,
               "remote_requests": 0, "remote_retries": 0, "remote_bytes": 0}
    rounds = max((entry[4] for entry in plan), default=-1) + 1
    if order is not None:
        order.extend(name for name, _ in outputs)
    # Outputs by the tensor read for them (a tied alias shares its target's).
    outputs_of = {}
    for name, source in outputs:
        outputs_of.setdefault(source, []).append(name)
    # The rounds are the budget: the reader under them has none of its own.
    reader = _core.Reader(base, dict(reader_options or {}))
    if stats is not None:
        stats.update(figures)
    try:
        mine_names = [entry[0] for entry in plan if entry[3] == rank]
        fw.check(reader, mine_names)
        for k in range(rounds):
            mine = [entry[0] for entry in plan if entry[3] == rank and entry[4] == k]
            loaded = {}
            error = None
            if mine:
                t0 = time.perf_counter()
                try:
                    triples = reader.load(mine, fw.code)
                    loaded = dict(fw.finish_all(triples, comm_device))
                    del triples
                    core = reader.stats()
                    figures["bytes_read"] += core["bytes"]
                    for key in ("remote_requests", "remote_retries", "remote_bytes"):
                        figures[key] += core[key]
                except Exception as e:  # re-raised below, after the others know
                    error = e
                figures["read_seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            flags = torch.zeros(world, dtype=torch.int32, device=comm_device)
            flags[rank] = 1 if error is not None else 0
            step = f"round {k} of {rounds}"
            _collective(f"{step} (every rank's reads)", rank, timeout,
                        lambda: dist.all_reduce(flags, group=group, async_op=True))
            if error is not None:
                raise error
            failed = [q for q in range(world) if flags[q].item()]
            if failed:
                raise _core.SafetensorError(
                    f"cooperative load: rank {failed[0]} failed reading its share; see its error")
            got = {}  # this round's tensors read, by name
            for name, st_dtype, shape, root, rnd, dim, parts in plan:
                if rnd != k:
                    continue
                src = _global_rank(dist, group, root)
                tdtype = fw.dtype(st_dtype)
                if dim < 0:
                    if root == rank:
                        t = loaded.pop(name)
                        figures["bytes_sent"] += t.nbytes * (world - 1)
                    else:
                        t = torch.empty(fw.shape(st_dtype, shape, name), dtype=tdtype,
                                        device=comm_device)
                        figures["bytes_received"] += t.nbytes
                    if t.numel():
                        _collective(f"{step} (broadcast of {name})", rank, timeout,
                                    lambda: dist.broadcast(t, src=src, group=group,
                                                           async_op=True))
                    got[name] = t
                    continue
                counts = [p[2] for p in parts]
                longest = max(counts)
                local_shape = parts[rank][0]
                if longest == 0:
                    got[name] = torch.empty(local_shape, dtype=tdtype, device=comm_device)
                    continue
                recv = torch.empty(longest, dtype=torch.uint8, device=comm_device)
                scatter_list = None
                if root == rank:
                    full = loaded.pop(name)
                    scatter_list = []
                    for q, (q_shape, blocks, nbytes) in enumerate(parts):
                        pieces = [full.narrow(dim, s, n) for s, n in blocks]
                        piece = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
                        flat = _as_bytes(torch, piece.contiguous())
                        if nbytes < longest:
                            padded = torch.empty(longest, dtype=torch.uint8, device=comm_device)
                            padded[:nbytes] = flat
                            flat = padded
                        scatter_list.append(flat)
                        if q != rank:
                            figures["bytes_sent"] += nbytes
                    del full
                else:
                    figures["bytes_received"] += counts[rank]
                _collective(f"{step} (scatter of {name})", rank, timeout,
                            lambda: dist.scatter(recv, scatter_list, src=src, group=group,
                                                 async_op=True))
                del scatter_list
                mine_bytes = recv[:counts[rank]]
                if counts[rank] < longest:
                    mine_bytes = mine_bytes.clone()  # do not keep the padding alive
                got[name] = mine_bytes.view(tdtype).reshape(local_shape)
            figures["exchange_seconds"] += time.perf_counter() - t0
            figures["rounds"] += 1
            del loaded
            # The outputs of this round's tensors (the plan is in checkpoint order, as the
            # Loader's); tied aliases share their target's tensor, tensors read only for an
            # alias are dropped.
            batch = {}
            for name in got:
                for output in outputs_of.get(name, ()):
                    batch[output] = got[name]
            del got
            if on_gpu and device != comm_device:
                batch = {n: t.to(device) for n, t in batch.items()}
            figures["bytes"] += sum(t.nbytes for t in batch.values())
            figures["seconds"] = time.perf_counter() - start
            if stats is not None:
                stats.update(figures)
            yield k, batch
            del batch
    finally:
        reader.close()
        figures["seconds"] = time.perf_counter() - start
        if stats is not None:
            stats.update(figures)

"""One rank of a torch.distributed (gloo) job across the hosts of scripts/multihost.sh, started in
each host by `scripts/multihost.sh exec` (tests/python/test_multihost.py).

    python multihost_gloo_worker.py RANK WORLD MASTER_ADDR MASTER_PORT CHECKPOINT OUT_JSON [--fault]

An all_reduce of rank + 1 over the hosts, then cooperative tensor-parallel loads of CHECKPOINT
(each host reads its own copy) through the same process group, every tensor exchanged and then
the cost model's choice, each compared byte for byte with the independent sliced load of this
rank's slices. Writes its figures to OUT_JSON; any mismatch fails
the process.

With --fault: cooperative loads with O_DIRECT, 2 MB rounds and coop_timeout_ms 4000 (120000 for
the first, a warm-up), over and over, until one fails (the test kills a rank or cuts a link
meanwhile); writes the failure (type, message, seconds from the last completed load) to OUT_JSON
and exits 0."""
import hashlib
import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def fault(rank, world, path, out):
    import time

    import tensorferry
    pg = dist.new_group(list(range(world)))
    dist.barrier(pg)  # both ranks imported what they need before the first load
    loads = 0
    last = time.monotonic()
    try:
        while loads < 1000:
            # The first load warms up (its first reads, beside the rest of a test suite on 2
            # vCPUs, have kept a rank past 4 s in round 0): the 4 s timeout applies from the
            # second load on, where the test brings its fault.
            loader = tensorferry.Loader(path, tp_rank=rank, tp_size=world, shard_rules="builtin",
                                        process_group=pg, budget="2MB", direct="on",
                                        coop_timeout_ms=4000 if loads > 0 else 120_000)
            loader.load()
            loader.close()
            loads += 1
            last = time.monotonic()
            with open(out + ".loads", "w") as f:
                f.write(str(loads))
        outcome = {"type": None, "error": None}
    except Exception as e:  # the test checks the type and the message
        outcome = {"type": type(e).__name__, "error": str(e)}
    outcome.update(loads=loads, seconds=time.monotonic() - last)
    with open(out, "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    os._exit(0)  # the group is unusable after a failed collective: no orderly teardown


def main():
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    addr, port, path, out = sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world)
    if "--fault" in sys.argv[7:]:
        fault(rank, world, path, out)
    try:
        t = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(t)

        import tensorferry
        pg = dist.new_group(list(range(world)))
        independent = tensorferry.Loader(path, tp_rank=rank, tp_size=world,
                                         shard_rules="builtin").load()
        figures = {"rank": rank, "all_reduce": t.item(), "hostname": socket.gethostname(),
                   "host_ip": os.environ.get("TF_MULTIHOST_IP")}
        # Every tensor exchanged (each byte read once in all), then the cost model's choice.
        for exchange in ("all", "auto"):
            # auto: the network rate measured by the probe (the shaped link's, or less), storage
            # modelled as slower still, so that the replicated and dimension-1 tensors pay to
            # exchange and the exact dimension-0 slices stay local (read during the probe). So
            # slow that the probe's time, which the plan counts, is small beside the reads of
            # this tiny checkpoint (0.2 MB: 10 s at 20 KB/s).
            extra = {"coop_storage_rate": "20KB"} if exchange == "auto" else {}
            loader = tensorferry.Loader(path, tp_rank=rank, tp_size=world, shard_rules="builtin",
                                        process_group=pg, coop_exchange=exchange, **extra)
            got = loader.load()
            stats = loader.cooperative_stats
            assert list(got) == list(independent), (list(got), list(independent))
            digest = hashlib.sha256()
            for name, tensor in got.items():
                a = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                b = independent[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                assert tensor.dtype == independent[name].dtype, name
                assert list(tensor.shape) == list(independent[name].shape), name
                assert a == b, f"{name}: the cooperative slice differs from the sliced one"
                digest.update(name.encode() + b"\0" + a)
            read = torch.tensor([stats["bytes_read"]], dtype=torch.int64)
            dist.all_reduce(read)
            figures[exchange] = {"tensors": len(got), "sha256": digest.hexdigest(),
                                 "bytes_read_all_ranks": read.item(),
                                 "bytes_sent": stats["bytes_sent"],
                                 "bytes_received": stats["bytes_received"],
                                 "hosts": stats["hosts"],
                                 "exchanged_tensors": stats["exchanged_tensors"],
                                 "local_tensors": stats["local_tensors"],
                                 "measured_network_rate": stats["measured_network_rate"],
                                 "probe_seconds": stats["probe_seconds"]}
        with open(out, "w") as f:
            json.dump(figures, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

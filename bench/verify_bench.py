"""What load-time checksum verification costs (docs/integrity.md; figures in docs/benchmarks.md,
"Integrity checksums"): `tensorferry load` with --verify off and on, alternating within each round
(the order flips every round), warm into reused buffers (--repeat: the runs after the first reuse
the pooled buffers of the first), cold into fresh memory (files evicted before a one-load
process) and cold into reused buffers (--repeat --drop-cache: the runs after the first find the
files evicted by the run before and reuse its buffers), in the same run. Prints the medians and
the cost of verification (1 - on/off) per case, and first the machine's floor for the warm case:
`tensorferry bench`'s page-cache copy limit against the same copy with each piece hashed as it
lands (on a machine where the load's threads keep every core copying, no verified warm load can
cost less than the hashing does there).

  .venv/bin/python bench/verify_bench.py data/default --rounds 5 [--engine io_uring] [--json]
      [--save FILE]

Each round's figures are printed as the round ends (to stderr with --json), so a run cut off
keeps what it measured; --save writes the summary as JSON to FILE as well.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _pagecache  # noqa: E402


def files_of(path):
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    return [path]


def load(cli, path, engine, verify, repeat, extra):
    cmd = [cli, "load", path, "--engine", engine, "--verify", verify, "--repeat", str(repeat),
           "--no-checksum", "--json"] + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def references(cli, path):
    """The warm floor, from `tensorferry bench`'s references (medians of 3 runs each)."""
    out = subprocess.run([cli, "bench", path, "--runs", "3", "--engines", "pread", "--no-cold",
                          "--json"], check=True, capture_output=True, text=True).stdout
    refs = json.loads(out)["results"]
    copy = refs["ref: page-cache copy limit"]["median_gb_per_s"]
    checksummed = refs["ref: page-cache copy, checksummed"]["median_gb_per_s"]
    return {"copy": copy, "checksummed": checksummed, "cost": 1 - checksummed / copy}


def round_line(r, modes, results, before):
    """One round's figures: the median GB/s of the runs it added, per case and mode."""
    parts = []
    for case, by_mode in results.items():
        got = {m: by_mode[m][before[case][m]:] for m in ("off", "on")}
        if got["off"] and got["on"]:
            parts.append(f"{case} off {statistics.median(got['off']):.2f} "
                         f"on {statistics.median(got['on']):.2f}")
    return f"  round {r + 1} ({' then '.join(modes)}), GB/s: " + "; ".join(parts)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path")
    p.add_argument("--cli", default=os.environ.get("TENSORFERRY_CLI",
                                                   "build/release/bin/tensorferry"))
    p.add_argument("--engine", default="io_uring")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=4, help="warm: loads per process (first dropped)")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--no-floor", action="store_true", help="skip the copy/hash references")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--save", help="write the summary as JSON to this file too")
    a = p.parse_args()
    progress = sys.stderr if a.json else sys.stdout

    def say(line):
        print(line, file=progress, flush=True)

    files = files_of(a.path)
    say(f"{a.path}: engine {a.engine}, {a.rounds} rounds")
    floor = None if a.no_floor else references(a.cli, a.path)
    if floor:
        say(f"  floor: page-cache copy {floor['copy']:.2f} GB/s, checksummed "
            f"{floor['checksummed']:.2f} GB/s: hashing costs a copy on every core "
            f"{floor['cost']:+.1%}")
    results = {"warm": {"off": [], "on": []}, "cold": {"off": [], "on": []},
               "cold, reused buffers": {"off": [], "on": []}}
    verified = {}
    for r in range(a.rounds):
        modes = ("off", "on") if r % 2 == 0 else ("on", "off")
        cold_modes = () if a.no_cold else modes
        before = {case: {m: len(v) for m, v in by.items()} for case, by in results.items()}
        for mode in modes:
            _pagecache.warm(files, unless_cached=True)
            doc = load(a.cli, a.path, a.engine, mode, a.repeat, [])
            results["warm"][mode] += doc["runs_gb_per_s"][1:]  # reused buffers only
            verified[mode] = doc["verified_bytes"]
        for mode in cold_modes:
            left = _pagecache.evict(files)
            if left > 0.01:
                print(f"warning: {left:.1%} of the files still cached", file=sys.stderr)
            doc = load(a.cli, a.path, a.engine, mode, 1, [])
            results["cold"][mode] += doc["runs_gb_per_s"]
        for mode in cold_modes:
            _pagecache.evict(files)
            doc = load(a.cli, a.path, a.engine, mode, a.repeat, ["--drop-cache"])
            results["cold, reused buffers"][mode] += doc["runs_gb_per_s"][1:]
        say(round_line(r, modes, results, before))
    summary = {"path": a.path, "engine": a.engine, "rounds": a.rounds, "repeat": a.repeat,
               "verified_bytes_on": verified.get("on"), "verified_bytes_off": verified.get("off"),
               "loadavg": os.getloadavg(), "floor": floor, "cases": {}}
    for case, by_mode in results.items():
        if not by_mode["off"]:
            continue
        off, on = statistics.median(by_mode["off"]), statistics.median(by_mode["on"])
        summary["cases"][case] = {
            "off_gb_per_s": off, "on_gb_per_s": on, "cost": 1 - on / off if off else 0.0,
            "off_runs": by_mode["off"], "on_runs": by_mode["on"]}
    if a.save:
        with open(a.save, "w") as f:
            json.dump(summary, f, indent=2)
    if a.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{a.path}: medians of {a.rounds} rounds, load average "
          f"{' '.join(f'{x:.2f}' for x in summary['loadavg'])}")
    for case, c in summary["cases"].items():
        off_runs, on_runs = c["off_runs"], c["on_runs"]
        print(f"  {case:20s}  verify off {c['off_gb_per_s']:.2f} GB/s  on {c['on_gb_per_s']:.2f}"
              f" GB/s  cost {c['cost']:+.1%}  (runs off {min(off_runs):.2f}-{max(off_runs):.2f},"
              f" on {min(on_runs):.2f}-{max(on_runs):.2f})")


if __name__ == "__main__":
    main()

"""How much of a budgeted `Loader.iter_batches()` loop's reading hides behind the caller's work.

A caller that iterates (`for batch in loader.iter_batches(): work(batch)`) still holds the batch
before while it asks for the next, so the batch after that does not fit the budget when it would be
read ahead; the loader reads it as soon as the caller drops the one before (src/loader/
batch_iterator.cc). This measures the loop's wall time with a fixed amount of work per batch
(`time.sleep`, standing for a copy to a GPU or a model's own processing) against the work alone
and the reads alone (work 0), warm (the files read through once first), medians over repeats, every
loop with the same Loader (later loops reuse its buffers). Figures: docs/benchmarks.md.
"""
import argparse
import statistics
import time

import tensorferry


def loop(loader, work_s):
    t0 = time.perf_counter()
    n = 0
    for _batch in loader.iter_batches():
        n += 1
        if work_s:
            time.sleep(work_s)
    return time.perf_counter() - t0, n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--budget", default="512M")
    ap.add_argument("--work-ms", default="0,20,50", help="work per batch, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tensorferry.Loader(args.path, budget=args.budget) as loader:
        loop(loader, 0)  # read the files through once, allocate the buffers
        works = [float(w) / 1000 for w in args.work_ms.split(",")]
        runs = {w: [] for w in works}
        batches = 0
        for _ in range(args.repeats):
            for w in works:  # alternating
                t, batches = loop(loader, w)
                runs[w].append(t)
        reads = statistics.median(runs[works[0]]) if works[0] == 0 else None
        print(f"{args.path}: budget {args.budget}, {batches} batches, {args.repeats} repeats")
        for w in works:
            med = statistics.median(runs[w])
            work = w * batches
            line = f"  work {w * 1000:5.0f} ms/batch: loop {med:.3f} s (work alone {work:.3f} s"
            if reads is not None and w:
                hidden = (reads + work - med) / reads if reads else float("nan")
                line += f", reads alone {reads:.3f} s: {100 * hidden:.0f}% of the reads hidden"
            print(line + ")  runs " + ", ".join(f"{t:.3f}" for t in runs[w]))


if __name__ == "__main__":
    main()

"""How far apart the tuner's timings of one candidate land, call after call.

    python3 bench/measure_spread.py --case cross_entropy:32768x256 --kernel k2_sum_2 [--calls 8]

The tuner times a candidate with `tune.measure.measure` (read flush before each repetition,
input copies rotated when they fit in L2) and compares medians taken in different calls.
For a kernel of a few microseconds, the difference between two calls can exceed the
difference between two schedules; this script shows it. It times the heuristic default of
one kernel of a bench/mapreduce.py case:
- `measure` called `--calls` times in a row (fresh buffers each call, as the tuner does);
- one set of buffers kept across calls, each call's median split by which rotated copy a
  repetition used (even / odd copy index), to see whether placement decides the time.
Prints one line per call; writes nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from tilefuse.analyze.bench import _read_flush  # noqa: E402
from tilefuse.tune.families import get_family  # noqa: E402
from tilefuse.tune.measure import ROTATE_MAX, MeasureJob, _state, _with_workspace, measure  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="cross_entropy:32768x256")
    ap.add_argument("--kernel", default="k2_sum_2")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    args = ap.parse_args()
    from tune_eval import mapreduce_kernels

    kernel = next(k for name, k in mapreduce_kernels(args.case) if name.endswith(args.kernel))
    fam = get_family(kernel.family)
    sp = fam.space(kernel, "sm_90a")
    knobs = sp.as_dict(sp.default)
    job = MeasureJob(kernel.family, kernel, knobs, "sm_90a", rep_ms=args.rep_ms)
    print(f"{torch.cuda.get_device_name()}: {args.case} {args.kernel}, default {knobs}")
    for i in range(args.calls):
        m = measure(job)
        s = m.stats
        print(f"measure call {i}: time {m.median_us:.2f} (copies' medians averaged; pooled median "
              f"{s['pooled_median_us']:.2f}) min {s['min_us']:.2f} p20 {s['p20_us']:.2f} "
              f"p80 {s['p80_us']:.2f} us ({s['reps']} reps, {s['copies']} copies)")
    st = _state(job, fam)
    fn = _with_workspace(fam.compile(kernel, fam.build(kernel, knobs, "sm_90a"), "sm_90a"), "cuda")
    copies = ROTATE_MAX  # as many as the tuner rotates for a kernel this small
    sets = [{**{n: x.clone() for n, x in st.inputs.items()},
             **{n: torch.empty(sh, dtype=d, device="cuda") for n, (sh, d) in st.outputs.items()}}
            for _ in range(copies)]
    clear = _read_flush()
    for i in range(args.calls):
        by = {0: [], 1: []}
        for r in range(400):
            c = r % copies
            clear()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            st.problem.call(fn, sets[c])
            b.record()
            by[c % 2].append((a, b))
        torch.cuda.synchronize()
        med = {k: statistics.median(x.elapsed_time(y) * 1e3 for x, y in v) for k, v in by.items()}
        print(f"kept buffers, pass {i}: even copies {med[0]:.2f} us, odd copies {med[1]:.2f} us")


if __name__ == "__main__":
    main()

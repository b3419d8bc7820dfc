"""Row programs whose kernels' reduction passes would recompute long chains of maps, planned
with the recompute limit (graph/fusion.py RECOMPUTE_LIMIT, or --limit) and without it, timed side by
side with eager and torch.compile.

    python3 bench/recompute_limit.py --json bench/results/s24/recompute_limit_h100.json [--rounds 5] [--limit N]

Programs, on random normal bf16 inputs of 16384 rows by 1024 and 4096 columns:
- `chain70_sum`: 35 x (x * 0.999 + 0.001), then a row sum (one pass: never split);
- `lngelu2`, `lngelu3`: 2 or 3 x LayerNorm(GELU-tanh(x)) with weight and bias;
- `softmax5`, `softmax8`, `softmax12`: k x softmax(2 * x).
Each tilefuse program is checked against eager (2x rule against a float64 reference) before it
is timed. Timing: `analyze.bench.timings_ms` (CUDA events, L2 flushed by a read), `--rounds`
rounds in a rotated order, each row's median over rounds. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tilefuse
import tilefuse.graph.fusion as fusion
from tilefuse.analyze.bench import fresh_compile, timings_ms
from tilefuse.check import compare, flatten, float64_reference


def _chain70_sum(x, w, b):
    for _ in range(35):
        x = x * 0.999 + 0.001
    return x.sum(-1)


def _lngelu(k):
    def f(x, w, b):
        for _ in range(k):
            x = F.layer_norm(F.gelu(x, approximate="tanh"), (x.shape[-1],), w, b)
        return x
    return f


def _softmaxes(k):
    def f(x, w, b):
        for _ in range(k):
            x = torch.softmax(x * 2, -1)
        return x
    return f


PROGRAMS = {"chain70_sum": _chain70_sum, "lngelu2": _lngelu(2), "lngelu3": _lngelu(3),
            "softmax5": _softmaxes(5), "softmax8": _softmaxes(8), "softmax12": _softmaxes(12)}


def _compiled(fn, inputs, limit):
    old = fusion.RECOMPUTE_LIMIT
    fusion.RECOMPUTE_LIMIT = limit
    try:
        return tilefuse.compile(fn, inputs)
    finally:
        fusion.RECOMPUTE_LIMIT = old


def rotated_medians(impls: dict, inputs, rounds: int):
    """({name: median ms over rounds}, {name: each round's ms}): every implementation timed once
    a round, the order rotated each round."""
    times = {k: [] for k in impls}
    order = list(impls)
    with torch.no_grad():
        for r in range(rounds):
            for k in order[r % len(order):] + order[:r % len(order)]:
                times[k].append(statistics.median(timings_ms(lambda: impls[k](*inputs))))
    return {k: statistics.median(v) for k, v in times.items()}, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cols", default="1024,4096")
    ap.add_argument("--limit", type=int, default=fusion.RECOMPUTE_LIMIT)
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    LIM = f"limit {args.limit}"
    rows = []
    for cols in [int(c) for c in args.cols.split(",")]:
        torch.manual_seed(0)
        x = torch.randn(16384, cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        inputs = (x, w, torch.randn_like(w))
        for name, fn in PROGRAMS.items():
            impls = {LIM: _compiled(fn, inputs, args.limit), "no limit": _compiled(fn, inputs, 10**9),
                     "eager": fn, "torch.compile": fresh_compile(fn)}
            kernels = {k: sum(s.family == "mapreduce" for s in impls[k].stages.plan.steps)
                       for k in (LIM, "no limit")}
            fresh = (torch.randn_like(x), *inputs[1:])
            ref = flatten(float64_reference(fn, fresh))
            with torch.no_grad():
                eager = flatten(fn(*fresh))
            for k in (LIM, "no limit"):
                (c,) = [compare(name, o, r, e) for o, r, e in zip(flatten(impls[k](*fresh)), ref, eager)]
                if not c.ok:
                    raise SystemExit(f"{name} {cols} ({k}) fails the 2x rule: {c}")
            med, times = rotated_medians(impls, inputs, args.rounds)
            rows.append({"program": name, "cols": cols, "kernels": kernels, "ms": med, "rounds": times})
            print(f"{name:12s} {cols:5d} kernels {kernels[LIM]}/{kernels['no limit']}  "
                  + "  ".join(f"{k} {v * 1e3:8.1f} us" for k, v in med.items()), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gpu": gpu, "limit": args.limit, "rows": rows}, indent=1))
    print(f"\n{gpu}: us (kernels), {LIM} vs no limit; ratio = no limit / {LIM} (> 1: the limit is faster)")
    print(f"{'program':12s} {'cols':>5s} {LIM:>16s} {'no limit':>16s} {'ratio':>6s} {'eager':>9s} {'compile':>9s}")
    for r in rows:
        m, k = r["ms"], r["kernels"]
        print(f"{r['program']:12s} {r['cols']:5d} {m[LIM] * 1e3:10.1f} ({k[LIM]:2d}) "
              f"{m['no limit'] * 1e3:10.1f} ({k['no limit']:2d}) {m['no limit'] / m[LIM]:6.2f} "
              f"{m['eager'] * 1e3:9.1f} {m['torch.compile'] * 1e3:9.1f}")


if __name__ == "__main__":
    sys.exit(main())

"""Whole-call time of a `-c` program four ways: thin call or CUDA-graph replay, programmatic
launch on or off (TILEFUSE_PDL is read when kernels are built, so each is its own compile):
`tilefuse run --bench` times the replay, and for a two-kernel program it read well above the
sum of its kernels' own times (bench/kernel_times.py).

    python3 bench/graph_gap_probe.py -c EXPR [--dtype bf16] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import tilefuse
from tilefuse.analyze.bench import median_ms, timings_ms
from tilefuse.cli import DTYPES
from tilefuse.frontend.expr import parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--expr", required=True)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--json")
    a = ap.parse_args()
    module, inputs, _ = parse(a.expr, getattr(torch, DTYPES[a.dtype]))
    module, inputs = module.cuda(), [x.cuda() for x in inputs]
    runs = {}
    for pdl in ("1", "0"):
        os.environ["TILEFUSE_PDL"] = pdl
        for graphs in (False, True):
            prog = tilefuse.compile(module, tuple(inputs), graphs=graphs)
            runs[f"{'graph' if graphs else 'thin'} pdl={pdl}"] = (lambda p: lambda: p(*inputs))(prog)
    with torch.no_grad():
        runs["eager"] = lambda: module(*inputs)
        per = {k: [] for k in runs}
        for i in range(5):
            for k in list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]:
                per[k].append(median_ms(runs[k]) * 1e3)
        nf = {k: statistics.median(timings_ms(f, flush="none")) * 1e3 for k, f in runs.items()}
    print(f"{torch.cuda.get_device_name()}: {a.expr} ({a.dtype})")
    print(f"{'':16s} {'flushed us':>11s} {'back to back us':>16s}")
    for k in runs:
        print(f"{k:16s} {statistics.median(per[k]):11.1f} {nf[k]:16.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "expr": a.expr, "flushed_us": per, "back_to_back_us": nf}, f,
                      indent=1)


if __name__ == "__main__":
    main()

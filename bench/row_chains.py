"""Row programs whose passes over the row recompute costly values (chains of reductions),
compiled with values kept on chip between passes (codegen/keep.py: "kept", a max and its sum of
exps in two passes; "kept online", the two in one online pass) and without ("recomputed"), timed
side by side with eager and torch.compile.

    python3 bench/row_chains.py --json bench/results/s25/row_chains_h100.json [--rounds 5] \
        [--shapes 16384x1024,16384x4096] [--programs softmax5,softmax]

Programs, on random normal bf16 inputs: recompute_limit.py's (35 maps then a sum; 2 or 3 x
LayerNorm(GELU-tanh); 5, 8 or 12 x softmax(2x)), plus softmax(2x), softmax, LayerNorm and
GELU-LayerNorm once, where little is kept. Each tilefuse program is checked against
eager (2x rule against a float64 reference) before it is timed. Timing: `analyze.bench.timings_ms`
(CUDA events, L2 flushed by a read), `--rounds` rounds in a rotated order, each row's median
over rounds. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from recompute_limit import PROGRAMS as CHAINS
from recompute_limit import rotated_medians
from tilefuse.analyze.bench import fresh_compile

import tilefuse
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.codegen import keep


def _softmax2x(x, w, b):
    return torch.softmax(x * 2, -1)


def _softmax(x, w, b):
    return torch.softmax(x, -1)


def _layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _lngelu1(x, w, b):
    return F.layer_norm(F.gelu(x, approximate="tanh"), (x.shape[-1],), w, b)


PROGRAMS = {**CHAINS, "softmax1": _softmax2x, "softmax": _softmax, "layernorm": _layernorm, "lngelu1": _lngelu1}


def _compiled(fn, inputs, kept: bool, split: bool = True):
    old = keep.ENABLED, keep.SPLIT_LSE
    keep.ENABLED, keep.SPLIT_LSE = kept, split
    try:
        c = tilefuse.compile(fn, inputs)
        c(*inputs)  # kernels are built by the first call at the latest
        return c
    finally:
        keep.ENABLED, keep.SPLIT_LSE = old


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default="16384x1024,16384x4096")
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    rows = []
    for shape in args.shapes.split(","):
        nrows, cols = map(int, shape.split("x"))
        torch.manual_seed(0)
        x = torch.randn(nrows, cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        inputs = (x, w, torch.randn_like(w))
        for name in args.programs.split(","):
            fn = PROGRAMS[name]
            impls = {"kept": _compiled(fn, inputs, True), "kept online": _compiled(fn, inputs, True, False),
                     "recomputed": _compiled(fn, inputs, False),
                     "eager": fn, "torch.compile": fresh_compile(fn)}
            fresh = (torch.randn_like(x), *inputs[1:])
            ref = flatten(float64_reference(fn, fresh))
            with torch.no_grad():
                eager = flatten(fn(*fresh))
            for k in ("kept", "kept online", "recomputed"):
                (c,) = [compare(name, o, r, e) for o, r, e in zip(flatten(impls[k](*fresh)), ref, eager)]
                if not c.ok:
                    raise SystemExit(f"{name} {cols} ({k}) fails the 2x rule: {c}")
            med, times = rotated_medians(impls, inputs, args.rounds)
            rows.append({"program": name, "shape": shape, "ms": med, "rounds": times})
            print(f"{name:12s} {shape:>12s} " + "  ".join(f"{k} {v * 1e3:8.1f} us" for k, v in med.items()), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    print(f"\n{gpu}: us; kept/recomputed > 1 where keeping values is faster; vs compile = torch.compile / kept")
    print(f"{'program':12s} {'shape':>12s} {'kept':>9s} {'online':>9s} {'recomp':>9s} {'ratio':>6s} {'eager':>9s} "
          f"{'compile':>9s} {'vs compile':>10s}")
    for r in rows:
        m = r["ms"]
        print(f"{r['program']:12s} {r['shape']:>12s} {m['kept'] * 1e3:9.1f} {m['kept online'] * 1e3:9.1f} "
              f"{m['recomputed'] * 1e3:9.1f} "
              f"{m['recomputed'] / m['kept']:6.2f} {m['eager'] * 1e3:9.1f} {m['torch.compile'] * 1e3:9.1f} "
              f"{m['torch.compile'] / m['kept']:10.2f}")


if __name__ == "__main__":
    sys.exit(main())

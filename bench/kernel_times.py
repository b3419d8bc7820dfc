"""Each GPU kernel's time in a `-c` program: tilefuse's, eager's and torch.compile's side by side.

    python3 bench/kernel_times.py -c "F.layer_norm(torch.randn(32,96,56,56).permute(0,2,3,1),(96,))" \\
        [--dtype bf16] [--calls 20] [--json FILE]

`tilefuse run --bench` times whole programs; this says which kernel of a program the time went
to. Each implementation runs `--calls` times (after a warm-up) under torch.profiler with the L2
flushed by a 256 MB write between calls (as the bench does), and a kernel's time is its mean
GPU duration per call; the flush kernel is left out. tilefuse runs its thin call (one launch a
kernel, no CUDA graph), so its kernels carry the names the plan gives them.

Each call's span (its first kernel's start to its last kernel's end) is printed too: that is the
program's GPU time where kernels overlap or leave gaps. tilefuse's programmatic dependent launch
is off here (TILEFUSE_PDL=0, unless `--pdl`): with it a kernel starts before the one it depends on
ends and its duration holds the wait (session 59 read a GroupNorm's apply kernel, 20.3 us with
the wait, as a slow statistics kernel), so per-kernel times would not add up to the program's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tilefuse.cli import DTYPES
from tilefuse.frontend.expr import parse

import tilefuse


def kernel_times(fn, inputs, calls: int) -> tuple[dict[str, float], float]:
    """({kernel name: mean us per call}, mean span per call in us) of `fn(*inputs)`, L2 flushed
    between calls."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.fill_(1)
            fn(*inputs)
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    spans, call = [], []
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in sorted(events, key=lambda e: e.time_range.start):
        if "fill" in e.name.lower():  # the flush: the call before it ends here
            if call:
                spans.append(max(c.time_range.end for c in call) - min(c.time_range.start for c in call))
            call = []
            continue
        call.append(e)
        total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    if call:
        spans.append(max(c.time_range.end for c in call) - min(c.time_range.start for c in call))
    per_call = {k: v / calls for k, v in sorted(total.items(), key=lambda kv: -kv[1])}
    return per_call, sum(spans) / max(1, len(spans))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--expr", required=True)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--impls", default="tilefuse,eager,torch.compile", help="comma-separated: which to time")
    ap.add_argument("--pdl", action="store_true", help="keep tilefuse's programmatic dependent launch on")
    a = ap.parse_args()
    if not a.pdl:
        os.environ["TILEFUSE_PDL"] = "0"
    if not torch.cuda.is_available():
        sys.exit("kernel_times: needs a CUDA GPU")
    dtype = getattr(torch, DTYPES[a.dtype])
    module, inputs, _ = parse(a.expr, dtype)
    module, inputs = module.cuda(), [x.cuda() for x in inputs]
    prog = tilefuse.compile(module, tuple(inputs))
    with torch.no_grad():
        make = {"tilefuse": lambda: prog, "eager": lambda: module, "torch.compile": lambda: torch.compile(module)}
        impls = {name: make[name]() for name in a.impls.split(",")}
        out = {name: kernel_times(fn, inputs, a.calls) for name, fn in impls.items()}
    print(f"{torch.cuda.get_device_name()}: {a.expr} ({a.dtype})")
    for name, (ks, span) in out.items():
        print(f"  {name}: {sum(ks.values()):.1f} us in kernels, {span:.1f} us a call first start to last end")
        for k, us in ks.items():
            print(f"    {us:8.1f}  {k[:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "expr": a.expr, "dtype": a.dtype, "pdl": a.pdl,
                       "us": {name: ks for name, (ks, _) in out.items()},
                       "span_us": {name: span for name, (_, span) in out.items()}}, f, indent=1)


if __name__ == "__main__":
    main()

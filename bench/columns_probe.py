"""Schedules of column kernels (codegen/columns.py: reductions over a dim that is not last, a
row a thread) side by side on the same tensors in one process (CUDA events, L2 flushed,
rotated rounds), each checked equal to the default's output; beside them the same program
with column kernels off (TILEFUSE_COLUMNS=0: PyTorch's reductions and row kernels of the
maps, what tilefuse did before), eager and torch.compile.

    python3 bench/columns_probe.py [--only REGEX] [--quick | --batches]

(--quick: the default beside a row a thread, registers and streamed, only. --batches: the
default beside batches of 1, 2 and 4 neighbouring rows a thread, each column's element of them
read as one vector, at splits of 4, 8 and 16 threads a row.)

Every case is compiled with TILEFUSE_COLUMN_MIN_ROWS=1, so that cases of fewer rows than a
column kernel takes by default (graph/fusion.py, COLUMN_MIN_ROWS) measure one against what the
planner does there ("columns off"; for a lone reduction split into pieces there,
rewrites.split_long_columns, also "as planned (pieces)").

Writes $OUT/columns_probe.json (or /tmp/columns_probe.json); a line a case on stdout.
"""
import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_schedules import beside_baselines, case_summary, launched, program_launch  # noqa: E402
import tilefuse  # noqa: E402
from tilefuse.check import compare, float64_reference  # noqa: E402
from tilefuse.analyze.bench import copy_bandwidth  # noqa: E402
from tilefuse.codegen import mapreduce  # noqa: E402
from tilefuse.runtime.launch import compile_kernel  # noqa: E402


def ln_channels_first(x, w, b):
    """ConvNeXt's LayerNorm over the channels of [N, C, H, W]."""
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    x = (x - u) / torch.sqrt(s + 1e-6)
    return w[:, None, None] * x + b[:, None, None]


CASES = {
    "softmax dim 1 32x128x56x56": (lambda x: torch.softmax(x, 1), [(32, 128, 56, 56)]),
    "layernorm channels-first 32x96x56x56": (ln_channels_first, [(32, 96, 56, 56), (96,), (96,)]),
    "mean dim 1 64x512x1024": (lambda x: x.mean(1), [(64, 512, 1024)]),
    "mean dim 1 16x512x4096": (lambda x: x.mean(1), [(16, 512, 4096)]),
    "mean dim 1 256x128x2048": (lambda x: x.mean(1), [(256, 128, 2048)]),
    "mean dim 1 f32 16x512x4096": (lambda x: x.mean(1), [(16, 512, 4096)], torch.float32),
    "softmax dim 1 f32 32x128x56x56": (lambda x: torch.softmax(x, 1), [(32, 128, 56, 56)], torch.float32),
    "amax dim 1 16x256x4096": (lambda x: x.amax(1), [(16, 256, 4096)]),
    "softmax dim 1 8x64x8192": (lambda x: torch.softmax(x, 1), [(8, 64, 8192)]),
    "layernorm channels-first f32 32x96x56x56": (ln_channels_first, [(32, 96, 56, 56), (96,), (96,)], torch.float32),
    "log_softmax dim 0 1000x65536": (lambda x: torch.log_softmax(x, 0), [(1000, 65536)]),
    "log_softmax dim 0 1000x16384": (lambda x: torch.log_softmax(x, 0), [(1000, 16384)]),
    "sum dim 0 8192x4096": (lambda x: x.sum(0), [(8192, 4096)]),
    "mean dim 1 4x1024x1024": (lambda x: x.mean(1), [(4, 1024, 1024)]),
    "softmax dim 1 8x64x32x32": (lambda x: torch.softmax(x, 1), [(8, 64, 32, 32)]),
    "layernorm channels-first 8x96x28x28": (ln_channels_first, [(8, 96, 28, 28), (96,), (96,)]),
    "layernorm channels-first 2x96x28x28": (ln_channels_first, [(2, 96, 28, 28), (96,), (96,)]),
    "softmax dim 1 2x64x32x32": (lambda x: torch.softmax(x, 1), [(2, 64, 32, 32)]),
    "softmax dim 1 1x64x32x32": (lambda x: torch.softmax(x, 1), [(1, 64, 32, 32)]),
    "mean dim 1 2x1024x1024": (lambda x: x.mean(1), [(2, 1024, 1024)]),
    "mean dim 1 1x1024x1024": (lambda x: x.mean(1), [(1, 1024, 1024)]),
    "sum dim 0 8192x2048": (lambda x: x.sum(0), [(8192, 2048)]),
    "sum dim 0 8192x1024": (lambda x: x.sum(0), [(8192, 1024)]),
    "rmsnorm channels-first 16x64x128x128": (
        lambda x, w: x * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6).to(x.dtype) * w[:, None, None],
        [(16, 64, 128, 128), (64,)]),
}


def variants_of(d):
    stream = replace(d, stage="stream", min_blocks=2, batch=1)
    return (("stream unroll 8", replace(stream, unroll=8)), ("stream unroll 16", replace(stream, unroll=16)),
            ("stream unroll 32", replace(stream, unroll=32)), ("stream 16, 128 threads", replace(stream, unroll=16, threads=128)),
            ("regs", replace(d, stage="regs", min_blocks=1, batch=1)), ("regs, 2 CTAs/SM", replace(d, stage="regs", min_blocks=2, batch=1)),
            ("regs, 128 threads", replace(d, stage="regs", threads=128, min_blocks=1, batch=1))) + across_of(d)


def row_a_thread(d):
    """A row a thread, as column kernels were before rows were split (session 67)."""
    base = replace(d, threads=128, group=1, vector=1, across=False, two_pass=False, batch=1)
    return (("a row a thread, stream 32", replace(base, stage="stream", unroll=32, min_blocks=2)),
            ("a row a thread, regs", replace(base, stage="regs", min_blocks=1)))


def batches_of(d):
    """A thread's batch of 1, 2 or 4 neighbouring rows (MapReduceSchedule.batch with across: one
    vector load a column for the batch), at splits of 4, 8 and 16 threads a row, registers."""
    out = []
    for g in (4, 8, 16):
        for batch in (1, 2, 4):
            out.append((f"across {g}, batch {batch}, regs",
                        replace(d, threads=g * 32, group=g, across=True, two_pass=False, min_blocks=1,
                                stage="regs", batch=batch)))
    return tuple(out)


def across_of(d):
    """Each row split between G warps (MapReduceSchedule.across), 32 or 64 rows a CTA."""
    out = []
    for g in (2, 4, 8, 16, 32):
        for rows in (32, 64):
            if g * rows > 1024:
                continue
            base = replace(d, threads=g * rows, group=g, across=True, two_pass=False, min_blocks=1, batch=1)
            out.append((f"across {g} x {rows} rows, stream 16", replace(base, stage="stream", unroll=16)))
            out.append((f"across {g} x {rows} rows, regs", replace(base, stage="regs")))
    return tuple(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="cases whose name matches this regex")
    ap.add_argument("--quick", action="store_true", help="time the default beside a row a thread only")
    ap.add_argument("--batches", action="store_true", help="time the default beside batches of 1, 2, 4 rows")
    args = ap.parse_args()
    copy = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": copy, "cases": {}}
    for name, (fn, shapes, *dtype) in CASES.items():
        if args.only and not re.search(args.only, name):
            continue
        torch.manual_seed(0)
        inputs = tuple(torch.randn(*s, device="cuda", dtype=(dtype or [torch.bfloat16])[0]) for s in shapes)
        os.environ["TILEFUSE_COLUMN_MIN_ROWS"] = "1"
        try:
            prog = tilefuse.compile(fn, inputs)
        finally:
            del os.environ["TILEFUSE_COLUMN_MIN_ROWS"]
        lowered, op, ptrs, outs = program_launch(prog, inputs)
        k = lowered.kernel
        d = mapreduce.default_schedule(k)
        variants = {"default": op.ck}
        for label, s in (row_a_thread(d) if args.quick else batches_of(d) if args.batches else variants_of(d)):
            try:
                variants[label] = compile_kernel(k, None, s)
            except Exception as e:  # noqa: BLE001 (a variant that does not build is reported, not fatal)
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:200]}")
        want = None
        ref, eager = float64_reference(fn, inputs), fn(*inputs)
        for label, got in launched(variants, ptrs, outs):
            # every variant against float64 under the 2x rule (tilefuse.check); bit for bit
            # beside the default where it has the default's stage and split
            c = compare(f"{name} {label}", got, ref, eager)
            assert c.ok, c
            want = got if want is None else want
            got_s = variants[label].source.schedule
            if got_s.stage == d.stage and got_s.across == d.across and got_s.group == d.group:
                assert torch.equal(got, want), (name, label)
        os.environ["TILEFUSE_COLUMNS"] = "0"
        try:
            before = tilefuse.compile(fn, inputs)
        finally:
            del os.environ["TILEFUSE_COLUMNS"]
        extra = {"columns off": lambda: before(*inputs)}
        planned = tilefuse.compile(fn, inputs, graphs=True)
        if any(n.name.endswith("_pieces") for n in planned.graph.nodes):
            # (below the floor, a lone reduction as the planner takes it: pieces, then a finish,
            # rewrites.split_long_columns; its CUDA graph replayed, checked first)
            c = compare(f"{name} as planned", planned(*inputs), ref, eager)
            assert c.ok, c
            extra["as planned (pieces)"] = lambda: planned(*inputs)
        per = beside_baselines(fn, inputs, variants, ptrs, extra)
        out["cases"][name] = case_summary(name, d, inputs, outs, per, copy)
    Path(os.environ.get("OUT", "/tmp"), "columns_probe.json").write_text(json.dumps(out, indent=1))
    print("\ncase | default us | best (label) | torch.compile us | eager us")
    for name, c in out["cases"].items():
        us = c["us"]
        ours = {k: v for k, v in us.items() if k not in ("torch.compile", "eager", "columns off")}
        best = min(ours, key=ours.get)
        print(f"{name} | {us['default']:.1f} | {ours[best]:.1f} ({best}) | {us['torch.compile']:.1f} | {us['eager']:.1f}")


if __name__ == "__main__":
    main()

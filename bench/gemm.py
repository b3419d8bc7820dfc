"""tilefuse's sm_90a GEMM vs cuBLAS (torch.matmul), bf16, issue 4's shapes.

    python3 bench/gemm.py [--json bench/results/gemm_h100.json] [--shapes 4096,4096,4096 ...]
        [--schedules 128x256s4c2,128x128s6c2] [--fused]

Random normal inputs; each tilefuse result is checked against a float32 reference (the 2x
rule of tilefuse.check, against cuBLAS's own bf16 error) before it is timed. Times are
medians of CUDA-event timings (triton.testing.do_bench). TFLOP/s counts 2*M*N*K. The
dense bf16 peak is the best cuBLAS rate measured in this run. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.check import rel_error  # noqa: E402
from tilefuse.codegen import epilogue as epi  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem, GemmSchedule, default_schedule  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402

SHAPES = [(4096, 4096, 4096), (6144, 6144, 6144), (8192, 8192, 8192), (8192, 4096, 4096),
          (8192, 11008, 4096), (8192, 4096, 11008), (16384, 6144, 4096), (8192, 14336, 4096),
          (8192, 4096, 14336), (512, 4096, 4096), (128, 4096, 4096)]


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def parse_schedule(text: str) -> GemmSchedule:
    """'128x256s4c2' -> bm 128, bn 256, 4 stages, 2 consumers (g<G>: group_m, m2: cluster)."""
    import re

    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)c(\d+)(?:g(\d+))?(?:m(\d))?", text)
    if not m:
        raise SystemExit(f"bad schedule {text!r}; want like 128x256s4c2 (g8: group_m, m2: 2-CTA cluster)")
    bm, bn, s, c, g, cl = m.groups()
    return GemmSchedule(int(bm), int(bn), stages=int(s), consumers=int(c), group_m=int(g or 8),
                        cluster_m=int(cl or 1))


def check(out, a, b, b_major):
    bt = b.float() if b_major == "N" else b.float().transpose(-1, -2)
    ref = a.float() @ bt
    lowp = a @ (b if b_major == "N" else b.transpose(-1, -2))
    err, base = rel_error(out.float(), ref), rel_error(lowp.float(), ref)
    ok = bool(torch.isfinite(out).all()) and err <= 2 * base + 1e-5
    return ok, err, base


def run_shape(m, n, k, schedules, b_major="K"):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(*((n, k) if b_major == "K" else (k, n)), device="cuda", dtype=torch.bfloat16)
    bt = b.t() if b_major == "K" else b
    t_cublas = median_ms(lambda: torch.matmul(a, bt))
    flops = 2 * m * n * k
    rows = []
    prob = GemmProblem(m, n, k, "bf16", b_major=b_major)
    for sched in schedules or [default_schedule(prob)]:
        t0 = time.perf_counter()
        g = compile_gemm(prob, sched)
        compile_s = time.perf_counter() - t0
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        g(a, b, out=out)
        torch.cuda.synchronize()
        ok, err, base = check(out, a, b, b_major)
        t = median_ms(lambda: g(a, b, out=out)) if ok else float("nan")
        rows.append(dict(m=m, n=n, k=k, b_major=b_major, schedule=str(sched), ok=ok, err=err, cublas_err=base,
                         ms=t, cublas_ms=t_cublas, tflops=flops / t / 1e9 if ok else 0.0,
                         cublas_tflops=flops / t_cublas / 1e9, ratio=t_cublas / t if ok else 0.0,
                         regs=g.info.registers, spills=g.info.spill_stores + g.info.spill_loads,
                         compile_s=compile_s))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", help="M,N,K triples")
    ap.add_argument("--schedules", default="", help="comma-separated, e.g. 128x256s4c2,128x128s6c2")
    ap.add_argument("--b-major", default="K", choices=["K", "N"])
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    scheds = [parse_schedule(s) for s in args.schedules.split(",") if s]
    rows = []
    for m, n, k in shapes:
        for r in run_shape(m, n, k, scheds, args.b_major):
            rows.append(r)
            print(json.dumps(r), flush=True)
    best = {}
    for r in rows:
        key = (r["m"], r["n"], r["k"])
        if key not in best or r["ratio"] > best[key]["ratio"]:
            best[key] = r
    peak = max(r["cublas_tflops"] for r in rows)
    gpu = torch.cuda.get_device_name()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, peak_tflops=peak, rows=rows), indent=1))
    print(f"\n{gpu}, bf16, B {args.b_major}-major; peak = best cuBLAS rate here = {peak:.0f} TFLOP/s")
    print(f"{'M x N x K':>22} {'schedule':>44} {'ok':>3} {'TFLOP/s':>8} {'cuBLAS':>7} {'ratio':>6} {'%peak':>6}")
    for (m, n, k), r in best.items():
        print(f"{f'{m}x{n}x{k}':>22} {r['schedule'][:44]:>44} {'y' if r['ok'] else 'N':>3} {r['tflops']:8.0f} "
              f"{r['cublas_tflops']:7.0f} {r['ratio']:6.3f} {100 * r['tflops'] / peak:6.1f}")
    ratios = [r["ratio"] for r in best.values() if r["ratio"] > 0]
    if ratios:
        print(f"geomean ratio vs cuBLAS: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
              f"min {min(ratios):.3f}")


if __name__ == "__main__":
    main()

"""Stream-K against whole tiles: each shape's default tile with and without stream-K, cuBLAS in
the same run, bf16, random normal inputs, H100.

    python3 bench/gemm_stream_k.py [--json bench/results/gemm_stream_k_h100.json] [M,N,K ...]

Without shapes: issue 4's nine large shapes. Each schedule is timed twice, interleaved
(whole, stream-K, whole, stream-K), so the table shows the run-to-run spread next to the
difference. Every result is checked against a float32 reference first (bench/gemm.py's
run_shape: the 2x rule, outputs poisoned). Prints a table and each variant's geomean
against cuBLAS last.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gemm as bench  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem, default_schedule  # noqa: E402

SMS = 132


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", help="M,N,K triples (default: issue 4's large shapes)")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] or bench.SHAPES[:9]
    rows = []
    for m, n, k in shapes:
        d = default_schedule(GemmProblem(m, n, k))
        whole, sk = replace(d, stream_k=0), replace(d, stream_k=SMS)
        rs = bench.run_shape(m, n, k, [whole, sk, whole, sk])
        for r, role in zip(rs, ["whole", "stream-k", "whole", "stream-k"]):
            r["role"] = role
        rows += rs
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    print(f"{torch.cuda.get_device_name()}: us (ratio to cuBLAS), two samples each")
    print(f"{'shape':>18} {'whole':>26} {'stream-K':>26} {'cuBLAS us':>10}")
    for m, n, k in shapes:
        rr = [r for r in rows if (r["m"], r["n"], r["k"]) == (m, n, k)]

        def cell(role):
            return " ".join(f"{r['ms'] * 1e3:6.1f} ({r['ratio']:.3f})" for r in rr if r["role"] == role)
        print(f"{f'{m}x{n}x{k}':>18} {cell('whole'):>26} {cell('stream-k'):>26} {rr[0]['cublas_ms'] * 1e3:10.1f}")
    for role in ("whole", "stream-k"):
        rr = [r for r in rows if r["role"] == role and r["ok"]]
        if rr:
            print(f"{role}: geomean {math.exp(sum(math.log(r['ratio']) for r in rr) / len(rr)):.3f}x cuBLAS")


if __name__ == "__main__":
    main()

"""Run one tilefuse GEMM per schedule, once, for a profiler to capture (Nsight Compute):

    ncu --section SpeedOfLight --section WarpStateStats python3 bench/gemm_profile.py \
        --shape 8192,8192,8192 --schedules 128x256s4c2,128x256s4c2m2
    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg \
        python3 bench/gemm_profile.py --shape 8192,4096,4096 --epilogues plain,residual,swiglu

--epilogues runs the default-schedule GEMM once per epilogue (bench/gemm.py's epilogue_kinds:
plain, bias+gelu, swiglu (output N/2 wide on an N-wide product), residual, row-scale). Each
kernel then runs alone from an idle GPU, and an epilogue's cost is the duration and cycle
difference (bench/ncu_table.py prints them), free of the power-limit clock drift that moves
same-run CUDA-event ratios by 2-3%. The device notes ask to leave ncu's clock control off.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gemm import epilogue_kinds, epilogue_operands, parse_schedule  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8192,8192,8192")
    ap.add_argument("--schedules", default="128x256s4c2")
    ap.add_argument("--cublas", action="store_true", help="also run torch.matmul once")
    ap.add_argument("--epilogues", default="", help="comma-separated: plain, bias+gelu, swiglu, residual, row-scale")
    args = ap.parse_args()
    m, n, k = (int(x) for x in args.shape.split(","))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if args.epilogues:
        operands, kinds = epilogue_operands(m, n), epilogue_kinds(m, n)
        for kind in args.epilogues.split(","):
            ep, names = kinds[kind]
            g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=ep))
            g(a, b, **{x: operands[x] for x in names})
        torch.cuda.synchronize()
        return
    for text in args.schedules.split(","):
        g = compile_gemm(GemmProblem(m, n, k, "bf16"), parse_schedule(text))
        g(a, b)
    if args.cublas:
        torch.matmul(a, b.t())
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

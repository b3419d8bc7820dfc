"""Residual-epilogue GEMMs three ways, the plain GEMM beside (with the default ring and with one
stage less): one launch each, two rounds, for Nsight Compute to time from an idle GPU
(same-run CUDA events at the power limit cannot resolve 1-3%):

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,\\
        smsp__inst_executed.sum,dram__bytes_read.sum -k regex:tf_gemm \\
        python3 bench/gemm_residual_ab.py 8192,4096,4096 8192,2048,2048 > run.csv
    python3 bench/ncu_table.py run.csv --labels "$(cat labels.txt)" --sep ' '

- ahead: the words read into registers, each store slot's PRELOAD_SLOTS slots ahead (the
  first slots' in the main loop's last K step): MAINLOOP_PAIR_REGS = 0;
- mainloop: all the tile's words read into registers in the main loop's last PRELOAD_STEPS
  K steps (the default where they fit);
- tma: the residual tile loaded by TMA into the store slots, one stage less in the ring
  (GemmSchedule.tma_loads; the default where K is short).

Checks first that all three give the same bits (they differ only in how the residual gets
to the epilogue), and writes the kernels' labels, in launch order, to $OUT/labels.txt (or
./labels.txt), space-separated (the shapes have commas).
"""
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen import epilogue as epi, gemm_sm90 as g  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402


def kernels(m: int, n: int, k: int) -> dict:
    plain = GemmProblem(m, n, k)
    res = GemmProblem(m, n, k, epilogue=epi.standard(m, n, "bf16", residual=True))
    base = g.default_schedule(plain)  # the plain GEMM's schedule: what the residual variants start from
    budget = g.MAINLOOP_PAIR_REGS
    g.MAINLOOP_PAIR_REGS = 0
    try:
        ahead = compile_gemm(res, base)
    finally:
        g.MAINLOOP_PAIR_REGS = budget
    three = replace(base, stages=base.stages - 1)
    tma = compile_gemm(res, replace(three, tma_loads=True))
    if not tma.source.tma_loads:
        raise SystemExit(f"{m}x{n}x{k}: {three} cannot take the residual by TMA")
    return {"plain": compile_gemm(plain, base), f"plain-s{three.stages}": compile_gemm(plain, three),
            "ahead": ahead, "mainloop": compile_gemm(res, base), "tma": tma}


def main(specs: list[str]) -> None:
    labels = []
    for spec in specs:
        m, n, k = (int(v) for v in spec.split(","))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ks = kernels(m, n, k)
        variants = [name for name in ks if not name.startswith("plain")]
        outs = [ks[name](x, w, residual=r) for name in variants]
        labels += [f"{spec}:check-{name}" for name in variants]
        same = all(torch.equal(outs[0], o) for o in outs)
        print(f"{spec}: variants give the same bits: {same}", file=sys.stderr, flush=True)
        if not same:
            raise SystemExit(f"{spec}: the variants disagree")
        for _ in range(2):
            for name, f in ks.items():
                f(x, w) if name.startswith("plain") else f(x, w, residual=r)
                torch.cuda.synchronize()
                labels.append(f"{spec}:{name}")
    Path(os.environ.get("OUT", "."), "labels.txt").write_text(" ".join(labels))


if __name__ == "__main__":
    main(sys.argv[1:] or ["8192,4096,4096", "8192,2048,2048"])

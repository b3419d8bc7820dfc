"""Residual-epilogue GEMMs with their residual pairs loaded ahead (the default) and in their own
store slot (PRELOAD_SLOTS = 0), the plain GEMM beside: one launch each, two rounds, for Nsight
Compute to time from an idle GPU (same-run CUDA events at the power limit cannot resolve 1-3%):

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,\\
        smsp__inst_executed.sum,dram__bytes_read.sum -k regex:tf_gemm \\
        python3 bench/gemm_residual_ab.py 8192,4096,4096 8192,2048,2048 > run.csv
    python3 bench/ncu_table.py run.csv --labels $(cat labels.txt)

Checks first that both variants give the same bits (they differ only in when they load), and
writes the kernels' labels, in launch order, to $OUT/labels.txt (or ./labels.txt).
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen import epilogue as epi, gemm_sm90 as g  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402

VARIANTS = {"in-slot": 0, f"ahead{g.PRELOAD_SLOTS}": g.PRELOAD_SLOTS}


def main(specs: list[str]) -> None:
    labels = []
    default = g.PRELOAD_SLOTS
    for spec in specs:
        m, n, k = (int(v) for v in spec.split(","))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ep = epi.standard(m, n, "bf16", residual=True)
        ks = {"plain": compile_gemm(GemmProblem(m, n, k))}
        for name, slots in VARIANTS.items():
            g.PRELOAD_SLOTS = slots
            ks[name] = compile_gemm(GemmProblem(m, n, k, epilogue=ep))
        g.PRELOAD_SLOTS = default
        outs = [f(x, w, residual=r) for name, f in ks.items() if name != "plain"]
        labels += [f"{spec}:check-{name}" for name in ks if name != "plain"]
        same = all(torch.equal(outs[0], o) for o in outs)
        print(f"{spec}: variants give the same bits: {same}", file=sys.stderr, flush=True)
        if not same:
            raise SystemExit(f"{spec}: the variants disagree")
        for _ in range(2):
            for name, f in ks.items():
                f(x, w) if name == "plain" else f(x, w, residual=r)
                torch.cuda.synchronize()
                labels.append(f"{spec}:{name}")
    Path(os.environ.get("OUT", "."), "labels.txt").write_text(",".join(labels))


if __name__ == "__main__":
    main(sys.argv[1:] or ["8192,4096,4096", "8192,2048,2048"])

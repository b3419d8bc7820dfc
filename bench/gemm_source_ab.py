"""The default GEMM kernel of this tree against the same kernel as another revision rendered it:
one launch each, alternating, for Nsight Compute to time from an idle GPU (two rounds).

On the CPU, in a checkout of the old revision, save its kernels' sources:

    python3 bench/gemm_source_ab.py dump old.json 8192,4096,4096 8192,4096,4096,residual

then, in this tree on the GPU:

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,\\
        smsp__inst_executed.sum,dram__bytes_read.sum -k regex:tf_gemm \\
        python3 bench/gemm_source_ab.py run old.json > run.csv
    python3 bench/ncu_table.py run.csv --labels "$(cat labels.txt)" --sep ' '

Each case is M,N,K[,epilogue] with epilogue one of plain (default), residual, gelu (bias+GELU),
rowscale, swiglu (N the interleaved gate/up width). Both kernels are compiled from their own
source with this tree's launcher (the old source must take the same parameters), run on the
same random inputs, and must give the same bits before they are timed. Labels go to $OUT/labels.txt (or ./labels.txt), space-separated.
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen import epilogue as epi, gemm_sm90 as g  # noqa: E402


def problem(case: str) -> g.GemmProblem:
    m, n, k, *rest = case.split(",")
    m, n, k = int(m), int(n), int(k)
    kind = rest[0] if rest else "plain"
    ep = {"plain": None, "residual": lambda: epi.standard(m, n, "bf16", residual=True),
          "gelu": lambda: epi.standard(m, n, "bf16", bias="col", activation="gelu"),
          "rowscale": lambda: epi.standard(m, n, "bf16", row_scale=True),
          "swiglu": lambda: epi.glu(m, n, "bf16")}[kind]
    return g.GemmProblem(m, n, k, epilogue=ep() if ep else None)


def dump(path: str, cases: list[str]) -> None:
    out = {}
    for case in cases:
        p = problem(case)
        out[case] = g.render(p, g.default_schedule(p)).source
    Path(path).write_text(json.dumps(out))


def run(path: str) -> None:
    import torch

    from tilefuse import dtypes
    from tilefuse.runtime import cache
    from tilefuse.runtime.gemm import GemmKernel, compile_gemm

    old = json.loads(Path(path).read_text())
    labels = []
    for case, old_source in old.items():
        p = problem(case)
        new = compile_gemm(p, g.default_schedule(p))
        src = dataclasses.replace(new.source, source=old_source)
        cubin, hit = cache.compile_cached(src.source, src.name, "sm_90a")
        kernels = {"old": GemmKernel(src, cubin, hit), "new": new}
        x = torch.randn(p.m, p.k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(p.n, p.k, device="cuda", dtype=torch.bfloat16) / p.k ** 0.5
        ops = {b.name: torch.randn(b.shape, device="cuda", dtype=dtypes.to_torch(b.dtype))
               for b in (epi.operands(p.epilogue) if p.epilogue is not None else ())}
        outs = [f(x, w, **ops) for f in kernels.values()]
        labels += [f"{case}:check-{name}" for name in kernels]
        if not torch.equal(outs[0], outs[1]):
            raise SystemExit(f"{case}: the two kernels disagree")
        print(f"{case}: old and new give the same bits", file=sys.stderr, flush=True)
        for _ in range(2):
            for name, f in kernels.items():
                f(x, w, **ops)
                torch.cuda.synchronize()
                labels.append(f"{case}:{name}")
    Path(os.environ.get("OUT", "."), "labels.txt").write_text(" ".join(labels))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("dump", "run"):
        raise SystemExit(__doc__)
    dump(sys.argv[2], sys.argv[3:]) if sys.argv[1] == "dump" else run(sys.argv[2])

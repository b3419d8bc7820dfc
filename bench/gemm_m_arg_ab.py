"""GEMMs that take M as an argument against the same kernels with M baked in (`m_arg=False`):
what counting tiles at run time costs, shape by shape, in one run.

    python3 bench/gemm_m_arg_ab.py [--json out.json] [--rounds 3] [--shapes 4096,4096,4096[,kind] ...]

Both kernels get the default schedule of the shape and the same random inputs; they must give
the same bits before they are timed. Each round times baked, then argument, then argument,
then baked (flushed per-call medians, tilefuse.analyze.bench.median_ms), so a clock that drifts
during the run weighs on both alike. The ratio is baked time / argument time (> 1: the
argument kernel is faster). Kinds: plain (default), gelu (bias + GELU), residual, swiglu (N the
interleaved gate/up width), rmsnorm (residual add + the sum of squares per 128 columns).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from tilefuse.analyze.bench import median_ms  # noqa: E402
from tilefuse.codegen import epilogue as epi  # noqa: E402
from tilefuse.codegen import gemm_sm90 as g  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402

# issue 4's shapes, then prompt-like Ms whose tiles do not fill whole waves (stream-K) or tiles
SHAPES = ["4096,4096,4096", "6144,6144,6144", "8192,8192,8192", "8192,4096,4096", "8192,11008,4096",
          "8192,4096,11008", "16384,6144,4096", "8192,14336,4096", "8192,4096,14336", "512,4096,4096",
          "128,4096,4096", "1500,4096,4096", "3000,22016,4096", "3000,4096,11008", "777,1024,4096",
          "8192,4096,4096,gelu", "8192,4096,4096,residual", "8192,22016,4096,swiglu", "3000,4096,4096,residual",
          "3000,4096,4096,rmsnorm"]


def rmsnorm_partials(m, n):
    """The RMSNorm fold's producer: residual add, stored, and its sum of squares per 128 columns."""
    e = epi.EpilogueBuilder(m, n)
    x = e.op("add", e.acc(), e.load("residual", "tile", "bf16"))
    e.store("out", x, "bf16")
    e.partial_sum("sumsq", e.op("mul", x, x))
    return e.kernel()


def case(text: str):
    m, n, k, *rest = text.split(",")
    m, n, k = int(m), int(n), int(k)
    kind = rest[0] if rest else "plain"
    ep = {"plain": lambda: None, "gelu": lambda: epi.standard(m, n, "bf16", bias="col", activation="gelu"),
          "residual": lambda: epi.standard(m, n, "bf16", residual=True),
          "swiglu": lambda: epi.glu(m, n, "bf16"), "rmsnorm": lambda: rmsnorm_partials(m, n)}[kind]()
    return g.GemmProblem(m, n, k, "bf16", epilogue=ep), kind


def operands(problem):
    ep = problem.out_epilogue
    a = torch.randn(problem.m, problem.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(problem.n, problem.k, device="cuda", dtype=torch.bfloat16)
    ts = {}
    for buf in ep.params:
        if buf.name == epi.ACC:
            continue
        dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[buf.dtype]
        ts[buf.name] = (torch.randn(buf.shape, device="cuda", dtype=dt) if buf.role != "out"
                        else torch.empty(buf.shape, device="cuda", dtype=dt))
    return a, b, ts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    rows = []
    from concurrent.futures import ThreadPoolExecutor

    cases = [case(text) for text in args.shapes]
    scheds = [g.default_schedule(p) for p, _ in cases]
    jobs = [job for (p, _), s in zip(cases, scheds) for job in ((p, s), (replace(p, m_arg=False), s))]
    with ThreadPoolExecutor(8) as pool:  # (NVRTC runs outside the GIL)
        built = iter(list(pool.map(lambda ps: compile_gemm(*ps), jobs)))
    for text, (problem, kind), sched in zip(args.shapes, cases, scheds):
        arg, baked = next(built), next(built)
        a, b, ts = operands(problem)
        outs = {}
        for label, kern in (("baked", baked), ("arg", arg)):
            mine = {nm: (t.clone().fill_(float("nan")) if t.is_floating_point() and problem.out_epilogue.buffer(nm).role == "out"
                         else t) for nm, t in ts.items()}
            kern(a, b, **mine)
            torch.cuda.synchronize()
            outs[label] = {nm: t for nm, t in mine.items() if problem.out_epilogue.buffer(nm).role == "out"}
        # every element written (outputs poisoned with NaN) and the same bits from both
        same = all(bool(torch.isfinite(outs["arg"][nm]).all()) and torch.equal(outs["baked"][nm], outs["arg"][nm])
                   for nm in outs["arg"])
        times = {"baked": [], "arg": []}
        if same:
            calls = {"baked": lambda: baked(a, b, **ts), "arg": lambda: arg(a, b, **ts)}
            for _ in range(args.rounds):
                for label in ("baked", "arg", "arg", "baked"):
                    times[label].append(median_ms(calls[label], warmup=20, rep=100))
        tb = statistics.median(times["baked"]) if same else math.nan
        ta = statistics.median(times["arg"]) if same else math.nan
        rows.append({"shape": text, "kind": kind, "schedule": str(sched), "m_arg": arg.source.m_arg,
                     "same_bits": same, "baked_ms": tb, "arg_ms": ta, "ratio": tb / ta,
                     "baked_all": times["baked"], "arg_all": times["arg"]})
        print(f"{text:28s} {'arg' if arg.source.m_arg else 'BAKED':5s} same={same} baked {tb * 1e3:9.1f} us  "
              f"arg {ta * 1e3:9.1f} us  ratio {tb / ta:.3f}", flush=True)
    ratios = [r["ratio"] for r in rows if r["same_bits"] and r["m_arg"]]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.nan
    print(f"\n{gpu}: baked / argument time, geomean over {len(ratios)} argument kernels: {geo:.4f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows,
                                               "geomean": geo}, indent=1))


if __name__ == "__main__":
    main()

"""GEMMs taking M as an argument, run at many M through the tuner's correctness check: every
epilogue kind below x every schedule x M in MS, outputs NaN-poisoned, sampled rows against
float32 (tune.gemm.gemm_check), and which kernels served which Ms.

    python3 bench/gemm_m_arg_check.py [--jobs 8] [--kinds plain,rms,...]

Builds every distinct source first in `--jobs` processes (NVRTC), then, with a GPU, runs each
case. Without one it stops after the builds. Session 41, H200: 382 right, 0 wrong (the other
38 cases a schedule refuses); 96 of 158 kernels served more than one M
(results/s41/gemm_m_arg_check_h200.txt).
"""
import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from tilefuse.codegen import epilogue as epi  # noqa: E402
from tilefuse.codegen import gemm_sm90 as g  # noqa: E402
from tilefuse.codegen.epilogue import EpilogueBuilder  # noqa: E402
from tilefuse.runtime import cache  # noqa: E402
from gemm_m_arg_ab import rmsnorm_partials  # noqa: E402

S = g.GemmSchedule


def _lse(m, n):
    e = EpilogueBuilder(m, n)
    e.partial_lse("mx", "sm", e.op("mul", e.acc(), e.load("rs", "row", "f32")))
    return e.kernel()


KINDS = {"plain": lambda m, n: None,
         "rsres": lambda m, n: epi.standard(m, n, "bf16", row_scale=True, residual=True, bias="col"),
         "rms": rmsnorm_partials, "lse": _lse, "glu": lambda m, n: epi.glu(m, n, "bf16"),
         "rope": lambda m, n: epi.rope(m, n, "bf16", table=(512, 64))}
SCHEDULES = {"big": S(128, 256, stages=4), "cm2": S(128, 256, stages=4, cluster_m=2),
             "cn2": S(128, 128, stages=6, cluster_n=2), "pp": S(128, 128, stages=4, pingpong=True),
             "sk": S(128, 128, stages=6, stream_k=132), "skc": S(128, 128, stages=6, stream_k=132, cluster_m=2),
             "sp3": S(128, 128, stages=6, split_k=3), "dir": S(128, 64, stages=8, tma_store=False),
             "tl": S(128, 256, stages=3, tma_loads=True), "c1": S(64, 128, stages=8, consumers=1)}
MS = [40, 100, 2000, 2048, 3001, 4224, 8448]
N, K = 2048, 1024


def cases(kinds):
    for kind in kinds:
        for sname, s in SCHEDULES.items():
            for m in MS:
                yield kind, sname, m, g.GemmProblem(m, N, K, epilogue=KINDS[kind](m, N)), s


def _build(item):
    source, name = item
    cache.compile_cached(source, name, "sm_90a")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    todo = {}
    for *_, p, s in cases(kinds):
        try:
            r = g.render(p, s)
        except g.GemmError:
            continue
        todo[r.source] = r.name
    t = time.time()
    with ProcessPoolExecutor(args.jobs) as ex:
        list(ex.map(_build, todo.items()))
    print(f"built {len(todo)} sources in {time.time() - t:.0f} s", flush=True)
    if not torch.cuda.is_available():
        return
    from tilefuse.runtime.gemm import compile_gemm
    from tilefuse.tune.gemm import GemmTask, gemm_check

    bad = ok = 0
    served: dict = {}
    for kind, sname, m, p, s in cases(kinds):
        try:
            fn = compile_gemm(p, s)
        except g.GemmError:
            continue
        try:
            chk = gemm_check(GemmTask(p), 1, "cuda")
            outs = fn.allocate_outputs()
            chk.call(fn, {**chk.inputs, **outs})
            torch.cuda.synchronize()
            why = chk.check(outs)
            finite = all(torch.isfinite(v).all().item() for v in outs.values())
        except Exception as e:  # (reported with the case, and the run goes on)
            why, finite = "raised " + repr(e)[:200], True
        served.setdefault(fn.source.name, []).append(m)
        if why or not finite:
            bad += 1
            print("BAD", kind, sname, m, "m_arg" if fn.source.m_arg else "baked", fn.source.name, why,
                  "" if finite else "non-finite output", flush=True)
        else:
            ok += 1
    shared = sum(len(ms) > 1 for ms in served.values())
    print(f"{torch.cuda.get_device_name()}: {ok} right, {bad} wrong; {shared} of {len(served)} kernels ran at more than one M")


if __name__ == "__main__":
    main()

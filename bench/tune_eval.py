"""The autotuner's evaluation (issue 6): GEMM shapes of issue 4, map-reduce shapes of issue 2.

    python3 bench/tune_eval.py --json bench/results/tune_eval_h100.json \\
        [--gemm 4096x4096x4096,128x4096x4096] [--mapreduce rmsnorm:32768x4096] [--budget 64]
        [--time-limit 300]

For each kernel (bf16), in a fresh tuning cache and a fresh cubin cache:
- `tilefuse tune`'s search: SP-MCTS with `--budget` candidates over the whole knob space,
  candidates compiled ahead on `--jobs` CPU processes; its pick and wall-clock time (cold:
  every candidate rendered and compiled inside that time; the compile processes and the
  benchmark worker are started once per run, before the first kernel, and their start-up
  is recorded apart);
- the exhaustive best over a *restricted neighbourhood* (the whole spaces hold 500-1000
  candidates, too many to measure all in this run's GPU budget): GEMM: every tile shape
  (bm, bn, consumers) at its deepest shared-memory ring, with group_m (or, where the grid has
  fewer tile rows than it, the group covering them all), cluster_m and the other knobs at the
  heuristic's values; map-reduce: every stage, threads, group, cluster and
  pipeline, with vector, unroll and min_blocks at the heuristic's values. So "SP-MCTS / exhaustive" below 1.00 means the search found something the
  neighbourhood does not hold;
- the heuristic default, the SP-MCTS pick and the exhaustive pick re-timed side by side in
  one worker, `--rounds` times each (min of medians), so the ratios compare like with like
  ("paired": the median over rounds of the pick's time over the exhaustive pick's in the
  same round, which cancels drift between rounds);
  for GEMMs, cuBLAS (torch.matmul) timed the same way in this process;
- a second tuning run on the warm cache: the kernel is a hit; its wall time.
Times are kernel times as the tuner measures them (tune/measure.py: median with L2 flushed by
a read; when the buffers fit in L2, copies rotated and their medians averaged).
Writes JSON after every kernel (a run cut short keeps what it measured); prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.tune.cache import TuneCache  # noqa: E402
from tilefuse.tune.device import cuda_device  # noqa: E402
from tilefuse.tune.families import get_family  # noqa: E402
from tilefuse.tune.gemm import GROUP_M, STAGES, GemmTask  # noqa: E402
from tilefuse.tune.measure import MeasureJob, measure  # noqa: E402
from tilefuse.tune.precompile import compiler_pool, warm  # noqa: E402
from tilefuse.tune.tuner import TuneOptions, Tuner  # noqa: E402
from tilefuse.tune.worker import WorkerPool  # noqa: E402

GEMM_SHAPES = "4096x4096x4096,8192x11008x4096,512x4096x4096,128x4096x4096,8192x8192x8192"
ALL_GEMM = ("4096x4096x4096,6144x6144x6144,8192x8192x8192,8192x4096x4096,8192x11008x4096,8192x4096x11008,"
            "16384x6144x4096,8192x14336x4096,8192x4096x14336,512x4096x4096,128x4096x4096")
MR_CASES = "rmsnorm:32768x4096,softmax:4096x65536"


def neighbourhood(space, family: str):
    """The restricted sub-space measured exhaustively (see the module docstring)."""
    d = space.as_dict(space.default)
    if family == "gemm_sm90":
        fixed = {n: d[n] for n in space.names if n not in ("bm", "bn", "consumers", "stages", "group_m")}
        sub = space.restrict(**fixed)
        ok = sub.admits

        def deepest(k, knob, values):  # no admitted value of `knob` above k's
            return not any(ok({**k, knob: v}) for v in values if v > k[knob])

        def admits(k):
            if not ok(k):
                return False
            if k == {n: d[n] for n in k}:
                return True
            if "stages" in k and "group_m" not in k:
                return deepest(k, "stages", STAGES)  # the deepest ring per tile
            if "group_m" in k:  # the heuristic's group; where it is pruned (few tile rows), the covering one
                return k["group_m"] == d["group_m"] or (not ok({**k, "group_m": d["group_m"]})
                                                        and deepest(k, "group_m", GROUP_M))
            return True

        from dataclasses import replace

        return replace(sub, admits=admits)
    return space.restrict(vector=d["vector"], unroll=d["unroll"], min_blocks=d["min_blocks"])


def in_neighbourhood(nb, knobs) -> bool:
    """Whether a pick is one of the neighbourhood's candidates (admits prunes prefix by prefix,
    so membership is decided by enumerating, which needs no rendering)."""
    if not knobs or any(knobs.get(n) not in d.values for n, d in zip(nb.names, nb.dims)):
        return False
    return nb.from_dict(knobs) in set(nb.admitted())


def retime(pool, kernel, knob_sets: dict, arch: str, rounds: int, rep_ms: float) -> tuple[dict, list]:
    """(name -> min over rounds of its time, each round's times), candidates interleaved in
    one worker; a time is `measure`'s (the median, or with rotated copies their medians' mean)."""
    seen: dict = {}
    alias = {}  # name -> the first name with the same knobs: a pick equal to another is timed once
    for name, knobs in knob_sets.items():
        alias[name] = seen.setdefault(tuple(sorted(knobs.items())), name)
    best, per_round = {}, []
    for _ in range(rounds):
        times = {}
        for name in (n for n in knob_sets if alias[n] == n):
            job = MeasureJob(kernel.family, kernel, knob_sets[name], arch, rep_ms=rep_ms)
            out = pool.submit(measure, job).result()
            if out.ok:
                times[name] = out.value.median_us
                best[name] = min(best.get(name, float("inf")), out.value.median_us)
            else:
                print(f"  re-timing {name} failed: {out.reason}", flush=True)
        per_round.append({n: times[a] for n, a in alias.items() if a in times})
    best = {n: best[a] for n, a in alias.items() if a in best}
    return best, per_round


def paired(per_round: list, a: str, b: str) -> float:
    """Median over rounds of a's time over b's in the same round (drift between rounds cancels)."""
    r = [t[a] / t[b] for t in per_round if a in t and b in t]
    return statistics.median(r) if r else float("nan")


def cublas_us(problem: GemmProblem, rounds: int, rep_ms: float) -> float:
    """torch.matmul on the same shapes (x @ W.T), median with L2 flushed by a read (as the
    candidates are timed), min of rounds."""
    from tilefuse.analyze.bench import median_ms

    a = torch.randn(problem.m, problem.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(problem.n, problem.k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(problem.m, problem.n, device="cuda", dtype=torch.bfloat16)
    t = min(median_ms(lambda: torch.matmul(a, w.t(), out=out), warmup=10, rep=rep_ms) for _ in range(rounds))
    del a, w, out
    torch.cuda.empty_cache()
    return t * 1e3


def evaluate(pool, compiler, device, tmp: Path, name: str, kernel, args) -> dict:
    fam = get_family(kernel.family)
    space = fam.space(kernel, device.arch)
    rec = {"family": kernel.family, "kernel": name, "admitted": sum(1 for _ in space.admitted())}
    opts = TuneOptions(budget=args.budget, jobs=args.jobs)
    t0 = time.perf_counter()
    with Tuner(pool, device, TuneCache(tmp / "tune.sqlite"), opts, compiler=compiler) as tuner:
        r = tuner.tune({name: kernel})[0]
    rec["mcts"] = {"wall_s": time.perf_counter() - t0, "evaluated": r.evaluated, "failed": r.failed,
                   "knobs": r.knobs, "status": r.status, "note": r.note, "method": r.method,
                   "failures": r.failures[:5], "tuner_best_us": r.best_us, "tuner_default_us": r.default_us}
    picks = {"default": space.as_dict(space.default)}
    if r.knobs:
        picks["mcts"] = r.knobs
    if not args.no_exhaustive:
        full = any(f and f in name for f in args.full.split(","))
        nb = space if full else neighbourhood(space, kernel.family)
        ex_opts = TuneOptions(exhaustive=True, jobs=args.jobs)
        if args.exhaustive_rep_ms:
            ex_opts = dataclasses.replace(ex_opts, rep_ms=args.exhaustive_rep_ms)
        t0 = time.perf_counter()
        with Tuner(pool, device, TuneCache(tmp / "exhaustive.sqlite"), ex_opts,
                   compiler=compiler) as ex:
            e = ex.tune_kernel(name, kernel, space=nb)
        rec["exhaustive"] = {"space": "full" if full else "neighbourhood", "wall_s": time.perf_counter() - t0, "evaluated": e.evaluated, "failed": e.failed,
                             "knobs": e.knobs, "status": e.status, "note": e.note, "failures": e.failures[:5]}
        if e.knobs:
            picks["exhaustive"] = e.knobs
        rec["mcts_pick_in_neighbourhood"] = in_neighbourhood(nb, r.knobs)
    if args.no_exhaustive and args.exhaustive_from:
        # an earlier run's exhaustive pick for this kernel, re-timed side by side with today's picks
        earlier = {x["kernel"]: x for f in args.exhaustive_from.split(",")
                   for x in json.loads(Path(f).read_text())["results"]}
        ex = earlier.get(name, {}).get("exhaustive")
        if ex and ex.get("knobs"):
            picks["exhaustive"] = ex["knobs"]
            rec["exhaustive"] = {**ex, "space": f"{ex['space']} (from {args.exhaustive_from})"}
            rec["mcts_pick_in_neighbourhood"] = True
    rec["us"], rec["rounds_us"] = retime(pool, kernel, picks, device.arch, args.rounds, args.rep_ms)
    rec["paired_mcts_over_exhaustive"] = paired(rec["rounds_us"], "mcts", "exhaustive")
    if kernel.family == "gemm_sm90":
        rec["us"]["cublas"] = cublas_us(kernel.problem, args.rounds, args.rep_ms)
    t0 = time.perf_counter()
    again = Tuner(pool, device, TuneCache(tmp / "tune.sqlite"), opts).tune({name: kernel})[0]
    rec["cache_hit_s"] = time.perf_counter() - t0
    rec["cache_hit"] = again.status == "cached"
    return rec


def mapreduce_kernels(spec: str):
    from mapreduce import PROGRAMS, cases, inputs_for

    from tilefuse.compiler import compile_stages

    for prog, (rows, cols) in cases(False, spec):
        module = PROGRAMS[prog](cols).cuda().bfloat16()
        st = compile_stages(module, inputs_for(prog, rows, cols))
        for kname, lk in st.kernels.items():
            yield f"{prog} {rows}x{cols} {kname}", lk.kernel
        del module, st
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--gemm", default=GEMM_SHAPES, help=f"MxNxK,... ('all': {ALL_GEMM}; '': none)")
    ap.add_argument("--mapreduce", default=MR_CASES, help="program:RxC,... as bench/mapreduce.py --cases ('': none)")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--no-exhaustive", action="store_true", help="skip the neighbourhood's exhaustive search")
    ap.add_argument("--full", default="", help="kernels (name substrings, comma-separated) whose exhaustive "
                    "search covers the whole space instead of the neighbourhood")
    ap.add_argument("--exhaustive-from", help="with --no-exhaustive: re-time each kernel's exhaustive pick "
                    "from these earlier --json results (comma-separated) next to today's picks")
    ap.add_argument("--exhaustive-rep-ms", type=float, default=None,
                    help="do_bench time per exhaustive candidate (default: the tuner's)")
    ap.add_argument("--cache-dir", help="keep the SP-MCTS picks here (tune.sqlite, as TILEFUSE_CACHE_DIR reads it) "
                    "instead of a temporary directory: `tilefuse run` / bench/mapreduce.py then use them")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="compile-ahead processes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=float, default=100.0, help="do_bench time per re-timing")
    ap.add_argument("--time-limit", type=float, default=float("inf"), help="start no kernel after this many s")
    args = ap.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    tmp = Path(args.cache_dir or tempfile.mkdtemp(prefix="tune_eval_"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TILEFUSE_CACHE_DIR"] = str(tmp)  # a cold tuning cache (and cubin cache) for this run
    device = cuda_device(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "device": str(device),
           "budget": args.budget, "jobs": args.jobs, "cpus": os.cpu_count(), "results": [], "skipped": []}

    def save():
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    gemm = ALL_GEMM if args.gemm == "all" else args.gemm
    work = [(f"gemm {s}", GemmTask(GemmProblem(*map(int, s.split("x")), "bf16"), name=f"gemm_{s}"))
            for s in gemm.split(",") if s]
    t0 = time.perf_counter()
    compiler = compiler_pool(args.jobs)  # started once per run (not part of any kernel's tuning time)
    list(compiler.map(warm, range(2 * args.jobs)))
    out["compile_pool_start_s"] = time.perf_counter() - t0
    with compiler, WorkerPool([0], timeout=120) as pool:
        pool.submit(abs, 0).result()  # the worker's start (torch, CUDA), likewise once per run
        todo = work + ([("mapreduce", args.mapreduce)] if args.mapreduce else [])
        for label, item in todo:
            kernels = mapreduce_kernels(item) if label == "mapreduce" else [(label, item)]
            for name, kernel in kernels:
                if time.perf_counter() - start > args.time_limit:
                    out["skipped"].append(name)
                    continue
                rec = evaluate(pool, compiler, device, tmp, name, kernel, args)
                out["results"].append(rec)
                save()
                us = rec["us"]
                print(f"{name}: " + "  ".join(f"{n} {v:.1f}us" for n, v in us.items())
                      + f"  mcts {rec['mcts']['wall_s']:.1f}s ({rec['mcts']['evaluated']} tried)"
                      + (f"  exh {rec['exhaustive']['wall_s']:.1f}s ({rec['exhaustive']['evaluated']})"
                         if "exhaustive" in rec else "") + f"  hit {rec['cache_hit_s'] * 1e3:.0f}ms", flush=True)
    out["wall_s"] = time.perf_counter() - start
    save()
    nan = float("nan")
    print(f"\n{out['gpu']}: SP-MCTS budget {args.budget}, {args.jobs} compile processes; kernel medians (us), "
          f"re-timed side by side; exh = exhaustive over the restricted neighbourhood")
    print(f"{'kernel':44s} {'cand':>5s} {'default':>8s} {'mcts':>8s} {'exh':>8s} {'cublas':>8s} {'def/mcts':>8s} "
          f"{'mcts/exh':>8s} {'paired':>6s} {'tune s':>6s} {'exh s':>6s} {'hit ms':>6s}")
    for r in out["results"]:
        us = r["us"]
        d, m, x, c = (us.get(k, nan) for k in ("default", "mcts", "exhaustive", "cublas"))
        print(f"{r['kernel'][:44]:44s} {r['admitted']:5d} {d:8.1f} {m:8.1f} {x:8.1f} {c:8.1f} {d / m:8.3f} "
              f"{m / x:8.3f} {r.get('paired_mcts_over_exhaustive', nan):6.3f} {r['mcts']['wall_s']:6.1f} {r.get('exhaustive', {}).get('wall_s', nan):6.1f} "
              f"{r['cache_hit_s'] * 1e3:6.1f}" + ("" if r["cache_hit"] else "  (no cache hit!)"))
    if out["skipped"]:
        print(f"skipped (time limit): {', '.join(out['skipped'])}")
    if not math.isinf(args.time_limit):
        print(f"total {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

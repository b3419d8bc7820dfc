"""The autotuner's evaluation (issue 6) on the map-reduce shapes of bench/mapreduce.py.

    python3 bench/tune_eval.py --json bench/results/tune_eval_h100.json [--quick] [--budget 64]

For every distinct kernel of each program (bf16), in a fresh tuning cache:
- SP-MCTS with `--budget` candidates (the default `tilefuse tune`): its pick and wall time;
- exhaustive search over the same space (candidates compiled on all CPU cores first): the
  best any candidate reaches, and its wall time (`--no-exhaustive` skips it);
- the heuristic default, the SP-MCTS pick and the exhaustive pick re-timed side by side in
  one worker, `--rounds` times each (min of medians), so the ratios compare like with like;
- a second tuning run on the warm cache: every kernel a hit, its wall time per kernel.
Times are kernel times (do_bench median, L2 flushed, buffers rotated when they fit in L2).
Prints a table last; writes JSON with the GPU's name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mapreduce import PROGRAMS, cases, inputs_for  # noqa: E402

from tilefuse.compiler import compile_stages  # noqa: E402
from tilefuse.tune.cache import TuneCache, key_for  # noqa: E402
from tilefuse.tune.device import cuda_device  # noqa: E402
from tilefuse.tune.families import get_family  # noqa: E402
from tilefuse.tune.measure import MeasureJob, measure  # noqa: E402
from tilefuse.tune.tuner import TuneOptions, Tuner  # noqa: E402
from tilefuse.tune.worker import WorkerPool  # noqa: E402


def retime(pool, kernel, knob_sets: dict, arch: str, rounds: int, rep_ms: float) -> dict:
    """name -> min over rounds of the median time, candidates interleaved in one worker."""
    best = {}
    for _ in range(rounds):
        for name, knobs in knob_sets.items():
            out = pool.submit(measure, MeasureJob(kernel.family, kernel, knobs, arch, rep_ms=rep_ms)).result()
            if out.ok:
                best[name] = min(best.get(name, float("inf")), out.value.median_us)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="two shapes per program (as bench/mapreduce.py --quick)")
    ap.add_argument("--programs", nargs="*", choices=sorted(PROGRAMS), help="only these programs")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive search")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="CPU processes compiling ahead")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=float, default=100.0, help="do_bench time per re-timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = cuda_device(0)
    fam = get_family("mapreduce")
    results, seen = [], set()
    tmp = tempfile.mkdtemp(prefix="tune_eval_")
    os.environ["TILEFUSE_CACHE_DIR"] = tmp  # a cold tuning cache (and cubin cache) for this run
    with WorkerPool([0], timeout=120) as pool:
        for prog, (rows, cols) in cases(args.quick):
            if args.programs and prog not in args.programs:
                continue
            module = PROGRAMS[prog](cols).cuda().bfloat16()
            st = compile_stages(module, inputs_for(prog, rows, cols))
            for kname, lk in st.kernels.items():
                k = lk.kernel
                key = key_for(k, device, fam)
                if key.digest in seen:
                    continue
                seen.add(key.digest)
                rec = {"program": prog, "shape": [rows, cols], "kernel": kname, "rows": k.body[0].extent}
                space = fam.space(k, device.arch)
                rec["space"] = sum(1 for _ in space.configs())
                mcts = Tuner(pool, device, TuneCache(Path(tmp) / "mcts.sqlite"), TuneOptions(budget=args.budget))
                t0 = time.perf_counter()
                r = mcts.tune({kname: k})[0]
                rec["mcts"] = {"wall_s": time.perf_counter() - t0, "evaluated": r.evaluated, "failed": r.failed,
                               "knobs": r.knobs, "status": r.status, "note": r.note}
                picks = {"default": space.as_dict(space.default)}
                if r.knobs:
                    picks["mcts"] = r.knobs
                if not args.no_exhaustive:
                    ex = Tuner(pool, device, TuneCache(Path(tmp) / "exhaustive.sqlite"),
                               TuneOptions(exhaustive=True, jobs=args.jobs))
                    t0 = time.perf_counter()
                    e = ex.tune({kname: k})[0]
                    rec["exhaustive"] = {"wall_s": time.perf_counter() - t0, "evaluated": e.evaluated,
                                         "failed": e.failed, "knobs": e.knobs, "status": e.status}
                    if e.knobs:
                        picks["exhaustive"] = e.knobs
                rec["us"] = retime(pool, k, picks, device.arch, args.rounds, args.rep_ms)
                t0 = time.perf_counter()
                again = mcts.tune({kname: k})[0]
                rec["cache_hit_s"] = time.perf_counter() - t0
                rec["cache_hit"] = again.status == "cached"
                results.append(rec)
                us = rec["us"]
                print(f"{prog:14s} {rows}x{cols} {kname}: " + "  ".join(f"{n} {v:.1f}us" for n, v in us.items())
                      + f"  mcts {rec['mcts']['wall_s']:.1f}s", flush=True)
            del module, st
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "device": str(device),
           "budget": args.budget, "results": results}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{out['gpu']}: SP-MCTS budget {args.budget}; times are kernel medians (us), re-timed side by side")
    print(f"{'program':13s} {'shape':>12s} {'space':>5s} {'default':>8s} {'mcts':>8s} {'exh':>8s} {'def/mcts':>8s} "
          f"{'mcts/exh':>8s} {'tune s':>6s} {'exh s':>6s} {'hit ms':>6s}")
    for r in results:
        us = r["us"]
        d, m, x = us.get("default", float("nan")), us.get("mcts", float("nan")), us.get("exhaustive", float("nan"))
        print(f"{r['program']:13s} {'x'.join(map(str, r['shape'])):>12s} {r['space']:5d} {d:8.1f} {m:8.1f} {x:8.1f} "
              f"{d / m:8.2f} {m / x:8.3f} {r['mcts']['wall_s']:6.1f} {r.get('exhaustive', {}).get('wall_s', 0):6.1f} "
              f"{r['cache_hit_s'] * 1e3:6.1f}" + ("" if r["cache_hit"] else "  (no cache hit!)"))


if __name__ == "__main__":
    main()

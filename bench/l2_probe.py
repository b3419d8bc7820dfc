"""Explicit map-reduce schedules side by side with torch.compile, in interleaved rounds.

    python3 bench/l2_probe.py --json bench/results/l2_probe_h100.json \
        [--cases rmsnorm:16384x8192,layernorm:32768x256] [--rounds 5]

For each fixture kernel (bf16, random normal inputs) the default schedule and a few
hand-picked ones (the stream stage with and without `l2_hints`, the short-row shapes the
tuner picked before) are compiled, checked against eager PyTorch, and timed with the same
function as the tuner and bench/mapreduce.py (`analyze.bench.timings_ms`: CUDA events, L2
flushed by a read before each call) in `--rounds` rounds, each round timing every candidate
and torch.compile's kernel once in a rotated order; a candidate's score is the median over
rounds of its time over torch.compile's in that round. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))
import loop_fixtures as fx  # noqa: E402
from mapreduce_kernels import make_inputs, outputs_close, torch_fn  # noqa: E402

from tilefuse import dtypes  # noqa: E402
from tilefuse.analyze.bench import fresh_compile, timings_ms  # noqa: E402
from tilefuse.codegen.mapreduce import MapReduceSchedule as S  # noqa: E402
from tilefuse.codegen.mapreduce import default_schedule  # noqa: E402
from tilefuse.runtime.launch import compile_kernel  # noqa: E402

CASES = ["rmsnorm:16384x8192", "layernorm:16384x8192", "rmsnorm:32768x4096", "layernorm:32768x4096",
         "softmax:16384x8192", "softmax:32768x4096", "add_rmsnorm:16384x8192", "add_rmsnorm:32768x4096"]


def candidates(kernel, C: int) -> list[S]:
    out = [default_schedule(kernel, "sm_90a")]
    if C >= 4096:
        for t, mbs in ((256, (8,)), (512, (4,)), (1024, (2,))):
            for mb in mbs:
                for u in (1, 2, 4):
                    out.append(S(threads=t, group=t, vector=8, stage="stream", unroll=u, min_blocks=mb, l2_hints=True))
    else:
        out += [S(threads=1024, group=16, vector=8, min_blocks=2), S(threads=64, group=16, vector=8, min_blocks=16),
                S(threads=256, group=32, vector=8, min_blocks=8), S(threads=128, group=32, vector=8, min_blocks=16),
                S(threads=256, group=32, vector=8, stage="stream", unroll=1, min_blocks=8),
                S(threads=256, group=32, vector=8, stage="stream", unroll=1, min_blocks=8, l2_hints=True),
                S(threads=128, group=16, vector=8, stage="stream", unroll=2, min_blocks=16, l2_hints=True)]
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


def probe(case: str, rounds: int) -> dict:
    name, shape = case.split(":")
    R, C = (int(x) for x in shape.split("x"))
    kernel = fx.BUILDERS[name](R, C, "bf16")
    inputs = make_inputs(kernel)
    torch_args = [inputs[b.name] for b in kernel.inputs]
    fn = torch_fn(name)
    ref = fn(*torch_args)
    compiled = fresh_compile(fn)
    compiled(*torch_args)
    calls = {"torch.compile": lambda: compiled(*torch_args)}
    errors = {}
    for s in candidates(kernel, C):
        try:
            ck = compile_kernel(kernel, schedule=s)
        except ValueError as e:
            errors[str(s)] = str(e)
            continue
        outs = {b.name: torch.full(b.shape, float("nan"), dtype=dtypes.to_torch(b.dtype), device="cuda")
                for b in kernel.outputs}
        args = [inputs[b.name] if b.role == "in" else outs[b.name] for b in kernel.params]
        ck(*args)
        torch.cuda.synchronize()
        err = outputs_close(kernel, outs, ref)
        if not err < 2e-2:
            errors[str(s)] = f"wrong result: max relative difference {err}"
            continue
        calls[str(s)] = (lambda ck=ck, args=args: ck(*args))
    names = list(calls)
    per_round = []
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        per_round.append({n: statistics.median(timings_ms(calls[n], warmup=10, rep=50)) * 1e3 for n in order})
    rows = []
    for n in names:
        ratio = statistics.median(r["torch.compile"] / r[n] for r in per_round)
        rows.append({"schedule": n, "us": min(r[n] for r in per_round), "vs_tc": ratio})
    rows.sort(key=lambda r: -r["vs_tc"])
    return {"case": case, "rounds": rounds, "rows": rows, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for case in args.cases.split(","):
        out["results"].append(probe(case, args.rounds))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{out['gpu']}: us = fastest round's median; vs t.c. = median over rounds of t.c. time / ours")
    for res in out["results"]:
        print(f"\n{res['case']}")
        for r in res["rows"][:8]:
            print(f"  {r['us']:8.2f} us  {r['vs_tc']:6.3f}x  {r['schedule']}")
        for s, e in res["errors"].items():
            print(f"  error: {s}: {e[:120]}")


if __name__ == "__main__":
    main()

"""Short-kernel programs (13-15 us): how much of a same-run ratio is placement and launch path.

    python3 bench/short_rows_probe.py --json bench/results/short_rows_probe_h100.json \
        [--cases rmsnorm:32768x256,layernorm:32768x256,softmax:32768x256] [--placements 4] [--rounds 5]

For each bench/mapreduce.py program, `--placements` sets of inputs are allocated one after
another (each set at other addresses). For every set, tilefuse's program through its CUDA
graph, the same program launched kernel by kernel (the thin path, no graph), and
torch.compile's function are timed with `analyze.bench.timings_ms` (CUDA events, L2 flushed by
a read) in `--rounds` interleaved rounds, rotated. Reported per implementation: the median
over rounds for each input set, and their spread. If the graph path costs GPU time, graph >
thin on every set; if placement decides, the sets differ by more than the implementations.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mapreduce import PROGRAMS, inputs_for  # noqa: E402

import tilefuse  # noqa: E402
from tilefuse.analyze.bench import fresh_compile, timings_ms  # noqa: E402

CASES = "rmsnorm:32768x256,layernorm:32768x256,softmax:32768x256"


def probe(case: str, placements: int, rounds: int) -> dict:
    name, shape = case.split(":")
    rows, cols = (int(x) for x in shape.split("x"))
    module = PROGRAMS[name](cols).cuda().bfloat16()
    sets = [inputs_for(name, rows, cols) for _ in range(placements)]
    compiled = fresh_compile(module)
    calls = {}
    with torch.no_grad():
        for i, inputs in enumerate(sets):
            graph = tilefuse.compile(module, inputs)
            thin = tilefuse.compile(module, inputs)
            thin.graphs = False
            for label, fn in (("tilefuse graph", graph), ("tilefuse thin", thin), ("torch.compile", compiled)):
                fn(*inputs)
                calls[(label, i)] = (lambda fn=fn, inputs=inputs: fn(*inputs))
        torch.cuda.synchronize()
        keys = list(calls)
        per = {k: [] for k in keys}
        for rnd in range(rounds):
            for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
                per[k].append(statistics.median(timings_ms(calls[k], warmup=10, rep=50)) * 1e3)
    out = {"case": case, "placements": placements, "rounds": rounds, "impls": {}}
    for label in ("tilefuse graph", "tilefuse thin", "torch.compile"):
        meds = [statistics.median(per[(label, i)]) for i in range(placements)]
        out["impls"][label] = {"us_per_set": meds, "median_us": statistics.median(meds)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--placements", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for case in args.cases.split(","):
        out["results"].append(probe(case, args.placements, args.rounds))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{out['gpu']}: us, median over rounds, one column per input set; last: median of the sets")
    for res in out["results"]:
        print(f"\n{res['case']}")
        for label, r in res["impls"].items():
            cells = " ".join(f"{u:6.2f}" for u in r["us_per_set"])
            print(f"  {label:15s} {cells}   | {r['median_us']:6.2f}")


if __name__ == "__main__":
    main()

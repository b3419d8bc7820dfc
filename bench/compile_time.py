"""How long tilefuse.compile takes on the blocks of bench/blocks.py, cold and warm.

    python3 bench/compile_time.py [--cases llama4,hf_llama,gpt2] [--json out.json]

Each case runs in fresh Python processes (so every one pays the same imports: torch.export
pulls in torch._dynamo, several seconds on a cold interpreter): first with an empty cubin
cache (cold: every kernel is rendered and built by NVRTC), then again on the cache the first
left (warm: rendered, read from disk). A process times tilefuse.compile (capture, rewrites,
plan, Loop IR, and for CUDA inputs rendering and building every kernel) and the first call
(weights and tables on the GPU, the CUDA graph's capture), each with the GPU synchronised.
Prints a table last; the JSON carries the GPU's name.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(case: str) -> dict:
    """In this process: compile `case` and call it once; the two wall times."""
    import torch

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "src"))
    import blocks
    import tilefuse

    m, inputs, _ = blocks.build(case)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prog = tilefuse.compile(m, inputs)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        prog(*inputs)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    kinds = [s.family for s in prog.plan.steps]
    return {"compile_s": t1 - t0, "first_call_s": t2 - t1, "gemm": kinds.count("gemm"),
            "mapreduce": kinds.count("mapreduce"), "gpu": torch.cuda.get_device_name()}


def measure(case: str, cache_dir: str) -> dict:
    env = {**os.environ, "TILEFUSE_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, __file__, "--one", case], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{case}: the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="llama4,hf_llama,gpt2")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the measuring process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    rows = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="tf-cubins-") as d:
            cold = measure(case, d)
            warm = measure(case, d)
        rows.append({"case": case, "cold": cold, "warm": warm})
        print(json.dumps(rows[-1]), flush=True)
    gpu = rows[0]["cold"]["gpu"] if rows else ""
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    print(f"\n{gpu}; seconds of wall time, each in a fresh process")
    print(f"{'case':10} {'kernels':>8} {'cold compile':>13} {'first call':>11} {'warm compile':>13} {'first call':>11}")
    for r in rows:
        c, w = r["cold"], r["warm"]
        print(f"{r['case']:10} {c['gemm'] + c['mapreduce']:8d} {c['compile_s']:13.2f} {c['first_call_s']:11.2f} "
              f"{w['compile_s']:13.2f} {w['first_call_s']:11.2f}")


if __name__ == "__main__":
    main()

"""Clock and power while one GEMM runs back to back: does an epilogue's cost follow its cycles
(ncu, idle GPU) or the card's power limit (sustained launches)?

    python3 bench/gemm_power.py [--shape 8192,22016,4096] [--kinds plain,swiglu] [--seconds 3]

For each epilogue kind (bench/gemm.py's epilogue_kinds) the kernel runs back to back for
--seconds while `nvidia-smi` samples the SM clock and board power every 50 ms (read only: the
card's settings are left alone). Prints ms per call (CUDA events over the window), median
clock and power over the window's second half, and writes JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gemm import epilogue_kinds, epilogue_operands  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402


def sampled(fn, seconds: float):
    """(ms per call, [(t, MHz, W)]) for fn run back to back for `seconds`."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out = smi.communicate()[0]
    samples = [tuple(float(x) for x in line.split(",")) for line in out.splitlines() if line.count(",") == 1]
    return start.elapsed_time(end) / calls, samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8192,22016,4096")
    ap.add_argument("--kinds", default="plain,swiglu,plain,swiglu")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    m, n, k = (int(x) for x in args.shape.split(","))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    operands, kinds = epilogue_operands(m, n), epilogue_kinds(m, n)
    rows = []
    for kind in args.kinds.split(","):
        ep, names = kinds[kind]
        g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=ep))
        kw = {x: operands[x] for x in names}
        g(a, b, **kw)
        torch.cuda.synchronize()
        ms, samples = sampled(lambda: g(a, b, **kw), args.seconds)
        late = samples[len(samples) // 2:] or samples
        mhz = statistics.median(s[0] for s in late)
        watts = statistics.median(s[1] for s in late)
        rows.append(dict(kind=kind, m=m, n=n, k=k, ms=ms, sm_mhz=mhz, watts=watts, samples=samples))
        print(f"{kind:>10} {m}x{n}x{k}: {ms:.3f} ms/call, SM clock {mhz:.0f} MHz, {watts:.0f} W", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()

"""GPT-2's c_fc GEMM with its tanh GELU in the epilogue: tanhf against the fast tanh (cexpr's
tf_tanh_fast), and the GEMM with its bias alone, same inputs, interleaved rounds (CUDA events,
L2 flushed by a read). Each GELU program is checked against float64 under the 2x rule first.

    python3 bench/fast_tanh_ab.py [--shape 4096,4096,1024] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import tilefuse  # noqa: E402
from tilefuse.analyze.bench import median_ms  # noqa: E402
from tilefuse.check import compare, float64_reference  # noqa: E402
from tilefuse.codegen import cexpr  # noqa: E402


def gelu_new(x):
    """transformers' NewGELUActivation (GPT-2), step by step in the input's dtype."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096,4096,1024", help="M,N,K")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    m, n, k = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1

    def fc(x):
        return torch.addmm(b, x, w)

    def fc_gelu(x):
        return gelu_new(torch.addmm(b, x, w))

    progs = {"bias only": tilefuse.compile(fc, (x,))}
    saved = cexpr.FAST_OPS
    try:
        cexpr.FAST_OPS = tuple(o for o in saved if o != "tanh")
        progs["GELU, tanhf"] = tilefuse.compile(fc_gelu, (x,))
        progs["GELU, tanhf"](x)  # compiled now, with tanhf
    finally:
        cexpr.FAST_OPS = saved
    progs["GELU, fast tanh"] = tilefuse.compile(fc_gelu, (x,))
    ref = float64_reference(fc_gelu, (x,))
    eager = fc_gelu(x)
    checks = {}
    for name in ("GELU, tanhf", "GELU, fast tanh"):
        c = compare(name, progs[name](x), ref, eager)
        checks[name] = {"ok": c.ok, "error": c.error, "bound": c.bound}
        if not c.ok:
            raise SystemExit(f"{name} failed the 2x rule: {c}")
    times = {name: [] for name in progs}
    for _ in range(args.rounds):
        for name, p in progs.items():
            times[name].append(median_ms(lambda: p(x)) * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "shape": [m, n, k], "us": times, "median_us": med, "checks": checks}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"\n{gpu}, bf16, {m}x{n}x{k}, median of {args.rounds} rounds' medians")
    for name, us in med.items():
        print(f"  {name:16} {us:8.1f} us  ({us / med['bias only']:.3f}x the GEMM with its bias alone)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

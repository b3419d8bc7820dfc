"""GEMM schedules next to cuBLAS at the power limit, at the 4-layer Llama's GEMM shapes.

    python3 bench/gemm_sustained.py      (JSON to $OUT/gemm_sustained_s23.json)

Plain bf16 GEMMs (B K-major, as nn.Linear), the default schedule and six neighbours (no
cluster, group_m 4 / 16, 3 stages, stores not deferred, 256x128 with an N-pair cluster), each
checked against a float32 reference, then timed with analyze.bench.sustained_ms (0.8 s settle,
0.4 s timed), 2 rounds in opposite orders. Prints cuBLAS's time over each one's.
"""
import json, os, statistics, sys
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import gemm as G
from tilefuse.analyze.bench import sustained_ms
from tilefuse.codegen.gemm_sm90 import GemmProblem, default_schedule
from tilefuse.runtime.gemm import compile_gemm

shapes = [(8192, 11264, 2048), (8192, 32000, 2048), (8192, 2048, 5632), (8192, 2048, 2048), (8192, 4096, 4096)]
rows = []
for m, n, k in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref, base = G.reference(a, b, "K")
    prob = GemmProblem(m, n, k, "bf16", b_major="K")
    d = default_schedule(prob)
    cands = {"default": d, "no-cluster": replace(d, cluster_m=1), "g4": replace(d, group_m=4),
             "g16": replace(d, group_m=16), "s3": replace(d, stages=3), "no-defer": replace(d, defer_stores=False),
             "256x128n2": replace(d, bm=256, bn=128, cluster_m=1, cluster_n=2)}
    fns = {"cublas": lambda: torch.matmul(a, b.t())}
    for name, s in cands.items():
        try:
            g = compile_gemm(prob, s)
        except Exception as e:
            print(m, n, k, name, "refused:", e, flush=True)
            continue
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        g(a, b, out=out)
        ok, err, _ = G.check(out, ref, base)
        if not ok:
            print(m, n, k, name, "WRONG", err, flush=True)
            continue
        fns[name] = (lambda g=g, out=out: g(a, b, out=out))
        cands[name] = s
    per = {x: [] for x in fns}
    names = list(fns)
    for r in range(2):
        order = names if r % 2 == 0 else names[::-1]
        for x in order:
            per[x].append(sustained_ms(fns[x], seconds=0.4, settle_s=0.8))
    res = {x: statistics.median(v) for x, v in per.items()}
    row = {"shape": (m, n, k), "default": str(d), "ms": res, "rounds": per}
    rows.append(row)
    print(m, n, k, " ".join(f"{x} {res['cublas'] / v:.3f}" for x, v in res.items()), flush=True)
    del ref
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.environ.get("OUT", "/tmp") + "/gemm_sustained_s23.json", "w"), indent=1)

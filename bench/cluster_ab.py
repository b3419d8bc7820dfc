"""A block with the 2-CTA cluster dropped from some of its GEMMs, against the default and torch.compile.

    python3 bench/cluster_ab.py [case [rounds]]   (a bench/blocks.py case, default llama4, 4 rounds)

Variants (the default schedule with cluster_m 1 where it had 2): the square projections
(N, K <= 2048), those and the LM head (N >= 32000), every GEMM. Each program is checked under
the 2x rule, then all are timed with analyze.bench.sustained_ms in rotated rounds.
"""
import json, os, statistics, sys
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import blocks
import tilefuse
import tilefuse.codegen.gemm_sm90 as g
from tilefuse.analyze.bench import fresh_compile, sustained_ms
from tilefuse.check import compare, flatten, float64_reference

orig = g.default_schedule
case = sys.argv[1] if len(sys.argv) > 1 else "llama4"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4


changed: dict = {}  # variant -> GEMM problems it took the cluster from


def variant(name, pred):
    def ds(problem, sms=132):
        s = orig(problem, sms)
        if s.cluster_m == 2 and pred(problem):
            try:
                s = replace(s, cluster_m=1)
            except g.GemmError:
                return s
            changed.setdefault(name, set()).add((problem.m, problem.n, problem.k))
        return s
    return ds


variants = {"default": lambda p: False, "nocl_sq": lambda p: p.n <= 2048 and p.k <= 2048,
            "nocl_sq_head": lambda p: (p.n <= 2048 and p.k <= 2048) or p.n >= 32000,
            "nocl_all": lambda p: True}
m, inputs, tokens = blocks.build(case)
runs = {}
with torch.no_grad():
    ref = flatten(float64_reference(m, inputs))
    eager = flatten(m(*inputs))
    for name, pred in variants.items():
        g.default_schedule = variant(name, pred)
        prog = tilefuse.compile(m, inputs)
        g.default_schedule = orig
        if name != "default" and not changed.get(name):
            print(name, "changes no GEMM of this case: the default program again (a noise estimate)", flush=True)
        out = flatten(prog(*inputs))
        ok = all(compare("o", o, r, e).ok for o, r, e in zip(out, ref, eager))
        print(name, "ok" if ok else "FAILED", flush=True)
        if ok:
            runs[name] = (lambda prog=prog: prog(*inputs))
    del ref
    tc = fresh_compile(m)
    tc(*inputs)
    runs["torch_compile"] = lambda: tc(*inputs)
    per = {k: [] for k in runs}
    ks = list(runs)
    for r in range(rounds):
        for k in ks[r % len(ks):] + ks[:r % len(ks)]:
            per[k].append(sustained_ms(runs[k], seconds=0.5, settle_s=1.0))
res = {k: statistics.median(v) for k, v in per.items()}
json.dump({"gpu": torch.cuda.get_device_name(), "case": case, "rounds": per, "median": res,
           "changed": {k: sorted(v) for k, v in changed.items()}},
          open(os.environ.get("OUT", "/tmp") + f"/cluster_ab_{case}_s23.json", "w"), indent=1)
for k, v in per.items():
    print(f"{k:14} {res[k]:.3f} ms  vs t.c {res['torch_compile'] / res[k]:.3f}  rounds {[round(x, 3) for x in v]}")

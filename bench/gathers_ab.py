"""Gathers in map-reduce kernels (session 61) against torch.gather / aten.embedding externs
(TILEFUSE_GATHERS=0), same run: each model of bench/blocks.py compiled both ways, checked
against a float64 reference (the 2x rule), then timed alternately, sustained, several rounds.

    python3 bench/gathers_ab.py [--cases llama4,gpt2] [--rounds 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import blocks  # noqa: E402  (its models, timing and flattening)

import tilefuse  # noqa: E402
from tilefuse.check import compare, float64_reference  # noqa: E402


def compiled(m, inputs, gathers: bool):
    os.environ["TILEFUSE_GATHERS"] = "1" if gathers else "0"
    try:
        return tilefuse.compile(m, inputs)
    finally:
        os.environ.pop("TILEFUSE_GATHERS", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="llama4,gpt2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    rows = []
    for case in a.cases.split(","):
        m, inputs, tokens = blocks.build(case)
        with torch.no_grad():
            progs = {"externs": compiled(m, inputs, False), "fused": compiled(m, inputs, True)}
            ref, eager = blocks.flatten(float64_reference(m, inputs)), blocks.flatten(m(*inputs))
            row = {"case": case, "gpu": gpu, "tokens": tokens}
            for k, p in progs.items():
                got = blocks.flatten(p(*inputs))
                row[f"{k}_ok"] = all(compare(f"{k} out{i}", o, r, e).ok for i, (o, r, e) in enumerate(zip(got, ref, eager)))
                row[f"{k}_kernels"] = sum(s.family in ("gemm", "mapreduce") for s in p.plan.steps)
                row[f"{k}_externs"] = sum(s.family == "extern" and not s.view for s in p.plan.steps)
            del ref
            per = {k: [] for k in progs}
            for i in range(a.rounds):
                for k in (list(progs) if i % 2 == 0 else list(progs)[::-1]):
                    per[k].append(blocks.sustained_ms(lambda: progs[k](*inputs), seconds=0.5, settle_s=1.0))
            for k in progs:
                row[f"{k}_ms"] = statistics.median(per[k])
            row["speedup"] = row["externs_ms"] / row["fused_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del progs, m
        torch.cuda.empty_cache()
    print(f"\n{gpu}: gathers fused vs externs (TILEFUSE_GATHERS=0), ms per forward, sustained, median of {a.rounds}")
    print(f"{'case':10s} {'externs':>9s} {'fused':>9s} {'ratio':>7s}  kernels/externs (externs -> fused)")
    for r in rows:
        print(f"{r['case']:10s} {r['externs_ms']:9.3f} {r['fused_ms']:9.3f} {r['speedup']:7.3f}  "
              f"{r['externs_kernels']}/{r['externs_externs']} -> {r['fused_kernels']}/{r['fused_externs']}  "
              f"ok {r['externs_ok']}/{r['fused_ok']}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast can a read-only row kernel go? Issue 2's cross-entropy bound, measured.

    python3 bench/read_probe.py [--rows 32768 --cols 4096] [--json FILE]

Times, on one (rows, cols) bf16 tensor (random normal, CUDA-event medians; L2 flushed by a
256 MB write as do_bench does, by a 256 MB read, and not at all):
a device-to-device copy (read + write), PyTorch's row sum and row max (reads the tensor,
writes one value per row), tilefuse's cross-entropy program (its row kernel and the small
mean kernel), and each tilefuse kernel's GPU time. Bandwidths count bytes read + written.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.analyze.bench import median_ms

from mapreduce import kernel_times

FLUSHES = ("write", "read", "none")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args()
    x = torch.randn(a.rows, a.cols, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, a.cols, (a.rows,), device="cuda")
    y = torch.empty_like(x)
    nb = x.numel() * 2
    rows = {}

    def rec(name, fn, nbytes):
        rows[name] = {}
        for flush in FLUSHES:
            ms = median_ms(fn, rep=300, flush=flush)
            rows[name][flush] = {"us": ms * 1e3, "TBps": nbytes / ms / 1e9}

    rec("copy (read + write)", lambda: y.copy_(x), 2 * nb)
    rec("torch row sum (f32)", lambda: x.sum(-1, dtype=torch.float32), nb + a.rows * 4)
    rec("torch row amax", lambda: x.amax(-1), nb + a.rows * 2)
    ce = tilefuse.compile(lambda lg, tg: F.cross_entropy(lg, tg), (x, t))
    rec("tilefuse cross_entropy", lambda: ce(x, t), nb + a.rows * 8 + 4)
    ce_eager = lambda: F.cross_entropy(x, t)  # noqa: E731
    rec("eager cross_entropy", ce_eager, nb + a.rows * 8 + 4)
    kt = kernel_times(ce, (x, t))
    copy = rows["copy (read + write)"]
    print(f"{torch.cuda.get_device_name()}, bf16 {a.rows}x{a.cols}; us and % of copy with L2 flushed by a write "
          f"(do_bench), by a read, and not flushed")
    for k, r in rows.items():
        print(f"{k:>28} " + " | ".join(f"{f}: {r[f]['us']:7.1f} us {100 * r[f]['TBps'] / copy[f]['TBps']:5.1f}%"
                                       for f in FLUSHES))
    for k, r in kt.items():
        print(f"{'kernel ' + k[:40]:>48} {r['us']:9.1f} us x{r['count']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": [a.rows, a.cols], "rows": rows,
                       "kernels": kt}, f, indent=1)


if __name__ == "__main__":
    main()

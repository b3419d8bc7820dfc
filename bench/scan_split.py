"""Scans over few long rows, split into pieces (graph/rewrites.split_long_scans) or whole (a CTA a row).

    python3 bench/scan_split.py [--rounds 5] [--json FILE]

Each case is timed four ways in one process, on the same tensors (median of single calls, L2
flushed, rounds interleaved: analyze/bench.compare): tilefuse as planned (split), tilefuse with
TILEFUSE_SPLIT=0 when compiling (each row one CTA), eager and torch.compile. Outputs are checked
with DESIGN.md's 2x rule first."""
from __future__ import annotations

import argparse
import json
import os

CASES = {
    "vocab_1": ("lambda x: x.softmax(-1).cumsum(-1)", (1, 128256)),
    "vocab_8": ("lambda x: x.softmax(-1).cumsum(-1)", (8, 128256)),
    "vocab_32": ("lambda x: x.softmax(-1).cumsum(-1)", (32, 128256)),
    "long_64": ("lambda x: x.cumsum(-1)", (64, 524288)),
    "flat_16M": ("lambda x: x.cumsum(-1)", (1 << 24,)),
    "cummax_8": ("lambda x: torch.cummax(x, -1)[0]", (8, 262144)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    import tilefuse
    from tilefuse.analyze.bench import compare, copy_bandwidth
    from tilefuse.check import compare as check, float64_reference

    gpu, copy_bps, rows = torch.cuda.get_device_name(), copy_bandwidth(), []
    for name, (src, shape) in CASES.items():
        fn = eval(src)  # noqa: S307 - the cases above
        torch.manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        split = tilefuse.compile(fn, (x,))
        os.environ["TILEFUSE_SPLIT"] = "0"
        try:
            whole = tilefuse.compile(fn, (x,))
        finally:
            del os.environ["TILEFUSE_SPLIT"]
        ref, want = float64_reference(fn, (x,)), fn(x)
        for label, p in (("split", split), ("whole", whole)):
            c = check(f"{name} {label}", p(x), ref, want)
            assert c.ok, c
        kernels = lambda p: sum(s.family == "mapreduce" for s in p.plan.steps)  # noqa: E731
        nbytes = 2 * x.numel() * 2
        try:
            rows_ = compare(split, fn, [x], nbytes, copy_bps, rounds=a.rounds, extra={"whole": lambda: whole(x)})
        except Exception as ex:  # noqa: BLE001 - torch.compile fails on some (Inductor's split scan, 32 x 128256)
            print(f"{name}: torch.compile failed ({type(ex).__name__}); timed without it", flush=True)
            rows_ = compare(split, fn, [x], nbytes, copy_bps, rounds=a.rounds, with_compile=False,
                            extra={"whole": lambda: whole(x)})
        times = {r.name: r.ms * 1e3 for r in rows_}
        times.setdefault("torch.compile", float("nan"))
        row = {"case": name, "shape": shape, "kernels": [kernels(split), kernels(whole)], "us": times}
        rows.append(row)
        print(f"{name:10s} {str(shape):16s} split {times['tilefuse']:7.1f} ({kernels(split)} k)  whole "
              f"{times['whole']:7.1f}  eager {times['eager']:7.1f}  t.c {times['torch.compile']:7.1f}  "
              f"whole/split {times['whole'] / times['tilefuse']:.2f}  t.c/split "
              f"{times['torch.compile'] / times['tilefuse']:.2f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"gpu": gpu, "dtype": "bf16", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""RoPE's table kernel with its row count and period as arguments (tf_rows, tf_s:
codegen.mapreduce.rows_period) against the same kernel with both written into the source:
same tensors, same schedule, bitwise-equal outputs checked, then interleaved rounds of
CUDA-event timings (L2 flushed by a read), 7 rounds, alternating which goes first.

    python3 bench/rope_period_ab.py [--shapes 32x3000x128,8x3000x128,32x777x128,32x16384x128]

A shape is heads x S x head_dim, batch 1, bf16: the kernel that reads the [S, head_dim] cos and
sin tables beside the heads x S rows of q (the program of `_rope` below, as tilefuse lowers it).
Prints one line per shape, "arg/baked" last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rope(q, cos, sin):
    import torch

    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x3000x128,8x3000x128,32x777x128,32x16384x128")
    args = ap.parse_args()
    sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(HERE.parent / "src")))
    import torch

    from tilefuse.analyze.bench import timings_ms
    from tilefuse.codegen import mapreduce
    from tilefuse.compiler import compile_stages
    from tilefuse.loop.canon import named_by_structure
    from tilefuse.runtime.launch import compile_kernel

    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    for shape in args.shapes.split(","):
        H, S, D = (int(v) for v in shape.split("x"))
        x = [torch.randn(1, H, S, D, dtype=torch.bfloat16), torch.randn(1, 1, S, D, dtype=torch.bfloat16),
             torch.randn(1, 1, S, D, dtype=torch.bfloat16)]
        st = compile_stages(_rope, x, arch="sm_90a")
        (k,) = [named_by_structure(lk.kernel) for lk in st.kernels.values()
                if any(b.shape == (S, D) for b in lk.kernel.params)]
        assert mapreduce.rows_period(k) == S, k
        arg = compile_kernel(k)
        mapreduce.ROWS_ARG = False
        try:
            baked = compile_kernel(k, schedule=arg.schedule)
        finally:
            mapreduce.ROWS_ARG = True
        assert arg.source.period == S and baked.source.period is None and "const int tf_s)" not in baked.source.source
        tensors = [torch.randn(b.shape, dtype=torch.bfloat16, device="cuda") if b.role == "in"
                   else torch.full(b.shape, float("nan"), dtype=torch.bfloat16, device="cuda") for b in k.params]
        outs = [i for i, b in enumerate(k.params) if b.role == "out"]
        got = {}
        for label, ck in (("arg", arg), ("baked", baked)):
            for i in outs:
                tensors[i].fill_(float("nan"))
            ck.launch(tensors, 0)
            torch.cuda.synchronize()
            got[label] = [tensors[i].clone() for i in outs]
        same = all(torch.equal(a, b) for a, b in zip(got["arg"], got["baked"]))
        assert same and all(torch.isfinite(t).all() for t in got["arg"]), f"{shape}: outputs differ"
        calls = {"arg": lambda: arg.launch(tensors, 0), "baked": lambda: baked.launch(tensors, 0)}
        per = {"arg": [], "baked": []}
        for rnd in range(7):
            for lab in (("arg", "baked") if rnd % 2 == 0 else ("baked", "arg")):
                per[lab].append(statistics.median(timings_ms(calls[lab], warmup=10, rep=50)) * 1e3)
        a, b = statistics.median(per["arg"]), statistics.median(per["baked"])
        print(f"AB rope {shape}: regs {arg.info.registers}/{baked.info.registers}, outputs equal, "
              f"arg {a:.2f} us, baked {b:.2f} us, arg/baked {a / b:.4f}  "
              f"rounds arg {[round(t, 2) for t in per['arg']]} baked {[round(t, 2) for t in per['baked']]}", flush=True)


if __name__ == "__main__":
    main()

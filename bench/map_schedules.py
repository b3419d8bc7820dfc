"""Maps: their default schedule against a grid of neighbours, on the
program's own tensors, one process, interleaved rounds.

    python3 bench/map_schedules.py [--only NAME,...] [--rounds 5] [--json FILE]

Session 65's tuner runs found the defaults of maps in registers 5-20% off the best schedule
(8-byte chunks, more threads a row, a higher occupancy). This probe times, for each one-kernel
map program below, its kernel as rendered by default, under "regs layout" (`_regs_schedule`:
the registers layout of other kernels, a short map's default until session 67) and under a grid
of (chunk bytes, chunks a thread, threads a CTA), each checked against the program's output
first. A row's score is the median over rounds of `timings_ms`' median (L2 flushed by a read).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = {
    "silu": "F.silu(torch.randn(8192, 4096))",
    "mul2_1024": "torch.randn(32768, 1024) * 2",
    "mul2_16384": "torch.randn(2048, 16384) * 2",
    "add": "torch.randn(8192, 4096) + torch.randn(8192, 4096)",
    "bias_add": "torch.randn(8192, 4096) + torch.randn(4096)",
    "masked_fill": "torch.randn(8192, 4096).masked_fill(torch.rand(8192, 4096) > 0.5, -1e4)",
    "swiglu_halves": "(lambda x: F.silu(x[:, :4096]) * x[:, 4096:])(torch.randn(8192, 8192))",
    "slice_cols": "torch.randn(8192, 8192)[:, 2048:6144].contiguous()",
    "heads_permute": "torch.randn(8, 1024, 32, 128).transpose(1, 2).contiguous()",
    "heads_merge": "torch.randn(8, 32, 1024, 128).transpose(1, 2).reshape(8, 1024, 4096)",
    "repeat_kv": "torch.randn(8, 8, 1024, 128)[:, :, None].expand(8, 8, 4, 1024, 128).reshape(8, 32, 1024, 128)",
    "pad": "F.pad(torch.randn(8192, 4000), (0, 96))",
    "pad_8184": "F.pad(torch.randn(4096, 8184), (0, 8))",
    "flip": "torch.randn(8192, 4096).flip(-1) * 2",
    "rope_rotate_half": "(lambda q, c, s: q * c + torch.cat([-q[..., 64:], q[..., :64]], -1) * s)"
                        "(torch.randn(8, 32, 1024, 128), torch.randn(1, 1, 1024, 128), torch.randn(1, 1, 1024, 128))",
    "f32_silu": "F.silu(torch.randn(8192, 4096))",
}


def pow2ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def grid(v16: int, cols: int):
    """(chunk of 16 or 8 bytes) x (1, 2, 4 or 8 chunks a thread) x (256, 512 threads), at up to
    2048 threads an SM, in registers, and staged in shared memory at 2 or 4 chunks a thread."""
    from tilefuse.codegen.mapreduce import MapReduceSchedule as S

    out = []
    for v in (v16, v16 // 2):
        chunks = -(-cols // v)
        for k in (1, 2, 4, 8):
            g = pow2ceil(-(-chunks // k))
            for t in (256, 512):
                if g > 1024:
                    continue
                tt = max(t, g)
                out.append(S(threads=tt, group=g, vector=v, min_blocks=max(1, 2048 // tt)))
                if v == v16 and k in (2, 4):  # staged through shared memory (16-byte copies only)
                    out.append(S(threads=tt, group=g, vector=v, stage="smem", pipeline=True,
                                 min_blocks=max(1, 2048 // tt)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()

    import torch

    import tilefuse
    from tilefuse.analyze.bench import timings_ms
    from tilefuse.codegen import mapreduce
    from tilefuse.frontend.expr import parse
    from tilefuse.runtime.launch import CudaError, compile_kernel
    from program_schedules import program_launch

    gpu = torch.cuda.get_device_name()
    names = a.only.split(",") if a.only else list(CASES)
    rows = []
    for name in names:
        module, inputs, _ = parse(CASES[name], torch.float32 if name.startswith("f32_") else torch.bfloat16)
        torch.manual_seed(0)
        module, inputs = module.cuda(), tuple(x.cuda() for x in inputs)
        prog = tilefuse.compile(module, inputs)
        with torch.no_grad():
            want = prog(*inputs)
        want = (want if isinstance(want, torch.Tensor) else want[-1]).clone()
        try:
            lowered, op, ptrs, outs = program_launch(prog, inputs)
        except SystemExit as e:
            print(f"{name}: {e}")
            continue
        dflt = op.ck.source.schedule
        cols = mapreduce.ir.row_kernel_parts(lowered.kernel).col_extent
        v16 = 16 // max(1, outs[-1].element_size())
        labelled = {"default": dflt}
        parts = mapreduce.ir.row_kernel_parts(lowered.kernel)
        if dflt.stage == "regs":
            labelled["regs layout"] = mapreduce._regs_schedule(lowered.kernel, parts,
                                                                mapreduce._choose_vector(lowered.kernel, parts), "sm_90a")
        for s in grid(v16, cols):
            labelled.setdefault(str(s), s)
        kernels = {}
        for label, s in labelled.items():
            try:
                ck = compile_kernel(lowered.kernel, schedule=s)
                outs[-1].fill_(float("nan"))
                ck.launch_ptrs(0, ptrs)
                torch.cuda.synchronize()
            except (ValueError, CudaError) as e:
                print(f"  {name} skip {s}: {str(e)[:120]}")
                continue
            if not torch.equal(outs[-1].float().nan_to_num(7.0), want.float().nan_to_num(7.0)):
                print(f"  {name} {s}: differs from the program's output; kept out")
                continue
            kernels[label] = (ck, s, ck.info.registers, ck.info.spill_stores)
        per = {k: [] for k in kernels}
        keys = list(kernels)
        for rnd in range(a.rounds):
            for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
                ck = kernels[k][0]
                per[k].append(statistics.median(timings_ms(lambda: ck.launch_ptrs(0, ptrs), warmup=5, rep=20)) * 1e3)
        med = {k: statistics.median(v) for k, v in per.items()}
        best = min(med, key=med.get)
        row = {"case": name, "expr": CASES[name], "default": str(dflt), "us": med, "best": best,
               "best_schedule": str(kernels[best][1]), "registers": {k: kernels[k][2] for k in kernels},
               "rounds": per}
        rows.append(row)
        r = f"  regs layout {med['regs layout']:6.1f}" if "regs layout" in med else ""
        print(f"{name:18s} default {med['default']:6.1f}{r}  best {med[best]:6.1f} {kernels[best][1]}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"gpu": gpu, "rows": rows}, f, indent=1)
    print(f"\n{gpu}: default / best, regs layout / best")
    for r in rows:
        m = r["us"]
        extra = f"  regs layout {m['regs layout'] / m[r['best']]:.3f}" if "regs layout" in m else ""
        print(f"  {r['case']:18s} {m['default'] / m[r['best']]:.3f}{extra}")


if __name__ == "__main__":
    main()

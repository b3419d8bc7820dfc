"""A one-kernel program's own kernel under other schedules, launched on the program's own
tensors, next to the program itself and torch.compile.

    python3 bench/program_schedules.py rmsnorm:32768x256 --json FILE [--rounds 7] [--placements 2]
    python3 bench/program_schedules.py layernorm:32768x256 --schedules layernorm --both-moments --rounds 5
    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,\\
        dram__bytes_read.sum,dram__bytes_write.sum python3 bench/program_schedules.py \\
        rmsnorm:32768x256 --ncu

Rows: "program" (tilefuse.compile as by default: a one-kernel program launches its kernel
directly), "program graph" (the same replayed as a CUDA graph, graphs=True), "kernel
<schedule>" (the program's kernel re-rendered under that schedule and launched on the
program's input and weight tensors into one output allocated once), "kernel (program's) into
the graph's output" (the program's kernel writing where the graph writes; one-output
kernels), "torch.compile", and "copy" (x.copy_ into a preallocated tensor: the bandwidth
floor for the same read + write). Every kernel row is checked against the program's output
first. Timing: `analyze.bench.timings_ms` (CUDA events, L2 flushed by a read), `--rounds`
interleaved rounds in a rotated order, for each of `--placements` input sets; a row's score
is its median. With `--ncu` each row runs twice inside cudaProfilerStart/Stop after a
warm-up, for Nsight Compute (labels are printed in order).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mapreduce import PROGRAMS, inputs_for  # noqa: E402

import tilefuse  # noqa: E402
from tilefuse.analyze.bench import fresh_compile, timings_ms  # noqa: E402
from tilefuse.codegen.mapreduce import MapReduceSchedule as S  # noqa: E402
from tilefuse.runtime.launch import CudaError, compile_kernel  # noqa: E402


def short_row_schedules() -> list[S]:
    """Neighbours of the short-row defaults: a row per 8/16/32 threads, 128-1024 threads."""
    return [S(threads=128, group=32, vector=8, min_blocks=16), S(threads=256, group=32, vector=8, min_blocks=8),
            S(threads=512, group=32, vector=8, min_blocks=4), S(threads=128, group=16, vector=8, min_blocks=16),
            S(threads=256, group=16, vector=8, min_blocks=8), S(threads=1024, group=16, vector=8, min_blocks=2),
            S(threads=256, group=8, vector=8, min_blocks=3), S(threads=256, group=32, vector=8, stage="smem", min_blocks=8)]


def grid_schedules() -> list[S]:
    """Short rows: stage x threads per row (8, 16, 32) x threads per CTA (64-256) x a 32- or
    64-register cap."""
    return [S(threads=t, group=g, vector=8, stage=st, min_blocks=max(1, min(32, 65536 // (t * regs))))
            for st in ("regs", "smem") for g in (8, 16, 32) for t in (64, 128, 256) for regs in (32, 64)]


def layernorm_schedules() -> list[S]:
    """LayerNorm's short rows: the layouts the grid found near the top, and the defaults."""
    return [S(threads=256, group=8, vector=8, min_blocks=3), S(threads=128, group=16, vector=8, min_blocks=8),
            S(threads=64, group=16, vector=8, min_blocks=16), S(threads=64, group=8, vector=8, stage="smem", min_blocks=16),
            S(threads=256, group=32, vector=8, min_blocks=8), S(threads=128, group=32, vector=8, min_blocks=16),
            S(threads=256, group=16, vector=8, min_blocks=4), S(threads=256, group=32, vector=8, min_blocks=3),
            S(threads=128, group=32, vector=8, min_blocks=8), S(threads=256, group=16, vector=8, min_blocks=3)]


def batch_schedules() -> list[S]:
    """Short rows with several rows per row group in flight (MapReduceSchedule.batch): a row
    per 8, 16 or 32 threads, 32-256 threads, a batch of 2 or 4, a 64-register cap (and 128
    for a lone warp), next to the same layouts with a batch of 1."""
    out = []
    for g, shapes in ((32, ((32, 4), (32, 2), (64, 4), (64, 2), (128, 4), (128, 2), (256, 2))),
                      (16, ((32, 4), (32, 2), (64, 2), (128, 2), (256, 2))),
                      (8, ((32, 2), (64, 2), (128, 2)))):
        for t, b in shapes:
            out.append(S(threads=t, group=g, vector=8, batch=b, min_blocks=min(32, 65536 // (t * 64))))
            if t == 32:
                out.append(S(threads=t, group=g, vector=8, batch=b, min_blocks=16))
        for t in sorted({t for t, _ in shapes}):
            out.append(S(threads=t, group=g, vector=8, min_blocks=min(32, 65536 // (t * 64))))
    return out


def batch_top_schedules() -> list[S]:
    """The batch sweep's leaders at 256 columns (RMSNorm, LayerNorm), each also with two-pass
    moments and under an 80-register cap, next to the batch-1 defaults."""
    lead = [S(threads=64, group=8, vector=8, batch=2, min_blocks=16), S(threads=128, group=8, vector=8, batch=2, min_blocks=8),
            S(threads=32, group=8, vector=8, batch=2, min_blocks=32), S(threads=256, group=16, vector=8, batch=2, min_blocks=4),
            S(threads=128, group=16, vector=8, batch=2, min_blocks=8), S(threads=256, group=32, vector=8, batch=2, min_blocks=4),
            S(threads=128, group=32, vector=8, batch=4, min_blocks=8)]
    capped = [replace(s, min_blocks=max(1, 65536 // (s.threads * 80))) for s in lead[:3]]
    base = [S(threads=256, group=32, vector=8, min_blocks=8), S(threads=128, group=16, vector=8, min_blocks=8)]
    return [x for s in lead + capped + base for x in (s, replace(s, two_pass=True))]


def mid_schedules() -> list[S]:
    """Rows of 512-4096 columns: a row per 32-512 threads, 128-1024 threads a CTA, the row held
    in registers or staged in shared memory, under a 64-register cap (and 128 for 32 or 64
    threads a row, which hold many chunks)."""
    out = []
    for g in (32, 64, 128, 256, 512):
        for t in (128, 256, 512, 1024):
            if t < g:
                continue
            for st in ("regs", "smem"):
                for regs in ((64, 128) if g <= 64 else (64,)):
                    out.append(S(threads=t, group=g, vector=8, stage=st, min_blocks=max(1, min(32, 65536 // (t * regs)))))
    return out


SCHEDULE_SETS = {"grid": grid_schedules, "mid": mid_schedules, "layernorm": layernorm_schedules, "batch": batch_schedules,
                 "batch-top": batch_top_schedules}


def long_row_schedules() -> list[S]:
    """The row held in registers (read once) by a CTA of 512 or 1024 threads."""
    return [S(threads=1024, group=1024, vector=8, min_blocks=2), S(threads=512, group=512, vector=8, min_blocks=4),
            S(threads=512, group=512, vector=8, min_blocks=2)]



def program_launch(prog, inputs):
    """(its lowered kernel, its launch step, the kernel's pointer list, the outputs it writes)
    of a one-kernel program: inputs and weights where the program keeps them, each output a
    fresh tensor allocated once (the last pointer is the last output)."""
    runner = prog.runner(inputs[0].device)
    launches = [op for op in runner.ops if hasattr(op, "ck")]
    if len(launches) != 1 or len(runner.ops) != 1:
        raise SystemExit(f"expected a one-kernel program, got {len(runner.ops)} steps")
    op = launches[0]
    env = runner.base.copy()
    env[:runner.n_inputs] = inputs
    ptrs, outs = [], []
    for kind, i, shape, dtype, _ in op.params:
        if shape is None:
            ptrs.append(env[i].data_ptr())
        else:
            t = torch.empty(shape, dtype=dtype, device="cuda")
            outs.append(t)
            ptrs.append(t.data_ptr())
    return next(iter(prog.kernels.values())), op, ptrs, outs


def program_case(case: str):
    """'layernorm:32768x256' -> (module, inputs, the program's outputs, and program_launch's
    lowered kernel, launch step, pointers and outputs): a probe's starting point, on the GPU."""
    name, shape = case.split(":")
    rows, cols = (int(v) for v in shape.split("x"))
    module = PROGRAMS[name](cols).cuda().bfloat16()
    inputs = inputs_for(name, rows, cols)
    prog = tilefuse.compile(module, inputs)
    got = prog(*inputs)
    want = [o.clone() for o in (got if isinstance(got, (tuple, list)) else (got,))]  # (one output: a tensor)
    return (module, inputs, want, *program_launch(prog, inputs))


def with_source(ck, source: str):
    """`ck` (a CompiledKernel) built from `source` instead, an edit of its own (the probes'
    hand edits of a rendered kernel): same kernel, arch, name and launch."""
    from tilefuse.runtime import cache
    from tilefuse.runtime.launch import CompiledKernel

    cubin, _ = cache.compile_cached(source, ck.source.name, ck.arch)
    return CompiledKernel(kernel=ck.kernel, arch=ck.arch, source=replace(ck.source, source=source), cubin=cubin,
                          cache_hit=False)


def beside_baselines(fn, inputs, kernels: dict, ptrs, extra: dict | None = None) -> dict:
    """label -> us per round (rotated_rounds) for each compiled kernel of `kernels` launched on
    `ptrs`, each of `extra`'s calls (warmed up first), torch.compile of `fn` and eager `fn`."""
    from tilefuse.analyze.bench import fresh_compile

    comp = fresh_compile(fn)
    calls = {label: (lambda ck=ck: ck.launch_ptrs(0, ptrs)) for label, ck in kernels.items()}
    with torch.no_grad():
        for _ in range(3):
            comp(*inputs)
            for call in (extra or {}).values():
                call()
        calls.update(extra or {})
        calls["torch.compile"] = lambda: comp(*inputs)
        calls["eager"] = lambda: fn(*inputs)
        return rotated_rounds(calls)


def launched(kernels: dict, ptrs, outs):
    """(label, its last output) for each compiled kernel, launched on `ptrs` once, that output
    poisoned with NaN first."""
    for label, ck in kernels.items():
        outs[-1].fill_(float("nan"))
        ck.launch_ptrs(0, ptrs)
        torch.cuda.synchronize()
        yield label, outs[-1].clone()


def case_summary(name: str, schedule, inputs, outs, per: dict, copy: float) -> dict:
    """One probe case's record (schedule, bytes, median us per call, every round), its line printed."""
    nbytes = sum(t.numel() * t.element_size() for t in list(inputs) + list(outs))
    med = {k: statistics.median(v) for k, v in per.items()}
    print(f"{name} [{schedule}]: " + ", ".join(f"{k} {v:.1f} us ({nbytes / (v * 1e-6) / copy:.0%})"
                                              for k, v in med.items()), flush=True)
    return {"schedule": str(schedule), "bytes": nbytes, "us": med, "rounds": per}


def rotated_rounds(calls: dict, rounds: int = 9) -> dict:
    """label -> us per round: each call timed once a round (timings_ms' median, L2 flushed),
    the order rotated from round to round."""
    keys = list(calls)
    per = {k: [] for k in keys}
    for rnd in range(rounds):
        for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            per[k].append(statistics.median(timings_ms(calls[k], warmup=10, rep=50)) * 1e3)
    return per


def rows_for(name: str, R: int, C: int, placements: int, extra: list[S]):
    module = PROGRAMS[name](C).cuda().bfloat16()
    compiled = fresh_compile(module)
    calls, regs = {}, {}
    with torch.no_grad():
        for p in range(placements):
            inputs = inputs_for(name, R, C)
            prog = tilefuse.compile(module, inputs, graphs=True)
            thin = tilefuse.compile(module, inputs)  # as by default: a one-kernel program launches directly
            for _ in range(3):  # warm-up, capture, replay: the last result is the graph's own output
                want = prog(*inputs)
            want = want if isinstance(want, torch.Tensor) else want[-1]
            lowered, op, ptrs, outs = program_launch(thin, inputs)
            scheds = [op.ck.source.schedule] + [s for s in extra if s != op.ck.source.schedule]
            for s in scheds:
                try:
                    ck = compile_kernel(lowered.kernel, schedule=s)
                except ValueError as e:
                    print(f"  skip {s}: {e}", flush=True)
                    continue
                outs[-1].fill_(float("nan"))
                try:
                    ck.launch_ptrs(0, ptrs)
                    torch.cuda.synchronize()
                except CudaError as e:  # e.g. more shared memory than an SM has beside the rest
                    print(f"  skip {s}: {e}", flush=True)
                    continue
                err = (outs[-1].float() - want.float()).abs().max().item()
                if not err <= 0.05 * want.float().abs().max().item():  # NaN fails too
                    print(f"  {s}: differs from the program's output (max {err:.3g}); kept out", flush=True)
                    continue
                label = "kernel " + ("(program's) " if s == op.ck.source.schedule else "") + str(s)
                calls[(label, p)] = (lambda ck=ck, ptrs=ptrs, keep=(inputs, outs): ck.launch_ptrs(0, ptrs))
                regs[label] = (ck.info.registers, ck.info.spill_stores)
            # the program's kernel writing where the program's CUDA graph writes: if this runs as
            # fast as the kernel above, the program's extra time is its output's placement
            # (which memory it lands in), not the graph launch
            if len(outs) == 1:  # its one output is the last parameter
                gptrs = ptrs[:-1] + [want.data_ptr()]
                calls[("kernel (program's) into the graph's output", p)] = (
                    lambda ck=op.ck, ptrs=gptrs, keep=(inputs, want): ck.launch_ptrs(0, ptrs))
            x = inputs[0]
            y = torch.empty_like(x)
            calls[("program graph", p)] = (lambda prog=prog, inputs=inputs: prog(*inputs))
            calls[("program", p)] = (lambda thin=thin, inputs=inputs: thin(*inputs))
            compiled(*inputs)
            calls[("torch.compile", p)] = (lambda inputs=inputs: compiled(*inputs))
            calls[("copy", p)] = (lambda x=x, y=y: y.copy_(x))
    return calls, regs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="name:RxC as bench/mapreduce.py names them")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--placements", type=int, default=2)
    ap.add_argument("--ncu", action="store_true", help="each row twice inside cudaProfilerStart/Stop")
    ap.add_argument("--json", default=None)
    ap.add_argument("--schedules", choices=["auto", *SCHEDULE_SETS], default="auto",
                    help="the schedules tried besides the program's: auto (short or long rows' list), or a named set")
    ap.add_argument("--both-moments", action="store_true",
                    help="each schedule with merged and with two-pass (count, mean, M2) (MapReduceSchedule.two_pass)")
    args = ap.parse_args()
    results = []
    for case in args.cases:
        name, shape = case.split(":")
        R, C = (int(v) for v in shape.split("x"))
        extra = (SCHEDULE_SETS[args.schedules]() if args.schedules != "auto"
                 else short_row_schedules() if C <= 1024 else long_row_schedules())
        if args.both_moments:
            extra = [replace(s, two_pass=tp) for s in extra for tp in (True, False)]
        calls, regs = rows_for(name, R, C, 1 if args.ncu else args.placements, extra)
        keys = list(calls)
        if args.ncu:
            for k in keys:
                for _ in range(3):
                    calls[k]()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for k in keys:
                print(f"ncu {case} | {k[0]}", flush=True)
                for _ in range(2):
                    calls[k]()
                torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        per = {k: [] for k in keys}
        for rnd in range(args.rounds):
            for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
                per[k].append(statistics.median(timings_ms(calls[k], warmup=10, rep=50)) * 1e3)
        labels = list(dict.fromkeys(k[0] for k in keys))
        tc = statistics.median(statistics.median(per[("torch.compile", p)]) for p in range(args.placements))
        rows = []
        for label in labels:
            meds = [statistics.median(per[(label, p)]) for p in range(args.placements) if (label, p) in per]
            rows.append({"row": label, "us_per_set": meds, "us": statistics.median(meds), "vs_tc": tc / statistics.median(meds),
                         "registers, spill stores": regs.get(label)})
        rows.sort(key=lambda r: r["us"])
        results.append({"case": case, "rows": rows})
        print(f"\n{case} (torch.compile {tc:.2f} us)")
        for r in rows:
            sets = " ".join(f"{u:.2f}" for u in r["us_per_set"])
            print(f"  {r['us']:8.2f} us  {r['vs_tc']:.3f}x t.c.  [{sets}]  {r['row']}")
        if args.json:
            Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                   "rounds": args.rounds, "placements": args.placements,
                                                   "results": results}, indent=1))


if __name__ == "__main__":
    with torch.no_grad():  # as bench/mapreduce.py: torch.compile's inference graph, not a training one
        main()

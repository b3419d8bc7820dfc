"""Timing a compiled program next to its baselines, in one run, as the performance method says.

Times are medians of CUDA-event timings (triton.testing.do_bench, which flushes L2 between
repetitions). Bytes are the program's unavoidable traffic: every input and weight read
once, every output written once. The copy ceiling is a device-to-device copy measured in
the same run, counting bytes read plus bytes written.

Host overhead is the other half of a small program's time: the wall time of one Python
call with the GPU idle (synchronize, then time the call until it returns, median). When
it exceeds the GPU time, a loop of calls is bound by the host, whatever the kernels do.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def host_us(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median host time of one call, in microseconds, each started with the GPU idle."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy rate in bytes/s (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def program_bytes(graph) -> int:
    return (sum(graph[i].type.nbytes for i in graph.inputs) + sum(graph[w].type.nbytes for w in graph.weights)
            + sum(graph[o].type.nbytes for o in set(graph.outputs)))


@dataclass
class Row:
    name: str
    ms: float
    gbps: float
    pct_copy: float
    vs_tilefuse: float  # this time / tilefuse's time (> 1: tilefuse is faster)
    host_us: float = float("nan")  # host time of one call with the GPU idle


def compare(prog, module, inputs, nbytes: int, copy_bps: float | None = None, with_compile=True,
            extra: dict | None = None) -> list[Row]:
    """Time tilefuse, eager, torch.compile (and any `extra` named callables) in this run."""
    copy_bps = copy_bps or copy_bandwidth()
    runs = {"tilefuse": lambda: prog(*inputs)}
    with torch.no_grad():
        runs["eager"] = lambda: module(*inputs)
        if with_compile:
            # a fresh dynamo: after an earlier case of the same module class it would recompile
            # with dynamic shapes (automatic dynamic), a slower baseline than this program gets
            torch._dynamo.reset()
            compiled = torch.compile(module)
            compiled(*inputs)
            runs["torch.compile"] = lambda: compiled(*inputs)
        runs.update(extra or {})
        times = {k: median_ms(f) for k, f in runs.items()}
        hosts = {k: host_us(f) for k, f in runs.items()}
    base = times["tilefuse"]
    return [Row(k, t, nbytes / (t * 1e-3) / 1e9, 100 * nbytes / (t * 1e-3) / copy_bps, t / base, hosts[k])
            for k, t in times.items()]


def bench_program(prog, module, inputs, stages):
    from rich.table import Table

    copy_bps = copy_bandwidth()
    rows = compare(prog, module, inputs, program_bytes(stages.graph), copy_bps)
    table = Table(title=f"{torch.cuda.get_device_name()}: copy {copy_bps / 1e12:.2f} TB/s",
                  caption="host: one call's Python time with the GPU idle; above the GPU time, a loop is host-bound"
                          + _graph_note(prog))
    flops = program_flops(stages.plan)
    cols = ["impl", "time (us)", "GB/s", "% of copy"] + (["TFLOP/s"] if flops else []) + ["time / tilefuse",
                                                                                         "host us/call"]
    for col in cols:
        table.add_column(col)
    for r in rows:
        bound = " (host-bound)" if r.host_us > r.ms * 1e3 else ""
        rate = [f"{flops / (r.ms * 1e-3) / 1e12:.0f}"] if flops else []
        table.add_row(r.name, f"{r.ms * 1e3:.1f}", f"{r.gbps:.0f}", f"{r.pct_copy:.0f}%", *rate,
                      f"{r.vs_tilefuse:.2f}x", f"{r.host_us:.1f}{bound}")
    return table


def program_flops(plan) -> int:
    """The matrix products' FLOPs (2 M N K each), generated GEMMs and cuBLAS externs alike: a
    program with them is compute-bound, and its rate says more than its bytes."""
    return sum(s.flops for s in plan.steps)


def _graph_note(prog) -> str:
    info = prog.graph_info() if hasattr(prog, "graph_info") else []
    if not info:
        return "; tilefuse: CUDA graphs off"
    i = info[-1]
    return ("; tilefuse: CUDA graph replay" if i["graphs"] else f"; tilefuse: no CUDA graph ({i['reason']})")


def as_dicts(rows):
    return [asdict(r) for r in rows]

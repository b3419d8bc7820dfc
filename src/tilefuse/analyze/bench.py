"""Timing a compiled program next to its baselines, in one run, as the performance method says.

Times are medians of CUDA-event timings (triton.testing.do_bench, which flushes L2 between
repetitions). Bytes are the program's unavoidable traffic: every input and weight read
once, every output written once. The copy ceiling is a device-to-device copy measured in
the same run, counting bytes read plus bytes written.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


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


def compare(prog, module, inputs, nbytes: int, copy_bps: float | None = None, with_compile=True) -> list[Row]:
    copy_bps = copy_bps or copy_bandwidth()
    runs = {"tilefuse": lambda: prog(*inputs)}
    with torch.no_grad():
        runs["eager"] = lambda: module(*inputs)
        if with_compile:
            compiled = torch.compile(module)
            compiled(*inputs)
            runs["torch.compile"] = lambda: compiled(*inputs)
        times = {k: median_ms(f) for k, f in runs.items()}
    base = times["tilefuse"]
    return [Row(k, t, nbytes / (t * 1e-3) / 1e9, 100 * nbytes / (t * 1e-3) / copy_bps, t / base)
            for k, t in times.items()]


def bench_program(prog, module, inputs, stages):
    from rich.table import Table

    copy_bps = copy_bandwidth()
    rows = compare(prog, module, inputs, program_bytes(stages.graph), copy_bps)
    table = Table(title=f"{torch.cuda.get_device_name()}: copy {copy_bps / 1e12:.2f} TB/s")
    for col in ("impl", "time (us)", "GB/s", "% of copy", "time / tilefuse"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, f"{r.ms * 1e3:.1f}", f"{r.gbps:.0f}", f"{r.pct_copy:.0f}%", f"{r.vs_tilefuse:.2f}x")
    return table


def as_dicts(rows):
    return [asdict(r) for r in rows]

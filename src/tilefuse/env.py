"""The environment variables tilefuse reads, in one place: name, default and what each does.

One table so that every switch parses alike (before it, some took only "0" and others
"0/false/off/no", and a typo such as TILEFUSE_GEMM=of silently meant "on"), so that a wrong
value is an error naming the variable rather than a guess, and so that the README's table and
`tilefuse env` can be checked against what the code reads (tests/cpu/test_env.py).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Var:
    name: str
    default: str   # as it would be written in the environment; "" where unset means something else
    kind: str      # "switch" (on/off), "path", "size", "rows" (a whole number), "list"
    what: str      # one line for users: what it changes


VARS: tuple[Var, ...] = (
    Var("TILEFUSE_CACHE_DIR", "", "path",
        "the folder for compiled kernels and tuned schedules (tune.sqlite); unset: "
        "~/.cache/tilefuse/cubin and ~/.cache/tilefuse/tune.sqlite"),
    Var("TILEFUSE_LOG", "", "list",
        "`summary`: under torch.compile(backend=\"tilefuse\"), print per graph what ran in kernels "
        "and what fell back to eager, and why"),
    Var("TILEFUSE_TUNED", "1", "switch",
        "use the schedules `tilefuse tune` stored; 0: the heuristic defaults"),
    Var("TILEFUSE_CUDA_GRAPHS", "1", "switch",
        "replay a program of two or more kernels as one CUDA graph after its first call"),
    Var("TILEFUSE_GRAPH_MEMORY", "0.25", "size",
        "what the CUDA graphs of a process may hold on each device: a fraction (0.25) or a size (8GiB)"),
    Var("TILEFUSE_PDL", "1", "switch",
        "on Hopper, let each kernel start while the one before it finishes (programmatic dependent "
        "launch); 0 for per-kernel profiler times"),
    Var("TILEFUSE_GEMM", "1", "switch",
        "run 16-bit matmuls in tilefuse's generated GEMM with fused epilogues; 0: cuBLAS"),
    Var("TILEFUSE_GEMV", "1", "switch",
        "run matmuls of up to 8 rows (decode steps) in the matrix-vector kernel; 0: the tiled GEMM"),
    Var("TILEFUSE_GEMV_GROUPS", "1", "switch",
        "launch consecutive matrix-vector products of one input (Q, K, V) as one kernel"),
    Var("TILEFUSE_NORM_PARTIALS", "1", "switch",
        "compute an RMSNorm's / LayerNorm's row sums in the epilogue of the GEMM that wrote its input"),
    Var("TILEFUSE_ROPE_EPILOGUE", "1", "switch",
        "apply RoPE in the epilogue of the Q/K projection"),
    Var("TILEFUSE_PLANLESS_ATTENTION", "1", "switch",
        "run a program's first call at new sizes on attention backends that plan nothing per shape"),
    Var("TILEFUSE_FLASH_WINDOW", "1", "switch",
        "run a sliding-window mask known when compiling on flash attention's own window"),
    Var("TILEFUSE_GATHERS", "1", "switch",
        "compute embeddings, index_select, gather, flip and pads inside kernels; 0: torch.gather"),
    Var("TILEFUSE_SCANS", "1", "switch",
        "compute cumsum, cumprod, cummax and cummin inside kernels; 0: PyTorch's ops"),
    Var("TILEFUSE_COLUMNS", "1", "switch",
        "fuse reductions over a dim that is not last into column kernels; 0: PyTorch's ops"),
    Var("TILEFUSE_COLUMN_MIN_ROWS", "", "rows",
        "the fewest rows a reduction over a dim that is not last needs to become a column kernel "
        "(unset: the planner's floor, larger for longer rows; 1: at any size)"),
    Var("TILEFUSE_FLAT_ROWS", "1", "switch",
        "let map kernels over short rows work on the tensor as flat memory"),
    Var("TILEFUSE_MERGED_ROWS", "1", "switch",
        "let map kernels merge short rows into long ones"),
    Var("TILEFUSE_SPLIT", "1", "switch",
        "cut few long rows into pieces so that every SM works"),
    Var("TILEFUSE_GRID_REDUCE", "0", "switch",
        "experimental: fuse full reductions of per-row values into their row kernel"),
)

BY_NAME: dict[str, Var] = {v.name: v for v in VARS}


def raw(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value as set, stripped; its default where unset or empty."""
    var = BY_NAME[name]
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or var.default


def switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch `name` is on: 1/on/true/yes or 0/off/false/no, any case."""
    var = BY_NAME[name]
    assert var.kind == "switch", name
    value = raw(name, environ).lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={value!r}: use 1 or 0 (on/off, true/false, yes/no); the switch: {var.what}")


def rows(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A whole number of rows, or None where unset."""
    assert BY_NAME[name].kind == "rows", name
    value = raw(name, environ)
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{name} must be a whole number of rows, not {value!r}")
    return max(1, n)


def check(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the variable's value would be refused where it is read, or None where it is fine."""
    kind = BY_NAME[name].kind
    try:
        if kind == "switch":
            switch(name, environ)
        elif kind == "rows":
            rows(name, environ)
        elif kind == "size":
            from .runtime.graphs import memory_limit

            memory_limit(1 << 30, environ)
    except ValueError as e:
        return str(e)
    return None


def table() -> list[tuple[str, str, str]]:
    """(name, value now or default, what) for every variable: `tilefuse env` prints it."""
    out = []
    for v in VARS:
        now = os.environ.get(v.name, "").strip()
        shown = f"{now} (set)" if now else (v.default or "unset")
        out.append((v.name, shown, v.what))
    return out

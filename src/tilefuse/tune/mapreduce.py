"""The map-reduce family's knob space, derived from MapReduceSchedule and default_schedule.

Dimensions, most influential first (the search tree branches in this order):
stage (regs | smem | stream), vector (the widest chunk and half of it), threads per CTA,
group (threads per row), cluster (CTAs per row, sm_90), min_blocks (__launch_bounds__'s
CTAs per SM, i.e. the register cap), unroll (stream stage only).

`admits` prunes what cannot help: more threads per row than the row has chunks, more
than 32 chunks per thread, more rows per CTA than the kernel has rows, a register cap
that does not fit 2048 threads per SM, unroll away from its default outside the stream
stage (it changes nothing there). `valid` is the codegen's own word: the schedule
constructs and the kernel renders for the target (staged registers, shared memory,
16-byte chunks for smem, clusters only on sm_90).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Mapping

from ..codegen import mapreduce as mr
from ..loop import ir
from .space import Dim, Space

STAGES = ("smem", "regs", "stream")
THREADS = (64, 128, 256, 512, 1024)
GROUPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CLUSTERS = (1, 2, 4, 8)
MIN_BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
UNROLLS = (2, 4, 8)
MAX_CHUNKS_PER_THREAD = 16
SM_THREADS = 2048  # resident threads per SM on sm_80 and sm_90


def _pow2ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def space(kernel: ir.Kernel, arch: str = "sm_90a") -> Space:
    """The knob space of a map-reduce kernel on `arch`, with the heuristic default in it."""
    parts = ir.row_kernel_parts(kernel)
    d = mr.default_schedule(kernel, arch)
    knobs = asdict(d)
    C, R = parts.col_extent, parts.rows
    vectors = tuple(v for v in (d.vector, d.vector // 2) if v >= 1)
    clusters = CLUSTERS if mr.supports_clusters(arch) else (1,)

    def occupancies(t: int) -> set:
        """__launch_bounds__ minima worth trying for t threads: none, 1024 or 2048 resident
        threads per SM, and the heuristic's own choice."""
        return {1, max(1, 1024 // t), SM_THREADS // t} | ({d.min_blocks} if t == d.threads else set())

    def chunks_per_thread(k: Mapping) -> int:
        return -(-(-(-C // k["vector"])) // (k["group"] * k["cluster"]))

    def admits(k: Mapping) -> bool:
        if all(knobs[n] == v for n, v in k.items()):
            return True  # the heuristic's pick is always a candidate
        if "vector" in k and k["vector"] != d.vector and k["stage"] != "regs":
            return False  # narrower chunks only to ease register pressure; smem needs 16 bytes
        if "group" in k:
            t, g = k["threads"], k["group"]
            if g > t or t % g or (g > 32 and g % 32) or t // g > _pow2ceil(R):
                return False
            if g > _pow2ceil(-(-C // k["vector"])):  # idle threads in every row
                return False
        if "cluster" in k:
            if k["cluster"] > 1 and k["group"] != k["threads"]:
                return False
            if k["group"] * k["cluster"] > _pow2ceil(-(-C // k["vector"])):
                return False
            if chunks_per_thread(k) > MAX_CHUNKS_PER_THREAD:
                return False
        if "min_blocks" in k:
            mb = k["min_blocks"]
            if mb * k["threads"] > SM_THREADS or mb not in occupancies(k["threads"]):
                return False
        if "unroll" in k and k["unroll"] != d.unroll:
            # unroll shapes only the stream stage's chunk loop, and only up to its trip count
            if k["stage"] != "stream" or k["unroll"] > chunks_per_thread(k):
                return False
        return True

    def valid(k: Mapping) -> bool:
        try:
            mr.render(kernel, mr.MapReduceSchedule(**k), arch)
        except ValueError:
            return False
        return True

    candidates = {"stage": STAGES, "vector": vectors, "threads": THREADS, "group": GROUPS, "cluster": clusters,
                  "min_blocks": MIN_BLOCKS, "unroll": UNROLLS}
    dims = tuple(Dim(n, vals if knobs[n] in vals else tuple(sorted(vals + (knobs[n],))))
                 for n, vals in candidates.items())
    return Space("mapreduce", dims, valid=valid, admits=admits, default=tuple(knobs[x.name] for x in dims))


def build(kernel: ir.Kernel, knobs: Mapping, arch: str = "sm_90a") -> mr.MapReduceSchedule:
    """The schedule these knobs name; ValueError if MapReduceSchedule rejects them."""
    return mr.MapReduceSchedule(**dict(knobs))


def knobs_of(schedule: mr.MapReduceSchedule) -> dict:
    return asdict(schedule)

"""The map-reduce family's knob space, derived from MapReduceSchedule and default_schedule.

Dimensions, most influential first (the search tree branches in this order): stage
(smem | regs | stream), vector (the widest chunk, and half of it for the regs stage),
threads per CTA, group (threads per row), cluster (CTAs per row, sm_90), min_blocks
(__launch_bounds__'s CTAs per SM, i.e. the register cap), unroll (stream stage only),
l2_hints (stream stage only, where a later pass re-reads a row from L2), two_pass (a
(count, mean, M2) of a row a warp or less holds: two passes and butterflies or a merge tree;
where it renders the same kernel either way, the duplicate is dropped), batch (rows a row
group of at most a warp works on at once, chunks in registers: 1, 2 or 4).

`admits` prunes what cannot help: more threads per row than the row has chunks, more
than 16 staged chunks per thread (regs, smem; a batch's rows counted), more rows per CTA than the
kernel has rows, a register cap
other than none / 1024 / 2048 resident threads per SM (or the heuristic's own), unroll
away from its default where it changes nothing. `valid` is the codegen's own word: the
schedule constructs and the kernel renders for the target (staged registers, shared
memory, 16-byte chunks for smem, clusters only on sm_90); a config that renders exactly
the kernel another config already did is a duplicate, not a new candidate.

Fields of MapReduceSchedule this module does not name get candidates by their type: a
bool knob both values, anything else the heuristic's value only; so a new codegen knob is
searched (or at least carried) without touching this file. The heuristic default is
always a candidate.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, fields
from typing import Mapping

from ..codegen import mapreduce as mr
from ..loop import ir
from .space import Dim, Space

STAGES = ("smem", "regs", "stream", "tiles")
THREADS = (64, 128, 256, 512, 1024)
GROUPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CLUSTERS = (1, 2, 4, 8)
MIN_BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
UNROLLS = (2, 4, 8)
BATCHES = (1, 2, 4)
MAX_CHUNKS_PER_THREAD = 16
SM_THREADS = 2048  # resident threads per SM on sm_80 and sm_90
# Spaces with at most this many distinct kernels are measured whole: enumerating them
# renders each (~1.5 ms), and a candidate's timing costs about the same whatever the
# kernel's size (warm-up + rep_ms), so 256 of them take ~20 s. The one-row finishing sums
# of a cross-entropy mean (5-6 us, 170-220 kernels) are such spaces: SP-MCTS left them
# 3-8% behind the whole space's best on an H100, where the whole space was ~7 s away.
EXHAUSTIVE_UPTO = 256


def _pow2ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def space(kernel: ir.Kernel, arch: str = "sm_90a") -> Space:
    """The knob space of a map-reduce kernel on `arch`, with the heuristic default in it."""
    parts = ir.row_kernel_parts(kernel)
    d = mr.default_schedule(kernel, arch)
    knobs = asdict(d)
    C, R = parts.col_extent, parts.rows
    vectors = tuple(v for v in (d.vector, d.vector // 2) if v >= 1)
    if d.stage == "tiles":  # (a tiled map: the output columns a thread computes, up to 16 bytes)
        vectors += (d.vector * 2, d.vector * 4)
    clusters = CLUSTERS if mr.supports_clusters(arch) else (1,)
    rereads = mr.rereads_rows(kernel)
    # a batch overlaps the loads of its rows' staged chunks: a kernel with no row stream to
    # stage (a gather) or ending in a grid reduction (one row per row group) has none to batch
    batches = ir.grid_parts(kernel) is None and any(
        st.per_row for st in mr._analyse(kernel, parts, d.vector).in_streams.values())

    from ..codegen import columns

    strided = d.stage != "tiles" and columns.strided_rows(kernel)  # a column kernel: rows across lanes

    def occupancies(t: int) -> set:
        return {1, max(1, 1024 // t), SM_THREADS // t} | ({d.min_blocks} if t == d.threads else set())

    def row_chunks(k: Mapping) -> int:
        return -(-C // k["vector"])

    def admits(k: Mapping) -> bool:
        if all(knobs[n] == v for n, v in k.items()):
            return True  # the heuristic's pick and everything on the way to it
        if strided:
            return _admits_columns(k, d, C, R)
        if k.get("across"):
            return False  # rows split across warps only where rows lie side by side (a column kernel)
        if "vector" in k and k["vector"] != d.vector and k["stage"] not in ("regs", "tiles"):
            return False  # narrower chunks only to ease register pressure; smem needs 16 bytes
        if "group" in k:
            t, g = k["threads"], k["group"]
            if g > t or t % g or (g > 32 and g % 32) or t // g > _pow2ceil(R):
                return False
            if g > _pow2ceil(row_chunks(k)):  # threads that would idle in every row
                return False
        if "cluster" in k:
            p = k["group"] * k["cluster"]
            if k["cluster"] > 1 and k["group"] != k["threads"]:
                return False
            if p > _pow2ceil(row_chunks(k)):
                return False
            if k["stage"] != "stream" and -(-row_chunks(k) // p) > MAX_CHUNKS_PER_THREAD:
                return False  # staged chunks live in registers or shared memory: a few per thread
        if "min_blocks" in k:
            mb = k["min_blocks"]
            if mb * k["threads"] > SM_THREADS or mb not in occupancies(k["threads"]):
                return False
        if k.get("l2_hints") and (k["stage"] != "stream" or not rereads):
            return False  # a row read once gains nothing from a priority: only re-read rows get hints
        if k.get("batch", 1) > 1:
            if not batches or k["stage"] != "regs" or k["group"] > 32 or k["cluster"] > 1:
                return False  # a batch is held in registers by a row group of at most a warp
            if k["threads"] // k["group"] * k["batch"] > _pow2ceil(R):
                return False  # more rows per CTA than the kernel has
            if -(-row_chunks(k) // k["group"]) * k["batch"] > MAX_CHUNKS_PER_THREAD:
                return False
        if "unroll" in k and k["unroll"] != d.unroll:
            # unroll shapes only the stream stage's chunk loop, and only up to its trip count
            if k["stage"] != "stream" or k["unroll"] > -(-row_chunks(k) // (k["group"] * k["cluster"])):
                return False
        return True

    rendered: dict = {}  # what a config renders to -> the first config that did
    answers: dict = {}   # config -> valid, so a config counted before the search is not rendered again

    def valid(k: Mapping) -> bool:
        key = tuple(sorted(k.items()))
        if key not in answers:
            try:
                src = mr.render(kernel, mr.MapReduceSchedule(**k), arch)
            except (ValueError, TypeError):
                answers[key] = False
                return False
            code = re.sub(r"//[^\n]*", "", src.source)  # the header comment names every knob
            fp = (hashlib.sha256(code.encode()).hexdigest(), src.grid, src.block, src.smem_bytes, src.cluster)
            answers[key] = rendered.setdefault(fp, dict(k)) == dict(k)
        return answers[key]

    valid(knobs)  # the default claims its kernel first
    candidates = {"stage": STAGES, "vector": vectors, "threads": THREADS, "group": GROUPS, "cluster": clusters,
                  "min_blocks": MIN_BLOCKS, "unroll": (COLUMN_UNROLLS if strided else UNROLLS), "batch": BATCHES}
    for f in fields(mr.MapReduceSchedule):
        if f.name not in candidates:
            candidates[f.name] = (False, True) if isinstance(knobs[f.name], bool) else (knobs[f.name],)
    dims = tuple(Dim(n, vals if knobs[n] in vals else tuple(vals) + (knobs[n],)) for n, vals in candidates.items())
    return Space("mapreduce", dims, valid=valid, admits=admits, default=tuple(knobs[x.name] for x in dims),
                 exhaustive_upto=EXHAUSTIVE_UPTO)


COLUMN_UNROLLS = (8, 16, 32)


def _admits_columns(k: Mapping, d: mr.MapReduceSchedule, C: int, R: int) -> bool:
    """A column kernel's space (codegen/columns.py): single elements (a row's neighbours lie a
    whole row apart); a row a thread, or split between 2-32 threads a warp apart (`across`, and
    only then), at least 8 columns a thread; a thread's columns in registers (up to twice
    REGS_MAX_COLUMNS) or streamed 8-32 an iteration; 64-1024 threads a CTA, no more row slots
    than rows beyond a warp's; a split row's thread may take a batch of 2-4 neighbouring rows in
    registers (up to 128 columns of them)."""
    from ..codegen import columns

    g = k.get("group", 1)
    if k.get("stage", "stream") not in ("regs", "stream") or k.get("vector", 1) != 1 or g > 32:
        return False
    if g > 1 and C < columns.MIN_SHARE * g:
        return False
    if "across" in k and k["across"] != (g > 1):
        return False
    if k.get("stage") == "regs" and -(-C // g) > 2 * columns.REGS_MAX_COLUMNS:
        return False
    t = k.get("threads", 128)
    if (t > 512 and g == 1) or t // g > max(32, _pow2ceil(R)) or k.get("cluster", 1) != 1:
        return False
    if "min_blocks" in k and (k["min_blocks"] * t > SM_THREADS or k["min_blocks"] not in (1, 2, 4)):
        return False
    if "unroll" in k and k["unroll"] != d.unroll and (k["stage"] != "stream" or k["unroll"] not in COLUMN_UNROLLS):
        return False
    if k.get("l2_hints") or k.get("two_pass"):
        return False
    b = k.get("batch", 1)
    if b > 1 and (g == 1 or k.get("stage") != "regs" or -(-C // g) * b > 128):
        return False  # a batch of neighbouring rows a thread, read as vectors: split rows, in registers
    return True


def build(kernel: ir.Kernel, knobs: Mapping, arch: str = "sm_90a") -> mr.MapReduceSchedule:
    """The schedule these knobs name; ValueError if MapReduceSchedule rejects them."""
    try:
        return mr.MapReduceSchedule(**dict(knobs))
    except TypeError as e:  # a knob this MapReduceSchedule does not have
        raise ValueError(str(e)) from None


def knobs_of(schedule: mr.MapReduceSchedule) -> dict:
    return asdict(schedule)

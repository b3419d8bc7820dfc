"""Column kernels: row kernels whose rows lie side by side in memory, each row strided.

A reduction over a dim that is not last (`softmax(x, 1)` over [N, C, H, W], a channels-first
norm, `x.mean(1)` over [B, S, D]) is planned as a row kernel whose row runs along that dim
(graph/fusion.py, `Planner.column_start`): element c of row r lies at base(r) + c * stride,
and row r + 1 next to row r. The row kernel's usual layouts, a group of threads along each
row, would then make every load its own memory transaction. Here each thread takes a row of
its own part of a row and neighbouring lanes neighbouring rows, so a warp's loads of one
column are one coalesced run. A row's threads lie a warp apart (MapReduceSchedule.across) and
combine their partials through shared memory once per reduction; short rows (and a grid
reduction's) take a thread each, with no exchange at all.
"""
from __future__ import annotations

import math

from .. import dtypes
from ..loop import ir


def _accesses(parts: ir.RowKernel):
    """(column variable, Load or Store) of each access inside the row's loops and reductions."""
    for s in parts.body:
        if isinstance(s, (ir.Loop, ir.Reduce)):
            for t in s.body:
                if isinstance(t, (ir.Load, ir.Store)):
                    yield s.var, t


def strided_rows(kernel: ir.Kernel) -> bool:
    """Whether more of the row's bytes are read or written across rows (the address steps by one
    element from a row to the next and by more along the row) than along them."""
    from .tiles import _along_columns, _flat

    try:
        parts = ir.row_kernel_parts(kernel)
    except ValueError:
        return False
    if parts.rows <= 1 or parts.col_extent <= 1 or kernel.scratch:
        return False
    if all(_along_columns(s.index, col) for col, s in _accesses(parts)):
        return False  # (every access steps along the row: a row kernel, found without the analysis)
    across = along = 0
    seg = (parts.rows, 1, parts.col_extent)
    for col, s in _accesses(parts):
        buf = kernel.buffer(s.buf)
        a = _flat(buf, s.index, parts.row_var, col, 1, 1, seg)
        if a is None:
            continue
        size = dtypes.itemsize(buf.dtype)
        if a.dc == 1:
            along += size
        elif a.dr == 1 and a.dc > 1:
            across += size
    return across > 0 and across >= along


def row_vector_loads(kernel: ir.Kernel, batch: int, kind=ir.Load) -> dict:
    """The loads inside the row's loops that a thread of a column kernel can read for its
    `batch` neighbouring rows (MapReduceSchedule.across with a batch) as one vector: element
    (r0 + b, c) lies at offset(r0, c) + b for every r0 a multiple of `batch`, and that offset is
    a multiple of `batch` (a vector-aligned address where the buffer is). Keyed by the load's
    index with its loop's column variable renamed (the passes' loads of one element share a
    vector): {key: [(column variable, Load), ...]}. Empty where the batch's rows are no
    vector: 16 bytes at most, no gathered index, every division of the row by a multiple of
    the batch. `kind=ir.Store`: the stores inside the loops that can be written so."""
    from .tiles import _divisors, _flat, _subst

    parts = ir.row_kernel_parts(kernel)
    rows = parts.rows
    if rows <= 0:  # a rows_free kernel (mapreduce.rows_free), run at any row count: analysed for a
        # count too large to fold a division of the row (its rows 0: every r // k read as 0 and r
        # % k as r, which passed rows 3 elements apart as neighbours: found by review)
        whole = math.lcm(batch, *(k for _, s in _accesses(parts) for e in s.index
                                   for k in _divisors(e, parts.row_var)))
        rows = whole * -(-(1 << 40) // whole)
    out: dict = {}
    for col, s in _accesses(parts):
        if not isinstance(s, kind) or any(ir.index_values(e) for e in s.index):
            continue
        buf = kernel.buffer(s.buf)
        size = dtypes.itemsize(buf.dtype)
        if size * batch > 16:
            continue
        # (each // and % of the row by a multiple of the batch: the batch's rows share every
        # quotient at any row count, a rows_free kernel's too)
        if any(k % batch for e in s.index for k in _divisors(e, parts.row_var)):
            continue
        a = _flat(buf, s.index, parts.row_var, col, batch, 1, (rows, 1, parts.col_extent))
        if a is None or a.dr != 1 or a.align % batch:
            continue
        key = (s.buf, tuple(_subst(e, col, ir.Var(ROW_VECTOR_COLUMN)) for e in s.index))
        out.setdefault(key, []).append((col, s))
    return out


ROW_VECTOR_COLUMN = "tf_rv_c"  # the column variable of row_vector_loads' keys


REGS_MAX_COLUMNS = 96  # columns a thread takes in registers (the passes unrolled whole)
MIN_SHARE = 8  # columns a thread of a split row keeps at least: rows under twice this stay a row a thread
FILL_THREADS = 132 * 512  # threads a grid wants at least: a quarter of an H100's / H200's
MAX_SPLIT = 16


def split_of(C: int, R: int, row_bytes: int) -> int:
    """Threads a row is split between (MapReduceSchedule.across): more where a thread's share
    of the row is long (fewer loads a thread, more in flight across the SM), more again where
    the rows alone would not fill the GPU; a thread keeps at least MIN_SHARE columns."""
    if C < 2 * MIN_SHARE:
        return 1
    g = 2 if row_bytes <= 128 else 4 if row_bytes < 384 else 8
    while g < MAX_SPLIT and R * g < FILL_THREADS:
        g *= 2
    while g > 1 and C < MIN_SHARE * g:
        g //= 2
    return g


def row_bytes(kernel: ir.Kernel) -> int:
    """Bytes of a row's inputs read along it (outputs where there are none: a map)."""
    parts = ir.row_kernel_parts(kernel)
    seen: dict = {}
    for col, s in _accesses(parts):
        if isinstance(s, ir.Load) or not any(isinstance(t, ir.Load) for _, t in _accesses(parts)):
            seen.setdefault(s.buf, dtypes.itemsize(kernel.buffer(s.buf).dtype))
    return parts.col_extent * sum(seen.values())


def vector_words(kernel: ir.Kernel, batch: int) -> list[int]:
    """Registers a column of each of row_vector_loads' vectors takes (32-bit words), loads and
    stores."""
    from .mapreduce import _words

    return [_words(kernel.buffer(b).dtype, batch) for kind in (ir.Load, ir.Store)
            for b, _ in row_vector_loads(kernel, batch, kind)]


MAX_VECTOR_WORDS = 48  # a batch's vectors' registers a thread (C = 512 LayerNorm's 64 spilled at 128)


def _row_batch(kernel: ir.Kernel, R: int, C: int) -> int:
    """2 where a thread can read its two neighbouring rows' elements of a column as one vector
    and every such vector is of 16-bit elements (or 8-bit): a warp's load of a column then
    covers 128 bytes where a row a thread covered 64. H200, bf16, one process
    (bench/columns_probe.py --batches, bench/results/s71/): `x.mean(1)` over [256, 128, 2048]
    39.2 -> 34.5 us, over [16, 512, 4096] 21.6 -> 21.0, `x.amax(1)` over [16, 256, 4096] 13.4 ->
    12.9. 1 where a store in the row's loops is no such pair (each row's store its own, a warp's
    store then covers 64 bytes over 128: softmax over channels 16.6 -> 22.6, channels-first
    RMSNorm 24.5 -> 28.8, LayerNorm 20.6 -> 22.1 before stores were paired too) and for f32
    (128 bytes a warp already; its mean 33.9 -> 42.3)."""
    if R < 64 or C < 2 * MIN_SHARE:
        return 1
    stores = [s for _, s in _accesses(ir.row_kernel_parts(kernel)) if isinstance(s, ir.Store)]
    if len(stores) != sum(len(v) for v in row_vector_loads(kernel, 2, ir.Store).values()):
        return 1  # (a row's store on its own would half-fill a warp's sectors: the batch's are one vector)
    loads = row_vector_loads(kernel, 2)
    if not loads or any(dtypes.itemsize(kernel.buffer(b).dtype) > 2 for b, _ in loads):
        return 1
    return 2


def default_schedule(kernel: ir.Kernel, arch: str = "sm_90a", batch: bool = True):
    """Each row split between G threads a warp apart (G = split_of), neighbouring lanes on
    neighbouring rows, 32 rows a CTA (64 at G = 2, 128 threads). A thread's share of up to
    REGS_MAX_COLUMNS columns is taken in registers (its passes unrolled whole, every load of a
    pass in flight); up to 128 at 64 rows a CTA (512 threads: __launch_bounds__ caps a thread at
    128 registers, 4 warps a scheduler stay resident); longer shares streamed 16 an iteration.

    H200, bf16, same tensors (bench/columns_probe.py, bench/results/s68/), a row a thread before
    against this: softmax over dim 1 of 32 x 128 x 56 x 56 20.0 -> 16.3 us (G 4), a
    channels-first LayerNorm over 96 channels 20.4 -> 19.5 (G 4; f32 58.1 -> 24.0 at G 8), a
    mean over 512: 23.6 -> 21.8 (G 8), a max over 256: 14.3 -> 13.5 (G 8), softmax over 64
    8.8 -> 8.6 (G 2), log_softmax over dim 0 of 1000 x 65536 165.3 -> 104.6 (G 8, 64 rows a CTA).
    G 16 and 32 were slower at every one of these (65536 rows or more). A kernel a split
    cannot take (a grid reduction's) keeps a row a thread.

    Where a column's elements of two neighbouring rows are one 16-bit pair in memory
    (_row_batch), a thread takes both rows (batch 2, MapReduceSchedule.across): G is chosen for
    half the rows, and the pair is read as one 4-byte load, if its columns fit in registers."""
    from .mapreduce import MAX_STAGED_WORDS, MapReduceSchedule, staged_words

    parts = ir.row_kernel_parts(kernel)
    C, R = parts.col_extent, parts.rows
    g = 1 if ir.grid_parts(kernel) is not None else split_of(C, R, row_bytes(kernel))
    if g > 1:
        batch = _row_batch(kernel, R, C) if batch else 1
        if batch > 1:
            g = split_of(C, R // batch, row_bytes(kernel))  # (fewer threads fill the GPU)
        words = sum(vector_words(kernel, batch)) if batch > 1 else 0
        stores = any(isinstance(s, ir.Store) for _, s in _accesses(parts))
        while (batch > 1 and not stores and -(-C // g) * words > MAX_VECTOR_WORDS and g < MAX_SPLIT
               and C >= MIN_SHARE * 2 * g):
            g *= 2  # (a reduction's batch in registers: [16, 512, 4096]'s mean 22.0 us at 8 a row, 20.4 at 16)
        per = -(-C // g)
        rows = 64 if g == 2 or REGS_MAX_COLUMNS < per else 32
        stage = "regs" if per <= 128 and per * staged_words(kernel, 1) <= MAX_STAGED_WORDS else "stream"
        if batch > 1 and (stage != "regs" or per * words > MAX_VECTOR_WORDS
                          or per * staged_words(kernel, 1) * batch > MAX_STAGED_WORDS):
            # (a row stream beside the columns, `(x * y[:, :, None]).sum(1)`'s y, is staged for
            # each row of the batch: 96 registers at 768 columns, which render refuses)
            return default_schedule(kernel, arch, batch=False)
        return MapReduceSchedule(threads=g * rows, group=g, vector=1, stage=stage, unroll=16, min_blocks=1,
                                 across=True, batch=batch)
    # (a row a thread stages C chunks of its row streams: `e.t().to(torch.int32)` over 40 i64
    # columns held 80 registers, which render refuses)
    if C <= REGS_MAX_COLUMNS and C * staged_words(kernel, 1) <= MAX_STAGED_WORDS:
        return MapReduceSchedule(threads=128, group=1, vector=1, stage="regs", min_blocks=1)
    return MapReduceSchedule(threads=128, group=1, vector=1, stage="stream", unroll=32, min_blocks=2)

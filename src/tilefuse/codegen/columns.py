"""Column kernels: row kernels whose rows lie side by side in memory, each row strided.

A reduction over a dim that is not last (`softmax(x, 1)` over [N, C, H, W], a channels-first
norm, `x.mean(1)` over [B, S, D]) is planned as a row kernel whose row runs along that dim
(graph/fusion.py, `Planner.column_start`): element c of row r lies at base(r) + c * stride,
and row r + 1 next to row r. The row kernel's usual layouts, a group of threads along each
row, would then make every load its own memory transaction. Here each thread takes a row of
its own and neighbouring lanes neighbouring rows, so a warp's loads of one column are one
coalesced run; a thread's reductions need no exchange with other threads.
"""
from __future__ import annotations

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


REGS_MAX_COLUMNS = 96  # rows this short are held in registers (the passes unrolled whole)


def default_schedule(kernel: ir.Kernel, arch: str = "sm_90a"):
    """A row a thread, 128 threads a CTA. Rows of up to REGS_MAX_COLUMNS elements are held in
    registers, every load of a pass issued at once; longer ones are streamed in each pass, 32
    columns an iteration (32 loads in flight a thread).

    H200, bf16, same tensors (bench/columns_probe.py, bench/results/s57/): softmax over dim 1 of
    32 x 128 x 56 x 56 20.5 us in registers (20.4 streamed 32 a time, 24.7 at 8), a channels-first
    LayerNorm over 96 channels 20.4 (21.6), softmax over 64: 8.9 (10.0); a mean over 512: 24.3
    streamed (25.2 in registers, 40.3 at 8 a time), a max over 256: 13.9 (14.3)."""
    from .mapreduce import MAX_STAGED_WORDS, MapReduceSchedule, staged_words

    C = ir.row_kernel_parts(kernel).col_extent
    # (a row a thread stages C chunks of its row streams: `e.t().to(torch.int32)` over 40 i64
    # columns held 80 registers, which render refuses)
    if C <= REGS_MAX_COLUMNS and C * staged_words(kernel, 1) <= MAX_STAGED_WORDS:
        return MapReduceSchedule(threads=128, group=1, vector=1, stage="regs", min_blocks=1)
    return MapReduceSchedule(threads=128, group=1, vector=1, stage="stream", unroll=32, min_blocks=2)

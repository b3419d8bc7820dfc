"""Shared-memory bank arithmetic: which bank an element lands in, and how many wavefronts
(serialized passes) an access takes. 32 banks of 4 bytes; one wavefront serves at most
one distinct 4-byte word per bank (threads reading the same word share it).
"""
from __future__ import annotations

from collections import defaultdict

from .inttuple import product_each

BANKS = 32
BANK_BYTES = 4


def bank(byte_address: int) -> int:
    return (byte_address // BANK_BYTES) % BANKS


def wavefronts(byte_addresses, access_bytes: int = 4) -> int:
    """Wavefronts needed when each address is read `access_bytes` wide, all at once
    (one phase: for 16-byte accesses that is 8 threads, for 4-byte ones 32)."""
    words = defaultdict(set)
    for a in byte_addresses:
        for w in range(a // BANK_BYTES, (a + access_bytes - 1) // BANK_BYTES + 1):
            words[w % BANKS].add(w)
    return max((len(ws) for ws in words.values()), default=0)


def row_phase_wavefronts(layout, elem_bytes: int, rows: int = 8, segment_bytes: int = 16) -> int:
    """Worst wavefront count of the ldmatrix/stmatrix access pattern on a (rows, cols) layout:
    in one phase `rows` consecutive rows are each read as one `segment_bytes` segment at the
    same column. 1 means conflict-free; n means an n-way conflict.
    """
    n_rows, n_cols = _grid(layout)
    per_segment = segment_bytes // elem_bytes
    if n_rows % rows or n_cols % per_segment:
        raise ValueError(f"{layout}: the grid {n_rows}x{n_cols} does not split into "
                         f"{rows}-row phases of {per_segment}-element segments")
    for r in range(n_rows):
        for c in range(0, n_cols, per_segment):
            if any(layout(r, c + j) != layout(r, c) + j for j in range(per_segment)):
                raise ValueError(f"{layout}: row {r} is not contiguous over the "
                                 f"{segment_bytes}-byte segment at column {c}")
    worst = 0
    for r0 in range(0, n_rows, rows):
        for c in range(0, n_cols, per_segment):
            addrs = [layout(r, c) * elem_bytes for r in range(r0, r0 + rows)]
            worst = max(worst, wavefronts(addrs, segment_bytes))
    return worst


def _grid(layout):
    shape = product_each(layout.shape)
    if not isinstance(shape, tuple) or len(shape) != 2:
        raise ValueError(f"{layout}: need a rank-2 (rows, cols) layout")
    return shape

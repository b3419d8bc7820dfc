"""The map-reduce template's index maps, as CuTe layouts: the one place they are defined.

Every index formula the map-reduce template prints (which row a thread works on, which
columns of the row its chunks cover, where a staged chunk sits in shared memory, which
warp of a row a thread is in) is `cgen.c_index` of a layout built here; render() never
writes such a formula by hand. `row_layouts(schedule, C, ...)` is the entry point:

    thread -> (lane, slot)       (group, slots):(1, group)               threadIdx.x's digits
                                 (slots, group):(1, slots) rows across lanes (a split column row)
    (slot, row block) -> row     (slots, blocks):(1, slots)
    (slot, b, row block) -> row  (slots, batch, blocks):(1, slots, slots*batch)   batch > 1
                                 (slots, batch, blocks):(batch, 1, slots*batch)   ... rows across lanes
    block -> (rank, row block)   (cluster, blocks):(1, cluster)          blockIdx.x's digits
    (lane, rank) -> p            (group, cluster):(1, group)             thread within the row
    (p, j) -> chunk              (P, nchunk):(1, P)                      chunk j of thread p
    (v, (p, j)) -> column        V:1 x chunk = (V,(P,nchunk)):(1,(V,V*P))  (logical_product)
    (thread, piece, j) -> byte   (threads, w16, nchunk):(16, 16*threads, 16*threads*w16)
    lane -> warp of the row      (32, warps):(0, 1)

A "digits" map (threadIdx.x -> lane) is the projection of a layout onto one of its modes
(stride 0 elsewhere): c_index splits the one coordinate into the layout's digits, so
`lane = threadIdx.x % group` and `slot = threadIdx.x / group` come out of the same layout.
Columns print factored, `(p + j * P) * V` (the chunk layout, then V elements per chunk):
the same numbers as the column layout's `p * V + j * V*P`, and what lets the compiler see
that a chunk's first column is a multiple of V (measured: 39 instead of 64 registers and
no spill for a streamed LayerNorm on sm_80).
The staging layout makes a warp's 16-byte accesses contiguous (conflict-free: 32 threads
x 16 bytes cover the 32 banks four times in four wavefronts, the minimum), and each
thread reads back only what it copied.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout, c_index, logical_product, size


@dataclass(frozen=True)
class RowLayouts:
    """The layouts of one schedule at one row length (see the module docstring)."""

    lane: Layout     # threadIdx.x -> thread within the row's group (projection of `thread`)
    slot: Layout     # threadIdx.x -> row within the CTA (projection of `thread`)
    thread: Layout   # (lane, slot) -> threadIdx.x
    row: Layout      # (slot, row block) -> row, or (slot, b, row block) -> row with a batch
    rank: Layout     # blockIdx.x -> CTA of the cluster (projection of `block`)
    rowblock: Layout  # blockIdx.x -> row block (projection of `block`)
    block: Layout    # (rank, row block) -> blockIdx.x
    p: Layout        # (lane, rank) -> thread within the row (cluster-wide)
    chunk: Layout    # (p, j) -> chunk of the row
    column: Layout   # (v, (p, j)) -> column of the row: logical_product(V:1, chunk)
    smem: Layout     # (threadIdx.x, 16-byte piece, j) -> byte offset in a stream's staging area
    warp: Layout     # lane -> warp of the row (rows of more than 32 threads)

    # -- the C expressions render() prints, all through c_index --------------------------------
    def c_lane(self, tid: str = "threadIdx.x") -> str:
        return c_index(self.lane, tid)

    def c_slot(self, tid: str = "threadIdx.x") -> str:
        return c_index(self.slot, tid)

    def c_row(self, slot: str = "slot", rowblock: str = "blockIdx.x", b: int | None = None) -> str:
        """The row of `slot` in `rowblock` (row b of the group's batch where there is one)."""
        if b is None:
            return c_index(self.row, (slot, rowblock))
        return c_index(self.row, (slot, b, rowblock))

    def c_rank(self, bid: str = "blockIdx.x") -> str:
        return c_index(self.rank, bid)

    def c_rowblock(self, bid: str = "blockIdx.x") -> str:
        return c_index(self.rowblock, bid)

    def c_p(self, lane: str = "lane", rank: str = "rank") -> str:
        return c_index(self.p, (lane, rank))

    @property
    def vector(self) -> int:
        return size(self.column[0])

    def c_chunk(self, p: str = "p", j: str = "j") -> str:
        return c_index(self.chunk, (p, j))

    def c_column(self, v="v", p="p", j="j") -> str:
        """Column of element v of chunk j of thread p, as (chunk) * V + v: c_index of the
        chunk layout times V (the column layout's first mode, V:1) plus c_index of v."""
        q = c_index(self.chunk, (p, j))
        head = "" if q == "0" else (q if self.vector == 1 else f"({q}) * {self.vector}")
        tail = c_index(self.column[0], v) if v != 0 and self.vector > 1 else ""
        return " + ".join(x for x in (head, tail) if x) or "0"

    def c_smem(self, piece: int, j: str = "j", tid: str = "threadIdx.x") -> str:
        """Byte offset of 16-byte piece `piece` of this thread's chunk j, inside one stream's area."""
        return c_index(self.smem, (tid, piece, j))

    def c_warp(self, lane: str = "lane") -> str:
        return c_index(self.warp, lane, shifts=True)


def row_layouts(*, threads: int, group: int, cluster: int, vector: int, nchunk: int,
                pieces: int = 1, rows: int = 1, batch: int = 1, across: bool = False) -> RowLayouts:
    """The layouts of a schedule: `threads` per CTA in row groups of `group`, `cluster` CTAs
    per row, chunks of `vector` elements, `nchunk` chunks per thread, chunks of `pieces`
    16-byte pieces (staged streams), `rows` rows in all, `batch` rows per row group (a
    group's rows `slots` apart, so each of a warp's loads covers neighbouring rows).
    `across`: a row group's threads lie `slots` apart and neighbouring threads take
    neighbouring rows (a column kernel's row split between warps: a warp's loads of one column
    stay one run of neighbouring rows); a batch's rows are then neighbours too, so a thread
    reads a column's element of its `batch` rows as one vector."""
    rpc = threads // group
    P = group * cluster
    blocks = max(1, -(-rows // (rpc * batch)))
    row = (Layout((rpc, blocks), (1, rpc)) if batch == 1
           else Layout((rpc, batch, blocks), (batch, 1, rpc * batch)) if across
           else Layout((rpc, batch, blocks), (1, rpc, rpc * batch)))
    if across:
        thread = Layout((group, rpc), (rpc, 1))
        lane, slot = Layout((rpc, group), (0, 1)), Layout((rpc, group), (1, 0))
    else:
        thread = Layout((group, rpc), (1, group))
        lane, slot = Layout((group, rpc), (1, 0)), Layout((group, rpc), (0, 1))
    block = Layout((cluster, blocks), (1, cluster))
    chunk = Layout((P, nchunk), (1, P))
    return RowLayouts(
        lane=lane,
        slot=slot,
        thread=thread,
        row=row,
        rank=Layout((cluster, blocks), (1, 0)),
        rowblock=Layout((cluster, blocks), (0, 1)),
        block=block,
        p=Layout((group, cluster), (1, group)),
        chunk=chunk,
        column=logical_product(Layout(vector, 1), chunk),
        smem=Layout((threads, pieces, nchunk), (16, 16 * threads, 16 * threads * pieces)),
        warp=Layout((32, max(1, group // 32)), (0, 1)),
    )

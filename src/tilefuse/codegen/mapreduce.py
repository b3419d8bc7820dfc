"""CUDA C++ for the map-reduce family: one row of the Loop IR kernel per group of threads.

The row stays on chip. Every input read in the column loops at a contiguous (r, c)-like
index is a *stream*: each thread copies its chunks of the row once, with 16-byte
accesses, into shared memory (`stage="smem"`, cp.async: no registers held, so many CTAs
per SM keep many bytes in flight) or into registers (`stage="regs"`), and every Reduce
and Loop over the row reads them from there. A chunk is `vector` consecutive elements;
chunk q of a row belongs to thread `q % P` of the row's P threads, so a warp's accesses
are contiguous, and each thread reads back only the chunks it copied (no barrier).

    rows --> row groups of `group` threads (several rows per CTA, one row per warp, or
             one row per CTA; a row of >= 32k elements spans a cluster of `cluster` CTAs)
    per row:  copies of every stream (all in flight before the first use)
              row-scalar statements, in order
              Reduce: thread-local -> warp shuffles -> shared memory across warps
                      -> distributed shared memory across the cluster's CTAs
                      (independent Reduces share one pass and one exchange; so do a
                      max and a sum of exp(y - max), and a sum and the sum of squares
                      centred on the mean made from it: patterns.py)
              Loop:   element-wise math, stores packed into 16-byte vector stores

Rows too long to stage on chip (without a cluster, e.g. on sm_80) use `stage="stream"`:
each pass re-reads its chunks from global memory (L2 catches part). Loads the vector path
cannot serve (gathers of single elements, strided or misaligned indices, odd row lengths)
are scalar loads at the element's own index; tails are masked, any length works. Buffers
must not alias (inputs are read through the non-coherent path, pointers are __restrict__).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .. import dtypes
from ..loop import ir
from . import cexpr, keep, patterns, scan
from .patterns import CentredSquares, OnlineLse, TargetSelect
from .rowlayout import RowLayouts, row_layouts

# ---------------------------------------------------------------- schedule and source


@dataclass(frozen=True)
class MapReduceSchedule:
    """How a map-reduce kernel is laid out on the GPU.

    threads:    threads per CTA.
    group:      threads that share one row inside a CTA: 1, 2, 4, 8, 16 or 32 (a row per
                sub-warp or warp, threads/group rows per CTA), or a multiple of 32 that
                divides `threads` (warps combine through shared memory).
    vector:     elements per chunk (8 for bf16 = one 16-byte access).
    cluster:    CTAs per row (> 1: sm_90 thread-block cluster; one row per cluster).
    stage:      "regs" (the row's chunks stay in registers, read once from memory),
                "smem" (they stay in shared memory, copied there with cp.async: few
                registers, so many CTAs per SM; needs 16-byte chunks), "stream" (each
                pass over the row re-reads it; any row, any alignment), or "tiles" (a
                map reading an input transposed: 2-D tiles, that input staged through
                shared memory; codegen/tiles.py; only threads, vector (output columns a
                thread computes) and min_blocks apply).
    unroll:     stream mode: chunks per unrolled iteration (loads in flight per thread).
    min_blocks: __launch_bounds__ minimum CTAs per SM (caps registers per thread).
    pipeline:   smem stage: one cp.async group per chunk, and the first pass over the row
                takes chunk j as soon as its copies land (not when the whole row has).
    l2_hints:   L2 eviction priorities on the row's 16-byte reads: evict_last where a later
                pass reads the row again (the stream stage re-reads it from L2), evict_first
                on its last read, so rows read once make room for rows still to be re-read.
    two_pass:   a row held by at most a warp, in registers or shared memory, makes its
                (count, mean, M2) in two passes over the held values (a plain sum, then the
                sums of y - sum / C and their squares: two butterflies) instead of merging
                partials down a shuffle tree (fewer registers; on an H100 from 2% faster to
                1.3% slower by layout, so a tuner's knob); elsewhere it changes nothing.
    batch:      rows each row group works on at once (a row group of at most a warp, chunks
                in registers, no cluster): every row's chunks are loaded before the first
                is reduced, so a thread keeps batch times the bytes in flight and the batch's
                reductions overlap; the CTA covers threads / group * batch rows. With
                `across` the batch's rows are neighbours, and a column's element of all of
                them is one vector load (_row_vector_loads).
    across:     the row group's threads lie threads / group apart, neighbouring threads on
                neighbouring rows (a column kernel, codegen/columns.py, whose rows are each
                split between warps: a warp's loads of one column stay one run of neighbouring
                rows); the group's partials combine through shared memory.
    """

    threads: int = 256
    group: int = 256
    vector: int = 8
    cluster: int = 1
    stage: str = "regs"
    unroll: int = 4
    min_blocks: int = 1
    pipeline: bool = False
    l2_hints: bool = False
    two_pass: bool = False
    batch: int = 1
    across: bool = False

    def __post_init__(self):
        if not 1 <= self.threads <= 1024 or self.threads % 32:
            raise ValueError(f"threads per CTA must be a multiple of 32 up to 1024, not {self.threads}")
        g = self.group
        if g <= 32:
            if g & (g - 1):
                raise ValueError(f"a row group of up to 32 threads must be a power of two, not {g}")
        elif g % 32 or self.threads % g:
            raise ValueError(f"a row group of {g} threads must be a multiple of 32 dividing {self.threads}")
        if self.threads % g:
            raise ValueError(f"row group {g} does not divide {self.threads} threads")
        if self.vector not in (1, 2, 4, 8, 16):
            raise ValueError(f"vector width must be 1, 2, 4, 8 or 16 elements, not {self.vector}")
        if self.cluster not in (1, 2, 4, 8, 16):
            raise ValueError(f"cluster size must be 1, 2, 4, 8 or 16, not {self.cluster}")
        if self.cluster > 1 and self.group != self.threads:
            raise ValueError("a clustered schedule has one row per cluster: group must equal threads")
        if self.stage not in ("regs", "smem", "stream", "tiles"):
            raise ValueError(f"stage must be 'regs', 'smem', 'stream' or 'tiles', not {self.stage!r}")
        if self.batch not in (1, 2, 4, 8):
            raise ValueError(f"a row group's batch must be 1, 2, 4 or 8 rows, not {self.batch}")
        if self.batch > 1 and (self.group > 32 or self.cluster > 1 or self.stage != "regs"):
            raise ValueError(f"a batch of {self.batch} rows per row group needs a group of at most 32 "
                             f"threads, no cluster and stage='regs' (not group={self.group}, "
                             f"cluster={self.cluster}, stage={self.stage!r})")
        if self.across and (g < 2 or g > 32 or (self.threads // g) % 32 or self.cluster > 1
                            or self.two_pass or self.stage not in ("regs", "stream") or self.vector != 1):
            raise ValueError(f"a row group across warps needs 2-32 threads a row, a multiple of 32 rows a CTA, "
                             f"no cluster, single elements, one-pass moments and stage 'regs' or 'stream' (not "
                             f"group={g}, threads={self.threads}, cluster={self.cluster}, vector={self.vector}, "
                             f"two_pass={self.two_pass}, stage={self.stage!r})")

    @property
    def slots(self) -> int:
        """Row groups per CTA."""
        return self.threads // self.group

    @property
    def rows_per_cta(self) -> int:
        return self.slots * self.batch

    def __str__(self):
        if self.stage == "tiles":
            return (f"mapreduce(stage=tiles, threads={self.threads}, vector={self.vector}, "
                    f"min_blocks={self.min_blocks})")
        return (f"mapreduce(threads={self.threads}, group={self.group}, rows/cta={self.rows_per_cta}, "
                f"vector={self.vector}, cluster={self.cluster}, stage={self.stage}, "
                f"unroll={self.unroll}, min_blocks={self.min_blocks}"
                + (", pipeline" if self.pipeline else "") + (", l2 hints" if self.l2_hints else "")
                + (", two-pass moments" if self.two_pass else "")
                + (f", batch {self.batch}" if self.batch > 1 else "")
                + (", rows across lanes" if self.across else "") + ")")


@dataclass(frozen=True)
class KernelSource:
    """A rendered kernel: what NVRTC compiles and what the launcher needs."""

    name: str                       # extern "C" entry point
    source: str                     # CUDA C++
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int                 # dynamic shared memory per CTA
    cluster: tuple[int, int, int]   # (1, 1, 1) when not clustered
    params: tuple[str, ...]         # buffer names in launch order (kernel.params order)
    alignment: tuple[tuple[str, int], ...] = ()  # (buffer, bytes) its data pointer must be aligned to
    schedule: MapReduceSchedule | None = field(default=None, compare=False)
    workspace_bytes: int = 0        # > 0: a last parameter, zeroed device memory owned by the caller
    kept: int = 0                   # values kept in registers between passes (codegen/keep.py)
    moved: int = 0                  # stores made by an earlier pass than the one holding them (keep.Moved)
    rows: int | None = None         # the row count, passed as the kernel's argument tf_rows (an int);
                                    # None: written into the source (rows_free says where)
    period: int | None = None       # the rows' period (rows_period), passed after it as tf_s; None:
                                    # the source takes none


# ---------------------------------------------------------------- access analysis


def _c_offset(e: ir.Index, cvar: str):
    """`e` as c + k (returns k), or None if `e` is not that shape."""
    if isinstance(e, ir.Var) and e.name == cvar:
        return 0
    if isinstance(e, ir.IBin) and e.op == "+":
        if isinstance(e.a, ir.Var) and e.a.name == cvar and isinstance(e.b, ir.IConst):
            return e.b.value
        if isinstance(e.b, ir.Var) and e.b.name == cvar and isinstance(e.a, ir.IConst):
            return e.a.value
    return None


@dataclass(frozen=True)
class _Stream:
    """A buffer read or written contiguously along the row: base(row) + c."""

    key: tuple
    buf: ir.Buffer
    base_index: tuple  # the index with the column replaced by its constant offset
    name: str          # C identifier stem
    wrap: tuple | None = None  # (k, n): a roll's stream, chunk c0 read at column (c0 + k) % n
    split: tuple | None = None  # (m, S): the row read as pieces of m, piece c // m at S apart (_split_load)
    clamp: tuple | None = None  # (k, lo, hi): a pad's stream, column c read at min(max(c + k, lo), hi)

    @property
    def itemsize(self):
        return dtypes.itemsize(self.buf.dtype)

    @property
    def values(self) -> frozenset:
        """Row-level SSA values the base depends on (a gathered row)."""
        out = frozenset()
        for e in self.base_index:
            out |= ir.index_values(e)
        return out

    @property
    def per_row(self) -> bool:
        """True for a row of a matrix (read once, staged with the row's other streams before the
        row's statements run); False for a column vector shared by all rows, and for a gathered
        row (an embedding's, or a slice picked by an index per row of a larger table): its base
        comes from row-level values, so it is read where it is used, after they are computed."""
        return any(ir.index_vars(e) for e in self.base_index) and not self.values


def _c_wrap(e: ir.Index, cvar: str):
    """`e` as (c + k) % n (returns (k, n): a roll's read, loop/views.py), or None."""
    if isinstance(e, ir.IBin) and e.op == "%" and isinstance(e.b, ir.IConst):
        k = _c_offset(e.a, cvar)
        if k is not None:
            return k, e.b.value
    return None


def _stream_wrap(index: tuple, cvar: str):
    """The (k, n) of a stream whose column index is (c + k) % n, else None."""
    found = [_c_wrap(e, cvar) for e in index if cvar in ir.index_vars(e)]
    return found[0] if len(found) == 1 else None


def _int_consts(parts: ir.RowKernel) -> dict:
    """The integer constants of the row body and its blocks, by SSA name."""
    out = {}
    for s in parts.body:
        for t in (s.body if isinstance(s, (ir.Loop, ir.Reduce)) else (s,)):
            if isinstance(t, ir.Const) and isinstance(t.value, int) and not isinstance(t.value, bool):
                out[t.dst] = t.value
    return out


def _clamped_column(v: str, cvar: str, defs: dict, consts: dict):
    """The integer value `v` as min(max(c + k, lo), hi) (returns (k, lo, hi), lo or hi None where
    unbounded), or None. F.pad's gather reads its table at such a column (frontend/aten.py _pad):
    a chunk of columns inside [lo, hi] is then one vector load at c0 + k, where the gather's
    element loads took 2x the time of a copy (bench/op_sweep.py, pad)."""
    s = defs.get(v)
    if isinstance(s, ir.IndexValue):
        k = _c_offset(s.expr, cvar)
        return None if k is None or s.dtype not in ("i32", "i64") else (k, None, None)
    if not isinstance(s, ir.Op) or s.dtype not in ("i32", "i64") or len(s.args) != 2:
        return None
    a, b = s.args
    if s.op in ("add", "max", "min") and a in consts and b not in consts:
        a, b = b, a  # (commutative: the constant second)
    if b not in consts:
        return None
    inner = _clamped_column(a, cvar, defs, consts)
    if inner is None:
        return None
    k, lo, hi, d = *inner, consts[b]
    if s.op in ("add", "sub"):
        d = d if s.op == "add" else -d
        return k + d, None if lo is None else lo + d, None if hi is None else hi + d
    if s.op == "max":  # max(min(max(x, lo), hi), d) = min(max(x, max(lo, d)), max(hi, d))
        return k, d if lo is None else max(lo, d), None if hi is None else max(hi, d)
    if s.op == "min":  # min(min(max(x, lo), hi), d) = min(max(x, min(lo, d)), min(hi, d))
        return k, None if lo is None else min(lo, d), d if hi is None else min(hi, d)
    return None


def _val_plus(e: ir.Index, defs: dict):
    """(v, d) where index `e` is the block's integer value v plus a constant d, else None."""
    if isinstance(e, ir.Val) and e.name in defs:
        return e.name, 0
    if isinstance(e, ir.IBin) and e.op == "+":
        for a, b in ((e.a, e.b), (e.b, e.a)):
            if isinstance(a, ir.Val) and a.name in defs and isinstance(b, ir.IConst):
                return a.name, b.value
    return None


def _clamped_load(buf: ir.Buffer, index: tuple, cvar: str, vector: int, row_values, defs: dict, consts: dict):
    """(base_index, (k, lo, hi)) where buf[index] reads the row at a clamped column c + k (a pad),
    chunk-aligned for `vector` where the chunk lies inside [lo, hi]; else None."""
    at = [i for i, e in enumerate(index) if _val_plus(e, defs) is not None]
    if len(at) != 1 or any(ir.index_values(e) for i, e in enumerate(index) if i != at[0]):
        return None
    v, d = _val_plus(index[at[0]], defs)
    clamp = _clamped_column(v, cvar, defs, consts)
    if clamp is None or clamp[1] is None or clamp[2] is None:
        return None
    clamp = (clamp[0] + d, clamp[1] + d, clamp[2] + d)  # (a table read through a slice: loop/views.py)
    if not 0 <= clamp[1] <= clamp[2] < buf.shape[at[0]]:
        return None
    col = ir.Var(cvar) if clamp[0] == 0 else ir.IBin("+", ir.Var(cvar), ir.IConst(clamp[0]))
    base = _contiguous(buf, tuple(col if i == at[0] else e for i, e in enumerate(index)), cvar, vector, row_values)
    return None if base is None else (base, clamp)


def _contiguous(buf: ir.Buffer, index: tuple, cvar: str, vector: int, row_values=frozenset()):
    """base_index if buf[index] is contiguous in `cvar` and chunk-aligned for `vector`, else None.

    A dimension may be indexed by a row-level value (a gather of whole rows, e.g. an
    embedding lookup): its stride must keep chunks aligned whatever the value is.
    """
    if len(index) != len(buf.shape) or not buf.shape:
        return None
    strides = []
    s = 1
    for n in reversed(buf.shape):
        strides.append(s)
        s *= n
    strides.reverse()
    c_dims = [i for i, e in enumerate(index) if cvar in ir.index_vars(e)]
    if len(c_dims) != 1 or strides[c_dims[0]] != 1:
        return None
    k = _c_offset(index[c_dims[0]], cvar)
    if k is None:
        # a roll's (c + k) % n: a chunk of `vector` columns from a multiple of it stays whole and
        # in order when k and n are multiples of it too; the chunk's start wraps (_chunk_col)
        wrap = _c_wrap(index[c_dims[0]], cvar)
        if wrap is None or wrap[0] % vector or wrap[1] % vector or wrap[1] != buf.shape[c_dims[0]]:
            return None
        k = 0
    const_part = k
    for i, e in enumerate(index):
        if i == c_dims[0]:
            continue
        if not ir.index_values(e) <= row_values:  # gathered by a value of the column
            return None
        if isinstance(e, ir.IConst):
            const_part += e.value * strides[i]
        elif strides[i] % vector:
            return None
    if const_part % vector:
        return None
    base = tuple(ir.IConst(k) if i == c_dims[0] else e for i, e in enumerate(index))
    return base


def _split_load(buf: ir.Buffer, index: tuple, cvar: str, vector: int, row_values=frozenset()):
    """(base_index, (m, S)) where buf[index] reads the row as pieces of m contiguous elements,
    piece c // m at S elements apart (heads merged back into a row: [B, H, S, D] read at
    (b, c // D, s, c % D)), each chunk of `vector` inside one piece and aligned; else None."""
    if len(index) != len(buf.shape) or not buf.shape:
        return None
    c_dims = [i for i, e in enumerate(index) if cvar in ir.index_vars(e)]
    if len(c_dims) != 2:
        return None

    def part(e, op):
        if (isinstance(e, ir.IBin) and e.op == op and isinstance(e.a, ir.Var) and e.a.name == cvar
                and isinstance(e.b, ir.IConst)):
            return e.b.value
        return None

    (i, j) = c_dims
    if part(index[i], "%") is None:
        i, j = j, i
    m = part(index[i], "%")
    if m is None or part(index[j], "//") != m or m % vector or buf.shape[i] != m:
        return None
    strides = [1] * len(buf.shape)
    for d in range(len(buf.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * buf.shape[d + 1]
    if strides[i] != 1 or strides[j] % vector:
        return None
    const_part = 0
    for d, e in enumerate(index):
        if d in (i, j):
            continue
        if not ir.index_values(e) <= row_values:
            return None
        if isinstance(e, ir.IConst):
            const_part += e.value * strides[d]
        elif strides[d] % vector:
            return None
    if const_part % vector:
        return None
    return tuple(ir.IConst(0) if d in (i, j) else e for d, e in enumerate(index)), (m, strides[j])


def _inner_blocks(parts: ir.RowKernel):
    return [s for s in parts.body if isinstance(s, (ir.Loop, ir.Reduce))]


def _choose_vector(kernel: ir.Kernel, parts: ir.RowKernel) -> int:
    """Widest chunk (16 bytes of the narrowest streamed dtype) that divides the row length."""
    sizes = []
    consts = _int_consts(parts)
    for blk in _inner_blocks(parts):
        defs = _defs(blk)
        for s in blk.body:
            if isinstance(s, (ir.Load, ir.Store)):
                buf = kernel.buffer(s.buf)
                rv = _row_values(parts) if isinstance(s, ir.Load) else frozenset()
                if (_contiguous(buf, s.index, blk.var, 1, rv) is not None
                        or isinstance(s, ir.Load) and (_clamped_load(buf, s.index, blk.var, 1, rv, defs, consts)
                                                       or _split_load(buf, s.index, blk.var, 1, rv))):
                    sizes.append(dtypes.itemsize(buf.dtype))
    if not sizes:
        return 1
    v = 16 // min(sizes)
    while v > 1 and parts.col_extent % v:
        v //= 2
    return v


@dataclass(frozen=True)
class _Analysis:
    in_streams: dict    # key -> _Stream (loads served from staged chunks)
    out_streams: dict   # key -> _Stream (stores packed into vector stores)
    load_stream: dict   # id(Load) -> key
    store_stream: dict  # id(Store) -> key


def _defs(blk) -> dict:
    """The integer statements of a row block, by SSA name (what a clamped column is made of)."""
    return {t.dst: t for t in blk.body if isinstance(t, (ir.Op, ir.IndexValue))}


def _row_values(parts: ir.RowKernel) -> frozenset:
    return frozenset(s.dst for s in parts.body if isinstance(s, (ir.Load, ir.Op, ir.IndexValue, ir.Const)))


def _analyse(kernel: ir.Kernel, parts: ir.RowKernel, vector: int) -> _Analysis:
    ins, outs, lmap, smap = {}, {}, {}, {}
    row_values = _row_values(parts)
    consts = _int_consts(parts)
    for blk in _inner_blocks(parts):
        stores_seen = set()
        defs = _defs(blk)
        for s in blk.body:
            if not isinstance(s, (ir.Load, ir.Store)):
                continue
            buf = kernel.buffer(s.buf)
            base = _contiguous(buf, s.index, blk.var, vector,
                               row_values if isinstance(s, ir.Load) else frozenset())
            clamp = split = None
            if base is None and isinstance(s, ir.Load):
                base, clamp = _clamped_load(buf, s.index, blk.var, vector, row_values, defs, consts) or (None, None)
            if base is None and isinstance(s, ir.Load):
                base, split = _split_load(buf, s.index, blk.var, vector, row_values) or (None, None)
            if base is None:
                continue
            wrap = _stream_wrap(s.index, blk.var)
            key = (buf.name, tuple(str(e) for e in base), wrap, clamp) + ((split,) if split else ())
            table = ins if isinstance(s, ir.Load) else outs
            if isinstance(s, ir.Store):
                if key in stores_seen:  # two stores to one chunk in a loop: keep them scalar
                    continue
                stores_seen.add(key)
            if key not in table:
                stem = _ident(buf.name) + ("" if not any(k[0] == buf.name for k in table) else f"_{len(table)}")
                table[key] = _Stream(key, buf, base, stem, wrap=wrap, clamp=clamp, split=split)
            (lmap if isinstance(s, ir.Load) else smap)[id(s)] = key
    return _Analysis(ins, outs, lmap, smap)


def _chunk_col(st: _Stream) -> str:
    """The column a stream's chunk c0 starts at in its buffer's row."""
    if st.split is not None:
        m, stride = st.split
        return f"((long long)(c0 / {m}) * {stride} + c0 % {m})"
    return "c0" if st.wrap is None else f"((c0 + {st.wrap[0]}) % {st.wrap[1]})"


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _param(name: str) -> str:
    """A buffer's parameter name: prefixed, so a graph tensor named like one of the template's
    locals (`r`, `slot`, `tid`...) cannot shadow or collide with it."""
    return "g_" + _ident(name)


def _words(dtype: str, vector: int) -> int:
    """32-bit words holding one chunk of `vector` elements of `dtype`."""
    return max(1, vector * dtypes.itemsize(dtype) // 4)


# ---------------------------------------------------------------- default schedule


def arch_number(arch: str) -> int:
    m = re.fullmatch(r"(?:sm|compute)_(\d+)a?", arch)
    if not m:
        raise ValueError(f"unknown GPU architecture {arch!r} (expected e.g. sm_90a or sm_80)")
    return int(m.group(1))


def supports_clusters(arch: str) -> bool:
    return arch_number(arch) >= 90


def _pow2ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


TARGET_WORDS = 16  # registers per thread for staged row chunks: about 64 bytes in flight
STAGE_WORDS = 24   # the most a schedule may spend on them (under a 64-register cap)


def staged_words(kernel: ir.Kernel, vector: int) -> int:
    """32-bit registers one chunk of the row takes: the staged (per-row input) streams, or,
    for a kernel with none (a gather, a pure column-vector map), the chunk a pass loads and stores."""
    parts = ir.row_kernel_parts(kernel)
    ana = _analyse(kernel, parts, vector)
    staged = sum(_words(s.buf.dtype, vector) for s in ana.in_streams.values() if s.per_row)
    if staged:
        return staged
    return sum(_words(s.buf.dtype, vector) for s in list(ana.in_streams.values()) + list(ana.out_streams.values()))


def _smem_eligible(kernel: ir.Kernel, vector: int) -> bool:
    """Every staged stream comes in whole 16-byte pieces (what cp.async copies)."""
    parts = ir.row_kernel_parts(kernel)
    staged = [s for s in _analyse(kernel, parts, vector).in_streams.values() if _smem_staged(s)]
    return bool(staged) and all((vector * s.itemsize) % 16 == 0 for s in staged)


def _smem_staged(st: _Stream) -> bool:
    """Whether stage="smem" copies the stream to shared memory: a row's, except a pad's (its
    chunks at the edge are loaded an element at a time, which cp.async cannot: each pass loads it)."""
    return st.per_row and st.clamp is None


def default_schedule(kernel: ir.Kernel, arch: str = "sm_90a", stage: str | None = None) -> MapReduceSchedule:
    """A schedule from the row length, the kernel's kind, the staged bytes and the target
    (see _default_schedule); a kernel ending in a grid reduction takes one row per row group."""
    sch = _default_schedule(kernel, arch, stage)
    sch = replace(sch, batch=1) if sch.batch > 1 and ir.grid_parts(kernel) is not None else sch
    if sch.stage == "regs" and held_words(kernel, sch) > MAX_STAGED_WORDS:
        # the heuristics aim at STAGE_WORDS, but a row of many wide streams can outgrow what
        # render accepts: streamed, it is read again instead of failing the program's build
        sch = replace(sch, stage="stream", batch=1)
    return sch


def held_words(kernel: ir.Kernel, sch: MapReduceSchedule) -> int:
    """Registers of row chunks a thread holds with `sch` in the registers stage (what render checks)."""
    gp = ir.grid_parts(kernel)
    head = gp.head if gp is not None else kernel
    parts = ir.row_kernel_parts(head)
    nchunk, _ = _plan_chunks(parts.col_extent, sch.vector, sch.group * sch.cluster)
    return _held(_analyse(head, parts, sch.vector), nchunk, sch)


def _held(ana: _Analysis, nchunk: int, sch: MapReduceSchedule) -> int:
    return nchunk * sch.batch * sum(_words(st.buf.dtype, sch.vector) for st in ana.in_streams.values() if st.per_row)


def _default_schedule(kernel: ir.Kernel, arch: str = "sm_90a", stage: str | None = None) -> MapReduceSchedule:
    """A schedule from the row length, the kernel's kind, the staged bytes and the target.

    stage=None picks "smem" where the rows come in 16-byte chunks (except short rows of a
    map or a plain norm, and a loss over rows that need a cluster: "regs"), else "regs";
    naming a stage gives that stage's heuristic. The choices are the fastest of the
    neighbours bench/mapreduce_kernels.py timed on an H100 (bf16), and where the tuner's
    whole-space searches found better, their picks.
    """
    parts = ir.row_kernel_parts(kernel)
    if scan.has_scan(kernel):
        return scan.default_schedule(kernel, parts, arch, stage)
    if stage in (None, "tiles"):
        from . import tiles

        tp = tiles.plan(kernel)
        if tp is not None:
            # a map reading an input transposed: `(x * 2 + 1).transpose(1, 2).contiguous()` at
            # (64, 4096, 256) bf16 ran 11% of copy bandwidth as a row kernel, 95% in tiles (H200).
            # 16-bit outputs: 8 CTAs an SM (32 registers a thread, no spill in tests/cpu/test_tiles.py):
            # sigmoid(x.T) * 3 67.1 us against 72.9 at the registers ptxas picks (46: 5 CTAs),
            # bench/tiles_probe.py, session 56
            return MapReduceSchedule(threads=tiles.THREADS, group=tiles.THREADS, vector=tp.vb, stage="tiles",
                                     min_blocks=8 if tp.packed else 1)
        if stage == "tiles":
            raise ValueError(f"kernel {kernel.name}: stage='tiles' needs a map reading an input transposed")
    if stage is None:
        from . import columns

        if columns.strided_rows(kernel):
            return columns.default_schedule(kernel, arch)
    v = _choose_vector(kernel, parts)
    auto = stage is None
    if stage is None:
        chunks = -(-parts.col_extent // v)
        short = chunks <= 32 * 4
        kind = _kind(parts)
        n_ex, online = exchanges(kernel)
        row_streams = [st for st in _analyse(kernel, parts, v).in_streams.values() if st.per_row]
        # short rows of a map or of a kernel with several exchanges (the two-pass LayerNorm was
        # 64.4% of copy in registers, 59.9% staged, H100 32768 x 256 bf16) stay in registers;
        # a norm's rows of at most 32 chunks take the layouts below. Its rows of 33-128 chunks
        # are staged: H100, bf16, 2^25 elements, same tensors (bench/results/s26/mid_rows_*_h100.json),
        # RMSNorm and LayerNorm at 512-1024 columns held in registers took 1.014-1.038x the
        # staged layouts' time; two row streams (add+RMSNorm) and the online (max, sum-exp)
        # pass were already staged
        plain_norm = kind == "norm" and n_ex == 1 and not online and len(row_streams) == 1
        regs = short and (kind == "map" or n_ex >= 2)
        row_bytes = parts.col_extent * sum(st.itemsize for st in row_streams)
        if plain_norm and 16384 <= row_bytes <= 32768 and _smem_eligible(kernel, v):  # hints need 16-byte reads
            # a plain norm's 16-32 KB rows: read twice through L2, the first pass's reads kept
            # there (evict_last) for the second, at 2048 threads per SM; H100, 16384 x 8192 bf16,
            # same run (bench/results/l2_probe_h100.json): RMSNorm 0.994x torch.compile against
            # 0.990x staged, LayerNorm 0.986x against 0.988x (0.998x and 0.997x with the L1
            # priorities the hinted loads now carry); without the hints a stream schedule ran
            # 0.68x, its second pass missing L2 (l2_probe_h100_a.json)
            return MapReduceSchedule(threads=512, group=512, vector=v, stage="stream", unroll=2, min_blocks=4,
                                     l2_hints=True)
        norm = kind == "norm" and n_ex == 1 and not online and len(row_streams) in (1, 2)
        if norm and chunks <= 32 and len(row_streams) == 1 and _centred(kernel):
            # LayerNorm's short rows: two chunks per thread, two rows per row group (a batch:
            # four chunks in flight per thread), 256 threads, 4 CTAs per SM (a 64-register cap,
            # no spills). H100, 32768 x 256 bf16, two runs (bench/results/s17/batch_{sweep,top}_h100.json):
            # 13.89 / 13.54 us against 14.06 / 13.95 for session 16's one row per 16 lanes at
            # 128 threads (which had beaten 14.26-14.48 for 8 lanes per row); a third run, the
            # two defaults on the same tensors (s17/batch_defaults_ab_h100.json): 13.86 against
            # 14.19. Eight lanes with a batch of two ran 13.44-13.72 but spills 4 bytes under that cap
            return MapReduceSchedule(threads=256, group=_pow2ceil(-(-chunks // 2)), vector=v, min_blocks=4, batch=2)
        if norm and chunks <= 32 and not _centred(kernel):
            # a row of at most 32 chunks (<= 256 bf16 columns) of a norm with a plain exchange:
            # in registers, a chunk per thread for each row stream (RMSNorm: 1, the row one
            # warp's; add+RMSNorm: 2, half a warp's). H100, 32768 x 256 bf16, each pair timed on
            # the same inputs (bench/results/s11/program_schedules_*): RMSNorm 12.83 / 12.94 /
            # 12.86 us in three runs against 12.99 / 13.09 / 13.15 at 4 chunks per thread (the
            # old group 8) and 12.86 / 13.36 / 12.96 at 2; add+RMSNorm 21.30 us against 22.08
            # staged (its old default) and 21.86 at 1 chunk per thread. With a (count, mean, M2)
            # exchange (LayerNorm) the merge's five levels cost more than the parallelism buys
            # (14.51 against 14.32 us): LayerNorm takes its own layout, above
            per = len(row_streams)
            if per == 1 and chunks == 32:
                # one row stream (RMSNorm): four chunks per thread and a batch of two rows per
                # row group, so eight 16-byte loads are in flight per thread; 128 threads, 8 CTAs
                # per SM. H100, 32768 x 256 bf16, two runs (bench/results/s17/batch_{sweep,top}_h100.json):
                # 12.97 / 12.51 us against 13.15 / 12.67 for a chunk per thread and a row per
                # warp (the old default below); a third, paired (s17/batch_defaults_ab_h100.json):
                # 12.75 against 12.98. add+RMSNorm gained nothing from a batch. Only rows of 32
                # chunks: at some other lengths this layout spills under its 64-register cap
                # (128 columns on sm_90a, 200-248 on sm_80), so they keep a chunk per thread
                return MapReduceSchedule(threads=128, group=_pow2ceil(-(-chunks // 4)), vector=v, min_blocks=8,
                                         batch=2)
            words = staged_words(kernel, v) * per
            return MapReduceSchedule(threads=256, group=_pow2ceil(-(-chunks // per)), vector=v,
                                     min_blocks=8 if words <= 16 else 3)
        stage = "smem" if _smem_eligible(kernel, v) and not regs else "regs"
        if stage == "regs" and kind == "map" and short and v > 1:
            return _short_map_schedule(kernel, parts, v)
    if stage == "smem":
        if not _smem_eligible(kernel, v):
            raise ValueError(f"kernel {kernel.name}: stage='smem' needs 16-byte row chunks")
        s = _smem_schedule(kernel, parts, v, arch)
        if auto and s.cluster > 1 and _kind(parts) == "reduce" and exchanges(kernel) == (1, True):
            # a loss over rows too long for one CTA (cross-entropy): its one (max, sum-exp)
            # pass reads each chunk once, so staging the row in shared memory only adds a
            # trip through it; the same shape in registers, without the cp.async pipeline,
            # was the whole knob space's best at 8192 x 262144 on an H100: 1348 us against
            # 1788 staged (bench/results/tune_eval_mr_full_h100_e.json)
            s = replace(s, stage="regs", pipeline=False)
        return s
    return _regs_schedule(kernel, parts, v, arch)


def _short_map_schedule(kernel: ir.Kernel, parts: ir.RowKernel, v: int) -> MapReduceSchedule:
    """A map's rows of at most 128 chunks: half-width chunks (8 bytes), two a thread, 256
    threads, 2048 threads an SM. H200, bf16, each kernel's own tensors, against its previous
    default (256 threads, 4 chunks of 16 bytes a thread, 768 threads an SM; bench/map_schedules.py,
    bench/results/s67/): a head permute's rows of 128 34.0 against 37.5 us, RoPE's rotate-half
    over rows of 128 35.3 against 40.7, x * 2 over rows of 1024 33.5 against 35.2; each the best
    of 30 neighbours (16-byte chunks at two a thread: 1.03-1.47x the best). More than 16
    registers of staged chunks (RoPE's three streams: 16) leave too few of the 32 a thread
    gets at 2048 threads an SM (six f32 inputs: a stack frame): 1024 threads an SM then.
    Wide streams next to narrow ones (Gemma 2's mask under transformers 5.17: two bool and
    two i64 rows, 36 registers a chunk of 8) take one chunk a thread, then narrower chunks,
    until render accepts them (MAX_STAGED_WORDS), at 512 threads an SM.
    """

    def layout(v: int, per: int) -> MapReduceSchedule:
        group = _pow2ceil(-(-(-(-parts.col_extent // v)) // per))
        threads = max(256, group)
        per_sm = 2048 if per * staged_words(kernel, v) <= 16 else 1024
        sch = MapReduceSchedule(threads=threads, group=group, vector=v, min_blocks=max(1, per_sm // threads))
        # more than 32 registers of chunks held (the masks' 36) spill under 1024 threads' cap of 64
        return replace(sch, min_blocks=max(1, 512 // threads)) if held_words(kernel, sch) > 32 else sch

    v //= 2
    sch = layout(v, 2)
    if held_words(kernel, sch) > MAX_STAGED_WORDS:
        sch = layout(v, 1)
    while held_words(kernel, sch) > MAX_STAGED_WORDS and sch.vector > 1 and sch.group < 1024:
        sch = layout(sch.vector // 2, 1)
    return sch  # (default_schedule streams what still does not fit)


def _centred(kernel: ir.Kernel) -> bool:
    """Whether the kernel's row has a CentredSquares (a (count, mean, M2) exchange)."""
    parts = ir.row_kernel_parts(kernel)
    _, rest, selects = _row_plan(kernel, list(parts.body))
    return any(isinstance(r, CentredSquares) for kind, x in _row_steps(rest, selects) if kind == "reduce" for r in x)


def _kind(parts: ir.RowKernel) -> str:
    """'map' (no reduction), 'reduce' (reductions, per-row outputs only, e.g. a loss) or
    'norm' (reductions and per-element outputs: norms, softmax)."""
    if not any(isinstance(s, ir.Reduce) for s in parts.body):
        return "map"
    if any(isinstance(x, ir.Store) for s in parts.body if isinstance(s, ir.Loop) for x in s.body):
        return "norm"
    return "reduce"


SMEM_PER_CTA = 96 * 1024   # keep at least two CTAs' staging in an SM's shared memory


def max_smem(arch: str) -> int:
    """Dynamic shared memory one CTA may have on `arch`."""
    n = arch_number(arch)
    return {90: 227 * 1024, 80: 163 * 1024, 87: 163 * 1024}.get(n, 99 * 1024 if n >= 86 else 48 * 1024)


def _smem_schedule(kernel, parts, v, arch) -> MapReduceSchedule:
    """Rows staged in shared memory (cp.async): registers stay few (a ~40-register cap), so
    an SM holds 1536+ threads and their copies in flight.

    Short rows: a sub-warp or warp per row, 4 chunks per thread. Rows up to ~16k elements:
    one CTA per row, 4 chunks per thread (at least 256 threads for a norm); a loss (a
    reduction-only kernel: less work per element, and only an exchange to amortise) takes
    8 or 16 chunks per thread, one warp per row where 16 suffice. Rows of a kernel with one
    exchange and no column vector to load (softmax, cross-entropy) stay in one CTA of 512
    threads while 16 chunks per thread and the shared memory allow it (65536 bf16 columns,
    128 KB): at 4096 x 65536, softmax 98.1% of copy (512 x 2 cluster: 94.6%), cross-entropy
    97.0% (84.8%); a cluster's CTAs are scheduled together and hold their shared memory
    until the slowest arrives (ncu, rmsnorm 128 x 8: 124 clusters active, 44% achieved
    occupancy of 81% possible). LayerNorm (two column vectors) ran at 63.6% that way (88.0%
    with 512 x 2, two-pass form): it keeps the cluster. Longer rows: a cluster (sm_90), 8
    chunks per thread, shaped by the row's exchanges (each costs a cluster barrier and a
    gather over the CTAs): one cheap exchange (a norm's sum) takes small CTAs in a large
    cluster, 128 x 8; LayerNorm's one (count, mean, M2) exchange (a tree in the first warp,
    then over the CTAs) 256 x 4; several exchanges or a (max, sum-exp) one take large CTAs
    in a small cluster, 512 x 2 (x 8 for 256k rows); a loss too, unless that needs a
    cluster over 2, where 256 threads with 16 chunks each did better. Without clusters: one
    large CTA, then the streaming stage.

    Measured on an H100 (bf16, bench/mapreduce_kernels.py --sweep, % of copy bandwidth):
    at 4096 x 65536, rmsnorm 93.9 and add+rmsnorm 96.7 with 128 x 8 (88.0 / 88.6 with
    256 x 4); layernorm (one exchange) 96.8 with 256 x 4 (93.4 with 512 x 2, 81.3 with
    128 x 8; bench/results/mapreduce_layernorm_h100.json), softmax 86.4 with 512 x 2
    (81.2 with 128 x 8);
    cross-entropy 82.2 with 512 x 2 (77.4 with 128 x 4); at 8192 x 262144 softmax 87.0
    with 512 x 8, cross-entropy 72.7 with 256 x 8 (68.9 with 512 x 8); cross-entropy
    32768 x 4096 88.1 with one warp per row (83.2 with 64 threads).
    """
    C = parts.col_extent
    kind = _kind(parts)
    in_streams = _analyse(kernel, parts, v).in_streams.values()
    row_streams = [s for s in in_streams if s.per_row]
    # staged bytes per chunk: every stream's area is sized by the widest chunk (_render)
    chunk_bytes = max((v * s.itemsize for s in row_streams), default=0) * len(row_streams)
    chunks = -(-C // v)
    one_stream = len(row_streams) == 1
    # (a few such rows, as a decode step's norm finishing its partials, 1-8 rows of 256 f32,
    # also take this: one CTA of 256 threads, most idle. One CTA of a warp a row in registers
    # instead made no difference to a 4-sequence decode step: 1.064 / 1.063 ms against 1.062 /
    # 1.062, H200, session 53)
    if -(-chunks // 4) <= 32 and 4 * 256 * chunk_bytes <= max_smem(arch):  # a row per warp or sub-warp, several rows per CTA
        per = 4
        if 32 < chunks and kind == "norm" and one_stream and exchanges(kernel) == (1, False) and not _centred(kernel):
            # one row stream and one plain sum (RMSNorm): two chunks per thread. H100, bf16,
            # 2^25 elements, same tensors (bench/results/s26/mid_rows_sweep_short_h100.json): at
            # 512, 768 and 1024 columns 1.1%, 1.4% and 2.1% faster than four
            per = 2
        return MapReduceSchedule(threads=256, group=_pow2ceil(-(-chunks // per)), vector=v, stage="smem",
                                 min_blocks=4)
    uneven = chunks % 256 != 0  # a row per 256 threads below would leave them uneven
    # about 3 chunks a thread counted over every row stream (chunks > 128 here): add+LayerNorm's
    # two rows at 1544, 2040 and 3064 columns took 3-4% less time with a row per 128 threads than
    # per 64 (bench/results/s27/mid_rows_uneven_s27.json); one-stream rows keep 3-6 a thread
    g = min(128, 1 << ((chunks * max(1, len(row_streams)) // 3).bit_length() - 1))
    fits = -(-chunks // g) * 256 * chunk_bytes <= SMEM_PER_CTA
    if kind == "norm" and fits and ((one_stream and chunks < 3 * 256 and (chunks < 512 or uneven))
                                    or (chunks < 512 and uneven and _centred(kernel))):
        # rows of 129-767 chunks (1032-6143 bf16 columns): a row per 32-128 threads, 3-6 chunks
        # each, several rows per CTA (no cross-warp exchange below 64 threads). A row per CTA of
        # 256 threads (below) leaves threads with one chunk, or none, or some with one more than
        # others (a (count, mean, M2) merge of uneven counts divides at every level). H100, bf16,
        # 2^25 elements, same tensors (bench/results/s26/mid_rows_ab_h100.json): that layout took
        # LayerNorm 1.18-2.12x this one's time at 1536-5120 columns, RMSNorm up to 1.09x, softmax
        # up to 1.13x. Kept where it gives every thread the same two or more chunks (4096
        # columns: within 0.3% either way) and for two row streams (add+RMSNorm: 1.8-2.4%
        # faster, mid_rows_sweep_mid_h100.json), except for a (count, mean, M2) merge with under
        # two chunks a thread, some with more than others (add+LayerNorm at 1536 columns: 1.20x
        # this layout's time; 1.00x at 2560 and 3072; at 2048 and 5120, where it is not taken,
        # 0.98x). Rows of many input streams whose staging would outgrow SMEM_PER_CTA keep a
        # row per CTA too
        return MapReduceSchedule(threads=256, group=g, vector=v, stage="smem", min_blocks=4)
    if kind == "reduce":
        t = _pow2ceil(-(-chunks // 8))
        if t <= 64:  # one warp per row, up to 16 chunks per lane: no exchange across warps
            t = max(32, _pow2ceil(-(-chunks // 16)))
    else:
        t = max(_pow2ceil(-(-chunks // 4)), 256 if kind == "norm" else 64)
    if t <= 512 and -(-chunks // t) * t * chunk_bytes <= max_smem(arch):  # a row per CTA
        return MapReduceSchedule(threads=t, group=t, vector=v, stage="smem", min_blocks=max(1, min(32, 1536 // t)),
                                 pipeline=True)
    n_ex, online = exchanges(kernel)
    col_vectors = len(row_streams) < len(in_streams)
    k = -(-chunks // 512)
    if n_ex == 1 and not col_vectors and k <= 16 and k * 512 * chunk_bytes <= max_smem(arch):
        # one exchange and nothing to load in the output pass: the whole row in one CTA
        return MapReduceSchedule(threads=512, group=512, vector=v, stage="smem", min_blocks=3, pipeline=True)
    if supports_clusters(arch):
        if kind == "norm" and n_ex == 1 and not online:
            shapes, cl_max = ((256, 512) if _centred(kernel) else (128, 256, 512)), 8
        elif kind == "norm":
            shapes, cl_max = (512,), 8
        else:
            shapes, cl_max = (512,), 2
        for t in shapes:
            cl = -(-chunks // (t * 8))
            if cl <= cl_max and cl & (cl - 1) == 0 and 8 * t * chunk_bytes <= SMEM_PER_CTA:
                return MapReduceSchedule(threads=t, group=t, vector=v, cluster=cl, stage="smem",
                                         min_blocks=max(1, 1536 // t), pipeline=True)
    clusters = (1, 2, 4, 8) if supports_clusters(arch) else (1,)
    threads, k_max = ((128, 256, 512), 16) if kind == "reduce" else ((256, 512, 1024), 8)
    for t in threads:
        for cl in clusters:
            k = -(-chunks // (t * cl))
            if k <= k_max and k * t * chunk_bytes <= SMEM_PER_CTA:
                return MapReduceSchedule(threads=t, group=t, vector=v, cluster=cl, stage="smem",
                                         min_blocks=max(1, 1536 // t), pipeline=True)
    cl = clusters[-1]
    k = -(-chunks // (1024 * cl))
    if k * 1024 * chunk_bytes <= max_smem(arch):
        return MapReduceSchedule(threads=1024, group=1024, vector=v, cluster=cl, stage="smem", pipeline=True)
    return MapReduceSchedule(threads=512, group=512, vector=v, stage="stream", unroll=4, min_blocks=2)


def _regs_schedule(kernel, parts, v, arch) -> MapReduceSchedule:
    """Rows staged in registers: about TARGET_WORDS registers (64 bytes) of row chunks per
    thread, at most STAGE_WORDS, under a 64-register cap so that 1024 threads fit an SM.
    Short rows share a warp or a CTA; long rows get their own CTA; rows too long for one
    CTA's registers get a cluster (sm_90) or, without clusters, the streaming stage."""
    C = parts.col_extent
    words = max(1, staged_words(kernel, v))
    k_target = max(1, min(16, TARGET_WORDS // words))
    k_max = max(1, min(32, STAGE_WORDS // words))
    chunks = -(-C // v)
    want = -(-chunks // k_target)
    if want <= 32:  # a row per warp or sub-warp, many rows per CTA
        return MapReduceSchedule(threads=256, group=_pow2ceil(want), vector=v, min_blocks=3)
    if want <= 512:  # a row per CTA (two per CTA for 64-thread rows)
        g = _pow2ceil(want)
        t = max(g, 128)
        return MapReduceSchedule(threads=t, group=g, vector=v, min_blocks=max(1, 1024 // t))
    clusters = (1, 2, 4, 8) if supports_clusters(arch) else (1,)
    shapes = [(512, cl) for cl in clusters] + [(1024, clusters[-1])]
    for k in (k_target, k_max):
        for t, cl in shapes:
            if -(-chunks // (t * cl)) <= k:
                return MapReduceSchedule(threads=t, group=t, vector=v, cluster=cl, min_blocks=max(1, 1024 // t))
    return MapReduceSchedule(threads=512, group=512, vector=v, stage="stream", unroll=4, min_blocks=2)


# ---------------------------------------------------------------- rendering


class _Emitter:
    """Accumulates indented lines of C++."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str = ""):
        self.lines.append(("  " * self.depth + line) if line else "")

    def open(self, line: str):
        self(f"{line} {{" if line else "{")
        self.depth += 1

    def close(self, tail: str = ""):
        self.depth -= 1
        self("}" + tail)

    def text(self):
        return "\n".join(self.lines) + "\n"


@dataclass
class _Ctx:
    kernel: ir.Kernel
    parts: ir.RowKernel
    sched: MapReduceSchedule
    ana: _Analysis
    V: int
    C: int
    P: int           # threads per row (group * cluster)
    nchunk: int      # chunks per thread (regs) or chunk loop trip count (stream)
    full: bool       # every chunk of every thread is inside the row
    names: dict = field(default_factory=dict)     # SSA name -> C identifier
    dtype_of: dict = field(default_factory=dict)  # SSA name -> IR dtype
    store_only_casts: set = field(default_factory=set)
    smem_offset: dict = field(default_factory=dict)  # stream key -> byte offset (stage="smem")
    rgroup: int = 0  # reduce groups emitted so far
    lay: RowLayouts | None = None  # every thread -> element index map (codegen/rowlayout.py)
    pending_wait: bool = False     # the next pass waits for chunk j's copies (pipelined smem stage)
    fast: bool = False             # exp and division on the special-function unit (fast_math)
    cluster_done: int | None = None  # line after the last cluster exchange's remote reads
    reads_left: dict = field(default_factory=dict)  # stream key -> passes still to read it (l2_hints)
    var_state: dict = field(default_factory=dict)  # id(CentredSquares) -> its merged (n, k, u, m2)
    var_sums: dict = field(default_factory=dict)   # a CentredSquares' sum -> (it, its merged state)
    var_phase: dict = field(default_factory=dict)  # id(CentredSquares) -> pass 1 or 2 of its two-pass form
    mean_err: dict = field(default_factory=dict)   # a mean _emit_var_mean rounded -> C name of (k + u) - it
    kept: keep.KeepPlan = field(default_factory=keep.KeepPlan)  # values kept between passes (codegen/keep.py)
    passes: list | None = None  # where given, each pass's blocks are recorded (for keep.plan)
    pass_no: int = 0            # passes over the row emitted so far (this row)
    stores: dict = field(default_factory=dict)  # each Store of the row body, by value: this render's own object
    rows_arg: bool = False      # the row count is the argument tf_rows (rows_free)
    hoisted: frozenset = frozenset()  # column-vector streams loaded before the row's reductions
    row_vec: dict = field(default_factory=dict)  # id(Load / Store) -> the batch's vectors of it (_emit_row_vectors)
    batch_row: int | None = None  # the batch's row whose body is being emitted (row_vec's element)

    def c(self, ssa: str) -> str:
        return self.names[ssa]

    def hint(self, key=None) -> str | None:
        """The L2 policy of a read of row stream `key` (None: a read that happens once), or
        None without l2_hints: "last" while a later pass reads the row again, else "first"."""
        if not self.sched.l2_hints:
            return None
        if key is None:
            return "first"
        self.reads_left[key] -= 1
        return "last" if self.reads_left[key] > 0 else "first"

    def define(self, ssa: str, dtype: str) -> str:
        base = "v_" + _ident(ssa)
        name = base
        i = 1
        while name in self.names.values():
            name = f"{base}_{i}"
            i += 1
        self.names[ssa] = name
        self.dtype_of[ssa] = dtype
        return name


def _cast_store_only(kernel: ir.Kernel, body) -> set:
    uses: dict[str, list] = {}

    def use(name, stmt):
        uses.setdefault(name, []).append(stmt)

    for s in ir.walk(body):
        if isinstance(s, ir.Op):
            for a in s.args:
                use(a, s)
        elif isinstance(s, (ir.Store,)):
            use(s.value, s)
        elif isinstance(s, (ir.Reduce, ir.Scan)):
            use(s.value, s)
        if isinstance(s, (ir.Load, ir.Store)):
            for e in s.index:
                for v in ir.index_values(e):
                    use(v, s)
        if isinstance(s, ir.IndexValue):
            for v in ir.index_values(s.expr):
                use(v, s)
    out = set()
    for s in ir.walk(body):
        if isinstance(s, ir.Op) and s.op == "cast" and s.dtype in ("bf16", "f16"):
            us = uses.get(s.dst, [])
            if us and all(isinstance(u, ir.Store) and u.value == s.dst
                          and kernel.buffer(u.buf).dtype == s.dtype for u in us):
                out.add(s.dst)
    return out


def _env(ctx: _Ctx, cvar: str | None) -> dict:
    env = {ctx.parts.row_var: "r", cexpr.PERIOD: cexpr.PERIOD}  # (the period's argument: rows_period)
    if cvar is not None:
        env[cvar] = "c"
    env.update(ctx.names)
    return env


def _guarded_load(kernel: ir.Kernel, s: ir.Load, env: dict, extra_guard: str) -> str:
    """A scalar load at the element's own index, with masks for the row (or tile) and for gathers."""
    buf = kernel.buffer(s.buf)
    off = cexpr.flat_offset(buf, s.index, env)
    guards = [g for g in (extra_guard,) if g]
    for e, n in zip(s.index, buf.shape):
        if ir.index_values(e):  # a gathered index: stay inside the buffer
            guards.append(f"(unsigned long long)({cexpr.index(e, env)}) < {n}ULL")
    load = cexpr.from_storage(buf.dtype, f"{_param(buf.name)}[{off}]")
    if not guards:
        return load
    return f"({' && '.join(guards)}) ? {load} : ({cexpr.ctype(buf.dtype)})0"


def _minus_mean(ctx: _Ctx, s: ir.Op, args: list, arg_dtypes: list) -> str:
    """x - mean (or mean - x) with the mean's rounding taken back out (_emit_var_mean's err):
    on a row far from 0 and narrow (1e4 + N(0, 1) in f16) the mean's half ulp, times rstd * w,
    was the whole error of y, up to 2.7x PyTorch's (the 2x rule failed on 2 of 40 random rows,
    session 52); x - mean is exact there (x near the mean), and so is the difference now. One
    add an element: 0.2-1.5% of a LayerNorm's time on an H200. (Taking err out in the FMA of
    the multiply by rstd instead made ptxas spill at 64 registers: 32768 x 256 11% slower.)"""
    plain = cexpr.op(s.op, args, arg_dtypes, s.dtype, fast=ctx.fast)
    a, b = (ctx.mean_err.get(x) for x in s.args)
    if a and b:  # the difference of two such means: both roundings out
        return f"({plain} + ({a} - {b}))"
    return f"({plain} - {b})" if b else f"({plain} + {a})"


def _emit_stmt(ctx: _Ctx, em: _Emitter, s, env: dict, *, inner: bool, src_chunk=None, out_chunk=None):
    """One scalar statement (not a loop). In an inner body, `src_chunk(key)` names the
    staged words of a stream and `out_chunk(key)` the packed words of an output chunk."""
    if isinstance(s, ir.Const):
        name = ctx.define(s.dst, s.dtype)
        em(f"const {cexpr.ctype(s.dtype)} {name} = {cexpr.const(s.value, s.dtype)};")
    elif isinstance(s, ir.Op):
        args = [ctx.c(a) for a in s.args]
        arg_dtypes = [ctx.dtype_of[a] for a in s.args]
        if s.dst in ctx.store_only_casts:  # the store's conversion rounds it
            expr = cexpr.cast(args[0], arg_dtypes[0], "f32")
        elif s.op == "sub" and s.dtype in ("f32", "f64") and any(a in ctx.mean_err for a in s.args):
            expr = _minus_mean(ctx, s, args, arg_dtypes)
        else:
            expr = cexpr.op(s.op, args, arg_dtypes, s.dtype, fast=ctx.fast)
        name = ctx.define(s.dst, s.dtype)
        em(f"const {cexpr.ctype(s.dtype)} {name} = {expr};")
        env[s.dst] = name
    elif isinstance(s, ir.IndexValue):
        name = ctx.define(s.dst, s.dtype)
        em(f"const {cexpr.ctype(s.dtype)} {name} = ({cexpr.ctype(s.dtype)})({cexpr.index(s.expr, env)});")
    elif isinstance(s, ir.Load):
        buf = ctx.kernel.buffer(s.buf)
        key = ctx.ana.load_stream.get(id(s)) if inner else None
        rv = ctx.row_vec.get(id(s)) if inner and ctx.batch_row is not None else None
        if rv is not None:  # this row's element of the batch's vector (zeros past the last row)
            expr = f"tf_get_{buf.dtype}({rv}[j], {ctx.batch_row})"
        elif key is not None and src_chunk is not None:
            expr = f"tf_get_{buf.dtype}({src_chunk(key)}, v)"
        else:
            expr = _guarded_load(ctx.kernel, s, env, "row_ok")
        name = ctx.define(s.dst, buf.dtype)
        em(f"const {cexpr.ctype(buf.dtype)} {name} = {expr};")
    elif isinstance(s, ir.Store):
        buf = ctx.kernel.buffer(s.buf)
        val = ctx.c(s.value)
        vdt = ctx.dtype_of[s.value]
        if vdt != buf.dtype and s.value not in ctx.store_only_casts:
            val = cexpr.cast(val, vdt, buf.dtype)
        key = ctx.ana.store_stream.get(id(s)) if inner else None
        rv = ctx.row_vec.get(id(s)) if inner and ctx.batch_row is not None else None
        if rv is not None:  # into the batch's vector, stored once the batch's rows are done
            em(f"tf_put_{buf.dtype}({rv}[j], {ctx.batch_row}, {val});")
        elif key is not None and out_chunk is not None:
            em(f"tf_put_{buf.dtype}({out_chunk(key)}, v, {val});")
        else:
            off = cexpr.flat_offset(buf, s.index, env)
            guard = "row_ok" if inner else "row_ok && p == 0"
            for e, n in zip(s.index, buf.shape):
                if ir.index_values(e):
                    guard += f" && (unsigned long long)({cexpr.index(e, env)}) < {n}ULL"
            em(f"if ({guard}) {_param(buf.name)}[{off}] = {cexpr.to_storage(buf.dtype, val)};")
    else:
        raise ValueError(f"kernel {ctx.kernel.name}: unexpected statement {s}")
    if isinstance(s, (ir.Const, ir.Op, ir.IndexValue, ir.Load)):
        env[s.dst] = ctx.c(s.dst)


def _ld_fn(nbytes: int, stream: bool) -> list[tuple[str, int]]:
    """Load calls for a chunk of nbytes: [(function, word offset)]."""
    if nbytes >= 16:
        fn = "tf_ld16_stream" if stream else "tf_ld16"
        return [(fn, 4 * i) for i in range(nbytes // 16)]
    return [({8: "tf_ld8", 4: "tf_ld4", 2: "tf_ld2", 1: "tf_ld1"}[nbytes], 0)]


def _st_fn(nbytes: int) -> list[tuple[str, int]]:
    if nbytes >= 16:
        return [("tf_st16", 4 * i) for i in range(nbytes // 16)]
    return [({8: "tf_st8", 4: "tf_st4", 2: "tf_st2", 1: "tf_st1"}[nbytes], 0)]


def _emit_chunk_load(ctx: _Ctx, em: _Emitter, st: _Stream, dst: str, guard: str, hint: str | None = None):
    """dst (words) <- this thread's chunk of stream st at column c0, zeros where masked; a row
    stream's 16-byte reads carry the L2 policy `hint` ("first", "last") where one is given."""
    nbytes = ctx.V * st.itemsize
    calls = _ld_fn(nbytes, stream=st.per_row)
    pol = ""
    if hint is not None and st.per_row and nbytes >= 16:
        calls = [(f"tf_ld16_{hint}", off) for _, off in calls]
        pol = f", tf_pol_{hint}"
    w = _words(st.buf.dtype, ctx.V)
    ptr = f"{_param(st.buf.name)} + b_{st.name} + {_chunk_col(st)}"
    if st.values:  # a gathered row: its base and bounds come from row-level values
        env = _env(ctx, None)
        em(f"const long long b_{st.name} = {cexpr.flat_offset(st.buf, st.base_index, env)};")
        for e, n in zip(st.base_index, st.buf.shape):
            if ir.index_values(e):
                guard = f"{guard} && (unsigned long long)({cexpr.index(e, env)}) < {n}ULL"
    body = " ".join(
        f"{fn}({dst} + {off}, {ptr}{'' if off == 0 else f' + {off * 4 // st.itemsize}'}{pol});"
        for fn, off in calls)
    zero = " ".join(f"{dst}[{i}] = 0u;" for i in range(w))
    if st.clamp is not None:
        _emit_clamped_chunk_load(ctx, em, st, dst, guard, body, zero)
    elif guard:
        em(f"if ({guard}) {{ {body} }} else {{ {zero} }}")
    else:
        em(body)


_BITS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}


def _emit_clamped_chunk_load(ctx: _Ctx, em: _Emitter, st: _Stream, dst: str, guard: str, body: str, zero: str):
    """A pad's chunk (_clamped_column): one vector load where columns c0 + k .. c0 + k + V - 1 all
    lie inside [lo, hi]; else (a chunk at the pad's edge, or outside) each element loaded at its
    own clamped column, its bits packed into the chunk's words as the vector load packs them."""
    k, lo, hi = st.clamp
    size, V = st.itemsize, ctx.V
    em.open("")
    plus = f" + {k}" if k > 0 else f" - {-k}" if k else ""
    em(f"const long long q = (long long)c0{plus};  // the chunk's first column in {st.buf.name}'s row")
    em(f"if ({guard or 'true'} && q >= {lo} && q <= {hi - V + 1}) {{ {body} }}")
    em.open(f"else if ({guard or 'true'})")
    minus = f" - {k}" if k > 0 else f" + {-k}" if k else ""
    row = f"reinterpret_cast<const {_BITS[size]}*>({_param(st.buf.name)} + b_{st.name}{minus})"
    em(f"const {_BITS[size]}* src = {row};  // column 0 of this row")
    em(zero)
    for i in range(V):
        at = f"src[tf_min(tf_max(q + {i}, {lo}LL), {hi}LL)]"
        if size == 8:
            em(f"{{ const unsigned long long e = {at}; {dst}[{2 * i}] = (unsigned)e; "
               f"{dst}[{2 * i + 1}] = (unsigned)(e >> 32); }}")
        else:
            per = 4 // size
            shift = 8 * size * (i % per)
            em(f"{dst}[{i // per}] |= (unsigned){at}{f' << {shift}' if shift else ''};")
    em.close()
    em(f"else {{ {zero} }}")
    em.close()


def _smem_chunk(ctx: _Ctx, st: _Stream, i: int) -> str:
    """Shared-memory address of 16-byte piece i of this thread's chunk j of stream st
    (the staging layout of rowlayout: pieces [j][i][thread], a warp's accesses contiguous)."""
    return f"smem0 + {ctx.smem_offset[st.key]}u + (unsigned)({ctx.lay.c_smem(i)})"


def _chunk_header(ctx: _Ctx, em: _Emitter, regs: bool):
    """Opens the loop over this thread's chunks and the column c0 of the current one.

    The first pass after a pipelined copy waits, per chunk, until that chunk's copies landed
    (at most nchunk-1-j groups still in flight: a constant once the loop is unrolled)."""
    if regs:
        em("#pragma unroll")
    elif ctx.sched.unroll > 1:
        em(f"#pragma unroll {ctx.sched.unroll}")
    em.open(f"for (int j = 0; j < {ctx.nchunk}; ++j)")
    if ctx.pending_wait:
        em(f"tf_cp_async_wait_pending({ctx.nchunk - 1} - j);  // chunk j's copies have landed")
    em(f"const int c0 = {ctx.lay.c_column(0)};  // first column of chunk j")
    if not ctx.full:
        em.open(f"if (c0 < {ctx.C})")


def _chunk_footer(ctx: _Ctx, em: _Emitter):
    if not ctx.full:
        em.close()
    em.close()


def _streams_used(body, table: dict, key_map: dict):
    keys = []
    for s in body:
        k = key_map.get(id(s))
        if k is not None and k not in keys:
            keys.append(k)
    return [table[k] for k in keys]


def _block_body(blk) -> tuple:
    return blk.y_body if isinstance(blk, (OnlineLse, CentredSquares)) else blk.body


def _block_var(blk) -> str:
    return blk.sm.var if isinstance(blk, (OnlineLse, CentredSquares)) else blk.var


def _kept_as(ctx: _Ctx, k: keep.Kept) -> str:
    """The dtype a kept value is held in: a 16-bit one two to a register where the row is staged
    in shared memory (registers are few there), else as computed (f32): where the row is in
    registers nvcc already reuses a value computed twice from them, and the packing only cost
    instructions (GELU then LayerNorm, 1024 columns, H100: 0.94x of recomputing, packed)."""
    return k.dtype if ctx.sched.stage != "regs" else "f32"  # keep.KEPT_DTYPES all compute in f32


def _live_body(blk, writes: dict, reads: dict, moved: set = frozenset()) -> tuple:
    """A block's statements less the stores an earlier pass makes (`moved`) and those only a
    value read back from an earlier pass, or only a moved store, needed (its loads of shared
    memory are volatile: nvcc would keep them)."""
    body = _block_body(blk)
    if not reads and not moved:
        return body
    need = set(_block_reads(blk)) | set(writes)
    live = []
    for s in reversed(body):
        if isinstance(s, ir.Store) and s in moved:
            continue
        if isinstance(s, ir.Store) or s.dst in need:
            live.append(s)
            if getattr(s, "dst", None) not in reads:
                need |= _reads(s)
    return tuple(reversed(live))


def _block_reads(blk) -> tuple:
    """What a block reads after its statements: a reduction's operand."""
    if isinstance(blk, (OnlineLse, CentredSquares)):
        return (blk.y,)
    return (blk.value,) if isinstance(blk, ir.Reduce) else ()


def _block_header(blk) -> str:
    if isinstance(blk, CentredSquares):
        return f"{blk.sm.header()} and {blk.sq.header()}"
    return blk.sm.header() if isinstance(blk, OnlineLse) else blk.header()


def _emit_pass(ctx: _Ctx, em: _Emitter, blocks: list, accs: list):
    """One pass over this thread's chunks, running the bodies of `blocks` per element.

    `accs[i]` is the accumulator of blocks[i] when it is a Reduce, the pair (max, sum) of
    an OnlineLse, the (count, base, mean - base, M2) state of a CentredSquares, None for a Loop.
    """
    regs = ctx.sched.stage == "regs"
    p = ctx.pass_no
    ctx.pass_no += 1
    if ctx.passes is not None and len(ctx.passes) == p:
        ctx.passes.append([keep.Block(_block_var(b), tuple(_block_body(b)), _block_reads(b)) for b in blocks])
    writes, reads = ctx.kept.writes(p), ctx.kept.reads(p)
    moved_out = ctx.kept.moved_out(p)
    bodies = [_live_body(b, writes, reads, moved_out) for b in blocks]
    # stores a later pass would make, made here as soon as their value is (codegen/keep.py Moved)
    early = {n: [ctx.stores[st] for st in sts] for n, sts in ctx.kept.stores_at(p).items()}
    for k in ctx.kept.declared(p):
        w = _words(_kept_as(ctx, k), ctx.V)
        em(f"unsigned k{k.slot}[{ctx.nchunk}][{w}] = {{}};  // %{k.producer[1]} per element, kept for "
           f"pass{'es' if len(k.readers) > 1 else ''} {', '.join(str(q) for q, _ in k.readers)} (codegen/keep.py)")
    _chunk_header(ctx, em, ctx.sched.stage != "stream")
    ctx.pending_wait = False
    all_body = [s for body in bodies for s in body]
    staged = {k for k, st in ctx.ana.in_streams.items() if regs and st.per_row}
    for st in _streams_used(all_body, ctx.ana.in_streams, ctx.ana.load_stream):
        if st.key in ctx.smem_offset:  # staged in shared memory: this thread's own chunk
            w = _words(st.buf.dtype, ctx.V)
            em(f"unsigned {st.name}_c[{w}];")
            em(" ".join(f"tf_lds16({st.name}_c + {4 * i}, {_smem_chunk(ctx, st, i)});" for i in range(w // 4)))
        elif st.key in ctx.hoisted:  # loaded before the reductions (_hoisted_vectors)
            em(f"const unsigned* {st.name}_c = {st.name}_h[j];")
        elif st.key not in staged:  # not held in registers: this pass loads the chunk it reads
            em(f"unsigned {st.name}_c[{_words(st.buf.dtype, ctx.V)}];")
            _emit_chunk_load(ctx, em, st, f"{st.name}_c", "row_ok", ctx.hint(st.key))

    def src_chunk(key):
        st = ctx.ana.in_streams[key]
        return f"{st.name}_s[j]" if key in staged else f"{st.name}_c"

    outs = _streams_used(all_body + [st for sts in early.values() for st in sts], ctx.ana.out_streams,
                         ctx.ana.store_stream)
    for st in outs:
        w = _words(st.buf.dtype, ctx.V)
        em(f"unsigned {st.name}_o[{w}] = {{{', '.join(['0u'] * w)}}};")
    out_chunk = lambda key: f"{ctx.ana.out_streams[key].name}_o"  # noqa: E731
    for blk, acc in zip(blocks, accs):
        if isinstance(blk, (OnlineLse, CentredSquares)):
            em(f"{cexpr.ctype(blk.dtype)} {acc[0]}_y[{ctx.V}];  // this chunk's values of the row")
    em("#pragma unroll")
    em.open(f"for (int v = 0; v < {ctx.V}; ++v)")
    em(f"const int c = c0 + {ctx.lay.c_column('v', 0, 0)}; (void)c;  // a layout is affine: L(v,q) = L(0,q) + L(v,0)")
    saved = dict(ctx.names), dict(ctx.dtype_of)
    for blk, acc, body in zip(blocks, accs, bodies):
        env = _env(ctx, None)
        env[_block_var(blk)] = "c"
        if len(blocks) > 1:
            em(f"// {_block_header(blk)}")
            em.open("")
        for s in body:
            k = reads.get(getattr(s, "dst", None))
            if k is not None:  # an earlier pass computed it: read it back (what computed it here is dead)
                name = ctx.define(s.dst, s.dtype)
                em(f"const {cexpr.ctype(s.dtype)} {name} = tf_get_{_kept_as(ctx, k)}(k{k.slot}[j], v);  // kept")
                env[s.dst] = name
                continue
            _emit_stmt(ctx, em, s, env, inner=True, src_chunk=src_chunk, out_chunk=out_chunk)
            k = writes.get(getattr(s, "dst", None))
            if k is not None:
                em(f"tf_put_{_kept_as(ctx, k)}(k{k.slot}[j], v, {ctx.c(s.dst)});  // kept for a later pass")
            for st in early.get(getattr(s, "dst", None), ()):  # the later pass's store, of this value
                ctx.names[st.value], ctx.dtype_of[st.value] = ctx.c(s.dst), ctx.dtype_of[s.dst]
                em(f"// {st}: stored here, where its value is made (codegen/keep.py)")
                _emit_stmt(ctx, em, st, env, inner=True, src_chunk=src_chunk, out_chunk=out_chunk)
        if isinstance(blk, (OnlineLse, CentredSquares)):
            em(f"{acc[0]}_y[v] = {ctx.c(blk.y)};")
        elif isinstance(blk, ir.Reduce):
            val = ctx.c(blk.value)
            vdt = ctx.dtype_of[blk.value]
            acc_t = dtypes.compute_type(blk.dtype)
            if dtypes.compute_type(vdt) != acc_t:
                val = f"({cexpr.ctype(acc_t)})({val})"
            em(f"{acc} = {cexpr.combine(blk.op, acc, val)};")
        if len(blocks) > 1:
            em.close()
        ctx.names, ctx.dtype_of = dict(saved[0]), dict(saved[1])  # body values die here
    em.close()
    for blk, acc in zip(blocks, accs):
        if isinstance(blk, OnlineLse):
            _emit_online_chunk(ctx, em, blk, acc)
        elif isinstance(blk, CentredSquares):
            if id(blk) in ctx.var_phase:
                _emit_two_pass_chunk(ctx, em, blk, acc)
            else:
                _emit_var_chunk(ctx, em, blk, acc)
    _emit_out_chunks(ctx, em, outs)
    _chunk_footer(ctx, em)


def _emit_out_chunks(ctx: _Ctx, em: _Emitter, outs: list):
    """Stores this thread's packed chunk at c0 of each output stream in `outs`."""
    for st in outs:
        nbytes = ctx.V * st.itemsize
        ptr = f"{_param(st.buf.name)} + b_{st.name} + c0"
        calls = " ".join(
            f"{fn}({ptr}{'' if off == 0 else f' + {off * 4 // st.itemsize}'}, {st.name}_o + {off});"
            for fn, off in _st_fn(nbytes))
        em(f"if (row_ok) {{ {calls} }}")


LOG2E_F32 = "1.44269504f"


def _emit_online_chunk(ctx: _Ctx, em: _Emitter, blk: OnlineLse, acc):
    """Fold this chunk's values into the running (max, sum of exp(y - max)): the sum is
    rescaled once per chunk when the max grows, then gets exp(y - max) of each value.

    In f32, exp(d) is ex2.approx.ftz(d * log2 e), d = y - max as the two-pass form computes
    it (ex2.approx, like expf, is within 2 ulp). Every d here is <= 0, so the rounding of
    d * log2 e adds at most |d| 2^-24 relative to a term of size e^d: under 2^-24/e of the
    sum; a term flushed to 0 (d < -87.3) is under 2^-126 of the max's own term, 1. That is
    3 instructions per element where exp2f's subnormal handling takes 6 and expf about 10
    (at 4096 columns the softmax kernel was issue-bound, H100). (Fusing the scale into one FMA
    with a pre-scaled max would shift every exponent by the rounding of max * log2 e:
    2e-5 relative for logits near 600, measured in the CPU mirror of this algorithm.)"""
    m, s = acc
    ct, dt = cexpr.ctype(blk.dtype), blk.dtype
    y = f"{m}_y"
    ninf = cexpr.const(float("-inf"), dt)
    em(f"// {blk.mx.header()} and {blk.sm.header()}, online")
    em(f"{ct} {m}_c = {y}[0];")
    if ctx.V > 1:
        em("#pragma unroll")
        em(f"for (int v = 1; v < {ctx.V}; ++v) {m}_c = tf_max({m}_c, {y}[v]);")
    em(f"const {ct} {m}_n = tf_max({m}, {m}_c);")
    if dt == "f32":
        grow = f"tf_ex2_ftz(({m} - {m}_n) * {LOG2E_F32})"
    else:
        grow = cexpr.op("exp", [cexpr.op("sub", [m, f"{m}_n"], [dt, dt], dt)], [dt], dt)
    em(f"{s} = ({m} == {m}_n) ? {s} : {s} * {grow};")
    em(f"{m} = {m}_n;")
    em(f"const {ct} {m}_z = ({m}_n == {ninf}) ? {cexpr.const(0, dt)} : {m}_n;  // a chunk of -inf adds 0, not NaN")
    if dt == "f32":
        term = f"tf_ex2_ftz(({y}[v] - {m}_z) * {LOG2E_F32})"
    else:
        term = cexpr.op("exp", [cexpr.op("sub", [f"{y}[v]", f"{m}_z"], [dt, dt], dt)], [dt], dt)
    em("#pragma unroll")
    em(f"for (int v = 0; v < {ctx.V}; ++v) {s} = {s} + {term};")


# The (count, mean, M2) merge of a CentredSquares pair (patterns.py), printed once per kernel
# that has one. A partial is (n, k, u, m2): n values with mean k + u and squared deviations
# from that mean summing to m2. k is a base (the first chunk's mean, rounded), u the small
# rest: merging takes d = mean_b - mean_a as (k_b - k_a) + (u_b - u_a) (bases nearly equal
# subtract exactly) and keeps a's base, so the mean comes out of a long chain of merges with
# about one rounding of k + u, not one per merge (a plain running mean drifts by half an ulp
# of the mean per merge: ~2 ulps for a 65536-column row, more than the 2x rule allows
# against PyTorch's own f32 result when the row sits far from 0).
VAR_PRELUDE = r"""// ---- (count, mean, M2) partials of a row, merged with Chan et al.'s formula
// A quotient that only weighs a correction (a weight, the small u): 2 ulps do in f32 (no
// IEEE slow path, whose call costs registers), IEEE in f64.
__device__ __forceinline__ float tf_var_quot(float a, float b) { return __fdividef(a, b); }
__device__ __forceinline__ double tf_var_quot(double a, double b) { return a / b; }
// (n, k, u, m2) <- itself merged with (nb, kb, ub, m2b): mean k + u, a's base k kept. An empty
// side (n = 0) contributes nothing.
template <class F>
__device__ __forceinline__ void tf_var_merge(F& n, F& k, F& u, F& m2, F nb, F kb, F ub, F m2b) {
  const F nn = n + nb;
  const F f = tf_var_quot(nb, nn);  // b's weight in the merged mean
  const F d = (kb - k) + (ub - u);  // mean_b - mean_a
  const F u2 = u + d * f;
  const F m22 = (m2 + m2b) + d * d * (n * f);  // + d^2 n_a n_b / n
  const bool a_empty = n == F(0), b_empty = nb == F(0);
  n = b_empty ? n : nn;
  k = a_empty ? kb : k;
  u = b_empty ? u : (a_empty ? ub : u2);
  m2 = b_empty ? m2 : (a_empty ? m2b : m22);
}
// A group's sums about its base gk (count gn, sum of y - gk, sum of (y - gk)^2) as a
// (count, base, mean - base, M2) partial merged into (n, k, u, m2); the group restarts.
template <class F>
__device__ __forceinline__ void tf_var_flush(F& n, F& k, F& u, F& m2, F& gn, F& gk, F& gt, F& gq) {
  const F gu = gn > F(0) ? tf_var_quot(gt, gn) : F(0);
  tf_var_merge(n, k, u, m2, gn, gk, gu, tf_max(F(0), gq - gt * gu));
  gn = F(0); gt = F(0); gq = F(0);
}
// The same merge where both counts are known when the kernel is printed (every thread of
// the row holds as many values): f = n_b / (n_a + n_b), w = n_a n_b / (n_a + n_b) are
// constants, and no count is exchanged.
template <class F>
__device__ __forceinline__ void tf_var_merge_w(F& k, F& u, F& m2, F kb, F ub, F m2b, F f, F w) {
  const F d = (kb - k) + (ub - u);
  u = u + d * f;
  m2 = (m2 + m2b) + d * d * w;
}
"""


VAR_GROUP = 8  # chunks summed about one base before they are merged into the thread's state


def _var_group(acc) -> tuple:
    """The names of the running group's (count, base, sum of y - base, sum of (y - base)^2)."""
    p = acc[0][:-2]  # acc_<sum>_n -> acc_<sum>
    return f"{p}_gn", f"{p}_gk", f"{p}_gt", f"{p}_gq"


def _emit_var_chunk(ctx: _Ctx, em: _Emitter, blk: CentredSquares, acc):
    """Fold this chunk's V values into the thread's running group: every value adds y - gk
    to gt and (y - gk)^2 to gq, gk being the group's base: a subtraction, an add and an FMA
    per element, the two-pass form's count. The groups are 1, 1, 2, 4, then 8 (VAR_GROUP)
    chunks; each (and the last, at the end of the pass, _emit_var_thread) becomes a (count,
    mean, M2) partial merged into the thread's state (tf_var_flush). A thread of 1 or 2
    chunks sums them as one group about its first chunk's mean, the loss bound being the
    same (log2(3) bits) and a merge fewer (1.2% of a 32768x256 bf16 LayerNorm on an H100).

    The base: for the thread's first group (one chunk) that chunk's mean (V a power of two:
    the scaling is exact); for every later group the thread's running mean k + u. A later
    group never holds more values than the state it merges into, so with d its mean's distance
    from the base, the state's M2 after the merge is at least d^2 n_g / 2, and the group's
    squares about the base, M2_g + n_g d^2, are at most M2_g + 2 M2 of the merged state:
    taking the shift's share back out loses at most log2(3) bits of what the row's M2 is
    made of, whatever the values. A base from each group's own first chunk (the previous
    form) lost up to log2(9) bits of the group's, a thread's first value being an outlier
    ((6, 300001) f32 rows of 1e4 + N(0, 1) with one -3e4: 10-40 ulps of y at the outlier,
    against PyTorch's 1-4); E[y^2] - E[y]^2 (base 0) loses every digit of a row 1e4 + N(0, 1)."""
    gn, gk, gt, gq = _var_group(acc)
    n, k, u = acc[0], acc[1], acc[2]
    ct, V, dt = cexpr.ctype(blk.dtype), ctx.V, blk.dtype
    y = f"{acc[0]}_y"
    fma = "fmaf" if ct == "float" else "fma"
    running = ctx.nchunk > 2  # one group of 1 or 2 chunks about the first one's mean: at most log2(3) bits too
    base = "the running mean" if running else "its first chunk's mean"
    em(f"// {blk.sm.header()} and {blk.sq.header()}: sums about the group's base ({base})")
    em.open(f"if ({gn} == {cexpr.const(0, dt)})")
    if running:
        em.open(f"if ({n} > {cexpr.const(0, dt)})")
        em(f"{gk} = {k} + {u};")
        em.close()
        em.open("else")
    em(f"{ct} s = {y}[0];" + ("  // the thread's first chunk: its own mean" if running else ""))
    if V > 1:
        em("#pragma unroll")
        em(f"for (int v = 1; v < {V}; ++v) s += {y}[v];")
    em(f"{gk} = s * {cexpr.const(1.0 / V, dt)};")
    if running:
        em.close()
    em.close()
    em("#pragma unroll")
    em(f"for (int v = 0; v < {V}; ++v) {{ const {ct} e = {y}[v] - {gk}; {gt} += e; {gq} = {fma}(e, e, {gq}); }}")
    em(f"{gn} += {cexpr.const(float(V), dt)};")
    if running:
        em(f"if (((j + 1) & j) == 0 || (j + 1) % {VAR_GROUP} == 0) "
           f"tf_var_flush({', '.join(acc)}, {gn}, {gk}, {gt}, {gq});  // groups of 1, 1, 2, 4, {VAR_GROUP}... chunks")


def _emit_var_thread(ctx: _Ctx, em: _Emitter, r: CentredSquares, acc):
    """The thread's last group merged in: its state is (n, k, mean - k, M2) of its values; a
    thread with no value of the row keeps (0, 0, 0, 0)."""
    em("// the last group into this thread's (count, base, mean - base, M2)")
    em(f"tf_var_flush({', '.join(acc)}, {', '.join(_var_group(acc))});")


def _emit_var_tree(em: _Emitter, r: CentredSquares, vals, lanes: int, per: int | None):
    """(n, k, u, m2) of `lanes` consecutive lanes (a power of two, at most 32) merged down a
    shuffle tree into the first: lane i takes lane i + o's partial, its own first (so the
    order is fixed: lower lanes first). Where each lane starts with `per` values, the
    weights are constants and n is not exchanged (at each step both sides hold as many)."""
    n, k, u, m2 = vals
    dt = r.dtype
    width = "" if lanes == 32 else f", {lanes}"

    def down(a, o):
        return f"__shfl_down_sync(0xffffffffu, {a}, {o}{width})"

    o = lanes // 2
    while o:
        if per:
            side = per * lanes // (2 * o)  # values on each side of this merge
            em(f"tf_var_merge_w({k}, {u}, {m2}, {down(k, o)}, {down(u, o)}, {down(m2, o)}, "
               f"{cexpr.const(0.5, dt)}, {cexpr.const(side / 2, dt)});")
        else:
            em(f"tf_var_merge({n}, {k}, {u}, {m2}, {down(n, o)}, {down(k, o)}, {down(u, o)}, {down(m2, o)});")
        o //= 2


def _emit_var_warp(ctx: _Ctx, em: _Emitter, r: CentredSquares, acc, per_thread: int | None):
    """(n, k, u, m2) across the group's lanes (at most a warp): a tree to the group's first
    lane, then, for a group of at most 32 threads, its result to every lane of the group."""
    gw = min(ctx.sched.group, 32)
    em(f"// (count, mean, M2) across the {gw} threads of the {'warp' if gw == 32 else 'row group'}: "
       f"a tree to its first lane (lower lane first)")
    _emit_var_tree(em, r, acc, gw, per_thread)
    if ctx.sched.group <= 32:
        width = "" if gw == 32 else f", {gw}"
        em("// the first lane's result to every lane of the group")
        for a in (acc[1:] if per_thread else acc):
            em(f"{a} = __shfl_sync(0xffffffffu, {a}, 0{width});")


def _emit_var_warps(em: _Emitter, r: CentredSquares, acc, gi: int, wpr: int, per: int | None):
    """The CTA's (n, k, u, m2) in thread 0, from the warps' partials in shared memory: lane
    i of the first warp reads warp i's, a tree merges them in warp order (a power of two of
    them; every thread merging all of them in turn took more registers than a 64-register
    cap leaves beside a row held in registers, and a chain of dependent merges)."""
    ps = _parts(r, acc, per)
    ct = cexpr.ctype(r.dtype)
    em("// the CTA's (count, mean, M2) in thread 0: lane i of warp 0 reads warp i's, a tree merges them in order")
    em.open("if (lane < 32)")  # one row per CTA: lane is threadIdx.x
    loc = {a: f"t_{a}" for a in acc}
    for a, _, nm in ps:
        em(f"{ct} {loc[a]} = red{gi}_{nm}[0][lane & {wpr - 1}];")
    _emit_var_tree(em, r, tuple(loc[a] for a in acc), wpr, per)
    em(" ".join(f"{a} = {loc[a]};" for a, _, _ in ps))
    em.close()


def _emit_var_cluster(ctx: _Ctx, em: _Emitter, r: CentredSquares, acc, gi: int, per: int | None):
    """(n, k, u, m2) across the cluster's CTAs, once the CTAs' partials are in their shared
    memory: lane i of the first warp reads rank i's partial (all ranks' reads in flight at
    once, not one dependent remote load after another), a shuffle tree merges them in rank
    order, and the result goes to every thread through shared memory. Every CTA computes the
    same merge of the same partials, so all CTAs of the row agree to the bit."""
    cl = ctx.sched.cluster
    ps = _parts(r, acc, per)
    ct = cexpr.ctype(r.dtype)
    em(f"// the {cl} CTAs' (count, mean, M2): lane i of warp 0 reads rank i's, a tree merges them in rank order")
    for a, _, nm in ps:
        em(f"__shared__ {ct} clr{gi}_{nm};")
    em.open("if (lane < 32)")  # one row per CTA: lane is threadIdx.x
    loc = {a: f"t_{a}" for a in acc}
    for a, _, nm in ps:
        em(f"{ct} {loc[a]} = tf_remote_ld(&cl{gi}_{nm}, (unsigned)(lane & {cl - 1}));")
    _emit_var_tree(em, r, tuple(loc[a] for a in acc), cl, per)
    em.open("if (threadIdx.x == 0)")
    for a, _, nm in ps:
        em(f"clr{gi}_{nm} = {loc[a]};")
    em.close()
    em.close()


def _emit_var_mean(ctx: _Ctx, em: _Emitter, s) -> bool:
    """A row statement sum / C (or sum * (1/C)) of a CentredSquares' sum, C its extent, as
    k + u rounded once: the mean to half an ulp, where the sum's own rounding and the
    division's would take up to one and a half (on a row far from 0 and narrow, what the
    output's error is made of, and more than 2x PyTorch's own in f32). Returns whether it
    was that statement (and emitted it)."""
    if not (isinstance(s, ir.Op) and s.op in ("div", "mul") and len(s.args) == 2 and s.args[0] in ctx.var_sums):
        return False
    r, acc = ctx.var_sums[s.args[0]]
    c = next((x for x in ctx.parts.body if isinstance(x, ir.Const) and x.dst == s.args[1]), None)
    if c is None or s.dtype != r.dtype or c.dtype != r.dtype:
        return False
    C = r.sm.extent
    want = float(C) if s.op == "div" else float(dtypes.to_numpy(r.dtype).type(1.0 / C))
    if float(dtypes.to_numpy(r.dtype).type(c.value)) != want:
        return False
    name = ctx.define(s.dst, s.dtype)
    ct = cexpr.ctype(s.dtype)
    em(f"const {ct} {name} = {acc[1]} + {acc[2]};  // %{s.args[0]} / {C}: the mean, rounded once")
    em(f"const {ct} {name}_err = ({acc[1]} - {name}) + {acc[2]};  // what that rounding took off (exact where |u| <= |k|; else within an ulp of it)")
    ctx.mean_err[s.dst] = f"{name}_err"
    return True


def _emit_var_finish(ctx: _Ctx, em: _Emitter, cs: CentredSquares):
    """%sq = sum (y - m)^2 = M2 + C (mean - m)^2, m being the row value the Loop IR subtracts
    (its mean, from the sum the exchange gave): two non-negative terms, the second ~0."""
    n, k, u, m2 = ctx.var_state[id(cs)]
    ct, dt = cexpr.ctype(cs.dtype), cs.dtype
    em(f"// {cs.sq.header()}: the squares about the row's mean, then the shift to %{cs.m}")
    em(f"const {ct} {n}_dm = ({k} - {ctx.c(cs.m)}) + {u};")
    name = ctx.define(cs.sq.dst, dt)
    em(f"const {ct} {name} = {m2} + {cexpr.const(float(cs.sq.extent), dt)} * {n}_dm * {n}_dm;")


def _two_pass_applies(ctx: _Ctx, r: CentredSquares) -> bool:
    """Whether `r` takes the two-pass form: the schedule asks for it, a warp or less holds
    the row (two butterflies, no shared memory), and every value its y reads is held
    (registers or shared memory), so the second pass reads nothing from global memory."""
    sch = ctx.sched
    if not (sch.two_pass and sch.group <= 32 and sch.cluster == 1 and sch.stage in ("regs", "smem")):
        return False
    per_row = {k for k, st in ctx.ana.in_streams.items() if st.per_row or k in ctx.smem_offset}
    used = {ctx.ana.load_stream[id(x)] for x in r.y_body if id(x) in ctx.ana.load_stream}
    return used <= per_row


def _two_pass_names(acc) -> tuple:
    """The row's plain sum (pass 1), and the sums of y - base and (y - base)^2 (pass 2)."""
    p = acc[0][:-2]  # acc_<sum>_n -> acc_<sum>
    return f"{p}_s", f"{p}_t", f"{p}_q"


def _emit_two_pass_chunk(ctx: _Ctx, em: _Emitter, blk: CentredSquares, acc):
    """Pass 1 adds this chunk's values to the plain sum; pass 2 adds y - k and (y - k)^2,
    k being that sum / C (the base; any value near the mean does, see _emit_two_pass)."""
    ssum, t, q = _two_pass_names(acc)
    ct, V, y = cexpr.ctype(blk.dtype), ctx.V, f"{acc[0]}_y"
    em("#pragma unroll")
    if ctx.var_phase[id(blk)] == 1:
        em(f"for (int v = 0; v < {V}; ++v) {ssum} += {y}[v];  // {blk.sm.header()}: pass 1, the plain sum")
        return
    fma = "fmaf" if ct == "float" else "fma"
    em(f"for (int v = 0; v < {V}; ++v) {{ const {ct} e = {y}[v] - {acc[1]}; {t} += e; {q} = {fma}(e, e, {q}); }}"
       f"  // pass 2: about the base")


def _emit_two_pass(ctx: _Ctx, em: _Emitter, twos: list):
    """The corrected two-pass form (Chan, Golub and LeVeque) of each CentredSquares in
    `twos`, once pass 1's sums crossed the group: base k = sum / C; a second pass over the
    held values sums e = y - k and e^2; a butterfly; then mean - k = T / C and M2 = Q -
    T^2 / C, the state (C, k, u, M2) the merge would have made. The sum's rounding moves k
    off the mean by some d; T / C takes d back out of the mean (k + u, rounded once), and
    T^2 / C its C d^2 out of Q: on 16-bit rows C d^2 is a vanishing share of M2, and on the
    adversarial f32 rows (-7777.7 + 0.01 N(0, 1)) at most ~2% of it, taken back out to
    5e-8 (tests/cpu/test_mapreduce_welford.py mirrors it). Two butterflies of one and two
    values replace a shuffle tree of three with a merge per level and a broadcast, and take
    fewer registers; on an H100 that ran from 2% faster to 1.3% slower by layout
    (bench/LOG.md, session 16)."""
    g = ctx.sched.group
    for r, acc in twos:
        ct, dt = cexpr.ctype(r.dtype), r.dtype
        ssum, t, q = _two_pass_names(acc)
        C = r.sm.extent
        em(f"{acc[1]} = {ssum} * {cexpr.const(1.0 / C, dt)};  // the base: the plain mean")
        em(f"{ct} {t} = {cexpr.const(0, dt)}, {q} = {cexpr.const(0, dt)};")
        ctx.var_phase[id(r)] = 2
    _emit_pass(ctx, em, [r for r, _ in twos], [acc for _, acc in twos])
    if g > 1:
        em(f"// the sums about the base across the {g} threads of the {'warp' if g == 32 else 'row group'}")
        em("#pragma unroll")
        em.open(f"for (int o = {g // 2}; o > 0; o >>= 1)")
        for r, acc in twos:
            _, t, q = _two_pass_names(acc)
            ct = cexpr.ctype(r.dtype)
            em(f"{t} += {_shfl(t, ct, 'o')}; {q} += {_shfl(q, ct, 'o')};")
        em.close()
    for r, acc in twos:
        _, t, q = _two_pass_names(acc)
        C, dt = r.sm.extent, r.dtype
        quot = f"{t} * {cexpr.const(1.0 / C, dt)}" if C & (C - 1) == 0 else f"{t} / {cexpr.const(float(C), dt)}"
        em(f"{acc[2]} = {quot};  // mean - base")
        em(f"{acc[3]} = tf_max({cexpr.const(0, dt)}, {q} - {t} * {acc[2]});  // M2 = Q - T^2 / C")


def _shfl(acc: str, ctype: str, off: int) -> str:
    if ctype in ("float", "double", "int", "long long", "unsigned", "unsigned long long"):
        return f"__shfl_xor_sync(0xffffffffu, {acc}, {off})"
    return f"({ctype})__shfl_xor_sync(0xffffffffu, (int){acc}, {off})"


def _group_items(group: list):
    """(Reduce, OnlineLse or CentredSquares; its accumulator, (max, sum) accumulators or
    (n, k, u, m2) state) of each member."""
    out = []
    for r in group:
        if isinstance(r, OnlineLse):
            out.append((r, (f"acc_{_ident(r.mx.dst)}", f"acc_{_ident(r.sm.dst)}")))
        elif isinstance(r, CentredSquares):
            b = f"acc_{_ident(r.sm.dst)}"
            out.append((r, (f"{b}_n", f"{b}_k", f"{b}_u", f"{b}_m2")))
        else:
            out.append((r, f"acc_{_ident(r.dst)}"))
    return out


def _parts(r, acc, per=None):
    """[(accumulator, its C type, name suffix)] of a member: one value, the (max, sum) pair,
    or a (count, mean, M2) state (without its count where every partial's is known: `per`)."""
    if isinstance(r, OnlineLse):
        ct = cexpr.ctype(r.dtype)
        return [(acc[0], ct, _ident(r.mx.dst)), (acc[1], ct, _ident(r.sm.dst))]
    if isinstance(r, CentredSquares):
        ct = cexpr.ctype(r.dtype)
        named = [(a, ct, f"{_ident(r.sm.dst)}_{x}") for a, x in zip(acc, ("n", "k", "u", "m2"))]
        return named[1:] if per else named
    return [(acc, cexpr.ctype(r.dtype), _ident(r.dst))]


def _emit_gather_combine(em: _Emitter, items, n: int, load, head: str, per: int | None = None):
    """acc = the combination of n partial values, load(part, i) naming partial i of a part.

    A sum or max folds left to right. A (max, sum) pair takes the max of the maxima first,
    then adds each partial sum rescaled to it: n independent exps, not a chain of n merges.
    (count, mean, M2) partials merge left to right, with constant weights where each holds
    `per` values. Every thread reads the partials in the same order, so all agree."""
    for r, acc in items:
        ps = _parts(r, acc, per)
        if isinstance(r, CentredSquares):
            em(f"// the {n} partial (count, mean, M2){head}, merged in order")
            for a, _, nm in ps:
                em(f"{a} = {load(nm, 0)};")
            em("#pragma unroll")
            if per:  # partial i joins i partials of `per` values each
                ct = cexpr.ctype(r.dtype)
                em(f"for (int i = 1; i < {n}; ++i) tf_var_merge_w({', '.join(a for a, _, _ in ps)}, "
                   f"{', '.join(load(nm, 'i') for _, _, nm in ps)}, ({ct})1 / ({ct})(i + 1), "
                   f"({ct})i * ({ct}){per} / ({ct})(i + 1));")
            else:
                em(f"for (int i = 1; i < {n}; ++i) tf_var_merge({', '.join(a for a, _, _ in ps)}, "
                   f"{', '.join(load(nm, 'i') for _, _, nm in ps)});")
        elif isinstance(r, OnlineLse):
            (m, ct, nm), (s, _, ns) = ps
            em(f"// the {n} partial (max, sum) pairs{head}: the max of the maxima, then the rescaled sums")
            em(f"{m} = {load(nm, 0)};")
            em("#pragma unroll")
            em(f"for (int i = 1; i < {n}; ++i) {m} = tf_max({m}, {load(nm, 'i')});")
            em(f"{s} = tf_lse_scale({load(ns, 0)}, {load(nm, 0)}, {m});")
            em("#pragma unroll")
            em(f"for (int i = 1; i < {n}; ++i) {s} = {s} + tf_lse_scale({load(ns, 'i')}, {load(nm, 'i')}, {m});")
        else:
            a, ct, nm = ps[0]
            em(f"{a} = {load(nm, 0)};")
            em("#pragma unroll")
            em(f"for (int i = 1; i < {n}; ++i) {a} = {cexpr.combine(r.op, a, load(nm, 'i'))};")


def _emit_parts_to_shared(em: _Emitter, items, per, var: str, guard: str, dims: str = "", at: str = ""):
    """A shared variable `var<part>dims` for each part of each member's accumulator, and the
    parts written to them (at `at`) by the threads where `guard` holds."""
    for r, acc in items:
        for _, ct, nm in _parts(r, acc, per):
            em(f"__shared__ {ct} {var}{nm}{dims};")
    em.open(f"if ({guard})")
    for r, acc in items:
        for a, _, nm in _parts(r, acc, per):
            em(f"{var}{nm}{at} = {a};")
    em.close()


def _emit_reduce_group(ctx: _Ctx, em: _Emitter, group: list):
    """A run of mutually independent Reduces (an OnlineLse or a CentredSquares counts as
    one): one pass, one exchange.

    An OnlineLse's (max, sum) crosses each level max first: the warp's butterfly takes the
    max, each thread rescales its sum once, a second butterfly adds the sums; across warps
    and CTAs the partials are gathered, their max taken, and the sums rescaled to it.
    A CentredSquares' (n, k, u, m2) merges down a shuffle tree to the group's first lane
    (_emit_var_warp), then across warps (a tree in the first warp where the CTA is part of a
    cluster or holds one row in 16+ warps, else in order in every thread) and CTAs; where every thread
    holds as many values (no masked chunk) the weights are constants and no count is
    exchanged. A row a warp or less holds may take two passes instead (_emit_two_pass)."""
    sch = ctx.sched
    gi = ctx.rgroup
    ctx.rgroup += 1
    items = _group_items(group)
    online = [(r, acc) for r, acc in items if isinstance(r, OnlineLse)]
    twos = [(r, acc) for r, acc in items if isinstance(r, CentredSquares) and _two_pass_applies(ctx, r)]
    two_ids = {id(r) for r, _ in twos}
    for r, _ in twos:
        ctx.var_phase[id(r)] = 1
    dsts = [d for r in group for d in ((r.mx.dst, r.sm.dst) if isinstance(r, OnlineLse)
                                       else (r.sm.dst,) if isinstance(r, CentredSquares) else (r.dst,))]
    em(f"// ---- reduce {', '.join('%' + d for d in dsts)} over the row")
    for r, acc in items:
        if isinstance(r, OnlineLse):
            ct = cexpr.ctype(r.dtype)
            em(f"{ct} {acc[0]} = {cexpr.identity('max', r.dtype)};  // running max")
            em(f"{ct} {acc[1]} = {cexpr.identity('sum', r.dtype)};  // running sum of exp(y - max)")
        elif id(r) in two_ids:
            ct, z = cexpr.ctype(r.dtype), cexpr.const(0, r.dtype)
            em(f"{ct} {acc[0]} = {cexpr.const(float(r.sm.extent), r.dtype)}, {acc[1]} = {z}, {acc[2]} = {z}, "
               f"{acc[3]} = {z};  // count, base k, mean - k, M2 of the row (two passes)")
            em(f"{ct} {_two_pass_names(acc)[0]} = {z};  // the row's plain sum")
        elif isinstance(r, CentredSquares):
            ct, z = cexpr.ctype(r.dtype), cexpr.const(0, r.dtype)
            em(f"{ct} {acc[0]} = {z}, {acc[1]} = {z}, {acc[2]} = {z}, {acc[3]} = {z};  "
               f"// count, base k, mean - k, M2 of this thread's values")
            em(f"{ct} {', '.join(f'{g} = {z}' for g in _var_group(acc))};  "
               f"// the running group: count, base, sum of (y - base), sum of (y - base)^2")
        else:
            acc_t = dtypes.compute_type(r.dtype)
            em(f"{cexpr.ctype(acc_t)} {acc} = {cexpr.identity(r.op, acc_t)};")
    _emit_pass(ctx, em, group, [acc for _, acc in items])
    g = sch.group
    per_thread = ctx.nchunk * ctx.V if ctx.full else None  # values each thread of the row holds
    for r, acc in items:
        if isinstance(r, CentredSquares) and id(r) not in two_ids:
            _emit_var_thread(ctx, em, r, acc)
            if g > 1 and not sch.across:
                _emit_var_warp(ctx, em, r, acc, per_thread)
    if sch.across:
        em(f"// across the row's {g} threads, one a warp, through shared memory (in order: all agree)")
        _emit_parts_to_shared(em, items, per_thread, f"red{gi}_", "true", f"[{g}][{sch.slots}]",
                              "[lane][slot]")
        em("__syncthreads();")
        _emit_gather_combine(em, items, g, lambda nm, i: f"red{gi}_{nm}[{i}][slot]", " of the row's threads",
                             per_thread)
    elif g > 1 and any(not isinstance(r, CentredSquares) or id(r) in two_ids for r, _ in items):
        em(f"// across the {min(g, 32)} threads of the {'warp' if g >= 32 else 'row group'} (butterfly: all lanes agree)")
        for r, acc in online:
            em(f"const {cexpr.ctype(r.dtype)} {acc[0]}_t = {acc[0]};  // this thread's max")
        em("#pragma unroll")
        em.open(f"for (int o = {min(g, 32) // 2}; o > 0; o >>= 1)")
        for r, acc in items:
            if isinstance(r, OnlineLse):
                ct = cexpr.ctype(r.dtype)
                em(f"{acc[0]} = tf_max({acc[0]}, {_shfl(acc[0], ct, 'o')});")
            elif id(r) in two_ids:
                ssum = _two_pass_names(acc)[0]
                em(f"{ssum} += {_shfl(ssum, cexpr.ctype(r.dtype), 'o')};")
            elif isinstance(r, CentredSquares):
                continue  # _emit_var_warp
            else:
                ct = cexpr.ctype(r.dtype if dtypes.compute_type(r.dtype) == r.dtype else "f32")
                em(f"{acc} = {cexpr.combine(r.op, acc, _shfl(acc, ct, 'o'))};")
        em.close()
        if online:
            for r, acc in online:
                em(f"{acc[1]} = tf_lse_scale({acc[1]}, {acc[0]}_t, {acc[0]});  // to the group's max")
            em("#pragma unroll")
            em.open(f"for (int o = {min(g, 32) // 2}; o > 0; o >>= 1)")
            for r, acc in online:
                em(f"{acc[1]} = {acc[1]} + {_shfl(acc[1], cexpr.ctype(r.dtype), 'o')};")
            em.close()
    if twos:
        _emit_two_pass(ctx, em, twos)
    if g > 32:
        wpr = g // 32
        em(f"// across the {wpr} warps of the row, through shared memory")
        per = per_thread and per_thread * 32
        _emit_parts_to_shared(em, items, per, f"red{gi}_", "(lane & 31) == 0", f"[{sch.slots}][{wpr}]",
                              f"[slot][{ctx.lay.c_warp('lane')}]")
        em("__syncthreads();")
        # the first warp merges the warps' (count, mean, M2) partials as a tree. In a cluster
        # the CTA's partial is needed in thread 0 only (it hands it to the other CTAs). In a
        # CTA of one row and 16+ warps, thread 0 hands it to every thread through shared
        # memory after a second barrier: every thread merging 16 partials in turn cost more
        # instructions than its 2 chunks of the row (H100, LayerNorm 16384 x 8192, 512
        # threads: 176.64 us against 177.57); with 8 warps the barrier costs more than the 7
        # merges (32768 x 4096, 256 threads staged: 185.01 against 176.58; bench/LOG.md)
        warp_tree = (sch.cluster > 1 or (sch.slots == 1 and wpr >= 16)) and wpr & (wpr - 1) == 0
        tree = [(r, acc) for r, acc in items if warp_tree and isinstance(r, CentredSquares)]
        seq = [(r, acc) for r, acc in items if (r, acc) not in tree]
        if seq:
            _emit_gather_combine(em, seq, wpr, lambda nm, i: f"red{gi}_{nm}[slot][{i}]", " of the warps", per)
        for r, acc in tree:
            _emit_var_warps(em, r, acc, gi, wpr, per)
        if tree and sch.cluster == 1:
            _emit_parts_to_shared(em, tree, per, f"vr{gi}_", "threadIdx.x == 0")
            em("__syncthreads();  // warp 0's merge of the warps' partials is written")
            for r, acc in tree:
                for a, _, nm in _parts(r, acc, per):
                    em(f"{a} = vr{gi}_{nm};")
    if sch.cluster > 1:
        em(f"// across the {sch.cluster} CTAs of the cluster, through distributed shared memory (rank order: all CTAs agree)")
        per = per_thread and per_thread * g
        _emit_parts_to_shared(em, items, per, f"cl{gi}_", "threadIdx.x == 0")
        em("tf_cluster_sync();  // every CTA's value is written")
        plain = [(r, acc) for r, acc in items if not isinstance(r, CentredSquares)]
        centred = [(r, acc) for r, acc in items if isinstance(r, CentredSquares)]
        if plain:
            _emit_gather_combine(em, plain, sch.cluster, lambda nm, i: f"tf_remote_ld(&cl{gi}_{nm}, {i})",
                                 " of the CTAs", per)
        for r, acc in centred:
            _emit_var_cluster(ctx, em, r, acc, gi, per)
        ctx.cluster_done = len(em.lines)
        if centred:
            em("__syncthreads();  // warp 0's merge of the CTAs' partials is written")
            for r, acc in centred:
                for a, _, nm in _parts(r, acc, per):
                    em(f"{a} = clr{gi}_{nm};")
    for r, acc in items:
        if isinstance(r, CentredSquares):
            ct, dt = cexpr.ctype(r.dtype), r.dtype
            s = ctx.define(r.sm.dst, dt)
            fma = "fmaf" if ct == "float" else "fma"
            n = acc[0] if per_thread is None else cexpr.const(float(r.sm.extent), dt)
            em(f"const {ct} {s} = {fma}({n}, {acc[1]}, {n} * {acc[2]});  // n (k + u), rounded once")
            ctx.var_state[id(r)] = acc
            ctx.var_sums[r.sm.dst] = (r, acc)
            continue
        if isinstance(r, OnlineLse):
            ct, dt = cexpr.ctype(r.dtype), r.dtype
            m = ctx.define(r.mx.dst, dt)
            em(f"const {ct} {m} = {acc[0]};")
            s = ctx.define(r.sm.dst, dt)
            nan, ninf = cexpr.const(float("nan"), dt), cexpr.const(float("-inf"), dt)
            em(f"const {ct} {s} = ({acc[0]} == {ninf}) ? {nan} : {acc[1]};  // exp(-inf - -inf) is NaN")
            continue
        name = ctx.define(r.dst, r.dtype)
        val = acc if dtypes.compute_type(r.dtype) == r.dtype else cexpr.round_to(r.dtype, acc)
        em(f"const {cexpr.ctype(r.dtype)} {name} = {val};")


def _emit_select(ctx: _Ctx, em: _Emitter, sel: TargetSelect):
    """sum over c of where(c == t, v(c), 0), as v at one column: t if 0 <= t < C, else a
    column (0) where the select's own compare is false, so the where gives its 0."""
    r = sel.red
    t = ctx.c(sel.target)
    cvar = f"sel_{_ident(r.dst)}"
    em(f"// {r.header()}: where(index == %{sel.target}, ...) is non-zero at one column only")
    em(f"const long long {cvar} = ({t} >= 0 && {t} < {r.extent}) ? (long long)({t}) : 0LL;")
    saved = dict(ctx.names), dict(ctx.dtype_of)
    env = _env(ctx, None)
    env[r.var] = cvar
    for s in r.body:
        _emit_stmt(ctx, em, s, env, inner=False)
    val = ctx.c(r.value)
    ctx.names, ctx.dtype_of = dict(saved[0]), dict(saved[1])
    name = ctx.define(r.dst, r.dtype)
    em(f"const {cexpr.ctype(r.dtype)} {name} = {cexpr.combine('sum', cexpr.identity('sum', r.dtype), val)};")


def _reads(s) -> set:
    """Values a statement (a whole Reduce or Loop included) reads from outside itself."""
    inner = set()
    reads = set()
    for x in ir.walk([s]):
        if isinstance(x, ir.Op):
            reads |= set(x.args)
        elif isinstance(x, (ir.Load, ir.Store)):
            for e in x.index:
                reads |= ir.index_values(e)
            if isinstance(x, ir.Store):
                reads.add(x.value)
        elif isinstance(x, ir.IndexValue):
            reads |= ir.index_values(x.expr)
        elif isinstance(x, (ir.Reduce, ir.Scan)):
            reads.add(x.value)
        if isinstance(x, (ir.Load, ir.Op, ir.IndexValue, ir.Const, ir.Scan)) and x is not s:
            inner.add(x.dst)
    return reads - inner


def _independent(dsts: set, r) -> bool:
    """r (a Reduce, an OnlineLse or a CentredSquares' pass) reads none of `dsts`."""
    stmts = [r.mx, r.sm] if isinstance(r, OnlineLse) else [r.sm] if isinstance(r, CentredSquares) else [r]
    return not any(_reads(s) & dsts for s in stmts)


def _dsts(r) -> set:
    """What a reduce step defines (a CentredSquares' sum of squares comes later, at its own step)."""
    if isinstance(r, OnlineLse):
        return {r.mx.dst, r.sm.dst}
    return {r.sm.dst} if isinstance(r, CentredSquares) else {r.dst}


def _centred_at(rest: list, i: int, selects: dict):
    """The CentredSquares of rest[i] and the next reduction, if the statements between them
    are neither loops nor reductions and the pair is that pattern."""
    j = i + 1
    while j < len(rest) and not isinstance(rest[j], (ir.Loop, ir.Reduce)):
        j += 1
    if j == len(rest) or not isinstance(rest[j], ir.Reduce) or id(rest[j]) in selects:
        return None
    return patterns.centred_squares(rest[i], rest[j], rest[i + 1:j])


def _row_plan(kernel: ir.Kernel, body: list):
    """(statements hoisted to the top of the row, the rest in order, target selects by id).

    A row statement that depends on no reduction (a row load, a constant, a target select)
    is emitted before the first pass over the row, so its memory latency overlaps the row's.
    Stores, loops and other reductions keep their place."""
    consts = {s.dst: s for s in body if isinstance(s, ir.Const)}
    dtype_of = {}
    for s in body:
        if isinstance(s, ir.Load):
            dtype_of[s.dst] = kernel.buffer(s.buf).dtype
        elif isinstance(s, (ir.Const, ir.Op, ir.IndexValue, ir.Reduce)):
            dtype_of[s.dst] = s.dtype
    selects = {}
    for s in body:
        sel = patterns.target_select(s, consts, dtype_of)
        if sel is not None:
            selects[id(s)] = sel
    late, early, rest = set(), [], []
    for s in body:
        movable = isinstance(s, (ir.Load, ir.Const, ir.Op, ir.IndexValue)) or id(s) in selects
        if movable and not (_reads(s) & late):
            early.append(s)
            continue
        rest.append(s)
        if isinstance(s, (ir.Load, ir.Const, ir.Op, ir.IndexValue, ir.Reduce)):
            late.add(s.dst)
    return early, rest, selects


def _pass_reads(ana: _Analysis, steps: list) -> dict:
    """Row stream key -> how many passes over the row read it (the stream stage's re-reads)."""
    reads: dict = {}
    for kind, x in steps:
        if kind in ("reduce", "loop"):
            body = [s for b in (x if kind == "reduce" else [x]) for s in _block_body(b)]
            for st in _streams_used(body, ana.in_streams, ana.load_stream):
                reads[st.key] = reads.get(st.key, 0) + 1
    return reads


def rereads_rows(kernel: ir.Kernel) -> bool:
    """Whether a pass over the row reads a row input that an earlier pass read (what the
    stream stage then finds in L2, and what `l2_hints` can keep there)."""
    gp = ir.grid_parts(kernel)
    kernel = gp.head if gp is not None else kernel
    parts = ir.row_kernel_parts(kernel)
    ana = _analyse(kernel, parts, 1)
    _, rest, selects = _row_plan(kernel, list(parts.body))
    reads = _pass_reads(ana, _row_steps(rest, selects))
    return any(n > 1 for key, n in reads.items() if ana.in_streams[key].per_row)


def _row_steps(rest: list, selects: dict, online: bool = True):
    """The row statements after the hoisted ones, as steps: ("select", TargetSelect),
    ("reduce", [Reduce, OnlineLse or CentredSquares, ...]: one pass and one exchange),
    ("squares", CentredSquares: its sum of squares, from the merged state), ("loop", Loop)
    or ("stmt", statement). Consecutive mutually independent reductions share a step; a max
    followed by a sum of exp(y - max) becomes one OnlineLse; a sum y, the statements making
    m from it, and a sum of (y - m)^2 become one CentredSquares (its pass and exchange at the
    sum's place, the statements in between as they were, the squares at their own place).
    online=False leaves a max and its sum of exps two passes (so the sum's exp(y - max) can be
    kept for the pass after it: codegen/keep.py)."""
    out, i, later = [], 0, {}
    while i < len(rest):
        s = rest[i]
        if id(s) in selects:
            out.append(("select", selects[id(s)]))
        elif id(s) in later:
            out.append(("squares", later[id(s)]))
        elif isinstance(s, ir.Reduce):
            group, dsts = [], set()
            while (i < len(rest) and isinstance(rest[i], ir.Reduce) and id(rest[i]) not in selects
                   and id(rest[i]) not in later):
                pair = patterns.online_lse(rest[i], rest[i + 1]) if online and i + 1 < len(rest) else None
                item = pair or _centred_at(rest, i, selects) or rest[i]
                if group and not _independent(dsts, item):
                    break
                group.append(item)
                dsts |= _dsts(item)
                if isinstance(item, CentredSquares):
                    later[id(item.sq)] = item
                i += 2 if pair else 1
            out.append(("reduce", group))
            continue
        elif isinstance(s, ir.Loop):
            out.append(("loop", s))
        else:
            out.append(("stmt", s))
        i += 1
    return out


def exchanges(kernel: ir.Kernel) -> tuple[int, bool]:
    """(exchanges across the row's threads, whether one carries a (max, sum-exp) pair): the
    reductions left after target selects become loads, independent ones share a pass, and a
    centred sum of squares shares its sum's (LayerNorm: 1, a (count, mean, M2) exchange)."""
    parts = ir.row_kernel_parts(kernel)
    _, rest, selects = _row_plan(kernel, list(parts.body))
    groups = [x for kind, x in _row_steps(rest, selects) if kind == "reduce"]
    return len(groups), any(isinstance(r, OnlineLse) for g in groups for r in g)


def fast_math(kernel: ir.Kernel) -> bool:
    """Whether the kernel's f32 exp and division may use the special-function unit
    (ex2.approx of x log2 e, a times rcp.approx of b): when every output is bf16 or f16.

    Each such result is rounded to 8 (bf16) or 11 (f16) significant bits, a relative step of
    2^-9 or 2^-12. ex2.approx is within 2 ulp (2^-22) of 2^x, rcp.approx within 1 ulp, and
    rounding x log2 e moves the exponent by at most |x| 2^-24, under 2^-17.5 relative for the
    |x| <= 88 where exp(x) is a normal float: the result differs from the IEEE-accurate one by
    a 30th of its final rounding step at most, so it rounds the same but in rare ties. Results
    under 2^-126 (exp of x < -87.3) become 0: an absolute error under 1.2e-38. That makes a
    softmax's two exps and its division one instruction each instead of about 25 (at 4096
    columns the accurate form was issue-bound: 255 us for 179 us of memory traffic, H100).
    GELU's Phi (the ncdf op) becomes one polynomial and one ex2, within 2e-5 relatively
    (cexpr's tf_ncdf_fast); expm1, tanh and log1p a short polynomial near 0 and ex2 / rcp / lg2
    elsewhere, within 2^-17 (tests/cpu/test_fast_functions.py). An f32 (or integer, or bool)
    output keeps the accurate library calls."""
    outs = [b for b in kernel.params if b.role == "out"]
    return bool(outs) and all(b.dtype in ("bf16", "f16") for b in outs)


MAX_STAGED_WORDS = 64  # beyond this an explicit schedule would spill whatever ptxas does
MAX_KEPT_WORDS = 64    # kept values' registers per thread at once beyond which keeping is not tried


def _plan_chunks(C: int, V: int, P: int):
    """(chunks per thread, whether every chunk of every thread lies inside the row)."""
    chunks = -(-C // V)
    nchunk = -(-chunks // P)
    return nchunk, (C == nchunk * P * V)


ROWS_ARG = True  # the row count a kernel argument wherever rows_free allows (False: always baked)
_RENDERED: dict = {}  # _rows_free_key -> the source rendered for it (the row count an argument)


def render(kernel: ir.Kernel, schedule: MapReduceSchedule | None = None, arch: str = "sm_90a",
           keep_values: bool = True) -> KernelSource:
    """CUDA C++ for a map-reduce kernel under `schedule` (default_schedule(kernel, arch) if None).

    Rendered once to see its passes over the row; where a later pass recomputes a costly value
    an earlier one made and one CTA holds the row (not the stream stage, not a cluster),
    rendered again keeping those values in registers between the passes (codegen/keep.py),
    and with the stores of values an earlier pass made moved to that pass (keep.Moved).

    Where the row count reaches the source only as the bound of `row_ok` (rows_free), it is
    the kernel's last argument: one source (one NVRTC build, one cubin) serves every row count
    of the same schedule, so a new prompt length of a model builds no map-reduce kernel whose
    schedule it shares with a length seen before; and a source rendered for one row count is
    the source for the others (the render alone is tens of ms of Python per kernel)."""
    if schedule is not None and scan.has_scan(kernel):
        scan.check(kernel, schedule)
    if schedule is not None and schedule.stage == "tiles":
        from . import tiles

        return tiles.render(kernel, schedule, arch)
    free, period = _rows_free(kernel) if ROWS_ARG else (None, None)
    if free is None:
        return _render_kept(kernel, schedule, arch, keep_values, False)
    sched = schedule or default_schedule(kernel, arch)
    key = _rows_free_key(replace(free, name=_digestless(free.name)), sched, arch, keep_values)
    src = _RENDERED.get(key)
    if src is None:
        src = _render_kept(free, sched, arch, keep_values, True)
        if len(_RENDERED) > 1024:
            _RENDERED.clear()
        _RENDERED[key] = src
    return at_rows(src, kernel.body[0].extent, period)  # (the row loop: rows_free checked the shape)


def rows_free(kernel: ir.Kernel) -> ir.Kernel | None:
    """`kernel` with its row count left out (its row loop's extent, and the leading dim of each
    buffer of that many rows, zeroed), or None where the count may reach the source otherwise.

    A buffer's leading dim is no stride, so the source holds it only as the bound that keeps a
    gathered index inside the buffer: a buffer read at a gathered leading index keeps it (an
    embedding table of as many rows as the kernel). Where the rows cycle through a table
    (rows_period), its length S is left out too. Other constants and index expressions stay as
    they are (a count written as a constant keeps it), so two kernels with the same rows_free
    differ in the row count and the period alone. None for a grid reduction (its workspace and
    finishing tail are sized by the rows) and for a single row (its buffers drop the row dim, a
    structure of its own)."""
    return _rows_free(kernel)[0]


def _rows_free(kernel: ir.Kernel) -> tuple[ir.Kernel | None, int | None]:
    """(rows_free(kernel), rows_period(kernel)), the kernel's parts found once."""
    parts = _row_parts(kernel)
    if parts is None or parts.rows <= 1:
        return None, None
    R, gathered = parts.rows, _gathered(parts)
    S = _period(kernel, parts, gathered)
    row_led = _row_led(parts)  # (a column vector as long as R or S keeps its length: it is no row count)
    params = tuple(replace(b, shape=(0,) + tuple(b.shape[1:]))
                   if b.shape and b.shape[0] in (R, S) and b.name not in gathered and b.name in row_led else b
                   for b in kernel.params)
    body = (replace(kernel.body[0], extent=0),)
    if S is not None:
        period, row = ir.Var(cexpr.PERIOD), parts.row_var
        body = map_index(body, lambda e: replace(e, b=period) if _row_divisor(e, row) == S else e)
    return replace(kernel, params=params, body=body), S


def _row_parts(kernel: ir.Kernel) -> ir.RowKernel | None:
    """The row kernel's parts, or None for a grid reduction or a kernel of another shape."""
    if kernel.scratch or kernel.family != "mapreduce":
        return None
    try:
        return ir.row_kernel_parts(kernel)
    except ValueError:
        return None


def _row_led(parts: ir.RowKernel) -> set:
    """Buffers whose leading index is an expression of the row."""
    return {s.buf for s in ir.walk(parts.body)
            if isinstance(s, (ir.Load, ir.Store)) and s.index and parts.row_var in ir.index_vars(s.index[0])}


def _gathered(parts: ir.RowKernel) -> set:
    return {s.buf for s in ir.walk(parts.body)
            if isinstance(s, (ir.Load, ir.Store)) and s.index and ir.index_values(s.index[0])}


def _indices(s) -> tuple:
    """The index expressions a statement holds."""
    return s.index if isinstance(s, (ir.Load, ir.Store)) else (s.expr,) if isinstance(s, ir.IndexValue) else ()


def rows_period(kernel: ir.Kernel) -> int | None:
    """The period S of rows that cycle through a table of S rows (R = k x S rows read an [S, ...]
    table at r % S: RoPE's cos and sin tables beside the heads x S rows of a prompt of S
    tokens), or None. rows_free leaves S out as it leaves out R (the `tf_s` argument): the table's
    leading dim zeroed, and each S that divides the row (`r % S`, `r // S`) the variable
    cexpr.PERIOD. Two kernels whose rows_free forms are equal are then the same form at their
    own R and S, as every place a form differs from its kernel holds the count or the period.
    S is taken only where one candidate is a divisor in an index, the leading dim of a buffer
    read unmasked, and a proper divisor of R."""
    parts = _row_parts(kernel)
    return None if parts is None else _period(kernel, parts, _gathered(parts))


def _period(kernel: ir.Kernel, parts: ir.RowKernel, gathered: set) -> int | None:
    R = parts.rows
    divisors = set()
    for s in ir.walk(parts.body):
        for e in _indices(s):
            divisors |= _row_divisors(e, parts.row_var)
    # a table's leading dim is indexed by the row (a column vector's length is no period: RoPE's
    # signs, cat_signs.py, of D = 64 beside 2 batches of 32 rows read at r // 64 named 64)
    row_led = _row_led(parts)
    tables = {b.shape[0] for b in kernel.params if b.shape and b.name not in gathered and b.name in row_led}
    found = {v for v in divisors & tables if 1 < v < R and R % v == 0}
    return found.pop() if len(found) == 1 else None


def _row_divisor(e: ir.Index, row: str) -> int | None:
    """k where `e` is (an expression of the row) // k or % k: the places rows_free writes the
    period (only there: an S elsewhere, a constant row index or a column's divisor, stays a
    number, and a kernel holding one is a source per length)."""
    if isinstance(e, ir.IBin) and e.op in ("//", "%") and isinstance(e.b, ir.IConst) and row in ir.index_vars(e.a):
        return e.b.value
    return None


def _row_divisors(e: ir.Index, row: str) -> set:
    if not isinstance(e, ir.IBin):
        return set()
    own = _row_divisor(e, row)
    return ({own} if own is not None else set()) | _row_divisors(e.a, row) | _row_divisors(e.b, row)


def map_index(body: tuple, fn) -> tuple:
    """`body` with `fn` applied to every leaf and node of its index expressions, bottom up."""
    def ix(e):
        return fn(replace(e, a=ix(e.a), b=ix(e.b)) if isinstance(e, ir.IBin) else e)

    def st(s):
        if isinstance(s, (ir.Load, ir.Store)):
            return replace(s, index=tuple(map(ix, s.index)))
        if isinstance(s, ir.IndexValue):
            return replace(s, expr=ix(s.expr))
        if isinstance(s, (ir.Loop, ir.Reduce)):
            return replace(s, body=tuple(map(st, s.body)))
        return s
    return tuple(map(st, body))


def _rows_free_key(free: ir.Kernel, sched: MapReduceSchedule, arch: str, keep_values: bool):
    """What a rows-argument source is made from: the kernel without its row count, the
    constants as the source writes them (-0.0 == 0.0 in Python, not in C), the schedule, the
    target, and the generator's module knobs (a test or bench that changes one must not get a
    source rendered before)."""
    consts = tuple(repr(x.value) for x in ir.walk(free.body) if isinstance(x, ir.Const))
    knobs = tuple((m.__name__, k, v) for m in (keep, patterns) for k, v in vars(m).items()
                  if k.isupper() and isinstance(v, (bool, int, float, str, tuple)))
    knobs += tuple((k, v) for k, v in globals().items()
                   if k.isupper() and isinstance(v, (bool, int, float, str, tuple)) and not k.endswith("PRELUDE"))
    return (free, consts, knobs, sched, arch, keep_values)


ROWS_LAYOUT = 1 << 30  # the rows a rows-argument source's layouts are written for (any count above one block)


def _digestless(name: str) -> str:
    """A kernel name without its structural digest (loop.canon.named_by_structure's), which
    counts the rows."""
    return re.sub(r"_[0-9a-f]{10}$", "", name)


def _rows_buffer(b: ir.Buffer, periodic: set) -> str:
    """A rows_free buffer as its header comment shows it: its zeroed leading dim as `rows`, or as
    `tf_s` for a table the rows cycle through (`periodic`: the buffers read at an index holding it)."""
    if not b.shape or b.shape[0] != 0:
        return str(b)
    lead = cexpr.PERIOD if b.name in periodic else "rows"
    return f"{b.role} {b.name}: {b.dtype}[{'x'.join([lead, *map(str, b.shape[1:])])}]"


def at_rows(src: KernelSource, rows: int, period: int | None = None) -> KernelSource:
    """`src` (a source taking its row count as an argument) as the launch of `rows` rows, and of
    rows cycling through `period`-row tables where it takes that too (rows_period)."""
    sch = src.schedule
    grid = -(-rows // sch.rows_per_cta) * sch.cluster
    if rows + sch.rows_per_cta >= 2**31 or grid >= 2**31:
        raise ValueError(f"kernel {src.name}: {rows} rows are too many (row indices are 32-bit, and a grid "
                         f"holds fewer than 2^31 CTAs)")
    if (period is None) != (src.period is None):
        raise ValueError(f"kernel {src.name}: " + ("takes the period of its rows (tf_s); none given" if period is None
                                                    else f"takes no period; {period} given"))
    return replace(src, rows=rows, grid=(grid, 1, 1), period=period)


def _render_kept(kernel: ir.Kernel, schedule: MapReduceSchedule | None, arch: str, keep_values: bool,
                 rows_arg: bool) -> KernelSource:
    """render's body: the source with values kept between passes where that pays."""
    draw = lambda *a: _render(*a, rows_arg=rows_arg)  # noqa: E731
    if not keep_values or not keep.ENABLED or scan.has_scan(kernel):  # (a scan's kernel makes one pass)
        return draw(kernel, schedule, arch, keep.KeepPlan(), None)
    passes = []
    online = not keep.SPLIT_LSE
    src = draw(kernel, schedule, arch, keep.KeepPlan(), passes, online)
    if src.schedule.stage == "stream" or src.cluster != (1, 1, 1):
        # rows not held, or held by a cluster, whose extra exchange (the split max and sum)
        # crosses CTAs: issue 2's tuned kernels there are kept as they were (not measured)
        return src if online else draw(kernel, schedule, arch, keep.KeepPlan(), None)
    kp = keep_plan(kernel, passes)
    sch = src.schedule
    gp = ir.grid_parts(kernel)
    nchunk, _ = _plan_chunks(ir.row_kernel_parts(gp.head if gp else kernel).col_extent, sch.vector, sch.group)
    words = lambda d: nchunk * _words(d if sch.stage != "regs" else "f32", sch.vector)  # noqa: E731 (as _kept_as)
    if kp.peak_words(words) > MAX_KEPT_WORDS:  # would spill: not worth a second build
        kp = keep.KeepPlan(moved=kp.moved)
    if not kp.kept:
        # only stores to move: the passes recorded are the online render's too unless the
        # kernel has a (max, sum-exp) pass, which keeps its online form without kept values
        if kp.moved and not exchanges(gp.head if gp else kernel)[1]:
            return draw(kernel, schedule, arch, kp, None)
        return src if online else draw(kernel, schedule, arch, keep.KeepPlan(), None)
    return draw(kernel, schedule, arch, kp, None, online)


def keep_plan(kernel: ir.Kernel, passes: list) -> keep.KeepPlan:
    """The values to keep between `passes` (recorded by a rendering of `kernel`)."""
    gp = ir.grid_parts(kernel)
    head = gp.head if gp is not None else kernel
    parts = ir.row_kernel_parts(head)
    dtype_of = {}
    for s in parts.body:
        if isinstance(s, ir.Load):
            dtype_of[s.dst] = head.buffer(s.buf).dtype
        elif isinstance(s, (ir.Const, ir.Op, ir.IndexValue, ir.Reduce)):
            dtype_of[s.dst] = s.dtype
    outputs = frozenset(b.name for b in head.params if b.role == "out")
    return keep.plan(passes, outputs, dtype_of)


def _render(kernel: ir.Kernel, schedule: MapReduceSchedule | None, arch: str, kept: keep.KeepPlan,
            passes: list | None, online: bool = True, *, rows_arg: bool = False) -> KernelSource:
    """`rows_arg`: `kernel` is a rows_free one, rendered with its row count an argument."""
    whole = kernel
    gp = ir.grid_parts(kernel)
    if gp is not None:  # the row kernel is rendered as usual, then its grid reduction (_emit_grid_tail)
        kernel = gp.head
    parts = ir.row_kernel_parts(kernel)
    sch = schedule or default_schedule(whole, arch)  # the whole kernel's: a grid reduction's takes batch 1
    if gp is not None and (sch.batch > 1 or sch.across):
        raise ValueError(f"kernel {kernel.name}: a grid reduction's rows take one row per row group "
                         f"(batch 1), its threads neighbours, not {sch}")
    has_reduce = any(isinstance(x, ir.Reduce) for x in parts.body)
    hw_cluster = sch.cluster > 1 and has_reduce  # a map needs no exchange: plain CTAs split the row
    if hw_cluster and not supports_clusters(arch):
        raise ValueError(f"kernel {kernel.name}: schedule has a cluster of {sch.cluster} CTAs, "
                         f"which {arch} does not support; use default_schedule(kernel, {arch!r})")
    C, R, V = parts.col_extent, parts.rows, sch.vector
    if V > 1 and C % V:
        raise ValueError(f"kernel {kernel.name}: vector width {V} does not divide the row length {C}")
    ana = _analyse(kernel, parts, V) if V > 1 else _analyse(kernel, parts, 1)
    P = sch.group * sch.cluster
    nchunk, full = _plan_chunks(C, V, P)
    if C + P * V >= 2**31 or (not rows_arg and R + sch.rows_per_cta >= 2**31):
        raise ValueError(f"kernel {kernel.name}: {R} rows of {C} elements are too many "
                         f"(row and column indices are 32-bit)")
    staged_regs = _held(ana, nchunk, sch) if sch.stage == "regs" else 0
    if staged_regs > MAX_STAGED_WORDS:
        raise ValueError(f"kernel {kernel.name}: {sch} would hold {staged_regs} registers of row per thread "
                         f"(at most {MAX_STAGED_WORDS}); use more threads, a cluster, or stage='stream'")
    stores = {x: x for x in ir.walk(parts.body) if isinstance(x, ir.Store)}
    # a store moves to an earlier pass only as a chunk of its stream (the pass packs and stores
    # it), and only where rows are staged in shared memory without the cp.async pipeline.
    # add+RMSNorm, H100, bf16, old and new source on the same tensors, 7 rounds
    # (bench/results/s26/add_rmsnorm_moved_store_ab_h100.txt): 0.6-2.4% faster with several
    # rows a CTA (512 and 1024 columns), 0.3-0.7% slower with a pipelined row a CTA (2048-4096
    # columns); where the row is in registers the packed chunk adds to their pressure (256
    # columns, f16, sm_80: spilled under its 32-register cap)
    movable = sch.stage == "smem" and not sch.pipeline
    kept = kept.only_moving(lambda st: movable and st in stores and id(stores[st]) in ana.store_stream)
    ctx = _Ctx(kernel, parts, sch, ana, V, C, P, nchunk, full, kept=kept, passes=passes, stores=stores,
               rows_arg=rows_arg)
    # a kept value is read back by a later pass: its cast must round, whatever stores it
    ctx.store_only_casts = _cast_store_only(kernel, parts.body) - {k.producer[1] for k in kept.kept}
    ctx.fast = fast_math(whole)  # a grid reduction's scratch values are not outputs
    smem_bytes = 0
    if sch.stage == "smem":
        staged = [st for st in ana.in_streams.values() if _smem_staged(st)]
        for st in staged:
            if (V * st.itemsize) % 16:
                raise ValueError(f"kernel {kernel.name}: stage='smem' needs 16-byte chunks; {st.buf.name} "
                                 f"has {V * st.itemsize}-byte chunks (vector={V})")
        # one staging layout for every stream (rowlayout's smem: a chunk j at j times the widest
        # stream's chunk), so each stream's area is sized by the widest chunk: a bf16 row beside
        # an f32 one, sized by its own, ran into the f32 area from its second chunk on
        widest = max((V * st.itemsize for st in staged), default=0)
        for st in staged:
            ctx.smem_offset[st.key] = smem_bytes
            smem_bytes += nchunk * sch.threads * widest
        if smem_bytes > max_smem(arch):
            raise ValueError(f"kernel {kernel.name}: {sch} would stage {smem_bytes} bytes of shared memory "
                             f"per CTA ({arch} allows {max_smem(arch)}); use more CTAs per row or stage='stream'")
    pieces = max([_words(st.buf.dtype, V) // 4 for st in ana.in_streams.values() if st.key in ctx.smem_offset],
                 default=1)
    ctx.lay = row_layouts(threads=sch.threads, group=sch.group, cluster=sch.cluster, vector=V, nchunk=nchunk,
                          pieces=pieces, rows=ROWS_LAYOUT if rows_arg else R, batch=sch.batch,
                          across=sch.across)
    lay = ctx.lay
    name = f"{_ident(_digestless(kernel.name))}_@ROWS@" if rows_arg else _ident(kernel.name)
    em = _Emitter()

    # ---- header and parameters
    em(f"// tilefuse map-reduce kernel {name}: "
       + (f"rows (tf_rows, an argument) x {C} columns" if rows_arg else f"{R} rows x {C} columns"))
    em(f"// schedule: {sch}")
    uses = [x for x in ir.walk(parts.body) if any(cexpr.PERIOD in ir.index_vars(e) for e in _indices(x))]
    periodic = rows_arg and bool(uses)  # (a rows_free kernel whose rows cycle through a table)
    tables = {x.buf for x in uses if isinstance(x, (ir.Load, ir.Store))}
    em(f"// {'; '.join(str(b) for b in kernel.params)}" if not rows_arg else
       f"// {'; '.join(_rows_buffer(b, tables) for b in kernel.params)}")
    params = []
    for b in whole.params:
        t = cexpr.storage_ctype(b.dtype)
        params.append(f"{'const ' if b.role == 'in' else ''}{t}* __restrict__ {_param(b.name)}")
    ws = workspace_layout(whole) if gp is not None else None
    if ws is not None:
        params.append("unsigned char* __restrict__ tf_ws")
    if rows_arg:
        params.append("const int tf_rows")
    if periodic:
        params.append(f"const int {cexpr.PERIOD}")
    em(f'extern "C" __global__ void __launch_bounds__({sch.threads}, {sch.min_blocks})')
    em.open(f"{name}({', '.join(params)})")
    em("tf_pdl_launch();  // the next kernel may start once every CTA is here (programmatic launch)")
    em("tf_pdl_wait();    // and this one touches global memory only once the one before has finished")
    if ws is not None:
        em("// per-row values of the grid reduction: scratch carved out of the workspace")
        for b in gp.scratch:
            t = cexpr.storage_ctype(b.dtype)
            em(f"{t}* __restrict__ {_param(b.name)} = ({t}*)(tf_ws + {ws.scratch[b.name]});")

    # ---- which row, which part of it: digits of threadIdx.x and blockIdx.x (codegen/rowlayout.py)
    em("// ---- which row this thread works on, and its place in the row (layouts: codegen/rowlayout.py)")
    em(f"const int slot = {lay.c_slot()};  // row within the CTA: {lay.slot}")
    em(f"const int lane = {lay.c_lane()};  // thread within the row's group: {lay.lane}")
    B = sch.batch
    if sch.cluster > 1:
        em(f"const unsigned rank = {lay.c_rank()};  // this CTA's part of the row (its cluster rank): {lay.rank}")
        em(f"const int rowblock = {lay.c_rowblock()};  // {lay.rowblock}")
        em(f"const long long r = {lay.c_row('slot', 'rowblock')};  // {lay.row}")
        em(f"const int p = {lay.c_p('lane', 'rank')};  // thread within the row (cluster-wide): {lay.p}")
    elif B == 1:
        em(f"const long long r = {lay.c_row('slot', 'blockIdx.x')};  // {lay.row}")
        em(f"const int p = {lay.c_p('lane', 0)};")
    else:
        em(f"// this row group's {B} rows: (slot, b, row block) -> row {lay.row}")
        em(f"const int p = {lay.c_p('lane', 0)};")
    # the streams whose row bases a row's code needs: a batch's loads take those staged in
    # registers, its rows' bodies the others
    based = [x for x in list(ana.in_streams.values()) + list(ana.out_streams.values()) if not x.values]
    staged = [st for st in ana.in_streams.values() if st.per_row] if sch.stage == "regs" else []
    held = [x for x in based if any(x is st for st in staged)]
    unstaged = [x for x in based if not any(x is st for st in staged)]
    if B == 1:
        _emit_row_start(ctx, em, None, based)
    else:
        em(f"(void)slot; (void)lane; (void)p;  // chunk j of thread p covers columns {lay.column} (v, (p, j))")
        if sch.l2_hints:
            _emit_l2_policies(em)

    # ---- staging
    if staged:
        em(f"// ---- this thread's {nchunk} chunk(s) of {V} element(s) of each input row"
           + (f", for each of its {B} rows" if B > 1 else "") + ": loaded once, all in flight")
        for b in range(B):
            for st in staged:
                em(f"unsigned {st.name}_s{b if B > 1 else ''}[{nchunk}][{_words(st.buf.dtype, V)}];")
        for b in range(B):
            if B > 1:
                em.open("")
                _emit_row_start(ctx, em, b, held)
            em("#pragma unroll")
            em.open(f"for (int j = 0; j < {nchunk}; ++j)")
            em(f"const int c0 = {lay.c_column(0)};")
            guard = "row_ok" if full else f"row_ok && c0 < {C}"
            for st in staged:
                _emit_chunk_load(ctx, em, st, f"{st.name}_s{b if B > 1 else ''}[j]", guard, ctx.hint())
            em.close()
            if B > 1:
                em.close()

    pipelined = False
    if ctx.smem_offset:
        pipelined = sch.pipeline
        em(f"// ---- copy this thread's {nchunk} chunk(s) of each input row to shared memory, all in flight"
           + (" (one group per chunk)" if pipelined else ""))
        em(f"// staging layout (thread, 16-byte piece, chunk) -> byte: {lay.smem}")
        hint = ctx.hint()  # a staged row is read once
        cp, pol = ("tf_cp_async16", "") if hint is None else ("tf_cp_async16_hint", f", tf_pol_{hint}")
        em("extern __shared__ __align__(16) unsigned char tf_smem[];")
        em("const unsigned smem0 = tf_smem_addr(tf_smem);")
        em("#pragma unroll")
        em.open(f"for (int j = 0; j < {nchunk}; ++j)")
        em(f"const int c0 = {lay.c_column(0)};")
        em.open("if (row_ok" + ("" if full else f" && c0 < {C}") + ")")
        for st in ana.in_streams.values():
            if st.key in ctx.smem_offset:
                for i in range(_words(st.buf.dtype, V) // 4):
                    off = "" if i == 0 else f" + {16 * i // st.itemsize}"
                    em(f"{cp}({_smem_chunk(ctx, st, i)}, {_param(st.buf.name)} + b_{st.name} + {_chunk_col(st)}{off}{pol});")
        em.close()
        if pipelined:
            em("tf_cp_async_commit();")
        em.close()

    # ---- the row body: statements that need no reduction first (their loads overlap the row's)
    early, rest, selects = _row_plan(kernel, list(parts.body))
    steps = _row_steps(rest, selects, online)
    if ctx.smem_offset and not pipelined:
        wait_line = "tf_cp_async_wait_all();  // each thread reads back only its own chunks: no barrier needed"
    else:
        wait_line = None
    row_vectors = {}
    if B > 1 and sch.across and sch.stage == "regs":
        from .columns import row_vector_loads

        row_vectors = row_vector_loads(kernel, B)
        out_vectors = row_vector_loads(kernel, B, ir.Store)
        ctx.row_vec = _emit_row_vectors(ctx, em, row_vectors)
        for i, ((bname, _), sts) in enumerate(out_vectors.items()):
            em(f"unsigned ro{i}[{nchunk}][{_words(kernel.buffer(bname).dtype, B)}] = {{}};  // {bname}, "
               f"the batch's rows' values, stored as one vector a column once all are made")
            ctx.row_vec.update({id(st): f"ro{i}" for _, st in sts})
        row_vectors = {**row_vectors, **out_vectors}
    if B == 1:
        _emit_row_body(ctx, em, early, steps, selects, pipelined, wait_line)
    else:
        fresh = _ctx_state(ctx)
        for b in range(B):
            _set_ctx_state(ctx, fresh)  # every row of the batch renders the same body, in its own scope
            em.open("")
            em(f"// ---- row {b} of the batch")
            _emit_row_start(ctx, em, b, unstaged)
            for st in staged:
                em(f"auto& {st.name}_s = {st.name}_s{b};")
            ctx.batch_row = b
            _emit_row_body(ctx, em, early, steps, selects, pipelined, wait_line)
            ctx.batch_row = None
            em.close()
        if row_vectors:
            _emit_row_vector_stores(ctx, em, out_vectors)
    if ctx.cluster_done is not None:  # done reading the other CTAs: say so early, wait at the end
        em.lines.insert(ctx.cluster_done, "  tf_cluster_arrive();  // done reading the other CTAs' "
                        "shared memory (each waits for every arrival before it exits)")
        em("// keep this CTA's shared memory alive until every CTA of the cluster has read it")
        em("tf_cluster_wait();")
    if gp is not None:
        _emit_grid_tail(ctx, em, gp, ws, sch.cluster)  # grid: ceil(R / rows per CTA) row blocks of sch.cluster CTAs
    em.close()

    code = (cexpr.PRELUDE + (cexpr.CLUSTER_PRELUDE if hw_cluster else "")
            + (VAR_PRELUDE if ctx.var_state else "") + (GRID_PRELUDE if gp is not None else "")
            + "\n" + em.text())
    grid = (-(-R // sch.rows_per_cta) * sch.cluster, 1, 1)
    if rows_arg:  # named by its code, comments left out (at_rows sets the grid): schedules that
        # render the same code (the header comment names every knob) are one kernel, one build
        import hashlib

        from ..runtime.cache import code_of

        name = name.replace("@ROWS@", hashlib.sha256(code_of(code).encode()).hexdigest()[:10])
        code = code.replace(f"{name.rsplit('_', 1)[0]}_@ROWS@", name)
    align = []
    for st in list(ana.in_streams.values()) + list(ana.out_streams.values()):
        need = min(16, V * st.itemsize)
        if need > st.itemsize:
            align.append((st.buf.name, need))
    for (bname, _), loads in row_vectors.items():
        size = dtypes.itemsize(kernel.buffer(bname).dtype)
        if B * size > size:
            align.append((bname, min(16, B * size)))
    align_d = {}
    for b, n in align:
        align_d[b] = max(n, align_d.get(b, 0))
    return KernelSource(name=name, source=code, grid=grid, block=(sch.threads, 1, 1), smem_bytes=smem_bytes,
                        cluster=(sch.cluster if hw_cluster else 1, 1, 1), params=tuple(b.name for b in whole.params),
                        alignment=tuple(sorted(align_d.items())), schedule=sch,
                        workspace_bytes=ws.nbytes if ws is not None else 0, kept=len(kept.kept),
                        moved=len(kept.moved), period=0 if periodic else None)  # (at_rows sets the period)


def _open_batch_columns(ctx: _Ctx, em: _Emitter, B: int, limit: str) -> str:
    """Opens a scope at the batch's first row and the loop over this thread's chunks (column c0
    of chunk j); returns the column's guard (empty where every chunk is inside the row)."""
    em.open("")
    em(f"const long long r = {ctx.lay.c_row('slot', 'blockIdx.x', 0)};  // the batch's first row")
    em(f"const bool whole = r + {B - 1} < {limit};  // every row of the batch exists")
    em("#pragma unroll")
    em.open(f"for (int j = 0; j < {ctx.nchunk}; ++j)")
    em(f"const int c0 = {ctx.lay.c_column(0)};  // first column of chunk j")
    em("const int c = c0; (void)c;")
    return "" if ctx.full else f" && c0 < {ctx.C}"


def _emit_row_vectors(ctx: _Ctx, em: _Emitter, groups: dict) -> dict:
    """A column kernel's batch of neighbouring rows (MapReduceSchedule.across, batch > 1): each
    load of columns.row_vector_loads read for all the batch's rows at once, chunk j's column as
    one vector (rv<i>[j], element b for row b), before the row bodies, which read it back
    (_emit_stmt). A warp's load of a column is then 32 x batch neighbouring elements, where a
    row a thread read 32: H200, bf16, `x.mean(1)` over [16, 512, 4096], hand-written, 22.3 ->
    19.8 us at 2 rows (bench/column_vector_probe.py). Rows past the last (a batch the row
    count does not divide) read as zeros, element by element. Returns {id(Load): array}."""
    B, limit = ctx.sched.batch, ("tf_rows" if ctx.rows_arg else str(ctx.parts.rows))
    names: dict = {}
    if not groups:
        return names
    em(f"// ---- each column's element of this thread's {B} neighbouring rows: one vector load a column, "
       f"all in flight (columns.row_vector_loads)")
    for i, ((bname, _), loads) in enumerate(groups.items()):
        w = _words(ctx.kernel.buffer(bname).dtype, B)
        em(f"unsigned rv{i}[{ctx.nchunk}][{w}];  // {bname}")
        for _, s in loads:
            names[id(s)] = f"rv{i}"
    col_ok = _open_batch_columns(ctx, em, B, limit)
    for i, ((bname, _), loads) in enumerate(groups.items()):
        col, s = loads[0]
        buf = ctx.kernel.buffer(bname)
        size = dtypes.itemsize(buf.dtype)
        w = _words(buf.dtype, B)
        ptr = f"{_param(bname)} + ({cexpr.flat_offset(buf, s.index, _env(ctx, col))})"
        ((vec, _),) = _ld_fn(B * size, stream=True)
        ((one, _),) = _ld_fn(size, stream=False)
        em(f"if (whole{col_ok}) {{ {vec}(rv{i}[j], {ptr}); }}")
        em.open("else")
        em(" ".join(f"rv{i}[j][{k}] = 0u;" for k in range(w)))
        em("#pragma unroll")
        em.open(f"for (int b = 0; b < {B}; ++b)")
        if size < 4:
            put = f"rv{i}[j][(b * {size}) / 4] |= e[0] << (8 * ((b * {size}) % 4));"
        else:
            put = " ".join(f"rv{i}[j][b * {size // 4} + {k}] = e[{k}];" for k in range(size // 4))
        em(f"if (r + b < {limit}{col_ok}) {{ unsigned e[2]; {one}(e, {ptr} + b); {put} }}")
        em.close()
        em.close()
    em.close()
    em.close()
    return names


def _emit_row_vector_stores(ctx: _Ctx, em: _Emitter, groups: dict):
    """The batch's rows' values of each store of columns.row_vector_loads(kind=ir.Store), put in
    ro<i>[j] by the row bodies: one vector store a column (each row's element on its own past
    the last row), so a warp's store covers 32 x batch neighbouring elements."""
    if not groups:
        return
    B, limit = ctx.sched.batch, ("tf_rows" if ctx.rows_arg else str(ctx.parts.rows))
    em("// ---- the batch's rows' values, one vector store a column")
    col_ok = _open_batch_columns(ctx, em, B, limit)
    for i, ((bname, _), sts) in enumerate(groups.items()):
        col, s = sts[0]
        buf = ctx.kernel.buffer(bname)
        size = dtypes.itemsize(buf.dtype)
        ptr = f"{_param(bname)} + ({cexpr.flat_offset(buf, s.index, _env(ctx, col))})"
        ((vec, _),) = _st_fn(B * size)
        ((one, _),) = _st_fn(size)
        em(f"if (whole{col_ok}) {{ {vec}({ptr}, ro{i}[j]); }}")
        em.open("else")
        em("#pragma unroll")
        em.open(f"for (int b = 0; b < {B}; ++b)")
        if size < 4:
            get = f"e[0] = (ro{i}[j][(b * {size}) / 4] >> (8 * ((b * {size}) % 4))) & {(1 << 8 * size) - 1}u;"
        else:
            get = " ".join(f"e[{k}] = ro{i}[j][b * {size // 4} + {k}];" for k in range(size // 4))
        em(f"if (r + b < {limit}{col_ok}) {{ unsigned e[2]; {get} {one}({ptr} + b, e); }}")
        em.close()
        em.close()
    em.close()
    em.close()


def _emit_row_start(ctx: _Ctx, em: _Emitter, b: int | None, streams: list):
    """Row b of the group's batch (None: the one row, `r` already defined): its index, whether
    it exists, and the row bases of `streams`."""
    if b is not None:
        em(f"const long long r = {ctx.lay.c_row('slot', 'blockIdx.x', b)};")
    # (a 32-bit compare with the argument: r < 2^31 (at_rows); the 64-bit one held a register
    # pair for the whole row and spilled a batch of rows under its register cap)
    em(f"const bool row_ok = {'(int)r < tf_rows' if ctx.rows_arg else f'r < {ctx.parts.rows}'};")
    if b is None:
        em(f"(void)slot; (void)lane; (void)p;  // chunk j of thread p covers columns {ctx.lay.column} (v, (p, j))")
        if ctx.sched.l2_hints:
            _emit_l2_policies(em)
    env0 = _env(ctx, None)
    for st in streams:
        em(f"const long long b_{st.name} = {cexpr.flat_offset(st.buf, st.base_index, env0)};  // {st.buf.name} row base")


def _emit_l2_policies(em: _Emitter):
    em("// L2 eviction priorities: rows read again later stay (evict_last), last reads go first")
    em("const unsigned long long tf_pol_first = tf_l2_evict_first(), tf_pol_last = tf_l2_evict_last();")
    em("(void)tf_pol_first; (void)tf_pol_last;")


_CTX_STATE = ("names", "dtype_of", "rgroup", "reads_left", "var_state", "var_sums", "var_phase", "pending_wait",
              "pass_no")


def _ctx_state(ctx: _Ctx) -> dict:
    """What emitting a row's body changes in ctx (copied: a batch renders each row from it)."""
    return {k: (dict(v) if isinstance(v := getattr(ctx, k), dict) else v) for k in _CTX_STATE}


def _set_ctx_state(ctx: _Ctx, state: dict):
    for k, v in state.items():
        setattr(ctx, k, dict(v) if isinstance(v, dict) else v)


def _emit_row_body(ctx: _Ctx, em: _Emitter, early: list, steps: list, selects: dict, pipelined: bool,
                   wait_line: str | None):
    """A row's statements: those that need no reduction first (their loads overlap the row's),
    then its reductions and passes in order."""
    ctx.reads_left = _pass_reads(ctx.ana, steps)  # a row stream's last read is evict_first (l2_hints)
    if early:
        em("// ---- row values that depend on no reduction")
    for s in early:
        if id(s) in selects:
            _emit_select(ctx, em, selects[id(s)])
        else:
            _emit_stmt(ctx, em, s, _env(ctx, None), inner=False)
    _emit_hoisted_vectors(ctx, em, _hoisted_vectors(ctx, steps))
    if pipelined:
        ctx.pending_wait = True
    elif wait_line:
        em(wait_line)
    for kind, x in steps:
        if kind == "select":  # a target select that waited for a value it reads
            _emit_select(ctx, em, x)
        elif kind == "reduce":
            _emit_reduce_group(ctx, em, x)
        elif kind == "squares":
            _emit_var_finish(ctx, em, x)
        elif kind == "loop" and scan.scan_of(x) is not None:
            scan.emit_pass(ctx, em, x)
        elif kind == "loop":
            em(f"// ---- map over the row: {x.header()}")
            _emit_pass(ctx, em, [x], [None])
        elif not _emit_var_mean(ctx, em, x):
            _emit_stmt(ctx, em, x, _env(ctx, None), inner=False)


HOIST_VECTOR_WORDS = 16  # registers per thread that column vectors loaded ahead of the reductions may take


def _hoisted_vectors(ctx: _Ctx, steps: list) -> list:
    """The column vectors (inputs the same for every row: a norm's weight and bias) that the
    row's output passes read, to be loaded before its reductions, where a CTA's one row is
    staged in shared memory: their loads then overlap the row's copies instead of waiting
    behind its reduction tree. H200, bf16, 32768 x 4096, the edited source against the
    rendered one on the same tensors (bench/early_vectors_probe.py, three runs of 9 rounds,
    results/s47): LayerNorm 141.5-142.1 -> 138.6-139.1 us, RMSNorm 130.8 -> 129.3,
    add+RMSNorm unchanged. Not elsewhere: rows held in registers ran slower (LayerNorm 32768 x
    256: 12.45 -> 12.64 us), and a cluster's row at 65536 columns spilled (64 registers held).
    Rows with a masked tail keep the loads in the pass: a 136-column LayerNorm at 128 threads
    spilled under its 40-register cap with them hoisted."""
    s = ctx.sched
    if s.stage != "smem" or s.cluster != 1 or s.group != s.threads or not ctx.full:
        return []
    body = [st for kind, x in steps if kind == "loop" for st in _block_body(x)]
    vecs = [st for st in _streams_used(body, ctx.ana.in_streams, ctx.ana.load_stream)
            if not st.per_row and not st.values and st.key not in ctx.smem_offset]
    if sum(ctx.nchunk * _words(st.buf.dtype, ctx.V) for st in vecs) > HOIST_VECTOR_WORDS:
        return []
    return vecs


def _emit_hoisted_vectors(ctx: _Ctx, em: _Emitter, vecs: list):
    """Loads every chunk of `vecs` into registers ({name}_h[j]); later passes read them there."""
    ctx.hoisted = frozenset(st.key for st in vecs)
    if not vecs:
        return
    em("// ---- column vectors the output pass reads, loaded ahead of the reductions")
    for st in vecs:
        em(f"unsigned {st.name}_h[{ctx.nchunk}][{_words(st.buf.dtype, ctx.V)}];")
    em("#pragma unroll")
    em.open(f"for (int j = 0; j < {ctx.nchunk}; ++j)")
    em(f"const int c0 = {ctx.lay.c_column(0)};  // first column of chunk j")
    for st in vecs:
        _emit_chunk_load(ctx, em, st, f"{st.name}_h[j]", "row_ok")  # (full rows only: no column guard)
    em.close()


# ---------------------------------------------------------------- grid reductions

GRID_PRELUDE = r"""
// ---- grid reduction: loads that bypass L1 (values other CTAs wrote during this launch)
__device__ __forceinline__ float tf_ldcg(const float* p) { float v; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory"); return v; }
"""

GRID_GROUP_ROWS = 256  # rows per group at least: a group's last CTA reads this many values per scratch buffer


@dataclass(frozen=True)
class Workspace:
    """Byte layout of a grid reduction's workspace, from the kernel alone (every schedule of
    it, the scalar fallback's included, fits): arrival counters (one per group of rows, one
    for the groups; zero between launches: each is reset by the CTA that saw it full), the
    groups' partials (f32, group-major), then each scratch buffer's per-row values."""

    nbytes: int
    max_groups: int
    partials: int            # byte offset
    scratch: dict            # scratch buffer -> byte offset


def workspace_layout(kernel: ir.Kernel) -> Workspace:
    gp = ir.grid_parts(kernel)
    R = ir.row_kernel_parts(gp.head).rows
    nred = sum(isinstance(s, ir.Reduce) for s in gp.tail.body)
    ng = -(-R // GRID_GROUP_ROWS)

    def up(n):
        return -(-n // 256) * 256

    off = up(4 * (ng + 1))
    partials = off
    off += up(4 * ng * nred)
    scratch = {}
    for b in gp.scratch:
        scratch[b.name] = off
        off += up(R * dtypes.itemsize(b.dtype))
    return Workspace(off, ng, partials, scratch)


def _emit_grid_tail(ctx: _Ctx, em: _Emitter, gp: ir.GridParts, ws: Workspace, cs: int):
    """The end of a kernel with a grid reduction. Rows are cut into groups of GR (>= 256, a
    multiple of the rows per CTA); every CTA, once its rows' values are stored, counts itself
    in at its group (fence, then atomicAdd), and the last CTA of a group reduces the group's
    values in a fixed order (thread t takes rows t, t + T, ..., then a butterfly in each warp
    and the warps in order) into the group's partial; the last group to finish reduces the
    partials the same way, runs the tail's row-level statements and stores the scalars. Which
    CTA comes last varies; what it computes does not: the result is the same every launch.
    Each counter is reset by the CTA that found it full, so the next launch (or CUDA-graph
    replay) starts from zero without a memset. A CTA never waits for another: no deadlock
    whatever the order in which CTAs run."""
    sch = ctx.sched
    R, T = ctx.parts.rows, sch.threads
    rpc = sch.rows_per_cta
    gc = -(-GRID_GROUP_ROWS // rpc)        # row blocks (CTAs, or clusters) per group
    gr = gc * rpc                          # rows per group
    nblocks = -(-R // rpc)
    ng = -(-nblocks // gc)
    assert ng <= ws.max_groups
    tail = gp.tail
    reds = [s for s in tail.body if isinstance(s, ir.Reduce)]
    rest = [s for s in tail.body if not isinstance(s, ir.Reduce)]
    for r in reds:
        if r.dtype != "f32":
            raise ValueError(f"kernel {ctx.kernel.name}: grid reduction {r.header()} must accumulate in f32")
    for b in gp.scratch:
        if b.dtype != "f32":
            raise ValueError(f"kernel {ctx.kernel.name}: grid reduction scratch {b.name} must be f32")
    nw = T // 32
    nred = len(reds)
    acc = [f"tf_ga{i}" for i in range(nred)]

    def element(r) -> str:
        vals = {}
        for t in r.body:
            if isinstance(t, ir.Load):
                vals[t.dst] = (f"tf_ldcg({_param(t.buf)} + tf_lo + tf_i)", "f32")
            else:  # a cast (grid_parts checks)
                e, dt = vals[t.args[0]]
                vals[t.dst] = (cexpr.cast(e, dt, t.dtype), t.dtype)
        return vals[r.value][0]

    def block_reduce():
        em("// across the CTA in a fixed order: a butterfly in each warp, then the warps in order")
        em("#pragma unroll")
        em.open("for (int o = 16; o > 0; o >>= 1)")
        for r, a in zip(reds, acc):
            em(f"{a} = {cexpr.combine(r.op, a, f'__shfl_xor_sync(0xffffffffu, {a}, o)')};")
        em.close()
        if nw > 1:
            em.open("if ((threadIdx.x & 31) == 0)")
            for i, a in enumerate(acc):
                em(f"tf_gw[{i}][threadIdx.x >> 5] = {a};")
            em.close()
            em("__syncthreads();")
            em.open("if (threadIdx.x == 0)")
            for i, (r, a) in enumerate(zip(reds, acc)):
                em(f"{a} = tf_gw[{i}][0];")
                em(f"for (int w = 1; w < {nw}; ++w) {a} = {cexpr.combine(r.op, a, f'tf_gw[{i}][w]')};")
            em.close()

    em(f"// ---- grid reduction over all {R} rows: {', '.join(r.header() for r in reds)}")
    em(f"// groups of {gr} rows ({gc} row block(s) of {cs} CTA(s)); {ng} group(s); counters and partials in tf_ws")
    em.open("")
    em("__shared__ unsigned tf_glast, tf_glast2;  // two flags: a lane may read the first after thread 0 sets the second")
    if nw > 1:
        em(f"__shared__ float tf_gw[{nred}][{nw}];")
    em("unsigned* tf_cnt = (unsigned*)tf_ws;")
    em(f"float* tf_part = (float*)(tf_ws + {ws.partials});")
    em("__threadfence();  // this thread's stores of per-row values are visible to the whole GPU")
    em("__syncthreads();")
    # the row block (rowlayout.py: the CTA, or the cluster, of this CTA's rows) -> its group
    em(f"const unsigned tf_rowblock = {'rowblock' if cs > 1 else 'blockIdx.x'};")
    em(f"const unsigned tf_grp = tf_rowblock / {gc}u;")
    em.open("if (threadIdx.x == 0)")
    em(f"const unsigned n_in = min({gc * cs}u, gridDim.x - tf_grp * {gc * cs}u);  // CTAs of this group")
    em("tf_glast = (atomicAdd(tf_cnt + tf_grp, 1u) == n_in - 1u);")
    em.close()
    em("__syncthreads();")
    em.open("if (tf_glast)")
    em("__threadfence();  // see every store the group's other CTAs fenced before counting in")
    em(f"const long long tf_lo = (long long)tf_grp * {gr}LL;")
    em(f"const int tf_n = (int)min({gr}LL, {R}LL - tf_lo);")
    for r, a in zip(reds, acc):
        em(f"float {a} = {cexpr.identity(r.op, 'f32')};")
    em("#pragma unroll 8")
    em.open(f"for (int tf_i = threadIdx.x; tf_i < tf_n; tf_i += {T})")
    for r, a in zip(reds, acc):
        em(f"{a} = {cexpr.combine(r.op, a, element(r))};  // {r.header()}")
    em.close()
    block_reduce()
    em.open("if (threadIdx.x == 0)")
    for i, a in enumerate(acc):
        em(f"tf_part[tf_grp * {nred}u + {i}u] = {a};")
    em("tf_cnt[tf_grp] = 0u;  // ready for the next launch")
    em("__threadfence();")
    em(f"tf_glast2 = (atomicAdd(tf_cnt + {ng}, 1u) == {ng - 1}u);")
    em.close()
    em("__syncthreads();")
    em.open("if (tf_glast2)")
    em("__threadfence();")
    for r, a in zip(reds, acc):
        em(f"{a} = {cexpr.identity(r.op, 'f32')};")
    em.open(f"for (int tf_i = threadIdx.x; tf_i < {ng}; tf_i += {T})")
    for i, (r, a) in enumerate(zip(reds, acc)):
        em(f"{a} = {cexpr.combine(r.op, a, f'tf_ldcg(tf_part + tf_i * {nred} + {i})')};")
    em.close()
    block_reduce()
    em.open("if (threadIdx.x == 0)")
    em(f"tf_cnt[{ng}] = 0u;")
    em("const long long r = 0; const bool row_ok = true; const int p = 0;  // the one row of the tail")
    em("(void)r; (void)row_ok; (void)p;")
    env = {tail.var: "r"}
    for r, a in zip(reds, acc):
        name = ctx.define(r.dst, r.dtype)
        em(f"const float {name} = {a};")
        env[r.dst] = name
    for s in rest:
        env.update(ctx.names)
        _emit_stmt(ctx, em, s, env, inner=False)
    em.close()
    em.close()
    em.close()
    em.close()


def scalar_fallback(schedule: MapReduceSchedule) -> MapReduceSchedule:
    """The same layout with scalar accesses, re-reading the row (for misaligned data pointers);
    a streamed row group works on one row at a time."""
    return replace(schedule, vector=1, stage="stream", unroll=8, batch=1)

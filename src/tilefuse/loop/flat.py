"""Kernels of maps alone re-walked: neighbouring rows merged (`merged_rows`), or short rows
walked as rows of K elements of the whole tensor (`flat_rows`). lower_step tries the merge first.

A map kernel's rows are its result's last dim. Where that dim is short (`x * sigmoid(s)` over
[N, C, 7, 7] with s of [N, C, 1, 1]: rows of 7, 14 bytes in bf16) its rows take no 16-byte loads
and a warp's lanes split across many of them. Maps have no row structure to keep, so where every
tensor the kernel writes and every one it reads whole lies row after row ([R, C] read at
[r, c]), the kernel walks the R x C elements as R * C / K rows of K instead:

    r, c   ->   (r' * K + c') // C, (r' * K + c') % C

its [R, C] tensors viewed as [R * C / K, K] (read at [r', c']: 16-byte chunks), and what was
read once a row (a per-row gate, a per-channel scale) read at the element's own row instead:
an index computed per element, a load the L1 serves.

The element's place r' * K + c' is a 32-bit value (N < 2^31), so its divisions by constants
are 32-bit multiplies: with the 64-bit index expressions the gate's kernel had 1264
instructions, with it 992 (sm_90a).

H200, bf16 (`bench/flat_rows.sh`, session 58), the program (the gate's sigmoid is a kernel of
its own): the gate over 128 x 2048 x 7 x 7 50.7 -> 26.1 us, over 128 x 512 x 14 x 14 35.0 ->
25.2 us; torch.compile's best 17.8 and 15.3 (its one kernel does less index arithmetic an
element: ours still issues ~30 instructions an element). Only rows shorter than SHORT (64):
over long rows whose bytes are no multiple of 16, the first (64-bit) form cost more than the
narrower chunks (`gelu(x + b)`, rows of 98: 57.7 -> 63.3 us; `x * s`, rows of 1001: 13.4 ->
18.4 us), so those keep their rows.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .. import dtypes
from .. import env
from . import ir as L

K_CHOICES = (1024, 2048, 512, 4096, 256)  # preferred first: rows the row kernel reads at full speed
SHORT = 64  # rows shorter than this are walked flat


def _subst(e: L.Index, sub: dict) -> L.Index:
    if isinstance(e, L.Var):
        return sub.get(e.name, e)
    if isinstance(e, L.IBin):
        return L.IBin(e.op, _subst(e.a, sub), _subst(e.b, sub))
    return e


def _simplified(e: L.Index) -> L.Index:
    """(a // m) // n as a // (m * n) (indices are never negative): one division, not two."""
    if not isinstance(e, L.IBin):
        return e
    a, b = _simplified(e.a), _simplified(e.b)
    if (e.op == "//" and isinstance(b, L.IConst) and isinstance(a, L.IBin) and a.op == "//"
            and isinstance(a.b, L.IConst)):
        return L.IBin("//", a.a, L.IConst(a.b.value * b.value))
    return L.IBin(e.op, a, b)


def _fresh(kernel: L.Kernel, stem: str) -> str:
    taken = {getattr(s, "dst", None) for s in L.walk(kernel.body)}
    name, i = stem, 0
    while name in taken:
        i += 1
        name = f"{stem}{i}"
    return name


def _whole(s, r: str, c: str, R: int, C: int, kernel: L.Kernel) -> bool:
    """s reads or writes a buffer of [R, C] at [r, c] (or, one row, a buffer of [C] at [c])."""
    b = kernel.buffer(s.buf)
    if R == 1 and tuple(b.shape) == (C,) and tuple(s.index) == (L.Var(c),):
        return True
    return (tuple(b.shape) == (R, C) and len(s.index) == 2 and s.index[0] == L.Var(r) and s.index[1] == L.Var(c))


def _moved(s, whole: set, r: str, c: str, sub: dict):
    """Statement s of a re-walked kernel: a whole tensor read or written at the new [r, c], any
    other index (and index value) with the old r and c substituted by `sub`."""
    if isinstance(s, (L.Load, L.Store)):
        index = (L.Var(r), L.Var(c)) if s.buf in whole else tuple(_simplified(_subst(e, sub)) for e in s.index)
        return replace(s, index=index)
    if isinstance(s, L.IndexValue):
        return replace(s, expr=_simplified(_subst(s.expr, sub)))
    return s


def wanted(C: int) -> bool:
    """Rows worth walking flat: shorter than SHORT."""
    return C < SHORT


def enabled() -> bool:
    """TILEFUSE_FLAT_ROWS=0 keeps every map kernel's rows (for A/B runs; TILEFUSE_MERGED_ROWS=0
    turns off merged rows alone)."""
    return env.switch("TILEFUSE_FLAT_ROWS")


def _maps_alone(kernel: L.Kernel):
    """(row loop, head, inner loop, whole buffers) of a kernel of maps alone whose written
    tensors and streamed inputs all lie row after row, or None. Not for a gather
    (`table[idx[r], c]`: a row's elements stay one gathered run, not a load apiece)."""
    if kernel.family != "mapreduce" or kernel.scratch or len(kernel.body) != 1 or not enabled():
        return None
    if any(isinstance(s, L.Load) and any(L.index_values(e) for e in s.index) for s in L.walk(kernel.body)):
        return None
    loop = kernel.body[0]
    if not isinstance(loop, L.Loop) or not loop.parallel or not loop.body:
        return None
    *head, inner = loop.body
    if not isinstance(inner, L.Loop) or inner.parallel:
        return None
    r, c, R, C = loop.var, inner.var, loop.extent, inner.extent
    if any(isinstance(s, (L.Loop, L.Reduce, L.Store)) for s in head):
        return None  # (a reduction, or a value written once a row)
    if any(isinstance(s, (L.Loop, L.Reduce)) for s in inner.body):
        return None
    whole: set[str] = set()
    for s in inner.body:
        if isinstance(s, L.Store):
            if not _whole(s, r, c, R, C, kernel):
                return None
            whole.add(s.buf)
        elif isinstance(s, L.Load) and _whole(s, r, c, R, C, kernel):
            whole.add(s.buf)
    for s in L.walk(loop.body):  # a whole buffer read elsewhere at another index keeps the rows
        if isinstance(s, (L.Load, L.Store)) and s.buf in whole and not _whole(s, r, c, R, C, kernel):
            return None
    return loop, head, inner, whole


def flat_rows(kernel: L.Kernel) -> L.Kernel | None:
    """The kernel walked as rows of K (its new row loop's extent), or None where it is not a
    kernel of maps alone (`_maps_alone`), its rows are not short, or no K divides its size."""
    found = _maps_alone(kernel)
    if found is None:
        return None
    loop, head, inner, whole = found
    r, c, R, C = loop.var, inner.var, loop.extent, inner.extent
    N = R * C
    if not wanted(C) or N >= 2**31:
        return None
    K = next((k for k in K_CHOICES if N % k == 0 and N // k > 1), None)
    if K is None:
        return None
    # the element's place in the whole as a 32-bit value (N < 2^31): divisions of it by constants
    # are 32-bit multiplies, where those of the 64-bit index expression were 64-bit ones
    pos = L.IndexValue(_fresh(kernel, "pos"), L.IBin("+", L.IBin("*", L.Var(r), L.IConst(K)), L.Var(c)), "i32")
    sub = {r: L.IBin("//", L.Val(pos.dst), L.IConst(C)), c: L.IBin("%", L.Val(pos.dst), L.IConst(C))}

    body = (pos,) + tuple(_moved(s, whole, r, c, sub) for s in (*head, *inner.body))
    params = tuple(replace(b, shape=(N // K, K)) if b.name in whole else b for b in kernel.params)
    new = L.Loop(r, N // K, (L.Loop(c, K, body),), parallel=True)
    return replace(kernel, params=params, body=(new,))


# ---------------------------------------------------------------- merged rows

MERGED_MAX = 16384  # a merged row's elements, at most
MERGED_MIN_ROWS = 512  # rows left after merging, at least (CTAs for every SM)
LONG = 1024  # rows this long whose bytes are whole 16-byte chunks are left as they are


def _row_divisors(e: L.Index, r: str) -> list[int] | None:
    """The k of every `r // k` in `e`, or None where `e` reads r otherwise (bare, or `r % n`)."""
    if isinstance(e, L.Var):
        return None if e.name == r else []
    if isinstance(e, L.IBin):
        if e.op == "//" and e.a == L.Var(r) and isinstance(e.b, L.IConst):
            return [e.b.value]
        a, b = _row_divisors(e.a, r), _row_divisors(e.b, r)
        return None if a is None or b is None else a + b
    return []


def _merged_index(e: L.Index, r: str, m: int) -> L.Index:
    """`e` with every `r // k` as `r' // (k / m)` (r' the merged row; m divides k)."""
    if isinstance(e, L.IBin):
        if e.op == "//" and e.a == L.Var(r) and isinstance(e.b, L.IConst):
            k = e.b.value // m
            return L.Var(r) if k == 1 else L.IBin("//", L.Var(r), L.IConst(k))
        return L.IBin(e.op, _merged_index(e.a, r, m), _merged_index(e.b, r, m))
    return e


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def merged_rows(kernel: L.Kernel) -> L.Kernel | None:
    """The kernel with m of its rows merged into one (rows of m * C), or None.

    A map kernel over NCHW's rows of W (a BatchNorm, a per-channel bias and ReLU) reads its
    per-channel values at `(r // H) % C`: constant over H rows at a time. Merged H rows at a
    time, a row is a whole H x W plane, the per-channel values read once a plane, the tensors
    viewed as [N * C, H * W] (long rows of 16-byte chunks). m divides every k of the `r // k`
    the row-level indices read (r // k = r' // (k / m) exactly: the merged row's place in it
    is below m); no index may read r otherwise or read the column (a vector along W would
    be read at c % W per element). A kernel of maps alone with no row-level value (`x * 2`)
    merges as far as MERGED_MAX and MERGED_MIN_ROWS let it.

    Rows already LONG and 16-byte aligned are left as they are; a merged row whose bytes are
    whole 16-byte chunks is preferred, then the longest."""
    found = _maps_alone(kernel) if env.switch("TILEFUSE_MERGED_ROWS") else None
    if found is None:
        return None
    loop, head, inner, whole = found
    r, c, R, C = loop.var, inner.var, loop.extent, inner.extent
    sizes = [kernel.buffer(b).dtype for b in sorted(whole)]

    def aligned(n: int) -> bool:
        return all(n * dtypes.itemsize(d) % 16 == 0 for d in sizes)

    if C >= LONG and aligned(C):
        return None
    bound = R
    for s in L.walk(loop.body):
        exprs = ()
        if isinstance(s, (L.Load, L.Store)) and s.buf not in whole:
            exprs = s.index
        elif isinstance(s, L.IndexValue):
            exprs = (s.expr,)
        for e in exprs:
            if c in L.index_vars(e):
                return None
            ks = _row_divisors(e, r)
            if ks is None:
                return None
            for k in ks:
                bound = math.gcd(bound, k)
    choices = [m for m in _divisors(bound) if m > 1 and m * C <= MERGED_MAX and R // m >= MERGED_MIN_ROWS
               and m * C >= SHORT and (aligned(m * C) or not aligned(C))]
    if not choices:
        return None
    m = max(choices, key=lambda m: (aligned(m * C), m))

    def moved(s):
        if isinstance(s, (L.Load, L.Store)):
            index = (L.Var(r), L.Var(c)) if s.buf in whole else tuple(_merged_index(e, r, m) for e in s.index)
            return replace(s, index=index)
        if isinstance(s, L.IndexValue):
            return replace(s, expr=_merged_index(s.expr, r, m))
        return s

    new_inner = replace(inner, extent=m * C, body=tuple(moved(s) for s in inner.body))
    new = replace(loop, extent=R // m, body=tuple(moved(s) for s in head) + (new_inner,))
    params = tuple(replace(b, shape=(R // m, m * C)) if b.name in whole else b for b in kernel.params)
    return replace(kernel, params=params, body=(new,))


# ---------------------------------------------------------------- split rows

SPLIT_MAX_ROWS = 512  # kernels of fewer rows than this split them (as MERGED_MIN_ROWS: CTAs for every SM)
SPLIT_MIN = 256       # a piece's elements, at least
SPLIT_MAX = 4096      # ... and at most


def split_enabled() -> bool:
    """TILEFUSE_SPLIT=0 keeps few long rows whole: map kernels here, reductions in
    rewrites.split_long_reductions (for A/B runs)."""
    return env.switch("TILEFUSE_SPLIT")


def split_rows(kernel: L.Kernel) -> L.Kernel | None:
    """The kernel with each of its few long rows cut into pieces of K (K divides the row), or None.

    A kernel's CTAs take whole rows, so a map over one row of 16M elements (`expm1(x * 2 + 1)`
    over a 1-D tensor) ran in one CTA: 1106 us where torch.compile took 24 (H200, session 60).
    Cut into rows of K, row r, column c of the old walk is row r' // P, column (r' % P) K + c'
    (P = C / K pieces a row): the row-level values stay row-level (a piece lies in one row), the
    whole tensors are viewed as [R P, K]. K is a divisor of C in [SPLIT_MIN, SPLIT_MAX] whose
    bytes are whole 16-byte chunks, the preferred K_CHOICES first, then the largest; where none
    is, the largest divisor (a row of 999999 as rows of 3861)."""
    found = _maps_alone(kernel) if split_enabled() else None
    if found is None:
        return None
    loop, head, inner, whole = found
    r, c, R, C = loop.var, inner.var, loop.extent, inner.extent
    if R >= SPLIT_MAX_ROWS or C < 4 * SPLIT_MAX:  # (a row of 16k elements is work enough for a CTA)
        return None
    sizes = [kernel.buffer(b).dtype for b in sorted(whole)]
    divisors = [k for k in range(SPLIT_MIN, min(SPLIT_MAX, C // 2) + 1) if C % k == 0]
    ok = [k for k in divisors if all(k * dtypes.itemsize(d) % 16 == 0 for d in sizes)]
    if not divisors:
        return None
    # (pieces whose bytes are no whole 16-byte chunks read narrower, but many CTAs beat one)
    K = next((k for k in K_CHOICES if k in ok), max(ok or divisors))
    P = C // K
    sub = {r: L.IBin("//", L.Var(r), L.IConst(P)),
           c: L.IBin("+", L.IBin("*", L.IBin("%", L.Var(r), L.IConst(P)), L.IConst(K)), L.Var(c))}

    head_sub = {r: sub[r]}  # (the head reads no column)
    new_inner = replace(inner, extent=K, body=tuple(_moved(s, whole, r, c, sub) for s in inner.body))
    new = replace(loop, extent=R * P, body=tuple(_moved(s, whole, r, c, head_sub) for s in head) + (new_inner,))
    params = tuple(replace(b, shape=(R * P, K)) if b.name in whole else b for b in kernel.params)
    return replace(kernel, params=params, body=(new,))

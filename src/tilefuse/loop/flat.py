"""A kernel of maps alone over short rows, walked as rows of K elements of the whole tensor.

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

import os
from dataclasses import replace

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
    """s reads or writes a buffer of [R, C] at [r, c]."""
    b = kernel.buffer(s.buf)
    return (tuple(b.shape) == (R, C) and len(s.index) == 2 and s.index[0] == L.Var(r) and s.index[1] == L.Var(c))


def wanted(C: int) -> bool:
    """Rows worth walking flat: shorter than SHORT."""
    return C < SHORT


def enabled() -> bool:
    """TILEFUSE_FLAT_ROWS=0 keeps every map kernel's rows (for A/B runs)."""
    return os.environ.get("TILEFUSE_FLAT_ROWS", "1") != "0"


def flat_rows(kernel: L.Kernel) -> L.Kernel | None:
    """The kernel walked as rows of K (its new row loop's extent), or None where it is not a kernel of maps alone whose
    written tensors and streamed inputs all lie row after row, or no K divides its size. Not for
    a gather (`table[idx[r], c]`: a row's elements stay one gathered run, not a load apiece)."""
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

    def moved(s):
        if isinstance(s, (L.Load, L.Store)):
            index = (L.Var(r), L.Var(c)) if s.buf in whole else tuple(_simplified(_subst(e, sub)) for e in s.index)
            return replace(s, index=index)
        if isinstance(s, L.IndexValue):
            return replace(s, expr=_simplified(_subst(s.expr, sub)))
        return s

    body = (pos,) + tuple(moved(s) for s in (*head, *inner.body))
    params = tuple(replace(b, shape=(N // K, K)) if b.name in whole else b for b in kernel.params)
    new = L.Loop(r, N // K, (L.Loop(c, K, body),), parallel=True)
    return replace(kernel, params=params, body=(new,))

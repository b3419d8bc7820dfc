"""Where a chain of Graph IR views reads its source: a Loop IR index expression.

A GEMM epilogue may read an operand that is a chain of views (reshape, expand, permute, slice)
of a smaller tensor: the RoPE tables (S, D/2) viewed as (B, S, H*D/2), repeated over heads and
batch, or a bias broadcast through an expand. Reading the small tensor at the composed index
instead of a materialised copy of the view keeps it small enough to stay in L2 (the 7B layer's
tables at S = 8192: 1 MB each in bf16, against 32 MB for a copy repeated over 32 heads).

While composing, an index is a sum of terms (coefficient * atom, an atom being a loop variable,
a gather's index value (its range known: a gather's table read through views, loop/lower.py), or
a `//` or `%` of a sum by a constant) with the loop variables' ranges known, so that the
divisions and remainders each reshape spells out cancel where they can: the RoPE table at
output element (m, n) is read at (m % S, n % (D/2)), and at (m, n % (D/2)) when m < S, not
through the nested expression the three views spell out. Every index is non-negative (views
have non-negative strides and offsets), so floor division is C's truncating division here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..graph import ir as g_ir
from ..graph.contraction import view_chain
from . import ir as L


@dataclass(frozen=True)
class _Sum:
    """sum(coef * atom) + const; an atom is a loop variable's name or (op, _Sum, divisor) with
    op "//" or "%". Terms are sorted (largest coefficient first) so equal sums are equal."""

    terms: tuple = ()
    const: int = 0


def _sum(terms: dict, const: int = 0) -> _Sum:
    if any(c < 0 for c in terms.values()) or const < 0:
        raise ValueError("view indices have non-negative coefficients")
    kept = [(a, c) for a, c in terms.items() if c]
    return _Sum(tuple(sorted(kept, key=lambda t: (-t[1], repr(t[0])))), const)


def _add(*xs: _Sum) -> _Sum:
    terms: dict = {}
    for x in xs:
        for a, c in x.terms:
            terms[a] = terms.get(a, 0) + c
    return _sum(terms, sum(x.const for x in xs))


def _scale(x: _Sum, k: int) -> _Sum:
    return _sum({a: c * k for a, c in x.terms}, x.const * k)


def _const(c: int) -> _Sum:
    return _Sum((), c)


def _bounds(x: _Sum, ext: dict) -> tuple[int, int]:
    lo = hi = x.const
    for a, c in x.terms:
        if isinstance(a, str):
            alo, ahi = 0, ext[a] - 1
        elif isinstance(a, L.Val):  # a gather's index, in [0, its extent)
            alo, ahi = 0, ext[a.name] - 1
        else:
            op, y, k = a
            ylo, yhi = _bounds(y, ext)
            alo, ahi = (ylo // k, yhi // k) if op == "//" else (0, min(yhi, k - 1))
        lo, hi = lo + c * alo, hi + c * ahi
    return lo, hi


def _divmod(x: _Sum, k: int, op: str, ext: dict) -> _Sum:
    """x // k or x % k, simplified."""
    if k == 1:
        return x if op == "//" else _const(0)
    # whole multiples of k come out exactly: (k q + r) // k = q + r // k, (k q + r) % k = r % k
    q = _sum({a: c // k for a, c in x.terms}, x.const // k)
    r = _sum({a: c % k for a, c in x.terms}, x.const % k)
    rest = _small(r, k, op, ext)
    return _add(q, rest) if op == "//" else rest


def _small(r: _Sum, k: int, op: str, ext: dict) -> _Sum:
    """r // k or r % k for r whose coefficients are below k: when r = g * big + small with g
    dividing k and 0 <= small < g (the largest terms a multiple of g, the rest provably below
    it), r // k = big // (k / g) and r % k = g * (big % (k / g)) + small; else an atom."""
    terms = r.terms
    for i in range(len(terms) + 1):
        g = math.gcd(k, *(c for _, c in terms[:i]))
        if g == 1:
            break
        small = _Sum(terms[i:], r.const % g)
        lo, hi = _bounds(small, ext)
        if 0 <= lo and hi < g:
            big = _sum({a: c // g for a, c in terms[:i]}, r.const // g)
            if op == "//":
                return _divmod(big, k // g, "//", ext)
            return _add(_scale(_divmod(big, k // g, "%", ext), g), small)
    return _sum({(op, r, k): 1})


def _of_index(e: L.Index, ext: dict | None = None) -> _Sum:
    """`e` as a _Sum; with the loop variables' extents, `//` and `%` by constants too (a row
    kernel's coordinates of its merged row variable)."""
    if isinstance(e, L.Var):
        return _sum({e.name: 1})
    if isinstance(e, L.Val) and ext is not None and e.name in ext:
        return _sum({e: 1})
    if isinstance(e, L.IConst):
        return _const(e.value)
    if isinstance(e, L.IBin) and e.op == "+":
        return _add(_of_index(e.a, ext), _of_index(e.b, ext))
    if isinstance(e, L.IBin) and e.op == "*" and isinstance(e.a, L.IConst):
        return _scale(_of_index(e.b, ext), e.a.value)
    if isinstance(e, L.IBin) and e.op == "*" and isinstance(e.b, L.IConst):
        return _scale(_of_index(e.a, ext), e.b.value)
    if isinstance(e, L.IBin) and e.op in ("//", "%") and isinstance(e.b, L.IConst) and ext is not None:
        return _divmod(_of_index(e.a, ext), e.b.value, e.op, ext)
    raise ValueError(f"not an affine index of loop variables: {e}")


def _to_index(x: _Sum) -> L.Index:
    parts = []
    for a, c in x.terms:
        atom = (L.Var(a) if isinstance(a, str) else a if isinstance(a, L.Val)
                else L.IBin(a[0], _to_index(a[1]), L.IConst(a[2])))
        parts.append(atom if c == 1 else L.IBin("*", L.IConst(c), atom))
    if x.const or not parts:
        parts.append(L.IConst(x.const))
    out = parts[0]
    for p in parts[1:]:
        out = L.IBin("+", out, p)
    return out


def _reshape(x: list, shape, to, ext: dict) -> list:
    """Coordinates `x` of an element of `shape`, as coordinates of the same element (in row-major
    order) of `to`."""
    lin, stride = _const(0), 1
    for e, n in reversed(list(zip(x, shape))):
        lin, stride = _add(lin, _scale(e, stride)), stride * n
    out = []
    stride = math.prod(to)
    for j, n in enumerate(to):
        stride //= n
        if n == 1:
            out.append(_const(0))
            continue
        e = _divmod(lin, stride, "//", ext)
        out.append(e if j == 0 else _divmod(e, n, "%", ext))
    return out


def _back(n: g_ir.View, x: list, src: tuple, ext: dict) -> list:
    """Coordinates in n's argument (of shape `src`) of n's element at `x`."""
    if n.op == "reshape":
        return _reshape(x, n.type.shape, src, ext)
    if n.op == "expand":  # broadcast dims (size 1 in the argument) read index 0
        off = len(x) - len(src)
        return [_const(0) if s == 1 else x[off + i] for i, s in enumerate(src)]
    if n.op == "permute":  # dim i of the view is dim perm[i] of its argument
        out = [None] * len(src)
        for i, p in enumerate(n.params):
            out[p] = x[i]
        return out
    if n.op == "slice":
        dim, start, _, step = n.params
        dim %= len(src)
        return [_add(_const(start), _scale(e, step)) if i == dim else e for i, e in enumerate(x)]
    if n.op == "roll":  # element i of the view is element (i + shift) % size of its argument
        dim, shift = n.params
        dim %= len(src)
        return [_divmod(_add(e, _const(shift)), src[dim], "%", ext) if i == dim else e for i, e in enumerate(x)]
    raise ValueError(f"cannot read through view {n.op}")


def along_last_dim(g: g_ir.Graph, name: str, until: str) -> bool:
    """Whether every view from `name` down to `until` only moves elements along the last dim
    (slices and rolls of it): its rows are `until`'s rows, in order."""
    for v in view_chain(g, name):
        if v == until:
            return True
        n = g[v]
        rank = len(n.type.shape)
        if n.op not in ("slice", "roll") or n.params[0] % rank != rank - 1:
            return False
    return True


def read_index(g: g_ir.Graph, name: str, shape: tuple[int, ...], index: tuple[L.Index, ...],
               extents: dict[str, int], until: str | None = None, rows: bool = False) -> tuple[L.Index, ...]:
    """The index into the tensor under `name`'s chain of views (`view_chain`; or the tensor
    `until` in it) of element `index` of `name` reshaped to `shape` (the layout the reader
    indexes it in), `index` affine in loop variables of the given extents (or their `//` and
    `%` by constants).

    rows (a chain `along_last_dim`): into that tensor viewed as (rows, last dim), the same row
    and the last dim's index moved through the slices and rolls. A kernel whose rows are a
    prompt's tokens then reads it without the prompt's length in its index (one source serves
    every length: codegen.mapreduce.rows_free)."""
    t = g[name].type
    if math.prod(shape) != t.numel:
        raise ValueError(f"{name} ({t}) cannot be read as {list(shape)}")
    lead = math.prod(t.shape[:-1])
    x = _reshape([_of_index(e, extents) for e in index], shape, (lead, t.shape[-1]) if rows else t.shape, extents)
    for v in view_chain(g, name):
        if v == until:
            break
        n = g[v]
        if rows:  # the same view on the last of two dims
            n, src = g_ir.View(n.name, n.type, n.op, n.arg, (1,) + tuple(n.params[1:])), (lead, g[n.arg].type.shape[-1])
        else:
            src = g[n.arg].type.shape
        x = _back(n, x, src, extents)
    return tuple(_to_index(e) for e in x)

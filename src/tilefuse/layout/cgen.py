"""From layouts to C index expressions: the one place CUDA templates get index formulas.

    c_index(Layout((8, 64), (64, 1)), ("row", "col"))  ->  "row * 64 + col"
    c_index(Sw<3,3,3> o (8,64):(64,1), ("row", "col"))
        ->  "((row * 64 + col) ^ (((row * 64 + col) >> 3) & 0x38))"

Coordinates are C expressions (str), ints (folded into the constant), or tuples for the
sub-modes of a nested mode. A single expression against a nested mode is split into that
mode's digits (i / 2 % 4 ...). Expressions assume in-range, non-negative coordinates.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .inttuple import crd2idx, flatten, is_int, is_tuple, to_str
from .layout import Layout, coalesce

_IDENT = re.compile(r"^[A-Za-z_][\w.]*$|^\d+$")


@dataclass(frozen=True)
class Term:
    """coeff * expr, where expr takes values in [0, extent)."""

    expr: str
    coeff: int
    extent: int


def _is_atom(e: str) -> bool:
    if _IDENT.match(e):
        return True
    if not (e.startswith("(") and e.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(e):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i < len(e) - 1:
            return False
    return True


def atom(e: str) -> str:
    """e, parenthesized unless it already is one operand."""
    return e if _is_atom(e) else f"({e})"


def _pow2(n: int) -> int | None:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


def _digit(sym: str, divisor: int, extent: int | None, shifts: bool) -> str:
    e = atom(sym)
    if divisor > 1:
        k = _pow2(divisor)
        e = f"({atom(e)} >> {k})" if shifts and k is not None else f"{atom(e)} / {divisor}"
    if extent is not None:
        k = _pow2(extent)
        # e is an operand or "operand / n"; % binds like / (left to right), so no parens
        e = f"({atom(e)} & {extent - 1})" if shifts and k is not None else f"{e} % {extent}"
    return e


def terms(layout: Layout, coords, shifts: bool = False) -> tuple[list[Term], int]:
    """The linear terms and constant of layout(coords)."""
    out: list[Term] = []
    const = _collect(coords, layout.shape, layout.stride, out, shifts)
    merged: dict[str, Term] = {}
    for t in out:
        if t.expr in merged:
            old = merged[t.expr]
            merged[t.expr] = Term(t.expr, old.coeff + t.coeff, old.extent)
        else:
            merged[t.expr] = t
    return [t for t in merged.values() if t.coeff], const


def _collect(crd, shape, stride, out, shifts) -> int:
    if is_tuple(crd):
        if not is_tuple(shape) or len(crd) != len(shape):
            raise ValueError(f"coordinates {crd!r} do not fit shape {to_str(shape)}")
        return sum(_collect(c, s, d, out, shifts) for c, s, d in zip(crd, shape, stride))
    if is_int(crd):
        return crd2idx(crd, shape, stride)
    if not isinstance(crd, str):
        raise TypeError(f"a coordinate is a C expression (str), an int or a tuple, not {crd!r}")
    fl = coalesce(Layout(shape, stride))
    leaves = list(zip(flatten(fl.shape), flatten(fl.stride)))
    divisor = 1
    for k, (s, d) in enumerate(leaves):
        last = k == len(leaves) - 1
        if s > 1 and d != 0:
            out.append(Term(_digit(crd.strip(), divisor, None if last else s, shifts), d, s))
        divisor *= s
    return 0


def render(ts: list[Term], const: int = 0) -> str:
    """Sum of terms as C: 'row * 64 + col + 8'."""
    parts = []
    for t in ts:
        body = t.expr if abs(t.coeff) == 1 else f"{atom(t.expr)} * {abs(t.coeff)}"
        parts.append(("-" if t.coeff < 0 else "+", body))
    if const or not parts:
        parts.append(("-" if const < 0 else "+", str(abs(const))))
    sign, first = parts[0]
    text = f"-{atom(first)}" if sign == "-" else first
    for sign, body in parts[1:]:
        text += f" {sign} {body}"
    return text


def c_swizzle(expr: str, swizzle) -> str:
    """C for Swizzle<B,M,S> applied to expr: x ^ ((x >> S) & mask), parenthesized."""
    if swizzle.bits == 0:
        return expr
    x = atom(expr)
    if swizzle.shift >= 0:
        moved = f"({x} >> {swizzle.shift})"
    else:
        moved = f"({x} << {-swizzle.shift})"
    return f"({x} ^ ({moved} & {hex(swizzle.target_mask)}))"


def c_index(layout, coords, *, shifts: bool = False) -> str:
    """C expression for layout(coords), simplified; swizzled layouts give the XOR form.

    shifts=True writes power-of-two / and % as >> and & (for signed indices in CUDA,
    where the compiler cannot assume non-negative values).
    """
    if getattr(layout, "is_composed", False):
        inner = c_index(layout.inner, coords, shifts=shifts)
        if layout.offset:
            inner = f"{inner} + {layout.offset}"
        outer = layout.outer
        if getattr(outer, "is_swizzle", False):
            return c_swizzle(inner, outer)
        if isinstance(outer, Layout):
            return c_index(outer, inner, shifts=shifts)
        raise TypeError(f"c_index: cannot render outer function {outer}")
    return render(*terms(layout, coords, shifts))


def c_function(name: str, layout, params=("row", "col"), index_type: str = "int") -> str:
    """A __device__ function computing the layout, for a template to paste in."""
    args = ", ".join(f"{index_type} {p}" for p in params)
    crd = params[0] if len(params) == 1 else tuple(params)
    return (f"// {layout}\n"
            f"__device__ __forceinline__ {index_type} {name}({args}) {{\n"
            f"  return {c_index(layout, crd)};\n}}\n")


def c_tv_coords(fragment, thread: str, value: int) -> tuple[str, str]:
    """(row, col) C expressions of register `value` of the thread named `thread`.

    Terms of the (thread, value) -> index map that only move along rows or only along
    columns are split exactly; otherwise this falls back to index % rows and index / rows.
    """
    rows = fragment.tile[0]
    ts, const = terms(fragment.tv, (thread, value))
    row_t, col_t = [], []
    row_max = const % rows
    for t in ts:
        if t.coeff % rows == 0:
            col_t.append(Term(t.expr, t.coeff // rows, t.extent))
        elif 0 < t.coeff < rows:
            row_t.append(t)
            row_max += t.coeff * (t.extent - 1)
        else:
            row_max = rows  # force the fallback
    if row_max < rows:
        return render(row_t, const % rows), render(col_t, const // rows)
    index = render(ts, const)
    return f"{atom(index)} % {rows}", f"{atom(index)} / {rows}"

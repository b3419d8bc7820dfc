"""Swizzle<B,M,S>, composed layouts (swizzle o offset o layout), and changing element width.

Swizzle<B,M,S> XORs the B bits starting at bit M+S into the B bits starting at bit M:
it permutes groups of 2^M contiguous elements (keeping the low M bits), which is how
shared-memory tiles avoid bank conflicts. The 128-byte swizzle of Hopper/Ampere tiles is
Swizzle<3,4,3> on byte offsets, i.e. Swizzle<3,3,3> on 16-bit element offsets.
"""
from __future__ import annotations

import functools

import re
from dataclasses import dataclass

from .inttuple import flatten, has_none, is_int, is_tuple, shape_div, to_str
from .layout import Layout, composition, parse_layout, size, slice_and_offset, unflatten


@dataclass(frozen=True)
class Swizzle:
    bits: int   # B: how many bits are XORed
    base: int   # M: low bits kept as is (log2 of the contiguous group)
    shift: int  # S: distance from the source bits to the target bits

    is_swizzle = True

    def __post_init__(self):
        if self.bits < 0 or self.base < 0:
            raise ValueError(f"Swizzle<{self.bits},{self.base},{self.shift}>: B and M must be >= 0")
        if abs(self.shift) < self.bits:
            raise ValueError(
                f"Swizzle<{self.bits},{self.base},{self.shift}>: |S| must be >= B "
                f"(source and target bits would overlap; the swizzle would not be a bijection)"
            )

    @property
    def source_mask(self) -> int:
        """The bits that are read (the 'yyy' bits)."""
        return ((1 << self.bits) - 1) << (self.base + max(0, self.shift))

    @property
    def target_mask(self) -> int:
        """The bits that are flipped (the 'zzz' bits)."""
        return ((1 << self.bits) - 1) << (self.base - min(0, self.shift))

    def __call__(self, x: int) -> int:
        if self.shift >= 0:
            return x ^ ((x & self.source_mask) >> self.shift)
        return x ^ ((x & self.source_mask) << -self.shift)

    def __str__(self):
        return f"Sw<{self.bits},{self.base},{self.shift}>"

    def __repr__(self):
        return f"Swizzle({self.bits}, {self.base}, {self.shift})"


@dataclass(frozen=True)
class ComposedLayout:
    """outer(offset + inner(c)): usually a Swizzle over a plain layout."""

    outer: object
    offset: int
    inner: Layout

    is_composed = True

    def __call__(self, *crd):
        crd = crd[0] if len(crd) == 1 else tuple(crd)
        if has_none(crd):
            sub, off = slice_and_offset(crd, self.inner)
            return ComposedLayout(self.outer, self.offset + off, sub)
        return self.outer(self.offset + self.inner(crd))

    @property
    def shape(self):
        return self.inner.shape

    def __getitem__(self, i):
        return self.with_inner(self.inner[i])

    def with_inner(self, inner) -> "ComposedLayout":
        return ComposedLayout(self.outer, self.offset, inner)

    def compose(self, b) -> "ComposedLayout":
        """(outer o offset o inner) o b == outer o offset o (inner o b)."""
        return self.with_inner(composition(self.inner, b))

    def cosize(self) -> int:
        return _composed_cosize(self)

    def __str__(self):
        mid = f" o {self.offset}" if self.offset else ""
        return f"{self.outer}{mid} o {self.inner}"

    def __repr__(self):
        return f"ComposedLayout({self.outer!r}, {self.offset}, {self.inner!r})"


@functools.lru_cache(maxsize=4096)
def _composed_cosize(layout: ComposedLayout) -> int:
    """1 + the largest index the layout reaches. A swizzle has no closed form here, so every
    index is evaluated; layouts are immutable, so each one is evaluated once per process (a
    GEMM's render asks for its shared-memory tiles' sizes several times)."""
    return 1 + max(layout(i) for i in range(size(layout.inner)))


def make_swizzled(swizzle: Swizzle, layout: Layout, offset: int = 0) -> ComposedLayout:
    return ComposedLayout(swizzle, offset, layout)


# ------------------------------------------------------------------ element width


def _log2(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return n.bit_length() - 1


def upcast(x, n: int):
    """Same memory seen as elements n times wider: index i becomes i // n.
    A stride-1 mode shrinks by n; larger strides are divided by n."""
    if isinstance(x, Swizzle):
        k = _log2(n)
        if x.base < k:
            raise ValueError(f"upcast {x} by {n}: the swizzle keeps only {x.base} low bits")
        return Swizzle(x.bits, x.base - k, x.shift)
    if getattr(x, "is_composed", False):
        if x.offset % n:
            raise ValueError(f"upcast {x} by {n}: offset {x.offset} is not a multiple of {n}")
        return ComposedLayout(upcast(x.outer, n), x.offset // n, upcast(x.inner, n))
    if isinstance(x, Layout):
        pairs = [_upcast_leaf(s, d, n, x) for s, d in zip(flatten(x.shape), flatten(x.stride))]
        return _relayout(pairs, x.shape)
    raise TypeError(f"upcast: not a layout: {x!r}")


def _upcast_leaf(s, d, n, layout):
    if d == 0:
        return s, 0
    if abs(d) >= n:
        if d % n:
            raise ValueError(f"upcast {layout} by {n}: stride {d} is not a multiple of {n}")
        return s, d // n
    if n % abs(d):
        raise ValueError(f"upcast {layout} by {n}: stride {d} does not divide {n}")
    try:
        return shape_div(s, n // abs(d)), 1 if d > 0 else -1
    except ValueError:
        raise ValueError(f"upcast {layout} by {n}: mode {s}:{d} does not hold whole "
                         f"{n}-element groups") from None


def downcast(x, n: int):
    """Same memory seen as elements n times narrower: stride-1 modes grow by n,
    other strides are multiplied by n."""
    if isinstance(x, Swizzle):
        return Swizzle(x.bits, x.base + _log2(n), x.shift)
    if getattr(x, "is_composed", False):
        return ComposedLayout(downcast(x.outer, n), x.offset * n, downcast(x.inner, n))
    if isinstance(x, Layout):
        pairs = [(s * n, d) if abs(d) == 1 else (s, d * n)
                 for s, d in zip(flatten(x.shape), flatten(x.stride))]
        return _relayout(pairs, x.shape)
    raise TypeError(f"downcast: not a layout: {x!r}")


def recast(x, old_bits: int, new_bits: int):
    """View a layout of old_bits-wide elements as one of new_bits-wide elements."""
    if new_bits == old_bits:
        return x
    if new_bits > old_bits:
        if new_bits % old_bits:
            raise ValueError(f"recast: {new_bits} bits is not a multiple of {old_bits} bits")
        return upcast(x, new_bits // old_bits)
    if old_bits % new_bits:
        raise ValueError(f"recast: {old_bits} bits is not a multiple of {new_bits} bits")
    return downcast(x, old_bits // new_bits)


def _relayout(pairs, profile) -> Layout:
    """Layout from flat (shape, stride) leaves, nested like `profile`."""
    return Layout(unflatten([p[0] for p in pairs], profile), unflatten([p[1] for p in pairs], profile))


# ------------------------------------------------------------------ text

_SWIZZLE = re.compile(r"^\s*Sw(?:izzle)?\s*<\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*>\s*$")
_COMPOSE = re.compile(r"\s*(?:\bo\b|\u2218)\s*")


def parse_swizzle(text: str) -> Swizzle:
    """'Sw<3,3,3>' (or 'Swizzle<3,3,3>', or '3,3,3') -> Swizzle(3, 3, 3)."""
    m = _SWIZZLE.match(text)
    if m:
        return Swizzle(*(int(g) for g in m.groups()))
    parts = text.split(",")
    if len(parts) == 3:
        try:
            return Swizzle(*(int(p) for p in parts))
        except ValueError:
            pass
    raise ValueError(f"not a swizzle: {text!r} (expected Sw<B,M,S> or B,M,S)")


def parse(text: str):
    """Layout or composed layout from its printed form:
    '(8,64):(64,1)', 'Sw<3,3,3> o (8,64):(64,1)', 'Sw<3,3,3> o 32 o (8,64):(64,1)'."""
    parts = _COMPOSE.split(text.strip())
    if len(parts) == 1:
        return parse_layout(parts[0])
    if len(parts) not in (2, 3):
        raise ValueError(f"expected 'outer o [offset o] layout', got {text!r}")
    outer_text = parts[0]
    outer = parse_swizzle(outer_text) if outer_text.lstrip().startswith("Sw") else parse_layout(outer_text)
    offset = int(parts[1].strip().lstrip("_")) if len(parts) == 3 else 0
    return ComposedLayout(outer, offset, parse_layout(parts[-1]))


def to_text(x) -> str:
    """Printed form of a layout, composed layout, swizzle or IntTuple."""
    if is_int(x) or is_tuple(x):
        return to_str(x)
    return str(x)

"""Hopper (sm_90) shared-memory tiles: GMMA layout atoms, the TMA swizzle mode, and the
wgmma matrix-descriptor fields, all read off the layout rather than written by hand.

Layouts here map an (MN, K) element coordinate to an element offset in shared memory.
K-major means K is the contiguous dimension (row-major A of an M x K matrix), MN-major
means M (or N) is. An atom is 8 rows of `swizzle_bytes` bytes (16 bytes when not swizzled,
the "interleaved" core matrix), swizzled by Swizzle<B,4,3> on byte offsets.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache

from .inttuple import product_each
from .layout import Layout, cosize, tile_to_shape
from .swizzle import ComposedLayout, Swizzle, upcast

SWIZZLE_BITS = {0: 0, 32: 1, 64: 2, 128: 3}  # swizzle bytes -> B of Swizzle<B,4,3> on bytes


class TmaSwizzle(IntEnum):
    """CUtensorMapSwizzle values."""

    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3


class GmmaLayoutType(IntEnum):
    """The 2-bit layout_type field of an sm_90 wgmma matrix descriptor."""

    INTERLEAVE = 0
    B128 = 1
    B64 = 2
    B32 = 3


_TYPE_OF_BITS = {0: GmmaLayoutType.INTERLEAVE, 1: GmmaLayoutType.B32,
                 2: GmmaLayoutType.B64, 3: GmmaLayoutType.B128}


def _elem_bytes(elem_bits: int) -> int:
    if elem_bits not in (8, 16, 32):
        raise ValueError(f"GMMA shared-memory layouts take 8-, 16- or 32-bit elements, not {elem_bits}")
    return elem_bits // 8


def _check_major(major: str) -> str:
    if major not in ("K", "MN"):
        raise ValueError(f"major must be 'K' or 'MN', not {major!r}")
    return major


def gmma_atom(major: str, swizzle_bytes: int, elem_bits: int) -> ComposedLayout:
    """The smallest (MN, K) tile a wgmma operand layout repeats, in elements.

    gmma_atom("K", 128, 16) == Sw<3,3,3> o (8,64):(64,1)   (bf16/fp16 SW128, K-major)
    gmma_atom("MN", 128, 16) == Sw<3,3,3> o (64,8):(1,64)
    """
    _check_major(major)
    if swizzle_bytes not in SWIZZLE_BITS:
        raise ValueError(f"swizzle_bytes must be one of 0 (interleave), 32, 64, 128; got {swizzle_bytes}")
    eb = _elem_bytes(elem_bits)
    width = (16 << SWIZZLE_BITS[swizzle_bytes]) // eb  # elements in one 8-row line
    swizzle = upcast(Swizzle(SWIZZLE_BITS[swizzle_bytes], 4, 3), eb)
    inner = Layout((8, width), (width, 1)) if major == "K" else Layout((width, 8), (1, width))
    return ComposedLayout(swizzle, 0, inner)


def gmma_smem_layout(major: str, swizzle_bytes: int, elem_bits: int, tile_shape) -> ComposedLayout:
    """A whole (MN, K) shared-memory tile: the atom repeated MN first, then K."""
    return tile_to_shape(gmma_atom(major, swizzle_bytes, elem_bits), tile_shape)


def _split(layout):
    """(swizzle, offset, inner layout) of a plain or swizzled layout."""
    if isinstance(layout, Layout):
        return Swizzle(0, 4, 3), 0, layout
    if getattr(layout, "is_composed", False) and isinstance(layout.outer, Swizzle):
        return layout.outer, layout.offset, layout.inner
    raise TypeError(f"expected a Layout or a swizzled layout, got {layout}")


def swizzle_bytes(layout, elem_bits: int) -> int:
    """0, 32, 64 or 128: the byte swizzle span of a shared-memory layout.

    The layout's swizzle, seen on byte offsets, must be Swizzle<B,4,3> (16-byte chunks
    permuted within 2^B of them, by the row index); anything else is not a TMA/GMMA swizzle.
    """
    sw, _, _ = _split(layout)
    if sw.bits == 0:
        return 0
    eb = _elem_bytes(elem_bits)
    byte_base = sw.base + (eb.bit_length() - 1)
    if byte_base != 4 or sw.shift != 3 or sw.bits > 3:
        raise ValueError(
            f"{layout} with {elem_bits}-bit elements: the swizzle is Sw<{sw.bits},{byte_base},"
            f"{sw.shift}> on bytes, but TMA and wgmma only know Sw<1|2|3,4,3> on bytes"
        )
    return 16 << sw.bits


def tma_swizzle(layout, elem_bits: int) -> TmaSwizzle:
    """The CUtensorMapSwizzle a TMA copy into this layout must use."""
    return TmaSwizzle(SWIZZLE_BITS[swizzle_bytes(layout, elem_bits)])


def tma_box(layout, major: str, elem_bits: int) -> tuple[int, int]:
    """TMA box (inner, outer) extents, contiguous dimension first, for one load of the tile.

    A swizzled box may be at most one swizzle span wide (the span is the unit the hardware
    swizzles), so a wider K-major tile takes several boxes along K.
    """
    _check_major(major)
    eb = _elem_bytes(elem_bits)
    mn, k = product_each(layout.shape)
    contiguous, other = (k, mn) if major == "K" else (mn, k)
    span = swizzle_bytes(layout, elem_bits)
    inner = contiguous if span == 0 else min(contiguous, span // eb)
    return inner, other


@dataclass(frozen=True)
class GmmaDescriptor:
    """wgmma shared-memory matrix descriptor fields (byte values, before >> 4)."""

    layout_type: GmmaLayoutType
    lbo: int  # leading dimension byte offset
    sbo: int  # stride dimension byte offset

    def encode(self, start_address: int = 0, base_offset: int = 0) -> int:
        """The 64-bit descriptor: start>>4 [0,14), lbo>>4 [16,30), sbo>>4 [32,46),
        base_offset [49,52), layout_type [62,64)."""
        return (((start_address >> 4) & 0x3FFF)
                | ((self.lbo >> 4) & 0x3FFF) << 16
                | ((self.sbo >> 4) & 0x3FFF) << 32
                | (base_offset & 0x7) << 49
                | int(self.layout_type) << 62)

    def __str__(self):
        return f"GmmaDescriptor({self.layout_type.name}, lbo={self.lbo}B, sbo={self.sbo}B)"


# Cached: its check walks every element of the slice through the layout (~0.1 s), and each
# GEMM render asks twice for the same few layouts.
@lru_cache(maxsize=256)
def gmma_descriptor(layout, major: str, elem_bits: int, k_bytes: int = 32) -> GmmaDescriptor:
    """Descriptor fields for a wgmma reading an (MN, k_bytes of K) slice of `layout` at (0, 0).

    LBO and SBO are measured on the layout (byte distance between core-matrix groups), then
    the whole slice is checked against the canonical form the hardware assumes with those
    values; a layout that is not of that form raises ValueError. Unused fields get 16 bytes.
    """
    _check_major(major)
    eb = _elem_bytes(elem_bits)
    _, _, inner = _split(layout)
    span = swizzle_bytes(layout, elem_bits)
    layout_type = _TYPE_OF_BITS[SWIZZLE_BITS[span]]
    mn_extent, k_extent = product_each(inner.shape)
    kdim = k_bytes // eb
    if k_extent < kdim:
        raise ValueError(f"{layout}: K extent {k_extent} is less than one wgmma K step ({kdim})")

    def f(m, k):  # pre-swizzle byte offset from the slice origin
        return (inner(m, k) - inner(0, 0)) * eb

    # The canonical form: MN in groups of `mn_group`, K in groups of `k_group` elements;
    # inside a group the hardware assumes fixed steps, between groups it takes LBO or SBO.
    t = 16 // eb  # elements per 16 bytes
    if major == "K":
        if mn_extent % 8:
            raise ValueError(f"{layout}: K-major MN extent {mn_extent} is not a multiple of 8")
        mn_group, mn_step = 8, (span or 16)             # 8 rows, span (or 16) bytes apart
        k_group, k_step = (t, eb) if span == 0 else (kdim, eb)
        mn_field, k_field = "sbo", "lbo"
    else:
        mn_group, mn_step = (t, eb) if span == 0 else (span // eb, eb)
        k_group, k_step = 8, (span or 16)
        mn_field, k_field = ("sbo", "lbo") if span == 0 else ("lbo", "sbo")
    # measured distances between groups (16 bytes, i.e. "1", where a field is unused)
    mn_gap = f(mn_group, 0) if mn_extent > mn_group else 16
    k_gap = f(0, k_group) if kdim > k_group else 16
    fields = {mn_field: mn_gap, k_field: k_gap}
    lbo, sbo = fields["lbo"], fields["sbo"]

    def canon(m, k):
        return ((m % mn_group) * mn_step + (m // mn_group) * mn_gap
                + (k % k_group) * k_step + (k // k_group) * k_gap)

    for m in range(mn_extent):
        for k in range(kdim):
            if f(m, k) != canon(m, k):
                raise ValueError(
                    f"{layout} is not a canonical {major}-major {layout_type.name} wgmma layout: "
                    f"element ({m},{k}) is at byte {f(m, k)}, the descriptor "
                    f"(lbo={lbo}, sbo={sbo}) would read byte {canon(m, k)}"
                )
    for name, value in fields.items():
        if value % 16 or not 0 <= value < (1 << 18):
            raise ValueError(f"{layout}: {name} = {value} bytes is not a 14-bit multiple of 16")
    used = [g for g, extent, group in ((mn_gap, mn_extent, mn_group), (k_gap, kdim, k_group))
            if extent > group]
    if span and any(g % (8 * span) for g in used):
        raise ValueError(f"{layout}: core-matrix groups must start on {8 * span}-byte swizzle "
                         f"atoms, but lbo={lbo}, sbo={sbo}")
    return GmmaDescriptor(layout_type, lbo, sbo)


def smem_bytes(layout, elem_bits: int) -> int:
    """Bytes of shared memory the layout spans."""
    return cosize(layout) * elem_bits // 8

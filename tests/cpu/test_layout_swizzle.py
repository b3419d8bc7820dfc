"""Swizzle<B,M,S>, composed layouts, and recasting between element widths."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.layout import (
    ComposedLayout,
    Layout,
    Swizzle,
    composition,
    downcast,
    logical_divide,
    parse,
    recast,
    size,
    tile_to_shape,
    upcast,
)

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def swizzles(draw):
    b = draw(st.integers(0, 4))
    m = draw(st.integers(0, 5))
    s = draw(st.integers(max(b, 1), 6)) * draw(st.sampled_from([1, -1]))
    return Swizzle(b, m, s)


@SETTINGS
@given(swizzles(), st.integers(0, 1 << 16))
def test_swizzle_is_an_involution_keeping_the_low_bits(sw, x):
    assert sw(sw(x)) == x
    low = (1 << sw.base) - 1
    assert sw(x) & low == x & low


@SETTINGS
@given(swizzles())
def test_swizzle_permutes_each_aligned_block(sw):
    span = 1 << (sw.bits + sw.base + abs(sw.shift))
    assert sorted(sw(x) for x in range(span)) == list(range(span))


def test_swizzle_rejects_overlapping_bits():
    with pytest.raises(ValueError, match="must be >= B"):
        Swizzle(3, 4, 2)


def test_sw128_bytes_is_sw333_on_16_bit_elements():
    byte_atom = parse("Sw<3,4,3> o (8,128):(128,1)")
    elem_atom = upcast(byte_atom, 2)
    assert str(elem_atom) == "Sw<3,3,3> o (8,64):(64,1)"
    assert recast(byte_atom, 8, 16) == elem_atom
    assert recast(elem_atom, 16, 8) == byte_atom
    # the element view and the byte view address the same bytes
    for r in range(8):
        for c in range(64):
            assert elem_atom(r, c) * 2 == byte_atom(r, 2 * c)


def test_upcast_downcast_layouts():
    assert str(upcast(Layout((8, 64), (64, 1)), 4)) == "(8,16):(16,1)"
    assert str(downcast(Layout((8, 16), (16, 1)), 4)) == "(8,64):(64,1)"
    assert str(upcast(Layout((64, 8), (1, 64)), 2)) == "(32,8):(1,32)"
    assert str(upcast(Layout((4, 8), (0, 1)), 2)) == "(4,4):(0,1)"
    with pytest.raises(ValueError):
        upcast(Layout((8, 6), (6, 1)), 4)
    with pytest.raises(ValueError):
        upcast(Swizzle(3, 1, 3), 4)


def test_composed_layout_is_swizzle_of_inner():
    sw = parse("Sw<3,3,3> o (8,64):(64,1)")
    assert sw(1, 0) == Swizzle(3, 3, 3)(64) == 72
    assert sorted(sw(i) for i in range(size(sw))) == list(range(512))
    # composition and divide act on the inner layout
    assert str(composition(sw, Layout((8, 8), (1, 8)))) == "Sw<3,3,3> o (8,8):(64,1)"
    assert str(logical_divide(sw, (8, 16))).startswith("Sw<3,3,3> o ")
    big = tile_to_shape(sw, (64, 128))
    assert str(big) == "Sw<3,3,3> o (64,(64,2)):(64,(1,4096))"
    assert sorted(big(i) for i in range(size(big))) == list(range(64 * 128))


def test_slicing_a_composed_layout_keeps_the_offset_inside_the_swizzle():
    sw = parse("Sw<3,3,3> o (8,64):(64,1)")
    row3 = sw(3, None)
    assert isinstance(row3, ComposedLayout) and row3.offset == 192
    assert [row3(c) for c in range(64)] == [sw(3, c) for c in range(64)]


def test_local_tile_and_partition_of_a_swizzled_tile_stay_exact():
    from tilefuse.layout import Layout, local_partition, local_tile

    smem = parse("Sw<3,3,3> o (128,(64,2)):(64,(1,8192))")
    tile, offset = local_tile(smem, (64, 64), (1, 1))
    assert offset == 0  # folded inside the swizzle
    assert all(tile(r, c) == smem(64 + r, 64 + c) for r in range(64) for c in range(64))
    threads = Layout((16, 8), (8, 1))
    seen = []
    for t in range(128):
        part, offset = local_partition(smem, threads, t)
        seen += [part(i) + offset for i in range(size(part))]
    assert sorted(seen) == list(range(128 * 128))

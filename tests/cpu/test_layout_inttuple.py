"""Nested int tuples, layout evaluation, slicing, and the printed form of layouts."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.layout import (
    ComposedLayout,
    Layout,
    Swizzle,
    cosize,
    crd2idx,
    depth,
    flatten,
    idx2crd,
    parse,
    prefix_product,
    product,
    rank,
    shape_div,
    size,
    slice_and_offset,
)
from tilefuse.layout.inttuple import parse_int_tuple, to_str

SETTINGS = settings(max_examples=60, deadline=None)

shapes = st.recursive(st.integers(1, 5),
                      lambda ch: st.lists(ch, min_size=1, max_size=3).map(tuple), max_leaves=5)


def test_basic_queries():
    a = parse("((2,2),3):((24,2),8)")
    assert size(a) == 12 and rank(a) == 2 and depth(a) == 2
    assert cosize(a) == 24 + 2 + 16 + 1
    assert flatten(a.shape) == (2, 2, 3) and product(a.shape) == 12
    assert prefix_product(((2, 2), 3)) == ((1, 2), 4)
    assert rank(Layout(8)) == 1 and depth(Layout(8)) == 0


def test_evaluation_by_int_and_by_coordinate():
    a = parse("(4,2):(1,4)")
    assert [a(i) for i in range(8)] == list(range(8))
    b = parse("(4,2):(2,1)")
    assert [b(i) for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert b(1, 1) == b((1, 1)) == 3
    nested = parse("((2,2),3):((1,6),2)")
    assert nested((1, 1), 2) == 1 + 6 + 4
    assert nested(3, 2) == nested((1, 1), 2)  # an int against a nested mode splits it


def test_evaluation_past_the_size_extends_the_last_mode():
    a = parse("(4,2):(1,10)")
    assert a(8) == 20 and a(9) == 21 and a(13) == 31


def test_slicing():
    a = parse("((2,3),4):((1,2),6)")
    assert str(a(None, 2)) == "(2,3):(1,2)"
    sub, off = slice_and_offset(((1, None), None), a)
    assert str(sub) == "(3,4):(2,6)" and off == 1
    assert a[0] == parse("(2,3):(1,2)") and a[1] == Layout(4, 6)


def test_shape_div():
    assert shape_div(12, 4) == 3 and shape_div(4, 12) == 1
    assert shape_div((6, 2), 2) == (3, 2) and shape_div((6, 2), 12) == (1, 1)
    with pytest.raises(ValueError):
        shape_div(6, 4)


@SETTINGS
@given(shapes, st.data())
def test_idx2crd_inverts_crd2idx(shape, data):
    stride = prefix_product(shape)
    i = data.draw(st.integers(0, product(shape) - 1))
    crd = idx2crd(i, shape)
    assert crd2idx(crd, shape, stride) == i
    assert crd2idx(i, shape, stride) == i


@pytest.mark.parametrize("text", [
    "8:1", "(4,2):(1,4)", "((2,2),3):((24,2),8)", "(4):(1)", "(8,(4,2)):(0,(1,32))",
    "Sw<3,3,3> o (8,64):(64,1)", "Sw<2,4,3> o 32 o (8,32):(32,1)",
])
def test_print_parse_round_trip(text):
    assert str(parse(text)) == text


def test_parse_accepts_cute_spellings():
    assert parse("(_8,_64):(_64,_1)") == Layout((8, 64), (64, 1))
    assert parse("( 4 , 2 ) : ( 1 , 4 )") == Layout((4, 2), (1, 4))
    assert parse("(4,2)") == Layout((4, 2), (1, 4))
    assert parse("Swizzle<3,3,3> o _0 o (8,64):(64,1)") == ComposedLayout(
        Swizzle(3, 3, 3), 0, Layout((8, 64), (64, 1)))
    with pytest.raises(ValueError):
        parse("(4,2):(1,4,8)")
    with pytest.raises(ValueError):
        parse("(4,2:(1,4)")


@SETTINGS
@given(shapes, st.data())
def test_print_parse_round_trip_random(shape, data):
    n = len(flatten(shape))
    strides = data.draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    it = iter(strides)

    def build(p):
        return tuple(build(e) for e in p) if isinstance(p, tuple) else next(it)

    a = Layout(shape, build(shape))
    assert parse(str(a)) == a
    assert parse_int_tuple(to_str(shape)) == shape

"""C index expressions generated from layouts evaluate to the layout's values."""
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.layout import (
    Layout,
    c_function,
    c_index,
    c_tv_coords,
    gmma_smem_layout,
    ldmatrix_dst,
    parse,
    sm80_16x8x16_a,
    sm80_16x8x16_c,
    sm90_64xN_c,
    size,
)
from tilefuse.layout.inttuple import idx2crd, product_each

SETTINGS = settings(max_examples=60, deadline=None)


def c_eval(expr: str, **env) -> int:
    """Evaluate a C integer expression on non-negative ints (C's / is Python's //; the
    operators used have the same relative precedence in both languages)."""
    assert re.fullmatch(r"[\w\s.+\-*/%^&|<>()x]*", expr), expr
    return eval(expr.replace("/", "//"), {"__builtins__": {}}, dict(env))


def test_row_major_tile():
    assert c_index(Layout((8, 64), (64, 1)), ("row", "col")) == "row * 64 + col"


def test_swizzled_tile_gives_the_xor_form():
    expr = c_index(parse("Sw<3,3,3> o (8,64):(64,1)"), ("row", "col"))
    assert expr == "((row * 64 + col) ^ (((row * 64 + col) >> 3) & 0x38))"


def test_constants_fold_and_nested_modes_split():
    layout = parse("((2,4),(4,4)):((1,8),(2,32))")
    assert c_index(layout, ("i", 3)) == "i % 2 + (i / 2) * 8 + 6"
    assert c_index(layout, (5, 3)) == str(layout(5, 3))
    assert c_index(layout, ((1, "j"), "k")) == "j * 8 + k % 4 * 2 + (k / 4) * 32 + 1".replace(
        "k % 4 * 2", "(k % 4) * 2")


@pytest.mark.parametrize("shifts", [False, True])
@pytest.mark.parametrize("text", [
    "(8,64):(64,1)",
    "Sw<3,3,3> o (8,64):(64,1)",
    "Sw<3,3,3> o (64,(64,2)):(64,(1,4096))",
    "Sw<2,4,3> o 32 o (8,32):(32,1)",
    "((2,4),(4,4)):((1,8),(2,32))",
    "(4,(3,5)):(15,(1,3))",
])
def test_expressions_evaluate_to_the_layout(text, shifts):
    layout = parse(text)
    rows, cols = product_each(layout.shape)
    expr = c_index(layout, ("r", "c"), shifts=shifts)
    for r in range(rows):
        for c in range(cols):
            assert c_eval(expr, r=r, c=c) == layout(r, c)
    flat = c_index(layout, "i", shifts=shifts)
    for i in range(size(layout)):
        assert c_eval(flat, i=i) == layout(i)


@st.composite
def layouts(draw):
    shape = draw(st.recursive(st.integers(1, 5),
                              lambda ch: st.lists(ch, min_size=1, max_size=3).map(tuple),
                              max_leaves=4))
    it = iter(draw(st.lists(st.integers(0, 40), min_size=16, max_size=16)))

    def build(p):
        return tuple(build(e) for e in p) if isinstance(p, tuple) else next(it)

    return Layout(shape, build(shape))


@SETTINGS
@given(layouts())
def test_random_layouts_render_exactly(layout):
    expr = c_index(layout, "idx")
    for i in range(size(layout)):
        assert c_eval(expr, idx=i) == layout(i)
    if isinstance(layout.shape, tuple):
        names = tuple(f"x{k}" for k in range(len(layout.shape)))
        expr = c_index(layout, names)
        for i in range(size(layout)):
            crd = idx2crd(i, product_each(layout.shape))
            assert c_eval(expr, **dict(zip(names, crd))) == layout(i)


@pytest.mark.parametrize("frag", [sm80_16x8x16_a(), sm80_16x8x16_c(), sm90_64xN_c(64),
                                  ldmatrix_dst(4, True)], ids=lambda f: f.name)
def test_fragment_coordinates(frag):
    for v in range(frag.values):
        row, col = c_tv_coords(frag, "tid", v)
        assert "%" not in row or "tid" in row
        for t in range(frag.threads):
            assert (c_eval(row, tid=t), c_eval(col, tid=t)) == frag(t, v)


def test_accumulator_coordinates_are_split_not_divided():
    row, col = c_tv_coords(sm90_64xN_c(128), "tid", 2)
    assert row == "tid / 4 % 8 + (tid / 32) * 16 + 8"
    assert col == "(tid % 4) * 2"


def test_c_function_for_a_template():
    src = c_function("smem_a_offset", gmma_smem_layout("K", 128, 16, (128, 64)))
    assert src.startswith("// Sw<3,3,3> o (128,64):(64,1)\n")
    assert "__device__ __forceinline__ int smem_a_offset(int row, int col)" in src
    assert "return ((row * 64 + col) ^ (((row * 64 + col) >> 3) & 0x38));" in src

"""CuTe layout algebra: worked examples, divisibility errors, and the post-conditions of
each operation (from CuTe's "02_layout_algebra") checked on random admissible layouts."""
from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilefuse.layout import (
    Layout,
    blocked_product,
    coalesce,
    compatible,
    complement,
    composition,
    cosize,
    depth,
    filter,
    flat_divide,
    flatten,
    left_inverse,
    local_partition,
    local_tile,
    logical_divide,
    logical_product,
    make_layout,
    make_ordered_layout,
    make_tv_layout,
    parse,
    product_each,
    raked_product,
    rank,
    right_inverse,
    size,
    tile_to_shape,
    tiled_divide,
    tiled_product,
    zipped_divide,
    zipped_product,
)
from tilefuse.layout.layout import unflatten

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
P = parse

# ------------------------------------------------------------------ worked examples

EXAMPLES = [
    # the table, verbatim
    ("composition", "(6,2):(8,2)", "(4,3):(3,1)", "((2,2),3):((24,2),8)"),
    ("composition", "20:2", "(5,4):(4,1)", "(5,4):(8,2)"),
    ("complement", "4:2", 24, "(2,3):(1,8)"),
    ("complement", "(2,2):(1,6)", 24, "(3,2):(2,12)"),
    ("logical_divide", "(4,2,3):(2,1,8)", "4:2", "((2,2),(2,3)):((4,1),(2,8))"),
    ("logical_product", "(2,2):(4,1)", "6:1", "((2,2),(2,3)):((4,1),(2,8))"),
    # more from the CuTe documentation
    ("composition", "(10,2):(16,4)", "(5,4):(1,5)", "(5,(2,2)):(16,(80,4))"),
    ("complement", "4:1", 24, "6:4"),
    ("complement", "6:4", 24, "4:1"),
    ("complement", "(4,6):(1,4)", 24, "1:0"),
    ("blocked_product", "(2,5):(5,1)", "(3,4):(1,3)", "((2,3),(5,4)):((5,10),(1,30))"),
    ("raked_product", "(2,5):(5,1)", "(3,4):(1,3)", "((3,2),(4,5)):((10,5),(30,1))"),
]

OPS = {
    "composition": lambda a, b: composition(P(a), P(b)),
    "complement": lambda a, b: complement(P(a), b),
    "logical_divide": lambda a, b: logical_divide(P(a), P(b)),
    "logical_product": lambda a, b: logical_product(P(a), P(b)),
    "blocked_product": lambda a, b: blocked_product(P(a), P(b)),
    "raked_product": lambda a, b: raked_product(P(a), P(b)),
}


@pytest.mark.parametrize("op,a,b,expected", EXAMPLES)
def test_worked_example(op, a, b, expected):
    assert str(OPS[op](a, b)) == expected


def test_composition_with_tiler_applies_by_mode():
    a = P("(12,(4,8)):(59,(13,1))")
    assert str(composition(a, (P("3:4"), P("8:2")))) == "(3,(2,4)):(236,(26,1))"


def test_divide_with_tiler_examples():
    a = P("(9,(4,8)):(59,(13,1))")
    tiler = (P("3:3"), P("(2,4):(1,8)"))
    assert str(logical_divide(a, tiler)) == "((3,3),((2,4),(2,2))):((177,59),((13,2),(26,1)))"
    assert str(zipped_divide(a, tiler)) == "((3,(2,4)),(3,(2,2))):((177,(13,2)),(59,(26,1)))"
    assert str(tiled_divide(a, tiler)) == "((3,(2,4)),3,(2,2)):((177,(13,2)),59,(26,1))"
    assert str(flat_divide(a, tiler)) == "(3,(2,4),3,(2,2)):(177,(13,2),59,(26,1))"


def test_coalesce_example_and_profile():
    assert str(coalesce(P("(2,(1,6)):(1,(6,2))"))) == "12:1"
    assert str(coalesce(P("((2,4),(3,5)):((1,2),(8,24))"), (1, 1))) == "(8,15):(1,8)"
    assert str(filter(P("(2,4,3):(0,1,4)"))) == "12:1"


def test_tile_to_shape_examples():
    assert str(tile_to_shape(P("(8,64):(64,1)"), (128, 64))) == "(128,64):(64,1)"
    assert str(tile_to_shape(P("(2,2):(1,2)"), (4, 6))) == "((2,2),(2,3)):((1,4),(2,8))"
    with pytest.raises(ValueError, match="not a multiple"):
        tile_to_shape(P("(8,64):(64,1)"), (128, 96))


def test_inverse_examples():
    assert str(right_inverse(P("(4,2):(2,1)"))) == "(2,4):(4,1)"
    assert str(left_inverse(P("4:2"))) == "(2,4):(4,1)"
    assert str(right_inverse(P("(2,3):(0,1)"))) == "3:2"


def test_partition_helpers():
    gmem = P("(256,128):(128,1)")
    tile, offset = local_tile(gmem, (64, 32), (1, None))
    assert str(tile) == "(64,32,4):(128,1,32)" and offset == 64 * 128
    part, offset = local_partition(P("(16,8):(8,1)"), P("(4,8):(8,1)"), 9)
    assert offset == 9 and [part(i) + offset for i in range(size(part))] == [9, 41, 73, 105]
    tile_shape, tv = make_tv_layout(P("(4,8):(8,1)"), P("(2,2)"))
    assert tile_shape == (8, 16)
    owned = sorted(tv(t, v) for t in range(32) for v in range(4))
    assert owned == list(range(128))


# ------------------------------------------------------------------ divisibility errors


@pytest.mark.parametrize("a,b,condition", [
    ("(4,6):(1,10)", "6:1", "shape divisibility"),
    ("(2,2):(0,1)", "(2,2):(1,1)", "mode disjointness"),
    ("(4,6):(1,10)", "(2,4):(1,1)", "mode disjointness"),
    ("(4,6):(1,10)", "(2,3):(1,2)", "shape divisibility"),
    ("(6,2):(1,10)", "3:4", "stride divisibility"),
    ("(4,6):(1,10)", "2:6", "stride divisibility"),
])
def test_composition_raises_when_not_admissible(a, b, condition):
    with pytest.raises(ValueError, match=condition) as err:
        composition(P(a), P(b))
    assert a in str(err.value) and b in str(err.value)


@pytest.mark.parametrize("a", ["(2,2):(1,1)", "(4,2):(1,2)", "(2,3):(1,3)"])
def test_complement_raises_when_modes_overlap(a):
    with pytest.raises(ValueError, match="disjointness condition") as err:
        complement(P(a), 24)
    assert a in str(err.value)


def test_left_inverse_rejects_non_injective():
    with pytest.raises(ValueError, match="not injective"):
        left_inverse(P("(2,2):(0,1)"))


# ------------------------------------------------------------------ strategies


def _nest(leaves_st, max_leaves=5):
    """Random nestings (rank <= 3) of up to max_leaves leaves."""
    return st.recursive(leaves_st, lambda ch: st.lists(ch, min_size=1, max_size=3).map(tuple),
                        max_leaves=max_leaves)


def small(strategy, limit=256):
    return strategy.filter(lambda x: size(x) <= limit)


@st.composite
def layouts(draw, extents=st.integers(1, 6), strides=st.integers(0, 24)):
    shape = draw(_nest(extents))
    n = len(flatten(shape))
    return Layout(shape, unflatten(draw(st.lists(strides, min_size=n, max_size=n)), shape))


@st.composite
def injective_layouts(draw, extents=st.integers(1, 6), gaps=st.integers(1, 3), rank2=False):
    """Strides follow a random order of the modes with gaps: always complementable."""
    shape = (draw(_nest(extents, 2)), draw(_nest(extents, 2))) if rank2 else draw(_nest(extents))
    leaves = flatten(shape)
    order = draw(st.permutations(range(len(leaves))))
    strides, current = [0] * len(leaves), 1
    for i in order:
        current *= draw(gaps)
        strides[i] = current
        current *= leaves[i]
    return Layout(shape, unflatten(strides, shape))


POW2 = st.sampled_from([1, 2, 4, 8])
pow2_layouts = small(layouts(POW2, st.sampled_from([0, 1, 2, 4, 8, 16, 32])))
pow2_injective = small(injective_layouts(POW2, st.sampled_from([1, 2, 4])))
SMALL2 = st.sampled_from([1, 2, 4])
tiny_pow2_layouts = small(layouts(SMALL2, st.sampled_from([0, 1, 2, 4, 8, 16])), 16)
tiny_pow2_injective = small(injective_layouts(SMALL2, st.sampled_from([1, 2])), 8)


@st.composite
def admissible_pairs(draw):
    """A with arbitrary extents; B's modes are disjoint windows [j, k) of A's coalesced
    extents: stride prod(fs[:j]), extent prod(fs[j:k]) (times more in A's last mode)."""
    a = draw(layouts())
    fs = flatten(coalesce(a).shape)
    n = len(fs)
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=6)))
    pairs = []
    for j, k in zip(cuts[::2], cuts[1::2]):
        extra = draw(st.integers(1, 3)) if k == n else 1
        pairs.append((prod(fs[j:k]) * extra, prod(fs[:j])))
    pairs += [(draw(st.integers(1, 4)), 0) for _ in range(draw(st.integers(0, 1)))]
    pairs = draw(st.permutations(pairs))
    if len(pairs) == 1:
        b = Layout(*pairs[0])
    elif draw(st.booleans()):
        b = Layout(tuple(s for s, _ in pairs), tuple(d for _, d in pairs))
    else:
        b = Layout((tuple(s for s, _ in pairs[:-1]), pairs[-1][0]),
                   (tuple(d for _, d in pairs[:-1]), pairs[-1][1]))
    return a, b


def values(layout):
    return [layout(i) for i in range(size(layout))]


# ------------------------------------------------------------------ coalesce, filter


@SETTINGS
@given(layouts())
def test_coalesce_keeps_function_and_size(a):
    c = coalesce(a)
    assert size(c) == size(a) and depth(c) <= 1
    assert values(c) == values(a)


@SETTINGS
@given(layouts())
def test_coalesce_by_mode_keeps_rank_and_function(a):
    profile = (1,) * rank(a)
    c = coalesce(a, profile)
    assert rank(c) == rank(a) and values(c) == values(a)


@SETTINGS
@given(layouts())
def test_filter_keeps_the_image(a):
    f = filter(a)
    assert set(values(f)) == set(values(a)) and size(f) <= size(a)
    assert 0 not in flatten(f.stride) or size(f) == 1


# ------------------------------------------------------------------ composition


def _check_composition(a, b, r):
    assert compatible(b.shape, r.shape), f"{r} is not compatible with {b}"
    for i in range(size(b)):
        assert r(i) == a(b(i)), f"({a}) o ({b}) = {r} differs at {i}"


@SETTINGS
@given(admissible_pairs())
def test_composition_post_conditions(pair):
    a, b = pair
    _check_composition(a, b, composition(a, b))


@SETTINGS
@given(pow2_layouts, pow2_injective)
def test_composition_of_power_of_two_layouts(a, b):
    _check_composition(a, b, composition(a, b))


@SETTINGS
@given(layouts(), layouts())
def test_composition_is_right_or_raises_naming_the_condition(a, b):
    try:
        r = composition(a, b)
    except ValueError as e:
        assert " condition fails" in str(e) and str(a) in str(e) and str(b) in str(e)
        return
    _check_composition(a, b, r)


# ------------------------------------------------------------------ complement


@SETTINGS
@given(injective_layouts(), st.integers(1, 4), st.integers(0, 30))
def test_complement_post_conditions(a, mult, extra):
    target = mult * cosize(a) + extra
    c = complement(a, target)
    cv, av = values(c), set(values(a))
    assert all(x < y for x, y in zip(cv, cv[1:])), f"complement {c} is not increasing"
    assert set(cv[1:]).isdisjoint(av), f"complement {c} meets {a}"
    both = make_layout(a, c)
    span = _span(a)  # extent of a's modes chained by stride
    bound = -(-target // span) * span
    assert cosize(both) >= target and cosize(c) <= bound
    # (a, complement) is a bijection onto [0, round_up(target, span))
    assert sorted(values(both)) == list(range(bound))


@SETTINGS
@given(injective_layouts(), st.integers(1, 3))
def test_complement_of_complement(a, mult):
    target = mult * size(make_layout(a, complement(a)))
    back = complement(complement(a, target), target)
    fl = filter(a)
    pairs = sorted(zip(flatten(fl.shape), flatten(fl.stride)), key=lambda p: (p[1], p[0]))
    pairs = [p for p in pairs if p[0] > 1]
    expected = coalesce(Layout(tuple(s for s, _ in pairs), tuple(d for _, d in pairs))) if pairs \
        else Layout(1, 0)
    assert back == expected


# ------------------------------------------------------------------ inverses


@SETTINGS
@given(layouts())
def test_right_inverse(a):
    r = right_inverse(a)
    for i in range(size(r)):
        assert a(r(i)) == i


@SETTINGS
@given(injective_layouts(gaps=st.just(1)))
def test_right_inverse_of_a_bijection_is_total(a):
    r = right_inverse(a)
    assert size(r) == size(a)
    assert [a(r(i)) for i in range(size(a))] == list(range(size(a)))


@SETTINGS
@given(injective_layouts())
def test_left_inverse(a):
    r = left_inverse(a)
    for i in range(size(a)):
        assert r(a(i)) == i


# ------------------------------------------------------------------ divide


def _span(b):
    return size(make_layout(b, complement(b)))


@SETTINGS
@given(pow2_layouts, pow2_injective)
def test_logical_divide(a, b):
    d = logical_divide(a, b)
    assert rank(d) == 2 and size(d[0]) == size(b)
    for i in range(size(b)):
        assert d[0](i) == a(b(i))
    full = make_layout(b, complement(b, size(a)))
    for i in range(size(d)):
        assert d(i) == a(full(i))
    if size(a) % _span(b) == 0:
        assert size(d) == size(a)


@st.composite
def rank2_with_tiler(draw):
    return make_layout(draw(tiny_pow2_layouts), draw(tiny_pow2_layouts)), \
        (draw(tiny_pow2_injective), draw(tiny_pow2_injective))


@SETTINGS
@given(rank2_with_tiler())
def test_zipped_tiled_flat_divide_rearrange_logical_divide(case):
    a, tiler = case
    ld = logical_divide(a, tiler)
    z, t, f = zipped_divide(a, tiler), tiled_divide(a, tiler), flat_divide(a, tiler)
    assert rank(ld) == 2 and rank(z) == 2 and rank(t) == 3 and rank(f) == 4
    n0, n1 = size(ld[0][0]), size(ld[1][0])
    m0, m1 = size(ld[0][1]), size(ld[1][1])
    for t0 in range(n0):
        for t1 in range(n1):
            for r0 in range(m0):
                for r1 in range(m1):
                    want = ld((t0, r0), (t1, r1))
                    assert z((t0, t1), (r0, r1)) == want
                    assert t((t0, t1), r0, r1) == want
                    assert f(t0, t1, r0, r1) == want


# ------------------------------------------------------------------ product


@SETTINGS
@given(pow2_injective, pow2_injective)
def test_logical_product(a, b):
    p = logical_product(a, b)
    assert rank(p) == 2 and p[0] == a and size(p) == size(a) * size(b)
    rest = composition(complement(a, size(a) * cosize(b)), b)
    assert values(p[1]) == values(rest)


@SETTINGS
@given(pow2_injective, pow2_injective)
def test_logical_product_of_injective_layouts_is_injective(a, b):
    p = logical_product(a, b)
    assert len(set(values(p))) == size(p)


rank2_injective = small(injective_layouts(SMALL2, st.sampled_from([1, 2]), rank2=True), 16)


@st.composite
def rank2_injective_pairs(draw):
    return draw(rank2_injective), draw(rank2_injective)


@SETTINGS
@given(rank2_injective_pairs())
def test_blocked_and_raked_products(pair):
    a, b = pair
    for op in (blocked_product, raked_product):
        p = op(a, b)
        assert rank(p) == 2 and size(p) == size(a) * size(b)
        assert len(set(values(p))) == size(p)  # both injective -> injective
        for j0 in range(size(a[0])):
            for j1 in range(size(a[1])):
                if op is blocked_product:
                    assert p(j0, j1) == a(j0, j1)  # the block sits at the origin
                else:
                    assert p(j0 * size(b[0]), j1 * size(b[1])) == a(j0, j1)  # raked apart


@SETTINGS
@given(rank2_injective_pairs())
def test_zipped_and_tiled_products_rearrange_logical_product(pair):
    a, b = pair
    tiler = (b[0], b[1])
    lp = logical_product(a, tiler)
    z, t = zipped_product(a, tiler), tiled_product(a, tiler)
    for x0 in range(size(a[0])):
        for x1 in range(size(a[1])):
            for y0 in range(size(b[0])):
                for y1 in range(size(b[1])):
                    want = lp((x0, y0), (x1, y1))
                    assert z((x0, x1), (y0, y1)) == want
                    assert t((x0, x1), y0, y1) == want


compact_rank2 = small(injective_layouts(st.integers(1, 4), st.just(1), rank2=True), 24)


@SETTINGS
@given(compact_rank2, st.integers(1, 3), st.integers(1, 3), st.booleans())
def test_tile_to_shape(block, k0, k1, row_major):
    b0, b1 = product_each(block.shape)
    target = (b0 * k0, b1 * k1)
    t = tile_to_shape(block, target, (1, 0) if row_major else None)
    assert product_each(t.shape) == target
    for j0 in range(b0):
        for j1 in range(b1):
            assert t(j0, j1) == block(j0, j1)
    assert sorted(values(t)) == list(range(size(t)))  # a compact block tiles compactly


def test_tile_to_shape_of_a_compact_block_is_compact():
    t = tile_to_shape(make_ordered_layout((8, 16), (1, 0)), (64, 64))
    assert sorted(values(t)) == list(range(64 * 64))


@pytest.mark.parametrize("data,threads", [
    ("(32,16):(16,1)", "(8,4):(4,1)"),
    ("(32,16):(1,32)", "(8,4):(1,8)"),
    ("(24,(2,8)):(16,(8,1))", "(4,(2,2)):(1,(4,8))"),
])
def test_local_partition_gives_every_element_to_exactly_one_thread(data, threads):
    data, threads = P(data), P(threads)
    seen = []
    for t in range(size(threads)):
        part, offset = local_partition(data, threads, t)
        assert size(part) == size(data) // size(threads)
        seen += [part(i) + offset for i in range(size(part))]
    assert sorted(seen) == sorted(values(data))

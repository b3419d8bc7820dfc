"""graph/rules/merged_reductions.py: a reduction over neighbouring dims becomes one over a dim
of a reshape, which the planner takes (a row kernel, or a column kernel); the rewritten graph
computes what the program does (the interpreter against PyTorch, random shapes and dims)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import fusion, ir
from tilefuse.graph.rules import merged_reductions as mr


def capture(fn, inputs):
    return to_graph(export(fn, inputs))


def _steps(p):
    return [s for s in p.plan.steps if s.family not in ("alias",) and not s.view]


def test_global_average_pooling_is_one_row_kernel():
    """x.mean((2, 3)) of [N, C, H, W]: rows N x C of H * W, read where x lies (a free reshape)."""
    x = torch.randn(2, 300, 7, 9)
    p = tilefuse.compile(lambda x: x.mean((2, 3)), (x,))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and s.space == ((2, 300), 63) and not s.columns
    torch.testing.assert_close(p(x), x.mean((2, 3)))


def test_maps_only_the_reduction_reads_move_into_its_kernel():
    """relu(x * w[:, None, None]).amax((2, 3), keepdim=True): the maps run on the merged shape, in
    the reduction's kernel, the per-channel weight reshaped with them."""
    fn = lambda x, w: torch.relu(x * w[:, None, None]).amax((2, 3), keepdim=True)  # noqa: E731
    x, w = torch.randn(2, 300, 7, 9), torch.randn(300)
    p = tilefuse.compile(fn, (x, w))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and s.space == ((2, 300), 63)
    torch.testing.assert_close(p(x, w), fn(x, w))


def test_squeeze_and_excitation_is_one_row_kernel():
    """x * sigmoid(mean): the product, of x's shape, computed from the reduction's result and x,
    moves below the reshape too and joins the mean's row kernel (it was a map kernel of its own
    with rows of W); the result is that kernel's output viewed back as [N, C, H, W]."""
    fn = lambda x: x * torch.sigmoid((x * 2).mean((2, 3), keepdim=True))  # noqa: E731
    x = torch.randn(2, 300, 7, 9)
    p = tilefuse.compile(fn, (x,))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and s.space == ((2, 300), 63)
    assert [n.op for n in p.graph.nodes if isinstance(n, ir.Map) and n.op == "mul"] == ["mul", "mul"]
    torch.testing.assert_close(p(x), fn(x))


def test_a_map_read_elsewhere_too_keeps_its_kernel():
    """y = x * 2 returned as well as reduced: y is computed in x's shape (a map kernel), the mean's
    kernel reads it through the reshape."""
    fn = lambda x: ((y := x * 2).mean((2, 3)), y)  # noqa: E731
    x = torch.randn(2, 300, 7, 9)
    p = tilefuse.compile(fn, (x,))
    assert [s.family for s in _steps(p)] == ["mapreduce", "mapreduce"]
    for got, want in zip(p(x), fn(x)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [
    lambda x: ((e := (x * 3).exp()) * (e + 2)).mean((2, 3)),          # e read by two maps of the chain
    lambda x: torch.nn.functional.mish(x).amax((2, 3)),               # mish's exp and its product, each read twice
    lambda x: x * torch.nn.functional.mish(x).mean((2, 3), keepdim=True),
    lambda x: ((y := x.sin()).mean((2, 3)), (y * y).sum((2, 3))),     # y read by a reduction and a map of the run
], ids=["two readers", "mish", "mish gate", "reduction and map"])
def test_a_map_only_the_chain_reads_moves_even_when_read_twice(fn):
    """A map of x's shape read by more than one node, each of them a reduction over the run or a
    map only they read, is computed merged, once, in the reduction's kernel (session 59's Mish,
    written as e (e + 2) over e = exp(x), was split off and written in full)."""
    x = torch.randn(2, 300, 7, 9)
    p = tilefuse.compile(fn, (x,))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and s.space == ((2, 300), 63), str(p.plan)
    got, want = p(x), fn(x)
    for g_, w_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g_, w_)


def test_a_map_read_twice_and_by_an_output_stays_in_place():
    """e read by the chain and returned: computed in x's shape (a kernel writes it), the mean reads it."""
    def fn(x):
        e = x.exp()
        return (e * (e + 2)).mean((2, 3)), e

    x = torch.randn(2, 300, 7, 9)
    p = tilefuse.compile(fn, (x,))
    assert len(_steps(p)) == 2, str(p.plan)
    for got, want in zip(p(x), fn(x)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", ["unmergeable reader", "reduced again", "read by another", "a map read elsewhere"])
def test_maps_below_move_only_with_all_their_readers(case):
    """A map after the reduction moves below only where every reader of its result moves too (or
    reads it merged): one left behind would read the product back, a full tensor written and
    read that the kernel of the maps after the reduction never wrote (a review's finding). Here
    none moves: `+ b` with b of [W] (b broadcasts over part of the run), a sum over W, and an
    argument computed for an output too."""
    fns = {"unmergeable reader": lambda x, b: x * torch.sigmoid(x.mean((2, 3), keepdim=True)) + b,
           "reduced again": lambda x, b: (x * torch.sigmoid(x.mean((2, 3), keepdim=True))).sum(-1),
           "read by another": lambda x, b: ((y := x * torch.sigmoid(x.mean((2, 3), keepdim=True))) + b, y.exp()),
           "a map read elsewhere": lambda x, b: ((y := torch.exp(x)) * torch.sigmoid(x.mean((2, 3), keepdim=True)), y)}
    fn = fns[case]
    x, b = torch.randn(2, 300, 7, 9), torch.randn(9)
    g = mr.merged_reductions(capture(fn, (x, b)))
    assert not [n for n in g.nodes if isinstance(n, ir.Map) and n.type.shape == (2, 300, 63)], g
    p = tilefuse.compile(fn, (x, b))
    want = fn(x, b)
    for got, w in zip(*((o if isinstance(o, tuple) else (o,)) for o in (p(x, b), want))):
        torch.testing.assert_close(got, w)


def test_a_hand_written_instance_norm_is_one_kernel():
    """(x - m) * rsqrt(mean((x - m)^2) + eps) over (2, 3): both reductions merge over one run and
    share x - m, merged."""
    fn = lambda x: (x - (m := x.mean((2, 3), keepdim=True))) * torch.rsqrt(((x - m) ** 2).mean((2, 3), keepdim=True) + 1e-5)  # noqa: E731
    x = torch.randn(2, 300, 7, 9)
    p = tilefuse.compile(fn, (x,))
    (s,) = _steps(p)
    assert s.space == ((2, 300), 63)
    torch.testing.assert_close(p(x), fn(x), rtol=1e-5, atol=1e-5)


def test_an_argument_broadcast_over_part_of_the_run_stays_unmerged():
    """(x + b).sum((2, 3)) with b of [W]: no reshape of b spans H * W, so the map keeps x's shape
    (a kernel of its own) and the reduction reads its result merged."""
    fn = lambda x, b: (x + b).sum((2, 3))  # noqa: E731
    x, b = torch.randn(2, 300, 7, 9), torch.randn(9)
    g = capture(fn, (x, b))
    out = mr.merged_reductions(g)
    assert any(isinstance(n, ir.Map) and n.type.shape == (2, 300, 7, 9) for n in out.nodes)
    p = tilefuse.compile(fn, (x, b))
    torch.testing.assert_close(p(x, b), fn(x, b))


@pytest.mark.parametrize("fn,shape", [
    (lambda x: x.sum((0, 1, 2)), (4, 5, 6)),          # every dim: one row of the whole tensor
    (lambda x: x.mean((1, 2)), (8, 300, 200)),        # 8 rows of 60000: too few rows
    (lambda x: x.sum((1, 3)), (8, 30, 20, 10)),       # dims 1 and 3 with dim 2 between, kept
    (lambda x: x.sum(1), (8, 30, 20)),                # one dim: the planner's own case
], ids=["whole", "few rows", "not neighbours", "one dim"])
def test_reductions_it_leaves_alone(fn, shape):
    g = capture(fn, (torch.randn(*shape),))
    assert mr.merged_reductions(g) is g


def test_a_run_of_leading_dims_is_a_column_kernel(monkeypatch):
    """x.sum((0, 1)) of [B, S, D]: a column kernel over B * S rows' worth of D columns."""
    monkeypatch.setattr(fusion, "COLUMN_MIN_ROWS", 1)
    x = torch.randn(4, 30, 50)
    p = tilefuse.compile(lambda x: x.sum((0, 1)), (x,))
    (s,) = _steps(p)
    assert s.columns and s.space == ((50,), 120)
    torch.testing.assert_close(p(x), x.sum((0, 1)), rtol=1e-5, atol=1e-4)


OPS = {"sum": lambda x, a, k: x.sum(a, keepdim=k), "mean": lambda x, a, k: x.mean(a, keepdim=k),
       "amax": lambda x, a, k: x.amax(a, keepdim=k), "amin": lambda x, a, k: x.amin(a, keepdim=k)}
PRE = {"none": lambda x, w: x, "relu_scale": lambda x, w: torch.relu(x * w), "exp": lambda x, w: torch.exp(x - w)}
POST = {"none": lambda x, w, r: r, "gate": lambda x, w, r: x * torch.sigmoid(r),   # (r with keepdim only)
        "centre_scale": lambda x, w, r: (x - r) * w, "twice": lambda x, w, r: torch.tanh(x + r) * (x - r)}


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4), data=st.data(), op=st.sampled_from(sorted(OPS)),
       pre=st.sampled_from(sorted(PRE)), post=st.sampled_from(sorted(POST)), keepdim=st.booleans())
def test_merged_reductions_match_pytorch(shape, data, op, pre, post, keepdim):
    """Any of OPS over any set of dims, after any of PRE (a weight broadcast over the last dims)
    and before any of POST (maps of x's shape reading the result, kept dims then), at any shape
    (dims of 1 included): the program through the interpreter equals PyTorch's, with the rewrite
    and the column kernels taking every size."""
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
    wshape = tuple(data.draw(st.sampled_from([shape[k:] for k in range(len(shape) + 1)])))
    keepdim = keepdim or post != "none"
    fn = lambda x, w: POST[post](x, w, OPS[op](PRE[pre](x, w), axes, keepdim))  # noqa: E731
    x, w = torch.randn(shape, dtype=torch.float64), torch.randn(wshape, dtype=torch.float64)
    old = mr.MIN_ROWS, fusion.COLUMN_MIN_ROWS
    mr.MIN_ROWS, fusion.COLUMN_MIN_ROWS = 1, 1
    try:
        p = tilefuse.compile(fn, (x, w))
    finally:
        mr.MIN_ROWS, fusion.COLUMN_MIN_ROWS = old
    torch.testing.assert_close(p(x, w), fn(x, w))

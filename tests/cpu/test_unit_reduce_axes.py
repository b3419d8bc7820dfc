"""Reductions over dims of one element beside longer ones (rewrites.drop_unit_reduce_axes):
`x.sum((1, 2))` of [2000, 1, 300] is a row reduction and `x.mean((1, 3))` of [N, C, 1, W] one
over neighbouring dims, but both ran in PyTorch. The rewritten graph computes what the original
does (graph interpreter, any shape with ones, any axes), and the plans: kernels where PyTorch ran,
and nothing changed where the planner already took the reduction."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph
from tilefuse.graph.rewrites import drop_unit_reduce_axes


def _externs(p):
    return [s for s in p.plan.steps if s.family == "extern"]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=2, max_size=5),
       data=st.data(), op=st.sampled_from(["sum", "mean", "max", "min", "prod"]), keepdim=st.booleans())
def test_the_rewritten_reduction_computes_what_the_original_does(shape, data, op, keepdim):
    shape = tuple(shape)
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
    out = tuple(1 if i in axes else d for i, d in enumerate(shape)) if keepdim else \
        tuple(d for i, d in enumerate(shape) if i not in axes)
    g = ir.Graph((ir.Input("x", ir.TensorType(shape, "f32")),
                  ir.Reduce("y", ir.TensorType(out, "f32"), op, "x", axes, keepdim)), ("x",), ("y",))
    h = drop_unit_reduce_axes(g)
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    a, b = run_graph(g, {"x": x})[0], run_graph(h, {"x": x})[0]
    assert a.shape == b.shape == out
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    long = [i for i in axes if shape[i] != 1]
    if h is not g:  # (it fires only where a dim of one element lies among or between the long ones)
        assert long and any(shape[i] == 1 for i in range(max(i for i, d in enumerate(shape) if d != 1)))


def test_a_row_reduction_over_a_dim_of_one_element_is_a_row_kernel():
    x = torch.randn(2000, 1, 300)
    for fn in (lambda x: x.sum((1, 2)), lambda x: (x * x).sum((1, 2), keepdim=True)):
        p = tilefuse.compile(fn, (x,))
        assert not _externs(p) and [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce"], \
            str(p.plan)
        torch.testing.assert_close(p(x), fn(x), rtol=1e-5, atol=1e-4)


def test_neighbours_but_for_a_dim_of_one_element_merge():
    """mean over dims 1 and 3 of [1024, 300, 1, 40]: 300 x 40 merged, a row kernel."""
    x = torch.randn(1024, 300, 1, 40)
    fn = lambda x: x.mean((1, 3))  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert not _externs(p), str(p.plan)
    torch.testing.assert_close(p(x), fn(x), rtol=1e-5, atol=1e-6)


def test_trailing_ones_and_shared_arguments_keep_their_plans():
    """[N, C, H, 1]: the planner takes the trailing one as it is (a squeeze-and-excitation stays
    one kernel); a softmax's sum over a dim of one element reads a map others read: unchanged."""
    x = torch.randn(4, 64, 300, 1)
    se = tilefuse.compile(lambda x: x * torch.sigmoid(x.mean((2, 3), keepdim=True)), (x,))
    assert [s.family for s in se.plan.steps] == ["mapreduce"], str(se.plan)
    g = tilefuse.compile(lambda x: torch.softmax(x, 1).sum((1, 2)), (torch.randn(4, 64, 1, 300),)).graph
    assert not any(n.name.endswith("_squeezed") for n in g.nodes), str(g)


def test_an_empty_tensor_keeps_pytorchs_reduction():
    """Zero elements: no kernel takes them, so nothing is rewritten (review: a crash)."""
    for fn, shape in ((lambda x: x.sum((1, 2)), (0, 1, 300)), (lambda x: x.mean((1, 2), keepdim=True), (5, 1, 0))):
        x = torch.randn(*shape)
        p = tilefuse.compile(fn, (x,))
        torch.testing.assert_close(p(x), fn(x), equal_nan=True)  # (the mean of nothing is NaN)


def test_what_it_leaves_is_split_like_any_reduction():
    """First among the rules: x.sum((0, 1)) of [8192, 1, 2048] is x.sum(0) of [8192, 2048], its
    column reduced in pieces (split_long_columns); a full reduction over ones is flattened."""
    x = torch.randn(8192, 1, 2048)
    g = tilefuse.compile(lambda x: x.sum((0, 1)), (x,)).graph
    assert any(n.name.endswith("_pieces") for n in g.nodes), str(g)
    g = tilefuse.compile(lambda x: x.sum((0, 2)), (torch.randn(64, 1, 300),)).graph
    assert any(n.name.endswith("_flat") for n in g.nodes), str(g)

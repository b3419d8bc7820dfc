"""graph/rules/small_reductions.py: a reduction over a short dim (2 to 8 elements) that is not
the last becomes maps of its slices (a mixture of experts' sum over its top k), so it runs in a
map kernel rather than in PyTorch; the rewritten graph computes what PyTorch does (the
interpreter, random shapes, dims and dtypes), a 16-bit sum in float32 rounded once."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph, to_torch
from tilefuse.graph.rules.small_reductions import MAX_EXTENT, short_reductions_as_maps


def _graph(fn, inputs):
    return to_graph(export(fn, inputs))


def _run(g, inputs):
    return [to_torch(a).reshape(a.shape) for a in run_graph(g, dict(zip(g.inputs, inputs)))]


OPS = {"sum": lambda x, d, k: x.sum(d, keepdim=k), "mean": lambda x, d, k: x.mean(d, keepdim=k),
       "amax": lambda x, d, k: x.amax(d, keepdim=k), "amin": lambda x, d, k: x.amin(d, keepdim=k)}


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_rewritten_graph_computes_what_pytorch_does(data):
    rank = data.draw(st.integers(2, 4))
    shape = [data.draw(st.integers(1, 6)) for _ in range(rank)]
    d = data.draw(st.integers(0, rank - 2))
    shape[d] = data.draw(st.integers(2, MAX_EXTENT))
    shape[-1] = data.draw(st.integers(2, 9))
    op, keep = data.draw(st.sampled_from(sorted(OPS))), data.draw(st.booleans())
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.bool]))
    if dtype == torch.bool and op != "sum" or dtype.is_floating_point is False and op == "mean":
        dtype = torch.float32
    x = (torch.randn(shape) * 3).to(dtype) if dtype != torch.bool else torch.randn(shape) > 0
    fn = lambda x: OPS[op](x, d, keep) * 1  # noqa: E731  (a map after it: the result is no bare view)
    g = _graph(fn, (x,))
    r = short_reductions_as_maps(g)
    assert not any(isinstance(n, ir.Reduce) for n in r.nodes), str(r)
    (got,), want = _run(r, (x,)), fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.bfloat16 and op in ("sum", "mean"):
        # float32 sums rounded once, as PyTorch's; the order of a sum of k may differ
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_bf16_sum_of_two_equals_pytorch_exactly():
    """One float32 add, one rounding: the same value as PyTorch's sum, bit for bit."""
    x = torch.randn(64, 2, 96).to(torch.bfloat16)
    p = tilefuse.compile(lambda x: x.sum(1), (x,))
    assert torch.equal(p(x), x.sum(1))


def test_a_mixture_of_experts_combine_is_map_kernels_with_no_extern():
    """Each token's top-2 expert outputs, weighted, summed, added to the residual: no reduction
    left to PyTorch (before the rule: `reduction over a non-last axis runs in PyTorch`)."""
    fn = lambda y, w, res: res + (y * w[:, None]).view(64, 2, 96).sum(1).to(res.dtype)  # noqa: E731
    y, w, res = torch.randn(128, 96).to(torch.bfloat16), torch.rand(128), torch.randn(64, 96).to(torch.bfloat16)
    p = tilefuse.compile(fn, (y, w, res))
    steps = [s for s in p.plan.steps if s.family not in ("alias",) and not s.view]
    assert steps and all(s.family == "mapreduce" for s in steps), str(p.plan)
    torch.testing.assert_close(p(y, w, res), fn(y, w, res), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(-1),  # the last dim: a row reduction
    lambda x: x.view(8, 9, 16).sum(1),  # 9 > MAX_EXTENT
    lambda x: x.view(24, 3, 16).sum((0, 1)),  # two dims
    lambda x: x.view(24, 16, 3, 1).sum(2),  # nothing of more than one element after it
])
def test_not_taken_leaves_the_graph_as_it_is(fn):
    g = _graph(fn, (torch.randn(8, 144),))
    assert short_reductions_as_maps(g) is g

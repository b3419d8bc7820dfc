"""graph/rules/slice_sink.py: slices along the last dim of a map's result, where they are all
its readers, become maps of sliced arguments, so the map runs in the kernel that reads the
slices (a mixture of experts' masked gate/up product and its SwiGLU: one kernel, was two);
the rewritten graph computes what PyTorch does (the interpreter, random shapes and slices)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph, to_torch
from tilefuse.graph.rules.slice_sink import slices_into_maps


def _graph(fn, inputs):
    return to_graph(export(fn, inputs))


def _run(g, inputs):
    return [to_torch(a).reshape(a.shape) for a in run_graph(g, dict(zip(g.inputs, inputs)))]


def _steps(p):
    return [s for s in p.plan.steps if s.family not in ("alias",) and not s.view]


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_rewritten_graph_computes_what_pytorch_does(data):
    rows, n = data.draw(st.integers(1, 5)), data.draw(st.integers(2, 12))
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(i + 1, n - 1 if i == 0 else n))  # (a whole-row slice is no slice)
    k = data.draw(st.integers(1, n - 1))
    x, c, w = torch.randn(rows, n), torch.randn(rows, 1) > 0, torch.randn(n)

    def fn(x, c, w):
        m = torch.where(c, x * w, 0.5) + 1
        return m[:, i:j] * 2, torch.exp(m[:, k:])  # two slices, perhaps overlapping

    g = _graph(fn, (x, c, w))
    r = slices_into_maps(g)
    assert r is not g
    assert not [n for n in r.nodes if isinstance(n, ir.View) and n.op == "slice"
                and isinstance(r[n.arg], ir.Map)], str(r)  # no slice of a map is left
    for got, want in zip(_run(r, (x, c, w)), fn(x, c, w)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_masked_gate_up_product_and_its_swiglu_are_one_kernel():
    """where(valid, gate_up, 0) then silu(gate) * up, gate_up an extern's result (the experts'
    grouped matmul; here a logcumsumexp): the mask runs in the SwiGLU kernel, which reads each half
    where the extern wrote it."""
    def fn(x, w, valid):
        gu = torch.where(valid, torch.logcumsumexp(x, -1) * w, 0.0)
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    x, w, valid = torch.randn(64, 96), torch.randn(96), torch.rand(64, 1) > 0.3
    p = tilefuse.compile(fn, (x, w, valid))
    maps = [s for s in _steps(p) if s.family == "mapreduce"]
    assert len(maps) <= 1 and not any("where" in s.nodes[0] for s in maps), str(p.plan)
    torch.testing.assert_close(p(x, w, valid), fn(x, w, valid), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, fn", [
    ("read whole too", lambda x: (lambda m: (m[:, :3] + 1, m.sum(-1)))(x * 2)),
    ("a result", lambda x: (lambda m: (m, m[:, :3] + 1))(x * 2)),
    ("not the last dim", lambda x: (x * 2)[1:3] + 1),
    ("a generated argument", lambda x: (x * torch.arange(8.0))[:, 2:5] + 1),
    ("a step of 2", lambda x: (x * 2)[:, ::2] + 1),
    # a matmul's epilogue (its row scale, pairwise SwiGLU, partial sums) is matched on the maps
    # after it: moved slices would split it
    ("after a matmul", lambda x: (lambda m: (m[:, :3] + 1, m[:, 3:] * 2))(torch.relu(x @ x.T) * 2)),
])
def test_not_taken_leaves_the_graph_as_it_is(name, fn):
    g = _graph(fn, (torch.randn(4, 8),))
    assert slices_into_maps(g) is g, str(g)

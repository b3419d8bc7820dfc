"""graph/rules/gather_sink.py: a gather of a map's result, where gathers are all its readers,
becomes the map of gathered arguments, and the slices a short reduction makes of a gathered
tensor split into row gathers at slices of the index; the rewritten graph computes what
PyTorch does (the interpreter, random shapes), and a mixture of experts' scale, un-permute and
top-k sum run in one kernel that reads the experts' rows where they lie."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph, to_torch
from tilefuse.graph.rules.gather_sink import gathers_through_maps, split_gathers
from tilefuse.graph.rules.small_reductions import short_reductions_as_maps


def _graph(fn, inputs):
    return to_graph(export(fn, inputs))


def _run(g, inputs):
    return [to_torch(a).reshape(a.shape) for a in run_graph(g, dict(zip(g.inputs, inputs)))]


def _gathers_of_maps(g):
    """Gathers left reading a map (but a bool's f32 table, which the rule makes to gather it)."""
    return [n.name for n in g.nodes if isinstance(n, ir.Gather) and isinstance(g[n.arg], ir.Map)
            and not (g[n.arg].op == "cast" and g[g[n.arg].args[0]].type.dtype == "bool")]


def _combine(k):
    def fn(y, w, perm):
        """An MoE's combine: expert rows y (an extern's result) masked where their expert is not
        local (transformers 5.17's `where(valid, ...)`, a bool per row), scaled by their routing
        weights, put back in token order by the inverse of the sort, each token's k rows summed."""
        rows = torch.where(w > 0.1, torch.logcumsumexp(y, -1), 0.0)
        inv = torch.argsort(perm)
        scaled = rows.float() * w
        return scaled[inv].view(-1, k, y.shape[-1]).sum(1).to(y.dtype)
    return fn


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_the_rewritten_graph_computes_what_pytorch_does(data):
    tokens, k, d = data.draw(st.integers(1, 6)), data.draw(st.integers(2, 4)), data.draw(st.integers(1, 9))
    y, w = torch.randn(tokens * k, d), torch.rand(tokens * k, 1)
    perm = torch.randperm(tokens * k)
    fn = _combine(k)
    g = short_reductions_as_maps(_graph(fn, (y, w, perm)))
    r = gathers_through_maps(split_gathers(g))
    assert r is not g and not _gathers_of_maps(r), str(r)
    (got,) = _run(r, (y, w, perm))
    torch.testing.assert_close(got, fn(y, w, perm), rtol=1e-6, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_an_elementwise_gather_of_a_map_is_the_map_of_gathers(data):
    """torch.gather with an index of the map's full size beside the axis, along either dim; an
    argument that broadcasts along the axis stays as it is."""
    n, m = data.draw(st.integers(2, 6)), data.draw(st.integers(2, 6))
    axis = data.draw(st.integers(0, 1))
    size = n if axis == 0 else m
    x, v = torch.randn(n, m), torch.randn(m)
    picked = data.draw(st.integers(1, size))  # (no more elements than the map has)
    idx = torch.randint(0, size, (picked, m) if axis == 0 else (n, picked))

    def fn(x, v, idx):
        return torch.gather(torch.logcumsumexp(x, 0) * v + 1, axis, idx)

    g = _graph(fn, (x, v, idx))
    r = gathers_through_maps(g)
    assert r is not g and not _gathers_of_maps(r), str(r)
    (got,) = _run(r, (x, v, idx))
    torch.testing.assert_close(got, fn(x, v, idx), rtol=1e-6, atol=1e-6)


def test_an_moe_combine_is_one_kernel_reading_the_experts_rows_in_place():
    """The scale, the un-permute gather and the top-2 sum: one map-reduce kernel, which reads
    the expert rows (16-bit, as the grouped matmul wrote them) and the weights at each token's
    gathered rows; nothing float32 of the experts' size is written."""
    tokens, k, d = 48, 2, 64
    y, w = torch.randn(tokens * k, d, dtype=torch.bfloat16), torch.rand(tokens * k, 1)
    perm = torch.randperm(tokens * k)
    fn = _combine(k)
    p = tilefuse.compile(fn, (y, w, perm))
    maps = [s for s in p.plan.steps if s.family == "mapreduce"]
    combine = [s for s in maps if any(p.graph[m].type.shape == (tokens, d) for m in s.nodes
                                      if not isinstance(p.graph[m], ir.View))]
    assert len(combine) == 1, str(p.plan)
    big_f32 = [m for s in maps for m in s.nodes if p.graph[m].type.dtype == "f32"
               and p.graph[m].type.shape == (tokens * k, d) and m in s.outputs]
    assert not big_f32, str(p.plan)
    torch.testing.assert_close(p(y, w, perm), fn(y, w, perm), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name, fn, args", [
    ("the map read whole too", lambda x, i: (lambda m: (m[i], m.sum(-1)))(torch.logcumsumexp(x, 0) * 2), None),
    ("the map a result", lambda x, i: (lambda m: (m, m[i] + 1))(torch.logcumsumexp(x, 0) * 2), None),
    # an integer table cannot read NaN out of range; a generated one is not in memory
    ("an integer argument cut", lambda x, i: (torch.logcumsumexp(x, 0) * (x > 0).long())[i], None),
    ("an iota argument cut", lambda x, i: (torch.logcumsumexp(x, 0) * torch.arange(6.0).view(6, 1))[i], None),
    # the map gathered more often than it has elements: it would be computed twice over
    ("gathered twice over", lambda x, i: (lambda m: (m[i], m[i.flip(0)]))(torch.logcumsumexp(x, 0) * 2), None),
    # a gather that takes a prefix of the other dim would leave the other arguments too long
    ("a prefix of the other dim", lambda x, i: torch.gather(torch.logcumsumexp(x, 0) * 2, 0, i),
     (torch.randn(6, 5), torch.randint(0, 6, (4, 3)))),
])
def test_not_taken_leaves_the_graph_as_it_is(name, fn, args):
    x, i = args or (torch.randn(6, 5), torch.randint(0, 6, (4,)))
    g = _graph(fn, (x, i))
    assert gathers_through_maps(g) is g, name


def test_a_bool_argument_is_gathered_as_f32_and_reads_true_out_of_range():
    """A mask gathered with the rows it masks: its f32 0.0 / 1.0 table is read at the index and
    compared with 0 (the kernel's out-of-range NaN reads True; the interpreter refuses an index
    out of range outright)."""
    def fn(x, m, i):
        return torch.where(m, torch.logcumsumexp(x, 0), -1.0)[i]

    x, m, i = torch.randn(9, 4), torch.rand(9, 1) > 0.5, torch.randint(-9, 9, (7,))
    g = _graph(fn, (x, m, i))
    r = gathers_through_maps(g)
    assert not _gathers_of_maps(r), str(r)
    tables = [n for n in r.nodes if isinstance(n, ir.Gather)]
    assert {r[t.arg].type.dtype for t in tables} == {"f32"}, str(r)
    (got,) = _run(r, (x, m, i))
    torch.testing.assert_close(got, fn(x, m, i), rtol=0, atol=0)


def test_split_gathers_leaves_a_gathered_table_in_memory_alone():
    """An embedding (a gather of a weight or an input) read through a reshape and slices is a
    kernel's gather already: split_gathers only prepares gathers of maps."""
    def fn(t, i):
        return t[i].view(-1, 2, t.shape[-1]).sum(1)

    g = short_reductions_as_maps(_graph(fn, (torch.randn(8, 4), torch.randint(0, 8, (6,)))))
    assert split_gathers(g) is g

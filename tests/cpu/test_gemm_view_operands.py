"""GEMM epilogue operands read through views of a smaller tensor (loop/views.py, contraction.py).

Properties:
- `read_index` of any chain of reshape / expand / permute / slice views, read in any reshape of
  the last view, names the element of the source tensor that NumPy's views name (every index of
  random chains, checked exhaustively);
- it simplifies what RoPE's table views spell out to one remainder per dimension: (m % S, n % W),
  and (m, n % W) when the rows do not wrap;
- a GEMM whose epilogue adds a table and a bias broadcast through `expand` binds the small
  tensors themselves (no expand copy anywhere in the plan), passes the 2x rule against float64
  through the interpreter, and renders and compiles clean for sm_90a and sm_80.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as hst

import tilefuse
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.compiler import compile_stages
from tilefuse.graph import ir
from tilefuse.graph.interp import eval_view
from tilefuse.loop import ir as L
from tilefuse.loop.views import read_index
from loop_fixtures import index_value


def _ops(e) -> int:
    return 1 + _ops(e.a) + _ops(e.b) if isinstance(e, L.IBin) else 0


def _factor(draw, n: int) -> tuple[int, ...]:
    """A random shape of n elements (size-1 dims included)."""
    primes, k, p = [], n, 2
    while k > 1:
        while k % p == 0:
            primes.append(p)
            k //= p
        p += 1
    primes = draw(hst.permutations(primes))
    dims, cur = [], 1
    for q in primes:
        cur *= q
        if draw(hst.booleans()):
            dims.append(cur)
            cur = 1
    if cur > 1:
        dims.append(cur)
    for _ in range(draw(hst.integers(0, 2))):
        dims.insert(draw(hst.integers(0, len(dims))), 1)
    return tuple(dims) or (1,)


@hst.composite
def view_chains(draw):
    """(graph, last view, reader shape, index, extents): a random source, 1 to 4 random views of
    it, and a reshape of the last view into (M, W) read at (m, n), at (b, m, n) over (B, M, W), or
    at (m, 2n + p) over (M, W) with W even (a pairwise epilogue's full-width read)."""
    shape = tuple(draw(hst.lists(hst.integers(1, 4), min_size=1, max_size=3)))
    f32 = lambda s: ir.TensorType(tuple(s), "f32")  # noqa: E731
    nodes, name = [ir.Weight("src", f32(shape))], "src"
    for i in range(draw(hst.integers(1, 4))):
        op = draw(hst.sampled_from(["reshape", "expand", "permute", "slice"]))
        if op == "reshape":
            new, params = _factor(draw, int(np.prod(shape))), None
        elif op == "expand":
            new = tuple(draw(hst.integers(1, 3)) if s == 1 else s for s in shape)
            params = new
        elif op == "permute":
            params = tuple(draw(hst.permutations(range(len(shape)))))
            new = tuple(shape[p] for p in params)
        else:
            dims = [d for d, s in enumerate(shape) if s > 1]
            if not dims:
                continue
            d = draw(hst.sampled_from(dims))
            start, step = draw(hst.integers(0, shape[d] - 1)), draw(hst.integers(1, 2))
            end = draw(hst.integers(start + 1, shape[d]))
            params = (d, start, end, step)
            new = shape[:d] + (len(range(start, end, step)),) + shape[d + 1:]
        v = ir.View(f"v{i}", f32(new), op, name, params if params is not None else new)
        nodes.append(v)
        name, shape = v.name, new
    numel = int(np.prod(shape))
    divisors = [w for w in range(1, numel + 1) if numel % w == 0]
    W = draw(hst.sampled_from(divisors))
    form = draw(hst.sampled_from(["mn", "bmn", "pair"] if W % 2 == 0 else ["mn", "bmn"]))
    if form == "bmn":
        B = draw(hst.sampled_from([b for b in range(1, numel // W + 1) if (numel // W) % b == 0]))
        M = numel // W // B
        return (ir.Graph(tuple(nodes), (), (name,)), name, (B, M, W), (L.Var("b"), L.Var("m"), L.Var("n")),
                {"b": B, "m": M, "n": W})
    M = numel // W
    if form == "pair":
        p = draw(hst.integers(0, 1))
        col = L.IBin("+", L.IBin("*", L.IConst(2), L.Var("n")), L.IConst(p))
        return ir.Graph(tuple(nodes), (), (name,)), name, (M, W), (L.Var("m"), col), {"m": M, "n": W // 2}
    return ir.Graph(tuple(nodes), (), (name,)), name, (M, W), (L.Var("m"), L.Var("n")), {"m": M, "n": W}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(view_chains())
def test_read_index_names_the_element_numpy_views_name(case):
    """For every value of the loop variables, the composed index reads the source element that
    the chain of views (evaluated by NumPy, as the graph interpreter does) puts there."""
    g, name, shape, index, ext = case
    src = np.arange(g["src"].type.numel).reshape(g["src"].type.shape)
    x = src
    for n in g.nodes[1:]:
        x = eval_view(n, x)
    x = x.reshape(shape)
    at = read_index(g, name, shape, index, ext)
    assert len(at) == src.ndim
    names = sorted(ext)
    for values in itertools.product(*(range(ext[v]) for v in names)):
        env = dict(zip(names, values))
        want = x[tuple(index_value(e, env) for e in index)]
        got = tuple(index_value(e, env) for e in at)
        assert all(0 <= i < s for i, s in zip(got, src.shape)), (got, src.shape)
        assert src[got] == want, (env, [str(e) for e in at])


@pytest.mark.parametrize("B", [1, 2, 3])
def test_the_rope_table_views_read_one_remainder_per_dim(B):
    """(S, W) viewed (1, S, 1, W), expanded (B, S, H, W), viewed (B, S, H*W), read as the
    (B*S, H*W) GEMM output at (m, n) or at (m, 2n + p): (m % S, n % W) or (m % S, (2n + p) % W),
    with the m remainder gone when B = 1 (m < S)."""
    S, H, W = 12, 4, 16
    f32 = lambda *s: ir.TensorType(s, "f32")  # noqa: E731
    g = ir.Graph((ir.Weight("t", f32(S, W)),
                  ir.View("a", f32(1, S, 1, W), "reshape", "t", (1, S, 1, W)),
                  ir.View("e", f32(B, S, H, W), "expand", "a", (B, S, H, W)),
                  ir.View("c", f32(B, S, H * W), "reshape", "e", (B, S, H * W))), (), ("c",))
    m, n = L.Var("m"), L.Var("n")
    row, col = read_index(g, "c", (B * S, H * W), (m, n), {"m": B * S, "n": H * W})
    assert row == (m if B == 1 else L.IBin("%", m, L.IConst(S)))
    assert col == L.IBin("%", n, L.IConst(W))
    pair = L.IBin("+", L.IBin("*", L.IConst(2), n), L.IConst(1))
    row2, col2 = read_index(g, "c", (B * S, H * W), (m, pair), {"m": B * S, "n": H * W // 2})
    assert row2 == row and _ops(col2) <= 4  # 2 * (n % 8) + 1
    assert all(index_value(col2, {"n": j}) == (2 * j + 1) % W for j in range(H * W // 2))


class TableBias(nn.Module):
    """x @ W + table over positions (expanded over the batch) + bias (expanded over every row);
    the table and bias are inputs (weight folding would fold a weight's small expand into a copy)."""

    def __init__(self, k=64, n=96):
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x, table, bias):
        B, S, _ = x.shape
        y = x @ self.w + table.expand(B, S, -1)
        return torch.relu(y + bias.expand(B, S, -1))


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_table_and_a_bias_broadcast_through_expand_are_read_where_they_are(batch):
    """The epilogue reads the (S, N) table and the (N,) bias themselves (kind "view", bound at
    their own shapes): no step copies an expand, the program passes the 2x rule against float64,
    and the GEMM compiles clean for sm_90a and sm_80."""
    torch.manual_seed(0)
    m = TableBias().to(torch.bfloat16)
    x = [torch.randn(batch, 12, 64, dtype=torch.bfloat16), torch.randn(12, 96, dtype=torch.bfloat16),
         torch.randn(96, dtype=torch.bfloat16)]
    st = compile_stages(m, x, arch="sm_90a")
    (gs,) = [s for s in st.plan.steps if s.family == "gemm"]
    g = st.graph
    sources = {src for _, src in gs.gemm.viewed}
    assert sources == set(g.inputs[1:])
    assert sorted(k for _, k in gs.gemm.operands) == ["view", "view"]
    assert [s for s in st.plan.steps if s.family != "gemm"] == [], str(st.plan)
    lg = st.gemms[gs.name]
    assert sorted(b.shape for b in lg.bindings if b.tensor in sources) == [(12, 96), (96,)]
    prog = tilefuse.compile(m, x)
    with torch.no_grad():
        eager = flatten(m(*x))
    for o, r, e in zip(flatten(prog(*x)), flatten(float64_reference(m, x)), eager):
        c = compare("y", o, r, e)
        assert c.ok, c
    from tilefuse.codegen import gemm_sm80, gemm_sm90
    from tilefuse.runtime import nvrtc

    src = gemm_sm90.render(lg.problem())
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean
    s8 = gemm_sm80.render(lg.problem(), None, "sm_80")
    assert nvrtc.compile_cuda(s8.source, s8.name, "sm_80").info.clean

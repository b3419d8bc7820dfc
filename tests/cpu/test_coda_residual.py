"""residual_into_epilogue: h = reshape(cast(epilogue(x @ W))) + res moves into the matmul's shape.

Properties: the rewritten graph computes the same function (exact in f64, 2x rule in bf16);
afterwards the add reads the contraction's epilogue chain directly (no reshape or cast in
between), and that chain runs in f32 with one rounding, at the add; a matmul output used
elsewhere, or a residual computed from the matmul itself, is left alone.
"""
from __future__ import annotations

import torch
from torch import nn

from coda_fixtures import assert_bf16, assert_exact, capture, nodes_of
from tilefuse.graph import ir
from tilefuse.graph.rules import residual_into_epilogue


class Residual(nn.Module):
    def __init__(self, d=16, bias=False):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x, r):
        return r + self.proj(x)


class Conv1DResidual(nn.Module):
    """GPT-2's attention output: addmm on flattened rows, view back, add the residual."""

    def __init__(self, d=16):
        super().__init__()
        self.weight, self.bias = nn.Parameter(0.2 * torch.randn(d, d)), nn.Parameter(torch.randn(d))

    def forward(self, x, r):
        y = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return r + y.view(x.shape)


def _adds_on_contractions(g):
    mm = {n.name for n in nodes_of(g, ir.Contraction)}
    maps = {n.name: n for n in nodes_of(g, ir.Map)}
    return [n for n in maps.values() if n.op == "add" and any(a in mm or (a in maps and set(maps[a].args) & mm)
                                                               for a in n.args)]


def test_bf16_linear_residual_on_the_accumulator():
    torch.manual_seed(0)
    m = Residual()
    x, r = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    assert_exact(m, residual_into_epilogue, x, r, fires=False)  # f64: already in epilogue form
    g2 = assert_bf16(m, residual_into_epilogue, x, r)
    (mm,) = nodes_of(g2, ir.Contraction)
    (add,) = [n for n in nodes_of(g2, ir.Map) if n.op == "add"]
    assert mm.type.dtype == "f32" and mm.name in add.args and add.type.dtype == "bf16"


def test_conv1d_add_moves_into_the_flat_rows():
    torch.manual_seed(1)
    m = Conv1DResidual()
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    g, g2 = assert_exact(m, residual_into_epilogue, x, r)
    out = g2[g2.outputs[0]]
    assert isinstance(out, ir.View) and out.op == "reshape", "h is the epilogue's result, viewed back"
    epi = g2[out.arg]
    assert epi.op == "add" and epi.type.shape == (6, 16)
    assert _adds_on_contractions(g2)
    assert_bf16(m, residual_into_epilogue, x, r)


def test_left_alone_when_the_matmul_output_is_used_twice_or_feeds_the_residual():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)

        def forward(self, x, r):
            y = self.proj(x)
            return (r + y) * y

    class SelfResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            y = self.proj(x).view(-1)
            return y + y.flip(0)  # the residual is computed from the matmul's own output

    torch.manual_seed(2)
    x, r = torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    g = capture(Twice().bfloat16(), x, r)
    assert residual_into_epilogue(g) is g
    g = capture(SelfResidual().bfloat16(), x)
    assert residual_into_epilogue(g) is g


def test_an_integer_matmul_keeps_its_float_maps_float():
    """An integer product followed by float maps and an add (found by the fuzzer: `(v @ v).exp()
    .log() + 0`) is no float accumulator's chain: the rule once retyped exp and log to i64,
    which the Loop IR verifier then refused. Left alone, the program compiles and is eager's."""
    import tilefuse

    def fn(a, b, r):
        return (a @ b).exp().log() + r

    a, b = torch.randint(-2, 3, (3, 4)), torch.randint(-2, 3, (4, 5))
    r = torch.randn(3, 5)
    g = capture(_Fn(fn), a, b, r)
    assert residual_into_epilogue(g) is g
    with torch.no_grad():
        torch.testing.assert_close(tilefuse.compile(fn, (a, b, r))(a, b, r), fn(a, b, r))


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _ancestors(g: ir.Graph, name: str) -> set[str]:
    seen, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(ir.node_args(g[n]))
    return seen


def test_depends_on_answers_as_the_whole_ancestry_does():
    """match.depends_on stops its walk at nodes placed before every target (the graph is in
    topological order); over a 3-layer Llama's graph it answers as intersecting the whole
    ancestry with the targets does, for every node against random sets of targets."""
    import random

    from coda_fixtures import bf16_through_coda
    from tilefuse import models
    from tilefuse.graph.rules.match import depends_on

    torch.manual_seed(0)
    blocks = nn.Sequential(*[models.llama_block(64, 128, 4, 2, max_seq=16) for _ in range(3)])
    g = bf16_through_coda(blocks, lambda g: g, torch.randn(1, 4, 64))[2]
    names = [n.name for n in g.nodes]
    rng = random.Random(0)
    hits = 0
    for x in names:
        for k in (1, 3):
            targets = rng.sample(names, k)
            want = bool(_ancestors(g, x) & set(targets))
            assert depends_on(g, x, targets) == want, (x, targets)
            hits += want
    assert 0 < hits < 2 * len(names)

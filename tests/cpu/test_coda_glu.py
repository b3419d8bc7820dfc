"""interleave_glu: act(x @ Wg) ⊙ (x @ Wu) as one matmul with interleaved weight columns.

Properties: the rewritten graph computes the same function (exact in f64, 2x rule in bf16)
for SwiGLU and both GeGLU forms; there is one contraction where there were two; its weight
holds Wg in the even and Wu in the odd columns (built once, at compile time), so the gate
and up values of one output are adjacent: g and u are stride-2 slices of one result; pairs
that are not a GLU are left alone.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coda_fixtures import assert_bf16, assert_exact, nodes_of
from tilefuse.graph import ir
from tilefuse.graph.rules import interleave_glu

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GLU(nn.Module):
    def __init__(self, act="silu", d=16, ffn=24):
        super().__init__()
        self.act = ACTS[act]
        self.gate, self.up, self.down = (nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False),
                                         nn.Linear(ffn, d, bias=False))

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("act", sorted(ACTS))
def test_same_function_one_matmul_pairwise(act):
    torch.manual_seed(0)
    m = GLU(act)
    x = torch.randn(2, 5, 16)
    g, g2 = assert_exact(m, interleave_glu, x)
    assert len(nodes_of(g2, ir.Contraction)) == len(nodes_of(g, ir.Contraction)) - 1
    slices = [n for n in nodes_of(g2, ir.View) if n.op == "slice"]
    assert len(slices) == 2 and slices[0].arg == slices[1].arg
    assert sorted(s.params for s in slices) == [(2, 0, 48, 2), (2, 1, 48, 2)], "gate even, up odd columns"
    fused = g2[slices[0].arg]
    w = g2.weights[g2[fused.b].arg].double()  # stored (2N, K) like nn.Linear's weight
    assert torch.equal(w[0::2], m.gate.weight.double()) and torch.equal(w[1::2], m.up.weight.double())
    assert_bf16(m, interleave_glu, x)


def test_not_a_glu_when_operands_or_shapes_differ():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

        def forward(self, x, y):
            return F.silu(self.gate(x)) * self.up(y)

    class Widths(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(8, 1, bias=False), nn.Linear(8, 8, bias=False)

        def forward(self, x):  # a broadcast gate, not a pairwise one
            return torch.sigmoid(self.gate(x)) * self.up(x)

    torch.manual_seed(1)
    assert_exact(TwoInputs(), interleave_glu, torch.randn(3, 8), torch.randn(3, 8), fires=False)
    assert_exact(Widths(), interleave_glu, torch.randn(3, 8), fires=False)


def test_gate_through_a_reduction_is_not_elementwise():
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

        def forward(self, x):
            g = self.gate(x)
            return torch.softmax(g, -1) * self.up(x)

    torch.manual_seed(2)
    assert_exact(Normed(), interleave_glu, torch.randn(3, 8), fires=False)


class ChunkedGLU(nn.Module):
    """Phi-3's MLP: gate and up in one weight, split by `chunk` (gate first unless `up_first`)."""

    def __init__(self, act="silu", d=16, ffn=24, up_first=False):
        super().__init__()
        self.act, self.up_first = ACTS[act], up_first
        self.gate_up, self.down = nn.Linear(d, 2 * ffn, bias=False), nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        a, b = self.gate_up(x).chunk(2, dim=-1)
        gate, up = (b, a) if self.up_first else (a, b)
        return self.down(up * self.act(gate))


@pytest.mark.parametrize("up_first", [False, True])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_chunked_halves_become_even_and_odd_columns(act, up_first):
    """The one product's halves are its even (gate) and odd (up) columns of a weight whose rows
    are interleaved once, here; the function is the same (exact in f64, 2x rule in bf16)."""
    torch.manual_seed(3)
    m = ChunkedGLU(act, up_first=up_first)
    x = torch.randn(2, 5, 16)
    g, g2 = assert_exact(m, interleave_glu, x)
    assert len(nodes_of(g2, ir.Contraction)) == len(nodes_of(g, ir.Contraction))
    slices = [n for n in nodes_of(g2, ir.View) if n.op == "slice"]
    assert sorted(s.params for s in slices) == [(2, 0, 48, 2), (2, 1, 48, 2)], "gate even, up odd columns"
    fused = g2[slices[0].arg]
    w = g2.weights[g2[fused.b].arg].double()
    gate_rows, up_rows = (slice(24, 48), slice(0, 24)) if up_first else (slice(0, 24), slice(24, 48))
    assert torch.equal(w[0::2], m.gate_up.weight.double()[gate_rows])
    assert torch.equal(w[1::2], m.gate_up.weight.double()[up_rows])
    assert_bf16(m, interleave_glu, x)


def test_chunked_halves_in_the_gemm_epilogue():
    """Compiled, the SwiGLU is the gate/up GEMM's pairwise epilogue: no kernel of its own."""
    import tilefuse

    torch.manual_seed(4)
    m = ChunkedGLU(d=64, ffn=96).to(torch.bfloat16)
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)
    p = tilefuse.compile(m, (x,))
    assert [s.family for s in p.plan.steps if s.family not in ("alias",) and not s.view] == ["gemm", "gemm"], \
        str(p.plan)
    gemm = next(s for s in p.plan.steps if s.family == "gemm")
    assert gemm.gemm.pairwise, str(p.plan)


def test_chunks_read_elsewhere_too_are_left_alone():
    """The product is also returned: its columns must keep their order."""
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Linear(8, 16, bias=False)

        def forward(self, x):
            y = self.gate_up(x)
            g, u = y.chunk(2, -1)
            return F.silu(g) * u, y

    class Thirds(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 24, bias=False)

        def forward(self, x):
            a, b, _ = self.proj(x).chunk(3, -1)
            return F.silu(a) * b

    torch.manual_seed(5)
    assert_exact(Both(), interleave_glu, torch.randn(3, 8), fires=False)
    assert_exact(Thirds(), interleave_glu, torch.randn(3, 8), fires=False)

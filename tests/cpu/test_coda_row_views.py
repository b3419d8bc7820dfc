"""maps_before_row_views: elementwise maps after a row reshape of a matmul's output (GPT-2's
Conv1D: `x.view(-1, K) @ W + b`, then `.view(B, S, N)`) move above the reshape, so that the
planner takes them into the matmul's epilogue.

Properties: the rewritten graph computes the same function (float64, exactly: the same
operations on the same elements); GPT-2's tanh GELU after the MLP's first projection runs in
that GEMM's epilogue (no map-reduce kernel reads the projection's output) and the epilogue
compiles for sm_90a without spills; the compiled program matches PyTorch in bf16; maps whose
results reach a reduction (a norm's statistics), maps with a full-size operand that is not a
row view of the same shape, and broadcast operands of higher rank than the rows are left
where they are.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tilefuse
import tilefuse.compiler
from coda_fixtures import assert_bf16, assert_exact
from tilefuse.check import compare, float64_reference
from tilefuse.codegen import gemm_sm90
from tilefuse.graph import ir
from tilefuse.graph.rules.row_views import maps_before_row_views
from tilefuse.runtime import nvrtc


def gelu_tanh(x):
    """GPT-2's NewGELU, as transformers writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Conv1DMLP(nn.Module):
    """GPT-2's MLP: Conv1D (addmm on the rows, viewed back), GELU, Conv1D."""

    def __init__(self, d=128, f=512):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(d, f) / d ** 0.5), nn.Parameter(torch.randn(f) * 0.1)
        self.w2, self.b2 = nn.Parameter(torch.randn(f, d) / f ** 0.5), nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        h = torch.addmm(self.b1, x.view(-1, x.shape[-1]), self.w1).view(*x.shape[:-1], -1)
        h = gelu_tanh(h)
        return torch.addmm(self.b2, h.view(-1, h.shape[-1]), self.w2).view(*x.shape[:-1], -1)


def test_gelu_moves_above_the_view_and_computes_the_same_function():
    torch.manual_seed(0)
    m = Conv1DMLP()
    x = torch.randn(2, 24, 128)
    g, g2 = assert_exact(m, maps_before_row_views, x)
    tanh = [n for n in g2.nodes if isinstance(n, ir.Map) and n.op == "tanh"]
    assert len(tanh) == 1 and tanh[0].type.shape == (48, 512), "the GELU runs at the matmul's [M, N]"
    assert_bf16(m, maps_before_row_views, x)


def test_gelu_runs_in_the_gemm_epilogue_and_the_program_matches_pytorch():
    torch.manual_seed(1)
    m = Conv1DMLP().to(torch.bfloat16).eval()
    x = torch.randn(2, 24, 128, dtype=torch.bfloat16)
    c = tilefuse.compiler.compile_stages(m, (x,), arch="sm_90a")
    assert "maps_before_row_views" in [f.rule for f in c.fired]
    fams = [s.family for s in c.plan.steps if s.family != "alias"]
    assert fams == ["gemm", "gemm"], f"GELU left in a kernel of its own: {fams}"
    first = next(s for s in c.plan.steps if s.family == "gemm")
    assert "sigmoid" in {c.graph[x].op for x in first.gemm.maps}  # (GPT-2's GELU: rewrites.tanh_halves_as_sigmoids)
    src = gemm_sm90.render(c.gemms[first.name].problem(), None)
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean
    out = tilefuse.compile(m, (x,))(x)
    with torch.no_grad():
        eager = m(x)
    res = compare("mlp", out, float64_reference(m, (x,)), eager)
    assert res.ok, res


class Cases(nn.Module):
    """Maps after a row view: a residual-like full-size operand (moves, reshaped), and ones
    that must stay: reaching a reduction, a full-size operand that is a view (its reshape may
    be a copy), an operand of higher rank."""

    def __init__(self, case, d=64, n=96):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, n) / d ** 0.5)
        self.case = case
        self.other = nn.Parameter(torch.randn(1, 1, 1, n))

    def forward(self, x, r):
        h = (x.view(-1, x.shape[-1]) @ self.w).view(*x.shape[:-1], -1)
        if self.case == "reduction":
            return (h.float() * 2.0).pow(2).mean(-1, keepdim=True)
        if self.case == "full operand":
            return torch.tanh(h) * r
        if self.case == "viewed operand":
            return h * r.transpose(0, 1).reshape(r.shape)
        return h + self.other


def _inputs():
    return torch.randn(2, 5, 64), torch.randn(2, 5, 96)


@pytest.mark.parametrize("case", ["reduction", "viewed operand", "higher rank"])
def test_left_where_moving_would_not_fuse(case):
    torch.manual_seed(2)
    g, g2 = assert_exact(Cases(case), maps_before_row_views, *_inputs(), fires=False)
    assert g2 is g


def test_a_full_size_operand_moves_reshaped_and_the_gemm_takes_it():
    """tanh(h) * r, r an input of h's view's shape: r is reshaped to the matmul's rows (a free
    view of an input), and the whole chain is the GEMM's epilogue, r a tile operand."""
    torch.manual_seed(3)
    m = Cases("full operand")
    g, g2 = assert_exact(m, maps_before_row_views, *_inputs())
    mul = [n for n in g2.nodes if isinstance(n, ir.Map) and n.op == "mul"]
    assert len(mul) == 1 and mul[0].type.shape == (10, 96)
    mb = m.to(torch.bfloat16).eval()
    xs = [t.bfloat16() for t in _inputs()]
    c = tilefuse.compiler.compile_stages(mb, xs, arch="sm_90a")
    assert [s.family for s in c.plan.steps if s.family != "alias"] == ["gemm"]
    out = tilefuse.compile(mb, xs)(*xs)
    with torch.no_grad():
        eager = mb(*xs)
    res = compare("tanh(h) * r", out, float64_reference(mb, xs), eager)
    assert res.ok, res

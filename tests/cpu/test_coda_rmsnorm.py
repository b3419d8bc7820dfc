"""rmsnorm_into_matmul: RMSNorm(x) @ W becomes r ⊙ (x @ (γ ⊙ W)).

Properties: the rewritten graph computes the same function (exact in f64, 2x rule in bf16);
γ is folded into the weight values at compile time (no per-call op touches γ); the matmul
reads x itself; r = rsqrt(mean(x²)+ε) is applied after the matmul, once per row, shared by
every matmul the norm feeds; graphs without the pattern come back unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from coda_fixtures import assert_bf16, assert_exact, capture, nodes_of, randomise_norms
from tilefuse.graph import ir
from tilefuse.graph.rules import rmsnorm_into_matmul
from tilefuse.graph.rules.match import peel_casts


class NormLinear(nn.Module):
    def __init__(self, d=24, n=40, heads=1):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.proj = nn.ModuleList(nn.Linear(d, n, bias=False) for _ in range(heads))

    def forward(self, x):
        h = self.norm(x)
        return sum(p(h) for p in self.proj)


class HFRMSNorm(nn.Module):
    """The transformers Llama/Qwen2 form: f32 statistics, cast back, then γ ⊙ y."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class HFNormLinear(nn.Module):
    def __init__(self, d=24, n=40):
        super().__init__()
        self.norm, self.proj = HFRMSNorm(d), nn.Linear(d, n, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def _x(*shape):
    return torch.randn(*shape)


def test_rmsnorm_linear_same_function_and_gamma_folded():
    torch.manual_seed(0)
    m = randomise_norms(NormLinear())
    g, g2 = assert_exact(m, rmsnorm_into_matmul, _x(3, 5, 24))
    gamma = [n.name for n in g.nodes if isinstance(n, ir.Weight) and n.type.shape == (24,)]
    assert gamma and all(w not in g2 for w in gamma), "γ is folded away, never read per call"
    (mm,) = nodes_of(g2, ir.Contraction)
    assert g2[peel_casts(g2, mm.a)].name == g2.inputs[0], "the matmul reads x itself"
    (w,) = [n for n in nodes_of(g2, ir.Weight)]
    expect = m.norm.weight.double()[None, :] * m.proj[0].weight.double()  # (N, K) stored like nn.Linear
    assert torch.allclose(g2.weights[w.name].double(), expect.to(torch.float64), rtol=0, atol=0)
    scale = [n for n in g2.nodes if isinstance(n, ir.Map) and mm.name in n.args]
    assert len(scale) == 1 and scale[0].op == "mul", "r scales the accumulator, after the matmul"


def test_hf_style_rmsnorm_bf16_within_2x():
    torch.manual_seed(1)
    m = randomise_norms(HFNormLinear())
    with torch.no_grad():
        m.norm.weight.copy_(1 + 0.3 * torch.randn(24))
    assert_exact(m, rmsnorm_into_matmul, _x(2, 7, 24))
    g2 = assert_bf16(m, rmsnorm_into_matmul, _x(2, 7, 24))
    (mm,) = nodes_of(g2, ir.Contraction)
    assert mm.type.dtype == "f32", "the row scale applies to the fp32 accumulator"


def test_one_row_scale_shared_by_every_projection():
    torch.manual_seed(2)
    m = randomise_norms(NormLinear(heads=3))
    _, g2 = assert_exact(m, rmsnorm_into_matmul, _x(4, 24))
    assert len(nodes_of(g2, ir.Contraction)) == 3
    assert len([n for n in g2.nodes if isinstance(n, ir.Map) and n.op == "rsqrt"]) == 1
    assert_bf16(m, rmsnorm_into_matmul, _x(4, 24))


def test_norm_without_weight_and_flattened_rows():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.w = nn.RMSNorm(16, elementwise_affine=False), nn.Parameter(torch.randn(16, 8))

        def forward(self, x):
            return self.norm(x).reshape(-1, 16) @ self.w

    torch.manual_seed(3)
    _, g2 = assert_exact(Flat(), rmsnorm_into_matmul, _x(2, 3, 16))
    (mm,) = nodes_of(g2, ir.Contraction)
    assert g2[mm.a].type.shape == (6, 16)


def test_does_not_fire_without_a_weight_operand_or_a_row_norm():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(16)

        def forward(self, x, y):
            return self.norm(x) @ y  # no weight to fold into

    class ColumnNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 4, bias=False)

        def forward(self, x):  # normalises over rows (dim 0), not along the matmul's K dim
            return self.proj(x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6))

    torch.manual_seed(4)
    assert_exact(TwoInputs(), rmsnorm_into_matmul, _x(3, 16), _x(16, 5), fires=False)
    assert_exact(ColumnNorm(), rmsnorm_into_matmul, _x(6, 8), fires=False)


def test_input_graph_is_not_changed():
    torch.manual_seed(5)
    m = randomise_norms(NormLinear())
    g = capture(m, _x(2, 24))
    before, weights = str(g), dict(g.weights)
    rmsnorm_into_matmul(g)
    assert str(g) == before and g.weights == weights


def test_folding_gamma_rounds_once_as_in_float64():
    """γ ⊙ W is formed in float32 when both are 16-bit (the product is exact there) and rounds to
    the same bf16 / f16 values as the float64 product: folding is fast and loses nothing."""
    from tilefuse.graph.rules.match import exact_product

    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        w, g = (torch.randn(512, 384) * 3).to(dt), (torch.randn(512, 1) * 2).to(dt)
        fast = exact_product(w, g)
        assert fast.dtype == torch.float32
        assert torch.equal(fast.to(dt), (w.double() * g.double()).to(dt))
        assert torch.equal(fast.double(), w.double() * g.double()), "no rounding before the last"
    assert exact_product(torch.randn(4, 4), torch.randn(4, 1).bfloat16()).dtype == torch.float64

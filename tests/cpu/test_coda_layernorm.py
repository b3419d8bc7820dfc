"""layernorm_into_matmul: LayerNorm(x) @ W = s ⊙ (x @ W') − (s·μ) ⊗ 1ᵀW' + βᵀW, W' = γ ⊙ W.

Properties: the rewritten graph computes the same function (exact in f64, 2x rule in bf16,
also for rows whose mean is far from 0); γ and β are folded into compile-time weights and
vectors; the matmul reads x itself; the statistics are two row reductions of x (Σx, Σx²);
GPT-2's Conv1D form (flatten rows, addmm with a (K, N) weight and bias) is covered.
"""
from __future__ import annotations

import torch
from torch import nn

from coda_fixtures import assert_bf16, assert_exact, nodes_of, randomise_norms
from tilefuse.graph import ir
from tilefuse.graph.rules import layernorm_into_matmul as rule_16bit
from tilefuse.graph.rules.match import peel_casts


def layernorm_into_matmul(g):
    """The rule at any dtype, so its algebra is checked exactly in f64."""
    return rule_16bit(g, any_dtype=True)


class NormLinear(nn.Module):
    def __init__(self, d=24, n=40, affine=True, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=affine)
        self.proj = nn.Linear(d, n, bias=bias)

    def forward(self, x):
        return self.proj(self.norm(x))


class Conv1DForm(nn.Module):
    """GPT-2: ln, view(-1, C), addmm(b, x, W) with W stored (K, N), view back."""

    def __init__(self, d=16, n=48):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.weight, self.bias = nn.Parameter(0.2 * torch.randn(d, n)), nn.Parameter(torch.randn(n))

    def forward(self, x):
        h = self.ln(x)
        y = torch.addmm(self.bias, h.view(-1, h.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], -1)


def test_same_function_folded_and_reading_x():
    torch.manual_seed(0)
    m = randomise_norms(NormLinear())
    x = torch.randn(3, 5, 24)
    g, g2 = assert_exact(m, layernorm_into_matmul, x)
    (mm,) = nodes_of(g2, ir.Contraction)
    assert g2[peel_casts(g2, mm.a)].name == g2.inputs[0], "the matmul reads x itself"
    small = [n.name for n in nodes_of(g, ir.Weight) if n.type.shape == (24,)]
    assert len(small) == 2 and not any(w in g2 for w in small), "γ and β are folded at compile time"
    sums = [n for n in nodes_of(g2, ir.Reduce) if n.axes == (2,)]
    assert len(sums) == 2, "two row reductions of x: the mean and the mean of squares"
    assert_bf16(m, layernorm_into_matmul, x)


def test_rows_with_a_large_mean_bf16_within_2x():
    torch.manual_seed(1)
    m = randomise_norms(NormLinear(d=32, n=16))
    assert_bf16(m, layernorm_into_matmul, torch.randn(64, 32) * 0.5 + 4.0)


def test_without_affine_and_without_matmul_bias():
    torch.manual_seed(2)
    assert_exact(NormLinear(affine=False, bias=False), layernorm_into_matmul, torch.randn(7, 24))


class CohereForm(nn.Module):
    """Cohere's bias-free LayerNorm written out: `x - mean` computed twice (once for the variance,
    once to normalise), the gain on the left."""

    def __init__(self, d=24, n=40, in_f32=True):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.proj = nn.Linear(d, n, bias=False)
        self.in_f32 = in_f32

    def forward(self, x):
        h = x.float() if self.in_f32 else x
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        h = self.weight.to(h.dtype) * ((h - mean) * torch.rsqrt(var + 1e-5))
        return self.proj(h.to(x.dtype))


def test_cohere_form_with_the_difference_computed_twice_is_folded():
    """Exact in f64 as written without Cohere's f32 casts (whose rounding of the normalised rows
    the fold moves), within the 2x rule in bf16 with them."""
    torch.manual_seed(5)
    x = torch.randn(3, 5, 24)
    g, g2 = assert_exact(CohereForm(in_f32=False), layernorm_into_matmul, x)
    (mm,) = nodes_of(g2, ir.Contraction)
    assert g2[peel_casts(g2, mm.a)].name == g2.inputs[0], "the matmul reads x itself"
    gb = assert_bf16(CohereForm(), layernorm_into_matmul, x)
    (mm,) = nodes_of(gb, ir.Contraction)
    assert gb[peel_casts(gb, mm.a)].name == gb.inputs[0], "folded with the f32 casts too"


def test_gpt2_conv1d_form():
    torch.manual_seed(3)
    m = randomise_norms(Conv1DForm())
    x = torch.randn(2, 6, 16)
    _, g2 = assert_exact(m, layernorm_into_matmul, x)
    (mm,) = nodes_of(g2, ir.Contraction)
    assert g2[mm.a].type.shape == (12, 16) and g2[mm.b].type.shape == (16, 48)
    assert_bf16(m, layernorm_into_matmul, x)


def test_does_not_fire_on_a_norm_that_feeds_no_weight():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)

        def forward(self, x, y):
            return self.ln(x) @ y

    torch.manual_seed(4)
    assert_exact(Plain(), layernorm_into_matmul, torch.randn(3, 8), torch.randn(8, 2), fires=False)


def test_only_16bit_matmuls_by_default_and_f32_rows_far_from_zero_keep_their_digits():
    """In f32 the matmul runs in PyTorch, so the rewrite saves nothing and its one-pass variance
    would lose digits on rows with a large mean: it does not fire there, and a compiled
    LayerNorm -> Linear of rows of mean 1e3 (spread 1) stays as close to float64 as eager."""
    import copy

    import tilefuse
    from coda_fixtures import capture

    torch.manual_seed(4)
    m = randomise_norms(NormLinear(d=64, n=32)).eval()
    x = torch.randn(8, 64) + 1000.0
    g = capture(m, x)
    assert rule_16bit(g) is g, "fired on an f32 matmul"
    gb = capture(copy.deepcopy(m).to(torch.bfloat16), x.to(torch.bfloat16))
    assert rule_16bit(gb) is not gb, "no longer fires on a bf16 matmul"
    with torch.no_grad():
        ref = copy.deepcopy(m).double()(x.double())
        eager = m(x).double()
        got = tilefuse.compile(m, (x,))(x).double()
    assert (got - ref).abs().max() <= 2 * (eager - ref).abs().max() + 1e-6


class PostNorm(nn.Module):
    """BERT's post-norm: h = LayerNorm(x); the projection of h, and h again as the residual."""

    def __init__(self, d=24, n=24):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, n)

    def forward(self, x):
        h = self.norm(x)
        return self.proj(h) + h


class ReturnsNorm(NormLinear):
    def forward(self, x):
        h = self.norm(x)
        return self.proj(h), h


def test_a_norm_read_beside_its_matmuls_is_not_folded():
    """Where the norm's output is read by more than contractions (a residual, or returned), the
    norm kernel writes it anyway: the matmul reads it, plainly, with no row scale and rank-1
    correction in its epilogue for nothing saved (rmsnorm_matmul.read_beside_contractions)."""
    torch.manual_seed(5)
    for m in (PostNorm(), ReturnsNorm()):
        assert_exact(randomise_norms(m), layernorm_into_matmul, torch.randn(3, 5, 24), fires=False)


def test_a_norm_feeding_several_matmuls_alone_is_folded_into_each():
    """Pre-norm, read by q, k and v through a row reshape: folded, the statistics made once."""
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(24)
            self.q, self.k = nn.Linear(24, 16), nn.Linear(24, 16)

        def forward(self, x):
            h = self.norm(x).reshape(-1, 24)
            return self.q(h) * self.k(h)

    torch.manual_seed(6)
    _, g2 = assert_exact(randomise_norms(QKV()), layernorm_into_matmul, torch.randn(3, 5, 24))
    assert len([n for n in nodes_of(g2, ir.Reduce) if n.axes == (2,)]) == 2

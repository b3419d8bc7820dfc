"""lmhead_ce_partials: cross-entropy over an LM head's logits becomes per-group partials in the
GEMM epilogue and a small finishing reduction; the [M, V] logits are never materialised.

Properties: the rewritten graph computes the same function (f64 to rounding: the sum of exp
is regrouped; bf16 within DESIGN.md's 2x rule), ignore_index rows included; the plan's GEMM
writes only [M, V / 128] partials and no step reads or writes an [M, V] tensor; the whole
compiled program (CPU: GEMM epilogue and map-reduce kernels through the Loop IR interpreter)
matches PyTorch; graphs without the pattern (or V not a multiple of 128, or the logits also
returned) come back unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tilefuse
from coda_fixtures import assert_bf16, assert_exact, capture
from tilefuse.check import compare
from tilefuse.codegen import epilogue as epi
from tilefuse.compiler import lower_plan
from tilefuse.graph import ir
from tilefuse.graph.fusion import plan
from tilefuse.graph.rules.lmhead_ce import lmhead_ce_partials


class LMHeadCE(nn.Module):
    def __init__(self, d=64, v=512, bias=False):
        super().__init__()
        self.head = nn.Linear(d, v, bias=bias)

    def forward(self, x, target):
        return F.cross_entropy(self.head(x), target)


class LMHeadCEAndLogits(LMHeadCE):
    def forward(self, x, target):
        z = self.head(x)
        return F.cross_entropy(z, target), z


def _inputs(m=48, d=64, v=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g)
    t = torch.randint(0, v, (m,), generator=g)
    t[::5] = -100          # ignore_index rows
    t[1] = v - 1           # the last column
    return x, t


def test_same_function_in_f64_and_ignore_index_rows_drop_out():
    torch.manual_seed(0)
    m = LMHeadCE()
    x, t = _inputs()
    g, g2 = assert_exact(m, lmhead_ce_partials, x, t)
    assert any(isinstance(n, ir.Reduce) and n.type.shape == (48, 4) for n in g2.nodes)
    assert not any(isinstance(n, ir.Reduce) and n.arg in [x.name for x in g2.nodes if x.type.shape == (48, 512)]
                   for n in g2.nodes)  # nothing reduces whole [M, V] rows any more


def test_bf16_within_the_2x_rule_with_bias_and_large_logits():
    torch.manual_seed(1)
    m = LMHeadCE(bias=True)
    with torch.no_grad():
        m.head.weight.mul_(8)  # logits of tens: exp needs its shift
    assert_bf16(m, lmhead_ce_partials, *_inputs(seed=1))


def test_not_fired_without_the_pattern():
    torch.manual_seed(2)
    x, t = _inputs(v=300)
    assert_exact(LMHeadCE(v=300), lmhead_ce_partials, x, t, fires=False)   # V not a multiple of 128
    x, t = _inputs()
    m = LMHeadCEAndLogits()
    g = capture(m.double(), x.double(), t)
    assert lmhead_ce_partials(g) is g   # the logits are an output: they exist anyway


def _planned(m, x, t):
    g2 = lmhead_ce_partials(capture(m, x, t))
    return g2, plan(g2)


def test_plan_materialises_no_logits():
    """The GEMM step writes pmax, psum, psel ([M, V/128] each); no step writes or reads an
    [M, V] tensor; its epilogue stores nothing per element."""
    torch.manual_seed(3)
    m = LMHeadCE().to(torch.bfloat16)
    x, t = _inputs()
    g2, p = _planned(m, x.bfloat16(), t)
    gemms = [s for s in p.steps if s.family == "gemm"]
    assert len(gemms) == 1
    s = gemms[0]
    assert [g2[o].type.shape for o in s.outputs] == [(48, 4)] * 3
    for step in p.steps:
        for name in list(step.inputs) + list(step.outputs):
            assert g2[name].type.shape != (48, 512), f"{step.name} moves the logits {name}"
    _, gemm_kernels = lower_plan(g2, p)
    ep = gemm_kernels[s.name].epilogue
    assert epi.inner_body(ep) == () and epi.partial_width(ep) == 128
    assert sorted(b.shape for b in ep.outputs) == [(48, 4)] * 3


def test_compiled_program_matches_pytorch():
    """tilefuse.compile on CPU (the GEMM's partials epilogue and the finishing kernels run on the
    Loop IR interpreter) gives PyTorch's bf16 loss within the 2x rule of a float64 reference."""
    torch.manual_seed(4)
    m = LMHeadCE(d=64, v=1024).to(torch.bfloat16).eval()
    x, t = _inputs(m=40, v=1024, seed=4)
    x = x.bfloat16()
    c = tilefuse.compiler.compile_stages(m, (x, t))
    assert "lmhead_ce_partials" in [f.rule for f in c.fired]
    gemm = [s for s in c.plan.steps if s.family == "gemm"]
    assert len(gemm) == 1 and gemm[0].gemm.partials
    fn = tilefuse.compile(m, (x, t))
    out = fn(x, t)
    with torch.no_grad():
        eager = m(x, t)
        ref = F.cross_entropy(x.double() @ m.head.weight.double().T, t)
    res = compare("loss", out.reshape(()), ref, eager)
    assert res.ok, res


def test_the_rule_runs_only_where_the_template_renders_partials():
    """compile_stages applies lmhead_ce_partials for sm_90a (and the CPU interpreter), never for
    sm_80, whose GEMM template declines partial reductions: there the logits stay a GEMM output."""
    torch.manual_seed(5)
    m = LMHeadCE(d=64, v=1024).to(torch.bfloat16).eval()
    x, t = _inputs(m=40, v=1024, seed=5)
    x = x.bfloat16()
    hopper = tilefuse.compiler.compile_stages(m, (x, t), arch="sm_90a")
    ampere = tilefuse.compiler.compile_stages(m, (x, t), arch="sm_80")
    assert "lmhead_ce_partials" in [f.rule for f in hopper.fired]
    assert "lmhead_ce_partials" not in [f.rule for f in ampere.fired]
    assert not any(s.gemm.partials for s in ampere.plan.steps if s.family == "gemm")

"""lmhead_ce_partials: cross-entropy over an LM head's logits becomes per-group partials in the
GEMM epilogue and a small finishing reduction; the [M, V] logits are never materialised.

Properties: the rewritten graph computes the same function (float64 to rounding, the graphs run
at f64 precision: the sum of exp is regrouped; bf16 within DESIGN.md's 2x rule), ignore_index
rows included, for V a multiple of 128 or not (the short last group is padded with -inf, which
adds nothing), for the forms a training loss takes (`logits.float().view(-1, V)`, bf16 logits
viewed, a bias, reduction mean / sum / none) and for hypothesis' shapes; the plan's GEMM writes
only [M, ceil(V / 128)] partials and no step reads or writes an [M, V] tensor; its epilogue
renders and compiles for sm_90a without spills; the whole compiled program (CPU: GEMM epilogue
and map-reduce kernels through the Loop IR interpreter) matches PyTorch; graphs where the
partials cannot save the logits' write (logits returned, no generated GEMM, another loss) come
back unchanged.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tilefuse
from coda_fixtures import EXACT, assert_bf16, capture, run
from tilefuse.check import compare, float64_reference, rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90
from tilefuse.compiler import lower_plan
from tilefuse.graph import ir
from tilefuse.graph.fusion import plan
from tilefuse.graph.rules.lmhead_ce import lmhead_ce_partials
from tilefuse.runtime import nvrtc

W = epi.PARTIAL_WIDTH
FORMS = ("flat", "float", "bf16", "sum", "none", "shift", "window")


class LMHeadCE(nn.Module):
    """An LM head and its loss, in the forms user code and transformers write it:
    flat: F.cross_entropy(head(x), target) on [M, D] rows;
    float: F.cross_entropy(head(x).float().view(-1, V), target.view(-1), ignore_index=-100) on
    [B, S, D] (what transformers' ForCausalLMLoss does with its shifted labels);
    bf16: the same without .float(); sum / none: the float form with that reduction;
    shift: the logits of all positions but the last against the labels shifted by one (the
    older transformers loss and many training loops); window: slices of two leading dims."""

    def __init__(self, d=64, v=512, bias=False, form="flat"):
        super().__init__()
        self.head = nn.Linear(d, v, bias=bias)
        self.form = form

    def forward(self, x, target):
        z = self.head(x)
        if self.form == "flat":
            return F.cross_entropy(z, target)
        v = z.shape[-1]
        if self.form == "shift":  # the logits of positions 0..S-2 against the labels of 1..S-1
            return F.cross_entropy(z[:, :-1].float().reshape(-1, v), target[:, 1:].reshape(-1), ignore_index=-100)
        if self.form == "window":  # slices of two dims, two of them composed on one
            return F.cross_entropy(z[1:, 2:][:, :-1].float().reshape(-1, v), target[1:, 3:].reshape(-1))
        if self.form == "bf16":
            return F.cross_entropy(z.view(-1, v), target.view(-1), ignore_index=-100)
        reduction = {"float": "mean", "sum": "sum", "none": "none"}[self.form]
        return F.cross_entropy(z.float().view(-1, v), target.view(-1), ignore_index=-100, reduction=reduction)


class LMHeadCEAndLogits(LMHeadCE):
    def forward(self, x, target):
        z = self.head(x)
        return F.cross_entropy(z, target), z


def _inputs(m=48, d=64, v=512, seed=0, form="flat"):
    g = torch.Generator().manual_seed(seed)
    lead = (m,) if form == "flat" else (2, m // 2)
    x = torch.randn(lead + (d,), generator=g)
    t = torch.randint(0, v, lead, generator=g)
    flat = t.view(-1)
    flat[::5] = -100          # ignore_index rows
    flat[1] = v - 1           # the last column (in the short last group when W does not divide V)
    return x, t


def _fired(m, x, t):
    """The module in bf16, captured, and the rule's result (asserted to have fired)."""
    m = m.to(torch.bfloat16).eval()
    x = x.bfloat16()
    g = capture(m, x, t)
    g2 = lmhead_ce_partials(g)
    assert g2 is not g, "lmhead_ce_partials did not fire"
    return g, g2, x


def _same_function(m, x, t):
    """Fires, and both graphs give the same loss computed in float64 throughout (the bf16
    operands as they are): the rewrite changes the function by rounding only."""
    g, g2, xb = _fired(m, x, t)
    err = rel_error(run(g2, [xb, t], "f64"), run(g, [xb, t], "f64"))
    assert err <= EXACT, f"rewritten graph differs by {err:.3g}"
    return g, g2


def _rows(x):
    return math.prod(x.shape[:-1])


def _no_logits_moved(g2, p, rows, v):
    """No step reads or writes a tensor of rows x V values or more, weights aside."""
    for step in p.steps:
        for name in list(step.inputs) + list(step.outputs):
            n = g2[name]
            assert isinstance(n, ir.Weight) or n.type.numel < rows * v, f"{step.name} moves the logits {name}"


@pytest.mark.parametrize("v", [512, 1000, 257, 129, 100])
@pytest.mark.parametrize("form", FORMS)
def test_same_function_at_any_vocab_size_and_ignore_index_rows_drop_out(form, v):
    """V a multiple of 128 or not: the short last group's padded columns (-inf) add nothing."""
    torch.manual_seed(0)
    x, t = _inputs(v=v, form=form)
    g, g2 = _same_function(LMHeadCE(v=v, form=form), x, t)
    groups = -(-v // W)
    assert any(isinstance(n, ir.Reduce) and n.type.shape == (48, groups) for n in g2.nodes)
    whole = {n.name for n in g2.nodes if n.type.shape[-1:] == (v,) and n.type.numel == 48 * v}
    assert not any(isinstance(n, ir.Reduce) and n.arg in whole for n in g2.nodes)  # no whole-row reduce left
    pads = [n for n in g2.nodes if isinstance(n, ir.Gather) and n.type.dtype == "f32"]
    assert bool(pads) == (v % W != 0)  # the -inf padding of the logits, only there


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 20), d=st.sampled_from([8, 16, 40, 64]),
       v=st.integers(2, 700), bias=st.booleans(), form=st.sampled_from(("flat", "float", "bf16", "shift")),
       seed=st.integers(0, 2 ** 16))
def test_same_function_at_hypothesis_shapes(batch, seq, d, v, bias, form, seed):
    torch.manual_seed(seed)
    seq = max(seq, 2) if form == "shift" else seq  # (a loss over some rows)
    m = LMHeadCE(d=d, v=v, bias=bias, form=form)
    g = torch.Generator().manual_seed(seed)
    lead = (batch * seq,) if form == "flat" else (batch, seq)
    x = torch.randn(lead + (d,), generator=g)
    t = torch.randint(0, v, lead, generator=g)
    # some rows ignored, never all (a loss over no rows is 0 / 0): the first row scored is kept,
    # which for the shifted form is each sequence's label 1
    if form == "shift":
        t[:, 2::3] = -100
    else:
        t.view(-1)[1::3] = -100
    _same_function(m, x, t)


@pytest.mark.parametrize("v", [512, 300])
def test_bf16_within_the_2x_rule_with_bias_and_large_logits(v):
    torch.manual_seed(1)
    m = LMHeadCE(v=v, bias=True)
    with torch.no_grad():
        m.head.weight.mul_(8)  # logits of tens: exp needs its shift
    x, t = _inputs(v=v, seed=1)
    _fired(copy.deepcopy(m), x, t)  # (a bias add between the product and the loss)
    assert_bf16(m, lmhead_ce_partials, x, t)


def test_not_fired_where_nothing_is_saved():
    """Logits the program returns are written anyway; without a generated GEMM (an f32 or f64
    head) the partials would only add kernels; label smoothing is another loss."""
    torch.manual_seed(2)
    x, t = _inputs()
    for m, xx in [(LMHeadCEAndLogits().bfloat16(), x.bfloat16()), (LMHeadCE(), x), (LMHeadCE().double(), x.double())]:
        g = capture(m, xx, t)
        assert lmhead_ce_partials(g) is g

    class Smoothed(LMHeadCE):
        def forward(self, x, target):
            return F.cross_entropy(self.head(x), target, label_smoothing=0.1)

    g = capture(Smoothed().bfloat16(), x.bfloat16(), t)
    assert lmhead_ce_partials(g) is g


def _planned(m, x, t):
    g2 = lmhead_ce_partials(capture(m, x, t))
    return g2, plan(g2)


@pytest.mark.parametrize("v,form", [(512, "flat"), (300, "float"), (257, "bf16"), (300, "shift")])
def test_plan_materialises_no_logits(v, form):
    """The GEMM step writes pmax, psum, psel ([M, ceil(V/128)] each, M all the product's rows);
    no step writes or reads an [M, V] tensor (nor the -inf padding); its epilogue stores nothing
    per element."""
    torch.manual_seed(3)
    m = LMHeadCE(v=v, form=form).to(torch.bfloat16)
    x, t = _inputs(v=v, form=form)
    g2, p = _planned(m, x.bfloat16(), t)
    gemms = [s for s in p.steps if s.family == "gemm"]
    assert len(gemms) == 1
    s = gemms[0]
    groups = -(-v // W)
    assert [g2[o].type.shape for o in s.outputs] == [(48, groups)] * 3
    _no_logits_moved(g2, p, 48, v)
    for step in p.steps:  # (the padding's gather is not run)
        assert not any(isinstance(g2[o], ir.Gather) and g2[o].type.dtype == "f32" for o in step.outputs)
    _, gemm_kernels = lower_plan(g2, p)
    ep = gemm_kernels[s.name].epilogue
    assert epi.inner_body(ep) == () and epi.partial_width(ep) == W
    assert sorted(b.shape for b in ep.outputs) == [(48, groups)] * 3


def _compiles_for_sm90a(g2, p, scheds=(None, gemm_sm90.GemmSchedule(64, 128, stages=8, consumers=1))):
    """Each GEMM step with partials renders for sm_90a and NVRTC compiles it without spills."""
    _, gemms = lower_plan(g2, p)
    done = 0
    for lowered in gemms.values():
        if epi.partials_loop(lowered.epilogue) is None:
            continue
        for sched in scheds:
            src = gemm_sm90.render(lowered.problem(), sched)
            cubin = nvrtc.compile_cuda(src.source, src.name, "sm_90a")
            assert cubin.info.clean, cubin.info
            done += 1
    assert done


@pytest.mark.parametrize("v,form,bias", [(1000, "float", True), (257, "bf16", False), (512, "flat", False),
                                         (300, "shift", False)])
def test_the_partials_epilogue_compiles_for_sm90a(v, form, bias):
    torch.manual_seed(6)
    m = LMHeadCE(v=v, form=form, bias=bias).to(torch.bfloat16)
    x, t = _inputs(v=v, form=form)
    _compiles_for_sm90a(*_planned(m, x.bfloat16(), t))


@pytest.mark.parametrize("v,form", [(1024, "flat"), (1000, "float"), (129, "sum"), (300, "shift"),
                                    (257, "window")])
def test_compiled_program_matches_pytorch(v, form):
    """tilefuse.compile on CPU (the GEMM's partials epilogue and the finishing kernels run on the
    Loop IR interpreter) gives PyTorch's bf16 loss within the 2x rule of a float64 reference."""
    torch.manual_seed(4)
    m = LMHeadCE(d=64, v=v, form=form).to(torch.bfloat16).eval()
    x, t = _inputs(m=40, v=v, seed=4, form=form)
    x = x.bfloat16()
    c = tilefuse.compiler.compile_stages(m, (x, t))
    assert "lmhead_ce_partials" in [f.rule for f in c.fired]
    gemm = [s for s in c.plan.steps if s.family == "gemm"]
    assert len(gemm) == 1 and gemm[0].gemm.partials
    fn = tilefuse.compile(m, (x, t))
    out = fn(x, t)
    with torch.no_grad():
        eager = m(x, t)
    res = compare("loss", out.reshape(()), float64_reference(m, (x, t)), eager)
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

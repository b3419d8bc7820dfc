"""layernorm_partials: a LayerNorm's two row sums (of x and of x·x) become per-group partials in
the epilogue of the GEMM that wrote x, and a small kernel finishes the statistics from them.

Properties: the rewritten graph computes the same function (float64 to rounding: the sums are
regrouped; bf16 within DESIGN.md's 2x rule); the producing GEMM writes x and both [M, N / 128]
partials, no kernel but GEMMs reads x any more, and one map-reduce kernel finishes mean, var,
rstd and s·μ; the epilogue takes both partials beside its element code (gemm_sm90.InlinePartials)
and compiles for sm_90a without spills, keeping its TMA store; the epilogue sums x and x·x as
stored; a GPT-2 (transformers) compiles with the rule on its four residual GEMMs and matches
PyTorch (CPU: the Loop IR interpreter), one 128-column group a row included; graphs where
partials would save nothing (the norm's output read by a kernel, x a program input, N not a
multiple of 128, sm_80) come back unchanged.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tilefuse
import tilefuse.compiler
from coda_fixtures import EXACT, ResidualNormLinear, bf16_through_coda, run_all
from tilefuse import dtypes, models
from tilefuse.check import compare, float64_reference, rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90
from tilefuse.compiler import lower_plan
from tilefuse.graph import ir
from tilefuse.graph.fusion import plan
from tilefuse.graph.rules import layernorm_partials as lp
from tilefuse.graph.rules import rmsnorm_partials as rp
from tilefuse.graph.rules.layernorm_partials import layernorm_partials
from tilefuse.loop.interp import run_kernel
from tilefuse.runtime import nvrtc

W = epi.PARTIAL_WIDTH


def ResidualLayerNormLinear(**kw):
    """coda_fixtures.ResidualNormLinear with a LayerNorm (biases on O and the first projection)."""
    return ResidualNormLinear(norm="layer", **kw)


def _inputs(*lead, d=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # (an offset mean per row, so that the rank-1 correction and the mean's partials matter)
    return torch.randn(*lead, d, generator=gen) + 0.5, torch.randn(*lead, d, generator=gen)


def _graphs(module, *inputs):
    """The module in bf16, captured, through the CODA rules, and layernorm_partials' result."""
    return bf16_through_coda(module, layernorm_partials, *inputs)


run = run_all


def _row_reductions(g: ir.Graph, rows: int, n: int) -> list[ir.Reduce]:
    """The reductions in g that read whole rows of n elements."""
    return [x for x in g.nodes if isinstance(x, ir.Reduce) and g[x.arg].type.numel == rows * n
            and g[x.arg].type.shape[-1] == n]


@pytest.mark.parametrize("lead", [(2, 40), (33,), (1, 1)])
def test_same_function_and_both_row_reductions_gone(lead):
    torch.manual_seed(0)
    _, xs, g, g2 = _graphs(ResidualLayerNormLinear(), *_inputs(*lead))
    assert g2 is not g, "layernorm_partials did not fire"
    err = max(rel_error(a, b) for a, b in zip(run(g2, xs, "f64"), run(g, xs, "f64")))
    assert err <= EXACT, f"rewritten graph differs by {err:.3g}"
    rows = int(np.prod(lead))
    assert len(_row_reductions(g, rows, 256)) == 2, "the folded LayerNorm reduces x twice"
    assert not _row_reductions(g2, rows, 256), "no whole-row reduction left"
    parts = [x for x in g2.nodes if isinstance(x, ir.Reduce) and x.type.shape == (rows, 256 // epi.width_for_rows(rows))]
    assert len(parts) == 2


def test_bf16_within_the_2x_rule():
    torch.manual_seed(1)
    m, xs, g, g2 = _graphs(ResidualLayerNormLinear(), *_inputs(3, 17))
    assert g2 is not g
    with torch.no_grad():
        eager = m(*xs)
    for name, got, r, e in zip(("y", "h"), run(g2, xs), float64_reference(m, xs), eager):
        c = compare(name, got, r, e)
        assert c.ok, c


def _partials_step(g2):
    p = plan(g2)
    steps = [s for s in p.steps if s.family == "gemm" and s.gemm.partials]
    assert len(steps) == 1
    return p, steps[0]


def test_plan_reads_x_only_in_gemms_and_finishes_in_one_kernel():
    """The O GEMM writes h and two [M, 2] partials (of h' and of h'·h'); the finishing kernel
    reads only those; no map-reduce step reads h; the epilogue takes both partials beside its
    element code (TMA store kept) and compiles for sm_90a without spills."""
    torch.manual_seed(2)
    _, xs, _, g2 = _graphs(ResidualLayerNormLinear(), *_inputs(2, 40))
    p, s = _partials_step(g2)
    assert [k for k, _, _ in s.gemm.partials] == ["sum", "sum"]
    (_, _, v0), (_, _, v1) = s.gemm.partials
    assert g2[v0].op == "cast" and g2[v1].op == "mul" and g2[v1].args == (v0, v0), "x' and x'·x'"
    h, p_sum, p_sq = s.gemm.outs
    assert g2[h].type.shape == (80, 256) or g2[h].type.shape == (2, 40, 256)
    assert g2[p_sum].type.shape == g2[p_sq].type.shape == (80, 2)
    assert f"partials of {h} per {W} columns: sum -> {p_sum}; sum -> {p_sq}" in str(p)
    hs = {h} | {x.name for x in g2.nodes if isinstance(x, ir.View) and x.arg == h}
    readers = [t for t in p.steps if t.family == "mapreduce" and hs & set(t.inputs)]
    assert not readers, f"{[t.name for t in readers]} still read x"
    finish = [t for t in p.steps if t.family == "mapreduce"]
    assert len(finish) == 1 and {g2[o].type.shape for o in finish[0].outputs} == {(2, 40, 1)}, "rstd and s·μ"
    assert all(g2[i].type.numel == 80 * 2 for i in finish[0].inputs)
    _, lowered = lower_plan(g2, p)
    problem = lowered[s.name].problem()
    inline = gemm_sm90.inline_partials(problem, problem.epilogue)
    assert inline is not None and len(inline.reds) == 2
    for sched in (None, gemm_sm90.GemmSchedule(128, 128, stages=6), gemm_sm90.GemmSchedule(128, 256, stages=4)):
        src = gemm_sm90.render(problem, sched)
        assert (src.c_box is not None) == src.schedule.tma_store, "the tile keeps its TMA store"
        assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean


def test_the_epilogue_sums_x_and_its_square_as_stored():
    """The lowered epilogue (run by the Loop IR interpreter on a random accumulator, bias and
    residual) sums the bf16 values it stores and their squares, as a row kernel reading x
    would: each group's partials equal the f64 sums over the stored tile to f32 rounding."""
    torch.manual_seed(7)
    _, _, _, g2 = _graphs(ResidualLayerNormLinear(), *_inputs(2, 40))
    p, s = _partials_step(g2)
    _, lowered = lower_plan(g2, p)
    lg = lowered[s.name]
    rng = np.random.default_rng(0)
    feeds = {"acc": (rng.standard_normal((80, 256)) * 3 + 1).astype(np.float32)}
    for b in lg.bindings:
        buf = lg.epilogue.buffer(b.buffer)
        if buf.role == "in":
            feeds[b.buffer] = rng.standard_normal(buf.shape).astype(dtypes.to_numpy(buf.dtype))
    out = run_kernel(lg.epilogue, feeds)
    by_tensor = {b.tensor: b.buffer for b in lg.outputs}
    h, p_sum, p_sq = s.gemm.outs
    stored = np.asarray(out[by_tensor[h]], dtype=np.float64).reshape(80, 2, W)
    np.testing.assert_allclose(out[by_tensor[p_sum]], stored.sum(-1), rtol=2e-6, atol=1e-5)
    np.testing.assert_allclose(out[by_tensor[p_sq]], (stored ** 2).sum(-1), rtol=2e-6)


class NormLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(256), nn.Linear(256, 384)

    def forward(self, x):
        return self.proj(self.norm(x))


@pytest.mark.parametrize("case", ["norm output read", "x an input", "N not a multiple of 128"])
def test_not_fired_where_nothing_is_saved(case):
    torch.manual_seed(3)
    if case == "norm output read":  # a kernel reads h to normalise it: its row sums are free there
        _, _, g, g2 = _graphs(ResidualLayerNormLinear(norm_out=True), *_inputs(2, 8))
    elif case == "x an input":  # no GEMM wrote x
        _, _, g, g2 = _graphs(NormLinear(), _inputs(2, 8)[0])
    else:
        _, _, g, g2 = _graphs(ResidualLayerNormLinear(d=200), *_inputs(2, 8, d=200))
    assert g2 is g


@pytest.mark.parametrize("hidden", [128, 256])
def test_gpt2_compiled_matches_pytorch_and_the_rule_runs_only_for_sm90a(hidden):
    """GPT-2's LayerNorms after the first take their statistics from the attention and MLP
    output projections (bias + residual in their epilogues): four GEMMs with partials in two
    layers, ln_f's from the last. At hidden 128 a row is one group, and its partial is the row's
    sum. The compiled program (CPU interpreter) matches PyTorch's bf16 model within the 2x rule.
    sm_80's template declines partials: there the rule does not run."""
    pytest.importorskip("transformers")
    b = models.build("gpt2", 2, hidden=hidden, seq=8, batch=2, vocab=64, dtype=torch.bfloat16)
    c = tilefuse.compiler.compile_stages(b.model, b.inputs, arch="sm_90a")
    assert "layernorm_partials" in [f.rule for f in c.fired]
    parts = [s for s in c.plan.steps if s.family == "gemm" and s.gemm.partials]
    assert len(parts) == 4, "attention and MLP output projections of both layers"
    assert not any(s.family == "extern" and any(o.endswith("_sum") for o in s.outputs) for s in c.plan.steps), \
        "the finishing sums run in tilefuse kernels"
    prog = tilefuse.compile(b.model, b.inputs)
    with torch.no_grad():
        eager = b.model(*b.inputs)
    res = compare("gpt2", prog(*b.inputs), float64_reference(b.model, b.inputs), eager)
    assert res.ok, res
    ampere = tilefuse.compiler.compile_stages(b.model, b.inputs, arch="sm_80")
    assert "layernorm_partials" not in [f.rule for f in ampere.fired]


class ReluToo(nn.Module):
    """h = x + O(a), LayerNorm(h) into a projection, and relu(h): a kernel reads h anyway."""

    def __init__(self, d=256):
        super().__init__()
        self.o, self.norm, self.p = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 384)

    def forward(self, x, a):
        h = x + self.o(a)
        return self.p(self.norm(h)), torch.relu(h)


def test_not_fired_where_another_kernel_reads_x():
    """The statistics' partials would only add work to the GEMM when a map kernel reads h
    anyway (its row sums are free there): the rule's last check leaves the graph."""
    torch.manual_seed(4)
    _, _, g, g2 = _graphs(ReluToo(), *_inputs(2, 8))
    assert any(isinstance(n, ir.Map) and n.op == "rsqrt" for n in g.nodes), "the norm was folded"
    assert g2 is g


class RowShapes(nn.Module):
    """One LayerNorm into two projections whose operands are rows of different shapes."""

    def __init__(self, d=256):
        super().__init__()
        self.o, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
        self.q, self.k = nn.Linear(d, 128), nn.Linear(d, 128, bias=False)

    def forward(self, x, a):
        h = x + self.o(a)
        z = self.norm(h)
        return self.q(z).sum(-1), self.k(z.reshape(-1, z.shape[-1])).sum(-1), h


def test_one_norm_one_set_of_statistics_for_matmuls_of_any_row_shape():
    """The folded norm reduces x twice however many matmuls it feeds, even of rows shaped
    differently, so the partials rule can take both sums; the result is the same function."""
    torch.manual_seed(5)
    _, xs, g, g2 = _graphs(RowShapes(), *_inputs(2, 8))
    assert len(_row_reductions(g, 16, 256)) == 2
    assert g2 is not g and not _row_reductions(g2, 16, 256)
    err = max(rel_error(a, b) for a, b in zip(run(g2, xs, "f64"), run(g, xs, "f64")))
    assert err <= EXACT


@pytest.mark.parametrize("affine", ["none", "no bias"])
def test_layernorm_without_affine_or_bias_compiles_and_matches_pytorch(affine):
    """A LayerNorm with no weight (matched as an RMSNorm of x − μ) or no bias before a matmul
    compiles (the folded graph's cast of x is new: its shape is x's) and matches PyTorch."""
    torch.manual_seed(6)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.o = nn.Linear(256, 256)
            self.norm = nn.LayerNorm(256, elementwise_affine=affine != "none", bias=affine != "no bias")
            self.p = nn.Linear(256, 384)

        def forward(self, x, a):
            h = x + self.o(a)
            return self.p(self.norm(h)), h

    m = M().to(torch.bfloat16).eval()
    xs = [t.bfloat16() for t in _inputs(2, 40)]
    out = tilefuse.compile(m, xs)(*xs)
    with torch.no_grad():
        eager = m(*xs)
    for i, (o, r, e) in enumerate(zip(out, float64_reference(m, xs), eager)):
        c = compare(f"out{i}", o, r, e)
        assert c.ok, c


def test_a_reader_joining_an_epilogue_through_an_operand_map_counts_as_read_by_that_gemm():
    """x's reader y = r·v + x joins mm2's epilogue through the operand map r·v (a rank-1 term the
    epilogue computes, made a member by z = mm2 - r·v), though y reads nothing of mm2: no walk
    back from y reaches mm2. The rule asks each reader's own producers first, then every other
    GEMM, so y still counts as read by a GEMM and the partials go into mm1's epilogue, as when
    every contraction was matched for each norm (a review found the producers-only version
    refused this graph)."""
    T = ir.TensorType
    m, n, k = 16, 256, 64
    nodes = [ir.Input("a", T((m, k), "bf16")), ir.Input("b", T((m, k), "bf16")), ir.Input("res", T((m, n), "f32")),
             ir.Input("r", T((m, 1), "f32")), ir.Input("v", T((n,), "f32")),
             ir.Weight("w1", T((k, n), "bf16")), ir.Weight("w2", T((k, n), "bf16")),
             ir.Contraction("mm1", T((m, n), "f32"), "a", "w1"),
             ir.Map("x", T((m, n), "f32"), "add", ("mm1", "res")),
             ir.Map("xf", T((m, n), "f32"), "cast", ("x",)),
             ir.Reduce("mu", T((m, 1), "f32"), "mean", "xf", (1,), True),
             ir.Map("sq", T((m, n), "f32"), "mul", ("xf", "xf")),
             ir.Reduce("msq", T((m, 1), "f32"), "mean", "sq", (1,), True),
             ir.Contraction("mm2", T((m, n), "f32"), "b", "w2"),
             ir.Map("inner", T((m, n), "f32"), "mul", ("r", "v")),
             ir.Map("z", T((m, n), "f32"), "sub", ("mm2", "inner")),
             ir.Map("y", T((m, n), "f32"), "add", ("inner", "x")),
             ir.Map("out", T((m, n), "f32"), "add", ("z", "y"))]
    g = ir.Graph(tuple(nodes), ("a", "b", "res", "r", "v"), ("out", "mu", "msq"))
    new = layernorm_partials(g)
    assert new is not g
    (step,) = [s for s in plan(new).steps if s.family == "gemm" and "mm1" in s.nodes]
    assert {"xf", "sq"} <= set(step.nodes) and len(step.outputs) == 3  # x and both partials


def _gpt2_before_the_rule(layers: int, monkeypatch) -> ir.Graph:
    """A transformers GPT-2's graph as the partials rules get it (compiled with them off)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("TILEFUSE_NORM_PARTIALS", "0")
    b = models.build("gpt2", layers, hidden=128, seq=8, batch=2, vocab=64, dtype=torch.bfloat16)
    return tilefuse.compiler.compile_stages(b.model, b.inputs, arch="sm_90a").graph


def _partials(g: ir.Graph) -> int:
    return sum(1 for n in g.nodes if isinstance(n, ir.Reduce) and n.name.endswith("_partials"))


@pytest.mark.parametrize("layers", [1, 3])
def test_all_norms_at_once_give_the_graph_of_one_norm_at_a_time(layers, monkeypatch):
    """The rule rewrites every LayerNorm in one pass and puts back those no GEMM takes (the
    first layer's, which reads the embeddings): the same graph as rewriting and checking one
    norm at a time, in the graph of those before it, which was quadratic in the layers."""
    g = _gpt2_before_the_rule(layers, monkeypatch)
    found = lp.candidates(g)
    assert len(found) == 2 * layers + 1  # (ln_1, ln_2 a layer, and ln_f)
    fast = layernorm_partials(g)
    assert str(fast) == str(rp.one_at_a_time(g, found, lambda h, n: lp._rewritten(h, n, W)))
    assert _partials(fast) == 2 * (2 * layers)  # (a sum and a sum of squares each, but the first's)


def test_where_one_norms_rewrite_would_change_anothers_answer_the_rule_goes_one_at_a_time(monkeypatch):
    """Should a GEMM take a norm's partials only while some other norm is not rewritten, the
    check once more of the norms kept fails, and the rule goes one norm at a time. Here GEMMs
    take no partials in a graph holding exactly eight (four norms' sums and sums of squares),
    which the check once more of a 2-layer GPT-2 is (its first norm reads the embeddings)."""
    g = _gpt2_before_the_rule(2, monkeypatch)

    class Picky(rp.Specs):
        def some(self, near, ok):
            return _partials(self.g) != 8 and super().some(near, ok)

    monkeypatch.setattr(lp, "Specs", Picky)
    got = layernorm_partials(g)
    assert str(got) == str(rp.one_at_a_time(g, lp.candidates(g), lambda h, n: lp._rewritten(h, n, W)))
    assert _partials(got) == 6

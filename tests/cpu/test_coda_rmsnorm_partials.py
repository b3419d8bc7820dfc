"""rmsnorm_partials: an RMSNorm's sum of squares becomes per-group partials in the epilogue of
the GEMM that wrote x, and a small finishing reduction over [M, N / 128] (N / 16 at up to 8 rows).

Properties: the rewritten graph computes the same function (float64 to rounding: the graphs
run at f64 precision, the sum is regrouped; bf16 within DESIGN.md's 2x rule); the plan's
producing GEMM writes x and the [M, N / 128] partials, and no kernel but GEMMs reads x any more;
the finishing sum, the mean, ε and rsqrt are one map-reduce kernel; the epilogue takes the
partials beside its element code (gemm_sm90.InlinePartials) and compiles for sm_90a without
spills, keeping its TMA store; the compiled program (CPU: the Loop IR interpreter) matches
PyTorch on a Llama block; graphs where partials would save nothing (a norm whose output a
kernel reads anyway, x a program input, N not a multiple of 128, sm_80) come back unchanged.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tilefuse
from coda_fixtures import EXACT, ResidualNormLinear, bf16_through_coda, randomise_norms, run_all
from tilefuse import models
from tilefuse.check import compare, float64_reference, rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90
from tilefuse.compiler import lower_plan
from tilefuse.graph import ir
from tilefuse.graph.fusion import plan
from tilefuse.graph.rules import rmsnorm_partials as rp
from tilefuse.graph.rules.rmsnorm_partials import rmsnorm_partials
from tilefuse.runtime import nvrtc

W = epi.PARTIAL_WIDTH


def _graphs(module, *inputs):
    """The module in bf16, captured, through the CODA rules, and rmsnorm_partials' result."""
    return bf16_through_coda(module, rmsnorm_partials, *inputs)


run = run_all


def _inputs(*lead, d=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, d, generator=gen), torch.randn(*lead, d, generator=gen)


@pytest.mark.parametrize("lead", [(2, 40), (33,), (1, 1)])
def test_same_function_and_the_row_reduction_gone(lead):
    torch.manual_seed(0)
    m, xs, g, g2 = _graphs(ResidualNormLinear(), *_inputs(*lead))
    assert g2 is not g, "rmsnorm_partials did not fire"
    err = max(rel_error(a, b) for a, b in zip(run(g2, xs, "f64"), run(g, xs, "f64")))
    assert err <= EXACT, f"rewritten graph differs by {err:.3g}"
    rows = 1
    for d in lead:
        rows *= d
    parts = [n for n in g2.nodes if isinstance(n, ir.Reduce) and n.type.shape == (rows, 256 // epi.width_for_rows(rows))]
    assert len(parts) == 1
    assert not any(isinstance(n, ir.Reduce) and g2[n.arg].type.shape[-1] == 256 and n is not parts[0]
                   and g2[n.arg].type.numel == rows * 256 for n in g2.nodes), "no whole-row reduce left"


def test_bf16_within_the_2x_rule():
    torch.manual_seed(1)
    m, xs, g, g2 = _graphs(ResidualNormLinear(), *_inputs(3, 17))
    assert g2 is not g
    with torch.no_grad():
        eager = m(*xs)
    ref = float64_reference(m, xs)
    for name, got, r, e in zip(("y", "h"), run(g2, xs), ref, eager):
        c = compare(name, got, r, e)
        assert c.ok, c


def test_plan_reads_x_only_in_gemms_and_finishes_in_one_kernel():
    """The O GEMM writes h and the partials [M, 2]; the finishing kernel reads only those; no
    map-reduce step reads h; the epilogue takes the partials beside its element code (TMA
    store kept) and compiles for sm_90a without spills."""
    torch.manual_seed(2)
    _, xs, _, g2 = _graphs(ResidualNormLinear(), *_inputs(2, 40))
    p = plan(g2)
    gemms = [s for s in p.steps if s.family == "gemm"]
    with_parts = [s for s in gemms if s.gemm.partials]
    assert len(with_parts) == 1
    s = with_parts[0]
    assert [k for k, _, _ in s.gemm.partials] == ["sum"]
    h, psq = s.gemm.outs
    assert g2[h].type.shape == (2, 40, 256) and g2[psq].type.shape == (80, 2)
    assert f"partials of {h} per {W} columns: sum -> {psq}" in str(p), "the plan says where they go"
    readers = [t for t in p.steps if t.family == "mapreduce" and h in t.inputs]
    assert not readers, f"{[t.name for t in readers]} still read x"
    finish = [t for t in p.steps if t.family == "mapreduce" and any(g2[i].type.numel == 80 * 2 for i in t.inputs)]
    assert len(finish) == 1 and {g2[o].type.shape for o in finish[0].outputs} == {(2, 40, 1)}
    _, lowered = lower_plan(g2, p)
    problem = lowered[s.name].problem()
    assert gemm_sm90.inline_partials(problem, problem.epilogue) is not None
    for sched in (None, gemm_sm90.GemmSchedule(128, 128, stages=6)):
        src = gemm_sm90.render(problem, sched)
        assert (src.c_box is not None) == src.schedule.tma_store, "the tile keeps its TMA store"
        assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean


@pytest.mark.parametrize("lead,width", [((1, 1), 16), ((4, 1), 16), ((8,), 16), ((9,), W), ((2, 8), W)])
def test_a_few_rows_group_the_gemvs_16_columns(lead, width):
    """At up to gemv.MAX_M rows (a decode step) the partials group 16 columns, a CTA's of the
    GEMV, which then takes the producing GEMM (the tensor-core form, at one row too) and compiles
    it without spills; at more rows, 128 (the tile templates'). The sm_90a template renders 16 too
    (TILEFUSE_GEMV=0)."""
    torch.manual_seed(5)
    _, _, _, g2 = _graphs(ResidualNormLinear(), *_inputs(*lead))
    p = plan(g2)
    (s,) = [s for s in p.steps if s.family == "gemm" and s.gemm.partials]
    assert s.gemm.partial_width == width
    _, lowered = lower_plan(g2, p)
    problem = lowered[s.name].problem()
    from tilefuse.codegen import gemv

    if width == W:
        assert "more than 8 rows" in gemv.why_not(problem)
        return
    assert gemv.why_not(problem) == ""
    assert isinstance(gemv.default_schedule(problem), gemv.MmaGemvSchedule)
    src = gemv.render(problem)
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean
    tile = gemm_sm90.render(problem, gemm_sm90.GemmSchedule(128, 128, stages=6))
    assert nvrtc.compile_cuda(tile.source, tile.name, "sm_90a").info.clean


@pytest.mark.parametrize("case", ["norm output read", "x an input", "N not a multiple of 128"])
def test_not_fired_where_nothing_is_saved(case):
    torch.manual_seed(3)
    if case == "norm output read":  # a kernel reads h to normalise it: its sum of squares is free there
        _, _, g, g2 = _graphs(ResidualNormLinear(norm_out=True), *_inputs(2, 8))
    elif case == "x an input":  # no GEMM wrote x
        class NormLinear(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm, self.proj = nn.RMSNorm(256), nn.Linear(256, 384, bias=False)

            def forward(self, x):
                return self.proj(self.norm(x))

        _, _, g, g2 = _graphs(NormLinear(), _inputs(2, 8)[0])
    else:
        _, _, g, g2 = _graphs(ResidualNormLinear(d=200), *_inputs(2, 8, d=200))
    assert g2 is g


def test_llama_block_compiled_matches_pytorch_and_the_rule_runs_only_for_sm90a():
    """Both norms of a two-layer Llama stack after the first: the post-attention norm's sum of
    squares comes from the O GEMM, the second layer's input norm's from the first's down GEMM;
    the compiled program (CPU interpreter) matches PyTorch's bf16 block within the 2x rule.
    sm_80's template declines partials: there the rule does not run."""
    torch.manual_seed(4)
    block = randomise_norms(nn.Sequential(models.llama_block(256, 512, 4, 2, max_seq=16),
                                          models.llama_block(256, 512, 4, 2, max_seq=16))).to(torch.bfloat16).eval()
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16)
    c = tilefuse.compiler.compile_stages(block, (x,), arch="sm_90a")
    assert "rmsnorm_partials" in [f.rule for f in c.fired]
    parts = [s for s in c.plan.steps if s.family == "gemm" and s.gemm.partials]
    assert len(parts) == 3, "O of both layers, down of the first"
    out = tilefuse.compile(block, (x,))(x)
    with torch.no_grad():
        eager = block(x)
    res = compare("block", out, float64_reference(block, (x,)), eager)
    assert res.ok, res
    ampere = tilefuse.compiler.compile_stages(block, (x,), arch="sm_80")
    assert "rmsnorm_partials" not in [f.rule for f in ampere.fired]


class Bf16Norm(nn.Module):
    """An RMSNorm computed in bf16 throughout (no upcast): its square is bf16."""

    def __init__(self, d=256, n=384):
        super().__init__()
        self.o, self.p = nn.Linear(d, d, bias=False), nn.Linear(d, n, bias=False)
        self.w = nn.Parameter(1 + 0.3 * torch.randn(d))

    def forward(self, x, a):
        h = x + self.o(a)
        r = torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5)
        return self.p(h * r * self.w), h


class GroupedSquares(nn.Module):
    """A user's own sum of squares over groups of W columns of a GEMM's output."""

    def __init__(self, width, d=256, n=1024):
        super().__init__()
        self.p, self.width = nn.Linear(d, n, bias=False), width

    def forward(self, x):
        y = self.p(x)
        f = y.float()
        return y, (f * f).reshape(x.shape[0], -1, self.width).sum(-1)


def _matches_pytorch(m, inputs):
    out = tilefuse.compile(m, inputs)(*inputs)
    with torch.no_grad():
        eager = m(*inputs)
    for i, (o, r, e) in enumerate(zip(out, float64_reference(m, inputs), eager)):
        c = compare(f"out{i}", o, r, e)
        assert c.ok, c


def test_a_bf16_square_is_left_to_the_row_kernel():
    """Epilogue partials are f32: a square computed in bf16 is not theirs (the rule and the
    planner leave it), and the program still matches PyTorch."""
    torch.manual_seed(5)
    m = Bf16Norm().to(torch.bfloat16).eval()
    x, a = (t.bfloat16() for t in _inputs(2, 40))
    c = tilefuse.compiler.compile_stages(m, (x, a), arch="sm_90a")
    assert "rmsnorm_partials" not in [f.rule for f in c.fired]
    assert not any(s.gemm.partials for s in c.plan.steps if s.family == "gemm")
    _matches_pytorch(m, (x, a))


@pytest.mark.parametrize("width,arch,taken", [(4, "sm_90a", False), (512, "sm_90a", False), (W, "sm_80", False),
                                              (W, "sm_90a", True)])
def test_a_users_grouped_squares_get_partials_only_where_they_render(width, arch, taken):
    """The planner attaches sum partials only over the template's 128-column groups and only
    for a target that renders them (not sm_80): anything else stays a map-reduce kernel and
    compiles as before."""
    torch.manual_seed(6)
    m = GroupedSquares(width).to(torch.bfloat16).eval()
    x = torch.randn(80, 256, dtype=torch.bfloat16)
    c = tilefuse.compiler.compile_stages(m, (x,), arch=arch)
    gemm = [s for s in c.plan.steps if s.family == "gemm"]
    assert len(gemm) == 1 and bool(gemm[0].gemm.partials) == taken
    if arch == "sm_90a":
        src = gemm_sm90.render(c.gemms[gemm[0].name].problem(), None)
        assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean
    _matches_pytorch(m, (x,))


def test_the_epilogue_squares_x_as_stored():
    """The lowered epilogue (run by the Loop IR interpreter on a random accumulator and
    residual) sums the squares of the bf16 values it stores, as a row kernel reading x would:
    each group's partial equals the f64 sum of the stored tile's squares to f32 rounding."""
    import numpy as np

    from tilefuse import dtypes
    from tilefuse.loop.interp import run_kernel

    torch.manual_seed(7)
    _, xs, _, g2 = _graphs(ResidualNormLinear(), *_inputs(2, 40))
    p = plan(g2)
    s = next(s for s in p.steps if s.family == "gemm" and s.gemm.partials)
    _, lowered = lower_plan(g2, p)
    lg = lowered[s.name]
    rng = np.random.default_rng(0)
    feeds = {"acc": (rng.standard_normal((80, 256)) * 3).astype(np.float32)}
    for b in lg.bindings:
        buf = lg.epilogue.buffer(b.buffer)
        if buf.role == "in":
            feeds[b.buffer] = rng.standard_normal(buf.shape).astype(dtypes.to_numpy(buf.dtype))
    out = run_kernel(lg.epilogue, feeds)
    tile = [b.buffer for b in lg.outputs if lg.epilogue.buffer(b.buffer).shape == (80, 256)][0]
    part = [b.buffer for b in lg.outputs if b.buffer != tile][0]
    stored = np.asarray(out[tile], dtype=np.float64)
    want = (stored ** 2).reshape(80, 2, W).sum(-1)
    np.testing.assert_allclose(out[part], want, rtol=2e-6)


class GroupedSquaresAndMore(nn.Module):
    """A user's grouped sum of squares of a GEMM's f32 output, and another reader: of the f32
    cast the partials square (`cast read`), or of y through a cast of its own (`second cast`)."""

    def __init__(self, case, d=256):
        super().__init__()
        self.p, self.case = nn.Linear(d, d, bias=False), case

    def forward(self, x):
        y = self.p(x)
        f = y.float()
        other = f.half() * 2 if self.case == "cast read" else y.half() * 3
        return y, (f * f).reshape(x.shape[0], -1, W).sum(-1), other


@pytest.mark.parametrize("case,taken", [("cast read", False), ("second cast", True)])
def test_partials_only_where_the_epilogue_holds_every_reader(case, taken):
    """Partials put a cast into the epilogue without storing it: where another kernel reads
    that cast, the planner leaves the squares to a map-reduce kernel (every step reads what an
    earlier one wrote); where y has a second cast of its own, the partials still go in. Both
    programs match PyTorch."""
    from test_fusion import check_invariants

    torch.manual_seed(8)
    m = GroupedSquaresAndMore(case).to(torch.bfloat16).eval()
    x = torch.randn(80, 256, dtype=torch.bfloat16)
    c = tilefuse.compiler.compile_stages(m, (x,), arch="sm_90a")
    check_invariants(c.graph, c.plan)
    gemm = [s for s in c.plan.steps if s.family == "gemm"]
    assert len(gemm) == 1 and bool(gemm[0].gemm.partials) == taken
    _matches_pytorch(m, (x,))


def _llama_blocks(layers: int):
    torch.manual_seed(layers)
    blocks = nn.Sequential(*[models.llama_block(256, 512, 4, 2, max_seq=16) for _ in range(layers)])
    return bf16_through_coda(blocks, lambda g: g, torch.randn(2, 8, 256))[2]


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_all_norms_at_once_give_the_graph_of_one_norm_at_a_time(layers):
    """The rule rewrites every norm in one pass and puts back those no GEMM takes (the first
    layer's, which reads the embeddings): the same graph as rewriting and checking one norm at a
    time, in the graph of those before it, which was quadratic in the layers."""
    g = _llama_blocks(layers)
    found = rp.candidates(g)
    assert len(found) == 2 * layers
    fast = rmsnorm_partials(g)
    assert str(fast) == str(rp.one_at_a_time(g, found, lambda h, n: rp._rewritten(h, n, W)))
    parts = [n for n in fast.nodes if isinstance(n, ir.Reduce) and n.name.endswith("_partials")]
    assert len(parts) == 2 * layers - 1


def test_where_one_norms_rewrite_would_change_anothers_answer_the_rule_goes_one_at_a_time(monkeypatch):
    """Should a GEMM take a norm's partials only while some other norm is not rewritten (no
    such transformer is known: each norm's GEMM is its own), the check once more of the norms
    kept fails, and the rule goes one norm at a time. Here GEMMs take no partials in a graph
    holding exactly three, which the check once more is (the first norm reads the embeddings)."""
    g = _llama_blocks(2)

    class Picky(rp.Specs):
        def first(self, names, ok):
            n = sum(1 for x in self.g.nodes if isinstance(x, ir.Reduce) and x.name.endswith("_partials"))
            return n != 3 and super().first(names, ok)

    monkeypatch.setattr(rp, "Specs", Picky)
    got = rmsnorm_partials(g)
    assert str(got) == str(rp.one_at_a_time(g, rp.candidates(g), lambda h, n: rp._rewritten(h, n, W)))
    assert sum(1 for x in got.nodes if isinstance(x, ir.Reduce) and x.name.endswith("_partials")) == 2


def test_where_no_norm_pays_in_one_pass_the_graph_is_left_as_it_is(monkeypatch):
    """OLMo's norms are all candidates and none pays: the rule leaves the graph at once rather
    than asking one norm at a time (a graph per norm: 1 s at 32 layers)."""
    g = _llama_blocks(2)
    monkeypatch.setattr(rp.Specs, "first", lambda self, names, ok: False)
    calls = []
    real = rp.one_at_a_time
    monkeypatch.setattr(rp, "one_at_a_time", lambda *a: calls.append(a) or real(*a))
    assert rmsnorm_partials(g) is g and not calls

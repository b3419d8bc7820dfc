"""The planner's GEMM steps: which matmuls become generated GEMMs, which maps join their
epilogues, and that the planned program (GEMM product by torch in fp32, epilogue by the Loop
IR interpreter) computes what PyTorch computes, within the 2x rule of DESIGN.md."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.compiler import compile_stages
from tilefuse.graph import ir
from tilefuse.graph.contraction import operand_kind
from tilefuse.graph.fold import fold_weights

BF = torch.bfloat16


class Fn(nn.Module):
    def __init__(self, f, **params):
        super().__init__()
        self.f = f
        for k, v in params.items():
            setattr(self, k, nn.Parameter(v))

    def forward(self, *xs):
        return self.f(self, *xs)


def _gemms(st):
    return [s for s in st.plan.steps if s.family == "gemm"]


def _check(module, inputs):
    """Runs the compiled program on CPU and checks every output against float64 under the 2x rule."""
    prog = tilefuse.compile(module, inputs)
    out = flatten(prog(*inputs))
    with torch.no_grad():
        eager = flatten(module(*inputs))
    ref = flatten(float64_reference(module, inputs))
    for i, (o, r, e) in enumerate(zip(out, ref, eager)):
        c = compare(f"out{i}", o, r, e)
        assert c.ok, c
    return prog.stages


def test_operand_kinds_follow_broadcasting():
    out = (4, 6, 32)
    assert operand_kind((4, 6, 32), out, 1) == "tile"
    assert operand_kind((32,), out, 1) == "col"
    assert operand_kind((1, 1, 32), out, 1) == "col"
    assert operand_kind((4, 6, 1), out, 1) == "row"
    assert operand_kind((6, 1), out, 1) is None, "a row vector broadcast over the batch is not per-row"
    assert operand_kind((1, 6, 32), out, 1) is None
    assert operand_kind((4, 6, 1), out, 4) is None, "batched GEMMs take no per-row operands"


def test_linear_bias_gelu_residual_is_one_gemm_reading_the_weight_as_stored():
    """linear(x) is x @ W.T: the GEMM reads W [N, K] as a K-major B (no transpose step), and the
    bias, the GELU and the residual are its epilogue; the result matches PyTorch."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).to(BF)
    m = Fn(lambda s, x, r: F.gelu(s.lin(x)) + r)
    m.lin = lin
    st = _check(m, [torch.randn(3, 5, 64, dtype=BF), torch.randn(3, 5, 48, dtype=BF)])
    (g,) = _gemms(st)
    assert [s.family for s in st.plan.steps] == ["gemm"]
    sp = g.gemm
    assert (sp.m, sp.n, sp.k, sp.batch, sp.b_major) == (15, 48, 64, 1, "K")
    assert st.graph[sp.b].type.shape == (48, 64) and isinstance(st.graph[sp.b], ir.Weight)
    assert sorted(k for _, k in sp.operands) == ["col", "tile"]
    assert "epilogue" in str(st.plan) and "(col)" in str(st.plan)


def test_a_value_read_twice_outside_stops_the_epilogue_there():
    """y = x @ W is also returned: the epilogue cannot swallow the maps after it without a second
    output, which does not pay at K = 8192 (the cost model); the maps run in a map-reduce kernel."""
    torch.manual_seed(0)
    m = Fn(lambda s, x: (lambda y: (y, torch.relu(y) * 2))(x @ s.w), w=torch.randn(8192, 32, dtype=BF))
    st = _check(m, [torch.randn(16, 8192, dtype=BF)])
    (g,) = _gemms(st)
    assert g.gemm.maps == () and g.gemm.out == g.gemm.contraction
    assert [s.family for s in st.plan.steps] == ["gemm", "mapreduce"]


def test_silu_reads_the_accumulator_twice_and_still_fuses():
    torch.manual_seed(0)
    m = Fn(lambda s, x: F.silu(x @ s.w), w=torch.randn(64, 40, dtype=BF))
    st = _check(m, [torch.randn(9, 64, dtype=BF)])
    (g,) = _gemms(st)
    assert [st.graph[x].op for x in g.gemm.maps if st.graph[x].op != "cast"] == ["sigmoid", "mul"]


def test_an_operand_computed_from_the_product_is_not_an_epilogue_operand():
    """y + rowmax(y) needs all of y before any element: the add cannot run in y's epilogue."""
    torch.manual_seed(0)
    m = Fn(lambda s, x: (lambda y: y + y.amax(-1, keepdim=True))(x @ s.w), w=torch.randn(64, 32, dtype=BF))
    st = _check(m, [torch.randn(8, 64, dtype=BF)])
    (g,) = _gemms(st)
    assert g.gemm.maps == ()


def test_row_scale_and_pairwise_glu_after_coda():
    """The Llama MLP: after the CODA rules the gate/up matmul is one GEMM whose epilogue scales rows
    (the RMSNorm) and then pairs columns (SwiGLU); the down matmul takes the residual."""
    torch.manual_seed(0)

    class MLP(nn.Module):
        def __init__(self, d=32, f=48):
            super().__init__()
            self.norm = nn.RMSNorm(d)
            self.gate, self.up, self.down = (nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False),
                                             nn.Linear(f, d, bias=False))
            with torch.no_grad():
                self.norm.weight.copy_(1 + 0.3 * torch.randn(d))

        def forward(self, x):
            h = self.norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    st = _check(MLP().to(BF), [torch.randn(2, 7, 32, dtype=BF)])
    glu, down = _gemms(st)
    assert glu.gemm.pairwise and glu.gemm.n == 96 and [k for _, k in glu.gemm.operands] == ["row"]
    assert st.gemms[glu.name].epilogue.buffer("out").shape == (14, 48)
    assert [k for _, k in down.gemm.operands] == ["tile"]
    assert [s.family for s in st.plan.steps].count("mapreduce") == 1


def test_batched_matmul_with_column_bias():
    torch.manual_seed(0)
    bias = torch.randn(24, dtype=BF)
    m = Fn(lambda s, a, b: torch.bmm(a, b) * 0.5 + s.bias, bias=bias)
    st = _check(m, [torch.randn(3, 10, 16, dtype=BF), torch.randn(3, 16, 24, dtype=BF)])
    (g,) = _gemms(st)
    assert (g.gemm.batch, g.gemm.m, g.gemm.b_major) == (3, 10, "N")


@pytest.mark.parametrize("why, make", [
    ("f32", lambda: ([torch.randn(8, 64), torch.randn(64, 32)], "bf16 or fp16")),
    ("K", lambda: ([torch.randn(8, 36, dtype=BF), torch.randn(36, 32, dtype=BF)], "K=36")),
    ("N", lambda: ([torch.randn(8, 64, dtype=BF), torch.randn(64, 30, dtype=BF)], "N=30")),
])
def test_matmuls_the_gemm_cannot_take_stay_in_cublas_and_say_why(why, make):
    inputs, reason = make()
    st = _check(Fn(lambda s, a, b: a @ b), inputs)
    (mm,) = [s for s in st.plan.steps if s.family == "extern"]
    assert reason in mm.note and not _gemms(st)


def test_tilefuse_gemm_off_keeps_every_matmul_in_cublas(monkeypatch):
    monkeypatch.setenv("TILEFUSE_GEMM", "0")
    st = compile_stages(Fn(lambda s, a: a @ s.w, w=torch.randn(64, 32, dtype=BF)), (torch.randn(8, 64, dtype=BF),))
    assert not _gemms(st) and any(s.family == "extern" for s in st.plan.steps)


def test_weight_only_work_is_folded_once():
    """A cast and a scale of a parameter run when compiling, not per call; the folded graph computes
    the same values (checked by running both through the graph interpreter)."""
    from tilefuse.graph.interp import run_graph

    torch.manual_seed(0)
    m = Fn(lambda s, x: x * (s.g.to(torch.float32) * 2.0), g=torch.randn(16, dtype=BF))
    st = compile_stages(m, (torch.randn(4, 16),))
    folded = fold_weights(st.captured)
    assert folded is not st.captured
    assert not any(isinstance(n, ir.Map) and n.op == "cast" for n in folded.nodes)
    x = torch.randn(4, 16).numpy()
    (a,) = run_graph(st.captured, {st.captured.inputs[0]: x})
    (b,) = run_graph(folded, {folded.inputs[0]: x})
    assert (a == b).all()


def test_transposes_the_gemm_reads_through_are_not_folded():
    """W.T feeding a generated GEMM stays a view (the GEMM reads W as stored); feeding a matmul
    the GEMM cannot take (fp32) it is folded into a transposed weight, once."""
    lin16 = Fn(lambda s, x: F.linear(x, s.w), w=torch.randn(32, 64, dtype=BF))
    g16 = compile_stages(lin16, (torch.randn(4, 64, dtype=BF),)).graph
    assert any(isinstance(n, ir.View) and n.op == "permute" for n in g16.nodes)
    lin32 = Fn(lambda s, x: F.linear(x, s.w), w=torch.randn(32, 64))
    st = compile_stages(lin32, (torch.randn(4, 64),))
    assert not any(isinstance(n, ir.View) and n.op == "permute" for n in st.graph.nodes)
    assert [s.family for s in st.plan.steps] == ["extern"]


def test_gemms_are_planned_for_sm80_and_newer_targets_only():
    from tilefuse.compiler import gemm_enabled

    assert gemm_enabled("sm_90a") and gemm_enabled("sm_80") and gemm_enabled("sm_89")
    assert not gemm_enabled("sm_75")
    m = Fn(lambda s, a: a @ s.w, w=torch.randn(64, 32, dtype=BF))
    st = compile_stages(m, (torch.randn(8, 64, dtype=BF),), arch="sm_75")
    assert not _gemms(st)


def test_tune_collects_the_planned_gemms_with_the_map_reduce_kernels():
    """`tilefuse tune` gets every generated kernel of a program: GEMMs as GemmTasks (tuned by the
    GEMM family, keyed by problem and epilogue), map-reduce kernels as they are."""
    from tilefuse.tune.command import collect
    from tilefuse.tune.gemm import GemmTask

    torch.manual_seed(0)
    m = Fn(lambda s, x: torch.softmax(F.gelu(x @ s.w), -1), w=torch.randn(64, 32, dtype=BF))
    st = compile_stages(m, (torch.randn(8, 64, dtype=BF),))
    kernels = collect([st])
    gemm = [k for k in kernels.values() if isinstance(k, GemmTask)]
    assert len(gemm) == 1 and gemm[0].family == "gemm_sm90" and gemm[0].problem.epilogue is not None
    assert len(kernels) == 2 and sum(getattr(k, "family", "") == "mapreduce" for k in kernels.values()) == 1
    two = collect([st, st])
    assert len(two) == 4 and all(name.startswith(("g0.", "g1.")) for name in two)


def test_tune_leaves_out_the_gemms_programs_run_in_the_gemv(monkeypatch):
    """A GEMM of one row runs in the GEMV (codegen/gemv.py), whose knobs the tuner does not
    search: tuning the tile template for it would spend GPU time on a kernel that never runs;
    with TILEFUSE_GEMV=0 the tile template runs it, and is tuned."""
    from tilefuse.tune.command import collect
    from tilefuse.tune.gemm import GemmTask

    torch.manual_seed(0)
    m = Fn(lambda s, x: torch.softmax(F.gelu(x @ s.w.t()), -1), w=torch.randn(32, 64, dtype=BF))  # B K-major
    st = compile_stages(m, (torch.randn(1, 64, dtype=BF),))
    assert len(_gemms(st)) == 1
    assert not [k for k in collect([st]).values() if isinstance(k, GemmTask)]
    monkeypatch.setenv("TILEFUSE_GEMV", "0")
    assert len([k for k in collect([st]).values() if isinstance(k, GemmTask)]) == 1


def test_tune_model_without_a_gpu_is_one_error_line(capfd):
    from tilefuse.cli import main

    assert main(["tune", "--model", "llama", "--layers", "1"]) == 1
    out, err = capfd.readouterr()
    assert "tune measures kernels on a GPU" in err and len(err.strip().splitlines()) == 1


def test_pre_activation_and_activation_both_come_from_the_epilogue_when_it_pays():
    """y = x @ W + b is returned and so is gelu(y): at K = 64 writing both from the epilogue beats
    a map-reduce kernel reading y back (the cost model), so the GEMM has two outputs; at
    K = 8192 the TMA store it would give up is worth more, and the GELU runs after it."""
    from tilefuse.graph.contraction import _extra_outputs_pay

    torch.manual_seed(0)
    f = lambda s, x: (lambda y: (y, F.gelu(y)))(x @ s.w + s.b)  # noqa: E731
    m = Fn(f, w=torch.randn(64, 48, dtype=BF), b=torch.randn(48, dtype=BF))
    st = _check(m, [torch.randn(20, 64, dtype=BF)])
    (g,) = _gemms(st)
    assert len(g.gemm.outs) == 2 and [s.family for s in st.plan.steps] == ["gemm"]
    assert [b.buffer for b in st.gemms[g.name].outputs] == ["out0", "out1"]
    big = Fn(f, w=torch.randn(8192, 48, dtype=BF), b=torch.randn(48, dtype=BF))
    st2 = compile_stages(big, (torch.randn(20, 8192, dtype=BF),))
    (g2,) = _gemms(st2)
    assert len(g2.gemm.outs) == 1 and [s.family for s in st2.plan.steps] == ["gemm", "mapreduce"]
    c = st2.graph[g2.gemm.contraction]
    g_ = st2.graph
    outs = [g2.gemm.out] + [o for o in g_.outputs if o != g2.gemm.out]
    assert len(outs) == 2 and not _extra_outputs_pay(g_, c, outs, [g2.gemm.out], g_.users())


def test_an_output_only_maps_and_reductions_read_is_not_written_by_the_epilogue():
    """After a residual GEMM, the next RMSNorm's x*x (an f32 tile, twice the bytes of the bf16
    sum) is read only by the mean: the epilogue never writes that tile. It writes the bf16 sum
    and x*x reduced per 128 columns (rules/rmsnorm_partials.py), and the map-reduce kernel
    finishes those [64, 2] partials without reading the sum back."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o = torch.nn.Linear(256, 256, bias=False)
            self.norm = torch.nn.RMSNorm(256)
            self.up = torch.nn.Linear(256, 512, bias=False)

        def forward(self, a, x):
            h = x + self.o(a)
            return h, self.up(self.norm(h))

    torch.manual_seed(0)
    m = Block().bfloat16()
    with torch.no_grad():
        m.norm.weight.copy_(1 + 0.1 * torch.randn(256))
    st = _check(m, [torch.randn(64, 256, dtype=BF), torch.randn(64, 256, dtype=BF)])
    first = _gemms(st)[0]
    h, psq = first.gemm.outs
    assert st.graph[h].type.dtype == "bf16" and st.graph[psq].type.shape == (64, 2)
    mr = [s for s in st.plan.steps if s.family == "mapreduce"]
    assert len(mr) == 1 and h not in mr[0].inputs and all(
        st.graph[o].type.numel == 64 for o in mr[0].outputs)  # it writes one value per row


# -- random programs around a matmul -----------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from test_fusion import check_invariants  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

_UNARY = [torch.relu, torch.sigmoid, torch.tanh, F.silu, F.gelu, lambda t: t * 0.5, lambda t: -t,
          lambda t: t.float().exp().to(t.dtype)]


@hst.composite
def matmul_programs(draw):
    """x[M, K] @ W[K, N] (bf16, K and N multiples of 8), then a random chain of maps reading the
    product and tile / row / column operands, maybe a row reduction, maybe several results."""
    m, k, n = draw(hst.integers(1, 9)), 8 * draw(hst.integers(1, 4)), 8 * draw(hst.integers(1, 3))
    steps = draw(hst.lists(hst.sampled_from(["unary", "bias", "rowscale", "residual", "keep", "rowsum",
                                             "cast"]), min_size=0, max_size=6))
    fns = draw(hst.lists(hst.sampled_from(_UNARY), min_size=len(steps), max_size=len(steps)))
    linear = draw(hst.booleans())

    def fn(s, x, r, rs):
        y = F.linear(x, s.w) if linear else x @ s.w
        outs = []
        for kind, f in zip(steps, fns):
            if kind == "unary":
                y = f(y)
            elif kind == "bias":
                y = y + s.b
            elif kind == "rowscale":
                y = y * rs
            elif kind == "residual":
                y = y + r
            elif kind == "keep":  # an intermediate the program also returns
                outs.append(y)
            elif kind == "rowsum":
                y = y - y.float().sum(-1, keepdim=True).to(y.dtype)
            else:
                y = y.float().to(torch.bfloat16)
        return (y, *outs)

    w = torch.randn(n, k) if linear else torch.randn(k, n)
    mod = Fn(fn, w=(w / k ** 0.5).to(BF), b=torch.randn(n, dtype=BF))
    return mod, [torch.randn(m, k, dtype=BF), torch.randn(m, n, dtype=BF), torch.randn(m, 1, dtype=BF)]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(matmul_programs())
def test_random_programs_around_a_matmul_plan_a_gemm_and_match_pytorch(prog):
    """Whatever maps follow the matmul: it is planned as a GEMM (its operands are bf16 and TMA can
    read them), every epilogue operand is a tile, row or column read, each output is written once,
    and the planned program (GEMM product in fp32 + epilogue by the Loop IR interpreter, the rest
    by map-reduce kernels) passes the 2x rule against float64 on every result."""
    mod, inputs = prog
    st = _check(mod, inputs)
    (g,) = _gemms(st)
    assert {k for _, k in g.gemm.operands} <= {"tile", "row", "col"}
    written = [t for s in st.plan.steps for t in s.outputs]
    assert len(written) == len(set(written))


@hst.composite
def block_programs(draw):
    """A random transformer-ish block over x[B, S, D] in bf16: an optional RMSNorm or LayerNorm,
    then either one linear (with or without bias) and an activation, or a gated pair (SwiGLU /
    GeGLU / ReGLU), then a down projection, an optional residual, an optional second result."""
    # sizes large enough that the 2x rule compares errors, not the luck of a few roundings
    b, s, d = draw(hst.integers(1, 2)), draw(hst.integers(1, 8)), 32 * draw(hst.integers(1, 3))
    f = 32 * draw(hst.integers(1, 2))
    norm = draw(hst.sampled_from([None, "rms", "layer"]))
    gated = draw(hst.booleans())
    act = draw(hst.sampled_from([F.silu, F.gelu, torch.relu, lambda t: F.gelu(t, approximate="tanh")]))
    bias = draw(hst.booleans())
    residual = draw(hst.booleans())
    keep_hidden = draw(hst.booleans())

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = {None: nn.Identity(), "rms": nn.RMSNorm(d), "layer": nn.LayerNorm(d)}[norm]
            self.up = nn.Linear(d, f, bias=bias)
            self.gate = nn.Linear(d, f, bias=False) if gated else None
            self.down = nn.Linear(f, d, bias=bias)
            with torch.no_grad():
                for p in self.norm.parameters():
                    p.copy_(1 + 0.3 * torch.randn(p.shape))

        def forward(self, x):
            h = self.norm(x)
            u = act(self.gate(h)) * self.up(h) if gated else act(self.up(h))
            y = self.down(u)
            y = x + y if residual else y
            return (y, u) if keep_hidden else y

    torch.manual_seed(draw(hst.integers(0, 1000)))
    # the gate/up pair is interleaved into one GEMM when neither has a bias (the CODA rule's case)
    n_gemms = 3 if gated and bias else 2
    return Block().to(BF), [torch.randn(b, s, d, dtype=BF)], n_gemms


@settings(max_examples=40, deadline=None, derandomize=True)
@given(block_programs())
def test_random_blocks_plan_their_matmuls_as_gemms_and_match_pytorch(prog):
    """Random norm / (gated) MLP / residual blocks go through the CODA rules, weight folding and
    the planner: every matmul becomes a GEMM (a bias-free gated pair one pairwise GEMM), the plan
    has no cycle, and every result passes the 2x rule against float64 through the interpreter."""
    mod, inputs, n_gemms = prog
    st = _check(mod, inputs)
    gemms = _gemms(st)
    assert len(gemms) == n_gemms, str(st.plan)
    assert not [s for s in st.plan.steps if s.family == "extern"], str(st.plan)


class _LNMLP(nn.Module):
    def __init__(self, gated: bool, d=64, f=128):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, f, bias=not gated)
        self.gate = nn.Linear(d, f, bias=False) if gated else None
        self.down = nn.Linear(f, d)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.3 * torch.randn(d))
            self.norm.bias.copy_(0.3 * torch.randn(d))

    def forward(self, x):
        h = self.norm(x)
        u = F.silu(self.gate(h)) * self.up(h) if self.gate is not None else F.gelu(self.up(h), approximate="tanh")
        return x + self.down(u)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_layernorm_rank1_term_is_computed_in_the_epilogue(gated):
    """LayerNorm before a matmul leaves s * (x @ W') - (s * mean) x colsum(W') + beta W': the rank-1
    term is a row vector times a column vector, which the epilogue computes from the two vectors
    instead of reading an M x N tile a map-reduce kernel wrote; with SwiGLU after it the epilogue is
    pairwise and reads the column vectors at the accumulator's columns (2j, 2j + 1). Matches
    PyTorch; both kernels compile clean for sm_90a and sm_80."""
    from tilefuse.codegen import gemm_sm80, gemm_sm90
    from tilefuse.runtime import nvrtc

    torch.manual_seed(0)
    st = _check(_LNMLP(gated).to(BF), [torch.randn(2, 16, 64, dtype=BF)])
    first, _ = _gemms(st)
    kinds = sorted(k for _, k in first.gemm.operands)
    assert kinds == (["col", "col", "row", "row"] if gated else ["col", "col", "col", "row", "row"])
    assert bool(first.gemm.pairwise) == gated
    assert [s.family for s in st.plan.steps] == ["mapreduce", "gemm", "gemm"]
    problem = st.gemms[first.name].problem()
    for src, arch in ((gemm_sm90.render(problem), "sm_90a"), (gemm_sm80.render(problem, None, "sm_80"), "sm_80")):
        assert nvrtc.compile_cuda(src.source, src.name, arch).info.clean


@hst.composite
def dag_programs(draw):
    """A random DAG over bf16 tensors [M, 16] / [M, 32]: matmuls of any earlier tensor with a new
    weight, maps of one or two earlier tensors of a shape, row-sum corrections; a random subset
    of the tensors is returned. Matmuls may share inputs and feed each other's epilogues."""
    m = draw(hst.integers(1, 6))
    n_ops = draw(hst.integers(1, 7))
    ops = []
    shapes = [16]  # tensor 0 is the input, [M, 16]
    for _ in range(n_ops):
        kind = draw(hst.sampled_from(["matmul", "matmul", "unary", "binary", "rowsum"]))
        src = draw(hst.integers(0, len(shapes) - 1))
        if kind == "matmul":
            width = draw(hst.sampled_from([16, 32]))
            ops.append(("matmul", src, width, draw(hst.integers(0, 3))))
            shapes.append(width)
        elif kind == "binary":
            same = [i for i, w in enumerate(shapes) if w == shapes[src]]
            ops.append(("binary", src, draw(hst.sampled_from(same)), draw(hst.sampled_from(["add", "mul", "sub"]))))
            shapes.append(shapes[src])
        else:
            ops.append((kind, src, draw(hst.sampled_from(range(len(_UNARY)))), None))
            shapes.append(shapes[src])
    outs = draw(hst.sets(hst.integers(1, len(shapes) - 1), min_size=1, max_size=3))

    class Dag(nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = nn.ParameterList([nn.Parameter(torch.randn(shapes[o[1]], o[2]) / shapes[o[1]] ** 0.5)
                                        for o in ops if o[0] == "matmul"])

        def forward(self, x):
            ts, w = [x], iter(self.ws)
            for kind, src, arg, extra in ops:
                t = ts[src]
                if kind == "matmul":
                    weight = next(w)
                    ts.append(F.linear(t, weight.t().contiguous()) if extra == 0 else t @ weight)
                elif kind == "binary":
                    u = ts[arg]
                    ts.append(t + u if extra == "add" else t * u if extra == "mul" else t - u)
                elif kind == "rowsum":
                    ts.append(t - t.float().mean(-1, keepdim=True).to(t.dtype))
                else:
                    ts.append(_UNARY[arg](t))
            return tuple(ts[i] for i in sorted(outs))

    return Dag().to(BF), [torch.randn(m, 16, dtype=BF)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dag_programs())
def test_random_dags_of_matmuls_and_maps_plan_without_cycles_and_match_pytorch(prog):
    """Matmuls that share inputs, feed each other and are returned midway: the plan orders every
    step after what it reads (no cycle), writes each tensor once, plans every matmul as a GEMM,
    and the program passes the 2x rule against float64 on every result."""
    mod, inputs = prog
    st = _check(mod, inputs)
    written = [t for s in st.plan.steps for t in s.outputs]
    assert len(written) == len(set(written)), str(st.plan)
    check_invariants(st.graph, st.plan)  # every node in one step, each step after what it reads
    n_mm = sum(isinstance(n, ir.Contraction) for n in st.graph.nodes)
    assert len(_gemms(st)) == n_mm


def test_tables_built_from_sizes_and_buffers_fold_externs_included():
    """A causal mask from ones/cumsum and rotary tables from arange and a frequency buffer depend
    on no input's values: folding computes them once (the externs among them too), and the
    program still matches PyTorch. Random draws are never folded."""
    class Tables(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))

        def forward(self, x):
            s = x.shape[1]
            ones = x.new_ones(s, s, dtype=torch.long)
            mask = torch.cumsum(ones, -1) <= torch.cumsum(ones, 0)  # lower triangle
            ang = torch.outer(torch.arange(s, dtype=torch.float32), self.inv_freq)
            emb = torch.cat([ang, ang], -1)
            y = x * emb.cos() + x * emb.sin()
            return torch.where(mask, y.sum(-1, keepdim=True).expand(-1, s, s), 0.0), x + torch.rand_like(x) * 0

    x = torch.randn(2, 6, 8)
    st = compile_stages(Tables(), (x,))
    externs = [st.graph[s.nodes[0]] for s in st.plan.steps if s.family == "extern"]
    assert not any("cumsum" in getattr(n, "target", "") or "cat" in getattr(n, "target", "") for n in externs)
    assert any("rand" in getattr(n, "target", "") for n in externs), "a random draw is never folded"
    assert any("folded at compile time" in n.source for n in st.graph.nodes if isinstance(n, ir.Weight))
    got, _ = st.program(x)
    torch.testing.assert_close(got, Tables()(x)[0])


@hst.composite
def batched_programs(draw):
    """bmm [B, M, K] @ [B, K, N] (or a linear on [B, M, K]) in bf16 or fp16, then maps with tile,
    column and per-(batch, row) operands: the last are not per-row operands of a batched GEMM
    and must stay out of its epilogue."""
    dt = draw(hst.sampled_from([torch.bfloat16, torch.float16]))
    b, m, k, n = draw(hst.integers(1, 3)), draw(hst.integers(1, 7)), 8 * draw(hst.integers(1, 3)), 8 * draw(hst.integers(1, 3))
    bmm = draw(hst.booleans())
    steps = draw(hst.lists(hst.sampled_from(["unary", "bias", "rowscale", "residual"]), max_size=4))
    fns = draw(hst.lists(hst.sampled_from(_UNARY), min_size=len(steps), max_size=len(steps)))

    def fn(s, x, w, r, rs):
        y = torch.bmm(x, w) if bmm else F.linear(x, s.lin)
        for kind, f in zip(steps, fns):
            y = f(y) if kind == "unary" else y + s.b if kind == "bias" else y * rs if kind == "rowscale" else y + r
        return y

    mod = Fn(fn, lin=(torch.randn(n, k) / k ** 0.5).to(dt), b=torch.randn(n, dtype=dt))
    inputs = [torch.randn(b, m, k, dtype=dt), (torch.randn(b, k, n) / k ** 0.5).to(dt),
              torch.randn(b, m, n, dtype=dt), torch.randn(b, m, 1, dtype=dt)]
    return mod, inputs, bmm


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batched_programs())
def test_random_batched_programs_match_pytorch(prog):
    """Batched GEMMs (bmm) and linears on 3-D inputs in bf16 and fp16: one GEMM each (batch > 1
    only for bmm), no per-row operand in a batched epilogue, every result within the 2x rule."""
    mod, inputs, bmm = prog
    st = _check(mod, inputs)
    (g,) = _gemms(st)
    assert (g.gemm.batch > 1) == (bmm and inputs[0].shape[0] > 1)
    if g.gemm.batch > 1:
        assert "row" not in {k for _, k in g.gemm.operands}


@hst.composite
def einsums(draw):
    """A random two-operand einsum: batch, left, right and summed indices in random orders."""
    letters = iter("abcdefgh")
    kinds = {"batch": draw(hst.integers(0, 2)), "left": draw(hst.integers(0, 2)),
             "right": draw(hst.integers(0, 2)), "summed": draw(hst.integers(1, 2))}
    idx = {k: [next(letters) for _ in range(n)] for k, n in kinds.items()}
    size = {c: draw(hst.sampled_from([1, 2, 3, 8])) for k in idx for c in idx[k]}
    for c in idx["summed"]:
        size[c] = 8 * draw(hst.integers(1, 2))  # K a multiple of 8: a GEMM can take it
    sa = draw(hst.permutations(idx["batch"] + idx["left"] + idx["summed"]))
    sb = draw(hst.permutations(idx["batch"] + idx["right"] + idx["summed"]))
    res = draw(hst.permutations(idx["batch"] + idx["left"] + idx["right"]))
    eq = f"{''.join(sa)},{''.join(sb)}->{''.join(res)}"
    x = torch.randn([size[c] for c in sa], dtype=BF)
    y = torch.randn([size[c] for c in sb], dtype=BF)
    return eq, x, y


@settings(max_examples=60, deadline=None, derandomize=True)
@given(einsums())
def test_two_operand_einsums_become_one_matmul_and_match_pytorch(case):
    """Any two-operand einsum with batch, free and summed indices in any order is views around one
    matmul (no einsum extern), and matches torch.einsum within the 2x rule."""
    eq, x, y = case
    st = _check(Fn(lambda s, a, b: torch.einsum(eq, a, b)), [x, y])
    assert not any("einsum" in getattr(st.graph[s.nodes[0]], "target", "") for s in st.plan.steps)
    assert sum(isinstance(n, ir.Contraction) for n in st.graph.nodes) == 1


def test_einsums_tilefuse_cannot_map_to_a_matmul_stay_einsum_and_say_why():
    st = compile_stages(Fn(lambda s, a, b: torch.einsum("ii,ij->j", a, b)), (torch.randn(4, 4), torch.randn(4, 8)))
    (e,) = [s for s in st.plan.steps if s.family == "extern"]
    assert "einsum" in e.note and "repeated index" in e.note
    st = compile_stages(Fn(lambda s, a: torch.einsum("ij->j", a)), (torch.randn(4, 4),))
    assert "two operands" in [s for s in st.plan.steps if s.family == "extern"][0].note


def test_the_plan_prints_an_epilogue_with_a_target_select():
    """Cross-entropy over a matmul's product at a width the LM-head partials do not take puts the
    target select (a Gather, which has no op name) in the GEMM's epilogue; `--ir graph` prints
    it as "gather" (it raised AttributeError)."""
    torch.manual_seed(0)
    x, w, t = torch.randn(8, 64).to(BF), (torch.randn(64, 96) / 8).to(BF), torch.randint(0, 96, (8,))
    st = compile_stages(lambda x, w, t: F.cross_entropy((x @ w).float(), t), (x, w, t))
    gemm = [s for s in st.plan.steps if s.family == "gemm"]
    assert gemm and any(isinstance(st.graph[m], ir.Gather) for s in gemm for m in s.gemm.maps)
    (line,) = [ln for ln in str(st.plan).splitlines() if ln.strip().startswith("epilogue")]
    assert "gather" in line

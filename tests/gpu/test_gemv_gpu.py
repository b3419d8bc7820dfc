"""The GEMV template (codegen/gemv.py: a GEMM of a few rows, B streamed by warps) on the GPU
against a float32 reference (DESIGN.md's 2x rule).

Fresh random normal inputs per case; outputs poisoned with NaN first, so an unwritten
element fails. Odd shapes (N not a multiple of a warp's columns or a CTA's warps, K not a
multiple of a lane step), M from 1 to MAX_M, bf16 and f16, every schedule knob, every
epilogue kind and GLU, partial row reductions (an RMSNorm's), B a weight (loaded before the wait) or not, chains of GEMVs launched
back to back under programmatic launch, programs whose short GEMMs it runs, and groups of GEMMs
of one A in one launch.
"""
import pytest
import torch

from tilefuse.check import rel_error
from tilefuse.codegen import epilogue as epi, gemv
from tilefuse.codegen.gemm_sm90 import GemmProblem
from tilefuse.runtime.gemv import compile_gemv, compile_gemv_group

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("the GEMV template is built for sm_80 or later", allow_module_level=True)

TDT = {"bf16": torch.bfloat16, "f16": torch.float16}
SHAPES = [(1, 1, 8), (1, 33, 72), (2, 4097, 4104), (3, 777, 1024), (4, 130, 96), (1, 4096, 4096),
          (1, 1024, 11008), (2, 22016, 512)]
S = gemv.GemvSchedule
SCHEDULES = [S(1, 1, 1), S(1, 16, 8), S(2, 4, 2), S(4, 8, 1), S(4, 2, 8), S(2, 8, 4)]
_F = torch.nn.functional
ACT_FN = {"none": lambda x: x, "relu": torch.relu, "gelu": _F.gelu,
          "gelu_tanh": lambda x: _F.gelu(x, approximate="tanh"), "silu": _F.silu, "sigmoid": torch.sigmoid}


def _passes(out, ref, lowp):
    """2x rule: our error at most twice torch's own low-precision error (+1e-5)."""
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element was not written"
    err, base = rel_error(out.float(), ref), rel_error(lowp.float(), ref)
    assert err <= 2 * base + 1e-5, f"error {err:.3e} vs torch's {base:.3e}"


def _plain(m, n, k, dtype="bf16", sched=None, b_const=False):
    tdt = TDT[dtype]
    a = torch.randn(m, k, device="cuda", dtype=tdt)
    b = torch.randn(n, k, device="cuda", dtype=tdt)
    g = compile_gemv(GemmProblem(m, n, k, dtype, b_major="K", b_const=b_const), sched)
    assert g.info.clean, g.info
    out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
    g(a, b, out=out)
    torch.cuda.synchronize()
    _passes(out, a.float() @ b.float().T, a @ b.T)


@pytest.mark.parametrize("b_const", [False, True])
@pytest.mark.parametrize("dtype", list(TDT))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_plain_gemv_matches_float32(shape, dtype, b_const):
    _plain(*shape, dtype, b_const=b_const)


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: f"c{s.cols}w{s.warps}u{s.unroll}")
@pytest.mark.parametrize("m", [1, 4])
def test_schedules_match_float32(sched, m):
    _plain(m, 1000, 2056, "bf16", sched, b_const=True)


T = gemv.MmaGemvSchedule
MMA_SHAPES = [(2, 1, 8), (2, 33, 72), (5, 4097, 4104), (8, 777, 1000), (3, 130, 96), (8, 4096, 4096),
              (4, 1024, 11008), (7, 17, 40), (6, 2048, 5632)]


@pytest.mark.parametrize("b_const", [False, True])
@pytest.mark.parametrize("dtype", list(TDT))
@pytest.mark.parametrize("shape", MMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tensor_core_form_matches_float32(shape, dtype, b_const):
    """The tensor-core form (M > 1's default): N not a multiple of 16, K not of 32 (a partial
    last chunk) or shorter than one step, every M from 2 to 8."""
    assert isinstance(gemv.default_schedule(GemmProblem(*shape)), T)
    _plain(*shape, dtype, b_const=b_const)


@pytest.mark.parametrize("sched", [T(w, u) for w in (1, 2, 4, 16) for u in (1, 2, 8)], ids=str)
@pytest.mark.parametrize("m", [1, 2, 8])
def test_tensor_core_schedules_match_float32(sched, m):
    _plain(m, 1000, 2056, "bf16", sched, b_const=True)


@pytest.mark.parametrize("sched", [T(w, u, p) for w, u in ((16, 8), (4, 2), (1, 1)) for p in (1, 2)], ids=str)
@pytest.mark.parametrize("b_const", [False, True])
@pytest.mark.parametrize("m,n,k", [(4, 1000, 2056), (2, 4097, 11008), (8, 33, 72)])
def test_tensor_core_form_with_l2_prefetches_matches_float32(m, n, k, b_const, sched):
    """B's steps asked into L2 ahead of the loads (one or two ahead, the first before the
    wait; rows past N and steps past K not asked) change no result."""
    _plain(m, n, k, "bf16", sched, b_const=b_const)


@pytest.mark.parametrize("act,dtype,m,sched", [(a, "bf16", 1, S(2, 4, 4)) for a in epi.ACTIVATIONS]
                         + [("gelu", "f16", 3, S(2, 4, 4)), ("silu", "bf16", 4, S(2, 4, 4)),
                            ("gelu", "bf16", 2, T()), ("silu", "f16", 5, T(8, 2)), ("sigmoid", "bf16", 8, T(1, 4))],
                         ids=str)
def test_epilogue_bias_activation_residual_rowscale(act, dtype, m, sched):
    n, k = 1030, 776
    tdt = TDT[dtype]
    a, b = torch.randn(m, k, device="cuda", dtype=tdt), torch.randn(n, k, device="cuda", dtype=tdt)
    bias = torch.randn(n, device="cuda", dtype=tdt)
    res = torch.randn(m, n, device="cuda", dtype=tdt)
    scale = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
    ep = epi.standard(m, n, dtype, bias="col", activation=act, residual=True, row_scale=True)
    g = compile_gemv(GemmProblem(m, n, k, dtype, epilogue=ep, b_const=True), sched)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
    g(a, b, out=out, bias=bias, residual=res, row_scale=scale)
    torch.cuda.synchronize()
    f = ACT_FN[act]
    ref = f((a.float() @ b.float().T) * scale[:, None] + bias.float()) + res.float()
    lowp = f((a @ b.T) * scale[:, None].to(tdt) + bias) + res
    _passes(out, ref, lowp)


@pytest.mark.parametrize("sched", [None, S(2, 8, 4), S(4, 4, 2), T(4, 4), T(1, 2)], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_epilogue_on_interleaved_weights(act, m, sched):
    """SwiGLU/GeGLU as a pairwise epilogue equals act(x @ Wg.T) * (x @ Wu.T)."""
    n2, k = 2 * 1501, 1032
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(n2 // 2, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.stack([wg, wu], dim=1).reshape(n2, k).contiguous()  # gate j at row 2j, up j at 2j+1
    g = compile_gemv(GemmProblem(m, n2, k, "bf16", epilogue=epi.glu(m, n2, "bf16", activation=act), b_const=True),
                     sched)
    out = torch.full((m, n2 // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(x, w, out=out)
    torch.cuda.synchronize()
    f = ACT_FN[act]
    _passes(out, f(x.float() @ wg.float().T) * (x.float() @ wu.float().T), f(x @ wg.T) * (x @ wu.T))


def _with_sq(m, n, operand):
    """out = acc + residual[m, n] (or + bias[n]) in bf16, and per 16 columns (a CTA's) the sum of
    its squares and its max: an RMSNorm's partials after a decode step's O or down projection."""
    e = epi.EpilogueBuilder(m, n)
    y = e.op("add", e.acc(), e.load(operand, "tile" if operand == "residual" else "col", "bf16"))
    e.store("out", y, "bf16")
    e.partial_sum("sq", e.op("mul", y, y), gemv.GROUP)
    e.partial_max("mx", y, gemv.GROUP)
    return e.kernel(f"{operand}_sq")


@pytest.mark.parametrize("sched", [None, T(1, 1), T(4, 2), T(32, 4)], ids=str)
@pytest.mark.parametrize("operand", ["residual", "bias"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (3, 4096, 11008), (8, 2048, 1000), (4, 16, 72)])
def test_partials_beside_the_store(m, n, k, operand, sched):
    """The tensor-core form's partials (at M = 1 too): the stored tile and each (row, CTA)'s sum of
    squares and max under the 2x rule of float64, every output poisoned first."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    r = torch.randn(*((m, n) if operand == "residual" else (n,)), device="cuda", dtype=torch.bfloat16)
    g = compile_gemv(GemmProblem(m, n, k, "bf16", epilogue=_with_sq(m, n, operand), b_const=True), sched)
    assert isinstance(g.source.schedule, T) and g.info.clean, g.info
    t = n // gemv.GROUP
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    sq, mx = (torch.full((m, t), float("nan"), device="cuda") for _ in range(2))
    g(x, w, out=out, sq=sq, mx=mx, **{operand: r})
    torch.cuda.synchronize()
    ref, lowp = x.double() @ w.double().T + r.double(), (x @ w.T + r).float()
    _passes(out, ref, lowp)
    for got, want, lp in ((sq, ref ** 2, lowp.double() ** 2), (mx, ref, lowp.double())):
        red = (lambda v: v.view(m, t, gemv.GROUP).sum(-1)) if got is sq else (lambda v: v.view(m, t, gemv.GROUP).amax(-1))
        _passes(got, red(want), red(lp))


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("b_const", [False, True])
def test_chains_launched_back_to_back_read_the_gemv_before(b_const, m):
    """Each GEMV reads the one before's output; launched with nothing between them (programmatic
    launch lets each begin while the one before ends), the chain gives the bits of the same
    launches each synchronised, and every link is within the 2x rule of its own reference."""
    n, links = 2048, 12
    g = compile_gemv(GemmProblem(m, n, n, "bf16", b_const=b_const))
    ws = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(links)]
    x0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(links)]
    torch.cuda.synchronize()
    x = x0
    for w, o in zip(ws, outs):
        g(x, w, out=o)
        x = o
    torch.cuda.synchronize()
    x = x0
    for i, w in enumerate(ws):
        o = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        g(x, w, out=o)
        torch.cuda.synchronize()
        assert torch.equal(o, outs[i]), f"link {i}: back to back differs from synchronised"
        _passes(o, x.float() @ w.float().T, x @ w.T)
        x = o


def test_misaligned_operand_is_a_clear_error():
    g = compile_gemv(GemmProblem(1, 64, 64, "bf16"))
    spare = torch.randn(64 + 1, device="cuda", dtype=torch.bfloat16)
    a = spare[1:].view(1, 64)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte"):
        g(a, b)


def _linear_program(m, monkeypatch, on: bool):
    import tilefuse

    monkeypatch.setenv(gemv.ENV, "1" if on else "0")
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(512, 1536, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(1536, 512)).to("cuda", torch.bfloat16)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        prog = tilefuse.compile(mod, (x,))
        return prog, mod, x


@pytest.mark.parametrize("m", [1, 4, 9])
def test_a_program_runs_its_short_gemms_here(m, monkeypatch):
    """A program's GEMMs of M <= MAX_M build the GEMV (TILEFUSE_GEMV=0, or more rows: the tile
    templates), and its output is within the 2x rule of float32 eager either way."""
    names = {}
    for on in (True, False):
        prog, mod, x = _linear_program(m, monkeypatch, on)
        with torch.no_grad():
            out = prog(x)
            ref = mod.float()(x.float())
            lowp = mod.to(torch.bfloat16)(x)
        torch.cuda.synchronize()
        _passes(out, ref, lowp)
        names[on] = sorted(type(k).__name__ for k in prog._compiled.values())
        mod.to(torch.bfloat16)
    assert ("GemvKernel" in names[True]) == (m <= gemv.MAX_M), names
    assert "GemvKernel" not in names[False], names


@pytest.mark.parametrize("m,k,n_kv", [(1, 4096, 1024), (4, 4096, 4096), (8, 1000, 520), (3, 72, 16)])
def test_a_group_computes_what_its_members_compute_alone(m, k, n_kv):
    """render_group's one launch (Q with a row scale, K pairwise as a GLU, V plain, of one A)
    writes bit for bit what each member writes launched alone under the same schedule, and
    passes the 2x rule; every output poisoned first, each member's B its own tensor."""
    n_q = 4 * n_kv
    ps = [GemmProblem(m, n_q, k, "bf16", epilogue=epi.standard(m, n_q, "bf16", row_scale=True), b_const=True),
          GemmProblem(m, n_kv, k, "bf16", epilogue=epi.glu(m, n_kv, "bf16"), b_const=True),
          GemmProblem(m, n_kv, k, "bf16", b_const=True)]
    group = compile_gemv_group(ps)
    assert group.info.clean, group.info
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bs = [torch.randn(p.n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for p in ps]
    scale = torch.rand(m, device="cuda") + 0.5
    outs = [torch.full((m, p.n // (2 if i == 1 else 1)), float("nan"), device="cuda", dtype=torch.bfloat16)
            for i, p in enumerate(ps)]
    got = group(a, bs, [dict(out=outs[0], row_scale=scale), dict(out=outs[1]), dict(out=outs[2])])
    alone = [compile_gemv(p, group.source.schedule) for p in ps]
    want = [alone[0](a, bs[0], row_scale=scale), alone[1](a, bs[1]), alone[2](a, bs[2])]
    torch.cuda.synchronize()
    for g, o, w in zip(got, outs, want):
        assert g is o and torch.equal(g, w)
    x, xf = a, a.float()
    glu = lambda v: _F.silu(v[:, 0::2]) * v[:, 1::2]  # noqa: E731 (gate j at column 2j, up at 2j + 1)
    _passes(outs[0], (xf @ bs[0].float().T) * scale[:, None], (x @ bs[0].T) * scale[:, None].to(x.dtype))
    _passes(outs[1], glu(xf @ bs[1].float().T), glu(x @ bs[1].T))
    _passes(outs[2], xf @ bs[2].float().T, x @ bs[2].T)



@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("tokens", [1, 4])
def test_a_programs_q_k_v_gemvs_run_as_one_launch_when_asked(tokens, kv_heads, monkeypatch):
    """With GEMV groups on (the default) a decode step's Q, K and V projections (one A, RoPE on Q and
    K) run as one launch (runner.grouped_gemvs), in the thin call and in the CUDA-graph replay
    after it; the logits pass the 2x rule against float64, as with groups off."""
    import tilefuse
    from tilefuse import models
    from tilefuse.check import compare, float64_reference
    from tilefuse.runtime.runner import _GemvGroup

    torch.manual_seed(0)
    m = models.llama(256, 2, 512, 1024, 8, kv_heads, max_seq=64).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (tokens, 1), device="cuda")
    ref = float64_reference(m, [ids])
    with torch.no_grad():
        eager = m(ids)
    for on in ("1", "0"):
        monkeypatch.setenv(gemv.GROUPS_ENV, on)
        prog = tilefuse.compile(m, [ids])
        for call in range(3):
            c = compare(f"logits (groups {on}, call {call})", prog(ids), ref, eager)
            assert c.ok, c
        groups = [op for op in prog.runner(ids.device).ops if isinstance(op, _GemvGroup)]
        assert len(groups) == (2 if on == "1" else 0) and all(len(g.members) == 3 for g in groups)
        info = prog.graph_info()
        assert info and info[0]["graphs"] and info[0]["replays"] >= 1, info  # the replay ran the groups too

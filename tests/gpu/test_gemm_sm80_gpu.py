"""The generated sm_80 GEMM (mma.sync + cp.async) on the GPU vs a float32 reference
(DESIGN.md's 2x rule), compiled for the GPU it runs on (sm_90a on an H100: a cubin runs
only on its own arch; the instructions are Ampere's).

Fresh random normal inputs per case; outputs poisoned with NaN first, so an unwritten
element fails. Odd shapes (tails in M, N and K; rows whose length is odd, so the copies
fall back to 8-, 4- and 2-byte widths), both B layouts, bf16 and f16, batches, several
schedules, each epilogue kind, GLU, and a custom two-output epilogue.
"""
import pytest
import torch

from tilefuse.check import rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen.gemm_sm80 import Sm80Schedule
from tilefuse.codegen.gemm_sm90 import GemmProblem
from tilefuse.runtime.gemm_sm80 import compile_gemm_sm80, precompile

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("the mma.sync GEMM needs sm_80 or later", allow_module_level=True)

TDT = {"bf16": torch.bfloat16, "f16": torch.float16}
SHAPES = [(1, 1, 8), (17, 33, 72), (300, 520, 136), (1000, 777, 1024), (2048, 2048, 2048), (65, 130, 37)]
SCHEDULES = [Sm80Schedule(128, 128, 32, 4, 2, 2), Sm80Schedule(128, 256, 32, 3, 2, 4),
             Sm80Schedule(256, 128, 64, 3, 4, 2), Sm80Schedule(64, 64, 16, 6, 2, 2)]
ACTS = epi.ACTIVATIONS
EP_SHAPE = (257, 384, 192)
GLU_SHAPE = (300, 400, 136)


def _ep_problem(act, dtype="bf16"):
    m, n, k = EP_SHAPE
    ep = epi.standard(m, n, dtype, bias="col", activation=act, residual=True, row_scale=True)
    return GemmProblem(m, n, k, dtype, epilogue=ep)


def _two_output_problem():
    m, n, k = 130, 200, 72
    e = epi.EpilogueBuilder(m, n)
    x = e.op("add", e.acc(), e.load("bias", "row", "bf16"))
    e.store("pre", x, "bf16")
    e.store("act", e.op("mul", x, e.op("sigmoid", x)), "f32")
    return GemmProblem(m, n, k, "bf16", b_major="N", epilogue=e.kernel("pre_and_silu"))


def _cases():
    """Every (problem, schedule) these tests compile, so one fixture can build them in parallel."""
    out = [(GemmProblem(m, n, k, dt, b_major=bm), None)
           for (m, n, k) in SHAPES for bm in "KN" for dt in TDT]
    out += [(GemmProblem(1000, 777, 1024, "bf16", b_major=bm), s) for s in SCHEDULES for bm in "KN"]
    out += [(GemmProblem(130, 200, 96, dt, batch=3, b_major=bm), None) for dt in TDT for bm in "KN"]
    out += [(_ep_problem(act), None) for act in ACTS]
    out += [(_ep_problem("gelu", "f16"), None)]
    m, n2, k = GLU_SHAPE
    out += [(GemmProblem(m, n2, k, "bf16", epilogue=epi.glu(m, n2, "bf16", activation=act)), None)
            for act in ("silu", "gelu")]
    out += [(_two_output_problem(), None), (GemmProblem(64, 64, 64, "bf16"), None)]
    return out


@pytest.fixture(scope="module", autouse=True)
def _built():
    """Compile every kernel of this module into the cubin cache, in parallel processes."""
    if torch.cuda.is_available():
        arch = torch.cuda.get_device_capability()
        precompile([(p, s, arch) for p, s in _cases()])


def _operands(m, n, k, b_major, dtype, batch=1):
    lead = (batch,) if batch > 1 else ()
    tdt = TDT[dtype]
    a = torch.randn(*lead, m, k, device="cuda", dtype=tdt)
    b = torch.randn(*lead, *((n, k) if b_major == "K" else (k, n)), device="cuda", dtype=tdt)
    bt = b.transpose(-1, -2) if b_major == "K" else b
    return a, b, bt


def _passes(out, ref, lowp):
    """2x rule: our error at most twice torch's own low-precision error (+1e-5)."""
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element was not written"
    err, base = rel_error(out.float(), ref), rel_error(lowp.float(), ref)
    assert err <= 2 * base + 1e-5, f"error {err:.3e} vs torch's {base:.3e}"


def _run_plain(m, n, k, b_major, dtype, sched=None, batch=1):
    a, b, bt = _operands(m, n, k, b_major, dtype, batch)
    g = compile_gemm_sm80(GemmProblem(m, n, k, dtype, b_major=b_major, batch=batch), sched)
    assert g.info.clean, g.info
    lead = (batch,) if batch > 1 else ()
    out = torch.full((*lead, m, n), float("nan"), device="cuda", dtype=TDT[dtype])
    g(a, b, out=out)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float(), a @ bt)


@pytest.mark.parametrize("dtype", list(TDT))
@pytest.mark.parametrize("b_major", ["K", "N"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_plain_gemm_matches_float32(shape, b_major, dtype):
    _run_plain(*shape, b_major, dtype)


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_schedules_match_float32(sched, b_major):
    _run_plain(1000, 777, 1024, b_major, "bf16", sched)


@pytest.mark.parametrize("dtype", list(TDT))
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_batched(dtype, b_major):
    _run_plain(130, 200, 96, b_major, dtype, batch=3)


_F = torch.nn.functional
ACT_FN = {"none": lambda x: x, "relu": torch.relu, "gelu": _F.gelu,
          "gelu_tanh": lambda x: _F.gelu(x, approximate="tanh"), "silu": _F.silu, "sigmoid": torch.sigmoid}


@pytest.mark.parametrize("act,dtype", [(a, "bf16") for a in ACTS] + [("gelu", "f16")])
def test_epilogue_bias_activation_residual_rowscale(act, dtype):
    m, n, k = EP_SHAPE
    tdt = TDT[dtype]
    a, b, bt = _operands(m, n, k, "K", dtype)
    bias = torch.randn(n, device="cuda", dtype=tdt)
    res = torch.randn(m, n, device="cuda", dtype=tdt)
    scale = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
    g = compile_gemm_sm80(_ep_problem(act, dtype))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
    g(a, b, out=out, bias=bias, residual=res, row_scale=scale)
    torch.cuda.synchronize()
    f = ACT_FN[act]
    ref = f((a.float() @ bt.float()) * scale[:, None] + bias.float()) + res.float()
    lowp = f((a @ bt) * scale[:, None].to(tdt) + bias) + res
    _passes(out, ref, lowp)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_epilogue_on_interleaved_weights(act):
    """SwiGLU/GeGLU as a pairwise epilogue equals act(x @ Wg.T) * (x @ Wu.T)."""
    m, n2, k = GLU_SHAPE
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(n2 // 2, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.stack([wg, wu], dim=1).reshape(n2, k).contiguous()  # gate j at row 2j, up j at 2j+1
    g = compile_gemm_sm80(GemmProblem(m, n2, k, "bf16", epilogue=epi.glu(m, n2, "bf16", activation=act)))
    out = torch.full((m, n2 // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(x, w, out=out)
    torch.cuda.synchronize()
    f = ACT_FN[act]
    _passes(out, f(x.float() @ wg.float().T) * (x.float() @ wu.float().T), f(x @ wg.T) * (x @ wu.T))


def test_custom_epilogue_with_two_outputs():
    """An EpilogueBuilder program storing the pre-activation (bf16) and silu of it (f32)."""
    p = _two_output_problem()
    a, b, bt = _operands(p.m, p.n, p.k, "N", "bf16")
    bias = torch.randn(p.m, device="cuda", dtype=torch.bfloat16)
    g = compile_gemm_sm80(p)
    pre = torch.full((p.m, p.n), float("nan"), device="cuda", dtype=torch.bfloat16)
    act = torch.full((p.m, p.n), float("nan"), device="cuda", dtype=torch.float32)
    outs = g(a, b, pre=pre, act=act, bias=bias)
    torch.cuda.synchronize()
    assert outs["pre"] is pre and outs["act"] is act
    ref = a.float() @ bt.float() + bias.float()[:, None]
    lowp = a @ bt + bias[:, None]
    _passes(pre, ref, lowp)
    _passes(act, _F.silu(ref), _F.silu(lowp.float()))


def test_misaligned_operand_is_a_clear_error():
    g = compile_gemm_sm80(GemmProblem(64, 64, 64, "bf16"))
    spare = torch.randn(64 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    a = spare[1:].view(64, 64)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte"):
        g(a, b)
    with pytest.raises(ValueError, match="expected shape"):
        g(b[:32], b)

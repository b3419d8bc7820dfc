"""Partial row reductions in the sm_90a GEMM epilogue on a Hopper GPU vs a float64 reference
(DESIGN.md's 2x rule): pmax / psum (log-sum-exp partials) and psel (target select) of the
logits x @ W.T over 128-column groups, and the row log-sum-exp and loss finished from them.
Outputs are poisoned (NaN) first, so a (row, group) no lane writes fails. Shapes with tails
in M and N (N not a multiple of 128 nor of the tile), every schedule the partials allow."""
import sys
from pathlib import Path

import numpy
import pytest
import torch

from tilefuse.check import rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen.gemm_sm90 import GemmError, GemmProblem, GemmSchedule
from tilefuse.runtime.gemm import compile_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from coda_fixtures import ResidualNormLinear  # noqa: E402  h = x + O(a), a norm, two projections

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("the sm_90a GEMM needs a Hopper GPU", allow_module_level=True)

W = epi.PARTIAL_WIDTH


def _lm_head(m, n, also_store=False):
    e = epi.EpilogueBuilder(m, n)
    x = e.acc()
    if also_store:
        e.store("logits", x, "bf16")
    e.partial_lse("pmax", "psum", x)
    e.partial_select("psel", x, "target")
    return e.kernel("lm_head_partials")


def _partials(logits: torch.Tensor, target: torch.Tensor):
    """The definition in float64, on logits [M, N] (any dtype)."""
    x = logits.double()
    m, n = x.shape
    t = -(-n // W)
    pad = torch.full((m, t * W), float("-inf"), dtype=torch.float64, device=x.device)
    pad[:, :n] = x
    g = pad.view(m, t, W)
    pmax = g.amax(-1)
    shift = torch.where(pmax == float("-inf"), torch.zeros_like(pmax), pmax)
    psum = torch.exp(g - shift[..., None]).sum(-1)
    cols = torch.arange(t * W, device=x.device).view(1, t, W)
    psel = torch.where(cols == target.view(m, 1, 1), g, torch.zeros_like(g)).sum(-1)
    return pmax, psum, psel


def _finish(pmax, psum, psel):
    big = pmax.amax(-1, keepdim=True)
    lse = big[:, 0] + torch.log((torch.exp(pmax - big) * psum).sum(-1))
    return lse, lse - psel.sum(-1)


def _passes(name, out, ref, lowp):
    assert torch.isfinite(out).all(), f"{name}: NaN/inf (an element was not written)"
    err, base = rel_error(out, ref), rel_error(lowp, ref)
    assert err <= 2 * base + 1e-5, f"{name}: error {err:.3e} vs torch's {base:.3e}"


SCHEDULES = [GemmSchedule(128, 256, stages=4, tma_store=False), GemmSchedule(128, 128, stages=6),
             GemmSchedule(64, 128, stages=8, consumers=1), GemmSchedule(256, 128, stages=4),
             GemmSchedule(128, 256, stages=4, cluster_m=2), GemmSchedule(64, 256, stages=4, consumers=1), None]


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("shape", [(17, 200, 72), (300, 1000, 136), (1000, 4096, 1024), (2048, 32000, 512),
                                   (513, 50264, 256)])
def test_lm_head_partials_match_float64(shape, sched):
    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    target = torch.randint(0, n, (m,), device="cuda")
    target[::5] = -100               # ignore_index: in no group
    target[1::7] = n - 1             # the last column (the tail group)
    gemm = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=_lm_head(m, n)), sched)
    assert gemm.info.clean, gemm.info
    outs = gemm.allocate_outputs(poison=True)
    gemm(x, w, target=target, **outs)
    torch.cuda.synchronize()
    ref = _partials(x.double() @ w.double().T, target)
    lowp = _partials(x @ w.T, target)  # torch's bf16 logits, reduced exactly
    for name, r, lp in zip(("pmax", "psum", "psel"), ref, lowp):
        _passes(name, outs[name], r, lp)
    got = _finish(outs["pmax"].double(), outs["psum"].double(), outs["psel"].double())
    for name, o, r, lp in zip(("lse", "loss"), got, _finish(*ref), _finish(*lowp)):
        _passes(name, o, r, lp)


def test_partials_with_the_logits_also_stored():
    m, n, k = 300, 1000, 136
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, n, (m,), device="cuda")
    gemm = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=_lm_head(m, n, also_store=True)))
    outs = gemm.allocate_outputs(poison=True)
    gemm(x, w, target=target, **outs)
    torch.cuda.synchronize()
    ref64 = x.double() @ w.double().T
    _passes("logits", outs["logits"], ref64, x @ w.T)
    for name, r, lp in zip(("pmax", "psum", "psel"), _partials(ref64, target), _partials(x @ w.T, target)):
        _passes(name, outs[name], r, lp)


class _HeadLoss(torch.nn.Module):
    """An LM head and the loss a training step writes over it: [B, S, V] logits cast to f32 and
    viewed as [B S, V], ignore_index -100 (what transformers' ForCausalLMLoss does)."""

    def __init__(self, d, v, shift=False):
        super().__init__()
        self.head = torch.nn.Linear(d, v, bias=False)
        self.shift = shift

    def forward(self, x, target):
        z = self.head(x)
        if self.shift:  # the logits of positions 0..S-2 against the labels of 1..S-1
            z, target = z[:, :-1], target[:, 1:]
        return torch.nn.functional.cross_entropy(z.float().reshape(-1, z.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100)


def _program_loss(module, inputs):
    """tilefuse.compile's loss (its thin call, then its CUDA-graph replay) under the 2x rule, with
    the LM head's GEMM writing the partials, not the logits."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    prog = tilefuse.compile(module, inputs)
    prog.poison = True
    assert "lmhead_ce_partials" in [f.rule for f in prog.stages.fired]
    assert sum(1 for s in prog.plan.steps if s.family == "gemm"
               and any(k == "lse" for k, _, _ in s.gemm.partials)) == 1
    ref = float64_reference(module, inputs)
    with torch.no_grad():
        eager = module(*inputs)
    for call in range(2):
        c = compare(f"call{call}", prog(*inputs).reshape(()).float(), ref.reshape(()), eager.reshape(()))
        assert c.ok, c


@pytest.mark.parametrize("v,shift", [(50257, False), (1000, False), (129, False), (4096, False), (50257, True)])
def test_compiled_head_loss_at_any_vocab_size(v, shift):
    """V not a multiple of 128 (GPT-2's 50257): the short last group's columns add nothing;
    shifted logits: the partials of every row, the finished values of the kept ones."""
    torch.manual_seed(0)
    m = _HeadLoss(256, v, shift).cuda().to(torch.bfloat16).eval()
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (2, 300), device="cuda")
    t.view(-1)[::7] = -100
    t.view(-1)[1::11] = v - 1
    _program_loss(m, (x, t))


@pytest.mark.parametrize("name,vocab", [("llama", 1000), ("gpt2", 50257)])
def test_compiled_transformers_loss(name, vocab):
    """transformers' own loss (shifted labels, f32 logits, ignore_index) on the partials."""
    pytest.importorskip("transformers")
    from tilefuse import models

    b = models.build(name, 1, hidden=128, seq=64, batch=2, vocab=vocab, dtype=torch.bfloat16, output="loss",
                     device="cuda")
    ids, labels = b.inputs
    labels[0, :5] = -100
    _program_loss(b.model, (ids, labels))


def _with_sq(m, n, operand, width=W):
    """out = acc + residual[m, n] (or + bias[n]) in bf16, and per 128 columns the sum of its
    squares (before rounding) and its max: what an RMSNorm after a residual GEMM needs, beside
    the tile's own store."""
    e = epi.EpilogueBuilder(m, n)
    y = e.op("add", e.acc(), e.load(operand, "tile" if operand == "residual" else "col", "bf16"))
    e.store("out", y, "bf16")
    e.partial_sum("sq", e.op("mul", y, y), width)
    e.partial_max("mx", y, width)
    return e.kernel(f"{operand}_sq")


def _grouped(y: torch.Tensor, width=W):
    """(sum of squares, max) of y [M, N] per group of `width` columns, in float64 (a short last
    group padded with what adds nothing)."""
    m, n = y.shape
    t = -(-n // width)
    sq = torch.zeros(m, t * width, dtype=torch.float64, device=y.device)
    mx = torch.full((m, t * width), float("-inf"), dtype=torch.float64, device=y.device)
    sq[:, :n], mx[:, :n] = y.double() ** 2, y.double()
    return sq.view(m, t, width).sum(-1), mx.view(m, t, width).amax(-1)


INLINE = [None, GemmSchedule(128, 256, stages=3, cluster_m=2, tma_loads=True), GemmSchedule(128, 128, stages=6),
          GemmSchedule(128, 256, stages=4, defer_stores=False), GemmSchedule(128, 256, stages=4, tma_store=False),
          GemmSchedule(64, 128, stages=8, consumers=1), GemmSchedule(128, 256, stages=4, stream_k=132),
          GemmSchedule(128, 128, stages=6, split_k=2), GemmSchedule(128, 128, stages=6, pingpong=True)]


@pytest.mark.parametrize("operand", ["residual", "bias"])
@pytest.mark.parametrize("sched", INLINE, ids=str)
@pytest.mark.parametrize("shape", [(1000, 1000, 136), (2048, 2048, 512), (300, 384, 64), (4096, 2048, 2048)])
def test_sum_of_squares_beside_the_tile_store(shape, sched, operand):
    """Partials a GEMM's element code adds up as it goes (gemm_sm90.InlinePartials), on every
    store path (TMA store, residual by TMA, a cluster, stores deferred to the next tile (with a
    bias, not a residual), direct stores, stream-K, split-K, ping-pong): the tile and each
    (row, group)'s sum of squares and max, with tails in M and N (N = 1000: a short last group)."""
    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if operand == "residual" else \
        torch.randn(n, device="cuda", dtype=torch.bfloat16)
    problem = GemmProblem(m, n, k, "bf16", epilogue=_with_sq(m, n, operand))
    try:
        gemm = compile_gemm(problem, sched)
    except GemmError as e:  # a schedule this shape cannot take (stated), not a wrong result
        pytest.skip(f"{sched}: {e}")
    assert gemm.info.clean, gemm.info
    outs = gemm.allocate_outputs(poison=True)
    gemm(x, w, **{operand: r}, **outs)
    torch.cuda.synchronize()
    ref = x.double() @ w.double().T + r.double()
    lowp = (x @ w.T + r).float()  # torch's bf16 result
    _passes("out", outs["out"], ref, lowp)
    for name, got, want, lp in zip(("sq", "mx"), (outs["sq"], outs["mx"]), _grouped(ref), _grouped(lowp)):
        _passes(name, got, want, lp)


def _two_calls_pass(prog, m, inputs):
    """Both outputs (y, h) of the thin call and of the CUDA-graph replay under the 2x rule."""
    from tilefuse.check import compare, float64_reference

    ref = float64_reference(m, inputs)
    with torch.no_grad():
        eager = m(*inputs)
    for call in range(2):
        for name, o, r, e in zip(("y", "h"), prog(*inputs), ref, eager):
            c = compare(f"{name} call{call}", o, r, e)
            assert c.ok, c


@pytest.mark.parametrize("gemv_on", [True, False])
@pytest.mark.parametrize("rows,d", [(2 * 1000, 512), (8192, 2048), (37, 256), (1, 4096), (4, 512)])
def test_compiled_rmsnorm_partials(rows, d, gemv_on, monkeypatch):
    """tilefuse.compile (its thin call, then its CUDA-graph replay) with the O GEMM writing h and
    its per-group sums of squares: both outputs under the 2x rule, outputs poisoned. At up to 8
    rows (a decode step) the groups are 16 columns and the GEMV writes them (TILEFUSE_GEMV=0: the
    tile template, at 16 columns too)."""
    import tilefuse
    from tilefuse.codegen import gemv

    if not gemv_on and rows > gemv.MAX_M:
        pytest.skip("the GEMV takes at most 8 rows: its switch changes nothing here")
    monkeypatch.setenv(gemv.ENV, "1" if gemv_on else "0")
    torch.manual_seed(0)
    m = ResidualNormLinear(d, 384).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        m.norm.weight.copy_(1 + 0.3 * torch.randn(d))
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    prog = tilefuse.compile(m, (x, a))
    prog.poison = True
    assert "rmsnorm_partials" in [f.rule for f in prog.stages.fired]
    (step,) = [s for s in prog.plan.steps if s.family == "gemm" and s.gemm.partials]
    assert step.gemm.partial_width == (16 if rows <= gemv.MAX_M else 128)
    _two_calls_pass(prog, m, (x, a))
    assert _partials_in_the_gemv(prog) == (gemv_on and rows <= gemv.MAX_M)


def _partials_in_the_gemv(prog) -> bool:
    """Whether the program built a GEMV whose epilogue writes partials (the GEMM with them ran
    there, not only the plain projections)."""
    from tilefuse.codegen import epilogue as epi
    from tilefuse.runtime.gemv import GemvKernel

    return any(isinstance(k, GemvKernel) and epi.partials_loop(k.source.problem.out_epilogue) is not None
               for k in prog._compiled.values())


@pytest.mark.parametrize("gemv_on", [True, False])
@pytest.mark.parametrize("rows,d", [(2 * 1000, 512), (8192, 2048), (37, 256), (300, 128), (3, 1024)])
def test_compiled_layernorm_partials(rows, d, gemv_on, monkeypatch):
    """tilefuse.compile (thin call, then CUDA-graph replay) with the O GEMM writing h and the
    per-group sums of h and of h², the rank-1 correction after: both outputs under the 2x rule,
    outputs poisoned; rows of a non-zero mean, so the correction matters. At up to 8 rows the
    groups are 16 columns, in the GEMV (TILEFUSE_GEMV=0: the tile template)."""
    import tilefuse
    from tilefuse.codegen import gemv

    if not gemv_on and rows > gemv.MAX_M:
        pytest.skip("the GEMV takes at most 8 rows: its switch changes nothing here")
    monkeypatch.setenv(gemv.ENV, "1" if gemv_on else "0")
    torch.manual_seed(0)
    m = ResidualNormLinear(d, 384, norm="layer").cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        m.norm.weight.copy_(1 + 0.3 * torch.randn(d))
        m.norm.bias.copy_(0.3 * torch.randn(d))
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16) + 1.0
    a = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    prog = tilefuse.compile(m, (x, a))
    prog.poison = True
    assert "layernorm_partials" in [f.rule for f in prog.stages.fired]
    parts = [s for s in prog.plan.steps if s.family == "gemm" and s.gemm.partials]
    assert len(parts) == 1 and len(parts[0].gemm.partials) == 2
    assert parts[0].gemm.partial_width == (16 if rows <= gemv.MAX_M else 128)
    _two_calls_pass(prog, m, (x, a))
    assert _partials_in_the_gemv(prog) == (gemv_on and rows <= gemv.MAX_M)


@pytest.mark.parametrize("hidden", [128, 768])
def test_compiled_gpt2_with_layernorm_partials(hidden):
    """A 2-layer transformers GPT-2 (bf16, random weights) compiled with its LayerNorm statistics
    in the output projections' epilogues: logits under the 2x rule against float64."""
    pytest.importorskip("transformers")
    import tilefuse
    from tilefuse import models
    from tilefuse.check import compare, float64_reference

    b = models.build("gpt2", 2, hidden=hidden, seq=64, batch=2, vocab=512, dtype=torch.bfloat16, device="cuda")
    prog = tilefuse.compile(b.model, b.inputs)
    assert "layernorm_partials" in [f.rule for f in prog.stages.fired]
    assert sum(1 for s in prog.plan.steps if s.family == "gemm" and s.gemm.partials) == 4
    ref = float64_reference(b.model, b.inputs)
    with torch.no_grad():
        eager = b.model(*b.inputs)
    c = compare("gpt2 logits", prog(*b.inputs), ref, eager)
    assert c.ok, c


_POISON = r"""
extern "C" __global__ void tf_poison_shared(int words) {
  extern __shared__ unsigned s[];
  for (int i = threadIdx.x; i < words; i += blockDim.x) s[i] = 0xFFC00000u;  // a float NaN in every word
}
"""


def _poison_shared_memory():
    """Fill every SM's shared memory with NaN words (several full-size CTAs an SM), so a GEMM
    launched next finds NaN wherever it reads shared memory its own loads did not write."""
    cupy = pytest.importorskip("cupy")
    kernel = cupy.RawKernel(_POISON, "tf_poison_shared")
    size = 227 * 1024
    kernel.max_dynamic_shared_size_bytes = size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel((4 * sms,), (256,), (numpy.int32(size // 4),), shared_mem=size)
    cupy.cuda.Device().synchronize()


SHORT_M = [((1, 22016, 1024), None, "sq"),                 # 64x256, A loaded in one 8-row atom
           ((1, 40000, 1024), None, "sq"),                 # 64x256 with stream-K (157 tiles)
           ((1, 4096, 4096), None, "sq"),                  # 64x128, split-K 4
           ((20, 1024, 1024), GemmSchedule(128, 128, stages=6), "sq"),  # consumer 1's rows all past M
           ((1, 32000, 512), None, "lm"), ((3, 32000, 512), GemmSchedule(128, 128, stages=6), "lm")]


@pytest.mark.parametrize("shape, sched, kind", SHORT_M, ids=lambda x: str(x) if isinstance(x, tuple) else None)
def test_short_m_rows_past_m_reach_no_result_with_nan_in_shared_memory(shape, sched, kind):
    """Where all of M fits one tile, TMA loads A only up to M's 8-row atom (gemm_sm90.a_rows) and
    the tile's other rows hold what shared memory held: with NaN there, the tile, the sums of
    squares and the log-sum-exp / target partials still pass the 2x rule, finite everywhere
    (split-K and stream-K carry those rows through their workspace; partials reduce by row)."""
    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    if kind == "sq":
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        problem, ops = GemmProblem(m, n, k, "bf16", epilogue=_with_sq(m, n, "residual")), {"residual": r}
    else:
        target = torch.randint(0, n, (m,), device="cuda")
        problem, ops = GemmProblem(m, n, k, "bf16", epilogue=_lm_head(m, n)), {"target": target}
    gemm = compile_gemm(problem, sched)
    assert gemm.info.clean, gemm.info
    assert "#define STAGE_TX" in gemm.source.source and gemm.source.a_box[1] < (sched.bm if sched else 64)
    outs = gemm.allocate_outputs(poison=True)
    _poison_shared_memory()
    gemm(x, w, **ops, **outs)
    torch.cuda.synchronize()
    if kind == "sq":
        ref, lowp = x.double() @ w.double().T + r.double(), (x @ w.T + r).float()
        _passes("out", outs["out"], ref, lowp)
        for name, got, want, lp in zip(("sq", "mx"), (outs["sq"], outs["mx"]), _grouped(ref), _grouped(lowp)):
            _passes(name, got, want, lp)
    else:
        for name, r_, lp in zip(("pmax", "psum", "psel"), _partials(x.double() @ w.double().T, target),
                                _partials(x @ w.T, target)):
            _passes(name, outs[name], r_, lp)

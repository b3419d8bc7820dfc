"""The generated sm_90a GEMM on an H100 vs a float32 reference (DESIGN.md's 2x rule).

Fresh random normal inputs per case; outputs poisoned with NaN first, so an unwritten
element fails. Odd shapes (tails in M, N and K), both B layouts, batches, every schedule
shape the heuristics pick, and each epilogue kind.
"""
from dataclasses import replace

import pytest
import torch

from tilefuse.check import rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen.gemm_sm90 import GemmError, GemmProblem, GemmSchedule, default_schedule
from tilefuse.runtime import gemm as rt_gemm
from tilefuse.runtime.gemm import compile_gemm

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("the sm_90a GEMM needs a Hopper GPU", allow_module_level=True)


def _operands(m, n, k, b_major, batch=1, dtype=torch.bfloat16):
    lead = (batch,) if batch > 1 else ()
    a = torch.randn(*lead, m, k, device="cuda", dtype=dtype)
    b = torch.randn(*lead, *((n, k) if b_major == "K" else (k, n)), device="cuda", dtype=dtype)
    bt = b.transpose(-1, -2) if b_major == "K" else b
    return a, b, bt


def _passes(out, ref, lowp):
    """2x rule: our error at most twice torch's own low-precision error (+1e-5)."""
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element was not written"
    err, base = rel_error(out.float(), ref), rel_error(lowp.float(), ref)
    assert err <= 2 * base + 1e-5, f"error {err:.3e} vs torch's {base:.3e}"


def _right_three_times(g, a, b, bt, shape):
    """Three launches in a row, each on a NaN-poisoned output, each within the 2x rule and
    bit for bit the same as the first: a launch leaves nothing (a counter, a barrier phase)
    that spoils the next, and no sum's order depends on which CTA gets there first."""
    ref, lowp = a.float() @ bt.float(), a @ bt
    first = None
    for _ in range(3):
        out = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        g(a, b, out=out)
        torch.cuda.synchronize()
        _passes(out, ref, lowp)
        if first is None:
            first = out
        assert torch.equal(out, first), "two launches gave different bits"


def _right_with_counters_at_zero(shape, sched):
    """A workspace-summing schedule (split-K, stream-K): right three launches in a row, and
    its turn counters back at zero after them."""
    m, n, k = shape
    a, b, bt = _operands(m, n, k, "K")
    g = compile_gemm(GemmProblem(m, n, k, "bf16"), sched)
    _right_three_times(g, a, b, bt, (m, n))
    flags = _stream_flags()
    assert flags and all(int(f.abs().sum()) == 0 for f in flags)


def _stream_flags() -> list:
    """The turn counters of every stream's shared GEMM workspace (runtime.gemm.Workspace)."""
    return [f for arena in rt_gemm._STREAMS.values() for bufs in arena.flags.values() for f in bufs]


def _bias_gelu_residual_batched(sched, m, n, k, batch=2):
    """GEMM + column bias + GELU + residual, batched, against float32."""
    a, b, bt = _operands(m, n, k, "K", batch=batch)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(batch, m, n, device="cuda", dtype=torch.bfloat16)
    ep = epi.standard(m, n, "bf16", bias="col", activation="gelu", residual=True, batch=batch)
    g = compile_gemm(GemmProblem(m, n, k, "bf16", batch=batch, epilogue=ep), sched)
    out = torch.full((batch, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out, bias=bias, residual=res)
    torch.cuda.synchronize()
    f = torch.nn.functional.gelu
    _passes(out, f(a.float() @ bt.float() + bias.float()) + res.float(), f(a @ bt + bias) + res)


# TMA-store epilogue by default (where N's row pitch allows); one direct-store schedule too
SCHEDULES = [GemmSchedule(128, 256, stages=4), GemmSchedule(128, 128, stages=6),
             GemmSchedule(64, 128, stages=8, consumers=1), GemmSchedule(256, 128, stages=4),
             GemmSchedule(64, 64, stages=4, consumers=1), GemmSchedule(128, 256, stages=4, cluster_m=2),
             GemmSchedule(128, 128, stages=6, cluster_m=2), GemmSchedule(64, 64, stages=8, consumers=1, cluster_m=2),
             GemmSchedule(128, 256, stages=4, tma_store=False), GemmSchedule(128, 128, stages=6, pingpong=True),
             GemmSchedule(64, 256, stages=5, pingpong=True, cluster_m=2),
             GemmSchedule(128, 128, stages=6, pingpong=True, tma_store=False),
             GemmSchedule(64, 64, stages=14, consumers=1, tma_store=False),  # rings past 8 deep
             GemmSchedule(64, 64, stages=13, consumers=1, cluster_m=2), GemmSchedule(64, 128, stages=9, consumers=1)]
PINGPONG = [GemmSchedule(128, 128, stages=6, pingpong=True), GemmSchedule(64, 256, stages=5, pingpong=True),
            GemmSchedule(128, 128, stages=5, pingpong=True, cluster_m=2)]


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 8), (17, 33, 72), (300, 520, 136), (1000, 777, 1024)])
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_plain_gemm_matches_float32(shape, sched, b_major):
    m, n, k = shape
    if b_major == "N" and n % 8:
        n += 8 - n % 8  # TMA needs 16-byte rows of B
    if b_major == "N" and sched.cluster_m == 2 and sched.bn < 128:
        pytest.skip("a 2-CTA cluster with N-major B needs bn a multiple of 128 (refused by render)")
    a, b, bt = _operands(m, n, k, b_major)
    g = compile_gemm(GemmProblem(m, n, k, "bf16", b_major=b_major), sched)
    assert g.info.clean, g.info
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float(), a @ bt)


@pytest.mark.parametrize("shape", [(4095, 4097, 4104), (2048, 2048, 8192)])
def test_large_gemm_matches_float32(shape):
    m, n, k = shape
    a, b, bt = _operands(m, n, k, "K")
    g = compile_gemm(GemmProblem(m, n, k, "bf16"))
    out = g(a, b)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float(), a @ bt)


@pytest.mark.parametrize("sched", PINGPONG, ids=str)
@pytest.mark.parametrize("shape", [(4095, 4097, 4104), (4096, 4096, 64), (2048, 8192, 200), (3000, 3000, 1000)])
def test_pingpong_turns_over_many_tiles_per_cta(shape, sched):
    """Many tiles per CTA, K steps fewer and more than the stages, odd tails: the consumers'
    turns and their place in the shared stage ring stay in step (a slip reads another tile's
    stage: wrong values, or a hang)."""
    m, n, k = shape
    a, b, bt = _operands(m, n, k, "K")
    g = compile_gemm(GemmProblem(m, n, k, "bf16"), sched)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float(), a @ bt)


SPLIT_K = [GemmSchedule(64, 64, stages=8, consumers=1, tma_store=False, split_k=4),
           GemmSchedule(128, 128, stages=6, split_k=2), GemmSchedule(128, 256, stages=4, split_k=3)]


@pytest.mark.parametrize("sched", SPLIT_K, ids=str)
@pytest.mark.parametrize("shape", [(128, 4096, 4096), (300, 520, 1000), (1, 64, 704), (2048, 2048, 1024)])
def test_split_k_matches_float32_and_leaves_its_counters_at_zero(shape, sched):
    """Slices of K summed through the workspace by whichever slice counts in last: right at one
    tile, at tails, and with more units than SMs (CTAs walk several); three launches in a row
    are right, so each left its counters at zero for the next."""
    _right_with_counters_at_zero(shape, sched)


def test_split_k_sums_the_same_bits_whichever_slice_comes_last():
    """Which slice counts in last varies from launch to launch; the sum over the slots runs in
    slice order, so twenty launches give one result (adding the others onto the last slice's
    own registers did not: the tuner's two-launch check refused 64x256 and 128x160 with four
    slices at 128x4096x4096)."""
    m, n, k = 128, 4096, 4096
    a, b, _ = _operands(m, n, k, "K")
    for sched in (GemmSchedule(64, 256, stages=4, consumers=1, split_k=4),
                  GemmSchedule(128, 160, stages=5, split_k=4)):
        g = compile_gemm(GemmProblem(m, n, k, "bf16"), sched)
        first = g(a, b).clone()
        for _ in range(20):
            assert torch.equal(g(a, b), first), sched


def test_split_k_runs_the_epilogue_once_on_the_whole_sum():
    """Bias, GELU and residual apply to the full K sum (the last slice runs the epilogue),
    batched."""
    _bias_gelu_residual_batched(GemmSchedule(128, 128, stages=6, split_k=4), 200, 384, 1536)


def test_gemms_of_one_stream_share_one_workspace_and_stay_right():
    """Split-K and stream-K GEMMs of different workspace sizes, launched in turn on one stream,
    take their partials and counters from the stream's one workspace (grown to the largest),
    not one each: each gives its first launch's bits again, in any order, and the counters
    are back at zero after them all."""
    runs = []
    for (m, n, k), sched in (((1, 4096, 4096), GemmSchedule(64, 128, stages=8, consumers=1, tma_store=False, split_k=4)),
                             ((300, 1280, 1000), GemmSchedule(128, 128, stages=6, stream_k=7)),
                             ((128, 4096, 4096), GemmSchedule(128, 256, stages=4, split_k=3))):
        a, b, _ = _operands(m, n, k, "K")
        g = compile_gemm(GemmProblem(m, n, k, "bf16"), sched)
        runs.append((g, a, b, g(a, b).clone()))
    arena = rt_gemm._STREAMS[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)]
    largest = max(g.source.workspace for g, *_ in runs)
    assert arena.partials[torch.cuda.current_device()][-1].numel() >= largest
    for g, a, b, first in runs[::-1] + runs + runs[::2]:
        assert torch.equal(g(a, b), first), g.source.schedule
    torch.cuda.synchronize()
    assert all(int(f.abs().sum()) == 0 for f in _stream_flags())


_SK132 = GemmSchedule(128, 256, stages=4, stream_k=132)
_SK132_M2 = GemmSchedule(128, 256, stages=4, cluster_m=2, stream_k=132)   # 66 pairs
_SK7 = GemmSchedule(128, 128, stages=6, stream_k=7)
_SK10_N2 = GemmSchedule(64, 64, stages=12, consumers=1, cluster_n=2, tma_store=False, stream_k=10)  # 5 pairs
STREAM_K = [((4096, 4096, 4096), _SK132), ((4096, 4096, 4096), _SK132_M2), ((4096, 4096, 4096), _SK10_N2),
            ((4095, 4097, 4104), _SK132), ((4095, 4097, 4104), _SK132_M2), ((4095, 4097, 4104), _SK7),
            ((1000, 1024, 520), _SK7), ((1000, 1024, 520), _SK10_N2),
            ((300, 1280, 1000), _SK7), ((300, 1280, 1000), _SK10_N2)]   # the last: whole waves, nothing cut


@pytest.mark.parametrize("shape,sched", STREAM_K, ids=lambda x: str(x) if isinstance(x, GemmSchedule) else None)
def test_stream_k_matches_float32_and_leaves_its_counters_at_zero(shape, sched):
    """The last waves' tiles cut by K steps between neighbouring CTAs and summed through the
    workspace: right with tails, clusters along M and N, a cut in every shared tile or in
    none, and three launches in a row give the same bits, so each left its counters at zero."""
    _right_with_counters_at_zero(shape, sched)


def test_stream_k_with_more_ctas_than_sms_finishes():
    """Nobody spins on a cut, so a grid larger than the GPU (CTAs waiting for an SM) still
    finishes, right: 256 tiles shared by 200 CTAs."""
    m = n = 1024
    a, b, bt = _operands(m, n, 2048, "K")
    g = compile_gemm(GemmProblem(m, n, 2048, "bf16"), GemmSchedule(64, 64, stages=8, consumers=1, tma_store=False,
                                                                   stream_k=200))
    _right_three_times(g, a, b, bt, (m, n))


def test_stream_k_sums_the_same_bits_whichever_half_comes_second():
    """Which half of a cut tile arrives second varies between launches; one f32 add commutes,
    so twenty launches give one result."""
    a, b, _ = _operands(2048, 2048, 4096, "K")
    g = compile_gemm(GemmProblem(2048, 2048, 4096, "bf16"), GemmSchedule(128, 128, stages=6, stream_k=100))
    first = g(a, b).clone()
    for _ in range(20):
        assert torch.equal(g(a, b), first)


def test_stream_k_runs_the_epilogue_once_on_the_whole_sum():
    """Bias, GELU and residual apply to the whole K sum of a cut tile, batched."""
    _bias_gelu_residual_batched(GemmSchedule(128, 128, stages=6, stream_k=5), 200, 384, 1536)


CLUSTER_N = [GemmSchedule(64, 64, stages=12, consumers=1, cluster_n=2, tma_store=False),
             GemmSchedule(64, 128, stages=8, consumers=1, cluster_n=2), GemmSchedule(128, 128, stages=6, cluster_n=2),
             GemmSchedule(256, 128, stages=4, cluster_n=2)]


@pytest.mark.parametrize("sched", CLUSTER_N, ids=str)
@pytest.mark.parametrize("shape", [(128, 4096, 4096), (200, 512, 520), (1, 1024, 72), (3000, 1024, 1024)])
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_a_shared_by_column_pairs_matches_float32(shape, sched, b_major):
    """1x2 clusters (each CTA loads half of the A tile and multicasts it): right at the skinny
    shape they are for, with tails in M and K, with one row, with more pairs than SMs (CTAs
    walk several), both B layouts; three launches in a row (no barrier left mid-phase)."""
    m, n, k = shape
    a, b, bt = _operands(m, n, k, b_major)
    g = compile_gemm(GemmProblem(m, n, k, "bf16", b_major=b_major), sched)
    assert g.info.clean, g.info
    _right_three_times(g, a, b, bt, (m, n))


def test_a_shared_by_column_pairs_runs_the_epilogue_on_each_tile():
    """Bias, GELU and residual with a 1x2 cluster, batched: each CTA's epilogue covers its own
    column tile."""
    _bias_gelu_residual_batched(CLUSTER_N[2], 200, 512, 1536)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_batched_and_f16(dtype):
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    a, b, bt = _operands(130, 200, 96, "K", batch=3, dtype=tdt)
    g = compile_gemm(GemmProblem(130, 200, 96, dtype, batch=3), GemmSchedule(128, 128, stages=4))
    out = torch.full((3, 130, 200), float("nan"), device="cuda", dtype=tdt)
    g(a, b, out=out)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float(), a @ bt)


@pytest.mark.parametrize("bn", [128, 256], ids=["128x128", "128x256"])
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "pingpong"])
@pytest.mark.parametrize("tma_store", [True, False], ids=["tma-store", "direct-store"])
@pytest.mark.parametrize("act", epi.ACTIVATIONS)
def test_epilogue_bias_activation_residual_rowscale(act, tma_store, pingpong, bn):
    """Both store paths, with a tail in M (and in N at 256 wide, 4 store slots per warpgroup):
    operand loads past the last row must not be made."""
    if pingpong and bn == 256:
        pytest.skip("a ping-pong consumer's 128x256 tile does not fit its registers")
    m, n, k = 257, 384, 192
    a, b, bt = _operands(m, n, k, "K")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
    ep = epi.standard(m, n, "bf16", bias="col", activation=act, residual=True, row_scale=True)
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=ep),
                     GemmSchedule(128, bn, stages=4, tma_store=tma_store, pingpong=pingpong))
    assert (g.source.c_box is not None) == tma_store
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out, bias=bias, residual=res, row_scale=scale)
    torch.cuda.synchronize()
    f = {"none": lambda x: x, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
         "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
         "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}[act]
    ref = f((a.float() @ bt.float()) * scale[:, None] + bias.float()) + res.float()
    lowp = f((a @ bt) * scale[:, None].bfloat16() + bias) + res
    _passes(out, ref, lowp)


def test_misaligned_operand_is_a_clear_error():
    g = compile_gemm(GemmProblem(64, 64, 64, "bf16"))
    spare = torch.randn(64 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    a = spare[1:].view(64, 64)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        g(a, b)


@pytest.mark.parametrize("tma_store", [True, False], ids=["tma-store", "direct-store"])
def test_residual_read_in_pairs_needs_4_byte_alignment(tma_store):
    """The residual is read as 4-byte column pairs: a view starting at an odd element is refused
    with the reason, and the same values in aligned memory give the right sum."""
    m, n, k = 128, 256, 64
    ep = epi.standard(m, n, "bf16", residual=True)
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=ep), GemmSchedule(128, 128, stages=4, tma_store=tma_store))
    assert g.source.pair_loads == ("residual",)
    _misaligned_residual_refused(g, m, n, k, 1, "4-byte column pairs")


def _misaligned_residual_refused(g, m, n, k, offset: int, why: str):
    """A residual view starting `offset` elements into its storage is refused with `why`; the
    same values in fresh (aligned) memory give the right sum."""
    a, b, bt = _operands(m, n, k, "K")
    spare = torch.randn(m * n + offset, device="cuda", dtype=torch.bfloat16)
    res = spare[offset:].view(m, n)
    with pytest.raises(ValueError, match=why):
        g(a, b, residual=res)
    out = g(a, b, residual=res.clone())
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float() + res.float(), a @ bt + res)


def test_unaligned_k_is_refused_with_reason():
    with pytest.raises(GemmError, match="multiple of 16 bytes"):
        compile_gemm(GemmProblem(64, 64, 70, "bf16"))


@pytest.mark.parametrize("sched", [GemmSchedule(128, 128, stages=4), GemmSchedule(128, 256, stages=4),
                                   GemmSchedule(128, 128, stages=4, tma_store=False),
                                   GemmSchedule(128, 128, stages=6, pingpong=True)], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_epilogue_on_interleaved_weights(act, sched):
    """SwiGLU/GeGLU as a pairwise epilogue equals act(x @ Wg.T) * (x @ Wu.T), stored through the
    TMA-store slots (tails clipped by TMA) or straight from registers."""
    m, n2, k = 300, 2 * 200, 136
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(n2 // 2, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.stack([wg, wu], dim=1).reshape(n2, k).contiguous()  # gate j at row 2j, up j at 2j+1
    g = compile_gemm(GemmProblem(m, n2, k, "bf16", epilogue=epi.glu(m, n2, "bf16", activation=act)), sched)
    assert (g.source.c_box is not None) == sched.tma_store
    out = torch.full((m, n2 // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(x, w, out=out)
    torch.cuda.synchronize()
    f = torch.nn.functional.silu if act == "silu" else torch.nn.functional.gelu
    ref = f(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    lowp = f(x @ wg.T) * (x @ wu.T)
    _passes(out, ref, lowp)


@pytest.mark.parametrize("sched", [GemmSchedule(128, 256, stages=4), GemmSchedule(128, 128, stages=6, cluster_m=2)],
                         ids=str)
def test_tma_store_writes_nothing_past_the_output(sched):
    """The TMA store clips the tail tiles: the output is a view at the front of a larger
    poisoned buffer, and the elements after it keep their poison."""
    m, n, k = 333, 200, 136      # tails in M and N; 400-byte rows (TMA's 16-byte rule holds)
    a, b, bt = _operands(m, n, k, "K")
    g = compile_gemm(GemmProblem(m, n, k, "bf16"), sched)
    assert g.source.c_box is not None
    big = torch.full((m * n + 4096,), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[: m * n].view(m, n)
    g(a, b, out=out)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float(), a @ bt)
    assert torch.isnan(big[m * n:]).all(), "the TMA store wrote past the end of the output"


def test_misaligned_tma_output_is_a_clear_error():
    g = compile_gemm(GemmProblem(64, 64, 64, "bf16"), GemmSchedule(64, 64, stages=4, consumers=1))
    assert g.source.c_box is not None
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    spare = torch.empty(64 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        g(a, a, out=spare[1:].view(64, 64))


@pytest.mark.parametrize("shape", [(8192, 8192, 1024), (512, 4096, 4096), (128, 4096, 4096)])
def test_default_schedules_at_benchmark_shapes(shape):
    """What bench/gemm.py times: each default schedule (clusters, TMA stores) is right at
    full size, checked on sampled rows of the output against float32."""
    m, n, k = shape
    a, b, bt = _operands(m, n, k, "K")
    g = compile_gemm(GemmProblem(m, n, k, "bf16"))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an element was not written"
    rows = torch.randperm(m, device="cuda")[:256]
    _passes(out[rows], a[rows].float() @ bt.float(), a[rows] @ bt)


SMALL_M_CASES = [(1, 22016, 4096, "glu"), (1, 4096, 4096, "residual"), (16, 12288, 1024, "rope"),
                 (1, 32000, 1024, "plain"), (3, 1024, 2816, "bias_gelu"), (64, 8192, 2048, "plain")]


@pytest.mark.parametrize("m, n, k, kind", SMALL_M_CASES, ids=lambda x: str(x))
def test_default_small_m_schedules_with_epilogues(m, n, k, kind):
    """Decode's projections (M <= 64) on the default's short-M picks (64x64 14-deep, 64x128
    9-deep, 64x256, 64x64 with 2 K slices): right within the 2x rule with each epilogue a decoder puts there,
    outputs poisoned first, the same bits on a second launch."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ops, width = {}, n
    if kind == "glu":
        ep, width = epi.glu(m, n, "bf16"), n // 2
    elif kind == "residual":
        ep, ops["residual"] = epi.standard(m, n, "bf16", residual=True), torch.randn(m, n, device="cuda").bfloat16()
    elif kind == "rope":
        ang = torch.rand(m, n // 2, device="cuda") * 6.28
        ep, ops["cos"], ops["sin"] = epi.rope(m, n, "bf16"), ang.cos(), ang.sin()
    elif kind == "bias_gelu":
        ep = epi.standard(m, n, "bf16", bias="col", activation="gelu")
        ops["bias"] = torch.randn(n, device="cuda").bfloat16()
    else:
        ep = None
    problem = GemmProblem(m, n, k, "bf16", epilogue=ep)
    sched = default_schedule(problem)
    assert (sched.bm, sched.consumers, sched.tma_store) == (64, 1, False)
    g = compile_gemm(problem, sched)

    def epilogue(y, lowp):
        if kind == "glu":
            return torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
        if kind == "residual":
            return y + (ops["residual"] if lowp else ops["residual"].float())
        if kind == "rope":
            y = y.float()
            y0, y1, c, s_ = y[:, 0::2], y[:, 1::2], ops["cos"], ops["sin"]
            r = torch.stack([y0 * c - y1 * s_, y0 * s_ + y1 * c], -1).reshape(m, n)
            return r.bfloat16() if lowp else r
        if kind == "bias_gelu":
            return torch.nn.functional.gelu(y + (ops["bias"] if lowp else ops["bias"].float()))
        return y

    ref, lowp = epilogue(x.float() @ w.float().T, False), epilogue(x @ w.T, True)
    first = None
    for _ in range(2):
        out = torch.full((m, width), float("nan"), device="cuda", dtype=torch.bfloat16)
        g(x, w, out=out, **ops)
        torch.cuda.synchronize()
        _passes(out, ref, lowp)
        assert first is None or torch.equal(out, first), "two launches gave different bits"
        first = out


ROPE_SCHEDULES = {"default": None, "tma-store": GemmSchedule(128, 256, stages=4, tma_store=True),
                  "direct-store": GemmSchedule(128, 128, stages=6, tma_store=False),
                  "cluster": GemmSchedule(128, 256, stages=4, cluster_m=2, tma_store=True)}


@pytest.mark.parametrize("sched", ROPE_SCHEDULES)
@pytest.mark.parametrize("shape", [(300, 256, 136), (2048, 1024, 512)], ids=lambda s: "x".join(map(str, s)))
def test_rope_epilogue_rotates_adjacent_pairs(shape, sched):
    """x @ Wq.T with each adjacent column pair rotated by its row's angles, in the epilogue: equals
    the product rotated afterwards (float32 reference), outputs poisoned first; with the pair's
    two values through the TMA-store slots and in one 4-byte direct store."""
    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(m, n // 2, device="cuda") * 6.28
    cos, sin = ang.cos(), ang.sin()
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=epi.rope(m, n, "bf16")), ROPE_SCHEDULES[sched])
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(x, w, out=out, cos=cos, sin=sin)
    torch.cuda.synchronize()

    def rotate(y):
        y0, y1 = y[:, 0::2], y[:, 1::2]
        return torch.stack([y0 * cos - y1 * sin, y0 * sin + y1 * cos], -1).reshape(m, n)

    _passes(out, rotate(x.float() @ w.float().T), rotate((x @ w.T).float()).bfloat16())


TABLE_ROPE_CASES = [((1024, 1024, 256), (512, 64), GemmSchedule(128, 256, stages=4)),
                    ((1024, 1024, 256), (512, 64), GemmSchedule(128, 256, stages=4, cluster_m=2)),
                    ((768, 512, 192), (384, 32), GemmSchedule(128, 128, stages=6)),
                    ((512, 1024, 128), (256, 128), GemmSchedule(128, 256, stages=4, defer_stores=False)),
                    ((1024, 512, 256), (256, 64), GemmSchedule(128, 128, stages=4, pingpong=True)),
                    ((1000, 1024, 256), (500, 64), GemmSchedule(128, 256, stages=4))]  # tail tiles: unpacked


@pytest.mark.parametrize("shape, table, sched", TABLE_ROPE_CASES, ids=lambda x: str(x) if isinstance(x, tuple) else "")
def test_rope_from_position_tables_reads_them_packed(shape, table, sched):
    """RoPE with Llama's [S, W] tables read at (m mod S, pair mod W), the kernel reading them as
    16-byte words of a column-permuted copy (gemm_sm90.packed_tables) where it applies: within
    the 2x rule of float32, outputs poisoned first; and the same bits whether the kernel packs
    the tables itself or is given them packed (as a compiled program passes its constants)."""
    from tilefuse.codegen.gemm_sm90 import pack_table

    (m, n, k), (s, w) = shape, table
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(s, w, device="cuda") * 6.28
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=epi.rope(m, n, "bf16", table_dtype="bf16", table=table)),
                     sched)
    assert bool(g.source.packed_tables) == (m % 128 == 0), g.source.packed_tables
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(x, wq, out=out, cos=cos, sin=sin)
    rows = torch.arange(m, device="cuda") % s
    c, sn = cos.float()[rows].repeat(1, n // 2 // w), sin.float()[rows].repeat(1, n // 2 // w)

    def rotate(y):
        y0, y1 = y[:, 0::2], y[:, 1::2]
        return torch.stack([y0 * c - y1 * sn, y0 * sn + y1 * c], -1).reshape(m, n)

    _passes(out, rotate(x.float() @ wq.float().T), rotate((x @ wq.T).float()).bfloat16())
    if g.source.packed_tables:
        again = torch.full_like(out, float("nan"))
        g(x, wq, out=again, cos=pack_table(cos, w), sin=pack_table(sin, w), prepacked={"cos", "sin"})
        torch.cuda.synchronize()
        assert torch.equal(again, out)


TMA_RESIDUAL_CASES = [((257, 384, 192, 1), GemmSchedule(128, 256, stages=3, tma_loads=True)),
                      ((300, 200, 136, 3), GemmSchedule(128, 128, stages=6, tma_loads=True)),
                      ((333, 448, 256, 1), GemmSchedule(128, 128, stages=4, pingpong=True, tma_loads=True)),
                      ((4095, 4160, 1000, 1), GemmSchedule(128, 256, stages=3, cluster_m=2, tma_loads=True)),
                      ((520, 640, 64, 1), GemmSchedule(256, 128, stages=3, tma_loads=True))]


@pytest.mark.parametrize("shape, sched", TMA_RESIDUAL_CASES, ids=lambda x: str(x) if isinstance(x, tuple) else "")
def test_residual_by_tma_gives_the_bits_of_register_loads(shape, sched):
    """The residual loaded by TMA into the store slots (tails in M and N, batches, ping-pong,
    two 64-row blocks per warpgroup, a 1-step K, a cluster, several tiles per CTA so the slots
    are refilled): within the 2x rule of float32, and bit for bit what the kernel reading it
    into registers gives (the same sums in the same order), two launches on poisoned outputs."""
    m, n, k, batch = shape
    lead = (batch,) if batch > 1 else ()
    a, b, bt = _operands(m, n, k, "K", batch)
    res = torch.randn(*lead, m, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    p = GemmProblem(m, n, k, "bf16", batch=batch,
                    epilogue=epi.standard(m, n, "bf16", batch=batch, bias="col", activation="gelu", residual=True))
    by_tma = compile_gemm(p, sched)
    assert by_tma.source.tma_loads == ("residual",)
    in_regs = compile_gemm(p, replace(sched, tma_loads=False))
    want = in_regs(a, b, residual=res, bias=bias)
    for fill in (float("nan"), 0.0):
        out = torch.full(lead + (m, n), fill, device="cuda", dtype=torch.bfloat16)
        by_tma(a, b, out=out, residual=res, bias=bias)
        torch.cuda.synchronize()
        assert torch.equal(out, want), "the residual by TMA gave other bits than read into registers"
    f = torch.nn.functional.gelu
    _passes(out, f(a.float() @ bt.float() + bias.float()) + res.float(), f(a @ bt + bias) + res)


def test_residual_by_tma_needs_16_byte_alignment():
    """TMA reads the residual: a view starting 4 bytes past a 16-byte boundary is refused with
    the reason, and the same values in aligned memory give the right sum."""
    m, n, k = 256, 256, 128
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=epi.standard(m, n, "bf16", residual=True)),
                     GemmSchedule(128, 256, stages=3, tma_loads=True))
    assert g.source.tma_loads == ("residual",)
    _misaligned_residual_refused(g, m, n, k, 2, "16-byte aligned")


def test_default_residual_schedule_at_the_llama_o_projection():
    """8192x2048x2048 + residual: the default takes the residual by TMA there; right at full size."""
    m, n, k = 8192, 2048, 2048
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=epi.standard(m, n, "bf16", residual=True)))
    assert g.source.tma_loads == ("residual",)
    a, b, bt = _operands(m, n, k, "K")
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out, residual=res)
    torch.cuda.synchronize()
    _passes(out, a.float() @ bt.float() + res.float(), a @ bt + res)


DEFER_CASES = [((4095, 4160, 1000, 1), GemmSchedule(128, 256, stages=4, cluster_m=2)),
               ((300, 200, 136, 3), GemmSchedule(128, 128, stages=6)),
               ((520, 640, 64, 1), GemmSchedule(256, 128, stages=4)),
               ((1000, 2048, 200, 1), GemmSchedule(64, 64, stages=8, consumers=1)),
               ((2048, 4096, 512, 1), GemmSchedule(128, 256, stages=4))]


@pytest.mark.parametrize("shape, sched", DEFER_CASES, ids=lambda x: str(x) if isinstance(x, tuple) else "")
def test_deferred_stores_give_the_bits_of_stores_in_place(shape, sched):
    """Stores deferred to the next tile's main loop (defer_stores; several tiles per CTA, tails
    in M and N, a batch of 3, a 1-step K that leaves most slots to after the loop, one consumer,
    a cluster): bit for bit what storing each tile in its own epilogue gives, within the 2x
    rule of float32, on outputs poisoned with NaN and with zeros."""
    m, n, k, batch = shape
    lead = (batch,) if batch > 1 else ()
    a, b, bt = _operands(m, n, k, "K", batch)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    p = GemmProblem(m, n, k, "bf16", batch=batch,
                    epilogue=epi.standard(m, n, "bf16", batch=batch, bias="col", activation="gelu"))
    deferred = compile_gemm(p, replace(sched, defer_stores=True))
    assert deferred.source.schedule.defer_stores and "pending" in deferred.source.source.split('extern "C"')[1]
    in_place = compile_gemm(p, replace(sched, defer_stores=False))
    want = in_place(a, b, bias=bias)
    for fill in (float("nan"), 0.0):
        out = torch.full(lead + (m, n), fill, device="cuda", dtype=torch.bfloat16)
        deferred(a, b, out=out, bias=bias)
        torch.cuda.synchronize()
        assert torch.equal(out, want), "deferred stores gave other bits than stores in place"
    f = torch.nn.functional.gelu
    _passes(out, f(a.float() @ bt.float() + bias.float()), f(a @ bt + bias))

"""The prelude's tf_expm1_fast, tf_tanh_fast and tf_log1p_fast (kernels whose every output is
bf16 or f16: mapreduce.fast_math): each within 2^-17 of the exact value relatively, checked by
evaluating as the kernel does (f32 products and fused multiply-adds; ex2, rcp and lg2 exact
and then moved by the PTX ISA's error bound, both ways), so their results round to 16 bits as
the accurate library's do but in rare ties."""
import numpy as np
import pytest

from tilefuse.codegen import cexpr

F = np.float32
BOUND = 2.0 ** -17  # a 256th of bf16's rounding step (2^-9), a 16th of f16's (2^-12, half of 2^-11)


def _ulp(x):
    return np.spacing(np.abs(np.asarray(x, np.float64)).astype(np.float32)).astype(np.float64)


def _fma(a, b, c):
    """f32 fused multiply-add: the exact product plus c, rounded once (f64 holds the product of
    two f32 exactly)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.float64(c)).astype(F)


def _mul(a, b):
    return (np.asarray(a, F) * np.asarray(b, F)).astype(F)


def _exp_fast(x, side):
    """tf_exp_fast: ex2.approx.ftz of x log2 e (the product rounded to f32), within 2 ulp."""
    t = _mul(x, F(1.44269504)).astype(np.float64)
    with np.errstate(over="ignore"):
        r = np.exp2(t).astype(F).astype(np.float64)  # (inf beyond f32's range, as the kernel's)
    return np.where(np.isfinite(r), r + side * 2 * _ulp(np.where(np.isfinite(r), r, 0)), r).astype(F)


def _expm1_fast(x, side):
    p = _mul(x, _fma(x, _fma(x, _fma(x, F(0.0416666679), F(0.166666672)), F(0.5)), F(1.0)))
    e = (_exp_fast(x, side) - F(1)).astype(F)
    return np.where(np.abs(x) < F(0.0625), p, e)


def _tanh_fast(x, side, rcp_side):
    x2 = _mul(x, x)
    p = _mul(x, _fma(x2, _fma(x2, F(0.13333334), F(-0.333333343)), F(1.0)))
    d = (_exp_fast(_mul(F(2), x), side) + F(1)).astype(F).astype(np.float64)
    with np.errstate(divide="ignore"):
        r = 1 / d
    r = (r + rcp_side * _ulp(r)).astype(F)  # rcp.approx: within 1 ulp
    q = (F(1) - _mul(F(2), r)).astype(F)
    return np.where(np.abs(x) < F(0.0625), p, q)


def _log1p_fast(x, side):
    p = _mul(x, _fma(x, _fma(x, _fma(x, _fma(x, F(0.2), F(-0.25)), F(0.333333343)), F(-0.5)), F(1.0)))
    a = (F(1) + x).astype(F).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.log2(a)
    # lg2.approx: 2^-22 absolutely for arguments in [1/2, 2], 2 ulp elsewhere
    fin = np.isfinite(lg)
    err = np.where((a >= 0.5) & (a <= 2), 2.0 ** -22, 2 * _ulp(np.where(fin, lg, 0)))
    err = np.where(fin, err, 0)
    q = _mul((lg + side * err).astype(F), F(0.693147182))
    return np.where(np.abs(x) < F(0.0625), p, q)


def _points(lo, hi):
    """A dense grid over [lo, hi] and geometric runs toward 0 from both sides (where the
    polynomial and the special-function branch meet, and where cancellation would show)."""
    tiny = np.geomspace(1e-8, 1.0, 100_001)
    x = np.concatenate([np.linspace(lo, hi, 1_000_001), tiny, -tiny[tiny < -lo]])
    return x.astype(F)


def _rel(got, want):
    keep = want != 0
    return np.abs(got[keep] / want[keep] - 1)


@pytest.mark.parametrize("side", [-1, 1])
def test_fast_expm1_is_within_its_bound(side):
    x = _points(-30, 30)
    assert _rel(_expm1_fast(x, side), np.expm1(x.astype(np.float64))).max() < BOUND


@pytest.mark.parametrize("side", [-1, 1])
@pytest.mark.parametrize("rcp_side", [-1, 1])
def test_fast_tanh_is_within_its_bound(side, rcp_side):
    x = _points(-30, 30)
    assert _rel(_tanh_fast(x, side, rcp_side), np.tanh(x.astype(np.float64))).max() < BOUND


@pytest.mark.parametrize("side", [-1, 1])
def test_fast_log1p_is_within_its_bound(side):
    x = _points(-0.999, 1e4)
    assert _rel(_log1p_fast(x, side), np.log1p(x.astype(np.float64))).max() < BOUND


def test_fast_functions_keep_the_edges():
    """Infinities, -1 and the saturations come out as the library's do (the kernel's ex2 of
    -inf is 0, of +inf is inf; rcp of inf is 0; lg2 of 0 is -inf)."""
    edges = np.array([-np.inf, np.inf, -100.0, 100.0], F)
    np.testing.assert_array_equal(_expm1_fast(edges[:2], 1), [-1.0, np.inf])
    np.testing.assert_array_equal(_tanh_fast(edges, 1, 0), [-1.0, 1.0, -1.0, 1.0])
    import ml_dtypes  # (an rcp 1 ulp off at 1 gives -1 - 2^-22: still -1 in 16 bits)
    for rcp_side in (-1, 1):
        np.testing.assert_array_equal(_tanh_fast(edges, 1, rcp_side).astype(ml_dtypes.bfloat16).astype(F),
                                      [-1.0, 1.0, -1.0, 1.0])
    assert _log1p_fast(np.array([-1.0], F), 1)[0] == -np.inf


def test_fast_elu_rounds_to_bf16_as_the_accurate_one_nearly_always():
    """alpha expm1(x) rounded to bf16 with the fast expm1 equals the accurate result rounded,
    but within the error of a rounding tie: at most 1 in 1000 of 200k normal inputs."""
    import ml_dtypes

    x = np.random.default_rng(0).standard_normal(200_000).astype(F) * 3
    for fast, exact in ((_expm1_fast(x, 1), np.expm1(x.astype(np.float64))),
                        (_tanh_fast(x, 1, 1), np.tanh(x.astype(np.float64))),
                        (_log1p_fast(np.abs(x), 1), np.log1p(np.abs(x).astype(np.float64)))):
        assert np.mean(fast.astype(ml_dtypes.bfloat16) != exact.astype(F).astype(ml_dtypes.bfloat16)) < 1e-3


def test_spellings_are_fast_only_for_f32_math_when_asked():
    for name in ("expm1", "tanh", "log1p"):
        assert cexpr.op(name, ["x"], ["f32"], "bf16", fast=True) == f"tf_round_bf16(tf_{name}_fast(x))"
        assert f"tf_{name}_fast" not in cexpr.op(name, ["x"], ["f32"], "f32")
        assert f"tf_{name}_fast" not in cexpr.op(name, ["x"], ["f64"], "f64", fast=True)
        assert f"__device__ __forceinline__ float tf_{name}_fast(float x)" in cexpr.PRELUDE
        assert name in cexpr.FAST_OPS


def test_elu_after_a_gemm_takes_the_fast_expm1_only_for_a_16_bit_output():
    """F.elu(x @ W.T) in bf16: one GEMM whose sm_90a epilogue calls tf_expm1_fast; with the
    result widened to f32 (an f32 output) the accurate expm1f."""
    import torch
    import torch.nn.functional as Fn

    import tilefuse
    from tilefuse.codegen import gemm_sm90

    for out, want, not_want in ((lambda y: y, "tf_expm1_fast(", "expm1f("),
                                (lambda y: y.float(), "expm1f(", "tf_expm1_fast(")):
        x, w = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(256, 128, dtype=torch.bfloat16)
        (lg,) = tilefuse.compile(lambda x, w: out(Fn.elu(x @ w.T)), (x, w)).gemms.values()
        problem = lg.problem()
        src = gemm_sm90.render(problem, gemm_sm90.default_schedule(problem)).source
        body = src[src.index('extern "C"'):]
        assert want in body and not_want not in body

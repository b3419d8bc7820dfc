"""The fast tanh spelling (cexpr's tf_tanh_fast), used where the result is rounded to bf16 or
f16: its error bound, checked by evaluating it the way the kernel does (f32 arithmetic, with
ex2.approx and rcp.approx pushed to the ends of their stated error: 2 ulp and 1 ulp)."""
import numpy as np

from tilefuse.codegen import cexpr

F32 = np.float32
ULP = 2.0 ** -23


def _fast(x, ex2_err=0.0, rcp_err=0.0):
    """tf_tanh_fast in NumPy: f32 operations in the kernel's order; fmaf as an exact product
    and one rounding (f64 then f32); ex2 and rcp exact, then scaled by (1 + err)."""
    x = np.asarray(x, F32)
    a = np.abs(x)
    with np.errstate(over="ignore", invalid="ignore"):  # the polynomial branch is not taken there
        x2 = (x * x).astype(F32)
    c5 = (x2.astype(np.float64) * F32(-0.053968254) + F32(0.133333333)).astype(F32)
    inner = (x2.astype(np.float64) * c5 + F32(-0.333333333)).astype(F32)
    outer = (x2.astype(np.float64) * inner + 1.0).astype(F32)
    p = (x * outer).astype(F32)
    with np.errstate(over="ignore"):
        e = (np.exp2((a * F32(2.88539008)).astype(F32).astype(np.float64)) * (1 + ex2_err)).astype(F32)
    d = (e + F32(1.0)).astype(F32)
    r = ((1.0 / d.astype(np.float64)) * (1 + rcp_err)).astype(F32)
    t = (F32(1.0) - (F32(2.0) * r).astype(F32)).astype(F32)
    return np.where(a < F32(0.25), p, np.copysign(t, x))


def test_fast_tanh_is_within_its_stated_bound():
    """Relative error under 1.5e-6 at every f32 magnitude from 1e-30 to 50, ex2 and rcp at
    either end of their error: a bf16 result rounds in steps of 2^-9 (2e-3), an f16 one in
    2^-12 (2.4e-4), so the rounding hides it but for values within that of a tie."""
    x = np.concatenate([np.geomspace(1e-30, 50, 400_001), np.linspace(0.2, 0.3, 100_001)]).astype(F32)
    want = np.tanh(x.astype(np.float64))
    for ex2_err in (-2 * ULP, 0.0, 2 * ULP):
        for rcp_err in (-ULP, 0.0, ULP):
            got = _fast(x, ex2_err, rcp_err).astype(np.float64)
            rel = np.abs(got / want - 1)
            assert rel.max() < 1.5e-6, (ex2_err, rcp_err, rel.max(), x[rel.argmax()])
            got_neg = _fast(-x, ex2_err, rcp_err)
            assert np.array_equal(got_neg, -_fast(x, ex2_err, rcp_err))  # odd


def test_fast_tanh_saturates_and_propagates_nan():
    big = np.array([44.5, 89.0, 1e30, np.inf], F32)
    assert np.all(_fast(big) == 1.0) and np.all(_fast(-big) == -1.0)
    assert np.isnan(_fast(np.array([np.nan], F32))).all()


def test_gelu_tanh_from_fast_tanh_rounds_to_bf16_as_the_accurate_one_nearly_always():
    """GPT-2's GELU, 0.5 x (1 + tanh(u)), with tanh rounded to bf16 as its bf16 graph does:
    the fast tanh's bf16 value equals the accurate one but for ties (under 1 in 1000)."""
    import ml_dtypes

    x = np.random.default_rng(0).standard_normal(200_000).astype(F32) * 3
    u = (np.float32(0.7978845608) * (x + np.float32(0.044715) * x * x * x)).astype(F32)
    fast = _fast(u).astype(ml_dtypes.bfloat16)
    exact = np.tanh(u.astype(np.float64)).astype(F32).astype(ml_dtypes.bfloat16)
    assert np.mean(fast != exact) < 1e-3


def test_spellings():
    """Fast only when asked (a 16-bit result or a 16-bit-output kernel), and only for floats."""
    assert cexpr.op("tanh", ["x"], ["f32"], "bf16", fast=True) == "tf_round_bf16(tf_tanh_fast(x))"
    assert cexpr.op("tanh", ["x"], ["f32"], "f32") == "tanhf(x)"
    assert "tf_tanh_fast" not in cexpr.op("tanh", ["x"], ["f64"], "f64", fast=True)
    assert "__device__ __forceinline__ float tf_tanh_fast(float x)" in cexpr.PRELUDE

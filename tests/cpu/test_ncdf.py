"""The `ncdf` op (Phi, the standard normal CDF; GELU is x Phi(x)): its NumPy meaning, its
accurate and fast C++ spellings, and the fast one's error bound, checked by evaluating the
prelude's polynomial the way the kernel does (f32 fused multiply-adds, then ex2)."""
import math

import numpy as np
import torch

from tilefuse import ops
from tilefuse.codegen import cexpr, epilogue as epi


def _phi(x):
    return np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in np.asarray(x, np.float64).ravel()])


def _fast(x):
    """tf_ncdf_fast in NumPy: f32 min and subtract, f32 FMAs (exact product, one rounding of
    the sum in f64 then to f32), ex2 exactly (the kernel's ex2.approx adds at most 2 ulp)."""
    x = np.asarray(x, np.float32)
    u = (np.minimum(np.abs(x), np.float32(cexpr.NCDF_FAST_RANGE)) - np.float32(cexpr.NCDF_FAST_RANGE / 2)
         ).astype(np.float32)
    c = [np.float32(v) for v in cexpr.NCDF_FAST_COEFFS]
    p = np.full_like(u, c[-1])
    for a in c[-2::-1]:
        p = (p.astype(np.float64) * u + np.float64(a)).astype(np.float32)
    e = np.exp2(p.astype(np.float64))
    return np.where(x < 0, e, 1.0 - e), e


def test_ncdf_means_the_normal_cdf_as_torch_computes_it():
    x = np.linspace(-10, 10, 2001)
    want = 0.5 * (1 + torch.erf(torch.tensor(x) / math.sqrt(2))).numpy()
    np.testing.assert_allclose(ops.OPS["ncdf"].numpy(x), want, rtol=1e-12, atol=1e-15)
    assert ops.OPS["ncdf"].numpy(np.float32(0.3)).dtype == np.float32


def test_fast_ncdf_is_within_its_stated_bound():
    """Relative error of Phi(-|x|) under 2e-5 (2 ulp of ex2 included) wherever it is a normal
    float, so Phi itself within 1e-5 absolutely; below that (x < -13.1) the kernel's ex2
    flushes to 0. A bf16 result rounds in steps of 2^-9 (2e-3) relatively, an f16 one in
    2^-12 (2.4e-4)."""
    t = np.linspace(0, 13.2, 400001).astype(np.float32)
    _, e = _fast(-t)
    want = _phi(-t.astype(np.float64))
    normal = want >= 2.0 ** -126
    rel = np.abs(e[normal] / want[normal] - 1) + 2 * 2.0 ** -23
    assert rel.max() < 2e-5, rel.max()
    x = np.linspace(-14, 14, 100001).astype(np.float32)
    assert np.abs(_fast(x)[0] - _phi(x)).max() < 1e-5
    assert np.all(_fast(np.array([13.5, 1e30], np.float32))[0] == 1.0)


def test_gelu_from_fast_ncdf_rounds_to_bf16_as_the_accurate_one_nearly_always():
    """x Phi(x) rounded to bf16 with the fast Phi equals the accurate result rounded, but for
    values within the error of a rounding tie: at most 1 in 1000 of 200k normal inputs
    (x 3, so the lower tail is in)."""
    import ml_dtypes

    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32) * 3
    fast = (x * _fast(x)[0].astype(np.float32)).astype(ml_dtypes.bfloat16)
    exact = (x.astype(np.float64) * _phi(x)).astype(np.float32).astype(ml_dtypes.bfloat16)
    assert np.mean(fast != exact) < 1e-3


def test_spellings():
    """Accurate: 0.5 erfc(-x / sqrt 2) (no 1 + erf cancelling in the lower tail), in f32 or
    f64; fast, for f32 math in a 16-bit-output kernel: the prelude's tf_ncdf_fast."""
    assert cexpr.op("ncdf", ["x"], ["f32"], "f32") == "(0.5f * erfcf(-0.70710678f * x))"
    assert cexpr.op("ncdf", ["x"], ["f64"], "f64") == "(0.5 * erfc(-0.7071067811865476 * x))"
    assert cexpr.op("ncdf", ["x"], ["f32"], "bf16", fast=True) == "tf_round_bf16(tf_ncdf_fast(x))"
    assert "tf_ncdf_fast" not in cexpr.op("ncdf", ["x"], ["f64"], "f64", fast=True)
    assert "__device__ __forceinline__ float tf_ncdf_fast(float x)" in cexpr.PRELUDE


def test_gelu_epilogue_is_x_times_ncdf_and_fast_only_for_16_bit_outputs():
    """The GEMM's GELU epilogue is x ncdf(x); with a bf16 output every element takes the fast
    spelling, with an f32 output the accurate erfc."""
    from tilefuse.codegen import gemm_sm90 as g

    k = epi.standard(256, 256, "bf16", bias="col", activation="gelu")
    assert "ncdf" in str(k) and "erf(" not in str(k)
    src = g.render(g.GemmProblem(256, 256, 128, epilogue=k), g.GemmSchedule(128, 128, stages=4)).source
    body = src[src.index("extern \"C\""):]
    assert "tf_ncdf_fast(" in body and "erfcf(" not in body
    k32 = epi.standard(256, 256, "f32", bias="col", activation="gelu")
    src32 = g.render(g.GemmProblem(256, 256, 128, epilogue=k32), g.GemmSchedule(128, 128, stages=4)).source
    body32 = src32[src32.index("extern \"C\""):]
    assert "erfcf(" in body32 and "tf_ncdf_fast(" not in body32

"""C++ spellings of scalar ops, constants, dtype conversions and index expressions.

Values live in registers in their *compute type* (`dtypes.compute_type`): bf16 and f16
values are floats that hold an exactly representable bf16/f16 number, so an op whose
result dtype is bf16 computes in f32 and rounds (round-to-nearest-even), exactly what the
NumPy interpreter does with ml_dtypes. Memory holds the storage type (16-bit patterns).

The generated source includes no header: the PRELUDE below spells the few conversions it
needs in inline PTX (sm_80+), so NVRTC compiles it on a machine with no CUDA toolkit (the
`nvidia-cuda-nvrtc` wheel ships no cuda_bf16.h) and a cold compile stays fast.

Math: IEEE-accurate library calls (`expf`, `logf`, `erff`, `tanhf`, ...) rather than the
`__expf` family, whose error grows with |x|; `rsqrtf` (2 ulp) for rsqrt. Two exceptions use
the special-function unit (one instruction instead of about ten): sums of exp(y - max)
(y <= max bounds the error), and, with `op(..., fast=True)`, exp, division and sigmoid in a kernel
whose every float result is rounded to bf16/f16 (mapreduce.fast_math says why that is
safe). max/min on floats propagate NaN like NumPy (PTX `max.NaN`), so a NaN input can never
vanish in a reduction.
"""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes, ops
from ..loop import ir

# ---------------------------------------------------------------- the prelude

# Phi(-t) = exp2(P(t - 6.6)) for 0 <= t <= 13.2: P's coefficients, lowest degree first, a
# Chebyshev least-squares fit of log2 Phi(-t) at degree 12, rounded to f32 (tests/cpu/test_ncdf.py
# checks the bound the prelude states, evaluating as the kernel does).
NCDF_FAST_COEFFS = (-35.5015182, -9.73133564, -0.706711471, -0.00131022034, 0.000126948813, -1.32834148e-05,
                    1.40535974e-06, -9.36264613e-08, 5.23482635e-09, -2.26306085e-09, 3.17959187e-10,
                    2.61220863e-12, -1.73661953e-12)
NCDF_FAST_RANGE = 13.2  # Phi(-13.2) = 4.7e-40: ex2.approx.ftz gives 0 from about 13.1 on


def _ncdf_fast_source() -> str:
    horner = "\n".join(f"  p = fmaf(p, u, {c!r}f);" for c in reversed(NCDF_FAST_COEFFS[:-1]))
    return f"""// Phi(x), the standard normal CDF, for results rounded to 16 bits: log2 Phi(-t) for
// t = min(|x|, 13.2) as a degree-12 polynomial in t - 6.6 (cexpr.NCDF_FAST_COEFFS), then ex2,
// and Phi(x) = 1 - Phi(-x) for x >= 0. Within 2e-5 of Phi(-|x|) relatively wherever that is
// a normal float (so within 1e-5 of Phi absolutely); 0 where it is not (x < -13.1).
__device__ __forceinline__ float tf_ncdf_fast(float x) {{
  const float u = tf_min(fabsf(x), {NCDF_FAST_RANGE!r}f) - {NCDF_FAST_RANGE / 2!r}f;  // NaN stays NaN
  float p = {NCDF_FAST_COEFFS[-1]!r}f;
{horner}
  const float e = tf_ex2_ftz(p);
  return x < 0.0f ? e : 1.0f - e;
}}
"""


PRELUDE = r"""// ---- tilefuse prelude: storage <-> compute conversions, NaN-propagating max/min
typedef unsigned short tf_bf16_t;  // bf16 bit pattern in memory
typedef unsigned short tf_f16_t;   // f16 bit pattern in memory

__device__ __forceinline__ float tf_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ unsigned short tf_f32_to_bf16(float x) {
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h;
}
__device__ __forceinline__ float tf_f16_to_f32(unsigned short h) {
  float x; asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h)); return x;
}
__device__ __forceinline__ unsigned short tf_f32_to_f16(float x) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h;
}
// Round a float to the nearest bf16 / f16 value, kept as a float.
__device__ __forceinline__ float tf_round_bf16(float x) { return tf_bf16_to_f32(tf_f32_to_bf16(x)); }
__device__ __forceinline__ float tf_round_f16(float x) { return tf_f16_to_f32(tf_f32_to_f16(x)); }

__device__ __forceinline__ float tf_max(float a, float b) { float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float tf_min(float a, float b) { float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ double tf_max(double a, double b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ double tf_min(double a, double b) { return (a != a || a < b) ? a : b; }
template <class T> __device__ __forceinline__ T tf_max(T a, T b) { return a > b ? a : b; }
template <class T> __device__ __forceinline__ T tf_min(T a, T b) { return a < b ? a : b; }
// Integer a // b and a % b as Python's and PyTorch's: the quotient rounded down, the
// remainder with b's sign (C's / truncates, its % takes a's sign)
template <class T> __device__ __forceinline__ T tf_floordiv(T a, T b) { T q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? T(q - 1) : q; }
template <class T> __device__ __forceinline__ T tf_mod(T a, T b) { T r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? T(r + b) : r; }
// Special-function-unit math, one instruction each (PTX ISA: ex2.approx within 2 ulp, rcp.approx
// within 1 ulp). tf_ex2_ftz flushes results under 2^-126 to 0. Used where the argument
// bounds the error (sums of exp(y - max), y <= max) or the result is rounded to 16 bits
// (mapreduce.fast_math); everywhere else the IEEE-accurate library calls are used.
__device__ __forceinline__ float tf_ex2_ftz(float x) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float tf_exp_fast(float x) { return tf_ex2_ftz(x * 1.44269504f); }
__device__ __forceinline__ float tf_rcp_fast(float x) { float r; asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float tf_div_fast(float a, float b) { return a * tf_rcp_fast(b); }
__device__ __forceinline__ float tf_lg2_approx(float x) { float r; asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
// expm1, tanh and log1p for results rounded to 16 bits, without the library's branches (an
// ELU after a GEMM spent 10% of the GEMM's time in expm1f): below |x| = 1/16 a Taylor
// polynomial (the first term left out is under 2^-19 of the result), above it ex2 / rcp /
// lg2, whose error near 1 (2^-22 absolute) is under 2^-17 of a result of at least 0.06.
// tests/cpu/test_fast_functions.py checks each bound evaluating as the kernel does.
__device__ __forceinline__ float tf_expm1_fast(float x) {
  const float p = x * fmaf(x, fmaf(x, fmaf(x, 0.0416666679f, 0.166666672f), 0.5f), 1.0f);
  return fabsf(x) < 0.0625f ? p : tf_exp_fast(x) - 1.0f;
}
__device__ __forceinline__ float tf_tanh_fast(float x) {
  const float p = x * fmaf(x * x, fmaf(x * x, 0.13333334f, -0.333333343f), 1.0f);
  return fabsf(x) < 0.0625f ? p : 1.0f - 2.0f * tf_rcp_fast(tf_exp_fast(2.0f * x) + 1.0f);
}
__device__ __forceinline__ float tf_log1p_fast(float x) {
  const float p = x * fmaf(x, fmaf(x, fmaf(x, fmaf(x, 0.2f, -0.25f), 0.333333343f), -0.5f), 1.0f);
  return fabsf(x) < 0.0625f ? p : tf_lg2_approx(1.0f + x) * 0.693147182f;
}
{ncdf_fast}// A partial sum of exp(x - m) rescaled to a larger max M (partial log-sum-exp states merge
// max first: M = max of the maxima, then the sum of the rescaled sums). Equal maxima (-inf
// included) need no exp; a NaN max propagates.
__device__ __forceinline__ float tf_lse_scale(float s, float m, float M) { return m == M ? s : s * tf_ex2_ftz((m - M) * 1.44269504f); }
__device__ __forceinline__ double tf_lse_scale(double s, double m, double M) { return m == M ? s : s * exp(m - M); }

// Element i of a chunk held as 32-bit words (a register array, i a compile-time constant
// once the loops are unrolled).
__device__ __forceinline__ float tf_get_bf16(const unsigned* w, int i) {
  unsigned x = w[i >> 1]; return __uint_as_float((i & 1) ? (x & 0xffff0000u) : (x << 16));
}
__device__ __forceinline__ float tf_get_f16(const unsigned* w, int i) {
  return tf_f16_to_f32((unsigned short)(w[i >> 1] >> ((i & 1) * 16)));
}
__device__ __forceinline__ float tf_get_f32(const unsigned* w, int i) { return __uint_as_float(w[i]); }
__device__ __forceinline__ double tf_get_f64(const unsigned* w, int i) {
  return __longlong_as_double((long long)(((unsigned long long)w[2 * i + 1] << 32) | w[2 * i]));
}
__device__ __forceinline__ int tf_get_i32(const unsigned* w, int i) { return (int)w[i]; }
__device__ __forceinline__ long long tf_get_i64(const unsigned* w, int i) {
  return (long long)(((unsigned long long)w[2 * i + 1] << 32) | w[2 * i]);
}
__device__ __forceinline__ signed char tf_get_i8(const unsigned* w, int i) { return (signed char)(w[i >> 2] >> ((i & 3) * 8)); }
__device__ __forceinline__ unsigned char tf_get_u8(const unsigned* w, int i) { return (unsigned char)(w[i >> 2] >> ((i & 3) * 8)); }
__device__ __forceinline__ bool tf_get_bool(const unsigned* w, int i) { return ((w[i >> 2] >> ((i & 3) * 8)) & 0xffu) != 0; }

// Set element i of a chunk of 32-bit words (the words start zeroed).
__device__ __forceinline__ void tf_put_bf16(unsigned* w, int i, float x) { w[i >> 1] |= ((unsigned)tf_f32_to_bf16(x)) << ((i & 1) * 16); }
__device__ __forceinline__ void tf_put_f16(unsigned* w, int i, float x) { w[i >> 1] |= ((unsigned)tf_f32_to_f16(x)) << ((i & 1) * 16); }
__device__ __forceinline__ void tf_put_f32(unsigned* w, int i, float x) { w[i] = __float_as_uint(x); }
__device__ __forceinline__ void tf_put_f64(unsigned* w, int i, double x) {
  unsigned long long b = (unsigned long long)__double_as_longlong(x); w[2 * i] = (unsigned)b; w[2 * i + 1] = (unsigned)(b >> 32);
}
__device__ __forceinline__ void tf_put_i32(unsigned* w, int i, int x) { w[i] = (unsigned)x; }
__device__ __forceinline__ void tf_put_i64(unsigned* w, int i, long long x) { w[2 * i] = (unsigned)x; w[2 * i + 1] = (unsigned)((unsigned long long)x >> 32); }
__device__ __forceinline__ void tf_put_i8(unsigned* w, int i, signed char x) { w[i >> 2] |= ((unsigned)(unsigned char)x) << ((i & 3) * 8); }
__device__ __forceinline__ void tf_put_u8(unsigned* w, int i, unsigned char x) { w[i >> 2] |= ((unsigned)x) << ((i & 3) * 8); }
__device__ __forceinline__ void tf_put_bool(unsigned* w, int i, bool x) { w[i >> 2] |= ((unsigned)x) << ((i & 3) * 8); }

// Global memory: read-only vector loads (L1 bypass for streamed rows), vector stores.
__device__ __forceinline__ void tf_ld16_stream(unsigned* w, const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}
// L2 eviction priorities (sm_80+) for a row's reads: evict_last while a later pass reads it
// again, evict_first on its last read, and the same priority in L1 (MapReduceSchedule.l2_hints;
// on an H100 these L1 priorities ran 0.2-1% faster than L1::no_allocate on the read-only path).
__device__ __forceinline__ unsigned long long tf_l2_evict_first() {
  unsigned long long p; asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p)); return p;
}
__device__ __forceinline__ unsigned long long tf_l2_evict_last() {
  unsigned long long p; asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p)); return p;
}
__device__ __forceinline__ void tf_ld16_last(unsigned* w, const void* p, unsigned long long pol) {
  asm volatile("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p), "l"(pol));
}
__device__ __forceinline__ void tf_ld16_first(unsigned* w, const void* p, unsigned long long pol) {
  asm volatile("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p), "l"(pol));
}
__device__ __forceinline__ void tf_ld16(unsigned* w, const void* p) {
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}
__device__ __forceinline__ void tf_ld8(unsigned* w, const void* p) {
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
}
__device__ __forceinline__ void tf_ld4(unsigned* w, const void* p) { w[0] = *(const unsigned*)p; }
__device__ __forceinline__ void tf_ld2(unsigned* w, const void* p) { w[0] = *(const unsigned short*)p; }
__device__ __forceinline__ void tf_ld1(unsigned* w, const void* p) { w[0] = *(const unsigned char*)p; }
__device__ __forceinline__ void tf_st16(void* p, const unsigned* w) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
}
__device__ __forceinline__ void tf_st8(void* p, const unsigned* w) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(w[0]), "r"(w[1]) : "memory");
}
// Shared-memory staging (sm_80+): async 16-byte copies global -> shared, then 16-byte reads.
__device__ __forceinline__ unsigned tf_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void tf_cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void tf_cp_async16_hint(unsigned dst, const void* src, unsigned long long pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "l"(pol) : "memory");
}
__device__ __forceinline__ void tf_cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void tf_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most n of this thread's cp.async groups are in flight (n: a constant once
// the caller's loop is unrolled, so the switch folds to one instruction; beyond 15: all).
__device__ __forceinline__ void tf_cp_async_wait_pending(int n) {
  switch (n) {
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    case 7: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    case 8: asm volatile("cp.async.wait_group 8;" ::: "memory"); break;
    case 9: asm volatile("cp.async.wait_group 9;" ::: "memory"); break;
    case 10: asm volatile("cp.async.wait_group 10;" ::: "memory"); break;
    case 11: asm volatile("cp.async.wait_group 11;" ::: "memory"); break;
    case 12: asm volatile("cp.async.wait_group 12;" ::: "memory"); break;
    case 13: asm volatile("cp.async.wait_group 13;" ::: "memory"); break;
    case 14: asm volatile("cp.async.wait_group 14;" ::: "memory"); break;
    case 15: asm volatile("cp.async.wait_group 15;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 0;" ::: "memory");
  }
}
__device__ __forceinline__ void tf_lds16(unsigned* w, unsigned src) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(src) : "memory");
}
__device__ __forceinline__ void tf_st4(void* p, const unsigned* w) { *(unsigned*)p = w[0]; }
__device__ __forceinline__ void tf_st2(void* p, const unsigned* w) { *(unsigned short*)p = (unsigned short)w[0]; }
__device__ __forceinline__ void tf_st1(void* p, const unsigned* w) { *(unsigned char*)p = (unsigned char)w[0]; }
// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with the
// programmatic-serialization attribute may start while the kernel before it still runs.
// tf_pdl_wait blocks until that kernel has finished and its writes are visible: every
// thread calls it before its first global read or write of anything another kernel makes
// or reads. tf_pdl_launch lets the next kernel start as soon as every CTA of this one has
// called it (or exited); it orders nothing, so it is called first thing.
__device__ __forceinline__ void tf_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void tf_pdl_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
""".replace("{ncdf_fast}", _ncdf_fast_source())

# The cluster prelude: distributed shared memory through PTX (sm_90).
CLUSTER_PRELUDE = r"""// ---- thread-block cluster: rank, barrier, reads of another CTA's shared memory
__device__ __forceinline__ unsigned tf_cluster_rank() { unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ void tf_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The two halves of tf_cluster_sync, apart: arrive when done with the other CTAs' shared
// memory, wait (for every CTA's arrival) only before exiting.
__device__ __forceinline__ void tf_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void tf_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ unsigned tf_remote_addr(const void* local, unsigned rank) {
  unsigned a = (unsigned)__cvta_generic_to_shared(local), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank)); return r;
}
__device__ __forceinline__ float tf_remote_ld(const float* p, unsigned rank) {
  float v; asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return v;
}
__device__ __forceinline__ double tf_remote_ld(const double* p, unsigned rank) {
  double v; asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return v;
}
__device__ __forceinline__ int tf_remote_ld(const int* p, unsigned rank) {
  int v; asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return v;
}
__device__ __forceinline__ long long tf_remote_ld(const long long* p, unsigned rank) {
  long long v; asm volatile("ld.shared::cluster.s64 %0, [%1];" : "=l"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return v;
}
__device__ __forceinline__ signed char tf_remote_ld(const signed char* p, unsigned rank) {
  int v; asm volatile("ld.shared::cluster.s8 %0, [%1];" : "=r"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return (signed char)v;
}
__device__ __forceinline__ unsigned char tf_remote_ld(const unsigned char* p, unsigned rank) {
  unsigned v; asm volatile("ld.shared::cluster.u8 %0, [%1];" : "=r"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return (unsigned char)v;
}
__device__ __forceinline__ bool tf_remote_ld(const bool* p, unsigned rank) {
  unsigned v; asm volatile("ld.shared::cluster.u8 %0, [%1];" : "=r"(v) : "r"(tf_remote_addr(p, rank)) : "memory"); return v != 0;
}
"""

# ---------------------------------------------------------------- types and constants


def ctype(dtype: str) -> str:
    """C++ type a value of `dtype` is computed in (bf16/f16 widen to float)."""
    return dtypes.to_cuda(dtypes.compute_type(dtype))


def storage_ctype(dtype: str) -> str:
    """C++ type of one element of a buffer of `dtype` in memory."""
    return {"bf16": "tf_bf16_t", "f16": "tf_f16_t"}.get(dtype) or dtypes.to_cuda(dtype)


def const(value, dtype: str) -> str:
    """A literal of `dtype`; floats are first rounded to `dtype`, printed so that they round-trip."""
    dtypes.check(dtype)
    if dtype == "bool":
        return "true" if value else "false"
    if dtype in dtypes.INTS:
        v = int(value)
        return f"{v}LL" if dtype == "i64" else (f"{v}" if dtype != "u8" else f"{v}u")
    if dtype == "f64":
        v = float(value)
        if math.isnan(v):
            return "__longlong_as_double(0x7ff8000000000000LL)"
        if math.isinf(v):
            return f"{'-' if v < 0 else ''}__longlong_as_double(0x7ff0000000000000LL)"
        return repr(v)
    v = np.float32(np.array(value).astype(dtypes.to_numpy(dtype)))
    if np.isnan(v):
        return "__int_as_float(0x7fffffff)"
    if np.isinf(v):
        return "__uint_as_float(0xff800000u)" if v < 0 else "__uint_as_float(0x7f800000u)"
    text = str(v)
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def identity(op: str, dtype: str) -> str:
    """Identity of reduction `op` in `dtype` (the value masked-off elements contribute)."""
    if op not in ops.REDUCTIONS:
        raise ValueError(f"unknown reduction {op!r}")
    if op in ("sum", "prod"):
        return const(0 if op == "sum" else 1, dtype)
    if dtypes.is_float(dtype):
        return const(-math.inf if op == "max" else math.inf, dtype)
    if dtype == "bool":
        return "false" if op == "max" else "true"
    info = np.iinfo(dtypes.to_numpy(dtype))
    return const(info.min if op == "max" else info.max, dtype)


def combine(op: str, a: str, b: str) -> str:
    """The binary step of reduction `op`."""
    if op == "sum":
        return f"{a} + {b}"
    if op == "prod":
        return f"{a} * {b}"
    if op in ("max", "min"):
        return f"tf_{op}({a}, {b})"
    raise ValueError(f"unknown reduction {op!r}")


# ---------------------------------------------------------------- conversions


def round_to(dtype: str, expr: str) -> str:
    """Round a compute-type expression to `dtype`'s precision (a no-op unless bf16/f16)."""
    if dtype == "bf16":
        return f"tf_round_bf16({expr})"
    if dtype == "f16":
        return f"tf_round_f16({expr})"
    return expr


def cast(expr: str, src: str, dst: str) -> str:
    """Convert a compute-type value of dtype `src` to dtype `dst` (NumPy's astype)."""
    if src == dst:
        return expr
    if dst == "bool":
        return f"(({expr}) != 0)"
    if dtypes.is_float(dst):
        widened = expr if ctype(src) == ctype(dst) else f"({ctype(dst)})({expr})"
        # Narrowing to bf16/f16 rounds; every other float destination holds the value (or
        # the C conversion rounds it, f64 -> f32 and int -> float).
        return round_to(dst, widened) if dst in ("bf16", "f16") else widened
    if dst == "u8" and dtypes.is_float(src):
        # PyTorch converts a float to uint8 through int64 (c10's cast: a negative value wraps,
        # -1.5 -> 255, where a direct conversion would saturate to 0 on the GPU)
        return f"(unsigned char)(long long)({expr})"
    # integer destination: floats truncate toward zero, like astype
    return f"({ctype(dst)})({expr})"


def to_storage(dtype: str, expr: str) -> str:
    """Compute-type expression -> the bits stored in memory."""
    if dtype == "bf16":
        return f"tf_f32_to_bf16({expr})"
    if dtype == "f16":
        return f"tf_f32_to_f16({expr})"
    return f"({dtypes.to_cuda(dtype)})({expr})"


def from_storage(dtype: str, expr: str) -> str:
    """A storage element (memory bits) -> compute-type expression."""
    if dtype == "bf16":
        return f"tf_bf16_to_f32({expr})"
    if dtype == "f16":
        return f"tf_f16_to_f32({expr})"
    return expr


# ---------------------------------------------------------------- scalar ops

_FLOAT_FN = {
    # op: (f32 spelling, f64 spelling)
    "exp": ("expf", "exp"), "exp2": ("exp2f", "exp2"), "log": ("logf", "log"),
    "log2": ("log2f", "log2"), "log1p": ("log1pf", "log1p"), "expm1": ("expm1f", "expm1"),
    "sqrt": ("sqrtf", "sqrt"), "rsqrt": ("rsqrtf", "rsqrt"), "tanh": ("tanhf", "tanh"),
    "sin": ("sinf", "sin"), "cos": ("cosf", "cos"), "erf": ("erff", "erf"),
    "floor": ("floorf", "floor"), "pow": ("powf", "pow"),
    "ceil": ("ceilf", "ceil"), "round": ("rintf", "rint"), "log10": ("log10f", "log10"),
    "tan": ("tanf", "tan"), "atan": ("atanf", "atan"), "asin": ("asinf", "asin"), "acos": ("acosf", "acos"),
    "sinh": ("sinhf", "sinh"), "cosh": ("coshf", "cosh"), "asinh": ("asinhf", "asinh"),
    "acosh": ("acoshf", "acosh"), "atanh": ("atanhf", "atanh"), "erfc": ("erfcf", "erfc"),
    "lgamma": ("lgammaf", "lgamma"), "atan2": ("atan2f", "atan2"), "hypot": ("hypotf", "hypot"),
    "fmod": ("fmodf", "fmod"), "copysign": ("copysignf", "copysign"),
}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_ARITH = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


_UNSIGNED = {"int": "unsigned", "long long": "unsigned long long"}
_WRAPPING = ("add", "sub", "mul", "neg", "abs")


def _wrapping(name: str, a: list[str], ct: str) -> str:
    """A 32- or 64-bit integer add, sub, mul, neg or abs that wraps as PyTorch's does, computed
    in the unsigned type: signed overflow is undefined in C++, and nvcc used that to fold
    abs(-(x * x)) into x * x (x * x >= 0 where nothing overflows), giving -5e8 where PyTorch's
    wrapped product, negated and abs'd, is 5e8 (GPU fuzzing, session 79). abs(INT_MIN) stays
    INT_MIN, as in PyTorch. (8- and 16-bit values are promoted to int first: no overflow.)"""
    u = _UNSIGNED[ct]
    if name == "neg":
        return f"(({ct})(({u})0 - ({u})({a[0]})))"
    if name == "abs":
        return f"({a[0]} < 0 ? {_wrapping('neg', a, ct)} : {a[0]})"
    return f"(({ct})(({u})({a[0]}) {_ARITH[name]} ({u})({a[1]})))"


FAST_OPS = ("exp", "div", "sigmoid", "ncdf", "expm1", "tanh", "log1p")  # the ops with a special-function spelling (op's fast)


def op(name: str, args: list[str], arg_dtypes: list[str], dtype: str, fast: bool = False) -> str:
    """C++ expression for `dtype = name(args)`; args are compute-type expressions.

    The result is rounded to `dtype` when it is bf16/f16 (compute in f32, then round).
    fast=True spells an f32 exp as tf_exp_fast (ex2.approx of x log2 e), an f32 division
    as tf_div_fast (a times rcp.approx of b: a row-constant divisor's reciprocal is then
    computed once per row, the asm being pure), and an f32 sigmoid as the rcp.approx of
    1 + ex2.approx: two special-function instructions, no branch (the IEEE division's slow
    path is a call site per element, which keeps ptxas from overlapping the elements);
    ncdf, expm1, tanh and log1p as the prelude's tf_*_fast (a short polynomial near 0, the
    special-function unit elsewhere: no library branches).
    """
    info = ops.info(name)
    if len(args) != info.arity:
        raise ValueError(f"op {name} takes {info.arity} arguments, got {len(args)}")
    ct = ctype(dtype)
    if name == "cast":
        return cast(args[0], arg_dtypes[0], dtype)
    if info.kind == "cmp":
        return f"({args[0]} {_CMP[name]} {args[1]})"
    if info.kind == "logic":
        if name == "not":
            return f"(!{args[0]})"
        return f"({args[0]} {'&&' if name == 'and' else '||'} {args[1]})"

    def conv(i):  # argument i in the result's compute type
        a, d = args[i], arg_dtypes[i]
        return a if ctype(d) == ct else f"({ct})({a})"

    f64 = dtypes.compute_type(dtype) == "f64"
    is_float = dtypes.is_float(dtype)
    fast = fast and ct == "float"
    if fast and name == "exp":
        e = f"tf_exp_fast({conv(0)})"
    elif fast and name == "div":
        e = f"tf_div_fast({conv(0)}, {conv(1)})"
    elif fast and name == "sigmoid":  # 1 / (1 + exp(-x)): inf for x < -88 gives rcp 0, as IEEE does
        e = f"tf_rcp_fast(1.0f + tf_exp_fast(-{conv(0)}))"
    elif fast and name in ("ncdf", "expm1", "tanh", "log1p"):
        e = f"tf_{name}_fast({conv(0)})"
    elif name == "ncdf":  # 0.5 erfc(-x / sqrt 2): no cancellation in the lower tail
        fn, half, r2 = ("erfc", "0.5", "0.7071067811865476") if f64 else ("erfcf", "0.5f", "0.70710678f")
        e = f"({half} * {fn}(-{r2} * {conv(0)}))"
    elif name in _FLOAT_FN:
        fn = _FLOAT_FN[name][1 if f64 else 0]
        e = f"{fn}({', '.join(conv(i) for i in range(info.arity))})"
    elif name == "recip":
        e = f"({const(1, dtypes.compute_type(dtype))} / {conv(0)})"
    elif name == "sigmoid":
        one = const(1, dtypes.compute_type(dtype))
        e = f"({one} / ({one} + {'exp' if f64 else 'expf'}(-{conv(0)})))"
    elif name in _WRAPPING and ct in _UNSIGNED:
        e = _wrapping(name, [conv(i) for i in range(info.arity)], ct)
    elif name == "neg":
        e = f"(-{conv(0)})"
    elif name == "abs":  # (8-bit integers: promoted to int, so -(-128) is 128, narrowed where stored)
        e = f"{'fabs' if f64 else 'fabsf'}({conv(0)})" if is_float else f"({conv(0)} < 0 ? -{conv(0)} : {conv(0)})"
    elif name == "relu":
        zero = const(0, dtypes.compute_type(dtype))
        e = f"tf_max({conv(0)}, {zero if is_float else f'({ct})0'})"
    elif name in _ARITH:
        e = f"({conv(0)} {_ARITH[name]} {conv(1)})"
    elif name in ("max", "min"):
        # an integer literal is an int (or unsigned) in C++: name the type, or tf_max(T, T)
        # cannot deduce T beside an 8- or 16-bit value
        e = f"tf_{name}({conv(0)}, {conv(1)})" if is_float else f"tf_{name}(({ct})({args[0]}), ({ct})({args[1]}))"
    elif name in ("floordiv", "mod"):
        e = f"tf_{name}(({ct})({args[0]}), ({ct})({args[1]}))"
    elif name == "where":
        e = f"({args[0]} ? {conv(1)} : {conv(2)})"
    else:  # pragma: no cover - every op of ops.OPS is spelled above
        raise ValueError(f"no C++ spelling for op {name!r}")
    if is_float:
        return round_to(dtype, e)
    return e


def check_all_ops_spelled():
    """Every op in ops.OPS has a spelling (a test calls this)."""
    missing = []
    for name, info in ops.OPS.items():
        try:
            op(name, ["a", "b", "c"][: info.arity], ["f32"] * info.arity if name != "where"
               else ["bool", "f32", "f32"], "f32" if info.kind not in ("cmp", "logic") else "bool")
        except ValueError:
            missing.append(name)
    return missing


# ---------------------------------------------------------------- index expressions


PERIOD = "tf_s"  # a size the launch passes as an int argument (codegen.mapreduce.rows_free's period)


def index(e: ir.Index, env: dict[str, str]) -> str:
    """C++ (long long) for an index expression; `env` maps loop vars and SSA values to C names.

    Index arithmetic is 64-bit with C's truncating `/` and `%` (the interpreter's semantics).
    A loop variable divided by the PERIOD argument divides in 32 bits (a 64-bit division by a
    variable is a long subroutine): loop variables of a kernel taking sizes as arguments are
    below 2^31 (mapreduce.at_rows and _render check), and none is negative.
    """
    if isinstance(e, ir.IConst):
        return f"{e.value}LL" if abs(e.value) >= 2**31 else str(e.value)
    if isinstance(e, ir.Var):
        return env[e.name]
    if isinstance(e, ir.Val):
        return f"(long long)({env[e.name]})"
    if isinstance(e, ir.IBin):
        a, b = index(e.a, env), index(e.b, env)
        if e.op == "+":
            return f"({a} + {b})"
        if e.op == "*":
            return f"((long long)({a}) * ({b}))"
        if e.b == ir.Var(PERIOD) and isinstance(e.a, ir.Var):
            return f"(long long)((int)({a}) {'/' if e.op == '//' else '%'} {b})"
        # "//" and "%" are C's (truncating) division and remainder, as in the interpreter
        return f"({a} {'/' if e.op == '//' else '%'} {b})"
    raise TypeError(f"not an index expression: {e!r}")


def flat_offset(buf: ir.Buffer, index_exprs: tuple, env: dict[str, str]) -> str:
    """Row-major element offset of buf[index...] as a C++ expression."""
    if len(index_exprs) != len(buf.shape):
        raise ValueError(f"buffer {buf.name} has {len(buf.shape)} dims, indexed with {len(index_exprs)}")
    if not index_exprs:
        return "0"
    terms = []
    stride = 1
    for e, n in reversed(list(zip(index_exprs, buf.shape))):
        s = index(e, env)
        if s != "0":  # (a leading dim read at 0 adds nothing: its stride, which may hold a size, is left out)
            terms.append(s if stride == 1 else f"({s}) * {stride}LL")
        stride *= n
    return " + ".join(reversed(terms)) or "0"

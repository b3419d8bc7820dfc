"""A GEMM of a few rows (a decode step's projections) as a matrix-vector kernel.

At M = 1 a GEMM is B's bytes streamed through the SMs: no tile shape of the tensor-core
templates keeps enough of B in flight on every SM (a 64-wide tile of a 4096-wide weight is
64 CTAs on 132 SMs), and their ramp (barriers, a ring of stages) is long beside a 10 us
kernel. Here each warp owns `cols` adjacent rows of B ([N, K], nn.Linear's weight), its lanes
stream them in 16-byte vectors, `unroll` vectors of each row in flight per lane, multiply by
A's M rows (read through L1: every warp of the CTA reads the same A) and reduce across the
lanes with shuffles. Then one lane per (row, column) runs the epilogue program for that
element, the same Loop IR the tile templates run per accumulator register
(gemm_sm90._render_element), pairwise ones included (each warp's columns come in pairs).

What it takes (`why_not`): one batch, B K-major, K a multiple of 8 (16-byte vectors), M at
most MAX_M, no partial row reductions. Under programmatic launch B's first vectors, where B is
a weight (`b_const`), are loaded before the wait for the kernel before. CUDA C++ for sm_80 and
later: no TMA, no wgmma.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..loop import ir
from . import cexpr, epilogue as epi
from .gemm_sm90 import GemmError, GemmProblem, _check_epilogue, _ident, _render_element

MAX_M = 1            # rows of A a GEMM may have to run here by default (session 50: at M = 2 and 4
                     # the tile template was as fast or faster at most decode shapes)
VEC = 8              # 16-bit elements per 16-byte vector
ENV = "TILEFUSE_GEMV"


@dataclass(frozen=True)
class GemvSchedule:
    cols: int = 1      # adjacent output columns (rows of B) per warp
    warps: int = 8     # warps per CTA
    unroll: int = 4    # 16-byte vectors of each B row a lane loads before it multiplies

    def __post_init__(self):
        if self.cols not in (1, 2, 4):
            raise GemmError(f"GEMV cols must be 1, 2 or 4, not {self.cols}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise GemmError(f"GEMV warps must be 1, 2, 4, 8 or 16, not {self.warps}")
        if self.unroll not in (1, 2, 4, 8):
            raise GemmError(f"GEMV unroll must be 1, 2, 4 or 8, not {self.unroll}")

    def __str__(self):
        return f"gemv {self.cols} column(s) a warp, {self.warps} warps, {self.unroll} vector(s) of B a lane in flight"


@dataclass(frozen=True)
class GemvSource:
    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    params: tuple[str, ...]           # epilogue outputs, then its operands: the kernel's order after A, B
    problem: GemmProblem
    schedule: GemvSchedule
    arch: str
    align_a: int = 16                 # bytes A and B must be aligned to: each is read in 16-byte vectors
    align_b: int = 16
    pair_store: bool = False


def enabled(environ=None) -> bool:
    """TILEFUSE_GEMV=0 (or false/off/no) runs short GEMMs in the tile templates."""
    import os

    value = (os.environ if environ is None else environ).get(ENV, "1")
    return value.strip().lower() not in ("0", "false", "off", "no")


def takes(problem: GemmProblem, environ=None) -> bool:
    """Whether a program runs this GEMM here rather than in a tile template."""
    return enabled(environ) and not why_not(problem)


def why_not(problem: GemmProblem, max_m: int = MAX_M) -> str:
    """Why this template does not take the GEMM ("" where it does)."""
    P = problem
    if P.m > max_m:
        return f"M = {P.m} is more than {max_m} rows"
    if P.batch != 1:
        return "batched"
    if P.b_major != "K":
        return "B is N-major (a GEMV streams B's rows along K)"
    if P.k % VEC:
        return f"K = {P.k} is not a multiple of {VEC} (16-byte vectors)"
    if P.m_arg:
        return "M is a kernel argument"
    kernel = P.out_epilogue
    if epi.partials_loop(kernel) is not None:
        return "the epilogue has partial row reductions"
    if epi.is_pairwise(kernel) and P.n % 2:
        return "a pairwise epilogue of odd N"
    return ""


def default_schedule(problem: GemmProblem) -> GemvSchedule:
    """From a sweep of every knob at Llama's decode shapes (H200, bench/gemv.py --sweep, session
    50): one column a warp (two for a pairwise epilogue) and 4 warps a CTA were the best or within
    2% at every shape; the best unroll was the deepest (up to 8 vectors of B a lane) whose steps
    tile K's vectors exactly (K = 11008: 1, 5632: 2, 4096: 8), so that is the pick."""
    cols = 2 if epi.is_pairwise(problem.out_epilogue) else 1
    kv = problem.k // VEC
    unroll = next(u for u in (8, 4, 2, 1) if u * cols <= 8 and (kv % (32 * u) == 0 or u == 1))
    return GemvSchedule(cols=cols, warps=4, unroll=unroll)


def kernel_name(problem: GemmProblem, s: GemvSchedule, kernel: ir.Kernel) -> str:
    from ..loop.canon import structural_hash

    h = structural_hash(kernel)[:10]
    return (f"tf_gemv_{problem.m}x{problem.n}x{problem.k}_{problem.dtype}_c{s.cols}w{s.warps}u{s.unroll}"
            f"{'_bc' if problem.b_const else ''}_{h}")


def _dot(dtype: str) -> str:
    """tf_dot8(acc, w, x): acc + the dot product of two 16-byte vectors of 16-bit values, in f32."""
    if dtype == "bf16":
        lo, hi = "__uint_as_float(u << 16)", "__uint_as_float(u & 0xffff0000u)"
    else:
        lo, hi = "tf_f16_to_f32((unsigned short)(u & 0xffffu))", "tf_f16_to_f32((unsigned short)(u >> 16))"
    return f"""
__device__ __forceinline__ float tf_lo(unsigned u) {{ return {lo}; }}
__device__ __forceinline__ float tf_hi(unsigned u) {{ return {hi}; }}
__device__ __forceinline__ float tf_dot8(float acc, const uint4& w, const uint4& x) {{
  acc = fmaf(tf_lo(w.x), tf_lo(x.x), acc); acc = fmaf(tf_hi(w.x), tf_hi(x.x), acc);
  acc = fmaf(tf_lo(w.y), tf_lo(x.y), acc); acc = fmaf(tf_hi(w.y), tf_hi(x.y), acc);
  acc = fmaf(tf_lo(w.z), tf_lo(x.z), acc); acc = fmaf(tf_hi(w.z), tf_hi(x.z), acc);
  acc = fmaf(tf_lo(w.w), tf_lo(x.w), acc); acc = fmaf(tf_hi(w.w), tf_hi(x.w), acc);
  return acc;
}}
__device__ __forceinline__ uint4 tf_ld_stream(const uint4* p) {{
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {{%0, %1, %2, %3}}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}}
"""


def _epilogue_lines(problem: GemmProblem, s: GemvSchedule, kernel: ir.Kernel) -> list[str]:
    """Lane `lane` of each warp finishes one element: (m, column) = (lane % M, n0 + lane / M),
    or for a pairwise epilogue (m, pair) = (lane % M, n0 / 2 + lane / M) from the column pair's
    two sums. Every lane holds every sum after the butterflies; each picks its own by a chain
    of selects on constant register indices (no local-memory array)."""
    M = problem.m
    body = epi.inner_body(kernel)
    pair = epi.is_pairwise(kernel)
    width = 2 if pair else 1                          # accumulator columns one element reads
    names = ["v0", "v1"] if pair else ["v"]
    lines = [f"float {', '.join(f'{v} = 0.f' for v in names)};"]
    for j in range(s.cols // width):
        for m in range(M):
            sets = " ".join(f"{v} = acc[{width * j + e}][{m}];" for e, v in enumerate(names))
            lines.append(f"if (lane == {j * M + m}) {{ {sets} }}")
    lines += [f"if (lane < {s.cols // width * M}) {{",
              f"  const int m = lane % {M};",
              f"  const int n = {'(n0 >> 1)' if pair else 'n0'} + lane / {M};",
              f"  if ({'2 * n' if pair else 'n'} < {problem.n}) {{"]
    _render_element(kernel, body, names if pair else "v", "n", lines, "", store=True)
    lines += ["  }", "}"]
    return lines


def render(problem: GemmProblem, schedule: GemvSchedule | None = None, arch: str = "sm_90a") -> GemvSource:
    """CUDA C++ for one short GEMM (+ epilogue) at fixed shapes."""
    P = problem
    why = why_not(P, max_m=32)
    if why:
        raise GemmError(f"the GEMV template does not take {P.m}x{P.n}x{P.k}: {why}")
    S = schedule or default_schedule(P)
    kernel = P.out_epilogue
    _check_epilogue(P, kernel)
    if epi.is_pairwise(kernel) and S.cols % 2:
        raise GemmError(f"{S}: a pairwise epilogue needs an even number of columns a warp")
    if S.cols * P.m > 32:
        raise GemmError(f"{S}: {S.cols} columns x {P.m} rows is more elements than a warp's 32 lanes finish")
    name = kernel_name(P, S, kernel)
    M, N, KV = P.m, P.n, P.k // VEC
    warps_total = -(-N // S.cols)
    grid = -(-warps_total // S.warps)
    step = 32 * S.unroll
    ops_params, out_params = epi.operands(kernel), kernel.outputs
    cparams = ["const uint4* __restrict__ A", "const uint4* __restrict__ B"]
    cparams += [f"{cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in out_params]
    cparams += [f"const {cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in ops_params]

    full = KV // step   # whole steps: every lane's `unroll` vectors of each row lie inside K
    tail = KV - full * step

    def load_b(kb: str) -> list[str]:
        """B's vectors of this lane for the whole step at vector column kb, each row of the
        warp's (a row past N reads row N - 1, whose sums are never stored)."""
        return [f"w[{u}][{c}] = tf_ld_stream(brow{c} + {kb} + {u * 32});"
                for u in range(S.unroll) for c in range(S.cols)]

    rows = [f"const uint4* brow{c} = B + (long long)min(n0 + {c}, {N - 1}) * {KV};" for c in range(S.cols)]
    early = P.b_const and full > 0
    if early:
        note = "B is a weight, which no kernel writes: its first step loads before the wait"
    else:
        note = "nothing loads before the wait (B may be written by the kernel before, or K is short)"
    src = []
    w = src.append
    w(f"// {name}\n// ({M} x {P.k}) @ ({N} x {P.k} K-major) {P.dtype}, {S}, for {arch}")
    w(f"// {full} whole step(s) of {step} vectors a row, then {tail} vector(s) one a lane")
    w(f"// epilogue {kernel.name}: " + "; ".join(str(x) for x in epi.inner_body(kernel)))
    w(cexpr.PRELUDE)
    w(_dot(P.dtype))
    ind = "\n  "
    w(f"""
extern "C" __global__ void __launch_bounds__({32 * S.warps})
{name}({", ".join(cparams)}) {{
  tf_pdl_launch();
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * {S.warps} + (threadIdx.x >> 5)) * {S.cols};
  if (n0 >= {N}) return;
  {ind.join(rows)}
  float acc[{S.cols}][{M}];
  #pragma unroll
  for (int c = 0; c < {S.cols}; ++c)
    #pragma unroll
    for (int m = 0; m < {M}; ++m) acc[c][m] = 0.f;
  uint4 w[{S.unroll}][{S.cols}];
  // {note}
  {'' if early else 'tf_pdl_wait();'}""")
    if full:
        w(f"""  {ind.join(load_b('lane'))}
  {'tf_pdl_wait();' if early else ''}
  for (int s = 0, kb = lane; s < {full}; ++s, kb += {step}) {{
    if (s) {{
      {(ind + '    ').join(load_b('kb'))}
    }}
    #pragma unroll
    for (int u = 0; u < {S.unroll}; ++u)
      #pragma unroll
      for (int m = 0; m < {M}; ++m) {{
        const uint4 x = __ldg(A + m * {KV} + kb + u * 32);
        #pragma unroll
        for (int c = 0; c < {S.cols}; ++c) acc[c][m] = tf_dot8(acc[c][m], w[u][c], x);
      }}
  }}""")
    if tail:
        w(f"""  for (int kb = {full * step} + lane; kb < {KV}; kb += 32) {{
    {(ind + '  ').join(f"w[0][{c}] = tf_ld_stream(brow{c} + kb);" for c in range(S.cols))}
    #pragma unroll
    for (int m = 0; m < {M}; ++m) {{
      const uint4 x = __ldg(A + m * {KV} + kb);
      #pragma unroll
      for (int c = 0; c < {S.cols}; ++c) acc[c][m] = tf_dot8(acc[c][m], w[0][c], x);
    }}
  }}""")
    w(f"""  #pragma unroll
  for (int c = 0; c < {S.cols}; ++c)
    #pragma unroll
    for (int m = 0; m < {M}; ++m)
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[c][m] += __shfl_xor_sync(0xffffffffu, acc[c][m], o);
""")
    for line in _epilogue_lines(P, S, kernel):
        w("  " + line)
    w("}\n")
    params = tuple(p.name for p in out_params) + tuple(p.name for p in ops_params)
    return GemvSource(name=name, source="\n".join(src), grid=(grid, 1, 1), block=(32 * S.warps, 1, 1),
                      smem_bytes=0, params=params, problem=P, schedule=S, arch=arch)

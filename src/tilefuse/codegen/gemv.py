"""A GEMM of a few rows (a decode step's projections) as a matrix-vector kernel.

At M <= 8 a GEMM is B's bytes streamed through the SMs: no tile shape of the tensor-core
templates keeps enough of B in flight on every SM (a 64-wide tile of a 4096-wide weight is
64 CTAs on 132 SMs), and their ramp (barriers, a ring of stages) is long beside a 10 us
kernel. Two forms:

- FMA (one row, GemvSchedule): each warp owns `cols` adjacent rows of B ([N, K], nn.Linear's
  weight), its lanes stream them in 16-byte vectors, `unroll` vectors of each row in flight
  per lane, multiply by A's rows (read through L1: every warp of the CTA reads the same A) and
  reduce across the lanes with shuffles. Its cost grows with the rows: every B vector is
  converted and multiplied once per row of A.
- Tensor cores (2-8 rows, MmaGemvSchedule): a CTA owns 16 rows of B, the M side of
  mma.m16n8k16, whose N side (8) holds A's rows; its warps split K and meet in shared memory.

Either way one lane per output element then runs the epilogue program, the same Loop IR the
tile templates run per accumulator register (gemm_sm90._render_element), pairwise ones
included (adjacent columns meet in one lane).

What it takes (`why_not`): one batch, B K-major, K a multiple of 8 (16-byte vectors), M at
most MAX_M; partial row reductions (a norm's sums after the O and down projections) only over
groups of the tensor-core form's CTA's 16 columns, which that form renders (at M = 1 too).
Both forms launch programmatically; the FMA form loads B's first vectors, where B is a weight
(`b_const`), before the wait for the kernel before (on the coherent path: ptxas 13.0 moves
non-coherent loads after the wait; session 51). The tensor-core form loads nothing before it:
its weight's first step there made a 4-sequence decode step 12% slower (session 53). Its
`prefetch` knob asks L2 for B's next steps instead, with bulk prefetches that hold no
registers: on by default where the CTAs are few and K short (_mma_default).
CUDA C++ for sm_80 and later: no TMA, no wgmma.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

from .. import env
from ..loop import ir
from . import cexpr, epilogue as epi
from .mapreduce import arch_number
from .gemm_sm90 import (_PARTIAL_COMBINE, GemmError, GemmProblem, _check_epilogue, _ident, _render_element,
                        inline_partial_terms, inline_partials)

MAX_M = 8            # rows of A a GEMM may have to run here: one in the FMA form, 2-8 in the
                     # tensor-core form (whose N side, 8 wide, holds A's rows)
GROUP = epi.SHORT_PARTIAL_WIDTH  # output columns a CTA of the tensor-core form owns (16), so a partial's width
FEW_GROUPS = 128     # at most this many CTAs (16 columns each), about a large GPU's SMs: 32 warps a CTA
PREFETCH_MAX_K = 4096  # and, up to this K, one step of B prefetched into L2 (_mma_default)
VEC = 8              # 16-bit elements per 16-byte vector
ENV = "TILEFUSE_GEMV"
GROUPS_ENV = "TILEFUSE_GEMV_GROUPS"


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
class MmaGemvSchedule:
    """The tensor-core form: a CTA owns 16 rows of B (the M side of mma.m16n8k16, A's rows its
    N side) and its warps split K; each lane holds one 16-byte vector of two B rows a chunk of
    32 K."""
    warps: int = 4     # warps per CTA, each a share of K (their sums meet in shared memory)
    unroll: int = 4    # chunks of 32 K each lane loads before it multiplies
    prefetch: int = 0  # steps of B the CTA asks into L2 ahead of its loads (sm_90: bulk prefetches)

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise GemmError(f"GEMV warps must be 1, 2, 4, 8, 16 or 32, not {self.warps}")
        if self.unroll not in (1, 2, 4, 8):
            raise GemmError(f"GEMV unroll must be 1, 2, 4 or 8, not {self.unroll}")
        if self.prefetch not in (0, 1, 2):
            raise GemmError(f"GEMV prefetch must be 0, 1 or 2 steps, not {self.prefetch}")

    def __str__(self):
        ahead = f", {self.prefetch} step(s) of B prefetched into L2" if self.prefetch else ""
        return (f"gemv on tensor cores, 16 columns a CTA, K over {self.warps} warps, "
                f"{self.unroll} chunk(s) of 32 a lane in flight{ahead}")


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
    members: tuple = ()               # render_group: each GEMM's (problem, own params), in CTA order


def enabled(environ=None) -> bool:
    """TILEFUSE_GEMV=0 (or false/off/no) runs short GEMMs in the tile templates."""
    return env.switch(ENV, environ)


def groups_enabled(environ=None) -> bool:
    """A program runs its consecutive GEMVs of one A as one launch (render_group;
    runtime.runner) unless TILEFUSE_GEMV_GROUPS=0 (or false/off/no): a decode step 4-6% faster
    (H200, session 54)."""
    return env.switch(GROUPS_ENV, environ)


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
        why = _partials_why_not(P, kernel)
        if why:
            return why
    if epi.is_pairwise(kernel) and P.n % 2:
        return "a pairwise epilogue of odd N"
    return ""


def _partials_why_not(P: GemmProblem, kernel: ir.Kernel) -> str:
    """Why the tensor-core form does not render these partial row reductions ("" where it does):
    it takes a norm's sums (or maxima) over its CTA's 16 columns, added up beside the element
    code (gemm_sm90.InlinePartials), so one CTA makes each partial and none is shared."""
    try:
        width = epi.partial_width(kernel)
    except ValueError as e:
        return str(e)
    if width != GROUP:
        return f"partials over {width} columns (the GEMV's are its CTA's {GROUP})"
    if P.n % GROUP:
        return f"partials of N = {P.n}, not a multiple of {GROUP}"
    if inline_partials(P, kernel) is None:
        return "partials other than sums or maxima of the stored value (a log-sum-exp's, say)"
    return ""


def default_schedule(problem: GemmProblem) -> GemvSchedule | MmaGemvSchedule:
    """One row: the FMA form (below). More, or partial row reductions: the tensor-core form,
    whose cost does not grow with the rows (each lane's FMA form multiplies every B vector by
    every row of A), and whose CTA owns a partial's 16 columns."""
    if problem.m > 1 or epi.partials_loop(problem.out_epilogue) is not None:
        return _mma_default(problem)
    return _fma_default(problem)


def _mma_default(problem: GemmProblem) -> MmaGemvSchedule:
    """From two sweeps at Llama's decode shapes, M = 2 and 8 (H200, bench/gemv.py --sweep mma,
    session 51; noisy, so a simple rule): 16 warps a CTA, 32 where the CTAs (16 columns each)
    are fewer than a large GPU's SMs (N <= 2048: 1.2-1.4x faster there); each lane the deepest
    unroll (8 chunks, 4 at 32 warps) where K is whole steps of it, else 2. No more warps than
    K has chunks of 32 (a short K would leave the rest idle).

    One step of B prefetched into L2 (sm_90; `for_arch` drops it below) where the CTAs are that
    few and K at most PREFETCH_MAX_K: there the first loads' latency is much of the kernel, and
    the prefetch issued before the wait for the kernel before hides it (bench/gemv.py --sweep
    prefetch, H200, session 54: 2048x2048 and 1024x4096 at M = 1 and 4, 7-15% faster; K = 5632
    0.5-2% slower; over 128 CTAs up to 28% slower: the prefetches only add L2 traffic)."""
    kv = problem.k // VEC
    few = -(-problem.n // 16) <= FEW_GROUPS
    warps = 32 if few else 16
    while warps > 1 and warps > -(-kv // 4):
        warps //= 2
    deep = min(8, 128 // warps)
    return MmaGemvSchedule(warps, deep if kv % (4 * warps * deep) == 0 else 2,
                           prefetch=int(few and problem.k <= PREFETCH_MAX_K))


def for_arch(schedule: GemvSchedule | MmaGemvSchedule, arch: str) -> GemvSchedule | MmaGemvSchedule:
    """A default schedule as `arch` can run it: no L2 bulk prefetches before sm_90."""
    if isinstance(schedule, MmaGemvSchedule) and schedule.prefetch and arch_number(arch) < 90:
        return replace(schedule, prefetch=0)
    return schedule


def _fma_default(problem: GemmProblem) -> GemvSchedule:
    """From a sweep of every knob at Llama's decode shapes (H200, bench/gemv.py --sweep, session
    50): one column a warp (two for a pairwise epilogue) and 4 warps a CTA were the best or within
    2% at every shape; the best unroll was the deepest (up to 8 vectors of B a lane) whose steps
    tile K's vectors exactly (K = 11008: 1, 5632: 2, 4096: 8), so that is the pick."""
    cols = 2 if epi.is_pairwise(problem.out_epilogue) else 1
    kv = problem.k // VEC
    unroll = next(u for u in (8, 4, 2, 1) if u * cols <= 8 and (kv % (32 * u) == 0 or u == 1))
    return GemvSchedule(cols=cols, warps=4, unroll=unroll)


def kernel_name(problem: GemmProblem, s: GemvSchedule | MmaGemvSchedule, kernel: ir.Kernel) -> str:
    from ..loop.canon import structural_hash

    h = structural_hash(kernel)[:10]
    knobs = (f"tw{s.warps}u{s.unroll}{f'p{s.prefetch}' if s.prefetch else ''}" if isinstance(s, MmaGemvSchedule)
             else f"c{s.cols}w{s.warps}u{s.unroll}")
    return (f"tf_gemv_{problem.m}x{problem.n}x{problem.k}_{problem.dtype}_{knobs}"
            f"{'_bc' if problem.b_const else ''}_{h}")


PREFETCH_L2 = """// Ask L2 for `bytes` (a multiple of 16) from a 16-byte aligned p: a bulk prefetch the TMA
// unit carries out (sm_90), a hint that holds no register while it is in flight.
__device__ __forceinline__ void tf_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes));
}
"""


def _load(name: str, op: str, note: str = "") -> str:
    """A 16-byte vector load helper `name` issuing PTX `op`."""
    return (note + f"__device__ __forceinline__ uint4 {name}(const uint4* p) {{\n  uint4 v;\n"
            f'  asm volatile("{op}.v4.u32 {{%0, %1, %2, %3}}, [%4];"\n'
            '               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));\n  return v;\n}\n')


_LOADS = (_load("tf_ld_stream", "ld.global.nc.L1::no_allocate")
          + _load("tf_ld_early", "ld.global.L1::no_allocate",
                  "// The same load on the coherent path, for a weight's vectors before griddepcontrol.wait:\n"
                  "// ptxas (13.0) schedules .nc loads after the wait, plain ones where the source puts them.\n")
          + _load("tf_ld_act", "ld.global",
                  "// A (another kernel's output under programmatic launch) on the coherent path, kept in L1 (every\n"
                  "// warp of the CTA reads it): ptxas moves non-coherent (.nc, __ldg) loads above\n"
                  "// griddepcontrol.wait, where they would read A before the kernel before has written it.\n"))


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
{_LOADS}"""


def _head(name: str, P: GemmProblem, S, kernel: ir.Kernel, arch: str, steps: str) -> list[str]:
    """A GEMV source's opening: what it computes, how K is walked, the epilogue, the helpers."""
    return [f"// {name}\n// ({P.m} x {P.k}) @ ({P.n} x {P.k} K-major) {P.dtype}, {S}, for {arch}",
            f"// {steps}",
            f"// epilogue {kernel.name}: " + "; ".join(str(x) for x in epi.inner_body(kernel)),
            cexpr.PRELUDE, _dot(P.dtype)]


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


def render(problem: GemmProblem, schedule: GemvSchedule | MmaGemvSchedule | None = None,
           arch: str = "sm_90a") -> GemvSource:
    """CUDA C++ for one short GEMM (+ epilogue) at fixed shapes."""
    P = problem
    S = schedule or for_arch(default_schedule(P), arch)
    mma = isinstance(S, MmaGemvSchedule)
    why = why_not(P, max_m=MAX_M if mma else 32)
    if why:
        raise GemmError(f"the GEMV template does not take {P.m}x{P.n}x{P.k}: {why}")
    kernel = P.out_epilogue
    partials = epi.partials_loop(kernel) is not None
    _check_epilogue(P, kernel, partials=partials)
    if mma:
        return _render_mma(P, S, kernel, arch)
    if partials:
        raise GemmError(f"{S}: partial row reductions run in the tensor-core form (MmaGemvSchedule)")
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

    def load_b(kb: str, load: str = "tf_ld_stream") -> list[str]:
        """B's vectors of this lane for the whole step at vector column kb, each row of the
        warp's (a row past N reads row N - 1, whose sums are never stored)."""
        return [f"w[{u}][{c}] = {load}(brow{c} + {kb} + {u * 32});"
                for u in range(S.unroll) for c in range(S.cols)]

    rows = [f"const uint4* brow{c} = B + (long long)min(n0 + {c}, {N - 1}) * {KV};" for c in range(S.cols)]
    early = P.b_const and full > 0
    if early:
        note = "B is a weight, which no kernel writes: its first step loads before the wait"
    else:
        note = "nothing loads before the wait (B may be written by the kernel before, or K is short)"
    src = _head(name, P, S, kernel, arch, f"{full} whole step(s) of {step} vectors a row, then {tail} vector(s) one a lane")
    w = src.append
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
        w(f"""  {ind.join(load_b('lane', 'tf_ld_early' if early else 'tf_ld_stream'))}
  {'tf_pdl_wait();' if early else ''}
  for (int s = 0, kb = lane; s < {full}; ++s, kb += {step}) {{
    if (s) {{
      {(ind + '    ').join(load_b('kb'))}
    }}
    #pragma unroll
    for (int u = 0; u < {S.unroll}; ++u)
      #pragma unroll
      for (int m = 0; m < {M}; ++m) {{
        const uint4 x = tf_ld_act(A + m * {KV} + kb + u * 32);
        #pragma unroll
        for (int c = 0; c < {S.cols}; ++c) acc[c][m] = tf_dot8(acc[c][m], w[u][c], x);
      }}
  }}""")
    if tail:
        w(f"""  for (int kb = {full * step} + lane; kb < {KV}; kb += 32) {{
    {(ind + '  ').join(f"w[0][{c}] = tf_ld_stream(brow{c} + kb);" for c in range(S.cols))}
    #pragma unroll
    for (int m = 0; m < {M}; ++m) {{
      const uint4 x = tf_ld_act(A + m * {KV} + kb);
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


def _mma(dtype: str) -> str:
    """tf_mma(c, a0..a3, b0, b1): c += the m16n8k16 product of one B fragment (a) and one A
    fragment (b), f32 accumulators."""
    t = "bf16" if dtype == "bf16" else "f16"
    return f"""
__device__ __forceinline__ void tf_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {{
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}}
"""


def _mma_epilogue_lines(problem: GemmProblem, kernel: ir.Kernel) -> list[str]:
    """Lane (g, q) = (lane / 4, lane % 4) holds acc[2r + e] = C[n0 + 2g + r][2q + e]: columns
    n0 + 2g and n0 + 2g + 1 of A's rows 2q and 2q + 1, so a pairwise epilogue's two columns
    are in one lane."""
    body = epi.inner_body(kernel)
    M, N = problem.m, problem.n
    lines = []
    if epi.is_pairwise(kernel):
        for e in range(2):
            lines += [f"{{ const int m = 2 * tf_q + {e}; const int n = (n0 >> 1) + tf_g;",
                      f"  if (m < {M} && 2 * n < {N}) {{",
                      f"  const float v0 = acc[{e}], v1 = acc[{2 + e}];"]
            _render_element(kernel, body, ["v0", "v1"], "n", lines, "", store=True)
            lines += ["}}"]
        return lines
    inl = inline_partials(problem, kernel)  # (None without partials: why_not declines the rest)
    reds = inl.reds if inl else ()
    regs = [[f"pp{i}_{e}" for i in range(len(reds))] for e in range(2)]  # per row of the lane's two
    for i, red in enumerate(reds):
        lines.append(f"float pp{i}_0 = {cexpr.const(_PARTIAL_COMBINE[red.op][1], 'f32')}, pp{i}_1 = pp{i}_0;")
    for r in range(2):
        for e in range(2):
            lines += [f"{{ const int m = 2 * tf_q + {e}; const int n = n0 + 2 * tf_g + {r};",
                      f"  if (m < {M} && n < {N}) {{",
                      f"  const float v = acc[{2 * r + e}];"]
            scope = ({}, {})
            _render_element(kernel, body, "v", "n", lines, "", store=True, scope=scope)
            if inl:
                inline_partial_terms(kernel, inl, "v", "n", lines, scope, "", regs[e])
            lines += ["}}"]
    if inl:
        lines += _mma_partials_finish(problem, kernel, inl, regs)
    return lines


def _mma_partials_finish(problem: GemmProblem, kernel: ir.Kernel, inl, regs: list[list[str]]) -> list[str]:
    """Each of the lane's two rows' partials (rows 2q and 2q + 1) across the 8 lanes holding
    that row's other columns (lane bits 2-4), then lane g = 0 stores the CTA's group t."""
    stores = [x for x in epi.partials_loop(kernel).body if isinstance(x, ir.Store)]
    lines = ["// the partials: this CTA's 16 columns of rows 2q, 2q + 1, across the lanes of one q"]
    for e in range(2):
        for i, red in enumerate(inl.reds):
            for mask in (4, 8, 16):
                other = f"__shfl_xor_sync(0xffffffffu, {regs[e][i]}, {mask})"
                lines.append(f"{regs[e][i]} = {_PARTIAL_COMBINE[red.op][0].format(a=regs[e][i], b=other)};")
    names = {red.dst: i for i, red in enumerate(inl.reds)}
    for e in range(2):
        lines.append(f"if (tf_g == 0 && 2 * tf_q + {e} < {problem.m}) {{")
        lines.append(f"  const int m = 2 * tf_q + {e};")
        for x in stores:
            buf = kernel.buffer(x.buf)
            off = cexpr.flat_offset(buf, x.index, {"m": "m", "t": "blockIdx.x"})
            lines.append(f"  {_ident(buf.name)}[{off}] = {cexpr.to_storage(buf.dtype, regs[e][names[x.value]])};")
        lines.append("}")
    return lines


def _render_mma(P: GemmProblem, S: MmaGemvSchedule, kernel: ir.Kernel, arch: str) -> GemvSource:
    """The tensor-core form. K may be taken in any order, the same for both operands: a lane's
    16-byte vector at K offset 32c + 8q (q = lane % 4) holds the mma's k = 2q, 2q+1, 2q+8, 2q+9
    of one k16 step (its .x, .y) and of the next (.z, .w), in B's rows and A's alike; fragment
    row g (lane / 4) is B's row n0 + 2g and row g + 8 is n0 + 2g + 1. A's rows past M repeat
    row M - 1 into accumulator columns nobody stores."""
    name = kernel_name(P, S, kernel)
    M, N, KV = P.m, P.n, P.k // VEC
    U, W = S.unroll, S.warps
    chunks = -(-KV // 4)                 # chunks of 32 K (4 vectors a row); the last may be partial
    per_step = W * U
    full = (KV // 4) // per_step         # whole steps of the CTA: every chunk whole
    grid = -(-N // GROUP)
    ops_params, out_params = epi.operands(kernel), kernel.outputs
    cparams = ["const uint4* __restrict__ A", "const uint4* __restrict__ B"]
    cparams += [f"{cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in out_params]
    cparams += [f"const {cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in ops_params]
    ind = "\n  "

    def load_b(kv: str) -> str:
        return ind.join(f"w0[{u}] = tf_ld_stream(tf_b0 + {kv} + {4 * u}); w1[{u}] = tf_ld_stream(tf_b1 + {kv} + {4 * u});"
                        for u in range(U))

    def mma(w0: str, w1: str, x: str) -> str:
        return (f"tf_mma(tf_c0, {w0}.x, {w1}.x, {w0}.y, {w1}.y, {x}.x, {x}.y); "
                f"tf_mma(tf_c1, {w0}.z, {w1}.z, {w0}.w, {w1}.w, {x}.z, {x}.w);")

    if S.prefetch and arch_number(arch) < 90:
        raise GemmError(f"{S}: L2 bulk prefetches (cp.async.bulk.prefetch) need sm_90, not {arch}")
    step_vectors = 4 * per_step          # a step's vectors of each B row (the last step may be short)

    def prefetch(step: int | str) -> str:
        """The CTA's 16 rows of B at step `step` (a number, or an expression in the loop's s)
        asked into L2, where that step and the row exist, by thread 0: the instruction takes a
        uniform address, and ptxas wraps one of lane-distinct addresses in a loop over them
        (lane 0 of each warp for its rows did not do: the warp index is not uniform to it).
        Where one step is all of K the rows lie end to end: one prefetch asks for them all."""
        rows_here = f"min({GROUP}, {N} - n0)"
        if isinstance(step, int) and step_vectors >= KV:  # one step: every row whole
            return "" if step else (f"if (threadIdx.x == 0) tf_prefetch_l2(B + (long long)n0 * {KV}, "
                                    f"16u * {KV} * {rows_here});")
        if isinstance(step, int):
            v0 = step * step_vectors
            if v0 >= KV:
                return ""
            size, guard = f"{16 * min(step_vectors, KV - v0)}u", ""
        else:
            v0 = f"({step}) * {step_vectors}"
            size, guard = f"16u * min({step_vectors}, {KV} - {v0})", f" && {v0} < {KV}"
        return (f"if (threadIdx.x == 0{guard}) for (int r = 0; r < {rows_here}; ++r) "
                f"tf_prefetch_l2(B + (long long)(n0 + r) * {KV} + {v0}, {size});")

    src = _head(name, P, S, kernel, arch, f"{full} whole step(s) of {per_step} chunks of 32 K, then "
                f"{chunks - full * per_step} chunk(s) a warp at a time")
    w = src.append
    w(_mma(P.dtype))
    if S.prefetch:
        w(PREFETCH_L2)
    w(f"""
extern "C" __global__ void __launch_bounds__({32 * W})
{name}({", ".join(cparams)}) {{
  tf_pdl_launch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tf_g = lane >> 2, tf_q = lane & 3;
  const int n0 = blockIdx.x * {GROUP};
  const uint4* tf_b0 = B + (long long)min(n0 + 2 * tf_g, {N - 1}) * {KV} + tf_q;
  const uint4* tf_b1 = B + (long long)min(n0 + 2 * tf_g + 1, {N - 1}) * {KV} + tf_q;
  float tf_c0[4] = {{0.f, 0.f, 0.f, 0.f}}, tf_c1[4] = {{0.f, 0.f, 0.f, 0.f}};
  uint4 w0[{U}], w1[{U}];""")
    if S.prefetch:  # L2 is where every write lands: asking it for B early reads nothing stale
        w("  // B's first step(s) into L2 before the wait: the loads below then find them there")
        w("\n".join(f"  {prefetch(j)}" for j in range(S.prefetch) if prefetch(j)))
    w(f"""  tf_pdl_wait();   // nothing loads before it (the module's docstring says why)
  const uint4* tf_a = A + min(tf_g, {M - 1}) * {KV} + tf_q;""")
    if full:
        loads = (ind + '  ').join(load_b('kv').split(ind))
        ahead = f"\n    {prefetch(f's + {S.prefetch}')}" if S.prefetch and step_vectors < KV else ""
        w(f"""  for (int s = 0, kv = warp * {4 * U}; s < {full}; ++s, kv += {4 * per_step}) {{{ahead}
    {loads}
    uint4 x[{U}];
    #pragma unroll
    for (int u = 0; u < {U}; ++u) x[u] = tf_ld_act(tf_a + kv + 4 * u);
    #pragma unroll
    for (int u = 0; u < {U}; ++u) {{ {mma('w0[u]', 'w1[u]', 'x[u]')} }}
  }}""")
    if chunks > full * per_step:
        w(f"""  for (int kv = {4 * full * per_step} + warp * 4; kv < {KV}; kv += {4 * W}) {{
    const bool in = kv + tf_q < {KV};
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4 v0 = in ? tf_ld_stream(tf_b0 + kv) : zero, v1 = in ? tf_ld_stream(tf_b1 + kv) : zero;
    const uint4 x = in ? tf_ld_act(tf_a + kv) : zero;
    {mma('v0', 'v1', 'x')}
  }}""")
    w("  float acc[4];\n  #pragma unroll\n  for (int i = 0; i < 4; ++i) acc[i] = tf_c0[i] + tf_c1[i];")
    if W > 1:
        w(f"""  __shared__ float4 part[{W - 1}][32];   // each other warp's share of K
  if (warp) part[warp - 1][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
  if (warp) return;
  #pragma unroll 1
  for (int i = 0; i < {W - 1}; ++i) {{   // rolled: unrolled, ptxas spilled GLU epilogues at 16 warps
    const float4 p = part[i][lane];
    acc[0] += p.x; acc[1] += p.y; acc[2] += p.z; acc[3] += p.w;
  }}""")
    for line in _mma_epilogue_lines(P, kernel):
        w("  " + line)
    w("}\n")
    params = tuple(p.name for p in out_params) + tuple(p.name for p in ops_params)
    return GemvSource(name=name, source="\n".join(src), grid=(grid, 1, 1), block=(32 * W, 1, 1),
                      smem_bytes=0, params=params, problem=P, schedule=S, arch=arch)


# ---------------------------------------------------------------- several GEMMs of one A

_EXCHANGE = re.compile(r"__shared__ float4 part\[(\d+)\]\[32\];[^\n]*\n?")  # _render_mma's, between warps


def group_schedule(problems) -> GemvSchedule | MmaGemvSchedule:
    """One schedule for GEMMs launched together (render_group): the tensor-core form where any
    member would take it (more than one row, or partials), laid out for their columns together;
    else the FMA form with the most columns a warp any member wants (2 for a pairwise one)."""
    p0 = problems[0]
    if any(isinstance(default_schedule(p), MmaGemvSchedule) for p in problems):
        return _mma_default(GemmProblem(p0.m, sum(p.n for p in problems), p0.k, p0.dtype, b_major="K"))
    fma = [_fma_default(p) for p in problems]
    return max(fma, key=lambda s: s.cols)


def render_group(problems, schedule: GemvSchedule | MmaGemvSchedule | None = None,
                 arch: str = "sm_90a") -> GemvSource:
    """GEMMs that read one A (a decode step's Q, K and V projections) in one launch: each
    member is rendered as by itself, under one schedule (group_schedule), as a device function
    of its CTA index, and the kernel hands CTAs [0, g0) to the first, [g0, g0 + g1) to the
    second, and so on. Why: a 4096-wide projection alone streams its 32 MB at ~3.1-3.3 TB/s
    on an H200, a 12288-wide one at 3.6-4.1 (bench/gemv.py, session 51): the small ones' ramp
    and tail are paid once instead of three times.

    The kernel's parameters: A, then each member's B and its epilogue's outputs and operands,
    named g<i>_<name> (`params` lists them after A and the first B, which keeps the name B, as
    a single GEMV's do)."""
    problems = tuple(problems)
    if len(problems) < 2:
        raise GemmError("a group is two or more GEMMs")
    p0 = problems[0]
    for p in problems[1:]:
        if (p.m, p.k, p.dtype) != (p0.m, p0.k, p0.dtype):
            raise GemmError(f"a group's GEMMs read one A: {p.m}x{p.k} {p.dtype} is not {p0.m}x{p0.k} {p0.dtype}")
    S = schedule or for_arch(group_schedule(problems), arch)
    members = [render(p, S, arch) for p in problems]
    head, kernels = members[0].source.split('extern "C"', 1)[0], []
    helpers = head[head.index(cexpr.PRELUDE):]
    params, cparams, calls, first, exchange = [], ["const uint4* __restrict__ A"], [], 0, None
    for i, src in enumerate(members):
        text = 'extern "C"' + src.source.split('extern "C"', 1)[1]
        sig_open = text.index(src.name + "(") + len(src.name) + 1
        sig_close = text.index(") {", sig_open)
        own = [x.strip() for x in text[sig_open:sig_close].split(",")]
        body = text[sig_close + len(") {"):].rstrip().removesuffix("}")
        if "gridDim" in body:
            raise GemmError(f"{src.name}: a member reads gridDim, which the group changes")
        # the warps' exchange buffer, declared once in the kernel: a static array in each member
        # would add up (4 members at 32 warps: 62 KB, past the 48 KB of static shared memory)
        found = _EXCHANGE.search(body)
        extra = ""
        if found:
            exchange = found.group(1)
            body = body[:found.start()] + body[found.end():]
            extra = ", float4 (*part)[32]"
        if "__shared__" in body:
            raise GemmError(f"{src.name}: a member declares shared memory the group does not know how to share")
        kernels.append(f"__device__ __forceinline__ void tf_member{i}({', '.join(own)}{extra}, const int tf_bid) {{"
                       + body.replace("blockIdx.x", "tf_bid") + "}\n")
        names = ["B"] + [_ident(n) for n in src.params]
        mine = ["B" if i == 0 and n == "B" else f"g{i}_{n}" for n in names]
        params += mine[1:] if i == 0 else mine
        cparams += [decl.rsplit(" ", 1)[0] + " " + m for decl, m in zip(own[1:], mine)]
        args = ", ".join(["A"] + mine + (["tf_part"] if found else []))
        last = i == len(members) - 1
        calls.append(f"  {'' if last else f'if (blockIdx.x < {first + src.grid[0]}) '}"
                     f"{{ tf_member{i}({args}, blockIdx.x - {first}); return; }}")
        first += src.grid[0]
    block = members[0].block
    h = hashlib.sha1(" ".join(m.name for m in members).encode()).hexdigest()[:10]
    knobs = members[0].name.split("_")[4]
    name = (f"tf_gemvg_{p0.m}x{'_'.join(str(p.n) for p in problems)}x{p0.k}_{p0.dtype}_{knobs}"
            f"{'_bc' if all(p.b_const for p in problems) else ''}_{h}")
    lines = [f"// {name}\n// {len(members)} GEMMs of one A ({p0.m} x {p0.k} {p0.dtype}) in one launch, {S}, for {arch}:"]
    lines += [f"//   CTAs from {sum(m.grid[0] for m in members[:i])}: {m.name}" for i, m in enumerate(members)]
    lines += [helpers] + kernels
    lines.append(f'extern "C" __global__ void __launch_bounds__({block[0]})\n{name}({", ".join(cparams)}) {{')
    if exchange:
        lines.append(f"  __shared__ float4 tf_part[{exchange}][32];   // each other warp's share of K, for whichever member runs")
    lines += calls + ["}\n"]
    return GemvSource(name=name, source="\n".join(lines), grid=(first, 1, 1), block=block, smem_bytes=0,
                      params=tuple(params), problem=p0, schedule=S, arch=arch,
                      members=tuple((p, m.params) for p, m in zip(problems, members)))

"""The sm_80 GEMM template: cp.async -> swizzled shared memory -> ldmatrix -> mma.sync
m16n8k16, multistage, with the same Loop IR epilogues as the Hopper template.

    C[b, m, n] = epilogue(sum_k A[b, m, k] * B[b, n, k])      (B "K-major": x @ W.T)
    C[b, m, n] = epilogue(sum_k A[b, m, k] * B[b, k, n])      (B "N-major": x @ W)

It runs on Ampere (sm_80, sm_86, sm_89) and on anything later (mma.sync runs on Hopper
too), and it takes what the sm_90 path cannot: rows that are not a multiple of 16 bytes
(TMA's rule; here the copy width follows the row length down to one element, and the
operands need only be aligned to that width), and GPUs without wgmma.

One CTA per BM x BN output tile (grouped tile order, GROUP_M tile rows at a time, so the
B tiles stay in L2; blockIdx.y is the batch), warps_m x warps_n warps, each owning a
(BM / warps_m) x (BN / warps_n) block of the tile as MI x NI m16n8 accumulators:
- every thread copies its share of the next A and B k-tiles with cp.async (16, 8 or 4
  bytes a copy, the widest the row length allows; out-of-range chunks are zero-filled by
  giving cp.async a source size of 0), STAGES - 1 k-tiles ahead, one commit group each;
- per k-tile: wait for the oldest group, one __syncthreads, refill the stage that was
  read last, then for each 16-deep K slice ldmatrix.x4 the A and B fragments (one slice
  ahead, double-buffered in registers) and issue mma.sync m16n8k16 with f32 accumulators;
- the epilogue program runs once per accumulator register and stores straight to global
  memory (two adjacent 16-bit outputs in one 4-byte store when they can share one).

Everything layout-shaped comes from `tilefuse.layout` and is built in one place,
`layouts()`: the shared-memory tiles (swizzled atoms tiled over the k-tile), the copy
partition ((thread, value) -> tile element), the ldmatrix address of every thread (the MMA
operand fragment composed with the inverse of ldmatrix's register layout), and the
accumulator's (thread, value) -> (row, col) map (the m16n8 C fragment placed per warp and
per MMA). Constant steps between the addresses a thread uses (the next 16 rows, the next
K slice) are read off those layouts as an XOR inside the swizzle's span plus an offset
above it, and checked for every thread at render time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..layout import Layout, c_index, c_tv_coords, composition, hopper, make_layout, mma, right_inverse
from ..layout.mma import Fragment
from ..layout.swizzle import ComposedLayout
from ..loop import ir
from . import cexpr, epilogue as epi
from .gemm_sm90 import GemmError, GemmProblem, _check_epilogue, _ident, _pair_store, _render_element

SMEM_LIMITS = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_87": 163 * 1024, "sm_89": 99 * 1024,
               "sm_90": 227 * 1024, "sm_90a": 227 * 1024}
_MMA_TYPE = {"bf16": "bf16", "f16": "f16"}

__all__ = ["GemmProblem", "GemmError", "Sm80Schedule", "Sm80Source", "Sm80Layouts", "default_schedule",
           "layouts", "render", "vector_width", "smem_limit"]


def smem_limit(arch: str) -> int:
    """Dynamic shared memory one block may use on `arch` (the opt-in maximum)."""
    if arch in SMEM_LIMITS:
        return SMEM_LIMITS[arch]
    major = int("".join(c for c in arch.split("_")[1] if c.isdigit())[:-1] or 0)
    return 227 * 1024 if major >= 9 else 99 * 1024


@dataclass(frozen=True)
class Sm80Schedule:
    """The knobs: the CTA tile (bm x bn, bk deep), pipeline stages, the warp grid, tile order."""

    bm: int = 128
    bn: int = 128
    bk: int = 32
    stages: int = 4
    warps_m: int = 2
    warps_n: int = 2
    group_m: int = 8

    def __post_init__(self):
        if self.warps_m < 1 or self.warps_n < 1 or self.warps > 16:
            raise GemmError(f"warps_m={self.warps_m} x warps_n={self.warps_n}: want 1 to 16 warps")
        if self.bm % (16 * self.warps_m):
            raise GemmError(f"bm={self.bm} must be a multiple of 16 * warps_m = {16 * self.warps_m} "
                            f"(each warp owns whole m16 MMA rows)")
        if self.bn % (16 * self.warps_n):
            raise GemmError(f"bn={self.bn} must be a multiple of 16 * warps_n = {16 * self.warps_n} "
                            f"(each warp reads B in n16 ldmatrix.x4 blocks)")
        if self.bk not in (16, 32, 64):
            raise GemmError(f"bk={self.bk} must be 16, 32 or 64 (a k-tile row is one 32/64/128-byte swizzle span)")
        if not 2 <= self.stages <= 8:
            raise GemmError(f"stages={self.stages} must be in [2, 8]")
        if self.group_m < 1:
            raise GemmError(f"group_m={self.group_m} must be positive")
        if self.acc_regs > 128:
            raise GemmError(f"a {self.warp_m_tile}x{self.warp_n_tile} warp tile needs {self.acc_regs} "
                            f"accumulator registers per thread; at most 128 fit beside the fragments")

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_n

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def warp_m_tile(self) -> int:
        return self.bm // self.warps_m

    @property
    def warp_n_tile(self) -> int:
        return self.bn // self.warps_n

    @property
    def mi(self) -> int:
        """m16 MMA tiles per warp."""
        return self.warp_m_tile // 16

    @property
    def ni(self) -> int:
        """n8 MMA tiles per warp."""
        return self.warp_n_tile // 8

    @property
    def acc_regs(self) -> int:
        return self.mi * self.ni * 4

    def stage_bytes(self, elem_bytes: int = 2) -> int:
        return (self.bm + self.bn) * self.bk * elem_bytes

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return self.stages * self.stage_bytes(elem_bytes) + 128  # + alignment slack

    def __str__(self):
        return (f"Sm80Schedule(tile {self.bm}x{self.bn}x{self.bk}, {self.stages} stages, "
                f"warps {self.warps_m}x{self.warps_n}, group_m {self.group_m})")


def default_schedule(problem: GemmProblem, sms: int = 132) -> Sm80Schedule:
    """The biggest tile that still gives about one wave of CTAs (a heuristic until the tuner
    has one). 128x128x32 with 4 stages was within timing noise of the best tile on the H100
    sweep (bench/LOG_gemm_sm80.md) and needs 64 KB of shared memory, which every Ampere/Ada
    part has; smaller tiles keep more SMs busy on small problems."""
    candidates = [Sm80Schedule(128, 128, 32, 4, 2, 2), Sm80Schedule(64, 128, 32, 4, 2, 2),
                  Sm80Schedule(64, 64, 32, 4, 2, 2)]

    def waves(s):
        return -(-problem.m // s.bm) * -(-problem.n // s.bn) * problem.batch / sms

    for s in candidates:
        if waves(s) >= 0.9:
            return s
    return candidates[-1]


def vector_width(extent: int) -> int:
    """Elements per cp.async copy along a contiguous dimension of `extent` elements: the
    widest of 8, 4, 2 (16, 8, 4 bytes) that divides it, so that no copy straddles two rows
    and every row starts aligned; 1 (plain loads and stores) when the extent is odd."""
    for v in (8, 4, 2):
        if extent % v == 0:
            return v
    return 1


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class _Steps:
    """How a thread's address for one value follows from its base address: (base ^ xor) + add
    (element offsets), checked for every thread; None when no such constants exist."""

    xor: int
    add: int


@dataclass(frozen=True)
class Sm80Layouts:
    """Everything layout-shaped in one kernel, built by `layouts()` from tilefuse.layout.

    Tiles are (MN, K) coordinates: A (BM, BK), B (BN, BK). Fragments map (tid, value) to
    the column-major index of their tile, so `frag(tid, v)` is (row, col).
    """

    smem_a: ComposedLayout       # (m, k) -> element offset in the A stage
    smem_b: ComposedLayout       # (n, k) -> element offset in the B stage
    b_major: str                 # "K" (K contiguous in B's rows) or "N"
    vec_a: int                   # elements per copy
    vec_b: int
    copy_a: Fragment             # (tid, (vec, chunk)) -> (m, k)
    copy_b: Fragment             # (tid, (vec, chunk)) -> (n, k)
    ldsm_a: Fragment             # (tid, (8, mi, kk)) -> (m, k): the 8 elements of ldmatrix rows
    ldsm_b: Fragment             # (tid, (8, np, kk)) -> (n, k)
    acc: Fragment                # (tid, (4, mi, ni)) -> (m, n)
    steps_copy_a: tuple = ()     # per chunk: _Steps of its smem offset from chunk 0's
    steps_copy_b: tuple = ()
    steps_ldsm_a: dict = field(default_factory=dict)   # (mi, kk) -> _Steps
    steps_ldsm_b: dict = field(default_factory=dict)   # (np, kk) -> _Steps


def _smem_tile(mn: int, bk: int, major: str) -> ComposedLayout:
    """A swizzled (MN, K) stage tile: the widest 16-bit swizzle atom whose line fits the
    contiguous extent (128-byte lines take Sw<3,3,3>), repeated over the tile."""
    contiguous = bk if major == "K" else mn
    span = min(128, 2 * contiguous)
    if span not in (32, 64, 128) or contiguous * 2 % span:
        raise GemmError(f"a {'K' if major == 'K' else 'N'}-contiguous tile {contiguous} elements wide "
                        f"fits no 32/64/128-byte swizzle atom")
    return hopper.gmma_smem_layout(major, span, 16, (mn, bk))


def _copy_fragment(mn: int, bk: int, contiguous: str, vec: int, threads: int, name: str) -> Fragment:
    """(tid, (vec, chunk)) -> (mn, k): consecutive threads take consecutive vec-element
    chunks along the contiguous dimension, then the next line; `chunk` repeats over the tile."""
    if contiguous == "K":
        lines = Layout((bk // vec, mn), (mn * vec, 1))        # chunk index (along K first) -> tile index
        elem = Layout(vec, mn)
    else:
        lines = Layout((mn // vec, bk), (vec, mn))
        elem = Layout(vec, 1)
    chunks = mn * bk // vec
    if chunks % threads:
        raise GemmError(f"{name}: {chunks} copies of {vec} elements do not split over {threads} threads")
    per = composition(lines, Layout((threads, chunks // threads), (1, threads)))
    tv = make_layout(per[0], make_layout(elem, per[1]))
    return Fragment(f"{name} copy ({vec} x 16-bit)", tv, (mn, bk))


def _ldsm_fragment(operand: Fragment, trans: bool) -> Layout:
    """(lane, c) -> operand-tile index of the element that lane's ldmatrix.x4 row address
    names (c = 0) and the 7 after it: the operand fragment composed with the inverse of
    ldmatrix's register layout (which register pair lands where), then with ldmatrix's
    row-address pattern."""
    dst = mma.ldmatrix_dst(4, trans)
    if (operand.threads, operand.values) != (dst.threads, dst.values):
        raise GemmError(f"{operand.name} does not match one ldmatrix.x4")
    stacked_to_tile = composition(operand.tv, right_inverse(dst.tv))
    return composition(stacked_to_tile, mma.ldmatrix_rows(4).tv)


def _b_pair() -> Fragment:
    """Two m16n8k16 B fragments side by side along N (n16 x k16): what one ldmatrix.x4 fills;
    values (2, 2) of the first n8 block, then the same for the second."""
    b = mma.sm80_16x8x16_b()
    placed = composition(Layout((8, 16), (1, 16)), b.tv)   # (8, 16) index -> (16, 16) index
    tv = make_layout(placed[0], make_layout(placed[1], Layout(2, 8)))
    return Fragment("sm80 m16n8k16 B x2 (n16)", tv, (16, 16))


def _embed(lane_tv: Layout, sub: tuple[int, int], tile_rows: int) -> Layout:
    """The same (lane, value) map, onto the column-major index of a taller tile."""
    return composition(Layout(sub, (1, tile_rows)), lane_tv)


def _steps(base, target, tids, swz_bits: int) -> _Steps | None:
    """Constants (x, y) with target(t) == (base(t) ^ x) + y for every t, x below 2^swz_bits,
    y a multiple of it: the swizzle only permutes inside spans of 2^swz_bits elements."""
    lo = (1 << swz_bits) - 1
    b0, t0 = base(tids[0]), target(tids[0])
    x, y = (b0 ^ t0) & lo, (t0 & ~lo) - (b0 & ~lo)
    if all(target(t) == (base(t) ^ x) + y for t in tids):
        return _Steps(x, y)
    return None


def _swizzle_span_bits(layout) -> int:
    sw = layout.outer
    return 0 if sw.bits == 0 else sw.base + max(sw.shift, 0) + sw.bits


def layouts(problem: GemmProblem, s: Sm80Schedule) -> Sm80Layouts:
    """All layouts of the kernel for this problem and schedule (see Sm80Layouts)."""
    bm, bn, bk, T = s.bm, s.bn, s.bk, s.threads
    smem_a = _smem_tile(bm, bk, "K")
    smem_b = _smem_tile(bn, bk, "K" if problem.b_major == "K" else "MN")
    vec_a = vector_width(problem.k)
    vec_b = vector_width(problem.k if problem.b_major == "K" else problem.n)
    copy_a = _copy_fragment(bm, bk, "K", vec_a, T, "A")
    copy_b = _copy_fragment(bn, bk, "K" if problem.b_major == "K" else "N", vec_b, T, "B")

    wm, wn = s.warp_m_tile, s.warp_n_tile
    kk_n = bk // 16
    # ldmatrix addresses: A is (m, k) with k contiguous (no .trans); B K-major the same,
    # B N-major is read with .trans (its 16-byte rows run along n)
    addr_a = _ldsm_fragment(mma.sm80_16x8x16_a(), trans=False)
    la = _embed(addr_a, (16, 16), bm)
    ldsm_a = Fragment("A ldmatrix.x4 rows", make_layout(
        make_layout(la[0], Layout((s.warps_m, s.warps_n), (wm, 0))),
        make_layout(la[1], Layout(s.mi, 16), Layout(kk_n, 16 * bm))), (bm, bk))
    addr_b = _ldsm_fragment(_b_pair(), trans=problem.b_major == "N")
    lb = _embed(addr_b, (16, 16), bn)
    ldsm_b = Fragment("B ldmatrix.x4 rows", make_layout(
        make_layout(lb[0], Layout((s.warps_m, s.warps_n), (0, wn))),
        make_layout(lb[1], Layout(s.ni // 2, 16), Layout(kk_n, 16 * bn))), (bn, bk))
    c = _embed(mma.sm80_16x8x16_c().tv, (16, 8), bm)
    acc = Fragment("accumulators", make_layout(
        make_layout(c[0], Layout((s.warps_m, s.warps_n), (wm, wn * bm))),
        make_layout(c[1], Layout(s.mi, 16), Layout(s.ni, 8 * bm))), (bm, bn))

    tids = range(T)

    def off(smem, frag, v):
        return lambda t: smem(*frag(t, v))

    def steps(smem, frag, values):
        bits = _swizzle_span_bits(smem)
        return tuple(_steps(off(smem, frag, 0), off(smem, frag, v), tids, bits) for v in values)

    chunks_a, chunks_b = copy_a.values // vec_a, copy_b.values // vec_b
    lay = Sm80Layouts(
        smem_a, smem_b, problem.b_major, vec_a, vec_b, copy_a, copy_b, ldsm_a, ldsm_b, acc,
        steps_copy_a=steps(smem_a, copy_a, [vec_a * i for i in range(chunks_a)]),
        steps_copy_b=steps(smem_b, copy_b, [vec_b * i for i in range(chunks_b)]),
        steps_ldsm_a=dict(zip([(i, k) for k in range(kk_n) for i in range(s.mi)],
                              steps(smem_a, ldsm_a, [8 * (i + s.mi * k) for k in range(kk_n) for i in range(s.mi)]))),
        steps_ldsm_b=dict(zip([(p, k) for k in range(kk_n) for p in range(s.ni // 2)],
                              steps(smem_b, ldsm_b, [8 * (p + s.ni // 2 * k) for k in range(kk_n)
                                                     for p in range(s.ni // 2)]))))
    _check_rows(lay)
    return lay


def _check_rows(lay: Sm80Layouts):
    """Every ldmatrix row and every copy is contiguous and aligned in shared memory (the
    hardware reads/writes 16 (or vec * 2) bytes at the address): a layout that broke this
    would read the wrong elements, so refuse it here rather than render it."""
    for smem, frag, width in ((lay.smem_a, lay.ldsm_a, 8), (lay.smem_b, lay.ldsm_b, 8),
                              (lay.smem_a, lay.copy_a, lay.vec_a), (lay.smem_b, lay.copy_b, lay.vec_b)):
        for v0 in range(0, frag.values, width):
            for t in range(0, frag.threads, 7):
                start = smem(*frag(t, v0))
                if start % width or any(smem(*frag(t, v0 + j)) != start + j for j in range(width)):
                    raise GemmError(f"{frag.name}: thread {t} value {v0} is not {width} contiguous aligned "
                                    f"elements of {smem}")


# ---------------------------------------------------------------- the source


PRELUDE = r"""// ---- sm_80 GEMM primitives: cp.async, ldmatrix, mma.sync
__device__ __forceinline__ void tf_cp_async16(unsigned dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tf_cp_async8(unsigned dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tf_cp_async4(unsigned dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tf_st_shared_u16(unsigned dst, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;" :: "r"(dst), "h"(v) : "memory");
}
__device__ __forceinline__ void tf_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void tf_cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void tf_ldsm_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void tf_ldsm_x4_trans(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
"""


def _mma_fn(dtype: str) -> str:
    t = _MMA_TYPE[dtype]
    return (
        "__device__ __forceinline__ void tf_mma(float* d, const unsigned* a, const unsigned* b) {\n"
        f"  asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\"\n"
        "    : \"+f\"(d[0]), \"+f\"(d[1]), \"+f\"(d[2]), \"+f\"(d[3])\n"
        "    : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));\n}\n")


@dataclass(frozen=True)
class Sm80Source:
    """A rendered kernel and how to launch it: grid (tiles, batch), params after A and B."""

    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    params: tuple[str, ...]           # epilogue outputs then operands, after the A and B pointers
    problem: GemmProblem
    schedule: Sm80Schedule
    layouts: Sm80Layouts
    arch: str
    align_a: int                      # bytes the A and B pointers must be aligned to (one copy)
    align_b: int
    pair_store: bool                  # outputs written two 16-bit elements per 4-byte store


def kernel_name(problem: GemmProblem, s: Sm80Schedule, kernel: ir.Kernel) -> str:
    from ..loop.canon import structural_hash

    h = structural_hash(kernel)[:10]
    return (f"tf_gemm_sm80_{problem.batch}x{problem.m}x{problem.n}x{problem.k}_{problem.dtype}_b{problem.b_major}"
            f"_{s.bm}x{s.bn}x{s.bk}s{s.stages}w{s.warps_m}x{s.warps_n}g{s.group_m}_{h}")


def _stepped(base: str, st: _Steps | None, full: str, scale: int = 2) -> str:
    """C for an address `base` moved by constant steps (byte offsets; `full` if none fit)."""
    if st is None:
        return full
    e = base
    if st.xor:
        e = f"({e} ^ {st.xor * scale}u)"
    if st.add:
        e = f"{e} + {st.add * scale}u"
    return e


def _copy_lines(name: str, ptr: str, lay_smem, frag: Fragment, vec: int, steps_: tuple, glob: Layout,
                mn0: str, mn_extent: int, k_extent: int, mn_tail: bool, k_tail: bool) -> tuple[list, list]:
    """(setup, per-k-tile) lines copying one operand's k-tile into shared memory.

    Setup binds the thread's chunk-0 coordinates (from the copy fragment) and its swizzled
    shared-memory offset; each chunk's coordinates and offset are constant steps from those.
    """
    mn_e, k_e = c_tv_coords(frag, "tid", 0)
    setup = [f"const int {name}_mn = {mn_e};", f"const int {name}_k = {k_e};",
             f"const unsigned {name}_st = ({c_index(lay_smem, (f'{name}_mn', f'{name}_k'))}) * 2u;"]
    body = []
    for i, st in enumerate(steps_):
        dmn, dk = frag(0, i * vec)
        full = f"({c_index(lay_smem, (f'{name}_mn + {dmn}', f'{name}_k + {dk}'))}) * 2u"
        dst = f"st_{name} + {_stepped(f'{name}_st', st, full)}"
        conds = []
        body.append("{")
        body.append(f"  const long long gmn = {mn0} + {name}_mn + {dmn};")
        body.append(f"  const long long gk = k0 + {name}_k + {dk};")
        if mn_tail:
            conds.append(f"gmn < {mn_extent}")
        if k_tail:
            conds.append(f"gk < {k_extent}")
        ok = " && ".join(conds) if conds else "true"
        goff = c_index(glob, ("gmn", "gk"))
        body.append(f"  const bool ok = {ok};")
        body.append(f"  const unsigned short* src = {ptr} + (ok ? {goff} : 0);")
        if vec == 1:
            body.append(f"  tf_st_shared_u16({dst}, ok ? *src : (unsigned short)0);")
        else:
            body.append(f"  tf_cp_async{vec * 2}({dst}, src, ok ? {vec * 2}u : 0u);")
        body.append("}")
    return setup, body


def _epilogue_lines(problem: GemmProblem, kernel: ir.Kernel, frag: Fragment, full_tiles: bool) -> list[str]:
    """Per accumulator register acc[v]: bind (b, m, n) from the accumulator fragment, run the
    epilogue body (gemm_sm90's element renderer), store. Register v of thread tid holds
    element frag(tid, v) = frag(tid, 0) + frag(0, v): only the thread's base is computed at
    run time, every register's offset is a constant."""
    body = epi.inner_body(kernel)
    row_e, col_e = c_tv_coords(frag, "tid", 0)
    lines = [f"const int frag_row = {row_e};", f"const int frag_col = {col_e};"]
    if epi.is_pairwise(kernel):  # one output element per register pair (v, v + 1)
        for v in range(0, frag.values, 2):
            r, c = frag(0, v)
            lines += ["{", f"  const int m = row_base + frag_row + {r};",
                      f"  const int n = (col_base + frag_col + {c}) >> 1;",
                      f"  if (m < {problem.m} && 2 * n < {problem.n}) {{"]
            _render_element(kernel, body, [f"acc[{v}]", f"acc[{v + 1}]"], "n", lines, "", store=True)
            lines += ["  }", "}"]
        return lines
    packs = _pair_store(kernel, body)
    for v in range(0, frag.values, 2 if packs else 1):
        r, c = frag(0, v)
        lines += ["{", f"  const int m = row_base + frag_row + {r};", f"  const int n = col_base + frag_col + {c};"]
        if packs:
            guard = "" if full_tiles else f"if (m < {problem.m} && n < {problem.n}) "
            vals = [_render_element(kernel, body, f"acc[{v + e}]", f"n + {e}", lines, f"_{e}", store=False)
                    for e in (0, 1)]
            (buf, off), (x0, x1) = vals[0][0], (vals[0][1], vals[1][1])
            lines.append(f"  {guard}*(unsigned*)({buf} + {off}) = (unsigned){cexpr.to_storage(packs, x0)} | "
                         f"((unsigned){cexpr.to_storage(packs, x1)} << 16);")
        else:
            lines.append(f"  if (m < {problem.m} && n < {problem.n}) {{")
            _render_element(kernel, body, f"acc[{v}]", "n", lines, "", store=True)
            lines.append("  }")
        lines.append("}")
    return lines


def render(problem: GemmProblem, schedule: Sm80Schedule | None = None, arch: str = "sm_80") -> Sm80Source:
    """CUDA C++ for one GEMM (+ epilogue) at fixed shapes, for sm_80 or any later arch."""
    S = schedule or default_schedule(problem)
    P = problem
    kernel = P.out_epilogue
    _check_epilogue(P, kernel)
    smem = S.smem_bytes()
    limit = smem_limit(arch)
    if smem > limit:
        raise GemmError(f"{S} needs {smem} bytes of shared memory; {arch} allows {limit} per block")
    lay = layouts(P, S)
    name = kernel_name(P, S, kernel)
    tiles_m, tiles_n = -(-P.m // S.bm), -(-P.n // S.bn)
    k_iters = -(-P.k // S.bk)
    a_bytes = S.bm * S.bk * 2
    kk_n = S.bk // 16
    np_n = S.ni // 2
    full_tiles = P.m % S.bm == 0 and P.n % S.bn == 0
    ops_params = epi.operands(kernel)
    out_params = kernel.outputs
    cparams = ["const unsigned short* __restrict__ A", "const unsigned short* __restrict__ B"]
    cparams += [f"{cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in out_params]
    cparams += [f"const {cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in ops_params]

    # global operands as layouts over (MN, K, batch): A [B, M, K]; B [B, N, K] or [B, K, N]
    glob_a = Layout((P.m, P.k, P.batch), (P.k, 1, P.m * P.k))
    if P.b_major == "K":
        glob_b = Layout((P.n, P.k, P.batch), (P.k, 1, P.n * P.k))
    else:
        glob_b = Layout((P.n, P.k, P.batch), (1, P.n, P.n * P.k))
    k_tail = P.k % S.bk != 0
    set_a, cp_a = _copy_lines("a", "A", lay.smem_a, lay.copy_a, lay.vec_a, lay.steps_copy_a,
                              Layout(glob_a.shape[:2], glob_a.stride[:2]), "row_base", P.m, P.k,
                              P.m % S.bm != 0, k_tail)
    set_b, cp_b = _copy_lines("b", "B", lay.smem_b, lay.copy_b, lay.vec_b, lay.steps_copy_b,
                              Layout(glob_b.shape[:2], glob_b.stride[:2]), "col_base", P.n, P.k,
                              P.n % S.bn != 0, k_tail)
    batch_a, batch_b = glob_a.stride[2], glob_b.stride[2]

    ra, ca = c_tv_coords(lay.ldsm_a, "tid", 0)
    rb, cb = c_tv_coords(lay.ldsm_b, "tid", 0)
    ldsm_b = "tf_ldsm_x4_trans" if P.b_major == "N" else "tf_ldsm_x4"

    def frag_loads(buf: int, kk: int) -> list[str]:
        out = []
        for i in range(S.mi):
            r0, c0 = lay.ldsm_a(0, 8 * (i + S.mi * kk))
            full = f"({c_index(lay.smem_a, (f'a_r + {r0}', f'a_c + {c0}'))}) * 2u"
            out.append(f"tf_ldsm_x4(af[{buf}][{i}], sa + {_stepped('a_ld', lay.steps_ldsm_a[(i, kk)], full)});")
        for p in range(np_n):
            r0, c0 = lay.ldsm_b(0, 8 * (p + np_n * kk))
            full = f"({c_index(lay.smem_b, (f'b_r + {r0}', f'b_c + {c0}'))}) * 2u"
            out.append(f"{ldsm_b}(bf[{buf}][{p}], sb + {_stepped('b_ld', lay.steps_ldsm_b[(p, kk)], full)});")
        return out

    def mmas(buf: int) -> list[str]:
        out = []
        for i in range(S.mi):
            js = range(S.ni) if i % 2 == 0 else reversed(range(S.ni))  # serpentine: reuse B registers
            for j in js:
                v = 4 * (i + S.mi * j)  # acc fragment value index of (0, i, j)
                out.append(f"tf_mma(acc + {v}, af[{buf}][{i}], bf[{buf}][{j // 2}] + {2 * (j % 2)});")
        return out

    compute = frag_loads(0, 0)
    for kk in range(kk_n):
        if kk + 1 < kk_n:
            compute += frag_loads((kk + 1) % 2, kk + 1)
        compute += mmas(kk % 2)

    src = []
    w = src.append
    w(f"// {name}\n// {P.batch} x ({P.m} x {P.k}) @ ({P.n} x {P.k} {'K-major' if P.b_major == 'K' else 'N-major'}) "
      f"{P.dtype}, {S}, for {arch}")
    w(f"// A stage {lay.smem_a}; copies of {lay.vec_a}: {lay.copy_a.tv}")
    w(f"// B stage {lay.smem_b}; copies of {lay.vec_b}: {lay.copy_b.tv}")
    w(f"// ldmatrix A {lay.ldsm_a.tv}\n// ldmatrix B {lay.ldsm_b.tv}\n// accumulators {lay.acc.tv}")
    w(f"// epilogue {kernel.name}: " + "; ".join(str(s) for s in epi.inner_body(kernel)))
    w(cexpr.PRELUDE)
    w(PRELUDE)
    w(_mma_fn(P.dtype))
    ind = "\n  "
    w(f"""
#define STAGES {S.stages}
#define K_ITERS {k_iters}
#define TILES_M {tiles_m}
#define TILES_N {tiles_n}
#define GROUP_M {S.group_m}
#define BK {S.bk}
#define A_BYTES {a_bytes}
#define STAGE_BYTES {S.stage_bytes()}

extern "C" __global__ void __launch_bounds__({S.threads}, 1)
{name}({", ".join(cparams)}) {{
  extern __shared__ __align__(128) unsigned char tf_smem_raw[];
  const unsigned smem = (tf_smem_addr(tf_smem_raw) + 127u) & ~127u;
  const int tid = threadIdx.x;
  // grouped tile order: GROUP_M tile rows at a time walk along N
  int t = blockIdx.x;
  const int per_group = GROUP_M * TILES_N;
  const int first_m = (t / per_group) * GROUP_M;
  const int rows = min(TILES_M - first_m, GROUP_M);
  const int tm = first_m + (t % per_group) % rows;
  const int tn = (t % per_group) / rows;
  const long long batch = blockIdx.y;
  const int row_base = tm * {S.bm};
  const int col_base = tn * {S.bn};
  A += batch * {batch_a}LL;
  B += batch * {batch_b}LL;
  {ind.join(set_a)}
  {ind.join(set_b)}
  const int a_r = {ra};
  const int a_c = {ca};
  const unsigned a_ld = ({c_index(lay.smem_a, ('a_r', 'a_c'))}) * 2u;
  const int b_r = {rb};
  const int b_c = {cb};
  const unsigned b_ld = ({c_index(lay.smem_b, ('b_r', 'b_c'))}) * 2u;

  auto load_tile = [&](int kt, int stage) {{
    const int k0 = kt * BK;
    const unsigned st_a = smem + stage * STAGE_BYTES, st_b = st_a + A_BYTES;
    {(chr(10) + '    ').join(cp_a)}
    {(chr(10) + '    ').join(cp_b)}
  }};

  float acc[{S.acc_regs}];
  #pragma unroll
  for (int i = 0; i < {S.acc_regs}; ++i) acc[i] = 0.f;
  unsigned af[2][{S.mi}][4], bf[2][{np_n}][4];

  #pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {{
    if (s < K_ITERS) load_tile(s, s);
    tf_cp_commit();
  }}
  int rd = 0, wr = STAGES - 1;
  for (int kt = 0; kt < K_ITERS; ++kt) {{
    tf_cp_wait<STAGES - 2>();
    __syncthreads();   // stage rd has landed for everyone; everyone is done reading stage wr
    if (kt + STAGES - 1 < K_ITERS) load_tile(kt + STAGES - 1, wr);
    tf_cp_commit();
    const unsigned sa = smem + rd * STAGE_BYTES, sb = sa + A_BYTES;
    {(chr(10) + '    ').join(compute)}
    if (++rd == STAGES) rd = 0;
    if (++wr == STAGES) wr = 0;
  }}
  tf_cp_wait<0>();
""")
    for line in _epilogue_lines(P, kernel, lay.acc, full_tiles):
        w("  " + line)
    w("}\n")
    params = tuple(p.name for p in out_params) + tuple(p.name for p in ops_params)
    return Sm80Source(name=name, source="\n".join(src), grid=(tiles_m * tiles_n, P.batch, 1),
                      block=(S.threads, 1, 1), smem_bytes=smem, params=params, problem=P, schedule=S,
                      layouts=lay, arch=arch, align_a=2 * lay.vec_a, align_b=2 * lay.vec_b,
                      pair_store=bool(_pair_store(kernel, epi.inner_body(kernel))) and not epi.is_pairwise(kernel))

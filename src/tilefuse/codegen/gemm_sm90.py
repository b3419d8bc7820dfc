"""The Hopper (sm_90a) GEMM template: TMA -> swizzled shared memory -> wgmma, warp
specialized and persistent, with a Loop IR epilogue run on the accumulator registers.

    C[b, m, n] = epilogue(sum_k A[b, m, k] * B[b, n, k])      (B "K-major": x @ W.T)
    C[b, m, n] = epilogue(sum_k A[b, m, k] * B[b, k, n])      (B "N-major": x @ W)

One CTA of (consumers + 1) warpgroups runs on each SM and walks the output tiles in a
grouped order (GROUP_M tile rows at a time, so the B tiles stay in L2):
- warpgroup 0, one thread: the producer. For each K step it waits until a stage is empty,
  then has TMA copy the A and B tiles into it, completing on the stage's `full` barrier.
- warpgroups 1..consumers: each owns BM/consumers rows of the tile, issues wgmma
  m64nBNk16 on descriptors into the stage, keeps one wgmma group in flight and releases
  the previous stage through its `empty` barrier; then runs the epilogue on its
  registers and stores through swizzled shared-memory slots and TMA (one 16-bit output
  at out[m, n]) or straight to global memory (anything else).
`setmaxnreg` moves registers from the producer to the consumers. With `cluster_m=2`, CTA
pairs along M share tn: each loads half of the B tile and multicasts it to both, and a
consumer releases a stage in both CTAs (a remote arrive, without `.release.cluster`: that
qualifier costs a GPU-wide MEMBAR per K step). `cluster_n=2` is the same along N: pairs
share tm and each loads half of the A tile (for few tile rows, where every A row block is
read by every column of tiles).

Everything layout-shaped comes from `tilefuse.layout`: the shared-memory tile layouts
(`gmma_smem_layout`), the TMA box and swizzle mode, the wgmma descriptor fields and K-step
offsets, and the accumulator's (thread, value) -> (row, col) map (`sm90_64xN_c`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ..layout import cgen, hopper, mma
from ..layout.layout import Layout
from ..loop import ir
from . import cexpr, epilogue as epi

SMEM_LIMIT = 227 * 1024   # H100 dynamic shared memory per block
OPERAND_DTYPES = ("bf16", "f16")
_WGMMA_TYPE = {"bf16": "bf16", "f16": "f16"}


class GemmError(ValueError):
    """The problem or the schedule is outside what this template can run."""


@dataclass(frozen=True)
class GemmProblem:
    """What to compute: shapes, operand dtype and layouts, the epilogue program."""

    m: int
    n: int
    k: int
    dtype: str = "bf16"
    b_major: str = "K"           # "K": B is [N, K] (nn.Linear's weight); "N": B is [K, N]
    batch: int = 1
    epilogue: ir.Kernel | None = field(default=None, compare=False)
    m_arg: bool | None = None    # M a kernel argument (the source holds no M, so one cubin serves every
                                 # M of a tail class): None, wherever the schedule allows (rows_as_argument)
    b_const: bool = False        # B is a program's weight, which no kernel writes: its first stages are
                                 # loaded before the wait for the kernel before (programmatic launch)

    def __post_init__(self):
        if self.dtype not in OPERAND_DTYPES:
            raise GemmError(f"GEMM operands must be one of {OPERAND_DTYPES}, not {self.dtype}")
        if min(self.m, self.n, self.k, self.batch) < 1:
            raise GemmError(f"GEMM sizes must be positive: m={self.m} n={self.n} k={self.k} batch={self.batch}")
        if self.b_major not in ("K", "N"):
            raise GemmError(f"b_major must be 'K' or 'N', not {self.b_major!r}")

    @property
    def M(self) -> str:
        """M as the source writes it: the kernel argument `tf_m`, or the number."""
        return "tf_m" if self.m_arg else str(self.m)

    @property
    def out_epilogue(self) -> ir.Kernel:
        return self.epilogue if self.epilogue is not None else epi.standard(
            self.m, self.n, self.dtype, batch=self.batch)

    def tma_ok(self) -> str | None:
        """Why TMA cannot read these operands (row strides must be multiples of 16 bytes)."""
        if self.k * 2 % 16:
            return f"K={self.k}: A's rows ({self.k * 2} bytes) are not a multiple of 16 bytes"
        if self.b_major == "N" and self.n * 2 % 16:
            return f"N={self.n}: B's rows ({self.n * 2} bytes) are not a multiple of 16 bytes"
        return None


@dataclass(frozen=True)
class GemmSchedule:
    """The knobs. Cooperative (the default): both consumers share one BM x BN tile, BM/consumers
    rows each. Ping-pong: each of the 2 consumers owns a whole BM x BN tile, and their main
    loops take turns, so one warpgroup's epilogue runs while the other's MMAs do."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 4
    consumers: int = 2
    group_m: int = 8
    cluster_m: int = 1          # 2: CTA pairs along M share each B tile through TMA multicast
    cluster_n: int = 1          # 2: CTA pairs along N share each A tile through TMA multicast
    producer_regs: int = 40     # the pool's limit beside two 232-register consumers; one consumer
                                # leaves room, and its producer keeps at least ONE_CONSUMER_PRODUCER_REGS
    consumer_regs: int = 232
    tma_store: bool = True      # registers -> swizzled shared memory -> TMA store, where the epilogue allows
    pingpong: bool = False      # each consumer its own tile, main loops in turn (needs 2 consumers)
    split_k: int = 1            # K cut in this many slices, each its own work unit; partial sums meet in a workspace
    stream_k: int = 0           # > 0: the grid is this many CTAs (one per SM), and the last waves' tiles are
                                # shared out among them by K steps, so every CTA ends at the same time
    tma_loads: bool = False     # the epilogue's residual tile loaded by TMA into the store slots during the
                                # main loop, a slot per 64-column box (where it applies: tma_residual)
    defer_stores: bool = True   # a tile's TMA-store slots written under the next tile's first MMAs
                                # (where it applies: defers_stores)

    def __post_init__(self):
        if self.consumers not in (1, 2):
            raise GemmError(f"consumers must be 1 or 2 warpgroups, not {self.consumers}")
        if self.pingpong and self.consumers != 2:
            raise GemmError("a ping-pong schedule takes turns between 2 consumer warpgroups")
        if self.pingpong and (self.bm % 64 or self.bm > 128):
            raise GemmError(f"bm={self.bm}: a ping-pong consumer owns the whole tile, 64 or 128 rows")
        if not 1 <= self.split_k <= 16:
            raise GemmError(f"split_k={self.split_k} must be in [1, 16]")
        if self.split_k > 1 and (self.pingpong or self.cluster_m > 1):
            raise GemmError("split_k > 1 takes neither ping-pong consumers nor 2-CTA clusters")
        if not 0 <= self.stream_k <= 1024:
            raise GemmError(f"stream_k={self.stream_k} must be 0 (off) or a CTA count up to 1024")
        if self.stream_k and (self.split_k > 1 or self.pingpong):
            raise GemmError("stream_k takes neither split-K nor ping-pong consumers")
        if self.stream_k % (self.cluster_m * self.cluster_n):
            raise GemmError(f"stream_k={self.stream_k} CTAs do not make whole 2-CTA clusters")
        if not self.pingpong and (self.bm % (64 * self.consumers) or self.bm // self.consumers > 128):
            raise GemmError(f"bm={self.bm} must be 64 or 128 rows per consumer warpgroup "
                            f"({self.consumers} consumers)")
        if self.bn % 8 or not 8 <= self.bn <= 256:
            raise GemmError(f"bn={self.bn} must be a multiple of 8 in [8, 256] (wgmma N)")
        if self.bk != 64:
            raise GemmError(f"bk={self.bk}: this template reads K in 64-element (128-byte) swizzle spans")
        if self.cluster_m not in (1, 2):
            raise GemmError(f"cluster_m must be 1 or 2, not {self.cluster_m}")
        if self.cluster_m == 2 and self.bn % 16:
            raise GemmError(f"bn={self.bn}: a 2-CTA cluster splits the B tile in halves of whole 8-row atoms")
        if self.cluster_n not in (1, 2):
            raise GemmError(f"cluster_n must be 1 or 2, not {self.cluster_n}")
        if self.cluster_n > 1 and (self.cluster_m > 1 or self.split_k > 1 or self.pingpong):
            raise GemmError("cluster_n=2 takes no cluster along M, no split-K and no ping-pong consumers")
        if not 2 <= self.stages <= 16:  # a 64x64 tile's 16 KB stages fit 14 deep in shared memory
            raise GemmError(f"stages={self.stages} must be in [2, 16]")
        if self.acc_regs > 160:
            raise GemmError(f"bm={self.bm} x bn={self.bn} needs {self.acc_regs} accumulator registers "
                            f"per thread; at most 160 fit")

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def rows_per_wg(self) -> int:
        return self.bm if self.pingpong else self.bm // self.consumers

    @property
    def acc_regs(self) -> int:
        return self.rows_per_wg // 64 * self.bn // 2

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        stage = (self.bm + self.bn) * self.bk * elem_bytes
        return self.stages * stage + 2 * self.stages * 8 + 1024  # + barriers + alignment slack

    @property
    def span(self) -> tuple[int, int]:
        """Output rows and columns one cluster covers: tiles are counted in these units, and a
        tail is what falls short of one."""
        return self.bm * self.cluster_m, self.bn * self.cluster_n

    def __str__(self):
        cluster = (f", cluster {self.cluster_m}x1 (B multicast)" if self.cluster_m > 1 else
                   f", cluster 1x{self.cluster_n} (A multicast)" if self.cluster_n > 1 else "")
        store = "" if self.tma_store else ", direct stores"
        wgs = "2 ping-pong consumers" if self.pingpong else f"{self.consumers} consumer warpgroups"
        split = f", split-K {self.split_k}" if self.split_k > 1 else ""
        split += f", stream-K over {self.stream_k}" if self.stream_k else ""
        split += ", residual by TMA" if self.tma_loads else ""
        split += "" if self.defer_stores else ", stores not deferred"
        return (f"GemmSchedule(tile {self.bm}x{self.bn}x{self.bk}, {self.stages} stages, "
                f"{wgs}, group_m {self.group_m}{cluster}{store}{split})")


def default_schedule(problem: GemmProblem, sms: int = 132) -> GemmSchedule:
    """A heuristic pick until the tuner has one (_heuristic_schedule); stores deferred to the
    next tile (defers_stores) only where some CTA has a next tile: at 512x4096x4096 (128
    tiles, one per CTA) deferring was 0.6% slower under ncu, every store left to after the
    loop (s15)."""
    s = _heuristic_schedule(problem, sms)
    if -(-problem.m // s.bm) * -(-problem.n // s.bn) * problem.batch <= sms:
        s = replace(s, defer_stores=False)
    return s


def _heuristic_schedule(problem: GemmProblem, sms: int) -> GemmSchedule:
    """The biggest tile that still fills the GPU.

    From the H100 sweep in bench/LOG_gemm.md (round 2):
    - 128x256 tiles (the largest that fit 2 x 64 x 256 accumulators) wherever they make at
      least 0.9 waves, storing through shared memory and TMA (5-15% over 4-byte pair stores
      at large shapes);
    - of those, 2-CTA clusters multicasting B where M >= 4096 (a third less L2 -> SM
      traffic). Until session 12 only where also N <= 8192: the round-2 single-sample sweep
      had the cluster 1-8% slower at N >= 11008 and M <= 6144. Session 12 timed both twice,
      interleaved, in one run (bench/results/gemm_cluster_flip_h100_s12.json): with the
      cluster 6144^3 631 against 667 us, 8192x14336x4096 1395 against 1410, 4096^3 184.4
      against 185.5, 8192x11008x4096 1016 against 1027 (samples 987-1058); and the shapes
      that had it were 1-4% slower without;
    - 128x128 next, storing through TMA (512x4096x4096, session 8: 0.985x cuBLAS against 0.881x
      storing from registers, same run);
    - smaller tiles for small M, storing straight from registers, 64x64 with a 12-deep ring
      (128x4096x4096, session 8: 1.016x cuBLAS against 0.971x with 8 stages).
    """
    width = epi.partial_width(problem.epilogue) if problem.epilogue is not None else None
    if width is not None and problem.m <= SMALL_M and problem.batch == 1 and 256 % width == 0:
        return _small_m_schedule(problem, sms, width)
    if width is not None:  # partial row reductions: tiles of whole column groups only
        if inline_partials(problem, problem.epilogue) is not None:
            # beside the element code, the partials leave it its store path: the plain pick
            # where its tile holds whole groups
            s = _plain_schedule(problem, sms)
            if s.bn % width == 0:
                return s
        return _default_for_partials(problem, width, sms)
    return _plain_schedule(problem, sms)


def _plain_schedule(problem: GemmProblem, sms: int) -> GemmSchedule:
    """_heuristic_schedule's pick, partials aside."""
    m, n = problem.m, problem.n
    if m <= SMALL_M and problem.batch == 1:
        return _small_m_schedule(problem, sms)
    big = GemmSchedule(128, 256, stages=4)
    candidates = [big, GemmSchedule(128, 128, stages=6),
                  GemmSchedule(128, 64, stages=8, consumers=2, tma_store=False),
                  GemmSchedule(64, 128, stages=8, consumers=1, tma_store=False),
                  GemmSchedule(64, 64, stages=12, consumers=1, tma_store=False)]

    def waves(s):
        tiles = -(-m // s.bm) * -(-n // s.bn) * problem.batch
        return tiles / sms

    for s in candidates:
        if waves(s) >= 0.9 or s is candidates[-1]:
            if s is big and m >= 4096 and problem.batch == 1:
                return _with_tma_residual(_with_stream_k(GemmSchedule(128, 256, stages=4, cluster_m=2), problem, sms),
                                          problem)
            return _with_stream_k(_with_split(s, problem, sms), problem, sms)
    return _with_split(candidates[-1], problem, sms)


SMALL_M = 64          # rows one 64-row tile holds: below this the GEMM streams B (decode's projections)
# (tile width, ring depth) for short M, narrowest first: the deepest ring each width fits
# (64x64: 14 stages of 16 KB in 227 KB; 64x128: 9 of 24 KB); 64x256 (5 of 40 KB) past them
SMALL_M_RINGS = ((64, 14), (128, 9))
SPLIT_SMALL_M_STAGES = 12  # the ring of a short-M tile sliced along K


def _small_m_schedule(problem: GemmProblem, sms: int, multiple: int = 1) -> GemmSchedule:
    """Where one 64-row tile holds all of M, the time is B's bytes streamed through the SMs,
    and what sets the rate is how many bytes are in flight: CTAs x ring depth x B's bytes a
    stage. So the narrowest 64-row tile whose tiles fit one wave (every CTA one tile, none
    idle for a second round), with the deepest ring it fits; past 64x128's wave, 64x256 (5
    stages) with stream-K as the tile count asks. Few tiles (a quarter of the SMs or less)
    also take _with_split's K slices. H200 sweep, M = 1 (bench/LOG_gemm.md, session 46; us,
    cuBLAS in brackets): 1x4096x4096 13.8 (15.7) with 64x64 x 14 stages against 17.5 with
    64x128 x 6 and 24.1 with 64x256 x 5; 1x4096x11008 29.2 (29.6) against 32.9 with 64x128 x
    9; 1x11008x4096 26.7-27.4 (26.5) with 64x128 x 6-9 against 29.3 with 64x256 x 5 and 29.9
    with 64x64 (172 tiles: a second round for 40 CTAs); 1x22016x4096 48.4-48.7 (50.4) with
    64x256 x 4-5 against 50.9-52.9 for the narrower tiles' rounds; 64x4096x4096 14.4 (14.3)
    with 64x64 x 14 against 16.3 for session 37's 64x64 x 12 with 2 slices. Within a width,
    fewer stages were slower at every shape (64x64 at 1x4096x11008: 36.4, 31.1, 29.2 us with
    6, 10, 14). Stores go straight from registers (a one-row tile has nothing for TMA to
    gather). `multiple`: tile widths must be multiples of it (partial row reductions' groups)."""
    for bn, stages in SMALL_M_RINGS:
        tiles = -(-problem.n // bn)
        if tiles <= sms and bn % multiple == 0:
            s = GemmSchedule(64, bn, stages=stages, consumers=1, tma_store=False)
            if tiles * 4 > sms:
                return s
            split = _with_split(s, problem, sms)
            # sliced, session 37's 12-deep ring: at 1x1024x2816 (2 slices) 14 stages took 10.5 us
            # against 9.8-9.9 (H200, session 46)
            return replace(split, stages=min(stages, SPLIT_SMALL_M_STAGES)) if split.split_k > 1 else split
    return _with_stream_k(GemmSchedule(64, 256, stages=5, consumers=1, tma_store=False), problem, sms)


TMA_RESIDUAL_MAX_K_STEPS = 32   # the residual by TMA (3 stages) where K takes at most this many steps


def _with_tma_residual(s: GemmSchedule, problem: GemmProblem) -> GemmSchedule:
    """The residual loaded by TMA into the store slots (tma_residual), which takes the 128x256
    tile's ring from 4 stages to 3, where K is short. ncu, one launch each (bench/LOG_gemm.md,
    session 14): 8192x2048x2048 103.2 us against 107.2 loading it into registers (plain 95.3);
    at K = 4096 and 5632 the ring's fourth stage is worth more (374.7 against 365.6 us at
    8192x4096x4096, 253.7 against 247.7 at 8192x2048x5632)."""
    if s.bn != 256 or -(-problem.k // s.bk) > TMA_RESIDUAL_MAX_K_STEPS:
        return s
    t = replace(s, tma_loads=True, stages=3)
    return t if problem.epilogue is not None and tma_residual(problem, t, problem.epilogue) else s


STREAM_K_IDLE = 0.06  # stream-K where whole tiles would leave more than this share of the last wave's time idle


def _with_stream_k(s: GemmSchedule, problem: GemmProblem, sms: int) -> GemmSchedule:
    """Stream-K where whole tiles would waste much of the last wave. Whole waves take
    ceil(w) tile times for w waves of work; past STREAM_K_IDLE of waste, sharing the last
    waves out by K steps pays. On an H100 (bench/LOG_gemm.md, session 12): 1152x4096x4096
    (1.09 waves) 87.0 -> 60.0 us, 2304x4096x4096 133.3 -> 114.3, 3072x3072x4096 131.3 ->
    114.1, 4096x4352x4096 (4.12 waves) 226.5 -> 211.5, 8192x4352x4096 (8.24) 427 -> 419.5;
    at issue 4's shapes (3% waste or less) it was 0-7% slower (its cut tiles' f32 halves, and
    L2 reuse lost where CTAs are not in step), the power-limited clock already making up
    much of a short last wave."""
    if s.split_k > 1 or s.pingpong:
        return s
    cl = s.cluster_m * s.cluster_n
    tiles = -(-problem.m // s.span[0]) * -(-problem.n // s.span[1]) * problem.batch
    workers = sms // cl
    if tiles < workers or -(-tiles // workers) * workers / tiles - 1 <= STREAM_K_IDLE:
        return s
    return replace(s, stream_k=workers * cl)


def _with_split(s: GemmSchedule, problem: GemmProblem, sms: int) -> GemmSchedule:
    """Split-K where whole tiles leave at least half the SMs idle: the most slices (4, else 2)
    whose units still fit one wave, each slice at least 16 K steps. On an H100 (LOG_gemm,
    session 6): 128x1024x8192 22.5 -> 14.5 us with 4 slices, 128x2048x14336 37.1 -> 29.9 us and
    64x4096x16384 55.4 -> 53.2 us with 2; at 128x4096x4096 and 512x4096x4096 (enough tiles)
    every split measured slower, and this leaves them whole."""
    tiles = -(-problem.m // s.bm) * -(-problem.n // s.bn) * problem.batch
    if s.cluster_m > 1 or s.cluster_n > 1 or tiles * 2 > sms:
        return s
    k_iters = -(-problem.k // s.bk)
    for split in (4, 2):
        if tiles * split <= sms and k_iters >= 16 * split:
            return replace(s, split_k=split)
    return s


def _default_for_partials(problem: GemmProblem, width: int, sms: int) -> GemmSchedule:
    """The default for an epilogue with partial row reductions over `width` columns: the first
    of 128x256 (4 stages) and 128x128 (6 stages) that holds whole groups and makes about a wave
    (the plain default's first two candidates; stores go from registers, so no TMA-store slots),
    else 64x128 with one consumer, else the widest bn that is a multiple of `width`. Not yet
    measured on a GPU."""
    cands = [GemmSchedule(128, 256, stages=4, tma_store=False), GemmSchedule(128, 128, stages=6, tma_store=False),
             GemmSchedule(64, 128, stages=8, consumers=1, tma_store=False)]
    cands = [s for s in cands if s.bn % width == 0]
    if not cands:
        bn = max((b for b in range(width, 257, width) if b % 8 == 0), default=None)
        if bn is None:
            raise GemmError(f"partial row reductions over {width} columns: no tile width in [8, 256] holds "
                            f"whole groups")
        return GemmSchedule(128, bn, stages=4, tma_store=False)
    for s in cands:
        if -(-problem.m // s.bm) * -(-problem.n // s.bn) * problem.batch / sms >= 0.9:
            return s
    return cands[-1]


@dataclass(frozen=True)
class GemmSource:
    name: str
    source: str
    grid_tiles: int                   # output tiles (pairs, with a cluster); the launcher runs min(tiles, SMs/cluster) clusters
    block: tuple[int, int, int]
    smem_bytes: int
    params: tuple[str, ...]           # launch order after the two tensor maps
    problem: GemmProblem
    schedule: GemmSchedule
    a_box: tuple[int, int]            # TMA boxes (contiguous dim first)
    b_box: tuple[int, int]
    swizzle: hopper.TmaSwizzle
    cluster: int = 1
    notes: tuple[str, ...] = ()
    c_box: tuple[int, int] | None = None   # TMA store box of the output (contiguous dim first); None: direct stores
    workspace: int = 0                # split-K: f32 partial sums (elements), passed after the tensor maps
    flags: int = 0                    # split-K: int32 arrival counters, zero before a launch and left zero after
    pair_loads: tuple[str, ...] = ()  # operands read as 4-byte column pairs: they must start 4-byte aligned
    exact_grid: bool = False          # stream-K: run exactly grid_tiles clusters, whatever the SM count
    tma_loads: tuple[str, ...] = ()   # epilogue operands also passed as tensor maps (after c_map), c_box boxes
    packed_tables: tuple[tuple[str, int], ...] = ()  # (operand, W): read in pack_table's column order
    m_arg: bool = False               # M is the kernel's last argument (an int), after the pointers


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class _Operand:
    """One operand's shared-memory tile and what TMA and wgmma need to know about it."""

    layout: object          # (MN, K) -> element offset, swizzled
    major: str              # "K" or "MN"
    box: tuple[int, int]    # TMA box, contiguous dimension first
    boxes: int              # TMA copies per stage
    box_step: int           # bytes between consecutive boxes in shared memory
    desc: hopper.GmmaDescriptor
    k_offsets: tuple[int, ...]   # byte offset of each 16-wide K slice (pre-swizzle)
    mn_stride: int          # bytes between 64-row (MN) blocks

    @property
    def bytes(self) -> int:
        return hopper.smem_bytes(self.layout, 16)


def _operand(mn: int, bk: int, major: str) -> _Operand:
    if major == "K":
        layout = hopper.gmma_smem_layout("K", 128, 16, (mn, bk))
        box = hopper.tma_box(layout, "K", 16)
        boxes, step = 1, 0
    else:
        if mn % 64:
            raise GemmError(f"an MN-major operand tile must be a multiple of 64 wide (one 128-byte "
                            f"swizzle span), not {mn}")
        # MN-major: one TMA box is 64 MN-elements (one 128-byte span) by all bk K rows, so
        # the atoms go K first inside a box, boxes side by side along MN.
        atom = hopper.gmma_atom("MN", 128, 16)
        span = 64
        inner = Layout(((span, mn // span), (8, bk // 8)), ((1, span * bk), (span, span * 8)))
        layout = type(atom)(atom.outer, atom.offset, inner)
        box = (span, bk)
        boxes, step = mn // span, span * bk * 2
    desc = hopper.gmma_descriptor(layout, major, 16)
    inner = layout.inner

    def byte(m, k):
        return (inner(m, k) - inner(0, 0)) * 2

    k_offsets = tuple(byte(0, 16 * j) for j in range(bk // 16))
    mn_stride = byte(64, 0) if mn > 64 else 0
    return _Operand(layout, major, box, boxes, step, desc, k_offsets, mn_stride)


def rows_as_argument(problem: GemmProblem, sched: GemmSchedule) -> str | None:
    """Why this kernel must hold M as a number, or None where M can be its argument `tf_m`.

    A prompt of a new length is a new M for every GEMM of a model; with M an argument, the
    source is the same for every M of a tail class (M a multiple of the tile's rows or not),
    so a new length builds no GEMM where it takes the same schedule. Split-K's units and
    stream-K's shares are cut from the tile count in the kernel (their workspaces, sized on
    the host, grow to the largest asked). What stays baked: batched GEMMs (M sits in the
    batch strides) and an M under one tile (TMA then fills only M's rows: a_rows)."""
    if problem.batch > 1:
        return f"batch={problem.batch}: M is in the batch strides"
    if a_rows(problem, sched) != sched.bm:
        return f"M={problem.m} is under one tile: TMA fills only its rows"
    return None


def a_rows(problem: GemmProblem, sched: GemmSchedule) -> int:
    """Rows of A that TMA loads into a stage: where all of M fits one tile (a decode step's
    M = 1), whole 8-row swizzle atoms up to M; the tile's other rows keep whatever the shared
    memory held, which only reaches accumulator rows past M, never stored or reduced. Less to
    fill per stage: 1 KB instead of 8 at M = 1."""
    if problem.m >= sched.bm or sched.cluster_m > 1 or sched.cluster_n > 1:
        return sched.bm
    return -(-problem.m // 8) * 8


# ---------------------------------------------------------------- the source


PRELUDE = r"""// ---- sm_90a GEMM primitives: mbarrier, TMA, wgmma
typedef unsigned long long tf_u64;
struct __align__(64) tf_tmap { tf_u64 v[16]; };

__device__ __forceinline__ void tf_bar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void tf_bar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tf_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void tf_bar_wait(unsigned bar, unsigned parity) {
  unsigned ok = 0;
  do {
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  } while (!ok);
}
__device__ __forceinline__ void tf_tma_load(unsigned dst, const tf_tmap* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"((tf_u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void tf_tma_load_evict_first(unsigned dst, const tf_tmap* map, int c0, int c1, int c2,
                                                        unsigned bar) {
  asm volatile("{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n\t"
               "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3, %4}], [%5], pol;\n\t}"
               :: "r"(dst), "l"((tf_u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void tf_tma_load_mc(unsigned dst, const tf_tmap* map, int c0, int c1, int c2, unsigned bar,
                                               unsigned short mask) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3, %4}], [%5], %6;"
               :: "r"(dst), "l"((tf_u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ void tf_bar_arrive_cta(unsigned bar, unsigned rank) {
  asm volatile("{\n\t.reg .b32 r;\n\tmapa.shared::cluster.u32 r, %0, %1;\n\t"
               "mbarrier.arrive.shared::cluster.b64 _, [r];\n\t}" :: "r"(bar), "r"(rank) : "memory");
}
__device__ __forceinline__ void tf_cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void tf_sts32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void tf_stsm4(unsigned addr, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ unsigned tf_lds32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void tf_sts16(unsigned addr, unsigned short v) {
  asm volatile("st.shared.b16 [%0], %1;" :: "r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ void tf_fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void tf_named_bar(unsigned id, unsigned count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void tf_named_arrive(unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ int tf_bar_any(unsigned id, unsigned count, int p) {
  int r;
  asm volatile("{\n\t.reg .pred q, r;\n\tsetp.ne.s32 q, %1, 0;\n\tbar.red.or.pred r, %2, %3, q;\n\t"
               "selp.s32 %0, 1, 0, r;\n\t}" : "=r"(r) : "r"(p), "r"(id), "r"(count) : "memory");
  return r;
}
__device__ __forceinline__ void tf_tma_store(const tf_tmap* map, unsigned src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               :: "l"((tf_u64)map), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tf_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void tf_bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void tf_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void tf_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void tf_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
"""


def _wgmma_fn(n: int, dtype: str, trans_b: int) -> str:
    """The wgmma m64nNk16 call with N/2 fp32 accumulators, as an inline function."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    args = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    t = _WGMMA_TYPE[dtype]
    return (
        f"__device__ __forceinline__ void tf_wgmma(float* d, tf_u64 da, tf_u64 db) {{\n"
        f"  asm volatile(\"{{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, 1, 0;\\n\\t\"\n"
        f"    \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} {{{outs}}}, %{regs}, %{regs + 1}, "
        f"p, 1, 1, 0, {trans_b};\\n\\t}}\"\n"
        f"    : {args}\n"
        f"    : \"l\"(da), \"l\"(db) : \"memory\");\n}}\n")


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _epilogue_code(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel,
                   inl: InlinePartials | None = None) -> list[str]:
    """Per accumulator register: bind (b, m, n), run the epilogue body, store (with `inl`, also
    add its terms to the partials' registers: InlinePartials).

    The (thread, value) -> (row, col) map is the wgmma accumulator fragment's; each value's
    column offset is a constant, so every index below folds at compile time except the
    thread's own row/col base.
    """
    body = epi.inner_body(kernel)
    frag = mma.sm90_64xN_c(sched.bn)
    lines = []
    mb_count = sched.rows_per_wg // 64
    row0, _ = cgen.c_tv_coords(frag, "tid", 0)  # row of value 0 (values 2,3 are 8 rows down)
    lines.append(f"const int frag_row = {row0};")
    lines.append(f"const int frag_col = {cgen.c_tv_coords(frag, 'tid', 0)[1]};")
    full_tiles = _full_tiles(problem, sched)
    if epi.is_pairwise(kernel):  # one output element per register pair (v, v + 1)
        full = _full_pair_store(kernel, body)  # or two, at columns 2n and 2n + 1: one 4-byte store
        for mb in range(mb_count):
            for v in range(0, frag.values, 2):
                r, c = frag(0, v)
                lines.append("{")
                lines.append(f"  const int m = row_base + {mb * 64} + frag_row + {r};")
                lines.append(f"  const int n = (col_base + frag_col + {c}) >> 1;")
                lines.append(f"  if (m < {problem.M} && 2 * n < {problem.n}) {{")
                accs = [f"acc[{mb}][{v}]", f"acc[{mb}][{v + 1}]"]
                if full:
                    (buf, off), x0, x1 = _pair_values(kernel, body, accs, lines)
                    lines.append(f"    *(unsigned*)({buf} + {off}) = (unsigned){cexpr.to_storage(full, x0)} | "
                                 f"((unsigned){cexpr.to_storage(full, x1)} << 16);")
                else:
                    _render_element(kernel, body, accs, "n", lines, "", store=True)
                lines.append("  }")
                lines.append("}")
        return lines
    packs = _pair_store(kernel, body)
    pairs = _pair_loads(kernel, body, tma_store=False)
    for mb in range(mb_count):
        for v in range(0, frag.values, 2 if packs else 1):
            r, c = frag(0, v)  # offsets relative to thread 0's element
            lines.append("{")
            lines.append(f"  const int m = row_base + {mb * 64} + frag_row + {r};")
            lines.append(f"  const int n = col_base + frag_col + {c};")
            if packs:
                # on tail tiles the guard also covers the epilogue's operand loads (bias[n],
                # residual[m, n], ...), which must not read past their tensors
                if not full_tiles:
                    lines.append(f"  if (m < {problem.M} && n < {problem.n}) {{")
                vals = []
                halves = _issue_pair_loads(kernel, pairs, lines, "  ")
                for e in (0, 1):
                    vals.append(_element(kernel, body, inl, frag, mb, v + e, f"n + {e}", lines, f"_{e}",
                                         store=False, loaded=halves[e]))
                (buf, off), (x0, x1) = vals[0][0], (vals[0][1], vals[1][1])
                lines.append(f"  *(unsigned*)({buf} + {off}) = "
                             f"(unsigned){cexpr.to_storage(packs, x0)} | ((unsigned){cexpr.to_storage(packs, x1)} << 16);")
                if not full_tiles:
                    lines.append("  }")
            else:
                lines.append(f"  if (m < {problem.M} && n < {problem.n}) {{")
                _element(kernel, body, inl, frag, mb, v, "n", lines, "", store=True)
                lines.append("  }")
            lines.append("}")
    return lines


# Partial row reductions (epilogue.py's partials loop): each consumer warpgroup owns whole rows
# of the tile, so a row's partial over a group of W columns is complete inside it. Per row
# a thread holds and per group: the reduction over the thread's own registers of that group,
# then across the lanes that share the row (xor 1 and 2 of the lane: a quad, checked against
# the fragment by `partial_quads`), then one lane of the quad stores it. Reductions run in
# the loop's order, with the row statements between them, so a sum of exp(y - max) sees the
# group's whole max (two passes over registers cost no memory traffic, and need one
# exchange each where a running (max, sum) pair would need a rescale per merge).
_PARTIAL_COMBINE = {"sum": ("{a} + {b}", 0.0), "max": ("tf_max({a}, {b})", float("-inf")),
                    "min": ("tf_min({a}, {b})", float("inf"))}
QUAD_XOR = (1, 2)   # lane masks whose __shfl_xor_sync partners hold the same rows


def partial_quads(frag, width: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """For the accumulator fragment `frag` (64 x BN) and column groups of `width`: which
    (thread, register) pairs hold each (row, group), checked to be what _partials_code assumes,
    else GemmError: a register's group is the same in every thread (thread 0's column // W),
    the threads holding a (row, group) are one quad {q, q ^ 1, q ^ 2, q ^ 3} (so the xor
    shuffles of QUAD_XOR reach exactly them), every thread of it holds registers there, and
    every element of the tile is in exactly one (row, group)."""
    return {key: list(held) for key, held in _quad_owners(frag, width)}


@functools.lru_cache(maxsize=64)
def _quad_owners(frag, width: int) -> tuple:
    # partial_quads' check, once per (fragment, width): it visits every element of the tile,
    # and every render of a GEMM with partials asks for it.
    rows, cols = frag.tile
    if cols % width:
        raise GemmError(f"{cols} columns do not split into groups of {width}")
    owners: dict[tuple[int, int], list[tuple[int, int]]] = {}
    seen = set()
    for t in range(frag.threads):
        for v in range(frag.values):
            r, c = frag(t, v)
            if c // width != frag(0, v)[1] // width:
                raise GemmError(f"register {v}: its column group differs between threads")
            if (r, c) in seen:
                raise GemmError(f"element {(r, c)} is held twice")
            seen.add((r, c))
            owners.setdefault((r, c // width), []).append((t, v))
    if len(seen) != rows * cols:
        raise GemmError("the fragment does not cover its tile")
    for key, held in owners.items():
        threads = {t for t, _ in held}
        q = min(threads) & ~3
        if threads != {q | j for j in range(4)}:
            raise GemmError(f"row {key[0]}, group {key[1]}: held by threads {sorted(threads)}, not one quad")
    return tuple((key, tuple(held)) for key, held in owners.items())


def _fast_exps(body, outer: set) -> frozenset:
    """exp ops of a partial's body whose argument is y - s with s a row value (the shift of a
    sum of exp(y - max)): their argument is <= 0 where it counts, so ex2.approx suffices
    (see mapreduce._emit_online_chunk)."""
    defs = {x.dst: x for x in body if isinstance(x, ir.Op)}
    out = set()
    for x in body:
        if isinstance(x, ir.Op) and x.op == "exp" and x.dtype == "f32":
            d = defs.get(x.args[0])
            if d is not None and d.op == "sub" and d.args[1] in outer:
                out.add(x.dst)
    return frozenset(out)


def _partial_indices(x, col, wrapped, clamp: bool):
    """Statement x of a partial's body with the group's column (t * W + c, or its wrap % N)
    spelled n: loads read at nc (n clamped into the row on tail tiles), index values use n."""
    def sub(e, by):
        if e == wrapped or e == col:
            return ir.Var(by)
        if isinstance(e, ir.IBin):
            return ir.IBin(e.op, sub(e.a, by), sub(e.b, by))
        return e

    if isinstance(x, ir.Load):
        return ir.Load(x.dst, x.buf, tuple(sub(e, "nc" if clamp else "n") for e in x.index))
    if isinstance(x, ir.IndexValue):
        return ir.IndexValue(x.dst, sub(x.expr, "n"), x.dtype)
    return x


def _index_leaves(index) -> set:
    out = set()
    for e in index:
        if isinstance(e, ir.IBin):
            out |= _index_leaves((e.a, e.b))
        else:
            out.add(e)
    return out


def _partials_code(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel,
                   frag_coords: bool = True) -> list[str]:
    """The partials loop of one consumer warpgroup (see _PARTIAL_COMBINE above): per 64-row
    block, per row of the thread's two (frag rows r and r + 8), per W-column group of the tile.
    Rows past M and columns past N read operands at the last row / column (clamped) and are not
    stored; the masks the program has past N keep the group's values exact."""
    loop = epi.partials_loop(kernel)
    w = epi.partial_width(kernel)
    frag = mma.sm90_64xN_c(sched.bn)
    partial_quads(frag, w)
    P = problem
    groups_per_tile = sched.bn // w
    tail_m, tail_n = P.m % sched.span[0] != 0, P.n % sched.span[1] != 0
    col = ir.IBin("+", ir.IBin("*", ir.Var("t"), ir.IConst(w)), ir.Var("c"))
    wrapped = ir.IBin("%", col, ir.IConst(P.n))
    row0, col0 = cgen.c_tv_coords(frag, "tid", 0)
    lines = [f"const int frag_row = {row0};", f"const int frag_col = {col0};"] if frag_coords else []
    env = {"m": "mc", "t": "grp", "nc": "nc", "n": "n"}
    halves = sorted({frag(0, v)[0] for v in range(frag.values)})
    for mb in range(sched.rows_per_wg // 64):
        for r in halves:
            for g in range(groups_per_tile):
                regs = [v for v in range(frag.values) if frag(0, v)[0] == r and frag(0, v)[1] // w == g]
                lines.append("{")
                lines.append(f"  const int m = row_base + {mb * 64} + frag_row + {r};")
                lines.append(f"  const int mc = {f'min(m, {P.M} - 1)' if tail_m else 'm'};")
                lines.append(f"  const int grp = tn * {groups_per_tile} + {g};")
                names: dict[str, str] = {}
                dts: dict[str, str] = {}
                stores = []
                for x in loop.body:
                    if isinstance(x, ir.Store):
                        stores.append(x)
                    elif isinstance(x, ir.Reduce):
                        _render_partial(kernel, x, mb, regs, frag, lines, env, (names, dts), col, wrapped, tail_n,
                                        P.n)
                    else:
                        _render_element(kernel, [x], None, "n", lines, "", store=False, env=env, scope=(names, dts))
                lines += _partial_stores(P, kernel, stores, names, groups_per_tile, tail_m)
                lines.append("}")
    return lines


# Partials beside the element code ("inline"): where each partial is a sum, max or min of a
# body that needs nothing the partials loop computes between them (a sum of squares, a max;
# not a log-sum-exp's shifted sum), every element the element code computes also adds its term
# to a register per (64-row block, row of the two, group), from the values the element code has
# just made: the statements of a partial's body that copy the element's (codegen/epilogue.py's
# `chain`) reuse the element's registers, so a residual is read once, and the element code keeps
# its own store path (TMA store, residual by TMA, clusters). After the tile's last element: the
# quad exchange and the stores of _partials_code. (The loop form above re-renders each body from
# the accumulators after the element code: a second read of every tile operand, and stores from
# registers; s17 measured it +14-60% on a residual GEMM, bench/gemm_partials_cost.py.)
@dataclass(frozen=True)
class InlinePartials:
    reds: tuple                  # the partials loop's Reduces
    twins: tuple                 # per Reduce: {copy's SSA name: the element statement's}
    rest: tuple                  # per Reduce: its body's statements that are not copies (masks), n for the column
    width: int


def inline_partials(problem: GemmProblem, kernel: ir.Kernel) -> InlinePartials | None:
    """The partials of `kernel` as the element code can take them, else None (no partials, no
    element code, or a partial that reads a value the partials loop computes)."""
    loop = epi.partials_loop(kernel)
    body = epi.inner_body(kernel)
    if loop is None or not body or epi.is_pairwise(kernel):
        return None
    if any(not isinstance(x, (ir.Reduce, ir.Store)) for x in loop.body):
        return None
    w = epi.partial_width(kernel)
    col = ir.IBin("+", ir.IBin("*", ir.Var("t"), ir.IConst(w)), ir.Var("c"))
    wrapped = ir.IBin("%", col, ir.IConst(problem.n))
    elem = {x.dst: x for x in body if not isinstance(x, ir.Store)}
    reds, twins, rests = [], [], []
    for red in loop.body:
        if not isinstance(red, ir.Reduce):
            continue
        defined = {x.dst for x in red.body}
        if any(isinstance(x, ir.Op) and not set(x.args) <= defined for x in red.body):
            return None
        tw: dict[str, str] = {}
        rest = []
        for x in red.body:
            y = _partial_indices(x, col, wrapped, False)
            e = _twin_of(y, elem, tw)
            if e is not None:
                tw[x.dst] = e
            else:
                rest.append(y)
        reds.append(red)
        twins.append(tw)
        rests.append(tuple(rest))
    return InlinePartials(tuple(reds), tuple(twins), tuple(rests), w)


def _twin_of(y, elem: dict, twins: dict) -> str | None:
    """The element statement that partial statement `y` (its column spelled n) copies, or None:
    `y` is named e's name + _p<k> and computes what e does (its args the copies of e's)."""
    base = y.dst.rsplit("_p", 1)[0] if "_p" in y.dst else None
    e = elem.get(base)
    if e is None or type(e) is not type(y):
        return None
    if isinstance(y, ir.Op):
        same = (y.op, y.dtype, len(y.args)) == (e.op, e.dtype, len(e.args)) and all(
            twins.get(a) == b for a, b in zip(y.args, e.args))
    elif isinstance(y, ir.Load):
        same = y.buf == e.buf and tuple(y.index) == tuple(e.index)
    elif isinstance(y, ir.Const):
        same = (y.value, y.dtype) == (e.value, e.dtype)
    elif isinstance(y, ir.IndexValue):
        same = (y.expr, y.dtype) == (e.expr, e.dtype)
    else:
        same = False
    return base if same else None


def _inline_acc(i: int, mb: int, r: int, g: int) -> str:
    return f"pp{i}_{mb}_{r}_{g}"


def inline_partials_decl(sched: GemmSchedule, inl: InlinePartials) -> list[str]:
    """The partials' registers of one tile, at their identities (before the element code)."""
    frag = mma.sm90_64xN_c(sched.bn)
    halves = sorted({frag(0, v)[0] for v in range(frag.values)})
    out = []
    for i, red in enumerate(inl.reds):
        ident = cexpr.const(_PARTIAL_COMBINE[red.op][1], "f32")
        names = [_inline_acc(i, mb, r, g) for mb in range(sched.rows_per_wg // 64) for r in halves
                 for g in range(sched.bn // inl.width)]
        out.append(f"float {', '.join(f'{x} = {ident}' for x in names)};")
    return out


def _element(kernel, body, inl: InlinePartials | None, frag, mb: int, v: int, n_expr: str, lines: list,
             suffix: str, **kw):
    """_render_element of accumulator register (mb, v), and with `inl` its partials' terms."""
    scope = ({}, {})
    out = _render_element(kernel, body, f"acc[{mb}][{v}]", n_expr, lines, suffix, scope=scope, **kw)
    if inl is not None:
        inline_partials_add(kernel, inl, frag, mb, v, f"acc[{mb}][{v}]", n_expr, lines, scope, suffix)
    return out


def inline_partials_add(kernel, inl: InlinePartials, frag, mb: int, v: int, acc_expr: str, n_expr: str,
                        lines: list, scope: tuple[dict, dict], suffix: str):
    """Element (mb, v)'s terms, added to its (row, group) registers; `scope` is the element's
    (C names, dtypes) just rendered, `n_expr` its column."""
    r, cc = frag(0, v)
    inline_partial_terms(kernel, inl, acc_expr, n_expr, lines, scope, suffix,
                         [_inline_acc(i, mb, r, cc // inl.width) for i in range(len(inl.reds))])


def inline_partial_terms(kernel, inl: InlinePartials, acc_expr: str, n_expr: str, lines: list,
                         scope: tuple[dict, dict], suffix: str, regs: list[str]):
    """One element's term of each partial (from the element's C names in `scope`, just
    rendered), combined into its register regs[i] (the GEMV shares this with the template)."""
    for i, red in enumerate(inl.reds):
        names, dts = dict(scope[0]), dict(scope[1])
        for copy, orig in inl.twins[i].items():
            names[copy], dts[copy] = names[orig], dts[orig]
        _render_element(kernel, list(inl.rest[i]), acc_expr, n_expr, lines, f"{suffix}_q{i}", store=False,
                        scope=(names, dts))
        lines.append(f"    {regs[i]} = {_PARTIAL_COMBINE[red.op][0].format(a=regs[i], b=names[red.value])};")


def inline_partials_finish(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel,
                           inl: InlinePartials) -> list[str]:
    """After the tile's element code: each register across its quad, then one lane stores it
    (needs frag_row, row_base, tn, batch in scope)."""
    loop = epi.partials_loop(kernel)
    frag = mma.sm90_64xN_c(sched.bn)
    partial_quads(frag, inl.width)
    halves = sorted({frag(0, v)[0] for v in range(frag.values)})
    groups = sched.bn // inl.width
    tail_m = problem.m % sched.span[0] != 0
    lines = ["// the partials: each across its quad, one lane stores"]
    for mb in range(sched.rows_per_wg // 64):
        for r in halves:
            for g in range(groups):
                lines.append("{")
                names = {}
                for i, red in enumerate(inl.reds):
                    acc = names[red.dst] = _inline_acc(i, mb, r, g)
                    for mask in QUAD_XOR:
                        other = f"__shfl_xor_sync(0xffffffffu, {acc}, {mask})"
                        lines.append(f"  {acc} = {_PARTIAL_COMBINE[red.op][0].format(a=acc, b=other)};")
                lines.append(f"  const int m = row_base + {mb * 64} + frag_row + {r};")
                lines.append(f"  const int grp = tn * {groups} + {g};")
                lines += _partial_stores(problem, kernel, [x for x in loop.body if isinstance(x, ir.Store)], names,
                                         groups, tail_m)
                lines.append("}")
    return lines


def _partial_stores(problem: GemmProblem, kernel: ir.Kernel, stores: list, names: dict, groups: int,
                    tail_m: bool) -> list[str]:
    """One lane of the quad stores a (row m, group grp)'s partials (`names`: their C values),
    inside the output's rows (`tail_m`: some tile passes M) and groups (`groups` a tile)."""
    loop = epi.partials_loop(kernel)
    guard = [f"(tid & {max(QUAD_XOR) * 2 - 1}) == 0"]
    if tail_m:
        guard.append(f"m < {problem.M}")
    if -(-problem.n // epi.partial_width(kernel)) % groups:
        guard.append(f"grp < {loop.extent}")
    lines = [f"  if ({' && '.join(guard)}) {{"]
    store_env = {"m": "m", "t": "grp", "b": "batch"}
    for x in stores:
        buf = kernel.buffer(x.buf)
        off = cexpr.flat_offset(buf, x.index, store_env)
        lines.append(f"    {_ident(buf.name)}[{off}] = {cexpr.to_storage(buf.dtype, names[x.value])};")
    return lines + ["  }"]


def _render_partial(kernel, red: ir.Reduce, mb: int, regs: list, frag, lines: list, env: dict, scope,
                    col, wrapped, tail_n: bool, n_total: int):
    """One Reduce of the partials loop: over the thread's registers `regs` of the group, then
    across its quad; binds red.dst in `scope` to the result."""
    names, dts = scope
    combine, identity = _PARTIAL_COMBINE[red.op]
    acc = _ident(red.dst)
    body = [_partial_indices(x, col, wrapped, tail_n) for x in red.body]
    fast = _fast_exps(body, set(names))
    lines.append(f"  // {red.header()}")
    lines.append(f"  float {acc} = {cexpr.const(identity, 'f32')};")
    for v in regs:
        _, cc = frag(0, v)
        lines.append("  {")
        used = _index_leaves(e for x in body for e in (x.index if isinstance(x, ir.Load) and x.buf != epi.ACC else
                                                        (x.expr,) if isinstance(x, ir.IndexValue) else ()))
        if used & {ir.Var("n"), ir.Var("nc")}:
            lines.append(f"    const int n = col_base + frag_col + {cc};")
        if ir.Var("nc") in used:
            lines.append(f"    const int nc = min(n, {n_total - 1});")
        inner = (dict(names), dict(dts))
        _render_element(kernel, body, f"acc[{mb}][{v}]", "n", lines, f"_{v}", store=False, env=env, scope=inner,
                        fast=fast)
        lines.append(f"    {acc} = {combine.format(a=acc, b=inner[0][red.value])};")
        lines.append("  }")
    for mask in QUAD_XOR:
        other = f"__shfl_xor_sync(0xffffffffu, {acc}, {mask})"
        lines.append(f"  {acc} = {combine.format(a=acc, b=other)};")
    names[red.dst], dts[red.dst] = acc, "f32"


# The TMA-store epilogue: each consumer warpgroup writes its accumulators, 64 rows x 64
# columns at a time, into one of two swizzled shared-memory slots (the layout TMA reads a
# (64, 64) box from), then one thread has TMA store the slot. Out-of-range rows and columns
# are clipped by TMA, and the store runs while the warpgroup goes on to its next tile.
STORE_SPAN = 64          # output columns per slot: one 128-byte swizzle span of 16-bit values
STORE_SLOTS = 2          # slots per consumer warpgroup
PRELOAD_SLOTS = 2        # slots ahead whose residual pairs are loaded (_preload_pairs; 0: in their own slot)
MAINLOOP_PAIR_REGS = 64  # at most this many pair words per thread: all loaded in the main loop instead,
PRELOAD_STEPS = 8        # spread over its last this many K steps (16 or more: 10-20% slower; s14)


def _store_layout():
    """The shared-memory layout of one store slot: (64 rows, 64 cols) of 16-bit values, SW128."""
    return hopper.gmma_smem_layout("K", 128, 16, (64, STORE_SPAN))


STORE_SWIZZLE = hopper.tma_swizzle(_store_layout(), 16)   # the output tensor map's swizzle mode


def _tma_store_dtype(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel) -> str | None:
    """The output dtype when this GEMM can store through shared memory and TMA, else None:
    one 16-bit output stored at out[(b,) m, n] (not pairwise), rows a multiple of 16 bytes
    (TMA's rule), whole 64-column slots in a tile."""
    body = epi.inner_body(kernel)
    full = _full_pair_store(kernel, body)
    half = epi.is_pairwise(kernel) and not full  # a pairwise epilogue's half-width output
    out_bn = sched.bn // 2 if half else sched.bn
    if not sched.tma_store or out_bn % STORE_SPAN:
        return None
    if full:  # two 16-bit values per register pair, at the pair's own columns: packed as below
        return full if problem.n * 2 % 16 == 0 else None
    if half:  # one 16-bit value per register pair: any single 16-bit output will do
        outs, stores = epi.tile_outputs(kernel), [x for x in body if isinstance(x, ir.Store)]
        dt = outs[0].dtype if len(outs) == 1 and len(stores) == 1 and outs[0].dtype in ("bf16", "f16") else None
    else:
        dt = _pair_store(kernel, body)
    if dt is None:
        return None
    out = epi.tile_outputs(kernel)[0]
    out_n = problem.n // 2 if half else problem.n
    store = next(x for x in body if isinstance(x, ir.Store))
    want = ((ir.Var("b"),) if problem.batch > 1 else ()) + (ir.Var("m"), ir.Var("n"))
    lead = (problem.batch,) if problem.batch > 1 else ()
    if tuple(store.index) != want or out.shape != lead + (problem.m, out_n):
        return None
    if out_n * 2 % 16:
        return None
    return dt


def _store_staging_bytes(sched: GemmSchedule) -> int:
    """STORE_SLOTS slots per consumer warpgroup, taken in turn; with tma_loads a slot per
    64 x 64 box of the warpgroup's rows of the tile, each filled with its residual box."""
    slots = sched.rows_per_wg // 64 * (sched.bn // STORE_SPAN) if sched.tma_loads else STORE_SLOTS
    return sched.consumers * slots * hopper.smem_bytes(_store_layout(), 16)


def tma_residual(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel) -> ir.Load | None:
    """The epilogue's residual load that TMA brings into the store slots (sched.tma_loads), else None.

    Most of a residual's cost is its bytes through L2, wherever they are read (ncu,
    bench/LOG_gemm.md, session 14). By TMA they come in under the MMAs, as whole boxes, with an
    L2 evict_first hint and no load instructions; each box lands in the slot that will store
    the same box of the output, and each thread reads its words where it writes its results.
    3.5% faster than the register loads at 8192x2048x2048, but the slots cost the 128x256
    tile its fourth stage, worth more at longer K (see _with_tma_residual).
    Needs the TMA-store path, one 16-bit residual at [(b,) m, n] shaped as the output (the
    output's box coordinates then address it), whole K per tile (no split-K or stream-K), and
    the slots' shared memory beside the stage ring (128x256 tiles: 3 stages, not 4)."""
    if not sched.tma_loads or sched.split_k > 1 or sched.stream_k or epi.is_pairwise(kernel):
        return None
    if _tma_store_dtype(problem, sched, kernel) is None:
        return None
    loads = _pair_loads(kernel, epi.inner_body(kernel), tma_store=True)
    if len(loads) != 1:
        return None
    x, out = loads[0], epi.tile_outputs(kernel)[0]
    want = ((ir.Var("b"),) if problem.batch > 1 else ()) + (ir.Var("m"), ir.Var("n"))
    if tuple(x.index) != want or kernel.buffer(x.buf).shape != out.shape:
        return None
    if sched.smem_bytes() + _store_staging_bytes(sched) + RESIDUAL_BARS * sched.consumers > SMEM_LIMIT:
        return None
    return x


RESIDUAL_BARS = 8           # bytes of shared memory per consumer for its residual mbarrier
RESIDUAL_FIRST_STEP = 2     # the main loop's K step that issues the first residual box
RESIDUAL_SPREAD = 1         # the boxes' K steps apart (0: all at once)
RESIDUAL_HINT = "evict_first"  # the L2 eviction policy of the residual's boxes ("": the default policy)


def residual_tma_issue(sched: GemmSchedule, k_iters: int) -> list[tuple[int, list[str]]]:
    """Thread 0 of a consumer warpgroup loads its rows of the tile's residual into the slots, once
    the last tile's TMA stores have read them: one 64 x 64 box per slot, slot mb * (bn / 64) + j
    holding rows 64 mb.., columns 64 j... As (K step, lines) pairs; the lines need row_base,
    col_base, batch, stage_out, res_bar."""
    slot_bytes = hopper.smem_bytes(_store_layout(), 16)
    nj = sched.bn // STORE_SPAN
    boxes = sched.rows_per_wg // 64 * nj
    first = min(RESIDUAL_FIRST_STEP, k_iters - 1)
    out = {}
    for i in range(boxes):
        mb, j = divmod(i, nj)
        kt = min(first + i * RESIDUAL_SPREAD, k_iters - 1)
        lines = out.setdefault(kt, [])
        if i == 0:
            lines += ["tf_bulk_wait_read<0>();  // the last tile's stores have read the slots",
                      f"tf_bar_expect(res_bar, {boxes * slot_bytes});"]
        load = "tf_tma_load_evict_first" if RESIDUAL_HINT == "evict_first" else "tf_tma_load"
        lines.append(f"{load}(stage_out + {i * slot_bytes}, &r_map, col_base + {j * STORE_SPAN}, "
                     f"row_base + {mb * 64}, batch, res_bar);")
    return sorted(out.items())


def _epilogue_code_tma(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel, dtype: str,
                       early: dict | None = None, res_load: ir.Load | None = None,
                       inl: InlinePartials | None = None) -> list[str]:
    """The TMA-store epilogue of one consumer warpgroup (see STORE_SPAN above).

    Per slot: thread 0 waits until the TMA store that last read the slot is done reading;
    a warpgroup barrier; every thread writes its packed pairs (each pair's (row, col) from
    the wgmma accumulator fragment, its shared-memory offset from the slot's swizzled
    layout); a proxy fence and a barrier; thread 0 issues the TMA store of the slot.
    Expects in scope: tid, c (warpgroup), row_base, col_base, batch, stage_out (slot
    base address of this warpgroup), ep_slot (running slot index).

    With `early` (a dict), some pair loads are not in the returned lines: early["decl"]
    declares their registers (before the main loop), early["coords"] binds frag_row and
    frag_col, and early["groups"] lists blocks of loads (each needs row_base, col_base,
    frag_row and frag_col) that the main loop spreads over its last early["steps"] K steps,
    under the MMAs.
    Where a thread's pair words fit MAINLOOP_PAIR_REGS registers, that is all of them (one
    block per register pair); else the first PRELOAD_SLOTS slots' (one block), and each slot
    loads the words of the slot PRELOAD_SLOTS ahead.

    With `res_load` (tma_residual) the slots hold the residual, loaded by TMA during the main
    loop (residual_tma_issue): each warpgroup waits for it once (res_bar, res_phase), then
    fills and stores each slot in turn, reading each pair's residual word from where it
    writes the pair's result.

    With `inl`, each element also adds its terms to the partials' registers (InlinePartials).
    """
    body = epi.inner_body(kernel)
    frag = mma.sm90_64xN_c(sched.bn)
    lay = _store_layout()
    slot_bytes = hopper.smem_bytes(lay, 16)
    mb_count = sched.rows_per_wg // 64
    full_tiles = _full_tiles(problem, sched)
    # loads of epilogue operands must stay inside their tensors on tail tiles
    guarded = not full_tiles and any(isinstance(x, ir.Load) and x.buf != epi.ACC
                                     and (res_load is None or x.dst != res_load.dst) for x in body)
    row0, col0 = cgen.c_tv_coords(frag, "tid", 0)
    coords = [f"const int frag_row = {row0};", f"const int frag_col = {col0};"]
    lines = list(coords)
    bar = "tf_named_bar(1 + c, 128);"
    full = _full_pair_store(kernel, body)
    if epi.is_pairwise(kernel) and not full:
        return lines + _pairwise_tma_slots(problem, sched, kernel, dtype, frag, guarded, bar)
    # deferred (render has kept the knob only where defers_stores holds), the main loop writes
    # the slots: the lanes' stmatrix coordinates go before it, with the packed registers
    defer = early is not None and sched.defer_stores
    if not defer:
        lines += _stsm_coords(frag)
    if res_load is not None:
        return lines + _residual_slots(problem, sched, kernel, dtype, frag, guarded, bar, res_load, inl)
    pairs = _pair_loads(kernel, body, tma_store=True)
    # Only whole tiles: a split-K or stream-K fixup leaves no registers for words held across
    # slots (ptxas spills), and tail tiles keep their guarded loads in their slot (held ahead,
    # never measured: the session-13 timing cited for them was of 8192x11008x4096, whole tiles).
    preload = bool(pairs) and PRELOAD_SLOTS > 0 and sched.split_k == 1 and not sched.stream_k and not guarded
    slot_vs = _slot_pairs(frag, sched.bn)
    # The whole tile's words from the main loop's last PRELOAD_STEPS K steps, where they fit
    # MAINLOOP_PAIR_REGS registers: 1-2.5% faster than two slots ahead (ncu, s14). Earlier or
    # more spread out is slower: the loop then stalls at its back edge on loads in flight.
    mainloop = preload and early is not None and len(pairs) * mb_count * frag.values // 2 <= MAINLOOP_PAIR_REGS
    if mainloop:
        early["coords"] += coords
        early["steps"] = PRELOAD_STEPS
        for mb in range(mb_count):
            early["decl"].append(_preload_decl(pairs, frag, mb))
            for vs in slot_vs:
                for v in vs:
                    group = []
                    _preload_pairs(kernel, pairs, frag, mb, [v], group)
                    early["groups"].append(group)
    if defer:
        regs = [f"dpk_{mb}_{v // 2}" for mb in range(mb_count) for v in range(0, frag.values, 2)]
        early["defer"] = {"decl": _stsm_coords(frag) + ["unsigned " + ", ".join(regs) + ";",
                                                        "int d_row_base = 0, d_col_base = 0, d_batch = 0;",
                                                        "bool pending = false;"],
                          "boxes": []}
    tables = packed_tables(problem, sched, kernel) if full else ()
    for mb in range(mb_count):
        if tables:  # (full tiles only: no guard)
            table_regs = _table_words(kernel, tables, mb, sorted({frag(0, v)[0] for v in range(frag.values)}), lines)
        if preload and not mainloop:
            lines.append("{")
            ahead = lines
            if mb == 0 and early is not None:  # the first slots' words from the main loop's last K step
                early["decl"].append(_preload_decl(pairs, frag, mb))
                early["coords"] += coords
                ahead = []
                early["groups"].append(ahead)
            else:
                lines.append(_preload_decl(pairs, frag, mb))
            for vs in slot_vs[:PRELOAD_SLOTS]:
                _preload_pairs(kernel, pairs, frag, mb, vs, ahead)
        for j, vs in enumerate(slot_vs):
            if defer:  # the slot is written and stored by the next tile's main loop
                box = []
                _slot_open(box, slot_bytes, bar)
                box += [_stsm_store(lay, r0, c0, j, [f"dpk_{mb}_{v // 2}" for v in g])
                        for g, r0, c0 in _stsm_groups(frag, vs)]
                _slot_close(box, bar, f"d_col_base + {j * STORE_SPAN}", f"d_row_base + {mb * 64}", batch="d_batch")
                early["defer"]["boxes"].append(box)
            else:
                _slot_open(lines, slot_bytes, bar)
                lines.append("  unsigned pk0, pk1, pk2, pk3;")
            for q, v, group in ((q, v, g) for g in _stsm_groups(frag, vs) for q, v in enumerate(g[0])):
                r, cc = frag(0, v)  # offsets relative to thread 0's element
                _pair_open(lines, problem, mb, r, cc, guarded)
                if full:  # the pair (n, n + 1) is one pairwise element's two outputs
                    lines.append("    const int n2 = n >> 1;")
                    _, x0, x1 = _pair_values(kernel, body, [f"acc[{mb}][{v}]", f"acc[{mb}][{v + 1}]"], lines,
                                             n_expr="n2",
                                             loaded=_table_values(tables, table_regs, r, cc) if tables else None)
                else:
                    vals = []
                    halves = (_preloaded(pairs, mb, v) if preload else
                              _issue_pair_loads(kernel, pairs, lines, "    "))
                    for e in (0, 1):
                        vals.append(_element(kernel, body, inl, frag, mb, v + e, f"n + {e}", lines, f"_{e}",
                                             store=False, loaded=halves[e]))
                    x0, x1 = vals[0][1], vals[1][1]
                lines.append(f"    packed = (unsigned){cexpr.to_storage(dtype, x0)} | "
                             f"((unsigned){cexpr.to_storage(dtype, x1)} << 16);")
                if guarded:
                    lines.append("    }")
                lines.append(f"    {f'dpk_{mb}_{v // 2}' if defer else f'pk{q}'} = packed;")
                lines.append("  }")
                if q == 3 and not defer:
                    lines.append(_stsm_store(lay, group[1], group[2], j))
            if preload and not mainloop and j + PRELOAD_SLOTS < len(slot_vs):
                _preload_pairs(kernel, pairs, frag, mb, slot_vs[j + PRELOAD_SLOTS], lines)
            if not defer:
                _slot_close(lines, bar, f"col_base + {j * STORE_SPAN}", f"row_base + {mb * 64}")
        if preload and not mainloop:
            lines.append("}")
    if defer:
        lines.append("d_row_base = row_base; d_col_base = col_base; d_batch = batch; pending = true;")
    return lines


def packed_tables(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel) -> tuple[tuple[ir.Load, int], ...]:
    """The loads of a pairwise rotation's (RoPE's) angle tables that each thread reads as whole
    16-byte words from a column-permuted copy (pack_table): a 16-bit [R, W] operand read at
    [row(m), n % W] (n the pair index), W a multiple of 32 dividing the tile's bn / 2 pairs.

    Why: the C fragment gives the quad's thread t the pairs t + 4j of each row, so read in
    place each thread makes W/4 two-byte loads per row and table, each touching 8 rows' lines
    per warp. At 8192 x 2048 x 2048 (Llama's Q and K) those loads cost the GEMM 8.8 of the
    10 us its RoPE epilogue adds over a plain row scale (H100, bench/LOG_gemm.md, session 21).
    Permuted so thread t's W/4 values are contiguous (pack_table), they are W/32 16-byte
    loads per row and table. Full tiles of the TMA-store epilogue that writes each rotated
    pair whole (_full_pair_store) only."""
    if not epi.is_pairwise(kernel) or not sched.tma_store or not _full_tiles(problem, sched):
        return ()
    body = epi.inner_body(kernel)
    if not _full_pair_store(kernel, body) or _tma_store_dtype(problem, sched, kernel) is None:
        return ()
    frag = mma.sm90_64xN_c(sched.bn)
    # the fragment this relies on: pair v of thread 0 at column 8 (v // 4), thread t 2t columns on
    if any(frag(0, v)[1] != 8 * (v // 4) for v in range(0, frag.values, 2)):
        return ()
    _, col0 = cgen.c_tv_coords(frag, "tid", 0)
    if col0.replace(" ", "") != "(tid%4)*2":
        return ()
    def fits(x: ir.Load) -> bool:
        buf = kernel.buffer(x.buf)
        if buf.dtype not in ("bf16", "f16") or len(buf.shape) != 2 or len(x.index) != 2:
            return False
        w, col = buf.shape[1], x.index[1]
        if not (isinstance(col, ir.IBin) and col.op == "%" and col.a == ir.Var("n") and col.b == ir.IConst(w)):
            return False
        return ir.Var("n") not in _index_leaves(x.index[:1]) and not w % 32 and not (sched.bn // 2) % w

    loads = [x for x in body if isinstance(x, ir.Load) and x.buf != epi.ACC]
    elsewhere = set()  # a buffer the partials also read, or read outside the pattern, stays unpacked
    part = epi.partials_loop(kernel)
    if part is not None:
        elsewhere |= {x.buf for x in ir.walk(part.body) if isinstance(x, ir.Load)}
    elsewhere |= {x.buf for x in loads if not fits(x)}
    return tuple((x, kernel.buffer(x.buf).shape[1]) for x in loads if x.buf not in elsewhere)


def pack_table(t, w: int):
    """The column order packed_tables reads a [R, W] table in: thread t's pairs t + 4k (k < W/4)
    side by side, at t * W/4 + k. A torch tensor in, a new contiguous one out."""
    r = t.shape[0]
    return t.reshape(r, w // 4, 4).transpose(1, 2).contiguous().reshape(r, w)


def _table_words(kernel: ir.Kernel, tables, mb: int, rows: list[int], lines: list) -> dict:
    """Load each packed table's row segments of 64-row block mb (its W/4 values of each of the
    thread's rows, as uint4 words); return {(load dst, row offset): register name prefix}."""
    names = {}
    for x, w in tables:
        buf = kernel.buffer(x.buf)
        for r in rows:
            name = f"tq_{_ident(x.dst)}_{mb}_{r}"
            names[(x.dst, r)] = name
            off = cexpr.flat_offset(buf, x.index, {"m": f"(row_base + {mb * 64} + frag_row + {r})", "n": "0",
                                                   "b": "batch"})
            base = f"{_ident(buf.name)} + {off} + {w // 4} * (tid % 4)"
            lines.append("uint4 " + ", ".join(f"{name}_{q}" for q in range(w // 32)) + ";")
            lines += [f"{name}_{q} = __ldg((const uint4*)({base}) + {q});" for q in range(w // 32)]
    return names


def _table_values(tables, names: dict, r: int, cc: int) -> dict:
    """The `loaded` map (_render_element) of the pair at column offset cc of row offset r: the
    packed segment's value k = (cc / 8) mod W/4, as 16-bit storage."""
    out = {}
    for x, w in tables:
        k = (cc // 8) % (w // 4)
        word = f"{names[(x.dst, r)]}_{k // 8}.{'xyzw'[k % 8 // 2]}"
        out[x.dst] = f"(unsigned short)({word} >> 16)" if k % 2 else f"(unsigned short)({word} & 0xFFFFu)"
    return out


def _pair_open(lines: list, problem: GemmProblem, mb: int, r: int, cc: int, guarded: bool):
    """Open one register pair's block in a slot: its (m, n), its packed result (zero unless
    computed), and on tail tiles the guard that keeps its loads inside the tensors."""
    lines.append("  {")
    lines.append(f"    const int m = row_base + {mb * 64} + frag_row + {r};")
    lines.append(f"    const int n = col_base + frag_col + {cc};")
    lines.append("    unsigned packed = 0u;")
    if guarded:
        lines.append(f"    if (m < {problem.M} && n < {problem.n}) {{")


def _slot_offset(lay, frag, v: int, j: int) -> str:
    """Register pair v's element offset in slot j's swizzled layout (C, from frag_row, frag_col)."""
    r, cc = frag(0, v)
    return cgen.c_index(lay, (f"frag_row + {r}", f"frag_col + {cc - j * STORE_SPAN}"), shifts=True)


def _slot_pairs(frag, bn: int) -> list[list[int]]:
    """Each 64-column slot's register pairs (v, v + 1) of a 64-row block, in fragment order."""
    return [[v for v in range(0, frag.values, 2) if j * STORE_SPAN <= frag(0, v)[1] < (j + 1) * STORE_SPAN]
            for j in range(bn // STORE_SPAN)]


def _stsm_groups(frag, vs: list[int]) -> list[tuple[list[int], int, int]]:
    """A slot's register pairs in fours that one stmatrix.x4 stores: pairs q = 0..3 of a group
    cover, across a warp, the 8x8 blocks at (r0 + 8 (q & 1), c0 + 8 (q >> 1)) from thread 0's
    element (rows and 16-bit columns), each lane holding the two values at (lane / 4, 2 (lane % 4))
    of each block: stmatrix's fragment. Returns (pairs, r0, c0) per group."""
    if len(vs) % 4:
        raise GemmError(f"{len(vs)} register pairs in a slot do not make whole stmatrix.x4 groups")
    out = []
    for i in range(0, len(vs), 4):
        group = vs[i:i + 4]
        r0, c0 = frag(0, group[0])
        want = [(r0 + 8 * (q & 1), c0 + 8 * (q >> 1)) for q in range(4)]
        if [frag(0, v) for v in group] != want:
            raise GemmError(f"register pairs {group} are not the four 8x8 blocks of one stmatrix.x4")
        out.append((group, r0, c0))
    return out


def _stsm_coords(frag) -> list[str]:
    """Each lane's row and column for stmatrix.x4's addresses: lane L gives row L % 8 of block
    L / 8 of its group, i.e. (relative to the group's first block) thread 4 (L % 8) of its warp's
    first element, moved by block L / 8's offset (8 rows for odd blocks, 8 columns for the
    last two)."""
    row, col = cgen.c_tv_coords(frag, "sm_src", 0)
    return ["const int sm_src = (tid & ~31) | ((tid & 7) << 2);",
            f"const int sm_row = {row} + ((tid >> 3) & 1) * 8;",
            f"const int sm_col = {col} + ((tid >> 4) & 1) * 8;"]


def _stsm_store(lay, r0: int, c0: int, j: int, regs=("pk0", "pk1", "pk2", "pk3")) -> str:
    """The stmatrix.x4 of one group (_stsm_groups) into slot j, its four packed pairs `regs`."""
    off = cgen.c_index(lay, (f"sm_row + {r0}", f"sm_col + {c0 - j * STORE_SPAN}"), shifts=True)
    return f"  tf_stsm4(slot + 2 * ({off}), {', '.join(regs)});"


def defers_stores(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel) -> bool:
    """Whether the TMA-store epilogue leaves its slots to the next tile's main loop: it packs
    the tile's results into registers (half the accumulators' count), and the next tile writes
    them to the slots and stores them, one slot per K step, under its first MMAs (the last tile
    right after its loop). The epilogue's slot waits, barriers and shared-memory writes cost
    ~2000 cycles a tile per warpgroup, 3% of a 128x256x4096 tile, with the tensor cores idle
    (clock64, s15). Whole-tile persistent loops only (not split-K, stream-K or ping-pong), and
    not where registers or slots already carry residual words across the main loop. Where it
    does not apply, render ignores the knob (the kernel is the one without it). Nor with
    partials beside the element code on tail tiles: their registers and masks on top of the
    packed results spilled 16 bytes (1000x1000x136, 128x256 tiles in a cluster; s18)."""
    if not sched.defer_stores or sched.split_k > 1 or sched.stream_k or sched.pingpong:
        return False
    if not _full_tiles(problem, sched) and inline_partials(problem, kernel) is not None:
        return False
    store_dt = _tma_store_dtype(problem, sched, kernel)
    if store_dt is None or tma_residual(problem, sched, kernel) is not None:
        return False
    body = epi.inner_body(kernel)
    if epi.is_pairwise(kernel) and not _full_pair_store(kernel, body):
        return False
    return not _pair_loads(kernel, body, tma_store=True)


def _residual_slots(problem, sched, kernel, dtype, frag, guarded, bar, res_load, inl=None) -> list[str]:
    """The slots of _epilogue_code_tma when TMA has loaded the residual into them (tma_residual)."""
    body = epi.inner_body(kernel)
    lay = _store_layout()
    slot_bytes = hopper.smem_bytes(lay, 16)
    slot_vs = _slot_pairs(frag, sched.bn)
    lines = ["tf_bar_wait(res_bar, res_phase);  // this tile's residual is in the slots",
             "res_phase ^= 1;"]
    for mb in range(sched.rows_per_wg // 64):
        for j, vs in enumerate(slot_vs):
            lines.append("{")
            lines.append(f"  const unsigned slot = stage_out + {(mb * len(slot_vs) + j) * slot_bytes};")
            # the slot's words all read first: each read waits on the one store before it
            # (both are volatile), so read between the stores, each would wait its latency
            groups = _stsm_groups(frag, vs)
            order = [v for g in groups for v in g[0]]
            for i, v in enumerate(order):
                lines.append(f"  const unsigned res_w{i} = tf_lds32(slot + 2 * ({_slot_offset(lay, frag, v, j)}));")
            lines.append("  unsigned pk0, pk1, pk2, pk3;")
            for i, v in enumerate(order):
                r, cc = frag(0, v)  # offsets relative to thread 0's element
                _pair_open(lines, problem, mb, r, cc, guarded)
                halves = [{res_load.dst: f"(unsigned short)(res_w{i} {part})"} for part in ("& 0xFFFFu", ">> 16")]
                vals = [_element(kernel, body, inl, frag, mb, v + e, f"n + {e}", lines, f"_{e}", store=False,
                                 loaded=halves[e]) for e in (0, 1)]
                lines.append(f"    packed = (unsigned){cexpr.to_storage(dtype, vals[0][1])} | "
                             f"((unsigned){cexpr.to_storage(dtype, vals[1][1])} << 16);")
                if guarded:
                    lines.append("    }")
                lines.append(f"    pk{i % 4} = packed;")
                lines.append("  }")
                if i % 4 == 3:
                    lines.append(_stsm_store(lay, groups[i // 4][1], groups[i // 4][2], j))
            _slot_close(lines, bar, f"col_base + {j * STORE_SPAN}", f"row_base + {mb * 64}", turn=False)
    return lines


def _pair_loads(kernel: ir.Kernel, body, tma_store: bool) -> list:
    """Loads of a 16-bit tile operand at [..., n] (a residual) with an even row length: the
    two columns (n, n + 1) of a register pair are then one aligned 4-byte load instead of two
    2-byte ones: 2.5% fewer cycles for a residual GEMM at 8192x4096x4096 (ncu, bench/LOG_gemm.md).
    Only the element-wise epilogues that take a register pair at a time do this: the TMA-store
    one, and the direct-store one where two columns share a 4-byte store (_pair_store)."""
    if epi.is_pairwise(kernel) or not (tma_store or _pair_store(kernel, body)):
        return []
    return [x for x in body if isinstance(x, ir.Load) and x.buf != epi.ACC and x.index
            and x.index[-1] == ir.Var("n") and ir.Var("m") in _index_leaves(x.index)
            and kernel.buffer(x.buf).dtype in ("bf16", "f16") and kernel.buffer(x.buf).shape[-1] % 2 == 0]


def _preload_decl(loads, frag, mb: int) -> str:
    """The registers of 64-row block mb's pair words (_preload_pairs), one per register pair."""
    return "unsigned " + ", ".join(f"pre_{_ident(x.dst)}_{mb}_{v // 2}" for x in loads
                                   for v in range(0, frag.values, 2)) + ";"


def _preload_pairs(kernel: ir.Kernel, loads, frag, mb: int, vs: list[int], lines: list):
    """Issue the pair loads of register pairs `vs` (of 64-row block mb, whole tiles: no guard)
    into registers named by pair, ahead of the slot that uses them (PRELOAD_SLOTS). Loaded in
    their own slot, each slot's loads wait a whole memory round trip between two barriers;
    ahead, they wait under the slots before (and the first under the last K step's MMAs).
    Under ncu: 1-4% off residual GEMMs at 8192 x {4096, 2048} x K (bench/LOG_gemm.md, s13)."""
    for v in vs:
        r, cc = frag(0, v)
        lines.append(f"{{ const int m = row_base + {mb * 64} + frag_row + {r}, n = col_base + frag_col + {cc};")
        for x in loads:
            buf = kernel.buffer(x.buf)
            off = cexpr.flat_offset(buf, x.index, {"m": "m", "n": "n", "b": "batch"})
            lines.append(f"  pre_{_ident(x.dst)}_{mb}_{v // 2} = *(const unsigned*)({_ident(buf.name)} + {off});")
        lines.append("}")


def _preloaded(loads, mb: int, v: int) -> list[dict]:
    """The two elements' `loaded` maps of register pair (v, v + 1) of block mb, from _preload_pairs."""
    return [{x.dst: f"(unsigned short)(pre_{_ident(x.dst)}_{mb}_{v // 2} {part})" for x in loads}
            for part in ("& 0xFFFFu", ">> 16")]


def _issue_pair_loads(kernel, loads, lines: list, indent: str) -> list[dict]:
    """Emit one 4-byte load per pair-loaded operand at (m, n), n even; the two elements' `loaded`
    maps (column n, then n + 1)."""
    halves = [{}, {}]
    for x in loads:
        buf = kernel.buffer(x.buf)
        name = f"pair_{_ident(x.dst)}"
        off = cexpr.flat_offset(buf, x.index, {"m": "m", "n": "n", "b": "batch"})
        lines.append(f"{indent}const unsigned {name} = *(const unsigned*)({_ident(buf.name)} + {off});")
        halves[0][x.dst] = f"(unsigned short)({name} & 0xFFFFu)"
        halves[1][x.dst] = f"(unsigned short)({name} >> 16)"
    return halves


def _slot_open(lines: list, slot_bytes: int, bar: str):
    """Open one store slot: wait until the TMA store that last read it is done, then sync."""
    lines.append("{")
    lines.append(f"  const unsigned slot = stage_out + ep_slot * {slot_bytes};")
    lines.append(f"  if (tid == 0) tf_bulk_wait_read<{STORE_SLOTS - 1}>();")
    lines.append(f"  {bar}")


def _slot_close(lines: list, bar: str, col: str, row: str, turn: bool = True, batch: str = "batch"):
    """Close a filled slot: make the writes visible to TMA, sync, thread 0 stores it at (col, row);
    then (turn) the next slot is the other one."""
    lines.append("  tf_fence_async_smem();")
    lines.append(f"  {bar}")
    lines.append(f"  if (tid == 0) {{ tf_tma_store(&c_map, slot, {col}, {row}, {batch}); tf_bulk_commit(); }}")
    if turn:
        lines.append("  ep_slot ^= 1;")
    lines.append("}")


def _pairwise_tma_slots(problem, sched, kernel, dtype, frag, guarded, bar) -> list[str]:
    """The TMA-store slots of a pairwise epilogue: register pair (v, v + 1), accumulator columns
    (c, c + 1) with c even, gives the one output element at column c / 2, so a warpgroup's
    64 x BN accumulator block fills 64 x BN/2 outputs, BN/2 / 64 slots; each thread writes its
    16-bit values into the slot's swizzled layout, then thread 0 stores the slot by TMA."""
    body = epi.inner_body(kernel)
    lay = _store_layout()
    slot_bytes = hopper.smem_bytes(lay, 16)
    lines = []
    for mb in range(sched.rows_per_wg // 64):
        for j in range(sched.bn // 2 // STORE_SPAN):
            _slot_open(lines, slot_bytes, bar)
            for v in range(0, frag.values, 2):
                r, cc = frag(0, v)  # offsets relative to thread 0's element; cc is even
                if not j * STORE_SPAN <= cc // 2 < (j + 1) * STORE_SPAN:
                    continue
                lines.append("  {")
                lines.append(f"    const int m = row_base + {mb * 64} + frag_row + {r};")
                lines.append(f"    const int n = (col_base + frag_col + {cc}) >> 1;")
                lines.append("    unsigned short bits = 0;")
                if guarded:
                    lines.append(f"    if (m < {problem.M} && 2 * n < {problem.n}) {{")
                _, val = _render_element(kernel, body, [f"acc[{mb}][{v}]", f"acc[{mb}][{v + 1}]"], "n", lines, "",
                                         store=False)
                lines.append(f"    bits = {cexpr.to_storage(dtype, val)};")
                if guarded:
                    lines.append("    }")
                off = cgen.c_index(lay, (f"frag_row + {r}", f"(frag_col >> 1) + {cc // 2 - j * STORE_SPAN}"),
                                   shifts=True)
                lines.append(f"    tf_sts16(slot + 2 * ({off}), bits);")
                lines.append("  }")
            _slot_close(lines, bar, f"(col_base >> 1) + {j * STORE_SPAN}", f"row_base + {mb * 64}")
    return lines


def _full_pair_store(kernel: ir.Kernel, body) -> str | None:
    """The 16-bit dtype when a pairwise epilogue has one full-width output that it writes at
    columns 2n and 2n + 1 (a rotation of each pair, RoPE's) and nothing else: the two values
    then go out in one 4-byte store (N even), or through the TMA-store slots; else None."""
    if not epi.is_pairwise(kernel):
        return None
    outs = kernel.outputs
    stores = [s for s in body if isinstance(s, ir.Store)]
    if len(outs) != 1 or len(stores) != 2 or outs[0].dtype not in ("bf16", "f16") or outs[0].shape[-1] % 2:
        return None
    try:
        parities = sorted(_column_parity(s.index[-1]) for s in stores)
    except GemmError:
        return None
    if parities != [0, 1] or any(s.index[:-1] != stores[0].index[:-1] for s in stores):
        return None
    return outs[0].dtype


def _pair_values(kernel, body, accs: list, lines: list, n_expr: str = "n", loaded: dict | None = None):
    """One pairwise element whose two stores fill columns 2n and 2n + 1: ((out, offset of the
    2n store), value at 2n, value at 2n + 1), each value before its rounding to the output.
    `loaded` as _render_element takes it."""
    found = _render_element(kernel, body, accs, n_expr, lines, "", store=False, every=True, loaded=loaded)
    by = {_column_parity(s.index[-1]): (target, val) for s, target, val in found}
    return by[0][0], by[0][1], by[1][1]


def _pair_store(kernel: ir.Kernel, body) -> str | None:
    """The 16-bit dtype when the epilogue has one output that two adjacent columns can
    share a 4-byte store to (N even, so every pair starts 4-byte aligned); else None."""
    outs = epi.tile_outputs(kernel)
    stores = [s for s in body if isinstance(s, ir.Store)]
    if len(outs) != 1 or len(stores) != 1 or outs[0].dtype not in ("bf16", "f16"):
        return None
    if outs[0].shape[-1] % 2:
        return None
    return outs[0].dtype


def _column_parity(e) -> int:
    """0 or 1: which of the pair (2n, 2n + 1) an accumulator column index names."""
    def ev(x, n):
        if isinstance(x, ir.IConst):
            return x.value
        if isinstance(x, ir.Var):
            if x.name != "n":
                raise GemmError(f"pairwise epilogue: acc column index uses {x.name}")
            return n
        if isinstance(x, ir.IBin):
            a, b = ev(x.a, n), ev(x.b, n)
            if x.op == "+":
                return a + b
            if x.op == "*":
                return a * b
            if b == 0:
                raise GemmError(f"pairwise epilogue: division by zero in {x}")
            return a // b if x.op == "//" else a % b
        raise GemmError(f"pairwise epilogue: unsupported acc column index {x}")

    if any(ev(e, n) != 2 * n + ev(e, 0) for n in range(4)) or ev(e, 0) not in (0, 1):
        raise GemmError(f"pairwise epilogue: acc column {e} is not 2n or 2n + 1")
    return ev(e, 0)


def _fast_ops(kernel: ir.Kernel, body) -> frozenset:
    """The exp, division, sigmoid and ncdf ops of an element body that may use the special-
    function unit: all of them when every output of the epilogue is bf16 or f16
    (mapreduce.fast_math and cexpr's tf_ncdf_fast give the error bounds: the rounding to the
    output hides them)."""
    from .mapreduce import fast_math
    if not fast_math(kernel):
        return frozenset()
    return frozenset(x.dst for x in body if isinstance(x, ir.Op) and x.op in cexpr.FAST_OPS and x.dtype == "f32")


def _render_element(kernel, body, acc_expr, n_expr, lines, suffix, *, store: bool, every: bool = False,
                    env: dict | None = None, scope: tuple[dict, dict] | None = None,
                    fast: frozenset | None = None, loaded: dict | None = None):
    """Emit one element's statements; return ((out name, offset), value) of its store (with
    `every`, [(Store, (out name, offset), value)] of all its stores). `env` adds or replaces
    index variables' C expressions; `scope` is (C names, dtypes) of SSA values defined
    outside `body`, which it also receives the body's; ops named in `fast` (default: the
    kernel's _fast_ops) use the special-function spelling (cexpr.op's fast). `loaded` maps
    an operand load's SSA name to the storage-type C expression already holding its value
    (a half of a pair load, _pair_loads)."""
    if fast is None:
        fast = _fast_ops(kernel, body)
    loaded = loaded or {}
    env = {"m": "m", "n": f"({n_expr})", "b": "batch", **(env or {})}
    names: dict[str, str] = scope[0] if scope else {}
    dts: dict[str, str] = scope[1] if scope else {}
    cast_of: dict[str, str] = {}  # SSA name of a cast -> its argument
    result, results = None, []
    for s in body:
        if isinstance(s, ir.Load):
            buf = kernel.buffer(s.buf)
            name = f"{_ident(s.dst)}{suffix}"
            if buf.name == epi.ACC:
                if isinstance(acc_expr, list):  # pairwise: which of the two columns
                    pair = _column_parity(s.index[-1])
                    expr = acc_expr[pair]
                else:
                    expr = acc_expr
            elif s.dst in loaded:
                expr = cexpr.from_storage(buf.dtype, loaded[s.dst])
            else:
                off = cexpr.flat_offset(buf, s.index, env)
                expr = cexpr.from_storage(buf.dtype, f"{_ident(buf.name)}[{off}]")
            lines.append(f"  const {cexpr.ctype(buf.dtype)} {name} = {expr};")
            names[s.dst], dts[s.dst] = name, buf.dtype
        elif isinstance(s, ir.Const):
            name = f"{_ident(s.dst)}{suffix}"
            lines.append(f"  const {cexpr.ctype(s.dtype)} {name} = {cexpr.const(s.value, s.dtype)};")
            names[s.dst], dts[s.dst] = name, s.dtype
        elif isinstance(s, ir.Op):
            name = f"{_ident(s.dst)}{suffix}"
            expr = cexpr.op(s.op, [names[a] for a in s.args], [dts[a] for a in s.args], s.dtype,
                            fast=s.dst in fast)
            if s.op == "cast":
                cast_of[s.dst] = s.args[0]
            lines.append(f"  const {cexpr.ctype(s.dtype)} {name} = {expr};")
            names[s.dst], dts[s.dst] = name, s.dtype
        elif isinstance(s, ir.IndexValue):
            name = f"{_ident(s.dst)}{suffix}"
            lines.append(f"  const {cexpr.ctype(s.dtype)} {name} = ({cexpr.ctype(s.dtype)})({cexpr.index(s.expr, env)});")
            names[s.dst], dts[s.dst] = name, s.dtype
        elif isinstance(s, ir.Store):
            buf = kernel.buffer(s.buf)
            off = cexpr.flat_offset(buf, s.index, env)
            val, vdt = names[s.value], dts[s.value]
            if store:
                if vdt != buf.dtype:
                    val = cexpr.cast(val, vdt, buf.dtype)
                lines.append(f"    {_ident(buf.name)}[{off}] = {cexpr.to_storage(buf.dtype, val)};")
            else:
                # the pair store converts: skip a cast that only rounds to the stored type
                src_name = cast_of.get(s.value)
                if vdt == buf.dtype and src_name is not None and dts[src_name] == "f32":
                    val = names[src_name]
                result = ((_ident(buf.name), off), val)
                results.append((s, result[0], val))
        else:
            raise GemmError(f"epilogue {kernel.name}: unsupported statement {s}")
    return results if every else result


def _check_epilogue(problem: GemmProblem, kernel: ir.Kernel, partials: bool = False):
    """Raise GemmError unless the epilogue fits the problem; `partials`: the caller renders
    partial row reductions (the sm_90a template does, the sm_80 one declines them)."""
    acc = [b for b in kernel.params if b.name == epi.ACC]
    want = ((problem.batch,) if problem.batch > 1 else ()) + (problem.m, problem.n)
    if not acc or acc[0].shape != want or acc[0].dtype != "f32":
        raise GemmError(f"epilogue {kernel.name}: needs an f32 input 'acc' of shape {want}")
    try:
        body = epi.inner_body(kernel)
        loop = epi.partials_loop(kernel)
    except ValueError as e:
        raise GemmError(str(e)) from None
    pairwise = epi.is_pairwise(kernel)
    part_outs = {b.name for b in epi.partial_outputs(kernel)}
    if loop is not None:
        if not partials:
            raise GemmError(f"epilogue {kernel.name}: partial row reductions are rendered by the sm_90a "
                            f"template only")
        if pairwise:
            raise GemmError(f"epilogue {kernel.name}: partial row reductions of a pairwise epilogue")
        _check_partials(problem, kernel, loop, want)
    for b in kernel.outputs:
        if b.name in part_outs:
            continue
        # a pairwise epilogue writes half-width outputs at column n, full-width ones at 2n + p
        cols = [x.index[-1] for x in body if isinstance(x, ir.Store) and x.buf == b.name]
        half = pairwise and all(isinstance(c, ir.Var) and c.name == "n" for c in cols)
        if pairwise and not half:
            for c in cols:
                _column_parity(c)  # raises unless it is 2n or 2n + 1
        w = want[:-1] + (problem.n // 2,) if half else want
        if b.shape != w:
            raise GemmError(f"epilogue {kernel.name}: output {b.name} has shape {b.shape}, want {w}")


def _check_partials(problem: GemmProblem, kernel: ir.Kernel, loop: ir.Loop, want: tuple):
    """The partials loop has the shape _partials_code renders: row statements, f32 Reduces
    (sum, max, min) over c of straight-line bodies, stores of reduced values at [(b,) m, t]."""
    try:
        w = epi.partial_width(kernel)
    except ValueError as e:
        raise GemmError(str(e)) from None
    if w is None or w % 8:
        raise GemmError(f"epilogue {kernel.name}: partials over {w} columns; want a multiple of 8 "
                        f"(whole 8-column blocks of the wgmma accumulator)")
    t = -(-want[-1] // w)
    if loop.extent != t:
        raise GemmError(f"epilogue {kernel.name}: {loop.extent} column groups of {w}, want {t}")
    lead = (ir.Var("b"),) if problem.batch > 1 else ()
    reduced = {x.dst for x in loop.body if isinstance(x, ir.Reduce)}
    for x in loop.body:
        if isinstance(x, ir.Loop):
            raise GemmError(f"epilogue {kernel.name}: a loop inside the partials loop")
        if isinstance(x, ir.Reduce):
            if x.op not in _PARTIAL_COMBINE or x.dtype != "f32" or x.var != "c":
                raise GemmError(f"epilogue {kernel.name}: partial {x.header()}: want an f32 sum, max or min over c")
            if any(isinstance(y, (ir.Loop, ir.Reduce, ir.Store)) for y in x.body):
                raise GemmError(f"epilogue {kernel.name}: partial {x.header()} has loops or stores inside")
            col = ir.IBin("+", ir.IBin("*", ir.Var("t"), ir.IConst(w)), ir.Var("c"))
            wrapped = ir.IBin("%", col, ir.IConst(want[-1]))
            for y in x.body:  # c only inside the group's column t * W + c (read as n)
                y = _partial_indices(y, col, wrapped, True)
                exprs = y.index if isinstance(y, ir.Load) else (y.expr,) if isinstance(y, ir.IndexValue) else ()
                free = set().union(*(ir.index_vars(e) for e in exprs)) if exprs else set()
                if not free <= {"b", "m", "t", "n", "nc"}:
                    raise GemmError(f"epilogue {kernel.name}: `{y}` in {x.header()} indexes with c other than "
                                    f"as the column t * {w} + c")
        if isinstance(x, ir.Store):
            if x.index != lead + (ir.Var("m"), ir.Var("t")) or x.value not in reduced:
                raise GemmError(f"epilogue {kernel.name}: `{x}`: partials store a reduction at [(b,) m, t]")
            if kernel.buffer(x.buf).shape != want[:-1] + (t,):
                raise GemmError(f"epilogue {kernel.name}: partial output {x.buf} has shape "
                                f"{kernel.buffer(x.buf).shape}, want {want[:-1] + (t,)}")


def _full_tiles(problem: GemmProblem, sched: GemmSchedule) -> bool:
    """Every tile lies wholly inside the output: the epilogue needs no bounds checks."""
    return problem.m % sched.span[0] == 0 and problem.n % sched.span[1] == 0


def stream_k_tiles(tiles: int, workers: int) -> int:
    """How many of the first tiles stream-K shares out by K steps: one whole wave plus the last
    partial one, so that every CTA's share is at least one tile's K steps long and a tile is
    cut at most once (two halves, one workspace slot pair per cut); none when the tiles make
    whole waves. Fewer tiles than CTAs is split-K's case, not this one."""
    if tiles < workers:
        raise GemmError(f"stream-K: {tiles} tiles (cluster pairs, with a cluster) are fewer than the {workers} "
                        f"CTAs (clusters) to share them; split_k is for less than a wave")
    return 0 if tiles % workers == 0 else workers + tiles % workers


def stream_k_units(tiles: int, k_iters: int, workers: int, worker: int) -> list[tuple[int, int, int]]:
    """CTA `worker`'s work units (tile, first K step, end K step) in the order it runs them.

    Its share is an even cut of the first stream_k_tiles' K steps: the tail of one tile, maybe
    a whole tile, the head of another. It runs the whole tile first, then the head, then the
    tail, and then whole tiles a wave apart. That order keeps the CTAs in step along K: every
    CTA starts at K step 0 and every tail ends at the share's end, so the CTAs that read one
    row of A or one column of B read each K step of it at about the same time, and L2 serves
    all but the first. Run in the share's own order (tail first), each CTA is at its own K
    step, and every CTA streams its A and B rows from DRAM: 4096^3 took 1.3x as long (H100,
    session 12). This is the kernel's `tf_units`, mirrored for the tests."""
    sk_tiles = stream_k_tiles(tiles, workers)
    shared = sk_tiles * k_iters
    lo, hi = worker * shared // workers, (worker + 1) * shared // workers
    whole = [(t, 0, k_iters) for t in range(-(-lo // k_iters), hi // k_iters)]
    head = [(hi // k_iters, 0, hi % k_iters)] if hi % k_iters else []
    tail = [(lo // k_iters, lo % k_iters, k_iters)] if lo % k_iters else []
    return whole + head + tail + [(t, 0, k_iters) for t in range(sk_tiles + worker, tiles, workers)]


def _slot_float4s(sched: GemmSchedule, mb_count: int) -> int:
    """A warpgroup's partial tile in float4s: one per thread per four accumulators."""
    return mb_count * (sched.bn // 2) // 4 * 128


def _partial_io(sched: GemmSchedule, mb_count: int, dst: str, src: str, store_indent: int,
                load_indent: int) -> tuple[str, str]:
    """Lines that store the accumulators to `dst` and add them back from `src` (float4 pointers
    already offset by the thread), in fragment order, one float4 per thread per step, so each
    access is coalesced."""
    quads = [(mb, j) for mb in range(mb_count) for j in range(0, sched.bn // 2, 4)]
    store = "\n".join(f"{' ' * store_indent}__stcg({dst} + {q * 128}, make_float4(acc[{mb}][{j}], "
                      f"acc[{mb}][{j + 1}], acc[{mb}][{j + 2}], acc[{mb}][{j + 3}]));"
                      for q, (mb, j) in enumerate(quads))
    load = "\n".join(f"{' ' * load_indent}{{ const float4 v = __ldcg({src} + {q * 128}); acc[{mb}][{j}] += v.x; "
                     f"acc[{mb}][{j + 1}] += v.y; acc[{mb}][{j + 2}] += v.z; acc[{mb}][{j + 3}] += v.w; }}"
                     for q, (mb, j) in enumerate(quads))
    return store, load


STREAM_K_PRELUDE = r"""
__device__ __forceinline__ int tf_ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
struct tf_units {  // stream-K: this CTA's share of the first sk_tiles tiles' K steps, then whole tiles
  int whole, whole_end, head_t, head_hi, tail_t, tail_lo, dp, tiles;
  __device__ __forceinline__ tf_units(int w, int tiles_) : tiles(tiles_) {
    const int sk_tiles = tiles % STREAM_K ? STREAM_K + tiles % STREAM_K : 0;  // stream_k_tiles
    const long long sk_iters = (long long)sk_tiles * K_ITERS;
    const long long lo = (long long)w * sk_iters / STREAM_K, hi = (long long)(w + 1) * sk_iters / STREAM_K;
    whole = (int)((lo + K_ITERS - 1) / K_ITERS);
    whole_end = head_t = (int)(hi / K_ITERS);
    head_hi = (int)(hi % K_ITERS);
    tail_t = (int)(lo / K_ITERS);
    tail_lo = (int)(lo % K_ITERS);
    dp = sk_tiles + w;
  }
  // whole tiles of the share, its last tile's head, its first tile's tail (in step along K), then a wave apart
  __device__ __forceinline__ bool next(int& t, int& k_lo, int& k_hi) {
    k_lo = 0;
    k_hi = K_ITERS;
    if (whole < whole_end) { t = whole++; return true; }
    if (head_hi) { t = head_t; k_hi = head_hi; head_hi = 0; return true; }
    if (tail_lo) { t = tail_t; k_lo = tail_lo; tail_lo = 0; return true; }
    if (dp >= tiles) return false;
    t = dp;
    dp += STREAM_K;
    return true;
  }
};
"""


def _stream_k_fixup(sched: GemmSchedule, mb_count: int) -> str:
    """Stream-K: a tile cut between CTAs w and w + 1 (w runs its head, w + 1 its tail) meets in
    the cut's slot pair. Each half first looks whether the other is in already; if so it only
    reads that half (no write, no count), else it writes its own and counts in, as in
    split-K, and whoever counts in second reads the other. The second adds the other's half
    to its own registers and runs the epilogue; one f32 add commutes, so the sum is the same
    bits whichever half that is. The tail ends its CTA's share, long after the head, so it
    nearly always finds the head in. Nobody spins, so no CTA waits on one not resident."""
    per = _slot_float4s(sched, mb_count)
    store, load = _partial_io(sched, mb_count, "mine", "other", 10, 8)
    return f"""      if (k_lo != 0 || k_hi != K_ITERS) {{  // stream-K: this tile is cut; its two halves meet in a slot pair
        const int head = k_lo == 0;
        const int cut = (head ? first + 1 : first) * CLUSTER + rank;
        float4* slots = reinterpret_cast<float4*>(tf_ws) + (size_t)cut * {2 * sched.consumers * per} + c * {per} + tid;
        float4* mine = slots + (head ? 0 : {sched.consumers * per});
        const float4* other = slots + (head ? {sched.consumers * per} : 0);
        int* flag = tf_flags + cut * {sched.consumers} + c;
        int in = 0;
        if (tid == 0) in = tf_ld_acquire(flag);  // the other half is in already
        if (!tf_bar_any(1 + c, 128, in)) {{
{store}
          __threadfence();  // each thread's slot writes visible GPU-wide before the count says so
          tf_named_bar(1 + c, 128);
          int last = 0;
          if (tid == 0) {{
            last = atomicAdd(flag, 1) == 1;
            if (last) __threadfence();
          }}
          if (!tf_bar_any(1 + c, 128, last)) continue;
        }}
        if (tid == 0) *flag = 0;  // for the next launch
{load}
      }}
"""


def _split_fixup(sched: GemmSchedule, mb_count: int) -> str:
    """Split-K: every slice writes its partial sums to its own workspace slot and counts itself
    in (an atomic per tile and warpgroup, after every writer's GPU-scope fence); the slice that counts last
    sums every slot, its own included, in slice order, puts the counter back to zero for the
    next launch and runs the epilogue; the others go on to their next unit. Nobody waits for
    anybody (no spin, no order between slices), so one write and one read of the tile's
    partials is all the reduction costs. The fixed order makes the sum the same whichever
    slice comes last: adding the others onto its own registers rounded differently from
    launch to launch (the tuner's two-launch check caught it at 128x4096x4096, split 4).
    Slots are in fragment order, one float4 per thread per step: each access is coalesced."""
    per = _slot_float4s(sched, mb_count)
    store, load = _partial_io(sched, mb_count, f"ws + split * {per}", "ws + o", 8, 12)
    zero = "\n".join(f"        acc[{mb}][{j}] = 0.f;" for mb in range(mb_count) for j in range(sched.bn // 2))
    return f"""      {{  // split-K: each slice leaves its partial sums in its slot; the last to count in adds them up
        float4* ws = reinterpret_cast<float4*>(tf_ws) + (size_t)(t * {sched.consumers} + c) * (SPLIT * {per}) + tid;
        int* flag = tf_flags + t * {sched.consumers} + c;
{store}
        __threadfence();  // each thread's slot writes visible GPU-wide before the count says so
        tf_named_bar(1 + c, 128);
        int last = 0;
        if (tid == 0) {{
          last = atomicAdd(flag, 1) == SPLIT - 1;
          if (last) {{ __threadfence(); *flag = 0; }}
        }}
        if (!tf_bar_any(1 + c, 128, last)) continue;
{zero}
        #pragma unroll 1
        for (int o2 = 0; o2 < SPLIT; ++o2) {{  // in slice order: the same sum every launch
          const int o = o2 * {per};
{load}
        }}
      }}"""


def _early_loads(early: dict, k_iters: int, row_offset: str) -> list[str]:
    """The main loop's lines that issue the epilogue's early load groups (_epilogue_code_tma),
    spread evenly over its last early["steps"] K steps (all of them where it has fewer; one
    step, the last, if not given), in order: the first slots' words first."""
    groups = early["groups"]
    steps = max(1, min(early.get("steps", 1), k_iters))
    out = []
    for s in range(steps):
        mine = [g for i, g in enumerate(groups) if i * steps // len(groups) == s]
        if not mine:
            continue
        out += [f"        if (kt == K_ITERS - {steps - s}) {{",
                f"          const int row_base = tm * BM{row_offset}, col_base = tn * BN;"]
        out += ["          " + x for x in early["coords"]]
        out += ["          " + x for g in mine for x in g]
        out.append("        }")
    return out


ONE_CONSUMER_PRODUCER_REGS = 56


def _producer_regs(s: GemmSchedule) -> int:
    """The producer's register cap. Beside one consumer 40 is needlessly tight: an N-major B
    with A multicast (64x128, 8 stages) spilled 28 bytes there, clean at 48."""
    return s.producer_regs if s.consumers == 2 else max(s.producer_regs, ONE_CONSUMER_PRODUCER_REGS)


def kernel_name(problem: GemmProblem, sched: GemmSchedule, kernel: ir.Kernel, h: str | None = None) -> str:
    """The kernel's name: problem, knobs, and `h` (default: the epilogue's structural hash)."""
    if h is None:
        from ..loop.canon import structural_hash

        h = structural_hash(kernel)[:10]
    return (f"tf_gemm_sm90_{problem.batch}x{'M' if problem.m_arg else problem.m}x{problem.n}x{problem.k}"
            f"_{problem.dtype}_b{problem.b_major}"
            f"_{sched.bm}x{sched.bn}x{sched.bk}s{sched.stages}c{sched.consumers}g{sched.group_m}"
            f"{f'm{sched.cluster_m}' if sched.cluster_m > 1 else ''}{f'n{sched.cluster_n}' if sched.cluster_n > 1 else ''}"
            f"{'' if sched.tma_store else 'd'}"
            f"{'p' if sched.pingpong else ''}{f'k{sched.split_k}' if sched.split_k > 1 else ''}"
            f"{f'sk{sched.stream_k}' if sched.stream_k else ''}{'r' if sched.tma_loads else ''}"
            f"{'l' if sched.defer_stores else ''}_{h}")


_RENDERED: dict = {}  # _m_free_key -> the GemmSource rendered at the first M of that key


def prefetch_b(problem: GemmProblem, sched: GemmSchedule) -> bool:
    """Whether the producer loads B's first stages before waiting for the kernel before it
    (programmatic dependent launch): where B is a weight no kernel writes (`b_const`) and no
    cluster shares the loads (a multicast lands in the peer's stages too)."""
    return problem.b_const and sched.cluster_m * sched.cluster_n == 1


def _producer_loop(problem: GemmProblem, S: GemmSchedule, split: int, prod_head: str, k_range: str,
                   pair_coord: str, a_load: str, b_loads: list) -> tuple[str, str, str]:
    """The producer thread's loop over its units' K steps, and where the kernel waits for the
    kernel before it (programmatic launch): (loop, the wait every thread makes after the barrier
    set-up, the consumers' own wait). Where B is a weight (`prefetch_b`), B's loads for the first
    unit's first STAGES steps go out before the producer's wait (the stages' bytes expected
    then), its main loop skips them, and the consumers wait for themselves; else every thread
    waits before the roles part."""
    b_lines = "\n".join("          " + x for x in b_loads)
    if not prefetch_b(problem, S):
        loop = f"""
{prod_head}
        int batch, tm, tn;
        tf_tile_coords(t, TILES_M, batch, tm, tn);
        {pair_coord}
        for ({k_range}) {{
          tf_bar_wait(bars + 8 * (STAGES + stage), phase ^ 1);
          const unsigned full = bars + 8 * stage;
          tf_bar_expect(full, STAGE_TX);
          const unsigned sa = base + stage * STAGE_BYTES, sb = sa + A_BYTES;
          {a_load}
{b_lines}
          if (++stage == STAGES) {{ stage = 0; phase ^= 1; }}
        }}"""
        return loop, "\n  tf_pdl_wait();    // and this one touches global memory only once the one before has finished", ""
    # the first unit as the loop takes it: whole tiles, K slices, or stream-K's first share
    # (peeked in a scope of its own: the loop declares the same names)
    first_unit = ("if (first < UNITS) {\n        const int t = first / SPLIT, k_lo = (first % SPLIT) * K_SPLIT, "
                  "k_hi = min(k_lo + K_SPLIT, K_ITERS);" if split > 1 else
                  "{\n      tf_units peek(first, TILES);\n      int t, k_lo, k_hi;\n      "
                  "if (peek.next(t, k_lo, k_hi)) {" if S.stream_k else
                  "if (first < TILES) {\n        const int t = first, k_lo = 0, k_hi = K_ITERS;")
    b_inner = "\n".join("            " + x for x in b_loads)
    loop = f"""
      int pre = 0;  // steps of the first unit whose B went out before the wait (stages 0, 1, ...)
      {first_unit}
        int batch, tm, tn;
        tf_tile_coords(t, TILES_M, batch, tm, tn);
        {pair_coord}
        for (int kt = k_lo; kt < k_hi && pre < STAGES; ++kt, ++pre) {{
          const unsigned full = bars + 8 * pre;
          tf_bar_expect(full, STAGE_TX);
          const unsigned sb = base + pre * STAGE_BYTES + A_BYTES;
{b_lines}
        }}
      }}{"}" if S.stream_k else ""}
      tf_pdl_wait();  // A is the kernel before's output
{prod_head}
        int batch, tm, tn;
        tf_tile_coords(t, TILES_M, batch, tm, tn);
        {pair_coord}
        for ({k_range}) {{
          const unsigned full = bars + 8 * stage;
          const unsigned sa = base + stage * STAGE_BYTES, sb = sa + A_BYTES;
          if (pre > 0) {{
            --pre;  // B is in flight, the stage's bytes expected
          }} else {{
            tf_bar_wait(bars + 8 * (STAGES + stage), phase ^ 1);
            tf_bar_expect(full, STAGE_TX);
{b_inner}
          }}
          {a_load}
          if (++stage == STAGES) {{ stage = 0; phase ^= 1; }}
        }}"""
    return loop, "", "\n    tf_pdl_wait();  // (the epilogue reads and writes global memory)"


def render(problem: GemmProblem, sched: GemmSchedule | None = None) -> GemmSource:
    """CUDA C++ for one GEMM (+ epilogue). Where M is the kernel's argument, a source rendered
    for another M of the same key (_m_free_key) is the source for this M too: a new prompt
    length renders no GEMM it has rendered at another (0.1-0.4 s of Python each)."""
    sched = sched or default_schedule(problem)
    key = _m_free_key(problem, sched)
    hit = _RENDERED.get(key) if key is not None else None
    if hit is not None:
        return _at_m(hit, problem)
    src = _render(problem, sched)
    if key is not None and src.m_arg:
        if len(_RENDERED) > 512:
            _RENDERED.clear()
        _RENDERED[key] = src
    return src


def _m_free_key(problem: GemmProblem, sched: GemmSchedule):
    """What the source of a GEMM taking M as an argument is made from, M left out: the problem
    but M, the schedule, whether M fills whole tiles, and the epilogue with M's extents zeroed.
    None (render every time) wherever M might reach the source other than as the argument: M
    baked, a batch, or an epilogue buffer indexed by m in other than its first dimension (its
    size would be a stride) or not M long."""
    if problem.m_arg is False or rows_as_argument(problem, sched) is not None:
        return None
    kernel = problem.out_epilogue
    dims = epi.row_dims(kernel)
    params = []
    for b in kernel.params:
        if dims[b.name] not in ((), (0,)) or (dims[b.name] and b.shape[0] != problem.m):
            return None
        params.append(replace(b, shape=(0,) + b.shape[1:]) if dims[b.name] else b)
    loops_ok = True

    def zeroed(stmts):
        nonlocal loops_ok
        out = []
        for x in stmts:
            if isinstance(x, ir.Loop):
                if x.var == "m":
                    loops_ok &= x.extent == problem.m
                x = replace(x, extent=0 if x.var == "m" else x.extent, body=zeroed(x.body))
            elif isinstance(x, ir.Reduce):
                x = replace(x, body=zeroed(x.body))
            out.append(x)
        return tuple(out)

    free = replace(kernel, params=tuple(params), body=zeroed(kernel.body))
    if not loops_ok:
        return None
    # constants as the source writes them (-0.0 == 0.0 in Python, not in C), and the template's
    # own constants (a bench or test that changes one must not get a source rendered before)
    consts = tuple(repr(x.value) for x in ir.walk(kernel.body) if isinstance(x, ir.Const))
    knobs = tuple((k, v) for k, v in globals().items()
                  if k.isupper() and isinstance(v, (int, float, str, tuple)) and not k.endswith("PRELUDE"))
    return (free, consts, knobs, kernel.scratch, problem.n, problem.k, problem.dtype, problem.b_major,
            problem.m_arg, problem.b_const, sched, problem.m % sched.span[0] == 0)


def _at_m(src: GemmSource, problem: GemmProblem) -> GemmSource:
    """`src`, rendered for another M of its key, as the source of `problem`."""
    P = replace(problem, m_arg=True)
    work = _work(P, src.schedule)
    return replace(src, problem=P, grid_tiles=work["grid_tiles"], workspace=work["workspace"], flags=work["flags"])


def _work(P: GemmProblem, S: GemmSchedule) -> dict:
    """The tile counts of a launch at P's M, and the workspace they need (split-K, stream-K)."""
    mb_count = S.rows_per_wg // 64
    tiles_m, tiles_n = -(-P.m // S.span[0]), -(-P.n // S.span[1])
    tiles = tiles_m * tiles_n * P.batch
    k_iters = -(-P.k // S.bk)
    split = S.split_k
    k_split = -(-k_iters // split)
    if (split - 1) * k_split >= k_iters:
        raise GemmError(f"split_k={split}: K={P.k} is {k_iters} steps of {S.bk}, too few for {split} "
                        f"non-empty slices")
    cl = S.cluster_m * S.cluster_n
    workers = S.stream_k // cl  # stream-K's clusters: each CTA of a pair runs its pair's share
    if S.stream_k:
        stream_k_tiles(tiles, workers)  # (raises where stream-K cannot share these tiles)
    ws = tiles * S.consumers * mb_count * (S.bn // 2) * 128 * split if split > 1 else 0  # a slot per slice
    flags = tiles * S.consumers if split > 1 else 0
    if S.stream_k:  # a slot pair per cut, a cut at the start of each CTA (the first CTA's unused)
        ws = S.stream_k * 2 * S.consumers * _slot_float4s(S, mb_count) * 4
        flags = S.stream_k * S.consumers
    return {"tiles_m": tiles_m, "tiles_n": tiles_n, "tiles": tiles, "k_iters": k_iters, "k_split": k_split,
            "units": tiles * split, "workers": workers, "grid_tiles": workers or tiles * split,
            "workspace": ws, "flags": flags}


def _render(problem: GemmProblem, sched: GemmSchedule) -> GemmSource:
    why = problem.tma_ok()
    if why:
        raise GemmError(f"the sm_90 GEMM reads operands with TMA, which cannot take this problem: {why}")
    kernel = problem.out_epilogue
    _check_epilogue(problem, kernel, partials=True)
    pw = epi.partial_width(kernel)
    if pw is not None and sched.bn % pw:
        raise GemmError(f"bn={sched.bn}: the epilogue's partial row reductions take groups of {pw} columns, "
                        f"so a tile must hold whole groups (bn a multiple of {pw})")
    smem = sched.smem_bytes()
    if smem > SMEM_LIMIT:
        raise GemmError(f"{sched} needs {smem} bytes of shared memory; the limit is {SMEM_LIMIT}")
    store_dt = _tma_store_dtype(problem, sched, kernel)
    res_load = tma_residual(problem, sched, kernel)
    if sched.tma_loads and res_load is None:  # nothing TMA can load here: the kernel without
        sched = replace(sched, tma_loads=False)
    if sched.defer_stores and not defers_stores(problem, sched, kernel):  # likewise
        sched = replace(sched, defer_stores=False)
    staging = _store_staging_bytes(sched) if store_dt else 0
    if smem + staging > SMEM_LIMIT:  # no room for the store slots: store straight from registers
        store_dt, staging = None, 0
    smem += staging + (RESIDUAL_BARS * sched.consumers if res_load is not None else 0)

    fixed = rows_as_argument(problem, sched)
    if problem.m_arg and fixed:
        raise GemmError(f"m_arg=True: this kernel needs M as a number: {fixed}")
    problem = replace(problem, m_arg=problem.m_arg is not False and fixed is None)
    a = _operand(sched.bm, sched.bk, "K")
    b = _operand(sched.bn, sched.bk, "K" if problem.b_major == "K" else "MN")
    # with M an argument the name is a hash of the source (the epilogue's hash holds M's shapes)
    name = "tf_gemm_@NAME@" if problem.m_arg else kernel_name(problem, sched, kernel)
    P, S = problem, sched
    CLM, CLN = S.cluster_m, S.cluster_n
    CL = CLM * CLN
    # with a cluster, tiles are counted in CTA pairs along M (an odd last row of tiles is
    # computed on zeros past M and not stored) or along N (N must hold whole pairs)
    if CLN > 1 and P.n % S.span[1]:
        raise GemmError(f"N={P.n}: a 1x{CLN} cluster needs N a multiple of {CLN} x bn={S.bn}")
    mb_count = S.rows_per_wg // 64
    work = _work(P, S)
    tiles_m, tiles_n, tiles, k_iters, k_split = (work[x] for x in ("tiles_m", "tiles_n", "tiles", "k_iters", "k_split"))
    split, units, workers = S.split_k, work["units"], work["workers"]
    sk_defines = f"\n#define STREAM_K {workers}" if S.stream_k else ""
    stage_bytes = a.bytes + b.bytes
    trans_b = 1 if problem.b_major == "N" else 0
    ops_params = epi.operands(kernel)
    out_params = kernel.outputs
    cparams = ["const __grid_constant__ tf_tmap a_map", "const __grid_constant__ tf_tmap b_map"]
    if store_dt:
        cparams.append("const __grid_constant__ tf_tmap c_map")
    if res_load is not None:
        cparams.append("const __grid_constant__ tf_tmap r_map")
    if split > 1 or S.stream_k:
        cparams += ["float* __restrict__ tf_ws", "int* __restrict__ tf_flags"]
    cparams += [f"{cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in out_params]
    cparams += [f"const {cexpr.storage_ctype(p.dtype)}* __restrict__ {_ident(p.name)}" for p in ops_params]
    if P.m_arg:
        cparams.append("const int tf_m")
    if S.pingpong:
        # Consumer c takes this CTA's tiles c, c + 2, ...; the stage ring is filled in tile order,
        # so its first stage of tile i is (i * K_ITERS) % STAGES. Main loops take turns through
        # named barriers 3 + c ("c may start"): besides overlapping one consumer's epilogue with
        # the other's MMAs, the turn keeps a waiting consumer at most one phase ahead of the
        # stage barriers, which is what a parity wait needs.
        loop_head = """    int seq = c;  // this tile's place in the CTA's sequence
    for (int t = first + c * step; t < TILES; t += 2 * step, seq += 2) {
      { const unsigned g = (unsigned)seq * K_ITERS; stage = g % STAGES; phase = (g / STAGES) & 1u; }"""
        turn_wait = "      if (seq > 0) tf_named_bar(3 + c, 256);  // the other consumer's main loop has issued"
        turn_pass = "      if (t + step < TILES) tf_named_arrive(3 + (c ^ 1), 256);  // its turn"
        a_offset, row_offset = "", ""
    else:
        loop_head = "    for (int t = first; t < TILES; t += step) {"
        turn_wait = turn_pass = ""
        a_offset, row_offset = f" + c * {S.rows_per_wg * 128}", f" + c * {S.rows_per_wg}"
    if split > 1:
        loop_head = """    for (int u = first; u < UNITS; u += step) {
      const int t = u / SPLIT, split = u % SPLIT;
      const int k_lo = split * K_SPLIT, k_hi = min(k_lo + K_SPLIT, K_ITERS);"""
        k_range = "int kt = k_lo; kt < k_hi; ++kt"
        prod_head = """      for (int u = first; u < UNITS; u += step) {
        const int t = u / SPLIT, k_lo = (u % SPLIT) * K_SPLIT, k_hi = min(k_lo + K_SPLIT, K_ITERS);"""
    elif S.stream_k:
        loop_head = """    tf_units units(first, TILES);
    int t, k_lo, k_hi;
    while (units.next(t, k_lo, k_hi)) {"""
        k_range = "int kt = k_lo; kt < k_hi; ++kt"
        prod_head = """      tf_units units(first, TILES);
      int t, k_lo, k_hi;
      while (units.next(t, k_lo, k_hi)) {"""
    else:
        k_range = "int kt = 0; kt < K_ITERS; ++kt"
        prod_head = "      for (int t = first; t < TILES; t += step) {"
    # B coordinates of a (k, n) tile: K-major reads box (k, n); N-major reads box (n, k) per 64-wide span
    # With a cluster, each CTA loads half of B and multicasts it to both.
    b_box = b.box
    if CLN == 1:
        a_box, a_load = (a.box[0], a_rows(problem, S)), "tf_tma_load(sa, &a_map, kt * BK, tm * BM, batch, full);"
    else:  # each CTA of the pair loads half of the A tile's rows and multicasts it to both
        half = S.bm // 2
        a_box = (a.box[0], half)
        a_load = f"tf_tma_load_mc(sa + rank * {half * 128}, &a_map, kt * BK, tm * BM + rank * {half}, batch, full, 3);"
    if problem.b_major == "K":
        if CLM == 1:
            b_loads = ["tf_tma_load(sb, &b_map, kt * BK, tn * BN, batch, full);"]
        else:
            half = S.bn // 2
            b_box = (b.box[0], half)
            b_loads = [f"tf_tma_load_mc(sb + rank * {half * 128}, &b_map, kt * BK, tn * BN + rank * {half}, "
                       f"batch, full, 3);"]
    else:
        if CLM == 1:
            b_loads = [f"tf_tma_load(sb + {j * b.box_step}, &b_map, tn * BN + {j * 64}, kt * BK, batch, full);"
                       for j in range(b.boxes)]
        else:
            if b.boxes % 2:
                raise GemmError(f"bn={S.bn}: a 2-CTA cluster with N-major B needs bn a multiple of 128")
            per = b.boxes // 2
            b_loads = [f"tf_tma_load_mc(sb + (rank * {per} + {j}) * {b.box_step}, &b_map, "
                       f"tn * BN + (rank * {per} + {j}) * 64, kt * BK, batch, full, 3);" for j in range(per)]

    early = {"decl": [], "coords": [], "groups": []}  # (filled where the epilogue loads ahead: _epilogue_code_tma)
    inl = inline_partials(problem, kernel)
    if store_dt:
        lines = _epilogue_code_tma(problem, sched, kernel, store_dt, early, res_load, inl)
    elif epi.inner_body(kernel) or epi.partials_loop(kernel) is None:
        lines = _epilogue_code(problem, sched, kernel, inl)
    else:  # partial row reductions only: the tile itself is not stored
        lines = []
    if inl is not None:  # (the element code has bound frag_row)
        lines = inline_partials_decl(sched, inl) + lines + inline_partials_finish(problem, sched, kernel, inl)
    elif pw is not None:  # (the element code, if any, has bound frag_row and frag_col)
        lines += _partials_code(problem, sched, kernel, frag_coords=not lines)
    decl_early = "\n".join("      " + x for x in early["decl"])
    defer = early.get("defer")
    defer_decl = defer_loop = defer_after = defer_flush = ""
    if defer:  # (defers_stores) slot b of the last tile at K step b, those past the loop after it
        boxes = defer["boxes"]
        defer_decl = "\n" + "\n".join("    " + x for x in defer["decl"])
        defer_peel = min(len(boxes), k_iters)
        defer_loop = ("        if (pending) {\n" + "".join(
            f"          {'if' if b == 0 else '} else if'} (kt == {b}) {{\n" + "\n".join("          " + x for x in box) + "\n"
            for b, box in enumerate(boxes[:defer_peel])) + "          }\n        }\n")
        late = [x for b, box in enumerate(boxes) if b >= k_iters for x in box]
        defer_after = ("      if (pending) {\n" + "\n".join("      " + x for x in late) + "\n      }\n" if late else "") \
            + "      pending = false;\n"
        defer_flush = ("    if (pending) {  // the last tile's slots\n" + "\n".join("    " + x for b in boxes for x in b)
                       + "\n    }\n")
    loads_early = "\n".join(_early_loads(early, k_iters, row_offset))
    res_init = res_state = ""
    if res_load is not None:  # the residual's TMA loads, issued from the main loop's third K step
        res_init = (f"\n    for (int c = 0; c < {S.consumers}; ++c) "
                    f"tf_bar_init(bars + 8 * (2 * STAGES) + {RESIDUAL_BARS} * c, 1);")
        res_state = (f"\n    const unsigned res_bar = bars + 8 * (2 * STAGES) + {RESIDUAL_BARS} * c;"
                     "\n    unsigned res_phase = 0;")
        issue = []
        for kt, box_lines in residual_tma_issue(S, k_iters):
            issue += [f"        if (kt == {kt} && tid == 0) {{",
                      f"          const int row_base = tm * BM{row_offset}, col_base = tn * BN;"]
            issue += ["          " + x for x in box_lines] + ["        }"]
        loads_early = "\n".join(issue) + ("\n" + loads_early if loads_early else "")
    pair_coord = "tn = tn * CLUSTER + rank;" if CLN > 1 else "tm = tm * CLUSTER + rank;"
    producer_loop, common_wait, consumer_wait = _producer_loop(problem, S, split, prod_head, k_range, pair_coord,
                                                               a_load, b_loads)
    # (no division where there is one batch: with TILES_M an argument it would not fold away)
    batch_coord = ("  batch = 0;" if P.batch == 1 else
                   "  batch = t / (tiles_m * TILES_N);\n  t -= batch * (tiles_m * TILES_N);")
    tiles_m_decl = f"\n  const int tf_tiles_m = (tf_m + {S.span[0] - 1}) / {S.span[0]};" if P.m_arg else ""
    src = []
    w = src.append
    w(f"// {name}\n// {P.batch} x ({P.M} x {P.k}) @ ({P.n} x {P.k} {'K-major' if P.b_major == 'K' else 'N-major'}) {P.dtype}, {S}")
    w(f"// A smem tile {a.layout}, wgmma {a.desc}, TMA box {a_box}")
    w(f"// B smem tile {b.layout}, wgmma {b.desc}, TMA box {b_box} x {len(b_loads)}")
    w(f"// epilogue {kernel.name}: " + "; ".join(str(s) for s in epi.inner_body(kernel)))
    if pw is not None:
        w(f"// partial row reductions over {pw}-column groups: "
          + "; ".join(x.header() if isinstance(x, ir.Reduce) else str(x) for x in epi.partials_loop(kernel).body))
    w(cexpr.PRELUDE)
    w(PRELUDE)
    w(_wgmma_fn(S.bn, P.dtype, trans_b))
    w(f"""
#define BM {S.bm}
#define BN {S.bn}
#define BK {S.bk}
#define STAGES {S.stages}
#define TILES_M {"tf_tiles_m" if P.m_arg else tiles_m}
#define TILES_N {tiles_n}
#define TILES {"(TILES_M * TILES_N)" if P.m_arg else tiles}
#define K_ITERS {k_iters}
#define SPLIT {split}
#define K_SPLIT {k_split}
#define UNITS {"(TILES * SPLIT)" if P.m_arg else units}{sk_defines}
#define GROUP_M {S.group_m}
#define CLUSTER {CL}
#define A_BYTES {a.bytes}
#define STAGE_BYTES {stage_bytes}
#define STAGE_TX {stage_bytes - a.bytes + a_rows(problem, S) * (a.bytes // S.bm)}
#define DESC_A {a.desc.encode()}ULL
#define DESC_B {b.desc.encode()}ULL

__device__ __forceinline__ void tf_tile_coords(int t, int tiles_m, int& batch, int& tm, int& tn) {{
{batch_coord}
  const int per_group = GROUP_M * TILES_N;
  const int first_m = (t / per_group) * GROUP_M;
  const int rows = min(tiles_m - first_m, GROUP_M);
  tm = first_m + (t % per_group) % rows;
  tn = (t % per_group) / rows;
}}
{STREAM_K_PRELUDE if S.stream_k else ""}
extern "C" __global__ void __launch_bounds__({S.threads}, 1)
{name}({", ".join(cparams)}) {{
  extern __shared__ __align__(1024) unsigned char tf_smem_raw[];
  const unsigned base = (tf_smem_addr(tf_smem_raw) + 1023u) & ~1023u;
  const unsigned staging = base + STAGES * STAGE_BYTES;   // TMA-store slots ({staging} bytes)
  const unsigned bars = staging + {staging};   // full[s] at bars + 8s, empty[s] at bars + 8(STAGES + s)
  const int wg = threadIdx.x / 128;{tiles_m_decl}
  const int rank = {"blockIdx.x % CLUSTER" if CL > 1 else "0"};
  const int first = blockIdx.x / CLUSTER, step = gridDim.x / CLUSTER;
  if (threadIdx.x == 0) {{
    for (int s = 0; s < STAGES; ++s) {{
      tf_bar_init(bars + 8 * s, 1);
      tf_bar_init(bars + 8 * (STAGES + s), {(1 if S.pingpong else S.consumers) * CL});
    }}{res_init}
    asm volatile("fence.mbarrier_init.release.cluster;\\n\\tfence.proxy.async.shared::cta;" ::: "memory");
  }}
  {"tf_cluster_sync_all();" if CL > 1 else "__syncthreads();"}
  tf_pdl_launch();  // the next kernel may start once every CTA is here (programmatic launch){common_wait}
  int stage = 0;
  unsigned phase = 0;
  if (wg == 0) {{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 {_producer_regs(S)};");
    if (threadIdx.x == 0) {{{producer_loop}
      }}
    }}
  }} else {{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 {S.consumer_regs};");{consumer_wait}
    const int c = wg - 1;
    const int tid = threadIdx.x % 128;
    const unsigned stage_out = staging + c * {staging // S.consumers};
    unsigned ep_slot = 0;{res_state}{defer_decl}
{loop_head}
      int batch, tm, tn;
      tf_tile_coords(t, TILES_M, batch, tm, tn);
      {pair_coord}
      float acc[{mb_count}][{S.bn // 2}];
      #pragma unroll
      for (int i = 0; i < {mb_count}; ++i)
        #pragma unroll
        for (int j = 0; j < {S.bn // 2}; ++j) acc[i][j] = 0.f;
      int prev = -1;
{decl_early}
{turn_wait}""")
    step_head = f"""{loads_early}
        tf_bar_wait(bars + 8 * stage, phase);
        const unsigned sa = base + stage * STAGE_BYTES{a_offset}, sb = base + stage * STAGE_BYTES + A_BYTES;
        tf_wgmma_fence();
""" + "".join(f"        tf_wgmma(acc[{mb}], DESC_A | ((tf_u64)((sa + {mb * a.mn_stride + ka}) & 0x3FFFF) >> 4), "
              f"DESC_B | ((tf_u64)((sb + {kb}) & 0x3FFFF) >> 4));\n"
              for ka, kb in zip(a.k_offsets, b.k_offsets) for mb in range(mb_count)) + "        tf_wgmma_commit();\n"
    if CL == 1:
        release = "if (prev >= 0 && tid == 0) tf_bar_arrive(bars + 8 * (STAGES + prev));"
    else:  # the stage is refilled by multicast from both CTAs: release it in both
        release = ("if (prev >= 0 && tid < CLUSTER) tf_bar_arrive_cta(bars + 8 * (STAGES + prev), tid);")
    step_tail = f"""        tf_wgmma_wait<1>();
        {release}
        prev = stage;
        if (++stage == STAGES) {{ stage = 0; phase ^= 1; }}
      }}
"""
    if defer_loop:  # the first K steps peeled (unrolled), each writing its slot of the last tile
        w(f"      #pragma unroll\n      for (int kt = 0; kt < {defer_peel}; ++kt) {{\n" + step_head + defer_loop + step_tail
          + f"      for (int kt = {defer_peel}; kt < K_ITERS; ++kt) {{\n" + step_head + step_tail)
    else:
        w(f"      for ({k_range}) {{\n" + step_head + step_tail)
    w(f"""{turn_pass}
      tf_wgmma_wait<0>();
      {release}
{defer_after}{_split_fixup(S, mb_count) if split > 1 else _stream_k_fixup(S, mb_count) if S.stream_k else ""}      const int row_base = tm * BM{row_offset};
      const int col_base = tn * BN;""")
    for line in lines:
        w("      " + line)
    w("""    }""" + ("\n" + defer_flush.rstrip("\n") if defer_flush else "") + ("""
    if (tid == 0) tf_bulk_wait_read<0>();  // the slots must outlive the stores that read them""" if store_dt else "")
      + """
  }""" + ("""
  tf_cluster_sync_all();  // no CTA leaves while its peer may still signal its barriers""" if CL > 1 else "") + """
}
""")
    params = tuple(p.name for p in out_params) + tuple(p.name for p in ops_params)
    ws, flags = work["workspace"], work["flags"]
    pair_loads = tuple(dict.fromkeys(x.buf for x in _pair_loads(kernel, epi.inner_body(kernel), store_dt is not None)))
    text = "\n".join(src)
    if P.m_arg:
        import hashlib

        name = kernel_name(P, S, kernel, hashlib.sha256(text.encode()).hexdigest()[:10])
        text = text.replace("tf_gemm_@NAME@", name)
    return GemmSource(name=name, source=text, m_arg=bool(P.m_arg), grid_tiles=work["grid_tiles"], block=(S.threads, 1, 1),
                      pair_loads=pair_loads, exact_grid=bool(S.stream_k),
                      workspace=ws, flags=flags,
                      smem_bytes=smem, params=params, problem=problem, schedule=sched,
                      a_box=a_box, b_box=b_box, swizzle=hopper.tma_swizzle(a.layout, 16), cluster=CL,
                      c_box=hopper.tma_box(_store_layout(), "K", 16) if store_dt else None,
                      tma_loads=(res_load.buf,) if res_load is not None else (),
                      packed_tables=tuple(dict.fromkeys((x.buf, w) for x, w in packed_tables(problem, sched, kernel)))
                      if store_dt else ())

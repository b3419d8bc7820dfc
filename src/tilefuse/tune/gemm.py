"""The GEMM family (codegen/gemm_sm90.py) for the tuner: its knob space, references and cache key.

A GEMM is tuned as a `GemmTask` (a `GemmProblem` with the family name the tuner dispatches
on). Everything here uses the GEMM's public API only: `GemmProblem`, `GemmSchedule`,
`default_schedule`, `render` and `runtime.gemm.compile_gemm`, so the template can change
underneath as long as that API holds.

Knobs, most influential first (the search tree branches in this order): bm, bn, consumers,
stages, cluster_m, group_m; GemmSchedule's other fields follow, a bool both ways (e.g.
tma_store), anything else (bk, producer_regs, consumer_regs) at the heuristic's value, so a
knob added to the template is searched or carried without editing this file. Candidates:

- tiles: bm = 64 x rows x consumers with rows in {1, 2} 64-row wgmma blocks per consumer
  warpgroup and 1 or 2 consumers; bn in {32, 64, 96, 128, 160, 192, 256} (wgmma N; 32 only
  where 64-wide tiles would leave some of the 132 SMs without a tile). A tile must
  build a GemmSchedule (at most 160 accumulator registers per thread: 128-row warpgroups
  take bn <= 160). A tile taller (wider) than the problem's M (N) rounded up to a power of
  two (and than 64) is pruned: its extra rows (columns) would be computed on zeros.
- stages: the ring must fit the shared memory (`GemmSchedule.smem_bytes` against the
  template's `SMEM_LIMIT`); only the three deepest that fit are candidates: with one CTA
  per SM and no other use of shared memory, a shallower ring only hides less latency.
- an N-major B (x @ W) takes bn in whole 64-wide swizzle spans, and a 2-CTA cluster then
  whole pairs of them.
- cluster_m 2 (CTA pairs multicasting B) only with at least two tile rows.
- group_m in {1, 4, 8, 16}: values at or above the number of tile rows all raster the same
  way, so only one of those is kept: the heuristic's when it is one, else the smallest.
- split_k in {1, 2, 4}, the slices only where the tiles would leave at least half the SMs
  idle, the (tile, slice) units still make at most 1.25 waves, and each slice has at least
  4 K steps.
- stream_k in {0, 132} (a grid of one CTA per SM, the last waves shared out by K steps) only
  where the tiles make at least a wave and not a whole number of waves (else it cuts nothing).
- tma_loads (the residual by TMA into the store slots) only where `gemm_sm90.tma_residual`
  says it applies: a residual epilogue with room for the slots beside this ring.
- defer_stores (the TMA-store slots written under the next tile's MMAs) only where
  `gemm_sm90.defers_stores` says it applies.
- pingpong stays off: on an H100 its 128x128 tiles ran 2-7% slower than the cooperative
  128x256 at every plain and fused shape measured (bench/LOG_gemm.md, session 6), so the
  search does not spend its time there.

`valid` is the code generator's word: the schedule constructs and `render` accepts it for
this problem (TMA alignment, shared memory, multicast halves); a config that renders exactly
the kernel another already did (a knob the template ignores there, such as tma_store where
no staging fits) is a duplicate, not a candidate. The heuristic default is always one.

Correctness (`GemmCheck`): DESIGN.md's 2x rule per output, on a sample of output rows
(every row when M <= 256): the float64 reference is A @ B in float64 on the device, with the
epilogue program run by the Loop IR interpreter in float64; the low-precision baseline is
PyTorch's own bf16/f16 `torch.matmul` with the epilogue run by the interpreter in the
program's own dtypes. Every row of every output is still checked to be written (two
launches over differently poisoned outputs must agree, measure.py). Rows are sampled at
random (seeded) plus the first and last, so they fall at every position inside a tile and
in the tail tile; each sampled row covers every column.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Mapping

import numpy as np

from ..codegen import epilogue as epi
from ..codegen import gemm_sm90 as g
from ..loop import ir
from .space import Dim, Space

FAMILY = "gemm_sm90"
ROWS_PER_CONSUMER = (1, 2)   # 64-row wgmma blocks per consumer warpgroup
CONSUMERS = (1, 2)
BN = (32, 64, 96, 128, 160, 192, 256)
SMS = 132                    # the SM count default_schedule assumes (H100 SXM)
STAGES = tuple(range(2, 17))  # small tiles' rings go past 8 deep: more bytes in flight per SM
STAGE_DEPTHS = 3             # the deepest this-many stage counts that fit are candidates
CLUSTER_M = (1, 2)
GROUP_M = (1, 4, 8, 16)
SPLIT_K = (1, 2, 4)
STREAM_K = (0, SMS)
SAMPLE_ROWS = 256


@dataclass(frozen=True)
class GemmTask:
    """One GEMM (with its epilogue) as a kernel for the tuner: `family` routes it here."""

    problem: g.GemmProblem
    name: str = "gemm"

    @property
    def family(self) -> str:
        return FAMILY


def _pow2ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_knobs(problem: g.GemmProblem) -> dict:
    return asdict(g.default_schedule(problem))


def space(task: GemmTask, arch: str = "sm_90a") -> Space:
    """The knob space of a GEMM on sm_90a, with the heuristic default in it."""
    p = task.problem
    knobs = default_knobs(p)

    def sched(k: Mapping, **over) -> g.GemmSchedule:
        return g.GemmSchedule(**{**knobs, **{n: v for n, v in k.items()}, **over})

    def deepest(k: Mapping) -> int:
        fit = [s for s in STAGES if sched(k, stages=s).smem_bytes() <= g.SMEM_LIMIT]
        return max(fit, default=0)

    def covering_from(k: Mapping) -> int:  # tile rows of the grid: a group_m this tall covers it
        return _cdiv(p.m, k["bm"] * k["cluster_m"])

    def covering_pick(k: Mapping) -> int:  # the heuristic's group_m when it covers, else the smallest that does
        rows = covering_from(k)
        return knobs["group_m"] if knobs["group_m"] >= rows else min(x for x in GROUP_M + (knobs["group_m"],)
                                                                      if x >= rows)

    def admits(k: Mapping) -> bool:
        if all(knobs[n] == v for n, v in k.items()):
            return True  # the heuristic's pick and everything on the way to it
        if "bm" in k and k["bm"] > max(64, _pow2ceil(p.m)):
            return False  # taller than M needs: rows computed on zeros
        if "bn" in k and k["bn"] > max(64, _pow2ceil(p.n)):
            return False
        if "bn" in k and p.b_major == "N" and k["bn"] % 64:
            return False  # an N-major B tile is whole 64-wide (128-byte) swizzle spans
        if "bn" in k and k["bn"] < 64 and _cdiv(p.m, k["bm"]) * _cdiv(p.n, 64) * p.batch >= SMS:
            return False  # narrow tiles only where 64-wide ones leave SMs idle
        if "consumers" in k:
            try:
                sched(k, stages=2, cluster_m=1)
            except g.GemmError:
                return False  # BM = 64 x rows x consumers, accumulator registers
        if "stages" in k:
            try:
                top = deepest({n: v for n, v in k.items() if n != "stages"})
            except g.GemmError:
                return False
            if not top - STAGE_DEPTHS < k["stages"] <= top:
                return False
        if "cluster_m" in k and k["cluster_m"] > 1:
            if _cdiv(p.m, k["bm"]) < 2:
                return False  # one tile row: the pair's second CTA would compute zeros
            if p.b_major == "N" and k["bn"] % 128:
                return False  # each CTA multicasts whole 64-wide spans of an N-major B
        if "split_k" in k and k["split_k"] > 1:
            tiles = _cdiv(p.m, k["bm"]) * _cdiv(p.n, k["bn"]) * p.batch
            if tiles * 2 > SMS or tiles * k["split_k"] > SMS * 5 // 4:
                return False  # slices only where whole tiles leave SMs idle, and at most 1.25 waves of units
            if _cdiv(p.k, knobs["bk"]) < 4 * k["split_k"]:
                return False  # slices of at least 4 K steps (fewer: the reduction costs more than it saves)
        if "stream_k" in k and k["stream_k"]:
            workers = k["stream_k"] // (k["cluster_m"] * knobs["cluster_n"])
            tiles = _cdiv(p.m, k["bm"] * k["cluster_m"]) * _cdiv(p.n, k["bn"] * knobs["cluster_n"]) * p.batch
            if tiles < workers or tiles % workers == 0:
                return False  # less than a wave (split-K's case), or whole waves: nothing to share out
        if "group_m" in k and k["group_m"] >= covering_from(k):
            if k["group_m"] != covering_pick(k):
                return False  # every group as tall as the grid rasters alike: one of them
        if k.get("tma_loads"):
            try:
                if g.tma_residual(p, sched(k), p.out_epilogue) is None:
                    return False  # no residual TMA can bring into the slots here: the kernel without the knob
            except g.GemmError:
                return False
        if k.get("defer_stores"):
            try:
                if not g.defers_stores(p, sched(k), p.out_epilogue):
                    return False  # nothing to defer here: the kernel without the knob
            except g.GemmError:
                return False
        return True

    rendered: dict = {}  # what a config renders to -> the first config that did
    answers: dict = {}   # config -> valid (rendering costs ~0.1 s)

    def valid(k: Mapping) -> bool:
        if not answers and dict(k) != knobs:
            valid(knobs)  # the default claims its kernel first
        config = tuple(sorted(k.items()))
        if config not in answers:
            try:
                src = g.render(p, sched(k))
            except (g.GemmError, TypeError):
                answers[config] = False
            else:
                code = re.sub(r"//[^\n]*", "", src.source)  # header comments name every knob
                fp = (hashlib.sha256(code.encode()).hexdigest(), src.block, src.smem_bytes, src.cluster,
                      src.grid_tiles)
                answers[config] = rendered.setdefault(fp, dict(k)) == dict(k)
        return answers[config]

    bms = tuple(sorted({64 * r * c for r in ROWS_PER_CONSUMER for c in CONSUMERS}))
    candidates = {"bm": bms, "bn": BN, "consumers": CONSUMERS, "stages": STAGES, "cluster_m": CLUSTER_M,
                  "group_m": GROUP_M, "split_k": SPLIT_K, "stream_k": STREAM_K,
                  "pingpong": (False,)}
    for f in fields(g.GemmSchedule):  # knobs not named here: a bool both ways, else the heuristic's value
        if f.name not in candidates:
            candidates[f.name] = (False, True) if isinstance(knobs[f.name], bool) else (knobs[f.name],)
    dims = tuple(Dim(n, vals if knobs[n] in vals else tuple(vals) + (knobs[n],)) for n, vals in candidates.items())
    # No render here: the default claims its kernel at the first question (above). A compile
    # that only wants the default (no tuned entry) then renders it once, not twice.
    return Space(FAMILY, dims, valid=valid, admits=admits, default=tuple(knobs[d.name] for d in dims))


def build(task: GemmTask, knobs: Mapping, arch: str = "sm_90a") -> g.GemmSchedule:
    """The schedule these knobs name; ValueError (GemmError) if GemmSchedule rejects them."""
    try:
        return g.GemmSchedule(**dict(knobs))
    except TypeError as e:  # a knob this GemmSchedule does not have
        raise ValueError(str(e)) from None


def knobs_of(schedule: g.GemmSchedule) -> dict:
    return asdict(schedule)


def compile_task(task: GemmTask, schedule: g.GemmSchedule, arch: str = "sm_90a"):
    from ..runtime.gemm import compile_gemm

    return compile_gemm(task.problem, schedule, arch)


def signature(problem: g.GemmProblem) -> str:
    return f"gemm:{problem.batch}x{problem.m}x{problem.n}x{problem.k}:{problem.dtype}:B{problem.b_major}"


def describe(task: GemmTask) -> tuple[str, str]:
    """(the epilogue's structural hash, the GEMM's shape/dtype/layout signature): two
    problems that differ only in names (epilogue buffers, SSA values, the kernel's name)
    share a cache entry."""
    from ..loop.canon import structural_hash

    return structural_hash(task.problem.out_epilogue), signature(task.problem)


# ---------------------------------------------------------------- correctness


def sample_rows(m: int, n: int = SAMPLE_ROWS, seed: int = 0) -> np.ndarray:
    """Sorted output rows to check: all of them when m <= n, else the first, the last and
    n - 2 others drawn at random (so every position inside a tile is likely hit)."""
    if m <= n:
        return np.arange(m)
    rng = np.random.default_rng(seed)
    inner = rng.choice(np.arange(1, m - 1), size=n - 2, replace=False)
    return np.sort(np.concatenate([[0, m - 1], inner]))


SAMPLED = "sampled_rows"  # the sampled epilogue's operand: the output row of each sampled row


def _subst_m(e, by):
    if e == ir.Var("m"):
        return by
    if isinstance(e, ir.IBin):
        return ir.IBin(e.op, _subst_m(e.a, by), _subst_m(e.b, by))
    return e


def sample_epilogue(kernel: ir.Kernel, rows: int) -> ir.Kernel:
    """The epilogue over `rows` rows: the m loop and every dimension indexed by m shrink. An
    index that computes with m (a table read through views at m % S) reads at the sampled
    row's own m, loaded from the SAMPLED operand (gemm_check passes the rows)."""
    dims = epi.row_dims(kernel)
    row = ir.Val("sampled_m")
    computed = False

    def shrink(b: ir.Buffer) -> ir.Buffer:
        return replace(b, shape=tuple(rows if d in dims[b.name] else x for d, x in enumerate(b.shape)))

    def index(ix):
        nonlocal computed
        out = []
        for e in ix:
            if e != ir.Var("m") and "m" in ir.index_vars(e):
                computed = True
                e = _subst_m(e, row)
            out.append(e)
        return tuple(out)

    def body(stmts):
        out = []
        for s in stmts:
            if isinstance(s, ir.Loop):
                s = replace(s, extent=rows if s.var == "m" else s.extent, body=body(s.body))
            elif isinstance(s, ir.Reduce):  # a partial row reduction's body
                s = replace(s, body=body(s.body))
            elif isinstance(s, (ir.Load, ir.Store)):
                s = replace(s, index=index(s.index))
            out.append(s)
        return tuple(out)

    new = body(kernel.body)
    params = tuple(shrink(b) for b in kernel.params)
    if computed:  # load the sampled row's m first thing in the per-element body
        def first(stmts):
            s = stmts[0]
            if isinstance(s, ir.Loop) and len(stmts) == 1:
                return (replace(s, body=first(s.body)),)
            return (ir.Load(row.name, SAMPLED, (ir.Var("m"),)),) + tuple(stmts)
        new = first(new)
        params += (ir.Buffer(SAMPLED, (rows,), "i64", "in"),)
    return replace(kernel, params=params, body=new)


A, B = "gemm.a", "gemm.b"  # keys of the operands among the tensors (epilogue names cannot clash)


@dataclass
class GemmCheck:
    """Inputs of one GEMM on a device and the references its outputs are checked against."""

    task: GemmTask
    inputs: dict           # A, B and the epilogue's operands -> tensors on the device
    rows: np.ndarray       # output rows checked
    ref64: dict            # output name -> float64 reference of those rows (CPU tensors)
    low: dict              # output name -> PyTorch's low-precision result of those rows
    packed: dict = field(default_factory=dict, repr=False)  # (name, data_ptr, W) -> pack_table of it

    @property
    def outputs(self) -> dict:
        return {b.name: (tuple(b.shape), b.dtype) for b in self.task.problem.out_epilogue.outputs}

    def call(self, fn, tensors: dict) -> None:
        """Launch `fn` (a compiled GemmKernel): A, B, then outputs and operands by name. Tables
        it reads packed (g.packed_tables) are packed once per tensor, outside the timed launch,
        as a compiled program packs its constant tables once."""
        names = [b.name for b in self.task.problem.out_epilogue.params if b.name != epi.ACC]
        ops = {n: tensors[n] for n in names}
        tables = dict(getattr(getattr(fn, "source", None), "packed_tables", ()))
        for n, w in tables.items():
            key = (n, ops[n].data_ptr(), w)
            if key not in self.packed:
                self.packed[key] = g.pack_table(ops[n], w)
            ops[n] = self.packed[key]
        if tables:
            ops["prepacked"] = tables.keys()
        fn(tensors[A], tensors[B], **ops)

    def check(self, outputs: dict) -> str | None:
        import torch

        from ..check import compare

        dims = epi.row_dims(self.task.problem.out_epilogue)
        for name in self.outputs:
            got = outputs[name]
            idx = torch.as_tensor(self.rows, device=got.device)
            for d in dims[name]:
                got = got.index_select(d, idx)
            c = compare(name, got.cpu(), self.ref64[name], self.low[name])
            if not c.ok:
                extra = f" ({c.note})" if c.note else ""
                return (f"wrong result: output {name} has error {c.error:.3g}, bound {c.bound:.3g} "
                        f"(2x torch.matmul's {c.torch_error:.3g}){extra}")
        return None


def gemm_check(task: GemmTask, seed: int = 0, device: str = "cpu") -> GemmCheck:
    """Random normal operands on `device` and the references of the sampled rows."""
    import torch

    from .. import dtypes
    from ..loop.interp import run_kernel
    from ..tensors import to_numpy, to_torch
    from .reference import promote_f64

    p = task.problem
    ep = p.out_epilogue
    gen = torch.Generator(device=device).manual_seed(seed)
    lead = (p.batch,) if p.batch > 1 else ()
    tdt = dtypes.to_torch(p.dtype)

    def randn(shape, dt):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    a = randn(lead + (p.m, p.k), tdt)
    b = randn(lead + ((p.n, p.k) if p.b_major == "K" else (p.k, p.n)), tdt)
    inputs = {A: a, B: b}
    for buf in epi.operands(ep):
        if not dtypes.is_float(buf.dtype):
            raise ValueError(f"epilogue operand {buf.name} is {buf.dtype}: only float operands get random inputs")
        inputs[buf.name] = randn(buf.shape, dtypes.to_torch(buf.dtype))
    rows = sample_rows(p.m, seed=seed)
    idx = torch.as_tensor(rows, device=device)
    a_rows = a.index_select(-2, idx)
    bt = b.transpose(-1, -2) if p.b_major == "K" else b
    acc64 = a_rows.double() @ bt.double()
    acc_low = (a_rows @ bt).float()
    if device != "cpu":
        torch.cuda.synchronize()
    sampled = sample_epilogue(ep, len(rows))
    dims = epi.row_dims(ep)
    operands = {}
    for buf in epi.operands(ep):
        t = inputs[buf.name]
        for d in dims[buf.name]:
            t = t.index_select(d, idx)
        operands[buf.name] = to_numpy(t)
    if any(b.name == SAMPLED for b in sampled.params):
        operands[SAMPLED] = np.asarray(rows, dtype=np.int64)
    ref_kernel = promote_f64(sampled)
    ref_kernel = replace(ref_kernel, params=tuple(replace(x, dtype="f64") if x.name == epi.ACC else x
                                                  for x in ref_kernel.params))
    ref64 = run_kernel(ref_kernel, {**operands, epi.ACC: acc64.cpu().numpy()})
    low = run_kernel(sampled, {**operands, epi.ACC: acc_low.cpu().numpy()})
    return GemmCheck(task, inputs, rows, {n: to_torch(v) for n, v in ref64.items()},
                     {n: to_torch(v) for n, v in low.items()})

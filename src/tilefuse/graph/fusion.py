"""The fusion planner: groups Graph IR nodes into kernels of a family, or externs.

A map-reduce kernel works on a row space: leading dims L (the rows) and a row length C.
Every tensor in the kernel is *aligned* to that space: for each of its dims, the space dim
it runs along, or None where it has size 1 (broadcast). Maps join the kernel of a producer
when their shapes align; reductions join when they reduce exactly the row (C) dim, so the
row stays on chip and every input is read once. Reshapes that only add or drop size-1 dims
keep their alignment; other reshapes are free aliases between kernels.

The cost model is deliberately small: each kernel's floor is its bytes over the measured
copy bandwidth (map-reduce is memory bound), and a node joins a kernel only if the row
it needs still fits on chip (shared memory of a cluster).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

from .. import dtypes, env
from . import ir
from .contraction import GemmSpec, match as match_gemm

Align = tuple[Optional[int], ...]

# Ceilings used until the tuner measures the device (H100 SXM, measured: see DESIGN.md).
COPY_BYTES_PER_S = 3.0e12
MATMUL_FLOPS_PER_S = 7.0e14
ON_CHIP_BYTES = 16 * 200 * 1024  # a 16-CTA cluster's shared memory
# A row kernel computes each reduction's argument again, element by element, from what it
# loaded (nothing per element is kept between its passes over a row), so a chain of k softmaxes
# in one kernel computes ~k^2 maps per element: at k = 32, 4453 Loop IR lines and a long NVRTC
# build. A reduction joins a kernel only while the maps its pass computes again, summed over
# every pass after the kernel's first, stay within this many. It guards the kernel's size, not
# its speed: measured on an H100 (bench/recompute_limit.py, bench/LOG.md session 24), splits
# at 64 or 256 were as often slower as faster than one kernel (2.7x slower for two
# GELU-LayerNorm blocks at 64, 1.6x faster for 12 softmaxes), so the limit sits above every
# program measured (12 softmaxes: 862).
RECOMPUTE_LIMIT = 1024
ROW_REDUCTIONS = ("sum", "max", "min", "mean", "prod")  # the reductions a map-reduce kernel's row takes
# A column kernel (Planner.column_start, codegen/columns.py) splits each row between up to 16
# threads, neighbouring rows on neighbouring lanes: their elements lie side by side in memory.
# Below COLUMN_MIN_ROWS rows, times the row's length in whole COLUMN_LONG_ROWs (rows of 2048
# want 2048 rows: a thread's share of the row is what a split kernel waits on), the reduction
# runs in PyTorch, or, alone, reduces pieces of its row first (rewrites.split_long_columns).
# H200, bf16 (bench/columns_probe.py, session 69, bench/results/s69): softmax over dim 1 of
# 1 x 64 x 32 x 32 (1024 rows) 5.5 us against 22.1 without column kernels,
# x.mean(1) alone over 1 x 1024 x 1024 6.8 against 12.9 (PyTorch's mean), x.sum(0) over 8192 x
# 4096 (4096 rows of 8192) 32.5 against 33.5, over 8192 x 2048 30.0 against 27.2: the floor there
# is 8192 rows. Scans keep a row a thread (codegen/scan.py) and their floor of session 66.
COLUMN_MIN_ROWS = 1024
COLUMN_LONG_ROW = 1024
# A reduction of at most COLUMN_SMALL elements is a column kernel at any rows: a launch either way,
# and the kernel takes the maps and reductions beside it (a variance's finish over the per-row
# moments of rules/apart_reductions.py: 2048 elements, four launches of PyTorch's otherwise).
COLUMN_SMALL = 16384
SCAN_MIN_ROWS = 16384


def scans_enabled() -> bool:
    """TILEFUSE_SCANS=0 leaves every scan (cumsum, cumprod, cummax, cummin) to PyTorch, as before
    map-reduce kernels took them (for A/B runs)."""
    return env.switch("TILEFUSE_SCANS")


def columns_enabled() -> bool:
    """TILEFUSE_COLUMNS=0 leaves reductions over a dim that is not last to PyTorch (for A/B runs)."""
    return env.switch("TILEFUSE_COLUMNS")


def column_min_rows(row_len: int = 1, scan: bool = False) -> int:
    """The rows a column kernel over rows of `row_len` needs: COLUMN_MIN_ROWS times the row's
    length in whole COLUMN_LONG_ROWs (SCAN_MIN_ROWS for a scan), or TILEFUSE_COLUMN_MIN_ROWS
    where set, as it is (1: column kernels at any size, as the fuzzer's small programs and the
    probes want them)."""
    n = env.rows("TILEFUSE_COLUMN_MIN_ROWS")
    if n is not None:
        return n
    return SCAN_MIN_ROWS if scan else COLUMN_MIN_ROWS * max(1, row_len // COLUMN_LONG_ROW)


@dataclass
class Step:
    """One step of the plan: a fused kernel, a free alias, or an extern op."""

    name: str
    family: str  # "mapreduce" | "gemm" | "alias" | "extern"
    nodes: list[str]
    space: tuple[tuple[int, ...], int] | None = None
    align: dict[str, Align] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    bytes: int = 0
    flops: int = 0
    note: str = ""
    gemm: GemmSpec | None = None  # family "gemm": the contraction, its B operand and its epilogue
    head: "Step | None" = None    # a grid reduction: the row kernel as planned alone
    tail: "Step | None" = None    # ... and the one-row kernel that reduced its per-row outputs
    scratch: list[str] = field(default_factory=list)  # per-row values passed from head to tail on chip
    view: bool = False  # family "extern": a strided view, no copy (attention_only_views; a result in eager's layout)
    reads: dict[str, str] = field(default_factory=dict)  # mapreduce: input view -> the tensor it reads it from (views_read_in_place)
    tables: dict[str, str] = field(default_factory=dict)  # mapreduce: gather -> the tensor in memory its table is (_Planner.table_of)
    ref: tuple | None = None  # a column kernel's (shape, alignment) of its full tensors: what others broadcast against
    passes: int = 0      # mapreduce: its reductions, each a pass over the row computing its argument
    scan: str = ""       # mapreduce: its scan (at most one; no reduction reads it: codegen/scan.py)
    recomputed: int = 0  # ... and the per-element maps the passes after the first compute again (RECOMPUTE_LIMIT)

    @property
    def columns(self) -> bool:
        """A column kernel: the row runs along a dim that is not last, its tensors' alignments may permute dims."""
        return self.ref is not None

    @property
    def floor_s(self) -> float:
        return max(self.bytes / COPY_BYTES_PER_S, self.flops / MATMUL_FLOPS_PER_S)


@dataclass
class Plan:
    graph: ir.Graph
    steps: list[Step]

    def __str__(self):
        return format_plan(self)


def _full(space) -> tuple[int, ...]:
    L, C = space
    return tuple(L) + (C,)


def right_align(shape, space) -> Align | None:
    """Alignment of `shape` broadcast against the space's full shape, or None if it does not."""
    full = _full(space)
    if len(shape) > len(full):
        return None
    off = len(full) - len(shape)
    out = []
    for i, s in enumerate(shape):
        if s == 1:
            out.append(None)
        elif s == full[off + i]:
            out.append(off + i)
        else:
            return None
    return tuple(out)


def row_align(shape, space) -> Align | None:
    """Alignment of `shape` as a per-row tensor (its dims run along the row dims only), or None."""
    Ls, _ = space
    if not Ls:
        return None
    return right_align(shape, (tuple(Ls[:-1]), Ls[-1]))


def _ref_align(shape, ref) -> Align | None:
    """Alignment of `shape` broadcast against a column kernel's full tensors (`Step.ref`), or None."""
    if ref is None:
        return None
    full, al = ref
    off = len(full) - len(shape)
    if off < 0 or any(s != 1 and s != full[off + i] for i, s in enumerate(shape)):
        return None
    return _arg_align(shape, full, al)


def _arg_align(arg_shape, node_shape, node_align) -> Align:
    """Alignment of a Map argument from its node's, through NumPy broadcasting."""
    off = len(node_shape) - len(arg_shape)
    return tuple(None if s == 1 else node_align[off + i] for i, s in enumerate(arg_shape))


def _valid(shape, align, space, permuted: bool = False) -> bool:
    """`align` puts each dim of `shape` on a space dim of its size (None: a size-1 dim), each on
    another, in the space's order unless `permuted` (a column kernel's tensors)."""
    full = _full(space)
    dims = [a for a in align if a is not None]
    if len(dims) != len(set(dims)) or not permuted and dims != sorted(dims):
        return False
    return all((a is None and s == 1) or (a is not None and full[a] == s) for s, a in zip(shape, align))


def is_row_level(align: Align, space) -> bool:
    return len(space[0]) not in align


def partial_rows(align: Align, space) -> bool:
    """Does a tensor with this alignment stay constant along some row dim (of size > 1)?"""
    L, _ = space
    covered = {a for a in align if a is not None}
    return any(L[d] > 1 and d not in covered for d in range(len(L)))


class _Planner:
    def __init__(self, g: ir.Graph, gemm: bool = True, whole_rows: frozenset = frozenset(), partials: bool = True,
                 in_torch: frozenset = frozenset()):
        self.partials = partials
        self.in_torch = in_torch  # maps to run in PyTorch, each a step of its own (see plan())
        self.g = g
        self.whole_rows = whole_rows  # nodes that may only join kernels whose every row they run along
        # whether any reduction could open a column kernel: column_ahead looks for none otherwise
        self.any_columns = columns_enabled() and any(
            (isinstance(n, ir.Reduce) and any(g[n.arg].type.shape[x] != 1 for x in n.axes)
             and max(x for x in n.axes if g[n.arg].type.shape[x] != 1) != len(g[n.arg].type.shape) - 1)
            or (isinstance(n, ir.Scan) and n.axis != len(n.type.shape) - 1)
            for n in g.nodes)
        self.users = g.users()
        self._feeds: dict[str, bool] = {}  # feeds_rows, memoised
        # maps reading a transposed view (computed in tiles: tiles_apart)
        self.transposed_readers = frozenset(n.name for n in g.nodes if isinstance(n, ir.Map) and _reads_transposed(g, n))
        self.group_of: dict[str, Step] = {}
        self.steps: list[Step] = []
        self.gemm_specs: dict[str, GemmSpec] = {}   # contraction -> its GEMM
        self.gemm_member: dict[str, str] = {}       # epilogue map or view -> its contraction
        self.gemm_skip: set[str] = set()            # views no step computes (read through by GEMMs)
        self.gemm_notes: dict[str, str] = {}        # contraction -> why it stays torch.matmul
        self.gemm_steps: dict[str, Step] = {}       # contraction -> its step, once made
        if gemm:
            self.plan_gemms()
        self.deferred = self.generated_maps()       # maps computed in each kernel that reads them

    def generated_maps(self) -> frozenset:
        """Maps of constants and indices alone (`n - 1 - iota`, a flip's index) read only by maps
        and gathers of map-reduce kernels: each kernel that reads one computes it (pull_deferred),
        in registers, as it does the constants and indices themselves; planned on their own, a
        map like that was a kernel writing a few integers for the next to read."""
        g = self.g
        out, outputs = set(), set(g.outputs) | set(g.results)
        for n in g.nodes:
            if (isinstance(n, ir.Map) and n.name not in outputs and n.name not in self.in_torch
                    and n.name not in self.gemm_member and self.users.get(n.name)
                    and all(isinstance(g[a], (ir.Constant, ir.Iota)) or a in out for a in n.args)
                    and all(isinstance(g[u], (ir.Map, ir.Gather)) and u not in self.gemm_member
                            and u not in self.in_torch for u in self.users[n.name])):
                out.add(n.name)
        return frozenset(out)

    def pull_deferred(self, step: Step, n, al: dict):
        """Put the deferred maps n reads (and those they read) into `step`, aligned as `al`
        (align_in) aligns them, before n."""
        g = self.g
        for a in ir.node_args(n):
            if a not in self.deferred or a in step.nodes:
                continue
            m, at = g[a], al.get(a)
            at = step.align.get(a) if at is None else at
            if at is None:
                continue  # (the kernel reads it written: plan() gives it a kernel of its own then)
            inner = {b: step.align.get(b) or _arg_align(g[b].type.shape, m.type.shape, at) for b in m.args}
            self.pull_deferred(step, m, inner)
            step.nodes.append(a)
            step.align.update({a: at, **{b: x for b, x in inner.items() if b not in step.align}})
            step.inputs_all.update(m.args)

    def gemm_step(self, contraction: str) -> Step:
        """The step of a planned GEMM, made at its first node in graph order."""
        if contraction in self.gemm_steps:
            return self.gemm_steps[contraction]
        spec = self.gemm_specs[contraction]
        step = Step(f"k{len(self.steps)}_{contraction}", "gemm", [], None, {},
                    note="generated GEMM, epilogue fused" if spec.maps else "generated GEMM", gemm=spec)
        step.inputs_all = set()
        self.steps.append(step)
        self.gemm_steps[contraction] = step
        for v in spec.absorbed:
            if v in self.gemm_skip and v not in self.group_of:
                self.add_to(step, self.g[v], {})
        return step

    def plan_gemms(self):
        """Decide every GEMM (and its epilogue) before the map-reduce grouping sees the maps."""
        g = self.g
        for n in g.nodes:
            if not isinstance(n, ir.Contraction):
                continue
            spec = match_gemm(g, n, self.users, frozenset(self.gemm_member), self.partials)
            if isinstance(spec, str):
                self.gemm_notes[n.name] = spec
                continue
            self.gemm_specs[n.name] = spec
            for m in spec.maps + (spec.pairwise or ()) + spec.stack_nodes:
                self.gemm_member[m] = n.name
        readers: dict[str, set] = {}  # view -> the GEMMs that read through it
        for c, spec in self.gemm_specs.items():
            for v in spec.absorbed:
                readers.setdefault(v, set()).add(c)
        order = {n.name: i for i, n in enumerate(g.nodes)}
        for v in sorted(readers, key=order.get, reverse=True):  # a chain of views from its last
            if v in self.gemm_member or v in g.outputs:
                continue
            # only GEMMs read it, each through the stored matrix or table: read by the
            # contraction or its epilogue, or by a view that is itself only read through
            if all(self.gemm_member.get(u, u) in readers[v] or u in self.gemm_skip for u in self.users[v]):
                self.gemm_skip.add(v)

    # -- alignment of a node inside a candidate kernel ------------------------------------------
    def align_in(self, n, step: Step) -> dict[str, Align] | None:
        """Alignments of n and of its arguments if n joins `step`, or None if it cannot."""
        g, space = self.g, step.space
        shape = n.type.shape
        if isinstance(n, ir.Gather) and not self.gathers_in(n, step):
            return None
        if isinstance(n, (ir.Map, ir.Gather)):
            args = _elementwise_args(n)
            align = [None] * len(shape)
            for a in args:
                if a in step.align:
                    aa, ashape = step.align[a], g[a].type.shape
                    off = len(shape) - len(ashape)
                    for i, s in enumerate(ashape):
                        if s != 1:
                            if align[off + i] not in (None, aa[i]):
                                return None
                            align[off + i] = aa[i]
            fallback = (_ref_align(shape, step.ref) if step.columns
                        else right_align(shape, space) or row_align(shape, space))
            for j, s in enumerate(shape):
                if align[j] is None and s != 1:
                    if fallback is None:
                        return None
                    align[j] = fallback[j]
            align = tuple(align)
            if not _valid(shape, align, space, step.columns):
                return None
            out = {n.name: align}
            for a in args:
                out.setdefault(a, step.align.get(a) or _arg_align(g[a].type.shape, shape, align))
                if not _valid(g[a].type.shape, out[a], space, step.columns):
                    return None
            return out
        if isinstance(n, ir.Scan):
            # one scan a kernel, its row along the scan: its pass, the row's last, walks the row
            # once carrying the running value from chunk to chunk (codegen/scan.py; in a column
            # kernel a thread walks its row alone), after the passes of the kernel's reductions
            if n.arg not in step.align or step.scan or not scans_enabled():
                return None
            if step.columns and math.prod(step.space[0]) < column_min_rows(scan=True):
                return None  # (a scan keeps a row a thread: its own floor, not a reduction's)
            aa = step.align[n.arg]
            return {n.name: aa} if aa[n.axis] == len(space[0]) else None
        if isinstance(n, ir.Reduce):
            if n.arg not in step.align or (step.scan and self.after_scan(n.arg, step)):
                return None
            aa = step.align[n.arg]
            ashape = g[n.arg].type.shape
            row_dim = len(space[0])
            reduced = [aa[x] for x in n.axes if ashape[x] != 1]
            if reduced != [row_dim] or n.op not in ROW_REDUCTIONS:
                return None
            if n.keepdim:
                align = tuple(None if i in n.axes else a for i, a in enumerate(aa))
            else:
                align = tuple(a for i, a in enumerate(aa) if i not in n.axes)
            return {n.name: align}
        if isinstance(n, ir.View) and n.arg in step.align:
            aa, ashape = step.align[n.arg], g[n.arg].type.shape
            if n.op == "reshape":
                src = [(s, a) for s, a in zip(ashape, aa) if s != 1]
                if [s for s, _ in src] != [s for s in shape if s != 1]:
                    return None
                it = iter(a for _, a in src)
                return {n.name: tuple(None if s == 1 else next(it) for s in shape)}
            if n.op == "expand" and len(ashape) == len(shape):
                fallback = right_align(shape, space)
                if fallback is None:
                    return None
                align = tuple(a if s0 != 1 else (None if s == 1 else fallback[i])
                              for i, (s0, s, a) in enumerate(zip(ashape, shape, aa)))
                return {n.name: align} if _valid(shape, align, space, step.columns) else None
        return None

    def after_scan(self, name: str, step: Step) -> bool:
        """Whether `name` is computed in `step` from its scan: a reduction of it would need a
        pass after the scan's, which is the row's last."""
        stack, seen = [name], set()
        while stack:
            a = stack.pop()
            if a == step.scan:
                return True
            if a in seen or self.group_of.get(a) is not step:
                continue
            seen.add(a)
            stack.extend(ir.node_args(self.g[a]))
        return False

    def table_of(self, n: ir.Gather) -> str:
        """The tensor in memory a gather's table is: its argument, under the reshapes that are
        free aliases (a reshape a kernel computes is written under its own name)."""
        name = n.arg
        while (isinstance(self.g[name], ir.View) and self.g[name].op == "reshape"
               and getattr(self.group_of.get(name), "family", None) == "alias"):
            name = self.g[name].arg
        return name

    def gathers_in(self, n: ir.Gather, step: Step) -> bool:
        """Whether gather `n` may be computed in `step`: elementwise in its index, it loads its
        table at the index it reads (loop/lower.py), so the table must lie in memory as itself
        (an input, a weight, or what another step writes under that name: no view a copy would
        make, no map computed where it is read) and be a float (an index out of range gives
        NaN, where PyTorch stops with a device-side assert); not in a column kernel, whose
        tensors may be laid out permuted."""
        t = self.table_of(n)
        table, made = self.g[t], self.group_of.get(t)
        # a view PyTorch copies (a slice, a permute: an extern step) is in memory as itself too;
        # views_read_in_place then drops the copy where the kernel can read through it. Not a
        # result's view: one returned strided (_mark_layout_views) is not the copy it looks like
        copied = (isinstance(table, ir.View) and made is not None and made.family == "extern"
                  and t not in self.g.outputs and t not in self.g.results)
        in_memory = (isinstance(table, (ir.Input, ir.Weight)) if made is None
                     else made.family in ("mapreduce", "gemm") or copied
                     or not isinstance(table, ir.View) and made.family == "extern")
        return (gathers_enabled() and not step.columns and dtypes.is_float(table.type.dtype) and in_memory
                and t not in self.deferred and n.arg not in self.deferred
                and not any(self.group_of.get(x) is step for x in (n.arg, t))
                and len(n.type.shape) > 0)

    def start_space(self, n):
        """The row space a node opens a new kernel with."""
        if isinstance(n, (ir.Map, ir.Gather)):
            s = n.type.shape
            return (tuple(s[:-1]), s[-1]) if s else ((), 1)
        if isinstance(n, ir.Reduce):
            s = self.g[n.arg].type.shape
            if len(n.axes) == 1 and n.axes[0] == len(s) - 1:
                return (tuple(s[:-1]), s[-1])
        if isinstance(n, ir.Scan) and n.axis == len(n.type.shape) - 1:
            return (tuple(n.type.shape[:-1]), n.type.shape[-1])
        return None

    def column_start(self, n):
        """(space, the argument's alignment) of a column kernel that reduction `n` opens: it
        reduces one dim of more than one element that is not last (`softmax(x, 1)`, a
        channels-first norm, `x.mean(1)` over [B, S, D]), the row runs along that dim and the
        rows along the others, in order; None where it is no such reduction, or has too few
        rows to keep the memory busy (column_min_rows()), or column kernels are off."""
        if isinstance(n, ir.Scan):
            if not columns_enabled() or not scans_enabled():
                return None
            s, axes = n.type.shape, [n.axis]
        elif not isinstance(n, ir.Reduce) or not columns_enabled() or n.op not in ROW_REDUCTIONS:
            return None
        else:
            s = self.g[n.arg].type.shape
            axes = [x for x in n.axes if s[x] != 1]
        if len(axes) != 1 or axes[0] == len(s) - 1:
            return None
        k = axes[0]
        rows = [d for i, d in enumerate(s) if i != k]
        if (math.prod(rows) < column_min_rows(s[k], isinstance(n, ir.Scan)) and any(d != 1 for d in s[k + 1:])
                and (isinstance(n, ir.Scan) or not 0 < math.prod(s) <= COLUMN_SMALL)):
            return None
        align = tuple(len(rows) if i == k else None if d == 1 else i - (i > k) for i, d in enumerate(s))
        return (tuple(rows), s[k]), align

    def reduce_note(self, n) -> str:
        """Why reduction `n` runs in PyTorch, for the plan."""
        s = self.g[n.arg].type.shape
        axes = [x for x in n.axes if s[x] != 1]
        why = "reduction over a non-last axis runs in PyTorch"
        if n.op not in ROW_REDUCTIONS:
            return f"{why}: {n.op}"
        if len(axes) > 1 and axes == list(range(axes[0], axes[-1] + 1)):
            return f"{why}: neighbouring dims {axes} not merged into one (few rows beside them: " \
                   f"graph/rules/merged_reductions.py)"
        if len(axes) > 1:
            return f"{why}: dims {axes} are not neighbours"
        if not columns_enabled():
            return f"{why}: column kernels are off (TILEFUSE_COLUMNS=0)"
        if not axes:
            return f"{why}: every dim it reduces has one element"
        if all(d == 1 for d in s[axes[0] + 1:]):
            return f"{why}: its dim is last but for dims of one element"
        rows = math.prod(d for i, d in enumerate(s) if i not in n.axes)
        row_len = s[axes[0]]
        if rows >= column_min_rows(row_len) or 0 < math.prod(s) <= COLUMN_SMALL:
            return why
        return f"{why}: {rows} rows beside it, fewer than a column kernel over rows of {row_len} takes " \
               f"({column_min_rows(row_len)})"

    def scan_note(self, n) -> str:
        """Why scan `n` runs in PyTorch, for the plan."""
        why = "scan runs in PyTorch"
        if not scans_enabled():
            return f"{why}: scans are off (TILEFUSE_SCANS=0)"
        if not columns_enabled():
            return f"{why}: along a dim that is not last, and column kernels are off (TILEFUSE_COLUMNS=0)"
        rows = n.type.numel // n.type.shape[n.axis]
        return f"{why}: {rows} rows beside it, fewer than a column kernel takes ({column_min_rows(scan=True)})"

    def column_ahead(self, n, limit: int = 16):
        """A map whose result (through maps of its shape, `limit` of them at most) is the
        argument of a column kernel's reduction starts that column kernel: (space, the map's
        alignment), else None. Started as a row kernel of its own shape, it would write its
        result for the column kernel to read back (a bf16 softmax(x, 1)'s upcast). So does a
        map beside such a one, reading the same tensor (`x.float() * rsqrt(x.float().pow(2)
        .mean(1))`: the first upcast, before the second that leads to the mean)."""
        if not self.any_columns:
            return None
        shape = n.type.shape
        beside = list(itertools.islice((u for a in dict.fromkeys(n.args) if a in self.users for u in self.users[a]
                                        if u != n.name and isinstance(self.g[u], ir.Map)
                                        and self.g[u].type.shape == shape), limit))
        seen, todo = {n.name, *beside}, [*beside, n.name]
        while todo and len(seen) <= limit:
            for u in self.users[todo.pop()]:
                m = self.g[u]
                if u in seen:
                    continue
                seen.add(u)
                if isinstance(m, (ir.Reduce, ir.Scan)) and self.g[m.arg].type.shape == shape:
                    start = self.column_start(m)
                    if start is not None:
                        return start
                elif isinstance(m, ir.Map) and m.type.shape == shape and self.leading(m):
                    todo.append(u)
        return None

    def leading(self, m, depth: int = 8) -> bool:
        """Whether map `m` is computed from program inputs, weights and constants by maps and
        views alone (`depth` deep at most): no reduction behind it, which a column kernel it
        would lead to could not take (a LayerNorm over the last dim before a mean over dim 1)."""
        stack = [(a, 0) for a in ir.node_args(m)]
        while stack:
            a, d = stack.pop()
            x = self.g[a]
            if isinstance(x, (ir.Input, ir.Weight, ir.Constant, ir.Iota)):
                continue
            if d >= depth or not isinstance(x, (ir.Map, ir.View)):
                return False
            stack.extend((b, d + 1) for b in ir.node_args(x))
        return True

    def depends_on(self, step: Step, other: Step) -> bool:
        """Does `step` (transitively) read anything `other` writes?"""
        return id(other) in self.upstream([step], until=other)

    def upstream(self, steps, until: Step | None = None) -> set[int]:
        """ids of `steps` and of every step they (transitively) read from; the walk stops as
        soon as it reaches `until` (a producer is usually a step or two up)."""
        seen, stack = set(), list(steps)
        while stack:
            s = stack.pop()
            if id(s) in seen:
                continue
            seen.add(id(s))
            if s is until:
                break
            for i in s.inputs_all:
                p = self.group_of.get(i)
                if p is not None:
                    stack.append(p)
        return seen

    def fits(self, step: Step, extra: dict[str, Align], n=None) -> bool:
        """Whether the rows the step's reductions pass over stay on chip with `extra` joining. A
        map joining a kernel of maps alone streams its rows: nothing is held (expm1(x).half()
        over 1M elements was two kernels, the row of 4 MB being "too long")."""
        if isinstance(n, (ir.Map, ir.Scan)) and not step.passes:
            return True
        L, C = step.space
        inside = set(step.nodes)
        row_tensors = {a for a, al in {**step.align, **extra}.items()
                       if a not in inside and not is_row_level(al, step.space)}
        return len(row_tensors) * C * 4 <= ON_CHIP_BYTES

    def coarse_in(self, name: str, align: Align, step: Step) -> bool:
        """Would `name` join `step` while varying along fewer of its rows than the kernel has,
        when it must not (a value like that, written by every row, is written more than once)?"""
        return name in self.whole_rows and partial_rows(align, step.space)

    def recompute(self, n, step: Step) -> int:
        """Per-element maps a pass of reduction `n` would compute in `step`: the maps of the
        step, not constant along rows, that its argument is computed from (itself included)."""
        seen, stack, count = set(), [n.arg], 0
        while stack:
            a = stack.pop()
            if a in seen or self.group_of.get(a) is not step or is_row_level(step.align[a], step.space):
                continue
            seen.add(a)
            m = self.g[a]
            count += isinstance(m, ir.Map)
            stack.extend(ir.node_args(m))
        return count

    def recompute_fits(self, n, step: Step) -> bool:
        if not isinstance(n, ir.Reduce) or not step.passes:
            return True  # (a kernel's first pass over its rows computes its maps once: nothing again)
        return step.recomputed + self.recompute(n, step) <= RECOMPUTE_LIMIT

    def tiles_apart(self, n, step: Step) -> bool:
        """A map reading a transposed view is computed in tiles (codegen/tiles.py), which a kernel
        with a reduction has not: the two stay apart, the map's result written for the
        reduction's kernel (what `transposed_results_as_copies` copies such a view with)."""
        readers = self.transposed_readers
        if not readers:
            return False
        tiled = any(x in readers for x in step.nodes)
        if isinstance(n, ir.Map):
            # nor does a map a row reduction reads (computed in the tiles, it would be written for
            # the reduction's kernel, which could compute it from the copy it reads anyway; a
            # LayerNorm's f32 cast of bf16 x would make the copy f32). Other widening casts join
            # (a bf16 GELU widens to f32 and narrows again inside one tiled kernel)
            return ((step.passes > 0 or bool(step.scan)) and n.name in readers) or (tiled and self.feeds_rows(n.name))
        return isinstance(n, (ir.Reduce, ir.Scan)) and tiled

    def feeds_rows(self, name: str) -> bool:
        """Whether a reduction over the last dim reads `name`, directly or through maps and views."""
        if name not in self._feeds:
            from .rules.permute_sink import reaches_row_reduction

            self._feeds[name] = reaches_row_reduction(self.g, self.users, name)
        return self._feeds[name]

    def try_join(self, n) -> Step | None:
        producers = []
        for a in ir.node_args(n):
            s = self.group_of.get(a)
            if s is not None and s.family == "mapreduce" and s not in producers:
                producers.append(s)
        for s in reversed(producers):
            if self.tiles_apart(n, s):
                continue
            al = self.align_in(n, s)
            if al is None or not self.fits(s, al, n) or self.coarse_in(n.name, al[n.name], s):
                continue
            if not self.recompute_fits(n, s):
                continue
            if any(self.depends_on(self.group_of[a], s) for a in ir.node_args(n)
                   if a in self.group_of and self.group_of[a] is not s):
                continue
            return s, al
        return None

    def join_sibling(self, n, space, columns: bool = False, arg_align=None):
        """A node none of whose producers it can join may still share a kernel of its row space,
        or, for a map, a kernel whose rows it runs along (a per-row value such as a target mask).
        A column kernel's row space is another than a row kernel's of the same sizes (`columns`;
        a reduction's argument aligned as `arg_align`)."""
        # a kernel its arguments come from (transitively) is no sibling: found in one walk, first,
        # since a long chain of kernels makes every earlier kernel a candidate to rule out
        upstream = self.upstream([self.group_of[a] for a in ir.node_args(n) if a in self.group_of])
        for s in reversed(self.steps):
            if s.family != "mapreduce" or id(s) in upstream or s.columns != columns or self.tiles_apart(n, s):
                continue
            if s.space != space and not self.runs_along(n, s.space):
                continue
            probe = Step(s.name, s.family, list(s.nodes), s.space, dict(s.align), ref=s.ref, passes=s.passes,
                         scan=s.scan)
            if isinstance(n, (ir.Reduce, ir.Scan)):
                probe.align.setdefault(n.arg, arg_align or right_align(self.g[n.arg].type.shape, space))
                if probe.align[n.arg] is None:
                    continue
            al = self.align_in(n, probe)
            if al is None or not self.fits(s, al, n) or self.coarse_in(n.name, al[n.name], s):
                continue
            if not self.recompute_fits(n, s):
                continue
            if isinstance(n, (ir.Reduce, ir.Scan)):
                al = {n.arg: probe.align[n.arg], **al}
            return s, al
        return None

    def runs_along(self, n, space) -> bool:
        """Whether n, of another shape than `space`'s, may join a kernel of that row space: a map
        or gather whose rows are its rows (a per-row value), or a gather broadcast along its rows
        (it reads its table again for each: GPT-2's position embedding beside the token one)."""
        if not isinstance(n, (ir.Map, ir.Gather)):
            return False
        right = right_align(n.type.shape, space) is not None
        return (isinstance(n, ir.Gather) and right) or (not right and row_align(n.type.shape, space) is not None)

    def add_to(self, step: Step, n, al):
        if step.family == "mapreduce" and self.deferred:
            self.pull_deferred(step, n, al)
        if step.family == "mapreduce" and isinstance(n, ir.Gather):
            step.tables[n.name] = self.table_of(n)
        if isinstance(n, ir.Reduce) and step.family == "mapreduce":
            step.recomputed += self.recompute(n, step) if step.passes else 0
            step.passes += 1
        if isinstance(n, ir.Scan) and step.family == "mapreduce":
            step.scan = n.name
        step.nodes.append(n.name)
        step.align.update(al)
        step.inputs_all.update(a for a in ir.node_args(n) if a not in step.nodes)
        self.group_of[n.name] = step

    def open_step(self, n, space, columns: bool, arg_align) -> bool:
        """Start a map-reduce kernel of row space `space` with `n`, if `n` aligns in it; a
        reduction's argument is aligned as `arg_align` (else on the space's last dims), and
        so are a map's arguments where `arg_align` is the map's own (column_ahead)."""
        g = self.g
        ref = (g[n.arg].type.shape if isinstance(n, ir.Reduce) else n.type.shape, arg_align) if columns else None
        step = Step(f"k{len(self.steps)}_{n.name}", "mapreduce", [], space, {}, ref=ref)
        step.inputs_all = set()
        if isinstance(n, (ir.Reduce, ir.Scan)):
            step.align[n.arg] = arg_align or right_align(g[n.arg].type.shape, space)
        elif arg_align is not None:
            for a in n.args:
                step.align[a] = _arg_align(g[a].type.shape, n.type.shape, arg_align)
        al = self.align_in(n, step)
        if al is None:
            return False
        self.steps.append(step)
        self.add_to(step, n, al)
        return True

    def new_step(self, family, n, space=None, align=None, note=""):
        step = Step(f"k{len(self.steps)}_{n.name}" if family != "alias" else n.name, family, [], space,
                    {}, note=note)
        step.inputs_all = set()
        self.steps.append(step)
        self.add_to(step, n, align or {})
        return step

    def plan(self) -> Plan:
        g = self.g
        for n in g.nodes:
            if isinstance(n, (ir.Input, ir.Weight, ir.Constant, ir.Iota)):
                continue  # inputs are buffers; constants and iotas are generated where used
            if n.name in self.gemm_skip:
                continue  # added to the first GEMM that reads through it
            if n.name in self.deferred:
                continue  # computed in the kernels that read it (pull_deferred)
            if n.name in self.in_torch and isinstance(n, ir.Map) and n.op in TORCH_MAPS:
                self.new_step("extern", n, note="runs in PyTorch: its shape changes with the sizes")
                continue
            if n.name in self.gemm_specs or n.name in self.gemm_member:
                # an epilogue may compute values the graph lists before the matmul (a rank-1
                # term of row and column vectors): the step opens at whichever comes first
                self.add_to(self.gemm_step(self.gemm_member.get(n.name, n.name)), n, {})
                continue
            joined = self.try_join(n) if isinstance(n, (ir.Map, ir.Reduce, ir.Scan, ir.View, ir.Gather)) else None
            if joined:
                self.add_to(joined[0], n, joined[1])
                continue
            space, columns, arg_align = self.start_space(n), False, None
            start = (self.column_start(n) if space is None and isinstance(n, (ir.Reduce, ir.Scan))
                     else self.column_ahead(n) if isinstance(n, ir.Map) else None)
            if start is not None:
                space, arg_align = start
                dims = [a for a in arg_align if a is not None]
                columns = dims != sorted(dims)  # (else the row is contiguous after all: dims of 1 follow it)
            sibling = self.join_sibling(n, space, columns, arg_align) if space is not None else None
            if sibling:
                self.add_to(sibling[0], n, sibling[1])
                continue
            if space is not None and self.open_step(n, space, columns, arg_align):
                continue
            if columns and isinstance(n, ir.Map) and self.open_step(n, self.start_space(n), False, None):
                continue  # (a map a column kernel could not start after all)
            if isinstance(n, ir.View) and n.op == "reshape":
                self.new_step("alias", n, note="free: same memory, new shape")
            elif isinstance(n, ir.Reduce):
                self.new_step("extern", n, note=self.reduce_note(n))
            elif isinstance(n, ir.Scan):
                self.new_step("extern", n, note=self.scan_note(n))
            elif n.name in self.gemm_notes:
                self.new_step("extern", n, note=f"torch.matmul (cuBLAS): {self.gemm_notes[n.name]}")
            else:
                self.new_step("extern", n, note=_extern_note(n, g))
        # a deferred map a kernel could not take (no alignment for it there) is written by a
        # kernel of its own, as any map (and so may the deferred maps it reads, in turn)
        while needed := [n for n in g.nodes if n.name in self.deferred and n.name not in self.group_of
                         and any(n.name in s.inputs_all and n.name not in s.nodes for s in self.steps)]:
            n = needed[-1]
            if not self.open_step(n, self.start_space(n), False, None):
                self.new_step("extern", n, note=_extern_note(n, g))
        return Plan(g, self._finish())

    def _finish(self) -> list[Step]:
        g = self.g
        outputs = set(g.outputs)
        for s in self.steps:
            members = set(s.nodes)
            s.inputs = sorted({a for a in s.inputs_all if a not in members and not _generated(g[a])},
                              key=g.order().__getitem__)
            # a deferred map is written only by a kernel of its own (plan()'s fallback), where
            # some reader does not compute it; the kernels that pulled it compute it for themselves
            s.outputs = [m for m in s.nodes if (self.group_of.get(m) is s if m in self.deferred else
                                                m in outputs or any(u not in members for u in self.users[m]))]
            if s.family == "gemm":
                spec = s.gemm
                s.inputs = list(dict.fromkeys([spec.a, spec.b] + [t for t, _ in spec.operands]))
                s.outputs = list(spec.outs)
                s.bytes = sum(g[t].type.nbytes for t in s.inputs + s.outputs)
                s.flops = spec.flops
            elif s.family == "mapreduce":
                s.bytes = step_bytes(g, s)
            elif s.family == "extern":
                s.bytes, s.flops = extern_cost(g, s)
        return self._ordered()

    def _ordered(self) -> list[Step]:
        """Steps in an order where each runs after the steps it reads from (joins can reorder).
        Depth first with an explicit stack: a program of a thousand layers is a chain that deep."""
        done, on_path, order = set(), set(), []
        for root in self.steps:
            if id(root) in done:
                continue
            on_path.add(id(root))
            stack = [(root, iter(root.inputs))]
            while stack:
                s, todo = stack[-1]
                for t in todo:
                    p = self.group_of.get(t)
                    if p is None or p is s or id(p) in done:
                        continue
                    if id(p) in on_path:
                        raise RuntimeError(f"internal: fusion made a cycle through {p.name}")
                    on_path.add(id(p))
                    stack.append((p, iter(p.inputs)))
                    break
                else:
                    stack.pop()
                    on_path.discard(id(s))
                    done.add(id(s))
                    order.append(s)
        return order


def gathers_enabled() -> bool:
    """TILEFUSE_GATHERS=0 leaves every gather to torch.gather (an extern step), as before they
    were computed in map-reduce kernels."""
    return env.switch("TILEFUSE_GATHERS")


def _elementwise_args(n) -> tuple[str, ...]:
    """The arguments a map or gather reads at its own element's position (a gather's index; its
    table is read where the index points)."""
    return (n.index,) if isinstance(n, ir.Gather) else n.args


def step_bytes(g: ir.Graph, s: Step) -> int:
    """A map-reduce step's bytes read and written: a table it gathers from counts at most the
    bytes of what it gathers (an embedding reads its tokens' rows, not its vocabulary)."""
    gathered: dict[str, int] = {}
    for m, table in s.tables.items():
        for t in {g[m].arg, table}:
            gathered[t] = gathered.get(t, 0) + g[m].type.nbytes
    return sum(min(g[t].type.nbytes, gathered[t]) if t in gathered and t not in s.align else g[t].type.nbytes
               for t in s.inputs) + sum(g[t].type.nbytes for t in s.outputs)


def _generated(n) -> bool:
    return isinstance(n, (ir.Constant, ir.Iota))


def extern_cost(g: ir.Graph, s: Step) -> tuple[int, int]:
    """An extern step's bytes read and written and its FLOPs (matmul and attention; 0 otherwise).
    A gather's table (an embedding's weight, torch.gather's source) counts only the rows or
    elements it reads, at most the output's bytes: a 32000-row embedding read for 512 tokens
    moves 2 MB of its 131 MB."""
    n = g[s.nodes[0]]
    table = _gathered_table(n)
    out_bytes = sum(g[t].type.nbytes for t in s.outputs)
    nbytes = sum(min(g[t].type.nbytes, out_bytes) if t == table else g[t].type.nbytes for t in s.inputs) + out_bytes
    flops = 0
    if isinstance(n, ir.Contraction):
        flops = 2 * n.type.numel * g[n.a].type.shape[-1]
    elif isinstance(n, ir.Attention):
        q, k = g[n.q].type.shape, g[n.k].type.shape
        flops = 4 * q[-2] * k[-2] * q[-1] * int(n.type.numel // (q[-2] * q[-1]))
        if n.causal:  # the kernel skips what lies above the (top-left) diagonal, and outside the window
            L, S = q[-2], k[-2]
            c = min(S, n.window or S)  # query i keeps min(i + 1, c) keys
            kept = L * (L + 1) // 2 if L <= c else c * (c + 1) // 2 + (L - c) * c
            flops = flops * kept // (L * S)
    return nbytes, flops


def _gathered_table(n) -> str | None:
    """The input a gather-like node reads only in part: torch.gather's source, aten.embedding's weight."""
    if isinstance(n, ir.Gather):
        return n.arg
    if isinstance(n, ir.Extern) and n.target.startswith("aten.embedding.") and n.args and isinstance(n.args[0], ir.Ref):
        return n.args[0].name
    return None


def _extern_note(n, g: ir.Graph | None = None) -> str:
    if (isinstance(n, ir.View) and n.op == "permute" and g is not None and isinstance(g[n.arg], ir.Attention)
            and tuple(n.params) == (0, 2, 1, 3)):
        # the copy is .contiguous() of the permuted output, nothing where SDPA laid it out [B, S, H,
        # D]: cuDNN's kernel did for this program's strided q (no copy kernel in the 4-layer
        # Llama's profile, H200, session 53)
        return "permute of attention's output: free where SDPA lays it out [B, S, H, D] (cuDNN's does), else a copy"
    if isinstance(n, ir.Contraction):
        return "torch.matmul (cuBLAS): generated GEMMs are off"
    if isinstance(n, ir.Attention):
        return "scaled_dot_product_attention until the attention family lands"
    if isinstance(n, ir.Extern):
        return n.reason
    if isinstance(n, ir.View):
        return f"{n.op} copy in PyTorch"
    if isinstance(n, ir.Gather):
        return "torch.gather"
    return "runs in PyTorch"


# maps a step may run in PyTorch (runtime.program.run_extern): plan(in_torch=...)
TORCH_MAPS = frozenset({"cast", "not", "and", "or", "eq", "ne", "lt", "le", "gt", "ge"})  # exact in any dtype


def plan(g: ir.Graph, gemm: bool = True, partials: bool = True, in_torch: frozenset = frozenset()) -> Plan:
    """Group the graph into kernels. `gemm=False` leaves every contraction to torch.matmul;
    `partials=False` puts no partial row reductions in GEMM epilogues (sm_80's template
    declines them). `in_torch`: maps (of TORCH_MAPS) that run in PyTorch, each a step of its
    own: the backend's small tensors whose shapes follow a generated sequence's length, so
    that runtime.resize can make new lengths with no compile.

    A value that is constant along some of a kernel's rows (a per-batch scalar inside a
    per-token kernel) may be computed there, but not written from there: every row would write
    it. Such outputs, and what they are computed from in that kernel, are planned again as
    kernels of their own rows, until none is left.
    """
    whole_rows: set[str] = set()
    for _ in range(8):
        p = _Planner(g, gemm, frozenset(whole_rows), partials, frozenset(in_torch)).plan()
        coarse = set()
        for s in p.steps:
            if s.family != "mapreduce":
                continue
            members = set(s.nodes)
            stack = [o for o in s.outputs if partial_rows(s.align[o], s.space)]
            while stack:
                x = stack.pop()
                if x in coarse or x not in members:
                    continue
                coarse.add(x)
                stack.extend(a for a in ir.node_args(g[x]) if a in members and partial_rows(s.align[a], s.space))
        if not coarse - whole_rows:
            # grid reductions are opt-in (TILEFUSE_GRID_REDUCE=1) until their CUDA path has been
            # checked and measured on a GPU (tests/gpu/test_mapreduce_gpu.py -k grid); otherwise
            # the finishing reduction stays a kernel of its own, as before
            p = grid_reductions(p) if grid_reduce_enabled() else p
            return views_read_in_place(_mark_attention_views(_mark_layout_views(p)))
        whole_rows |= coarse
    raise RuntimeError("internal: the fusion plan did not settle")


# extern aten ops that read strided inputs as they are and write nothing
_STRIDED_READERS = frozenset({"aten.cat.default"})


def _swaps_last_two(perm: tuple) -> bool:
    r = len(perm)
    return r >= 2 and tuple(perm) == tuple(range(r - 2)) + (r - 1, r - 2)


def grouped_mm_b(g: ir.Graph, users: dict, name: str) -> bool:
    """Is `name` a transpose of the last two dims that only mixtures of experts' grouped matmuls
    read? torch._grouped_mm takes such a column-major B as it lies (eager passes it
    `w.transpose(-2, -1)`), so it stays a view: not copied each call (2.3 ms of a 2-layer
    Mixtral's 9.8 on an H200), nor folded into a row-major copy, which PyTorch's CPU kernel takes
    7-9x slower (graph/fold.py)."""
    n = g[name]
    return (isinstance(n, ir.View) and n.op == "permute" and name not in g.outputs and _swaps_last_two(n.params)
            and bool(users.get(name))
            and all(isinstance(g[u], ir.Extern) and g[u].target.startswith("aten._grouped_mm.") for u in users[name]))


def attention_only_views(g: ir.Graph, steps) -> frozenset:
    """Permute and slice externs whose values only attention externs (or a cat) read, directly
    or through aliases and other such views: SDPA takes strided q/k/v, so the head transposes and
    the split of a fused QKV projection (GPT-2's c_attn; a full copy each) are skipped, and the
    attention output, transposed back, is then already contiguous; a cat reads its pieces where
    they lie (the rotate-half RoPE's `cat((-x2, x1))`, x1 a slice of q). Never a program output
    (the caller gets contiguous tensors)."""
    users = g.users()
    extern = {s.nodes[0] for s in steps if s.family == "extern"}
    alias = {s.nodes[0] for s in steps if s.family == "alias"}
    memo: dict[str, bool] = {}

    def viewable(name: str) -> bool:  # and keeps the last dim contiguous: SDPA's fast kernels need that
        n = g[name]
        if name not in extern or not isinstance(n, ir.View):
            return False
        return n.op in ("permute", "slice") and _last_dim_whole(n)

    def for_attention_only(name: str) -> bool:
        if name not in memo:
            us = users.get(name, [])
            memo[name] = (name not in g.outputs and bool(us)
                          and all(((isinstance(g[u], ir.Attention)
                                    or isinstance(g[u], ir.Extern) and g[u].target in _STRIDED_READERS)
                                   and u in extern)
                                  or ((u in alias or viewable(u)) and for_attention_only(u))
                                  for u in us))
        return memo[name]

    grouped = {name for name in extern if grouped_mm_b(g, users, name) and all(u in extern for u in users[name])}
    return frozenset(name for name in extern if viewable(name) and for_attention_only(name)) | grouped


def _readers(g: ir.Graph, users: dict, name: str) -> list:
    """The non-view nodes that read `name`, through views."""
    out, todo = [], [name]
    while todo:
        for u in users.get(todo.pop(), []):
            if isinstance(g[u], ir.View):
                todo.append(u)
            else:
                out.append(g[u])
    return out


def _mark_layout_views(p: "Plan") -> "Plan":
    """The results returned in PyTorch's layout (rules/permute_sink.layout_views): a strided
    view of what a kernel wrote, as eager and torch.compile return them."""
    from .rules.permute_sink import layout_views

    step_of = {n: s for s in p.steps for n in s.nodes}
    for name in layout_views(p.graph):
        s, under = step_of.get(name), step_of.get(p.graph[name].arg)
        if s is not None and s.family == "extern" and under is not None and under.family in ("mapreduce", "gemm"):
            s.view, s.bytes = True, 0
            s.note = "strided view: the result in the layout PyTorch gives it, no copy"
    return p


def _mark_attention_views(p: "Plan") -> "Plan":
    views = attention_only_views(p.graph, p.steps)
    users = p.graph.users() if views else {}
    for s in p.steps:
        if s.family == "extern" and s.nodes[0] in views:
            s.view, s.bytes = True, 0
            readers = {type(n).__name__ for n in _readers(p.graph, users, s.nodes[0])}
            s.note = ("strided view for attention: SDPA reads it in place, no copy" if readers <= {"Attention"}
                      else "strided view: its readers (SDPA, cat, a grouped matmul) take it in place, no copy")
    return p


def _last_dim_whole(n: ir.View) -> bool:
    """A permute that keeps the last dim last, a slice of the last dim with step 1 (or of
    another dim), any other view: its last dim stays contiguous in memory."""
    rank = len(n.type.shape)
    if n.op == "permute":
        return n.params[-1] % rank == rank - 1
    if n.op == "slice":
        dim, _, _, step = n.params
        return step == 1 or dim % rank != rank - 1
    return True


MAX_SECTOR_STEP = 4  # a slice of the last dim with a step up to this reads the sectors a copy would


def _small_step(n: ir.View) -> bool:
    """A slice of the last dim with a step of 2 to MAX_SECTOR_STEP: a kernel reading through it
    reads every 32-byte sector of the row (8 bytes apart at most), as PyTorch's copy of the slice
    does, without the copy's write and read back (GPT-J's x[..., ::2] and x[..., 1::2] of q and
    k, read by one kernel). Not for an extern: SDPA's kernels need a stride-1 last dim."""
    rank = len(n.type.shape)
    return n.op == "slice" and 2 <= n.params[3] <= MAX_SECTOR_STEP and n.params[0] % rank == rank - 1


_READ_THROUGH = ("permute", "slice", "expand", "reshape", "roll")  # views loop/views.py reads through


def _keeps_rows(n: ir.View) -> bool:
    """Whether a kernel reading through view `n` still reads each row where it lies in one run
    (`_last_dim_whole`; a roll: two runs). A transposing permute would make every load its own
    transaction, slower than PyTorch's copy and a contiguous read."""
    return n.op in _READ_THROUGH and _last_dim_whole(n)


def _moves_last_dim(n) -> bool:
    """A permute that moves the last dim: kernels of maps read through it in tiles (codegen/tiles.py)."""
    return isinstance(n, ir.View) and n.op == "permute" and not _last_dim_whole(n)


def _transposes(g: ir.Graph, view: str, root: str) -> bool:
    """Whether a permute between `view` and `root` moves the last dim."""
    while view != root and isinstance(g[view], ir.View):
        if _moves_last_dim(g[view]):
            return True
        view = g[view].arg
    return False


def _reads_transposed(g: ir.Graph, n) -> bool:
    """Whether map `n` reads an argument through a permute that moved the last dim."""
    return any(_transposes(g, a, None) for a in n.args)


def _gathers_from(n, table: str) -> bool:
    """Whether n gathers from `table`: under a transposing view a gather would read its table an
    element at a time across rows (no 2-D tiles for a gathered index), so the view keeps its copy."""
    return isinstance(n, ir.Gather) and n.arg == table


def views_read_in_place(p: Plan) -> Plan:
    """Drop the copies of views (slices, permutes, rolls; extern steps, and the reshapes after
    them) that only map-reduce kernels read, directly or through other such views: those
    kernels read the tensor under the views where it lies, at the index composed through them
    (loop/views.py; `Step.reads`). HF's rotate-half RoPE slices q and k and reads the halves
    in maps; each slice was a copy kernel of its own (a decode step's small launches)."""
    g = p.graph
    users, outputs = g.users(), set(g.outputs) | set(g.results)
    step_of = {n: s for s in p.steps for n in s.nodes}
    memo: dict[str, bool] = {}

    def maps_only(step: Step) -> bool:
        return not any(isinstance(g[x], ir.Reduce) for x in step.nodes)

    def consumable(name: str, transposed: bool = False) -> bool:
        """`name` a view step's value that only map-reduce kernels (not grid reductions) and
        other consumable views read; under a permute that moved the last dim (`transposed`),
        only kernels of maps, which read it in 2-D tiles (codegen/tiles.py)."""
        if (name, transposed) not in memo:
            s, n = step_of.get(name), g[name]
            moved = transposed or _moves_last_dim(n)
            memo[name, transposed] = (
                isinstance(n, ir.View) and s is not None and s.family in ("extern", "alias")
                and not s.view and name not in outputs and bool(users.get(name))
                and (_keeps_rows(n) or _small_step(n) or moved and n.op in _READ_THROUGH)
                and n.type.numel > 0  # (an empty one keeps its step: compiler._refuse_empty says why)
                and all(step_of[u].family == "mapreduce" and step_of[u].head is None
                        and (not moved or maps_only(step_of[u]) and not _gathers_from(g[u], name))
                        if not isinstance(g[u], ir.View) else consumable(u, moved) or not moved and strided(u)
                        for u in users[name])
                and not all(isinstance(g[u], ir.View) and strided(u) for u in users[name]))
        return memo[name, transposed]

    def strided(name: str) -> bool:
        """A strided view an extern reads in place (SDPA's q, k, v; `_mark_attention_views`): a
        view under it that kernels read too stays a strided view for it, not a copy."""
        s = step_of.get(name)
        return s is not None and s.family == "extern" and s.view

    def root(name: str) -> str:
        while name in region:
            name = g[name].arg
        return name

    region: set[str] = set()
    for s in p.steps:  # in order: a view's argument is decided before it
        n = g[s.nodes[0]]
        if not consumable(n.name) or not (s.family == "extern" or n.arg in region):
            continue
        region.add(n.name)
        r = g[root(n.name)]
        under = r
        while isinstance(under, ir.View):  # (a reshape of a written input is that input's memory)
            under = g[under.arg]
        if _generated(r) or (isinstance(under, ir.Input) and under.name in g.writes) \
                or step_of.get(r.name) is not None and step_of[r.name].view:
            region.discard(n.name)  # an iota's or constant's value is made where it is read; a strided view is not in memory as itself
    # a view read by a view that keeps its copy keeps its own (each was judged in its own
    # context: under a transposing permute a strided slice reads through, on its own it is a
    # copy, and the copy reads the permute: fuzz crash 9502758)
    # a view kept as a strided view for an extern is made at run time from its argument, so that
    # argument must exist: an extern step whose argument is not itself dropped (review, session 72:
    # a slice under a kept transpose, or a kept alias, ran on nothing)
    region -= {x for x in region if any(strided(u) for u in users[x])
               and (step_of[x].family != "extern" or g[x].arg in region)}
    while dropped := {x for x in region if any(isinstance(g[u], ir.View) and u not in region and not strided(u)
                                               for u in users[x])}:
        region -= dropped
    if not region:
        return p
    steps = []
    for s in p.steps:
        if s.nodes[0] in region and s.family in ("extern", "alias"):
            if s.family == "extern" and any(strided(u) for u in users[s.nodes[0]]):
                # (kernels read it through `reads`; the extern's strided view is made from it)
                s.view, s.bytes = True, 0
                s.note = "strided view: kernels and the externs after it read it in place, no copy"
                steps.append(s)
            continue
        if s.family == "mapreduce" and region & set(s.inputs):
            s.reads = {x: root(x) for x in s.inputs if x in region}
            s.inputs = list(dict.fromkeys(s.reads.get(x, x) for x in s.inputs))
            s.bytes = step_bytes(g, s)
        steps.append(s)
    return Plan(g, steps)


GRID_REDUCE_OPS = ("sum", "max", "min")


def grid_reduce_enabled() -> bool:
    """TILEFUSE_GRID_REDUCE=1 fuses full reductions of per-row values into their row kernel."""
    return env.switch("TILEFUSE_GRID_REDUCE")


def _grid_tail_ok(g: ir.Graph, tail: Step, scratch: set) -> bool:
    """Can `tail` (a one-row kernel over per-row values) finish inside their row kernel? Each of
    its reductions must reduce one per-row f32 value over all rows with sum, max or min (so a
    group of rows reduces to a partial that merges with the others), and everything else must
    be a scalar map of those results or of constants."""
    members = set(tail.nodes)
    for name in tail.nodes:
        n = g[name]
        if isinstance(n, ir.Reduce):
            if n.op not in GRID_REDUCE_OPS or n.arg not in scratch or n.type.dtype != "f32" or n.type.numel != 1:
                return False
        elif isinstance(n, ir.Map):
            if n.type.numel != 1 or any(a not in members and not _generated(g[a]) for a in n.args):
                return False
        else:
            return False
    return True


def grid_reductions(p: Plan) -> Plan:
    """Fuse each full reduction of a row kernel's per-row values (the mean over rows of a loss)
    into that row kernel, as a grid reduction: rather than writing the values and reducing them
    in a second launch (its launch and its serial read of every value cost ~4.5 us next to the
    ~100 us row kernel of a 32768 x 4096 cross-entropy), each group of rows is reduced on chip
    by the last of its CTAs to finish, and the last group finishes the scalar
    (codegen/mapreduce.py). A tail that does not fit stays a kernel of its own."""
    g = p.graph
    users, outputs = g.users(), set(g.outputs)
    producer = {o: s for s in p.steps if s.family == "mapreduce" for o in s.outputs}
    steps = list(p.steps)
    for tail in list(steps):
        if tail.family != "mapreduce" or tail.space is None or tail.space[0] != () or not tail.inputs:
            continue
        R = tail.space[1]
        heads = {id(producer.get(t)) for t in tail.inputs}
        head = producer.get(tail.inputs[0])
        if (head is None or len(heads) != 1 or head.tail is not None or head.space[0] != (R,)
                or head not in steps or head.scan):
            continue
        scratch = list(tail.inputs)
        if not all(g[t].type.shape == (R,) and g[t].type.dtype == "f32" and t not in outputs
                   and head.align.get(t) == (0,)
                   and set(users[t]) <= set(tail.nodes) for t in scratch):
            continue
        if not _grid_tail_ok(g, tail, set(scratch)):
            continue
        merged = Step(head.name, "mapreduce", head.nodes + tail.nodes, head.space, dict(head.align), ref=head.ref,
                      inputs=list(head.inputs), outputs=[o for o in head.outputs if o not in scratch] + tail.outputs,
                      note="grid reduction: " + ", ".join(tail.nodes) + " over all rows, finished by the "
                           "last CTA (per-row " + ", ".join(scratch) + " stay on chip)",
                      head=head, tail=tail, scratch=scratch)
        merged.inputs_all = set(getattr(head, "inputs_all", ()))
        merged.tables = {**head.tables, **tail.tables}
        merged.bytes = step_bytes(g, merged)
        steps[steps.index(head)] = merged
        steps.remove(tail)
    return Plan(g, steps) if len(steps) != len(p.steps) else p


def format_plan(p: Plan) -> str:
    g = p.graph
    lines = [f"plan: {sum(s.family == 'mapreduce' for s in p.steps)} fused kernel(s), "
             f"{sum(s.family == 'gemm' for s in p.steps)} GEMM(s), "
             f"{sum(s.family == 'extern' and not s.view for s in p.steps)} extern(s), "
             f"{sum(s.family == 'alias' for s in p.steps)} alias(es)"
             + (f", {views} strided view(s)" if (views := sum(s.view for s in p.steps)) else "")]
    for s in p.steps:
        if s.family == "alias":
            n = g[s.nodes[0]]
            lines.append(f"  alias {n.name} = {n.arg} as {n.type}")
            continue
        head = f"  {s.family} {s.name}"
        if s.space:
            L, C = s.space
            head += f"  rows={'x'.join(map(str, L)) or 1} row_len={C}" + (" (strided: a column kernel)" if s.columns else "")
        if s.gemm:
            sp = s.gemm
            head += (f"  {'%dx' % sp.batch if sp.batch > 1 else ''}{sp.m}x{sp.n}x{sp.k}"
                     f" B {'[N,K]' if sp.b_major == 'K' else '[K,N]'}")
        head += f"  bytes={_fmt_bytes(s.bytes)}"
        if s.flops:
            head += f" flops={s.flops / 1e9:.3g}G"
        head += f"  floor={s.floor_s * 1e6:.3g}us"
        lines.append(head)
        lines.append(f"    reads  {', '.join(f'{t}: {g[t].type}' for t in s.inputs) or '-'}")
        lines.append(f"    writes {', '.join(f'{t}: {g[t].type}' for t in s.outputs)}")
        lines.append(f"    fuses  {', '.join(s.nodes)}")
        if s.reads:
            lines.append(f"    in place {', '.join(f'{v} from {t}' for v, t in s.reads.items())} (no copy"
                         + ("; a transpose of the last dim: the kernel reads it in 2-D tiles)"
                            if any(_transposes(g, v, t) for v, t in s.reads.items()) else ")"))
        if s.gemm and (s.gemm.maps or s.gemm.pairwise):
            sp = s.gemm
            ops = ", ".join([getattr(g[m], "op", type(g[m]).__name__.lower()) for m in sp.maps]  # (a Gather: "gather")
                            + ["stack to columns (2j, 2j+1)" for _ in sp.stacks])
            lines.append(f"    epilogue {'pairwise on columns (2j, 2j+1): ' if sp.pairwise else ''}{ops}"
                         + (f"; reads {', '.join(f'{t} ({k})' for t, k in sp.operands)}" if sp.operands else ""))
        if s.gemm and s.gemm.partials:
            sp = s.gemm
            lines.append(f"    partials of {sp.partial_of} per {sp.partial_width} columns: "
                         + "; ".join(f"{kind} -> {', '.join(outs)}" for kind, outs, _ in sp.partials))
        if s.note:
            lines.append(f"    note   {s.note}")
    return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.3g}{unit}" if unit != "B" else f"{n}B"
        n /= 1000
    return str(n)

"""Which contractions run as generated GEMMs, and which maps ride in their epilogues.

A contraction `a @ b` becomes a GEMM when its operands are bf16 or fp16 (the sm_90a template's
inputs; the result may be typed f32, as the CODA rules make it) and TMA can read them: K a
multiple of 8, and for a row-major B, N too. `b` that is a transpose of a stored [N, K]
matrix (how `linear` is captured) is read as it is stored (K-major B): no transpose copy
ever runs.

Its epilogue is the longest run of maps after it that (1) read the accumulator or earlier
members, with every other operand a tile of the output's shape, a per-row vector, a
per-column vector, a scalar constant or a map of those vectors (computed in the epilogue, not
read as a tile), none of them computed from the contraction (a tile that is a chain of views
with an expand in it, RoPE's tables repeated over heads and batch, is read from the tensor
under the views: they are absorbed and the broadcast copy is never made); (2) are
float arithmetic; (3) leave exactly one tensor that anything outside reads: the GEMM's output,
the intermediate values never touching memory. A longer run that leaves two or three (the
pre-activation and the activation) is taken instead when the cost model says writing them
from the epilogue beats a map-reduce kernel after the GEMM.

When the run splits the columns into the two stride-2 slices of the last dim (the CODA
gate/up interleaving), directly or after full-width maps, the epilogue is pairwise: each
output element is made of two adjacent accumulator columns, full-width operands are read at
those columns and the output is half as wide. A map joins the first GEMM that can take it.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from .. import dtypes, ops
from . import ir

GEMM_DTYPES = ("bf16", "f16")
MAX_OUTPUTS = 3
# Members an epilogue takes at most. The epilogue is rendered for every accumulator fragment of
# the tile, unrolled (~60 CUDA lines a map), so a chain of a thousand maps after a matmul would
# make one kernel of ~90k lines; what lies beyond runs as a map-reduce kernel. The models'
# epilogues have up to 18 (GPT-2's GELU and the LM head's cross-entropy partials).
MAX_EPILOGUE = 64
FLOATS = ("bf16", "f16", "f32")


@dataclass(frozen=True)
class GemmSpec:
    """A planned GEMM: out[b, m, n] = epilogue(sum_k a[b, m, k] * B[b, k, n])."""

    contraction: str
    a: str
    b: str                # the tensor read as B: stored [N, K] when b_major == "K", else [K, N]
    b_major: str
    m: int
    n: int
    k: int
    batch: int
    dtype: str            # operand dtype
    pairwise: tuple[str, str] | None  # the (even, odd) column slices, when the epilogue pairs columns
    maps: tuple[str, ...]  # the epilogue's members, in graph order
    # (tensor, "tile" | "row" | "col" | "view") the epilogue reads; "view": the source of tile
    # operands read through views (see `viewed`)
    operands: tuple[tuple[str, str], ...]
    outs: tuple[str, ...]  # the tensors it writes (one, or a few when that pays), in graph order
    # views it reads through (b's transpose, the pair slices, the views of `viewed`)
    absorbed: tuple[str, ...] = ()
    # (stack, its full-width view, even, odd): half-width results interleaved back to full width
    # (RoPE's rotated pairs), stored at columns 2n and 2n + 1
    stacks: tuple[tuple[str, str, str, str], ...] = ()
    # (operand, source): a tile operand that is a chain of views broadcasting a tensor (RoPE's
    # (S, D/2) tables repeated over heads and batch): the epilogue reads the source at the
    # composed index (loop/views.py), so the broadcast copy is never made
    viewed: tuple[tuple[str, str], ...] = ()
    # partial row reductions of the epilogue's value `partial_of` over groups of
    # `partial_width` columns: (kind, the [M, T] tensors it writes, an argument) with kind
    # "lse" (pmax, psum) or "select" (psel, its argument the target operand), cross-entropy's
    # (rules/lmhead_ce.py), the value itself then not written (`outs` are the partials); or
    # "sum" (psq, its argument the value summed: RMSNorm's square of the stored value,
    # rules/rmsnorm_partials.py, or LayerNorm's value and its square, rules/layernorm_partials.py),
    # `outs` the value and the partials
    partials: tuple[tuple[str, tuple[str, ...], str | None], ...] = ()
    partial_of: str | None = None
    partial_width: int = 0

    @property
    def stack_nodes(self) -> tuple[str, ...]:
        return tuple(x for st, view, _, _ in self.stacks for x in (st, view))

    @property
    def out(self) -> str:
        """The last tensor it writes (the end of the epilogue's chain)."""
        return self.outs[-1]

    @property
    def out_n(self) -> int:
        return self.n // 2 if self.pairwise else self.n

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def operand_kind(shape: tuple[int, ...], out: tuple[int, ...], batch: int) -> str | None:
    """How an epilogue reads a tensor broadcast against the output: the whole tile, one value
    per row, one per column; None when it is some other broadcast."""
    if len(shape) > len(out):
        return None
    s = (1,) * (len(out) - len(shape)) + tuple(shape)
    if s == tuple(out):
        return "tile"
    if all(d == 1 for d in s[:-1]) and s[-1] == out[-1] and out[-1] > 1:
        return "col"
    if batch == 1 and s[-1] == 1 and s[:-1] == tuple(out[:-1]):
        return "row"  # (with one row, a single value: read at row 0)
    return None


def view_chain(g: ir.Graph, name: str) -> tuple[str, ...]:
    """The views from `name` back to the first tensor that is not a view (`name` first)."""
    out = []
    while isinstance(g[name], ir.View):
        out.append(name)
        name = g[name].arg
    return tuple(out)


def _view_source(g: ir.Graph, name: str) -> str | None:
    """The tensor a tile operand broadcasts through its chain of views (an expand in it, which
    the planner would otherwise copy, most often to a larger tensor), when it is held in memory
    (constants and indices are generated, not read); else None: the operand is read as the tile
    it is (a chain of reshapes is free already)."""
    views = view_chain(g, name)
    if not any(g[v].op == "expand" for v in views):
        return None
    src = g[views[-1]].arg
    return None if isinstance(g[src], (ir.Constant, ir.Iota)) else src


def _transposed_source(g: ir.Graph, b: str) -> str | None:
    """The stored matrix behind b = transpose(last two dims) of it, if b is one."""
    n = g[b]
    if not (isinstance(n, ir.View) and n.op == "permute"):
        return None
    r = len(n.type.shape)
    want = tuple(range(r - 2)) + (r - 1, r - 2)
    return n.arg if r >= 2 and tuple(n.params) == want else None


def _pair_slices(g: ir.Graph, users, c: str) -> tuple[str, str] | None:
    """(even, odd) when c is read only by the slices [..., 0::2] and [..., 1::2]."""
    n = g[c]
    last, width = len(n.type.shape) - 1, n.type.shape[-1]
    found = {}
    for u in users[c]:
        v = g[u]
        if not (isinstance(v, ir.View) and v.op == "slice"):
            return None
        dim, start, end, step = v.params
        if dim % len(n.type.shape) != last or step != 2 or end < width or start not in (0, 1) or start in found:
            return None
        found[start] = u
    return (found[0], found[1]) if len(found) == 2 else None


def _operand_map(g: ir.Graph, name: str, shape, batch: int, avoid: set) -> list[tuple[str, dict]] | None:
    """[(map, its operands), ...] in dependency order when `name` is a map of the output's shape
    computed from operands and constants alone (LayerNorm's rank-1 term: a row vector times a
    column vector), which the epilogue computes instead of reading a materialised tile; else None."""
    n = g[name]
    if name in avoid or not _epilogue_op(n) or n.type.shape != tuple(shape):
        return None
    out: list[tuple[str, dict]] = []
    ops_: dict[str, str] = {}
    for arg in n.args:
        if isinstance(g[arg], ir.Constant):
            continue
        kind = operand_kind(g[arg].type.shape, shape, batch)
        if arg not in avoid and kind in ("row", "col") and g[arg].type.dtype in FLOATS:
            ops_[arg] = kind
            continue
        sub = _operand_map(g, arg, shape, batch, avoid)
        if sub is None:
            return None
        out.extend(sub)
    return out + [(name, ops_)]


class _Below:
    """The nodes that depend on `root` (not root itself), as a set to ask: each asked node is
    found by walking back from it through nodes after root alone (nothing before root in graph
    order can read it), the answers kept. Listing them all up front cost a walk of the rest of
    the graph per contraction, quadratic in a model's layers."""

    def __init__(self, g: ir.Graph, order: dict, root: str):
        self.g, self.order, self.root, self.pos = g, order, root, order[root]
        self.known = {root: True}  # name -> it is root or depends on it

    def __contains__(self, name: str) -> bool:
        return name != self.root and self._reaches(name)

    def _reaches(self, name: str) -> bool:
        known, stack = self.known, [name]
        while stack:
            x = stack[-1]
            if x in known:
                stack.pop()
                continue
            if self.order[x] < self.pos:
                known[x] = False
                stack.pop()
                continue
            args = ir.node_args(self.g[x])
            pending = [a for a in args if a not in known]
            if pending:
                stack.extend(pending)
                continue
            known[x] = any(known[a] for a in args)
            stack.pop()
        return known[name]


class _Avoid:
    """`below`, the epilogue's members so far and the maps an earlier GEMM took, as one set."""

    def __init__(self, *parts):
        self.parts = parts

    def __contains__(self, name: str) -> bool:
        return any(name in p for p in self.parts)


def _epilogue_op(n) -> bool:
    """A map the epilogue computes: a float result, or a comparison or logic on comparisons (a
    bool that a `where` after it reads: leaky ReLU, ELU, softplus's threshold, hardshrink's
    band; never written, `match` keeps it inside)."""
    if not isinstance(n, ir.Map):
        return False
    info = ops.OPS.get(n.op)
    if n.type.dtype == "bool":
        return info is not None and info.kind in ("cmp", "logic")
    if n.type.dtype not in FLOATS:
        return False
    if n.op == "cast":
        return True
    return info is not None and info.kind in ("float", "any")


def why_not(g: ir.Graph, c: ir.Contraction) -> str | None:
    """Why contraction c cannot run as the generated GEMM (None: it can)."""
    a, b = g[c.a].type, g[c.b].type
    if a.dtype not in GEMM_DTYPES or b.dtype != a.dtype:
        return f"{a.dtype} @ {b.dtype}: the generated GEMM takes bf16 or fp16 operands"
    if c.type.dtype not in FLOATS:
        return f"result type {c.type.dtype}"
    if len(b.shape) == 2 and len(a.shape) >= 2:
        pass
    elif len(b.shape) == 3 and len(a.shape) == 3 and a.shape[0] == b.shape[0]:
        pass
    else:
        return f"operand shapes {list(a.shape)} @ {list(b.shape)}: broadcast batching runs in torch.matmul"
    k = a.shape[-1]
    if k % 8:
        return f"K={k}: TMA needs rows that are a multiple of 16 bytes (K a multiple of 8)"
    if _transposed_source(g, c.b) is None and b.shape[-1] % 8:
        return f"N={b.shape[-1]}: a row-major B needs N a multiple of 8 for TMA"
    return None


def match(g: ir.Graph, c: ir.Contraction, users=None, taken: frozenset = frozenset(),
          partials: bool = True) -> GemmSpec | str:
    """The GEMM (with its epilogue) contraction c runs as, or why it cannot. Maps in `taken` are
    in an earlier GEMM's epilogue already (act(g) * u can join g's or u's, not both).
    `partials=False`: no partial row reductions in the epilogue (a target whose template does
    not render them: sm_80)."""
    reason = why_not(g, c)
    if reason:
        return reason
    users = users or g.users()
    a, bt = g[c.a].type, g[c.b].type
    src = _transposed_source(g, c.b)
    b, b_major, absorbed = (src, "K", (c.b,)) if src is not None else (c.b, "N", ())
    if c.a == c.b:
        # B reads the stored matrix under the transpose, but A reads the transpose itself
        # (`t @ t`): absorbed, nothing would make it (fuzzing: A's slot was empty). Other
        # readers of it the planner weighs itself (fusion.plan_gemms).
        absorbed = ()
    if len(bt.shape) == 2:
        batch, m = 1, math.prod(a.shape[:-1])
    else:
        batch, m = a.shape[0], a.shape[1]
    k, n = a.shape[-1], bt.shape[-1]

    full = tuple(c.type.shape)
    half = full[:-1] + (n // 2,) if n % 2 == 0 else None
    level = {c.name: "full"}  # member -> the width it runs at
    order = g.order()
    below = _Below(g, order, c.name)
    pair_src, slices = None, {}
    candidates: list[tuple[str, dict]] = []  # (member, its operands), in graph order
    stacks: dict[str, tuple[str, str, str]] = {}  # full-width view -> (stack, even, odd)
    # Only a node reading a member can join, so the walk visits the readers of members, in
    # graph order (a heap of positions), not every node after c: the same candidates, at a cost
    # that no longer grows with what follows c (a 32-layer model matched each contraction
    # against the whole rest of the graph), and only until MAX_EPILOGUE have joined.
    queue, queued, at = [], set(), order[c.name]

    def joined(name: str) -> None:
        for u in users[name]:
            i = order[u]
            if i > at and i not in queued:
                queued.add(i)
                heapq.heappush(queue, i)

    joined(c.name)
    while queue and len(candidates) < MAX_EPILOGUE:  # (no candidate past those is ever chosen)
        at = heapq.heappop(queue)
        x = g.nodes[at]
        if x.name in taken or x.name in stacks:
            continue
        pair = stack_halves(x)
        if pair and slices and all(level.get(h) == "half" for h in pair) and len(users[x.name]) == 1:
            view = g[users[x.name][0]]
            if isinstance(view, ir.View) and view.op == "reshape" and view.type.shape == full:
                level[x.name], level[view.name] = "stack", "full"
                stacks[view.name] = (x.name, *pair)
                candidates += [(x.name, {}), (view.name, {})]
                joined(x.name)
                joined(view.name)
            continue
        if isinstance(x, ir.View) and x.op == "slice" and half and level.get(x.arg) == "full":
            pair = _pair_slices(g, users, x.arg)
            if pair and pair_src in (None, x.arg):
                pair_src, slices = x.arg, dict(zip(pair, (0, 1)))
                level[x.name] = "half"
                candidates.append((x.name, {}))
                joined(x.name)
            continue
        if not _epilogue_op(x):
            continue
        width = "full" if x.type.shape == full else "half" if half and x.type.shape == half else None
        mine = [a for a in x.args if a in level]
        if width is None or not mine or any(level[a] != width for a in mine):
            continue
        shape = full if width == "full" else half
        new: dict[str, str] = {}
        inner: list[tuple[str, dict]] = []  # maps of operands alone, computed in the epilogue
        for arg in x.args:
            if arg in level or isinstance(g[arg], ir.Constant):
                continue
            got = _operand_map(g, arg, shape, batch, _Avoid(below, level, taken))
            if got is not None:
                inner.extend(got)
                continue
            kind = operand_kind(g[arg].type.shape, shape, batch)
            if arg in below or kind is None or g[arg].type.dtype not in FLOATS:
                break
            new[arg] = "view" if kind == "tile" and _view_source(g, arg) else kind
        else:
            for name, ops_ in inner:
                if name not in level:
                    level[name] = width
                    candidates.append((name, ops_))
                    joined(name)
            level[x.name] = width
            candidates.append((x.name, new))
            joined(x.name)

    # The epilogue is the longest prefix that leaves one tensor read from outside, or a longer
    # one leaving up to MAX_OUTPUTS when that pays (see `_extra_outputs_pay`). With the column
    # pair split in it, the full-width part reads column and tile operands at the accumulator's
    # column (2j or 2j + 1), the part after it at the output's (j).
    outputs = set(g.outputs)

    def escapes(names: set[str]) -> list[str]:
        return sorted((x for x in names if x in outputs or any(u not in names for u in users[x])),
                      key=order.get)

    def widened_for_maps(x: str) -> bool:
        """x is a widening cast (bf16 -> f32 before a softmax) that only maps and reductions read:
        they widen it themselves; written wide, it costs twice the bytes both ways."""
        n = g[x]
        return (isinstance(n, ir.Map) and n.op == "cast" and x not in outputs
                and dtypes.itemsize(n.type.dtype) > dtypes.itemsize(g[n.args[0]].type.dtype)
                and all(isinstance(g[u], (ir.Map, ir.Reduce)) for u in users[x]))

    def valid(prefix) -> list[str] | None:
        names = {c.name} | {x for x, _ in prefix}
        esc = escapes(names)
        if not 1 <= len(esc) <= MAX_OUTPUTS or any(x in slices or g[x].type.dtype not in FLOATS for x in esc):
            return None  # (a comparison's bool is read inside, never written)
        if any(widened_for_maps(x) for x in esc):
            return None
        split = [x for x, _ in prefix if x in slices]
        if not split:
            return esc if all(level[x] == "full" for x in esc) else None
        stacked = any(level[x] == "stack" for x, _ in prefix)
        if len(split) != 2 or any(level[x] != "half" and not (stacked and level[x] == "full") for x in esc):
            return None
        if any(level[x] == "stack" for x in esc):
            return None
        return esc

    single, multi = (0, [c.name]), None
    for i in range(1, min(len(candidates), MAX_EPILOGUE) + 1):
        esc = valid(candidates[:i])
        if esc is not None:
            if len(esc) == 1:
                single = (i, esc)
            else:
                multi = (i, esc)
    best, outs = single
    # (the one output, or its square, reduced per group is a norm's partials, below: not a second output)
    sums = (_sum_partials_after(g, users, outs[0]) if partials and len(outs) == 1 and batch == 1
            and not any(x in slices for x, _ in candidates[:best]) else ())
    if len({s.width for s in sums}) > 1:  # (one epilogue groups its partials one way: none taken)
        sums = ()
    if multi and multi[0] > best and not sums and _extra_outputs_pay(g, c, multi[1], single[1], users):
        best, outs = multi
    chosen = candidates[:best]
    paired = any(x in slices for x, _ in chosen)
    taken_stacks = tuple((st, view, ev, od) for view, (st, ev, od) in stacks.items()
                         if any(x == view for x, _ in chosen))
    skip = set(slices) | {x for t in taken_stacks for x in t[:2]}
    maps = tuple(x for x, _ in chosen if x not in skip)
    operands: dict[str, str] = {}
    for _, new in chosen:
        operands.update(new)
    pairwise = tuple(slices) if paired else None
    viewed = tuple((t, _view_source(g, t)) for t, kind in operands.items() if kind == "view")
    through = dict(viewed)
    bound = tuple(dict.fromkeys((through.get(t, t), kind) for t, kind in operands.items()))
    views = tuple(dict.fromkeys(v for t, _ in viewed for v in reversed(view_chain(g, t))))
    allow_partials = partials
    partials, partial_of, width = (), None, 0
    if allow_partials and len(outs) == 1 and batch == 1 and not pairwise:
        # per-group row reductions after the epilogue's one value (cross-entropy's, rules/lmhead_ce.py):
        # they run in the epilogue too, which then writes the partials instead of the value
        from .rules.lmhead_ce import partials_after

        found = partials_after(g, users, outs[0])
        if found is not None:
            partial_of, width = found.source, found.width
            partials = (("lse", found.lse, None),)
            if found.select:
                partials += (("select", (found.select[0],), found.select[1]),)
                bound += ((found.select[1], "target"),)
            maps += found.members
            outs = list(found.outs)
        elif sums:
            # a norm's row sums after the stored value (RMSNorm's sum of squares, LayerNorm's sum
            # and sum of squares: rules/rmsnorm_partials.py, rules/layernorm_partials.py): the
            # epilogue also reduces them per column group, beside its store
            partial_of, width = outs[0], sums[0].width
            partials = tuple(("sum", (s.psq,), s.value) for s in sums)
            maps += tuple(sorted({x for s in sums for x in s.members}, key=order.get))
            outs = list(outs) + [s.psq for s in sums]
    return GemmSpec(c.name, c.a, b, b_major, m, n, k, batch, a.dtype, pairwise, maps, bound, tuple(outs),
                    absorbed + (pairwise or ()) + views, taken_stacks, viewed, partials, partial_of, width)


def _sum_partials_after(g: ir.Graph, users, y: str):
    from .rules.rmsnorm_partials import sum_partials_after

    return sum_partials_after(g, users, y)


def last_dim_pair(n, target: str) -> tuple[str, str] | None:
    """(first, second) for n = target((first, second), dim=-1), an extern of two tensors along
    the last dim (aten.stack, aten.cat); else None."""
    if not (isinstance(n, ir.Extern) and n.target == target) or not n.args:
        return None
    pair = n.args[0]
    dim = n.args[1] if len(n.args) > 1 else dict(n.kwargs).get("dim", 0)
    rank = len(n.type.shape)
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(a, ir.Ref) for a in pair)):
        return None
    if not isinstance(dim, int) or dim % rank != rank - 1:
        return None
    return pair[0].name, pair[1].name


def stack_halves(n) -> tuple[str, str] | None:
    """(first, second) for n = stack((first, second), dim=-1) of two tensors; else None."""
    pair = last_dim_pair(n, "aten.stack.default")
    return pair if pair and n.type.shape[-1] == 2 else None


def _extra_outputs_pay(g: ir.Graph, c: ir.Contraction, outs: list[str], kept: list[str], users) -> bool:
    """Several outputs cost the GEMM its TMA store (stores go straight from registers, ~10%
    slower at large shapes, bench/LOG_gemm.md); keeping one output (`kept`) costs a map-reduce
    kernel that reads it back and writes those of the others that must exist in memory: program
    outputs and tensors read by a GEMM or an extern. An output read only by maps and reductions
    is not written at all then: its readers compute it from the kept one in their own kernel
    (an RMSNorm's x*x after a residual GEMM, an f32 tile twice the kept bf16's bytes, was written
    and read back for nothing). Pays when the bytes moved take longer than the GEMM's ~10%, at
    the planner's ceilings (fusion.COPY_BYTES_PER_S, MATMUL_FLOPS_PER_S)."""
    from .fusion import COPY_BYTES_PER_S, MATMUL_FLOPS_PER_S

    outputs = set(g.outputs)

    def materialised(o: str) -> bool:
        return o in outputs or any(not isinstance(g[u], (ir.Map, ir.Reduce)) for u in users[o])

    extra = [o for o in outs if o not in kept and materialised(o)]
    if not extra:
        return False
    a = g[c.a].type
    flops = 2 * c.type.numel * a.shape[-1]
    moved = sum(g[o].type.nbytes for o in list(kept) + extra)  # the kept output read back, the others written
    return moved / COPY_BYTES_PER_S > 0.1 * flops / MATMUL_FLOPS_PER_S

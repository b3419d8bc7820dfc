"""A reduction over neighbouring dims as a reduction over one dim of a reshape.

    y = x.mean((2, 3))   ->   y = reshape(mean(reshape(x, [N, C, H * W]), 2), [N, C])

The planner takes reductions over one dim (the last: a row kernel; another: a column kernel,
graph/fusion.py), so `x.mean((2, 3))` (global average pooling, a squeeze-and-excitation's
squeeze) and `x.sum((0, 1))` ran in PyTorch. The dims of more than one element a reduction
takes, with only dims of one element between them, merge into one: a reshape that keeps the
element order, free where x lies in memory. A map of the same shape that only the reduction
reads moves below the reshape (`relu(x).mean((2, 3))`: the map runs on the merged shape, in
the reduction's kernel) where each of its arguments has either the merged dims' sizes or ones
there; the others keep their map, whose result the reshape then views. A map of x's shape computed
from the reduction's result (and from x, or what else has a merged version) moves below too
(`x * sigmoid(x.mean((2, 3), keepdim=True))`: one row kernel, the mean then the product, where
the product over [N, C, H, W] was a map kernel of its own with rows of W), viewed back as itself.

Not taken: a reduction of every dim of more than one element (one row of the whole tensor: a
row kernel would give it a CTA or a cluster, where PyTorch's reduction uses the whole GPU), and
a merged row reduction with fewer than MIN_ROWS rows beside it (a few very long rows: likewise).
"""
from __future__ import annotations

import math

from .. import ir
from .match import Editor

MIN_ROWS = 256  # rows beside a merged row reduction: about two a streaming multiprocessor


def _run(shape: tuple, axes) -> tuple[int, int] | None:
    """(i, j): the dims i..j the reduced dims of more than one element span, where there are two
    or more and every dim between them of more than one element is reduced; else None."""
    big = [a for a in axes if shape[a] != 1]
    if len(big) < 2:
        return None
    i, j = min(big), max(big)
    if any(shape[d] != 1 and d not in axes for d in range(i, j + 1)):
        return None
    return i, j


def _merged(shape: tuple, i: int, j: int) -> tuple:
    return tuple(shape[:i]) + (math.prod(shape[i:j + 1]),) + tuple(shape[j + 1:])


def _taken(shape: tuple, i: int, j: int) -> bool:
    """Whether the planner should see this merge: not a whole-tensor reduction, and a row
    reduction only with MIN_ROWS rows or more beside it."""
    outside = [d for k, d in enumerate(shape) if not i <= k <= j]
    if all(d == 1 for d in outside):
        return False
    last = all(d == 1 for d in shape[j + 1:])
    return not last or math.prod(shape[:i]) >= MIN_ROWS


class _Merge:
    """Builds the merged-shape version of tensors of rank `rank` whose dims i..j merge."""

    def __init__(self, g: ir.Graph, ed: Editor, users: dict, outputs: set, full: tuple, i: int, j: int, source: str):
        self.g, self.ed, self.users, self.outputs = g, ed, users, outputs
        self.full, self.rank, self.i, self.j, self.source = full, len(full), i, j, source
        self.key = (tuple(full), i, j)
        self.nodes: list = []
        self.merged: dict[str, str] = {}  # a tensor of the full shape -> its merged version
        self.views: dict[tuple, str] = {}  # one view a tensor and shape: a kernel reads it once
        self._inner: dict[str, bool] = {}  # inner(), memoised

    def rollback(self, mark: int):
        """Forget the nodes made since `mark` (an argument had no merged version)."""
        gone = {x.name for x in self.nodes[mark:]}
        del self.nodes[mark:]
        self.views = {k: v for k, v in self.views.items() if v not in gone}
        self.merged = {k: v for k, v in self.merged.items() if v not in gone}

    def view(self, a: str, shape: tuple) -> str:
        if (a, shape) not in self.views:
            t = ir.TensorType(shape, self.g[a].type.dtype)
            v = ir.View(self.ed.fresh(f"{a}_merged"), t, "reshape", a, shape, self.source)
            self.nodes.append(v)
            self.views[a, shape] = v.name
        return self.views[a, shape]

    def arg(self, a: str) -> str | None:
        """`a`, an argument broadcast against the full shape, in the merged shape; None where its
        dims i..j are neither all the full shape's nor all ones."""
        if a in self.merged:
            return self.merged[a]
        n, rank, i, j = self.g[a], self.rank, self.i, self.j
        s = n.type.shape
        if n.type.numel == 1 or len(s) <= rank - 1 - j:
            return a  # (a scalar, or dims after the run only: it broadcasts in the merged shape as it is)
        padded = (1,) * (rank - len(s)) + tuple(s)
        if all(d == 1 for d in padded[i:j + 1]):
            shape = padded[:i] + (1,) + padded[j + 1:]
        elif isinstance(n, ir.Map) and n.type.shape == self.full:
            return self.map(a)
        else:
            shape = _merged(padded, i, j)
            if shape[i] != math.prod(self.full[i:j + 1]):
                return None  # (part of the run broadcast: no reshape of it spans the merged dim)
        if isinstance(n, (ir.Constant, ir.Iota)):
            return None  # (a generated tensor is made where it is read: no view of it)
        return self.view(a, shape)

    def shared(self, a: str) -> bool:
        """`a` is read by more than one node, or is an output: computed where it is, not moved;
        unless each of its readers is a reduction over this run or a map only they read, in x's
        shape (Mish's exp(x), read by e (e + 2)): then it is computed merged, once, for all."""
        return (len(set(self.users[a])) != 1 or a in self.outputs) and not self.inner(a)

    def inner(self, a: str) -> bool:
        """`a` is a map of the full shape, no output, read only by reductions over this run and by
        maps that are themselves inner."""
        if a not in self._inner:
            self._inner[a] = False  # (a DAG: no cycle to meet, but stay finite)
            n = self.g[a]
            self._inner[a] = (isinstance(n, ir.Map) and n.type.shape == self.full and a not in self.outputs
                              and bool(self.users[a]) and all(self._reads_in_run(u) or self.inner(u)
                                                              for u in set(self.users[a])))
        return self._inner[a]

    def _reads_in_run(self, u: str) -> bool:
        r = self.g[u]
        return (isinstance(r, ir.Reduce) and self.g[r.arg].type.shape == self.full
                and _run(self.full, r.axes) == (self.i, self.j))

    def map(self, a: str) -> str | None:
        """Map `a` computed in the merged shape, where only the reduction's chain reads it."""
        n = self.g[a]
        if self.shared(a):
            return self.view(a, _merged(n.type.shape, self.i, self.j))
        mark = len(self.nodes)
        args = [self.arg(x) for x in n.args]
        if any(x is None for x in args):
            self.rollback(mark)
            return self.view(a, _merged(n.type.shape, self.i, self.j))
        m = ir.Map(self.ed.fresh(f"{a}_merged"), ir.TensorType(_merged(n.type.shape, self.i, self.j), n.type.dtype),
                   n.op, tuple(args), n.source)
        self.nodes.append(m)
        self.merged[a] = m.name
        return m.name

    def below(self, n: ir.Map) -> list | None:
        """Map `n` of the full shape after the reduction (`x * sigmoid(x.mean((2, 3), keepdim=True))`,
        a squeeze-and-excitation) computed in the merged shape, then viewed back as itself: the
        new nodes, or None where an argument has no merged version."""
        for x in n.args:  # (a map of the full shape computed for others too: read back, a pass more)
            a = self.g[x]
            if x not in self.merged and isinstance(a, ir.Map) and a.type.shape == self.full and self.shared(x):
                return None
        mark = len(self.nodes)
        args = [self.arg(x) for x in n.args]
        if any(x is None for x in args):
            self.rollback(mark)
            return None
        m = ir.Map(self.ed.fresh(f"{n.name}_merged"), ir.TensorType(_merged(self.full, self.i, self.j), n.type.dtype),
                   n.op, tuple(args), n.source)
        self.merged[n.name] = m.name
        new = self.nodes[mark:] + [m, ir.View(n.name, n.type, "reshape", m.name, tuple(n.type.shape), n.source)]
        del self.nodes[mark:]
        return new


def merged_reductions(g: ir.Graph) -> ir.Graph:
    # a dry run finds the maps that could move below a merged reduction; of those, only the ones
    # no map, view or other reduction reads from outside the move: such a reader, left in x's
    # shape, would read the moved map's result back, a full tensor written and read that the
    # kernel of maps after the reduction never wrote. (A reduction over the same run reads it
    # merged; an output, a matmul or a PyTorch op (a conv after an InstanceNorm) needs the
    # tensor written anyway.)
    first, moved, merged_by = _rewrite(g, None)
    if not moved:
        return first
    users = g.users()

    def blocks(u: str, m: str) -> bool:
        if u in keep:
            return False
        n = g[u]
        if isinstance(n, ir.Reduce):
            return merged_by.get(u) != moved[m]
        return isinstance(n, (ir.Map, ir.View))

    keep = set(moved)
    while True:
        drop = {m for m in keep
                if any(blocks(u, m) for u in users[m])
                or any(a in moved and a not in keep for a in g[m].args)}
        if not drop:
            break
        keep -= drop
    return _rewrite(g, frozenset(keep))[0]


def _rewrite(g: ir.Graph, allowed: frozenset | None) -> tuple[ir.Graph, dict, dict]:
    """(the graph rewritten, the maps moved below -> their merge's run, the reductions merged ->
    their run); `allowed`: the maps that may move below (None: any that can)."""
    users, outputs = g.users(), set(g.outputs)
    ed, nodes, changed = Editor(g), [], False
    after: dict[str, _Merge] = {}  # a tensor computed from a merged reduction's result -> that merge
    runs: dict[tuple, _Merge] = {}   # (shape, i, j) -> the merge of reductions over that run
    moved: dict[str, tuple] = {}
    merged_by: dict[str, tuple] = {}
    for n in g.nodes:
        if isinstance(n, ir.Map):
            merges = list({id(after[a]): after[a] for a in n.args if a in after}.values())
            if len(merges) == 1:
                mg = after[n.name] = merges[0]
                new = (mg.below(n) if n.type.shape == mg.full and (allowed is None or n.name in allowed)
                       else None)
                if new is not None:
                    nodes += new
                    moved[n.name] = mg.key
                    continue
        run = _run(g[n.arg].type.shape, n.axes) if isinstance(n, ir.Reduce) else None
        if run is None or not _taken(g[n.arg].type.shape, *run):
            nodes.append(n)
            continue
        i, j = run
        xs = g[n.arg].type.shape
        # reductions over the same run of one shape share their merged tensors: a hand-written
        # InstanceNorm's variance reads x - mean as the mean's kernel computed it, merged (one
        # kernel, not three)
        mg = runs.setdefault((xs, i, j), _Merge(g, ed, users, outputs, xs, i, j, n.source))
        x = (mg.merged.get(n.arg) or mg.map(n.arg) if isinstance(g[n.arg], ir.Map)
             else mg.view(n.arg, _merged(xs, i, j)))
        ms = _merged(xs, i, j)
        kept = tuple(d for k, d in enumerate(ms) if k != i or n.keepdim)
        rt = ir.TensorType(tuple(1 if k == i else d for k, d in enumerate(ms)) if n.keepdim else kept, n.type.dtype)
        r = ir.Reduce(ed.fresh(f"{n.name}_merged"), rt, n.op, x, (i,), n.keepdim, n.source)
        nodes += mg.nodes + [r, ir.View(n.name, n.type, "reshape", r.name, tuple(n.type.shape), n.source)]
        mg.nodes = []
        after[n.name] = mg
        merged_by[n.name] = mg.key
        changed = True
    return (ed.graph(nodes) if changed else g), moved, merged_by

"""A reduction over dims that are not neighbours, as one reduction a run of neighbouring dims.

    y = x.mean((0, 2, 3))   ->   y = mean(mean(x, (2, 3)), 0)      (x of [N, C, H, W])

BatchNorm's statistics (every dim but the channels), `x.sum((0, 2))` of [B, S, D] kept per
sequence position, ran in PyTorch: the planner takes a reduction over one dim or over
neighbouring ones (rules/merged_reductions.py), and the maps it reads (a variance's squares)
were a kernel of their own, written and read back. Reduced a run at a time, the last run first
(the one nearest in memory: a row kernel, merged where it spans several dims), each step's
result is smaller by that run's size, and the maps move into the first step's kernel. A sum,
mean or product of 16-bit values keeps float32 partials (the accumulator's type, rounded once at
the end); a mean is the mean of equal runs' means; max and min are exact in any order.

Taken where the first step leaves at most a fiftieth of the elements for the rest to read
(`MIN_SHRINK`: else the steps' launches and round trips lose to PyTorch's one pass), where the
first step is a kernel of the planner's (a row reduction with MIN_ROWS rows beside it, or a
column kernel's rows, fusion.column_min_rows), and, where the argument is the program's own
tensor (no map saved), where it has at least MIN_ELEMENTS elements: a small tensor's reduction is
one launch in PyTorch and would be two here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import ir
from .match import Editor
from .merged_reductions import MIN_ROWS
from .small_reductions import MAX_EXTENT

MIN_ELEMENTS = 1 << 20  # a program tensor reduced in runs: at least this many elements
MIN_SHRINK = 50         # the first run (the last dims) divides what is left to read by at least this
_OPS = ("sum", "mean", "max", "min", "prod")


def runs(shape: tuple, axes) -> list[list[int]]:
    """The reduced dims in runs of neighbours: a dim of more than one element that is not reduced
    separates two runs (dims of one element separate nothing)."""
    out: list[list[int]] = []
    for a in sorted(axes):
        if out and not any(shape[d] != 1 for d in range(out[-1][-1] + 1, a)):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def in_runs(shape: tuple, axes, tensor: bool) -> list[list[int]] | None:
    """The runs of a reduction over `axes` of `shape`, last first, where this rule takes it
    (module docstring); `tensor`: its argument is the program's own tensor."""
    from ..fusion import column_min_rows

    numel = math.prod(shape)
    rs = runs(shape, axes)
    if len(rs) < 2 or numel == 0 or any(all(shape[a] == 1 for a in r) for r in rs):
        return None
    if tensor and numel < MIN_ELEMENTS:
        return None
    last = rs[-1]
    size = math.prod(shape[a] for a in last)
    rows = numel // size
    if all(d == 1 for d in shape[last[-1] + 1:]):
        if rows < MIN_ROWS:
            return None
    elif rows < column_min_rows(size):
        return None
    if rows * MIN_SHRINK > numel:
        return None
    return rs[::-1]


def _in_order(g: ir.Graph, name: str, size: int) -> bool:
    """Whether `name` is laid out in its own dims' order: maps and reshapes of written tensors,
    not of a permuted view (`x.transpose(1, 2).sum((0, 2))` is `x.sum((0, 1))` in memory: runs
    of the view's dims would copy it)."""
    def below(x):
        n = g[x]
        return () if n.type.numel < size or not isinstance(n, (ir.View, ir.Map)) else ir.node_args(n)

    return not any(isinstance(g[x], ir.View) and g[x].op == "permute" and g[x].type.numel >= size
                   for x in ir.reached(name, below))


def _taken(g: ir.Graph, n: ir.Node) -> list[list[int]] | None:
    if not isinstance(n, ir.Reduce) or n.op not in _OPS or not _in_order(g, n.arg, g[n.arg].type.numel):
        return None
    return in_runs(g[n.arg].type.shape, n.axes, isinstance(g[n.arg], (ir.Input, ir.Weight)))


def _wide(n: ir.Reduce) -> str:
    return "f32" if n.op in ("sum", "mean", "prod") and n.type.dtype in ("bf16", "f16") else n.type.dtype


@dataclass(frozen=True)
class _Steps:
    """How a centred pair is reduced in two steps: over `last` of x viewed as `shape`, then over
    `first`; `pieces`: `shape` cuts one long dim into pieces (few long columns), else it is x's."""

    shape: tuple
    last: tuple
    first: tuple
    pieces: bool = False


def _steps(g: ir.Graph, n: ir.Reduce) -> _Steps | None:
    """Two runs of dims apart; or one dim that is not last with too few rows beside it for a
    column kernel (`x.var(0)` of [8192, 4096]), of the program's own tensor (or its upcast), cut
    into pieces as rewrites.split_long_columns cuts a lone sum: a column kernel over the pieces'
    rows, then one over the pieces."""
    from ...loop.flat import split_enabled
    from ..fusion import column_min_rows, columns_enabled
    from ..rewrites import _column_piece

    rs = _taken(g, n)
    shape = g[n.arg].type.shape
    if rs is not None:
        return _Steps(shape, tuple(rs[0]), tuple(rs[1])) if len(rs) == 2 else None
    src = g[n.arg]
    if isinstance(src, ir.Map) and src.op == "cast":
        src = g[src.args[0]]
    if (len(n.axes) != 1 or not isinstance(src, (ir.Input, ir.Weight)) or not split_enabled()
            or not columns_enabled() or all(d == 1 for d in shape[n.axes[0] + 1:])):
        return None
    k = n.axes[0]
    C, rows = shape[k], math.prod(shape) // shape[k]
    K = _column_piece(C, rows) if rows < column_min_rows(C) else None
    if K is None:
        return None
    while C // K <= MAX_EXTENT and K % 2 == 0 and K >= 128:
        K //= 2  # (more pieces than a short reduction's: their finish is then one column kernel, not maps after it)
    return _Steps(shape[:k] + (C // K, K) + shape[k + 1:], (k + 1,), (k,), True)


def _centred(g: ir.Graph, n: ir.Node):
    """(the mean, the centred value's argument, the steps) where n sums or averages the squares
    of x - m, m = x.mean(axes, keepdim=True) over the same dims, reduced in two steps (_steps: a
    variance, BatchNorm's statistics); x may be a cast of the mean's argument (a 16-bit tensor's
    variance)."""
    if not isinstance(n, ir.Reduce) or n.op not in ("sum", "mean"):
        return None
    q = g[n.arg]
    if not (isinstance(q, ir.Map) and q.op == "mul" and q.args[0] == q.args[1]):
        return None
    d = g[q.args[0]]
    if not (isinstance(d, ir.Map) and d.op == "sub" and d.type.shape == q.type.shape):
        return None
    a, m = d.args
    if isinstance(g[a], ir.Reduce) and not isinstance(g[m], ir.Reduce):  # ((m - x)^2 is (x - m)^2)
        a, m = m, a
    m = g[m]
    if not (isinstance(m, ir.Reduce) and m.op == "mean" and m.keepdim and m.axes == n.axes
            and g[a].type.shape == d.type.shape and m.type.dtype == d.type.dtype in ("f32", "f64")):
        return None
    cast = g[a]
    if m.arg != a and not (isinstance(cast, ir.Map) and cast.op == "cast" and cast.args == (m.arg,)):
        return None
    steps = _steps(g, m)
    if steps is None or (not steps.pieces and len(_taken(g, n) or ()) != 2):
        return None
    return m, a, steps


def reductions_in_runs(g: ir.Graph) -> ir.Graph:
    pairs = {}  # the second moment's reduction -> (its mean, x, the steps)
    for n in g.nodes:
        c = _centred(g, n)
        if c is not None:
            pairs[n.name] = c
    means = {m.name: steps for m, _, steps in pairs.values()}
    if not pairs and not any(_taken(g, n) for n in g.nodes):
        return g
    ed = Editor(g)
    out = []
    firsts = {}  # a pair's mean -> (the means of its first step, the whole mean), in the steps' shape
    for n in g.nodes:
        if n.name in means:
            out += _mean_in_steps(g, ed, n, means[n.name], firsts)
            continue
        if n.name in pairs:
            out += _moment_in_steps(g, ed, n, *pairs[n.name], firsts)
            continue
        rs = _taken(g, n)
        if rs is None:
            out.append(n)
            continue
        shape = g[n.arg].type.shape
        wide = _wide(n)
        cur = n.arg
        # last run first: dims before a run keep their numbers as the runs after it go
        for r in rs[:-1]:
            shape = tuple(d for i, d in enumerate(shape) if i not in r)
            step = ir.Reduce(ed.fresh(f"{n.name}_run"), ir.TensorType(shape, wide), n.op, cur, tuple(r), False,
                             n.source)
            out.append(step)
            cur = step.name
        first = tuple(rs[-1])
        if n.keepdim:
            rest = tuple(d for i, d in enumerate(shape) if i not in first)
            end = ir.Reduce(ed.fresh(f"{n.name}_run"), ir.TensorType(rest, n.type.dtype), n.op, cur, first, False,
                            n.source)
            out += [end, ir.View(n.name, n.type, "reshape", end.name, n.type.shape, n.source)]
        else:
            out.append(ir.Reduce(n.name, n.type, n.op, cur, first, False, n.source))
    return ed.graph(out)


def _keep(shape: tuple, axes) -> tuple:
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _upcast_source(g: ir.Graph, name: str) -> str:
    """A 16-bit tensor's f32 upcast: the tensor itself (read in place, converted where read)."""
    c = g[name]
    if isinstance(c, ir.Map) and c.op == "cast" and g[c.args[0]].type.dtype in ("bf16", "f16"):
        return c.args[0]
    return name


def _mean_in_steps(g: ir.Graph, ed: Editor, m: ir.Reduce, st: _Steps, firsts: dict) -> list:
    """The mean of a centred pair: the mean of each row of the first step (kept, for the second
    moment), then the mean of those."""
    # (a 16-bit tensor's upcast read in place: the reduction accumulates in f32 anyway, and the
    # cast, read by this kernel and the one normalising x, would be written between them)
    src = _upcast_source(g, m.arg)
    out = []
    up = None
    if st.pieces:
        v = ir.View(ed.fresh(f"{src}_pieces"), ir.TensorType(st.shape, g[src].type.dtype), "reshape", src, st.shape,
                    m.source)
        out.append(v)
        src = v.name
        if m.type.dtype != v.type.dtype:
            # (a column kernel starts at the upcast both its reductions read: column_ahead)
            up = ir.Map(ed.fresh(f"{m.name}_up"), ir.TensorType(st.shape, m.type.dtype), "cast", (src,), m.source)
            out.append(up)
            src = up.name
    row = ir.Reduce(ed.fresh(f"{m.name}_run"), ir.TensorType(_keep(st.shape, st.last), _wide(m)), "mean", src,
                    st.last, True, m.source)
    out.append(row)
    if st.pieces:
        whole = ir.Reduce(ed.fresh(f"{m.name}_run"), ir.TensorType(_keep(st.shape, st.last + st.first), m.type.dtype),
                          "mean", row.name, st.first, True, m.source)
        out += [whole, ir.View(m.name, m.type, "reshape", whole.name, m.type.shape, m.source)]
        firsts[m.name] = row.name, whole.name, up.name if up else v.name
    else:
        out.append(ir.Reduce(m.name, m.type, "mean", row.name, st.first, True, m.source))
        firsts[m.name] = row.name, m.name, None
    return out


def _moment_in_steps(g: ir.Graph, ed: Editor, n: ir.Reduce, m: ir.Reduce, x: str, st: _Steps, firsts: dict) -> list:
    """The sum (mean) of (x - mean)^2 in two steps, from each row's own: each row of the first
    step sums the squares about its mean (one kernel with that mean, as a norm's statistics
    are), and the rows combine as parallel variances do, adding the size of a row times the
    squares of the rows' means about the whole mean (Chan et al.)."""
    last, first, shape = st.last, st.first, st.shape
    row, whole, piece = firsts[m.name]
    t = g[x].type.dtype
    wt = ir.TensorType(shape, t)
    rt = ir.TensorType(_keep(shape, last), t)
    ft = ir.TensorType(_keep(shape, last + first), t)

    def node(kind, base, typ, *rest):
        return kind(ed.fresh(f"{n.name}_{base}"), typ, *rest, n.source)

    out = []
    if piece is not None:
        x = piece  # (the pieces of x, or their upcast, that the mean's first step read: x's dtype is the mean's)
    else:
        src = _upcast_source(g, x)
        if g[src].type.dtype != t:  # (its own upcast: the one x's normalisation reads stays in that kernel)
            up = node(ir.Map, "up", wt, "cast", (src,))
            out.append(up)
            src = up.name
        x = src
    d = node(ir.Map, "dev", wt, "sub", (x, row))
    q = node(ir.Map, "sq", wt, "mul", (d.name, d.name))
    s = node(ir.Reduce, "rowsq", rt, "sum", q.name, last, True)
    e = node(ir.Map, "spread", rt, "sub", (row, whole))
    e2 = node(ir.Map, "spreadsq", rt, "mul", (e.name, e.name))
    se = node(ir.Reduce, "between", ft, "sum", e2.name, first, True)
    ss = node(ir.Reduce, "within", ft, "sum", s.name, first, True)
    size = math.prod(shape[a] for a in last)
    k = ir.Constant(ed.fresh(f"{n.name}_rowsize"), ir.TensorType((), t), float(size), n.source)
    w = node(ir.Map, "weighted", ft, "mul", (se.name, k.name))
    tot = node(ir.Map, "total", ft, "add", (ss.name, w.name))
    out += [d, q, s, e, e2, se, ss, k, w, tot]
    if n.op == "mean":
        c = ir.Constant(ed.fresh(f"{n.name}_count"), ir.TensorType((), t), float(size * math.prod(
            shape[a] for a in first)), n.source)
        tot = node(ir.Map, "mean", ft, "div", (tot.name, c.name))
        out += [c, tot]
    if n.type.dtype != t:
        tot = node(ir.Map, "cast", ir.TensorType(ft.shape, n.type.dtype), "cast", (tot.name,))
        out.append(tot)
    return out + [ir.View(n.name, n.type, "reshape", tot.name, n.type.shape, n.source)]

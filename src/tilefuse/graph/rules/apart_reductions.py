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

from .. import ir
from .match import Editor
from .merged_reductions import MIN_ROWS

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
    node = g[name]
    if node.type.numel < size:
        return True
    if isinstance(node, ir.View):
        return node.op != "permute" and _in_order(g, node.arg, size)
    if isinstance(node, ir.Map):
        return all(_in_order(g, a, size) for a in node.args)
    return True


def _taken(g: ir.Graph, n: ir.Node) -> list[list[int]] | None:
    if not isinstance(n, ir.Reduce) or n.op not in _OPS or not _in_order(g, n.arg, g[n.arg].type.numel):
        return None
    return in_runs(g[n.arg].type.shape, n.axes, isinstance(g[n.arg], (ir.Input, ir.Weight)))


def _wide(n: ir.Reduce) -> str:
    return "f32" if n.op in ("sum", "mean", "prod") and n.type.dtype in ("bf16", "f16") else n.type.dtype


def _centred(g: ir.Graph, n: ir.Node):
    """(the mean, the centred value's argument) where n sums or averages the squares of x - m,
    m = x.mean(axes, keepdim=True) over the same dims in two runs (a variance, BatchNorm's
    statistics); x may be a cast of the mean's argument (a 16-bit tensor's variance)."""
    if not isinstance(n, ir.Reduce) or n.op not in ("sum", "mean") or len(_taken(g, n) or ()) != 2:
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
            and g[a].type.shape == d.type.shape and m.type.dtype == d.type.dtype in ("f32", "f64")
            and len(_taken(g, m) or ()) == 2):
        return None
    cast = g[a]
    if m.arg != a and not (isinstance(cast, ir.Map) and cast.op == "cast" and cast.args == (m.arg,)):
        return None
    return m, a


def reductions_in_runs(g: ir.Graph) -> ir.Graph:
    pairs = {}  # the second moment's reduction -> (its mean, x)
    for n in g.nodes:
        c = _centred(g, n)
        if c is not None:
            pairs[n.name] = c
    means = {m.name: n for n, (m, _) in pairs.items()}
    if not pairs and not any(_taken(g, n) for n in g.nodes):
        return g
    ed = Editor(g)
    out = []
    firsts = {}  # a pair's mean -> the mean of its first step (keepdim)
    for n in g.nodes:
        if n.name in means:
            out += _mean_in_runs(g, ed, n, firsts)
            continue
        if n.name in pairs:
            out += _moment_in_runs(g, ed, n, *pairs[n.name], firsts)
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


def _mean_in_runs(g: ir.Graph, ed: Editor, m: ir.Reduce, firsts: dict) -> list:
    """The mean of a centred pair: the mean of each row of the last run (kept, for the second
    moment), then the mean of those."""
    last, first = _taken(g, m)
    shape = g[m.arg].type.shape
    # (a 16-bit tensor's upcast read in place: the reduction accumulates in f32 anyway, and the
    # cast, read by this kernel and the one normalising x, would be written between them)
    src, c = m.arg, g[m.arg]
    if isinstance(c, ir.Map) and c.op == "cast" and g[c.args[0]].type.dtype in ("bf16", "f16"):
        src = c.args[0]
    row = ir.Reduce(ed.fresh(f"{m.name}_run"), ir.TensorType(_keep(shape, last), _wide(m)), "mean", src,
                    tuple(last), True, m.source)
    firsts[m.name] = row.name
    return [row, ir.Reduce(m.name, m.type, "mean", row.name, tuple(first), True, m.source)]


def _moment_in_runs(g: ir.Graph, ed: Editor, n: ir.Reduce, m: ir.Reduce, x: str, firsts: dict) -> list:
    """The sum (mean) of (x - mean)^2 over two runs, from each row's own: each row of the last run
    sums the squares about its mean (one kernel with that mean, as a norm's statistics are), and
    the rows combine as parallel variances do, adding the size of a row times the squares of
    the rows' means about the whole mean (Chan et al.)."""
    last, first = _taken(g, n)
    shape = g[x].type.shape
    row = firsts[m.name]
    t = g[x].type.dtype
    rt = ir.TensorType(_keep(shape, last), t)
    ft = ir.TensorType(_keep(shape, n.axes), t)

    def node(kind, base, typ, *rest):
        return kind(ed.fresh(f"{n.name}_{base}"), typ, *rest, n.source)

    out = []
    c = g[x]
    if isinstance(c, ir.Map) and c.op == "cast":  # (its own upcast: the one x's normalisation reads stays
        c = node(ir.Map, "up", g[x].type, "cast", c.args)  # in that kernel, not written for both)
        out.append(c)
        x = c.name
    d = node(ir.Map, "dev", c.type, "sub", (x, row))
    q = node(ir.Map, "sq", c.type, "mul", (d.name, d.name))
    s = node(ir.Reduce, "rowsq", rt, "sum", q.name, tuple(last), True)
    e = node(ir.Map, "spread", rt, "sub", (row, m.name))
    e2 = node(ir.Map, "spreadsq", rt, "mul", (e.name, e.name))
    se = node(ir.Reduce, "between", ft, "sum", e2.name, tuple(first), True)
    ss = node(ir.Reduce, "within", ft, "sum", s.name, tuple(first), True)
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

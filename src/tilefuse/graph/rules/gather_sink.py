"""Row gathers moved through the maps they gather from, and through the views that split them.

    gather(op(a, w), 0, idx)        ->   op(gather(a, 0, idx), gather(w, 0, idx))
    reshape(gather(t, 0, idx), [A, B, D])[:, j:j+1]
                                    ->   reshape(gather(t, 0, idx.view(A, B)[:, j:j+1]), [A, 1, D])

A mixture of experts runs each token's top-k rows through the experts in expert order, scales
them by their routing weights (a map, float32), puts them back in token order (a gather) and
sums each token's k rows (a reduction over a dim of k, maps of its slices after
small_reductions.py). Each of these ran as a kernel of its own: the scaled rows written in
float32, gathered into a second float32 copy, read back by the sum (441 us a forward of a
2-layer Mixtral on an H200). A gather is elementwise in its index, so the map of gathered
arguments computes the same values; the kernel that sums then reads the experts' 16-bit rows
where they lie, at their gathered positions, and scales them itself.

`gathers_through_maps` is taken where every reader of the map is a gather along the same axis
that keeps the map's other dims whole, together gathering no more elements than the map has
(nothing is computed twice over), the map is not a result, and every argument the gather would
cut is a float tensor in memory or a view of one (reshaped to the map's rank where it has fewer
dims): a kernel loads a gathered table from memory (fusion.gathers_in), and an index out of
range reads NaN, which a bool or integer table cannot hold. Arguments of size 1 along the axis
broadcast, and stay as they are. `split_gathers` rewrites the slices a reduction over a split
dim made (`out.view(T, k, D)`, sliced at each j) into gathers at the slices of the index, for a
gather of a map (it prepares the first rule; gathers of tables in memory are left alone). The
first repeats until nothing moves, at most MAX_PASSES times.
"""
from __future__ import annotations

import math

from ... import dtypes
from .. import ir
from .match import MAX_PASSES, Editor


def _row_gather(g: ir.Graph, name: str) -> bool:
    """A gather along dim 0 whose index is one value a row (shape [N, 1, ..., 1])."""
    n = g[name]
    return (isinstance(n, ir.Gather) and n.axis == 0 and len(n.type.shape) >= 1
            and all(s == 1 for s in g[n.index].type.shape[1:]) and len(g[n.index].type.shape) == len(n.type.shape))


def _split_slice(g: ir.Graph, name: str, users: dict) -> tuple | None:
    """(gather, A, B, j) where `name` is slice(reshape(gather, [A, B, *rest]), 1, j, j + 1) of a
    row gather [A * B, *rest] of a map, each read only by what this rewrites."""
    s = g[name]
    if not (isinstance(s, ir.View) and s.op == "slice" and s.params[0] == 1 and s.params[3] == 1
            and s.params[2] == s.params[1] + 1):
        return None
    r = g[s.arg]
    if not (isinstance(r, ir.View) and r.op == "reshape" and _row_gather(g, r.arg)):
        return None
    gat = g[r.arg]
    full, split = gat.type.shape, r.type.shape
    if (len(split) != len(full) + 1 or split[2:] != full[1:] or split[0] * split[1] != full[0]
            or not isinstance(g[gat.arg], ir.Map) or users.get(gat.name) != [r.name]
            or r.name in g.outputs or gat.name in g.outputs):
        return None
    if not all(isinstance(g[u], ir.View) and g[u].op == "slice" and g[u].params[0] == 1 for u in users.get(r.name, [])):
        return None
    return gat, split[0], split[1], s.params[1]


def split_gathers(g: ir.Graph) -> ir.Graph:
    users = g.users()
    found = {n.name: f for n in g.nodes if (f := _split_slice(g, n.name, users)) is not None}
    if not found:
        return g
    ed, out = Editor(g), []
    for n in g.nodes:
        if n.name not in found:
            out.append(n)
            continue
        gat, a, b, j = found[n.name]
        idx = g[gat.index]
        src = n.source
        pairs = ir.View(ed.fresh(f"{gat.index}_pairs"), ir.TensorType((a, b), idx.type.dtype), "reshape",
                        idx.name, (a, b), src)
        pick = ir.View(ed.fresh(f"{gat.index}_at{j}"), ir.TensorType((a, 1), idx.type.dtype), "slice",
                       pairs.name, (1, j, j + 1, 1), src)
        out += [pairs, pick]
        index = pick.name
        rank = len(gat.type.shape)
        if rank != 2:
            col = ir.View(ed.fresh(f"{gat.index}_col{j}"), ir.TensorType((a,) + (1,) * (rank - 1), idx.type.dtype),
                          "reshape", pick.name, (a,) + (1,) * (rank - 1), src)
            out.append(col)
            index = col.name
        part = ir.Gather(ed.fresh(f"{gat.name}_at{j}"), ir.TensorType((a,) + gat.type.shape[1:], gat.type.dtype),
                         gat.arg, index, 0, gat.source, gat.wrap)
        out += [part, ir.View(n.name, n.type, "reshape", part.name, n.type.shape, src)]
    return ed.graph(out)


def _in_memory(g: ir.Graph, a: str) -> bool:
    """A float or bool tensor a kernel may gather from (a bool one through its f32 cast): not a
    map computed where it is read (an iota's or a constant's)."""
    n = g[a]
    while isinstance(n, ir.View) and n.op == "reshape":
        n = g[n.arg]
    return ((dtypes.is_float(g[a].type.dtype) or g[a].type.dtype == "bool")
            and not isinstance(n, (ir.Iota, ir.Constant))
            and not (isinstance(n, ir.Map) and all(isinstance(g[x], (ir.Iota, ir.Constant)) for x in n.args)))


def _cut_dim(g: ir.Graph, m: ir.Map, a: str, axis: int) -> int | None:
    """Where argument a (right-aligned to the map's shape) has the gathered axis, when it is more
    than 1 there; None where a broadcasts along it."""
    t = g[a].type
    d = axis - (len(m.type.shape) - len(t.shape))
    return d if d >= 0 and t.shape[d] != 1 else None


def _movable(g: ir.Graph, name: str, users: dict) -> bool:
    m = g[name]
    if not isinstance(m, ir.Map) or name in g.outputs or not users.get(name):
        return False
    if m.op == "cast" and g[m.args[0]].type.dtype == "bool":
        return False  # (a bool's f32 table, made below: through it the gather would come back to it)
    readers = [g[u] for u in users[name]]
    if not all(isinstance(r, ir.Gather) and r.arg == name and r.index != name for r in readers):
        return False
    if len({r.axis for r in readers}) != 1 or sum(math.prod(r.type.shape) for r in readers) > math.prod(m.type.shape):
        return False
    axis = readers[0].axis
    # (a gather that takes a prefix of a dim besides its axis would leave the other arguments too long there)
    if not all(r.type.shape[d] == s for r in readers for d, s in enumerate(m.type.shape) if d != axis):
        return False
    cut = [a for a in m.args if _cut_dim(g, m, a, axis) is not None]
    return bool(cut) and all(_in_memory(g, a) for a in cut)


def _table(g: ir.Graph, ed: Editor, out: list, a: str, rank: int, source: str) -> str:
    """What a kernel gathers argument a from: a at the map's rank (a gather's table has its
    result's rank), and a bool as f32 0.0 / 1.0 (read back as != 0: out of range, NaN, True)."""
    t = g[a].type
    if len(t.shape) < rank:
        full = (1,) * (rank - len(t.shape)) + t.shape
        t = ir.TensorType(full, t.dtype)
        v = ir.View(ed.fresh(f"{a}_ranked"), t, "reshape", a, full, source)
        out.append(v)
        a = v.name
    if t.dtype == "bool":
        c = ir.Map(ed.fresh(f"{a}_f32"), ir.TensorType(t.shape, "f32"), "cast", (a,), source)
        out.append(c)
        a = c.name
    return a


def gathers_through_maps(g: ir.Graph) -> ir.Graph:
    for _ in range(MAX_PASSES):
        users = g.users()
        moving = {n.name for n in g.nodes if _movable(g, n.name, users)}
        if not moving:
            return g
        ed, out, tables = Editor(g), [], {}
        for n in g.nodes:
            if not (isinstance(n, ir.Gather) and n.arg in moving):
                out.append(n)
                continue
            m = g[n.arg]
            args, parts = [], []
            for a in m.args:
                if _cut_dim(g, m, a, n.axis) is None:
                    args.append(a)
                    continue
                key = (a, len(m.type.shape))
                if key not in tables:  # (made once a pass, before the first gather that reads it)
                    tables[key] = _table(g, ed, out, a, len(m.type.shape), n.source)
                t = g[a].type if tables[key] == a else _made_type(out, tables[key])
                # the argument's own size where the index broadcasts, the index's where it does not
                shape = tuple(i if d == n.axis or s == 1 else s
                              for d, (s, i) in enumerate(zip(t.shape, g[n.index].type.shape)))
                part = ir.Gather(ed.fresh(f"{n.name}_{a}"), ir.TensorType(shape, t.dtype), tables[key], n.index,
                                 n.axis, n.source, n.wrap)
                nodes = [part]
                if g[a].type.dtype == "bool":
                    zero = ir.Constant(ed.fresh("c"), ir.TensorType((), "f32"), 0.0, n.source)
                    nodes += [zero, ir.Map(ed.fresh(f"{part.name}_set"), ir.TensorType(shape, "bool"), "ne",
                                           (part.name, zero.name), n.source)]
                parts.append((math.prod(shape), nodes))
                args.append(nodes[-1].name)
            # the largest gathers first: the kernel the planner opens at the first takes the rest
            for _, nodes in sorted(parts, key=lambda p: -p[0]):
                out += nodes
            out.append(ir.Map(n.name, n.type, m.op, tuple(args), m.source))
        g = ed.graph(out)
    return g  # (a gather MAX_PASSES maps up a chain reads the map there, written whole)


def _made_type(out: list, name: str) -> ir.TensorType:
    return next(x.type for x in reversed(out) if x.name == name)

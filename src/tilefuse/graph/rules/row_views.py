"""Elementwise maps moved above the reshape that separates them from a matmul's output.

GPT-2's Conv1D (and any `x.view(-1, K) @ W` then `.view(B, S, N)`) puts a reshape between the
matmul and what follows it: the activation after the MLP's first projection runs on
reshape(y), and the planner, which grows an epilogue from the matmul's own output, stops at
the view, so the activation became a map kernel reading and writing the whole [M, N] tensor
again. A reshape that keeps the last dimension only regroups rows, so a map of it is the
reshape of the map:

    m = op(reshape(y), c...)  →  m' = op(y, c...);  m = reshape(m')

for y a matmul's output or a map (so the chain moves up one map at a time), every other
argument a scalar, a vector of the last dimension, a reshape of a tensor of y's shape, or a
program input or weight of the same size and last dimension (reshaped too: a view of it is
free), and everything computed from m ending in matmuls or program outputs. Each pass moves
every map whose arguments qualify, and each move is toward the shape of a tensor computed
earlier, so the passes end.
The maps then sit where contraction.match takes them into the epilogue; what reads m reads
the view, which costs nothing.
"""
from __future__ import annotations

import math

from .. import ir
from .match import Editor


def _row_view_source(g: ir.Graph, name: str) -> str | None:
    """The tensor `name` reshapes, when it is a reshape of a matmul output or a map that keeps
    the last dimension and changes the shape; else None."""
    n = g[name]
    if not (isinstance(n, ir.View) and n.op == "reshape"):
        return None
    src = g[n.arg]
    if not isinstance(src, (ir.Contraction, ir.Map)) or src.type.shape == n.type.shape:
        return None
    if src.type.shape[-1:] != n.type.shape[-1:] or len(src.type.shape) < 2:
        return None
    return n.arg


def _hoisted(g: ir.Graph, n: ir.Map):
    """(source shape, args at it, the args to reshape to it) when n's full-size args are row
    reshapes of tensors of one shape, or program inputs or weights of n's last dimension to
    reshape the same way, at least one of them the first kind, and the rest broadcast from
    scalars or last-dimension vectors; else None."""
    shape, args, reshape, size = None, [], [], math.prod(n.type.shape)
    for a in n.args:
        t = g[a].type
        if math.prod(t.shape) == size and len(t.shape):
            src = _row_view_source(g, a)
            if src is not None and shape not in (None, g[src].type.shape):
                return None
            if src is not None:
                shape = g[src].type.shape
                args.append(src)
            elif not isinstance(g[a], (ir.Input, ir.Weight)) or t.shape[-1] != n.type.shape[-1]:
                return None  # (a reshape of a view may be a copy; a map's turn comes when it has moved)
            else:
                args.append(a)
                reshape.append(a)
        elif math.prod(t.shape) == 1 or (all(d == 1 for d in t.shape[:-1]) and t.shape[-1] == n.type.shape[-1]):
            args.append(a)  # (a scalar, or a vector along the last dimension: it broadcasts the same at either shape)
        else:
            return None
    if shape is None or any(len(g[a].type.shape) > len(shape) for a in args if a not in reshape):
        return None  # (a broadcast operand of higher rank than the rows would add a dimension)
    return shape, tuple(args), tuple(reshape)


def _ends_in_matmuls(g: ir.Graph, users) -> dict[str, bool]:
    """For each node: does everything computed from it (through maps and views) end in matmuls
    or program outputs? Where it reaches a reduction (a norm's statistics, a softmax) or an
    extern, a kernel reads the chain as it is there, and moving maps up would only make the
    matmul write more (f32 casts, say). One sweep from the outputs back (users come later in
    the node order), so a long chain costs no stack."""
    ends: dict[str, bool] = {}
    for n in reversed(g.nodes):
        ends[n.name] = all(isinstance(g[u], ir.Contraction) or (isinstance(g[u], (ir.Map, ir.View)) and ends[u])
                           for u in users[n.name])
    return ends


def maps_before_row_views(g: ir.Graph) -> ir.Graph:
    out = g
    for _ in range(len(g.nodes) + 1):  # (each pass moves a map up a level: at most one pass a node)
        ed, nodes, changed = Editor(out), [], False
        ends = _ends_in_matmuls(out, out.users())
        for n in out.nodes:
            h = (_hoisted(out, n) if isinstance(n, ir.Map) and ends[n.name]
                 else None)
            if h is None:
                nodes.append(n)
                continue
            shape, args, reshape = h
            views = {a: ir.View(ed.fresh(f"{a}_rows"), ir.TensorType(shape, out[a].type.dtype), "reshape", a, shape,
                                n.source) for a in dict.fromkeys(reshape)}
            nodes += views.values()
            args = tuple(views[a].name if a in views else a for a in args)
            m = ir.Map(ed.fresh(f"{n.name}_rows"), ir.TensorType(shape, n.type.dtype), n.op, args, n.source)
            nodes += [m, ir.View(n.name, n.type, "reshape", m.name, tuple(n.type.shape), n.source)]
            changed = True
        if not changed:
            return out
        out = ed.graph(nodes)
    return out

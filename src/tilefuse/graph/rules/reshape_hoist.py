"""A reshape that regroups the leading dims of a map's result, moved onto the map's arguments.

    reshape(op(a, v), [B, S, D])   ->   op(reshape(a, [B, S, D]), v)       (a of [T, D], v of [D])
    reshape(gather(t, 0, idx), [B, S, D])
                                   ->   gather(reshape(t, [N, 1, D]), 0, reshape(idx, [B, S, 1]))

A kernel's rows are its tensors' leading dims, each aligned with one dim of the kernel's row
space, so a reshape that splits or merges them (`out.view(T, D)` ... `.view(B, S, D)`) ends the
kernel: what comes before it is written, and the kernel after it reads it back. A mixture of
experts computes its combine over the tokens flattened ([T, D]) and hands it to the residual add
and the next norm as [B, S, D]: 2 x 8192 x 2048 bf16 written and read again each layer. Moved
onto the arguments, the combine is computed in the [B, S] rows of the kernel that adds and
normalises: a reshape of a tensor in memory is a free view, a row gather's reshape is the
gather at the reshaped index.

Taken where every reader of the map is such a reshape to one shape (the last dim is kept, the
leading ones only regrouped), the map is not a result and is not computed from a matmul's result
by maps and views (a GEMM's epilogue is matched on the maps after it; slice_sink.py says the
same), and each argument either broadcasts over all the leading dims (it stays as it is) or
has all of them (it is reshaped). A reshape of a reshape is one reshape; a reshape of a row
gather (one index a row, along dim 0) that splits its first dim is the gather at the reshaped
index, where the gather is read only by that reshape. Passes repeat until nothing moves.
"""
from __future__ import annotations

import math

from ... import dtypes
from .. import ir
from .match import MAX_PASSES, Editor
from .slice_sink import _from_contraction


def _regroups(shape: tuple, to: tuple) -> bool:
    """Whether a reshape from `shape` to `to` keeps the last dim and only regroups the others."""
    return (len(shape) >= 2 and len(to) >= 2 and shape[-1] == to[-1]
            and math.prod(shape[:-1]) == math.prod(to[:-1]) and shape != to)


_IN_MEMORY = (ir.Input, ir.Weight, ir.Extern, ir.Attention)


def _broadcast(g: ir.Graph, a: str, rank: int) -> bool:
    s = g[a].type.shape
    return all(d == 1 for d in ((1,) * (rank - len(s)) + s)[:-1])


def _row_gather(g: ir.Graph, n: ir.Gather) -> bool:
    """A gather along dim 0 of one index a row, its result [M, 1, ..., 1, C]: its rows are M."""
    ishape = g[n.index].type.shape
    return (n.axis == 0 and len(ishape) == len(n.type.shape) >= 2 and all(s == 1 for s in ishape[1:])
            and all(s == 1 for s in n.type.shape[1:-1]) and all(s == 1 for s in g[n.arg].type.shape[1:-1]))


def _closure(g: ir.Graph, name: str, users: dict, fed: set, top: bool = True) -> bool:
    """Whether the reshape moves all the way up from `name`: through maps, reshapes and row
    gathers each read only by the node below it, to tensors in memory (a free view there) or
    arguments that broadcast over the leading dims. Stopping short would leave a reshape of a
    value some kernel computes, which ends that kernel as the reshape below did (a norm's
    statistics under it would be written, and read back by a kernel of their own)."""
    todo, seen = [(name, top)], {name}
    while todo:  # (a stack: a chain deeper than the recursion limit; `seen`: maps reading x twice)
        name, top = todo.pop()
        n = g[name]
        if isinstance(n, _IN_MEMORY) or isinstance(n, ir.Constant):
            continue
        if not top and (len(users.get(name, [])) != 1 or name in g.outputs):
            return False
        if isinstance(n, ir.View):
            if n.op != "reshape":
                return False
            below = [n.arg]
        elif isinstance(n, ir.Gather):
            if not _row_gather(g, n):
                return False
            below = []
        elif isinstance(n, ir.Map):
            if _stored_widening(g, name):
                continue
            if name in fed:
                return False
            rank, lead, below = len(n.type.shape), n.type.shape[:-1], []
            for a in n.args:
                if _broadcast(g, a, rank):
                    continue
                s = g[a].type.shape
                if len(s) != rank or s[:-1] != lead:
                    return False
                below.append(a)
        else:
            return False
        for a in below:
            if a not in seen:
                seen.add(a)
                todo.append((a, False))
    return True


def _stored_widening(g: ir.Graph, name: str) -> bool:
    """A widening cast of a result the program returns, so it is in memory anyway: transformers'
    loss, `logits.float().view(-1, V)` beside the returned logits (a matmul's result, or its
    epilogue's). No epilogue wants the cast (contraction.match leaves a widening that maps read
    to its readers), and under the reshape it ended the loss kernel's rows: the f32 logits were
    written by a kernel of their own, twice the logits' bytes, and read back."""
    n = g[name]
    if not (isinstance(n, ir.Map) and n.op == "cast" and len(n.args) == 1):
        return False
    a = g[n.args[0]]
    return a.name in g.outputs and dtypes.itemsize(n.type.dtype) > dtypes.itemsize(a.type.dtype)


def _hoistable(g: ir.Graph, r: ir.View, users: dict, fed: set) -> str | None:
    """'map', 'view' or 'gather': what the reshape r moves onto, or None."""
    if not (isinstance(r, ir.View) and r.op == "reshape"):
        return None
    x = g[r.arg]
    if not _regroups(x.type.shape, r.type.shape) or r.arg in g.outputs:
        return None
    if isinstance(x, ir.View) and x.op == "reshape":
        return "view" if isinstance(g[x.arg], (ir.Map, ir.Gather, ir.View)) and _closure(g, x.arg, users, fed) else None
    readers = users.get(r.arg, [])
    if isinstance(x, ir.Gather):
        return "gather" if readers == [r.name] and _row_gather(g, x) else None
    if any(isinstance(g[v], ir.Gather) and g[v].arg == u for u in readers for v in users.get(u, [])):
        return None  # (a reshape of it is a gather's table: the map stays whole, in memory, for that)
    if not isinstance(x, ir.Map) or not readers or (r.arg in fed
                                                      and not _stored_widening(g, r.arg)):
        return None
    if not all(isinstance(g[u], ir.View) and g[u].op == "reshape" and g[u].type.shape == r.type.shape for u in readers):
        return None
    return "map" if _closure(g, r.arg, users, fed) else None


def leading_reshapes_into_maps(g: ir.Graph) -> ir.Graph:
    for _ in range(MAX_PASSES):
        users, fed = g.users(), _from_contraction(g)
        moves = {n.name: k for n in g.nodes if (k := _hoistable(g, n, users, fed)) is not None}
        if not moves:
            return g
        # a map read by several reshapes moves once, under the first; the others read that one
        first: dict[str, str] = {}
        for n in g.nodes:
            if moves.get(n.name) == "map":
                first.setdefault(n.arg, n.name)
        ed, out = Editor(g), []
        for n in g.nodes:
            kind = moves.get(n.name)
            if kind is None:
                out.append(n)
            elif kind == "view":
                out.append(ir.View(n.name, n.type, "reshape", g[n.arg].arg, n.type.shape, n.source))
            elif kind == "gather":
                out += _gather_at_reshaped_index(g, ed, n)
            elif first[n.arg] != n.name:
                out.append(ir.View(n.name, n.type, "reshape", first[n.arg], n.type.shape, n.source))
            else:
                out += _map_of_reshapes(g, ed, n)
        g = ed.graph(out)
    return g  # (a reshape MAX_PASSES maps up a chain stays there)


def _map_of_reshapes(g: ir.Graph, ed: Editor, r: ir.View) -> list:
    m = g[r.arg]
    lead, out, args = r.type.shape[:-1], [], []
    for a in m.args:
        t = g[a].type
        s = (1,) * (len(m.type.shape) - len(t.shape)) + t.shape
        if all(d == 1 for d in s[:-1]):
            if len(t.shape) <= len(r.type.shape):
                args.append(a)  # (broadcasts over the leading dims in either shape)
                continue
            to = (1,) * (len(r.type.shape) - 1) + (s[-1],)  # (fewer leading dims: no more than the map's)
            v = ir.View(ed.fresh(_as(a)), ir.TensorType(to, t.dtype), "reshape", a, to, r.source)
            out.append(v)
            args.append(v.name)
            continue
        to = lead + (s[-1],)
        v = ir.View(ed.fresh(_as(a)), ir.TensorType(to, t.dtype), "reshape", a, to, r.source)
        out.append(v)
        args.append(v.name)
    # the largest first: the planner opens a kernel at the first node of a row space, and one
    # of a mask's single column would take no other (gather_sink.py orders its gathers so too)
    out.sort(key=lambda v: -math.prod(v.type.shape))
    return out + [ir.Map(r.name, r.type, m.op, tuple(args), m.source)]


def _gather_at_reshaped_index(g: ir.Graph, ed: Editor, r: ir.View) -> list:
    x = g[r.arg]
    t, i = g[x.arg], g[x.index]
    lead = r.type.shape[:-1]
    tshape = (t.type.shape[0],) + (1,) * (len(lead) - 1) + t.type.shape[-1:]
    ishape = lead + (1,)
    table = ir.View(ed.fresh(_as(x.arg)), ir.TensorType(tshape, t.type.dtype), "reshape", x.arg, tshape, r.source)
    index = ir.View(ed.fresh(_as(x.index)), ir.TensorType(ishape, i.type.dtype), "reshape", x.index, ishape, r.source)
    return [table, index, ir.Gather(r.name, r.type, table.name, index.name, 0, x.source, x.wrap)]


def _as(name: str) -> str:
    """x_as for x's reshape (x_as_1, ... for a reshape of a reshape, not x_as_as)."""
    return name if name.endswith("_as") else f"{name}_as"

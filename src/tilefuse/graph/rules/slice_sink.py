"""Slices of an elementwise map's result along its last dim, moved onto the map's arguments.

    slice(op(a, c), -1, i, j)   ->   op(slice(a, -1, i, j), c)      (c broadcast along that dim)

A mixture of experts masks its grouped matmul's output (`where(valid, gate_up, 0)` in
transformers 5.17) and then splits it into gate and up halves for SwiGLU: the masked product
was a kernel of its own, 16384 x 11264 bf16 written and read back (175 us a layer on an H200),
because a kernel reads another's result through a view only from memory. Moved onto the
arguments, each half is the map of a slice the SwiGLU kernel reads in place, and the map runs
in that kernel.

Taken where every reader of the map is such a slice, of step 1 (the map's result then is not
needed whole; overlapping slices compute the overlap twice, with no memory traffic added), the
map is not a result, nothing it is computed from by maps and views is a matmul's result (a
GEMM's epilogue is matched on the maps after it: its row scale, its SwiGLU or RoPE on
interleaved columns read as even and odd slices, its partial row sums; moved slices split it),
and each argument the slice would cut is a tensor in memory, not a generated one (a constant or
an iota of more than one element, which the planner reads through no view: permute_sink.py
says the same). Slices along the last dim only: rows stay rows. Each pass moves the slices one
map up; passes repeat until none moves, at most MAX_PASSES of them.
"""
from __future__ import annotations

from .. import ir
from .match import MAX_PASSES, Editor


def _last_dim_slice(g: ir.Graph, name: str) -> bool:
    n = g[name]
    return (isinstance(n, ir.View) and n.op == "slice" and len(n.type.shape) >= 1
            and n.params[0] % len(n.type.shape) == len(n.type.shape) - 1)


def _cut(g: ir.Graph, a: str) -> bool:
    """Whether a slice along a map's last dim cuts argument `a` (its shapes align from the
    right: a's last dim is the map's); else a broadcasts along it and stays as it is."""
    t = g[a].type
    return bool(t.shape) and t.shape[-1] != 1


def _generated(g: ir.Graph, a: str) -> bool:
    """Whether `a` is an iota, a constant, or maps of those alone."""
    def below(x):
        return g[x].args if isinstance(g[x], ir.Map) else ()

    return all(isinstance(g[x], (ir.Iota, ir.Constant, ir.Map)) for x in ir.reached(a, below))


def _from_contraction(g: ir.Graph) -> set[str]:
    """The tensors computed by maps and views from a matmul's result: a GEMM's epilogue (its
    row scale, its pairwise SwiGLU or RoPE on interleaved columns, its partial row sums) is
    matched on the maps after it, which a slice moved above them would split. One sweep in the
    graph's order (each node after its arguments)."""
    fed = set()
    for n in g.nodes:
        if isinstance(n, ir.Contraction) or (
                isinstance(n, (ir.Map, ir.View)) and any(a in fed for a in ir.node_args(n))):
            fed.add(n.name)
    return fed


def _sinkable(g: ir.Graph, m: str, users: dict, fed: set) -> bool:
    n = g[m]
    if not isinstance(n, ir.Map) or m in g.outputs or not users.get(m):
        return False
    if not all(_last_dim_slice(g, u) and g[u].params[3] == 1 for u in users[m]):
        return False
    if m in fed:
        return False
    return all(not _cut(g, a) or not _generated(g, a) for a in n.args)


def _same_slices(g: ir.Graph) -> dict[str, str]:
    """Each last-dim slice of a map that repeats an earlier one (same map, same bounds) -> that
    one. `x * x` sliced becomes `slice(x) * slice(x)`: without this the two would become two
    copies of all that x is made of, a chain of such maps 2^depth nodes."""
    first, alias = {}, {}
    for n in g.nodes:
        if _last_dim_slice(g, n.name) and isinstance(g[n.arg], ir.Map) and n.name not in g.outputs:
            key = (n.arg, n.params, n.type)
            alias.update({n.name: first[key]} if key in first else {})
            first.setdefault(key, n.name)
    return alias


def slices_into_maps(g: ir.Graph) -> ir.Graph:
    from ..rewrites import substitute

    for _ in range(MAX_PASSES):
        same = _same_slices(g)
        g = substitute(g, same) if same else g
        users, fed = g.users(), _from_contraction(g)
        moving = {m for m in (n.name for n in g.nodes) if _sinkable(g, m, users, fed)}
        if not moving:
            return g
        ed = Editor(g)
        out = []
        for n in g.nodes:
            if n.name in moving:
                continue  # (its slices become maps of sliced arguments below)
            if isinstance(n, ir.View) and n.arg in moving:
                m = g[n.arg]
                _, start, end, step = n.params
                args = []
                for a in m.args:
                    if _cut(g, a):
                        t = g[a].type
                        s = ir.View(ed.fresh(f"{a}_cut"), ir.TensorType(t.shape[:-1] + (n.type.shape[-1],), t.dtype),
                                    "slice", a, (len(t.shape) - 1, start, end, step), n.source)
                        out.append(s)
                        a = s.name
                    args.append(a)
                out.append(ir.Map(n.name, n.type, m.op, tuple(args), m.source))
                continue
            out.append(n)
        g = ed.graph(out)
    return g  # (slices MAX_PASSES maps up a chain read the map there, written whole)

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
map up; passes repeat until none moves.
"""
from __future__ import annotations

from .. import ir
from .match import Editor


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
    n = g[a]
    return isinstance(n, (ir.Iota, ir.Constant)) or (isinstance(n, ir.Map) and all(
        _generated(g, x) for x in n.args))


def _from_contraction(g: ir.Graph, a: str, memo: dict) -> bool:
    """Whether `a` is computed by maps and views from a matmul's result: a GEMM's epilogue (its
    row scale, its pairwise SwiGLU or RoPE on interleaved columns, its partial row sums) is
    matched on the maps after it, which a slice moved above them would split."""
    if a not in memo:
        n = g[a]
        memo[a] = False  # (cut cycles; the graph has none)
        memo[a] = isinstance(n, ir.Contraction) or (
            isinstance(n, (ir.Map, ir.View)) and any(_from_contraction(g, x, memo) for x in ir.node_args(n)))
    return memo[a]


def _sinkable(g: ir.Graph, m: str, users: dict, memo: dict) -> bool:
    n = g[m]
    if not isinstance(n, ir.Map) or m in g.outputs or not users.get(m):
        return False
    if not all(_last_dim_slice(g, u) and g[u].params[3] == 1 for u in users[m]):
        return False
    if _from_contraction(g, m, memo):
        return False
    return all(not _cut(g, a) or not _generated(g, a) for a in n.args)


def slices_into_maps(g: ir.Graph) -> ir.Graph:
    while True:
        users, memo = g.users(), {}
        moving = {m for m in (n.name for n in g.nodes) if _sinkable(g, m, users, memo)}
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

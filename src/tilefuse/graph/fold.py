"""Fold what depends on weights alone into new weights, once, when compiling.

A module's forward often casts, transposes or scales its parameters (`bias.to(x.dtype)`,
`W.t()` for an extern matmul, `scale * W`): work that would otherwise run on every call. Each
Map or View whose arguments are all weights (or scalar constants, or values folded already)
is evaluated here by the graph interpreter and becomes a Weight holding its value.

Two things are left alone: a transpose that generated GEMMs read through (they read the
stored matrix as a K-major B, so folding it would only copy the weight), and anything whose
value is larger than its largest argument (an expand would trade a free broadcast for memory).
"""
from __future__ import annotations

import numpy as np

from ..tensors import to_numpy, to_torch
from . import ir
from .contraction import why_not
from .interp import eval_map, eval_view
from .rules.match import prune


def _read_through(g: ir.Graph, users, n) -> bool:
    """Is n a transpose that every user reads as the B of a generated GEMM?"""
    if not (isinstance(n, ir.View) and n.op == "permute") or not users[n.name]:
        return False
    return all(isinstance(g[u], ir.Contraction) and g[u].b == n.name and why_not(g, g[u]) is None
               for u in users[n.name])


def fold_weights(g: ir.Graph) -> ir.Graph:
    users = g.users()
    values: dict[str, np.ndarray] = {}
    weighty: set[str] = set()  # names whose value is known here and that depend on a weight
    nodes, changed = [], False
    for n in g.nodes:
        if isinstance(n, ir.Weight):
            weighty.add(n.name)
        foldable = isinstance(n, (ir.Map, ir.View)) and not _read_through(g, users, n)
        args = ir.node_args(n) if foldable else ()
        if foldable and all(a in weighty or isinstance(g[a], ir.Constant) for a in args) \
                and any(a in weighty for a in args) and n.name not in g.outputs:
            if n.type.numel <= max(g[a].type.numel for a in args):
                vals = [_value(g, a, values) for a in args]
                out = eval_map(n, vals) if isinstance(n, ir.Map) else eval_view(n, vals[0])
                values[n.name] = np.asarray(out)
                weighty.add(n.name)
                nodes.append(ir.Weight(n.name, n.type, f"{n.describe()}, folded at compile time"))
                changed = True
                continue
        nodes.append(n)
    if not changed:
        return g
    weights = dict(g.weights)
    for name, v in values.items():
        weights[name] = to_torch(v.reshape(g[name].type.shape))
    return prune(ir.Graph(tuple(nodes), g.inputs, g.outputs, weights))


def _value(g: ir.Graph, name: str, values: dict) -> np.ndarray:
    if name not in values:
        n = g[name]
        values[name] = np.asarray(n.value) if isinstance(n, ir.Constant) else to_numpy(g.weights[name])
    return values[name]

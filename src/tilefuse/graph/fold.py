"""Fold what depends on weights and constants alone into new weights, once, when compiling.

A module's forward often casts, transposes or scales its parameters (`bias.to(x.dtype)`,
`W.t()` for an extern matmul, `scale * W`), or builds tables from sizes alone (rotary
cos/sin from `arange` and a frequency buffer, a causal mask from `ones` and `cumsum`): work
that would otherwise run on every call. Each such node is evaluated here by the graph
interpreter and becomes a Weight holding its value:

- a PyTorch extern whose tensor arguments are all known (it is one op less per call, and
  what follows it may fold too), unless it draws random numbers or reads uninitialised memory
  (`new_ones(x, ...)` and the like need only x's shape and dtype, so x need not be known);
- a map, view, reduction or gather of known values of which at least one came from a weight or
  an extern (maps of constants and indices alone stay: kernels generate those in registers);
- a contraction of such values, of any size (older transformers compute the rotary angles as
  inv_freq @ positions: a matmul per call, and the RoPE rules need the tables as weights).

Left alone: transposes that generated GEMMs read through (they read the stored matrix as a
K-major B, so folding would only copy the weight) and that torch._grouped_mm reads as a
column-major B, as eager passes it (a mixture of experts' weights), results larger than their largest argument
beyond GROW_MAX_BYTES (an expand would trade a free broadcast for memory) or larger than
FOLD_MAX_BYTES, and outputs.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes
from ..tensors import to_numpy, to_torch
from . import ir
from .contraction import why_not
from .fusion import grouped_mm_b
from .interp import (_extern, _gather, constant_value, eval_contraction, eval_map, eval_reduce, eval_scan, eval_view,
                     iota_value)
from .rules.match import prune

FOLD_MAX_BYTES = 256 << 20  # no folded value larger than this
GROW_MAX_BYTES = 1 << 20    # a value larger than its arguments (an expand) folds only up to this
# words in an aten op's name whose runs give other values each time (random draws; `empty`'s
# memory): never folded, and never run twice for two of one call's results (frontend.capture)
RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential",
                "geometric", "cauchy", "empty")


def _read_through(g: ir.Graph, users, n) -> bool:
    """Is n a transpose that every user reads where it lies: as the B of a generated GEMM, or as
    the B of torch._grouped_mm (fusion.grouped_mm_b)?"""
    if not (isinstance(n, ir.View) and n.op == "permute") or not users[n.name]:
        return False
    return grouped_mm_b(g, users, n.name) or all(
        isinstance(g[u], ir.Contraction) and g[u].b == n.name and why_not(g, g[u]) is None for u in users[n.name])


_SHAPE_ONLY = {"new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like"}


def _op(n: ir.Extern) -> str:
    parts = n.target.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def leaf_value(g: ir.Graph, n) -> np.ndarray | None:
    """The value of a weight, constant or index node; None for any other node."""
    if isinstance(n, ir.Weight):
        w = g.weights[n.name]
        return w if isinstance(w, np.ndarray) else to_numpy(w)
    if isinstance(n, ir.Constant):
        return constant_value(n)  # of its dtype: a Python int is no i64 where the Constant is u8
    if isinstance(n, ir.Iota):
        return iota_value(n)
    return None


def _deterministic(n: ir.Extern) -> bool:
    return not any(word in _op(n) for word in RANDOM_WORDS)


class _Values:
    """Known values by name: weights, constants, indices, folded nodes. A weight is read (a
    copy from the GPU, for a model's weights) only when a fold reads it: most never are, and
    reading every one at each compile cost a 4-layer Llama 0.15 s a size on an H100, a 7B
    model 14 GB of copies."""

    def __init__(self, g: ir.Graph):
        self.g, self.known, self.weights = g, {}, set()

    def __contains__(self, name) -> bool:
        return name in self.known or name in self.weights

    def __getitem__(self, name) -> np.ndarray:
        if name not in self.known and name in self.weights:
            self.known[name] = leaf_value(self.g, self.g[name])
        return self.known[name]

    def __setitem__(self, name, value) -> None:
        self.known[name] = value


def fold_weights(g: ir.Graph) -> ir.Graph:
    users = g.users()
    values = _Values(g)
    weighty: set[str] = set()           # known values worth keeping in memory (from weights or externs)
    folded: set[str] = set()
    nodes = []
    for n in g.nodes:
        if isinstance(n, ir.Weight):
            values.weights.add(n.name)
            weighty.add(n.name)
        else:
            leaf = leaf_value(g, n)
            if leaf is not None:
                values[n.name] = leaf
        value = _fold(g, users, n, values, weighty)
        if value is None:
            nodes.append(n)
            known = _known(g, n, values, weighty)  # a constant not worth a weight, but an extern may need it
            if known is not None:
                values[n.name] = _of_type(known, n)
            continue
        values[n.name] = _of_type(value, n)
        weighty.add(n.name)
        folded.add(n.name)
        nodes.append(ir.Weight(n.name, n.type, f"{n.describe()}, folded at compile time"))
    if not folded:
        return g
    weights = dict(g.weights)
    for name in folded:
        weights[name] = to_torch(np.ascontiguousarray(values[name]).reshape(g[name].type.shape))
    return prune(ir.Graph(tuple(nodes), g.inputs, g.outputs, weights, g.writes, g.layouts))


def _of_type(value, n) -> np.ndarray:
    """A folded value as its node's dtype (an extern run on NumPy values may widen it)."""
    return np.asarray(value).astype(dtypes.to_numpy(n.type.dtype), copy=False)


def _fold(g: ir.Graph, users, n, values: _Values, weighty: set) -> np.ndarray | None:
    """n's value when it folds, else None."""
    if n.name in g.outputs or n.type.nbytes > FOLD_MAX_BYTES:
        return None
    if isinstance(n, ir.Extern):
        refs = [a.name for a in _refs((n.args, n.kwargs))]
        if not _deterministic(n):
            return None
        env = values
        if _op(n) in _SHAPE_ONLY:  # only the argument's shape and dtype matter, not its values
            env = {r: values[r] if r in values else np.zeros(g[r].type.shape, dtypes.to_numpy(g[r].type.dtype))
                   for r in refs}
        if not all(r in env for r in refs):
            return None
        return np.asarray(_extern(n, env, "native"))
    if isinstance(n, ir.Contraction):  # known operands (transformers' rotary angles, inv_freq @ positions)
        known = n.a in values and n.b in values and (n.a in weighty or n.b in weighty)
        return evaluate(n, [values[n.a], values[n.b]]) if known else None
    if not isinstance(n, (ir.Map, ir.View, ir.Reduce, ir.Scan, ir.Gather)) or _read_through(g, users, n):
        return None
    args = ir.node_args(n)
    if not args or not all(a in values for a in args) or not any(a in weighty for a in args):
        return None
    if n.type.numel > max(g[a].type.numel for a in args) and n.type.nbytes > GROW_MAX_BYTES:
        return None
    return evaluate(n, [values[a] for a in args])


def _known(g: ir.Graph, n, values: _Values, weighty: set) -> np.ndarray | None:
    """The value of a map or view of known values (indices and constants), kept aside. Not of a
    weight's: `_fold` left that one alone (a transpose generated GEMMs read through, an
    output), and reading it would copy the weight for nothing."""
    if not isinstance(n, (ir.Map, ir.View)) or n.type.nbytes > GROW_MAX_BYTES:
        return None
    args = ir.node_args(n)
    if not all(a in values and a not in weighty for a in args):
        return None
    return evaluate(n, [values[a] for a in args])


def evaluate(n, vals: list) -> np.ndarray:
    """A map, view, reduction, scan, gather or contraction on its arguments' values, by the graph
    interpreter."""
    if isinstance(n, ir.Contraction):
        return np.asarray(eval_contraction(n, vals[0], vals[1]))
    if isinstance(n, ir.Map):
        return np.asarray(eval_map(n, vals))
    if isinstance(n, ir.View):
        return np.asarray(eval_view(n, vals[0]))
    if isinstance(n, ir.Reduce):
        return np.asarray(eval_reduce(n, vals[0]))
    if isinstance(n, ir.Scan):
        return np.asarray(eval_scan(n, vals[0]))
    return np.asarray(_gather(n, vals[0], vals[1]))


def _refs(x):
    if isinstance(x, ir.Ref):
        yield x
    elif isinstance(x, tuple):
        for y in x:
            yield from _refs(y)

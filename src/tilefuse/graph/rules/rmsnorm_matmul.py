"""RMSNorm before a matmul: RMSNorm(x) @ W = r ⊙ (x @ (γ ⊙ W)), r = rsqrt(mean(x²) + ε) per row.

CODA's reparameterisation. γ folds into the weight once, here, at compile time; the matmul
reads x itself, so the normalised tensor is never written; r becomes a row scale applied to
the fp32 accumulator (the matmul's epilogue). mean(x²) stays a row reduction of x: the
planner may compute it as a partial sum in the epilogue of whatever produced x.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import dtypes
from .. import ir
from .match import (Editor, exact_product, low_precision, peel_casts, rewrite_contractions, row_vector, split_pair,
                    value, weight_operand)


@dataclass(frozen=True)
class RMSNormMatch:
    x: str  # the tensor being normalised (under its casts)
    r: str  # rsqrt(mean(x²) + ε), per row, keepdim
    gamma: str | None  # a weight along the last dim, or None (no affine)


def rsqrt_mean_square(g: ir.Graph, r: str) -> str | None:
    """x when r = rsqrt(mean(x·x over the last axis, keepdim) + ε) (x under casts), else None."""
    n = g[r]
    if not (isinstance(n, ir.Map) and n.op == "rsqrt"):
        return None
    pair = split_pair(g, n.args[0], "add", lambda a: isinstance(g[a], ir.Constant))
    if pair is None:
        return None
    ms = g[pair[1]]
    if not (isinstance(ms, ir.Reduce) and ms.op == "mean" and ms.keepdim):
        return None
    sq = g[ms.arg]
    rank = len(sq.type.shape)
    if ms.axes != (rank - 1,) or not (isinstance(sq, ir.Map) and sq.op == "mul" and sq.args[0] == sq.args[1]):
        return None
    return peel_casts(g, sq.args[0])


def match(g: ir.Graph, z: str) -> RMSNormMatch | None:
    """z = [cast](γ ⊙ [cast](x ⊙ r)) or [cast](x ⊙ r), with r over x's own rows."""
    shape = g[z].type.shape
    if not shape:
        return None
    p = peel_casts(g, z)
    gamma = None
    pair = split_pair(g, p, "mul", lambda a: row_vector(g, a, shape[-1]))
    if pair is not None:
        gamma, p = pair[0], peel_casts(g, pair[1])
    pair = split_pair(g, p, "mul", lambda a: rsqrt_mean_square(g, a) is not None)
    if pair is None:
        return None
    r, xs = pair
    x = peel_casts(g, xs)
    if rsqrt_mean_square(g, r) != x or g[x].type.shape != shape:
        return None
    return RMSNormMatch(x, r, gamma)


def normalised_operand(g: ir.Graph, a: str):
    """(z, shape) for a contraction operand that is z, or a reshape of z keeping the last dim."""
    n = g[a]
    if isinstance(n, ir.View) and n.op == "reshape" and n.type.shape[-1:] == g[n.arg].type.shape[-1:]:
        return n.arg, n.type.shape
    return a, n.type.shape


def norm_feeding(g: ir.Graph, n: ir.Contraction, match):
    """(the norm `match` finds in n's left operand, n's weight operand, that operand's shape)
    when n multiplies a norm's output (or a row reshape of it) by a weight of matching K; else None."""
    z, a_shape = normalised_operand(g, n.a)
    m = match(g, z)
    wb = weight_operand(g, n.b)
    if m is None or wb is None or len(a_shape) < 2 or g[n.b].type.shape[0] != a_shape[-1]:
        return None
    if read_beside_contractions(g, z):
        return None
    return m, wb, a_shape


_USERS: list = [None, None]  # (the graph, its users): one graph's contractions are rewritten in a row


def read_beside_contractions(g: ir.Graph, z: str) -> bool:
    """Whether the norm's output z is read by more than contractions (through row reshapes):
    a post-norm model's residual (BERT adds it after attention and after the MLP). The norm
    kernel then writes z anyway, and the plain GEMM on it is cheaper than the fold, whose
    epilogue applies the row scale and the rank-1 correction for nothing saved (BERT, H200, a
    profile with programmatic launch on: the folded q, k and v GEMMs at 533 TFLOP/s against 687
    for the plain ones beside them; not yet measured without it)."""
    if _USERS[0] is not g:
        _USERS[:] = [g, g.users()]
    users = _USERS[1]
    todo, seen = [z], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in g.outputs:
            return True
        for u in users[x]:
            n = g[u]
            if isinstance(n, ir.View) and n.op == "reshape" and n.type.shape[-1:] == g[x].type.shape[-1:]:
                todo.append(u)
            elif not (isinstance(n, ir.Contraction) and n.a == x):
                return True
    return False


def rmsnorm_into_matmul(g: ir.Graph) -> ir.Graph:
    """Every contraction of an RMSNorm output with a weight: fold γ, scale rows after."""
    return rewrite_contractions(g, _rewrite)


def _rewrite(g: ir.Graph, ed: Editor, n: ir.Contraction):
    found = norm_feeding(g, n, match)
    if found is None:
        return None
    m, wb, a_shape = found
    src, a_dtype = n.source, g[n.a].type.dtype
    nodes = []
    x = m.x
    if g[x].type.dtype != a_dtype:
        x = _add(nodes, ir.Map(ed.fresh(f"{x}_{a_dtype}"), ir.TensorType(g[x].type.shape, a_dtype), "cast", (x,), src))
    if g[m.x].type.shape != a_shape:  # (x may be the cast just made: its shape is m.x's)
        x = _add(nodes, ir.View(ed.fresh(f"{x}_rows"), ir.TensorType(a_shape, a_dtype), "reshape", x, a_shape, src))
    r = m.r
    r_shape = tuple(a_shape[:-1]) + (1,)
    if g[r].type.shape != r_shape:
        r = _add(nodes, ir.View(ed.fresh(f"{r}_rows"), ir.TensorType(r_shape, g[r].type.dtype), "reshape", r,
                                r_shape, src))
    note = g[wb.weight].source or wb.weight
    if m.gamma is not None:
        gamma = value(g, peel_casts(g, m.gamma))
        w = exact_product(wb.matrix(g, exact=True), gamma.reshape(-1, 1),
                          round_to=dtypes.to_torch(g[wb.weight].type.dtype))
        note = f"{note} with RMSNorm weight {g[peel_casts(g, m.gamma)].source or m.gamma} folded in"
    else:
        w = wb.matrix(g, exact=True)
    wnodes, b = ed.operand(f"{wb.weight}_rms", w, wb, g[wb.weight].type.dtype, note, src)
    nodes.extend(wnodes)
    acc_dtype = "f32" if low_precision(n.type.dtype) else n.type.dtype
    acc = _add(nodes, ir.Contraction(ed.fresh(f"{n.name}_acc"), ir.TensorType(n.type.shape, acc_dtype), x, b, src))
    nodes.append(ir.Map(n.name, n.type, "mul", (acc, r), src))
    return nodes


def _add(nodes: list, node) -> str:
    nodes.append(node)
    return node.name

"""LayerNorm before a matmul, as a matmul of x plus a row scale and a rank-1 correction.

With x̂ = (x − μ)·s, s = rsqrt(var + ε), and W' = γ ⊙ W (γ folded into the rows of W):

    LayerNorm(x) @ W = s ⊙ (x @ W') − (s·μ) ⊗ (1ᵀW') + βᵀW

1ᵀW' (the column sums of W') and βᵀW are vectors computed once, here. μ and
var = mean(x²) − μ² come from two row sums of x (Σx, Σx²), which the planner may compute as
partial sums in the epilogue of whatever produced x. That one-pass variance loses digits when
|μ| is large against the spread of the row (it is clamped at 0); transformer activations
feeding a LayerNorm are far from that regime.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import dtypes
from .. import ir
from .match import (Editor, low_precision, peel_casts, rewrite_contractions, row_vector, split_pair, value)
from .rmsnorm_matmul import _add, norm_feeding


@dataclass(frozen=True)
class LayerNormMatch:
    x: str  # the tensor being normalised (under its casts)
    xf: str  # x as the norm computes it (its cast to f32, or x)
    mean: str  # mean(xf), per row, keepdim
    eps: str  # the ε constant
    gamma: str | None
    beta: str | None


def _row_mean(g: ir.Graph, name: str) -> str | None:
    """arg of a keepdim mean over the last axis, else None."""
    n = g[name]
    if isinstance(n, ir.Reduce) and n.op == "mean" and n.keepdim and n.axes == (len(n.type.shape) - 1,):
        return n.arg
    return None


def match(g: ir.Graph, z: str) -> LayerNormMatch | None:
    """z = [cast]([γ ⊙] ((xf − mean(xf)) ⊙ rsqrt(mean(d·d) + ε)) [+ β]), d = xf − mean(xf)."""
    shape = g[z].type.shape
    if not shape:
        return None
    width = shape[-1]
    p = peel_casts(g, z)
    beta = gamma = None
    pair = split_pair(g, p, "add", lambda a: row_vector(g, a, width))
    if pair is not None:
        beta, p = pair[0], peel_casts(g, pair[1])
    pair = split_pair(g, p, "mul", lambda a: row_vector(g, a, width))
    if pair is not None:
        gamma, p = pair[0], peel_casts(g, pair[1])
    pair = split_pair(g, p, "mul", lambda a: _centred(g, a) is not None)
    if pair is None:
        return None
    d, s = pair
    xf, mean = _centred(g, d)
    rs = g[s]
    if not (isinstance(rs, ir.Map) and rs.op == "rsqrt"):
        return None
    eps_var = split_pair(g, rs.args[0], "add", lambda a: isinstance(g[a], ir.Constant))
    if eps_var is None:
        return None
    sq = _row_mean(g, eps_var[1])
    # (x − μ)² from the same difference, or from one computed again (Cohere's LayerNorm writes
    # `x - mean` twice, and nothing merges the two)
    if sq is None or not (isinstance(g[sq], ir.Map) and g[sq].op == "mul"
                          and all(_centred(g, a) == (xf, mean) for a in g[sq].args)):
        return None
    if g[xf].type.shape != shape:
        return None
    return LayerNormMatch(peel_casts(g, xf), xf, mean, eps_var[0], gamma, beta)


def _centred(g: ir.Graph, d: str):
    """(xf, mean) for d = xf − mean(xf), else None."""
    n = g[d]
    if isinstance(n, ir.Map) and n.op == "sub" and _row_mean(g, n.args[1]) == n.args[0]:
        return n.args[0], n.args[1]
    return None


def layernorm_into_matmul(g: ir.Graph, any_dtype: bool = False) -> ir.Graph:
    """Every contraction of a LayerNorm output with a weight: fold γ and β, correct per row.
    The row statistics are made once per norm, for all the contractions it feeds.

    Only for 16-bit matmuls (a generated GEMM, whose epilogue takes the correction) unless
    `any_dtype`: an f32 or f64 matmul runs in PyTorch, so nothing is saved, and the one-pass
    variance would cost digits the input has (f32 rows of mean 1e3 and spread 1 lost 3 of them)."""
    stats: dict = {}
    return rewrite_contractions(g, lambda g, ed, n: _rewrite(g, ed, n, stats, any_dtype))


def _rewrite(g: ir.Graph, ed: Editor, n: ir.Contraction, stats: dict, any_dtype: bool):
    if not any_dtype and not low_precision(g[n.a].type.dtype):
        return None
    found = norm_feeding(g, n, match)
    if found is None:
        return None
    m, wb, a_shape = found
    src, a_dtype = n.source, g[n.a].type.dtype
    nodes = []

    def new(base, shape, dtype, op, *args):
        return _add(nodes, ir.Map(ed.fresh(base), ir.TensorType(shape, dtype), op, args, src))

    key = (m.xf, m.mean, m.eps)
    if key not in stats:  # (an earlier contraction's nodes, before this one's: the rewrite goes in graph order)
        stats[key] = _statistics(g, ed, m, new, nodes, src)
    rstd, shift = stats[key]
    stat = g[m.mean].type.dtype
    r_shape = tuple(a_shape[:-1]) + (1,)
    if g[m.mean].type.shape != r_shape:  # (as rows of this matmul's left operand)
        rstd, shift = (_add(nodes, ir.View(ed.fresh(f"{v}_rows"), ir.TensorType(r_shape, stat), "reshape", v, r_shape,
                                           src)) for v in (rstd, shift))
    # the matmul of x itself with W' = γ ⊙ W, and the two column vectors
    x = m.x
    if g[x].type.dtype != a_dtype:
        x = new(f"{x}_{a_dtype}", g[x].type.shape, a_dtype, "cast", x)
    if g[m.x].type.shape != a_shape:  # (x may be the cast just made: its shape is m.x's)
        x = _add(nodes, ir.View(ed.fresh(f"{x}_rows"), ir.TensorType(a_shape, a_dtype), "reshape", x, a_shape, src))
    w = wb.matrix(g)
    note = g[wb.weight].source or wb.weight
    wg = w
    if m.gamma is not None:
        wg = w * value(g, peel_casts(g, m.gamma)).double().reshape(-1, 1)
        note = f"{note} with LayerNorm weight folded in"
    wnodes, b = ed.operand(f"{wb.weight}_ln", wg, wb, g[wb.weight].type.dtype, note, src)
    nodes.extend(wnodes)
    # the column sums of W' as stored (rounded), so that x's mean cancels exactly against x @ W'
    stored = wg.to(dtypes.to_torch(g[wb.weight].type.dtype)).double()
    colsum = ed.weight(f"{wb.weight}_colsum", stored.sum(0), stat, f"column sums of {note}")
    nodes.append(colsum)
    acc_dtype = "f32" if low_precision(n.type.dtype) else n.type.dtype
    out_shape = n.type.shape
    acc = _add(nodes, ir.Contraction(ed.fresh(f"{n.name}_acc"), ir.TensorType(out_shape, acc_dtype), x, b, src))
    y = new(f"{n.name}_scaled", out_shape, acc_dtype, "mul", acc, rstd)
    last = ("sub", y, new(f"{n.name}_rank1", out_shape, acc_dtype, "mul", shift, colsum.name))
    if m.beta is not None:
        bias = ed.weight(f"{wb.weight}_beta", value(g, peel_casts(g, m.beta)).double().reshape(-1) @ w, stat,
                         f"LayerNorm bias through {g[wb.weight].source or wb.weight}")
        nodes.append(bias)
        y = new(f"{n.name}_centred", out_shape, acc_dtype, *last)
        last = ("add", y, bias.name)
    nodes.append(ir.Map(n.name, n.type, last[0], last[1:], src))
    return nodes


def _statistics(g: ir.Graph, ed: Editor, m: LayerNormMatch, new, nodes, src) -> tuple[str, str]:
    """(s, s·μ) per row of x, from Σx and Σx²: the mean (reused) and var = mean(x²) − mean²,
    clamped at 0."""
    stat = g[m.mean].type.dtype  # the norm's own compute type (f32 for bf16 inputs)
    row_shape = g[m.mean].type.shape
    sq = new(f"{m.x}_sq", g[m.xf].type.shape, stat, "mul", m.xf, m.xf)
    msq = _add(nodes, ir.Reduce(ed.fresh(f"{m.x}_msq"), ir.TensorType(row_shape, stat), "mean", sq,
                                (len(row_shape) - 1,), True, src))
    var = new(f"{m.x}_var", row_shape, stat, "sub", msq, new(f"{m.x}_mean2", row_shape, stat, "mul", m.mean, m.mean))
    zero = _add(nodes, ir.Constant(ed.fresh("zero"), ir.TensorType((), stat), 0.0, src))
    var = new(f"{m.x}_var0", row_shape, stat, "max", var, zero)
    rstd = new(f"{m.x}_rstd", row_shape, stat, "rsqrt", new(f"{m.x}_vareps", row_shape, stat, "add", var, m.eps))
    shift = new(f"{m.x}_shift", row_shape, stat, "mul", rstd, m.mean)  # s·μ
    return rstd, shift

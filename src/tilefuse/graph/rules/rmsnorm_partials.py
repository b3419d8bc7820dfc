"""RMSNorm's sum of squares as partials in the epilogue of the GEMM that wrote x.

After rmsnorm_into_matmul, an RMSNorm before matmuls is r = rsqrt(mean(x·x) + ε), a row
reduction of x, and row scales in those matmuls' epilogues: a kernel still reads all of x
only to reduce it. x is most often a GEMM's output with its residual added (the O and down
projections), and that GEMM holds every element of x in registers: it reduces x·x per group of
W columns there, beside its store of x, and the row kernel then reads T = N / W values a row:

    ms = mean(q, last, keepdim),  q = x'·x'  (x' = x under casts)
 →  q3 = reshape(q, [M, T, W]);  psq[m, t] = sum_c q3;  ms = reshape(sum_t psq / N, ms's shape)

The planner (contraction.match, through `sum_partials_after`) puts q, q3 and psq in the
producing GEMM's epilogue: codegen/epilogue.py's partial_sum, added up beside the element code
(gemm_sm90.InlinePartials, ~0.5% of a residual GEMM where the row kernel it shrinks was ~10%
of it: bench/LOG_gemm.md, session 18). The sum is regrouped (by group, then across groups):
the same function to rounding.

Fires when N is a multiple of W, q and the casts under it are read only by this chain, every
reader of r (through reshapes) is a row scale of a contraction's accumulator (where a kernel
reads x to normalise it, the sum of squares is free there and partials would only add a
kernel), the square is f32 (the partials are), and the rewritten graph's GEMM takes the
partials (a generated GEMM produced x). Otherwise the graph is left as it is. The epilogue
squares x as stored (rounded to its dtype), as the row kernel reading x would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...codegen.epilogue import PARTIAL_WIDTH
from .. import ir
from .match import Editor
from .rmsnorm_matmul import rsqrt_mean_square


def _scales_only(g: ir.Graph, users, r: str) -> bool:
    """Every reader of r, through reshapes, multiplies a contraction's result by it."""
    for u in users[r]:
        n = g[u]
        if isinstance(n, ir.View) and n.op == "reshape":
            if not _scales_only(g, users, u):
                return False
        elif not (isinstance(n, ir.Map) and n.op == "mul" and r in n.args
                  and isinstance(g[n.args[1 - n.args.index(r)]], ir.Contraction)):
            return False
    return bool(users[r])


def _square(g: ir.Graph, users, ms: str) -> str | None:
    """q when ms = mean(q = x'·x', last axis, keepdim), q read only by ms and each cast of x'
    only by the next (or by q); else None."""
    n = g[ms]
    q = g[n.arg]
    if users[n.arg] != [ms] or n.arg in g.outputs or q.type.dtype != "f32":  # (epilogue partials are f32)
        return None
    x = q.args[0]
    while isinstance(g[x], ir.Map) and g[x].op == "cast":
        if len(set(users[x])) != 1 or x in g.outputs:
            return None
        x = g[x].args[0]
    return n.arg


def rmsnorm_partials(g: ir.Graph, width: int = PARTIAL_WIDTH) -> ir.Graph:
    users = g.users()
    out = g
    for r in [n.name for n in g.nodes if isinstance(n, ir.Map) and n.op == "rsqrt"]:
        if rsqrt_mean_square(g, r) is None or not _scales_only(g, users, r):
            continue
        ms = next(a for a in g[g[r].args[0]].args if isinstance(g[a], ir.Reduce))
        q = _square(g, users, ms)
        if q is None or g[q].type.shape[-1] % width:
            continue
        new, psq = _rewrite(out, ms, q, width)
        if _fused(new, psq):
            out = new
    return out


def _rewrite(g: ir.Graph, ms: str, q: str, width: int) -> tuple[ir.Graph, str]:
    ed = Editor(g)
    f = ed.fresh
    qt, mt, src = g[q].type, g[ms].type, g[ms].source
    n = qt.shape[-1]
    m, t = math.prod(qt.shape[:-1]), n // width

    def T(shape, dtype=qt.dtype):
        return ir.TensorType(tuple(shape), dtype)

    lead = tuple(qt.shape[:-1])
    q3 = ir.View(f(f"{q}_groups"), T((m, t, width)), "reshape", q, (m, t, width), src)
    psq = ir.Reduce(f(f"{ms}_partials"), T((m, t)), "sum", q3.name, (2,), False, src)
    # (the rows' own shape before the finishing sum: it, the mean and what follows are one kernel)
    rows = ir.View(f(f"{ms}_partials_rows"), T(lead + (t,)), "reshape", psq.name, lead + (t,), src)
    tot = ir.Reduce(f(f"{ms}_sum"), mt, "sum", rows.name, (len(lead),), True, src)
    cols = ir.Constant(f(f"{ms}_n"), T(()), float(n), src)
    mean = ir.Map(ms, mt, "div", (tot.name, cols.name), src)
    nodes = []
    for x in g.nodes:
        nodes += [q3, psq, rows, tot, cols, mean] if x.name == ms else [x]
    return ed.graph(nodes), psq.name


def _fused(g: ir.Graph, psq: str) -> bool:
    """Does the planner put psq into a GEMM's epilogue?"""
    from ..contraction import GemmSpec, match

    users = g.users()
    for n in g.nodes:
        if isinstance(n, ir.Contraction):
            spec = match(g, n, users)
            if isinstance(spec, GemmSpec) and psq in spec.outs:
                return True
    return False


@dataclass(frozen=True)
class SumPartials:
    """What the planner puts in a GEMM's epilogue after its output y: psq = the per-group sums
    of `value` (a square of y under casts), and the nodes computing it there (`members`)."""

    psq: str
    value: str
    width: int
    members: tuple[str, ...]


def sum_partials_after(g: ir.Graph, users, y: str) -> SumPartials | None:
    """The partials the rule above leaves after y ([..., N], the epilogue's stored value): y's
    casts, their f32 square q, q3 = reshape(q, [M, T, W]) (W = PARTIAL_WIDTH, the groups the
    template renders) and psq = sum(q3, axis 2), each read only by the next; None otherwise."""
    yt = g[y].type
    if len(yt.shape) < 2:
        return None
    m, n = math.prod(yt.shape[:-1]), yt.shape[-1]
    for u in users[y]:
        members, x, prev = [], u, y
        while isinstance(g[x], ir.Map) and g[x].op == "cast" and g[x].type.dtype in ("f32", "f64", "bf16", "f16"):
            if len(set(users[x])) != 1 or x in g.outputs:
                break
            members.append(x)
            prev, x = x, users[x][0]
        sq = g[x]
        if not (isinstance(sq, ir.Map) and sq.op == "mul" and sq.args == (prev, prev) and sq.type.shape == yt.shape
                and sq.type.dtype == "f32" and len(users[x]) == 1 and x not in g.outputs):
            continue
        q3 = users[x][0]
        v = g[q3]
        if not (isinstance(v, ir.View) and v.op == "reshape" and v.type.shape == (m, n // PARTIAL_WIDTH, PARTIAL_WIDTH)
                and n % PARTIAL_WIDTH == 0 and len(users[q3]) == 1 and q3 not in g.outputs):
            continue
        psq = users[q3][0]
        p = g[psq]
        if not (isinstance(p, ir.Reduce) and p.op == "sum" and p.arg == q3 and tuple(p.axes) == (2,)
                and not p.keepdim):
            continue
        return SumPartials(psq, x, PARTIAL_WIDTH, tuple(members + [x, q3, psq]))
    return None

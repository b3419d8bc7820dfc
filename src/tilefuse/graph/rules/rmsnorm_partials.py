"""RMSNorm's sum of squares as partials in the epilogue of the GEMM that wrote x.

After rmsnorm_into_matmul, an RMSNorm before matmuls is r = rsqrt(mean(x·x) + ε), a row
reduction of x, and row scales in those matmuls' epilogues: a kernel still reads all of x
only to reduce it. x is most often a GEMM's output with its residual added (the O and down
projections), and that GEMM holds every element of x in registers: it reduces x·x per group of
W columns there, beside its store of x, and the row kernel then reads T = N / W values a row
(W = 128, or 16 where the GEMM has at most 8 rows and so runs in the GEMV, whose CTAs own 16
columns each: epilogue.width_for_rows):

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

from ...codegen.epilogue import PARTIAL_WIDTH, SHORT_PARTIAL_WIDTH, width_for_rows
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


def group_width(width: int | None, shape) -> int:
    """`width`, or where None the group width for rows of `shape` (epilogue.width_for_rows:
    16 where its GEMM runs in the GEMV, a decode step's)."""
    return width or width_for_rows(math.prod(shape[:-1]))


def candidates(g: ir.Graph, width: int | None = None) -> list[tuple[str, str]]:
    """(ms, q) of each norm the rule may rewrite, in graph order, before asking the GEMMs."""
    users = g.users()
    found = []
    for r in [n.name for n in g.nodes if isinstance(n, ir.Map) and n.op == "rsqrt"]:
        if rsqrt_mean_square(g, r) is None or not _scales_only(g, users, r):
            continue
        ms = next(a for a in g[g[r].args[0]].args if isinstance(g[a], ir.Reduce))
        q = _square(g, users, ms)
        if q is not None and g[q].type.shape[-1] % group_width(width, g[q].type.shape) == 0:
            found.append((ms, q))
    return found


def rmsnorm_partials(g: ir.Graph, width: int | None = None) -> ir.Graph:
    return in_one_pass(g, candidates(g, width), lambda h, norms: _rewritten(h, norms, width))


def _rewritten(g: ir.Graph, norms, width: int | None) -> tuple[ir.Graph, list[bool]]:
    """g with every norm (ms, q) of `norms` as partials, and whether a GEMM takes each one's."""
    new, psqs = means_as_partials(g, norms, width)
    specs = Specs(new)
    return new, [psq in new and specs.first(producers(new, (psq,)), lambda s, p=psq: p in s.outs)
                 for psq in psqs]  # (pruned where nothing reads the mean)


def in_one_pass(g: ir.Graph, found: list, rewritten) -> ir.Graph:
    """A norm-partials rule over the norms `found`, given `rewritten(g, norms) -> (graph, [ok])`
    (each norm rewritten, and whether that one pays in that graph). Every norm is rewritten in
    one pass, the ones that do not pay are put back, and what is left is checked once more:
    one graph and one Specs for the model, where rewriting and checking one norm at a time made
    a graph per norm, quadratic in the layers (3 s of a 32-layer Llama's 5.7 s lowering, 4.3 s
    of a 32-layer GPT-2's 6.5 s, profiled). Every norm rewritten pays in the graph returned.
    A norm's partials are taken by the GEMM before it, whose epilogue no other norm's rewrite
    reaches, so this is the graph one norm at a time gives (the same for 13 architectures);
    should a rewrite change another norm's answer, the check once more fails and the rule goes
    one norm at a time (`one_at_a_time`). Where no norm pays (OLMo's), the graph is left as it
    is at once: going one at a time there cost 1 s at 32 layers."""
    if not found:
        return g
    new, ok = rewritten(g, found)
    if all(ok):
        return new
    kept = [norm for norm, y in zip(found, ok) if y]
    if not kept:
        return g
    new, ok = rewritten(g, kept)
    return new if all(ok) else one_at_a_time(g, found, rewritten)


def one_at_a_time(g: ir.Graph, found: list, rewritten) -> ir.Graph:
    """The rule as it was: each norm rewritten and checked in the graph of those before it."""
    out = g
    for norm in found:
        new, (ok,) = rewritten(out, [norm])
        if ok:
            out = new
    return out


def means_as_partials(g: ir.Graph, pairs, width: int | None) -> tuple[ir.Graph, list[str]]:
    """g with each row mean ms = mean(q, last axis, keepdim) of `pairs` (ms, q) as the sum over t
    of per-group sums psq[m, t] of reshape(q, [M, T, W]), divided by N, all in one pass; and
    the psq names in the pairs' order. W = `width`, or group_width's for q's rows."""
    ed = Editor(g)
    f = ed.fresh
    swap, psqs = {}, []
    for ms, q in pairs:
        qt, mt, src = g[q].type, g[ms].type, g[ms].source
        n = qt.shape[-1]
        width_q = group_width(width, qt.shape)
        m, t = math.prod(qt.shape[:-1]), n // width_q

        def T(shape, dtype=qt.dtype):
            return ir.TensorType(tuple(shape), dtype)

        lead = tuple(mt.shape[:-1])  # (q may be the rows of x under a reshape: layernorm_partials.py)
        q3 = ir.View(f(f"{q}_groups"), T((m, t, width_q)), "reshape", q, (m, t, width_q), src)
        psq = ir.Reduce(f(f"{ms}_partials"), T((m, t)), "sum", q3.name, (2,), False, src)
        if t == 1:  # one group: its partial is the row's sum (a sum over an axis of 1 is no kernel's)
            finish = [ir.View(f(f"{ms}_sum"), mt, "reshape", psq.name, tuple(mt.shape), src)]
        else:  # (the rows' own shape before the finishing sum: it, the mean and what follows are one kernel)
            rows = ir.View(f(f"{ms}_partials_rows"), T(lead + (t,)), "reshape", psq.name, lead + (t,), src)
            finish = [rows, ir.Reduce(f(f"{ms}_sum"), mt, "sum", rows.name, (len(lead),), True, src)]
        cols = ir.Constant(f(f"{ms}_n"), T(()), float(n), src)
        swap[ms] = [q3, psq, *finish, cols, ir.Map(ms, mt, "div", (finish[-1].name, cols.name), src)]
        psqs.append(psq.name)
    return ed.graph([y for x in g.nodes for y in swap.get(x.name, [x])]), psqs


def producers(g: ir.Graph, names) -> set[str]:
    """The contractions whose epilogue could compute one of `names`: those reached from them
    backwards through maps, views and reductions alone, what an epilogue is made of. Matching
    only these gives what matching every contraction would, at a fraction of the cost (each
    match walks the graph: a 4-layer Llama spent half its compile time here)."""
    found, seen, stack = set(), set(), list(names)
    while stack:
        n = g[stack.pop()]
        if n.name in seen:
            continue
        seen.add(n.name)
        if isinstance(n, ir.Contraction):
            found.add(n.name)
        elif isinstance(n, (ir.Map, ir.View, ir.Reduce)):
            stack.extend(ir.node_args(n))
    return found


class Specs:
    """The GemmSpecs of a graph's contractions, each matched when first asked. Matching every
    contraction of the graph for each norm was quadratic in the layers."""

    def __init__(self, g: ir.Graph):
        self.g, self.users, self.order, self.got = g, g.users(), g.order(), {}
        self.every = {n.name for n in g.nodes if isinstance(n, ir.Contraction)}

    def some(self, near: set, ok) -> bool:
        """Whether some contraction's GemmSpec satisfies `ok`: those of `near` first, nearest
        first, then the rest (an epilogue can hold a node its contraction does not reach: one
        that joins through an operand map the epilogue computes, reading nothing of the
        accumulator), so the answer is the same as asking every spec."""
        return self.first(near, ok) or self.first(self.every - set(near), ok)

    def first(self, names, ok) -> bool:
        """Whether the GemmSpec of one of the contractions `names` satisfies `ok`, the latest
        in the graph asked first."""
        from ..contraction import GemmSpec, match

        for name in sorted(names, key=self.order.__getitem__, reverse=True):
            if name not in self.got:
                self.got[name] = match(self.g, self.g[name], self.users)
            s = self.got[name]
            if isinstance(s, GemmSpec) and ok(s):
                return True
        return False


@dataclass(frozen=True)
class SumPartials:
    """What the planner puts in a GEMM's epilogue after its output y: psq = the per-group sums
    of `value` (y under casts, or its square), and the nodes computing it there (`members`)."""

    psq: str
    value: str
    width: int
    members: tuple[str, ...]


def sum_partials_after(g: ir.Graph, users, y: str) -> tuple[SumPartials, ...]:
    """The partials this rule and layernorm_partials.py leave after y ([..., N], the epilogue's
    stored value): along y's chain of casts, an f32 value v (a cast, or y) or its square
    q = v·v, reshaped to [M, T, W] (W one of the widths the templates render: PARTIAL_WIDTH,
    or SHORT_PARTIAL_WIDTH for a few rows) and summed over axis 2. Each node after y is read
    only by what the partials compute from it (the next cast, the reshape, the square), so that
    the epilogue holds all of them; () when there are none."""
    yt = g[y].type
    if len(yt.shape) < 2:
        return ()
    m, n = math.prod(yt.shape[:-1]), yt.shape[-1]
    shapes = {(m, n // w, w): w for w in (PARTIAL_WIDTH, SHORT_PARTIAL_WIDTH) if n % w == 0}

    def grouped_sum(v: str) -> tuple[str, str, int] | None:
        """(q3, psq, W) for psq = sum(q3 = reshape(v, [M, T, W]), axis 2), q3 read only by psq."""
        for q3 in dict.fromkeys(users[v]):
            r = g[q3]
            if not (isinstance(r, ir.View) and r.op == "reshape" and r.arg == v and r.type.shape in shapes
                    and len(users[q3]) == 1 and q3 not in g.outputs):
                continue
            p = g[users[q3][0]]
            if isinstance(p, ir.Reduce) and p.op == "sum" and tuple(p.axes) == (2,) and not p.keepdim:
                return q3, p.name, shapes[r.type.shape]
        return None

    def square(v: str) -> str | None:
        for q in dict.fromkeys(users[v]):
            n = g[q]
            if (isinstance(n, ir.Map) and n.op == "mul" and n.args == (v, v) and n.type.shape == yt.shape
                    and n.type.dtype == "f32" and q not in g.outputs):
                return q
        return None

    def own(v: str, casts: tuple[str, ...]) -> tuple[list, set]:
        """The partials of v itself (y or a cast after it, `casts` the casts from y to v), and
        v's readers they leave."""
        found, taken = [], set()
        if g[v].type.dtype == "f32":
            for value in (v, square(v)):
                s = grouped_sum(value) if value is not None else None
                if s is not None and (value == v or set(users[value]) == {s[0]}):
                    found.append(SumPartials(s[1], value, s[2], casts + ((value,) if value != v else ()) + s[:2]))
                    taken |= {s[0]} if value == v else {value}
        return found, set(users[v]) - taken

    def casts_after(v: str) -> list[str]:
        return [u for u in dict.fromkeys(users[v]) if isinstance(g[u], ir.Map) and g[u].op == "cast"
                and g[u].type.dtype in ("f32", "f64", "bf16", "f16") and u not in g.outputs]

    found, _ = own(y, ())
    if found:
        return tuple(found)
    # Along each chain of casts from y (y itself may have other readers: it is stored), every
    # reader of each cast after y must be what the partials compute. A loop, not a recursive
    # closure: that would be a reference cycle holding g, and with it the graph's weights,
    # until the cyclic collector ran (tests/cpu/test_weight_lifetimes.py).
    for v in casts_after(y):
        casts = (v,)
        while True:
            found, rest = own(v, casts)
            if found:
                if not rest:
                    return tuple(found)
                break  # (a cast the epilogue computes that something else reads)
            nxt = casts_after(v)
            if len(nxt) != 1 or rest != set(nxt):
                break
            v, casts = nxt[0], casts + (nxt[0],)
    return ()

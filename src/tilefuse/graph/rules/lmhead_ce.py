"""LM head + cross-entropy without the logits in memory: per-group partials in the GEMM epilogue.

    z = X (an [M, V] product, maybe cast), loss = CE(z, target)
    →  z3 = reshape(z, [M, T, W])                      (T = V / W column groups of W)
       pmax[m, t] = max_c z3                           psum[m, t] = sum_c exp(z3 - shift)
       psel[m, t] = sum_c (t W + c == target[m]) ? z3 : 0,   shift = pmax, or 0 where it is -inf
       lse[m]  = B + log(sum_t exp(pmax - B) psum),  B = max_t pmax
       tgt[m]  = sum_t psel

lse and the target logit replace the graph's own (the log-sum-exp and the target select that
torch.export gives for F.cross_entropy); the masked mean over rows (ignore_index) after them
is left as it is. The partials are the generated GEMM's epilogue (`partials_after` is what the
planner recognises, codegen/epilogue.py's partial_lse / partial_select what it lowers them to):
the GEMM writes 3 floats per row and group instead of V logits per row, and the small row
kernel over [M, T] finishes them. The sum of exp is regrouped (by group, then across groups), so
the result is not bit-identical to the one-pass form: the same function to rounding.

Fires when z is 2-D, read only by the cross-entropy's max, subtraction and target select (not
returned), V a multiple of W (codegen.epilogue.PARTIAL_WIDTH), and z is (casts of) a contraction.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...codegen.epilogue import PARTIAL_WIDTH
from .. import ir
from .match import Editor, peel_casts, prune


def _red(g: ir.Graph, name: str, op: str, arg: str, axes: tuple, keepdim: bool) -> bool:
    n = g[name]
    return (isinstance(n, ir.Reduce) and n.op == op and n.arg == arg and tuple(n.axes) == axes
            and n.keepdim == keepdim)


def _map(g: ir.Graph, name: str, op: str):
    n = g[name]
    return n if isinstance(n, ir.Map) and n.op == op else None


def _const(g: ir.Graph, name: str, value) -> bool:
    n = g[name]
    return isinstance(n, ir.Constant) and float(n.value) == float(value)


@dataclass(frozen=True)
class _CE:
    z: str
    mx: str          # reduce max(z, keepdim)
    lse: str         # add(log(sum(exp(z - mx))), mx)
    select: str      # reduce sum(where(eq(iota, target[:, None]), z, 0))
    target: str      # the [M] class indices
    dead: tuple      # the nodes the rewrite replaces


def _find(g: ir.Graph, users, mx: str) -> _CE | None:
    """The cross-entropy pieces around `mx` = max(z, last axis, keepdim), if they are there."""
    n = g[mx]
    if not (isinstance(n, ir.Reduce) and n.op == "max" and n.keepdim):
        return None
    z = n.arg
    zt = g[z].type
    if len(zt.shape) != 2 or tuple(n.axes) != (1,) or zt.dtype not in ("f32", "f64") or z in g.outputs:
        return None  # (logits the program returns are written anyway: nothing to save)
    if not isinstance(g[peel_casts(g, z)], ir.Contraction):
        return None
    sub = lse = log = ssum = exp = sel = where = eq = target = None
    for u in users[z]:
        if u == mx:
            continue
        m = g[u]
        if isinstance(m, ir.Map) and m.op == "sub" and m.args == (z, mx):
            sub = u
        elif isinstance(m, ir.Map) and m.op == "where" and m.args[1] == z and _const(g, m.args[2], 0):
            where = u
        else:
            return None
    if sub is None or where is None or len(users[sub]) != 1:
        return None
    exp = users[sub][0]
    if not (_map(g, exp, "exp") and len(users[exp]) == 1):
        return None
    ssum = users[exp][0]
    if not (_red(g, ssum, "sum", exp, (1,), True) and len(users[ssum]) == 1):
        return None
    log = users[ssum][0]
    if not (_map(g, log, "log") and len(users[log]) == 1):
        return None
    lse = users[log][0]
    a = _map(g, lse, "add")
    if a is None or set(a.args) != {log, mx} or set(users[mx]) != {sub, lse}:
        return None
    eq = g[where].args[0]
    e = _map(g, eq, "eq")
    if e is None or users[eq] != [where] or len(users[where]) != 1:
        return None
    sel = users[where][0]
    if not _red(g, sel, "sum", where, (1,), False):
        return None
    for iota, t2 in (e.args, e.args[::-1]):
        io, tv = g[iota], g[t2]
        if (isinstance(io, ir.Iota) and io.type.shape == (zt.shape[1],) and io.axis == 0
                and isinstance(tv, ir.View) and tv.op == "reshape" and tv.type.shape == (zt.shape[0], 1)
                and g[tv.arg].type.shape == (zt.shape[0],) and g[tv.arg].type.dtype == "i64"):
            target = tv.arg
            break
    else:
        return None
    return _CE(z, mx, lse, sel, target, (mx, sub, exp, ssum, log, lse, eq, where, sel))


def lmhead_ce_partials(g: ir.Graph, width: int = PARTIAL_WIDTH) -> ir.Graph:
    users = g.users()
    found = []
    for n in g.nodes:
        ce = _find(g, users, n.name) if isinstance(n, ir.Reduce) else None
        if ce is not None and g[ce.z].type.shape[1] % width == 0:
            found.append(ce)
    if not found:
        return g
    ed = Editor(g)
    before: dict[str, list] = {}    # node -> new nodes placed before it
    instead: dict[str, list] = {}   # node -> the nodes that replace it
    drop: set[str] = set()
    for ce in found:
        zt = g[ce.z].type
        m, v = zt.shape
        t, dt, src = v // width, zt.dtype, g[ce.lse].source

        def T(shape, dtype=dt):
            return ir.TensorType(tuple(shape), dtype)

        f = ed.fresh
        z3 = ir.View(f(f"{ce.z}_groups"), T((m, t, width)), "reshape", ce.z, (m, t, width), src)
        pmax = ir.Reduce(f("pmax"), T((m, t)), "max", z3.name, (2,), False, src)
        pmk = ir.View(f("pmax_k"), T((m, t, 1)), "reshape", pmax.name, (m, t, 1), src)
        ninf = ir.Constant(f("ninf"), T(()), float("-inf"), src)
        empty = ir.Map(f("pmax_empty"), T((m, t, 1), "bool"), "eq", (pmk.name, ninf.name), src)
        zero = ir.Constant(f("zero"), T(()), 0.0, src)
        shift = ir.Map(f("pmax_shift"), T((m, t, 1)), "where", (empty.name, zero.name, pmk.name), src)
        d = ir.Map(f("pshift"), T((m, t, width)), "sub", (z3.name, shift.name), src)
        e = ir.Map(f("pexp"), T((m, t, width)), "exp", (d.name,), src)
        psum = ir.Reduce(f("psum"), T((m, t)), "sum", e.name, (2,), False, src)
        iota = ir.Iota(f("cols"), T((v,), "i64"), 0, src)
        cols = ir.View(f("cols_groups"), T((t, width), "i64"), "reshape", iota.name, (t, width), src)
        tg = ir.View(f(f"{ce.target}_rows"), T((m, 1, 1), "i64"), "reshape", ce.target, (m, 1, 1), src)
        hit = ir.Map(f("phit"), T((m, t, width), "bool"), "eq", (cols.name, tg.name), src)
        sel = ir.Map(f("pselect"), T((m, t, width)), "where", (hit.name, z3.name, zero.name), src)
        psel = ir.Reduce(f("psel"), T((m, t)), "sum", sel.name, (2,), False, src)
        # the finishing reduction over the T groups of a row
        big = ir.Reduce(f("lse_max"), T((m, 1)), "max", pmax.name, (1,), True, src)
        dd = ir.Map(f("lse_shift"), T((m, t)), "sub", (pmax.name, big.name), src)
        ee = ir.Map(f("lse_scale"), T((m, t)), "exp", (dd.name,), src)
        ww = ir.Map(f("lse_terms"), T((m, t)), "mul", (ee.name, psum.name), src)
        ss = ir.Reduce(f("lse_sum"), T((m, 1)), "sum", ww.name, (1,), True, src)
        lg = ir.Map(f("lse_log"), T((m, 1)), "log", (ss.name,), src)
        lse = ir.Map(ce.lse, g[ce.lse].type, "add", (lg.name, big.name), src)
        select = ir.Reduce(ce.select, g[ce.select].type, "sum", psel.name, (1,), False, g[ce.select].source)
        before[ce.mx] = [z3, pmax, pmk, ninf, empty, zero, shift, d, e, psum, iota, cols, tg, hit, sel, psel,
                         big, dd, ee, ww, ss, lg]
        instead[ce.lse] = [lse]
        instead[ce.select] = [select]
        drop |= set(ce.dead) - {ce.lse, ce.select}
    out = []
    for n in g.nodes:
        out += before.get(n.name, [])
        if n.name in instead:
            out += instead[n.name]
        elif n.name not in drop:
            out.append(n)
    return prune(ed.graph(out))


@dataclass(frozen=True)
class Partials:
    """What the planner puts in a GEMM's epilogue after its output z (see the module docstring):
    `members` the graph nodes it computes there, `outs` the [M, T] tensors it writes."""

    source: str                     # z, the epilogue's value the partials reduce
    width: int
    members: tuple[str, ...]
    lse: tuple[str, str]            # (pmax, psum)
    select: tuple[str, str] | None  # (psel, target)

    @property
    def outs(self) -> tuple[str, ...]:
        return self.lse + ((self.select[0],) if self.select else ())


def partials_after(g: ir.Graph, users, z: str) -> Partials | None:
    """The partials the rule above leaves after z (an [M, V] epilogue value read by nothing
    else), or None: z3 = reshape(z, [M, T, W]) read only by pmax, the shifted exp of psum and
    the target select of psel, each intermediate read only inside that pattern."""
    zt = g[z].type
    if len(zt.shape) != 2 or len(users[z]) != 1 or z in g.outputs:
        return None
    m, v = zt.shape
    z3 = users[z][0]
    n3 = g[z3]
    if not (isinstance(n3, ir.View) and n3.op == "reshape" and len(n3.type.shape) == 3
            and n3.type.shape[0] == m and n3.type.shape[1] * n3.type.shape[2] == v):
        return None
    t, w = n3.type.shape[1:]
    pmax = d = sel = None
    for u in users[z3]:
        x = g[u]
        if _red(g, u, "max", z3, (2,), False):
            pmax = u
        elif isinstance(x, ir.Map) and x.op == "sub" and x.args[0] == z3:
            d = u
        elif isinstance(x, ir.Map) and x.op == "where" and x.args[1] == z3 and _const(g, x.args[2], 0):
            sel = u
        else:
            return None
    if pmax is None or d is None:
        return None
    shift = g[d].args[1]
    sh = _map(g, shift, "where")
    if sh is None or users[shift] != [d] or not _const(g, sh.args[1], 0):
        return None
    pmk, empty = sh.args[2], sh.args[0]
    em = _map(g, empty, "eq")
    if not (isinstance(g[pmk], ir.View) and g[pmk].op == "reshape" and g[pmk].arg == pmax
            and em is not None and pmk in em.args and _const(g, em.args[1 - em.args.index(pmk)], float("-inf"))
            and users[empty] == [shift] and set(users[pmk]) == {empty, shift}):
        return None
    if len(users[d]) != 1 or not _map(g, users[d][0], "exp"):
        return None
    e = users[d][0]
    if len(users[e]) != 1 or not _red(g, users[e][0], "sum", e, (2,), False):
        return None
    psum = users[e][0]
    members = [z3, pmax, pmk, empty, shift, d, e, psum]
    select = None
    if sel is not None:
        hit = g[sel].args[0]
        h = _map(g, hit, "eq")
        if h is None or users[hit] != [sel] or len(users[sel]) != 1:
            return None
        psel = users[sel][0]
        if not _red(g, psel, "sum", sel, (2,), False):
            return None
        cols, tg = h.args
        c, tv = g[cols], g[tg]
        if not (isinstance(c, ir.View) and c.op == "reshape" and c.type.shape == (t, w) and users[cols] == [hit]
                and isinstance(g[c.arg], ir.Iota) and g[c.arg].type.shape == (v,)
                and isinstance(tv, ir.View) and tv.op == "reshape" and tv.type.shape == (m, 1, 1)
                and users[tg] == [hit] and g[tv.arg].type.shape == (m,) and g[tv.arg].type.dtype == "i64"):
            return None
        members += [cols, tg, hit, sel, psel]
        select = (psel, tv.arg)
    order = {n.name: i for i, n in enumerate(g.nodes)}
    return Partials(z, w, tuple(sorted(members, key=order.get)), (pmax, psum), select)

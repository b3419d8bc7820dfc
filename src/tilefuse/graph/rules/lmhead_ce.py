"""LM head + cross-entropy without the logits in memory: per-group partials in the GEMM epilogue.

    z = X (an [M, V] product: casts and row reshapes of a GEMM's epilogue value y), loss = CE(z, target)
    →  z3 = reshape(y, [M, T, W])                      (T = ceil(V / W) column groups of W)
       pmax[m, t] = max_c z3                           psum[m, t] = sum_c exp(z3 - shift)
       psel[m, t] = sum_c (t W + c == target[m]) ? z3 : 0,   shift = pmax, or 0 where it is -inf
       max[m]  = B = max_t pmax       log[m] = log(sum_t exp(pmax - B) psum)
       tgt[m]  = sum_t psel           (the loss: (max - tgt) + log, as the graph has it)

When W does not divide V (GPT-2's 50257), the last group is short: y is first padded to T W
columns with -inf,

       yp[..., j] = j < V ? y[..., min(j, V - 1)] : -inf        (a gather and a where)

so a padded column adds nothing (max -inf, exp 0, never the target). That is the Graph IR
spelling of what the epilogue does anyway: codegen/epilogue.py's partials read the column
t W + c wrapped into the row and mask it to the reduction's identity past V, and the sm_90a
template's tail tiles read clamped columns and keep those masks. The pad itself never runs:
the planner takes it into the GEMM with the partials.

The row max, the log of the sum and the target logit replace the graph's own (those of the
cross-entropy that torch.export gives for F.cross_entropy, as frontend/aten.py spells it); the
loss made of them and the masked mean or sum over rows (ignore_index) after it are left as they
are. The partials are the generated GEMM's epilogue (`partials_after` is what
the planner recognises, codegen/epilogue.py's partial_lse / partial_select what it lowers them
to): the GEMM writes 3 floats per row and group instead of V logits per row, and the small row
kernel over [M, T] finishes them. The sum of exp is regrouped (by group, then across groups), so
the result is not bit-identical to the one-pass form: the same function to rounding.

z is what `F.cross_entropy(logits.float().view(-1, V), labels.view(-1), ignore_index=-100)`
and transformers' ForCausalLMLoss make of [B, S, V] logits: a cast and a reshape of the
product (in either order), maybe after a bias add. The casts are applied to y before the
grouping reshape (an elementwise cast commutes with a reshape), so the partials read the
epilogue's own value.

z may also keep only some of y's rows: slices of leading dims, `logits[:, :-1]` against
`labels[:, 1:]` (shifting the logits, as older transformers and many training loops do). The
GEMM computes every row anyway, so the partials are taken over all of y's M_full rows, with the
target of a row the slices drop set to -1 (no column: built from the kept rows' targets by a
gather of the clamped row and a where), and the finished lse and target logit ([M_full]) are
sliced to the kept rows: views of [M]-sized vectors instead of a copy of the sliced logits.

Fires when z is 2-D [M, V] and f32/f64, read only by the cross-entropy's max, subtraction and
target select; every tensor from the product y to z is read only by the next (the logits are
not returned: returned logits are written anyway, so there is nothing to save); and the
rewritten graph's GEMM takes the partials into its epilogue (contraction.match says so: a
bf16/f16 product the planner generates). Otherwise the graph is left as it is: without the
GEMM the partials would only add kernels (and, for a short last group, copy the logits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...codegen.epilogue import PARTIAL_WIDTH
from .. import ir
from .match import Editor


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


def _rows(shape: tuple, m: int, v: int) -> bool:
    """shape is [..., V] with M rows in its leading dims."""
    return len(shape) >= 2 and shape[-1] == v and math.prod(shape[:-1]) == m


@dataclass(frozen=True)
class _CE:
    z: str
    mx: str          # reduce max(z, keepdim)
    log: str         # log(sum(exp(z - mx))), keepdim
    select: str      # reduce sum(where(eq(iota, target[:, None]), z, 0))
    target: str      # the [M] class indices
    base: str        # y: z is casts, row reshapes and row slices of it
    casts: tuple     # the dtypes of those casts, from y's side
    box: tuple       # ((dim, start, end), ...): the rows of y the slices keep; () for all
    dead: tuple      # the nodes the rewrite replaces


def _chain(g: ir.Graph, users, z: str) -> tuple[str, tuple[str, ...], tuple] | None:
    """(y, cast dtypes, box): z is float casts, reshapes of the rows ([..., V] into [M, V] and
    back) and slices of leading dims (step 1: `logits[:, :-1]`, first) of y, each link read only
    by the next and none returned; `box` the (dim, start, end) ranges of y's rows the slices keep
    (() for all of them). None otherwise."""
    m, v = g[z].type.shape
    casts, slices, x = [], [], z
    while True:
        n = g[x]
        if isinstance(n, ir.Map) and n.op == "cast" and n.type.dtype in ("bf16", "f16", "f32", "f64"):
            casts.append(n.type.dtype)
        elif isinstance(n, ir.View) and n.op == "reshape" and not slices and _rows(g[n.arg].type.shape, m, v):
            pass
        elif (isinstance(n, ir.View) and n.op == "slice" and n.params[3] == 1 and n.params[0] < len(n.type.shape) - 1
              and (slices or _rows(n.type.shape, m, v))):
            slices.append(tuple(n.params[:3]))
        else:
            break
        up = ir.node_args(n)[0]
        if users[up] != [x] or up in g.outputs or g[up].type.dtype not in ("bf16", "f16", "f32", "f64"):
            return None
        x = up
    box: dict[int, tuple[int, int]] = {}
    for d, start, end in reversed(slices):  # composed in the order they run, in y's coordinates
        s0 = box.get(d, (0, 0))[0]
        box[d] = (s0 + start, s0 + end)
    return x, tuple(reversed(casts)), tuple((d, *box[d]) for d in sorted(box))


def _find(g: ir.Graph, users, mx: str) -> _CE | None:
    """The cross-entropy pieces around `mx` = max(z, last axis, keepdim), if they are there."""
    n = g[mx]
    if not (isinstance(n, ir.Reduce) and n.op == "max" and n.keepdim):
        return None
    z = n.arg
    zt = g[z].type
    if len(zt.shape) != 2 or tuple(n.axes) != (1,) or zt.dtype not in ("f32", "f64") or z in g.outputs:
        return None  # (logits the program returns are written anyway: nothing to save)
    chain = _chain(g, users, z)
    if chain is None:
        return None
    sub = log = ssum = exp = sel = where = eq = target = None
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
    if not _map(g, log, "log"):
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
    return _CE(z, mx, log, sel, target, *chain, (mx, sub, exp, ssum, log, eq, where, sel))


def _rewrite(g: ir.Graph, ce: _CE, width: int) -> tuple[ir.Graph, str]:
    """g with `ce` rewritten to partials (the module docstring), and the name of its pmax."""
    ed = Editor(g)
    zt = g[ce.z].type
    m, v = zt.shape
    t, dt, src = -(-v // width), zt.dtype, g[ce.log].source
    y = g[ce.base]
    lead = y.type.shape[:-1]

    def T(shape, dtype=dt):
        return ir.TensorType(tuple(shape), dtype)

    f = ed.fresh
    new: list = []
    name = ce.base
    for d in ce.casts:  # z's casts, on y's own shape (before the reshape: the epilogue's value)
        c = ir.Map(f("logits_cast"), T(y.type.shape, d), "cast", (name,), src)
        new.append(c)
        name = c.name
    if v % width:  # pad to t * width columns with -inf (read at the last column, then masked)
        tw = t * width
        cols = ir.Iota(f("pad_cols"), T((tw,), "i64"), 0, src)
        last = ir.Constant(f("last_col"), T((), "i64"), v - 1, src)
        clamp = ir.Map(f("pad_index"), T((tw,), "i64"), "min", (cols.name, last.name), src)
        row = ir.View(f("pad_index_row"), T((1,) * len(lead) + (tw,), "i64"), "reshape", clamp.name,
                      (1,) * len(lead) + (tw,), src)
        index = ir.View(f("pad_index_rows"), T(lead + (tw,), "i64"), "expand", row.name, lead + (tw,), src)
        read = ir.Gather(f("pad_read"), T(lead + (tw,)), name, index.name, len(lead), src)
        nv = ir.Constant(f("ncols"), T((), "i64"), v, src)
        inside = ir.Map(f("pad_inside"), T((tw,), "bool"), "lt", (cols.name, nv.name), src)
        ninf_pad = ir.Constant(f("ninf"), T(()), float("-inf"), src)
        padded = ir.Map(f("padded"), T(lead + (tw,)), "where", (inside.name, read.name, ninf_pad.name), src)
        new += [cols, last, clamp, row, index, read, nv, inside, ninf_pad, padded]
        name = padded.name
    # the partials over all of y's rows (mf: the GEMM's), the target of a row the slices drop -1
    mf = math.prod(lead)
    target = ce.target
    if ce.box:
        more, target = _target_rows(f, ce.target, ce.box, lead, src)
        new += more
    z3 = ir.View(f(f"{ce.z}_groups"), T((mf, t, width)), "reshape", name, (mf, t, width), src)
    pmax = ir.Reduce(f("pmax"), T((mf, t)), "max", z3.name, (2,), False, src)
    pmk = ir.View(f("pmax_k"), T((mf, t, 1)), "reshape", pmax.name, (mf, t, 1), src)
    ninf = ir.Constant(f("ninf"), T(()), float("-inf"), src)
    empty = ir.Map(f("pmax_empty"), T((mf, t, 1), "bool"), "eq", (pmk.name, ninf.name), src)
    zero = ir.Constant(f("zero"), T(()), 0.0, src)
    shift = ir.Map(f("pmax_shift"), T((mf, t, 1)), "where", (empty.name, zero.name, pmk.name), src)
    d = ir.Map(f("pshift"), T((mf, t, width)), "sub", (z3.name, shift.name), src)
    e = ir.Map(f("pexp"), T((mf, t, width)), "exp", (d.name,), src)
    psum = ir.Reduce(f("psum"), T((mf, t)), "sum", e.name, (2,), False, src)
    iota = ir.Iota(f("cols"), T((t * width,), "i64"), 0, src)
    cols = ir.View(f("cols_groups"), T((t, width), "i64"), "reshape", iota.name, (t, width), src)
    tg = ir.View(f(f"{target}_rows"), T((mf, 1, 1), "i64"), "reshape", target, (mf, 1, 1), src)
    hit = ir.Map(f("phit"), T((mf, t, width), "bool"), "eq", (cols.name, tg.name), src)
    sel = ir.Map(f("pselect"), T((mf, t, width)), "where", (hit.name, z3.name, zero.name), src)
    psel = ir.Reduce(f("psel"), T((mf, t)), "sum", sel.name, (2,), False, src)
    new += [z3, pmax, pmk, ninf, empty, zero, shift, d, e, psum, iota, cols, tg, hit, sel, psel]
    # the finishing reduction over the T groups of a row (of all of y's rows: then the slices):
    # the row's max and the log of its sum of exp(z - max), which the graph's own max and log
    # become (the loss after them, (max - target logit) + log, is left as it is)
    whole = not ce.box
    big = ir.Reduce(ce.mx if whole else f("lse_max"), T((mf, 1)), "max", pmax.name, (1,), True, src)
    dd = ir.Map(f("lse_shift"), T((mf, t)), "sub", (pmax.name, big.name), src)
    ee = ir.Map(f("lse_scale"), T((mf, t)), "exp", (dd.name,), src)
    ww = ir.Map(f("lse_terms"), T((mf, t)), "mul", (ee.name, psum.name), src)
    ss = ir.Reduce(f("lse_sum"), T((mf, 1)), "sum", ww.name, (1,), True, src)
    lg = ir.Map(ce.log if whole else f("lse_log"), T((mf, 1)), "log", (ss.name,), src)
    new += [dd, ee, ww, ss]
    if whole:
        select = ir.Reduce(ce.select, g[ce.select].type, "sum", psel.name, (1,), False, g[ce.select].source)
        replaced = {ce.mx: big, ce.log: lg, ce.select: select}
    else:
        sel_all = ir.Reduce(f("select_all_rows"), T((mf,)), "sum", psel.name, (1,), False, src)
        mx_views = _kept_rows(f, big.name, ce.mx, ce.box, lead, (1,), dt, src)
        log_views = _kept_rows(f, lg.name, ce.log, ce.box, lead, (1,), dt, src)
        sel_views = _kept_rows(f, sel_all.name, ce.select, ce.box, lead, (), dt, src)
        new += [big, lg, sel_all] + mx_views[:-1] + log_views[:-1] + sel_views[:-1]
        replaced = {ce.mx: mx_views[-1], ce.log: log_views[-1], ce.select: sel_views[-1]}
    drop = set(ce.dead) - set(replaced)
    out = []
    for n in g.nodes:
        if n.name == ce.mx:  # the new nodes where the cross-entropy began
            out += new
        if n.name not in drop:
            out.append(replaced.get(n.name, n))
    return ed.graph(_in_order(out)), pmax.name


def _target_rows(f, target: str, box: tuple, lead: tuple, src: str) -> tuple[list, str]:
    """Nodes giving the [M_full] target of all of y's rows from the [M] one of the rows the
    slices keep: a kept row's target, -1 (no column) for a row they drop; and its name."""
    def T(shape, dtype="i64"):
        return ir.TensorType(tuple(shape), dtype)

    shape = list(lead)
    for d, start, end in box:
        shape[d] = end - start
    cur = ir.View(f(f"{target}_kept"), T(shape), "reshape", target, tuple(shape), src)
    nodes = [cur]
    for d, start, end in box:  # widen dim d: read at the clamped kept row, -1 outside [start, end)
        shape[d] = lead[d]
        io = ir.Iota(f("rows"), T(shape), d, src)
        c_start = ir.Constant(f("row_start"), T(()), start, src)
        c_end = ir.Constant(f("row_end"), T(()), end, src)
        c_zero = ir.Constant(f("row_zero"), T(()), 0, src)
        c_last = ir.Constant(f("row_last"), T(()), end - start - 1, src)
        off = ir.Map(f("row_offset"), T(shape), "sub", (io.name, c_start.name), src)
        lo = ir.Map(f("row_low"), T(shape), "max", (off.name, c_zero.name), src)
        idx = ir.Map(f("row_index"), T(shape), "min", (lo.name, c_last.name), src)
        read = ir.Gather(f(f"{target}_read"), T(shape), cur.name, idx.name, d, src)
        ge = ir.Map(f("row_ge"), T(shape, "bool"), "ge", (io.name, c_start.name), src)
        lt = ir.Map(f("row_lt"), T(shape, "bool"), "lt", (io.name, c_end.name), src)
        inside = ir.Map(f("row_inside"), T(shape, "bool"), "and", (ge.name, lt.name), src)
        none = ir.Constant(f("no_target"), T(()), -1, src)
        cur = ir.Map(f(f"{target}_full"), T(shape), "where", (inside.name, read.name, none.name), src)
        nodes += [io, c_start, c_end, c_zero, c_last, off, lo, idx, read, ge, lt, inside, none, cur]
    flat = ir.View(f(f"{target}_all_rows"), T((math.prod(lead),)), "reshape", cur.name, (math.prod(lead),), src)
    return nodes + [flat], flat.name


def _kept_rows(f, x: str, name: str, box: tuple, lead: tuple, tail: tuple, dtype: str, src: str) -> list:
    """Views of x ([M_full, *tail], a value per row of y) down to the rows the slices keep,
    [M, *tail], the last of them called `name`."""
    shape = tuple(lead) + tail
    out = [ir.View(f(f"{x}_rows"), ir.TensorType(shape, dtype), "reshape", x, shape, src)]
    for d, start, end in box:
        shape = shape[:d] + (end - start,) + shape[d + 1:]
        out.append(ir.View(f(f"{x}_kept"), ir.TensorType(shape, dtype), "slice", out[-1].name, (d, start, end, 1), src))
    m = math.prod(shape[:len(lead)])
    out.append(ir.View(name, ir.TensorType((m,) + tail, dtype), "reshape", out[-1].name, (m,) + tail, src))
    return out


def _in_order(nodes: list) -> list:
    """`nodes` as given, but for a node needed before it appears (the target, when the graph
    defines it after the cross-entropy's max): that one moves up, just before its first reader."""
    by = {n.name: n for n in nodes}
    placed: set[str] = set()
    out = []
    for first in nodes:
        stack = [(first, False)]
        while stack:
            n, ready = stack.pop()
            if n.name in placed:
                continue
            if ready:
                placed.add(n.name)
                out.append(n)
                continue
            stack.append((n, True))
            stack.extend((by[a], False) for a in reversed(ir.node_args(n)) if a in by and a not in placed)
    return out


def _fused(g: ir.Graph, pmax: str, v: int) -> bool:
    """Does the planner put the partials whose max is `pmax` into a GEMM's epilogue (that of a
    product of V columns: the LM head's)?"""
    from ..contraction import GemmSpec, match

    users = g.users()
    m, t = g[pmax].type.shape
    for n in g.nodes:
        if isinstance(n, ir.Contraction) and n.type.shape[-1] == v and math.prod(n.type.shape[:-1]) == m:
            spec = match(g, n, users)
            if isinstance(spec, GemmSpec) and pmax in spec.outs:
                return True
    return False


def lmhead_ce_partials(g: ir.Graph, width: int = PARTIAL_WIDTH) -> ir.Graph:
    users = g.users()
    found = [ce for n in g.nodes if isinstance(n, ir.Reduce) for ce in [_find(g, users, n.name)] if ce]
    out = g
    for ce in found:  # (each rewrite leaves the other cross-entropies' nodes as they are)
        new, pmax = _rewrite(out, ce, width)
        if _fused(new, pmax, g[ce.z].type.shape[1]):
            out = new
    return out


@dataclass(frozen=True)
class Partials:
    """What the planner puts in a GEMM's epilogue after its output y (see the module docstring):
    `members` the graph nodes it computes there, `outs` the [M, T] tensors it writes."""

    source: str                     # y, the epilogue's value the partials reduce
    width: int
    members: tuple[str, ...]
    lse: tuple[str, str]            # (pmax, psum)
    select: tuple[str, str] | None  # (psel, target)

    @property
    def outs(self) -> tuple[str, ...]:
        return self.lse + ((self.select[0],) if self.select else ())


def _pad_after(g: ir.Graph, users, y: str) -> tuple[list[str], str, int] | None:
    """(members, yp, padded width) for yp = where(j < V, gather(y, last, min(j, V - 1)), -inf),
    the -inf padding the rule puts after y when W does not divide V; None otherwise."""
    yt = g[y].type
    v, rank = yt.shape[-1], len(yt.shape)
    read = users[y][0]
    r = g[read]
    if not (isinstance(r, ir.Gather) and r.arg == y and r.axis == rank - 1 and len(users[read]) == 1
            and r.type.shape[:-1] == yt.shape[:-1] and r.type.shape[-1] > v):
        return None
    tw = r.type.shape[-1]

    def columns(name: str) -> bool:
        n = g[name]
        return isinstance(n, ir.Iota) and n.axis == 0 and n.type.shape == (tw,)

    index = g[r.index]
    row = g[index.arg] if isinstance(index, ir.View) else None
    clamp = _map(g, row.arg, "min") if isinstance(row, ir.View) else None
    if not (clamp is not None and index.op == "expand" and row.op == "reshape"
            and row.type.shape == (1,) * (rank - 1) + (tw,)
            and columns(clamp.args[0]) and _const(g, clamp.args[1], v - 1)
            and users[r.index] == [read] and users[index.arg] == [r.index] and users[row.arg] == [index.arg]):
        return None
    padded = users[read][0]
    p = _map(g, padded, "where")
    if p is None or p.args[1] != read or not _const(g, p.args[2], float("-inf")):
        return None
    inside = _map(g, p.args[0], "lt")
    if inside is None or not (columns(inside.args[0]) and _const(g, inside.args[1], v)) or users[p.args[0]] != [padded]:
        return None
    return [row.arg, index.arg, r.index, read, p.args[0], padded], padded, tw


def partials_after(g: ir.Graph, users, z: str) -> Partials | None:
    """The partials the rule above leaves after z (an epilogue value [..., V] read by nothing
    else), or None: z3 = reshape(z, [M, T, W]), or of z padded to T W columns with -inf, read
    only by pmax, the shifted exp of psum and the target select of psel, each intermediate read
    only inside that pattern."""
    zt = g[z].type
    if len(zt.shape) < 2 or len(users[z]) != 1 or z in g.outputs:
        return None
    v = zt.shape[-1]
    m = math.prod(zt.shape[:-1])
    members, grouped, tw = [], z, v
    pad = _pad_after(g, users, z)
    if pad is not None:
        members, grouped, tw = pad
        if len(users[grouped]) != 1:
            return None
    z3 = users[grouped][0]
    n3 = g[z3]
    if not (isinstance(n3, ir.View) and n3.op == "reshape" and n3.arg == grouped and len(n3.type.shape) == 3
            and n3.type.shape[0] == m and n3.type.shape[1] * n3.type.shape[2] == tw):
        return None
    t, w = n3.type.shape[1:]
    if tw != v and (t - 1) * w >= v:  # padding beyond the last group: not the rule's
        return None
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
    members += [z3, pmax, pmk, empty, shift, d, e, psum]
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
                and isinstance(g[c.arg], ir.Iota) and g[c.arg].type.shape == (tw,)
                and isinstance(tv, ir.View) and tv.op == "reshape" and tv.type.shape == (m, 1, 1)
                and users[tg] == [hit] and g[tv.arg].type.shape == (m,) and g[tv.arg].type.dtype == "i64"):
            return None
        members += [cols, tg, hit, sel, psel]
        select = (psel, tv.arg)
    order = {n.name: i for i, n in enumerate(g.nodes)}
    return Partials(z, w, tuple(sorted(members, key=order.get)), (pmax, psum), select)

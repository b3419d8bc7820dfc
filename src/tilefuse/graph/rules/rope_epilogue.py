"""RoPE on adjacent pairs moved onto the projection's output, where a GEMM epilogue can do it.

    p = x @ Wq                       (B, S, H*D)
    q = permute(view(p, B, S, H, D), 0, 2, 1, 3)                 (B, H, S, D)
                                    (at S = 1, a decode step's, that permute is a reshape)
    x0, x1 = q[..., 0::2], q[..., 1::2]     (through a view to (..., D/2, 2) and two slices)
    r = stack((x0 cos - x1 sin, x0 sin + x1 cos), -1) viewed (B, H, S, D)

becomes the same arithmetic on p's own columns, before the head view and the transpose:

    e, o = p[..., 0::2], p[..., 1::2]                            (B, S, H*D/2)
    r' = stack((e C - o S, e S + o C), -1) viewed (B, S, H*D)    C[b, s, h*D/2 + i] = cos[s, i]
    r = permute(view(r', B, S, H, D), 0, 2, 1, 3)

Column 2j + p of p is head j // (D/2), pair element p of pair j % (D/2): the slices pick the
same values, the tables C and S (views of cos and sin repeated over heads and batch, made once
here and shared by Q and K) hold the same angles, and every operation is the same, in the same
order: the result is the same bits. The GEMM reads C and S through their views from the small
tables themselves (contraction.py), so no repeated copy is ever made. What it buys: the pair
slices of a GEMM's output, maps of them with tile operands, and `stack` of the two halves
viewed back to full width are what a pairwise GEMM epilogue computes (`contraction.match`), so
the rotation runs in the projection's epilogue instead of as slice and stack copies in
PyTorch. It runs after weight folding (the tables must be weights: `cos[:S]` of a buffer is
folded by then); the native Llama block's RoPE takes this form (`models/llama.py`,
`apply_rope`).
"""
from __future__ import annotations

from .. import ir
from ..contraction import stack_halves
from ..rewrites import substitute
from .match import Editor, peel_casts, prune


def _half(g: ir.Graph, name: str, parity: int, src: str | None) -> str | None:
    """The tensor whose pair element `parity` `name` is: name = view(slice(view(X, ..., D/2, 2),
    -1, parity), ...); returns X (checked to be the same X as `src` when given)."""
    r = g[name]
    if not (isinstance(r, ir.View) and r.op == "reshape"):
        return None
    s = g[r.arg]
    if not (isinstance(s, ir.View) and s.op == "slice"):
        return None
    rank = len(s.type.shape)
    dim, start, end, step = s.params
    if dim % rank != rank - 1 or (start, end, step) != (parity, parity + 1, 1) or s.type.shape[-1] != 1:
        return None
    v = g[s.arg]
    if not (isinstance(v, ir.View) and v.op == "reshape" and v.type.shape[-1] == 2):
        return None
    if r.type.shape != v.type.shape[:-1]:
        return None
    return v.name if src in (None, v.name) else None


def _rotation(g: ir.Graph, a: str, b: str):
    """(x0, x1, cos, sin) when a = x0*cos - x1*sin and b = x0*sin + x1*cos, each product in
    either operand order, cos and sin weights (through casts); else None."""
    na, nb = g[a], g[b]
    if not (isinstance(na, ir.Map) and na.op == "sub" and isinstance(nb, ir.Map) and nb.op == "add"):
        return None

    def prod(name):
        n = g[name]
        return tuple(n.args) if isinstance(n, ir.Map) and n.op == "mul" and len(n.args) == 2 else None

    terms = [prod(x) for x in na.args + nb.args]
    if None in terms:
        return None
    for x0, c in (terms[0], terms[0][::-1]):
        for x1, s in (terms[1], terms[1][::-1]):
            if set(terms[2]) == {x0, s} and set(terms[3]) == {x1, c} and len({x0, x1, c, s}) == 4:
                if all(isinstance(g[peel_casts(g, t)], ir.Weight) for t in (c, s)):
                    return x0, x1, c, s
    return None


def _unit_transpose(g: ir.Graph, t) -> bool:
    """t is the heads' transpose (B, 1, H, D) -> (B, H, 1, D) of one position, which moves only a
    dim of size 1 and so is a reshape (rewrites.unit_permutes_as_reshapes): a decode step's."""
    if t.op != "reshape" or len(t.type.shape) != 4:
        return False
    src = g[t.arg].type.shape
    return len(src) == 4 and src[1] == 1 and tuple(t.type.shape) == (src[0], src[2], 1, src[3])


def _match(g: ir.Graph, users, st):
    """Everything one RoPE rewrite needs, or None: (p, heads, D, view (the stack's full-width
    reshape), its users' cast if it is the only one, x0, x1, cos, sin, the f32 cast of q)."""
    pair = stack_halves(st)
    if pair is None or len(users[st.name]) != 1:
        return None
    full = g[users[st.name][0]]
    if not (isinstance(full, ir.View) and full.op == "reshape" and full.type.shape == st.type.shape[:-2] + (
            2 * st.type.shape[-2],)):
        return None
    rot = _rotation(g, *pair)
    if rot is None:
        return None
    x0, x1, cos, sin = rot
    src = _half(g, x0, 0, None)
    if src is None or _half(g, x1, 1, src) != src:
        return None
    qf = g[g[src].arg]  # (B, H, S, D) in f32: a cast of the transposed head view, or that view itself
    t = g[qf.args[0]] if isinstance(qf, ir.Map) and qf.op == "cast" else qf
    if not (isinstance(t, ir.View) and (t.op == "permute" and tuple(t.params) == (0, 2, 1, 3) or _unit_transpose(g, t))):
        return None
    heads_view = g[t.arg]
    if not (isinstance(heads_view, ir.View) and heads_view.op == "reshape" and len(heads_view.type.shape) == 4):
        return None
    p = heads_view.arg
    B, S, H, D = heads_view.type.shape
    if g[p].type.shape != (B, S, H * D) or D % 2 or tuple(full.type.shape) != (B, H, S, D):
        return None
    for tab in (cos, sin):  # one angle per position and pair, broadcast over batch and heads
        shape = g[tab].type.shape
        if (1,) * (4 - len(shape)) + tuple(shape) != (1, 1, S, D // 2):
            return None
    cast = None
    if len(users[full.name]) == 1:
        u = g[users[full.name][0]]
        if isinstance(u, ir.Map) and u.op == "cast":
            cast = u
    return p, H, D, full, cast, qf, cos, sin


def _table_views(ed: Editor, g: ir.Graph, name: str, B: int, H: int, src: str) -> list[ir.View]:
    """Views of a (..., S, D/2) table as (B, S, H*D/2), the angle of column h*D/2 + i at row
    (b, s): reshape to (1, S, 1, D/2), expand over batch and heads, reshape. Views, not a new
    weight: the GEMM epilogue reads the table itself at (m % S, n % (D/2)) (contraction.py,
    loop/views.py), B*H times fewer bytes than a repeated copy (1 MB against 32 MB in bf16 for
    the 7B layer at S = 8192), small enough to stay in L2."""
    t = g[name].type
    S, half = t.shape[-2:]
    tt = lambda *shape: ir.TensorType(shape, t.dtype)  # noqa: E731
    r = ir.View(ed.fresh(f"{name}_bshd"), tt(1, S, 1, half), "reshape", name, (1, S, 1, half), src)
    e = ir.View(ed.fresh(f"{name}_bcast"), tt(B, S, H, half), "expand", r.name, (B, S, H, half), src)
    c = ir.View(ed.fresh(f"{name}_tiled"), tt(B, S, H * half), "reshape", e.name, (B, S, H * half), src)
    return [r, e, c]


def rope_into_projection(g: ir.Graph) -> ir.Graph:
    """Each adjacent-pair RoPE of a transposed head view moves onto the projection's columns."""
    users = g.users()
    found = {}
    for n in g.nodes:
        m = _match(g, users, n)
        if m is not None:
            found[n.name] = m
    if not found:
        return g
    ed = Editor(g)
    emit: dict[str, list] = {}
    replace_by: dict[str, str] = {}
    made: dict[tuple, str] = {}  # (table, B, H) -> its view over heads and batch: Q and K share them
    for st_name, (p, H, D, full, cast, qf, cos, sin) in found.items():
        B, S, N = g[p].type.shape
        f32 = qf.type.dtype
        src = g[st_name].source
        tt = lambda shape, dt=f32: ir.TensorType(tuple(shape), dt)  # noqa: E731
        nodes = []
        x = p
        if g[p].type.dtype != f32:
            c = ir.Map(ed.fresh(f"{p}_{f32}"), tt((B, S, N)), "cast", (p,), src)
            nodes.append(c)
            x = c.name
        e = ir.View(ed.fresh(f"{x}_even"), tt((B, S, N // 2)), "slice", x, (2, 0, N, 2), src)
        o = ir.View(ed.fresh(f"{x}_odd"), tt((B, S, N // 2)), "slice", x, (2, 1, N, 2), src)
        nodes += [e, o]
        tabs = []
        for name in (cos, sin):
            if (name, B, H) not in made:
                views = _table_views(ed, g, name, B, H, src)
                nodes += views
                made[(name, B, H)] = views[-1].name
            tabs.append(made[(name, B, H)])
        ct, sn = tabs
        mul = lambda a, b: ir.Map(ed.fresh("rope_mul"), tt((B, S, N // 2)), "mul", (a, b), src)  # noqa: E731
        m0, m1, m2, m3 = mul(e.name, ct), mul(o.name, sn), mul(e.name, sn), mul(o.name, ct)
        a = ir.Map(ed.fresh("rope_even"), tt((B, S, N // 2)), "sub", (m0.name, m1.name), src)
        b = ir.Map(ed.fresh("rope_odd"), tt((B, S, N // 2)), "add", (m2.name, m3.name), src)
        st = ir.Extern(ed.fresh("rope_stack"), tt((B, S, N // 2, 2)), "aten.stack.default",
                       ((ir.Ref(a.name), ir.Ref(b.name)), -1), (), g[st_name].reason, src)
        r = ir.View(ed.fresh("rope_cols"), tt((B, S, N)), "reshape", st.name, (B, S, N), src)
        nodes += [m0, m1, m2, m3, a, b, st, r]
        last, dt, old = r.name, f32, full.name
        if cast is not None:  # round where the program did, before the transpose (a cheaper output)
            rc = ir.Map(ed.fresh("rope_cast"), tt((B, S, N), cast.type.dtype), "cast", (r.name,), src)
            nodes.append(rc)
            last, dt, old = rc.name, cast.type.dtype, cast.name
        hv = ir.View(ed.fresh("rope_heads"), tt((B, S, H, D), dt), "reshape", last, (B, S, H, D), src)
        # at one position the transpose moves a unit dim only: a reshape (an alias, not a copy)
        op, params = ("reshape", (B, H, S, D)) if S == 1 else ("permute", (0, 2, 1, 3))
        tr = ir.View(ed.fresh("rope_bhsd"), tt((B, H, S, D), dt), op, hv.name, params, src)
        nodes += [hv, tr]
        emit[st_name] = nodes
        replace_by[old] = tr.name
    out = []
    for node in g.nodes:
        out.extend(emit.get(node.name, [node]))
    # the old results' readers read the new ones; what only the old chain read is pruned
    return prune(substitute(ir.Graph(tuple(out), g.inputs, g.outputs, ed.weights, g.writes, g.layouts), replace_by))

"""Hugging Face's rotate-half RoPE rewritten into the adjacent-pair form, on permuted Q/K weights.

transformers (Llama, Qwen2) rotates element i of each head with element i + D/2:

    q = permute(view(p, B, S, H, D), 0, 2, 1, 3)                 p = x @ Wq (+ bias, row scales)
    r = q * cos + cat(-q[..., D/2:], q[..., :D/2]) * sin         cos[..., i] == cos[..., i + D/2]

That is the adjacent-pair rotation of pairs (2j, 2j+1) once each head's dims are put in the order
P = (0, D/2, 1, D/2 + 1, ...). Permuting the rows of Wq (and of its bias) per head by P, once
here, makes the projection produce q' = q[..., P] itself; then

    x0, x1 = q'[..., 0::2], q'[..., 1::2]                        (= q[..., :D/2], q[..., D/2:])
    r' = stack((x0 c - x1 s, x0 s + x1 c), -1) viewed (B, H, S, D)   c, s = cos, sin[..., :D/2]

is r[..., P], element for element the same arithmetic at the same precision (x0 c + (-x1) s
rounds like x0 c - x1 s; the second half's sum only swaps operands): the same bits. r' is the
native Llama form (models/llama.py `apply_rope`) that `rope_into_projection` moves into the
projection's GEMM epilogue, so this rule only rewrites the form and the weights and lets that
rule (and contraction.match's pairwise epilogue) do the rest: no cat, neg or slice copies remain.

Why the output is unchanged: q and k leave in the permuted order, and attention reads them
only through q . k, a sum over the head dims that any common permutation of q's and k's dims
leaves the same function (the summation order changes, so not always the same bits). The rule
therefore fires only when every rotated tensor is read by attention alone, as its q or k
(through views that keep the head dim last and whole: GQA's repeat), and the attention reading
one rotated side reads a rotated other side; a rotated q or k that is returned, cached
(past_key_values) or read anywhere else, or an unrotated projection output read elsewhere,
leaves the graph alone. cos and sin must be weights (folded from the position ids after
`fold_weights`) whose halves are checked equal, so it runs after folding, before
`rope_into_projection`.
"""
from __future__ import annotations

import torch

from .. import ir
from ..contraction import last_dim_pair
from ..rewrites import substitute
from .match import Editor, peel_casts, prune, row_vector, value, weight_operand


def _table(g: ir.Graph, name: str, S: int, D: int) -> str | None:
    """The weight (through casts) under `name` if it broadcasts as (1, 1, S, D) over (B, H, S, D)
    and repeats each angle: t[..., i] == t[..., i + D/2]."""
    w = peel_casts(g, name)
    n = g[w]
    if not isinstance(n, ir.Weight) or name != w:  # a cast would change the rounding of the products
        return None
    shape = (1,) * (4 - len(n.type.shape)) + tuple(n.type.shape)
    if len(shape) != 4 or shape != (1, 1, S, D):
        return None
    v = value(g, w)
    h = D // 2
    return w if torch.equal(v[..., :h], v[..., h:]) else None


def _slice_of(g: ir.Graph, name: str, q: str, start: int, end: int) -> bool:
    n = g[name]
    if not (isinstance(n, ir.View) and n.op == "slice" and n.arg == q):
        return False
    rank = len(n.type.shape)
    dim, s, e, step = n.params
    return dim % rank == rank - 1 and (s, e, step) == (start, end, 1)


def _rotate_half(g: ir.Graph, name: str) -> str | None:
    """q when name = cat((neg(q[..., D/2:]), q[..., :D/2]), -1); else None."""
    c = g[name]
    pair = last_dim_pair(c, "aten.cat.default")
    if pair is None:
        return None
    neg, lo = g[pair[0]], pair[1]
    if not (isinstance(neg, ir.Map) and neg.op == "neg" and isinstance(g[neg.args[0]], ir.View)):
        return None
    q = g[neg.args[0]].arg
    D = c.type.shape[-1]
    if g[q].type.shape != c.type.shape or D % 2:
        return None
    ok = _slice_of(g, neg.args[0], q, D // 2, D) and _slice_of(g, lo, q, 0, D // 2)
    return q if ok else None


def _products(g: ir.Graph, name: str):
    n = g[name]
    return tuple(n.args) if isinstance(n, ir.Map) and n.op == "mul" and len(n.args) == 2 else None


def _projection(g: ir.Graph, users, q: str):
    """(p, H, D, chain) for q = permute(view(p, B, S, H, D), 0, 2, 1, 3) where p is a weight
    contraction followed by maps whose other operands are per-row (last dim 1), scalars or
    per-column weight vectors (a bias): chain lists (node, {arg: 'bias'}) from the contraction
    up to p, each read only by the next. None otherwise."""
    t = g[q]
    if not (isinstance(t, ir.View) and t.op == "permute" and tuple(t.params) == (0, 2, 1, 3)):
        return None
    hv = g[t.arg]
    if not (isinstance(hv, ir.View) and hv.op == "reshape" and len(hv.type.shape) == 4) or users[hv.name] != [q]:
        return None
    p = hv.arg
    B, S, H, D = hv.type.shape
    N = H * D
    if g[p].type.shape != (B, S, N) or users[p] != [hv.name]:
        return None
    chain, cur = [], p
    while True:
        n = g[cur]
        if isinstance(n, ir.Contraction):
            if weight_operand(g, n.b) is None or n.type.shape[-1] != N:
                return None
            chain.append((n, {}))
            break
        if not (isinstance(n, ir.Map) and n.type.shape[-1] == N):
            return None
        along = [a for a in n.args if g[a].type.shape and g[a].type.shape[-1] == N
                 and not (row_vector(g, a, N) and g[a].type.shape != n.type.shape)]
        if len(along) != 1:
            return None
        roles = {}
        for a in n.args:
            if a == along[0]:
                continue
            s = g[a].type.shape
            if row_vector(g, a, N) and isinstance(g[a], ir.Weight):
                roles[a] = "bias"
            elif not (len(s) == 0 or s[-1] == 1):
                return None
        chain.append((n, roles))
        nxt = along[0]
        if users[nxt] != [cur]:
            return None
        cur = nxt
    return p, H, D, chain[::-1]


def _reaches_attention_only(g: ir.Graph, users, name: str, D: int, outputs) -> list[tuple[str, str]] | None:
    """[(attention, 'q' | 'k')] reading `name`, when nothing else does: only views keeping the
    last dim whole and last (reshapes, expands, slices of other dims, permutes fixing it) lead
    there. None when anything else reads it or it is an output."""
    out, stack = [], [name]
    while stack:
        cur = stack.pop()
        if cur in outputs:
            return None
        for u in users[cur]:
            n = g[u]
            if isinstance(n, ir.Attention):
                if n.v == cur or n.mask == cur or (n.q == cur) == (n.k == cur):
                    return None
                out.append((u, "q" if n.q == cur else "k"))
                continue
            if not isinstance(n, ir.View) or n.type.shape[-1] != D:
                return None
            rank = len(n.type.shape)
            if n.op == "permute" and tuple(n.params)[-1] % rank != rank - 1:
                return None
            if n.op == "slice" and n.params[0] % rank == rank - 1:
                return None
            if n.op not in ("reshape", "expand", "permute", "slice", "unsqueeze", "squeeze"):
                return None
            stack.append(u)
    return out


def _match(g: ir.Graph, users, r):
    """(q, projection, cos, sin, products' dtype, sum's dtype) for r = q*cos + rotate_half(q)*sin."""
    if not (isinstance(r, ir.Map) and r.op == "add" and len(r.type.shape) == 4):
        return None
    terms = [_products(g, a) for a in r.args]
    if None in terms:
        return None
    for direct, rotated in (terms, terms[::-1]):
        for q, c in (direct, direct[::-1]):
            for cat, s in (rotated, rotated[::-1]):
                if _rotate_half(g, cat) != q or g[q].type.shape != r.type.shape:
                    continue
                B, H, S, D = r.type.shape
                cos, sin = _table(g, c, S, D), _table(g, s, S, D)
                if cos is None or sin is None:
                    continue
                # q is read only by this rotation (its product, two slices); the cat and its neg by it alone
                halves = [u for u in users[q] if isinstance(g[u], ir.View)]
                mul_q = [a for a in r.args if _products(g, a) == direct][0]
                mul_r = [a for a in r.args if a != mul_q][0]
                neg = g[cat].args[0][0].name
                if sorted(users[q]) != sorted([mul_q] + halves) or len(halves) != 2:
                    continue
                if users[mul_q] != [r.name] or users[mul_r] != [r.name] or users[cat] != [mul_r]:
                    continue
                if users[neg] != [cat] or any(len(users[h]) != 1 for h in halves):
                    continue
                proj = _projection(g, users, q)
                if proj is None:
                    continue
                dts = {g[mul_q].type.dtype, g[mul_r].type.dtype}
                if len(dts) != 1 or g[q].type.dtype != g[cat].type.dtype:
                    continue
                return q, proj, cos, sin, dts.pop(), r.type.dtype
    return None


def _permutation(H: int, D: int) -> torch.Tensor:
    """Column n' = h*D + 2j + e of the new projection is column h*D + j + e*D/2 of the old."""
    k = torch.arange(D)
    per_head = (k // 2) + (k % 2) * (D // 2)
    return (torch.arange(H)[:, None] * D + per_head[None, :]).reshape(-1)


def rotate_half_to_pairs(g: ir.Graph) -> ir.Graph:
    """Each rotate-half RoPE read only by attention becomes the adjacent-pair form on Q/K
    projections whose weights (and biases) are permuted per head."""
    users = g.users()
    outputs = set(g.outputs)
    found = {}
    for n in g.nodes:
        m = _match(g, users, n)
        if m is None:
            continue
        reads = _reaches_attention_only(g, users, n.name, n.type.shape[-1], outputs)
        if not reads:
            continue
        found[n.name] = (m, reads)
    # every attention reading a rotated side reads rotated q and k, both permuted alike
    sides: dict[str, set] = {}
    for _, reads in found.values():
        for att, side in reads:
            sides.setdefault(att, set()).add(side)
    bad = {a for a, s in sides.items() if s != {"q", "k"}}
    found = {k: v for k, v in found.items() if not any(a in bad for a, _ in v[1])}
    if not found:
        return g
    ed = Editor(g)
    emit: dict[str, list] = {}
    replace: dict[str, ir.Node] = {}  # projection-chain nodes rebuilt on permuted weights
    replace_by: dict[str, str] = {}
    halves: dict[str, str] = {}  # (S, D) table -> its first half, a new weight shared by q and k
    for r_name, ((q, (p, H, D, chain), cos, sin, pdt, sdt), _) in found.items():
        src = g[r_name].source
        perm = _permutation(H, D)
        nodes = []
        for node, roles in chain:
            if isinstance(node, ir.Contraction):
                wo = weight_operand(g, node.b)
                kn = wo.matrix(g, exact=True)[:, perm]
                wn, b = ed.operand(f"{wo.weight}_pairs", kn, wo, g[wo.weight].type.dtype,
                                   f"{g[wo.weight].source or wo.weight} rows permuted per head to (i, i + D/2) pairs",
                                   node.source)
                emit.setdefault(node.name, []).extend(wn)
                replace[node.name] = ir.Contraction(node.name, node.type, node.a, b, node.source)
            else:
                args = list(node.args)
                for i, a in enumerate(args):
                    if roles.get(a) == "bias":
                        v = value(g, a)
                        nb = ed.weight(f"{a}_pairs", v.reshape(-1)[perm].reshape(v.shape), g[a].type.dtype,
                                       g[a].source)
                        emit.setdefault(node.name, []).append(nb)
                        args[i] = nb.name
                replace[node.name] = ir.Map(node.name, node.type, node.op, tuple(args), node.source)
        B, _, S, _ = g[r_name].type.shape
        h = D // 2
        tabs = []
        for t in (cos, sin):
            if t not in halves:
                v = value(g, t)
                w = ed.weight(f"{t}_half", v[..., :h], g[t].type.dtype, g[t].source)
                nodes.append(w)
                halves[t] = w.name
            tabs.append(halves[t])
        c, s = tabs
        qt = g[q].type
        tt = lambda shape, dt: ir.TensorType(tuple(shape), dt)  # noqa: E731
        pv = ir.View(ed.fresh(f"{q}_pairs"), tt((B, H, S, h, 2), qt.dtype), "reshape", q, (B, H, S, h, 2), src)
        nodes.append(pv)
        xs = []
        for e in (0, 1):
            sl = ir.View(ed.fresh(f"{q}_pair{e}"), tt((B, H, S, h, 1), qt.dtype), "slice", pv.name, (4, e, e + 1, 1),
                         src)
            x = ir.View(ed.fresh(f"{q}_x{e}"), tt((B, H, S, h), qt.dtype), "reshape", sl.name, (B, H, S, h), src)
            nodes += [sl, x]
            xs.append(x.name)
        x0, x1 = xs
        mul = lambda a, b: ir.Map(ed.fresh("rope_mul"), tt((B, H, S, h), pdt), "mul", (a, b), src)  # noqa: E731
        m0, m1, m2, m3 = mul(x0, c), mul(x1, s), mul(x0, s), mul(x1, c)
        a = ir.Map(ed.fresh("rope_first"), tt((B, H, S, h), sdt), "sub", (m0.name, m1.name), src)
        b = ir.Map(ed.fresh("rope_second"), tt((B, H, S, h), sdt), "add", (m2.name, m3.name), src)
        st = ir.Extern(ed.fresh("rope_pairs"), tt((B, H, S, h, 2), sdt), "aten.stack.default",
                       ((ir.Ref(a.name), ir.Ref(b.name)), -1), (), "RoPE pairs (2j, 2j+1)", src)
        full = ir.View(ed.fresh("rope_full"), tt((B, H, S, D), sdt), "reshape", st.name, (B, H, S, D), src)
        nodes += [m0, m1, m2, m3, a, b, st, full]
        emit.setdefault(r_name, []).extend(nodes)
        replace_by[r_name] = full.name
    out = []
    for node in g.nodes:
        if node.name in replace:
            out.extend(emit.get(node.name, []))
            out.append(replace[node.name])
        elif node.name in replace_by:
            out.extend(emit[node.name])
            out.append(node)  # read until `substitute` points its readers at the new result; pruned then
        else:
            out.append(node)
    return prune(substitute(ir.Graph(tuple(out), g.inputs, g.outputs, ed.weights, g.writes, g.layouts), replace_by))

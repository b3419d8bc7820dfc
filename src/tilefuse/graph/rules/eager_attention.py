"""Attention written out in ops (transformers' "eager" attention) as one Attention node: SDPA.

    s = q @ kᵀ [· c | / c] [+ mask];  p = softmax(s, -1) [to v's dtype];  o = p @ v
      ->  attention(q, k, v, scale = c | 1/c | 1, mask)

GPT-J computes its attention so, and any model loaded with attn_implementation="eager" (the
default where a model has no SDPA path). In PyTorch the scores are written whole ([B, H, S, S]:
GPT-J's are f32, 1 GB a layer at 32 heads and 2 x 2048 tokens), read back by the softmax, whose
probabilities are written and read by the second matmul, and GPT-J's two matmuls run in f32 on
the CUDA cores. SDPA (flash or memory-efficient attention) keeps the scores on chip.

The values: flash attention multiplies the 16-bit q and k, sums in f32, takes the softmax in f32
and rounds the probabilities to 16 bits for p @ v with f32 sums. GPT-J's f32 matmul of q and k
cast from bf16 is that sum (each product of two bf16 values is exact in f32); its softmax is f32
and its probabilities are rounded to bf16 for p @ v. Where the eager matmul is a 16-bit one
(Llama's eager path) its scores are rounded to 16 bits before the softmax; SDPA's are not, so it
is nearer the exact result than eager. Dividing by c becomes multiplying by 1/c (one rounding
of the scale, as SDPA's own `scale` is applied).

Taken only where: q and k (under float casts) and v are one 16-bit dtype with the same leading
dims (a repeated KV has full heads: `repeated_kv_into_attention` strips the repeat after); the
scores are q times k with its last two dims swapped; the scale is a scalar constant; the mask, if
any, is a float tensor added to the scores that broadcasts to them (cast to q's dtype where it is
another, its lowest values first clamped to that dtype's lowest, so that a row masked whole stays
finite, as eager's); the softmax is over the last dim; the probabilities reach p @ v in v's dtype;
and nothing else reads the scores, the probabilities or a step between them (a model returning
its attention weights keeps them).
"""
from __future__ import annotations

import torch

from ... import dtypes
from .. import ir
from .match import Editor, float_cast, peel_casts, prune, value

SIXTEEN = ("bf16", "f16")


def _casts(g: ir.Graph, name: str, chain: list) -> str:
    """peel_casts, recording the casts passed in `chain`."""
    while float_cast(g, name):
        chain.append(name)
        name = g[name].args[0]
    return name


def _last_reduce(g: ir.Graph, name: str, op: str, of: str) -> bool:
    n = g[name]
    rank = len(g[of].type.shape)
    return (isinstance(n, ir.Reduce) and n.op == op and n.arg == of and n.keepdim
            and tuple(a % rank for a in n.axes) == (rank - 1,))


def _softmax(g: ir.Graph, name: str, chain: list) -> str | None:
    """x for name = exp(x - max(x)) / sum(exp(x - max(x))) over the last dim (frontend.aten's
    softmax), the nodes passed recorded in `chain`; else None."""
    d = g[name]
    if not (isinstance(d, ir.Map) and d.op == "div"):
        return None
    e, s = d.args
    ex = g[e]
    if not (_last_reduce(g, s, "sum", e) and isinstance(ex, ir.Map) and ex.op == "exp"):
        return None
    sub = g[ex.args[0]]
    if not (isinstance(sub, ir.Map) and sub.op == "sub" and _last_reduce(g, sub.args[1], "max", sub.args[0])):
        return None
    chain += [name, s, e, ex.args[0], sub.args[1]]
    return sub.args[0]


def _constant(g: ir.Graph, name: str) -> float | None:
    """A float scalar's value: a constant, or a weight of one element (GPT-J's scale_attn buffer)."""
    n = g[peel_casts(g, name)]
    if not dtypes.is_float(n.type.dtype):
        return None
    if isinstance(n, ir.Constant) and not isinstance(n.value, bool):
        return float(n.value)
    if isinstance(n, ir.Weight) and n.type.numel == 1:
        return float(value(g, n.name).reshape(()))
    return None


def _scores(g: ir.Graph, name: str, chain: list):
    """(scores contraction, scale, mask) for name = [mask +] scores [· c | / c] (either order),
    through float casts; else None."""
    name = _casts(g, name, chain)
    mask = None
    n = g[name]
    if isinstance(n, ir.Map) and n.op == "add":
        for s, m in (n.args, n.args[::-1]):
            inner: list = []
            under = _casts(g, s, inner)
            if _scaled(g, under) is not None:
                chain += [name] + inner
                name, mask = under, m
                break
        else:
            return None
    found = _scaled(g, name)
    if found is None:
        return None
    c, scale = found
    if c != name:
        chain.append(name)
    return c, scale, mask


def _scaled(g: ir.Graph, name: str):
    """(contraction, scale) for name = contraction [· c | c · | / c]; else None."""
    n = g[name]
    if isinstance(n, ir.Contraction):
        return name, 1.0
    if not (isinstance(n, ir.Map) and n.op in ("mul", "div")):
        return None
    a, b = n.args
    for x, c in ((a, b), (b, a)) if n.op == "mul" else ((a, b),):
        v = _constant(g, c)
        if v is not None and v != 0 and isinstance(g[x], ir.Contraction):
            return x, (v if n.op == "mul" else 1.0 / v)
    return None


def _transposed(g: ir.Graph, name: str, chain: list) -> str | None:
    """k for name = kᵀ (its last two dims swapped, under float casts either side); else None."""
    name = _casts(g, name, chain)
    n = g[name]
    rank = len(n.type.shape)
    swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
    if not (isinstance(n, ir.View) and n.op == "permute" and tuple(p % rank for p in n.params) == swap):
        return None
    chain.append(name)
    return _casts(g, n.arg, chain)


def _match(g: ir.Graph, pv: ir.Contraction):
    """(q, k, v, scale, mask, the nodes the pattern replaces) for pv = softmax(...) @ v; else None."""
    chain: list = []
    v = pv.b
    x = _softmax(g, _casts(g, pv.a, chain), chain)
    if x is None:
        return None
    found = _scores(g, x, chain)
    if found is None:
        return None
    s, scale, mask = found
    chain.append(s)
    qk = g[s]
    q = _casts(g, qk.a, chain)
    k = _transposed(g, qk.b, chain)
    if k is None:
        return None
    tq, tk, tv = g[q].type, g[k].type, g[v].type
    rank = len(tq.shape)
    if not (tq.dtype == tk.dtype == tv.dtype == pv.type.dtype and tq.dtype in SIXTEEN and g[pv.a].type.dtype == tv.dtype
            and rank >= 3 and len(tk.shape) == len(tv.shape) == rank
            and tq.shape[:-2] == tk.shape[:-2] == tv.shape[:-2] and tq.shape[-1] == tk.shape[-1]
            and tk.shape[-2] == tv.shape[-2]):
        return None
    if mask is not None:
        m = g[mask].type
        st = g[s].type.shape
        if (not dtypes.is_float(m.dtype) or len(m.shape) > len(st)
                or any(a not in (1, b) for a, b in zip(m.shape[::-1], st[::-1]))):
            return None
    return q, k, v, scale, mask, chain


def _private(g: ir.Graph, users, pv: str, chain: list) -> bool:
    """Nothing outside the pattern reads a node it replaces, and none is a result."""
    inside = set(chain) | {pv}
    return not any(x in g.outputs or any(u not in inside for u in users[x]) for x in chain)


def eager_attention_as_sdpa(g: ir.Graph) -> ir.Graph:
    users = g.users()
    ed, out, changed = Editor(g), [], False
    for n in g.nodes:
        found = _match(g, n) if isinstance(n, ir.Contraction) else None
        if found is None or not _private(g, users, n.name, found[5]):
            out.append(n)
            continue
        q, k, v, scale, mask, _ = found
        dt = g[q].type.dtype
        if mask is not None and g[mask].type.dtype != dt:
            mt = g[mask].type
            low = ir.Constant(ed.fresh("c"), ir.TensorType((), mt.dtype), torch.finfo(dtypes.to_torch(dt)).min, n.source)
            kept = ir.Map(ed.fresh(f"{mask}_floor"), mt, "max", (mask, low.name), n.source)
            cast = ir.Map(ed.fresh(f"{mask}_{dt}"), ir.TensorType(mt.shape, dt), "cast", (kept.name,), n.source)
            out += [low, kept, cast]
            mask = cast.name
        out.append(ir.Attention(n.name, n.type, q, k, v, False, scale, mask, n.source))
        changed = True
    return prune(ed.graph(out)) if changed else g

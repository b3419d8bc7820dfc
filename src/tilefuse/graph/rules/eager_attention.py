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

import math

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


def _regrouped(a: tuple, b: tuple) -> bool:
    """a and b differ only in how their leading dims are grouped: [B·H, S, T] and [B, H, S, T]."""
    return len(a) >= 3 and len(b) >= 3 and a[-2:] == b[-2:] and math.prod(a[:-2]) == math.prod(b[:-2])


def _through(g: ir.Graph, name: str, chain: list) -> str:
    """The tensor under float casts and reshapes that regroup leading dims (Bloom views its
    [B·H, S, T] scores as [B, H, S, T] for the mask and back for p @ v), recorded in `chain`."""
    while True:
        n = g[name]
        if not (float_cast(g, name) or isinstance(n, ir.View) and n.op == "reshape"
                and _regrouped(n.type.shape, g[n.arg].type.shape)):
            return name
        chain.append(name)
        name = n.args[0] if isinstance(n, ir.Map) else n.arg


def _scores(g: ir.Graph, name: str, chain: list, masks: list, depth: int = 0) -> tuple | None:
    """(scores contraction, scale) for name = scores [· c | / c] plus masks, in any order and
    grouping, through float casts and leading regroupings; each mask is appended to `masks` as
    (tensor, the scores' shape where it is added). None where no term is scores."""
    inner: list = []
    under = _through(g, name, inner)
    found = _scaled(g, under)
    if found is not None:
        chain += inner + ([under] if found[0] != under else [])
        return found
    n = g[under]
    if depth > 4 or not (isinstance(n, ir.Map) and n.op == "add"):
        return None
    hits = []
    for s, m in (n.args, n.args[::-1]):
        sub_chain, sub_masks = [], []
        got = _scores(g, s, sub_chain, sub_masks, depth + 1)
        if got is not None:
            hits.append((got, sub_chain, sub_masks, s, m))
    if not hits:
        return None
    # (where both sides are scaled matmuls, `q @ kᵀ · c + q @ rᵀ`, the second is a mask, computed
    # as before: _private refuses the pattern if that mask reads the scores themselves)
    got, sub_chain, sub_masks, s, m = hits[0]
    mt = g[m].type
    if (g[s].type.shape != n.type.shape or not dtypes.is_float(mt.dtype) or len(mt.shape) > len(n.type.shape)
            or any(a not in (1, b) for a, b in zip(mt.shape[::-1], n.type.shape[::-1]))):
        return None  # a mask that is not float, or that widens the scores
    chain += inner + [under] + sub_chain
    masks += sub_masks + [(m, n.type.shape)]
    return got


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
    """(q, k, v, scale, masks, the softmax's shape, the nodes the pattern replaces) for
    pv = softmax(...) @ v; else None."""
    chain: list = []
    v = pv.b
    x = _softmax(g, _through(g, pv.a, chain), chain)
    if x is None:
        return None
    masks: list = []
    found = _scores(g, x, chain, masks)
    if found is None:
        return None
    s, scale = found
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
            and tk.shape[-2] == tv.shape[-2] and _regrouped(g[x].type.shape, g[s].type.shape)
            and g[pv.a].type.shape[:-2] == tv.shape[:-2]  # p @ v batched as q and k are, no broadcast
            and math.prod(pv.type.shape[:-2]) == math.prod(tq.shape[:-2])):
        return None
    return q, k, v, scale, masks, g[x].type.shape, chain


def _private(g: ir.Graph, users, pv: str, chain: list) -> bool:
    """Nothing outside the pattern reads a node it replaces, and none is a result."""
    inside = set(chain) | {pv}
    return not any(x in g.outputs or any(u not in inside for u in users[x]) for x in chain)


class _Build:
    """The nodes a rewrite adds, with fresh names; masks built once for every layer adding the same ones."""

    def __init__(self, g: ir.Graph):
        self.g, self.ed, self.out, self.made = g, Editor(g), [], {}

    def add(self, n):
        self.out.append(n)
        return n.name

    def type(self, name: str) -> ir.TensorType:
        return self.made[name] if name in self.made else self.g[name].type

    def view(self, op: str, x: str, shape: tuple, source: str) -> str:
        t = ir.TensorType(tuple(shape), self.type(x).dtype)
        name = self.add(ir.View(self.ed.fresh(f"{x}_{op}"), t, op, x, tuple(shape), source))
        self.made[name] = t
        return name

    def map(self, op: str, args: tuple, t: ir.TensorType, base: str, source: str) -> str:
        name = self.add(ir.Map(self.ed.fresh(base), t, op, args, source))
        self.made[name] = t
        return name

    def constant(self, value: float, dtype: str, source: str) -> str:
        name = self.add(ir.Constant(self.ed.fresh("c"), ir.TensorType((), dtype), value, source))
        self.made[name] = ir.TensorType((), dtype)
        return name

    def regroup(self, x: str, lead: tuple, source: str) -> str:
        """x [..., S, D] viewed with leading dims `lead` (their product is x's): a reshape's argument
        of that shape is taken as it is, which SDPA reads in place where the reshape is not a view."""
        shape = tuple(lead) + self.type(x).shape[-2:]
        n = None if x in self.made else self.g[x]
        if self.type(x).shape == shape:
            return x
        if isinstance(n, ir.View) and n.op == "reshape" and self.g[n.arg].type.shape == shape:
            return n.arg
        return self.view("reshape", x, shape, source)

    def moved(self, m: str, at: tuple, space: tuple, source: str) -> str:
        """Mask m, added to scores of shape `at`, as a tensor that broadcasts to scores of shape
        `space` (the same scores, leading dims regrouped)."""
        if at == space:
            return m
        shape = (1,) * (len(at) - len(self.type(m).shape)) + self.type(m).shape
        if all(d == 1 for d in shape[:-2]):
            return self.view("reshape", m, (1,) * (len(space) - 2) + shape[-2:], source)
        if shape[:-2] != at[:-2]:  # broadcast along some leading dims but not all: made whole first
            m = self.view("expand", self.view("reshape", m, shape, source) if shape != self.type(m).shape else m,
                          at[:-2] + shape[-2:], source)
        return self.view("reshape", m, space[:-2] + shape[-2:], source)


def _mask(b: _Build, masks: list, space: tuple, dt: str, source: str) -> str | None:
    """One additive mask for SDPA in q's dtype: the masks summed in f32, their lowest values
    clamped to dt's lowest, so that a row masked whole stays finite, as eager's does (one mask
    already in dt is taken as it is). The same masks give the same node."""
    if not masks:
        return None
    key = (tuple(masks), space, dt)
    if key in b.made:
        return b.made[key]
    if len(masks) == 1 and masks[0][1] == space and b.type(masks[0][0]).dtype == dt:
        return masks[0][0]
    terms = [b.moved(m, at, space, source) for m, at in masks]
    f32 = [t if b.type(t).dtype == "f32" else
           b.map("cast", (t,), ir.TensorType(b.type(t).shape, "f32"), f"{t}_f32", source) for t in terms]
    total = f32[0]
    for t in f32[1:]:
        shape = tuple(torch.broadcast_shapes(b.type(total).shape, b.type(t).shape))
        total = b.map("add", (total, t), ir.TensorType(shape, "f32"), "mask_sum", source)
    shape = b.type(total).shape
    if dt != "f32":
        low = b.constant(torch.finfo(dtypes.to_torch(dt)).min, "f32", source)
        total = b.map("max", (total, low), ir.TensorType(shape, "f32"), f"{total}_floor", source)
        total = b.map("cast", (total,), ir.TensorType(shape, dt), f"{total}_{dt}", source)
    b.made[key] = total
    return total


def eager_attention_as_sdpa(g: ir.Graph) -> ir.Graph:
    users = g.users()
    b, changed = _Build(g), False
    for n in g.nodes:
        found = _match(g, n) if isinstance(n, ir.Contraction) else None
        if found is None or not _private(g, users, n.name, found[6]):
            b.out.append(n)
            continue
        q, k, v, scale, masks, space, _ = found
        lead, src = space[:-2], n.source
        mask = _mask(b, masks, space, g[q].type.dtype, src)
        q, k, v = (b.regroup(t, lead, src) for t in (q, k, v))
        if space[:-2] == n.type.shape[:-2]:
            b.add(ir.Attention(n.name, n.type, q, k, v, False, scale, mask, src))
        else:  # in the softmax's shape (where q, k and v are strided views, and the masks broadcast), then regrouped
            t = ir.TensorType(lead + n.type.shape[-2:], n.type.dtype)
            a = b.add(ir.Attention(b.ed.fresh(f"{n.name}_attention"), t, q, k, v, False, scale, mask, src))
            b.add(ir.View(n.name, n.type, "reshape", a, n.type.shape, src))
        changed = True
    return prune(b.ed.graph(b.out)) if changed else g

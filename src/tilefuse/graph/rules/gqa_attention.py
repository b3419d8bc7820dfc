"""Keys and values repeated for grouped-query attention reach SDPA unrepeated.

transformers' repeat_kv (Qwen2, Llama with fewer KV heads than query heads) turns k and v of
Hkv heads into H = n Hkv heads: [B, Hkv, S, D] -> reshape [B, Hkv, 1, S, D] -> expand
[B, Hkv, n, S, D] -> reshape [B, H, S, D]. The last reshape cannot view an expand, so each is
a full copy per call, n times the size of what it repeats. SDPA takes the Hkv heads itself
(`enable_gqa`: query head h reads KV head h // n, the pairing the expand makes), so the
attention reads k and v before the repeat and the copies go.
"""
from __future__ import annotations

import dataclasses

from .. import ir
from .match import prune


def repeated_kv_into_attention(g: ir.Graph) -> ir.Graph:
    nodes, changed = [], False
    for n in g.nodes:
        if isinstance(n, ir.Attention):
            k, v = unrepeated(g, n.k), unrepeated(g, n.v)
            heads = g[n.q].type.shape[-3] if len(g[n.q].type.shape) >= 3 else None
            if k and v and k[1] == v[1] > 1 and heads == g[k[0]].type.shape[-3] * k[1]:
                n = dataclasses.replace(n, k=k[0], v=v[0])
                changed = True
        nodes.append(n)
    return prune(g.replace(nodes)) if changed else g


def unrepeated(g: ir.Graph, name: str) -> tuple[str, int] | None:
    """(x, n) when `name` repeats each head of x [B, Hkv, S, D] n times in a row, else None."""
    flat = g[name]
    if not (isinstance(flat, ir.View) and flat.op == "reshape"):
        return None
    rep = g[flat.arg]
    if not (isinstance(rep, ir.View) and rep.op == "expand"):
        return None
    split = g[rep.arg]
    if not (isinstance(split, ir.View) and split.op == "reshape") or len(g[split.arg].type.shape) != 4:
        return None
    b, hkv, s, d = g[split.arg].type.shape
    shape = tuple(rep.type.shape)
    if tuple(split.type.shape) != (b, hkv, 1, s, d) or len(shape) != 5 or shape[:2] != (b, hkv) \
            or shape[3:] != (s, d) or tuple(flat.type.shape) != (b, hkv * shape[2], s, d):
        return None
    return split.arg, shape[2]

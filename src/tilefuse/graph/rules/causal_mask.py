"""An attention mask known when compiling that is the causal one becomes `is_causal`.

Under torch.export, transformers cannot drop its causal mask as it does in eager (it skips
the mask only when not tracing), so GPT-2, Llama and Qwen2 capture SDPA with an explicit
boolean mask built from index compares (`kv_idx <= q_idx`, `batch_idx == batch_idx`): a
[B, 1, L, S] mask kernel on every call, and a masked attention kernel that visits every
key block. With `is_causal` the mask is gone and the attention kernel skips the upper
triangle (about half the work in prefill).

The rule evaluates the mask's cone when it depends on weights, constants and indices alone
(fold_weights has already folded the externs among them) and compares it, broadcast, with
SDPA's own causal mask, tril(ones(L, S)) (top-left aligned): equal everywhere, the
attention becomes causal with no mask. An additive float mask qualifies when its allowed
entries are 0 and its masked ones -inf or the dtype's lowest value (exp underflows to 0 in
both; a causal row always keeps its diagonal, so no row is fully masked).

A sliding window (Mistral's, Gemma 3's sliding layers: query i keeps keys i - W < j <= i) is
found the same way where the queries are the keys (L == S): the attention becomes causal with
`window` W and no mask, which flash attention runs on the band alone (runtime.program), and
which PyTorch otherwise gets as a mask made at run time. Anything else (a padding mask from
an input) is left as it is.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ... import dtypes
from .. import ir
from ..fold import evaluate, leaf_value
from .match import prune

MAX_MASK_ELEMENTS = 1 << 28  # larger masks (batch 4 x 8192^2) stay: evaluating one takes seconds and GBs
_LEAVES = (ir.Weight, ir.Constant, ir.Iota)
_COMPUTED = (ir.Map, ir.View, ir.Reduce, ir.Gather)


def causal_masks(g: ir.Graph) -> ir.Graph:
    nodes, changed = [], False
    seen: dict[tuple, bool] = {}  # every layer reads the same mask: evaluated once
    for n in g.nodes:
        if isinstance(n, ir.Attention) and n.mask is not None:
            key = (n.mask, g[n.q].type.shape[-2], g[n.k].type.shape[-2])
            if key not in seen:
                seen[key] = _causal_window(g, n.mask, *key[1:])
            if seen[key] is not None:
                n = dataclasses.replace(n, causal=True, mask=None, window=seen[key] or None)
                changed = True
        nodes.append(n)
    return prune(g.replace(nodes)) if changed else g


def _causal_window(g: ir.Graph, mask: str, L: int, S: int) -> int | None:
    """0 where the mask is SDPA's causal one, W where it is a causal window of W keys (L == S,
    W < S), else None."""
    m = g[mask].type
    if tuple(m.shape[-2:]) != (L, S) or m.numel > MAX_MASK_ELEMENTS:
        return None
    try:
        value = known_value(g, mask)
    except (ValueError, IndexError, TypeError):  # a cone the interpreter refuses: leave the mask
        return None
    if value is None:
        return None
    if value.dtype == bool:
        kept = value
    elif dtypes.is_float(m.dtype):
        lowest = torch.finfo(dtypes.to_torch(m.dtype)).min  # -inf is below it too
        if not np.all((value == 0) | (value <= lowest)):
            return None
        kept = value == 0
    else:
        return None
    tri = np.tri(L, S, dtype=bool)  # [i, j] = j <= i: SDPA's is_causal
    if np.all(kept == tri):
        return 0
    w = int(np.count_nonzero(kept[(0,) * (kept.ndim - 2) + (-1,)]))  # the last query's keys
    if L != S or not 0 < w < S:
        return None
    band = tri & ~np.tri(L, S, -w, dtype=bool)  # i - w < j <= i
    return w if np.all(kept == band) else None


def known_value(g: ir.Graph, name: str) -> np.ndarray | None:
    """name's value when everything it depends on is a weight, constant or index, else None."""
    cone, stack = set(), [name]
    while stack:
        x = stack.pop()
        if x in cone:
            continue
        n = g[x]
        if not isinstance(n, _LEAVES + _COMPUTED) or n.type.numel > MAX_MASK_ELEMENTS:
            return None
        cone.add(x)
        stack.extend(ir.node_args(n))
    values: dict[str, np.ndarray] = {}
    for n in g.nodes:
        if n.name not in cone:
            continue
        leaf = leaf_value(g, n)
        values[n.name] = leaf if leaf is not None else evaluate(n, [values[a] for a in ir.node_args(n)])
    return np.broadcast_to(values[name], g[name].type.shape)


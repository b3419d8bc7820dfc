"""A `cat` of one tensor's slices that together cover it in rotated order is a roll of it.

    cat((x[..., h:], x[..., :h]), d)   ->   roll view of x: element i is x[..., (i + h) % n]

transformers' rotate-half RoPE at a decode step, once `cat_signs` has moved its `neg` into a
sign: `cat((x2, x1), -1)` of q's and of k's halves, each a PyTorch cat (a launch and a copy)
before the multiply-add kernel. A roll is a view (graph/ir.py): a map-reduce kernel reads it
where x lies (`fusion.views_read_in_place`, at index (i + h) % n), so the multiply-add reads q
twice and nothing is copied. Slices of x in order from 0 are x itself. And `cat((x, x), d)`
(the same RoPE's `cat((freqs, freqs), -1)` before its cos and sin, computed from the step's
positions) is views of x: a size-1 dim expanded to 2, merged with d, which the cos kernel
reads in place too.

The values are x's, moved: the same bits. Only pieces that are slices with step 1 of one
tensor along the cat's dim, each within x (no wrap inside a piece), consecutive modulo its
size and covering it once; any other cat is left as it is.
"""
from __future__ import annotations

from .. import ir
from ..rewrites import substitute
from .cat_signs import _pieces
from .match import prune


def _rotation(g: ir.Graph, names: list, dim: int) -> tuple[str, int] | None:
    """(x, h) when the pieces are x's slices along `dim` from h, in order modulo its size."""
    views = [g[p] for p in names]
    if not all(isinstance(v, ir.View) and v.op == "slice" for v in views):
        return None
    x = views[0].arg
    shape = g[x].type.shape
    rank = len(shape)
    if not shape or any(v.arg != x or v.params[0] % rank != dim or v.params[3] != 1 for v in views):
        return None
    n, at, total = shape[dim], views[0].params[1], 0
    for v in views:
        start, end = v.params[1], min(v.params[2], n)
        if start != at % n or end <= start:
            return None
        at, total = end, total + end - start
    return (x, views[0].params[1] % n) if total == n else None


def _repeats(g: ir.Graph, node, names: list, dim: int) -> list | None:
    """`cat((x,) * k, dim)` as views of x: x with a size-1 dim before `dim`, expanded to k there,
    then merged with `dim` (element j along it is x's j % n); None for any other cat."""
    x = names[0]
    t = g[x].type
    if len(names) < 2 or any(p != x for p in names) or len(t.shape) != len(node.type.shape) or not t.shape[dim]:
        return None
    k, s = len(names), t.shape
    one = ir.View(f"{node.name}_one", ir.TensorType(s[:dim] + (1,) + s[dim:], t.dtype), "reshape", x,
                  s[:dim] + (1,) + s[dim:], node.source)
    many = ir.View(f"{node.name}_repeated", ir.TensorType(s[:dim] + (k,) + s[dim:], t.dtype), "expand", one.name,
                   s[:dim] + (k,) + s[dim:], node.source)
    return [one, many, ir.View(node.name, node.type, "reshape", many.name, node.type.shape, node.source)]


def rotated_cat_as_roll(g: ir.Graph) -> ir.Graph:
    out, renamed, changed = [], {}, False
    for node in g.nodes:
        found = _pieces(g, node) if node.type.shape else None
        hit = _rotation(g, *found) if found is not None else None
        repeated = _repeats(g, node, *found) if found is not None and hit is None else None
        if repeated is not None and not any(v.name in g for v in repeated[:2]):
            out += repeated
            changed = True
            continue
        if hit is None or g[hit[0]].type != node.type:
            out.append(node)
            continue
        x, shift = hit
        if shift == 0:
            renamed[node.name] = x
        else:
            out.append(ir.View(node.name, node.type, "roll", x, (found[1], shift), node.source))
        changed = True
    if not changed:
        return g
    return prune(substitute(ir.Graph(tuple(out), g.inputs, g.outputs, g.weights, g.writes, g.layouts), renamed))

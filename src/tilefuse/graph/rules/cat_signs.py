"""A negated piece of a `cat` becomes a sign on the cat's result.

    cat((neg(a), b), d)   ->   cat((a, b), d) * s,   s = -1 along a's span of d, +1 along b's

transformers' rotate-half RoPE, `cat((-x[..., D/2:], x[..., :D/2]), -1)`, is the case that
matters: `neg` of a slice needs the slice as a tensor of its own (a copy in PyTorch) and a
kernel of its own, while `cat` reads both slices where they lie (fusion's strided readers) and
the sign, a multiply by a small constant vector, joins the kernel that reads the cat (RoPE's
multiply-add). At a decode step that is two launches fewer for each of q and k a layer; where
HF's RoPE goes into the projections instead (`rope_rotate_half`, which runs first) there is
nothing left here to match.

Negation and a multiply by -1 give the same bits in every float format (zeros, infinities and
NaNs included), so the rewritten graph computes the same values. Only pieces of the cat's own
float dtype (an integer `neg` wraps: int8 -128 stays -128, and a promoted 0 is +0) and rank (a
legacy 1-D empty piece has no such dim), only a `neg` the cat alone reads (anything else
reading it still needs it), and only where maps alone read the cat (`_pays`).
"""
from __future__ import annotations

import torch

from ... import dtypes
from .. import ir
from ..rewrites import substitute
from .match import Editor, prune

def _pieces(g: ir.Graph, n) -> tuple[list, int] | None:
    """(the cat's pieces as names, its dim) when n is a cat of named tensors; else None."""
    if not (isinstance(n, ir.Extern) and n.target == "aten.cat.default" and not n.kwargs):
        return None
    if not n.args or not isinstance(n.args[0], (tuple, list)):
        return None
    refs = n.args[0]
    if not refs or not all(isinstance(r, ir.Ref) for r in refs):
        return None
    dim = n.args[1] if len(n.args) > 1 else 0
    if not isinstance(dim, int):
        return None
    return [r.name for r in refs], dim % len(n.type.shape) if n.type.shape else 0


def _pays(g: ir.Graph, users, n) -> bool:
    """Only where the sign joins a kernel that runs anyway: every reader of the cat is a map
    and the cat is not a result (read by an extern or returned, it would be a pass of its own,
    where the `neg` may have been fused into the kernel that made its argument)."""
    readers = users[n.name]
    return bool(readers) and n.name not in g.outputs and all(isinstance(g[u], ir.Map) for u in readers)


def negated_pieces_as_signs(g: ir.Graph) -> ir.Graph:
    users = g.users()
    ed, out, renamed, changed = Editor(g), [], {}, False
    for n in g.nodes:
        found = _pieces(g, n) if dtypes.is_float(n.type.dtype) and n.type.shape else None
        if found is None:
            out.append(n)
            continue
        names, dim = found
        negs = [isinstance(g[x], ir.Map) and g[x].op == "neg" and users[x] == [n.name] for x in names]
        rank = len(n.type.shape)
        if (not any(negs) or not _pays(g, users, n)
                or any(g[x].type.dtype != n.type.dtype or len(g[x].type.shape) != rank or g[x].type.shape[dim] == 0
                       for x in names)):
            out.append(n)
            continue
        sign = torch.cat([torch.full((g[x].type.shape[dim],), -1.0 if neg else 1.0, dtype=torch.float64)
                          for x, neg in zip(names, negs)])
        w = ed.weight(f"{n.name}_signs", sign.reshape((-1,) + (1,) * (rank - 1 - dim)), n.type.dtype, "")
        pieces = tuple(ir.Ref(g[x].args[0] if neg else x) for x, neg in zip(names, negs))
        bare = ir.Extern(ed.fresh(f"{n.name}_unsigned"), n.type, n.target, (pieces,) + tuple(n.args[1:]), n.kwargs,
                         n.reason, n.source)
        signed = ir.Map(ed.fresh(f"{n.name}_signed"), n.type, "mul", (bare.name, w.name), n.source)
        out += [w, bare, signed]
        renamed[n.name] = signed.name
        changed = True
    if not changed:
        return g
    return prune(substitute(ir.Graph(tuple(out), g.inputs, g.outputs, ed.weights, g.writes, g.layouts), renamed))

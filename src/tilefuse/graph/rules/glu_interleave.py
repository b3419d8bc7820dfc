"""SwiGLU / GeGLU: gate and up projections as one matmul with interleaved weight columns.

    act(x @ Wg) ⊙ (x @ Wu)  →  y = x @ W,  W[:, 2j] = Wg[:, j],  W[:, 2j+1] = Wu[:, j]
                               g = y[..., 0::2],  u = y[..., 1::2]

W is built once, here. Each gate value then sits next to its up value in the same output
tile, so act(g)·u is a pairwise epilogue on adjacent accumulator columns, and the matmul
reads x once instead of twice. The rule fires for any activation: act is whatever chain of
elementwise ops leads from the gate to the product (silu, gelu, gelu-tanh, relu...).

A model that keeps gate and up in one weight (Phi-3's `gate_up_proj`, then `chunk(2, -1)`)
multiplies halves of one product: act(y[..., :F]) ⊙ y[..., F:]. Its weight's columns are
interleaved the same way, and the halves become the even and odd columns: the SwiGLU that was
a kernel of its own, reading the 2F-wide product back, is the GEMM's epilogue, which writes F.
Only where the halves are all that read the product (anything else would read it in the
order it had).
"""
from __future__ import annotations

import torch

from .. import ir
from .match import Editor, peel_casts, weight_operand


def elementwise_of(g: ir.Graph, name: str, root: str) -> bool:
    """Is `name` computed from `root` alone, through Maps and constants (and does it use root)?"""
    seen, stack, uses = set(), [name], False
    while stack:
        n = stack.pop()
        if n == root:
            uses = True
            continue
        if n in seen:
            continue
        seen.add(n)
        node = g[n]
        if isinstance(node, ir.Constant):
            continue
        if not isinstance(node, ir.Map):
            return False
        stack.extend(node.args)
    return uses


def _glu_pairs(g: ir.Graph):
    """(gate, up) contraction pairs: mul(act(gate), up), both of one operand with same-shaped weights."""
    found = []
    for n in g.nodes:
        if not (isinstance(n, ir.Map) and n.op == "mul"):
            continue
        for f, u in (n.args, n.args[::-1]):
            up = g[peel_casts(g, u)]
            if not isinstance(up, ir.Contraction):
                continue
            gate = _gate_of(g, f, up)
            if gate is not None and gate.name != up.name:
                found.append((gate, up))
                break
    return found




def _gate_of(g, f, up):
    """The contraction that `f` is an elementwise function of, if it pairs with `up`."""
    stack, seen = [f], set()
    while stack:  # the first contraction under f's maps
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        node = g[n]
        if isinstance(node, ir.Contraction):
            if node.a != up.a or not elementwise_of(g, f, n):
                return None
            wg, wu = weight_operand(g, node.b), weight_operand(g, up.b)
            ok = (wg is not None and wu is not None and wg.transposed == wu.transposed
                  and g[node.b].type == g[up.b].type and node.type == up.type)
            return node if ok else None
        if isinstance(node, ir.Map):
            stack.extend(node.args)
    return None


def _half(g: ir.Graph, name: str):
    """(contraction, start) when `name` is a slice of a weight contraction's last dim holding
    exactly its first or second half with step 1; else None."""
    n = g[name]
    if not (isinstance(n, ir.View) and n.op == "slice"):
        return None
    y = g[n.arg]
    rank = len(n.type.shape)
    if not isinstance(y, ir.Contraction) or weight_operand(g, y.b) is None or not rank:
        return None
    dim, start, end, step = n.params
    width = y.type.shape[-1]
    if dim % rank != rank - 1 or step != 1 or width % 2 or (start, min(end, width)) not in ((0, width // 2),
                                                                                        (width // 2, width)):
        return None
    return y, start


def _chunked_pairs(g: ir.Graph, users) -> list:
    """(product, gate half, up half): mul(act(y[..., gate half]), y[..., up half]) of one weight
    contraction y that only these two halves read."""
    found = []
    for n in g.nodes:
        if not (isinstance(n, ir.Map) and n.op == "mul"):
            continue
        for f, u in (n.args, n.args[::-1]):
            up = peel_casts(g, u)
            hu = _half(g, up)
            if hu is None:
                continue
            y = hu[0]
            others = [v for v in users[y.name] if v != up]
            hg = _half(g, others[0]) if len(others) == 1 else None
            if hg is None or hg[1] == hu[1]:
                continue
            if y.name in g.outputs or not elementwise_of(g, f, others[0]):
                continue
            found.append((y, others[0], up))
            break
    return found


def _interleave_halves(g: ir.Graph) -> ir.Graph:
    """Each chunked gate/up product: its weight's columns interleaved, its halves strided views."""
    found = _chunked_pairs(g, g.users())
    if not found:
        return g
    ed = Editor(g)
    emit: dict[str, list] = {}
    for y, gate, up in found:
        if y.name in emit:
            continue
        wo = weight_operand(g, y.b)
        m = wo.matrix(g, exact=True)  # (K, 2F); interleaving is exact
        k, n = m.shape
        g0, u0 = g[gate].params[1], g[up].params[1]
        both = torch.stack((m[:, g0:g0 + n // 2], m[:, u0:u0 + n // 2]), dim=-1).reshape(k, n)
        note = f"{g[wo.weight].source or wo.weight}: gate and up halves interleaved by column"
        nodes, b = ed.operand(f"{wo.weight}_glu", both, wo, g[wo.weight].type.dtype, note, y.source)
        last = len(y.type.shape) - 1
        emit[y.name] = nodes + [ir.Contraction(y.name, y.type, y.a, b, y.source)]
        for i, half in enumerate((gate, up)):
            h = g[half]
            emit[half] = [ir.View(h.name, h.type, "slice", y.name, (last, i, n, 2), h.source)]
    out = []
    for node in g.nodes:
        out.extend(emit.get(node.name, [node]))
    return ed.graph(out)


def interleave_glu(g: ir.Graph) -> ir.Graph:
    """Each gate/up pair becomes one contraction with interleaved weights and two strided views."""
    g = _interleave_halves(g)
    pairs = _glu_pairs(g)
    if not pairs:
        return g
    ed = Editor(g)
    order = {n.name: i for i, n in enumerate(g.nodes)}
    emit: dict[str, list] = {}  # node name -> what replaces it
    for gate, up in pairs:
        if gate.name in emit or up.name in emit:
            continue
        first, second = sorted((gate, up), key=lambda n: order[n.name])
        wg, wu = weight_operand(g, gate.b), weight_operand(g, up.b)
        mg, mu = wg.matrix(g, exact=True), wu.matrix(g, exact=True)  # (K, N) each; interleaving is exact
        k, n = mg.shape
        both = torch.stack((mg, mu), dim=-1).reshape(k, 2 * n)  # columns g0 u0 g1 u1 ...
        note = f"{g[wg.weight].source or wg.weight} and {g[wu.weight].source or wu.weight} interleaved by column"
        nodes, b = ed.operand(f"{wg.weight}_glu", both, wg, g[wg.weight].type.dtype, note, gate.source)
        shape = gate.type.shape[:-1] + (2 * n,)
        fused = ir.Contraction(ed.fresh(f"{gate.name}_glu"), ir.TensorType(shape, gate.type.dtype), gate.a, b,
                               gate.source)
        last = len(shape) - 1
        views = [ir.View(c.name, c.type, "slice", fused.name, (last, i, 2 * n, 2), c.source)
                 for i, c in enumerate((gate, up))]
        emit[first.name] = nodes + [fused] + views
        emit[second.name] = []
    out = []
    for node in g.nodes:
        out.extend(emit.get(node.name, [node]))
    return ed.graph(out)

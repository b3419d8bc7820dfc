"""Residual add as an epilogue of the matmul that produces its other operand.

    h = reshape(cast(epilogue(x @ W))) + res  →  h = reshape(epilogue(x @ W) + reshape(res))

The add moves into the matmul's own output shape, next to the rest of its epilogue (a bias,
an activation), and that chain runs on the fp32 accumulator: the contraction and the maps
after it are typed f32, and only the add rounds, once, to h's dtype. The residual is then a
tile load in the matmul's epilogue, and the sum is written once instead of the matmul's
output being written, read back and written again.
"""
from __future__ import annotations

from .. import ir
from .match import Editor, depends_on, float_cast, low_precision, retype


def _link(g: ir.Graph, users, n: ir.Node) -> str | None:
    """The one full-shape argument of map `n`, used only by it, through which a map chain goes
    down towards its contraction; None where the chain breaks."""
    full = [x for x in n.args if g[x].type.shape == n.type.shape]
    if len(full) != 1 or not _once(g, users, full[0]) or not _float(n.type.dtype):
        return None
    return full[0]


def _once(g: ir.Graph, users, x: str) -> bool:
    """x has one reader and is not an output (a returned link would come back retyped)."""
    return len(users[x]) == 1 and x not in g.outputs


def _on_contractions(g: ir.Graph, users) -> set[str]:
    """Nodes that are contractions, or maps whose chain of links ends in one: found in one
    sweep in node order, so that _chain walks only chains that lead somewhere (walking every
    chain from every add made a long chain of maps cost its length squared)."""
    on: set[str] = set()
    for n in g.nodes:
        if isinstance(n, ir.Contraction) or (isinstance(n, ir.Map) and _link(g, users, n) in on):
            on.add(n.name)
    return on


def _chain(g: ir.Graph, users, a: str, on: set[str]):
    """(contraction, [maps after it], tip) for `a` = [reshape|cast]*(map*(contraction)), each link
    used once; None if `a` is not one. `tip` is the last map (or the contraction) under the
    reshapes and casts. `on`: _on_contractions(g, users)."""
    if not _once(g, users, a):
        return None
    n = a
    while (isinstance(g[n], ir.View) and g[n].op == "reshape") or float_cast(g, n):
        n = g[n].arg if isinstance(g[n], ir.View) else g[n].args[0]
        if not _once(g, users, n):
            return None
    if n not in on:
        return None
    tip, maps = n, []
    while isinstance(g[n], ir.Map):
        maps.append(n)
        n = _link(g, users, g[n])
    return n, maps[::-1], tip


def _float(dtype: str) -> bool:
    return dtype in ("bf16", "f16", "f32", "f64")


def residual_into_epilogue(g: ir.Graph) -> ir.Graph:
    users = g.users()
    on = _on_contractions(g, users)
    ed = Editor(g)
    retyped: dict[str, object] = {}
    replaced: dict[str, list] = {}
    for h in g.nodes:
        if not (isinstance(h, ir.Map) and h.op == "add") or h.args[0] == h.args[1] or not _float(h.type.dtype):
            continue
        for a, res in (h.args, h.args[::-1]):
            found = _chain(g, users, a, on)
            if found is None:
                continue
            mm, maps, tip = found
            if not _float(g[mm].type.dtype):
                continue  # an integer product's chain is no float accumulator's (its maps would be retyped to it)
            acc = "f32" if low_precision(g[mm].type.dtype) else g[mm].type.dtype
            if tip == a and all(g[x].type.dtype == acc for x in (mm, *maps)):
                break  # already an add on the accumulator's chain: nothing to move
            if g[a].type.shape != h.type.shape or g[res].type.shape != h.type.shape:
                continue
            if depends_on(g, res, (mm, *maps, tip)):  # a residual computed from the matmul is no tile load
                continue
            if mm in retyped or any(m in retyped for m in maps):
                continue
            for name in [mm, *maps]:
                retyped[name] = retype(g[name], acc) if g[name].type.dtype != "f64" else g[name]
            tip_shape = g[tip].type.shape
            nodes = []
            if g[res].type.shape != tip_shape:
                r2 = ir.View(ed.fresh(f"{res}_rows"), ir.TensorType(tip_shape, g[res].type.dtype), "reshape", res,
                             tip_shape, h.source)
                nodes.append(r2)
                res = r2.name
            if tip_shape == h.type.shape:
                nodes.append(ir.Map(h.name, h.type, "add", (tip, res), h.source))
            else:
                s = ir.Map(ed.fresh(f"{h.name}_epi"), ir.TensorType(tip_shape, h.type.dtype), "add", (tip, res),
                           h.source)
                nodes += [s, ir.View(h.name, h.type, "reshape", s.name, h.type.shape, h.source)]
            replaced[h.name] = nodes
            break
    if not replaced:
        return g
    out = []
    for n in g.nodes:
        out.extend(replaced.get(n.name, [retyped.get(n.name, n)]))
    return ed.graph(out)

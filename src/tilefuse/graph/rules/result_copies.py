"""A result that is a view of a tensor in memory, returned contiguous, copied by a kernel.

    y = x.transpose(1, 2).contiguous()        ->   y = cast(permute(x))      (an identity cast)
    y = x[:, :, None].expand(...).reshape(...)     y = cast(reshape(expand(x)))

A view that no kernel reads was a PyTorch copy step (`expand copy in PyTorch`), and PyTorch's
copy of a strided tensor is slow: a head permute `[8, 1024, 32, 128] -> [8, 32, 1024, 128]`
took 92 us on an H200 where torch.compile's kernel took 34 (0.37x), a GQA `repeat_kv` 71 us
against 26 (`bench/op_sweep.py`, session 64). As an identity map the copy is a map-reduce kernel
that reads the views in place (`fusion.views_read_in_place`): each row of the result is a run of
the tensor under the views, read in 16-byte loads.

Only views a kernel reads row by row (`fusion._keeps_rows`: permutes that keep the last dim,
slices of step 1 along it, expands, reshapes, rolls); a permute that moves the last dim is
`permute_sink.transposed_results_as_copies`'s (read in 2-D tiles). Not a reshape alone (an
alias of its argument, free), nor a result PyTorch returns strided (`permute_sink.layout_views`),
nor views of a generated tensor (made where it is read) or of an input the program writes.
"""
from __future__ import annotations

from .. import ir
from ..fusion import _keeps_rows
from .match import Editor
from .permute_sink import layout_views


def _copied(g: ir.Graph, name: str, kept: frozenset) -> bool:
    if name in kept or g.outputs.count(name) != 1:
        return False
    chain, x = [], name
    while isinstance(g[x], ir.View):
        chain.append(g[x])
        x = g[x].arg
    base = g[x]
    return (any(v.op != "reshape" for v in chain) and all(_keeps_rows(v) for v in chain)
            and g[name].type.numel > 0 and not isinstance(base, (ir.Constant, ir.Iota))
            and not (isinstance(base, ir.Input) and x in g.writes))


def result_views_as_copies(g: ir.Graph) -> ir.Graph:
    kept = layout_views(g)
    hits = [name for name in dict.fromkeys(g.results) if _copied(g, name, kept)]
    if not hits:
        return g
    ed, outs, nodes = Editor(g), list(g.outputs), list(g.nodes)
    for name in hits:
        n = g[name]
        copy = ir.Map(ed.fresh(f"{name}_copy"), n.type, "cast", (name,), n.source)
        nodes.insert(nodes.index(n) + 1, copy)
        outs[outs.index(name)] = copy.name
    return ed.graph(nodes, outs)

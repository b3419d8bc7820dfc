"""A view of a tensor in memory that a result returns contiguous, or that an extern takes
contiguous, copied by a kernel.

    y = x.transpose(1, 2).contiguous()        ->   y = cast(permute(x))      (an identity cast)
    y = x[:, :, None].expand(...).reshape(...)     y = cast(reshape(expand(x)))
    y = conv2d(upsample_nearest(x), w)              y = conv2d(cast(reshape(expand(...))), w)

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
nor views of a generated tensor (made where it is read) or of an input the program writes; not
for the externs that read strided views as they lie (cat, a grouped matmul; attention is no
extern node).
"""
from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..fusion import _STRIDED_READERS, _keeps_rows
from ..rewrites import _subst_refs
from .match import Editor
from .permute_sink import layout_views


def _copyable(g: ir.Graph, name: str, kept: frozenset) -> bool:
    """A chain of views kernels read row by row, not a reshape alone, under a tensor in memory."""
    if name in kept or not isinstance(g[name], ir.View) or g[name].type.numel == 0:
        return False
    chain, x = [], name
    while isinstance(g[x], ir.View):
        chain.append(g[x])
        x = g[x].arg
    base = g[x]
    return (any(v.op != "reshape" for v in chain) and all(_keeps_rows(v) for v in chain)
            and not isinstance(base, (ir.Constant, ir.Iota)) and not (isinstance(base, ir.Input) and x in g.writes))


def _copies_for(n) -> bool:
    """An extern that takes its tensors contiguous (PyTorch copied a view for it); not the ones
    that read strided views as they lie (fusion.attention_only_views)."""
    return (isinstance(n, ir.Extern) and n.target not in _STRIDED_READERS
            and not n.target.startswith("aten._grouped_mm."))


def result_views_as_copies(g: ir.Graph) -> ir.Graph:
    kept = layout_views(g)
    results = [name for name in dict.fromkeys(g.results) if g.outputs.count(name) == 1 and _copyable(g, name, kept)]
    read = list(dict.fromkeys(a for n in g.nodes if _copies_for(n) for a in ir.node_args(n) if _copyable(g, a, kept)))
    if not results and not read:
        return g
    ed, outs, nodes = Editor(g), list(g.outputs), list(g.nodes)
    copies = {}
    for name in dict.fromkeys(results + read):
        n = g[name]
        copies[name] = ir.Map(ed.fresh(f"{name}_copy"), n.type, "cast", (name,), n.source)
        nodes.insert(nodes.index(n) + 1, copies[name])
    for name in results:
        outs[outs.index(name)] = copies[name].name
    swap = {v: c.name for v, c in copies.items() if v in read}
    nodes = [replace(n, args=_subst_refs(n.args, lambda a: swap.get(a, a)),
                     kwargs=tuple((k, _subst_refs(v, lambda a: swap.get(a, a))) for k, v in n.kwargs))
             if _copies_for(n) else n for n in nodes]
    return ed.graph(nodes, outs)

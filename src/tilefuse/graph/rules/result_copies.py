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
nor views of a generated tensor (made where it is read), of attention's output, or of an input
the program writes; not for the externs that read strided views as they lie (a grouped matmul;
a cat, permutes and slices); not where another reader (a gather's table, a matmul) would have
PyTorch copy the view anyway; not a result PyTorch returns in another layout (its copy keeps
eager's strides).
"""
from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..fusion import _STRIDED_READERS, _keeps_rows
from ..rewrites import _subst_refs
from .match import Editor
from .permute_sink import _through_views, layout_views


def _chain(g: ir.Graph, name: str) -> tuple[list, object]:
    """(the views from `name` down, the node under them)."""
    *views, base = _through_views(g, name)
    return [g[v] for v in views], g[base]


def _copyable(g: ir.Graph, name: str, kept: frozenset) -> bool:
    """A chain of views kernels read row by row, not a reshape alone, under a tensor in memory
    (not attention's output, whose head transpose is free where SDPA lays it out [B, S, H, D]:
    fusion._extern_note)."""
    if name in kept or not isinstance(g[name], ir.View) or g[name].type.numel == 0:
        return False
    chain, base = _chain(g, name)
    return (any(v.op != "reshape" for v in chain) and all(_keeps_rows(v) for v in chain)
            and not isinstance(base, (ir.Constant, ir.Iota, ir.Attention))
            and not (isinstance(base, ir.Input) and base.name in g.writes))


def _copies_for(g: ir.Graph, n, view: str) -> bool:
    """Whether extern `n` takes `view` contiguous, so that PyTorch copied it: not the externs
    that read strided views as they lie (fusion.attention_only_views): a grouped matmul, and a
    cat for permutes and slices (an expand, a roll it takes copied)."""
    if not isinstance(n, ir.Extern) or n.target.startswith("aten._grouped_mm."):
        return False
    if n.target in _STRIDED_READERS:
        return any(v.op not in ("permute", "slice", "reshape") for v in _chain(g, view)[0])
    return True


def _other_readers_in_place(g: ir.Graph, users: dict, name: str) -> bool:
    """Every reader of `name` other than the externs that take the copy reads it in place: a
    map, or a reduction along the last dim. Another reader (a gather's table, a reduction over
    another dim PyTorch may run, a matmul, a further view) may have PyTorch copy the view
    anyway, and the kernel would then copy that copy."""
    for u in users.get(name, []):
        r = g[u]
        if _copies_for(g, r, name) or isinstance(r, ir.Map):
            continue
        if isinstance(r, ir.Reduce) and r.axes == (len(g[name].type.shape) - 1,):
            continue
        return False
    return True


def result_views_as_copies(g: ir.Graph) -> ir.Graph:
    kept, users = layout_views(g), g.users()
    layouts = dict(zip(g.results, g.layouts or (None,) * len(g.results)))
    # (a result PyTorch lays out permuted, a channels-last upsample's, keeps its PyTorch copy,
    # which gives eager's strides)
    results = [name for name in dict.fromkeys(g.results)
               if g.outputs.count(name) == 1 and layouts.get(name) is None and _copyable(g, name, kept)
               and _other_readers_in_place(g, users, name)]
    read = list(dict.fromkeys(a for n in g.nodes if isinstance(n, ir.Extern) for a in ir.node_args(n)
                              if _copies_for(g, n, a) and _copyable(g, a, kept) and layouts.get(a) is None
                              and _other_readers_in_place(g, users, a)))
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
    read = set(read)

    def swapped(n):
        if not isinstance(n, ir.Extern):
            return n
        r = lambda a: copies[a].name if a in read and _copies_for(g, n, a) else a  # noqa: E731
        return replace(n, args=_subst_refs(n.args, r), kwargs=tuple((k, _subst_refs(v, r)) for k, v in n.kwargs))

    return ed.graph([swapped(n) for n in nodes], outs)

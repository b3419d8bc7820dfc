"""A roll of a map's result along a dim is the map of its arguments rolled there.

    roll(f(a, b, r), d, h)   ->   f(roll(a, d, h), roll(b, d, h), r)      (r of size 1 along d)

Rotate-half RoPE after a q/k norm (Qwen3, Gemma 3, OLMo 2): `q_norm(q) · cos + rotate_half(q_norm(q))
· sin`, where rotate_half is a roll of the norm's output with signs (`cat_signs`, `cat_roll`).
The roll is a view a kernel reads in place only where its argument lies in memory, so the norm
kernel wrote its output for the rotation kernel to read twice: two kernels and a round trip of
q and k. Moved below the norm's maps, the roll reads q (the projection's output, in memory) at
the rotated column, and the row's statistic as it is (one value a row, the same at every column):
the norm and the rotation are one kernel, reading q twice (the second read from cache) and
writing only the rotated result. The maps are recomputed at the rolled columns, not stored.

Moved through maps only (elementwise, so a rolled argument gives the rolled result, the same
bits), down to tensors in memory (inputs, weights, views, matmul and extern results), each
rolled as a view; an argument of size 1 along the dim is taken as it is. Not moved where the
chain reaches anything else with that dim (a reduction's or a scan's full result, an iota,
a gather), nor through more than MAX_MAPS maps.
"""
from __future__ import annotations

from .. import ir
from .match import Editor, prune

MAX_MAPS = 16
_IN_MEMORY = (ir.Input, ir.Weight, ir.View, ir.Contraction, ir.Extern, ir.Attention, ir.Constant)


def _along(t: ir.TensorType, rank: int, dim: int) -> int | None:
    """t's dim that lines up with `dim` of a rank-`rank` result (broadcast from the right), or
    None where t has none there or has size 1 there (then the same at every position)."""
    d = dim - (rank - len(t.shape))
    return d if d >= 0 and t.shape[d] != 1 else None


def _movable(g: ir.Graph, name: str, rank: int, dim: int, count: list) -> bool:
    n = g[name]
    d = _along(n.type, rank, dim)
    if d is None or isinstance(n, _IN_MEMORY):
        return True
    if not isinstance(n, ir.Map):
        return False
    count[0] += 1
    return count[0] <= MAX_MAPS and all(_movable(g, a, rank, dim, count) for a in n.args)


class _Rolled:
    """Rolled versions of tensors, each made once (a class, not a recursive closure: a closure
    that calls itself is a reference cycle, which would keep the Editor's weights alive until
    Python's cyclic collector ran)."""

    def __init__(self, g: ir.Graph):
        self.g, self.ed, self.out, self.made = g, Editor(g), [], {}

    def __call__(self, name: str, rank: int, dim: int, shift: int, source: str) -> str:
        n = self.g[name]
        d = _along(n.type, rank, dim)
        if d is None:
            return name
        key = (name, d, shift)
        if key not in self.made:
            if isinstance(n, ir.Map):
                args = tuple(self(a, rank, dim, shift, source) for a in n.args)
                new = ir.Map(self.ed.fresh(f"{name}_rolled"), n.type, n.op, args, n.source)
            else:
                new = ir.View(self.ed.fresh(f"{name}_rolled"), n.type, "roll", name, (d, shift), source)
            self.out.append(new)
            self.made[key] = new.name
        return self.made[key]


def rolls_into_maps(g: ir.Graph) -> ir.Graph:
    rolled, changed = _Rolled(g), False
    for n in g.nodes:
        if isinstance(n, ir.View) and n.op == "roll" and isinstance(g[n.arg], ir.Map):
            rank = len(n.type.shape)
            dim, shift = n.params[0] % rank, n.params[1]
            if _movable(g, n.arg, rank, dim, [0]):
                top = g[n.arg]
                args = tuple(rolled(a, rank, dim, shift, n.source) for a in top.args)
                rolled.out.append(ir.Map(n.name, n.type, top.op, args, n.source))
                changed = True
                continue
        rolled.out.append(n)
    return prune(rolled.ed.graph(rolled.out)) if changed else g

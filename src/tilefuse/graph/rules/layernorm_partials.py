"""LayerNorm's two row sums as partials in the epilogue of the GEMM that wrote x.

After layernorm_into_matmul, a LayerNorm before matmuls is two row reductions of x, μ =
mean(x') and mean(x'·x') (x' = x under casts, f32), a few row-sized maps (var, s =
rsqrt(var + ε), s·μ), and the matmuls' epilogues (a row scale by s and the rank-1 correction
by s·μ). As for RMSNorm (rmsnorm_partials.py), x is most often a GEMM's output with its
residual added, and that GEMM holds every element of x in registers: it sums x' and x'·x' per
group of W columns there, beside its store of x, and a small kernel finishes the statistics
from T = N / W values of each a row:

    mean(v, last, keepdim)  →  sum_t (sum_c reshape(v, [M, T, W])) / N,  v = x' and x'·x'

Fires for a pair of such means of one x' (x' read by nothing else, x'·x' only by its mean)
when N is a multiple of W, the producing GEMM takes both partials, and nothing but generated
GEMMs reads x any more, as an operand or in an epilogue (the planner's own match, on the
rewritten graph): where a kernel reads x anyway (to normalise it, say), its row sums are free
there, and partials would only add work to the GEMM. Otherwise the graph is left as it is.
"""
from __future__ import annotations

from .. import ir
from .layernorm_matmul import _row_mean
from .match import Editor
from .rmsnorm_partials import Specs, group_width, in_one_pass, means_as_partials, producers


def _stats(g: ir.Graph, users) -> list[tuple[str, str, str]]:
    """(mean of x', mean of x'·x', x'·x') for each f32 x' reduced by exactly these two."""
    found = []
    for n in g.nodes:
        xf = _row_mean(g, n.name)
        if xf is None or g[xf].type.dtype != "f32" or xf in g.outputs:
            continue
        readers = set(users[xf])
        sq = [u for u in readers if isinstance(g[u], ir.Map) and g[u].op == "mul" and g[u].args == (xf, xf)]
        if len(sq) != 1 or readers != {n.name, sq[0]} or sq[0] in g.outputs or g[sq[0]].type.dtype != "f32":
            continue
        if len(users[sq[0]]) == 1 and _row_mean(g, users[sq[0]][0]) == sq[0]:
            found.append((n.name, users[sq[0]][0], sq[0]))
    return found


def candidates(g: ir.Graph, width: int | None = None) -> list[tuple[str, str, str, str]]:
    """(mean, mean of squares, square, x') of each LayerNorm the rule may rewrite, in graph order."""
    return [(mean, msq, sq, g[sq].args[0]) for mean, msq, sq in _stats(g, g.users())
            if g[g[sq].args[0]].type.shape[-1] % group_width(width, g[g[sq].args[0]].type.shape) == 0]


def layernorm_partials(g: ir.Graph, width: int | None = None) -> ir.Graph:
    return in_one_pass(g, candidates(g, width), lambda h, norms: _rewritten(h, norms, width))


def _rewritten(g: ir.Graph, norms, width: int | None) -> tuple[ir.Graph, list[bool]]:
    """g with every norm of `norms` rewritten, and whether a GEMM takes each one's partials and
    only GEMMs read its x."""
    new = _from_the_sources(g, [(xf, sq) for _, _, sq, xf in norms])
    new, psqs = means_as_partials(new, [pair for mean, msq, sq, xf in norms for pair in ((mean, xf), (msq, sq))],
                                  width)
    specs = Specs(new)
    ok = []
    for i, (_, _, _, xf) in enumerate(norms):
        p_sum, p_sq = psqs[2 * i], psqs[2 * i + 1]
        ok.append(p_sum in new and p_sq in new  # (pruned: nothing reads the statistics)
                  and specs.some(producers(new, (p_sum, p_sq)), lambda sp, a=p_sum, b=p_sq: {a, b} <= set(sp.outs))
                  and _read_only_by_gemms(new, new[xf].args[0], specs))
    return new, ok


def _from_the_sources(g: ir.Graph, pairs) -> ir.Graph:
    """g with, for each (x', x'·x') of `pairs`, x' = cast(x) and its square computed from the
    tensor x reshapes (keeping rows of N), the GEMM's own output when the residual add went
    into its epilogue at its [M, N] shape (residual_epilogue.py): the planner finds partials
    after the stored value, not after a view of it. x' and x'·x' are read only by their two
    means, which keep their shapes."""
    swap = {}
    for xf, sq in pairs:
        n = g[xf]
        if not (isinstance(n, ir.Map) and n.op == "cast"):
            continue
        src = n.args[0]
        while (isinstance(g[src], ir.View) and g[src].op == "reshape"
               and g[g[src].arg].type.shape[-1] == n.type.shape[-1]):
            src = g[src].arg
        if src == n.args[0]:
            continue
        t = ir.TensorType(g[src].type.shape, "f32")
        swap[xf] = ir.Map(xf, t, "cast", (src,), n.source)
        swap[sq] = ir.Map(sq, t, "mul", (xf, xf), g[sq].source)
    return Editor(g).graph([swap.get(x.name, x) for x in g.nodes]) if swap else g


def _read_only_by_gemms(g: ir.Graph, x: str, specs: Specs) -> bool:
    """Is x (and every reshape of it) read only by generated GEMMs, as their operand or in their
    epilogues, so that no other kernel reads x? Each reader's own producers are asked first."""
    todo = [x]
    while todo:
        for u in set(specs.users[todo.pop()]):
            if isinstance(g[u], ir.View) and g[u].op == "reshape":
                todo.append(u)
            elif not specs.some(producers(g, (u,)), lambda sp: u == sp.contraction or u in sp.maps):
                return False
    return True

"""A permute of an elementwise map's result moved below the map, onto its arguments.

    permute(op(a, b), p)   ->   op(permute(a, p), permute(b, p))

A map-reduce kernel computes its map in the order its result is laid out; a permute of that
result (`(q * c + rot(q) * s).transpose(1, 2).contiguous()`, a program returning a transposed
sum) then ran as a PyTorch copy after it: 130 us on top of a 53 us kernel for RoPE over 8192 x
32 heads of 128 (H200, session 55). Moved onto the arguments, the permutes are views the kernel
reads in place (`fusion.views_read_in_place`), it writes the permuted result directly, and a
permute of a permute composes: there the query is read in its own order, contiguously.

A permute that keeps the last dimension keeps the kernels' rows rows; one that moves it
(`(x * 2 + 1).transpose(1, 2).contiguous()`) leaves a kernel of maps reading x transposed, in 2-D
tiles through shared memory (codegen/tiles.py; PyTorch's copy after the map ran at 11% of copy
bandwidth). Only permutes of a map nothing else reads and that is not an output, computed by
maps of program inputs and weights alone
(`_movable`): a permute moved onto a computed tensor would cost a kernel its fusion (an
RMSNorm's statistics computed in one row order, its scaling in another: a third kernel). A
permute of a permute composes into one (none when they cancel), a permute of a roll becomes a
roll of the permute, an argument of lower rank that the permute leaves where it broadcasts
stays as it is (others get leading 1s first). A map with an argument that is a generated
tensor (a constant or iota of more than one element) that would need moving keeps its
permute: the planner reads no generated tensor through a view. Each pass moves every
qualifying permute one map down, so a chain of maps takes one pass each; a map that reads
another moving map or permute waits for the next pass.
"""
from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..rewrites import substitute
from .match import Editor, prune


def _perm(v: ir.View) -> tuple[int, ...]:
    rank = len(v.type.shape)
    return tuple(d % rank for d in v.params)


def layout_views(g: ir.Graph) -> frozenset:
    """The results that are permutes back from the memory order `g.layouts` gives them, read
    by nothing else: each is returned as that strided view of its argument (graph.fusion),
    never sunk or copied. (One that kernels read too is no such view: a strided view there
    would be copied by each of them, unseen.)"""
    if not g.layouts:
        return frozenset()
    users, out = g.users(), set()
    for name, order in zip(g.results, g.layouts):
        n = g[name]
        if (order is not None and isinstance(n, ir.View) and n.op == "permute" and _perm(n) == _inverse(order)
                and not users[name]):
            out.add(name)
    return frozenset(out)


def _then(q, p) -> tuple[int, ...]:
    """The one permute that is permute q, then permute p: x.permute(q).permute(p)."""
    return tuple(q[i] for i in p)


def _inverse(p) -> tuple[int, ...]:
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return tuple(inv)


def _sinkable(g: ir.Graph, v, users, outputs, kept=frozenset()) -> bool:
    if not (isinstance(v, ir.View) and v.op == "permute" and len(v.type.shape) >= 2) or v.name in kept:
        return False
    p, m = _perm(v), g[v.arg]
    return (p != tuple(range(len(p))) and isinstance(m, ir.Map)
            and users[m.name] == [v.name] and m.name not in outputs)


class _Mover:
    """Builds permuted views of one map's arguments (each argument once), or says it cannot."""

    def __init__(self, g: ir.Graph, ed: Editor, source: str):
        self.g, self.ed, self.source, self.nodes, self.made = g, ed, source, [], {}

    def node(self, name: str):
        return self.made[name] if name in self.made else self.g[name]

    def view(self, op: str, arg: str, shape: tuple, params: tuple) -> str:
        t = ir.TensorType(shape, self.node(arg).type.dtype)
        v = ir.View(self.ed.fresh(f"{arg}_{'t' if op == 'permute' else op}"), t, op, arg, params, self.source)
        self.nodes.append(v)
        self.made[v.name] = v
        return v.name

    def moved(self, a: str, p: tuple[int, ...]) -> str | None:
        """`a` (broadcast to rank len(p)) permuted by p: a name, or None where it cannot be."""
        g, rank = self.g, len(p)
        shape = g[a].type.shape
        lead = rank - len(shape)
        if lead > 0:
            if all(p[i] == i for i in range(lead, rank)) or g[a].type.numel == 1:
                return a  # the permute only reorders the dims `a` broadcasts along
            shape = (1,) * lead + shape
            if isinstance(g[a], (ir.Constant, ir.Iota)):
                return None
            a = self.view("reshape", a, shape, shape)
        return self.full(a, p)

    def full(self, a: str, p: tuple[int, ...]) -> str | None:
        rank = len(p)
        if p == tuple(range(rank)):
            return a
        n = self.node(a)
        if isinstance(n, ir.View) and n.op == "permute":  # permute(permute(x, q), p) = permute(x, q∘p)
            return self.full(n.arg, _then(_perm(n), p))
        if isinstance(n, ir.View) and n.op == "roll":  # roll along d, then p: p, then roll along p⁻¹(d)
            inner = self.full(n.arg, p)
            if inner is None:
                return None
            d, shift = n.params
            return self.view("roll", inner, tuple(n.type.shape[d] for d in p), (p.index(d % rank), shift))
        shape = n.type.shape
        if all(s == 1 for s in shape):
            return a  # (every dim has size 1: permuted, the shape is the same)
        if isinstance(n, (ir.Constant, ir.Iota)):
            return None
        moved = [d for d in p if shape[d] != 1]
        new = tuple(shape[d] for d in p)
        if moved == sorted(moved):  # only dims of size 1 move: a reshape (a free alias)
            return self.view("reshape", a, new, new)
        return self.view("permute", a, new, p)


def _composed(g: ir.Graph, kept) -> ir.Graph:
    """Each permute of a permute as one permute of the inner one's argument (none where they
    cancel), but for the layout views (`kept`): a permute read through another one would
    otherwise stop at it."""
    alias, nodes, changed, seen = {}, [], False, {}
    for n in g.nodes:
        inner = g[n.arg] if isinstance(n, ir.View) and n.op == "permute" and n.name not in kept else None
        if isinstance(inner, ir.View) and inner.op == "permute":
            r = _then(_perm(inner), _perm(n))
            if r == tuple(range(len(r))):
                alias[n.name] = inner.arg
                continue
            n = ir.View(n.name, n.type, "permute", inner.arg, r, n.source)
            changed = True
        if isinstance(n, ir.View) and n.name not in kept:  # (one view made twice, by two maps' moves, is one)
            a = n.arg
            while a in alias:
                a = alias[a]
            key = (n.op, a, tuple(n.params), n.type)
            if key in seen:
                alias[n.name] = seen[key]
                continue
            seen[key] = n.name
        nodes.append(n)
    if not alias and not changed:
        return g
    return prune(substitute(g.replace(nodes=nodes), alias))


def _through_views(g: ir.Graph, a: str) -> list[str]:
    out = [a]
    while isinstance(g[a], ir.View):
        a = g[a].arg
        out.append(a)
    return out


def permutes_into_maps(g: ir.Graph) -> ir.Graph:
    out = g
    for _ in range(len(g.nodes) + 1):  # (each pass moves every permute one map down)
        kept = layout_views(out)  # (composing leaves them as they are)
        out = _composed(out, kept)
        users, outputs = out.users(), set(out.outputs)
        hits = {n.arg: n for n in out.nodes if _sinkable(out, n, users, outputs, kept)
                and _movable(out, n.arg, users, len(n.type.shape))}
        touched = set(hits) | {v.name for v in hits.values()}
        for m in list(hits):  # (one reading another's map or permute waits for the next pass)
            if any(x in touched for a in out[m].args for x in _through_views(out, a)):
                del hits[m]
        if not hits:
            return out
        ed, nodes, moved_any, done = Editor(out), [], False, set()
        for n in out.nodes:
            v = hits.get(n.name)
            if v is not None:
                mover, p = _Mover(out, ed, v.source), _perm(v)
                cache: dict[str, str | None] = {}
                for a in dict.fromkeys(n.args):
                    cache[a] = mover.moved(a, p)
                if all(x is not None for x in cache.values()):
                    nodes += mover.nodes
                    nodes.append(ir.Map(v.name, v.type, n.op, tuple(cache[a] for a in n.args), n.source))
                    done.add(v.name)
                    moved_any = True
                    continue
            if n.name in done:
                continue
            nodes.append(n)
        if not moved_any:
            return out
        out = ed.graph(nodes)
    return out


def _movable(g: ir.Graph, name: str, users, rank: int, root: bool = True) -> bool:
    """Whether permutes_into_maps would take a permute of `name` down to program inputs and
    weights: a map read by nothing else, of movable arguments; an input, a weight or views of
    one (read in place); or an argument it leaves where it is (of lower rank, or all dims 1).
    A permute left on a computed tensor would cost a kernel its fusion (a softmax's sum
    computed in one row order, its division in another)."""
    n = g[name]
    if len(n.type.shape) < rank or all(d == 1 for d in n.type.shape):
        return True
    if isinstance(n, ir.Map):  # (a map the program returns too stays as it is: computed once, in its order)
        return (len(set(users[name])) <= 1 and (root or name not in g.outputs)
                and all(_movable(g, a, users, rank, False) for a in dict.fromkeys(n.args)))
    while isinstance(n, ir.View):
        n = g[n.arg]
    return isinstance(n, (ir.Input, ir.Weight))


def results_in_eager_layout(g: ir.Graph) -> ir.Graph:
    """A result PyTorch lays out permuted (`g.layouts`), computed by maps of inputs and weights
    alone, is computed in that memory order and returned as a strided view of it:

        y = op(x.transpose(1, 2), c)   ->   m = permute(op(...), order); y = permute(m, order⁻¹)

    permutes_into_maps then moves the first permute onto op's arguments (where transposes
    compose: x is read in its own order), the kernel writes m contiguously, and the second
    permute, the result, is a view of m with eager's strides (graph.fusion: no copy). What
    torch.compile returns too; written contiguous instead, the kernel read x 256 bytes at a
    time 8 KB apart (rotate-half RoPE on 8192 x 32 heads: 53 us against its 34, H200). Any
    other result stays contiguous."""
    if not g.layouts:
        return g
    users = g.users()
    ed, outs, nodes, changed = Editor(g), list(g.outputs), list(g.nodes), False
    for i, (name, order) in enumerate(zip(g.results, g.layouts)):
        n = g[name]
        if order is None or users[name] or g.outputs.count(name) != 1 or name in g.inputs:
            continue
        base, chain = name, []  # (a result that is a permute of a map: the permutes compose, then move)
        while isinstance(g[base], ir.View) and g[base].op == "permute" and len(set(users[g[base].arg])) == 1:
            chain.append(_perm(g[base]))
            base = g[base].arg
        r = tuple(range(len(order)))
        for q in [*reversed(chain), order]:  # base's dims as the laid-out result orders them
            r = _then(r, q)
        if not isinstance(g[base], ir.Map) or not _movable(g, base, users, len(order)):
            continue
        shape = n.type.shape
        laid = ir.View(ed.fresh(f"{name}_laid"), ir.TensorType(tuple(shape[d] for d in order), n.type.dtype),
                       "permute", name, tuple(order), n.source)
        back = ir.View(ed.fresh(f"{name}_strided"), n.type, "permute", laid.name, _inverse(order), n.source)
        nodes += [laid, back]
        outs[i] = back.name
        changed = True
    return ed.graph(nodes, outs) if changed else g


def reaches_row_reduction(g: ir.Graph, users: dict, name: str) -> bool:
    """Whether a reduction over the last dim (a row kernel's, which reads rows along it) reads
    `name`, directly or through maps and views. (One over other dims runs in a column kernel or
    in PyTorch; maps before it are read in tiles as they are.)"""
    seen, stack = set(), [name]
    while stack:
        x = stack.pop()
        for u in users.get(x, ()):
            n = g[u]
            if isinstance(n, ir.Reduce):
                shape = g[n.arg].type.shape
                if [a for a in n.axes if shape[a] != 1] == [len(shape) - 1]:
                    return True
                continue
            if isinstance(n, (ir.Map, ir.View)) and u not in seen:
                seen.add(u)
                stack.append(u)
    return False


def transposed_results_as_copies(g: ir.Graph) -> ir.Graph:
    """A permute moving the last dim of a tensor in memory that a result returns contiguous, or
    that a matmul takes as its left operand (which the GEMM reads row-major), is copied by a
    kernel of its own (an identity cast of the view, which that kernel reads in place, in tiles:
    codegen/tiles.py) instead of PyTorch's copy: `x.transpose(1, 2).contiguous()` at 64 x 4096 x
    256 bf16 took 422 us in eager's copy (15% of copy bandwidth), 64 us so. A layout view
    (returned strided, no copy) stays as it is, as does a permute of a generated tensor (a
    constant, an iota: made where it is read, no view of it is read in place), of a written
    input, or of no element.

    Likewise one a row reduction reads, directly or through maps and views (a LayerNorm over the
    channels of NHWC read from NCHW, ConvNeXt's): a kernel with a reduction does not read a transposed
    tensor in place (its rows would load an element a transaction), so PyTorch copied it, at
    eager's copy speed; now the tiles kernel copies it for every reader."""
    kept = layout_views(g)
    users = g.users()
    ed, outs, changed = Editor(g), list(g.outputs), False

    def copied(name: str) -> bool:
        n = g[name]
        if (name in kept or not isinstance(n, ir.View) or n.op != "permute" or len(n.type.shape) < 2
                or n.type.numel == 0 or _perm(n)[-1] == len(n.type.shape) - 1):
            return False
        chain = _through_views(g, name)
        return not isinstance(g[chain[-1]], (ir.Constant, ir.Iota)) and not any(x in g.writes for x in chain)

    copies: dict[str, ir.Map] = {}

    def copy_of(name: str) -> str:
        if name not in copies:
            n = g[name]
            copies[name] = ir.Map(ed.fresh(f"{name}_copy"), n.type, "cast", (name,), n.source)
        return copies[name].name

    for i, name in enumerate(g.results):
        if g.outputs.count(name) == 1 and copied(name):
            outs[i] = copy_of(name)
            changed = True
    reduced = {n.name for n in g.nodes if copied(n.name) and reaches_row_reduction(g, users, n.name)}
    nodes = []
    for n in g.nodes:
        if isinstance(n, ir.Contraction) and copied(n.a):
            n = replace(n, a=copy_of(n.a))
            changed = True
        elif isinstance(n, ir.Map) and reduced & set(n.args):
            n = replace(n, args=tuple(copy_of(a) if a in reduced else a for a in n.args))
            changed = True
        elif isinstance(n, (ir.Reduce, ir.View)) and n.arg in reduced:  # (a view of it: of the copy, which is free)
            n = replace(n, arg=copy_of(n.arg))
            changed = True
        nodes.append(n)
    if not changed:
        return g
    at = {v: i for i, v in enumerate(x.name for x in nodes)}
    for name, c in sorted(copies.items(), key=lambda t: -at[t[0]]):  # each right after its view
        nodes.insert(at[name] + 1, c)
    return ed.graph(nodes, outs)

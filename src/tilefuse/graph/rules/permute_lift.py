"""Maps that attention reads through a permute of a computed tensor, computed in that tensor's order.

    y = f(permute(x, p), c, roll(permute(x, p)))      (y read only by attention)
      ->   y' = f(x, permute(c, p⁻¹), roll'(x));  y = permute(y', p)

Qwen3 normalises each head of q and k before the head transpose, then applies rotate-half RoPE
to the transposed heads: the norm kernel computes rows in [B, S, H] order and wrote its output,
the RoPE kernel read it transposed ([B, H, S]: another row order, so not the same kernel) and
wrote q for attention. Computed in the norm's order instead, the RoPE maps read the norm's
output as it lies (and its roll, which `roll_sink` then moves onto q itself), so the norm and
the rotation are one kernel; attention reads the result through the permute, a strided view
SDPA takes in place (its last dim stays last).

Taken where the map's result is read only by attention, every tensor it reaches through maps
and rolls that varies along the permuted dims is either a permute by one p (of a computed map
for at least one: else nothing fuses, and `permutes_into_maps` would move the permute back) or
a tensor in memory (cos and sin tables, viewed permuted back), and the permute keeps the last
dim last. The values are the same (elementwise maps of the same elements).
"""
from __future__ import annotations

from .. import ir
from .match import Editor, prune
from .permute_sink import _movable, _perm

MAX_MAPS = 16


def _computed(g: ir.Graph, name: str) -> bool:
    """Whether a map's cone (through maps and views) reaches anything but inputs, weights and
    constants: a permute of it stays where permutes_into_maps finds it."""
    stack, seen = [name], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        n = g[x]
        if isinstance(n, ir.Map):
            stack.extend(n.args)
        elif isinstance(n, ir.View):
            stack.append(n.arg)
        elif not isinstance(n, (ir.Input, ir.Weight, ir.Constant, ir.Iota)):
            return True
    return False


def _constant_everywhere(t: ir.TensorType) -> bool:
    return all(d == 1 for d in t.shape)


def _chain(g: ir.Graph, users, name: str, rank: int, found: dict) -> bool:
    """Whether `name` lifts: maps and rolls of full rank down to permutes of full rank (their
    orders gathered in found["p"]; found["fuses"] set where one permutes a computed map that
    permutes_into_maps would not move the permute back onto) and tensors in memory."""
    n = g[name]
    if _constant_everywhere(n.type) or len(n.type.shape) < rank and not isinstance(n, (ir.Map, ir.View)):
        return True
    full = len(n.type.shape) == rank
    if isinstance(n, ir.View) and n.op == "permute":
        found.setdefault("p", set()).add(_perm(n))
        if isinstance(g[n.arg], ir.Map) and _computed(g, n.arg) and not _movable(g, n.arg, users, rank):
            found["fuses"] = True
        return full
    if isinstance(n, ir.View) and n.op == "roll":
        return full and _chain(g, users, n.arg, rank, found)
    if isinstance(n, ir.Map):
        found["maps"] = found.get("maps", 0) + 1
        return (found["maps"] <= MAX_MAPS and full
                and all(_chain(g, users, a, rank, found) for a in n.args))
    return isinstance(n, (ir.Input, ir.Weight)) or isinstance(n, ir.View) and n.op in ("reshape", "expand", "slice")


class _Lift:
    """The chain's nodes in the permute's source order, each made once."""

    def __init__(self, g: ir.Graph, ed: Editor, p: tuple[int, ...], source: str):
        self.g, self.ed, self.p, self.source = g, ed, p, source
        self.inv = tuple(p.index(i) for i in range(len(p)))
        self.out, self.made, self.types = [], {}, {}

    def type(self, name: str) -> ir.TensorType:
        return self.types[name] if name in self.types else self.g[name].type

    def back(self, shape: tuple) -> tuple:
        """A shape of the permuted order (padded to its rank) in the source order."""
        full = (1,) * (len(self.p) - len(shape)) + tuple(shape)
        return tuple(full[i] for i in self.inv)

    def view(self, op: str, arg: str, shape: tuple, params: tuple) -> str:
        name = self.ed.fresh(f"{arg}_{op}")
        t = ir.TensorType(tuple(shape), self.type(arg).dtype)
        self.out.append(ir.View(name, t, op, arg, tuple(params), self.source))
        self.types[name] = t
        return name

    def __call__(self, name: str) -> str:
        if name not in self.made:
            self.made[name] = self._lift(name)
        return self.made[name]

    def _lift(self, name: str) -> str:
        n, rank = self.g[name], len(self.p)
        shape = n.type.shape
        if _constant_everywhere(n.type):
            return name
        if isinstance(n, ir.View) and n.op == "permute":
            return n.arg
        if isinstance(n, ir.View) and n.op == "roll":
            d, shift = n.params
            return self.view("roll", self(n.arg), self.back(shape), (self.p[d % rank], shift))
        if isinstance(n, ir.Map):
            new = self.ed.fresh(f"{name}_lifted")
            t = ir.TensorType(self.back(shape), n.type.dtype)
            self.out.append(ir.Map(new, t, n.op, tuple(self(a) for a in n.args), n.source))
            self.types[new] = t
            return new
        if len(shape) < rank:  # (cos and sin as [S, D]: leading 1s first)
            padded = (1,) * (rank - len(shape)) + shape
            name = self.view("reshape", name, padded, padded)
        return self.view("permute", name, self.back(shape), self.inv)


def maps_in_source_order(g: ir.Graph) -> ir.Graph:
    users = g.users()
    ed, out, changed = Editor(g), [], False
    for n in g.nodes:
        readers = users[n.name]
        found: dict = {}
        if (isinstance(n, ir.Map) and readers and n.name not in g.outputs and len(n.type.shape) >= 3
                and all(isinstance(g[u], ir.Attention) and n.name in (g[u].q, g[u].k, g[u].v) for u in readers)
                and _chain(g, users, n.name, len(n.type.shape), found) and found.get("fuses")
                and len(found["p"]) == 1):
            (p,) = found["p"]
            if p[-1] == len(p) - 1 and p != tuple(range(len(p))):
                lift = _Lift(g, ed, p, n.source)
                top = lift(n.name)
                out += lift.out
                out.append(ir.View(n.name, n.type, "permute", top, p, n.source))
                changed = True
                continue
        out.append(n)
    return prune(ed.graph(out)) if changed else g

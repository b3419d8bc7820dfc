"""A reduction over a short dim that is not the last, as maps of its slices.

    y = x.sum(1)   (x of [T, 2, D])   ->   y = reshape(x[:, 0:1] + x[:, 1:2], [T, D])

A mixture of experts sums each token's top-k expert outputs (`out.view(T, k, D).sum(1)`), a
reduction over a dim of 2 to 8 elements with D elements beside it in each row. The planner
takes reductions over the last dim (row kernels) or over another one with many rows beside
it (column kernels, graph/fusion.py); this one ran in PyTorch, the expert outputs written to
memory, read back, and the sum written again. As k slices combined by maps it is a map
kernel, computed in the kernel that computes the slices or the one that reads the sum.

Summation as PyTorch's: a 16-bit sum adds in float32 and rounds once; a mean divides the sum
by k; an integer or bool sum adds in its result's type; max/min compare in the input's type.
Taken where the dim has at most MAX_EXTENT elements, some dim after it more than one, nothing
but the reduction reads its argument, and nothing computed from its result is as large as the
argument: each element is then read once, by the map that adds it. Where the argument or its
inputs are read again beside the reduction (a softmax or a norm over a short dim,
`x - x.amax(1, keepdim=True)`), the maps would read each slice once per element of the result;
a column kernel (graph/fusion.py) reads the row once and keeps it. (A column kernel over a dim
of 2 reads 8 bytes a thread: the sum of a mixture of experts' top-2 outputs, 134 MB of float32,
took 326 us on an H200, about 0.6 TB/s.)
"""
from __future__ import annotations

import math
from dataclasses import replace

from .. import ir
from .match import Editor

MAX_EXTENT = 8
_COMBINE = {"sum": "add", "mean": "add", "prod": "mul", "max": "max", "min": "min"}


def _short_axis(n: ir.Node, g: ir.Graph, users: dict) -> int | None:
    """The reduced dim, where n reduces one short dim that is not the last of more than one
    element, of a tensor nothing else reads."""
    if not isinstance(n, ir.Reduce) or n.op not in _COMBINE or len(n.axes) != 1:
        return None
    shape = g[n.arg].type.shape
    a = n.axes[0] % len(shape)
    if not 2 <= shape[a] <= MAX_EXTENT or all(s == 1 for s in shape[a + 1:]):
        return None
    if users.get(n.arg) != [n.name] or n.arg in g.outputs or _read_back(g, users, n):
        return None
    return a


def _read_back(g: ir.Graph, users: dict, n: ir.Reduce) -> bool:
    """Whether a map or view after n (n's result, or what is computed from it) is as large as
    n's argument: the result broadcast back over the reduced dim, a norm's statistics."""
    size = math.prod(g[n.arg].type.shape)
    todo, seen = [n.name], set()
    while todo:
        for u in users.get(todo.pop(), []):
            if u in seen or not isinstance(g[u], (ir.Map, ir.View)):
                continue
            seen.add(u)
            if math.prod(g[u].type.shape) >= size:
                return True
            todo.append(u)
    return False


def _acc_dtype(n: ir.Reduce, arg_dtype: str) -> str:
    if n.op in ("max", "min"):
        return arg_dtype
    return "f32" if n.type.dtype in ("bf16", "f16") else n.type.dtype


def short_reductions_as_maps(g: ir.Graph) -> ir.Graph:
    users = g.users()
    if not any(_short_axis(n, g, users) is not None for n in g.nodes):
        return g
    ed = Editor(g)
    out = []
    for n in g.nodes:
        a = _short_axis(n, g, users)
        if a is None:
            out.append(n)
            continue
        x = g[n.arg]
        shape, k = x.type.shape, x.type.shape[a]
        acc = _acc_dtype(n, x.type.dtype)
        piece = ir.TensorType(shape[:a] + (1,) + shape[a + 1:], x.type.dtype)
        total = None
        for j in range(k):
            s = ir.View(ed.fresh(f"{n.name}_at{j}"), piece, "slice", x.name, (a, j, j + 1, 1), n.source)
            out.append(s)
            v = s.name
            if acc != x.type.dtype:
                c = ir.Map(ed.fresh(f"{n.name}_cast{j}"), ir.TensorType(piece.shape, acc), "cast", (v,), n.source)
                out.append(c)
                v = c.name
            if total is not None:
                m = ir.Map(ed.fresh(f"{n.name}_{_COMBINE[n.op]}"), ir.TensorType(piece.shape, acc), _COMBINE[n.op],
                           (total, v), n.source)
                out.append(m)
                v = m.name
            total = v
        if n.op == "mean":
            kc = ir.Constant(ed.fresh(f"{n.name}_k"), ir.TensorType((), acc), float(k), n.source)
            m = ir.Map(ed.fresh(f"{n.name}_div"), ir.TensorType(piece.shape, acc), "div", (total, kc.name), n.source)
            out += [kc, m]
            total = m.name
        if acc != n.type.dtype:
            c = ir.Map(ed.fresh(f"{n.name}_cast"), ir.TensorType(piece.shape, n.type.dtype), "cast", (total,), n.source)
            out.append(c)
            total = c.name
        # the result under the reduction's own name (a program output keeps it), reshaped when the
        # reduced dim is dropped, else the combining map renamed
        last = out.pop() if out[-1].name == total else None
        if n.keepdim:
            out.append(_renamed(last, n.name) if last is not None else
                       ir.View(n.name, n.type, "reshape", total, n.type.shape, n.source))
        else:
            if last is not None:
                out.append(last)
            out.append(ir.View(n.name, n.type, "reshape", total, n.type.shape, n.source))
    return ed.graph(out)


def _renamed(n, name: str):
    return replace(n, name=name)

"""One compiled program for every size of a graph whose changing sizes reach only PyTorch ops.

Under `generate` the decode graph's key/value cache grows by a token each call, and each
size was compiled on its own: about 0.5 s a size for a 4-layer Llama on an H100, and past 64
sizes a graph ran new ones in eager. Yet those programs differ only in the cache's shapes, and
the cache is read and written only by externs: the cat that appends the token, attention.
Where two sizes' programs are one program in that sense (`family`), a third size needs no
compile (`Family.at`): the same steps and kernels, with each extern's output shape found by
running the extern on meta tensors of its inputs' new shapes.

What a program cannot show, the caller checks (frontend/backend.py): that the graph's
symbolic export holds for the new sizes and passes no size as an argument to any op
(`sizes.Symbolic.sized_op`), so every extern runs with the same arguments at every size.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from .. import dtypes
from ..graph import ir
from ..graph.fusion import Plan, extern_cost

_KERNELS = ("mapreduce", "gemm")


@dataclass(frozen=True)
class Family:
    """A program and the tensors whose shapes change with its graph's sizes: name -> the dims
    that differed between the two compiled sizes (only those may change)."""

    program: object  # runtime.program.Program
    varying: dict

    def at(self, shapes) -> object | None:
        """The program for user inputs of these shapes (in `graph.inputs` order), or None where
        a shape that must stay fixed would change (the caller then compiles that size).

        It does not know the graph's guards: a slice the export dropped as a no-op at the
        compiled sizes (`k[:, :, -8:]` of a shorter cache) is not in the program. The caller
        checks that the graph holds at these sizes first (the backend: `Symbolic.bind`)."""
        p = self.program
        types = _inferred(p.graph, shapes, self.varying)
        if types is None:
            return None
        g = p.graph
        nodes = tuple(n if types[n.name] == n.type else dataclasses.replace(n, type=types[n.name]) for n in g.nodes)
        graph = ir.Graph(nodes, g.inputs, g.outputs, g.weights, g.writes, g.layouts)
        steps = []
        for s in p.plan.steps:
            if s.family == "extern" and self.varying.keys() & {*s.inputs, *s.outputs}:
                s = copy.copy(s)
                s.bytes, s.flops = extern_cost(graph, s)
            steps.append(s)
        return p.with_graph(graph, Plan(graph, steps))


def family(p0, p1) -> Family | str:
    """`p1`'s Family when `p0` (the same graph compiled at other sizes) is the same program but
    for the shapes of tensors that only externs read and write; else why not."""
    g0, g1 = p0.graph, p1.graph
    if (g0.inputs, g0.outputs) != (g1.inputs, g1.outputs) or [n.name for n in g0.nodes] != [n.name for n in g1.nodes]:
        return "its graph's nodes differ between sizes"
    varying = {}
    for a, b in zip(g0.nodes, g1.nodes):
        if type(a) is not type(b) or a.type.dtype != b.type.dtype or len(a.type.shape) != len(b.type.shape):
            return f"{b.name} differs between sizes"
        if a.type != b.type:
            if isinstance(b, (ir.Weight, ir.Constant, ir.Iota)):
                return f"{b.name}, a {type(b).__name__.lower()}, changes shape with the sizes"
            varying[b.name] = frozenset(i for i, (x, y) in enumerate(zip(a.type.shape, b.type.shape)) if x != y)
            a = dataclasses.replace(a, type=b.type)
        if a != b:  # a size baked into the node (slice bounds, a constant)
            return f"{b.name} differs between sizes beyond its shape"
    if not varying:
        return "the two programs have the same shapes"
    if set(g0.weights) != set(g1.weights):
        return "its weights differ between sizes"
    for name in g0.weights:
        # a value folded from the sizes (a sum of ones over a varying dim) is a weight too:
        # shared, the third size would get a compiled size's value
        if not _same_value(g0.weights[name], g1.weights[name]):
            return f"weight {name} has another value at each size"
    if len(p0.plan.steps) != len(p1.plan.steps):
        return "its plan differs between sizes"
    for s0, s in zip(p0.plan.steps, p1.plan.steps):
        touched = varying.keys() & {*s.nodes, *s.inputs, *s.outputs}
        if s.family in _KERNELS and touched:
            return f"kernel {s.name} reads or writes {min(touched)}, whose shape changes with the sizes"
        if _step_key(s0) != _step_key(s):
            return f"step {s.name} differs between sizes"
        if s.family in _KERNELS:
            table = "kernels" if s.family == "mapreduce" else "gemms"
            if getattr(p0, table)[s.name] != getattr(p1, table)[s.name]:
                return f"kernel {s.name} differs between sizes"
        elif touched:
            why = _not_polymorphic(g1, s)
            if why:
                return why
    for f in ("out_spec", "arch", "schedules", "inputs", "pool"):
        if getattr(p0, f) != getattr(p1, f):
            return f"the programs' {f} differ"
    fam = Family(p1, varying)
    for p in (p0, p1):  # the shapes each extern is found to make are the ones each compile recorded
        if _inferred(p.graph, [p.graph[i].type.shape for i in p.graph.inputs], fam.varying) != \
                {n.name: n.type for n in p.graph.nodes}:
            return "an extern's shape at a compiled size is not what running it gives"
    return fam


SMALL = 1 << 16  # elements: a map over a varying tensor this small may run in PyTorch instead


def torch_maps(p0, p1) -> frozenset:
    """Where `family(p0, p1)` fails only because kernels compute small maps over tensors whose
    shapes change with the sizes (transformers 5.17's decode step casts `generate`'s attention
    mask, one longer each step): those maps' names, to run in PyTorch (graph.fusion.plan's
    `in_torch`) so that the next two sizes make a family. A small map of a fixed shape fused
    into such a kernel goes with it (a left-padded batch's mask `and` shared its kernel with
    RoPE's [batch, 1, 1] position cast). Empty where that would not do."""
    from ..graph.fusion import TORCH_MAPS

    g0, g1 = p0.graph, p1.graph
    if [n.name for n in g0.nodes] != [n.name for n in g1.nodes]:
        return frozenset()
    varying = {b.name for a, b in zip(g0.nodes, g1.nodes) if a.type != b.type}
    found = set()
    for s in p1.plan.steps:
        if s.family not in _KERNELS or not varying & {*s.nodes, *s.inputs, *s.outputs}:
            continue
        for name in s.nodes:
            n = g1[name]
            if not (isinstance(n, ir.Map) and n.op in TORCH_MAPS
                    and max(g0[name].type.numel, n.type.numel) <= SMALL):
                return frozenset()
            found.add(name)
    return frozenset(found)


def _same_value(a, b) -> bool:
    """Whether two weights (torch tensors or ndarrays) hold the same values (one tensor: yes)."""
    if a is b:
        return True
    a, b = (torch.as_tensor(x) for x in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(
        torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                              and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))))


def _step_key(s) -> tuple:
    return s.name, s.family, tuple(s.nodes), tuple(s.inputs), tuple(s.outputs), s.view, s.space, tuple(s.reads.items())


def _not_polymorphic(g: ir.Graph, s) -> str:
    """Why step `s`, which reads or writes a tensor whose shape changes, cannot take new shapes
    as they come ("" when it can): an alias or a view keeps its target shape in the node."""
    if s.family != "extern":
        return f"{s.name} ({s.family}) keeps a fixed shape"
    n = g[s.nodes[0]]
    if isinstance(n, ir.View) and n.op != "permute":
        return f"{s.name} ({n.op}) keeps a fixed shape"
    return ""


def _inferred(g: ir.Graph, shapes, varying: dict) -> dict | None:
    """Each tensor's type with the inputs at `shapes`: the output shape of each extern that
    makes or reads a varying tensor from running it on meta tensors; None where a tensor outside
    `varying` would change, or a varying one in a dim that did not vary between the compiles."""
    shapes = [tuple(s) for s in shapes]
    if len(shapes) != len(g.inputs):
        return None
    types = {}
    changed = set()
    given = dict(zip(g.inputs, shapes))
    for n in g.nodes:
        t = n.type
        if n.name in given:
            t = ir.TensorType(given[n.name], t.dtype)
        elif n.name in varying or changed & set(ir.node_args(n)):
            t = _run_meta(n, types)
            if t is None:
                return None
        if t != n.type:
            dims = varying.get(n.name, ())
            if len(t.shape) != len(n.type.shape) or any(
                    x != y and i not in dims for i, (x, y) in enumerate(zip(t.shape, n.type.shape))):
                return None
            changed.add(n.name)
        types[n.name] = t
    return types


def _run_meta(n, types) -> ir.TensorType | None:
    """The node's type when its inputs have `types`: run as the program runs it, on meta tensors
    (the cache's cat and attention by their shape rules: a meta run costs ~1 ms each)."""
    from .program import run_extern, strided_view

    shape = _rule(n, types)
    if shape is not None:
        return ir.TensorType(shape, n.type.dtype)

    def get(name):
        t = types[name]
        return torch.empty(t.shape, dtype=dtypes.to_torch(t.dtype), device="meta")

    try:
        if isinstance(n, ir.View) and n.op == "permute":
            out = strided_view(n, get(n.arg))
        else:
            out = run_extern(n, get)
    except Exception:  # noqa: BLE001 - an op without a meta kernel, or shapes it refuses: compile the size
        return None
    return ir.TensorType(tuple(out.shape), n.type.dtype)


def _rule(n, types) -> tuple | None:
    """The output shape of a cat (along one dim, inputs of one rank) or of attention (q's
    shape with v's last dim); None for anything else, which runs on meta tensors."""
    if isinstance(n, ir.Attention):
        q, v = types[n.q].shape, types[n.v].shape
        return q[:-1] + v[-1:] if len(q) == len(v) >= 2 else None
    if isinstance(n, ir.Extern) and n.target == "aten.cat.default" and not n.kwargs and len(n.args) in (1, 2):
        parts = n.args[0]
        if not parts or not all(isinstance(a, ir.Ref) for a in parts):
            return None
        shapes = [types[a.name].shape for a in parts]
        rank = len(shapes[0])
        dim = n.args[1] if len(n.args) == 2 else 0
        if rank == 0 or not isinstance(dim, int) or not -rank <= dim < rank:
            return None
        dim %= rank
        if any(len(s) != rank or s[:dim] + s[dim + 1:] != shapes[0][:dim] + shapes[0][dim + 1:] for s in shapes):
            return None
        return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]
    return None

"""Python ints that dynamo made dynamic and that only enter tensor arithmetic, as 0-d tensors.

transformers' sliding-window caches pass their length to each decode step as a Python int
(`cumulative_length`). Dynamo makes it a SymInt input once it changes, and since no tensor's
shape holds it, every value was a new size: a new export and a full compile for every token.
Yet the length reaches the step only as a number added to index tensors (the mask's
positions) or as the returned length itself; no shape depends on it. Such an int is passed
to the program as a 0-d int64 tensor, and the graph is rewritten to compute with it as a
tensor: every value then runs one program.

An int is taken only where each of its uses is (transitively) integer arithmetic on it,
an elementwise operator between it and a tensor, or a graph output (an integer output,
evaluated on the host from the call's values as before). A use as a size, an index, a
slice bound or any other argument leaves it an int: the graph compiles per value, as before.
A 0-d tensor does not promote a tensor of dims beyond what a Python int does (an int tensor
keeps its width, a float its precision, bool becomes int64), so the results are the same.
What would differ stays an int: an operator whose tensors are all 0-d (two 0-d operands
promote to int64), a 16-bit float operand (PyTorch computes with a Python int in float32 but,
on a GPU, casts a 0-d tensor to the 16-bit type), the int as a divisor (`x // 0` raises in
Python, not in a GPU kernel), and an output the caller would get as a tensor. One difference
is accepted: integer arithmetic past int64 wraps where Python's ints grow (eager then raises
when the value meets a tensor).
"""
from __future__ import annotations

import operator

import torch

# integer arithmetic that works alike on ints and 0-d int64 tensors
_ARITH = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
          operator.pos, abs}
# elementwise operators between a tensor and the number
_ELEMENTWISE = _ARITH | {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne,
                         torch.add, torch.sub, torch.mul, torch.lt, torch.le, torch.gt, torch.ge, torch.eq,
                         torch.ne, torch.maximum, torch.minimum}
# a 16-bit float operand: PyTorch computes `x * n` with a Python int n in float32 (257 stays 257),
# but on a GPU casts a 0-d int64 CUDA tensor to the 16-bit type first (bf16: 257 becomes 256)
_HALF = (torch.float16, torch.bfloat16)
_MINMAX = {torch.sym_max: "min", torch.sym_min: "max"}  # -> torch.clamp(x, min=/max= the other)


def _is_tensor(node) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("example_value"), torch.Tensor)


def _is_int(node) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("example_value"), (int, torch.SymInt)) \
        and not isinstance(node.meta.get("example_value"), bool)


def _elementwise_with_a_tensor(user) -> bool:
    """An elementwise operator between the number and a tensor of dims (two 0-d operands promote
    to int64 where a Python int would keep the tensor's type), none of them 16-bit floats."""
    tensors = [a.meta["example_value"] for a in user.args if _is_tensor(a)]
    return (user.target in _ELEMENTWISE and any(t.dim() > 0 for t in tensors)
            and all(_is_tensor(a) or _is_int(a) or type(a) in (int, float) for a in user.args)
            and not any(t.dtype in _HALF for t in tensors))


def _closure(placeholder, int_outputs=None) -> tuple[list, bool]:
    """The integer nodes computed from `placeholder` (itself first), and whether every use of
    them is one this module can turn into tensor arithmetic. `int_outputs`: the graph's output
    positions the caller returns as integers (None: any)."""
    nodes, seen, todo = [], set(), [placeholder]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        nodes.append(n)
        for user in n.users:
            if user.op == "output":
                if int_outputs is not None:
                    out = user.args[0]
                    if not isinstance(out, (tuple, list)) or any(o is n and j not in int_outputs
                                                                 for j, o in enumerate(out)):
                        return nodes, False  # (it would come back as a tensor)
                continue
            if user.op != "call_function" or user.kwargs:
                return nodes, False
            if user.target in (operator.floordiv, operator.mod) and user.args[1] is n:
                return nodes, False  # a divisor: x // 0 raises in Python, not in a GPU kernel
            if _is_int(user) and user.target in _ARITH:
                todo.append(user)
            elif _is_int(user) and user.target in _MINMAX and len(user.args) == 2 and \
                    any(type(a) is int for a in user.args):  # a bound: torch.clamp
                todo.append(user)
            elif _is_tensor(user) and _elementwise_with_a_tensor(user):
                continue
            else:
                return nodes, False
    order = {n: i for i, n in enumerate(placeholder.graph.nodes)}
    return sorted(nodes, key=order.__getitem__), True


def value_ints(placeholders, kinds, tensor_dims, int_outputs=None) -> list[int]:
    """Positions of the int inputs to pass as 0-d tensors: SymInts no tensor's dim holds
    (`tensor_dims`: the sympy expressions of the user tensors' dynamic dims), used only as
    numbers, and output only at `int_outputs` (the positions returned as integers)."""
    found = []
    for i, (node, kind) in enumerate(zip(placeholders, kinds)):
        val = node.meta.get("example_value")
        if kind != "int" or not isinstance(val, torch.SymInt) or val.node.expr in tensor_dims:
            continue
        if _closure(node, int_outputs)[1]:
            found.append(i)
    return found


def tensorize(gm: torch.fx.GraphModule, positions) -> torch.fx.GraphModule:
    """A copy of `gm` taking 0-d int64 tensors at the placeholders `positions` (see value_ints),
    each integer node computed from them rewritten as tensor arithmetic. Its outputs at those
    nodes are 0-d tensors (the caller returns the integers it evaluates itself)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})  # (node metas copied shallowly: the fake values are shared)
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    closures = [_closure(placeholders[i]) for i in positions]
    assert all(ok for _, ok in closures), "a placeholder is not a value int"
    zero = torch.zeros((), dtype=torch.int64)
    for nodes, _ in closures:
        for n in nodes:
            if n.target in _MINMAX:  # torch.sym_max(x, 0) -> torch.clamp(x, min=0)
                x, bound = n.args if type(n.args[1]) is int else n.args[::-1]
                n.target, n.args, n.kwargs = torch.clamp, (x,), {_MINMAX[n.target]: bound}
            n.meta["example_value"] = zero
    # the integer outputs are evaluated on the host and these positions dropped: returning the
    # first rewritten input there leaves their arithmetic dead (`len(cache) + n` would otherwise
    # reach torch.export as an op taking a size, and stop sizes from being made with no compile)
    rewritten = {n for nodes, _ in closures for n in nodes}
    output = next(n for n in graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        first = placeholders[min(positions)]
        output.args = (type(output.args[0])(first if o in rewritten else o for o in output.args[0]),)
    for n in sorted(rewritten, key=list(graph.nodes).index, reverse=True):  # (only these: the graph's
        if n.op != "placeholder" and not n.users:                          # in-place writes stay)
            graph.erase_node(n)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)

"""Tensors a graph builds from its sizes alone, made in PyTorch before the program runs.

Under torch 2.11 transformers builds each decode step's causal mask inside the compiled graph
from the cache's length: `arange(1) + s0` (the query's position), `arange(s0 + 1)` (the keys'),
`kv <= q`, `expand(1, -1, 1, s0 + 1)`; Gemma2's global layers do it on any torch. Those ops take a size
as an argument, so no program made at one size serves another (`sizes.Symbolic.sized_op`), and
every token compiled anew. Yet nothing in them reads a tensor's values: only the sizes.

Here they are split off the graph (`split`): a prologue, the ancestors of those tensors run as
the graph as given (in PyTorch, a few small ops), and the graph without them, which takes their
results as extra inputs. The program then sees the mask as an input whose shape follows the
length, read by attention alone, and its later sizes are made with no compile
(runtime.resize), as for any cache tensor.

A node goes to the prologue when it makes a tensor, has no effects, and every input is a size
(an integer input of the graph, or integer arithmetic on sizes and on the caller's tensors'
shapes) or another such tensor, and it depends on an integer input. Staying in the graph: a
tensor computed from a tensor's values (`x.item()`, `x + s0`); one some op writes in place,
with all that may share its memory; and a tensor of two or more varying dims, with all it is
made from (a prefill step's square causal mask, which the rewrite to attention's `is_causal`
recognises from how it was built; as an input it would be read in full). A graph is split
only where that leaves no op taking a size, views that only restate their input's dims aside
(a view to a varying shape would compile each size anyway).
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch

from .sizes import restates

# integer results read from a tensor's metadata, not its values
_META = {"size", "numel", "dim", "stride", "sym_size", "sym_numel", "sym_stride"}
_META_FUNCTIONS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}
_SCALARS = (int, bool, torch.SymInt, torch.SymBool)


@dataclass(frozen=True)
class Split:
    """`prologue(*args)` gives the tensors `main` takes as extra trailing inputs."""

    prologue: torch.fx.GraphModule
    main: torch.fx.GraphModule
    names: tuple  # the moved nodes that became inputs, for the summary
    reads: tuple = ()  # the placeholders (positions) whose values or shapes the prologue reads
    # its results depend on those sizes alone, so one call's may serve every call of those sizes,
    # unless the graph returns one of them (or a view of one): the caller could write into it
    reusable: bool = False


def _value(n):
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, torch.fx.Node) else n


def _varying_dims(t) -> int:
    return sum(isinstance(d, torch.SymInt) and not isinstance(d.node.expr, int) and bool(d.node.expr.free_symbols)
               for d in t.shape) if isinstance(t, torch.Tensor) else 0


def _is_meta_query(n) -> bool:
    if n.op == "call_method":
        return n.target in _META
    return n.op == "call_function" and (n.target in _META_FUNCTIONS or getattr(n.target, "__name__", "") in _META)


def _random(n) -> bool:
    """A random draw: the same inputs give other results, so it never moves (FX marks
    `torch.rand` impure but not `F.dropout(..., training=True)`). Dropout with training off is
    the identity; where training is not a constant, it counts as a draw."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if "generator" in n.kwargs:
        return True
    if not isinstance(name, str) or name.startswith("__"):  # (`__rand__` is a reflected &)
        return False
    if name.lstrip("_").removesuffix("_") not in _RANDOM:
        return False
    if "dropout" in name:
        train = n.kwargs.get("training", n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True))
        return train is not False
    return True


# random ops by name (torch, Tensor methods, F), in-place forms included
_RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
    "normal", "multinomial", "poisson", "rrelu", "rrelu_with_noise", "uniform", "exponential", "cauchy",
    "geometric", "log_normal", "random", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
    "dropout2d", "dropout3d", "feature_dropout", "native_dropout", "fused_dropout"})


def _pure(n) -> bool:
    if n.op == "call_method":
        return not n.target.endswith("_") and n.target not in ("item", "tolist", "copy_")
    if n.op != "call_function":
        return False
    try:
        return not n.is_impure()
    except Exception:  # noqa: BLE001 - an unknown target: keep it where it is
        return False


def _writes(n) -> bool:
    """An op that may write one of its arguments (an in-place method or function, setitem, `out=`)
    or has some other effect."""
    if n.op not in ("call_function", "call_method"):
        return False
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("operator", "_operator"):
        # `a & b` is `operator.and_`, which writes nothing; `a &= b` is `operator.iand`
        return n.target in _OPERATOR_WRITES or not _pure(n)
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
        return True
    return "out" in n.kwargs or _inplace_flag(n) or not _pure(n)


def _inplace_flag(n) -> bool:
    """`F.relu(x, inplace=True)`, `F.dropout(x, 0.1, False, True)`: a function told to write its input."""
    if n.kwargs.get("inplace") is True:
        return True
    if n.op != "call_function" or not n.args:
        return False
    try:
        bound = inspect.signature(n.target).bind_partial(*n.args, **n.kwargs).arguments
    except (TypeError, ValueError):  # (a builtin without a signature: none of these has `inplace`)
        return False
    return bound.get("inplace") is True


_OPERATOR_WRITES = {operator.setitem, operator.delitem, operator.iadd, operator.iand, operator.ifloordiv,
                    operator.ilshift, operator.imatmul, operator.imod, operator.imul, operator.ior, operator.ipow,
                    operator.irshift, operator.isub, operator.itruediv, operator.ixor, operator.iconcat}


def split(gm: torch.fx.GraphModule, kinds: list) -> Split | None:
    """The graph's size-only tensors as a prologue, and the graph taking them as inputs; None
    where there are none (or the graph's placeholders do not match `kinds`)."""
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(kinds):
        return None
    size: set = set()      # integer values computed from sizes (shapes and integer inputs)
    sized: set = set()     # ... that depend on an integer input
    tensors: set = set()   # tensors computed from sizes and constants alone
    depends: set = set()   # ... that depend on an integer input
    for n, kind in zip(placeholders, kinds):
        if kind == "int" and isinstance(_value(n), _SCALARS):
            size.add(n)
            sized.add(n)
    for n in g.nodes:
        if n.op not in ("call_function", "call_method") or not _pure(n) or _random(n):
            continue
        val = _value(n)
        ins = n.all_input_nodes
        if isinstance(val, _SCALARS) and not isinstance(val, bool) or isinstance(val, torch.SymBool):
            if _is_meta_query(n) and ins and ins[0].op == "placeholder" and \
                    isinstance(_value(ins[0]), torch.Tensor) and all(a in size for a in ins[1:]):
                size.add(n)  # (an input's shape is known without its values, or anything run to make it)
            elif all(a in size for a in ins) and n.target not in (operator.getitem,):
                size.add(n)
                if any(a in sized for a in ins):
                    sized.add(n)
        elif isinstance(val, torch.Tensor) and all(a in size or a in tensors for a in ins):
            tensors.add(n)
            if any(a in sized or a in depends for a in ins):
                depends.add(n)
    # a tensor of two or more varying dims (prefill's square causal mask) stays in the program with
    # all it is made from: the rewrite to attention's is_causal reads how it was built
    keep = {n for n in depends if _varying_dims(_value(n)) >= 2}
    todo = list(keep)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in depends and a not in keep:
                keep.add(a)
                todo.append(a)
    # a tensor some op writes in place (`torch.empty(n).fill_(2)`, `m.mul_(x.sum())`) stays, with
    # every tensor that may share its memory (all made from it, all it is made from): a moved
    # reader would run before the write. A write through an alias made by an op that also reads
    # other tensors (`m.to(y).add_(y)`: `.to` returns m itself) is found by the fake values'
    # storages; where they cannot be compared, nothing moves.
    writes = [a for n in g.nodes if _writes(n) for a in n.all_input_nodes]
    try:
        storages = {_storage(a) for a in writes if isinstance(_value(a), torch.Tensor)}
        aliased = [t for t in tensors if _storage(t) in storages]
    except Exception:  # noqa: BLE001 - a value without a storage: assume any may be written
        return None
    written = [a for a in writes if a in tensors] + aliased
    todo = list(written)
    keep.update(written)
    while todo:
        n = todo.pop()
        for a in [*n.all_input_nodes, *n.users]:
            if a in tensors and a not in keep:
                keep.add(a)
                todo.append(a)
    depends -= keep
    frontier = [n for n in g.nodes if n in depends and any(u not in depends for u in n.users)]
    if not frontier:
        return None
    main = _main(gm, placeholders, frontier, depends, size)
    if any(_takes_size(n) for n in main.graph.nodes):
        return None  # its sizes still reach an op (a view of a varying shape): each size compiles anyway
    prologue = _prologue(gm, placeholders, frontier)
    used = {n.name for n in prologue.graph.nodes if n.op == "placeholder" and n.users}
    reads = tuple(i for i, n in enumerate(placeholders) if n.name in used)
    return Split(prologue, main, tuple(n.name for n in frontier), reads, not _returns_any(gm, frontier))


def _storage(n) -> int:
    return _value(n).untyped_storage()._cdata


def _returns_any(gm, frontier) -> bool:
    """Whether the graph returns one of `frontier`'s tensors or a view of one (their fake
    values share a storage); True where that cannot be told."""
    try:
        made = {_storage(f) for f in frontier}
        out = next(n for n in gm.graph.nodes if n.op == "output")
        for a in torch.utils._pytree.tree_leaves(out.args):
            if isinstance(_value(a), torch.Tensor) and _storage(a) in made:
                return True
        return False
    except Exception:  # noqa: BLE001 - a value without a storage to compare: assume it may
        return True


def _takes_size(n) -> bool:
    """An op making a tensor with a size among its arguments (`view(x, [s0, -1])`), but for a
    view that only restates its input's dims (`sizes.restates`)."""
    if n.op not in ("call_function", "call_method") or not isinstance(_value(n), torch.Tensor):
        return False
    sizes = [_value(a) for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
             if isinstance(a, torch.fx.Node) and isinstance(_value(a), (torch.SymInt, torch.SymBool, torch.SymFloat))]
    if not sizes:
        return False
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return not (name in _RESTATING and n.args and restates(_value(n.args[0]), sizes))


_RESTATING = {"expand", "view", "reshape"}


def _prologue(gm, placeholders, frontier) -> torch.fx.GraphModule:
    """The graph's placeholders, the frontier's ancestors, and the frontier as its output."""
    need: set = set()
    todo = list(frontier)
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(n.all_input_nodes)
    g = torch.fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in need:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in frontier))
    return torch.fx.GraphModule(gm, g)


def _main(gm, placeholders, frontier, depends, size) -> torch.fx.GraphModule:
    """A copy of the graph whose frontier nodes are trailing placeholders instead, without the
    moved nodes and the size arithmetic only they used."""
    g = torch.fx.Graph()
    env: dict = {}
    for n in placeholders:
        env[n] = g.node_copy(n, lambda a: env[a])
    for f in frontier:
        p = g.placeholder(f"sized_{f.name}")
        p.meta = dict(f.meta)
        env[f] = p
    for n in gm.graph.nodes:
        if n.op != "placeholder" and n not in env and n not in depends:
            env[n] = g.node_copy(n, lambda a: env[a])
    # what only the moved nodes used: pure size arithmetic left without users (never a write,
    # nor anything else with effects)
    arithmetic = {env[o] for o in size if o in env and o.op != "placeholder"}
    for n in reversed(list(g.nodes)):
        if n in arithmetic and not n.users:
            g.erase_node(n)
    return torch.fx.GraphModule(gm, g)

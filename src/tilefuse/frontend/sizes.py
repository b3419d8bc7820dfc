"""One torch.export with symbolic sizes, instantiated for each concrete size.

A graph whose sizes change from call to call (the key/value cache of `generate` grows by
one token a step) compiles once per size. torch.export was most of that compile (about 1 s
a size for a 2-layer model on a CPU, growing with the model), and it re-traced the same
graph each time. Here the graph is exported once with its dynamic dims symbolic; each new
size then gets a copy of that aten graph with every size evaluated (`instantiate`): what
`capture.to_graph` reads (each node's shape and dtype, and integer arguments) is concrete.

An instance is made only where the export holds for the sizes: every dim the export kept
fixed equals the call's, every symbol lies in the range the export assumed, and every guard
recorded while tracing (each decision taken on a symbolic size) is true for them. Otherwise,
and for graphs with regions (subgraphs) or data-dependent sizes, the caller exports that
size on its own, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

_SYM = (torch.SymInt, torch.SymBool, torch.SymFloat)


@dataclass(frozen=True)
class Instance:
    """What `capture.to_graph` and the compiler read of an ExportedProgram, for one size."""

    graph_module: torch.fx.GraphModule
    graph_signature: object
    state_dict: dict
    constants: dict
    call_spec: object

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph


class Symbolic:
    """An ExportedProgram with symbolic sizes; `instance(tensors, state)` for a call's user
    inputs and the weights (state dict) of that call. The export's own state dict is not kept:
    it would keep the weights of the first call alive after their module is gone."""

    def __init__(self, ep):
        self.ep = Instance(ep.graph_module, ep.graph_signature, {}, dict(getattr(ep, "constants", {}) or {}),
                           ep.call_spec)
        users = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
        self.inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in users]
        self.env = _shape_env(ep.graph)
        self.bound = self._bound_symbols() if self.env is not None else set()  # the inputs' size symbols
        self.why_not = self._why_not()
        self.sized_op = self._first_sized_op()  # "" when no op takes a size as an argument
        self.piecewise = self._first_piecewise()  # "" when every size is a polynomial of the inputs'

    def _why_not(self) -> str:
        """Why this export cannot serve other sizes ("" when it can)."""
        if self.env is None:
            return "the export kept no symbolic size"
        for n in self.ep.graph.nodes:
            if n.op == "get_attr" and isinstance(getattr(self.ep.graph_module, n.target, None), torch.nn.Module):
                return "the graph has a region (a subgraph)"
            val = n.meta.get("val")
            for v in val if isinstance(val, (tuple, list)) else (val,):
                if isinstance(v, _SYM) and self._free(v.node.expr) - self.bound:
                    return "a size depends on data"
        return ""

    def _first_sized_op(self) -> str:
        """The first op that takes a size as an argument (`view(x, [1, s0, 64])`, `arange(s0)`),
        or "" when none does: then every op runs with the same arguments at every size, and only
        its tensors' shapes change (what runtime.resize relies on). Ops whose results nothing
        uses count for nothing: the capture drops them (OPT's decode step builds a mask of ones
        from the cache's length, `ones([1, s0 + 1])`, and never reads it)."""
        live = _live(self.ep.graph)
        return next((n.name for n in self.ep.graph.nodes if n.op == "call_function" and n in live
                     and not isinstance(n.meta.get("val"), _SYM) and not _is_assert(n) and not _restates(n)
                     and any(_is_size(a) for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)))), "")

    def _first_piecewise(self) -> str:
        """The first live node with a size that is not a polynomial of the inputs' sizes
        (`Min(7, s0)`: the length of a diagonal, a window, a clamp; `s0 // 2`), or "" when none
        has one. Two compiled sizes show how a polynomial size changes (it differs between
        them unless it does not depend on the size that changed), but a piecewise one can be
        equal at both and differ at a third: `ones_like(b.diagonal())` of b at (7, 7) and
        (10, 7) is 7 long both times, 5 long at (5, 7), and a program made from the first two
        (runtime.resize, whose constants keep their shapes) would return 7 ones."""
        if self.env is None:
            return ""
        live = _live(self.ep.graph)
        for n in self.ep.graph.nodes:
            if n not in live:
                continue
            val = n.meta.get("val")
            for v in val if isinstance(val, (tuple, list)) else (val,):
                sizes = v.shape if isinstance(v, torch.Tensor) else (v,) if isinstance(v, torch.SymInt) else ()
                for size in sizes:
                    if isinstance(size, torch.SymInt):
                        expr = self.env.replace(sympy.sympify(size.node.expr))
                        if not expr.is_polynomial(*expr.free_symbols):
                            return f"{n.name}: {expr}"
        return ""

    def _bound_symbols(self) -> set:
        found = set()
        for n in self.inputs:
            for s in n.meta["val"].shape:
                if isinstance(s, torch.SymInt):
                    found |= self._free(s.node.expr)
        return found

    def _free(self, expr) -> set:
        return set(self.env.replace(sympy.sympify(expr)).free_symbols)

    def _value(self, expr, values: dict):
        out = self.env.replace(sympy.sympify(expr)).xreplace(values)
        if out.free_symbols:
            raise _Outside(f"{out} has unbound symbols")
        return out

    def bind(self, tensors) -> dict | None:
        """symbol -> size for a call's user tensors; None where the export does not hold for them."""
        if self.why_not or len(tensors) != len(self.inputs):
            return None
        values: dict = {}
        pending = []
        for n, t in zip(self.inputs, tensors):
            val = n.meta["val"]
            if t.dim() != val.dim() or t.dtype != val.dtype:
                return None
            for s, size in zip(val.shape, t.shape):
                if not isinstance(s, torch.SymInt):
                    if int(s) != size:
                        return None
                    continue
                expr = self.env.replace(s.node.expr)
                if isinstance(expr, sympy.Symbol):
                    if values.setdefault(expr, sympy.Integer(size)) != size:
                        return None
                else:
                    pending.append((expr, size))
        try:
            if any(int(self._value(e, values)) != size for e, size in pending):
                return None
            for sym, value in values.items():
                r = self.env.var_to_range.get(sym)
                if r is not None and not (r.lower <= value <= r.upper):
                    return None
            for g in self.env.guards:
                if not bool(self._value(g.expr, values)):
                    return None
        except (_Outside, TypeError):
            return None
        return values

    def instance(self, tensors, state: dict) -> Instance | None:
        values = self.bind(tensors)
        if values is None:
            return None
        return instantiate(self, values, state)


class _Outside(Exception):
    pass


_SHAPING = {"expand.default", "view.default", "reshape.default", "_unsafe_view.default"}


def _restates(n) -> bool:
    """A view whose every size argument is one of its input's own dims (`repeat_kv`'s
    `k[:, :, None].expand(b, h, n, s0, d)` of a cache of length s0): at any size it takes the
    same dims of its input, so it is no size of the call's own. (Where the program keeps such
    a view, its shape still differs between sizes, and runtime.resize compiles each size.)"""
    name = getattr(n.target, "__name__", "")
    if name not in _SHAPING or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return False
    sizes = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a
             for a in torch.utils._pytree.tree_leaves((n.args[1:], n.kwargs)) if _is_size(a)]
    return restates(n.args[0].meta.get("val"), sizes)


def restates(x, sizes) -> bool:
    """Whether every one of `sizes` (a view's size arguments, SymInts) is one of tensor `x`'s
    own dims. Also frontend.size_prologue's rule, on dynamo's graph."""
    if not isinstance(x, torch.Tensor):
        return False
    dims = {d.node.expr for d in x.shape if isinstance(d, torch.SymInt)}
    return all(isinstance(v, torch.SymInt) and v.node.expr in dims for v in sizes)


def _live(graph) -> set:
    """The nodes whose values reach the graph's outputs, or that have effects of their own."""
    live: set = set()
    for n in reversed(graph.nodes):
        if n.op == "output" or n in live or (n.op == "call_function" and n.is_impure()):
            live.add(n)
            live.update(n.all_input_nodes)
    return live


def _is_assert(n) -> bool:
    return getattr(n.target, "__name__", "") in ("_assert_scalar.default", "sym_constrain_range_for_size.default")


def _is_size(a) -> bool:
    return isinstance(a, _SYM) or (isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), _SYM))


def _shape_env(graph):
    for n in graph.nodes:
        val = n.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.SymInt):
                return v.node.shape_env
            if isinstance(v, torch.Tensor):
                for s in v.shape:
                    if isinstance(s, torch.SymInt):
                        return s.node.shape_env
    return None


def _concrete(sym: Symbolic, v, values: dict, fake, seen: dict):
    """`v` (a node's value in the export) at `values`; `seen` memoises the sizes, which many
    nodes share (s0, 4096·s0, ...), for one instance."""
    if isinstance(v, (torch.SymBool, torch.SymInt, torch.SymFloat)):
        key = (type(v), v.node.expr)
        if key not in seen:
            kind = bool if isinstance(v, torch.SymBool) else int if isinstance(v, torch.SymInt) else float
            seen[key] = kind(sym._value(v.node.expr, values))
        return seen[key]
    if isinstance(v, torch.Tensor):
        if not any(isinstance(x, torch.SymInt) for x in (*v.shape, *v.stride())):
            return v  # no symbolic size: the export's own value serves every instance
        shape = [_concrete(sym, s, values, fake, seen) for s in v.shape]
        stride = [_concrete(sym, s, values, fake, seen) for s in v.stride()]
        return _fake(fake, shape, stride, v)
    if isinstance(v, (tuple, list)):
        return type(v)(_concrete(sym, x, values, fake, seen) for x in v)
    return v


def _fake(fake, shape, stride, like: torch.Tensor):
    """A fake tensor of this shape and stride, of `like`'s dtype and device. Made around a meta
    tensor directly (~0.04 ms): through the fake mode's dispatch of empty_strided it took
    ~0.5 ms, most of an instance's time (0.27 s for an 8-layer Llama's 477 tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        return FakeTensor(fake, torch.empty_strided(shape, stride, dtype=like.dtype, device="meta"), like.device)
    except (TypeError, RuntimeError):  # (an internal constructor: another torch may want other arguments)
        with fake:
            return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)


def instantiate(sym: Symbolic, values: dict, state: dict) -> Instance:
    """The export's graph with every size evaluated at `values` (symbol -> int): nodes that
    compute a size become plain ints in their users' arguments, size assertions are checked
    and dropped, and each node's value is a fake tensor of concrete shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    ep = sym.ep
    g = torch.fx.Graph()
    env: dict = {}
    seen: dict = {}
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op == "call_function" and isinstance(val, _SYM):
            env[n] = _concrete(sym, val, values, fake, seen)
            continue
        if n.op == "call_function" and _is_assert(n):
            continue  # checked through the guards in bind
        new = g.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        if "val" in n.meta:
            new.meta["val"] = _concrete(sym, val, values, fake, seen)
        env[n] = new
    gm = torch.fx.GraphModule(ep.graph_module, g)
    return Instance(gm, ep.graph_signature, state, ep.constants, ep.call_spec)

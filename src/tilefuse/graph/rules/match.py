"""Small helpers the CODA rules share: peeling casts, recognising weight operands, naming
new nodes, computing folded weight values, and pruning what a rewrite left unused."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from ... import dtypes
from ...tensors import to_torch
from .. import ir

# passes of the rules that move a view or a gather one map up a pass (slice_sink, gather_sink,
# reshape_hoist): a chain of thousands of maps would cost time squared; past this the view
# stays where it is and the map it reads is written whole (a correct, slower plan)
MAX_PASSES = 64


def float_cast(g: ir.Graph, name: str) -> bool:
    """`name` is a cast from a float dtype to a float dtype: a change of precision, which a
    rewrite may move or drop. A cast to or from bool or an integer changes the value
    (`x.bool()` is x != 0), and must stay."""
    n = g[name]
    return (isinstance(n, ir.Map) and n.op == "cast" and dtypes.is_float(n.type.dtype)
            and dtypes.is_float(g[n.args[0]].type.dtype))


def peel_casts(g: ir.Graph, name: str) -> str:
    """The tensor under any chain of float casts (x for cast(cast(x)))."""
    while float_cast(g, name):
        name = g[name].args[0]
    return name


def is_map(g: ir.Graph, name: str, op: str) -> bool:
    return isinstance(g[name], ir.Map) and g[name].op == op


def split_pair(g: ir.Graph, name: str, op: str, pick) -> tuple[str, str] | None:
    """For name = op(a, b) (either order): (the arg that `pick` accepts, the other), else None."""
    n = g[name]
    if not (isinstance(n, ir.Map) and n.op == op):
        return None
    a, b = n.args
    if pick(a):
        return a, b
    if pick(b):
        return b, a
    return None


def row_vector(g: ir.Graph, name: str, width: int) -> bool:
    """A weight (through casts) that broadcasts along the last dim only: shape (..1.., width)."""
    w = g[peel_casts(g, name)]
    s = w.type.shape
    return isinstance(w, ir.Weight) and len(s) >= 1 and s[-1] == width and all(d == 1 for d in s[:-1])


@dataclass(frozen=True)
class WeightOperand:
    """The right operand of a contraction as a weight: `b` is the Weight itself, (K, N), or a
    permute of a Weight stored (N, K) (how `linear` is captured)."""

    weight: str
    transposed: bool  # True: the Weight is stored (N, K) and viewed (K, N)

    def matrix(self, g: ir.Graph, exact: bool = False) -> torch.Tensor:
        """The operand's value as a (K, N) float64 matrix (`exact`: in its stored dtype, for
        rewrites that only move elements: no rounding to undo, a quarter of the memory)."""
        w = value(g, self.weight)
        w = w if exact else w.double()
        return w.t() if self.transposed else w


def weight_operand(g: ir.Graph, b: str) -> WeightOperand | None:
    n = g[b]
    if isinstance(n, ir.Weight) and len(n.type.shape) == 2:
        return WeightOperand(b, False)
    if (isinstance(n, ir.View) and n.op == "permute" and tuple(n.params) == (1, 0)
            and isinstance(g[n.arg], ir.Weight)):
        return WeightOperand(n.arg, True)
    return None


def exact_product(a: torch.Tensor, b: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """a * b (broadcast) without rounding, in float32 when that holds it exactly (both 16-bit
    floats: at most 11 + 11 significant bits) and float64 otherwise; the caller rounds once.
    `round_to`: rounded to that dtype here, a block of a's rows at a time, so that the exact
    product of a whole weight (0.5 GiB in float32 for a 32000 x 4096 LM head, beside its
    widened copy) is never held at once. With both operands and `round_to` one 16-bit float:
    PyTorch's own multiply, which computes in float32 and rounds once (the same bits, a CPU
    test and a GPU test check; one pass, ~10x faster on a CPU, where folding an LM head took
    ~1 s)."""
    if round_to in (torch.bfloat16, torch.float16) and a.dtype == b.dtype == round_to:
        return torch.mul(a, b)
    wide = torch.float32 if a.dtype in (torch.bfloat16, torch.float16) and b.dtype in (torch.bfloat16, torch.float16) \
        else torch.float64
    if round_to is None or a.dim() != 2 or b.dim() != 2 or b.shape[0] not in (1, a.shape[0]):
        out = a.to(wide) * b.to(wide)
        return out if round_to is None else out.to(round_to)
    out = torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=round_to, device=a.device)
    step = max(1, _BLOCK // max(1, out.shape[1]))
    for i in range(0, out.shape[0], step):
        rows = slice(i, i + step)
        out[rows] = a[rows].to(wide) * (b[rows] if b.shape[0] > 1 else b).to(wide)  # (one rounding, as .to)
    return out


_BLOCK = 1 << 24  # elements of the exact product held at once by exact_product(round_to=...)


def value(g: ir.Graph, name: str) -> torch.Tensor:
    v = g.weights[name]
    return v if isinstance(v, torch.Tensor) else to_torch(v)


_INTERN = contextvars.ContextVar("tilefuse_intern_weights", default=lambda t: t)


@contextlib.contextmanager
def interning(intern):
    """Rewrites inside pass each weight they derive through `intern(tensor) -> tensor`: the
    torch.compile backend gives its WeightPool's, so that a value some program already holds
    is not held twice while the compile runs (runtime/shared_weights.py)."""
    token = _INTERN.set(intern)
    try:
        yield
    finally:
        _INTERN.reset(token)


class Editor:
    """Builds a rewritten graph: new nodes with fresh names, new weight values, kept pure
    (the input graph and its weights dict are never changed)."""

    def __init__(self, g: ir.Graph):
        self.g = g
        self.names = {n.name for n in g.nodes}
        self.weights = dict(g.weights)
        self.next_suffix: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        return ir.fresh_name(base, self.names, self.next_suffix)

    def weight(self, base: str, matrix: torch.Tensor, dtype: str, source: str) -> ir.Weight:
        """A new Weight holding `matrix` (computed in float64) rounded once to `dtype`, or an
        equal tensor the `interning` hook already holds."""
        name = self.fresh(base)
        self.weights[name] = _INTERN.get()(matrix.to(dtypes.to_torch(dtype)).contiguous())
        return ir.Weight(name, ir.TensorType(tuple(matrix.shape), dtype), source)

    def operand(self, base: str, matrix_kn: torch.Tensor, like: WeightOperand, dtype: str, source: str,
                src_line: str) -> tuple[list, str]:
        """Nodes making a (K, N) contraction operand from a new value, stored as `like` is."""
        if like.transposed:
            w = self.weight(base, matrix_kn.t(), dtype, source)
            k, n = matrix_kn.shape
            v = ir.View(self.fresh(f"{base}_t"), ir.TensorType((k, n), dtype), "permute", w.name, (1, 0), src_line)
            return [w, v], v.name
        w = self.weight(base, matrix_kn, dtype, source)
        return [w], w.name

    def graph(self, nodes, outputs=None) -> ir.Graph:
        g = ir.Graph(tuple(nodes), self.g.inputs, tuple(outputs or self.g.outputs), self.weights, self.g.writes,
                     self.g.layouts)
        return prune(g)


def rewrite_contractions(g: ir.Graph, rewrite) -> ir.Graph:
    """Replace each contraction n by `rewrite(g, editor, n)` (a list of nodes), where that is not
    None; the graph itself when none is replaced."""
    ed, out, changed = Editor(g), [], False
    for n in g.nodes:
        new = rewrite(g, ed, n) if isinstance(n, ir.Contraction) else None
        if new is None:
            out.append(n)
        else:
            out.extend(new)
            changed = True
    return ed.graph(out) if changed else g


def prune(g: ir.Graph) -> ir.Graph:
    """Drop nodes (and weight values) nothing reaches from the outputs; inputs stay."""
    live, stack = set(), list(g.outputs)
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(ir.node_args(g[n]))
    nodes = tuple(n for n in g.nodes if n.name in live or isinstance(n, ir.Input))
    if len(nodes) == len(g.nodes):
        return g
    return ir.Graph(nodes, g.inputs, g.outputs, {k: v for k, v in g.weights.items() if k in live}, g.writes,
                    g.layouts)


def depends_on(g: ir.Graph, name: str, targets) -> bool:
    """Whether `name` is computed from one of `targets` (or is one). The walk back stops at nodes
    placed before every target, which cannot be computed from one: asking of a residual stream
    whether it comes from this layer's matmul then looks at this layer only, where its whole
    ancestry made the question quadratic in the layers."""
    order = g.order()
    targets = set(targets)
    first = min(order[t] for t in targets)
    seen, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n not in seen and order[n] > first:
            seen.add(n)
            stack.extend(ir.node_args(g[n]))
    return False


def retype(n, dtype: str):
    """The same node with its result dtype changed."""
    return type(n)(**{**n.__dict__, "type": ir.TensorType(n.type.shape, dtype)})


def low_precision(dtype: str) -> bool:
    return dtype in ("bf16", "f16")

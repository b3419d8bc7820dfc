"""Graph IR: tensors with shape and dtype, and the ops that make them.

Each node defines one tensor named `name`. Nodes are frozen dataclasses; a `Graph` holds
them in topological order with its inputs, outputs and weight values. `source` is the
user's line that produced a node (from torch.export's stack traces), for error messages.

Map args broadcast with NumPy rules to the node's shape; a Map computes in f32 when its
result is bf16/f16 (and in the promoted type otherwise) and rounds once to its dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from .. import dtypes, ops


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        dtypes.check(self.dtype)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def __str__(self):
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Input:
    name: str
    type: TensorType
    source: str = field(default="", compare=False)

    def describe(self):
        return "input"


@dataclass(frozen=True)
class Weight:
    """A parameter or buffer; its value lives in Graph.weights."""

    name: str
    type: TensorType
    source: str = field(default="", compare=False)

    def describe(self):
        return "weight"


@dataclass(frozen=True)
class Constant:
    """A scalar (shape ()) constant. Kernels compute with `value` as given, in the compute type
    (f32 for bf16/f16): a bf16/f16 Constant made from a Python number PyTorch keeps in f32 (a
    weak scalar, `x * 1e5`) holds a value its dtype cannot; one that stands for a tensor
    (`torch.full`) was rounded when made (frontend.builder)."""

    name: str
    type: TensorType
    value: float | int | bool
    source: str = field(default="", compare=False)

    def describe(self):
        return f"const {self.value!r}" + (" (kept in f32)" if self.weak() else "")

    def weak(self) -> bool:
        """Whether this bf16/f16 Constant holds a value its dtype cannot: a Python number
        PyTorch keeps in f32 beside a 16-bit tensor."""
        if self.type.dtype not in ("bf16", "f16") or isinstance(self.value, bool):
            return False
        v = float(self.value)
        with np.errstate(over="ignore"):
            held = float(np.asarray(v).astype(dtypes.to_numpy(self.type.dtype)))
        return held != v and v == v


@dataclass(frozen=True)
class Map:
    name: str
    type: TensorType
    op: str
    args: tuple[str, ...]
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if len(self.args) != ops.info(self.op).arity:
            raise ValueError(f"{self.op} takes {ops.info(self.op).arity} args, got {len(self.args)}")

    def describe(self):
        return f"map {self.op}({', '.join(self.args)})"


@dataclass(frozen=True)
class Reduce:
    name: str
    type: TensorType
    op: str  # sum, max, min, mean
    arg: str
    axes: tuple[int, ...]  # non-negative, sorted
    keepdim: bool
    source: str = field(default="", compare=False)

    def describe(self):
        return f"reduce {self.op}({self.arg}, axes={list(self.axes)}, keepdim={self.keepdim})"


@dataclass(frozen=True)
class Scan:
    """An inclusive scan along `axis` (torch.cumsum / cumprod, cummax / cummin's values): element
    i is `op` (sum, prod, max, min) of the argument's elements 0..i there, accumulated in the
    compute type of the result's dtype (f32 for bf16/f16) and rounded once per element."""

    name: str
    type: TensorType
    op: str  # sum | prod | max | min
    arg: str
    axis: int  # non-negative
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if self.op not in ops.SCANS:
            raise ValueError(f"unknown scan {self.op!r}; known: {', '.join(ops.SCANS)}")

    def describe(self):
        return f"scan {self.op}({self.arg}, axis={self.axis})"



@dataclass(frozen=True)
class View:
    """An index map: reshape (same element order) or permute, expand, slice, roll (params (dim,
    shift): element i along dim is the argument's (i + shift) % size)."""

    name: str
    type: TensorType
    op: str  # reshape | permute | expand | slice | roll
    arg: str
    params: tuple = ()
    source: str = field(default="", compare=False)

    def describe(self):
        return f"view {self.op}({self.arg}{', ' if self.params else ''}{', '.join(map(str, self.params))})"


@dataclass(frozen=True)
class Iota:
    """Index along `axis` (an integer tensor), for masks and selects."""

    name: str
    type: TensorType
    axis: int
    source: str = field(default="", compare=False)

    def describe(self):
        return f"iota(axis={self.axis})"


@dataclass(frozen=True)
class Gather:
    """torch.gather(arg, axis, index), each expanded to the result's shape first (outside
    `axis`, for arg): either may have size 1 where the result does not. An embedding is its
    weight [1, V, D] gathered along V by the token ids [B, S, 1]: one id per row of D columns,
    which a kernel reads once a row. `wrap`: a negative index counts from the end, as x[idx]'s
    does (the size comes from the table, never a constant of the graph: a decode step's mask
    indexed by positions keeps one program for every length, runtime/resize.py)."""

    name: str
    type: TensorType
    arg: str
    index: str
    axis: int
    source: str = field(default="", compare=False)
    wrap: bool = False

    def describe(self):
        return f"gather({self.arg}, axis={self.axis}, index={self.index}{', wrap' if self.wrap else ''})"


@dataclass(frozen=True)
class Contraction:
    """a @ b with torch.matmul semantics (batched, broadcast). The planner gives it a generated
    GEMM, with what follows it fused into the epilogue, where the GEMM takes its operands, and
    runs it as an extern (torch.matmul) where not, saying why in the plan."""

    name: str
    type: TensorType
    a: str
    b: str
    source: str = field(default="", compare=False)

    def describe(self):
        return f"contraction {self.a} @ {self.b}"


@dataclass(frozen=True)
class Attention:
    """scaled_dot_product_attention(q, k, v). Runs as extern until the attention family lands.

    k and v may have fewer heads than q (grouped-query attention, SDPA's enable_gqa): query
    head h then reads KV head h // (H / Hkv). `window` (with causal): query i sees only the
    keys i - window < j <= i, a sliding window (rules/causal_mask.py finds it in a mask)."""

    name: str
    type: TensorType
    q: str
    k: str
    v: str
    causal: bool = False
    scale: float | None = None
    mask: str | None = None
    source: str = field(default="", compare=False)
    window: int | None = None

    def describe(self):
        extra = (f", mask={self.mask}" if self.mask else "") + (f", scale={self.scale:.6g}" if self.scale is not None else "")
        causal = f", causal, window={self.window}" if self.window else (", causal" if self.causal else "")
        return f"attention({self.q}, {self.k}, {self.v}{extra}{causal})"


@dataclass(frozen=True)
class Extern:
    """An aten op tilefuse does not lower, run by PyTorch: visible in the plan, never silent.

    `args` are node names (str wrapped in Ref) or Python literals. `item`: for an op that
    returns several tensors (topk, sort, ...), the one this node is; each used result is a
    node of its own, and each runs the op.
    """

    name: str
    type: TensorType
    target: str  # e.g. "aten.cumsum.default"
    args: tuple = ()
    kwargs: tuple = ()  # tuple of (key, value)
    reason: str = ""
    source: str = field(default="", compare=False)
    item: int | None = None

    def torch_op(self):
        """The callable this extern runs: the torch.ops overload, or for `item` a call of it
        that returns that result."""
        import torch

        op = torch.ops
        for part in self.target.split("."):
            op = getattr(op, part)
        if self.item is None:
            return op
        k = self.item
        return lambda *args, **kwargs: op(*args, **kwargs)[k]

    def describe(self):
        shown = ", ".join(str(a) for a in self.args)
        pick = "" if self.item is None else f"[{self.item}]"
        return f"extern {self.target}({shown}){pick}" + (f"  # {self.reason}" if self.reason else "")


@dataclass(frozen=True)
class Ref:
    """A reference to a node inside an Extern's args."""

    name: str

    def __str__(self):
        return self.name


Node = Union[Input, Weight, Constant, Map, Reduce, Scan, View, Iota, Gather, Contraction, Attention, Extern]


def fresh_name(base: str, taken: set[str], next_suffix: dict[str, int]) -> str:
    """`base`, or `base_1`, `base_2`... whichever is free first; taken into `taken`. Names are
    only ever added, so the first free suffix never moves back: `next_suffix` remembers where
    to look, and a program of a thousand adds is named in linear time."""
    name, i = base, next_suffix.get(base, 1)
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    next_suffix[base] = i
    taken.add(name)
    return name


def post_order(root, children) -> list:
    """What `root` reaches through `children(x)` (an iterable; whatever it leaves out is a leaf
    already done), each after all it reaches, depth first in `children` order, `root` last: the
    order a memoising recursion would finish them in, walked with a list for a stack, so a chain
    thousands of ops deep costs no Python recursion."""
    order, seen, stack = [], {root}, [(root, iter(children(root)))]
    while stack:
        x, todo = stack[-1]
        for c in todo:
            if c not in seen:
                seen.add(c)
                stack.append((c, iter(children(c))))
                break
        else:
            stack.pop()
            order.append(x)
    return order


def reached(root, children):
    """`root` and each name it reaches through `children(x)`, once each, walked with a list for a
    stack: a chain deeper than Python's recursion limit costs no recursion, and a DAG whose maps
    read one tensor twice (`x * x` repeated) costs its size, not its number of paths."""
    seen, todo = {root}, [root]
    while todo:
        x = todo.pop()
        yield x
        for c in children(x):
            if c not in seen:
                seen.add(c)
                todo.append(c)


def node_args(n) -> tuple[str, ...]:
    """Names of the tensors a node reads."""
    if isinstance(n, Map):
        return n.args
    if isinstance(n, (Reduce, Scan, View)):
        return (n.arg,)
    if isinstance(n, Gather):
        return (n.arg, n.index)
    if isinstance(n, Contraction):
        return (n.a, n.b)
    if isinstance(n, Attention):
        return (n.q, n.k, n.v) + ((n.mask,) if n.mask else ())
    if isinstance(n, Extern):
        found = []

        def visit(x):
            if isinstance(x, Ref):
                found.append(x.name)
            elif isinstance(x, (tuple, list)):
                for y in x:
                    visit(y)

        visit(n.args)
        visit(tuple(v for _, v in n.kwargs))
        return tuple(found)
    return ()


@dataclass
class Graph:
    """`writes`: inputs the program updates in place (a KV cache's `index_copy_`, a counter's
    `add_`). The last len(writes) outputs are their new values, of their inputs' types, copied
    into those inputs after the program runs; the outputs before them are the program's results
    (`results`). A result that names an input, written or not, is that input as given (a clone
    of it taken before the write: rewrites may well reduce a value to it).

    `layouts`: for each result, the order of its dims in memory where PyTorch lays it out
    permuted (an elementwise op on a transposed tensor keeps that tensor's strides), else
    None; empty: every result contiguous (rules/permute_sink.results_in_eager_layout)."""

    nodes: tuple
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: dict[str, Any] = field(default_factory=dict)  # name -> torch.Tensor or ndarray
    writes: tuple[str, ...] = ()
    layouts: tuple = ()

    def __post_init__(self):
        self._by_name = {n.name: n for n in self.nodes}
        if len(self._by_name) != len(self.nodes):
            raise ValueError("graph has two nodes with one name")
        if len(self.writes) > len(self.outputs) or not set(self.writes) <= set(self.inputs) \
                or len(set(self.writes)) != len(self.writes):
            raise ValueError(f"writes {self.writes} must be distinct inputs, each with a new value among the outputs")
        if self.layouts and len(self.layouts) != len(self.results):
            raise ValueError(f"{len(self.layouts)} layouts for {len(self.results)} results")
        for x, v in self.written:
            if self._by_name[v].type != self._by_name[x].type:
                raise ValueError(f"input {x} ({self._by_name[x].type}) would be written with {v} "
                                 f"({self._by_name[v].type})")

    @property
    def results(self) -> tuple[str, ...]:
        """The outputs the program returns (the outputs less the written inputs' new values)."""
        return self.outputs[:len(self.outputs) - len(self.writes)]

    @property
    def written(self) -> tuple[tuple[str, str], ...]:
        """(input, its new value) for each input written in place."""
        return tuple(zip(self.writes, self.outputs[len(self.outputs) - len(self.writes):]))

    def __getitem__(self, name: str):
        return self._by_name[name]

    def __contains__(self, name: str):
        return name in self._by_name

    def order(self) -> dict[str, int]:
        """Each node's position in `nodes`, built once per graph (passes ask it per contraction:
        rebuilt each time, it made matching quadratic in a model's layers)."""
        got = self.__dict__.get("_order")
        if got is None or len(got) != len(self.nodes):
            got = self._order = {n.name: i for i, n in enumerate(self.nodes)}
        return got

    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for a in node_args(n):
                out[a].append(n.name)
        return out

    def replace(self, nodes=None, outputs=None) -> "Graph":
        return Graph(tuple(nodes if nodes is not None else self.nodes), self.inputs,
                     tuple(outputs if outputs is not None else self.outputs), self.weights, self.writes, self.layouts)

    def __str__(self):
        return format_graph(self)


def format_graph(g: Graph) -> str:
    lines = [f"graph({', '.join(f'{i}: {g[i].type}' for i in g.inputs)}):"]
    for n in g.nodes:
        if isinstance(n, Input):
            continue
        lines.append(f"  {n.name}: {n.type} = {n.describe()}")
    lines.append(f"  return {', '.join(g.results)}")
    for r, order in zip(g.results, g.layouts):
        if order is not None:
            lines.append(f"  layout {r}: dims ({', '.join(map(str, order))}) in memory, as PyTorch lays it out")
    for x, v in g.written:
        lines.append(f"  write {x} <- {v}")
    return "\n".join(lines)

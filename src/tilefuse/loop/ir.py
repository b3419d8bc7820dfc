"""Loop IR: SSA loop nests, one `Kernel` per fused kernel.

A kernel reads and writes whole buffers (contiguous, row-major, in their logical shape).
Its body is a tuple of statements. Every value is defined once (`dst`) and is visible
to the statements after it in the same block and to nested blocks; nothing defined in a
loop body is visible after the loop, except a `Reduce`'s `dst`.

Index expressions are small integer trees over loop variables, integer constants and
integer SSA values (`Val`, for gathers). A `Load`/`Store` carries one index expression
per dimension of its buffer.

A `Scan` inside a column loop is that loop's running value (codegen/scan.py renders kernels
with one; no `Reduce` reads it).

The map-reduce family's kernels have one shape, which the lowering produces and the CUDA
printer expects (see `row_kernel_parts`):

    Loop(r, R, parallel=True, body=(
        <statements independent of the column: row loads, Consts, Ops on row scalars>,
        Reduce(dst, op, c, C, body, value) ...   # a reduction along the row
        Loop(c, C, body) ...                     # a map along the row, ending in Stores
    ))

with every inner loop over the same extent C (the row length).

A map-reduce kernel may end in a *grid reduction* (`grid_parts`): a second top-level
parallel loop of one iteration that reduces, over all rows, per-row values the row loop
stored into `scratch` buffers (per-row losses into a mean). Scratch buffers are not
parameters: the row loop only stores into them, the grid loop only loads from them, and
the runtime carves them out of the kernel's workspace (the CUDA kernel never writes them
in full: each group of rows is reduced on chip by its last CTA, see codegen/mapreduce.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from .. import dtypes

# ---------------------------------------------------------------- index expressions


@dataclass(frozen=True)
class Var:
    name: str

    def __str__(self):
        return self.name


@dataclass(frozen=True)
class IConst:
    value: int

    def __str__(self):
        return str(self.value)


@dataclass(frozen=True)
class Val:
    """An integer SSA value used as an index (a gather)."""

    name: str

    def __str__(self):
        return f"%{self.name}"


@dataclass(frozen=True)
class IBin:
    op: str  # "+", "*", "//", "%"
    a: "Index"
    b: "Index"

    def __post_init__(self):
        if self.op not in ("+", "*", "//", "%"):
            raise ValueError(f"unknown index operator {self.op!r}")

    def __str__(self):
        return f"({self.a} {self.op} {self.b})"


Index = Union[Var, IConst, Val, IBin]


def idx(x) -> Index:
    """Coerce an int or a loop-variable name to an index expression."""
    if isinstance(x, (Var, IConst, Val, IBin)):
        return x
    if isinstance(x, int):
        return IConst(x)
    if isinstance(x, str):
        return Var(x)
    raise TypeError(f"not an index expression: {x!r}")


def index_vars(e: Index) -> frozenset[str]:
    """Loop variables an index expression depends on."""
    if isinstance(e, Var):
        return frozenset((e.name,))
    if isinstance(e, IBin):
        return index_vars(e.a) | index_vars(e.b)
    return frozenset()


def index_values(e: Index) -> frozenset[str]:
    """SSA values an index expression reads."""
    if isinstance(e, Val):
        return frozenset((e.name,))
    if isinstance(e, IBin):
        return index_values(e.a) | index_values(e.b)
    return frozenset()


# ---------------------------------------------------------------- statements


@dataclass(frozen=True)
class Load:
    dst: str
    buf: str
    index: tuple[Index, ...]

    def __str__(self):
        return f"%{self.dst} = load {self.buf}[{', '.join(map(str, self.index))}]"


@dataclass(frozen=True, eq=False)
class Const:
    """A constant; equal to another of the same value, NaN included (a gather's NaN for an
    index out of range: two lowerings of one kernel must compare equal, runtime/resize.py)."""

    dst: str
    value: float | int | bool
    dtype: str

    def _key(self):
        v = self.value
        return self.dst, self.dtype, type(v), ("nan" if v != v else v)

    def __eq__(self, other):
        return isinstance(other, Const) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        return f"%{self.dst} = const {self.value!r} : {self.dtype}"


@dataclass(frozen=True)
class Op:
    """A scalar op from tilefuse.ops; `cast` converts its argument to `dtype`."""

    dst: str
    op: str
    args: tuple[str, ...]
    dtype: str

    def __str__(self):
        return f"%{self.dst} = {self.op} {', '.join('%' + a for a in self.args)} : {self.dtype}"


@dataclass(frozen=True)
class IndexValue:
    """An index expression materialised as an integer value (iota, masks, gathers)."""

    dst: str
    expr: Index
    dtype: str = "i32"

    def __str__(self):
        return f"%{self.dst} = index {self.expr} : {self.dtype}"


@dataclass(frozen=True)
class Store:
    buf: str
    index: tuple[Index, ...]
    value: str

    def __str__(self):
        return f"store {self.buf}[{', '.join(map(str, self.index))}] = %{self.value}"


@dataclass(frozen=True)
class Loop:
    var: str
    extent: int
    body: tuple["Stmt", ...]
    parallel: bool = False

    def header(self):
        kind = "parallel for" if self.parallel else "for"
        return f"{kind} {self.var} in 0..{self.extent}:"


@dataclass(frozen=True)
class Reduce:
    """dst = op over var in [0, extent) of `value`, computed by `body` for each var."""

    dst: str
    op: str  # a key of tilefuse.ops.REDUCTIONS
    var: str
    extent: int
    body: tuple["Stmt", ...]
    value: str
    dtype: str

    def header(self):
        return f"%{self.dst} = reduce {self.op} {self.var} in 0..{self.extent} : {self.dtype}"


@dataclass(frozen=True)
class Scan:
    """dst = `op` (a key of tilefuse.ops.SCANS) of `value` over the iterations 0..var, this one included, of
    the enclosing loop over `var` (an inclusive scan along the row: cumsum, cumprod, cummax);
    accumulated in dtypes.compute_type(dtype), each element rounded once. Only directly in
    that loop's body (loop/verify.py)."""

    dst: str
    op: str
    var: str
    value: str
    dtype: str

    def __str__(self):
        return f"%{self.dst} = scan {self.op} %{self.value} over {self.var} : {self.dtype}"


Stmt = Union[Load, Const, Op, IndexValue, Store, Loop, Reduce, Scan]


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "in" or "out"

    def __post_init__(self):
        dtypes.check(self.dtype)
        if self.role not in ("in", "out"):
            raise ValueError(f"buffer role must be 'in' or 'out', not {self.role!r}")

    def __str__(self):
        dims = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.role} {self.name}: {self.dtype}[{dims}]"


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Buffer, ...]
    body: tuple[Stmt, ...]
    family: str = "mapreduce"
    notes: tuple[str, ...] = field(default=(), compare=False)
    scratch: tuple[Buffer, ...] = ()  # per-row values the row loop stores and the grid loop reduces

    def buffer(self, name: str) -> Buffer:
        for b in self.params + self.scratch:
            if b.name == name:
                return b
        raise KeyError(f"kernel {self.name} has no buffer {name!r}")

    @property
    def inputs(self) -> tuple[Buffer, ...]:
        return tuple(b for b in self.params if b.role == "in")

    @property
    def outputs(self) -> tuple[Buffer, ...]:
        return tuple(b for b in self.params if b.role == "out")

    def __str__(self):
        return format_kernel(self)


# ---------------------------------------------------------------- printing


def format_block(body, indent: int = 1) -> list[str]:
    pad = "  " * indent
    lines = []
    for s in body:
        if isinstance(s, (Loop, Reduce)):
            lines.append(pad + s.header())
            lines += format_block(s.body, indent + 1)
            if isinstance(s, Reduce):
                lines.append(pad + f"  yield %{s.value}")
        else:
            lines.append(pad + str(s))
    return lines


def format_kernel(k: Kernel) -> str:
    head = f"kernel {k.name} [{k.family}]({', '.join(map(str, k.params))}):"
    lines = [head]
    if k.scratch:
        lines.append("  scratch " + ", ".join(f"{b.name}: {b.dtype}[{'x'.join(map(str, b.shape))}]" for b in k.scratch))
    return "\n".join(lines + format_block(k.body))


# ---------------------------------------------------------------- the map-reduce shape


@dataclass(frozen=True)
class RowKernel:
    """The parts of a map-reduce kernel: row loop var and extent, column var and extent."""

    row_var: str
    rows: int
    col_extent: int
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class GridParts:
    """A map-reduce kernel ending in a grid reduction, apart: `head` is the row kernel (its
    params plus the scratch buffers it stores, as outputs), `tail` the one-iteration loop that
    reduces the scratch buffers over all rows (its reductions, then row-level statements)."""

    head: Kernel
    tail: Loop
    scratch: tuple[Buffer, ...]


def grid_parts(k: Kernel) -> GridParts | None:
    """The parts of a kernel with a grid reduction, or None for a plain row kernel; raise
    ValueError if `k` has scratch buffers but not the shape the CUDA printer handles: a tail
    of one iteration whose reductions each load one scratch buffer at the column (maybe cast),
    followed by row-level statements only."""
    if not k.scratch:
        return None
    if len(k.body) != 2 or not all(isinstance(s, Loop) and s.parallel for s in k.body) or k.body[1].extent != 1:
        raise ValueError(f"kernel {k.name}: a grid reduction is a row loop then a parallel loop of one iteration")
    names = {b.name for b in k.scratch}
    for s in k.body[1].body:
        if isinstance(s, Loop):
            raise ValueError(f"kernel {k.name}: a grid reduction's tail has no column loops")
        if isinstance(s, Reduce):
            loads = [t for t in s.body if isinstance(t, Load)]
            if (len(loads) != 1 or loads[0].buf not in names or loads[0].index != (Var(s.var),)
                    or any(not (isinstance(t, Load) or (isinstance(t, Op) and t.op == "cast")) for t in s.body)):
                raise ValueError(f"kernel {k.name}: grid reduction {s.header()} must load one scratch buffer "
                                 f"at its column")
        elif isinstance(s, Load):
            raise ValueError(f"kernel {k.name}: a grid reduction's tail loads only inside its reductions")
    head = Kernel(k.name, k.params + k.scratch, (k.body[0],), k.family, k.notes)
    return GridParts(head, k.body[1], k.scratch)


def row_kernel_parts(k: Kernel) -> RowKernel:
    """Check that `k` has the map-reduce shape and return its parts, or raise ValueError."""
    if k.scratch:
        k = grid_parts(k).head
    if len(k.body) != 1 or not isinstance(k.body[0], Loop) or not k.body[0].parallel:
        raise ValueError(f"kernel {k.name}: a map-reduce kernel's body is one parallel row loop")
    row = k.body[0]
    extents = set()
    for s in row.body:
        if isinstance(s, (Loop, Reduce)):
            if isinstance(s, Loop) and s.parallel:
                raise ValueError(f"kernel {k.name}: nested parallel loop {s.var}")
            extents.add(s.extent)
            for inner in s.body:
                if isinstance(inner, (Loop, Reduce)):
                    raise ValueError(f"kernel {k.name}: loops nest deeper than row/column")
    if len(extents) > 1:
        raise ValueError(f"kernel {k.name}: inner loops have different extents {sorted(extents)}")
    return RowKernel(row.var, row.extent, extents.pop() if extents else 1, row.body)


def walk(body):
    """Every statement in a block, depth first, loops before their bodies."""
    for s in body:
        yield s
        if isinstance(s, (Loop, Reduce)):
            yield from walk(s.body)

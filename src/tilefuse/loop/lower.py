"""Lower a planned map-reduce kernel (graph nodes + row-space alignment) to Loop IR.

Shape of the result: one parallel loop over rows r; row-level values (per-row scalars,
reductions) are statements of the row body; each row reduction is a `Reduce` over the
row's columns; every tensor the kernel writes along the row is stored by one final
column loop. Column values are recomputed inside each inner loop that needs them (the
CUDA printer keeps the row's loads on chip, so recomputing costs arithmetic, not bytes).
Values are computed in f32 when stored as bf16/f16, and rounded once at the store.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


from .. import dtypes
from ..graph import ir as g_ir
from ..graph.fusion import Step, is_row_level
from ..graph.rewrites import fresh_name
from . import ir as L
from .flat import flat_rows, merged_rows, split_rows


@dataclass(frozen=True)
class Binding:
    """A kernel parameter: which graph tensor it is and the shape the kernel views it in."""

    buffer: str
    tensor: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Lowered:
    kernel: L.Kernel
    bindings: tuple[Binding, ...]
    walk: str = ""  # how a map kernel's rows were re-walked (loop/flat.py), for the plan's note


def _coord(space_dim: int, space, r: L.Index) -> L.Index:
    """Index expression of a space dim in terms of the row var r (or the column var)."""
    Ls, C = space
    stride = math.prod(Ls[space_dim + 1:])
    e = r if stride == 1 else L.IBin("//", r, L.IConst(stride))
    outer = math.prod(Ls[:space_dim])
    return e if outer == 1 else L.IBin("%", e, L.IConst(Ls[space_dim]))


def _buffer_view(shape, align, space):
    """Squeeze size-1 dims and merge a full run of row dims into one: (r, c), (r), (c) patterns.
    A column kernel's tensor with its row dim among the others keeps its dims."""
    Ls, C = space
    dims = [(s, a) for s, a in zip(shape, align) if a is not None]
    row = [a for _, a in dims if a < len(Ls)]
    if row and row == [d for d in range(len(Ls)) if Ls[d] != 1] and len(row) > 1 and row == [a for _, a in dims[:len(row)]]:
        merged = [(math.prod(Ls), "rows")] + [(s, a) for s, a in dims if a == len(Ls)]
        return merged
    return dims or [(1, None)]


class _Lowerer:
    def __init__(self, graph: g_ir.Graph, step: Step):
        self.g, self.step = graph, step
        self.space = step.space
        self.row_dim = len(self.space[0])
        self.counter = 0
        self.dtype: dict[str, str] = {}
        self.params: list[L.Buffer] = []
        self.bindings: list[Binding] = []
        self.views: dict[str, list] = {}
        self.as_rows: set[str] = set()  # views read in place as (rows, last dim) of their tensor (buffer_through)
        self.casts: dict[tuple, str] = {}  # (id(block), value, dtype) -> the value converted, in that block
        self.blocks: list[list] = []  # every block made, kept alive: the casts' keys are their ids
        self.rounded16 = _rounded_16bit_maps(graph, step)

    def block(self) -> list:
        """A new statement list. It stays referenced until lowering ends, so its id() (a key of
        `casts`) is never reused by a later block: a reused id made a conversion made in a
        finished reduction's body look available in another block."""
        b: list = []
        self.blocks.append(b)
        return b

    def fresh(self, base="v") -> str:
        self.counter += 1
        return f"{base}{self.counter}"

    def buffer(self, tensor: str, role: str) -> str:
        t = self.g[tensor].type
        view = _buffer_view(t.shape, self.step.align[tensor], self.space)
        shape = tuple(s for s, _ in view)
        self.views[tensor] = view
        self.params.append(L.Buffer(tensor, shape, t.dtype, role))
        self.bindings.append(Binding(tensor, tensor, shape))
        return tensor

    def buffer_through(self, view: str):
        """A view this kernel reads where its tensor lies (Step.reads): that tensor, in its own
        shape, as a parameter named after the view."""
        from .views import along_last_dim

        root = self.step.reads[view]
        t = self.g[root].type
        shape = t.shape or (1,)
        if len(shape) > 1 and along_last_dim(self.g, view, root):  # read as (rows, last dim): views.read_index
            shape = (math.prod(shape[:-1]), shape[-1])
            self.as_rows.add(view)
        self.views[view] = _buffer_view(self.g[view].type.shape, self.step.align[view], self.space)
        self.params.append(L.Buffer(view, shape, t.dtype, "in"))
        self.bindings.append(Binding(view, root, shape))

    def index(self, tensor: str, col: str | None) -> tuple[L.Index, ...]:
        own = self.own_index(tensor, col)
        if tensor not in self.step.reads:
            return own
        from .views import read_index

        root = self.step.reads[tensor]
        if not self.g[root].type.shape:
            return (L.IConst(0),)
        extents = {"r": math.prod(self.space[0])} | ({col: self.space[1]} if col else {})
        shape = tuple(s for s, _ in self.views[tensor])
        # the views from `tensor` down to `root` (a view of a view of root, each read in place)
        return read_index(self.g, tensor, shape, own, extents, until=root, rows=tensor in self.as_rows)

    def own_index(self, tensor: str, col: str | None) -> tuple[L.Index, ...]:
        out = []
        for _, a in self.views[tensor]:
            if a is None:
                out.append(L.IConst(0))
            elif a == "rows":
                out.append(L.Var("r"))
            elif a == self.row_dim:
                out.append(L.Var(col))
            else:
                out.append(_coord(a, self.space, L.Var("r")))
        return tuple(out)

    # -- emission -------------------------------------------------------------------------------
    def emit(self, name: str, block: list, memo: dict, col: str | None) -> str:
        """SSA value of tensor `name` in `block` (the row body when col is None)."""
        row_level = self.is_row(name)
        if row_level and col is not None:
            return self.emit(name, self.row_block, self.row_memo, None)
        if name in memo:
            return memo[name]
        for dep in self.below(name, memo, col):  # a long chain emitted from its far end: no deep recursion
            self.emit(dep, block, memo, col)
        n = self.g[name]
        if name not in self.step.nodes and not isinstance(n, (g_ir.Constant, g_ir.Iota)):
            v = self.load(name, block, col)
        elif isinstance(n, g_ir.Constant):
            v = self.fresh("k")
            ct = dtypes.compute_type(n.type.dtype)
            # as given, as a float: a weak bf16/f16 Constant's value is not rounded (ir.Constant)
            block.append(L.Const(v, float(n.value) if n.type.dtype in ("bf16", "f16") else n.value, ct))
            self.dtype[v] = ct
        elif isinstance(n, g_ir.Iota):
            al = self.step.align.get(name) or self.iota_align(name)
            space_dim = al[n.axis]
            v = self.fresh("i")
            if space_dim is None:  # a size-1 axis: the index is always 0
                expr = L.IConst(0)
            elif space_dim == self.row_dim:
                expr = L.Var(col)
            else:
                expr = _coord(space_dim, self.space, L.Var("r"))
            block.append(L.IndexValue(v, expr, n.type.dtype))
            self.dtype[v] = n.type.dtype
        elif isinstance(n, g_ir.Map):
            v = self.emit_map(n, block, memo, col)
            if name in self.rounded16:
                # a 16-bit result whose rounded value the kernel also uses (a reduction of it, or
                # an explicit cast) is rounded to its dtype for every use: `x - x.amax()` of a
                # bf16 softsign(x) was -0.0006 for a row of equal values, and `v - v.float().bfloat16()`
                # of a bf16 v = c * c was 41, where PyTorch's are 0 (fuzzing)
                v = self.convert(v, n.type.dtype, block)
        elif isinstance(n, g_ir.View):
            v = self.emit(n.arg, block, memo, col)
        elif isinstance(n, g_ir.Gather):
            v = self.emit_gather(n, block, memo, col)
        elif isinstance(n, g_ir.Reduce):
            v = self.emit_reduce(n)
        elif isinstance(n, g_ir.Scan) and col is not None:
            v = self.emit_scan(n, block, memo, col)
        else:
            raise TypeError(f"cannot lower {n.describe()} into a map-reduce kernel")
        memo[name] = v
        return v

    def iota_align(self, name):
        for m in self.step.nodes:
            if name in g_ir.node_args(self.g[m]):
                return self.step.align[name]
        raise KeyError(name)

    def is_row(self, name: str) -> bool:
        if isinstance(self.g[name], g_ir.Constant):
            return True
        return is_row_level(self.step.align[name], self.space)

    def load(self, name, block, col):
        t = self.g[name].type
        raw = self.fresh("x")
        block.append(L.Load(raw, name, self.index(name, col)))
        self.dtype[raw] = t.dtype
        return self.convert(raw, dtypes.compute_type(t.dtype), block)

    def convert(self, v: str, dtype: str, block: list) -> str:
        """v as `dtype`, reusing a conversion already made in this block."""
        if self.dtype[v] == dtype:
            return v
        key = (id(block), v, dtype)
        if key in self.casts:
            return self.casts[key]
        out = self.fresh("c")
        block.append(L.Op(out, "cast", (v,), dtype))
        self.dtype[out] = dtype
        self.casts[key] = out
        if self.dtype[v] in ("bf16", "f16") and dtype == dtypes.compute_type(self.dtype[v]):
            self.casts[(id(block), out, self.dtype[v])] = v  # an exact widening: rounding undoes it
        return out

    def below(self, name: str, memo: dict, col: str | None) -> list[str]:
        """The maps, views and leaves `name` is computed from in this block and not yet emitted,
        in the order the recursive emission reaches them. Emitted first, they leave each emit()
        only one level to recurse."""
        def inner(x: str) -> tuple[str, ...]:
            n = self.g[x]
            if x in memo or x not in self.step.nodes or (col is not None and self.is_row(x)):
                return ()
            args = (n.args if isinstance(n, g_ir.Map) else (n.arg,) if isinstance(n, g_ir.View)
                    else (n.index,) if isinstance(n, g_ir.Gather) else ())
            return tuple(a for a in args if a not in memo)

        return g_ir.post_order(name, inner)[:-1]

    def emit_map(self, n: g_ir.Map, block, memo, col):
        args = [self.emit(a, block, memo, col) for a in n.args]
        out_t = n.type.dtype
        v = self.fresh()
        if n.op == "cast":
            # The kernel holds bf16/f16 values in f32 and does not round between ops, but a value
            # that passes an explicit cast is exactly a value of its graph dtype, before and after:
            # x.to(bf16).float() is not x, and a composite op's bf16 result (softmax, a norm) is
            # rounded where PyTorch rounds it. Loaded values are exact already: no statement then.
            src, arg_t = args[0], self.g[n.args[0]].type.dtype
            if arg_t in ("bf16", "f16"):
                src = self.convert(src, arg_t, block)
            if out_t in ("bf16", "f16"):
                return self.convert(src, out_t, block)  # its users widen it where they need to
            return self.convert(src, dtypes.compute_type(out_t), block)  # float -> int truncates, as in torch
        if n.op in ("and", "or", "not"):
            args = [self.convert(a, "bool", block) for a in args]
            block.append(L.Op(v, n.op, tuple(args), "bool"))
            self.dtype[v] = "bool"
            return v
        # A 16-bit value entering an op of a wider type (`v - v.double()`, a bf16 value beside an
        # f32 tensor) is promoted from its graph dtype's value, as a cast of it sees it: the
        # cast rounded and the promotion did not, so `v - v.double()` came out -0.5 (fuzzing).
        # Chains within one 16-bit type stay unrounded in f32, as above.
        compares = n.op in ("eq", "ne", "lt", "le", "gt", "ge")
        graph_t = [self.g[a].type.dtype for a in n.args]
        operand_t = _compared_as(graph_t) if compares else out_t
        first = 1 if n.op == "where" else 0  # (where's condition is a bool, not an operand)
        args = [self.convert(a, t, block) if i >= first and t in ("bf16", "f16") and t != operand_t else a
                for i, (a, t) in enumerate(zip(args, graph_t))]
        if compares:
            common = _common([self.dtype[a] for a in args])
            args = [self.convert(a, common, block) for a in args]
            block.append(L.Op(v, n.op, tuple(args), "bool"))
            self.dtype[v] = "bool"
            return v
        want = dtypes.compute_type(out_t)
        if n.op == "where":
            args = [self.convert(args[0], "bool", block)] + [self.convert(a, want, block) for a in args[1:]]
        else:
            args = [self.convert(a, want, block) for a in args]
        block.append(L.Op(v, n.op, tuple(args), want))
        self.dtype[v] = want
        return v

    def gather_index(self, n: g_ir.Gather, block, memo, col) -> tuple[str, str]:
        """(in range, clamped) values of a gather's index. An index constant along the row (an
        embedding's token id) is computed once a row, in the row body, where the code
        generator sees the table's row as one contiguous run of 16-byte loads."""
        row = self.is_row(n.index)
        if row and n.name in self.row_gathers:
            return self.row_gathers[n.name]
        if row:
            block, memo, col = self.row_block, self.row_memo, None
        idx = self.convert(self.emit(n.index, block, memo, col), "i64", block)
        size = self.g[n.arg].type.shape[n.axis]
        span = index_range(self.g, n.index)
        if span is not None and 0 <= span[0] and span[1] <= size - 1:
            # in range by construction (F.pad's clamped column, a flip's n - 1 - i): no check,
            # no clamp; a pad's kernel spent as long on the index math as on its bytes
            if row:
                self.row_gathers[n.name] = None, idx
            return None, idx
        zero, last = self.const(block, 0, "i64"), self.const(block, size - 1, "i64")
        if n.wrap:  # x[idx]: a negative index counts from the end
            moved = self.op(block, "add", (idx, self.const(block, size, "i64")), "i64")
            idx = self.op(block, "where", (self.op(block, "lt", (idx, zero), "bool"), moved, idx), "i64")
        ok = self.op(block, "and", (self.op(block, "ge", (idx, zero), "bool"),
                                    self.op(block, "le", (idx, last), "bool")), "bool")
        clamped = self.op(block, "min", (self.op(block, "max", (idx, zero), "i64"), last), "i64")
        if row:
            self.row_gathers[n.name] = ok, clamped
        return ok, clamped

    def emit_gather(self, n: g_ir.Gather, block, memo, col):
        """table[..., index, ...] (torch.gather): the table loaded at this element's position
        with `axis` replaced by the index value, clamped into range; an index out of range
        gives NaN (fusion.gathers_in: the table is a float), where PyTorch stops with a
        device-side assert, so no load ever leaves the table."""
        ok, clamped = self.gather_index(n, block, memo, col)
        index = []
        table_shape = self.g[n.arg].type.shape
        for d, a in enumerate(self.step.align[n.name]):
            if d == n.axis:
                index.append(L.Val(clamped))
            elif a is None or table_shape[d] == 1:  # (a table dim of 1 is read at 0 for every index: ir.Gather)
                index.append(L.IConst(0))
            elif a == self.row_dim:
                index.append(L.Var(col))
            else:
                index.append(_coord(a, self.space, L.Var("r")))
        root = self.table_root(n)
        if root is not None:  # the table is a view of `root`: its element's index there (loop/views.py)
            from .views import read_index

            extents = {"r": math.prod(self.space[0]), clamped: table_shape[n.axis]} | (
                {col: self.space[1]} if col else {})
            index = read_index(self.g, n.arg, table_shape, tuple(index), extents, until=root) \
                if self.g[root].type.shape else (L.IConst(0),)
        raw = self.fresh("x")
        block.append(L.Load(raw, self.tables[n.name], tuple(index)))
        t = self.g[n.arg].type.dtype
        self.dtype[raw] = t
        ct = dtypes.compute_type(t)
        if ok is None:
            return self.convert(raw, ct, block)
        return self.op(block, "where", (ok, self.convert(raw, ct, block), self.const(block, float("nan"), ct)), ct)

    def table_root(self, n: g_ir.Gather) -> str | None:
        """The tensor this kernel reads gather n's table from, where that table is a view read in
        place (Step.reads, keyed by the view the kernel reads: it may be a reshape above the view
        `Step.tables` names), else None."""
        name = n.arg
        while name not in self.step.reads:
            if name == self.step.tables[n.name] or not isinstance(self.g[name], g_ir.View):
                return None
            name = self.g[name].arg
        return self.step.reads[name]

    def op(self, block: list, op: str, args: tuple, dtype: str) -> str:
        """A new value: `op` of `args`, of `dtype`, appended to `block`."""
        v = self.fresh()
        block.append(L.Op(v, op, args, dtype))
        self.dtype[v] = dtype
        return v

    def const(self, block: list, value, dtype: str) -> str:
        v = self.fresh("k")
        block.append(L.Const(v, value, dtype))
        self.dtype[v] = dtype
        return v

    def emit_reduce(self, n: g_ir.Reduce):
        col = f"c{self.counter + 1}"
        self.counter += 1
        body: list = self.block()
        x = self.emit(n.arg, body, {}, col)
        if self.g[n.arg].type.dtype in ("bf16", "f16"):
            # a 16-bit value reduced is a value of its graph dtype, as a cast of it sees it
            # (emit_map): the mean of x and the cast x in x - mean(x) must be the same values, or
            # a row of equal values gets a variance (std of ten equal f16 values: 0.0012)
            x = self.convert(x, self.g[n.arg].type.dtype, body)
        want = dtypes.compute_type(n.type.dtype)
        x = self.convert(x, want if dtypes.is_float(want) else "i64" if n.op in ("sum", "prod") else want, body)
        acc_t = self.dtype[x]
        v = self.fresh("red")
        op = "sum" if n.op == "mean" else n.op
        self.row_block.append(L.Reduce(v, op, col, self.space[1], tuple(body), x, acc_t))
        self.dtype[v] = acc_t
        if n.op == "mean":
            k, m = self.fresh("k"), self.fresh()
            # divide (not multiply by 1/C): exact where PyTorch's mean is, e.g. for a row of equal values
            self.row_block += [L.Const(k, float(self.space[1]), acc_t), L.Op(m, "div", (v, k), acc_t)]
            self.dtype[m] = acc_t
            v = m
        if not dtypes.is_float(acc_t) and acc_t != dtypes.compute_type(n.type.dtype):
            # an integer sum or product of a narrower dtype (`sum(x, dtype=torch.int32)`) wraps
            # as that dtype: a store narrowed it, but a use in the kernel read the i64 accumulator
            # (`sum(x, dtype=int32).long()` of 2e9 + 2e9 was 4e9, PyTorch's -294967296; fuzzing)
            v = self.convert(v, n.type.dtype, self.row_block)
        return v

    def emit_scan(self, n: g_ir.Scan, block, memo, col):
        """The running value in the column loop (the kernel's one scan: fusion.align_in), its
        argument a value of its graph dtype, as a cast of it sees it (emit_reduce)."""
        x = self.emit(n.arg, block, memo, col)
        if self.g[n.arg].type.dtype in ("bf16", "f16"):
            x = self.convert(x, self.g[n.arg].type.dtype, block)
        acc_t = dtypes.compute_type(n.type.dtype)
        acc_t = "i32" if acc_t in ("i8", "u8") else acc_t  # (exact for a running max or min; shuffles move 32 bits)
        x = self.convert(x, acc_t, block)
        v = self.fresh("scan")
        block.append(L.Scan(v, n.op, col, x, acc_t))
        self.dtype[v] = acc_t
        if acc_t != dtypes.compute_type(n.type.dtype):  # (an 8-bit sum or product wraps as its dtype)
            v = self.convert(v, n.type.dtype, block)
        return v

    def store(self, name, block, memo, col):
        v = self.emit(name, block, memo, col)
        v = self.convert(v, self.g[name].type.dtype, block)
        block.append(L.Store(name, self.index(name, col), v))

    def lower(self, kernel_name: str) -> Lowered:
        step = self.step
        for t in step.inputs:
            if t in step.align:
                self.buffer(t, "in")
            for v in (v for v, r in step.reads.items() if r == t and v in step.align):  # (else a gather's table)
                self.buffer_through(v)
        self.row_gathers: dict[str, tuple[str, str]] = {}  # gather -> its row-level index values (gather_index)
        self.tables = {}  # gather -> the buffer of its table: its tensor, in the gather's argument's shape
        for m in step.nodes:
            if isinstance(self.g[m], g_ir.Gather):
                root = self.table_root(self.g[m])  # a view read where its tensor lies (emit_gather)
                t = self.g[root or self.g[m].arg].type
                self.tables[m] = f"{m}_table"
                self.params.append(L.Buffer(self.tables[m], t.shape or (1,), t.dtype, "in"))
                self.bindings.append(Binding(self.tables[m], root or step.tables[m], t.shape or (1,)))
        for t in step.outputs:
            self.buffer(t, "out")
        self.row_block, self.row_memo = self.block(), {}
        col_outputs = []
        for name in step.nodes:
            if name in step.outputs and not self.is_row(name):
                col_outputs.append(name)
            elif name in step.outputs:
                self.store(name, self.row_block, self.row_memo, None)
            elif self.is_row(name):
                self.emit(name, self.row_block, self.row_memo, None)
        if col_outputs:
            col = f"c{self.counter + 1}"
            self.counter += 1
            body, memo = self.block(), {}
            for name in col_outputs:
                self.store(name, body, memo, col)
            self.row_block.append(L.Loop(col, self.space[1], tuple(body)))
        rows = math.prod(self.space[0])
        kernel = L.Kernel(kernel_name, tuple(self.params),
                          (L.Loop("r", rows, tuple(self.row_block), parallel=True),), "mapreduce",
                          notes=tuple(f"{n}: {self.g[n].describe()}" for n in step.nodes))
        return Lowered(kernel, tuple(self.bindings))


def index_range(g: g_ir.Graph, name: str) -> tuple[int, int] | None:
    """(least, greatest) an integer tensor's elements can be, from how it is made (iotas,
    integer constants, views, and add / sub / mul / min / max / casts of these, floor division
    and remainder by a positive constant), or None."""
    return _index_range(g, name, {})


_BITS = {"u8": (0, 255), "i8": (-128, 127), "i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1)}


def _index_range(g: g_ir.Graph, name: str, memo: dict) -> tuple[int, int] | None:
    """index_range, each node's range computed once (a shared operand is not walked per path)."""
    if name not in memo:
        n = g[name]
        span = _node_range(g, n, memo) if n.type.dtype in dtypes.INTS else None
        bits = _BITS.get(n.type.dtype)
        memo[name] = span if span is not None and bits[0] <= span[0] and span[1] <= bits[1] else None  # (else it may wrap)
    return memo[name]


def _node_range(g: g_ir.Graph, n, memo: dict) -> tuple[int, int] | None:
    if isinstance(n, g_ir.Iota):
        return 0, n.type.shape[n.axis] - 1
    if isinstance(n, g_ir.Constant):
        return (n.value, n.value) if isinstance(n.value, int) and not isinstance(n.value, bool) else None
    if isinstance(n, g_ir.View):
        return _index_range(g, n.arg, memo)
    if not isinstance(n, g_ir.Map) or n.op not in ("add", "sub", "mul", "min", "max", "cast", "floordiv", "mod"):
        return None
    spans = [_index_range(g, a, memo) for a in n.args]
    if None in spans:
        return None
    if n.op in ("floordiv", "mod"):  # by a positive constant (a stack's select's column and piece)
        (alo, ahi), (blo, bhi) = spans
        if blo != bhi or blo <= 0:
            return None
        return (alo // blo, ahi // blo) if n.op == "floordiv" else (0, blo - 1) if alo < 0 else (0, min(ahi, blo - 1))
    if n.op == "cast":  # (an integer's value, where the new dtype holds the range: index_range checks)
        return spans[0]
    (alo, ahi), (blo, bhi) = spans
    if n.op == "mul":
        corners = (alo * blo, alo * bhi, ahi * blo, ahi * bhi)
        return min(corners), max(corners)
    return {"add": (alo + blo, ahi + bhi), "sub": (alo - bhi, ahi - blo),
            "min": (min(alo, blo), min(ahi, bhi)), "max": (max(alo, blo), max(ahi, bhi))}[n.op]


def _rounded_16bit_maps(graph: g_ir.Graph, step) -> frozenset[str]:
    """The bf16/f16 maps of this step whose rounded value the kernel uses: the value one of its
    16-bit reductions or scans reads, or an explicit cast takes (through views), and the 16-bit
    maps under it in the step, so that each is one value wherever the kernel uses it:
    `v + (-v).amin()` reads -v, and v itself must be rounded for the sum of equal values to be 0."""
    out, seen = set(), set()
    todo = [graph[n].arg for n in step.nodes  # (a scan's too: `cummax(x) - x` is 0 where x is the max)
            if isinstance(graph[n], (g_ir.Reduce, g_ir.Scan)) and graph[graph[n].arg].type.dtype in ("bf16", "f16")]
    todo += [graph[n].args[0] for n in step.nodes
             if isinstance(graph[n], g_ir.Map) and graph[n].op == "cast"
             and graph[graph[n].args[0]].type.dtype in ("bf16", "f16")]
    while todo:
        a = todo.pop()
        if a in seen or a not in step.nodes:
            continue
        seen.add(a)
        n = graph[a]
        if isinstance(n, g_ir.View):
            todo.append(n.arg)
        elif isinstance(n, g_ir.Map):
            if n.type.dtype in ("bf16", "f16"):
                out.add(a)
            todo.extend(n.args)
    return frozenset(out)


def _compared_as(ts: list[str]) -> str:
    """The type a comparison of these graph dtypes compares in: one 16-bit float type among the
    floats compares as that type (its values as they are), mixed floats as f32/f64 (_common)."""
    floats = {t for t in ts if dtypes.is_float(t)}
    return floats.pop() if len(floats) == 1 and floats <= {"bf16", "f16"} else _common(ts)


def _common(ts: list[str]) -> str:
    floats = [t for t in ts if dtypes.is_float(t)]
    if floats:
        return "f64" if "f64" in floats else "f32"
    ints = [t for t in ts if t in dtypes.INTS]
    return "i64" if ints else "bool"


def lower_step(graph: g_ir.Graph, step: Step, name: str | None = None) -> Lowered:
    if step.family != "mapreduce":
        raise ValueError(f"step {step.name} is {step.family}, not a map-reduce kernel")
    if step.tail is not None:
        return _grid_reduction(graph, step, name or step.name)
    low = _Lowerer(graph, step).lower(name or step.name)
    # (maps alone: neighbouring rows merged where their row-level values allow, few long rows
    # split into pieces, else short rows as rows of K of the whole; none takes a kernel with a
    # reduction. A view read in place
    # along the row (a slice, a transpose read in tiles) reads the column: no merge takes it)
    kernel = None
    if not step.columns and not step.scan:  # (a scan runs along the row as it is)
        kernel = merged_rows(low.kernel)
        if kernel is not None:
            C = _inner(low.kernel)
            walk = f"rows merged {_inner(kernel) // C} at a time: {kernel.body[0].extent} rows of {_inner(kernel)}"
        elif (kernel := split_rows(low.kernel)) is not None:
            walk = (f"rows split: {kernel.body[0].extent} rows of {_inner(kernel)} "
                    f"({low.kernel.body[0].extent} rows of {_inner(low.kernel)} are few)")
        elif not step.reads:
            kernel = flat_rows(low.kernel)
            walk = kernel and (f"walked as {kernel.body[0].extent} rows of {_inner(kernel)} of the whole "
                               f"(rows of {_inner(low.kernel)} are short)")
    if kernel is None:
        return low
    shapes = {b.name: b.shape for b in kernel.params}
    return Lowered(kernel, tuple(replace(b, shape=shapes[b.buffer]) for b in low.bindings), f"{walk} (loop/flat.py)")


def _inner(kernel: L.Kernel) -> int:
    return kernel.body[0].body[-1].extent


def _grid_reduction(graph: g_ir.Graph, step: Step, name: str) -> Lowered:
    """One kernel from a row kernel and the one-row kernel that reduces its per-row values:
    the row loop stores them into scratch buffers, a second loop (of one iteration) reduces
    them; exactly the two kernels' statements, so the interpreter computes what it did before."""
    head = _Lowerer(graph, step.head).lower(name)
    tail = _Lowerer(graph, step.tail).lower(name + "_tail")
    scratch = tuple(b for b in head.kernel.params if b.name in step.scratch)
    for b in scratch:
        t = tail.kernel.buffer(b.name)
        if (t.shape, t.dtype) != (b.shape, b.dtype):
            raise AssertionError(f"{name}: scratch {b.name} is {b.dtype}{b.shape} in the row loop, "
                                 f"{t.dtype}{t.shape} in the grid reduction")
    taken = {s.dst for s in L.walk(head.kernel.body) if hasattr(s, "dst")}
    rename = {s.dst: fresh_name(taken, "g" + s.dst) for s in L.walk(tail.kernel.body) if hasattr(s, "dst")}
    keep = [i for i, b in enumerate(head.kernel.params) if b.name not in step.scratch]
    outs = [i for i, b in enumerate(tail.kernel.params) if b.role == "out"]
    params = tuple(head.kernel.params[i] for i in keep) + tuple(tail.kernel.params[i] for i in outs)
    bindings = tuple(head.bindings[i] for i in keep) + tuple(tail.bindings[i] for i in outs)
    body = head.kernel.body + tuple(_renamed(s, rename) for s in tail.kernel.body)
    kernel = L.Kernel(name, params, body, "mapreduce", notes=head.kernel.notes + tail.kernel.notes, scratch=scratch)
    return Lowered(kernel, bindings)


def _renamed(s, m: dict):
    """A statement with its SSA values renamed by `m` (nested bodies and gathered indices too)."""
    from dataclasses import replace

    def ix(e):
        if isinstance(e, L.Val):
            return L.Val(m.get(e.name, e.name))
        if isinstance(e, L.IBin):
            return L.IBin(e.op, ix(e.a), ix(e.b))
        return e

    if isinstance(s, L.Load):
        return replace(s, dst=m[s.dst], index=tuple(map(ix, s.index)))
    if isinstance(s, L.Store):
        return replace(s, index=tuple(map(ix, s.index)), value=m.get(s.value, s.value))
    if isinstance(s, (L.Const,)):
        return replace(s, dst=m[s.dst])
    if isinstance(s, L.IndexValue):
        return replace(s, dst=m[s.dst], expr=ix(s.expr))
    if isinstance(s, L.Op):
        return replace(s, dst=m[s.dst], args=tuple(m.get(a, a) for a in s.args))
    if isinstance(s, L.Loop):
        return replace(s, body=tuple(_renamed(t, m) for t in s.body))
    if isinstance(s, L.Reduce):
        return replace(s, dst=m[s.dst], value=m.get(s.value, s.value), body=tuple(_renamed(t, m) for t in s.body))
    raise TypeError(f"cannot rename {s!r}")

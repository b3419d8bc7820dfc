"""A `cat` along the last dim with a computed piece becomes a select of its pieces: one kernel.

    cat((f(a, ...), b), -1)   ->   where(j < A, f(a[.., min(j, A-1)], ...), b[.., max(j - A, 0)])

j is the output's column, A the first piece's width. GPT-NeoX, StableLM and Phi-3 rotate part
of each head (partial rotary) and put it back beside the rest: `cat((q_rot * cos +
rotate_half(q_rot) * sin, q_pass), -1)`. In PyTorch's op the rotated part is written by a
kernel of its own, then the cat copies it and the slice of the projection beside it: and the
slices of the projection feeding both were copies too (a view read by a kernel and by a cat
keeps its copy). As a select, one map kernel reads the projection where it lies and writes q
(or k) once, as torch.compile's kernel does.

Each piece is computed at its clamped column: a map's arguments are gathered along the last
dim at that column (a map of gathered arguments is the gathered map: gather_sink.py), down to
the tensors it reads (views of memory, weights, kernels' results); a tensor of size 1 there
broadcasts and stays. Columns outside a piece compute a value the select drops, at an index
inside the piece (loop/lower.py `index_range` bounds the clamp, so no range check), and a
piece's columns are read as 16-byte streams where its offset is a whole number of chunks
(codegen/mapreduce.py `_clamped_column`). The values are the pieces' own, selected: the same
bits as PyTorch's cat.

An empty piece is dropped, and a cat of one piece left is that piece (Phi-3 cats its fully
rotated q with an empty pass-through). Taken for float cats along the last dim of 2 to
MAX_PIECES pieces (each column computes every piece: a NeRF encoding's 21 would be 21 times the
sines), all of the cat's dtype and rank, at least one of them a map or a slice of one (a cat of tensors in memory
alone is PyTorch's copy, which reads them in place), none of them a program input (a cache grown
call by call, which runtime/resize.py resizes in PyTorch's cat), whose trees hold no more than
MAX_MAPS maps together and gather only float tensors (a kernel gathers floats:
fusion.gathers_in). A cat along another dim (a KV cache's, along the sequence) is left alone.
"""
from __future__ import annotations

from ... import dtypes
from .. import ir
from ..rewrites import substitute
from .cat_signs import _pieces
from .gather_sink import _made_type, _table
from .match import Editor, prune

MAX_PIECES = 4  # every column computes every piece's tree: more pieces, that many times the work
MAX_MAPS = 32  # over all pieces: each is computed at every column of the cat


def _maps(g: ir.Graph, name: str, width: int, budget: list, seen: set) -> bool:
    """Whether the piece's tree can be computed at other columns: every tensor it gathers is a
    float one, and the pieces hold no more than the budget's maps (each counted once)."""
    if name in seen:
        return True
    seen.add(name)
    n = g[name]
    t = n.type
    if not t.shape or t.shape[-1] != width or isinstance(n, ir.Constant):
        return True  # (broadcasts along the last dim: read as it is)
    if isinstance(n, ir.Map) and name not in g.outputs:
        budget[0] -= 1
        return budget[0] >= 0 and all(_maps(g, a, width, budget, seen) for a in n.args)
    if _along_columns(g, n) and name not in g.outputs:  # (a stack's select's, under a cat)
        budget[0] -= 1
        return budget[0] >= 0 and _maps(g, n.index, width, budget, seen)
    if _sliced_map(g, n):
        budget[0] -= 1
        return budget[0] >= 0 and _maps(g, n.arg, g[n.arg].type.shape[-1], budget, seen)
    return dtypes.is_float(t.dtype) or _column(n)


def _sliced_map(g: ir.Graph, n) -> bool:
    """A slice of the last dim of a map computed in the program (Cohere's x[..., ::2] of q cast
    to f32): at column c it is the map at column start + step c, computed there, so the map's
    own result need not be in memory for a kernel to gather it."""
    if not (isinstance(n, ir.View) and n.op == "slice" and n.type.shape):
        return False
    rank = len(n.type.shape)
    dim, start, _, step = n.params
    a = g[n.arg]
    return (dim % rank == rank - 1 and 0 <= start and step >= 1 and isinstance(a, ir.Map)
            and n.arg not in g.outputs and len(a.type.shape) == rank)


def _along_columns(g: ir.Graph, n) -> bool:
    """A gather of a float tensor along the last dim, without wrapping: at another column it
    is the same gather at its index's value there."""
    return (isinstance(n, ir.Gather) and n.axis == len(n.type.shape) - 1 and not n.wrap
            and dtypes.is_float(g[n.arg].type.dtype))


def _column(n) -> bool:
    """An iota along the last dim: its value at a column is the column (a stack's select's)."""
    return isinstance(n, ir.Iota) and n.axis == len(n.type.shape) - 1 and n.type.dtype == "i64"


def _input_piece(g: ir.Graph, name: str) -> bool:
    """A piece that is a whole program input under views that cut nothing: a cache the program
    grows (a key cache kept transposed, grown along its last dim), whose size changes from call
    to call; its cat stays PyTorch's, which a resized program runs at any size
    (runtime/resize.py). A slice of an input is a piece like any other."""
    n = g[name]
    while isinstance(n, ir.View) and n.op != "slice":
        n = g[n.arg]
    return isinstance(n, ir.Input)


class _At:
    """A piece's tree recomputed at the clamped columns `index` ([1, .., 1, m], in range)."""

    def __init__(self, g: ir.Graph, ed: Editor, out: list, width: int, index: str, m: int, rank: int, source: str):
        self.g, self.ed, self.out, self.width, self.index, self.m, self.rank = g, ed, out, width, index, m, rank
        self.source, self.memo = source, {}

    def __call__(self, name: str) -> str:
        if name not in self.memo:
            self.memo[name] = self._at(name)
        return self.memo[name]

    def _column_map(self, op: str, index: str, c: int) -> str:
        """op(index, c): the columns an index of the same shape reads."""
        col = ir.TensorType((1,) * (self.rank - 1) + (self.m,), "i64")
        moved = ir.Map(self.ed.fresh("slice_col"), col, op, (index, _const(self.ed, self.out, c, self.source)), self.source)
        self.out.append(moved)
        return moved.name

    def _at(self, name: str) -> str:
        g, n = self.g, self.g[name]
        t = n.type
        if not t.shape or t.shape[-1] != self.width or isinstance(n, ir.Constant):
            return name
        if _column(n):
            return self.index
        if _sliced_map(g, n):  # the map itself, at column start + step j
            _, start, _, step = n.params
            index = self.index
            if step != 1:
                index = self._column_map("mul", index, step)
            if start:
                index = self._column_map("add", index, start)
            return _At(g, self.ed, self.out, g[n.arg].type.shape[-1], index, self.m, self.rank, self.source)(n.arg)
        wide = ir.TensorType(t.shape[:-1] + (self.m,), t.dtype)
        if isinstance(n, ir.Map) and name not in g.outputs:
            m = ir.Map(self.ed.fresh(f"{name}_at"), wide, n.op, tuple(self(a) for a in n.args), n.source)
            self.out.append(m)
            return m.name
        if _along_columns(g, n) and name not in g.outputs:
            gat = ir.Gather(self.ed.fresh(f"{name}_at"), wide, n.arg, self(n.index), n.axis, n.source)
            self.out.append(gat)
            return gat.name
        table = _table(self.g, self.ed, self.out, name, self.rank, self.source)  # (at the gather's rank)
        if table != name:
            wide = ir.TensorType(_made_type(self.out, table).shape[:-1] + (self.m,), t.dtype)
        gat = ir.Gather(self.ed.fresh(f"{name}_at"), wide, table, self.index, self.rank - 1, self.source)
        self.out.append(gat)
        return gat.name


def _const(ed: Editor, out: list, value: int, source: str) -> str:
    c = ir.Constant(ed.fresh("c"), ir.TensorType((), "i64"), value, source)
    out.append(c)
    return c.name


def _select(g: ir.Graph, ed: Editor, n: ir.Extern, names: list) -> list:
    """The nodes computing cat `n` of `names` (non-empty pieces) as a select; the last is named n."""
    out, src = [], n.source
    rank, m = len(n.type.shape), n.type.shape[-1]
    i64 = lambda shape: ir.TensorType(shape, "i64")  # noqa: E731
    pos = ir.Iota(ed.fresh("cat_col"), i64((1,) * (rank - 1) + (m,)), rank - 1, src)
    out.append(pos)
    col = pos.type
    values, starts, off = [], [], 0
    for x in names:
        w = g[x].type.shape[-1]
        shifted = ir.Map(ed.fresh("cat_shift"), col, "sub", (pos.name, _const(ed, out, off, src)), src)
        low = ir.Map(ed.fresh("cat_low"), col, "max", (shifted.name, _const(ed, out, 0, src)), src)
        out += [shifted, low]
        at = ir.Map(ed.fresh("cat_at"), col, "min", (low.name, _const(ed, out, w - 1, src)), src)
        out.append(at)
        values.append(_At(g, ed, out, w, at.name, m, rank, src)(x))
        starts.append(off)
        off += w
    picks = _picks(ed, out, n, values, ("cat_in", "lt", pos.name, starts[1:]), "cat_pick")  # j < the next start
    return out + picks


def _picks(ed: Editor, out: list, n, values: list, test: tuple, base: str) -> list:
    """where(op(by, bounds[k]), values[k], the rest), from the last piece back, the outermost
    named n: `test` is (the condition's name, op, by, bounds). Their constants go to `out`."""
    cond_name, op, by, bounds = test
    picks, picked = [], values[-1]
    for k in range(len(values) - 2, -1, -1):
        col = (1,) * (len(n.type.shape) - 1) + (n.type.shape[-1],)
        cond = ir.Map(ed.fresh(cond_name), ir.TensorType(col, "bool"), op,
                      (by, _const(ed, out, bounds[k], n.source)), n.source)
        sel = ir.Map(n.name if k == 0 else ed.fresh(base), n.type, "where", (cond.name, values[k], picked), n.source)
        picks += [cond, sel]
        picked = sel.name
    return picks


def _selectable(g: ir.Graph, names: list) -> bool:
    """2 to MAX_PIECES pieces, none a program input, one computed (a map, or a slice of one),
    their trees computable at other columns within MAX_MAPS maps."""
    budget, seen = [MAX_MAPS], set()
    return (2 <= len(names) <= MAX_PIECES and not any(_input_piece(g, x) for x in names)
            and any(isinstance(g[x], ir.Map) and x not in g.outputs or _sliced_map(g, g[x]) for x in names)
            and all(_maps(g, x, g[x].type.shape[-1], budget, seen) for x in names))


def cats_as_maps(g: ir.Graph) -> ir.Graph:
    ed, out, renamed, changed = Editor(g), [], {}, False
    for n in g.nodes:
        found = _pieces(g, n) if dtypes.is_float(n.type.dtype) and n.type.shape else None
        rank = len(n.type.shape)
        if (found is None or found[1] != rank - 1
                or any(g[x].type.dtype != n.type.dtype or len(g[x].type.shape) != rank for x in found[0])):
            out.append(n)
            continue
        names = [x for x in found[0] if g[x].type.shape[-1] > 0]
        if len(names) == 1 and g[names[0]].type.shape == n.type.shape:
            renamed[n.name] = names[0]  # (the others were empty)
            out.append(n)
            changed = True
            continue
        if not _selectable(g, names):
            out.append(n)
            continue
        out += _select(g, ed, n, names)
        changed = True
    if not changed:
        return g
    return prune(substitute(ir.Graph(tuple(out), g.inputs, g.outputs, ed.weights, g.writes, g.layouts), renamed))


def _stacked(g: ir.Graph, n) -> list | None:
    """The pieces of `n` = reshape(stack((p0, .., pk-1), -1), (.., k w)): a stack along a new
    last dim flattened back, which interleaves the pieces' columns; else None."""
    if not (isinstance(n, ir.View) and n.op == "reshape" and n.type.shape):
        return None
    s = g[n.arg]
    if not (isinstance(s, ir.Extern) and s.target == "aten.stack.default" and not s.kwargs and s.args
            and isinstance(s.args[0], (tuple, list)) and s.args[0]
            and all(isinstance(r, ir.Ref) for r in s.args[0])):
        return None
    rank = len(s.type.shape)
    dim = s.args[1] if len(s.args) > 1 else 0
    if not isinstance(dim, int) or rank < 2 or dim % rank != rank - 1:
        return None
    if n.type.shape != s.type.shape[:-2] + (s.type.shape[-2] * s.type.shape[-1],):
        return None
    return [r.name for r in s.args[0]]


def _interleave(g: ir.Graph, ed: Editor, n: ir.View, names: list) -> list:
    """The nodes computing `n` as a select of its pieces at column j // k by j % k; the last is named n."""
    out, src = [], n.source
    rank, m, k = len(n.type.shape), n.type.shape[-1], len(names)
    col = ir.TensorType((1,) * (rank - 1) + (m,), "i64")
    pos = ir.Iota(ed.fresh("stack_col"), col, rank - 1, src)
    at = ir.Map(ed.fresh("stack_at"), col, "floordiv", (pos.name, _const(ed, out, k, src)), src)
    which = ir.Map(ed.fresh("stack_which"), col, "mod", (pos.name, _const(ed, out, k, src)), src)
    out += [pos, at, which]
    values = [_At(g, ed, out, m // k, at.name, m, rank, src)(x) for x in names]
    picks = _picks(ed, out, n, values, ("stack_is", "eq", which.name, range(k)), "stack_pick")
    return out + picks


def _pairwise_epilogue(g: ir.Graph, n, names: list) -> bool:
    """Whether the pieces are maps of column slices of a contraction's output of the stack's own
    shape (or of maps of it): rope_into_projection's pair form, which a GEMM
    computes in its pairwise epilogue (contraction.stack_halves), so the stack stays for it."""
    seen, todo = set(), list(names)
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        m = g[x]
        if isinstance(m, ir.Map):
            todo += m.args
        elif isinstance(m, ir.View) and m.op == "slice" and _gemm_output(g, m.arg, n.type.shape):
            return True
    return False


def _gemm_output(g: ir.Graph, name: str, shape: tuple) -> bool:
    """Whether `name` is a contraction of `shape` or maps of one, with no view between."""
    def below(x):
        n = g[x]
        return n.args if isinstance(n, ir.Map) and n.type.shape == shape else ()

    return any(isinstance(g[x], ir.Contraction) and g[x].type.shape == shape for x in ir.reached(name, below))


def stacks_as_maps(g: ir.Graph) -> ir.Graph:
    """A stack along a new last dim viewed back flat, `stack((-x2, x1), -1).flatten(-2)` (GPT-J's
    and Cohere's interleaved rotary: x1, x2 = x[..., ::2], x[..., 1::2]), becomes a select of its
    pieces: column j is piece j % k at column j // k, each piece computed there as a cat's are
    (`_At`). The stack was a PyTorch copy of the pieces, each a copy or a kernel's result of
    its own; as a map, the kernel that reads it computes it where it stands (the rotation, then
    the cat of the rotated part beside the rest: cats_as_maps, which runs next). Same values,
    selected: the same bits. Taken on the cat's terms: float, 2 to MAX_PIECES pieces of the
    result's dtype and rank, one of them a map (or a slice of one), none a program input, MAX_MAPS maps at most;
    not rope_into_projection's pair form, which its GEMM's epilogue computes."""
    ed, out, changed = Editor(g), [], False
    for n in g.nodes:
        names = _stacked(g, n) if dtypes.is_float(n.type.dtype) else None
        rank = len(n.type.shape)
        if (names is None or n.type.shape[-1] == 0
                or any(g[x].type.dtype != n.type.dtype or len(g[x].type.shape) != rank
                       or g[x].type.shape[-1] * len(names) != n.type.shape[-1] for x in names)
                or _pairwise_epilogue(g, n, names) or not _selectable(g, names)):
            out.append(n)
            continue
        out += _interleave(g, ed, n, names)
        changed = True
    if not changed:
        return g
    return ed.graph(out)

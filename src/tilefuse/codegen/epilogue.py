"""GEMM epilogue programs: small Loop IR kernels run on the accumulator tile while it is
still in registers.

An epilogue is a Loop IR `Kernel` (family "epilogue") whose body is

    Loop(m, M, parallel) { Loop(n, N, parallel) { ... Store out[..., m, n] ... } }

reading the fp32 accumulator as the buffer `acc` [B, M, N] (or [M, N]) and any other
operand by index: a row vector `v[m]`, a column vector `v[n]`, a tile `r[m, n]`, or a
tensor of its own shape at any index of b, m, n (a table read through views, `cos[m % S, n % W]`).
The NumPy Loop IR interpreter runs it as is (with `acc` = A @ B), which is how CPU tests check
an epilogue; the GEMM template renders the inner body once per accumulator register, with
`m` and `n` bound to that register's row and column (from the wgmma fragment layout).

The builders below make the common epilogues; `EpilogueBuilder` makes any other.

Partial row reductions. An epilogue may also reduce each output row over fixed groups of
W columns (`PARTIAL_WIDTH`), writing one value per (row, group) into [M, T] outputs,
T = ceil(N / W): a sum (of squares, say), a max, a (max, sum of exp(y - max)) pair, a
target select. A kernel that finishes the row (log-sum-exp, the loss, an RMS) then reads
T values per row instead of N: the [M, N] tile is never written unless something else
reads it. In Loop IR they are a second loop next to the element loop,

    Loop(m) { [Loop(n) { ... stores }]  Loop(t, T) { row statements, Reduce(c, W) ..., Stores at [m, t] } }

each Reduce's body a copy of the element statements its value needs, with the column
`t * W + c` in place of `n` (read at `(t * W + c) % N` when W does not divide N, so the
interpreter never reads past the tile, and masked to the reduction's identity past N).
The interpreter runs that as is; the sm_90a template computes each reduction on the
registers of the group's columns a thread holds, then across the four lanes that share
the row (see gemm_sm90._partials_code).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

from ..loop import ir

ACC = "acc"
PARTIAL_WIDTH = 128   # columns per partial: divides every bn of 128 or 256, one reduction per 128 columns
SHORT_PARTIAL_WIDTH = 16  # ... after a GEMM of a few rows, which programs run in the GEMV: its CTA's 16 columns
                          # (width_for_rows)
PARTIAL_KINDS = ("sum", "max", "lse", "select")


def width_for_rows(rows: int) -> int:
    """The columns a norm's partials group after a GEMM of `rows` rows: the GEMV's CTA owns 16
    output columns (codegen/gemv.py, which programs run at up to gemv.MAX_M rows: a decode
    step's O and down projections), the tile templates a multiple of 128 (both render 16)."""
    from .gemv import MAX_M

    return SHORT_PARTIAL_WIDTH if rows <= MAX_M else PARTIAL_WIDTH


@dataclass
class EpilogueBuilder:
    """Builds an epilogue kernel statement by statement (SSA names are made up here)."""

    m: int
    n: int
    batch: int = 1
    pairwise: bool = False      # outputs are n // 2 wide, each from columns (2j, 2j + 1)
    params: list = field(default_factory=list)
    body: list = field(default_factory=list)
    # (kind, output names, value, target buffer or None), in the order they were asked for
    partials: list = field(default_factory=list)
    width: int | None = None    # the partials' column group W (one for the whole epilogue)
    _count: int = 0

    def __post_init__(self):
        if self.pairwise and self.n % 2:
            raise ValueError(f"a pairwise epilogue needs an even N, not {self.n}")
        lead = (self.batch,) if self.batch > 1 else ()
        self.params.append(ir.Buffer(ACC, lead + (self.m, self.n), "f32", "in"))

    @property
    def out_n(self) -> int:
        return self.n // 2 if self.pairwise else self.n

    def _shape(self, kind: str = "tile", full: bool = False):
        lead = (self.batch,) if self.batch > 1 else ()
        n = self.n if full else self.out_n
        return {"tile": lead + (self.m, n), "row": (self.m,), "col": (n,)}[kind]

    def _index(self, kind: str = "tile", pair: int | None = None):
        lead = (ir.Var("b"),) if self.batch > 1 else ()
        n = ir.Var("n") if pair is None else self._pair_col(pair)
        return {"tile": lead + (ir.Var("m"), n), "row": (ir.Var("m"),), "col": (n,)}[kind]

    @staticmethod
    def _pair_col(pair: int):
        return ir.idx(ir.IBin("+", ir.IBin("*", ir.IConst(2), ir.Var("n")), ir.IConst(pair)))

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}{self._count}"

    def acc(self, pair: int | None = None) -> str:
        """The accumulator at (m, n); in a pairwise epilogue (`pairwise=True`), column
        2n + pair: the two adjacent accumulator columns one output element is made of."""
        dst = self._name("a")
        index = self._index()
        if self.pairwise:
            if pair not in (0, 1):
                raise ValueError("a pairwise epilogue reads acc(0) or acc(1)")
            index = index[:-1] + (self._pair_col(pair),)
        self.body.append(ir.Load(dst, ACC, index))
        return dst

    def load(self, name: str, kind: str, dtype: str, pair: int | None = None) -> str:
        """Read operand `name`: kind "row" ([M]), "col" ([N]) or "tile" (like the output). In a
        pairwise epilogue, `pair` 0 or 1 reads a full-width operand (as wide as the
        accumulator) at column 2n + pair, next to acc(pair)."""
        if pair is not None and not self.pairwise:
            raise ValueError("only a pairwise epilogue reads operands at column 2n + pair")
        return self.load_at(name, self._shape(kind, full=pair is not None), dtype,
                            self._index(kind, pair if kind != "row" else None))

    def tile(self, pair: int | None = None) -> tuple[tuple, tuple[int, ...]]:
        """(index, shape): where a tile operand (shaped like the output) is read at this element,
        and that shape; with `pair` 0 or 1, a full-width one of a pairwise epilogue (column 2n + pair)."""
        if pair is not None and not self.pairwise:
            raise ValueError("only a pairwise epilogue reads operands at column 2n + pair")
        return self._index("tile", pair), self._shape("tile", full=pair is not None)

    @property
    def extents(self) -> dict[str, int]:
        """The loop variables an index may use, with their extents."""
        return {"b": self.batch, "m": self.m, "n": self.out_n}

    def load_at(self, name: str, shape: tuple[int, ...], dtype: str, index: tuple) -> str:
        """Read operand `name`, a buffer of `shape`, at `index` (expressions of b, m, n): any
        operand, e.g. a small table the output reads through views, at (m % S, n % W)."""
        for p in self.params:
            if p.name == name and (p.shape, p.dtype) != (tuple(shape), dtype):
                raise ValueError(f"operand {name} read as {dtype}{list(shape)} and as {p.dtype}{list(p.shape)}")
        if not any(p.name == name for p in self.params):
            self.params.append(ir.Buffer(name, tuple(shape), dtype, "in"))
        dst = self._name("x")
        self.body.append(ir.Load(dst, name, tuple(index)))
        if dtype != "f32":
            return self.op("cast", dst, dtype="f32")
        return dst

    def const(self, value: float) -> str:
        dst = self._name("k")
        self.body.append(ir.Const(dst, value, "f32"))
        return dst

    def op(self, name: str, *args: str, dtype: str = "f32") -> str:
        dst = self._name("t")
        self.body.append(ir.Op(dst, name, tuple(args), dtype))
        return dst

    def store(self, name: str, value: str, dtype: str, pair: int | None = None):
        """Write `value` to output `name` at (m, n); in a pairwise epilogue, `pair` 0 or 1 writes a
        full-width output (as wide as the accumulator) at column 2n + pair instead: the two
        stores of an element then fill adjacent columns (a rotation of each pair, RoPE's)."""
        if pair is not None and not self.pairwise:
            raise ValueError("only a pairwise epilogue writes at column 2n + pair")
        if not any(p.name == name for p in self.params):
            self.params.append(ir.Buffer(name, self._shape(full=pair is not None), dtype, "out"))
        if dtype != "f32":
            value = self.op("cast", value, dtype=dtype)
        self.body.append(ir.Store(name, self._index("tile", pair), value))

    # ------------------------------------------------------------ partial row reductions

    def _partial(self, kind: str, outs: tuple[str, ...], value: str, width: int, target: str | None = None):
        if self.pairwise:
            raise ValueError("partial row reductions run on full-width epilogues, not pairwise ones")
        if width < 1 or (self.width is not None and width != self.width):
            raise ValueError(f"partials of one epilogue share one column group width; have {self.width}, "
                             f"asked for {width}")
        self.width = width
        lead = (self.batch,) if self.batch > 1 else ()
        for o in outs:
            if any(p.name == o for p in self.params):
                raise ValueError(f"output {o} is written twice")
            self.params.append(ir.Buffer(o, lead + (self.m, self.groups), "f32", "out"))
        self.partials.append((kind, outs, value, target))

    @property
    def groups(self) -> int:
        """T: column groups per row (the last one short when W does not divide N)."""
        return -(-self.out_n // self.width)

    def partial_sum(self, name: str, value: str, width: int = PARTIAL_WIDTH):
        """name[m, t] = sum of `value` over the columns n of group t (t * W <= n < (t + 1) * W, n < N)."""
        self._partial("sum", (name,), value, width)

    def partial_max(self, name: str, value: str, width: int = PARTIAL_WIDTH):
        """name[m, t] = max of `value` over the columns of group t."""
        self._partial("max", (name,), value, width)

    def partial_lse(self, max_name: str, sum_name: str, value: str, width: int = PARTIAL_WIDTH):
        """max_name[m, t] = the group's max of y = `value`, sum_name[m, t] = sum of exp(y - max)
        over the group; a group of -inf gives (-inf, 0), not NaN (the shift is 0 there), as the
        map-reduce family's online log-sum-exp does. The row's log-sum-exp is then
        M + log(sum_t exp(max_t - M) * sum_t), M = max_t max_t."""
        self._partial("lse", (max_name, sum_name), value, width)

    def partial_select(self, name: str, value: str, target: str, width: int = PARTIAL_WIDTH):
        """name[m, t] = `value` at column target[m] if that column is in group t, else 0: summed
        over t, the target logit of a cross-entropy (0 for a target in no group, ignore_index's).
        `target` is a row operand of int64 class indices ([M], or [B, M] when batched)."""
        lead = (self.batch,) if self.batch > 1 else ()
        for p in self.params:
            if p.name == target and (p.shape, p.dtype) != (lead + (self.m,), "i64"):
                raise ValueError(f"target {target} must be i64{list(lead + (self.m,))}")
        if not any(p.name == target for p in self.params):
            self.params.append(ir.Buffer(target, lead + (self.m,), "i64", "in"))
        self._partial("select", (name,), value, width, target)

    def _partials_loop(self) -> ir.Loop:
        """The t loop: per partial, Reduces over c whose bodies copy the element statements
        `value` needs (see the module docstring), then the stores at [(b,) m, t]."""
        w, n_total = self.width, self.out_n
        col = ir.IBin("+", ir.IBin("*", ir.Var("t"), ir.IConst(w)), ir.Var("c"))
        tail = n_total % w != 0
        read_col = ir.IBin("%", col, ir.IConst(n_total)) if tail else col
        defs = {s.dst: s for s in self.body if not isinstance(s, ir.Store)}
        lead = (ir.Var("b"),) if self.batch > 1 else ()
        out_index = lead + (ir.Var("m"), ir.Var("t"))
        row: list = []
        stores: list = []
        copies = 0

        def chain(value: str) -> tuple[list, str]:
            """The statements computing `value`, renamed apart and read at the group's column."""
            nonlocal copies
            copies += 1
            sfx = f"_p{copies}"
            need, stack = set(), [value]
            while stack:
                v = stack.pop()
                if v in need or v not in defs:
                    continue
                need.add(v)
                s = defs[v]
                if isinstance(s, ir.Op):
                    stack.extend(s.args)
                else:
                    for e in getattr(s, "index", ()) or ((s.expr,) if isinstance(s, ir.IndexValue) else ()):
                        stack.extend(ir.index_values(e))
            out = []
            for s in self.body:
                if isinstance(s, ir.Store) or s.dst not in need:
                    continue
                if isinstance(s, ir.Load):
                    s = ir.Load(s.dst + sfx, s.buf, tuple(_subst_n(e, read_col, sfx) for e in s.index))
                elif isinstance(s, ir.IndexValue):
                    s = ir.IndexValue(s.dst + sfx, _subst_n(s.expr, col, sfx), s.dtype)
                elif isinstance(s, ir.Op):
                    s = ir.Op(s.dst + sfx, s.op, tuple(a + sfx if a in need else a for a in s.args), s.dtype)
                else:
                    s = ir.Const(s.dst + sfx, s.value, s.dtype)
                out.append(s)
            return out, (value + sfx if value in need else value), sfx

        def masked(body: list, v: str, identity: float, sfx: str) -> str:
            """`v` where the column is inside the row (< N), else the reduction's identity."""
            if not tail:
                return v
            body += [ir.IndexValue("col" + sfx, col, "i32"), ir.Const("ncols" + sfx, n_total, "i32"),
                     ir.Op("inside" + sfx, "lt", ("col" + sfx, "ncols" + sfx), "bool"),
                     ir.Const("id" + sfx, identity, "f32"),
                     ir.Op("m" + sfx, "where", ("inside" + sfx, v, "id" + sfx), "f32")]
            return "m" + sfx

        def reduce(dst: str, op: str, body: list, v: str) -> ir.Reduce:
            return ir.Reduce(dst, op, "c", w, tuple(body), v, "f32")

        targets: dict[str, str] = {}
        for i, (kind, outs, value, target) in enumerate(self.partials):
            if kind in ("sum", "max"):
                body, v, sfx = chain(value)
                v = masked(body, v, 0.0 if kind == "sum" else float("-inf"), sfx)
                row.append(reduce(f"r{i}", kind, body, v))
                stores.append(ir.Store(outs[0], out_index, f"r{i}"))
            elif kind == "lse":
                body, v, sfx = chain(value)
                v = masked(body, v, float("-inf"), sfx)
                mx = f"r{i}_max"
                row.append(reduce(mx, "max", body, v))
                # the shift: the group's max, or 0 for a group of -inf (whose terms are then 0)
                row += [ir.Const(f"r{i}_ninf", float("-inf"), "f32"),
                        ir.Op(f"r{i}_empty", "eq", (mx, f"r{i}_ninf"), "bool"),
                        ir.Const(f"r{i}_zero", 0.0, "f32"),
                        ir.Op(f"r{i}_shift", "where", (f"r{i}_empty", f"r{i}_zero", mx), "f32")]
                body, y, sfx = chain(value)
                body += [ir.Op("d" + sfx, "sub", (y, f"r{i}_shift"), "f32"), ir.Op("e" + sfx, "exp", ("d" + sfx,), "f32")]
                v = masked(body, "e" + sfx, 0.0, sfx)
                row.append(reduce(f"r{i}_sum", "sum", body, v))
                stores += [ir.Store(outs[0], out_index, mx), ir.Store(outs[1], out_index, f"r{i}_sum")]
            elif kind == "select":
                if target not in targets:
                    # a target past the row (the last group's columns past N are read wrapped)
                    # becomes -1, which no column is: the row statement spares a mask per element
                    tg = targets[target] = f"target{len(targets)}"
                    row[:0] = [ir.Load(tg + "_in", target, lead + (ir.Var("m"),)),
                               ir.Const(tg + "_n", n_total, "i64"),
                               ir.Op(tg + "_ok", "lt", (tg + "_in", tg + "_n"), "bool"),
                               ir.Const(tg + "_none", -1, "i64"),
                               ir.Op(tg, "where", (tg + "_ok", tg + "_in", tg + "_none"), "i64")]
                body, y, sfx = chain(value)
                body += [ir.IndexValue("tcol" + sfx, col, "i64"),
                         ir.Op("hit" + sfx, "eq", ("tcol" + sfx, targets[target]), "bool"),
                         ir.Const("zero" + sfx, 0.0, "f32"),
                         ir.Op("s" + sfx, "where", ("hit" + sfx, y, "zero" + sfx), "f32")]
                row.append(reduce(f"r{i}", "sum", body, "s" + sfx))
                stores.append(ir.Store(outs[0], out_index, f"r{i}"))
            else:
                raise ValueError(f"unknown partial {kind!r}; known: {', '.join(PARTIAL_KINDS)}")
        return ir.Loop("t", self.groups, tuple(row + stores), parallel=True)

    def kernel(self, name: str = "epilogue") -> ir.Kernel:
        inner = ir.Loop("n", self.out_n, tuple(self.body), parallel=True)
        if self.partials:
            # the element loop only where something is stored per element
            element = (inner,) if any(isinstance(s, ir.Store) for s in self.body) else ()
            loop = ir.Loop("m", self.m, element + (self._partials_loop(),), parallel=True)
        else:
            loop = ir.Loop("m", self.m, (inner,), parallel=True)
        if self.batch > 1:
            loop = ir.Loop("b", self.batch, (loop,), parallel=True)
        return ir.Kernel(name, tuple(self.params), (loop,), family="epilogue")


def _subst_n(e, col, sfx: str):
    """Index expression `e` with the column `col` in place of the variable n (and the copy's
    SSA names, `sfx`, for gathered values)."""
    if isinstance(e, ir.Var) and e.name == "n":
        return col
    if isinstance(e, ir.Val):
        return ir.Val(e.name + sfx)
    if isinstance(e, ir.IBin):
        return ir.IBin(e.op, _subst_n(e.a, col, sfx), _subst_n(e.b, col, sfx))
    return e


ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid")


def _activate(e: EpilogueBuilder, x: str, act: str) -> str:
    if act == "none":
        return x
    if act in ("relu", "sigmoid"):
        return e.op(act, x)
    if act == "silu":
        return e.op("mul", x, e.op("sigmoid", x))
    if act == "gelu":  # x Phi(x) = x * 0.5 * (1 + erf(x / sqrt 2))
        return e.op("mul", x, e.op("ncdf", x))
    if act == "gelu_tanh":  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        c = 2 * math.sqrt(2 / math.pi)
        t = e.op("add", e.op("mul", e.op("mul", x, x), e.const(c * 0.044715)), e.const(c))
        return e.op("mul", x, e.op("sigmoid", e.op("mul", x, t)))
    raise ValueError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")


def standard(m: int, n: int, out_dtype: str, *, batch: int = 1, alpha: float | None = None,
             bias: str | None = None, row_scale: bool = False, activation: str = "none",
             residual: bool = False, operand_dtype: str | None = None) -> ir.Kernel:
    """out = act(alpha * acc * row_scale[m] + bias[n]) + residual[m, n], cast to out_dtype.

    bias: None, "col" (per output column, nn.Linear's) or "row". Operands are read in
    `operand_dtype` (default: out_dtype).
    """
    od = operand_dtype or out_dtype
    e = EpilogueBuilder(m, n, batch)
    x = e.acc()
    if alpha is not None:
        x = e.op("mul", x, e.const(float(alpha)))
    if row_scale:
        x = e.op("mul", x, e.load("row_scale", "row", "f32"))
    if bias is not None:
        if bias not in ("row", "col"):
            raise ValueError(f"bias must be 'row' or 'col', not {bias!r}")
        x = e.op("add", x, e.load("bias", bias, od))
    x = _activate(e, x, activation)
    if residual:
        x = e.op("add", x, e.load("residual", "tile", od))
    e.store("out", x, out_dtype)
    return e.kernel()


def glu(m: int, n: int, out_dtype: str, *, activation: str = "silu", batch: int = 1) -> ir.Kernel:
    """SwiGLU / GeGLU on interleaved gate/up columns: out[m, j] = act(acc[m, 2j]) * acc[m, 2j+1].

    The weight's rows are interleaved once at compile time (gate row j at 2j, up row j at
    2j + 1), so each output element's two inputs sit in one thread's adjacent registers.
    """
    e = EpilogueBuilder(m, n, batch, pairwise=True)
    gate, up = e.acc(0), e.acc(1)
    e.store("out", e.op("mul", _activate(e, gate, activation), up), out_dtype)
    return e.kernel("glu_epilogue")


def rope(m: int, n: int, out_dtype: str, *, batch: int = 1, table_dtype: str = "f32",
         table: tuple[int, int] | None = None) -> ir.Kernel:
    """RoPE on adjacent column pairs of the product: for output columns (2j, 2j + 1),

        out[m, 2j]     = acc[m, 2j] * cos[m, j] - acc[m, 2j + 1] * sin[m, j]
        out[m, 2j + 1] = acc[m, 2j] * sin[m, j] + acc[m, 2j + 1] * cos[m, j]

    with the angle tables `cos`, `sin` given per row (a token's position) and pair. The rows of a
    Q or K projection's weight are ordered so each rotated pair is adjacent (Llama's form; the
    half-split form of transformers is the same after a permutation of each head's rows).
    With `table` = (S, W) the tables are [S, W], read at [m % S, j % W]: a model's, shared by
    the sequences of a batch (S positions) and by the heads (W frequencies each)."""
    e = EpilogueBuilder(m, n, batch, pairwise=True)
    x0, x1 = e.acc(0), e.acc(1)
    if table is None:
        c, s_ = e.load("cos", "tile", table_dtype), e.load("sin", "tile", table_dtype)
    else:
        at = (ir.IBin("%", ir.Var("m"), ir.IConst(table[0])), ir.IBin("%", ir.Var("n"), ir.IConst(table[1])))
        c, s_ = (e.load_at(name, table, table_dtype, at) for name in ("cos", "sin"))
    e.store("out", e.op("sub", e.op("mul", x0, c), e.op("mul", x1, s_)), out_dtype, pair=0)
    e.store("out", e.op("add", e.op("mul", x0, s_), e.op("mul", x1, c)), out_dtype, pair=1)
    return e.kernel("rope_epilogue")


def _row_body(kernel: ir.Kernel) -> tuple[list, tuple]:
    """(loop variables around it, the body of the m loop): an epilogue's outer loops, b and m."""
    body, vars_seen = kernel.body, []
    while len(body) == 1 and isinstance(body[0], ir.Loop) and body[0].var not in ("n", "t"):
        vars_seen.append(body[0].var)
        body = body[0].body
    return vars_seen, body


def _element_and_partials(kernel: ir.Kernel) -> tuple[ir.Loop | None, ir.Loop | None]:
    vars_seen, body = _row_body(kernel)
    loops = [s for s in body if isinstance(s, ir.Loop)]
    shape_ok = (kernel.family == "epilogue" and vars_seen[-1:] == ["m"] and len(loops) == len(body)
                and [x.var for x in loops] in (["n"], ["t"], ["n", "t"]))
    if not shape_ok:
        raise ValueError(f"kernel {kernel.name}: not an epilogue (want loops ..., m around an n loop "
                         f"and/or a t loop of partial row reductions)")
    element = next((x for x in loops if x.var == "n"), None)
    partials = next((x for x in loops if x.var == "t"), None)
    return element, partials


def is_pairwise(kernel: ir.Kernel) -> bool:
    """Its n loop runs over half the accumulator's columns."""
    acc = kernel.buffer(ACC)
    element, _ = _element_and_partials(kernel)
    return element is not None and element.extent * 2 == acc.shape[-1]


def inner_body(kernel: ir.Kernel) -> tuple:
    """The per-element statements of an epilogue kernel (inside its m and n loops); () for
    one that only writes partial row reductions."""
    element, _ = _element_and_partials(kernel)
    body = element.body if element is not None else ()
    for s in ir.walk(body):
        if isinstance(s, (ir.Loop, ir.Reduce)):
            raise ValueError(f"epilogue {kernel.name}: nested loops and reductions are not supported yet")
    return body


def partials_loop(kernel: ir.Kernel) -> ir.Loop | None:
    """The t loop of an epilogue's partial row reductions (see the module docstring), or None."""
    return _element_and_partials(kernel)[1]


def partial_width(kernel: ir.Kernel) -> int | None:
    """W, the columns each partial reduces (its Reduces' extent), or None without partials."""
    loop = partials_loop(kernel)
    if loop is None:
        return None
    widths = {s.extent for s in loop.body if isinstance(s, ir.Reduce)}
    if len(widths) != 1:
        raise ValueError(f"epilogue {kernel.name}: partial reductions over {sorted(widths)} columns; want one width")
    return widths.pop()


def partial_outputs(kernel: ir.Kernel) -> tuple[ir.Buffer, ...]:
    """The outputs the partials loop stores ([(B,) M, T] each)."""
    loop = partials_loop(kernel)
    names = {s.buf for s in (loop.body if loop else ()) if isinstance(s, ir.Store)}
    return tuple(b for b in kernel.outputs if b.name in names)


def tile_outputs(kernel: ir.Kernel) -> tuple[ir.Buffer, ...]:
    """The outputs the element loop stores (the tile's), without the partials'."""
    part = {b.name for b in partial_outputs(kernel)}
    return tuple(b for b in kernel.outputs if b.name not in part)


def operands(kernel: ir.Kernel) -> tuple[ir.Buffer, ...]:
    """Buffers the epilogue reads besides the accumulator, in parameter order."""
    return tuple(b for b in kernel.inputs if b.name != ACC)


def row_dims(kernel: ir.Kernel) -> dict[str, tuple[int, ...]]:
    """For each buffer of an epilogue: the dimensions indexed by the row variable m."""
    out: dict[str, set] = {b.name: set() for b in kernel.params}
    for s in ir.walk(kernel.body):  # partial row reductions read inside their Reduce bodies too
        if isinstance(s, (ir.Load, ir.Store)):
            buf = s.buf
            for d, e in enumerate(s.index):
                if e == ir.Var("m"):
                    out[buf].add(d)
    return {n: tuple(sorted(d)) for n, d in out.items()}

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
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..loop import ir

ACC = "acc"


@dataclass
class EpilogueBuilder:
    """Builds an epilogue kernel statement by statement (SSA names are made up here)."""

    m: int
    n: int
    batch: int = 1
    pairwise: bool = False      # outputs are n // 2 wide, each from columns (2j, 2j + 1)
    params: list = field(default_factory=list)
    body: list = field(default_factory=list)
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

    def kernel(self, name: str = "epilogue") -> ir.Kernel:
        inner = ir.Loop("n", self.out_n, tuple(self.body), parallel=True)
        loop = ir.Loop("m", self.m, (inner,), parallel=True)
        if self.batch > 1:
            loop = ir.Loop("b", self.batch, (loop,), parallel=True)
        return ir.Kernel(name, tuple(self.params), (loop,), family="epilogue")


ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid")


def _activate(e: EpilogueBuilder, x: str, act: str) -> str:
    if act == "none":
        return x
    if act in ("relu", "sigmoid"):
        return e.op(act, x)
    if act == "silu":
        return e.op("mul", x, e.op("sigmoid", x))
    if act == "gelu":  # x * 0.5 * (1 + erf(x / sqrt 2))
        t = e.op("erf", e.op("mul", x, e.const(0.7071067811865476)))
        return e.op("mul", e.op("mul", x, e.const(0.5)), e.op("add", t, e.const(1.0)))
    if act == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        x3 = e.op("mul", e.op("mul", x, x), x)
        inner = e.op("mul", e.op("add", x, e.op("mul", x3, e.const(0.044715))), e.const(0.7978845608028654))
        return e.op("mul", e.op("mul", x, e.const(0.5)), e.op("add", e.op("tanh", inner), e.const(1.0)))
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


def rope(m: int, n: int, out_dtype: str, *, batch: int = 1, table_dtype: str = "f32") -> ir.Kernel:
    """RoPE on adjacent column pairs of the product: for output columns (2j, 2j + 1),

        out[m, 2j]     = acc[m, 2j] * cos[m, j] - acc[m, 2j + 1] * sin[m, j]
        out[m, 2j + 1] = acc[m, 2j] * sin[m, j] + acc[m, 2j + 1] * cos[m, j]

    with the angle tables `cos`, `sin` given per row (a token's position) and pair. The rows of a
    Q or K projection's weight are ordered so each rotated pair is adjacent (Llama's form; the
    half-split form of transformers is the same after a permutation of each head's rows)."""
    e = EpilogueBuilder(m, n, batch, pairwise=True)
    x0, x1 = e.acc(0), e.acc(1)
    c, s_ = e.load("cos", "tile", table_dtype), e.load("sin", "tile", table_dtype)
    e.store("out", e.op("sub", e.op("mul", x0, c), e.op("mul", x1, s_)), out_dtype, pair=0)
    e.store("out", e.op("add", e.op("mul", x0, s_), e.op("mul", x1, c)), out_dtype, pair=1)
    return e.kernel("rope_epilogue")


def is_pairwise(kernel: ir.Kernel) -> bool:
    """Its n loop runs over half the accumulator's columns."""
    acc = kernel.buffer(ACC)
    body = kernel.body
    while len(body) == 1 and isinstance(body[0], ir.Loop) and body[0].var != "n":
        body = body[0].body
    return bool(body) and isinstance(body[0], ir.Loop) and body[0].extent * 2 == acc.shape[-1]


def inner_body(kernel: ir.Kernel) -> tuple:
    """The per-element statements of an epilogue kernel (inside its m and n loops)."""
    body = kernel.body
    vars_seen = []
    while len(body) == 1 and isinstance(body[0], ir.Loop):
        vars_seen.append(body[0].var)
        body = body[0].body
    if kernel.family != "epilogue" or vars_seen[-2:] != ["m", "n"]:
        raise ValueError(f"kernel {kernel.name}: not an epilogue (want loops ..., m, n around the body)")
    for s in ir.walk(body):
        if isinstance(s, (ir.Loop, ir.Reduce)):
            raise ValueError(f"epilogue {kernel.name}: nested loops and reductions are not supported yet")
    return body


def operands(kernel: ir.Kernel) -> tuple[ir.Buffer, ...]:
    """Buffers the epilogue reads besides the accumulator, in parameter order."""
    return tuple(b for b in kernel.inputs if b.name != ACC)

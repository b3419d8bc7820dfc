"""A small helper that appends Graph IR nodes with fresh names and broadcasting shapes."""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes, ops
from ..graph import ir


def broadcast_shapes(*shapes):
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"shapes {' and '.join(map(str, shapes))} do not broadcast") from None


def promote(*dts: str) -> str:
    """Result dtype of mixing these dtypes, PyTorch-style for the types tilefuse knows."""
    floats = [d for d in dts if dtypes.is_float(d)]
    if floats:
        order = ["bf16", "f16", "f32", "f64"]
        top = max(floats, key=order.index)
        if set(floats) == {"bf16", "f16"}:
            return "f32"
        return top
    if any(d in dtypes.INTS for d in dts):
        order = ["u8", "i8", "i32", "i64"]
        return max((d for d in dts if d in dtypes.INTS), key=order.index)
    return "bool"


def wrap_dim(d: int, rank: int) -> int:
    """A dim in [-rank, rank) (a scalar's: [-1, 0]) as an index from 0; ValueError beyond, as PyTorch."""
    n = max(rank, 1)
    if not -n <= d < n:
        raise ValueError(f"dim {d} is out of range for a {rank}-d tensor (expected [{-n}, {n - 1}])")
    return d % n


# ops whose CUDA kernels round a Python number to the 16-bit tensor's dtype (measured with
# torch 2.11 on an H100: `f16(0.1) == 0.1` is True, `clamp(bf16, max=257.)` gives 256,
# `f16(2) ** 8.01` is 2 ** f16(8.01))
_ROUNDS_SCALAR = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "max", "min", "where", "pow"})


def check_fits(x, dtype: str):
    """PyTorch's overflow check for a number converted to `dtype` (c10::overflows): an unsigned
    type takes negatives down to -max (they wrap), a float type any value within its finite
    range or an infinity or NaN."""
    if dtypes.is_float(dtype):
        top = float(np.finfo(dtypes.to_numpy(dtype)).max) if dtype != "bf16" else 3.3895313892515355e38
        bad = math.isfinite(x) and abs(x) > top
    else:
        info = np.iinfo(dtypes.to_numpy(dtype))
        lo = -int(info.max) if info.min == 0 else int(info.min)
        bad = not math.isfinite(x) or not lo <= int(x) <= int(info.max)
    if bad:
        raise ValueError(f"value {x} cannot be converted to {dtype} without overflow (PyTorch refuses it too)")


class Builder:
    def __init__(self):
        self.nodes: list = []
        self.names: set[str] = set()
        self.next_suffix: dict[str, int] = {}
        self.types: dict[str, ir.TensorType] = {}
        self.source = ""

    def fresh(self, base: str) -> str:
        return ir.fresh_name(base.replace(".", "_"), self.names, self.next_suffix)

    def add(self, node):
        self.nodes.append(node)
        self.names.add(node.name)
        self.types[node.name] = node.type
        return node.name

    def type(self, name: str) -> ir.TensorType:
        return self.types[name]

    # -- node makers; each returns the new tensor's name --------------------------------
    def const(self, value, dtype: str, base="c", weak: bool = False) -> str:
        """A scalar tensor of `dtype`: a bf16/f16 value is rounded to that dtype, as the tensor
        holds it, unless `weak` (a Python number PyTorch keeps in f32 beside a 16-bit tensor;
        see `scalar`)."""
        if dtype in ("bf16", "f16") and not weak and not isinstance(value, bool):
            with np.errstate(over="ignore"):  # beyond the range (inf): the handlers check what PyTorch checks
                value = float(np.asarray(float(value), dtype=np.float64).astype(dtypes.to_numpy(dtype)))
        elif dtype in dtypes.INTS and isinstance(value, int) and not isinstance(value, bool):
            info = np.iinfo(dtypes.to_numpy(dtype))  # wrapped as the tensor holds it: -2 as u8 is 254
            value = (value - int(info.min)) % (int(info.max) - int(info.min) + 1) + int(info.min)
        return self.add(ir.Constant(self.fresh(base), ir.TensorType((), dtype), value, self.source))

    def result_type(self, *names: str) -> str:
        """PyTorch's result dtype of tensors `names` (torch.result_type): a 0-d tensor (a Python
        number made a Constant is one) raises it only from a higher category (bool < integer <
        float) than every tensor with dimensions: `u8 > torch.tensor(300)` compares in u8."""
        types = [self.type(n) for n in names]
        dims, zeros = [t.dtype for t in types if t.shape], [t.dtype for t in types if not t.shape]
        if not dims or not zeros:
            return promote(*(dims or zeros))
        hi, lo = promote(*dims), promote(*zeros)
        if dtypes.is_float(hi):
            return hi
        return promote(hi, lo) if hi == "bool" or dtypes.is_float(lo) else hi

    def _to_common(self, args, common: str) -> list:
        """Operands converted to the op's common dtype where the kernel's own widening would
        not give PyTorch's value: a wider 0-d operand (narrowed, wrapping or rounding), and an
        integer or bool one beside a bf16/f16 result (rounded to it first: 257 -> 256)."""
        out = []
        for a in args:
            t = self.type(a).dtype
            if t != common and (promote(t, common) != common or (common in ("bf16", "f16") and not dtypes.is_float(t))):
                a = self.cast(a, common)
            out.append(a)
        return out

    def map(self, op: str, *args: str, dtype: str | None = None, base=None) -> str:
        kind = ops.info(op).kind
        if op != "cast" and kind != "logic":
            head, operands = (args[:1], args[1:]) if op == "where" else ((), args)
            common = self.result_type(*operands)
            if kind == "float" and not dtypes.is_float(common) and common != "bool":
                # integers into a float op (true division, atan2): each goes straight to the
                # float, as PyTorch computes it; through their common integer type a 0-dim i64
                # beside an i32 tensor wrapped first (i32 / i64(-2462023543) divided by 1832943753;
                # atan2 of a u8 tensor's i64 product beside it took the product mod 256)
                common = dtype if dtype is not None and dtypes.is_float(dtype) else "f32"
            args = (*head, *self._to_common(operands, common))
        types = [self.type(a) for a in args]
        shape = broadcast_shapes(*(t.shape for t in types))
        if kind in ("cmp", "logic"):
            out = "bool"
        elif dtype is not None:
            out = dtype
        else:
            out = common
            if kind == "float" and not dtypes.is_float(out):
                out = "f32"
        return self.add(ir.Map(self.fresh(base or op), ir.TensorType(shape, out), op, tuple(args), self.source))

    def cast(self, x: str, dtype: str) -> str:
        if self.type(x).dtype == dtype:
            return x
        return self.map("cast", x, dtype=dtype, base="cast")

    def scalar(self, x, like: str, op: str | None = None) -> str:
        """A Python number as a Constant, typed as PyTorch types a weak scalar next to tensor
        `like`: a float next to an integer or bool tensor, or any number in a float op (`op`:
        div, pow) on one, is f32 (the default dtype); an int next to a bool tensor is i64;
        otherwise the tensor's dtype, an int out of an integer dtype's range wrapped into it as
        PyTorch wraps it (`u8 + 300` adds 44, `u8 == -1` is `u8 == 255`).

        Beside a bf16/f16 tensor the number keeps its value (a weak Constant) where PyTorch's CUDA
        kernels compute with it in f32: arithmetic, and the constants of a decomposition (`op`
        None): `f16 * 1e5` is 100.06 at 1e-3, not inf. It is rounded to the tensor's dtype where
        they round it: comparisons, clamp, where, pow's exponent.

        Where PyTorch's CUDA kernels refuse a number the tensor's dtype cannot hold (an integer
        tensor's clamp bounds, add's `alpha` (op "alpha") and `where`; a bf16/f16 tensor's
        `where` and pow exponent), a ValueError says so. (Its CPU kernels also refuse 16-bit
        clamp bounds and alpha, which its CUDA kernels take in f32.)"""
        t = self.type(like).dtype
        if isinstance(x, bool):
            return self.const(x, "bool")
        if dtypes.is_float(t):
            checked = ("where", "pow")  # CUDA takes clamp bounds and alpha in f32
        else:
            checked = ("max", "min", "alpha", "where") if t != "bool" and not isinstance(x, float) else ()
        if op in checked:
            check_fits(x, t)
        if dtypes.is_float(t):
            return self.const(x, t, weak=op not in _ROUNDS_SCALAR)
        if isinstance(x, float) or (op not in (None, "alpha") and ops.info(op).kind == "float"):
            return self.const(x, "f32")
        if t == "bool":
            return self.const(x, "i64")
        bits = 8 * dtypes.itemsize(t)
        lo = 0 if t == "u8" else -(1 << (bits - 1))
        return self.const((int(x) - lo) % (1 << bits) + lo, t)

    def reduce(self, op: str, x: str, axes, keepdim: bool, dtype: str | None = None) -> str:
        t = self.type(x)
        rank = len(t.shape)
        axes = tuple(sorted({wrap_dim(a, rank) for a in axes})) if rank else ()
        if not axes and rank:
            axes = tuple(range(rank))
        shape = tuple(1 if i in axes else s for i, s in enumerate(t.shape)) if keepdim else tuple(
            s for i, s in enumerate(t.shape) if i not in axes)
        out = dtype or t.dtype
        return self.add(ir.Reduce(self.fresh(op), ir.TensorType(shape, out), op, x, axes, keepdim, self.source))

    def view(self, op: str, x: str, shape, params=()) -> str:
        t = self.type(x)
        return self.add(ir.View(self.fresh(op), ir.TensorType(tuple(shape), t.dtype), op, x, tuple(params), self.source))

    def reshape(self, x: str, shape) -> str:
        shape = tuple(int(s) for s in shape)
        if self.type(x).shape == shape:
            return x
        return self.view("reshape", x, shape, shape)

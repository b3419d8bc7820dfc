"""Scalar operations shared by the Graph IR (Map nodes) and the Loop IR (Op statements).

Each op has one NumPy meaning here; the interpreters evaluate it, and the CUDA printer
has one C++ spelling for it (tilefuse.codegen.cexpr). An op name that is not in this
table is an error everywhere, never a guess.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


def _erf(x):
    from math import erf

    return np.vectorize(erf, otypes=[np.float64])(x).astype(np.result_type(x, np.float32))


def _ncdf(x):
    """Phi(x), the standard normal CDF, as 0.5 erfc(-x / sqrt 2): GELU is x Phi(x). One op
    rather than 0.5 (1 + erf(x / sqrt 2)), whose 1 + erf cancels to nothing for x < -5.5, and
    which a kernel with 16-bit outputs computes as one polynomial and one ex2 (cexpr)."""
    from math import erfc, sqrt

    return np.vectorize(lambda v: 0.5 * erfc(-v / sqrt(2)), otypes=[np.float64])(x).astype(
        np.result_type(x, np.float32))


def _erfc(x):
    from math import erfc

    return np.vectorize(erfc, otypes=[np.float64])(x).astype(np.result_type(x, np.float32))


def _lgamma(x):
    """log |Gamma(x)|: inf at the poles (0, -1, -2, ...), as C's lgamma and PyTorch's."""
    from math import inf, lgamma

    def one(v):
        try:
            return lgamma(v)
        except ValueError:  # (a pole)
            return inf
    return np.vectorize(one, otypes=[np.float64])(x).astype(np.result_type(x, np.float32))


def _by_zero(b):
    """An integer divided by zero raises here, as PyTorch's CPU kernels raise (a kernel's result
    is unspecified there: PyTorch's GPU kernels give -1 for a // 0)."""
    if np.any(np.asarray(b) == 0):
        raise RuntimeError("ZeroDivisionError: an integer divided by zero")


def _floordiv(a, b):
    """Python's and PyTorch's integer a // b, rounded towards minus infinity."""
    _by_zero(b)
    return np.floor_divide(a, b)


def _mod(a, b):
    """Python's and PyTorch's integer a % b, with the sign of b (C's % takes a's)."""
    _by_zero(b)
    return np.remainder(a, b)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _wide(fn):
    """fn evaluated in float64 and rounded once to its arguments' float type. NumPy's float32
    (and float16) transcendentals are its own SIMD approximations, some an ulp or more off
    (np.sin(float32(1)) is an ulp above sin 1 rounded, np.expm1(float32(17)) an ulp below),
    where PyTorch's CPU results are rounded correctly or nearly: a value then truncated to an
    integer, or the divisor of a large remainder, shows the ulp (fuzzing, session 47)."""
    def wide(*xs):
        dt = np.result_type(*xs)
        if dt.kind != "f" or dt.itemsize >= 8:
            return fn(*xs)
        return np.asarray(fn(*(np.asarray(x, np.float64) for x in xs))).astype(dt)
    wide.__name__ = getattr(fn, "__name__", "wide")
    return wide


@dataclass(frozen=True)
class OpInfo:
    name: str
    arity: int
    numpy: Callable
    kind: str  # "float": float in, float out; "cmp": -> bool; "logic": bool; "any": keeps type


def _table(*rows):
    return {r.name: r for r in rows}


OPS: dict[str, OpInfo] = _table(
    OpInfo("neg", 1, np.negative, "any"),
    OpInfo("abs", 1, np.abs, "any"),
    OpInfo("exp", 1, _wide(np.exp), "float"),
    OpInfo("exp2", 1, _wide(np.exp2), "float"),
    OpInfo("log", 1, _wide(np.log), "float"),
    OpInfo("log2", 1, _wide(np.log2), "float"),
    OpInfo("log1p", 1, _wide(np.log1p), "float"),
    OpInfo("expm1", 1, _wide(np.expm1), "float"),
    OpInfo("sqrt", 1, np.sqrt, "float"),
    OpInfo("rsqrt", 1, lambda x: 1.0 / np.sqrt(x), "float"),
    OpInfo("recip", 1, lambda x: 1.0 / x, "float"),
    OpInfo("tanh", 1, _wide(np.tanh), "float"),
    OpInfo("sin", 1, _wide(np.sin), "float"),
    OpInfo("cos", 1, _wide(np.cos), "float"),
    OpInfo("erf", 1, _erf, "float"),
    OpInfo("ncdf", 1, _ncdf, "float"),
    OpInfo("sigmoid", 1, _wide(_sigmoid), "float"),
    OpInfo("relu", 1, lambda x: np.maximum(x, 0), "any"),
    OpInfo("floor", 1, np.floor, "float"),
    OpInfo("ceil", 1, np.ceil, "float"),
    OpInfo("round", 1, np.rint, "float"),  # half to even, as torch.round
    OpInfo("log10", 1, _wide(np.log10), "float"),
    OpInfo("tan", 1, _wide(np.tan), "float"),
    OpInfo("atan", 1, _wide(np.arctan), "float"),
    OpInfo("asin", 1, _wide(np.arcsin), "float"),
    OpInfo("acos", 1, _wide(np.arccos), "float"),
    OpInfo("sinh", 1, _wide(np.sinh), "float"),
    OpInfo("cosh", 1, _wide(np.cosh), "float"),
    OpInfo("asinh", 1, _wide(np.arcsinh), "float"),
    OpInfo("acosh", 1, _wide(np.arccosh), "float"),
    OpInfo("atanh", 1, _wide(np.arctanh), "float"),
    OpInfo("erfc", 1, _erfc, "float"),
    OpInfo("lgamma", 1, _lgamma, "float"),
    OpInfo("not", 1, np.logical_not, "logic"),
    OpInfo("add", 2, np.add, "any"),
    OpInfo("sub", 2, np.subtract, "any"),
    OpInfo("mul", 2, np.multiply, "any"),
    OpInfo("div", 2, np.true_divide, "float"),
    OpInfo("max", 2, np.maximum, "any"),
    OpInfo("min", 2, np.minimum, "any"),
    OpInfo("pow", 2, _wide(np.power), "float"),
    OpInfo("atan2", 2, _wide(np.arctan2), "float"),
    OpInfo("hypot", 2, _wide(np.hypot), "float"),
    OpInfo("fmod", 2, np.fmod, "float"),  # the sign of the dividend, as C's fmod
    OpInfo("copysign", 2, np.copysign, "float"),
    OpInfo("floordiv", 2, _floordiv, "int"),  # integers only: a float floor division is maps of fmod and floor
    OpInfo("mod", 2, _mod, "int"),
    OpInfo("eq", 2, np.equal, "cmp"),
    OpInfo("ne", 2, np.not_equal, "cmp"),
    OpInfo("lt", 2, np.less, "cmp"),
    OpInfo("le", 2, np.less_equal, "cmp"),
    OpInfo("gt", 2, np.greater, "cmp"),
    OpInfo("ge", 2, np.greater_equal, "cmp"),
    OpInfo("and", 2, np.logical_and, "logic"),
    OpInfo("or", 2, np.logical_or, "logic"),
    OpInfo("where", 3, np.where, "any"),
    OpInfo("cast", 1, lambda x: x, "any"),  # the target dtype is the statement's dtype
)

# Scans (running ops along an axis): name -> the NumPy ufunc whose `accumulate` is it (maximum and
# minimum carry a NaN on, as torch.cummax does and the kernels' max.NaN).
SCANS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}

# Reductions: name -> (identity, NumPy reducer).
REDUCTIONS = {
    "sum": (0.0, np.sum),
    "max": (-np.inf, np.max),
    "min": (np.inf, np.min),
    "prod": (1.0, np.prod),
}


def info(name: str) -> OpInfo:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown scalar op {name!r}") from None


def result_dtype(op: str, arg_dtypes: tuple[str, ...], out: str | None = None) -> str:
    """dtype of op's result: bool for comparisons and logic, else the declared or first float type."""
    kind = info(op).kind
    if kind in ("cmp", "logic"):
        return "bool"
    if out is not None:
        return out
    return arg_dtypes[-1] if op == "where" else arg_dtypes[0]

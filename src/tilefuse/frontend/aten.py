"""aten op -> Graph IR: one small function per op family.

Composite ops (softmax, layer_norm, rms_norm, gelu, silu, var…) are decomposed here into
Maps and Reduces; that is the "decompose" rewrite, done once at translation. matmul-like
ops become Contraction nodes, SDPA an Attention node. An op not in `HANDLERS` becomes an
explicit Extern (shown in `--ir graph`), one per result used where it returns several
(ir.Extern.item).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .. import dtypes
from ..graph import ir
from .builder import Builder, broadcast_shapes, check_fits, wrap_dim

HANDLERS = {}


def handles(*names):
    def deco(fn):
        for n in names:
            HANDLERS[n] = fn
        return fn
    return deco


class Unsupported(Exception):
    """An op (or an argument of it) tilefuse cannot translate; becomes an Extern or an error."""


def _is_tensor(b: Builder, x) -> bool:
    return isinstance(x, str) and x in b.types


def _operand(b: Builder, x, like: str, op: str | None = None) -> str:
    return x if _is_tensor(b, x) else b.scalar(x, like, op)


def _binary(op):
    def handler(b: Builder, args, kwargs, out):
        x, y = args[0], args[1]
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)  # rsub.Scalar takes it by position
        like = x if _is_tensor(b, x) else y
        xs, ys = _operand(b, x, like, op), _operand(b, y, like, op)
        common = b.result_type(xs, ys)
        if alpha != 1 and common == "bool":  # PyTorch takes alpha as a bool there: -1 is True
            alpha = 1 if alpha else 0
        if alpha != 1:  # x + alpha y in the result's dtype, as PyTorch (not alpha y in y's: an i8 y wraps)
            ys = b.cast(ys, common)
            ys = b.map("mul", ys, b.scalar(alpha, ys, "alpha"))
        return b.map(op, xs, ys)
    return handler


for _aten, _op in [("add", "add"), ("sub", "sub"), ("mul", "mul"), ("div", "div"), ("maximum", "max"),
                   ("minimum", "min"), ("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"),
                   ("gt", "gt"), ("ge", "ge"), ("logical_and", "and"), ("logical_or", "or"),
                   ("pow", "pow")]:
    HANDLERS[_aten] = _binary(_op)


def _bool_logic(op):
    """& and | of bool tensors (attention masks) are logical and / or; of integers, bitwise
    ops tilefuse does not generate."""
    def handler(b, args, kwargs, out):
        if not all(_is_tensor(b, a) and b.types[a].dtype == "bool" for a in args[:2]):
            raise Unsupported("& / | of tensors that are not both bool")
        return b.map(op, args[0], args[1])
    return handler


for _aten, _op in [("__and__", "and"), ("bitwise_and", "and"), ("__or__", "or"), ("bitwise_or", "or")]:
    HANDLERS[_aten] = _bool_logic(_op)


@handles("rsub")
def _rsub(b, args, kwargs, out):
    return _binary("sub")(b, (args[1], args[0], *args[2:]), kwargs, out)


@handles("div")
def _div(b, args, kwargs, out):
    mode = kwargs.get("rounding_mode")
    if mode == "floor":
        return _floor_divide(b, args[:2], {}, out)
    if mode == "trunc":
        return _trunc_divide(b, args[:2], out)
    if mode is not None:
        raise Unsupported(f"div with rounding_mode={mode!r}")
    return _binary("div")(b, args, {}, out)


def _int_operands(b, args, op):
    x, y = args[0], args[1]
    like = x if _is_tensor(b, x) else y
    return _operand(b, x, like, op), _operand(b, y, like, op)


def _float_operands(b, args, out):
    """A float division's operands in the result's dtype, then in the type it computes in (f32
    for 16-bit floats)."""
    like = args[0] if _is_tensor(b, args[0]) else args[1]
    acc = _acc_of(out.dtype)
    return tuple(b.cast(b.cast(_operand(b, v, like, "div"), out.dtype), acc) for v in args[:2])


@handles("floor_divide")
def _floor_divide(b, args, kwargs, out):
    """a // b: of integers one op (rounded down; by zero unspecified, where PyTorch's CPU
    raises); of floats PyTorch's steps in maps: (a - fmod(a, b)) / b, one less where the
    remainder's sign is not b's, floored and rounded up past .5 (the division's error), a
    signed 0 for 0, and a / b for b = 0 (inf or NaN), computed in f32 for 16-bit floats."""
    if not dtypes.is_float(out.dtype):
        if out.dtype == "bool":
            raise Unsupported("floor division of bools")
        x, y = _int_operands(b, args, "floordiv")
        return b.map("floordiv", b.cast(x, out.dtype), b.cast(y, out.dtype), dtype=out.dtype)
    acc = _acc_of(out.dtype)
    x, y = _float_operands(b, args, out)
    zero = b.const(0.0, acc)
    mod = b.map("fmod", x, y)
    div = b.map("div", b.map("sub", x, mod), y)
    off = b.map("and", b.map("ne", mod, zero), b.map("ne", b.map("lt", y, zero), b.map("lt", mod, zero)))
    div = b.map("where", off, b.map("sub", div, b.const(1.0, acc)), div)
    fl = b.map("floor", div)
    fl = b.map("where", b.map("gt", b.map("sub", div, fl), b.const(0.5, acc)), b.map("add", fl, b.const(1.0, acc)), fl)
    quotient = b.map("div", x, y)
    fl = b.map("where", b.map("ne", div, zero), fl, b.map("copysign", zero, quotient))
    return b.cast(b.map("where", b.map("eq", y, zero), quotient, fl), out.dtype)


def _trunc_divide(b, args, out):
    """a / b rounded towards 0: of floats trunc(a / b) (in f32 for 16-bit ones), of integers
    the floor division plus one where it rounded a negative quotient down."""
    if dtypes.is_float(out.dtype):
        x, y = _float_operands(b, args, out)
        return b.cast(_trunc(b, [b.map("div", x, y)], {}, out), out.dtype)
    if out.dtype == "bool":
        raise Unsupported("division of bools")
    x, y = (b.cast(v, out.dtype) for v in _int_operands(b, args, "floordiv"))
    q = b.map("floordiv", x, y, dtype=out.dtype)
    r = b.map("mod", x, y, dtype=out.dtype)
    zero = b.scalar(0, r)
    up = b.map("and", b.map("ne", r, zero), b.map("ne", b.map("lt", x, zero), b.map("lt", y, zero)))
    return b.map("where", up, b.map("add", q, b.scalar(1, q), dtype=out.dtype), q, dtype=out.dtype)


@handles("pow")
def _pow(b, args, kwargs, out):
    x, e = args
    # the shortcuts keep x's dtype: an integer x ** 2.0 is a float in PyTorch, not an integer square
    if _is_tensor(b, x) and not _is_tensor(b, e) and (dtypes.is_float(b.type(x).dtype) or isinstance(e, int)):
        if e == 2:
            return b.map("mul", x, x)
        if e == 1:
            return x
        if e == 0:  # 1 everywhere, NaN included (True for a bool x ** False)
            one, shape = b.const(1, out.dtype), b.type(x).shape
            return b.view("expand", b.reshape(one, (1,) * len(shape)), shape, shape) if shape else one
        if e == 0.5:
            return b.map("sqrt", x)
        if e == -0.5:
            return b.map("rsqrt", x)
        if e == -1:
            return b.map("recip", x)
    if not dtypes.is_float(out.dtype):  # the float pow would round results above 2^24 and saturate on overflow
        raise Unsupported("an integer result")
    return _binary("pow")(b, args, kwargs, out)


def _unary(op):
    def handler(b, args, kwargs, out):
        return b.map(op, args[0])
    return handler


for _aten, _op in [("neg", "neg"), ("abs", "abs"), ("exp", "exp"), ("exp2", "exp2"), ("log", "log"),
                   ("log2", "log2"), ("log1p", "log1p"), ("expm1", "expm1"), ("sqrt", "sqrt"),
                   ("rsqrt", "rsqrt"), ("reciprocal", "recip"), ("tanh", "tanh"), ("sin", "sin"),
                   ("cos", "cos"), ("erf", "erf"), ("sigmoid", "sigmoid"), ("relu", "relu"),
                   ("logical_not", "not"), ("tan", "tan"), ("atan", "atan"), ("arctan", "atan"),
                   ("asin", "asin"), ("arcsin", "asin"), ("acos", "acos"), ("arccos", "acos"),
                   ("sinh", "sinh"), ("cosh", "cosh"), ("asinh", "asinh"), ("arcsinh", "asinh"),
                   ("acosh", "acosh"), ("arccosh", "acosh"), ("atanh", "atanh"), ("arctanh", "atanh"),
                   ("log10", "log10"), ("erfc", "erfc"), ("lgamma", "lgamma")]:
    HANDLERS[_aten] = _unary(_op)


def _rounding(op):
    def handler(b, args, kwargs, out):
        """ceil / round (half to even) of an integer tensor is the tensor, as in PyTorch."""
        x = args[0]
        if _arg(args, kwargs, 1, "decimals", 0):
            raise Unsupported(f"{op} with decimals")
        return x if not dtypes.is_float(b.type(x).dtype) else b.map(op, x)
    return handler


HANDLERS["ceil"], HANDLERS["round"] = _rounding("ceil"), _rounding("round")


def _float_binary(op):
    def handler(b, args, kwargs, out):
        """atan2, hypot, fmod, copysign of float results (an integer fmod is an extern)."""
        x, y = args[0], args[1]
        if not dtypes.is_float(out.dtype):
            raise Unsupported(f"{op} of a non-float result")
        like = x if _is_tensor(b, x) else y
        return b.map(op, _operand(b, x, like, op), _operand(b, y, like, op), dtype=out.dtype)
    return handler


for _aten, _op in [("atan2", "atan2"), ("arctan2", "atan2"), ("hypot", "hypot"), ("fmod", "fmod"),
                   ("copysign", "copysign")]:
    HANDLERS[_aten] = _float_binary(_op)


@handles("remainder")
def _remainder(b, args, kwargs, out):
    """Python's modulo (the sign of the divisor): of integers one op; of floats fmod, plus the
    divisor where the two signs differ and the remainder is not 0."""
    if not dtypes.is_float(out.dtype) and out.dtype != "bool":
        x, y = _int_operands(b, args, "mod")
        return b.map("mod", b.cast(x, out.dtype), b.cast(y, out.dtype), dtype=out.dtype)
    r = _float_binary("fmod")(b, args, kwargs, out)
    y = args[1]
    y = y if _is_tensor(b, y) else b.scalar(y, r, "fmod")
    zero = b.scalar(0.0, r)
    fix = b.map("and", b.map("ne", r, zero), b.map("ne", b.map("lt", r, zero), b.map("lt", y, zero)))
    return b.map("where", fix, b.map("add", r, y, dtype=out.dtype), r, dtype=out.dtype)


@handles("square")
def _square(b, args, kwargs, out):
    return b.cast(b.map("mul", args[0], args[0]), out.dtype)


def _float_test(test):
    def handler(b, args, kwargs, out):
        """isnan: x != x; isinf: |x| = inf; isfinite: x - x = 0 (NaN for either); signbit:
        copysign(1, x) < 0 (-0.0 and NaNs with the sign bit count)."""
        x = args[0]
        if not dtypes.is_float(b.type(x).dtype):
            raise Unsupported(f"{test} of an integer tensor")
        if test == "isnan":
            return b.map("ne", x, x)
        if test == "isinf":
            return b.map("eq", b.map("abs", x), b.scalar(float("inf"), x, "where"))
        if test == "isfinite":
            return b.map("eq", b.map("sub", x, x), b.scalar(0.0, x))
        acc = _acc(b, x)
        return b.map("lt", b.map("copysign", b.const(1.0, acc), b.cast(x, acc)), b.const(0.0, acc))
    return handler


for _t in ("isnan", "isinf", "isfinite", "signbit"):
    HANDLERS[_t] = _float_test(_t)


def _angle_scale(k):
    def handler(b, args, kwargs, out):
        x = args[0]
        return b.map("mul", b.cast(x, out.dtype), b.scalar(k, b.cast(x, out.dtype)))
    return handler


HANDLERS["deg2rad"], HANDLERS["rad2deg"] = _angle_scale(math.pi / 180), _angle_scale(180 / math.pi)


@handles("logit")
def _logit(b, args, kwargs, out):
    """log(x / (1 - x)), x clamped to [eps, 1 - eps] first where eps is given."""
    x = args[0]
    eps = _arg(args, kwargs, 1, "eps", None)
    if not dtypes.is_float(out.dtype):
        raise Unsupported("logit of a non-float result")
    acc = _acc_of(out.dtype)
    x = b.cast(x, acc)
    if eps is not None:
        x = b.map("min", b.map("max", x, b.const(float(eps), acc)), b.const(1.0 - float(eps), acc))
    return b.cast(b.map("log", b.map("div", x, b.map("sub", b.const(1.0, acc), x))), out.dtype)


def _nan_ignoring(op):
    def handler(b, args, kwargs, out):
        """fmin / fmax: the other operand where one is NaN (NaN only where both are)."""
        x, y = args[0], args[1]
        m = b.map(op, x, y, dtype=out.dtype)
        if not dtypes.is_float(out.dtype):
            return m
        return b.map("where", b.map("ne", x, x), b.cast(y, out.dtype),
                     b.map("where", b.map("ne", y, y), b.cast(x, out.dtype), m, dtype=out.dtype), dtype=out.dtype)
    return handler


HANDLERS["fmin"], HANDLERS["fmax"] = _nan_ignoring("min"), _nan_ignoring("max")


@handles("logical_xor")
def _logical_xor(b, args, kwargs, out):
    x, y = args[0], args[1]
    return b.map("ne", b.cast(x, "bool"), b.cast(y, "bool"))


@handles("heaviside")
def _heaviside(b, args, kwargs, out):
    """0 below 0, 1 above, `values` at 0 (NaN stays NaN: x > 0 is false, x == 0 too)."""
    x, v = args[0], args[1]
    if not dtypes.is_float(out.dtype):
        raise Unsupported("heaviside of a non-float result")
    x, v = b.cast(x, out.dtype), b.cast(v, out.dtype)
    step = b.cast(b.map("gt", x, b.scalar(0.0, x)), out.dtype)
    step = b.map("where", b.map("ne", x, x), x, step)
    return b.map("where", b.map("eq", x, b.scalar(0.0, x)), v, step, dtype=out.dtype)


@handles("float_power")
def _float_power(b, args, kwargs, out):
    """pow in float64, as torch.float_power."""
    x, y = args[0], args[1]
    x = b.cast(x, "f64") if _is_tensor(b, x) else b.const(float(x), "f64")
    y = b.cast(y, "f64") if _is_tensor(b, y) else b.const(float(y), "f64")
    return b.map("pow", x, y, dtype="f64")


@handles("floor")
def _floor(b, args, kwargs, out):
    """floor of an integer tensor is the tensor, as in PyTorch (not a round trip through f32)."""
    x = args[0]
    return x if not dtypes.is_float(b.type(x).dtype) else b.map("floor", x)


@handles("bitwise_not")
def _bitwise_not(b, args, kwargs, out):
    if b.types[args[0]].dtype != "bool":
        raise Unsupported("an integer operand (~ of a bool tensor is logical not; of an integer, bitwise)")
    return b.map("not", args[0])


@handles("silu")
def _silu(b, args, kwargs, out):
    x = b.cast(args[0], _acc(b, args[0]))  # one rounding at the end, as PyTorch's fused op
    return b.cast(b.map("mul", x, b.map("sigmoid", x)), out.dtype)


@handles("gelu")
def _gelu(b, args, kwargs, out):
    x = b.cast(args[0], _acc(b, args[0]))  # one rounding at the end, as PyTorch's fused op
    approx = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    if approx == "tanh":
        # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function
        # in fewer ops (a bf16 GELU after an 8192 x 4096 x 4096 GEMM cost 43 us over the GEMM with
        # tanh, H200, session 60), and no 1 + tanh(u) cancelling for large negative x
        c = 2 * math.sqrt(2 / math.pi)
        t = b.map("add", b.scalar(c, x), b.map("mul", b.scalar(c * 0.044715, x), b.map("mul", x, x)))
        y = b.map("mul", x, b.map("sigmoid", b.map("mul", x, t)))
    elif approx == "none":
        y = b.map("mul", x, b.map("ncdf", x))  # x Phi(x) = x 0.5 (1 + erf(x / sqrt 2))
    else:
        raise Unsupported(f"approximate={approx!r}")
    return b.cast(y, out.dtype)


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _float_in(b, x, out):
    """x in the type an activation computes in: f32 for 16-bit floats (rounded once, at the end,
    as PyTorch's kernels); an integer x is refused (PyTorch's activations take floats)."""
    if not dtypes.is_float(b.type(x).dtype):
        raise Unsupported(f"{out.op} of {b.type(x).dtype} (PyTorch takes floats)")
    return b.cast(x, _acc(b, x))


def _elu_of(b, x, alpha, scale, input_scale):
    """x > 0 ? scale x : alpha scale expm1(input_scale x) (ELU, SELU, CELU)."""
    neg = b.map("mul", b.scalar(alpha * scale, x), b.map("expm1", b.map("mul", x, b.scalar(input_scale, x))))
    return b.map("where", b.map("gt", x, b.scalar(0.0, x)), b.map("mul", x, b.scalar(scale, x)), neg)


def _softplus_of(b, x, beta=1.0, threshold=20.0):
    """log1p(exp(beta x)) / beta, and x itself where beta x > threshold (PyTorch's softplus)."""
    bx = b.map("mul", x, b.scalar(beta, x))
    soft = b.map("div", b.map("log1p", b.map("exp", bx)), b.scalar(beta, x))
    return b.map("where", b.map("gt", bx, b.scalar(threshold, x)), x, soft)


@handles("elu", "selu", "celu")
def _elu(b, args, kwargs, out):
    x = _float_in(b, args[0], out)
    if out.op == "selu":
        y = _elu_of(b, x, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946, 1.0)
    elif out.op == "celu":
        alpha = _arg(args, kwargs, 1, "alpha", 1.0)
        y = _elu_of(b, x, alpha, 1.0, 1.0 / alpha)
    else:
        y = _elu_of(b, x, _arg(args, kwargs, 1, "alpha", 1.0), _arg(args, kwargs, 2, "scale", 1.0),
                    _arg(args, kwargs, 3, "input_scale", 1.0))
    return b.cast(y, out.dtype)


@handles("softplus")
def _softplus(b, args, kwargs, out):
    x = _float_in(b, args[0], out)
    return b.cast(_softplus_of(b, x, _arg(args, kwargs, 1, "beta", 1.0), _arg(args, kwargs, 2, "threshold", 20.0)),
                  out.dtype)


@handles("mish")
def _mish(b, args, kwargs, out):
    """x tanh(log1p(exp(x))), as x n / (n + 2) with n = e (e + 2), e = exp(min(x, 20)): tanh(log(1 + e))
    is ((1 + e)^2 - 1) / ((1 + e)^2 + 1). One exp and a division where PyTorch's form takes an
    exp, a log1p and a tanh (bf16 over 64 x 96 x 112 x 112 on an H200: 139 -> 76 us, session
    59). From x = 20 on the ratio is 1 in f32 and f64, so x is clamped there (n would overflow
    from 44 on): x itself, as PyTorch's tanh(inf) = 1 gives; a NaN stays NaN (min propagates
    it). Float maps only (no comparison): the chain joins a GEMM's epilogue."""
    x = _float_in(b, args[0], out)
    e = b.map("exp", b.map("min", x, b.scalar(20.0, x)))
    n = b.map("mul", e, b.map("add", e, b.scalar(2.0, x)))
    y = b.map("mul", x, b.map("div", n, b.map("add", n, b.scalar(2.0, x))))
    return b.cast(y, out.dtype)


@handles("log_sigmoid")
def _log_sigmoid(b, args, kwargs, out):
    """min(x, 0) - log1p(exp(-|x|)): log(sigmoid(x)) without its underflow for large -x."""
    x = _float_in(b, args[0], out)
    y = b.map("sub", b.map("min", x, b.scalar(0.0, x)), b.map("log1p", b.map("exp", b.map("neg", b.map("abs", x)))))
    return b.cast(y, out.dtype)


def _leaky_of(b, x, slope):
    """x > 0 ? x : slope x (a leaky ReLU; PReLU's slope a tensor)."""
    s = slope if isinstance(slope, str) else b.scalar(slope, x)
    return b.map("where", b.map("gt", x, b.scalar(0.0, x)), x, b.map("mul", x, s))


@handles("leaky_relu")
def _leaky_relu(b, args, kwargs, out):
    x = _float_in(b, args[0], out)
    return b.cast(_leaky_of(b, x, _arg(args, kwargs, 1, "negative_slope", 0.01)), out.dtype)


@handles("rrelu")
def _rrelu(b, args, kwargs, out):
    """At inference a leaky ReLU of slope (lower + upper) / 2; training's random slopes stay PyTorch's."""
    if _arg(args, kwargs, 3, "training", False):
        raise Unsupported("training mode (a random slope an element)")
    x = _float_in(b, args[0], out)
    slope = (_arg(args, kwargs, 1, "lower", 1 / 8) + _arg(args, kwargs, 2, "upper", 1 / 3)) / 2
    return b.cast(_leaky_of(b, x, slope), out.dtype)


@handles("prelu")
def _prelu(b, args, kwargs, out):
    """x > 0 ? x : w x, w one value or one per channel (dim 1; dim 0 of a 1-D x)."""
    x = _float_in(b, args[0], out)
    w = b.cast(args[1], b.type(x).dtype)
    rank, n = len(b.type(x).shape), b.type(w).numel
    if n > 1 and rank >= 2:
        w = b.reshape(w, (n,) + (1,) * (rank - 2))
    return b.cast(_leaky_of(b, x, w), out.dtype)


@handles("threshold")
def _threshold(b, args, kwargs, out):
    """x <= threshold ? value : x, in x's type, threshold and value rounded to it (PyTorch's CUDA
    kernel; its CPU one compares 16-bit x with the unrounded threshold), a NaN kept."""
    x, th, value = args[0], args[1], args[2]
    return b.map("where", b.map("le", x, b.scalar(th, x, "where")), b.scalar(value, x, "where"), x)


@handles("hardshrink", "softshrink")
def _shrink(b, args, kwargs, out):
    """hardshrink: 0 where -l <= x <= l, else x; softshrink: x - l above l, x + l below -l, else
    0 (x * 0: a NaN stays NaN, as PyTorch's)."""
    lam = _arg(args, kwargs, 1, "lambd", 0.5)
    if out.op == "hardshrink":  # (compared in x's own type, lambda rounded to it: PyTorch's kernels)
        x = args[0]
        if not dtypes.is_float(b.type(x).dtype):
            raise Unsupported(f"hardshrink of {b.type(x).dtype} (PyTorch takes floats)")
        inside = b.map("and", b.map("ge", x, b.scalar(-lam, x, "ge")), b.map("le", x, b.scalar(lam, x, "le")))
        return b.map("where", inside, b.scalar(0.0, x, "where"), x)
    x = _float_in(b, args[0], out)
    hi, lo = b.scalar(lam, x), b.scalar(-lam, x)
    y = b.map("where", b.map("gt", x, hi), b.map("sub", x, hi),
              b.map("where", b.map("lt", x, lo), b.map("add", x, hi), b.map("mul", x, b.scalar(0.0, x))))
    return b.cast(y, out.dtype)


@handles("relu6")
def _relu6(b, args, kwargs, out):
    x = args[0]
    return b.map("min", b.map("max", x, b.scalar(0, x, "max")), b.scalar(6, x, "min"))


@handles("glu")
def _glu(b, args, kwargs, out):
    """a * sigmoid(g), a and g the two halves of x along dim (views of it, read in place)."""
    x = args[0]
    shape = b.type(x).shape
    dim = _arg(args, kwargs, 1, "dim", -1) % len(shape)
    half = shape[dim] // 2
    piece = tuple(half if i == dim else d for i, d in enumerate(shape))
    a = _float_in(b, b.view("slice", x, piece, (dim, 0, half, 1)), out)
    g = _float_in(b, b.view("slice", x, piece, (dim, half, 2 * half, 1)), out)
    return b.cast(b.map("mul", a, b.map("sigmoid", g)), out.dtype)


def _promoted(b, x, out):
    """x in the clamp's result dtype: a float bound promotes an integer tensor (clamp(u8, -1,
    1e5) is f32, its bounds compared as floats; in u8 the -1 wrapped to 255)."""
    return b.cast(x, out.dtype) if b.type(x).dtype != out.dtype else x


@handles("clamp", "clip", "hardtanh")
def _clamp(b, args, kwargs, out):
    x = _promoted(b, args[0], out)
    lo = kwargs.get("min", args[1] if len(args) > 1 else None)
    hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    if lo is not None:
        x = b.map("max", x, _operand(b, lo, x, "max"))
    if hi is not None:
        x = b.map("min", x, _operand(b, hi, x, "min"))
    return x


@handles("clamp_min", "clamp_max")
def _clamp_one(b, args, kwargs, out):
    """x.clamp_min(lo) (F.normalize's guard against a zero norm) and clamp_max."""
    op = "max" if out.op == "clamp_min" else "min"
    x = _promoted(b, args[0], out)
    return b.map(op, x, _operand(b, args[1], x, op))


@handles("where")
def _where(b, args, kwargs, out):
    c, x, y = args
    like = x if _is_tensor(b, x) else y if _is_tensor(b, y) else c
    return b.map("where", c, _operand(b, x, like, "where"), _operand(b, y, like, "where"))


@handles("broadcast_tensors")
def _broadcast_tensors(b, args, kwargs, out):
    """Every operand expanded to the common shape (mse_loss and l1_loss start with it)."""
    xs = args[0]
    shape = broadcast_shapes(*(b.type(x).shape for x in xs))
    res = []
    for x in xs:
        s = b.type(x).shape
        if s != shape:
            x = b.view("expand", b.reshape(x, (1,) * (len(shape) - len(s)) + s), shape, shape)
        res.append(x)
    return tuple(res)


def _filled(b, value, dtype: str) -> str:
    """A tensor's fill value as a Constant, refused where PyTorch refuses it (300 as u8, 1e6 as f16)."""
    if dtype != "bool" and not isinstance(value, bool):
        check_fits(value, dtype)
    return b.const(value, dtype)


@handles("scalar_tensor")
def _scalar_tensor(b, args, kwargs, out):
    return _filled(b, args[0], out.dtype)


@handles("full")
def _full(b, args, kwargs, out):
    c = _filled(b, args[1], out.dtype)
    return b.view("expand", b.reshape(c, (1,) * len(out.shape)), out.shape, out.shape) if out.shape else c


@handles("full_like", "zeros_like", "ones_like")
def _full_like(b, args, kwargs, out):
    value = {"zeros_like": 0, "ones_like": 1}.get(out.op, args[1] if len(args) > 1 else 0)
    c = _filled(b, value, out.dtype)
    return b.view("expand", b.reshape(c, (1,) * len(out.shape)), out.shape, out.shape) if out.shape else c


@handles("arange")
def _arange(b, args, kwargs, out):
    nums = [a for a in args if isinstance(a, (int, float))]
    start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
    if not all(isinstance(v, int) for v in (start, step)):
        raise Unsupported("arange with float bounds")
    # an index is an integer: a float arange is the integer one (exact), cast once
    dt = out.dtype if not dtypes.is_float(out.dtype) else "i64"
    i = b.add(ir.Iota(b.fresh("iota"), ir.TensorType(out.shape, dt), 0, b.source))
    if step != 1:
        i = b.map("mul", i, b.const(step, dt))
    if start != 0:
        i = b.map("add", i, b.const(start, dt))
    return b.cast(i, out.dtype)


@handles("_to_copy", "to", "type_as")
def _to(b, args, kwargs, out):
    return b.cast(args[0], out.dtype)


@handles("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_assert_tensor_metadata")
def _identity(b, args, kwargs, out):
    return args[0]


@handles("dropout")
def _dropout(b, args, kwargs, out):
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    train = args[2] if len(args) > 2 else kwargs.get("train", True)
    if train and p > 0:
        raise Unsupported("dropout in training mode")
    return args[0]


# -- reductions ----------------------------------------------------------------------------------


def _dims(arg, rank):
    if arg is None or arg == []:
        return tuple(range(rank))
    if isinstance(arg, int):
        arg = [arg]
    dims = tuple(wrap_dim(a, rank) for a in arg)  # checked: a scalar's dim is -1 or 0
    return dims if rank else ()  # a scalar reduces over no axes (one element)


def _reduction(op):
    def handler(b, args, kwargs, out):
        x = args[0]
        rank = len(b.type(x).shape)
        dims = _dims(kwargs.get("dim", args[1] if len(args) > 1 else None), rank)
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if kwargs.get("dtype") is not None:
            x = b.cast(x, out.dtype)
        if op in ("sum", "prod") and b.type(x).dtype in ("bool", "i32", "i8", "u8"):
            x = b.cast(x, "i64")
        return b.reduce(op, x, dims, keep, dtype=out.dtype)
    return handler


HANDLERS["sum"] = _reduction("sum")
HANDLERS["mean"] = _reduction("mean")
HANDLERS["amax"] = _reduction("max")
HANDLERS["amin"] = _reduction("min")
HANDLERS["prod"] = _reduction("prod")


def _dim_keep(b, args, kwargs, x):
    """(dims, keepdim) of a reduction's (x, dim, keepdim) arguments."""
    rank = len(b.type(x).shape)
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (list, tuple)) and not dim:
        raise Unsupported("an empty list of dims")  # (reduces nothing here, unlike sum's)
    return _dims(dim, rank), kwargs.get("keepdim", args[2] if len(args) > 2 else False)


def _nonzero(b, x, dtype):
    """1 where x is nonzero (NaN is), else 0, in `dtype`."""
    if b.type(x).dtype != "bool":
        x = b.map("ne", x, b.const(0, b.type(x).dtype))
    return b.cast(x, dtype)


@handles("all", "any")
def _all_any(b, args, kwargs, out):
    """all: the least of x != 0 over the dims; any: the greatest (a uint8 tensor's gives uint8)."""
    x = args[0]
    dims, keep = _dim_keep(b, args, kwargs, x)
    r = b.reduce("min" if out.op == "all" else "max", _nonzero(b, x, "f32"), dims, keep)
    return b.cast(b.map("ne", r, b.const(0.0, "f32")), out.dtype)


@handles("count_nonzero")
def _count_nonzero(b, args, kwargs, out):
    x = args[0]
    dims, _ = _dim_keep(b, args[:2], kwargs, x)
    return b.reduce("sum", _nonzero(b, x, "i64"), dims, False, dtype="i64")


def _without_nans(b, x):
    return b.map("where", b.map("ne", x, x), b.scalar(0, x), x) if dtypes.is_float(b.type(x).dtype) else x


@handles("nansum")
def _nansum(b, args, kwargs, out):
    """sum with NaNs counted as 0."""
    _dim_keep(b, args, kwargs, args[0])  # (refuses an empty list of dims)
    return HANDLERS["sum"](b, (_without_nans(b, args[0]),) + tuple(args[1:]), kwargs, out)


@handles("nanmean")
def _nanmean(b, args, kwargs, out):
    """The mean of the elements that are not NaN (NaN where all are)."""
    x = args[0]
    if not dtypes.is_float(b.type(x).dtype):
        raise Unsupported("nanmean of an integer tensor")
    dims, keep = _dim_keep(b, args, kwargs, x)
    x = b.cast(x, out.dtype) if kwargs.get("dtype") is not None else x
    acc = _acc(b, x)
    total = b.reduce("sum", b.cast(_without_nans(b, x), acc), dims, keep)
    count = b.reduce("sum", b.cast(b.map("eq", x, x), acc), dims, keep)
    return b.cast(b.map("div", total, count), out.dtype)


@handles("dot", "vdot")
def _dot(b, args, kwargs, out):
    """The sum of the products, accumulated in f32 for 16-bit vectors (as cuBLAS's dot)."""
    x, y = args[0], args[1]
    acc = _acc_of(out.dtype)
    return b.cast(b.reduce("sum", b.map("mul", b.cast(x, acc), b.cast(y, acc)), (0,), False), out.dtype)


@handles("mv")
def _mv(b, args, kwargs, out):
    return _matmul(b, args[0], args[1], out.shape, out.dtype)


@handles("var", "std")
def _var(b, args, kwargs, out):
    return _var_mean(b, args, kwargs, out, out.op == "std")[0]


@handles("var_mean", "std_mean")
def _var_and_mean(b, args, kwargs, out):
    """(variance or standard deviation, mean): a hand-written LayerNorm's torch.var_mean."""
    return _var_mean(b, args, kwargs, out, out.op == "std_mean")


def _var_mean(b, args, kwargs, out, std: bool):
    x, rest = args[0], list(args[1:])
    rank = len(b.type(x).shape)
    if rest and isinstance(rest[0], bool):  # var.default(x, unbiased)
        dim, unbiased, keep = None, rest[0], False
    else:  # var.dim(x, dim, unbiased, keepdim) or var.correction(x, dim, *, correction, keepdim)
        dim = rest[0] if rest else kwargs.get("dim")
        unbiased = rest[1] if len(rest) > 1 else kwargs.get("unbiased", True)
        keep = rest[2] if len(rest) > 2 else kwargs.get("keepdim", False)
    dims = _dims(dim, rank)
    corr = kwargs.get("correction")
    if corr is None:
        corr = 1 if unbiased else 0
    n = math.prod(b.type(x).shape[d] for d in dims)
    mean = b.reduce("mean", x, dims, True, dtype=_acc(b, x))
    d = b.map("sub", b.cast(x, _acc(b, x)), mean)
    s = b.reduce("sum", b.map("mul", d, d), dims, keep)
    v = b.map("mul", s, b.scalar(1.0 / max(n - corr, 0) if n - corr > 0 else math.inf, s))
    if std:
        v = b.map("sqrt", v)
    if not keep:
        mean = b.reshape(mean, b.type(v).shape)
    return b.cast(v, out.dtype), b.cast(mean, out.dtype)


def _loss_reduced(b, v, reduction, out, name):
    """A loss's elementwise values `v` (in the accumulation type) as PyTorch's `reduction`
    returns them (0 none, 1 mean, 2 sum), rounded once to the result's dtype."""
    if reduction == 0:
        return b.cast(v, out.dtype)
    if reduction not in (1, 2):
        raise Unsupported(f"{name} reduction {reduction!r}")
    dims = tuple(range(len(b.type(v).shape)))
    return b.cast(b.reduce("mean" if reduction == 1 else "sum", v, dims, False), out.dtype)


def _loss_operands(b, args, name):
    """A pointwise loss's two tensors in the accumulation type (float, same shape: torch.export
    broadcasts them first where PyTorch would)."""
    x, t = args[0], args[1]
    if not (dtypes.is_float(b.type(x).dtype) and dtypes.is_float(b.type(t).dtype)):
        raise Unsupported(f"{name} of tensors that are not float")
    if b.type(x).shape != b.type(t).shape:
        raise Unsupported(f"{name} of tensors of different shapes (PyTorch broadcasts them with a warning)")
    return b.cast(x, _acc(b, x)), b.cast(t, _acc(b, t))


@handles("l1_loss")
def _l1_loss(b, args, kwargs, out):
    x, t = _loss_operands(b, args, "l1_loss")
    return _loss_reduced(b, b.map("abs", b.map("sub", x, t)), _arg(args, kwargs, 2, "reduction", 1), out, "l1_loss")


def _smooth_l1(huber: bool):
    name = "huber_loss" if huber else "smooth_l1_loss"

    def handler(b, args, kwargs, out):
        """smooth L1 (beta): d < beta ? d^2 / (2 beta) : d - beta / 2; Huber (delta): d < delta ?
        d^2 / 2 : delta (d - delta / 2); d = |x - t|. A beta of 0 is the L1 loss."""
        x, t = _loss_operands(b, args, name)
        reduction = _arg(args, kwargs, 2, "reduction", 1)
        k = float(_arg(args, kwargs, 3, "delta" if huber else "beta", 1.0))
        d = b.map("abs", b.map("sub", x, t))
        if k < 0:
            raise Unsupported("a negative beta / delta")
        if k == 0:
            return _loss_reduced(b, d, reduction, out, name)
        sq = b.map("mul", b.map("mul", d, d), b.scalar(0.5 if huber else 0.5 / k, d))
        lin = b.map("sub", d, b.scalar(0.5 * k, d))
        if huber:
            lin = b.map("mul", lin, b.scalar(k, d))
        v = b.map("where", b.map("lt", d, b.scalar(k, d)), sq, lin)
        return _loss_reduced(b, v, reduction, out, name)
    return handler


HANDLERS["smooth_l1_loss"], HANDLERS["huber_loss"] = _smooth_l1(False), _smooth_l1(True)


@handles("binary_cross_entropy_with_logits")
def _bce_with_logits(b, args, kwargs, out):
    """(1 - t) x + log(1 + exp(-x)), as max(x, 0) - x t + log1p(exp(-|x|)): no overflow for
    large |x|. The per-element `weight` and `pos_weight` are refused (an extern runs them)."""
    if _arg(args, kwargs, 2, "weight", None) is not None or _arg(args, kwargs, 3, "pos_weight", None) is not None:
        raise Unsupported("binary_cross_entropy_with_logits with weight or pos_weight")
    x, t = _loss_operands(b, args, "binary_cross_entropy_with_logits")
    soft = b.map("log1p", b.map("exp", b.map("neg", b.map("abs", x))))
    v = b.map("add", b.map("sub", b.map("relu", x), b.map("mul", x, t)), soft)
    return _loss_reduced(b, v, _arg(args, kwargs, 4, "reduction", 1), out, "binary_cross_entropy_with_logits")


@handles("binary_cross_entropy")
def _bce(b, args, kwargs, out):
    """-(t log p + (1 - t) log(1 - p)), each log at least -100, as PyTorch clamps them."""
    if _arg(args, kwargs, 2, "weight", None) is not None:
        raise Unsupported("binary_cross_entropy with weight")
    p, t = _loss_operands(b, args, "binary_cross_entropy")
    lo = b.scalar(-100.0, p)
    lp = b.map("max", b.map("log", p), lo)
    lq = b.map("max", b.map("log", b.map("sub", b.scalar(1.0, p), p)), lo)
    v = b.map("neg", b.map("add", b.map("mul", t, lp), b.map("mul", b.map("sub", b.scalar(1.0, t), t), lq)))
    return _loss_reduced(b, v, _arg(args, kwargs, 3, "reduction", 1), out, "binary_cross_entropy")


def _xlogy(b, x, y):
    """x log y, 0 where x is 0 (and y is not NaN), as torch.xlogy."""
    zero = b.scalar(0.0, x)
    keep = b.map("or", b.map("ne", x, zero), b.map("ne", y, y))
    return b.map("where", keep, b.map("mul", x, b.map("log", y)), zero)


@handles("kl_div")
def _kl_div(b, args, kwargs, out):
    """target (log target - input), xlogy(t, t) - t x where the target is not log-space, as
    aten.kl_div ('batchmean' divides the sum after it, in PyTorch's own code)."""
    x, t = _loss_operands(b, args, "kl_div")
    if _arg(args, kwargs, 3, "log_target", False):
        v = b.map("mul", b.map("exp", t), b.map("sub", t, x))
    else:
        v = b.map("sub", _xlogy(b, t, t), b.map("mul", t, x))
    return _loss_reduced(b, v, _arg(args, kwargs, 2, "reduction", 1), out, "kl_div")


@handles("xlogy")
def _xlogy_op(b, args, kwargs, out):
    x, y = args[0], args[1]
    like = x if _is_tensor(b, x) else y
    x, y = _operand(b, x, like), _operand(b, y, like)
    if not dtypes.is_float(out.dtype):
        raise Unsupported("xlogy of a non-float result")
    return b.cast(_xlogy(b, b.cast(x, _acc_of(out.dtype)), b.cast(y, _acc_of(out.dtype))), out.dtype)


@handles("masked_fill")
def _masked_fill(b, args, kwargs, out):
    """where(mask, value, x): value a number (refused where x's dtype cannot hold it, as
    PyTorch refuses it) or a 0-dim tensor, taken in x's dtype."""
    x, mask, value = args[0], args[1], _arg(args, kwargs, 2, "value", None)
    if b.type(mask).dtype != "bool":
        raise Unsupported("masked_fill with a mask that is not bool")
    if broadcast_shapes(b.type(x).shape, b.type(mask).shape) != b.type(x).shape:
        raise Unsupported("masked_fill with a mask larger than the tensor")
    v = b.cast(value, b.type(x).dtype) if _is_tensor(b, value) else _operand(b, value, x, "where")
    return b.map("where", mask, v, x, dtype=b.type(x).dtype)


def _addc(op):
    def handler(b, args, kwargs, out):
        """x + value (a op b), in the result's dtype (PyTorch's addcmul / addcdiv)."""
        x, t1, t2 = args[0], args[1], args[2]
        value = _arg(args, kwargs, 3, "value", 1)
        if not dtypes.is_float(out.dtype):
            raise Unsupported(f"add{'cmul' if op == 'mul' else 'cdiv'} of a non-float result")
        acc = _acc_of(out.dtype)
        x, t1, t2 = (b.cast(a, acc) for a in (x, t1, t2))
        y = b.map(op, t1, t2)
        if value != 1:
            y = b.map("mul", y, b.const(float(value), acc))
        return b.cast(b.map("add", x, y), out.dtype)
    return handler


HANDLERS["addcmul"], HANDLERS["addcdiv"] = _addc("mul"), _addc("div")


@handles("lerp")
def _lerp(b, args, kwargs, out):
    """x + w (y - x) for w < 0.5, y - (y - x)(1 - w) otherwise: PyTorch's form, exact at both ends."""
    x, y, w = args[0], args[1], args[2]
    if not dtypes.is_float(out.dtype):
        raise Unsupported("lerp of a non-float result")
    acc = _acc_of(out.dtype)
    x, y = b.cast(x, acc), b.cast(y, acc)
    w = b.cast(w, acc) if _is_tensor(b, w) else b.const(float(w), acc)
    d = b.map("sub", y, x)
    lo = b.map("add", x, b.map("mul", w, d))
    hi = b.map("sub", y, b.map("mul", d, b.map("sub", b.const(1.0, acc), w)))
    return b.cast(b.map("where", b.map("lt", b.map("abs", w), b.const(0.5, acc)), lo, hi), out.dtype)


@handles("sign", "sgn")
def _sign(b, args, kwargs, out):
    """(x > 0) - (x < 0) in x's dtype: 0 for zeros of either sign and for NaN, as torch.sign."""
    x = args[0]
    if b.type(x).dtype == "bool":
        return x
    zero = b.scalar(0, x)
    return b.map("sub", b.cast(b.map("gt", x, zero), b.type(x).dtype), b.cast(b.map("lt", x, zero), b.type(x).dtype))


@handles("trunc", "fix")
def _trunc(b, args, kwargs, out):
    x = args[0]
    if not dtypes.is_float(b.type(x).dtype):
        return x
    return b.map("where", b.map("lt", x, b.scalar(0.0, x)), b.map("neg", b.map("floor", b.map("neg", x))),
                 b.map("floor", x))


@handles("frac")
def _frac(b, args, kwargs, out):
    x = args[0]
    return b.map("sub", x, _trunc(b, [x], {}, out))


@handles("nan_to_num")
def _nan_to_num(b, args, kwargs, out):
    """NaN, +inf and -inf replaced (by 0 and the dtype's largest and smallest finite values
    unless given)."""
    x = args[0]
    if not dtypes.is_float(b.type(x).dtype):
        return x
    info = np.finfo(dtypes.to_numpy(b.type(x).dtype)) if b.type(x).dtype != "bf16" else None
    big = float(info.max) if info is not None else 3.3895313892515355e38
    nan = _arg(args, kwargs, 1, "nan", None)
    posinf, neginf = _arg(args, kwargs, 2, "posinf", None), _arg(args, kwargs, 3, "neginf", None)
    inf = b.scalar(float("inf"), x, "where")
    y = b.map("where", b.map("ne", x, x), b.scalar(0.0 if nan is None else nan, x, "where"), x)
    y = b.map("where", b.map("eq", x, inf), b.scalar(big if posinf is None else posinf, x, "where"), y)
    return b.map("where", b.map("eq", x, b.map("neg", inf)), b.scalar(-big if neginf is None else neginf, x, "where"), y)


@handles("logaddexp")
def _logaddexp(b, args, kwargs, out):
    """max(x, y) + log1p(exp(-|x - y|)); where x = y = +-inf, that infinity (not NaN)."""
    x, y = args[0], args[1]
    if not dtypes.is_float(out.dtype):
        raise Unsupported("logaddexp of a non-float result")
    acc = _acc_of(out.dtype)
    x, y = b.cast(x, acc), b.cast(y, acc)
    m = b.map("max", x, y)
    v = b.map("add", m, b.map("log1p", b.map("exp", b.map("neg", b.map("abs", b.map("sub", x, y))))))
    same_inf = b.map("and", b.map("eq", x, y), b.map("eq", b.map("abs", x), b.const(float("inf"), acc)))
    return b.cast(b.map("where", same_inf, x, v), out.dtype)


@handles("sinc")
def _sinc(b, args, kwargs, out):
    """sin(pi x) / (pi x), 1 at 0."""
    x = args[0]
    acc = _acc_of(out.dtype)
    x = b.cast(x, acc)
    px = b.map("mul", x, b.const(math.pi, acc))
    v = b.map("div", b.map("sin", px), px)
    return b.cast(b.map("where", b.map("eq", x, b.const(0.0, acc)), b.const(1.0, acc), v), out.dtype)


@handles("mse_loss")
def _mse_loss(b, args, kwargs, out):
    """F.mse_loss: (x - t)^2 in the accumulation type, then its mean or sum."""
    x, t = _loss_operands(b, args, "mse_loss")
    d = b.map("sub", x, t)
    return _loss_reduced(b, b.map("mul", d, d), _arg(args, kwargs, 2, "reduction", 1), out, "mse_loss")


@handles("linalg_vector_norm")
def _vector_norm(b, args, kwargs, out):
    """torch.norm's and F.normalize's vector norm, a row reduction: |x| summed (or its max, min,
    count of nonzeros) in the accumulation type, then the root, rounded once to the result's
    dtype, as PyTorch accumulates a 16-bit norm in f32. The result's shape is the reduction's:
    torch.export's fake CUDA kernel kept a reduced size-1 dim (f32[16, 1, 7] for [16, 7])."""
    x, p = args[0], args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keep = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if not dtypes.is_float(b.type(x).dtype) or not dtypes.is_float(out.dtype):
        raise Unsupported("the norm of a tensor that is not float")
    if kwargs.get("dtype") is not None:
        x = b.cast(x, out.dtype)
    x = b.cast(x, _acc(b, x))
    acc = b.type(x).dtype
    dims = _dims(dim, len(b.type(x).shape))
    p = float(p)
    if p == 2:
        r = b.map("sqrt", b.reduce("sum", b.map("mul", x, x), dims, keep))
    elif p == 0:
        r = b.reduce("sum", b.cast(b.map("ne", x, b.const(0, acc)), acc), dims, keep)
    else:
        a = b.map("abs", x)
        if math.isinf(p):
            r = b.reduce("max" if p > 0 else "min", a, dims, keep)
        elif p == 1:
            r = b.reduce("sum", a, dims, keep)
        else:
            s = b.reduce("sum", b.map("pow", a, b.const(p, acc)), dims, keep)
            r = b.map("pow", s, b.const(1.0 / p, acc))
    return b.cast(r, out.dtype)


@handles("cosine_similarity")
def _cosine_similarity(b, args, kwargs, out):
    """sum((x1 / max(|x1|, eps)) * (x2 / max(|x2|, eps))) along dim: each normalised first, as
    PyTorch computes it (its norms clamped one by one, not their product), in f32 for 16-bit."""
    x1, x2 = args[0], args[1]
    dim = _arg(args, kwargs, 2, "dim", 1)
    eps = _arg(args, kwargs, 3, "eps", 1e-8)
    if not (dtypes.is_float(b.type(x1).dtype) and dtypes.is_float(b.type(x2).dtype)):
        raise Unsupported("the cosine similarity of tensors that are not float")
    shape = broadcast_shapes(b.type(x1).shape, b.type(x2).shape)
    d = dim % len(shape)
    acc = "f64" if "f64" in (b.type(x1).dtype, b.type(x2).dtype) else "f32"

    def unit(x):  # (expanded first, as PyTorch: an x broadcast along dim has the norm of its copies)
        s = b.type(x).shape
        if s != shape:
            x = b.view("expand", b.reshape(x, (1,) * (len(shape) - len(s)) + tuple(s)), shape, shape)
        x = b.cast(x, acc)
        norm = b.map("sqrt", b.reduce("sum", b.map("mul", x, x), (d,), True))
        return b.map("div", x, b.map("max", norm, b.scalar(float(eps), norm)))

    return b.cast(b.reduce("sum", b.map("mul", unit(x1), unit(x2)), (d,), False), out.dtype)


@handles("max", "min")
def _max_min(b, args, kwargs, out):
    """max/min of two tensors (elementwise), of all elements, or along a dim: (values, indices),
    the values a row reduction and the indices `_arg_index`'s."""
    op = out.op
    if len(args) > 1 and _is_tensor(b, args[1]) or _is_tensor(b, kwargs.get("other")):
        return _binary(op)(b, [args[0], args[1] if len(args) > 1 else kwargs["other"]], {}, out)
    x = args[0]
    rank = len(b.type(x).shape)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        return b.reduce(op, x, _dims(None, rank), False)
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not rank:  # (a 0-d tensor's one element)
        return b.reduce(op, x, (), keep), b.reshape(_arg_index(b, b.reshape(x, (1,)), op, 0, False), ())
    dim = wrap_dim(dim, rank)
    if not arg_lowered(b.type(x).shape, dim):
        values = b.reduce(op, x, (dim,), keep)
        return values, _arg_extern(b, x, op, dim, keep, b.type(values).shape)
    best = b.reduce(op, x, (dim,), True)  # (one reduction for the values and the indices)
    values = best if keep else b.reshape(best, out.shape)
    return values, _arg_index(b, x, op, dim, keep, best)


@handles("aminmax")
def _aminmax(b, args, kwargs, out):
    """(min, max), over `dim` or all elements: two reductions of one input (merged into one
    pass where they share a kernel)."""
    x = args[0]
    rank = len(b.type(x).shape)
    dims, keep = _dims(kwargs.get("dim"), rank), kwargs.get("keepdim", False)
    return b.reduce("min", x, dims, keep), b.reduce("max", x, dims, keep)


def _scan(b, x: str, dim, op: str, dtype: str) -> str:
    """A running `op` of x along `dim` in `dtype` (ir.Scan), the dims of 1 after it dropped (by a
    reshape). Of weights and constants alone, PyTorch's op, which folds into a weight (a causal
    mask's `ones(T, T).cumsum(-1)`)."""
    shape = b.type(x).shape
    if not shape:  # (one element: itself)
        return b.cast(x, dtype)
    d = wrap_dim(dim, len(shape))
    if _static(b, x):
        raise Unsupported("a tensor made of weights and constants (folded when compiling)")
    x = b.cast(x, dtype)
    if shape[d] == 1:
        return x
    last = max([d] + [i for i in range(d + 1, len(shape)) if shape[i] != 1])
    kept = shape[:last + 1]
    row = b.reshape(x, kept)
    scan = b.add(ir.Scan(b.fresh(f"cum{op}"), ir.TensorType(kept, dtype), op, row, d, b.source))
    return b.reshape(scan, shape)


@handles("cumsum", "cumprod")
def _cumulative(b, args, kwargs, out):
    """torch.cumsum / cumprod: a running sum (product) in the result's dtype (i64 for integers
    and bools, `dtype` where given), accumulated in f32 for bf16 / f16 as PyTorch's CUDA kernels do."""
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    return _scan(b, args[0], dim, "sum" if out.op == "cumsum" else "prod", out.dtype)


@handles("cummax", "cummin")
def _cummax(b, args, kwargs, out):
    """torch.cummax / cummin: the running max (min), NaN carried on once seen, as PyTorch does;
    the indices, where used, are PyTorch's op (ir.Extern.item 1)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    if b.type(x).dtype == "bool":
        raise Unsupported("a bool tensor")
    values = _scan(b, x, dim, "max" if out.op == "cummax" else "min", b.type(x).dtype)
    shape = b.type(x).shape
    indices = b.add(ir.Extern(b.fresh(f"{out.op}_indices"), ir.TensorType(shape, "i64"), f"aten.{out.op}.default",
                              (ir.Ref(x), dim), (), f"the indices of {out.op} run in PyTorch", b.source, item=1))
    return values, indices


@handles("avg_pool1d", "max_pool1d")
def _pool1d(b, args, kwargs, out):
    """F.avg_pool1d / F.max_pool1d over windows that tile the length (stride = kernel, no padding,
    no dilation): [.., L] viewed as [.., L // k, k] (what is left over dropped, as PyTorch's
    floor mode does) and reduced over its last dim. Other windows stay PyTorch's op."""
    names = (("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad") if out.op == "avg_pool1d"
             else ("kernel_size", "stride", "padding", "dilation", "ceil_mode"))
    got = {key: args[1 + i] if len(args) > 1 + i else kwargs.get(key) for i, key in enumerate(names)}
    one = lambda v, default: default if v in (None, [], ()) else v[0] if isinstance(v, (list, tuple)) else v  # noqa: E731
    k = one(got["kernel_size"], None)
    stride, padding, dilation = one(got["stride"], k), one(got["padding"], 0), one(got.get("dilation"), 1)
    # (without padding, count_include_pad changes nothing)
    if not (isinstance(k, int) and stride == k and padding == 0 and dilation == 1 and not got["ceil_mode"]):
        raise Unsupported("windows other than stride = kernel without padding")
    x = args[0]
    if not dtypes.is_float(b.type(x).dtype):
        raise Unsupported(f"a {b.type(x).dtype} tensor")
    shape = b.type(x).shape
    n = shape[-1] // k
    if n * k != shape[-1]:
        x = b.view("slice", x, shape[:-1] + (n * k,), (len(shape) - 1, 0, n * k, 1))
    windows = b.reshape(x, shape[:-1] + (n, k))
    if out.op == "max_pool1d":
        return b.reduce("max", windows, (-1,), False)
    return b.cast(b.reduce("mean", windows, (-1,), False, dtype=_acc(b, windows)), out.dtype)


@handles("argmax", "argmin")
def _argmax(b, args, kwargs, out):
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    shape, op = b.type(x).shape, out.op[3:]
    if b.type(x).dtype == "bool":
        raise Unsupported("a bool tensor")  # (PyTorch refuses it too: its extern raises as eager does)
    if dim is None or not shape:  # over every element: of the flattened tensor, shaped as PyTorch gives it
        numel = math.prod(shape)
        if not arg_lowered((numel,), 0):
            raise Unsupported(f"arg{op} over {numel} elements at once (a row split into pieces)")
        return b.reshape(_arg_index(b, b.reshape(x, (numel,)), op, 0, False), out.shape)
    dim = wrap_dim(dim, len(shape))
    if not arg_lowered(shape, dim):
        raise Unsupported(f"arg{op} over a dim that is not last, or over few long rows")
    return _arg_index(b, x, op, dim, keep)


def arg_lowered(shape: tuple, dim: int) -> bool:
    """Whether arg{max,min} along `dim` of a tensor of `shape` is two reductions of one row
    kernel (else PyTorch's arg op): along the last dim, for rows the planner keeps whole. Over
    another dim it does not put the second reduction (of a where over an iota along the column)
    in the first's column kernel; few long rows it splits (rewrites.split_long_reductions), and
    the split's index pass would write a tensor as large as x between kernels (1 x 2^20: five
    kernels and 16.8 MB, where PyTorch's argmax reads 4.2 MB once)."""
    from ..graph.rewrites import SPLIT_REDUCE_MIN, SPLIT_REDUCE_ROWS

    if dim != len(shape) - 1:
        return False
    return shape[-1] < SPLIT_REDUCE_MIN or math.prod(shape[:-1]) >= SPLIT_REDUCE_ROWS


def _arg_extern(b, x, op: str, dim: int, keep: bool, shape: tuple):
    of = b.cast(x, "u8") if b.type(x).dtype == "bool" else x  # PyTorch's argmax/argmin refuse bool
    return b.add(ir.Extern(b.fresh(f"arg{op}"), ir.TensorType(shape, "i64"), f"aten.arg{op}.default",
                           (ir.Ref(of), dim, keep), (), f"the index of each {op} (arg{op}) runs in PyTorch: "
                           f"over a dim that is not last, or over few long rows", b.source))


def _arg_index(b, x, op: str, dim: int, keep: bool, best: str | None = None):
    """argmax / argmin along `dim` as two row reductions in one kernel: the max (min; `best`, if
    made already, keepdim), then the least index where x equals it or is NaN. PyTorch's max
    propagates NaN and its arg points at the first NaN; of equal values it takes the first, as
    the least index does."""
    t = b.type(x)
    if t.dtype == "bool":
        x = b.cast(x, "u8")
    n = t.shape[dim]
    if n == 0:
        raise Unsupported(f"arg{op} over an empty dim")  # (PyTorch raises)
    best = best or b.reduce(op, x, (dim,), True)
    hit = b.map("eq", x, best)
    if dtypes.is_float(t.dtype):
        hit = b.map("or", hit, b.map("ne", x, x))
    # the least index in i32 where it fits (half the integer work of i64 per element: the kernel
    # had been bound by it), widened to PyTorch's i64 once reduced
    it = "i32" if n < 2**31 - 1 else "i64"
    at = b.map("where", hit, _positions(b, len(t.shape), dim, n, it), b.const(n, it))
    return b.cast(b.reduce("min", at, (dim,), keep), "i64")


@handles("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
         "_upsample_nearest_exact2d", "_upsample_nearest_exact3d")
def _upsample_nearest(b, args, kwargs, out):
    """Nearest (and nearest-exact) upsampling by whole factors as views: each spatial dim d of
    size n becomes (n, 1) expanded to (n, s) and merged, `x[..., i, None].expand(..., s)`, so a
    kernel reading the result reads x in place (rules/result_copies.py copies it where it is the
    result). For a factor s, PyTorch's source index floor(j / s) (nearest) and floor((j + 0.5)
    / s) (exact) are both j // s. Other factors stay PyTorch's op."""
    x = args[0]
    shape = b.type(x).shape
    k = len(out.shape) - 2
    if len(shape) != k + 2:
        raise Unsupported("an input without its batch and channel dims")
    if (out.target or "").endswith(".vec"):  # (x, output_size, scale_factors)
        given = args[2] if len(args) > 2 else kwargs.get("scale_factors")
    else:  # (x, output_size, scales_d...)
        given = list(args[2:]) + [v for key, v in kwargs.items() if key.startswith("scales")]
    given = [g for g in (given or ()) if g is not None]
    factors = []
    for d in range(k):
        n, m = shape[2 + d], out.shape[2 + d]
        if n == 0 or m % n:
            raise Unsupported(f"a factor of {m}/{n}, not a whole number")
        if not _nearest_is_floor_div(m, m // n, exact="exact" in out.op):
            raise Unsupported(f"a factor of {m // n}, where PyTorch's float32 source index is not j // {m // n}")
        factors.append(m // n)
    if given and [float(g) for g in given] != [float(f) for f in factors]:
        raise Unsupported(f"scale factors {list(given)} other than the sizes' ratios {factors}")
    split = tuple(shape[:2]) + tuple(v for n in shape[2:] for v in (n, 1))
    wide = tuple(shape[:2]) + tuple(v for n, f in zip(shape[2:], factors) for v in (n, f))
    return b.reshape(b.view("expand", b.reshape(x, split), wide, wide), out.shape)


def _nearest_is_floor_div(m: int, f: int, exact: bool) -> bool:
    """Whether PyTorch's nearest source index of every output position j < m, computed with the
    scale 1/f in float32 (its CUDA kernels) and in float64, is j // f: floor(j * s), or
    floor((j + 0.5) * s) for nearest-exact. For whole factors up to 40 it is; past that float32's
    1/f rounds below, and floor(41 * s) is 0 at f = 41."""
    j = np.arange(m, dtype=np.float64) + (0.5 if exact else 0.0)
    want = np.arange(m) // f
    for t in (np.float32, np.float64):
        got = np.floor((j.astype(t) * (t(1) / t(f))).astype(t)).astype(np.int64)
        if not np.array_equal(got, want):
            return False
    return True


@handles("topk", "sort")
def _ordered(b, args, kwargs, out):
    """topk / sort: the indices from PyTorch's own op (the same overload and arguments, so ties
    fall as eager's do), an extern; the values x gathered at them, exactly eager's values, in
    whichever kernel reads them (a mixture of experts' router weights)."""
    x = args[0]
    shape = b.type(x).shape
    if not shape or not out.target:
        raise Unsupported("a 0-d tensor" if not shape else "an in-place sort")
    dim = kwargs.get("dim", args[2] if out.op == "topk" and len(args) > 2 else
                     args[1] if out.op == "sort" and len(args) > 1 else -1)
    dim = wrap_dim(dim, len(shape))

    def refs(a):
        return ir.Ref(a) if isinstance(a, str) and a in b.types else a

    indices = b.add(ir.Extern(b.fresh(f"{out.op}_indices"), ir.TensorType(out.shape, "i64"), out.target,
                              tuple(refs(a) for a in args), tuple(kwargs.items()),
                              f"the order of {out.op} runs in PyTorch", b.source, item=1))
    return _gathered(b, x, dim, indices, out.shape[dim]), indices


def _acc_of(dtype: str) -> str:
    """The type a 16-bit float is computed in (f32); others compute in their own."""
    return "f32" if dtype in ("bf16", "f16") else dtype


def _acc(b, x):
    return _acc_of(b.type(x).dtype)


def _softmax_input(b, x, out):
    """x as a softmax computes it: in the result's dtype first (`dtype=torch.float64` computes
    in f64, as PyTorch's `x.to(dtype)` does), then in f32 where that is 16-bit."""
    x = b.cast(x, out.dtype) if dtypes.is_float(out.dtype) else x
    return b.cast(x, _acc(b, x))


@handles("_softmax", "softmax", "_safe_softmax")
def _softmax(b, args, kwargs, out):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    xf = _softmax_input(b, x, out)
    m = b.reduce("max", xf, (dim,), True)
    e = b.map("exp", b.map("sub", xf, m))
    s = b.reduce("sum", e, (dim,), True)
    return b.cast(b.map("div", e, s), out.dtype)


@handles("_log_softmax", "log_softmax")
def _log_softmax(b, args, kwargs, out):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    xf = _softmax_input(b, x, out)
    m = b.reduce("max", xf, (dim,), True)
    sh = b.map("sub", xf, m)
    lse = b.map("log", b.reduce("sum", b.map("exp", sh), (dim,), True))
    return b.cast(b.map("sub", sh, lse), out.dtype)


@handles("logsumexp")
def _logsumexp(b, args, kwargs, out):
    """log(sum(exp(x))) over dims, about the max as PyTorch computes it, an infinite max taken
    as 0 (a row of -inf: -inf, not NaN; a +inf in it: +inf)."""
    x = args[0]
    rank = len(b.type(x).shape)
    dims = _dims(kwargs.get("dim", args[1] if len(args) > 1 else None), rank)
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    xf = _softmax_input(b, x, out)
    dt = b.type(xf).dtype
    m = b.reduce("max", xf, dims, True)
    m = b.map("where", b.map("eq", b.map("abs", m), b.const(float("inf"), dt)), b.const(0.0, dt), m)
    s = b.map("log", b.reduce("sum", b.map("exp", b.map("sub", xf, m)), dims, keep))
    return b.cast(b.map("add", s, b.reshape(m, b.type(s).shape)), out.dtype)


@handles("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_avg_pool1d")
def _adaptive_avg_pool(b, args, kwargs, out):
    """Pooling to one output element a channel (ResNet's and EfficientNet's heads): the mean over
    the pooled dims (a reduction over neighbouring dims: graph/rules/merged_reductions.py)."""
    x, size = args[0], kwargs.get("output_size", args[1] if len(args) > 1 else None)
    size = [size] if isinstance(size, int) else list(size or ())
    if not size or any(s != 1 for s in size):
        raise Unsupported(f"output size {tuple(size)} (only 1 per pooled dim)")
    rank = len(b.type(x).shape)
    return b.cast(b.reduce("mean", x, tuple(range(rank - len(size), rank)), True), out.dtype)


def _norm_dims(b, x, normalized_shape):
    rank = len(b.type(x).shape)
    return tuple(range(rank - len(normalized_shape), rank))


@handles("rms_norm")
def _rms_norm(b, args, kwargs, out):
    x, shape = args[0], args[1]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    if eps is None:
        # PyTorch takes the epsilon of the type it computes in: f32 for bf16/f16 inputs.
        eps = 2.220446049250313e-16 if b.type(x).dtype == "f64" else 1.1920928955078125e-07
    xf = b.cast(x, _acc(b, x))
    ms = b.reduce("mean", b.map("mul", xf, xf), _norm_dims(b, x, shape), True)
    y = b.map("mul", xf, b.map("rsqrt", b.map("add", ms, b.scalar(float(eps), ms))))
    if w is not None:
        y = b.map("mul", y, w)
    return b.cast(y, out.dtype)


def _centred(b, xf, dims, eps):
    """(mean, x - mean, rsqrt(var + eps)) over dims, the variance that of x - mean (a LayerNorm's,
    an InstanceNorm's, a GroupNorm's statistics)."""
    mean = b.reduce("mean", xf, dims, True)
    d = b.map("sub", xf, mean)
    var = b.reduce("mean", b.map("mul", d, d), dims, True)
    return mean, d, b.map("rsqrt", b.map("add", var, b.scalar(float(eps), var)))


@handles("layer_norm", "native_layer_norm")
def _layer_norm(b, args, kwargs, out):
    x, shape = args[0], args[1]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    _, d, rstd = _centred(b, b.cast(x, _acc(b, x)), _norm_dims(b, x, shape), eps)
    y = b.map("mul", d, rstd)
    if w is not None:
        y = b.map("mul", y, w)
    if bias is not None:
        y = b.map("add", y, bias)
    return b.cast(y, out.dtype)


def _per_channel(b, v, x):
    """A [C] vector (a norm's weight, bias or running statistic) broadcast along dim 1 of x, in
    the type x is computed in."""
    rank = len(b.type(x).shape)
    return b.reshape(b.cast(v, b.type(x).dtype), (b.type(v).shape[0],) + (1,) * (rank - 2))


def _affine(b, y, w, bias):
    if w is not None:
        y = b.map("mul", y, _per_channel(b, w, y))
    if bias is not None:
        y = b.map("add", y, _per_channel(b, bias, y))
    return y


def _running(b, x, w, bias, rm, rv, eps, out):
    """x normalised with running statistics (a per-channel scale and shift), affine, in x's
    dtype: BatchNorm at inference, InstanceNorm told to use them."""
    xf = b.cast(x, _acc(b, x))
    rm, rv = _per_channel(b, rm, xf), _per_channel(b, rv, xf)
    y = b.map("mul", b.map("sub", xf, rm), b.map("rsqrt", b.map("add", rv, b.scalar(float(eps), rv))))
    return b.cast(_affine(b, y, w, bias), out.dtype)


@handles("batch_norm")
def _batch_norm(b, args, kwargs, out):
    """Inference (running statistics): a per-channel scale and shift, maps that join the kernels
    around them (a BatchNorm then ReLU is one map kernel). Batch statistics without running ones
    to update (`F.batch_norm(x, None, None, training=True)`, `track_running_stats=False`): the
    mean and biased variance over every dim but the channels (rules/apart_reductions.py reduces
    them a run of dims at a time, in one pass over x), then the same maps. A training-mode
    module's update of its running statistics stays PyTorch's."""
    x, w, bias, rm, rv, training = args[:6]
    eps = args[7] if len(args) > 7 else kwargs.get("eps", 1e-5)
    from ..graph.rules.apart_reductions import in_runs

    if training and rm is None and rv is None:
        shape = b.type(x).shape
        dims = (0,) + tuple(range(2, len(shape)))
        if len(shape) < 3 or not in_runs(shape, dims, True):
            raise Unsupported("batch statistics of fewer than 2^20 elements, or over one run of dims "
                              "(PyTorch's BatchNorm is one launch there)")
        made = next((n for n in reversed(b.nodes) if n.name == x), None)
        if isinstance(made, (ir.Map, ir.View)):
            # (the statistics' kernel and the normalisation's would each read it: written between
            # them, where PyTorch's BatchNorm reads the map's result once it is written)
            raise Unsupported("batch statistics of a computed or viewed tensor (a map's or a view's result)")
        _, d, rstd = _centred(b, b.cast(x, _acc(b, x)), dims, eps)
        return b.cast(_affine(b, b.map("mul", d, rstd), w, bias), out.dtype)
    if training or rm is None or rv is None:
        raise Unsupported("batch statistics and running statistics to update (training mode), or neither")
    return _running(b, x, w, bias, rm, rv, eps, out)


@handles("instance_norm")
def _instance_norm(b, args, kwargs, out):
    """Statistics over each channel's own elements: x viewed as [N, C, L] (L the elements after
    dim 1) and normalised along L, a row kernel at any N x C (not a merged reduction's, which
    leaves few rows to PyTorch), affine there too; or the running statistics where asked."""
    x, w, bias, rm, rv, use_input_stats = args[:6]
    eps = args[7] if len(args) > 7 else kwargs.get("eps", 1e-5)
    shape = b.type(x).shape
    if not use_input_stats:
        return _running(b, x, w, bias, rm, rv, eps, out)
    xr = b.reshape(x, (shape[0], shape[1], math.prod(shape[2:])))
    # (the cast after the view: a view of a cast would be a kernel's output, written and read back)
    _, d, rstd = _centred(b, b.cast(xr, _acc(b, x)), (2,), eps)
    y = b.map("mul", d, rstd)
    return b.reshape(b.cast(_affine(b, y, w, bias), out.dtype), shape)


@handles("group_norm")
def _group_norm(b, args, kwargs, out):
    """The statistics of each group (a row kernel over x viewed as [N, G, C / G x H x W]), then the
    normalisation over x's own shape, each group's mean and rsqrt broadcast to its channels (a
    view of the [N, G] statistics the map kernel reads in place): the maps after it (a UNet's
    SiLU) join that kernel."""
    x, groups = args[0], args[1]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    shape = b.type(x).shape
    N, C, rest = shape[0], shape[1], shape[2:]
    G = groups
    xf = b.cast(x, _acc(b, x))
    xg = b.cast(b.reshape(x, (N, G, C // G * math.prod(rest))), _acc(b, x))  # (cast after the view, as above)
    mean, _, rstd = _centred(b, xg, (2,), eps)

    def channels(t):  # [N, G, 1] -> [N, C, 1, ...]
        return b.reshape(b.view("expand", t, (N, G, C // G), (N, G, C // G)), (N, C) + (1,) * len(rest))

    y = b.map("mul", b.map("sub", xf, channels(mean)), channels(rstd))
    return b.cast(_affine(b, y, w, bias), out.dtype)


@handles("hardswish", "hardsigmoid")
def _hard(b, args, kwargs, out):
    """MobileNetV3's x * relu6(x + 3) / 6 and relu6(x + 3) / 6, in f32 for 16-bit x (as PyTorch)."""
    x = b.cast(args[0], _acc(b, args[0]))
    r = b.map("min", b.map("max", b.map("add", x, b.scalar(3.0, x)), b.scalar(0.0, x)), b.scalar(6.0, x))
    y = b.map("mul", x, r) if out.op == "hardswish" else r
    return b.cast(b.map("div", y, b.scalar(6.0, y)), out.dtype)


# -- views ---------------------------------------------------------------------------------------


@handles("view", "_unsafe_view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze")
def _reshape(b, args, kwargs, out):
    if out.dtype != b.type(args[0]).dtype:  # x.view(torch.int32): the same bits read as another type
        raise Unsupported("a dtype (a reinterpretation of the bits, not a conversion)")
    return b.reshape(args[0], out.shape)


@handles("permute", "transpose", "t", "swapaxes", "movedim", "numpy_T", "mT", "mH", "adjoint")
def _permute(b, args, kwargs, out):
    """Every spelling of a transpose is one permute view; `.T`, `.mT`, `.mH` reach export as their own ops
    (`mH` / `adjoint` conjugate too, which is nothing on the real dtypes tilefuse takes)."""
    x = args[0]
    rank = len(b.type(x).shape)
    name = out.op
    if name == "permute":
        perm = [p % rank for p in args[1]]
    elif name == "numpy_T":
        perm = list(reversed(range(rank)))
    elif name in ("mT", "mH", "adjoint"):
        if rank < 2:
            raise Unsupported(f"{name} of a {rank}-d tensor (it needs at least 2 dims)")
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    elif name in ("transpose", "swapaxes", "t"):
        d0, d1 = (args[1] % rank, args[2] % rank) if name != "t" else (0, 1 if rank > 1 else 0)
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    elif name == "movedim":
        src, dst = args[1], args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [d % rank for d in src], [d % rank for d in dst]
        rest = iter(d for d in range(rank) if d not in src)
        placed = dict(zip(dst, src))
        perm = [placed[i] if i in placed else next(rest) for i in range(rank)]
    else:
        raise Unsupported(name)
    if perm == list(range(rank)):
        return x
    return b.view("permute", x, out.shape, perm)


@handles("pixel_shuffle", "pixel_unshuffle")
def _pixel_shuffle(b, args, kwargs, out):
    """Views: [*, C r r, H, W] as [*, C, r, r, H, W], permuted to [*, C, H, r, W, r], reshaped to
    [*, C, H r, W r] (unshuffle the reverse). Maps after it read x in place, in tiles; alone it is
    the copy PyTorch's op is."""
    x, r = args[0], args[1]
    shape = b.type(x).shape
    lead, (C, H, W) = tuple(shape[:-3]), shape[-3:]
    k = len(lead)
    if out.op == "pixel_shuffle":
        c = C // (r * r)
        v = b.reshape(x, lead + (c, r, r, H, W))
        perm = list(range(k)) + [k, k + 3, k + 1, k + 4, k + 2]
        t = b.view("permute", v, lead + (c, H, r, W, r), perm)
    else:
        h, w = H // r, W // r
        v = b.reshape(x, lead + (C, h, r, w, r))
        perm = list(range(k)) + [k, k + 2, k + 4, k + 1, k + 3]
        t = b.view("permute", v, lead + (C, r, r, h, w), perm)
    return b.reshape(t, tuple(out.shape))


@handles("expand", "expand_as", "broadcast_to")
def _expand(b, args, kwargs, out):
    x = args[0]
    if b.type(x).shape == tuple(out.shape):
        return x
    src = b.type(x).shape
    src = (1,) * (len(out.shape) - len(src)) + src
    return b.view("expand", b.reshape(x, src), out.shape, out.shape)


@handles("slice")
def _slice(b, args, kwargs, out):
    x = args[0]
    shape = b.type(x).shape
    dim = (args[1] if len(args) > 1 else 0) % len(shape)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else shape[dim]
    step = args[4] if len(args) > 4 else 1
    start, end, _ = slice(start, end, step).indices(shape[dim])
    end = max(end, start)  # x[3:1] is empty, as in Python
    if (start, end, step) == (0, shape[dim], 1):
        return x
    return b.view("slice", x, out.shape, (dim, start, end, step))


@handles("roll")
def _roll(b, args, kwargs, out):
    """torch.roll as roll views (element i along a dim reads x's (i - shift) % size), one per
    dim; with no dims, of x flattened and shaped back."""
    x = args[0]
    shifts = args[1] if len(args) > 1 else kwargs["shifts"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims", ())
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(v, int) for v in shifts + dims):
        raise Unsupported("a roll by a tensor's value")
    shape = b.type(x).shape
    flat = not dims
    if flat:
        if len(shifts) != 1:
            raise Unsupported("several shifts with no dims")
        x, dims = b.reshape(x, (math.prod(shape),)), [0]
    if len(shifts) != len(dims):
        raise Unsupported(f"{len(shifts)} shifts for {len(dims)} dims")
    for shift, dim in zip(shifts, dims):
        t = b.type(x).shape
        dim %= len(t)
        if t[dim] and -shift % t[dim]:
            x = b.view("roll", x, t, (dim, -shift % t[dim]))
    return b.reshape(x, shape) if flat else x


@handles("narrow")
def _narrow(b, args, kwargs, out):
    """x.narrow(dim, start, length): x[..., start:start + length] along dim (start may count
    from the end, as PyTorch's does)."""
    x = args[0]
    shape = b.type(x).shape
    dim = (args[1] if len(args) > 1 else kwargs["dim"]) % len(shape)
    start = args[2] if len(args) > 2 else kwargs["start"]
    length = args[3] if len(args) > 3 else kwargs["length"]
    if not all(isinstance(v, int) for v in (start, length)):
        raise Unsupported("a narrow by a tensor's value")
    if start < 0:
        start += shape[dim]
    return _slice(b, (x, dim, start, start + length, 1), {}, out)


@handles("select")
def _select(b, args, kwargs, out):
    x, dim, i = args
    shape = b.type(x).shape
    dim %= len(shape)
    i %= shape[dim]
    s = b.view("slice", x, shape[:dim] + (1,) + shape[dim + 1:], (dim, i, i + 1, 1))
    return b.reshape(s, out.shape)


@handles("split", "split_with_sizes", "chunk", "unbind")
def _split(b, args, kwargs, out):
    """Every output as a slice of the input: a tuple, one name per output."""
    x = args[0]
    shape = b.type(x).shape
    if out.op == "unbind":
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(shape)
        rest = shape[:dim] + shape[dim + 1:]
        return tuple(b.reshape(_part(b, x, dim, i, i + 1), rest) for i in range(shape[dim]))
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(shape)
    n, arg = shape[dim], args[1]
    if out.op == "chunk":
        arg = -(-n // arg)
    sizes = [min(arg, n - s) for s in range(0, n, arg)] if isinstance(arg, int) else list(arg)
    starts = [0, *itertools.accumulate(sizes)][:-1]  # (a running total: 33,000 pieces summed afresh took 6 s)
    return tuple(_part(b, x, dim, s, s + k) for s, k in zip(starts, sizes))


def _part(b, x, dim, start, end):
    shape = b.type(x).shape
    if (start, end) == (0, shape[dim]):
        return x
    return b.view("slice", x, shape[:dim] + (end - start,) + shape[dim + 1:], (dim, start, end, 1))


@handles("gather")
def _gather(b, args, kwargs, out):
    x, dim, index = args[0], args[1], args[2]
    dim %= len(b.type(x).shape)
    return b.add(ir.Gather(b.fresh("gather"), ir.TensorType(out.shape, b.type(x).dtype), x, index, dim, b.source))


def _rows_of(b, x, dim: int, index, wrap: bool, out_shape):
    """x's slices along `dim` at the integers of `index` (any shape), in their place: one
    gather of x with size-1 dims for the index's leading dims, by the index with size-1 dims
    for x's others (ir.Gather expands both), so a kernel reads each slice's index once.
    `wrap`: negative indices count from the end (x[idx])."""
    t = b.type(index)
    if dtypes.is_float(t.dtype) or t.dtype == "bool":
        raise Unsupported(f"an index of dtype {t.dtype}")
    shape, ishape = b.type(x).shape, t.shape or (1,)
    if not shape:
        raise Unsupported("a 0-d tensor")
    k = len(ishape)
    table = b.reshape(x, shape[:dim] + (1,) * (k - 1) + shape[dim:])
    idx = b.reshape(index, (1,) * dim + ishape + (1,) * (len(shape) - dim - 1))
    got = b.add(ir.Gather(b.fresh("gather"), ir.TensorType(shape[:dim] + ishape + shape[dim + 1:], b.type(x).dtype),
                          table, idx, dim + k - 1, b.source, wrap))
    return b.reshape(got, out_shape)


def _positions(b, rank: int, d: int, n: int, dtype: str = "i64"):
    """0 .. n-1 along dim d of a rank-`rank` tensor, of size 1 elsewhere: an index to gather by."""
    return b.add(ir.Iota(b.fresh("iota"), ir.TensorType((1,) * d + (n,) + (1,) * (rank - d - 1), dtype), d, b.source))


def _gathered(b, x, d: int, index, n: int):
    """x's slices along d at `index` (n of them, every one in range)."""
    shape = b.type(x).shape
    return b.add(ir.Gather(b.fresh("gather"), ir.TensorType(shape[:d] + (n,) + shape[d + 1:], b.type(x).dtype),
                           x, index, d, b.source))


def _static(b, x: str) -> bool:
    """Whether x is made of weights and constants alone (graph/fold.py folds PyTorch's op of it
    into a weight once, when compiling: `torch.tril(torch.ones(T, T))`, `w.repeat(4, 1)`)."""
    nodes = {n.name: n for n in b.nodes}
    todo, seen = [x], set()
    while todo:
        n = nodes[todo.pop()]
        if isinstance(n, ir.Input):
            return False
        seen.add(n.name)
        todo += [a for a in ir.node_args(n) if a not in seen]
    return True


@handles("repeat", "tile")
def _repeat(b, args, kwargs, out):
    """x.repeat(r0, r1, ...) and torch.tile as views: each dim of size n becomes (1, n) expanded
    to (r, n) and merged, element i reading x at i % n, so a kernel reading the result reads x
    in place (rules/result_copies.py copies it where it is the result). Of a weight or constant,
    PyTorch's op, which folds into a weight (a view's copy would run every call)."""
    x = args[0]
    if _static(b, x):
        raise Unsupported("a tensor made of weights and constants (folded when compiling)")
    reps = [int(r) for r in (args[1] if len(args) > 1 else kwargs.get("repeats", kwargs.get("dims")))]
    shape = b.type(x).shape
    if out.op == "tile" and len(reps) < len(shape):  # (tile pads its reps with ones in front)
        reps = [1] * (len(shape) - len(reps)) + reps
    if len(reps) < len(shape):
        raise Unsupported("fewer repeats than dims")
    shape = (1,) * (len(reps) - len(shape)) + tuple(shape)
    split = tuple(v for n in shape for v in (1, n))
    wide = tuple(v for n, r in zip(shape, reps) for v in (r, n))
    return b.reshape(b.view("expand", b.reshape(x, split), wide, wide), out.shape)


@handles("tril", "triu")
def _tril(b, args, kwargs, out):
    """x's lower (tril) or upper (triu) triangle over its last two dims, from `diagonal` on, and
    zeros elsewhere: where(col - row <= k (tril) / >= k (triu), x, 0), the positions iotas. Of a
    weight or constant (a causal mask from `ones`), PyTorch's op, which folds into a weight."""
    x = args[0]
    if _static(b, x):
        raise Unsupported("a tensor made of weights and constants (folded when compiling)")
    k = int(args[1] if len(args) > 1 else kwargs.get("diagonal", 0))
    shape = b.type(x).shape
    if len(shape) < 2:
        raise Unsupported("a tensor of fewer than 2 dims")
    rank = len(shape)
    diag = b.map("sub", _positions(b, rank, rank - 1, shape[-1]), _positions(b, rank, rank - 2, shape[-2]))
    keep = b.map("le" if out.op == "tril" else "ge", diag, b.const(k, "i64"))
    return b.map("where", keep, x, b.scalar(0, x))


@handles("flip")
def _flip(b, args, kwargs, out):
    """x read backwards along each dim: a gather at n - 1 - i."""
    x = args[0]
    if not dtypes.is_float(b.type(x).dtype):  # (a kernel gathers floats only: torch's own flip, not a torch.gather)
        raise Unsupported(f"a {b.type(x).dtype} tensor")
    dims = args[1] if len(args) > 1 else kwargs["dims"]
    rank = len(b.type(x).shape)
    for d in sorted({wrap_dim(d, rank) for d in ([dims] if isinstance(dims, int) else dims)}):
        n = b.type(x).shape[d]
        if n > 1:
            x = _gathered(b, x, d, b.map("sub", b.const(n - 1, "i64"), _positions(b, rank, d, n)), n)
    return x


@handles("pad", "constant_pad_nd")
def _pad(b, args, kwargs, out):
    """F.pad, constant or replicate: along each padded dim a gather at the clamped position i -
    before (replicate: that is all), then the value outside the tensor (constant). A negative
    pad crops: the gather starts further in (a slice where nothing is padded)."""
    x, pads = args[0], list(args[1] if len(args) > 1 else kwargs["pad"])
    mode = (args[2] if len(args) > 2 else kwargs.get("mode", "constant")) if out.op == "pad" else "constant"
    value = (args[3] if len(args) > 3 else kwargs.get("value")) if out.op == "pad" else (
        args[2] if len(args) > 2 else kwargs.get("value", 0))
    if mode not in ("constant", "replicate"):
        raise Unsupported(f"mode {mode!r}")
    if not dtypes.is_float(b.type(x).dtype):  # (a kernel gathers floats only: torch's own pad of a mask)
        raise Unsupported(f"a {b.type(x).dtype} tensor")
    if not all(isinstance(p, int) for p in pads) or len(pads) % 2:
        raise Unsupported("pads that are not pairs of ints")
    rank = len(b.type(x).shape)
    for k in range(len(pads) // 2):
        d, lo, hi = rank - 1 - k, pads[2 * k], pads[2 * k + 1]
        t = b.type(x).shape
        n = t[d]
        first, last = max(-lo, 0), n - max(-hi, 0)  # a negative pad crops: what is kept of x
        if last < first:
            raise Unsupported("a crop larger than the dim")
        lo, hi, n = max(lo, 0), max(hi, 0), last - first
        if not lo and not hi:
            if n != t[d]:
                x = b.view("slice", x, t[:d] + (n,) + t[d + 1:], (d, first, last, 1))
            continue
        if n == 0:
            raise Unsupported("padding an empty dim")
        m = n + lo + hi
        pos = _positions(b, rank, d, m)
        at = b.map("min", b.map("max", b.map("sub", pos, b.const(lo, "i64")), b.const(0, "i64")),
                   b.const(n - 1, "i64"))
        g = _gathered(b, x, d, b.map("add", at, b.const(first, "i64")) if first else at, m)
        if mode == "constant":
            inside = b.map("and", b.map("ge", pos, b.const(lo, "i64")), b.map("lt", pos, b.const(lo + n, "i64")))
            g = b.map("where", inside, g, b.scalar(0 if value is None else value, g))
        x = g
    return b.cast(x, out.dtype)


@handles("embedding")
def _embedding(b, args, kwargs, out):
    """weight[indices]: its rows at the token ids (padding_idx matters only to gradients)."""
    return _rows_of(b, args[0], 0, args[1], False, out.shape)


@handles("index_select")
def _index_select(b, args, kwargs, out):
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs["dim"]) % max(len(b.type(x).shape), 1)
    return _rows_of(b, x, dim, args[2] if len(args) > 2 else kwargs["index"], False, out.shape)


@handles("index")
def _index(b, args, kwargs, out):
    """x[..., idx] with one integer tensor: the slices at idx (negative ones from the end);
    several index tensors and boolean masks are left to PyTorch."""
    x, indices = args[0], list(args[1] if len(args) > 1 else kwargs["indices"])
    given = [i for i, v in enumerate(indices) if v is not None]
    if len(given) != 1:
        raise Unsupported(f"{len(given)} index tensors")
    return _rows_of(b, x, given[0], indices[given[0]], True, out.shape)


# -- contractions and attention ---------------------------------------------------------------------


def _matmul(b, x, y, shape, dtype):
    tx, ty = b.type(x).dtype, b.type(y).dtype
    if tx != ty:  # torch.export lets it through; PyTorch's kernels refuse it when run
        raise ValueError(f"operands of different dtypes ({tx} @ {ty}); PyTorch's matmul needs one dtype")
    return b.add(ir.Contraction(b.fresh("matmul"), ir.TensorType(tuple(shape), dtype), x, y, b.source))


@handles("matmul", "mm", "bmm")
def _mm(b, args, kwargs, out):
    return _matmul(b, args[0], args[1], out.shape, out.dtype)


@handles("einsum")
def _einsum(b, args, kwargs, out):
    """A two-operand einsum as one batched matmul between views: a is arranged as
    [batch, left, contracted], b as [batch, contracted, right] (b's last two dims swapped is
    a transpose the GEMM reads through), the product viewed back into the output's order."""
    eq, ops = args[0], args[1]
    if len(ops) != 2 or "..." in eq or "->" not in eq:
        raise Unsupported("other than two operands and an explicit output (no '...')")
    lhs, res = eq.replace(" ", "").split("->")
    sa, sb = lhs.split(",")
    x, y = ops
    if len(set(sa)) != len(sa) or len(set(sb)) != len(sb) or len(set(res)) != len(res):
        raise Unsupported("a repeated index (a diagonal or trace)")
    if any(c not in sa + sb for c in res) or any(c not in res and c not in sb for c in sa) \
            or any(c not in res and c not in sa for c in sb):
        raise Unsupported("an index summed within one operand")
    size = {c: n for c, n in zip(sa, b.type(x).shape)}
    size.update({c: n for c, n in zip(sb, b.type(y).shape)})
    batch = [c for c in res if c in sa and c in sb]
    left = [c for c in res if c in sa and c not in sb]
    right = [c for c in res if c in sb and c not in sa]
    summed = [c for c in sa if c in sb and c not in res]
    if any(b.type(x).shape[sa.index(c)] != b.type(y).shape[sb.index(c)] for c in batch + summed):
        raise Unsupported("broadcast dims")

    def arrange(t, spec, order, shape3):
        perm = [spec.index(c) for c in order]
        if perm != list(range(len(perm))):
            t = b.view("permute", t, tuple(size[c] for c in order), perm)
        return b.reshape(t, shape3)

    prod = lambda cs: math.prod(size[c] for c in cs)  # noqa: E731
    nb, nl, nr, nk = prod(batch), prod(left), prod(right), prod(summed)
    lead = (nb,) if nb > 1 else ()
    a3 = arrange(x, sa, batch + left + summed, lead + (nl, nk))
    if [sb.index(c) for c in batch + summed + right] == list(range(len(sb))):
        b3 = arrange(y, sb, batch + summed + right, lead + (nk, nr))  # as stored: a row-major B
    else:  # as [batch, right, contracted], its last two dims swapped: a K-major B, read as stored
        bt = arrange(y, sb, batch + right + summed, lead + (nr, nk))
        b3 = b.view("permute", bt, lead + (nk, nr), (0, 2, 1) if nb > 1 else (1, 0))
    y3 = _matmul(b, a3, b3, lead + (nl, nr), out.dtype)
    order = batch + left + right
    y = b.reshape(y3, tuple(size[c] for c in order))
    perm = [order.index(c) for c in res]
    if perm != list(range(len(perm))):
        y = b.view("permute", y, out.shape, perm)
    return y


@handles("linear")
def _linear(b, args, kwargs, out):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    wt = b.view("permute", w, tuple(reversed(b.type(w).shape)), (1, 0))
    y = _matmul(b, x, wt, out.shape, out.dtype)
    return b.map("add", y, bias) if bias is not None else y


@handles("addmm", "baddbmm")
def _addmm(b, args, kwargs, out):
    """beta · bias + alpha · (x @ w): baddbmm is addmm of batched operands (Bloom's ALiBi
    scores, `alibi.baddbmm(q, kᵀ, alpha=1/√d)`), which eager_attention_as_sdpa then finds."""
    bias, x, w = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not dtypes.is_float(out.dtype) and any(isinstance(v, float) and not v.is_integer() for v in (beta, alpha)):
        raise Unsupported("a fractional beta or alpha on integer tensors")  # PyTorch truncates them
    if not dtypes.is_float(out.dtype):  # a whole float stays an integer factor (not an f32 one)
        beta, alpha = int(beta), int(alpha)
    y = _matmul(b, x, w, out.shape, out.dtype)
    if alpha != 1:
        y = b.map("mul", y, b.scalar(alpha, y))
    if beta == 0:
        return y  # PyTorch ignores the input then, NaN and inf included
    return b.map("add", y, bias if beta == 1 else b.map("mul", bias, b.scalar(beta, bias)))


@handles("scaled_dot_product_attention")
def _sdpa(b, args, kwargs, out):
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
    if dropout:
        raise Unsupported("attention dropout")
    return b.add(ir.Attention(b.fresh("attention"), ir.TensorType(out.shape, out.dtype), q, k, v,
                              bool(causal), scale, mask if _is_tensor(b, mask) else None, b.source))


# -- losses ----------------------------------------------------------------------------------------


def _target_logit(b, xf, target):
    """x[i, target[i]] as a masked row sum, so it fuses into the row's single pass."""
    n, c = b.type(xf).shape
    col = b.add(ir.Iota(b.fresh("iota"), ir.TensorType((c,), "i64"), 0, b.source))
    hit = b.map("eq", col, b.reshape(target, (n, 1)))
    return b.reduce("sum", b.map("where", hit, xf, b.scalar(0.0, xf)), (1,), False)


def _nan_outside_classes(b, loss, target, valid, classes: int):
    """NaN where a target that is not ignore_index lies outside [0, classes). Eager stops there
    with a device-side assert; the masked row sum of `_target_logit` would find no column and
    give the log-sum-exp alone, a plausible loss. A NaN carries through the mean, so it is seen."""
    inside = b.map("and", b.map("ge", target, b.scalar(0, target)), b.map("lt", target, b.scalar(classes, target)))
    fine = b.map("or", inside, b.map("not", valid))
    return b.map("where", fine, loss, b.scalar(float("nan"), loss))


def _reduce_loss(b, loss, valid, reduction):
    if reduction == 0:  # none
        return loss
    total = b.reduce("sum", loss, (0,), False)
    if reduction == 2:  # sum
        return total
    count = b.reduce("sum", b.cast(valid, "f32"), (0,), False)
    return b.map("div", total, count)


@handles("cross_entropy_loss")
def _cross_entropy(b, args, kwargs, out):
    x, target = args[0], args[1]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    smoothing = args[5] if len(args) > 5 else kwargs.get("label_smoothing", 0.0)
    if weight is not None or smoothing:
        raise Unsupported("class weights or label smoothing")
    if len(b.type(x).shape) != 2 or b.type(target).dtype not in ("i64", "i32"):
        raise Unsupported("logits that are not (N, C) with integer class targets")
    xf = b.cast(x, _acc(b, x))
    m = b.reduce("max", xf, (1,), True)
    log_sum = b.map("log", b.reduce("sum", b.map("exp", b.map("sub", xf, m)), (1,), True))
    # (max - x[target]) + log(sum): the row's max and its target logit cancel first, as log_softmax's
    # x - max does; lse - x[target] would round lse at the logits' magnitude (2^-13 near 2048 in f32)
    rows = b.type(target).shape
    loss = b.map("add", b.map("sub", b.reshape(m, rows), _target_logit(b, xf, target)), b.reshape(log_sum, rows))
    valid = b.map("ne", target, b.scalar(ignore, target))
    loss = b.map("where", valid, loss, b.scalar(0.0, loss))
    loss = _nan_outside_classes(b, loss, target, valid, b.type(x).shape[1])
    return b.cast(_reduce_loss(b, loss, valid, reduction), out.dtype)


@handles("nll_loss", "nll_loss_nd")
def _nll_loss(b, args, kwargs, out):
    x, target = args[0], args[1]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    if weight is not None or len(b.type(x).shape) != 2:
        raise Unsupported("class weights or input that is not (N, C)")
    xf = b.cast(x, _acc(b, x))
    loss = b.map("neg", _target_logit(b, xf, target))
    valid = b.map("ne", target, b.scalar(ignore, target))
    loss = b.map("where", valid, loss, b.scalar(0.0, loss))
    loss = _nan_outside_classes(b, loss, target, valid, b.type(x).shape[1])
    return b.cast(_reduce_loss(b, loss, valid, reduction), out.dtype)

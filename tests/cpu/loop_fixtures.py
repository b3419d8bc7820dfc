"""Hand-written Loop IR kernels of the map-reduce family, with inputs and PyTorch references.

Shared by the Loop IR tests (verifier, canonical form, interpreter) and the CUDA code
generator's tests, so each kernel here is the shape the lowering produces (loop/ir.py):

    parallel for r in 0..R:                 # one row per iteration
        <row scalars: Consts, row loads>
        %s = reduce sum c in 0..C: ...      # reductions along the row
        for c in 0..C: ... store            # maps along the row

and computes in `dtypes.compute_type(dtype)` (f32 for bf16/f16): Load narrow -> cast f32 ->
math -> cast narrow -> Store. Each `*_kernel(R, C, dtype, ...)` builds the kernel;
`example(name, R, C, dtype, seed)` bundles a kernel with fresh random inputs and a PyTorch
reference function; `check_against_torch` applies DESIGN.md's 2x rule.

Import from a test as `from loop_fixtures import ...` (tests/cpu is on sys.path under
pytest's default import mode) — this module is not itself a test file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tilefuse import dtypes
from tilefuse.loop.ir import Buffer, Const, IndexValue, Kernel, Load, Loop, Op, Reduce, Store, Val, Var

R_, C_ = Var("r"), Var("c")


def _load(dst: str, buf: str, index: tuple, dtype: str) -> tuple:
    """Load buf[index] as the compute-type value %dst (with a widening cast for bf16/f16)."""
    ct = dtypes.compute_type(dtype)
    if ct == dtype:
        return (Load(dst, buf, index),)
    return (Load(dst + "_in", buf, index), Op(dst, "cast", (dst + "_in",), ct))


def _store(buf: str, index: tuple, value: str, dtype: str) -> tuple:
    """Store compute-type %value into a `dtype` buffer (with a narrowing cast for bf16/f16)."""
    if dtypes.compute_type(dtype) == dtype:
        return (Store(buf, index, value),)
    return (Op(value + "_out", "cast", (value,), dtype), Store(buf, index, value + "_out"))


def _row_kernel(name: str, params: tuple, R: int, row_body: tuple) -> Kernel:
    return Kernel(name, params, (Loop("r", R, row_body, parallel=True),))


def rmsnorm_kernel(R: int, C: int, dtype: str = "bf16", eps: float = 1e-6) -> Kernel:
    """y = x * rsqrt(mean(x^2) + eps) * w, per row of x[R, C]; w[C]."""
    ct = dtypes.compute_type(dtype)
    row = (
        Const("n", float(C), ct),
        Const("eps", float(eps), ct),
        Reduce("ss", "sum", "c", C, (
            *_load("x0", "x", (R_, C_), dtype),
            Op("sq", "mul", ("x0", "x0"), ct),
        ), "sq", ct),
        Op("ms", "div", ("ss", "n"), ct),
        Op("mse", "add", ("ms", "eps"), ct),
        Op("rstd", "rsqrt", ("mse",), ct),
        Loop("c", C, (
            *_load("x1", "x", (R_, C_), dtype),
            *_load("w1", "w", (C_,), dtype),
            Op("xn", "mul", ("x1", "rstd"), ct),
            Op("y1", "mul", ("xn", "w1"), ct),
            *_store("y", (R_, C_), "y1", dtype),
        )),
    )
    params = (Buffer("x", (R, C), dtype, "in"), Buffer("w", (C,), dtype, "in"), Buffer("y", (R, C), dtype, "out"))
    return _row_kernel("rmsnorm", params, R, row)


def softmax_kernel(R: int, C: int, dtype: str = "bf16") -> Kernel:
    """y = exp(x - max(x)) / sum(exp(x - max(x))), per row of x[R, C]."""
    ct = dtypes.compute_type(dtype)
    row = (
        Reduce("m", "max", "c", C, _load("x0", "x", (R_, C_), dtype), "x0", ct),
        Reduce("s", "sum", "c", C, (
            *_load("x1", "x", (R_, C_), dtype),
            Op("d1", "sub", ("x1", "m"), ct),
            Op("e1", "exp", ("d1",), ct),
        ), "e1", ct),
        Op("inv", "recip", ("s",), ct),
        Loop("c", C, (
            *_load("x2", "x", (R_, C_), dtype),
            Op("d2", "sub", ("x2", "m"), ct),
            Op("e2", "exp", ("d2",), ct),
            Op("p", "mul", ("e2", "inv"), ct),
            *_store("y", (R_, C_), "p", dtype),
        )),
    )
    params = (Buffer("x", (R, C), dtype, "in"), Buffer("y", (R, C), dtype, "out"))
    return _row_kernel("softmax", params, R, row)


def cross_entropy_kernel(R: int, C: int, dtype: str = "bf16") -> Kernel:
    """loss[r] = logsumexp(x[r, :]) - x[r, target[r]], in the compute type (f32 for bf16/f32).

    The target logit is selected with `IndexValue(c) == target` inside a sum (the form the
    LM-head epilogue uses); targets must lie in [0, C).
    """
    ct = dtypes.compute_type(dtype)
    row = (
        Load("t", "target", (R_,)),
        Const("zero", 0.0, ct),
        Reduce("m", "max", "c", C, _load("x0", "x", (R_, C_), dtype), "x0", ct),
        Reduce("s", "sum", "c", C, (
            *_load("x1", "x", (R_, C_), dtype),
            Op("d1", "sub", ("x1", "m"), ct),
            Op("e1", "exp", ("d1",), ct),
        ), "e1", ct),
        Reduce("xt", "sum", "c", C, (
            *_load("x2", "x", (R_, C_), dtype),
            IndexValue("ci", C_, "i64"),
            Op("hit", "eq", ("ci", "t"), "bool"),
            Op("sel", "where", ("hit", "x2", "zero"), ct),
        ), "sel", ct),
        Op("ls", "log", ("s",), ct),
        Op("lse", "add", ("m", "ls"), ct),
        Op("loss1", "sub", ("lse", "xt"), ct),
        Store("loss", (R_,), "loss1"),
    )
    params = (Buffer("x", (R, C), dtype, "in"), Buffer("target", (R,), "i64", "in"),
              Buffer("loss", (R,), ct, "out"))
    return _row_kernel("cross_entropy", params, R, row)


def layernorm_kernel(R: int, C: int, dtype: str = "bf16", eps: float = 1e-5) -> Kernel:
    """y = (x - mean) * rsqrt(var + eps) * w + b per row (two-pass variance)."""
    ct = dtypes.compute_type(dtype)
    row = (
        Const("n", float(C), ct),
        Const("eps", float(eps), ct),
        Reduce("s1", "sum", "c", C, _load("x0", "x", (R_, C_), dtype), "x0", ct),
        Op("mean", "div", ("s1", "n"), ct),
        Reduce("s2", "sum", "c", C, (
            *_load("x1", "x", (R_, C_), dtype),
            Op("d1", "sub", ("x1", "mean"), ct),
            Op("dd", "mul", ("d1", "d1"), ct),
        ), "dd", ct),
        Op("var", "div", ("s2", "n"), ct),
        Op("vare", "add", ("var", "eps"), ct),
        Op("rstd", "rsqrt", ("vare",), ct),
        Loop("c", C, (
            *_load("x2", "x", (R_, C_), dtype),
            *_load("w2", "w", (C_,), dtype),
            *_load("b2", "b", (C_,), dtype),
            Op("d2", "sub", ("x2", "mean"), ct),
            Op("xn", "mul", ("d2", "rstd"), ct),
            Op("yw", "mul", ("xn", "w2"), ct),
            Op("y2", "add", ("yw", "b2"), ct),
            *_store("y", (R_, C_), "y2", dtype),
        )),
    )
    params = (Buffer("x", (R, C), dtype, "in"), Buffer("w", (C,), dtype, "in"), Buffer("b", (C,), dtype, "in"),
              Buffer("y", (R, C), dtype, "out"))
    return _row_kernel("layernorm", params, R, row)


def _residual(suffix: str, dtype: str) -> tuple:
    """%h<suffix> = x + res rounded to `dtype` (as PyTorch's own add would), widened again."""
    ct = dtypes.compute_type(dtype)
    stmts = (*_load("a" + suffix, "x", (R_, C_), dtype), *_load("r" + suffix, "res", (R_, C_), dtype))
    if ct == dtype:
        return stmts + (Op("h" + suffix, "add", ("a" + suffix, "r" + suffix), ct),)
    return stmts + (
        Op("hs" + suffix, "add", ("a" + suffix, "r" + suffix), ct),
        Op("hn" + suffix, "cast", ("hs" + suffix,), dtype),
        Op("h" + suffix, "cast", ("hn" + suffix,), ct),
    )


def add_rmsnorm_kernel(R: int, C: int, dtype: str = "bf16", eps: float = 1e-6) -> Kernel:
    """h = x + res (stored, in `dtype`); y = rmsnorm(h) * w — the pre-norm residual block."""
    ct = dtypes.compute_type(dtype)
    narrow_h = "h1" if ct == dtype else "hn1"
    row = (
        Const("n", float(C), ct),
        Const("eps", float(eps), ct),
        Reduce("ss", "sum", "c", C, (*_residual("0", dtype), Op("sq", "mul", ("h0", "h0"), ct)), "sq", ct),
        Op("ms", "div", ("ss", "n"), ct),
        Op("mse", "add", ("ms", "eps"), ct),
        Op("rstd", "rsqrt", ("mse",), ct),
        Loop("c", C, (
            *_residual("1", dtype),
            Store("h", (R_, C_), narrow_h),
            *_load("w1", "w", (C_,), dtype),
            Op("hr", "mul", ("h1", "rstd"), ct),
            Op("y1", "mul", ("hr", "w1"), ct),
            *_store("y", (R_, C_), "y1", dtype),
        )),
    )
    params = (Buffer("x", (R, C), dtype, "in"), Buffer("res", (R, C), dtype, "in"), Buffer("w", (C,), dtype, "in"),
              Buffer("h", (R, C), dtype, "out"), Buffer("y", (R, C), dtype, "out"))
    return _row_kernel("add_rmsnorm", params, R, row)


def map_kernel(R: int, C: int, dtype: str = "bf16") -> Kernel:
    """z = silu(x) * y elementwise (the SwiGLU product): a row loop with one map, no reduction."""
    ct = dtypes.compute_type(dtype)
    row = (
        Loop("c", C, (
            *_load("x0", "x", (R_, C_), dtype),
            *_load("y0", "y", (R_, C_), dtype),
            Op("sg", "sigmoid", ("x0",), ct),
            Op("sl", "mul", ("x0", "sg"), ct),
            Op("z0", "mul", ("sl", "y0"), ct),
            *_store("z", (R_, C_), "z0", dtype),
        )),
    )
    params = (Buffer("x", (R, C), dtype, "in"), Buffer("y", (R, C), dtype, "in"), Buffer("z", (R, C), dtype, "out"))
    return _row_kernel("silu_mul", params, R, row)


def gather_kernel(R: int, C: int, dtype: str = "bf16", V: int = 11) -> Kernel:
    """out[r, c] = table[ids[r], c] — an embedding lookup, the row index a Val (gather)."""
    row = (
        Load("id", "ids", (R_,)),
        Loop("c", C, (
            Load("e", "table", (Val("id"), C_)),
            Store("out", (R_, C_), "e"),
        )),
    )
    params = (Buffer("table", (V, C), dtype, "in"), Buffer("ids", (R,), "i64", "in"),
              Buffer("out", (R, C), dtype, "out"))
    return _row_kernel("embedding", params, R, row)


# ---------------------------------------------------------------- inputs and references


@dataclass(frozen=True)
class Example:
    """A kernel, fresh inputs for it, and what PyTorch computes from those inputs.

    `reference(tensors)` maps input tensors to output tensors by name; called on the
    inputs in their own dtype it gives PyTorch's low-precision answer, called on the
    inputs widened to float64 it gives the reference.
    """

    name: str
    kernel: Kernel
    inputs: dict
    reference: Callable[[dict], dict]


def _rmsnorm_ref(eps):
    return lambda t: {"y": F.rms_norm(t["x"], (t["x"].shape[-1],), t["w"], eps)}


def _add_rmsnorm_ref(eps):
    def ref(t):
        h = t["x"] + t["res"]
        return {"h": h, "y": F.rms_norm(h, (h.shape[-1],), t["w"], eps)}

    return ref


def _layernorm_ref(eps):
    return lambda t: {"y": F.layer_norm(t["x"], (t["x"].shape[-1],), t["w"], t["b"], eps)}


def example(name: str, R: int, C: int, dtype: str = "bf16", seed: int = 0) -> Example:
    """The fixture `name` at shape R x C with random normal inputs drawn from `seed`."""
    rng = np.random.default_rng(seed)
    np_dt = dtypes.to_numpy(dtype)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np_dt)

    if name == "rmsnorm":
        return Example(name, rmsnorm_kernel(R, C, dtype, 1e-6), {"x": normal(R, C), "w": normal(C)}, _rmsnorm_ref(1e-6))
    if name == "softmax":
        return Example(name, softmax_kernel(R, C, dtype), {"x": normal(R, C, scale=3.0)},
                       lambda t: {"y": torch.softmax(t["x"], -1)})
    if name == "cross_entropy":
        inputs = {"x": normal(R, C, scale=3.0), "target": rng.integers(0, C, R).astype(np.int64)}
        return Example(name, cross_entropy_kernel(R, C, dtype), inputs,
                       lambda t: {"loss": F.cross_entropy(t["x"], t["target"], reduction="none")})
    if name == "layernorm":
        inputs = {"x": normal(R, C) + np_dt.type(0.5), "w": normal(C), "b": normal(C)}
        return Example(name, layernorm_kernel(R, C, dtype, 1e-5), inputs, _layernorm_ref(1e-5))
    if name == "add_rmsnorm":
        inputs = {"x": normal(R, C), "res": normal(R, C), "w": normal(C)}
        return Example(name, add_rmsnorm_kernel(R, C, dtype, 1e-6), inputs, _add_rmsnorm_ref(1e-6))
    if name == "map":
        return Example(name, map_kernel(R, C, dtype), {"x": normal(R, C, scale=2.0), "y": normal(R, C)},
                       lambda t: {"z": F.silu(t["x"]) * t["y"]})
    if name == "gather":
        V = 11
        inputs = {"table": normal(V, C), "ids": rng.integers(0, V, R).astype(np.int64)}
        return Example(name, gather_kernel(R, C, dtype, V), inputs, lambda t: {"out": t["table"][t["ids"]]})
    raise KeyError(f"no fixture named {name!r}; known: {', '.join(NAMES)}")


NAMES = ("rmsnorm", "softmax", "cross_entropy", "layernorm", "add_rmsnorm", "map", "gather")
BUILDERS = {
    "rmsnorm": rmsnorm_kernel, "softmax": softmax_kernel, "cross_entropy": cross_entropy_kernel,
    "layernorm": layernorm_kernel, "add_rmsnorm": add_rmsnorm_kernel, "map": map_kernel,
    "gather": gather_kernel,
}


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A NumPy array (bf16 included, via its bits) as a torch tensor of the same dtype."""
    if a.dtype == dtypes.to_numpy("bf16"):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def to_f64(a: np.ndarray) -> np.ndarray:
    """Values as float64 (exactly), for error measurement."""
    return a.astype(np.float32).astype(np.float64) if a.dtype.kind not in "fiub" else a.astype(np.float64)


def torch_outputs(ex: Example) -> tuple[dict, dict]:
    """(PyTorch's answer on the inputs as given, the float64 reference), as float64 arrays."""
    lowp = {k: to_torch(v) for k, v in ex.inputs.items()}
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in lowp.items()}
    as64 = lambda d: {k: v.double().numpy() for k, v in d.items()}  # noqa: E731
    return as64(ex.reference(lowp)), as64(ex.reference(wide))


def check_against_torch(ex: Example, ours: dict, floor: float = 1e-6) -> None:
    """Assert DESIGN.md's rule for each output: no NaN, and
    max |ours - ref| <= 2 * max |torch - ref| + floor * max(1, max |ref|).

    `ref` is PyTorch in float64 on the same inputs; `torch` is PyTorch in the inputs' dtype.
    The floor (about 8 f32 ulps of the output's magnitude) only matters for f32 kernels,
    whose summation order legitimately differs from PyTorch's by an ulp or two.
    """
    lowp, ref = torch_outputs(ex)
    assert set(ours) == set(ref), f"{ex.name}: outputs {sorted(ours)} != {sorted(ref)}"
    for name, r in ref.items():
        got = to_f64(ours[name])
        assert got.shape == r.shape, f"{ex.name}.{name}: shape {got.shape} != {r.shape}"
        assert not np.isnan(got).any(), f"{ex.name}.{name}: NaN in output"
        ours_err = float(np.max(np.abs(got - r), initial=0.0))
        torch_err = float(np.max(np.abs(lowp[name] - r), initial=0.0))
        scaled_floor = floor * max(1.0, float(np.max(np.abs(r), initial=0.0)))
        assert ours_err <= 2 * torch_err + scaled_floor, (
            f"{ex.name}.{name}: error {ours_err:.3g} vs PyTorch's own {torch_err:.3g} "
            f"(2x rule, floor {scaled_floor:.3g})")


def index_value(e, env: dict) -> int:
    """A Loop IR index expression's value at loop variables `env` (C's // and % on
    non-negative ints): for checking composed indices element by element."""
    from tilefuse.loop import ir as L

    if isinstance(e, L.Var):
        return env[e.name]
    if isinstance(e, L.IConst):
        return e.value
    a, b = index_value(e.a, env), index_value(e.b, env)
    if e.op == "+":
        return a + b
    if e.op == "*":
        return a * b
    return a // b if e.op == "//" else a % b

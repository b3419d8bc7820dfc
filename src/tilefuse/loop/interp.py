"""A vectorized NumPy interpreter for Loop IR kernels.

It is the reference the CUDA kernels are checked against and the CPU execution path, so
it favours plain, checkable semantics over speed, while being fast enough for
transformer-sized tensors: instead of a Python loop per element, each loop body runs once
with its loop variable bound to an `arange` laid along an axis of its own (axis d for the
loop at nesting depth d). Every SSA value is then an ndarray with one axis per loop level
of the kernel, of size 1 along the loops it does not depend on, and NumPy broadcasting
does the rest. A `Reduce` reduces its value along its variable's axis, a `Scan` accumulates
it along its loop's.

Semantics (what a CUDA kernel must match):
- an `Op` computes in its stated dtype; bf16/f16 ops compute in f32 and round once
  (what a C++ `__nv_bfloat16` op does), comparisons give bool, `cast` converts like C
  (float -> int truncates toward zero, anything -> bool is `!= 0`);
- a `Reduce` accumulates in `dtypes.compute_type(dtype)` and rounds the result once;
  its order of accumulation is unspecified, as on the GPU;
- index arithmetic is int64 with C's `/` and `%` (truncation toward zero);
- loads check every index against the buffer's shape (no wrap-around of negatives);
- outputs start poisoned (NaN, the integer dtype's most extreme value, False for bool)
  and each output element must be written exactly once: a second write or an element
  never written is an error (tracked by a mask, not by the poison), because on the GPU
  either would be a race or garbage.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes, ops
from .ir import IConst, Index, IndexValue, Kernel, Const, Load, Loop, Op, Reduce, Scan, Store, Val, Var
from .verify import verify

_LOW_PRECISION = ("bf16", "f16")


@dataclass(frozen=True)
class _Frame:
    """The environment of one block: visible values, loop-variable axes, iteration shape."""

    values: dict  # SSA name -> ndarray of ndim == kernel depth
    axes: dict  # loop var -> axis
    shape: tuple  # the iteration space of this block: loop extents, 1 on unbound axes

    def bind(self, var: str, extent: int) -> "_Frame":
        axis = len(self.axes)
        shape = self.shape[:axis] + (extent,) + self.shape[axis + 1:]
        return _Frame(dict(self.values), {**self.axes, var: axis}, shape)


@dataclass
class _Run:
    """Mutable state of one kernel run: buffers and which output elements were written."""

    kernel: Kernel
    arrays: dict
    written: dict


def run_kernel(k: Kernel, inputs: dict) -> dict:
    """Execute `k` on NumPy arrays (one per input buffer); return its outputs by name."""
    verify(k)
    _check_inputs(k, inputs)
    arrays = dict(inputs)
    written = {}
    for b in k.outputs + k.scratch:  # scratch: per-row values a grid reduction reads back
        arrays[b.name] = _poisoned(b.shape, b.dtype)
        written[b.name] = np.zeros(b.shape, dtype=bool)
    run = _Run(k, arrays, written)
    depth = loop_depth(k.body)
    with np.errstate(all="ignore"):
        frame = _Frame({}, {}, (1,) * depth)
        for i, s in enumerate(k.body):  # in order: a grid reduction's tail reads what the row loop wrote
            if k.scratch and i == len(k.body) - 1:
                for b in k.scratch:
                    _check_all_written(k, b.name, written[b.name])
            _exec(run, s, frame)
    for b in k.outputs:
        _check_all_written(k, b.name, written[b.name])
    return {b.name: arrays[b.name] for b in k.outputs}


def loop_depth(body) -> int:
    """Deepest loop nesting in a block (0 for straight-line code)."""
    return max((1 + loop_depth(s.body) for s in body if isinstance(s, (Loop, Reduce))), default=0)


# ---------------------------------------------------------------- inputs and outputs


def _check_inputs(k: Kernel, inputs: dict):
    want = {b.name for b in k.inputs}
    missing = sorted(want - inputs.keys())
    extra = sorted(inputs.keys() - want)
    if missing:
        raise ValueError(f"kernel {k.name}: missing input(s) {', '.join(missing)}")
    if extra:
        raise ValueError(f"kernel {k.name}: unexpected input(s) {', '.join(map(str, extra))}; "
                         f"its inputs are {', '.join(b.name for b in k.inputs) or 'none'}")
    for b in k.inputs:
        a = inputs[b.name]
        if not isinstance(a, np.ndarray):
            raise ValueError(f"kernel {k.name}: input {b.name} must be a NumPy array, not {type(a).__name__}")
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"kernel {k.name}: input {b.name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
        if a.dtype != dtypes.to_numpy(b.dtype):
            raise ValueError(f"kernel {k.name}: input {b.name} has dtype {a.dtype}, expected {b.dtype}")


def _poisoned(shape, dt: str) -> np.ndarray:
    """An output buffer filled with a value no correct kernel leaves behind by accident."""
    np_dt = dtypes.to_numpy(dt)
    if dtypes.is_float(dt):
        fill = np.nan
    elif dt == "bool":
        fill = False
    else:
        info = np.iinfo(np_dt)
        fill = info.max if info.min == 0 else info.min
    return np.full(shape, fill, dtype=np_dt)


def _check_all_written(k: Kernel, name: str, written: np.ndarray):
    if not written.all():
        missing = np.argwhere(~written)
        first = tuple(int(i) for i in missing[0])
        raise ValueError(f"kernel {k.name}: {len(missing)} element(s) of output {name} are never "
                         f"written, the first at index {first}")


# ---------------------------------------------------------------- statements


def _exec_block(run: _Run, body, frame: _Frame):
    for s in body:
        _exec(run, s, frame)


def _exec(run: _Run, s, frame: _Frame):
    env = frame.values
    if isinstance(s, Load):
        env[s.dst] = _load(run, s, frame)
    elif isinstance(s, Const):
        env[s.dst] = np.full((1,) * len(frame.shape), s.value, dtype=dtypes.to_numpy(s.dtype))
    elif isinstance(s, IndexValue):
        env[s.dst] = _convert(_index(run, s, s.expr, frame), s.dtype)
    elif isinstance(s, Op):
        env[s.dst] = apply_op(s.op, tuple(env[a] for a in s.args), s.dtype)
    elif isinstance(s, Store):
        _store(run, s, frame)
    elif isinstance(s, Loop):
        _exec_block(run, s.body, frame.bind(s.var, s.extent))
    elif isinstance(s, Reduce):
        env[s.dst] = _reduce(run, s, frame)
    elif isinstance(s, Scan):
        env[s.dst] = _scan(s, frame)
    else:
        raise ValueError(f"kernel {run.kernel.name}: unknown statement {s!r}")


def _chain_type(op: str, acc: str, ops_in_order=("prod",)) -> str:
    """A float product's (a scan's running sum's) value in f64 (graph/interp.py's _chain_type
    says why)."""
    return "f64" if op in ops_in_order and dtypes.is_float(acc) else acc


def _reduce(run: _Run, s: Reduce, frame: _Frame) -> np.ndarray:
    inner = frame.bind(s.var, s.extent)
    _exec_block(run, s.body, inner)
    acc = _chain_type(s.op, dtypes.compute_type(s.dtype))
    value = _convert(inner.values[s.value], acc)
    axis = inner.axes[s.var]
    value = np.broadcast_to(value, value.shape[:axis] + (s.extent,) + value.shape[axis + 1:])
    _, reducer = ops.REDUCTIONS[s.op]
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # (a product's inf is PyTorch's too)
        if axis == value.ndim - 1:
            return _convert(np.asarray(reducer(value, axis=axis, keepdims=True)), s.dtype)
        # (NumPy sums pairwise only along a contiguous last axis; over another it adds row after
        # row, 12x eager's error for an f32 x.sum(0) of 2048 x 2048)
        last = np.ascontiguousarray(np.moveaxis(value, axis, -1))
        return _convert(np.moveaxis(np.asarray(reducer(last, axis=-1, keepdims=True)), -1, axis), s.dtype)


def _scan(s: Scan, frame: _Frame) -> np.ndarray:
    """The running op along the scan's loop axis (NumPy's maximum / minimum carry NaN on, as
    the kernels' max.NaN does)."""
    acc = _chain_type(s.op, dtypes.compute_type(s.dtype), ("sum", "prod"))
    value = _convert(frame.values[s.value], acc)
    axis = frame.axes[s.var]
    value = np.broadcast_to(value, value.shape[:axis] + (frame.shape[axis],) + value.shape[axis + 1:])
    return _convert(ops.SCANS[s.op].accumulate(value, axis=axis, dtype=value.dtype), s.dtype)


# ---------------------------------------------------------------- scalar ops


def apply_op(op: str, args: tuple, dt: str) -> np.ndarray:
    """The NumPy meaning of Loop IR `Op(op, args) : dt` on broadcastable arrays."""
    info = ops.info(op)
    if op == "cast":
        return _convert(args[0], dt)
    if info.kind == "cmp":
        common = np.result_type(*(_widen(a).dtype for a in args))
        return info.numpy(*(_widen(a).astype(common, copy=False) for a in args))
    if info.kind == "logic":
        return info.numpy(*(_convert(a, "bool") for a in args))
    compute = dtypes.compute_type(dt)
    if op == "where":
        cond, a, b = args
        return _convert(np.where(_convert(cond, "bool"), _convert(a, compute), _convert(b, compute)), dt)
    result = info.numpy(*(_convert(a, compute) for a in args))
    return _convert(np.asarray(result), dt)


def _widen(a: np.ndarray) -> np.ndarray:
    """bf16/f16 values as f32 (exact), so comparisons and math never run in 16 bits."""
    if a.dtype in (dtypes.to_numpy("bf16"), dtypes.to_numpy("f16")):
        return a.astype(np.float32)
    return a


def _convert(a: np.ndarray, dt: str) -> np.ndarray:
    """C-style conversion to tilefuse dtype `dt` (float -> int truncates, x -> bool is x != 0)."""
    target = dtypes.to_numpy(dt)
    if a.dtype == target:
        return a
    if dt == "bool":
        return a != 0
    if dt in _LOW_PRECISION or not dtypes.is_float(dt):
        a = _widen(a)  # ml_dtypes converts reliably through f32
    return a.astype(target)


# ---------------------------------------------------------------- indices, loads, stores


def _index(run: _Run, s, e: Index, frame: _Frame) -> np.ndarray:
    """An index expression as an int64 array over the block's axes."""
    ndim = len(frame.shape)
    if isinstance(e, Var):
        axis = frame.axes[e.name]
        shape = [1] * ndim
        shape[axis] = frame.shape[axis]
        return np.arange(frame.shape[axis], dtype=np.int64).reshape(shape)
    if isinstance(e, IConst):
        return np.full((1,) * ndim, e.value, dtype=np.int64)
    if isinstance(e, Val):
        return frame.values[e.name].astype(np.int64)
    a, b = _index(run, s, e.a, frame), _index(run, s, e.b, frame)
    if e.op == "+":
        return a + b
    if e.op == "*":
        return a * b
    if (b == 0).any():
        raise ValueError(f"kernel {run.kernel.name}: division by zero in index {e} of `{s}`")
    quotient = np.abs(a) // np.abs(b)
    quotient = np.where((a < 0) != (b < 0), -quotient, quotient)
    return quotient if e.op == "//" else a - b * quotient


def _axis_view(run: _Run, s, arr: np.ndarray, index: tuple, frame: _Frame):
    """A view of `arr` laid out over the block's axes, when every index is a distinct loop
    variable or a constant (the common case: no copy, no index arrays); else None."""
    loop_vars = [e.name for e in index if isinstance(e, Var)]
    if len(set(loop_vars)) != len(loop_vars) or not all(isinstance(e, (Var, IConst)) for e in index):
        return None
    select, axes = [], []
    for dim, e in enumerate(index):
        if isinstance(e, IConst):
            _check_range(run, s, dim, e.value, e.value, arr.shape[dim])
            select.append(e.value)
        else:
            axis = frame.axes[e.name]
            _check_range(run, s, dim, 0, frame.shape[axis] - 1, arr.shape[dim])
            select.append(slice(0, frame.shape[axis]))
            axes.append(axis)
    sub = arr[tuple(select) + (Ellipsis,)]
    sub = sub.transpose(np.argsort(axes)) if axes else sub
    missing = tuple(a for a in range(len(frame.shape)) if a not in axes)
    return np.expand_dims(sub, missing) if missing else sub


def _check_range(run: _Run, s, dim: int, lo: int, hi: int, size: int):
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"kernel {run.kernel.name}: index {bad} out of range for dimension {dim} "
                         f"of size {size} in `{s}`")


def _index_arrays(run: _Run, s, arr: np.ndarray, index: tuple, frame: _Frame) -> tuple:
    out = []
    for dim, e in enumerate(index):
        i = _index(run, s, e, frame)
        if i.size:
            _check_range(run, s, dim, int(i.min()), int(i.max()), arr.shape[dim])
        out.append(i)
    return tuple(out)


def _load(run: _Run, s: Load, frame: _Frame) -> np.ndarray:
    arr = run.arrays[s.buf]
    view = _axis_view(run, s, arr, s.index, frame)
    if view is not None:
        return view
    gathered = np.asarray(arr[_index_arrays(run, s, arr, s.index, frame)])
    return gathered.reshape(gathered.shape if gathered.ndim else (1,) * len(frame.shape))


def _store(run: _Run, s: Store, frame: _Frame):
    arr, written = run.arrays[s.buf], run.written[s.buf]
    value = frame.values[s.value]
    view = _axis_view(run, s, arr, s.index, frame)
    if view is not None:
        indexed = {frame.axes[e.name] for e in s.index if isinstance(e, Var)}
        repeated = [a for a, n in enumerate(frame.shape) if n > 1 and a not in indexed]
        if repeated:
            _double_write(run, s, "its index does not depend on every enclosing loop variable")
        mask = _axis_view(run, s, written, s.index, frame)
        if mask.any():
            _double_write(run, s, f"element {_first(mask, arr.shape, s.index, frame)} was already written")
        view[...] = np.broadcast_to(value, view.shape)
        mask[...] = True
        return
    idx = np.broadcast_arrays(*_index_arrays(run, s, arr, s.index, frame), np.empty(frame.shape, bool))[:-1]
    flat = np.ravel_multi_index(idx, arr.shape).reshape(-1)
    if flat.size > 1 and np.bincount(flat, minlength=arr.size).max() > 1:
        _double_write(run, s, "two iterations write the same element")
    flat_written = written.reshape(-1)
    if flat_written[flat].any():
        first = np.unravel_index(int(flat[flat_written[flat]][0]), arr.shape)
        _double_write(run, s, f"element {tuple(map(int, first))} was already written")
    arr.reshape(-1)[flat] = np.broadcast_to(value, frame.shape).reshape(-1)
    flat_written[flat] = True


def _first(mask_view: np.ndarray, shape, index, frame) -> str:
    """Buffer index of the first already-written element of a store's view (for messages)."""
    hit = tuple(int(i) for i in np.argwhere(mask_view)[0])
    out = []
    for e in index:
        out.append(e.value if isinstance(e, IConst) else hit[frame.axes[e.name]])
    return str(tuple(out))


def _double_write(run: _Run, s: Store, why: str):
    raise ValueError(f"kernel {run.kernel.name}: output {s.buf} written more than once ({why}) by `{s}`")

"""A NumPy interpreter for the Graph IR: the CPU reference for every rewrite and fusion.

`precision="native"` follows PyTorch: a Map whose result is bf16/f16 computes in f32 and
rounds once; reductions accumulate in f32. `precision="f64"` computes every float in f64,
the high-precision reference the 2x error rule compares against.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, ops
from ..tensors import to_numpy, to_torch
from . import ir


def _float_type(dtype: str, precision: str) -> np.dtype:
    if precision == "f64":
        return np.dtype(np.float64)
    return np.dtype(np.float64) if dtype == "f64" else np.dtype(np.float32)


def _store_type(dtype: str, precision: str) -> np.dtype:
    if precision == "f64" and dtypes.is_float(dtype):
        return np.dtype(np.float64)
    return dtypes.to_numpy(dtype)


def constant_value(n: ir.Constant, precision: str = "native") -> np.ndarray:
    """A Constant's value as an array of its dtype, but a weak one (ir.Constant.weak) in f32,
    the precision kernels compute it in."""
    if precision != "f64" and n.weak():
        return np.asarray(float(n.value), dtype=np.float32)
    return np.asarray(n.value, dtype=_store_type(n.type.dtype, precision))


def eval_map(n: ir.Map, args, precision="native"):
    kind = ops.info(n.op).kind
    out = n.type.dtype
    if n.op == "cast":
        x = args[0]
        if dtypes.is_float(out) or not np.issubdtype(x.dtype, np.floating):
            return x.astype(_store_type(out, precision))
        if out == "bool":  # nonzero, as PyTorch (and the Loop IR and the kernels): 0.5 and NaN are True
            return x != 0
        if out == "u8":  # through int64, as PyTorch does: a negative value wraps (-1.5 -> 255)
            with np.errstate(invalid="ignore"):
                return np.trunc(x).astype(np.int64).astype(np.uint8)
        with np.errstate(invalid="ignore"):  # NaN or inf to an integer: a value as PyTorch's, no warning
            return np.trunc(x).astype(_store_type(out, precision))
    if n.op == "where":
        c, x, y = args
        t = _float_type(out, precision) if dtypes.is_float(out) else dtypes.to_numpy(out)
        return np.where(c.astype(bool), x.astype(t), y.astype(t)).astype(_store_type(out, precision))
    if kind == "logic":
        return ops.info(n.op).numpy(*(a.astype(bool) for a in args))
    if kind == "cmp":
        if any(np.issubdtype(a.dtype, np.floating) or a.dtype == dtypes.to_numpy("bf16") for a in args):
            t = np.float64 if precision == "f64" or any(a.dtype == np.float64 for a in args) else np.float32
            args = [a.astype(t) for a in args]
        return ops.info(n.op).numpy(*args)
    if dtypes.is_float(out):
        t = _float_type(out, precision)
        with np.errstate(all="ignore"):
            r = ops.info(n.op).numpy(*(a.astype(t) for a in args))
        return np.asarray(r).astype(_store_type(out, precision))
    with np.errstate(all="ignore"):
        r = ops.info(n.op).numpy(*(a.astype(dtypes.to_numpy(out)) for a in args))
    return np.asarray(r).astype(dtypes.to_numpy(out))


def _chain_type(op: str, t: np.dtype, ops_in_order=("prod",)) -> np.dtype:
    """A float product's (and a scan's running sum's) value in float64: NumPy multiplies and
    accumulates in order, and in float32 that drifts (5e-4 over 131072 factors near 1, where
    PyTorch's CPU op holds 6e-8; a split scan's pieces start from their offsets, so each step
    rounds at the row's running size). A kernel's tree of partial values drifts far less than a
    chain. (np.sum adds pairwise: a float32 sum keeps its type.)"""
    return np.dtype(np.float64) if op in ops_in_order and t.kind == "f" else t


def eval_reduce(n: ir.Reduce, x, precision="native"):
    out = n.type.dtype
    t = _chain_type(n.op, _float_type(out, precision) if dtypes.is_float(out) else dtypes.to_numpy(out))
    x = x.astype(t)
    if n.op == "mean":
        r = np.sum(x, axis=n.axes, keepdims=n.keepdim) / max(1, int(np.prod([x.shape[a] for a in n.axes])))
    else:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # (a product's inf is PyTorch's too)
            r = ops.REDUCTIONS[n.op][1](x, axis=n.axes, keepdims=n.keepdim)
    return np.asarray(r).astype(_store_type(out, precision))


def eval_scan(n: ir.Scan, x, precision="native"):
    """Running `op` along the axis in the result's compute type (a float sum or product in
    float64: _chain_type), each element rounded once (np.maximum / minimum carry a NaN on, as
    torch.cummax does)."""
    out = n.type.dtype
    t = _chain_type(n.op, _float_type(out, precision) if dtypes.is_float(out) else dtypes.to_numpy(out),
                    ("sum", "prod"))
    with np.errstate(all="ignore"):
        r = ops.SCANS[n.op].accumulate(np.asarray(x).astype(t), axis=n.axis, dtype=t)
    return np.asarray(r).astype(_store_type(out, precision))


def eval_view(n: ir.View, x):
    if n.op == "reshape":
        return x.reshape(n.type.shape)
    if n.op == "permute":
        return np.transpose(x, n.params)
    if n.op == "expand":
        return np.broadcast_to(x, n.type.shape)
    if n.op == "slice":
        dim, start, end, step = n.params
        sl = [slice(None)] * x.ndim
        sl[dim] = slice(start, end, step)
        return x[tuple(sl)]
    if n.op == "roll":  # element i is x's (i + shift) % size along dim
        dim, shift = n.params
        return np.roll(x, -shift, axis=dim)
    raise ValueError(f"unknown view {n.op}")


def _attention(n: ir.Attention, q, k, v, mask, precision):
    t = np.float64 if precision == "f64" else np.float32
    q, k, v = (a.astype(t) for a in (q, k, v))
    if k.shape[-3] != q.shape[-3]:  # grouped-query: query head h reads KV head h // (H / Hkv)
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    scale = n.scale if n.scale is not None else 1.0 / np.sqrt(q.shape[-1])
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if n.causal:
        L, S = s.shape[-2:]
        kept = np.tril(np.ones((L, S), bool))
        if n.window:  # and only the last `window` keys up to the diagonal
            kept &= ~np.tril(np.ones((L, S), bool), -n.window)
        s = np.where(kept, s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask.astype(t)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.matmul(p, v)


def eval_contraction(n: ir.Contraction, a, b, precision="native"):
    t = _float_type(n.type.dtype, precision)
    return np.matmul(a.astype(t), b.astype(t)).astype(_store_type(n.type.dtype, precision))


def _gather(n: ir.Gather, x, index):
    """torch.gather: the index may be smaller than x in every dim (not only `axis`); it is
    expanded to the result's shape first, and x outside the axis (ir.Gather)."""
    index = np.broadcast_to(index.astype(np.int64), n.type.shape)
    if n.wrap:
        index = np.where(index < 0, index + x.shape[n.axis], index)
    x = np.broadcast_to(x, tuple(s if d == n.axis or s != 1 else o for d, (s, o) in enumerate(zip(x.shape, n.type.shape))))
    if index.ndim != x.ndim or any(i > s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != n.axis):
        raise ValueError(f"gather {n.name}: index shape {index.shape} does not fit input shape {x.shape}")
    if ((index < 0) | (index >= x.shape[n.axis])).any():
        raise ValueError(f"gather {n.name}: index out of range for dimension {n.axis} of size {x.shape[n.axis]}")
    x = x[tuple(slice(None) if d == n.axis else slice(0, i) for d, i in enumerate(index.shape))]
    return np.take_along_axis(x, index, axis=n.axis)


def _extern(n: ir.Extern, env, precision):
    import torch

    op = n.torch_op()
    kwargs = {k: _torch_arg(v, env) for k, v in n.kwargs}
    if precision == "f64" and "dtype" in kwargs and kwargs["dtype"] in (torch.bfloat16, torch.float16, torch.float32):
        kwargs["dtype"] = torch.float64
    r = op(*_torch_arg(n.args, env), **kwargs)
    return to_numpy(r)


def _torch_arg(a, env):
    """An extern's argument with each Ref's value as a tensor (module level: a nested function
    calling itself is a reference cycle that keeps `env` alive until the cycle collector runs)."""
    if isinstance(a, ir.Ref):
        x = env[a.name]
        return to_torch(x).reshape(x.shape)  # to_torch makes 0-d arrays 1-d
    if isinstance(a, tuple):
        return [_torch_arg(x, env) for x in a]
    return a


def iota_value(n: ir.Iota) -> np.ndarray:
    shape = n.type.shape
    idx = np.arange(shape[n.axis]).reshape([-1 if i == n.axis else 1 for i in range(len(shape))])
    return np.broadcast_to(idx, shape).astype(dtypes.to_numpy(n.type.dtype))


def run_graph(g: ir.Graph, inputs: dict, precision: str = "native") -> list[np.ndarray]:
    """Evaluate the graph on NumPy (or torch CPU) inputs; returns the outputs in order."""
    env: dict[str, np.ndarray] = {}
    for n in g.nodes:
        if isinstance(n, ir.Input):
            if n.name not in inputs:
                raise ValueError(f"missing input {n.name!r}")
            x = inputs[n.name]
            x = to_numpy(x) if not isinstance(x, np.ndarray) else x
            if tuple(x.shape) != n.type.shape:
                raise ValueError(f"input {n.name}: expected shape {n.type.shape}, got {tuple(x.shape)}")
            env[n.name] = x.astype(_store_type(n.type.dtype, precision))
        elif isinstance(n, ir.Weight):
            w = g.weights[n.name]
            w = to_numpy(w) if not isinstance(w, np.ndarray) else w
            env[n.name] = w.astype(_store_type(n.type.dtype, precision))
        elif isinstance(n, ir.Constant):
            env[n.name] = constant_value(n, precision)
        elif isinstance(n, ir.Map):
            env[n.name] = eval_map(n, [env[a] for a in n.args], precision)
        elif isinstance(n, ir.Reduce):
            env[n.name] = eval_reduce(n, env[n.arg], precision)
        elif isinstance(n, ir.Scan):
            env[n.name] = eval_scan(n, env[n.arg], precision)
        elif isinstance(n, ir.View):
            env[n.name] = eval_view(n, env[n.arg])
        elif isinstance(n, ir.Iota):
            env[n.name] = iota_value(n)
        elif isinstance(n, ir.Gather):
            env[n.name] = _gather(n, env[n.arg], env[n.index])
        elif isinstance(n, ir.Contraction):
            env[n.name] = eval_contraction(n, env[n.a], env[n.b], precision)
        elif isinstance(n, ir.Attention):
            r = _attention(n, env[n.q], env[n.k], env[n.v], env.get(n.mask) if n.mask else None, precision)
            env[n.name] = r.astype(_store_type(n.type.dtype, precision))
        elif isinstance(n, ir.Extern):
            env[n.name] = _extern(n, env, precision)
        else:
            raise TypeError(f"unknown node {n!r}")
    return [np.asarray(env[o]).astype(_store_type(g[o].type.dtype, precision), copy=False) for o in g.outputs]

"""Inputs and references for checking a candidate schedule of a Loop IR kernel.

A candidate is correct when each output is within DESIGN.md's 2x rule (tilefuse.check):
its error against a float64 reference at most twice the error of the kernel computed in
its own dtypes by the Loop IR interpreter (the low-precision baseline), plus a tiny floor;
integer and bool outputs exactly equal; no NaN the reference does not have.

The references come from the interpreter: once as written, once with every float dtype
promoted to f64. Large kernels are checked on a sample of rows (a map-reduce kernel
computes each row on its own): the row loop runs over `r * stride + offset`, the sample
spread over the rows and ending at the last (the tail a schedule's row groups leave).
Every output element is still checked to be written, on the GPU (measure.py).

Inputs: normal floats; integers in a range inferred from their use (an index into a
dimension of n: [0, n); otherwise [0, row length)); random bools.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import dtypes
from ..loop import ir
from ..loop.interp import run_kernel

SAMPLE_ROWS = 64


# ---------------------------------------------------------------- kernel rewrites


def _subst(e: ir.Index, var: str, by: ir.Index) -> ir.Index:
    if isinstance(e, ir.Var):
        return by if e.name == var else e
    if isinstance(e, ir.IBin):
        return ir.IBin(e.op, _subst(e.a, var, by), _subst(e.b, var, by))
    return e


def _map_body(body, fn):
    out = []
    for s in body:
        if isinstance(s, (ir.Loop, ir.Reduce)):
            s = replace(s, body=_map_body(s.body, fn))
        out.append(fn(s))
    return tuple(out)


def sample_rows(kernel: ir.Kernel, n: int = SAMPLE_ROWS):
    """(kernel over n sampled rows, their indices), or None when the kernel has at most n rows
    or an output is not stored one row per row-loop iteration (out[r, ...])."""
    parts = ir.row_kernel_parts(kernel)
    R, r = parts.rows, parts.row_var
    if R <= n:
        return None
    stride = R // n
    offset = R - 1 - (n - 1) * stride
    by = ir.IBin("+", ir.IBin("*", ir.Var(r), ir.IConst(stride)), ir.IConst(offset))
    outs = {b.name for b in kernel.outputs}
    ok = True

    def fn(s):
        nonlocal ok
        if isinstance(s, ir.Load):
            return replace(s, index=tuple(_subst(e, r, by) for e in s.index))
        if isinstance(s, ir.IndexValue):
            return replace(s, expr=_subst(s.expr, r, by))
        if isinstance(s, ir.Store):
            head, rest = s.index[:1], s.index[1:]
            if (s.buf not in outs or head != (ir.Var(r),) or kernel.buffer(s.buf).shape[0] != R
                    or any(r in ir.index_vars(e) for e in rest)):
                ok = False
        return s

    row = kernel.body[0]
    body = _map_body(row.body, fn)
    if not ok:
        return None
    params = tuple(replace(b, shape=(n,) + tuple(b.shape[1:])) if b.role == "out" else b for b in kernel.params)
    sampled = replace(kernel, params=params, body=(replace(row, extent=n, body=body),))
    return sampled, offset + stride * np.arange(n)


def promote_f64(kernel: ir.Kernel) -> ir.Kernel:
    """The same kernel computing and storing in f64: the float64 reference. Inputs keep
    their dtypes (every bf16/f16/f32 value is exact in f64; the casts after loads widen)."""
    f = lambda dt: "f64" if dtypes.is_float(dt) else dt  # noqa: E731

    floats_out = {b.name for b in kernel.outputs if dtypes.is_float(b.dtype)}
    n = 0

    def block(body):
        nonlocal n
        out = []
        for s in body:
            if isinstance(s, (ir.Loop, ir.Reduce)):
                s = replace(s, body=block(s.body))
            if isinstance(s, (ir.Const, ir.Op, ir.Reduce, ir.Scan)):
                s = replace(s, dtype=f(s.dtype))
            if isinstance(s, ir.Store) and s.buf in floats_out:  # a loaded value may be stored as is
                n += 1
                wide = f"{s.value}__f64_{n}"
                out.append(ir.Op(wide, "cast", (s.value,), "f64"))
                s = replace(s, value=wide)
            out.append(s)
        return tuple(out)

    params = tuple(replace(b, dtype=f(b.dtype)) if b.role == "out" else b for b in kernel.params)
    scratch = tuple(replace(b, dtype=f(b.dtype)) for b in kernel.scratch)  # a grid reduction's per-row values
    return replace(kernel, params=params, body=block(kernel.body), scratch=scratch)


# ---------------------------------------------------------------- inputs


def index_bounds(kernel: ir.Kernel) -> dict[str, int]:
    """For integer inputs used directly as an index: the smallest dimension they index."""
    loaded = {s.dst: s.buf for s in ir.walk(kernel.body) if isinstance(s, ir.Load)}
    bounds: dict[str, int] = {}
    for s in ir.walk(kernel.body):
        if isinstance(s, (ir.Load, ir.Store)):
            for d, e in enumerate(s.index):
                if isinstance(e, ir.Val) and e.name in loaded:
                    src = loaded[e.name]
                    n = kernel.buffer(s.buf).shape[d]
                    bounds[src] = min(n, bounds.get(src, n))
    return bounds


def make_inputs(kernel: ir.Kernel, seed: int = 0) -> dict[str, np.ndarray]:
    import torch

    from ..tensors import to_numpy

    g = torch.Generator().manual_seed(seed)
    parts = ir.row_kernel_parts(kernel) if kernel.family == "mapreduce" else None
    fallback = parts.col_extent if parts else 16
    bounds = index_bounds(kernel)
    out = {}
    for b in kernel.inputs:
        if dtypes.is_float(b.dtype):
            t = torch.randn(b.shape, generator=g, dtype=torch.float32).to(dtypes.to_torch(b.dtype))
        elif b.dtype == "bool":
            t = torch.randint(0, 2, b.shape, generator=g).bool()
        else:
            t = torch.randint(0, max(1, bounds.get(b.name, fallback)), b.shape, generator=g,
                              dtype=dtypes.to_torch(b.dtype))
        out[b.name] = to_numpy(t)
    return out


# ---------------------------------------------------------------- the problem


@dataclass
class LoopProblem:
    """Inputs of a Loop IR kernel and the references its outputs are checked against."""

    kernel: ir.Kernel
    inputs: dict          # name -> ndarray (whole inputs, the kernel's dtypes)
    rows: np.ndarray | None  # the rows checked (None: all)
    ref64: dict           # output name -> float64 reference (of the rows checked)
    low: dict             # output name -> the interpreter in the kernel's own dtypes

    @property
    def outputs(self) -> dict:
        """Output name -> (shape, dtype) of the whole kernel."""
        return {b.name: (tuple(b.shape), b.dtype) for b in self.kernel.outputs}

    def call(self, fn, tensors: dict) -> None:
        """Launch `fn` (a compiled kernel) on tensors by buffer name, in parameter order."""
        fn(*[tensors[b.name] for b in self.kernel.params])

    def check(self, outputs: dict) -> str | None:
        """None if every output passes the 2x rule, else why not (one line)."""
        import torch

        from ..check import compare
        from ..tensors import to_torch

        for b in self.kernel.outputs:
            got = outputs[b.name]
            if self.rows is not None:
                got = got[torch.as_tensor(self.rows, device=got.device)]
            c = compare(b.name, got.cpu(), to_torch(self.ref64[b.name]), to_torch(self.low[b.name]))
            if not c.ok:
                extra = f" ({c.note})" if c.note else ""
                return (f"wrong result: output {b.name} has error {c.error:.3g}, bound {c.bound:.3g} "
                        f"(2x the interpreter's {c.torch_error:.3g}){extra}")
        return None


def loop_problem(kernel: ir.Kernel, seed: int = 0, sample: int = SAMPLE_ROWS) -> LoopProblem:
    inputs = make_inputs(kernel, seed)
    s = sample_rows(kernel, sample) if kernel.family == "mapreduce" else None
    k, rows = s if s is not None else (kernel, None)
    low = run_kernel(k, inputs)
    ref64 = run_kernel(promote_f64(k), inputs)
    return LoopProblem(kernel, inputs, rows, ref64, low)

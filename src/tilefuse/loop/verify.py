"""Well-formedness checks for Loop IR kernels.

Every pass after lowering, the CUDA printer and the interpreter assume a kernel passes
`verify`; checking once here lets each of them stay simple and turns a malformed kernel
into a clear error naming the kernel and the statement instead of a wrong answer later.

Scoping rules checked (see loop/ir.py): a value is defined once in the whole kernel
(SSA) and is visible after its definition in its block and in nested blocks; nothing
defined in a loop body is visible after the loop except a `Reduce`'s `dst`. A loop
variable is visible only inside its loop; a nested loop may not rebind a variable that is
already bound (shadowing), but sibling loops may reuse a name (the map-reduce shape
uses `c` for each column loop of a row). A `Scan` stands directly in the body of the
(non-parallel) loop it runs along.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from .. import dtypes, ops
from .ir import (
    IBin, IConst, Index, IndexValue, Kernel, Const, Load, Loop, Op, Reduce, Scan, Stmt, Store,
    Val, Var,
)


@dataclass(frozen=True)
class _Scope:
    """What a statement may refer to: visible values (name -> dtype) and bound loop vars."""

    values: dict
    loop_vars: frozenset
    inner: str | None = None  # the variable of the loop whose body this is (a Scan runs along it)


def _stmt_text(s: Stmt) -> str:
    return s.header() if isinstance(s, (Loop, Reduce)) else str(s)


def _fail(k: Kernel, s: Stmt | None, problem: str):
    where = f" in `{_stmt_text(s)}`" if s is not None else ""
    raise ValueError(f"kernel {k.name}: {problem}{where}")


def verify(k: Kernel) -> None:
    """Raise ValueError describing the first malformation found in `k`; return None if well formed."""
    names = [b.name for b in k.params + k.scratch]
    for b in k.scratch:
        if b.role != "out":
            _fail(k, None, f"scratch buffer {b.name!r} must have role 'out' (the row loop stores it)")
    for n in names:
        if names.count(n) > 1:
            _fail(k, None, f"buffer {n!r} is declared twice")
    defined: set[str] = set()
    _check_block(k, k.body, _Scope({}, frozenset()), defined)


def _check_block(k: Kernel, body, scope: _Scope, defined: set) -> dict:
    """Check a block; return the visible values after it (its own definitions included)."""
    values = dict(scope.values)
    for s in body:
        inner = _Scope(values, scope.loop_vars, scope.inner)
        new = _check_stmt(k, s, inner, defined)
        for name, dt in new.items():
            if name in defined:
                _fail(k, s, f"value %{name} is defined twice (SSA)")
            defined.add(name)
            values[name] = dt
    return values


def _check_stmt(k: Kernel, s: Stmt, scope: _Scope, defined: set) -> dict:
    """Check one statement; return the values it defines (name -> dtype)."""
    if isinstance(s, Load):
        buf = _buffer(k, s, s.buf)
        if buf.role != "in" and buf not in k.scratch:
            _fail(k, s, f"load from output buffer {s.buf!r}")
        _check_indices(k, s, buf, s.index, scope)
        return {s.dst: buf.dtype}
    if isinstance(s, Store):
        buf = _buffer(k, s, s.buf)
        if buf.role != "out":
            _fail(k, s, f"store to input buffer {s.buf!r}")
        _check_indices(k, s, buf, s.index, scope)
        dt = _use(k, s, s.value, scope)
        if dt != buf.dtype:
            _fail(k, s, f"stores %{s.value} of dtype {dt} into {buf.dtype} buffer {s.buf!r}; cast it first")
        return {}
    if isinstance(s, Const):
        _dtype(k, s, s.dtype)
        if not isinstance(s.value, numbers.Real):
            _fail(k, s, f"constant {s.value!r} is not a real number or bool")
        return {s.dst: s.dtype}
    if isinstance(s, IndexValue):
        _dtype(k, s, s.dtype)
        if s.dtype not in dtypes.INTS:
            _fail(k, s, f"an index value must have an integer dtype, not {s.dtype}")
        _check_index(k, s, s.expr, scope)
        return {s.dst: s.dtype}
    if isinstance(s, Op):
        _check_op(k, s, scope)
        return {s.dst: s.dtype}
    if isinstance(s, Loop):
        body_scope = _enter_loop(k, s, scope)
        if not s.parallel:
            body_scope = _Scope(body_scope.values, body_scope.loop_vars, s.var)
        _check_block(k, s.body, body_scope, defined)
        return {}
    if isinstance(s, Scan):
        if s.op not in ops.SCANS:
            _fail(k, s, f"unknown scan {s.op!r}; known: {', '.join(ops.SCANS)}")
        _dtype(k, s, s.dtype)
        if s.var != scope.inner:
            _fail(k, s, f"a scan runs along the loop whose body holds it, not {s.var!r}")
        dt = _use(k, s, s.value, scope)
        if dt != s.dtype:
            _fail(k, s, f"scans %{s.value} of dtype {dt} in {s.dtype}; cast it first")
        return {s.dst: s.dtype}
    if isinstance(s, Reduce):
        if s.op not in ops.REDUCTIONS:
            _fail(k, s, f"unknown reduction {s.op!r}; known: {', '.join(ops.REDUCTIONS)}")
        _dtype(k, s, s.dtype)
        body_scope = _enter_loop(k, s, scope)
        after = _check_block(k, s.body, body_scope, defined)
        if s.value not in after:
            _fail(k, s, f"reduced value %{s.value} is not defined in the body or an enclosing scope")
        return {s.dst: s.dtype}
    _fail(k, None, f"unknown statement {s!r}")


def _enter_loop(k: Kernel, s: Loop | Reduce, scope: _Scope) -> _Scope:
    if not isinstance(s.extent, int) or isinstance(s.extent, bool) or s.extent <= 0:
        _fail(k, s, f"loop extent must be a positive int, not {s.extent!r}")
    if s.var in scope.loop_vars:
        _fail(k, s, f"loop variable {s.var!r} shadows an enclosing loop's variable")
    return _Scope(scope.values, scope.loop_vars | {s.var})


def _check_op(k: Kernel, s: Op, scope: _Scope):
    try:
        info = ops.info(s.op)
    except ValueError as e:
        _fail(k, s, str(e))
    if len(s.args) != info.arity:
        _fail(k, s, f"op {s.op} takes {info.arity} argument(s), got {len(s.args)}")
    _dtype(k, s, s.dtype)
    arg_dtypes = tuple(_use(k, s, a, scope) for a in s.args)
    if info.kind in ("cmp", "logic"):
        want = ops.result_dtype(s.op, arg_dtypes, s.dtype)
        if s.dtype != want:
            _fail(k, s, f"op {s.op} yields {want}, but the statement says {s.dtype}")
    if info.kind == "float" and not dtypes.is_float(s.dtype):
        _fail(k, s, f"op {s.op} computes in a float dtype, not {s.dtype}")
    if info.kind == "int" and (dtypes.is_float(s.dtype) or s.dtype == "bool"):
        _fail(k, s, f"op {s.op} computes in an integer dtype, not {s.dtype}")
    if s.op == "where" and arg_dtypes[0] != "bool":
        _fail(k, s, f"where's condition %{s.args[0]} is {arg_dtypes[0]}, not bool")


def _dtype(k: Kernel, s: Stmt, name: str):
    if name not in dtypes.ALL:
        _fail(k, s, f"unknown dtype {name!r}")


def _buffer(k: Kernel, s: Stmt, name: str):
    for b in k.params + k.scratch:
        if b.name == name:
            return b
    _fail(k, s, f"unknown buffer {name!r}")


def _use(k: Kernel, s: Stmt, name: str, scope: _Scope) -> str:
    """dtype of a value read by `s`, or fail if it is not visible there."""
    if name not in scope.values:
        _fail(k, s, f"value %{name} is used before its definition or out of its scope")
    return scope.values[name]


def _check_indices(k: Kernel, s: Stmt, buf, index: tuple, scope: _Scope):
    if len(index) != len(buf.shape):
        _fail(k, s, f"buffer {buf.name} has rank {len(buf.shape)} but is indexed with {len(index)} index(es)")
    for e in index:
        _check_index(k, s, e, scope)


def _check_index(k: Kernel, s: Stmt, e: Index, scope: _Scope):
    if isinstance(e, Var):
        if e.name not in scope.loop_vars:
            _fail(k, s, f"loop variable {e.name!r} is used outside its loop")
    elif isinstance(e, Val):
        dt = _use(k, s, e.name, scope)
        if dt not in dtypes.INTS:
            _fail(k, s, f"index value %{e.name} has dtype {dt}, not an integer dtype")
    elif isinstance(e, IBin):
        _check_index(k, s, e.a, scope)
        _check_index(k, s, e.b, scope)
    elif isinstance(e, IConst):
        if not isinstance(e.value, int) or isinstance(e.value, bool):
            _fail(k, s, f"index constant {e.value!r} is not an int")
    else:
        _fail(k, s, f"not an index expression: {e!r}")

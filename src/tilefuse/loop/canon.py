"""Canonical form and structural hash of Loop IR kernels.

Two kernels that differ only in names (SSA values, loop variables, buffers, the kernel)
or in the order of independent statements are the same program: they should compile
once and share a cache entry. `structural_hash` is that cache key; `canonicalize` rewrites
a kernel into the one representative its hash stands for.

How: every statement gets a Merkle digest of what it computes, built from its operands'
digests (never their names). A loop variable is named by its nesting depth, a buffer by
its position in the parameter list (plus role, shape and dtype), a block by the sorted
multiset of its statements' digests, stores included. Within a kernel, inputs are only
loaded and outputs only stored (verify checks this), so statements have no memory
dependencies on each other: the SSA data dependencies are the whole ordering constraint,
and the multiset loses nothing. The canonical order of a block is the topological order
that always emits the ready statement with the smallest digest.

Commutative ops (`add`, `mul`, `max`, `min`, `eq`, `ne`, `and`, `or`) have their operands
sorted by digest; constants are normalised to the Python type of their dtype, so
`const 1 : f32` and `const 1.0 : f32` are the same statement.
"""
from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, replace

from .. import dtypes
from .ir import (
    IBin, IConst, Index, IndexValue, Kernel, Const, Load, Loop, Op, Reduce, Scan, Store, Val, Var,
)

COMMUTATIVE = frozenset({"add", "mul", "max", "min", "eq", "ne", "and", "or"})


def structural_hash(k: Kernel) -> str:
    """Hex sha256 of `k` ignoring every name and the order of independent statements."""
    return _canonical(k)[1]


def canonicalize(k: Kernel, rename_buffers: bool = False) -> Kernel:
    """`k` with canonical statement order and names: values v0, v1, …, loop variables
    i0, i1, … in order of appearance; buffers keep their names unless `rename_buffers`
    (then b0, b1, … by position). The kernel's name, family and notes are kept."""
    ordered, _ = _canonical(k)
    return _renamed(k, ordered.body, rename_buffers)


def named_by_structure(k: Kernel) -> Kernel:
    """`k` with every name made from what it computes, its statement order kept: values v0, v1,
    …, loop variables i0, i1, …, buffers b0, b1, … by position, and the kernel named by its
    stem (`tf_k16_mean_1_sum` -> `tf_mean_sum`) and structural hash. A program compiles this: the
    kernels a model repeats per layer (each norm's finishing kernel) then render to one source,
    one NVRTC build and one cubin cache entry, where their names made each its own. The order is
    kept rather than made canonical so that the source is the one the lowering chose."""
    digest = structural_hash(k)[:10]
    return replace(_renamed(k, k.body, True), name=f"{stem(k.name.removesuffix('_' + digest))}_{digest}", notes=())


def _renamed(k: Kernel, body, rename_buffers: bool) -> Kernel:
    """`k` with `body` (its own, or reordered) under canonical value and loop names, and its
    buffers b0, b1, … by position if `rename_buffers`."""
    buffers = {b.name: (f"b{i}" if rename_buffers else b.name) for i, b in enumerate(k.params + k.scratch)}
    return replace(k, body=_rename_block(body, {}, {}, buffers, _Namer()),
                   params=tuple(replace(b, name=buffers[b.name]) for b in k.params),
                   scratch=tuple(replace(b, name=buffers[b.name]) for b in k.scratch))


def stem(name: str) -> str:
    """A kernel name without its step number and its values' numbers (`tf_k16_mean_1_sum` -> `tf_mean_sum`)."""
    words = [w for w in name.split("_") if w and not w.isdigit() and not (w[0] == "k" and w[1:].isdigit())]
    return "_".join(words) or "kernel"


# ---------------------------------------------------------------- digests and order


def _digest(*parts) -> str:
    """sha256 of a tuple of strs, ints, bools and nested tuples (repr is unambiguous for these)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass(frozen=True)
class _Ctx:
    """What a block's statements refer to: value digests, loop-variable depths, buffer keys."""

    kernel: str
    values: dict  # SSA name -> digest
    depths: dict  # loop var -> nesting depth
    buffers: dict  # buffer name -> position

    def enter(self, var: str) -> "_Ctx":
        return _Ctx(self.kernel, dict(self.values), {**self.depths, var: len(self.depths)}, self.buffers)


def _canonical(k: Kernel) -> tuple[Kernel, str]:
    """(k with every block in canonical order, original names kept; k's structural hash)."""
    ctx = _Ctx(k.name, {}, {}, {b.name: i for i, b in enumerate(k.params + k.scratch)})
    if k.scratch:  # a grid reduction's tail reads what the row loop stored: the top level keeps its order
        pairs = [_stmt(ctx, s) for s in k.body]
        body, body_digest = tuple(s for s, _ in pairs), _digest("sequence", tuple(d for _, d in pairs))
    else:
        body, body_digest = _block(ctx, k.body)
    params = tuple((b.role, tuple(b.shape), b.dtype) for b in k.params)
    if not k.scratch:  # the digest kernels had before scratch buffers existed: tuning caches stay valid
        return replace(k, body=body), _digest("kernel", k.family, params, body_digest)
    scratch = tuple((tuple(b.shape), b.dtype) for b in k.scratch)
    return replace(k, body=body), _digest("kernel", k.family, params, scratch, body_digest)


def _block(ctx: _Ctx, body) -> tuple[tuple, str]:
    """A block in canonical order and its digest; `ctx.values` gains the block's definitions."""
    stmts, digests = [], []
    for s in body:
        s, d = _stmt(ctx, s)
        stmts.append(s)
        digests.append(d)
        if _defines(s) is not None:
            ctx.values[_defines(s)] = d
    order = _topological(stmts, digests)
    return tuple(stmts[i] for i in order), _digest("block", tuple(sorted(digests)))


def _topological(stmts: list, digests: list) -> list[int]:
    """Positions of `stmts` in the dependency order that always takes the smallest digest next."""
    where = {_defines(s): i for i, s in enumerate(stmts) if _defines(s) is not None}
    deps = [{where[n] for n in free_uses(s) if n in where and where[n] < i} for i, s in enumerate(stmts)]
    users = [[] for _ in stmts]
    for i, ds in enumerate(deps):
        for j in ds:
            users[j].append(i)
    waiting = [len(ds) for ds in deps]
    ready = [(digests[i], i) for i in range(len(stmts)) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (digests[u], u))
    return order


def _stmt(ctx: _Ctx, s) -> tuple[object, str]:
    """A statement with canonical operand order and nested blocks, and its digest."""
    if isinstance(s, Load):
        return s, _digest("load", _buffer(ctx, s.buf), _indices(ctx, s.index))
    if isinstance(s, Const):
        s = replace(s, value=_normal_const(s.value, s.dtype))
        return s, _digest("const", s.dtype, repr(s.value))
    if isinstance(s, IndexValue):
        return s, _digest("index", s.dtype, _index(ctx, s.expr))
    if isinstance(s, Op):
        arg_digests = [_value(ctx, a) for a in s.args]
        if s.op in COMMUTATIVE:
            order = sorted(range(len(s.args)), key=lambda i: arg_digests[i])
            s = replace(s, args=tuple(s.args[i] for i in order))
            arg_digests = [arg_digests[i] for i in order]
        return s, _digest("op", s.op, s.dtype, tuple(arg_digests))
    if isinstance(s, Store):
        return s, _digest("store", _buffer(ctx, s.buf), _indices(ctx, s.index), _value(ctx, s.value))
    if isinstance(s, Scan):
        return s, _digest("scan", s.op, s.dtype, ctx.depths[s.var], _value(ctx, s.value))
    if isinstance(s, Loop):
        body, d = _block(ctx.enter(s.var), s.body)
        return replace(s, body=body), _digest("loop", s.extent, bool(s.parallel), d)
    if isinstance(s, Reduce):
        inner = ctx.enter(s.var)
        body, d = _block(inner, s.body)
        value = _value(inner, s.value)
        return replace(s, body=body), _digest("reduce", s.op, s.dtype, s.extent, d, value)
    raise ValueError(f"kernel {ctx.kernel}: unknown statement {s!r}")


def _normal_const(value, dtype: str):
    if dtype == "bool":
        return bool(value)
    return float(value) if dtypes.is_float(dtype) else int(value)


def _value(ctx: _Ctx, name: str) -> str:
    try:
        return ctx.values[name]
    except KeyError:
        raise ValueError(f"kernel {ctx.kernel}: value %{name} is used before its definition") from None


def _buffer(ctx: _Ctx, name: str) -> int:
    try:
        return ctx.buffers[name]
    except KeyError:
        raise ValueError(f"kernel {ctx.kernel}: unknown buffer {name!r}") from None


def _indices(ctx: _Ctx, index: tuple) -> tuple:
    return tuple(_index(ctx, e) for e in index)


def _index(ctx: _Ctx, e: Index) -> tuple:
    if isinstance(e, Var):
        if e.name not in ctx.depths:
            raise ValueError(f"kernel {ctx.kernel}: loop variable {e.name!r} used outside its loop")
        return ("var", ctx.depths[e.name])
    if isinstance(e, IConst):
        return ("int", int(e.value))
    if isinstance(e, Val):
        return ("val", _value(ctx, e.name))
    if isinstance(e, IBin):
        return ("ibin", e.op, _index(ctx, e.a), _index(ctx, e.b))
    raise ValueError(f"kernel {ctx.kernel}: not an index expression: {e!r}")


# ---------------------------------------------------------------- uses and definitions


def _defines(s) -> str | None:
    return s.dst if isinstance(s, (Load, Const, IndexValue, Op, Reduce, Scan)) else None


def _index_uses(e: Index) -> set:
    if isinstance(e, Val):
        return {e.name}
    if isinstance(e, IBin):
        return _index_uses(e.a) | _index_uses(e.b)
    return set()


def free_uses(s) -> frozenset[str]:
    """SSA values a statement reads from outside itself (nested bodies included)."""
    if isinstance(s, (Load, Store)):
        uses = set().union(*map(_index_uses, s.index))
        return frozenset(uses | {s.value} if isinstance(s, Store) else uses)
    if isinstance(s, IndexValue):
        return frozenset(_index_uses(s.expr))
    if isinstance(s, Op):
        return frozenset(s.args)
    if isinstance(s, Scan):
        return frozenset((s.value,))
    if isinstance(s, (Loop, Reduce)):
        inner, defined = set(), set()
        for t in s.body:
            inner |= free_uses(t) - defined
            if _defines(t) is not None:
                defined.add(_defines(t))
        if isinstance(s, Reduce) and s.value not in defined:
            inner.add(s.value)
        return frozenset(inner)
    return frozenset()


# ---------------------------------------------------------------- renaming


class _Namer:
    """Hands out v0, v1, … and i0, i1, … in order of request."""

    def __init__(self):
        self.values = 0
        self.loops = 0

    def value(self) -> str:
        self.values += 1
        return f"v{self.values - 1}"

    def loop(self) -> str:
        self.loops += 1
        return f"i{self.loops - 1}"


def _rename_block(body, values: dict, loops: dict, buffers: dict, namer: _Namer) -> tuple:
    """A block with canonical names; its definitions are recorded in `values` (pass a copy)."""
    return tuple(_rename(s, values, loops, buffers, namer) for s in body)


def _rename(s, values: dict, loops: dict, buffers: dict, namer: _Namer):
    """`s` with canonical names; records the names it defines in `values`."""
    def ix(e):
        return _rename_index(e, values, loops)

    if isinstance(s, Load):
        values[s.dst] = namer.value()
        return Load(values[s.dst], buffers[s.buf], tuple(map(ix, s.index)))
    if isinstance(s, Store):
        return Store(buffers[s.buf], tuple(map(ix, s.index)), values[s.value])
    if isinstance(s, Const):
        values[s.dst] = namer.value()
        return replace(s, dst=values[s.dst])
    if isinstance(s, IndexValue):
        expr = ix(s.expr)
        values[s.dst] = namer.value()
        return replace(s, dst=values[s.dst], expr=expr)
    if isinstance(s, Op):
        args = tuple(values[a] for a in s.args)
        values[s.dst] = namer.value()
        return replace(s, dst=values[s.dst], args=args)
    if isinstance(s, Scan):
        value = values[s.value]
        values[s.dst] = namer.value()
        return replace(s, dst=values[s.dst], var=loops[s.var], value=value)
    if isinstance(s, Loop):
        var = namer.loop()
        body = _rename_block(s.body, dict(values), {**loops, s.var: var}, buffers, namer)
        return replace(s, var=var, body=body)
    if isinstance(s, Reduce):
        dst, var = namer.value(), namer.loop()
        inner = dict(values)
        body = _rename_block(s.body, inner, {**loops, s.var: var}, buffers, namer)
        value = inner[s.value]
        values[s.dst] = dst
        return replace(s, dst=dst, var=var, body=body, value=value)
    raise ValueError(f"unknown statement {s!r}")


def _rename_index(e: Index, values: dict, loops: dict) -> Index:
    if isinstance(e, Var):
        return Var(loops[e.name])
    if isinstance(e, Val):
        return Val(values[e.name])
    if isinstance(e, IBin):
        return IBin(e.op, _rename_index(e.a, values, loops), _rename_index(e.b, values, loops))
    return e

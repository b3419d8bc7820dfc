"""Graph rewrites: small pure functions Graph -> Graph, each recorded when it fires.

`run_rewrites` returns the final graph and, for `-vv`, the (rule, before, after) trail.
"""
from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from . import ir
from .fusion import ON_CHIP_BYTES


@dataclass(frozen=True)
class Fired:
    """A rule that fired, with the graph before and after it (their nodes, not their weights:
    a trail that held the weights would hold each rewrite's derived values), printed when
    asked. Printing every graph as the rules ran took 0.2 s of a 32-layer Llama's compile, for
    a trail only `-vv` reads."""

    rule: str
    graphs: tuple  # (before, after), each an ir.Graph without weights

    @functools.cached_property
    def before(self) -> str:
        return str(self.graphs[0])

    @functools.cached_property
    def after(self) -> str:
        return str(self.graphs[1])


def fired(rule: str, before: ir.Graph, after: ir.Graph) -> Fired:
    def bare(g):
        return ir.Graph(g.nodes, g.inputs, g.outputs, {}, g.writes, g.layouts)

    return Fired(rule, (bare(before), bare(after)))


def flatten_full_reductions(g: ir.Graph) -> ir.Graph:
    """A reduction over every axis of a rank>1 tensor becomes one over a flat row.

    The map-reduce family reduces along the last axis of a row space; a full reduction is
    then a single row of numel elements (reshape of a contiguous tensor is free).
    """
    out, changed = [], False
    names = {n.name for n in g.nodes}
    for n in g.nodes:
        if isinstance(n, ir.Reduce):
            shape = g[n.arg].type.shape
            if len(shape) > 1 and n.axes == tuple(range(len(shape))):
                flat = fresh_name(names, f"{n.arg}_flat")
                out.append(ir.View(flat, ir.TensorType((g[n.arg].type.numel,), g[n.arg].type.dtype), "reshape",
                                   n.arg, (g[n.arg].type.numel,), n.source))
                red = fresh_name(names, f"{n.name}_row")
                out.append(ir.Reduce(red, ir.TensorType((), n.type.dtype), n.op, flat, (0,), False, n.source))
                out.append(ir.View(n.name, n.type, "reshape", red, n.type.shape, n.source))
                changed = True
                continue
        out.append(n)
    return g.replace(nodes=out) if changed else g


def shared_reductions(g: ir.Graph) -> ir.Graph:
    """Equal reductions (op, argument, dims, result type) are computed once; the others, with or
    without the kept dims, are views of it.

    `(x - x.mean(0)) / x.std(0)` reduces x's mean twice (the user's, and the one std makes
    inside): two row reductions in a kernel, or, over dims that are not last, a PyTorch mean
    beside the variance's kernels reading x again. The one with kept dims stays (a variance's
    mean is one: rules/apart_reductions.py matches it), at the first one's place."""
    key = lambda n: (n.op, n.arg, n.axes, n.type.dtype)  # noqa: E731
    seen: dict = {}
    for n in g.nodes:
        if isinstance(n, ir.Reduce):
            seen.setdefault(key(n), []).append(n)
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    if not dup:
        return g
    out, done = [], set()
    for n in g.nodes:
        k = key(n) if isinstance(n, ir.Reduce) else None
        if k not in dup:
            out.append(n)
            continue
        if k in done:
            continue
        done.add(k)
        same = dup[k]
        keep = next((m for m in same if m.keepdim), same[0])
        out.append(keep)
        out += [ir.View(m.name, m.type, "reshape", keep.name, m.type.shape, m.source) for m in same if m is not keep]
    return g.replace(nodes=out)


def drop_unit_reduce_axes(g: ir.Graph) -> ir.Graph:
    """A reduction over some dims of one element and some longer reduces the argument viewed
    without its dims of one element (a free reshape), its result reshaped back.

    `x.sum((1, 2))` of [2000, 1, 300] is a row reduction and `x.mean((1, 3))` of [64, 300, 1, 40]
    one over neighbouring dims, but neither is the shape the planner looks for, and both ran in
    PyTorch. Dims of one element after the last longer dim the planner takes as they are (a
    squeeze-and-excitation over [N, C, H, 1] is one kernel). First among the rules, so that
    what it leaves is flattened, split or merged like any other reduction. Only where the
    reduction alone reads its argument (`_alone`: the reshape moves up the maps it reads,
    reshapes_onto_maps) or that is the program's own tensor (a free view): a map's result other
    kernels read would be cut from them."""
    out, moved = [], set()
    names, users = {n.name for n in g.nodes}, g.users()
    for n in g.nodes:
        shape = g[n.arg].type.shape if isinstance(n, ir.Reduce) else ()
        keep = [i for i, d in enumerate(shape) if d != 1]
        long = [a for a in (n.axes if shape else ()) if shape[a] != 1]
        # (a dim of one element among the reduced ones or between them, before the last longer
        # dim: the planner takes trailing ones as they are)
        inner = [i for i in range(max(keep, default=0)) if shape[i] == 1]
        if (not long or g[n.arg].type.numel == 0 or not any(i in n.axes or min(long) < i < max(long) for i in inner)
                or not (_alone(g, users, n) or isinstance(g[n.arg], (ir.Input, ir.Weight)))):
            out.append(n)
            continue
        squeezed = tuple(shape[i] for i in keep)
        view = fresh_name(names, f"{n.arg}_squeezed")
        moved.add(view)
        out.append(ir.View(view, ir.TensorType(squeezed, g[n.arg].type.dtype), "reshape", n.arg, squeezed, n.source))
        axes = tuple(keep.index(a) for a in n.axes if shape[a] != 1)
        rest = tuple(d for i, d in enumerate(squeezed) if i not in axes)
        red = fresh_name(names, f"{n.name}_squeezed")
        out.append(ir.Reduce(red, ir.TensorType(rest, n.type.dtype), n.op, view, axes, False, n.source))
        out.append(ir.View(n.name, n.type, "reshape", red, n.type.shape, n.source))
    if not moved:
        return g
    return reshapes_onto_maps(g.replace(nodes=out), moved)


def _alone(g: ir.Graph, users: dict, n: ir.Reduce) -> bool:
    """Whether reduction n is the only reader of its row: the maps (and reshapes) of full size
    its argument is computed from, and the tensors they read, feed nothing else. A row other
    passes read too (a softmax's max and its exp, a cross-entropy's) is better held on chip by
    one kernel (a cluster's shared memory) than read again by each split piece."""
    size, stack, seen = g[n.arg].type.numel, [n.arg], set()
    chain = {n.name}
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        node = g[a]
        if node.type.numel != size:
            continue
        chain.add(a)
        if isinstance(node, ir.Map):
            stack.extend(node.args)
        elif isinstance(node, ir.View) and node.op == "reshape":
            stack.append(node.arg)
    return all(set(users.get(a, ())) <= chain for a in chain if a != n.name)


SPLIT_REDUCE_MIN = 65536   # rows at least this long are split when few
SPLIT_REDUCE_ROWS = 512    # ... and fewer than this (CTAs for every SM)
SPLIT_REDUCE_K = (1024, 2048, 4096, 512)  # a piece's length, preferred first (a divisor of the row)


def _reduced_in_pieces(names: set, n: ir.Reduce, src: str, x: ir.TensorType, k: int, K: int) -> list:
    """Reduction `n` over dim k of `x` (read from `src`) as [.., C / K, K, ..] pieces (a free
    reshape, its name first in the list): their partials (f32 for sums, means and products: the
    accumulator's type, rounded once at the end), then a reduction over the pieces."""
    C = x.shape[k]
    shape = x.shape[:k] + (C // K, K) + x.shape[k + 1:]
    pieces, part = fresh_name(names, f"{n.arg}_pieces"), fresh_name(names, f"{n.name}_part")
    wide = "f32" if n.op in ("sum", "mean", "prod") else x.dtype
    return [ir.View(pieces, ir.TensorType(shape, x.dtype), "reshape", src, shape, n.source),
            ir.Reduce(part, ir.TensorType(shape[:k + 1] + shape[k + 2:], wide), n.op, pieces, (k + 1,), False,
                      n.source),
            ir.Reduce(n.name, n.type, n.op, part, (k,), n.keepdim, n.source)]


def split_long_reductions(g: ir.Graph) -> ir.Graph:
    """A reduction over few long rows (a full reduction is one row) reduces pieces of K first.

    A kernel's CTAs take whole rows, so `(x * x).sum()` over 16M elements was one row: one CTA
    (or a cluster) streaming 64 MB. Viewed as [R, P, K] (P = C / K pieces a row, a free reshape),
    the row kernel reduces R P pieces, writing f32 partials (the accumulator's type: a bf16 sum
    rounds once, at the end), and a second reduction over P finishes each row; the maps the
    reduction reads move into the pieces' row space (reshapes_onto_maps). Sum, max and min split
    exactly so; a mean is the mean of equal pieces' means. A row a cluster's shared memory holds
    stays whole where other passes read it too (`_alone`: a softmax's, a cross-entropy's); K is
    the first of SPLIT_REDUCE_K dividing the row, else its largest divisor in [256, 4096]; rows
    with none (a prime length) stay whole."""
    from ..loop.flat import split_enabled
    if not split_enabled():
        return g
    out, moved = [], set()
    names, users = {n.name for n in g.nodes}, g.users()
    for n in g.nodes:
        x = g[n.arg].type if isinstance(n, ir.Reduce) else None
        if (x is None or n.op not in ("sum", "mean", "max", "min", "prod") or not x.shape
                or n.axes != (len(x.shape) - 1,) or x.shape[-1] < SPLIT_REDUCE_MIN
                or x.numel // x.shape[-1] >= SPLIT_REDUCE_ROWS or x.dtype not in ("f32", "bf16", "f16")):
            out.append(n)
            continue
        C = x.shape[-1]
        K = next((k for k in SPLIT_REDUCE_K if C % k == 0), None) or \
            next((k for k in range(4096, 255, -1) if C % k == 0), None)  # (any divisor: 999999 as 3861s)
        if K is None or (C * dtypes.itemsize(x.dtype) <= ON_CHIP_BYTES and not _alone(g, users, n)):
            out.append(n)
            continue
        src = g[n.arg]  # (a reshape of a reshape is one: flatten_full_reductions' flat row, read only here)
        src = src.arg if isinstance(src, ir.View) and src.op == "reshape" and users[n.arg] == [n.name] else n.arg
        nodes = _reduced_in_pieces(names, n, src, x, len(x.shape) - 1, K)
        moved.add(nodes[0].name)
        out.extend(nodes)
    if not moved:
        return g
    read = {a for n in out for a in ir.node_args(n)} | set(g.outputs)
    g = g.replace(nodes=[n for n in out if not (isinstance(n, ir.View) and n.name not in read)])
    return reshapes_onto_maps(g, moved)


SPLIT_COLUMN_FILL = 32768          # rows a column reduction's pieces give, where they can
SPLIT_COLUMN_K = range(1024, 63, -1)  # a piece's length: a divisor of the column, longest first


def _column_piece(C: int, rows: int) -> int | None:
    """A column's piece length: the longest divisor of C in SPLIT_COLUMN_K that gives
    SPLIT_COLUMN_FILL rows of pieces, else the shortest whose rows a column kernel takes
    (fusion.column_min_rows), and whose finish (rows of C / K) a column kernel takes too; None
    where none does."""
    from .fusion import column_min_rows

    # (a finish left to PyTorch would be a launch more for nothing)
    ks = [k for k in SPLIT_COLUMN_K if C % k == 0 and k < C and rows >= column_min_rows(C // k)]
    ok = [k for k in ks if rows * (C // k) >= column_min_rows(k)]
    return next((k for k in ok if rows * (C // k) >= SPLIT_COLUMN_FILL), ok[-1] if ok else None)


def _maps_of_tensors(g: ir.Graph, name: str, size: int) -> bool:
    """Whether `name` is computed by maps and views alone from the program's tensors (smaller
    operands, broadcast, from anything): a reshape moves up to them (reshapes_onto_maps), where
    a gather's or a scan's result of that size would be written whole first (a flip's)."""
    def below(x):
        n = g[x]
        return ir.node_args(n) if n.type.numel >= size and isinstance(n, (ir.View, ir.Map)) else ()

    return all(g[x].type.numel < size or isinstance(g[x], (ir.Input, ir.Weight, ir.Constant, ir.Iota, ir.View, ir.Map))
               for x in ir.reached(name, below))


def split_long_columns(g: ir.Graph) -> ir.Graph:
    """A reduction over a dim that is not last, with too few rows beside it for a column kernel
    (`x.sum(0)` over 8192 x 2048: 2048 rows of 8192), reduces pieces of K first.

    A column kernel splits each row between at most 16 threads, so few long rows leave each
    thread a long walk (fusion.COLUMN_LONG_ROW), and such reductions were PyTorch's. Viewed as
    [.., P, K, ..] (a free reshape of the reduced dim), a column kernel reduces rows P times as
    many, of K, writing f32 partials for sums and means, and a second reduction over P finishes
    (as split_long_reductions does along the last dim). Only a reduction that alone reads its
    argument (`_alone`: a softmax over dim 0 keeps its max and its exp together, and PyTorch's)."""
    from ..loop.flat import split_enabled
    from .fusion import column_min_rows, columns_enabled
    if not split_enabled() or not columns_enabled():
        return g
    out, moved = [], set()
    names, users = {n.name for n in g.nodes}, g.users()
    for n in g.nodes:
        x = g[n.arg].type if isinstance(n, ir.Reduce) else None
        k = n.axes[0] if x is not None and len(n.axes) == 1 else None
        if (k is None or n.op not in ("sum", "mean", "max", "min", "prod") or x.dtype not in ("f32", "bf16", "f16")
                or all(d == 1 for d in x.shape[k + 1:]) or x.numel == 0):
            out.append(n)
            continue
        C = x.shape[k]
        rows = x.numel // C
        K = _column_piece(C, rows) if (rows < column_min_rows(C) and _alone(g, users, n)
                                       and _maps_of_tensors(g, n.arg, x.numel)) else None
        if K is None:
            out.append(n)
            continue
        nodes = _reduced_in_pieces(names, n, n.arg, x, k, K)
        moved.add(nodes[0].name)
        out.extend(nodes)
    if not moved:
        return g
    return reshapes_onto_maps(g.replace(nodes=out), moved)


SPLIT_SCAN_MIN = 16384   # scans along rows at least this long are split when few
SPLIT_SCAN_ROWS = 264    # ... and fewer than this (two CTAs for each of an H100's / H200's SMs)


def _scan_piece(C: int, rows: int) -> int | None:
    """A scan's piece length: the longest divisor of the row in [256, 4096] that still gives
    SPLIT_SCAN_ROWS pieces in all, else the shortest there; None where none divides it."""
    ks = [k for k in range(4096, 255, -1) if C % k == 0]
    return next((k for k in ks if rows * (C // k) >= SPLIT_SCAN_ROWS), ks[-1] if ks else None)


def split_long_scans(g: ir.Graph) -> ir.Graph:
    """A scan (sum, product, max or min) over few long rows scans pieces of K, each offset by the running
    value of the pieces before it.

    A scan's CTAs take whole rows (codegen/scan.py), so 64 rows of 512k ran in 64 CTAs, and one
    row (a cumsum over a vocabulary's probabilities) in one. Viewed as [R, P, K] (a free
    reshape), each piece's total is reduced (R P rows), the totals scanned (R rows of P) and
    shifted by one piece (a roll, the first piece's offset the identity), and each piece scanned
    from that offset (its first element combined with it: R P rows): the row is read twice and
    written once, by R P CTAs. The offsets
    and running values are the accumulator's type (f32 for bf16 / f16), rounded once at the end."""
    from ..loop.flat import split_enabled
    from .fusion import scans_enabled
    if not split_enabled() or not scans_enabled():
        return g
    out, moved, back = [], set(), set()
    names = {n.name for n in g.nodes}
    for n in g.nodes:
        C = n.type.shape[-1] if isinstance(n, ir.Scan) and n.type.shape else 0
        rows = n.type.numel // C if C else 0
        K = _scan_piece(C, rows) if (C >= SPLIT_SCAN_MIN and rows < SPLIT_SCAN_ROWS
                                     and n.axis == len(n.type.shape) - 1) else None
        if K is None:
            out.append(n)
            continue
        lead, P, d = n.type.shape[:-1], C // K, len(n.type.shape) - 1
        wide = dtypes.compute_type(n.type.dtype)

        def add(node):
            out.append(node)
            return node.name

        def T(shape, dtype=wide):
            return ir.TensorType(tuple(shape), dtype)

        src = n.source
        pieces = add(ir.View(fresh_name(names, f"{n.name}_pieces"), T(lead + (P, K), g[n.arg].type.dtype), "reshape",
                             n.arg, lead + (P, K), src))
        moved.add(pieces)
        total = add(ir.Reduce(fresh_name(names, f"{n.name}_piece_totals"), T(lead + (P,)), n.op, pieces, (d + 1,),
                              False, src))
        running = add(ir.Scan(fresh_name(names, f"{n.name}_piece_running"), T(lead + (P,)), n.op, total, d, src))
        # the running value one piece back (a running sum less the piece's own total would be
        # inf - inf = NaN for a piece holding an inf, and every element of it NaN)
        offset = _shifted(add, names, n, running, lead, P, d, wide)
        offset = add(ir.View(fresh_name(names, f"{n.name}_piece_offset_col"), T(lead + (P, 1)), "reshape", offset,
                             lead + (P, 1), src))
        # each piece's first element combined with its offset, then the piece scanned: the scan
        # reads the offset, so it runs in the kernel that stores the result (a scan of the piece
        # alone joined the totals' kernel, its f32 running values stored and read back, and
        # 64 x 524288 bf16 moved 402 MB where 201 do). A 16-bit piece enters the maps as it is
        # (a map of a wider type promotes it): a cast of its own would join the totals' kernel
        # as a sibling and be stored.
        x = pieces
        seeded = add(ir.Map(fresh_name(names, f"{n.name}_seeded"), T(lead + (P, K)),
                            {"sum": "add", "prod": "mul", "max": "max", "min": "min"}[n.op], (offset, x), src))
        seeded = add(ir.Map(fresh_name(names, f"{n.name}_first_seeded"), T(lead + (P, K)), "where",
                            (_first(add, names, n, K), seeded, x), src))
        y = add(ir.Scan(fresh_name(names, f"{n.name}_from_offset"), T(lead + (P, K)), n.op, seeded, d + 1, src))
        if wide != n.type.dtype:
            y = add(ir.Map(fresh_name(names, f"{n.name}_rounded"), T(lead + (P, K), n.type.dtype), "cast", (y,), src))
        out.append(ir.View(n.name, n.type, "reshape", y, n.type.shape, src))
        back.add(n.name)
    # (the maps the scan reads move into the pieces' row space, into the kernels reading them,
    # and so do the maps after it)
    return maps_below_reshapes(reshapes_onto_maps(g.replace(nodes=out), moved), back) if moved else g


def maps_below_reshapes(g: ir.Graph, views: set) -> ir.Graph:
    """Maps reading the reshapes named in `views` (pieces [.., P, K] back to rows [.., C]) run in
    the pieces' shape, the reshape moved below them:

        op(reshape(y), b)   ->   reshape(op(y, reshape(b)))

    A reshape ends a kernel's row space, so `x.cumsum(-1) > p` over few long rows ran the
    comparison in a kernel of its own, reading the scan's result back. A map moves where its
    result has the rows' shape (not broadcast beyond it), each other argument broadcasts along
    the rows or not at all (its last dim 1 -> 1, 1, or C -> P, K) and is not computed from the
    scan (a softmax's max of it: that map could not join the scan's kernel), and each of its
    readers is a map that moves too, or it is a result: a map feeding a reduction of the rows
    stays, or the scan's kernel would store it in place of the scan (`(y > 0).sum(-1)` stored
    an int64 row). In order, so a map of a moved map reads the moved one's pieces."""
    names, outputs, users = {n.name for n in g.nodes}, set(g.outputs), g.users()
    pieces_shape = {v: (g[v].type.shape, g[g[v].arg].type.shape) for v in views}  # name -> (rows, pieces)
    after = set(views)  # what is computed from the scan
    for n in g.nodes:
        rows = n.type.shape
        if isinstance(n, ir.Map) and any(a in pieces_shape for a in n.args):
            inner = {pieces_shape[a][1] for a in n.args if a in pieces_shape and pieces_shape[a][0] == rows}
            if len(inner) == 1 and all(a in pieces_shape and pieces_shape[a][0] == rows
                                       or a not in after and _in_pieces(g[a].type.shape, rows, next(iter(inner)))
                                       is not None for a in n.args):
                pieces_shape[n.name] = (rows, next(iter(inner)))
        if any(a in after for a in ir.node_args(n)):
            after.add(n.name)
    moving = set(pieces_shape) - set(views)
    while True:  # (a map whose readers do not all move, and is no result, stays)
        # (and a map reading a candidate that stays: it would read that one back from memory)
        stay = {m for m in moving if m not in outputs and any(u not in moving for u in users.get(m, []))
                or any(a in pieces_shape and a not in moving and a not in views for a in g[m].args)}
        if not stay:
            break
        moving -= stay
    pieces_of = {v: g[v].arg for v in views}  # name -> its pieces' node
    out = []
    for n in g.nodes:
        if n.name not in moving:
            out.append(n)
            continue
        rows, inner = pieces_shape[n.name]
        args = []
        for a in n.args:
            s = _in_pieces(g[a].type.shape, rows, inner)
            if a in pieces_of:
                args.append(pieces_of[a])
            elif s == g[a].type.shape:
                args.append(a)
            else:
                args.append(fresh_name(names, f"{a}_as"))
                out.append(ir.View(args[-1], ir.TensorType(s, g[a].type.dtype), "reshape", a, s, n.source))
        m = ir.Map(fresh_name(names, f"{n.name}_pieces"), ir.TensorType(inner, n.type.dtype), n.op, tuple(args),
                   n.source)
        out += [m, ir.View(n.name, n.type, "reshape", m.name, rows, n.source)]
        pieces_of[n.name] = m.name
    # (a reshape no map reads any more is dropped: a kernel would store what it views)
    g = g.replace(nodes=out)
    users = g.users()
    return g.replace(nodes=[n for n in g.nodes if n.name not in pieces_of or users.get(n.name) or n.name in outputs])


def _in_pieces(shape: tuple, rows: tuple, pieces: tuple) -> tuple | None:
    """The shape an argument of a map over `rows` ([.., C]) takes over `pieces` ([.., P, K]):
    its last dim C -> P, K, 1 -> 1, 1 (right-aligned; no dims: as it is); None for any other."""
    if not shape:
        return shape
    if len(shape) > len(rows) or shape[-1] not in (1, rows[-1]):
        return None
    return shape[:-1] + ((1, 1) if shape[-1] == 1 and rows[-1] != 1 else pieces[-2:])


def _first(add, names: set, n: ir.Scan, length: int) -> str:
    """[length] bools, true at index 0 (broadcast along the last dim)."""
    src, T = n.source, ir.TensorType
    index = add(ir.Iota(fresh_name(names, f"{n.name}_index"), T((length,), "i64"), 0, src))
    zero = add(ir.Constant(fresh_name(names, f"{n.name}_zero"), T((), "i64"), 0, src))
    return add(ir.Map(fresh_name(names, f"{n.name}_first"), T((length,), "bool"), "eq", (index, zero), src))


def _shifted(add, names: set, n: ir.Scan, running: str, lead: tuple, P: int, d: int, wide: str) -> str:
    """Each piece's running value of the pieces before it: the running value one piece back (a
    roll), the identity for the first piece."""
    src, T = n.source, ir.TensorType
    before = add(ir.View(fresh_name(names, f"{n.name}_piece_before"), T(lead + (P,), wide), "roll", running,
                         (d, P - 1), src))
    first = _first(add, names, n, P)
    if n.op in ("sum", "prod"):
        ident = (0 if n.op == "sum" else 1) * (1.0 if dtypes.is_float(wide) else 1)
    elif dtypes.is_float(wide):
        ident = float("-inf") if n.op == "max" else float("inf")
    else:
        info = np.iinfo(dtypes.to_numpy(wide))
        ident = int(info.min) if n.op == "max" else int(info.max)
    ident = add(ir.Constant(fresh_name(names, f"{n.name}_identity"), T((), wide), ident, src))
    return add(ir.Map(fresh_name(names, f"{n.name}_piece_offset"), T(lead + (P,), wide), "where",
                      (first, ident, before), src))


def _reshaped_as(a, old: tuple, new: tuple) -> tuple | None:
    """The shape map argument `a` takes when its map of shape `old` is reshaped to `new`: `new`
    for an argument of the map's shape (not a generated one: the planner reads none through a
    view), its own for one element, and for a per-row value ([..., 1]) where only the last dim
    is cut into pieces ([..., C] -> [..., P, K]) the same with a 1 more; else None."""
    t = a.type
    if t.shape == old:
        return None if isinstance(a, (ir.Constant, ir.Iota)) else new
    if t.numel == 1 and len(t.shape) <= len(new):
        return t.shape
    if (len(t.shape) == len(old) and t.shape[-1] == 1 and len(new) == len(old) + 1 and new[:-2] == old[:-1]
            and new[-2] * new[-1] == old[-1] and not isinstance(a, (ir.Constant, ir.Iota))):
        return t.shape + (1,)
    return None


def reshapes_onto_maps(g: ir.Graph, moving: set) -> ir.Graph:
    """The reshapes named in `moving`, each of a map only it reads, moved onto the map's
    arguments, and so on up the chain:

        reduce(reshape(op(a, b)))   ->   reduce(op(reshape(a), reshape(b)))

    The planner grows a kernel along one row space and a reshape ends it, so `(x * x).sum()`
    split into pieces (split_long_reductions) would write the squares and read them back.
    Moved up the chain of maps to the program's tensors (whose reshapes are free views), the
    maps run in the pieces' row space, in their kernel. Only maps whose arguments have the
    map's shape (reshaped alike) or hold one element; a map of a generated tensor (a constant
    or iota of many elements) keeps its place. (Other reshapes keep theirs: a user's grouped
    sum of a GEMM's squares is what the RMSNorm partials rule looks for.)"""
    outputs, names = set(g.outputs), {n.name for n in g.nodes}
    while moving:
        users, out, drop, fresh = g.users(), [], set(), set()
        for n in g.nodes:
            m = g[n.arg] if n.name in moving else None
            shape = n.type.shape if m is not None else None
            if not (isinstance(m, ir.Map) and users.get(m.name) == [n.name] and m.name not in outputs
                    and all(_reshaped_as(g[a], m.type.shape, shape) is not None for a in m.args)):
                out.append(n)
                continue
            args, seen = [], {}
            for a in m.args:
                to = _reshaped_as(g[a], m.type.shape, shape)
                if to != g[a].type.shape and a not in seen:
                    seen[a] = fresh_name(names, f"{a}_as")
                    out.append(ir.View(seen[a], ir.TensorType(to, g[a].type.dtype), "reshape", a, to, n.source))
                    if to == shape:
                        fresh.add(seen[a])
                args.append(seen.get(a, a))
            out.append(ir.Map(n.name, ir.TensorType(shape, m.type.dtype), m.op, tuple(args), m.source))
            drop.add(m.name)
        if not drop:
            break
        g = g.replace(nodes=[x for x in out if x.name not in drop])
        moving = fresh
    return g


def drop_one_element_reductions(g: ir.Graph) -> ir.Graph:
    """A reduction over axes that all have size 1 reduces one element: it is a reshape (and a cast
    where the result type differs), so it fuses like a map instead of becoming an extern. Not a
    result whose argument's memory the caller holds (an input, a weight, another result): the
    reshape would hand it back (`x.amax(-1)` of a [3, 1] x, written through, changed x), where
    PyTorch returns a new tensor."""
    out, changed = [], False
    names = {n.name for n in g.nodes}
    results = set(g.outputs) | set(g.results)

    def held(name: str) -> bool:  # the caller holds this tensor's memory (through views)
        while not (name in results or isinstance(g[name], (ir.Input, ir.Weight))):
            if not isinstance(g[name], ir.View):
                return False
            name = g[name].arg
        return True

    for n in g.nodes:
        if (isinstance(n, ir.Reduce) and all(g[n.arg].type.shape[a] == 1 for a in n.axes)
                and not (n.name in results and n.type.dtype == g[n.arg].type.dtype and held(n.arg))):
            arg = g[n.arg].type
            if arg.dtype == n.type.dtype:
                out.append(ir.View(n.name, n.type, "reshape", n.arg, n.type.shape, n.source))
            else:
                flat = fresh_name(names, f"{n.name}_one")
                out.append(ir.View(flat, ir.TensorType(n.type.shape, arg.dtype), "reshape", n.arg, n.type.shape,
                                   n.source))
                out.append(ir.Map(n.name, n.type, "cast", (flat,), n.source))
            changed = True
            continue
        out.append(n)
    return g.replace(nodes=out) if changed else g


def drop_identity_casts(g: ir.Graph) -> ir.Graph:
    """cast(x) to x's own dtype is x."""
    alias = {n.name: n.args[0] for n in g.nodes
             if isinstance(n, ir.Map) and n.op == "cast" and g[n.args[0]].type == n.type}
    if not alias:
        return g
    return substitute(g, alias)


def substitute(g: ir.Graph, alias: dict[str, str]) -> ir.Graph:
    def r(name):
        while name in alias:
            name = alias[name]
        return name

    nodes = []
    for n in g.nodes:
        if n.name in alias:
            continue
        if isinstance(n, ir.Map):
            n = ir.Map(n.name, n.type, n.op, tuple(r(a) for a in n.args), n.source)
        elif isinstance(n, (ir.Reduce, ir.Scan, ir.View)):
            n = type(n)(**{**n.__dict__, "arg": r(n.arg)})
        elif isinstance(n, ir.Gather):
            n = dataclasses.replace(n, arg=r(n.arg), index=r(n.index))
        elif isinstance(n, ir.Contraction):
            n = ir.Contraction(n.name, n.type, r(n.a), r(n.b), n.source)
        elif isinstance(n, ir.Attention):
            n = dataclasses.replace(n, q=r(n.q), k=r(n.k), v=r(n.v), mask=r(n.mask) if n.mask else None)
        elif isinstance(n, ir.Extern):
            n = dataclasses.replace(n, args=_subst_refs(n.args, r),
                                    kwargs=tuple((k, _subst_refs(v, r)) for k, v in n.kwargs))
        nodes.append(n)
    return g.replace(nodes=nodes, outputs=[r(o) for o in g.outputs])


def _subst_refs(x, r):
    if isinstance(x, ir.Ref):
        return ir.Ref(r(x.name))
    if isinstance(x, tuple):
        return tuple(_subst_refs(y, r) for y in x)
    return x


def fresh_name(names: set, base: str) -> str:
    """`base`, or `base_1`, `base_2`... : the first not in `names` (which it joins)."""
    name, i = base, 1
    while name in names:
        name, i = f"{base}_{i}", i + 1
    names.add(name)
    return name


def drop_identity_reshapes(g: ir.Graph) -> ir.Graph:
    """A reshape to the shape its argument already has is the argument."""
    alias = {n.name: n.arg for n in g.nodes
             if isinstance(n, ir.View) and n.op == "reshape" and g[n.arg].type == n.type}
    if not alias:
        return g
    return substitute(g, alias)


def small_powers_as_products(g: ir.Graph) -> ir.Graph:
    """pow(x, 2) and pow(x, 3) (a constant exponent) are x·x and x·x·x, computed in f32 for a
    bf16/f16 x and rounded once, as pow rounds: powf is a library call of some forty
    instructions, which in a GEMM epilogue (GPT-2's GELU, x + 0.044715 x³) cost more than the
    whole map kernel it replaced (bench/LOG_blocks.md, session 19)."""
    names = {n.name for n in g.nodes}
    out, changed = [], False
    for n in g.nodes:
        c = g[n.args[1]] if isinstance(n, ir.Map) and n.op == "pow" else None
        x = n.args[0] if c is not None else None
        if not (isinstance(c, ir.Constant) and c.type.shape == () and float(c.value) in (2.0, 3.0)
                and g[x].type.shape == n.type.shape and n.type.dtype in ("bf16", "f16", "f32", "f64")
                and g[x].type.dtype == n.type.dtype):
            out.append(n)
            continue
        wide = "f32" if n.type.dtype in ("bf16", "f16") else n.type.dtype
        t = ir.TensorType(n.type.shape, wide)
        steps = ["mul"] * (int(c.value) - 1) + (["cast"] if wide != n.type.dtype else [])
        if wide != n.type.dtype:
            xw = fresh_name(names, f"{n.name}_x")
            out.append(ir.Map(xw, t, "cast", (x,), n.source))
        else:
            xw = x
        p = xw
        for i, op in enumerate(steps):
            last = i == len(steps) - 1
            name = n.name if last else fresh_name(names, f"{n.name}_p{i + 2}")
            out.append(ir.Map(name, n.type if last else t, op, (p, xw) if op == "mul" else (p,), n.source))
            p = name
        changed = True
    return g.replace(nodes=out) if changed else g


def _scalar(g: ir.Graph, name: str, value: float) -> bool:
    n = g[name]
    return isinstance(n, ir.Constant) and n.type.shape == () and not isinstance(n.value, bool) \
        and float(n.value) == value


def _other(g: ir.Graph, n: ir.Map, value: float) -> str | None:
    """The argument of a two-argument map beside the scalar constant `value`, or None."""
    a, b = n.args
    return b if _scalar(g, a, value) else a if _scalar(g, b, value) else None


def tanh_halves_as_sigmoids(g: ir.Graph) -> ir.Graph:
    """(0.5 a) (1 + tanh(u)) is a sigmoid(2u): the same function in fewer ops, and no 1 + tanh(u)
    cancelling for large negative u. GPT-2's GELU (transformers' NewGELUActivation, written out
    with torch.tanh) has this shape; after a GEMM its tanh form cost 43 us over an 8192 x 4096 x
    4096 bf16 GEMM, the sigmoid form 17.5 (H200, session 60: F.gelu(approximate='tanh') is
    lowered so, aten._gelu). Each op keeps the dtype (and rounding) its node had."""
    users, outputs = g.users(), set(g.outputs)
    names = {n.name for n in g.nodes}
    plan = {}  # name of the product -> (a, u, the three nodes it replaces)
    for n in g.nodes:
        if not (isinstance(n, ir.Map) and n.op == "mul"):
            continue
        for p, q in (n.args, n.args[::-1]):
            P, Q = g[p], g[q]
            if not (isinstance(P, ir.Map) and P.op == "mul" and isinstance(Q, ir.Map) and Q.op == "add"):
                continue
            a, t = _other(g, P, 0.5), _other(g, Q, 1.0)
            if a is None or t is None or not (isinstance(g[t], ir.Map) and g[t].op == "tanh"):
                continue
            if any(users.get(x) != [y] or x in outputs for x, y in ((p, n.name), (q, n.name), (t, q))):
                continue
            if p == q or len({g[x].type.shape for x in (p, q, t, n.name)}) != 1:
                continue
            plan[n.name] = (a, g[t].args[0], (p, q, t))
            break
    if not plan:
        return g
    gone = {x for _, _, three in plan.values() for x in three}
    out = []
    for n in g.nodes:
        if n.name in gone:
            continue
        if n.name in plan:
            a, u, (p, q, t) = plan[n.name]
            tt = g[t].type
            two = fresh_name(names, f"{n.name}_two")
            twice = fresh_name(names, f"{n.name}_2u")
            sig = fresh_name(names, f"{n.name}_sigmoid")
            out += [ir.Constant(two, ir.TensorType((), tt.dtype), 2.0, n.source),
                    ir.Map(twice, tt, "mul", (u, two), n.source),
                    ir.Map(sig, tt, "sigmoid", (twice,), n.source),
                    ir.Map(n.name, n.type, "mul", (a, sig), n.source)]
            continue
        out.append(n)
    return g.replace(nodes=out)


def unit_permutes_as_reshapes(g: ir.Graph) -> ir.Graph:
    """A permute that moves only dims of size 1 keeps every element where it was: it is a
    reshape, which the planner makes a free alias instead of a copy. A decode step (one token)
    has four a layer: the heads' transposes of q, k and v, (1, 1, H, D) -> (1, H, 1, D), and of
    attention's output back. A weight's transpose stays a permute (the GEMM matcher reads x @ W.T
    from it)."""
    out, changed = [], False
    for n in g.nodes:
        if isinstance(n, ir.View) and n.op == "permute" and not isinstance(g[n.arg], ir.Weight):
            shape = g[n.arg].type.shape
            moved = [d % len(shape) for d in n.params if shape[d % len(shape)] != 1]
            if moved == sorted(moved):
                out.append(ir.View(n.name, n.type, "reshape", n.arg, n.type.shape, n.source))
                changed = True
                continue
        out.append(n)
    return g.replace(nodes=out) if changed else g


RULES = (shared_reductions, drop_one_element_reductions, drop_unit_reduce_axes, drop_identity_reshapes, drop_identity_casts,
         flatten_full_reductions, split_long_reductions, split_long_columns, split_long_scans,
         small_powers_as_products, tanh_halves_as_sigmoids, unit_permutes_as_reshapes)


def run_rewrites(g: ir.Graph, rules=RULES) -> tuple[ir.Graph, list[Fired]]:
    trail = []
    for rule in rules:
        new = rule(g)
        if new is not g:
            trail.append(fired(rule.__name__, g, new))
            g = new
    return g, trail

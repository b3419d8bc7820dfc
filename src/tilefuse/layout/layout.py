"""Layout = shape:stride, a function from coordinates to integers, and CuTe's algebra on it.

Semantics follow the C++ CuTe documentation ("02_layout_algebra"). Where CuTe's
composition and complement only hold under divisibility conditions, these functions check
the conditions and raise ValueError naming the condition and the operands, so a wrong
layout is never returned.

A "tiler" (the right operand of composition, divide and product) is a Layout, an int n
(meaning n:1), or a tuple of tilers applied mode by mode, where None keeps a mode as is.
"""
from __future__ import annotations

from dataclasses import dataclass

from .inttuple import (
    IntTuple,
    ceil_div,
    check_int_tuple,
    congruent,
    crd2idx,
    depth as _depth,
    flatten,
    has_none,
    idx2crd,
    is_int,
    is_tuple,
    parse_int_tuple,
    prefix_product,
    product,
    product_each,
    to_str,
    transform,
)


@dataclass(frozen=True)
class Layout:
    """shape:stride. Layout(shape) gets compact column-major strides."""

    shape: IntTuple
    stride: IntTuple = None

    def __post_init__(self):
        shape = check_int_tuple(self.shape, "shape")
        if any(s < 1 for s in flatten(shape)):
            raise ValueError(f"shape {to_str(shape)}: every extent must be >= 1")
        stride = prefix_product(shape) if self.stride is None else check_int_tuple(self.stride, "stride")
        if not congruent(shape, stride):
            raise ValueError(f"shape {to_str(shape)} and stride {to_str(stride)} are not congruent")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "stride", stride)

    def __call__(self, *crd):
        """L(i), L(i, j), L((i, j)): the index. With a None (CuTe's _) anywhere: the slice."""
        crd = crd[0] if len(crd) == 1 else tuple(crd)
        if has_none(crd):
            return slice_and_offset(crd, self)[0]
        return crd2idx(crd, self.shape, self.stride)

    def __getitem__(self, i):
        """The i-th top-level mode as a Layout (a slice gives the sub-layout of those modes)."""
        if not is_tuple(self.shape):
            if i in (0, -1):
                return self
            raise IndexError(f"mode {i} of rank-1 layout {self}")
        return Layout(self.shape[i], self.stride[i])

    def __str__(self):
        return f"{to_str(self.shape)}:{to_str(self.stride)}"

    def __repr__(self):
        return f"Layout({self.shape!r}, {self.stride!r})"


# ------------------------------------------------------------------ basic queries


def size(x) -> int:
    """Number of coordinates of a layout (or product of an IntTuple)."""
    return product(x.shape) if hasattr(x, "shape") else product(x)


def cosize(x) -> int:
    """One past the largest index the layout produces (strides taken as non-negative)."""
    if hasattr(x, "cosize"):
        return x.cosize()
    return 1 + sum((s - 1) * abs(d) for s, d in zip(flatten(x.shape), flatten(x.stride)))


def rank(x) -> int:
    shape = x.shape if hasattr(x, "shape") else x
    return len(shape) if is_tuple(shape) else 1


def depth(x) -> int:
    return _depth(x.shape if hasattr(x, "shape") else x)


def modes(layout: Layout) -> list[Layout]:
    """Top-level modes; a layout with an int shape is its own single mode."""
    return [layout[i] for i in range(rank(layout))]


def make_layout(*parts) -> Layout:
    """The layout whose modes are `parts` (Layouts, or ints n meaning n:1)."""
    parts = [Layout(p) if is_int(p) else p for p in parts]
    return Layout(tuple(p.shape for p in parts), tuple(p.stride for p in parts))


def flat(layout: Layout) -> Layout:
    """Same function with the nesting removed."""
    if not is_tuple(layout.shape):
        return layout
    return Layout(flatten(layout.shape), flatten(layout.stride))


def append(layout: Layout, n: int) -> Layout:
    """Pad to rank n with 1:0 modes (no change to the function)."""
    r = rank(layout)
    if r >= n:
        return layout
    return make_layout(*modes(layout), *([Layout(1, 0)] * (n - r)))


def unflatten(leaves, profile):
    """Rebuild `leaves` (a flat sequence) with the nesting of `profile`."""
    it = iter(leaves)

    def build(p):
        return tuple(build(e) for e in p) if is_tuple(p) else next(it)

    return build(profile)


def _from_modes(pairs) -> Layout:
    """Layout from a list of (shape, stride) leaves: 1:0 if empty, int shape if one."""
    if not pairs:
        return Layout(1, 0)
    if len(pairs) == 1:
        return Layout(*pairs[0])
    return Layout(tuple(s for s, _ in pairs), tuple(d for _, d in pairs))


def _is_composed(x) -> bool:
    return getattr(x, "is_composed", False)


def _tstr(t) -> str:
    """Text of a tiler for error messages."""
    if t is None:
        return "_"
    if is_tuple(t):
        return "(" + ",".join(_tstr(e) for e in t) + ")"
    return str(t)


def _by_mode(op, a: Layout, tiler: tuple, name: str) -> Layout:
    parts = modes(a)
    if len(tiler) > len(parts):
        raise ValueError(f"{name}: tiler {_tstr(tiler)} has more modes than layout {a}")
    out = [p if t is None else op(p, t) for p, t in zip(parts, tiler)]
    return make_layout(*out, *parts[len(tiler):])


# ------------------------------------------------------------------ slicing


def slice_and_offset(crd, layout: Layout) -> tuple[Layout, int]:
    """Split a partial coordinate: the layout of the None (kept) modes, and the offset of the rest.

    layout(c) == offset + sliced(kept coordinates of c). One kept mode gives that mode's layout.
    """
    kept, offset = _slice(crd, layout.shape, layout.stride)
    if len(kept) == 1:
        return Layout(*kept[0]), offset
    return Layout(tuple(s for s, _ in kept), tuple(d for _, d in kept)), offset


def _slice(crd, shape, stride):
    if crd is None:
        return [(shape, stride)], 0
    if is_tuple(crd):
        if not is_tuple(shape) or len(crd) != len(shape):
            raise ValueError(f"coordinate {to_str(crd)} does not fit shape {to_str(shape)}")
        kept, offset = [], 0
        for c, s, d in zip(crd, shape, stride):
            k, o = _slice(c, s, d)
            kept += k
            offset += o
        return kept, offset
    return [], crd2idx(crd, shape, stride)


# ------------------------------------------------------------------ coalesce, filter


def coalesce(layout: Layout, profile=None) -> Layout:
    """Fewest modes with the same function on [0, size): drop size-1 modes, merge
    neighbours where shape0 * stride0 == stride1. A tuple `profile` coalesces mode by mode
    (keeping the rank), recursing into sub-profiles."""
    if _is_composed(layout):
        return layout.with_inner(coalesce(layout.inner, profile))
    if is_tuple(profile):
        return _by_mode(coalesce, layout, profile, "coalesce")
    merged = []
    for s, d in zip(flatten(layout.shape), flatten(layout.stride)):
        if s == 1:
            continue
        if merged and merged[-1][0] * merged[-1][1] == d:
            merged[-1] = (merged[-1][0] * s, merged[-1][1])
        else:
            merged.append((s, d))
    return _from_modes(merged)


def filter_zeros(layout: Layout) -> Layout:
    """Replace stride-0 modes by 1:0 (the layout's distinct images, same profile)."""
    shape = transform(lambda s, d: 1 if d == 0 else s, layout.shape, layout.stride)
    return Layout(shape, layout.stride)


def filter(layout: Layout, profile=None) -> Layout:  # noqa: A001 - CuTe's name
    """coalesce after dropping stride-0 modes: the layout of the distinct indices it hits."""
    return coalesce(filter_zeros(layout), profile)


# ------------------------------------------------------------------ composition


def composition(a, b):
    """a o b: R(c) == a(b(c)) for every coordinate c of b, and R's shape is compatible with b's.

    b may be a tiler (see module doc): a tuple applies mode by mode.
    Raises ValueError naming the condition that fails: stride divisibility (each stride of
    b steps over whole modes of a, or divides the mode it lands in), shape divisibility
    (each extent of b covers whole modes of a, or a prefix of one), or mode disjointness
    (b's modes together must not carry from one mode of a into the next).
    """
    if _is_composed(a):
        return a.compose(b)
    if b is None:
        return a
    if is_int(b):
        b = Layout(b)
    if is_tuple(b):
        return _by_mode(composition, a, b, "composition")
    if getattr(a, "is_swizzle", False):
        from .swizzle import ComposedLayout

        return ComposedLayout(a, 0, b)
    if not isinstance(b, Layout):
        raise TypeError(f"composition: cannot compose {a} with {b!r}")
    shapes, strides = _coalesce_extended(a)
    used = [0] * len(shapes)  # largest digit the modes of b put into each mode of a

    def rec(s, d):
        if is_tuple(s):
            parts = [rec(x, y) for x, y in zip(s, d)]
            return tuple(p[0] for p in parts), tuple(p[1] for p in parts)
        return _compose_leaf(shapes, strides, s, d, a, b, used)

    result = Layout(*rec(b.shape, b.stride))
    for k in range(len(shapes) - 1):  # the last mode of a is unbounded: no carry out of it
        if used[k] >= shapes[k]:
            raise ValueError(
                f"composition {a} o {b}: mode disjointness condition fails: the modes of {b} "
                f"together reach digit {used[k]} of mode {shapes[k]}:{strides[k]} of "
                f"coalesce({a}) = {Layout(shapes, strides)}, so their coordinates carry into "
                f"the next mode (A(B(c)) would not be the sum of A over B's modes)"
            )
    return result


def _coalesce_extended(a: Layout) -> tuple[tuple, tuple]:
    """Flat modes of coalesce(a) that also agree with `a` past its size: there the last
    leaf takes the overflow, so its stride is kept even when its extent is 1."""
    leaves = list(zip(flatten(a.shape), flatten(a.stride))) or [(1, 0)]
    merged = _merge([(s, d) for s, d in leaves[:-1] if s > 1])
    s, d = leaves[-1]
    if merged and merged[-1][0] * merged[-1][1] == d:
        merged[-1] = (merged[-1][0] * s, merged[-1][1])
    else:
        merged.append((s, d))
    return tuple(m[0] for m in merged), tuple(m[1] for m in merged)


def _compose_leaf(shapes, strides, s: int, d: int, a, b, used):
    """(shape, stride) of a o (s:d), `a` given by its coalesced flat modes.

    Adds to used[k] the largest digit this leaf puts into mode k of a.
    """
    if d == 0 or s == 1:
        return s, 0
    if d < 0:
        raise ValueError(f"composition {a} o {b}: negative stride {d} in the right operand")
    flat_a = Layout(shapes, strides)
    if len(shapes) == 1:  # a single mode extends past its size: a o s:d == s:(d*stride)
        return s, d * strides[0]
    # Divide the stride d out of a's modes (all but the last, which is unbounded):
    # entries (extent left, stride, mode k of a, digit step in mode k).
    rest_d, divided = d, []
    for k, (sk, dk) in enumerate(zip(shapes[:-1], strides[:-1])):
        if rest_d == 1:
            divided.append((sk, dk, k, 1))
        elif rest_d % sk == 0:
            rest_d //= sk  # this whole mode is stepped over
        elif sk % rest_d == 0:
            divided.append((sk // rest_d, dk * rest_d, k, rest_d))
            rest_d = 1
        else:
            raise ValueError(
                f"composition {a} o {b}: stride divisibility condition fails: stride {d} of "
                f"mode {s}:{d} must step over whole modes of coalesce({a}) = {flat_a}, but the "
                f"remaining stride {rest_d} and mode extent {sk} do not divide one another"
            )
    # Keep the first s coordinates of what is left; the rest go to a's last mode.
    rest_s, kept = s, []
    for tk, ek, k, step in divided:
        if rest_s == 1:
            break
        if rest_s % tk == 0:
            t = tk
        elif tk > rest_s:  # only a prefix of this mode is used: always exact
            t = rest_s
        else:
            raise ValueError(
                f"composition {a} o {b}: shape divisibility condition fails: mode {s}:{d} "
                f"needs {rest_s} more coordinates from coalesce({a}) = {flat_a} but the next "
                f"mode has extent {tk}, which does not divide {rest_s}"
            )
        kept.append((t, ek))
        used[k] += (t - 1) * step
        rest_s //= t
    if rest_s > 1:
        kept.append((rest_s, strides[-1] * rest_d))
    out = _from_modes(_merge(kept))
    return out.shape, out.stride


def _merge(pairs):
    merged = []
    for s, d in pairs:
        if merged and merged[-1][0] * merged[-1][1] == d:
            merged[-1] = (merged[-1][0] * s, merged[-1][1])
        else:
            merged.append((s, d))
    return merged


# ------------------------------------------------------------------ complement, inverses


def complement(layout: Layout, cotarget=None) -> Layout:
    """The layout R that fills the gaps of `layout` up to `cotarget` (default: its cosize).

    R is strictly increasing, its image meets layout's only at 0, and (layout, R) covers
    [0, cotarget). Raises ValueError when layout's modes overlap or interleave (sorted by
    stride, each stride must be a multiple of the extent of the modes before it).
    """
    if _is_composed(layout) or not isinstance(layout, Layout):
        raise TypeError(f"complement: needs a Layout, got {layout}")
    target = cosize(layout) if cotarget is None else product(cotarget)
    fl = filter(layout)
    pairs = [(s, d) for s, d in zip(flatten(fl.shape), flatten(fl.stride)) if s > 1]
    if any(d < 0 for _, d in pairs):
        raise ValueError(f"complement of {layout}: negative strides are not supported")
    pairs.sort(key=lambda p: (p[1], p[0]))
    current, out = 1, []
    for s, d in pairs:
        if d % current != 0:
            raise ValueError(
                f"complement of {layout} (cotarget {target}): disjointness condition fails: "
                f"sorted by stride, mode {s}:{d} must start at a multiple of {current}, the "
                f"extent of the modes before it (the layout overlaps itself or interleaves)"
            )
        out.append((d // current, current))
        current = s * d
    out.append((ceil_div(target, current), current))
    return coalesce(_from_modes(out))


def right_inverse(layout: Layout) -> Layout:
    """R with layout(R(i)) == i for all i < size(R), R as large as possible."""
    fl = coalesce(layout)
    shapes, strides = flatten(fl.shape), flatten(fl.stride)
    domain = flatten(prefix_product(fl.shape))
    out, current, used = [], 1, set()
    while True:
        k = next((k for k in range(len(shapes))
                  if k not in used and strides[k] == current and shapes[k] > 1), None)
        if k is None:
            break
        used.add(k)
        out.append((shapes[k], domain[k]))
        current *= shapes[k]
    return coalesce(_from_modes(out))


def left_inverse(layout: Layout) -> Layout:
    """R with R(layout(i)) == i for all i < size(layout). Needs an injective layout."""
    for s, d in zip(flatten(layout.shape), flatten(layout.stride)):
        if d == 0 and s > 1:
            raise ValueError(f"left_inverse: {layout} is not injective (mode {s}:0)")
    return right_inverse(make_layout(layout, complement(layout)))


# ------------------------------------------------------------------ divide


def logical_divide(a, tiler):
    """a o (tiler, complement(tiler, size(a))): mode 0 is the tile, mode 1 the tiles' layout."""
    if tiler is None:
        return a
    if is_int(tiler):
        tiler = Layout(tiler)
    if is_tuple(tiler):
        if _is_composed(a):
            return a.with_inner(logical_divide(a.inner, tiler))
        return _by_mode(logical_divide, a, tiler, "logical_divide")
    return composition(a, make_layout(tiler, complement(tiler, size(a))))


def _unzip(layout, tiler):
    """((tile modes...), (rest modes..., untiled modes...)) from a by-mode divide/product."""
    if _is_composed(layout):
        return layout.with_inner(_unzip(layout.inner, tiler))
    parts = modes(layout)
    tiles, rests = [], []
    for p, t in zip(parts, tiler):
        if t is None:
            tiles.append(p)
        else:
            tiles.append(p[0])
            rests.append(p[1])
    rests += parts[len(tiler):]
    return make_layout(make_layout(*tiles), make_layout(*rests) if rests else Layout(1, 0))


def zipped_divide(a, tiler):
    """((tile), (rest)): all tile modes together in mode 0, all rest modes in mode 1."""
    ld = logical_divide(a, tiler)
    return _unzip(ld, tiler) if is_tuple(tiler) else ld


def tiled_divide(a, tiler):
    """((tile), rest0, rest1, ...)."""
    return _unpack(zipped_divide(a, tiler), tile_flat=False)


def flat_divide(a, tiler):
    """(tile0, tile1, ..., rest0, rest1, ...)."""
    return _unpack(zipped_divide(a, tiler), tile_flat=True)


def _unpack(z, tile_flat: bool):
    if _is_composed(z):
        return z.with_inner(_unpack(z.inner, tile_flat))
    tile, rest = z[0], z[1]
    head = modes(tile) if tile_flat else [tile]
    return make_layout(*head, *modes(rest))


# ------------------------------------------------------------------ product


def logical_product(a, tiler):
    """(a, complement(a, size(a)*cosize(tiler)) o tiler): a repeated as tiler says."""
    if is_int(tiler):
        tiler = Layout(tiler)
    if _is_composed(a):
        return a.with_inner(logical_product(a.inner, tiler))
    if is_tuple(tiler):
        return _by_mode(logical_product, a, tiler, "logical_product")
    return make_layout(a, composition(complement(a, size(a) * cosize(tiler)), tiler))


def zipped_product(a, tiler):
    lp = logical_product(a, tiler)
    return _unzip(lp, tiler) if is_tuple(tiler) else lp


def tiled_product(a, tiler):
    return _unpack(zipped_product(a, tiler), tile_flat=False)


def blocked_product(block, layout):
    """Mode i is (block_i, repeat_i): block laid out contiguously, then repeated by layout."""
    return _zip_product(block, layout, raked=False)


def raked_product(block, layout):
    """Mode i is (repeat_i, block_i): block's elements interleaved (raked) across repeats."""
    return _zip_product(block, layout, raked=True)


def _zip_product(block, layout, raked: bool):
    if is_int(layout):
        layout = Layout(layout)
    if _is_composed(block):
        return block.with_inner(_zip_product(block.inner, layout, raked))
    r = max(rank(block), rank(layout))
    lp = logical_product(append(block, r), append(layout, r))
    first, second = modes(lp[0]), modes(lp[1])
    return make_layout(*[make_layout(y, x) if raked else make_layout(x, y)
                         for x, y in zip(first, second)])


def make_ordered_layout(shape, order=None) -> Layout:
    """Compact layout whose strides grow in the order given (order[i] smallest = fastest).
    Without order: column-major."""
    shape = check_int_tuple(shape, "shape")
    if order is None:
        return Layout(shape)
    leaves, ranks = flatten(shape), flatten(check_int_tuple(order, "order"))
    if len(leaves) != len(ranks):
        raise ValueError(f"order {to_str(order)} does not fit shape {to_str(shape)}")
    strides, current = [0] * len(leaves), 1
    for i in sorted(range(len(leaves)), key=lambda i: (ranks[i], i)):
        strides[i] = current
        current *= leaves[i]
    return Layout(shape, unflatten(strides, shape))


def tile_to_shape(block, target_shape, order=None):
    """Repeat `block` (blocked product) until it covers target_shape; the repeats are
    laid out column-major, or in `order`. Each target extent must be a multiple of the block's."""
    if _is_composed(block):
        return block.with_inner(tile_to_shape(block.inner, target_shape, order))
    target_shape = check_int_tuple(target_shape, "target shape")
    r = rank(target_shape)
    if rank(block) > r:
        raise ValueError(f"tile_to_shape: block {block} has more modes than {to_str(target_shape)}")
    padded = append(block, r)
    block_shape = product_each(padded.shape) if r > 1 else (size(padded),)
    target = product_each(target_shape) if is_tuple(target_shape) else (target_shape,)
    bad = [(t, b) for t, b in zip(target, block_shape) if t % b]
    if bad:
        raise ValueError(
            f"tile_to_shape: target {to_str(target_shape)} is not a multiple of block {block} "
            f"(extents {', '.join(f'{t} % {b} != 0' for t, b in bad)})"
        )
    reps = tuple(t // b for t, b in zip(target, block_shape))
    if not is_tuple(target_shape):
        reps = reps[0]
    result = blocked_product(padded, make_ordered_layout(reps, order))
    return coalesce(result, reps) if is_tuple(reps) else coalesce(result)


# ------------------------------------------------------------------ partitioning helpers


def local_tile(layout, tiler, coord):
    """(tile layout, offset) of tile `coord` when `layout` is cut into tiles of `tiler`.

    coord may hold None to keep those tile indices, e.g. local_tile(A, (128, 64), (m, None))
    gives the (128, 64, k) stack of one row of tiles. A swizzled layout keeps the offset
    inside its swizzle and returns offset 0.
    """
    z = zipped_divide(layout, tiler)
    inner = z.inner if _is_composed(z) else z
    keep = (None,) * rank(inner[0]) if is_tuple(inner[0].shape) else None
    return _slice_any(z, (keep, coord))


def local_partition(layout, thr_layout: Layout, thr_idx: int):
    """(layout, offset) of the elements thread thr_idx owns when thr_layout's threads are
    tiled over `layout` (each thread takes one element per tile, CuTe's outer partition)."""
    tile = product_each(thr_layout.shape)
    crd = idx2crd(thr_idx, thr_layout.shape, thr_layout.stride)  # where thr_layout sends it
    if is_tuple(tile):  # one int coordinate per mode of the thread layout
        crd = tuple(crd2idx(c, s, prefix_product(s)) for c, s in zip(crd, thr_layout.shape))
    elif rank(layout) > 1:  # a 1-D thread layout tiles mode 0
        tile, crd = (tile,), (crd,)
    z = zipped_divide(layout, tile)
    inner = z.inner if _is_composed(z) else z
    keep = (None,) * rank(inner[1]) if is_tuple(inner[1].shape) else None
    return _slice_any(z, (crd, keep))


def _slice_any(layout, crd):
    """slice_and_offset, except that a swizzled layout takes the offset inside its swizzle
    (sw(offset + x) is not offset + sw(x)) and returns 0."""
    if _is_composed(layout):
        return layout(crd), 0
    return slice_and_offset(crd, layout)


def make_tv_layout(thr_layout: Layout, val_layout: Layout) -> tuple[IntTuple, Layout]:
    """(tile shape, tv) for threads arranged as thr_layout each owning a val_layout block.

    tv maps (thread, value) to the column-major index of an element of the tile:
    each thread's values are the block val_layout, blocks raked across the threads.
    """
    layout_mn = raked_product(thr_layout, val_layout)
    tile = product_each(layout_mn.shape)
    tv = composition(right_inverse(layout_mn), Layout((size(thr_layout), size(val_layout))))
    return tile, tv


def tv_coord(tv: Layout, tile: IntTuple, thread: int, value: int) -> IntTuple:
    """(row, col, ...) of the element that `value` of `thread` holds in a tile."""
    return idx2crd(tv(thread, value), tile)


# ------------------------------------------------------------------ text


def parse_layout(text: str) -> Layout:
    """'(4,2):(1,4)' -> Layout; a bare shape '(4,2)' gets column-major strides."""
    if ":" in text:
        shape_text, stride_text = text.split(":", 1)
        return Layout(parse_int_tuple(shape_text), parse_int_tuple(stride_text))
    return Layout(parse_int_tuple(text))

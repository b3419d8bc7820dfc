"""Nested integer tuples: the shapes, strides and coordinates of layouts.

An IntTuple is an `int` or a `tuple` of IntTuples, e.g. `((2, 2), 3)`. Coordinates may
also hold `None` (CuTe's `_`) to mean "keep this mode" when slicing.
Everything here is a plain function on such values; nothing here knows about layouts.
"""
from __future__ import annotations

from functools import reduce
from typing import Union

IntTuple = Union[int, tuple]


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_tuple(x) -> bool:
    return isinstance(x, tuple)


def check_int_tuple(x, what: str = "int tuple") -> IntTuple:
    """Return `x` with lists turned into tuples; reject anything that is not an IntTuple."""
    if is_int(x):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(check_int_tuple(e, what) for e in x)
    raise TypeError(f"{what}: expected an int or a (nested) tuple of ints, got {x!r}")


def flatten(x) -> tuple:
    """All leaves, left to right: flatten(((2,2),3)) == (2,2,3)."""
    if is_tuple(x):
        return tuple(leaf for e in x for leaf in flatten(e))
    return (x,)


def product(x) -> int:
    """Product of all leaves; the number of coordinates of a shape."""
    if is_tuple(x):
        return reduce(lambda a, b: a * b, (product(e) for e in x), 1)
    return x


def product_each(x) -> IntTuple:
    """Product of each top-level mode: product_each(((2,2),3)) == (4,3)."""
    return tuple(product(e) for e in x) if is_tuple(x) else x


def rank(x) -> int:
    """Number of top-level modes (an int has rank 1)."""
    return len(x) if is_tuple(x) else 1


def depth(x) -> int:
    """Nesting depth: 0 for an int, 1 for a flat tuple, ..."""
    if is_tuple(x):
        return 1 + max((depth(e) for e in x), default=0)
    return 0


def congruent(a, b) -> bool:
    """Same nesting structure (profile)."""
    if is_tuple(a) and is_tuple(b):
        return len(a) == len(b) and all(congruent(x, y) for x, y in zip(a, b))
    return not is_tuple(a) and not is_tuple(b)


def compatible(a, b) -> bool:
    """Every coordinate of shape `a` is a coordinate of shape `b` (a's sizes refined by b)."""
    if is_tuple(a):
        return is_tuple(b) and len(a) == len(b) and all(compatible(x, y) for x, y in zip(a, b))
    return a == product(b)


def transform(f, *xs):
    """Apply `f` leaf-wise to congruent IntTuples."""
    if is_tuple(xs[0]):
        return tuple(transform(f, *es) for es in zip(*xs))
    return f(*xs)


def inner_product(a, b) -> int:
    if is_tuple(a):
        return sum(inner_product(x, y) for x, y in zip(a, b))
    return a * b


def prefix_product(shape, init: int = 1) -> IntTuple:
    """Exclusive prefix product, nested: the compact column-major strides of `shape`."""
    if is_tuple(shape):
        out = []
        for s in shape:
            out.append(prefix_product(s, init))
            init *= product(s)
        return tuple(out)
    return init


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def shape_div(a, b) -> IntTuple:
    """Divide shape `a` by `b`, consuming modes left to right (CuTe's shape_div).

    For ints one must divide the other; shape_div(a, b) == a // b, or 1 when b >= a.
    For a tuple `a`, b is divided through its modes until used up.
    """
    if is_tuple(a):
        if is_tuple(b):
            if len(a) != len(b):
                raise ValueError(f"shape_div: ranks differ: {to_str(a)} / {to_str(b)}")
            return tuple(shape_div(x, y) for x, y in zip(a, b))
        out = []
        for x in a:
            out.append(shape_div(x, b))
            b = shape_div(b, product(x))
        return tuple(out)
    if is_tuple(b):
        return shape_div(a, product(b))
    if a % b != 0 and b % a != 0:
        raise ValueError(f"shape_div: neither {a} nor {b} divides the other")
    return a // b if a >= b else 1


def elem_scale(a, b) -> IntTuple:
    """Leaf-wise product of congruent tuples (an int `b` scales every leaf)."""
    if is_tuple(a):
        if is_tuple(b):
            return tuple(elem_scale(x, y) for x, y in zip(a, b))
        return tuple(elem_scale(x, b) for x in a)
    return a * product(b)


def crd2idx(crd, shape, stride) -> int:
    """Index of coordinate `crd` in a (shape, stride) layout.

    An int coordinate against a tuple shape is split colexicographically (first mode
    fastest); the last mode takes what is left, so indices past the size extend it.
    """
    if is_tuple(crd):
        if not is_tuple(shape) or len(crd) != len(shape):
            raise ValueError(f"coordinate {to_str(crd)} does not fit shape {to_str(shape)}")
        return sum(crd2idx(c, s, d) for c, s, d in zip(crd, shape, stride))
    if crd is None:
        raise ValueError("coordinate has a '_' (None); slice the layout instead")
    if is_tuple(shape):
        if not shape:
            return 0
        idx = 0
        for s, d in zip(shape[:-1], stride[:-1]):
            n = product(s)
            idx += crd2idx(crd % n, s, d)
            crd //= n
        return idx + crd2idx(crd, shape[-1], stride[-1])
    return crd * stride


def idx2crd(idx: int, shape, stride=None) -> IntTuple:
    """Natural coordinate of `idx`: (idx // stride) % shape at each leaf.

    With the default (compact column-major) strides this inverts crd2idx on [0, size);
    with an explicit injective stride it finds where a layout sends idx (CuTe's idx2crd).
    """
    if stride is None:
        stride = prefix_product(shape)
    if is_tuple(shape):
        if is_tuple(stride):
            return tuple(idx2crd(idx, s, d) for s, d in zip(shape, stride))
        raise ValueError(f"idx2crd: stride {to_str(stride)} does not fit shape {to_str(shape)}")
    return (idx // stride) % shape if stride else 0


def has_none(x) -> bool:
    if is_tuple(x):
        return any(has_none(e) for e in x)
    return x is None


def to_str(x) -> str:
    """CuTe's notation: ints as is, tuples as (a,b) with no spaces; None as _."""
    if is_tuple(x):
        return "(" + ",".join(to_str(e) for e in x) + ")"
    return "_" if x is None else str(x)


def parse_int_tuple(text: str) -> IntTuple:
    """Inverse of to_str: '((2,2),3)' -> ((2,2),3). Leading underscores (CuTe's _8) are ok."""
    value, pos = _parse_at(text, 0)
    pos = _skip_ws(text, pos)
    if pos != len(text):
        raise ValueError(f"unexpected {text[pos:]!r} after {text[:pos]!r}")
    return value


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _parse_at(text: str, pos: int):
    pos = _skip_ws(text, pos)
    if pos < len(text) and text[pos] == "(":
        items = []
        pos = _skip_ws(text, pos + 1)
        if pos < len(text) and text[pos] == ")":
            return (), pos + 1
        while True:
            item, pos = _parse_at(text, pos)
            items.append(item)
            pos = _skip_ws(text, pos)
            if pos < len(text) and text[pos] == ",":
                pos = _skip_ws(text, pos + 1)
                if pos < len(text) and text[pos] == ")":  # trailing comma
                    return tuple(items), pos + 1
                continue
            if pos < len(text) and text[pos] == ")":
                return tuple(items), pos + 1
            raise ValueError(f"expected ',' or ')' at {pos} in {text!r}")
    start = pos
    if pos < len(text) and text[pos] == "_":
        pos += 1
    if pos < len(text) and text[pos] == "-":
        pos += 1
    while pos < len(text) and text[pos].isdigit():
        pos += 1
    digits = text[start:pos].lstrip("_")
    if not digits or digits == "-":
        raise ValueError(f"expected an integer or '(' at {start} in {text!r}")
    return int(digits), pos

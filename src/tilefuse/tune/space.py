"""Knob spaces: named dimensions with candidate values, and a validity predicate.

A configuration assigns one value to every dimension, in the dimensions' order (the order
the search tree branches in: most influential knob first). `admits` prunes prefixes
cheaply (it sees only the dimensions assigned so far); `valid` is the whole truth about a
complete configuration (for map-reduce: the schedule builds and the kernel renders), and
may cost a millisecond, so it is only ever asked about configurations a search reaches,
except where a space sets `exhaustive_upto`: its valid configs are then counted (up to that
many and one) before the search, which renders them (map-reduce: 0.2-0.5 s a kernel).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping


@dataclass(frozen=True)
class Dim:
    name: str
    values: tuple

    def __post_init__(self):
        if not self.values:
            raise ValueError(f"knob {self.name!r} has no candidate values")
        if len(set(self.values)) != len(self.values):
            raise ValueError(f"knob {self.name!r} lists a value twice: {self.values}")


def _always(_: Mapping) -> bool:
    return True


@dataclass(frozen=True)
class Space:
    """The knobs of one kernel. `default` (a complete config, usually the heuristic's pick)
    is evaluated first by every search, so a tuned pick is never a guess against nothing."""

    name: str
    dims: tuple[Dim, ...]
    valid: Callable[[Mapping], bool] = _always
    admits: Callable[[Mapping], bool] = _always
    default: tuple | None = None
    # search exhaustively any space holding at most this many valid configs (0: only the
    # tuner's admitted-count threshold decides); counting them renders up to that many and one
    # configs before the search, so a family sets it only where rendering is cheap enough
    exhaustive_upto: int = 0

    def __post_init__(self):
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"space {self.name}: a knob is named twice in {names}")
        if self.default is not None:
            if len(self.default) != len(self.dims):
                raise ValueError(f"space {self.name}: default {self.default} does not assign every knob")
            for d, v in zip(self.dims, self.default):
                if v not in d.values:
                    raise ValueError(f"space {self.name}: default {d.name}={v!r} is not a candidate {d.values}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def as_dict(self, config: tuple) -> dict:
        return dict(zip(self.names, config))

    def from_dict(self, knobs: Mapping) -> tuple:
        return tuple(knobs[n] for n in self.names)

    def prefix_ok(self, prefix: tuple) -> bool:
        return bool(self.admits(dict(zip(self.names, prefix))))

    def children(self, prefix: tuple) -> list:
        """Values of the next dimension that `admits` lets follow `prefix`."""
        dim = self.dims[len(prefix)]
        return [v for v in dim.values if self.prefix_ok(prefix + (v,))]

    def admitted(self, prefix: tuple = ()) -> Iterator[tuple]:
        """Every complete config extending `prefix` that `admits` passes (validity unchecked)."""
        if len(prefix) == len(self.dims):
            yield prefix
            return
        for v in self.children(prefix):
            yield from self.admitted(prefix + (v,))

    def is_valid(self, config: tuple) -> bool:
        return len(config) == len(self.dims) and self.prefix_ok(config) and bool(self.valid(self.as_dict(config)))

    def configs(self) -> Iterator[tuple]:
        """Every valid config, in dimension order."""
        return (c for c in self.admitted() if self.valid(self.as_dict(c)))

    def raw_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= len(d.values)
        return n

    def restrict(self, **allowed) -> "Space":
        """The sub-space where each named knob takes only the given values (a tuple, or one
        value); the default stays when it is inside, else there is none. For measuring the
        exhaustive best over a neighbourhood when the whole space costs too much. Restrict a
        space no search has enumerated yet: the families' `valid` remembers which config
        rendered each kernel first and calls the others duplicates, and a kernel claimed by a
        config outside the restriction would be missing from it."""
        unknown = set(allowed) - set(self.names)
        if unknown:
            raise ValueError(f"space {self.name}: no knob {sorted(unknown)}")
        dims = []
        for d in self.dims:
            if d.name in allowed:
                want = allowed[d.name] if isinstance(allowed[d.name], tuple) else (allowed[d.name],)
                d = Dim(d.name, tuple(v for v in d.values if v in want))
            dims.append(d)
        default = self.default
        if default is not None and any(v not in d.values for d, v in zip(dims, default)):
            default = None
        return replace(self, dims=tuple(dims), default=default)

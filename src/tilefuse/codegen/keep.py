"""Values a row kernel keeps on chip between its passes over the row, instead of computing
them again.

A map-reduce kernel's Loop IR recomputes, in every pass over the row, each element-wise value
that pass needs, from the row's loads: a reduction's body is self-contained. A chain of k
softmaxes therefore computes ~k^2 / 2 exps per element where k would do, and torch.compile
(which keeps a row's values in registers between reductions) was 3.3x faster at 5 softmaxes
(bench/LOG.md, session 24). Here, where a later pass computes a value an earlier pass
already computed (the same tree of ops over the same loads and row values) and that value is
costly to recompute, the earlier pass writes it per element into registers and the later
pass reads it back; what only that value needed is not emitted there. Where the row is staged
in shared memory, values a program rounds to bf16 / f16 are kept at that width (the rounding
made them exact there), two to a register; where it is in registers, as f32.

Likewise, a per-element store the final pass makes of a value an earlier pass already
computed (add+RMSNorm's x + res, which the pass summing its squares computes) is made by
that earlier pass, as soon as each chunk of it exists (`Moved`; codegen/mapreduce.py takes
these where rows are staged in shared memory without its cp.async pipeline).

A pass is what codegen/mapreduce.py's `_emit_pass` renders: blocks (a Reduce, a Loop, an
online (max, sum-exp) or centred-squares pattern), each with its column variable, its
statements, and the values it reads after them (a reduction's operand).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..loop import ir

# Ops cheaper than a register's worth of bookkeeping: one ALU instruction or so each.
_CHEAP = frozenset({"add", "sub", "mul", "neg", "abs", "max", "min", "where", "eq", "ne", "lt", "le", "gt", "ge",
                    "and", "or", "not", "relu", "floor"})
ENABLED = True  # False renders every pass recomputing its values (bench/row_chains.py's baseline)
SPLIT_LSE = True  # where values are kept, a max and its sum of exps take two passes (the exps kept)
MIN_COST = 3  # a value is kept when recomputing it costs at least this (cheap ops 1, others 4)
KEPT_DTYPES = ("f32", "bf16", "f16")


@dataclass(frozen=True)
class Block:
    """One block of a pass: its column variable, its statements, what it reads after them."""

    var: str
    body: tuple
    reads: tuple[str, ...]


@dataclass(frozen=True)
class Kept:
    """A value one pass computes and later passes read back: the C array `k<slot>`."""

    slot: int
    dtype: str
    producer: tuple[int, str]               # (pass, SSA name there)
    readers: tuple[tuple[int, str], ...]    # (pass, SSA name there), passes in order

    @property
    def last(self) -> int:
        return self.readers[-1][0]

    def __str__(self):
        reads = ", ".join(f"%{n} in pass {p}" for p, n in self.readers)
        return f"k{self.slot}: {self.dtype}, %{self.producer[1]} of pass {self.producer[0]}, read as {reads}"


@dataclass(frozen=True)
class Moved:
    """A per-element store a later pass would make, made instead by the first pass that
    computes its value (as soon as it computes it): the later pass stores nothing there."""

    store: ir.Store          # the statement as the later pass holds it
    at: tuple[int, str]      # (pass, SSA name there) of the value
    later: int               # the pass that held it

    def __str__(self):
        return f"{self.store.buf} stored by pass {self.at[0]} (%{self.at[1]}), not by pass {self.later}"


@dataclass(frozen=True)
class KeepPlan:
    kept: tuple[Kept, ...] = ()
    moved: tuple[Moved, ...] = ()

    def writes(self, p: int) -> dict:
        """SSA name -> Kept that pass p computes and stores."""
        return {k.producer[1]: k for k in self.kept if k.producer[0] == p}

    def reads(self, p: int) -> dict:
        """SSA name -> Kept that pass p reads back instead of computing."""
        return {n: k for k in self.kept for q, n in k.readers if q == p}

    def declared(self, p: int) -> list:
        """Kept values whose arrays open before pass p (the pass that writes them)."""
        return [k for k in self.kept if k.producer[0] == p]

    def stores_at(self, p: int) -> dict:
        """SSA name -> the stores pass p makes as soon as it computes that value."""
        out: dict = {}
        for m in self.moved:
            if m.at[0] == p:
                out.setdefault(m.at[1], []).append(m.store)
        return out

    def moved_out(self, p: int) -> set:
        """The stores pass p no longer makes."""
        return {m.store for m in self.moved if m.later == p}

    def only_moving(self, movable) -> "KeepPlan":
        """This plan less the moves of stores `movable(store)` rejects."""
        return KeepPlan(self.kept, tuple(m for m in self.moved if movable(m.store)))

    def peak_words(self, words) -> int:
        """The most 32-bit registers per thread kept values hold at once; `words(dtype)`:
        one value's registers per thread."""
        if not self.kept:
            return 0
        last = max(k.last for k in self.kept)
        return max(sum(words(k.dtype) for k in self.kept if k.producer[0] <= p <= k.last) for p in range(last + 1))

    def __str__(self):
        return "\n".join([*map(str, self.kept), *map(str, self.moved)]) or "nothing kept"


def _index_key(e: ir.Index, var: str, sid: dict) -> str:
    if isinstance(e, ir.Var):
        return "@c" if e.name == var else e.name
    if isinstance(e, ir.Val):
        return f"#{sid[e.name]}" if e.name in sid else f"%{e.name}"
    if isinstance(e, ir.IBin):
        return f"({_index_key(e.a, var, sid)} {e.op} {_index_key(e.b, var, sid)})"
    return str(e)


def _args(s) -> tuple[str, ...]:
    if isinstance(s, ir.Op):
        return s.args
    if isinstance(s, ir.Load):
        return tuple(v for e in s.index for v in sorted(ir.index_values(e)))
    if isinstance(s, ir.IndexValue):
        return tuple(sorted(ir.index_values(s.expr)))
    return ()


def _step_cost(s) -> int:
    if isinstance(s, ir.Op):
        if s.op == "cast":
            return 1 if s.dtype in ("bf16", "f16") else 0  # a rounding is a few instructions
        return 1 if s.op in _CHEAP else 4
    return 0


def plan(passes: list[list[Block]], outputs: frozenset = frozenset(), dtype_of: dict | None = None) -> KeepPlan:
    """Which values to keep between passes (`passes` in the order the kernel runs them).

    outputs: buffers the kernel stores (a load of one is never matched); dtype_of: row-level
    SSA values' dtypes (the statements in the passes supply their own)."""
    ids: dict = {}        # structural key -> id
    first: dict = {}      # id -> (pass, SSA name) of the first pass computing it
    cost: dict = {}       # id -> cost of recomputing it from loads and row values
    dtypes_ = dict(dtype_of or {})
    per_pass = []         # [(name -> id, name -> stmt, names read by statements that stay)]
    for p, blocks in enumerate(passes):
        sid, stmt, stays = {}, {}, set()
        for blk in blocks:
            for s in blk.body:
                if isinstance(s, ir.Store):
                    stays.add(s.value)
                    stays.update(v for e in s.index for v in ir.index_values(e))
                    continue
                if isinstance(s, (ir.Loop, ir.Reduce)):
                    raise ValueError(f"a pass over the row holds no nested loops: {s.header()}")
                args = _args(s)
                arg_keys = tuple(sid.get(a, f"%{a}") for a in args)
                if isinstance(s, ir.Load):
                    if s.buf in outputs:
                        key = ("load-out", p, s.dst)  # never matched
                    else:
                        key = ("load", s.buf, tuple(_index_key(e, blk.var, sid) for e in s.index))
                    dtypes_[s.dst] = None  # a load's dtype: its buffer's, which the caller knows
                elif isinstance(s, ir.Const):
                    key = ("const", repr(s.value), s.dtype)
                elif isinstance(s, ir.IndexValue):
                    key = ("index", _index_key(s.expr, blk.var, sid), s.dtype)
                else:
                    key = ("op", s.op, s.dtype, arg_keys)
                i = ids.setdefault(key, len(ids))
                sid[s.dst] = i
                stmt[s.dst] = s
                if isinstance(s, (ir.Op, ir.IndexValue, ir.Const)):
                    dtypes_[s.dst] = s.dtype
                if i not in first:
                    first[i] = (p, s.dst)
                    cost[i] = _step_cost(s) + sum(cost[sid[a]] for a in args if a in sid)
            stays.update(blk.reads)
        per_pass.append((sid, stmt, stays))

    readers: dict = {}  # id -> [(pass, name)]
    for p, (sid, stmt, stays) in enumerate(per_pass):
        matched = {n for n, i in sid.items() if first[i][0] < p}
        # what the pass still computes reads these; a matched one is read back or recomputed
        need = set(stays)
        for n, s in stmt.items():
            if n not in matched:
                need.update(_args(s))
        seen, work = set(), [n for n in need if n in matched]
        while work:
            n = work.pop()
            if n in seen:
                continue
            seen.add(n)
            s = stmt[n]
            keep = n
            if (isinstance(s, ir.Op) and s.op == "cast" and s.dtype == "f32" and len(s.args) == 1
                    and dtypes_.get(s.args[0]) in ("bf16", "f16") and s.args[0] in matched):
                keep = s.args[0]  # keep the 16-bit value the f32 one widens (exact, half the registers)
            ks = stmt[keep]
            if (cost[sid[keep]] >= MIN_COST and isinstance(ks, ir.Op) and ks.dtype in KEPT_DTYPES):
                rs = readers.setdefault(sid[keep], [])
                if (p, keep) not in rs:  # the value and its f32 widening may both be needed
                    rs.append((p, keep))
            else:
                work.extend(a for a in _args(s) if a in matched)

    kept = []
    for i, rs in sorted(readers.items(), key=lambda kv: first[kv[0]]):
        p0, name = first[i]
        s = per_pass[p0][1][name]
        kept.append(Kept(len(kept), s.dtype, (p0, name), tuple(rs)))
    return KeepPlan(tuple(kept), _moves(passes, per_pass, first))


def _moves(passes, per_pass, first) -> tuple[Moved, ...]:
    """Stores of a value an earlier pass computed, at an index that needs no per-element
    value, to a buffer no pass loads: made by that earlier pass. A row's output then leaves as
    soon as its value exists (add+RMSNorm's x + res in the pass that sums its squares, not
    beside the normed output at the end: 1.4-2.4% on an H100, bench/LOG.md session 26)."""
    loaded = {s.buf for blocks in passes for blk in blocks for s in blk.body if isinstance(s, ir.Load)}
    out = []
    for p, blocks in enumerate(passes):
        sid = per_pass[p][0]
        for blk in blocks:
            for s in blk.body:
                if not isinstance(s, ir.Store) or s.buf in loaded or s.value not in sid:
                    continue
                q, name = first[sid[s.value]]
                if q < p and not any(v in sid for e in s.index for v in ir.index_values(e)):
                    out.append(Moved(s, (q, name), p))
    return tuple(out)

"""Row patterns the map-reduce printer computes a cheaper way, with the same results.

The Loop IR states *what* a row computes; three of its shapes have a much cheaper schedule
than one pass per Reduce, and the printer recognises them here (pure functions over a
row body; mapreduce.render decides how to print what they find):

* Online log-sum-exp. `m = max_c y(c)` followed by `s = sum_c exp(y(c) - m)` over the
  same values y: each thread keeps a running (max, sum) pair and rescales its sum when the
  max grows, so both come out of ONE pass over the row and ONE exchange across threads
  (pairs merge as (m, s) + (m', s') = (M, s e^(m-M) + s' e^(m'-M))). Softmax and
  cross-entropy read the row once for both instead of twice, and cross CTA boundaries
  once instead of twice. Same special values as the two-pass form (NaN propagates, a row
  of -inf gives s = NaN); the sum differs from it by rounding only.

* Centred squares. `s = sum_c y(c)`, then row statements computing some m from s (the
  mean s/C, or any map of it), then `q = sum_c (y(c) - m)^2` over the same values y
  (LayerNorm's and var's two-pass variance): the second pass waits for the first one's
  exchange. Each thread instead keeps the (count, mean, M2) of its own elements and the
  exchange merges those triples with Chan et al.'s formula, so both come out of ONE pass
  and ONE exchange: s = n * mean, and q = M2 + n (mean - m)^2 (exact algebra: the squares
  about the row's own mean, then the shift to m). Unlike E[y^2] - E[y]^2 (or any single
  shift), nothing cancels: every merged term is a sum of non-negative ones, so a row far
  from 0 or with an outlier keeps f32 accuracy (mapreduce.VAR_PRELUDE says how).

* Target select. `sum_c where(index(c) == t, v(c), 0)` with t fixed for the row (the
  target logit of a cross-entropy) is `v(t)` when 0 <= t < C and 0 otherwise: one load
  of one element, instead of a 64-bit compare and a select per element of the row.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import dtypes
from ..graph import ir as g_ir
from ..loop import ir

_INDEX_DTYPES = ("i32", "i64")


def _defs(body) -> dict:
    return {s.dst: s for s in body if isinstance(s, (ir.Load, ir.Const, ir.Op, ir.IndexValue))}


def _uses(body, name: str) -> list:
    out = []
    for s in body:
        if isinstance(s, ir.Op) and name in s.args:
            out.append(s)
        elif isinstance(s, (ir.Load, ir.Store)) and any(name in ir.index_values(e) for e in s.index):
            out.append(s)
        elif isinstance(s, ir.Store) and s.value == name:
            out.append(s)
        elif isinstance(s, ir.IndexValue) and name in ir.index_values(s.expr):
            out.append(s)
    return out


def _rename(e: ir.Index, var_a: str, var_b: str) -> ir.Index:
    if isinstance(e, ir.Var) and e.name == var_a:
        return ir.Var(var_b)
    if isinstance(e, ir.IBin):
        return ir.IBin(e.op, _rename(e.a, var_a, var_b), _rename(e.b, var_a, var_b))
    return e


def same_value(a: ir.Reduce, va: str, b: ir.Reduce, vb: str) -> bool:
    """Does value `va` of a's body compute, for each column, what `vb` of b's body computes?
    (Structurally: the same loads at the same indices, the same ops, the same outer values.)"""
    da, db = _defs(a.body), _defs(b.body)

    def here(x: str, y: str) -> bool:  # x and y alike, their arguments aside
        sx, sy = da.get(x), db.get(y)
        if sx is None or sy is None:  # defined outside the loops: the same row value
            return sx is None and sy is None and x == y
        if type(sx) is not type(sy):
            return False
        if isinstance(sx, ir.Load):
            return sx.buf == sy.buf and tuple(_rename(e, a.var, b.var) for e in sx.index) == sy.index \
                and not any(ir.index_values(e) for e in sx.index)
        if isinstance(sx, ir.Const):
            return sx.dtype == sy.dtype and sx.value == sy.value
        if isinstance(sx, ir.IndexValue):
            return sx.dtype == sy.dtype and _rename(sx.expr, a.var, b.var) == sy.expr
        return sx.op == sy.op and sx.dtype == sy.dtype and len(sx.args) == len(sy.args)

    def below(pair):  # (called only on pairs `here` passed: two Ops of as many arguments, or none)
        sx = da.get(pair[0])
        return zip(sx.args, db[pair[1]].args) if isinstance(sx, ir.Op) else ()

    # each pair once (g_ir.reached): a chain deeper than the recursion limit or `x * x` repeated
    # (2^depth paths) costs its pairs
    return all(here(x, y) for x, y in g_ir.reached((va, vb), below))


@dataclass(frozen=True)
class OnlineLse:
    """`mx` (a max of y) and `sm` (a sum of exp(y - mx) over the same y), fused.

    y: the value in sm's body (computed by sm's body minus `sub` and `exp`)."""

    mx: ir.Reduce
    sm: ir.Reduce
    y: str
    sub: ir.Op
    exp: ir.Op

    @property
    def dtype(self) -> str:
        return self.mx.dtype

    @property
    def y_body(self) -> tuple:
        """The statements of sm's body that compute y (those of sub and exp left out)."""
        return tuple(s for s in self.sm.body if s is not self.sub and s is not self.exp)


def online_lse(a, b) -> OnlineLse | None:
    """The OnlineLse of two consecutive row statements, or None if they are not that pattern."""
    if not (isinstance(a, ir.Reduce) and isinstance(b, ir.Reduce)):
        return None
    if a.op != "max" or b.op != "sum" or a.dtype != b.dtype or a.extent != b.extent:
        return None
    if a.dtype not in ("f32", "f64") or dtypes.compute_type(a.dtype) != a.dtype:
        return None
    if any(isinstance(s, (ir.Store, ir.Loop, ir.Reduce)) for s in a.body + b.body):
        return None
    defs = _defs(b.body)
    e = defs.get(b.value)
    if not (isinstance(e, ir.Op) and e.op == "exp" and e.dtype == b.dtype and len(e.args) == 1):
        return None
    d = defs.get(e.args[0])
    if not (isinstance(d, ir.Op) and d.op == "sub" and d.dtype == b.dtype and d.args[1] == a.dst):
        return None
    y = d.args[0]
    if y == a.dst or _uses(b.body, d.dst) != [e] or _uses(b.body, e.dst):
        return None
    if _uses(b.body, a.dst) != [d]:  # m feeds the exponent only
        return None
    if y in defs and _depends_on(defs, y, a.dst):
        return None
    if not same_value(a, a.value, b, y):
        return None
    return OnlineLse(a, b, y, d, e)


def _depends_on(defs: dict, v: str, target: str) -> bool:
    """Whether v is computed from `target` through the Ops of `defs`, each value visited once
    (g_ir.reached: a chain deeper than the recursion limit; `x * x` repeated, 2^depth paths)."""
    def below(x):
        return defs[x].args if isinstance(defs.get(x), ir.Op) else ()

    return any(x == target and x not in defs for x in g_ir.reached(v, below))


@dataclass(frozen=True)
class CentredSquares:
    """`sm = sum_c y(c)`, then row statements making `m` from sm, then `sq = sum_c (y(c) - m)^2`.

    y: sm's value (computed by sm's body); m: the row value sq subtracts."""

    sm: ir.Reduce
    sq: ir.Reduce
    m: str

    @property
    def dtype(self) -> str:
        return self.sm.dtype

    @property
    def y(self) -> str:
        return self.sm.value

    @property
    def y_body(self) -> tuple:
        return self.sm.body


def centred_squares(a, b, between) -> CentredSquares | None:
    """The CentredSquares of row statements `a`, `between` (in order), `b`, or None.

    a sums y; b sums (y - m)^2 (or (m - y)^2) over the same y, m a row value computed in
    `between` from a (a centred sum: m independent of a would share a's pass anyway); b's
    body reads m only in that subtraction, and y does not depend on m."""
    if not (isinstance(a, ir.Reduce) and isinstance(b, ir.Reduce)):
        return None
    if a.op != "sum" or b.op != "sum" or a.dtype != b.dtype or a.extent != b.extent:
        return None
    if a.dtype not in ("f32", "f64") or dtypes.compute_type(a.dtype) != a.dtype:
        return None
    if any(isinstance(s, (ir.Store, ir.Loop, ir.Reduce)) for s in a.body + b.body):
        return None
    if any(isinstance(s, (ir.Loop, ir.Reduce)) for s in between):
        return None
    defs = _defs(b.body)
    sq = defs.get(b.value)
    if not (isinstance(sq, ir.Op) and sq.op == "mul" and sq.dtype == b.dtype and len(sq.args) == 2
            and sq.args[0] == sq.args[1]):
        return None
    d = defs.get(sq.args[0])
    if not (isinstance(d, ir.Op) and d.op == "sub" and d.dtype == b.dtype and len(d.args) == 2):
        return None
    if _uses(b.body, d.dst) != [sq] or _uses(b.body, sq.dst):
        return None
    outer = _defs(between)
    for y, m in (d.args, d.args[::-1]):
        if m in defs or m == y or _uses(b.body, m) != [d]:
            continue
        if not _depends_on(outer, m, a.dst):  # not centred on a's sum
            continue
        if y in defs and _depends_on(defs, y, m):
            continue
        if same_value(a, a.value, b, y):
            return CentredSquares(a, b, m)
    return None


@dataclass(frozen=True)
class TargetSelect:
    """`red = sum_c where(index(c) == t, v(c), 0)`: red = v(t) if 0 <= t < extent else 0.

    body: the Reduce's body, to evaluate once at c = t (its where/eq are left unused)."""

    red: ir.Reduce
    target: str      # the row value t
    value: str       # v, in the body
    zero: str        # the 0 the other columns give


def target_select(r, outer_consts: dict, dtype_of: dict) -> TargetSelect | None:
    """The TargetSelect of a row statement, or None. `outer_consts`: the row's Consts by
    name; `dtype_of`: the dtype of each row value (t must be an integer)."""
    if not isinstance(r, ir.Reduce) or r.op != "sum":
        return None
    if any(isinstance(s, (ir.Store, ir.Loop, ir.Reduce)) for s in r.body):
        return None
    defs = _defs(r.body)
    w = defs.get(r.value)
    if not (isinstance(w, ir.Op) and w.op == "where" and w.dtype == r.dtype):
        return None
    hit, v, zero = w.args
    z = defs.get(zero) or outer_consts.get(zero)
    if not (isinstance(z, ir.Const) and z.value == 0 and z.dtype == r.dtype):
        return None
    h = defs.get(hit)
    if not (isinstance(h, ir.Op) and h.op == "eq" and len(h.args) == 2):
        return None
    for iv_name, t in (h.args, h.args[::-1]):
        iv = defs.get(iv_name)
        if (isinstance(iv, ir.IndexValue) and iv.expr == ir.Var(r.var) and iv.dtype in _INDEX_DTYPES
                and t not in defs and dtype_of.get(t) in dtypes.INTS and r.extent < 2**31):
            return TargetSelect(r, t, v, zero)
    return None

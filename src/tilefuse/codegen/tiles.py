"""CUDA C++ for maps that read a tensor transposed: 2-D tiles, the transposed reads through shared memory.

A map kernel walks its output row-major (row r, column c), and the row kernel's threads read
along c. An input whose address steps by 1 along r and by a whole row along c (a permute that
moved the last dim, read where it lies: `x.transpose(1, 2) * 2 + 1`) then costs a memory
transaction per element: 11% of copy bandwidth on an H200, for eager's copy too. Here a CTA
takes a tile of TR rows x TC columns:

    phase A: every such input's tile is copied into shared memory, its threads walking r
             (that input's contiguous dim: 16-byte loads where alignment allows)
    barrier
    phase B: each thread computes 4 bytes of output along c (two 16-bit elements), reading
             those inputs from shared memory (rows padded by one element: no bank conflict)
             and every other input where it lies; stores coalesced along c

`plan` finds the transposed loads by writing each load's address, inside a tile, as
corner + dr * i + dc * j (`_affine`); a load is staged where dr == 1 and dc > 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import dtypes
from ..loop import ir
from . import cexpr

THREADS = 256
TILES = ((64, 64), (32, 64), (64, 32), (32, 32), (16, 64), (16, 32))  # (rows, columns), preferred first
STATIC_SMEM = 48 * 1024
_VEC = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "uint2", 16: "uint4"}


@dataclass(frozen=True)
class _Aff:
    """An index inside a tile: value(r0 + i, c0 + j) = value(r0, c0) + dr * i + dc * j, where
    value(r0, c0) is a multiple of `align` (0: it is 0)."""

    dr: int
    dc: int
    align: int


def _affine(e: ir.Index, row: str, col: str, TR: int, TC: int) -> _Aff | None:
    """`e` as an _Aff over a tile whose corner r0, c0 is a multiple of TR, TC; None if the
    tile does not make it affine (a division that splits the tile, a gathered value)."""
    if isinstance(e, ir.IConst):
        return _Aff(0, 0, e.value) if e.value >= 0 else None
    if isinstance(e, ir.Var):
        if e.name == SEGMENT:
            return _Aff(0, 0, 1)
        return _Aff(1, 0, TR) if e.name == row else _Aff(0, 1, TC) if e.name == col else None
    if not isinstance(e, ir.IBin):
        return None
    a = _affine(e.a, row, col, TR, TC)
    if e.op in ("+", "*"):
        b = _affine(e.b, row, col, TR, TC)
        if a is None or b is None:
            return None
        if e.op == "+":
            return _Aff(a.dr + b.dr, a.dc + b.dc, math.gcd(a.align, b.align))
        if isinstance(e.b, ir.IConst):
            a, b = a, e.b.value
        elif isinstance(e.a, ir.IConst):
            a, b = b, e.a.value
        elif a.dr == a.dc == b.dr == b.dc == 0:
            return _Aff(0, 0, a.align * b.align)
        else:
            return None
        return _Aff(a.dr * b, a.dc * b, a.align * b) if b >= 0 else None
    if a is None or not isinstance(e.b, ir.IConst) or e.b.value <= 0:
        return None
    k, span = e.b.value, a.dr * (TR - 1) + a.dc * (TC - 1)
    if a.dr == a.dc == 0:
        return _Aff(0, 0, 1)
    whole = a.align % k == 0  # the corner a multiple of k (or 0)
    inside = a.align and k % a.align == 0 and span < a.align  # the tile inside one multiple of align
    if e.op == "//":
        if whole and a.dr % k == 0 and a.dc % k == 0:
            return _Aff(a.dr // k, a.dc // k, a.align // k)
        if whole and span < k or inside:
            return _Aff(0, 0, 0 if a.align == 0 else 1)
        return None
    if whole and span < k:
        return _Aff(a.dr, a.dc, 0)
    if inside:
        return _Aff(a.dr, a.dc, a.align)
    if whole and a.dr % k == 0 and a.dc % k == 0:
        return _Aff(0, 0, 0)
    return None


SEGMENT, POS = "tf_seg", "tf_pos"  # a row r = SEGMENT * Lr + POS (0 <= POS < Lr): tiles stay inside a segment


def _flat(buf: ir.Buffer, index: tuple, row: str, col: str, TR: int, TC: int, seg: tuple) -> _Aff | None:
    """The element offset as an _Aff over a tile of rows POS0.. of one segment (`seg` = (Lr,
    R // Lr, C)), the buffer's row-major strides. Each dim's index is simplified with r written
    as SEGMENT * Lr + POS (loop/views.py's division rules: a [3, 70, 100] read transposed has
    r % 70 = POS), and the dims summed: a reshape's digits recombine, `56 * (POS // 56) + POS % 56`
    into POS."""
    from ..loop import views

    if any(ir.index_values(e) for e in index):
        return None
    Lr, nseg, C = seg
    rsub = ir.IBin("+", ir.IBin("*", ir.IConst(Lr), ir.Var(SEGMENT)), ir.Var(POS))
    ext = {SEGMENT: nseg, POS: Lr, col: C}
    terms, const, stride = {}, 0, 1
    for e, n in reversed(list(zip(index, buf.shape))):
        try:
            e = views._to_index(views._of_index(_subst(e, row, rsub), ext))
        except (ValueError, KeyError):
            return None
        t, k = _lin(e)
        for a, c in t.items():
            terms[a] = terms.get(a, 0) + c * stride
        const += k * stride
        stride *= n
    return _affine(_build(_merged(terms), const), POS, col, TR, TC)


def _subst(e: ir.Index, var: str, by: ir.Index) -> ir.Index:
    if isinstance(e, ir.Var) and e.name == var:
        return by
    if isinstance(e, ir.IBin):
        return ir.IBin(e.op, _subst(e.a, var, by), _subst(e.b, var, by))
    return e


def _lin(e: ir.Index) -> tuple[dict, int]:
    """`e` as ({atom: coefficient}, constant): an atom is a Var, a // or % by a constant of a
    canonical sum, or a product of two non-constants."""
    if isinstance(e, ir.IConst):
        return {}, e.value
    if isinstance(e, ir.IBin) and e.op == "+":
        (ta, ka), (tb, kb) = _lin(e.a), _lin(e.b)
        out = dict(ta)
        for a, c in tb.items():
            out[a] = out.get(a, 0) + c
        return out, ka + kb
    if isinstance(e, ir.IBin) and e.op == "*" and (isinstance(e.a, ir.IConst) or isinstance(e.b, ir.IConst)):
        k, x = (e.a.value, e.b) if isinstance(e.a, ir.IConst) else (e.b.value, e.a)
        t, c = _lin(x)
        return {a: v * k for a, v in t.items()}, c * k
    if isinstance(e, ir.IBin) and e.op in ("//", "%") and isinstance(e.b, ir.IConst) and e.b.value > 0:
        k = e.b.value
        inner = _build(*_merged_lin(_lin(e.a)))
        # (x % a) % k = x % k where k divides a
        if e.op == "%" and isinstance(inner, ir.IBin) and inner.op == "%" and inner.b.value % k == 0:
            inner = inner.a
        # (x // a) // k = x // (a k)
        if e.op == "//" and isinstance(inner, ir.IBin) and inner.op == "//":
            inner, k = inner.a, inner.b.value * k
        return {ir.IBin(e.op, inner, ir.IConst(k)): 1}, 0
    return {e: 1}, 0


def _merged_lin(lin: tuple[dict, int]) -> tuple[dict, int]:
    return _merged(lin[0]), lin[1]


def _merged(terms: dict) -> dict:
    """A reshape's digits put back together: m (y // m) + (y % m) = y, and
    m ((y // m) % n) + (y % m) = y % (m n), each at any common coefficient."""
    terms = {a: c for a, c in terms.items() if c}
    changed = True
    while changed:
        changed = False
        for a, c in list(terms.items()):
            if not (isinstance(a, ir.IBin) and a.op == "%") or a not in terms:
                continue
            y, m = a.a, a.b.value
            whole, digit = ir.IBin("//", y, ir.IConst(m)), None
            for b, cb in terms.items():
                if isinstance(b, ir.IBin) and b.op == "%" and b.a == whole and cb == c * m:
                    digit = b
            if terms.get(whole) == c * m:
                del terms[a], terms[whole]
                for t, v in _lin(y)[0].items():
                    terms[t] = terms.get(t, 0) + c * v
                changed = True
            elif digit is not None:
                del terms[a], terms[digit]
                t = ir.IBin("%", y, ir.IConst(m * digit.b.value))
                terms[t] = terms.get(t, 0) + c
                changed = True
            terms = {t: v for t, v in terms.items() if v}
            if changed:
                break
    return terms


def _build(terms: dict, const: int) -> ir.Index:
    """The canonical index tree of a linear form (terms in a fixed order)."""
    out = None
    for a, c in sorted(terms.items(), key=lambda t: str(t[0])):
        t = a if c == 1 else ir.IBin("*", a, ir.IConst(c))
        out = t if out is None else ir.IBin("+", out, t)
    if out is None:
        return ir.IConst(const)
    return ir.IBin("+", out, ir.IConst(const)) if const else out


@dataclass(frozen=True)
class _Staged:
    """A transposed load's tile in shared memory."""

    key: tuple           # (buffer, index): loads of the same element share it
    buf: ir.Buffer
    index: tuple
    col: str             # the column loop's variable in the load's index
    dc: int              # its address step per column
    vector: int          # elements per phase-A load (consecutive rows)


@dataclass(frozen=True)
class TilePlan:
    """What `render` needs of a kernel: its rows and columns, the tile, the inputs it stages."""

    rows: int            # R
    cols: int            # C
    Lr: int              # rows a segment: a tile takes rows of one segment (Lr = R: no segments)
    TR: int
    TC: int
    staged: tuple        # _Staged, in order of first use
    vb: int              # output elements per thread in phase B (the default schedule's vector)
    packed: bool         # 16-bit outputs, 8 bytes of them a thread (what 8 CTAs an SM were measured with)


def _map_only(parts: ir.RowKernel) -> bool:
    return all(not isinstance(s, ir.Reduce) for s in parts.body)


def _inner(parts: ir.RowKernel, kind):
    """(column variable, statement) of each `kind` statement in the column loops."""
    for s in parts.body:
        if isinstance(s, ir.Loop):
            for t in s.body:
                if isinstance(t, kind):
                    yield s.var, t


def _staged(kernel: ir.Kernel, parts: ir.RowKernel, TR: int, TC: int, seg: tuple) -> list[_Staged]:
    out: dict = {}
    for col, s in _inner(parts, ir.Load):
        buf = kernel.buffer(s.buf)
        a = _flat(buf, s.index, parts.row_var, col, TR, TC, seg)
        if a is None or a.dr != 1 or a.dc <= 1:
            continue
        key = _key(s, col)
        if key in out:
            continue
        size = dtypes.itemsize(buf.dtype)
        v = 16 // size
        while v > 1 and (TR % v or a.dc % v or a.align % v or seg[0] % v):
            v //= 2
        out[key] = _Staged(key, buf, s.index, col, a.dc, v)
    return list(out.values())


def _key(s: ir.Load, col: str) -> tuple:
    """(buffer, index with the column variable spelled `c`): loads of one element, in any column
    loop, share one staged tile."""
    return (s.buf, tuple(str(_subst(e, col, ir.Var("c"))) for e in s.index))


def plan(kernel: ir.Kernel) -> TilePlan | None:
    """The tiles for a map-only row kernel that reads some input transposed; None where it reads
    none (or is not map-only, or ends in a grid reduction)."""
    if kernel.scratch:
        return None
    try:
        parts = ir.row_kernel_parts(kernel)
    except ValueError:
        return None
    if not _map_only(parts) or parts.rows <= 1 or parts.col_extent <= 1:
        return None
    if all(_along_columns(s.index, col) for col, s in _inner(parts, ir.Load)):
        return None  # (every load's last index is the column: the row kernel's case, found without the analysis)
    R, C = parts.rows, parts.col_extent
    best = None
    for Lr in _segments(parts):
        for TR, TC in TILES:
            seg = (Lr, R // Lr, C)
            st = _staged(kernel, parts, TR, TC, seg)
            smem = sum(TC * (TR + 1) * dtypes.itemsize(s.buf.dtype) for s in st)
            if not st or smem > STATIC_SMEM:
                continue
            used = Lr / (-(-Lr // TR) * TR)  # rows a segment's tiles hold, of the rows they could
            key = (len(st), used >= 0.7, TR * TC, used)
            if best is None or key > best[0]:
                best = (key, Lr, TR, TC, st)
    if best is None:
        return None
    _, Lr, TR, TC, st = best
    widest = max(dtypes.itemsize(b.dtype) for b in kernel.outputs) if kernel.outputs else 4
    # 8 bytes of 16-bit outputs a thread (four columns), 4 of wider ones: H200, bf16, same tensors
    # (bench/tiles_probe.py, session 56), sigmoid(x.T) * 3 at 64 x 4096 x 256 ran 72.9 us against
    # 83.7 at 4 bytes, the NCHW -> NHWC GELU 22.0 against 23.3; (x * 2 + 1).T 68.1 against 65.2
    vb = max(1, (8 if widest <= 2 else 4) // widest)
    while vb > 1 and parts.col_extent % vb:
        vb //= 2
    return TilePlan(R, C, Lr, TR, TC, tuple(st), vb, widest <= 2 and vb * widest == 8)


def _along_columns(index: tuple, col: str) -> bool:
    """The last index is the column (plus a constant): the load steps by 1 along a row."""
    e = index[-1] if index else None
    if isinstance(e, ir.IBin) and e.op == "+" and isinstance(e.b, ir.IConst):
        e = e.a
    return isinstance(e, ir.Var) and e.name == col


def _segments(parts: ir.RowKernel) -> list[int]:
    """Row counts a tile may not cross: all rows, and each divisor that splits the row index
    (the rows of one [B, D, S] batch, read from [B, S, D] at r % D) and divides the row count."""
    ks = {parts.rows}
    for s in ir.walk(parts.body):
        if isinstance(s, (ir.Load, ir.Store)):
            for e in s.index:
                ks |= _divisors(e, parts.row_var)
    return sorted(k for k in ks if 1 < k <= parts.rows and parts.rows % k == 0)[::-1]


def _divisors(e: ir.Index, row: str) -> set:
    if isinstance(e, ir.IBin):
        out = _divisors(e.a, row) | _divisors(e.b, row)
        if e.op in ("//", "%") and isinstance(e.b, ir.IConst) and row in ir.index_vars(e.a):
            out.add(e.b.value)
        return out
    return set()


def render(kernel: ir.Kernel, schedule, arch: str = "sm_90a"):
    """The tiled kernel's source (a mapreduce.KernelSource) under a stage="tiles" schedule
    (its threads and min_blocks; the tile is `plan`'s). ValueError where `plan` finds no
    transposed load."""
    from . import mapreduce as mr

    tp = plan(kernel)
    if tp is None:
        raise ValueError(f"kernel {kernel.name}: reads no input transposed (or is no map): stage='tiles' "
                         f"does not apply")
    parts = ir.row_kernel_parts(kernel)
    R, C, TR, TC, VB, T = tp.rows, tp.cols, tp.TR, tp.TC, schedule.vector, schedule.threads
    widest = max((dtypes.itemsize(b.dtype) for b in kernel.outputs), default=1)
    if C % VB or TC % VB or VB * widest > 16:
        raise ValueError(f"kernel {kernel.name}: {VB} columns a thread (vector={VB}) do not divide its {C} "
                         f"columns, or exceed 16 bytes of its outputs (the default: {tp.vb})")
    if R >= 2**31 or C >= 2**31:
        raise ValueError(f"kernel {kernel.name}: {R} rows of {C} elements are too many (indices are 32-bit)")
    row = parts.row_var
    name = mr._ident(kernel.name)
    em = mr._Emitter()
    em(f"// tilefuse map kernel {name}: {R} rows x {C} columns in tiles of {TR} x {TC}, "
       f"{len(tp.staged)} input(s) read transposed through shared memory")
    em(f"// schedule: {schedule}")
    em(f"// {'; '.join(str(b) for b in kernel.params)}")
    params = [f"{'const ' if b.role == 'in' else ''}{cexpr.storage_ctype(b.dtype)}* __restrict__ {mr._param(b.name)}"
              for b in kernel.params]
    em(f'extern "C" __global__ void __launch_bounds__({T}, {schedule.min_blocks})')
    em.open(f"{name}({', '.join(params)})")
    em("tf_pdl_launch();  // the next kernel may start once every CTA is here (programmatic launch)")
    em("tf_pdl_wait();    // and this one touches global memory only once the one before has finished")
    tiles_c = -(-C // TC)
    em("const int tid = threadIdx.x;")
    Lr, per_seg = tp.Lr, -(-tp.Lr // TR)
    em(f"// this CTA's tile: rows r0 = segment * {Lr} + d0 (d0 + i < {Lr}), columns c0..")
    em(f"const int c0 = (int)(blockIdx.x % {tiles_c}u) * {TC};")
    em(f"const int d0 = (int)((blockIdx.x / {tiles_c}u) % {per_seg}u) * {TR};")
    em(f"const int r0 = (int)(blockIdx.x / {tiles_c * per_seg}u) * {Lr} + d0;")
    alignment: dict = {}

    # ---- phase A: each transposed input's tile into shared memory, r fastest
    stride = TR + 1  # a padded tile column: phase B's threads read across columns without bank conflicts
    for k, s in enumerate(tp.staged):
        st = cexpr.storage_ctype(s.buf.dtype)
        size = dtypes.itemsize(s.buf.dtype)
        v = s.vector
        vt = _VEC[v * size] if v > 1 else st
        if v > 1:
            alignment[s.buf.name] = max(alignment.get(s.buf.name, 1), v * size)
        n = TR // v * TC
        per = -(-n // T)
        base = cexpr.flat_offset(s.buf, s.index, {row: "r0", s.col: "c0"})
        em(f"// {s.buf.name}[{', '.join(map(str, s.index))}]: +1 a row, +{s.dc} a column; "
           f"{v} row(s) a load")
        em(f"__shared__ {st} tf_tile{k}[{TC * stride}];")
        em.open("")
        em(f"const {st}* tf_src = {mr._param(s.buf.name)} + ({base});")
        em(f"{vt} tf_ld[{per}];")
        for phase in ("load", "store"):
            em("#pragma unroll")
            em.open(f"for (int q = 0; q < {per}; ++q)")
            em(f"const int w = tid + q * {T}, i = (w % {TR // v}) * {v}, j = w / {TR // v};")
            guards = ([f"w < {n}"] if n % T else []) + ([f"d0 + i < {Lr}"] if Lr % TR else []) \
                + ([f"c0 + j < {C}"] if C % TC else [])
            cond = " && ".join(guards) or "true"
            if phase == "load":
                em(f"if ({cond}) tf_ld[q] = *reinterpret_cast<const {vt}*>(tf_src + i + (long long)j * {s.dc});")
            elif v == 1:
                em(f"if ({cond}) tf_tile{k}[j * {stride} + i] = tf_ld[q];")
            else:
                em.open(f"if ({cond})")
                em(f"const {st}* e = reinterpret_cast<const {st}*>(&tf_ld[q]);")
                em("#pragma unroll")
                em(f"for (int t = 0; t < {v}; ++t) tf_tile{k}[j * {stride} + i + t] = e[t];")
                em.close()
            em.close()
        em.close()
    em("__syncthreads();")

    # ---- phase B: VB consecutive columns of one row a thread, c fastest
    staged = {s.key: k for k, s in enumerate(tp.staged)}
    vec_out = {}
    for col, s in _inner(parts, ir.Store):
        b = kernel.buffer(s.buf)
        a = _flat(b, s.index, row, col, TR, TC, (Lr, R // Lr, C))
        if VB > 1 and a is not None and a.dc == 1 and a.align % VB == 0 and a.dr % VB == 0 and TC % VB == 0:
            vec_out[id(s)] = b
            alignment[b.name] = max(alignment.get(b.name, 1), VB * dtypes.itemsize(b.dtype))
    nb = TR * (TC // VB)
    per = -(-nb // T)
    fast = mr.fast_math(kernel)
    store_only = mr._cast_store_only(kernel, parts.body)
    em("#pragma unroll")
    em.open(f"for (int q = 0; q < {per}; ++q)")
    em(f"const int w = tid + q * {T}, i = w / {TC // VB}, jv = (w % {TC // VB}) * {VB};")
    em("const int r = r0 + i;")
    if nb % T:
        em(f"if (w >= {nb}) continue;")
    vec_names = {}
    for sid, b in vec_out.items():
        nm = f"tf_out{len(vec_names)}"
        vec_names[sid] = nm
        em(f"alignas({VB * dtypes.itemsize(b.dtype)}) {cexpr.storage_ctype(b.dtype)} {nm}[{VB}];")
    em("#pragma unroll")
    em.open(f"for (int e = 0; e < {VB}; ++e)")
    em("const int j = jv + e, c = c0 + j;")
    oks = ([f"d0 + i < {Lr}"] if Lr % TR else []) + ([f"c < {C}"] if C % TC else [])
    em(f"const bool ok = {' && '.join(oks) or 'true'};")
    names: dict = {}
    dtype_of: dict = {}

    def define(ssa: str, dtype: str) -> str:
        base = "v_" + mr._ident(ssa)
        nm, n = base, 1
        while nm in names.values():
            nm, n = f"{base}_{n}", n + 1
        names[ssa], dtype_of[ssa] = nm, dtype
        return nm

    def emit(s, env: dict, col: str | None):
        if isinstance(s, ir.Const):
            em(f"const {cexpr.ctype(s.dtype)} {define(s.dst, s.dtype)} = {cexpr.const(s.value, s.dtype)};")
        elif isinstance(s, ir.Op):
            args, adt = [names[a] for a in s.args], [dtype_of[a] for a in s.args]
            expr = (cexpr.cast(args[0], adt[0], "f32") if s.dst in store_only
                    else cexpr.op(s.op, args, adt, s.dtype, fast=fast))
            em(f"const {cexpr.ctype(s.dtype)} {define(s.dst, s.dtype)} = {expr};")
        elif isinstance(s, ir.IndexValue):
            em(f"const {cexpr.ctype(s.dtype)} {define(s.dst, s.dtype)} = "
               f"({cexpr.ctype(s.dtype)})({cexpr.index(s.expr, env)});")
        elif isinstance(s, ir.Load):
            b = kernel.buffer(s.buf)
            key = _key(s, col) if col else None
            if key in staged:
                expr = cexpr.from_storage(b.dtype, f"tf_tile{staged[key]}[j * {stride} + i]")
            else:
                expr = mr._guarded_load(kernel, s, env, "ok")  # (masked outside the tile's valid part)
            em(f"const {cexpr.ctype(b.dtype)} {define(s.dst, b.dtype)} = {expr};")
        elif isinstance(s, ir.Store):
            b = kernel.buffer(s.buf)
            val, vdt = names[s.value], dtype_of[s.value]
            if vdt != b.dtype and s.value not in store_only:
                val = cexpr.cast(val, vdt, b.dtype)
            if id(s) in vec_names:
                em(f"{vec_names[id(s)]}[e] = {cexpr.to_storage(b.dtype, val)};")
            else:
                guard = "ok" if col else "ok && c == 0"
                for e, n in zip(s.index, b.shape):
                    if ir.index_values(e):
                        guard += f" && (unsigned long long)({cexpr.index(e, env)}) < {n}ULL"
                em(f"if ({guard}) {mr._param(b.name)}[{cexpr.flat_offset(b, s.index, env)}] = "
                   f"{cexpr.to_storage(b.dtype, val)};")
        else:
            raise ValueError(f"kernel {kernel.name}: unexpected statement {s}")
        if isinstance(s, (ir.Const, ir.Op, ir.IndexValue, ir.Load)):
            env[s.dst] = names[s.dst]

    env = {row: "r"}
    for s in parts.body:
        if isinstance(s, ir.Loop):
            inner = dict(env, **{s.var: "c"})
            for t in s.body:
                emit(t, inner, s.var)
        else:
            emit(s, env, None)
    em.close()
    for col, s in _inner(parts, ir.Store):
        if id(s) in vec_names:
            b = kernel.buffer(s.buf)
            vt = _VEC[VB * dtypes.itemsize(b.dtype)]
            off = cexpr.flat_offset(b, s.index, {row: "r", col: "(c0 + jv)"})
            oks = ([f"d0 + i < {Lr}"] if Lr % TR else []) + ([f"c0 + jv < {C}"] if C % TC else [])
            em(f"if ({' && '.join(oks) or 'true'}) *reinterpret_cast<{vt}*>({mr._param(b.name)} + ({off})) = "
               f"*reinterpret_cast<const {vt}*>({vec_names[id(s)]});")
    em.close()
    em.close()
    return mr.KernelSource(name=name, source=cexpr.PRELUDE + "\n" + em.text(), grid=(R // Lr * per_seg * tiles_c, 1, 1),
                           block=(T, 1, 1), smem_bytes=0, cluster=(1, 1, 1),
                           params=tuple(b.name for b in kernel.params),
                           alignment=tuple(sorted(alignment.items())), schedule=schedule)



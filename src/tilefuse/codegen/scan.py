"""Scans along the row (cumsum, cumprod, cummax's values): the pass that carries a running
value across a row's chunks.

A kernel with a scan (loop/ir.py `Scan`, at most one: graph/fusion.py) is a map-reduce kernel
whose last column loop holds it, after the passes of its reductions (none of which reads the
scan: a softmax and then its cumsum). That loop walks the row once, a tile of J chunks per
thread at a time (all of a thread's chunks where the row is held in registers, `unroll` of
them in the stream stage); chunk j of thread p covers columns V (p + j P) (codegen/rowlayout.py):

1. each thread computes the scanned value of its chunks' elements and their running `op`
   within each chunk (the chunk's total is its last);
2. the row's threads scan the chunks' totals, in column order, for each chunk of the tile:
   warp shuffles for a row of at most 32 threads, else the shuffles, then each warp's total
   through shared memory (one barrier a tile; two buffers, so the next tile's writes never
   meet this one's reads), then each thread combines the totals of the warps before its own;
3. each element's value is the running value of the tiles before (`carry`), of the chunks
   before its own, and its own within its chunk; the statements after the scan (the maps of
   it, the stores) run on it, and the chunk is stored.

Values of step 1 that step 3 needs are held per element in registers. The order of additions
is a tree's, not PyTorch's left to right: a float sum differs from it by rounding, as
PyTorch's own CUDA scan does (a parallel one).
"""
from __future__ import annotations

from ..loop import ir
from . import cexpr, columns

# registers of running values per thread a tile may take (sc[J][V]): beyond it the stream stage
TILE_VALUES = 32


def scan_of(loop) -> ir.Scan | None:
    """The Scan directly in a column loop's body, or None."""
    found = [s for s in loop.body if isinstance(s, ir.Scan)]
    return found[0] if found else None


def has_scan(kernel: ir.Kernel) -> bool:
    return any(isinstance(s, ir.Scan) for s in ir.walk(kernel.body))


def identity(op: str, dtype: str) -> str:
    return cexpr.identity(op, dtype)


def combine(op: str, a: str, b: str) -> str:
    """a then b: a is the earlier part of the row (every op here commutes; floats' rounding
    follows the order written)."""
    return cexpr.combine(op, a, b)


def check_kernel(kernel: ir.Kernel) -> None:
    """Raise ValueError for a kernel the scan pass does not take."""
    scans = [s for s in ir.walk(kernel.body) if isinstance(s, ir.Scan)]
    row = kernel.body[0].body if kernel.body and isinstance(kernel.body[0], ir.Loop) else ()
    last = [s for s in row if isinstance(s, (ir.Loop, ir.Reduce))][-1:]
    if len(scans) > 1 or kernel.scratch or not last or scan_of(last[0]) is not scans[0]:
        raise ValueError(f"kernel {kernel.name}: a scan's kernel has one scan, in the row's last pass, "
                         f"and no grid reduction")


def check(kernel: ir.Kernel, sch) -> None:
    """Raise ValueError for a kernel or schedule the scan pass does not take."""
    check_kernel(kernel)
    if sch.stage not in ("regs", "stream") or sch.cluster != 1 or sch.batch != 1 or sch.across:
        raise ValueError(f"kernel {kernel.name}: a scan's row is walked by one CTA, its chunks in registers "
                         f"or streamed (stage 'regs' or 'stream', no cluster, batch 1, the row's threads "
                         f"neighbours), not {sch}")


def default_schedule(kernel: ir.Kernel, parts: ir.RowKernel, arch: str, stage: str | None = None):
    """Four chunks a thread in registers: a row of at most 128 chunks to a sub-warp or warp
    (shuffles alone), up to 4096 chunks to one CTA of up to 1024 threads (a barrier a row);
    longer rows streamed by 512 threads, 4 chunks a tile. A register cap of about 80 a thread:
    a tile's 32 running values, the staged chunks and the pass's own. Fewer chunks a thread
    where the staged streams are wide (at most MAX_STAGED_WORDS registers of them); streamed
    where one chunk of them is wider still."""
    from . import mapreduce as mr

    check_kernel(kernel)
    if stage is None and columns.strided_rows(kernel):
        # a column kernel (a scan along a dim that is not last): a row a thread, neighbouring rows
        # in neighbouring lanes, each thread's 32 loads of a tile in flight
        return mr.MapReduceSchedule(threads=128, group=1, vector=1, stage="stream", unroll=32, min_blocks=2)
    v = mr._choose_vector(kernel, parts)
    # (16 elements a chunk for a bool stream are 32 registers of an int64 one beside it: the
    # chunk narrowed until its streams take at most half the staged registers)
    while v > 1 and mr.staged_words(kernel, v) > mr.MAX_STAGED_WORDS // 2:
        v //= 2
    chunks = -(-parts.col_extent // v)
    # (fewer chunks a thread where the row's streams would stage more registers than render
    # holds: six f32 inputs of a map before the scan, at four 16-byte chunks, were 96)
    words = mr.staged_words(kernel, v)
    per = max(1, min(4, TILE_VALUES // v, mr.MAX_STAGED_WORDS // max(1, words)))
    want = -(-chunks // per)
    if stage == "stream" or (stage is None and (want > 1024 or per * words > mr.MAX_STAGED_WORDS)):
        return mr.MapReduceSchedule(threads=512, group=512, vector=v, stage="stream", unroll=per, min_blocks=1)
    if stage not in (None, "regs"):
        raise ValueError(f"kernel {kernel.name}: a scan's row is staged in registers or streamed, not {stage!r}")
    if want > 1024:
        raise ValueError(f"kernel {kernel.name}: a row of {chunks} chunks is too long to hold in registers")
    g = mr._pow2ceil(want)
    t = max(g, 128)
    return mr.MapReduceSchedule(threads=t, group=g, vector=v, stage="regs", min_blocks=max(1, 65536 // (80 * t)))


def _slice(body: list, value: str) -> set:
    """ids of the statements of `body` that `value` is computed from."""
    from .mapreduce import _reads

    need, out = {value}, set()
    for s in reversed(body):
        if getattr(s, "dst", None) in need:
            out.add(id(s))
            need |= _reads(s)
    return out


def emit_pass(ctx, em, loop: ir.Loop):
    """The row's one pass: its scan and every statement of the column loop (module docstring)."""
    from . import mapreduce as mr

    sc = scan_of(loop)
    body = list(loop.body)
    at = body.index(sc)
    first_ids = _slice(body[:at], sc.value)
    first = [s for s in body[:at] if id(s) in first_ids]
    second = [s for s in body if id(s) not in first_ids and s is not sc]
    made = {s.dst: s for s in first}
    read_later = set().union(*(mr._reads(s) for s in second)) if second else set()
    held = [d for d in made if d in read_later]
    held_type = {d: ctx.kernel.buffer(s.buf).dtype if isinstance(s, ir.Load) else s.dtype for d, s in made.items()}

    V, P, C, nchunk = ctx.V, ctx.P, ctx.C, ctx.nchunk
    regs = ctx.sched.stage == "regs"
    J = nchunk if regs else max(1, min(ctx.sched.unroll, nchunk))
    tiles = -(-nchunk // J)
    guarded = not ctx.full or nchunk % J != 0  # (a chunk past the row's end: c0 >= C)
    op, acc = sc.op, sc.dtype
    ct, ident = cexpr.ctype(acc), identity(sc.op, acc)
    staged = {k for k, st in ctx.ana.in_streams.items() if regs and st.per_row}
    streams = mr._streams_used(first + second, ctx.ana.in_streams, ctx.ana.load_stream)
    loaded = [st for st in streams if st.key not in staged]

    def src_chunk(key):
        st = ctx.ana.in_streams[key]
        return f"{st.name}_s[j]" if key in staged else f"{st.name}_c[jj]"

    em(f"// ---- scan along the row: {sc} (codegen/scan.py), then the statements after it")
    em(f"{ct} carry = {ident};  // the running value of the tiles before this one")
    warps = P // 32 if P > 32 else 0
    if warps:
        em(f"__shared__ {ct} tf_scan_w[2][{J}][{ctx.sched.threads // 32}];  "
           "// each warp's chunk totals, by tile parity (one barrier a tile)")
        em("const int wl = threadIdx.x & 31, wr = lane >> 5;  // lane in the warp, warp in the row")
        em("const int w0 = (threadIdx.x >> 5) - wr;  // the row's first warp in the CTA")
    if tiles > 1:
        em("#pragma unroll 1")
        em.open(f"for (int jt = 0; jt < {nchunk}; jt += {J})")
    else:
        em.open("")
        em("const int jt = 0;")
    em(f"{ct} sc[{J}][{V}];  // each chunk's running value from its first element")
    em(f"{ct} tot[{J}];      // each chunk's total")
    for h in held:
        em(f"{cexpr.ctype(held_type[h])} h_{mr._ident(h)}[{J}][{V}];  // %{h}, for after the scan")
    for st in loaded:
        em(f"unsigned {st.name}_c[{J}][{mr._words(st.buf.dtype, V)}];")

    # 1. the chunks' running values
    em("#pragma unroll")
    em.open(f"for (int jj = 0; jj < {J}; ++jj)")
    em("const int j = jt + jj; (void)j;")
    em(f"const int c0 = {ctx.lay.c_column(0)};  // first column of chunk j")
    for st in loaded:
        mr._emit_chunk_load(ctx, em, st, f"{st.name}_c[jj]", "row_ok" + (f" && c0 < {C}" if guarded else ""))
    em(f"{ct} run = {ident};")
    if guarded:
        em.open(f"if (c0 < {C})")
    _element_loop(ctx, em, loop, first, src_chunk, None,
                  tail=lambda c: [f"run = {combine(op, 'run', c(sc.value))};", "sc[jj][v] = run;"]
                  + [f"h_{mr._ident(h)}[jj][v] = {c(h)};" for h in held])
    if guarded:
        em.close()
    em("tot[jj] = run;")
    em.close()

    # 2. the totals' scan across the row's threads
    em(f"{ct} pre[{J}];  // the running value before chunk jj")
    if P == 1:
        em("#pragma unroll")
        em.open(f"for (int jj = 0; jj < {J}; ++jj)")
        em("pre[jj] = carry;")
        em(f"carry = {combine(op, 'carry', 'tot[jj]')};")
        em.close()
    elif not warps:
        em("#pragma unroll")
        em.open(f"for (int jj = 0; jj < {J}; ++jj)")
        _warp_scan(em, op, ct, ident, P, "lane")
        em(f"const {ct} all = __shfl_sync(0xffffffffu, x, {P - 1}, {P});  // the row's total")
        em(f"pre[jj] = {combine(op, 'carry', 'ex')};")
        em(f"carry = {combine(op, 'carry', 'all')};")
        em.close()
    else:
        parity = f"(jt / {J}) & 1" if tiles > 1 else "0"
        em(f"{ct} wex[{J}];  // the running value before this thread's chunk jj within its warp")
        em("#pragma unroll")
        em.open(f"for (int jj = 0; jj < {J}; ++jj)")
        _warp_scan(em, op, ct, ident, 32, "wl")
        em("wex[jj] = ex;")
        em(f"if (wl == 31) tf_scan_w[{parity}][jj][threadIdx.x >> 5] = x;")
        em.close()
        em("__syncthreads();")
        em("#pragma unroll")
        em.open(f"for (int jj = 0; jj < {J}; ++jj)")
        em(f"{ct} before = {ident}, all = {ident};")
        em("#pragma unroll")
        em.open(f"for (int w = 0; w < {warps}; ++w)")
        em(f"const {ct} t = tf_scan_w[{parity}][jj][w0 + w];")
        em(f"if (w < wr) before = {combine(op, 'before', 't')};")
        em(f"all = {combine(op, 'all', 't')};")
        em.close()
        em(f"pre[jj] = {combine(op, 'carry', combine(op, 'before', 'wex[jj]'))};")
        em(f"carry = {combine(op, 'carry', 'all')};")
        em.close()

    # 3. each element's value, and the statements after the scan
    em("#pragma unroll")
    em.open(f"for (int jj = 0; jj < {J}; ++jj)")
    em("const int j = jt + jj; (void)j;")
    em(f"const int c0 = {ctx.lay.c_column(0)};")
    if guarded:
        em.open(f"if (c0 < {C})")
    outs = mr._streams_used(second, ctx.ana.out_streams, ctx.ana.store_stream)
    for st in outs:
        w = mr._words(st.buf.dtype, V)
        em(f"unsigned {st.name}_o[{w}] = {{{', '.join(['0u'] * w)}}};")
    head = [(sc.dst, acc, combine(op, "pre[jj]", "sc[jj][v]"))] + [
        (h, held_type[h], f"h_{mr._ident(h)}[jj][v]") for h in held]
    _element_loop(ctx, em, loop, second, src_chunk, lambda key: f"{ctx.ana.out_streams[key].name}_o", head=head)
    mr._emit_out_chunks(ctx, em, outs)
    if guarded:
        em.close()
    em.close()
    em.close()


def _warp_scan(em, op: str, ct: str, ident: str, width: int, lane: str):
    """x: the inclusive scan of tot[jj] over the `width` lanes of a segment; ex: the exclusive."""
    em(f"{ct} x = tot[jj];")
    d = 1
    while d < width:
        em(f"{{ const {ct} y = __shfl_up_sync(0xffffffffu, x, {d}, {width}); "
           f"if ({lane} >= {d}) x = {combine(op, 'y', 'x')}; }}")
        d *= 2
    em(f"{ct} ex = __shfl_up_sync(0xffffffffu, x, 1, {width});")
    em(f"if ({lane} == 0) ex = {ident};")


def _element_loop(ctx, em, loop: ir.Loop, stmts: list, src_chunk, out_chunk, head=(), tail=None):
    """for v in the chunk: the values `head` names (SSA name, dtype, C expression), `stmts`,
    then the lines tail(c) gives, c(name) the C name of SSA value `name`."""
    from . import mapreduce as mr

    em("#pragma unroll")
    em.open(f"for (int v = 0; v < {ctx.V}; ++v)")
    em(f"const int c = c0 + {ctx.lay.c_column('v', 0, 0)}; (void)c;")
    saved = dict(ctx.names), dict(ctx.dtype_of)
    env = mr._env(ctx, None)
    env[loop.var] = "c"
    for ssa, dt, expr in head:
        name = ctx.define(ssa, dt)
        em(f"const {cexpr.ctype(dt)} {name} = {expr};")
        env[ssa] = name
    for s in stmts:
        mr._emit_stmt(ctx, em, s, env, inner=True, src_chunk=src_chunk, out_chunk=out_chunk)
    for line in tail(ctx.c) if tail else ():
        em(line)
    ctx.names, ctx.dtype_of = saved
    em.close()

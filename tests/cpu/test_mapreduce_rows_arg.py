"""Map-reduce kernels that take their row count as an argument (codegen.mapreduce.rows_free).

One source serves every row count of a schedule, so a new prompt length builds no map-reduce
kernel whose schedule it shares with a length seen before. The properties: the source rendered
with the count an argument is the baked source but for its name, its comments and the row
guard's bound; it is the same text at every count; the count reaches the launch (the grid, the
`rows` the launcher passes); and where the count could reach the source otherwise (a gathered
leading index bounded by a table as long as the kernel, a grid reduction, a single row) the
count stays baked. Rows that cycle through a table (RoPE's cos / sin, read at r % S beside
heads x S rows) take the period S as a second argument, so a new prompt length shares their
source too.
"""
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import loop_fixtures as fx
from tilefuse.codegen import cexpr, mapreduce
from tilefuse.codegen.mapreduce import default_schedule, render, rows_free
from tilefuse.loop import ir
from tilefuse.runtime import cache
from tilefuse.runtime.launch import CompiledKernel, compile_source_only

NAMES = ["rmsnorm", "softmax", "cross_entropy", "layernorm", "add_rmsnorm", "map"]
SHAPES = [(3000, 4096), (1001, 256), (9, 136), (5, 65536)]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path / "cubins"))


def _baked(kernel, sched):
    old = mapreduce.ROWS_ARG
    mapreduce.ROWS_ARG = False
    try:
        return render(kernel, sched, "sm_90a")
    finally:
        mapreduce.ROWS_ARG = old


def _code(src) -> list:
    """The source's lines that compile to something, without comments, its entry point's name
    taken out."""
    text = cache.code_of(src.source).replace(src.name, "NAME")
    return [re.sub(r"\s*//.*$", "", line.strip()) for line in text.splitlines()]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("R,C", SHAPES)
def test_the_rows_argument_source_is_the_baked_one_but_for_the_row_bound(name, R, C):
    k = fx.BUILDERS[name](R, C, "bf16")
    sched = default_schedule(k, "sm_90a")
    arg, baked = render(k, sched, "sm_90a"), _baked(k, sched)
    assert arg.rows == R and baked.rows is None
    assert arg.grid == baked.grid and arg.block == baked.block and arg.smem_bytes == baked.smem_bytes
    a, b = _code(arg), _code(baked)
    assert len(a) == len(b)
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    # the entry point takes the count last; each row guard reads it; where every row fits one
    # CTA the baked source wrote the row index without the block's digit (it is zero there)
    assert diff[0][0] == diff[0][1][:-len(") {")] + ", const int tf_rows) {"
    for x, y in diff[1:]:
        if x.startswith("const bool row_ok"):
            assert (x, y) == ("const bool row_ok = (int)r < tf_rows;", f"const bool row_ok = r < {R};")
        else:
            assert re.match(r"const (long long r|int rowblock) = ", x) and -(-R // sched.rows_per_cta) == 1, (x, y)
    assert sum(x.startswith("const bool row_ok") for x, _ in diff) >= 1


@pytest.mark.parametrize("name", NAMES)
def test_one_source_serves_every_row_count_of_a_schedule(name):
    """Renders at other counts under one schedule are the same text (one cubin cache key), each
    with its own grid; an unseen count renders no new source."""
    k0 = fx.BUILDERS[name](3000, 2048, "bf16")
    sched = default_schedule(k0, "sm_90a")
    srcs = {R: render(fx.BUILDERS[name](R, 2048, "bf16"), sched, "sm_90a") for R in (3000, 2250, 3001, 17)}
    assert len({s.source for s in srcs.values()}) == 1 and len({s.name for s in srcs.values()}) == 1
    for R, s in srcs.items():
        assert s.rows == R and s.grid == (-(-R // sched.rows_per_cta) * sched.cluster, 1, 1)


def test_a_second_row_count_compiles_nothing():
    """The cubin cache hits for a count whose schedule was built at another count."""
    k1, k2 = fx.rmsnorm_kernel(3000, 4096), fx.rmsnorm_kernel(2250, 4096)
    sched = default_schedule(k1, "sm_90a")
    assert default_schedule(k2, "sm_90a") == sched  # (the two counts share the default schedule)
    s1, c1 = compile_source_only(k1, "sm_90a", sched)
    s2, _ = compile_source_only(k2, "sm_90a", sched)
    _, hit = cache.compile_cached(s2.source, s2.name, "sm_90a")
    assert hit and s1.source == s2.source and c1.info.clean


def test_the_launcher_passes_the_count_last():
    """The kernel parameter block holds the buffers' pointers, then a pointer to an int holding
    the count."""
    import ctypes

    k = fx.rmsnorm_kernel(1001, 256)
    src, cubin = compile_source_only(k, "sm_90a")
    ck = CompiledKernel(k, "sm_90a", src, cubin, False)
    assert len(ck._ptrs) == len(src.params) + 1
    assert ctypes.c_int.from_address(ck._ptrs[len(src.params)]).value == 1001


def test_a_gathered_table_as_long_as_the_kernel_keeps_its_bound():
    """An embedding table read at a gathered row bounds the index by its length; when that
    length equals the row count it must not be left out with it."""
    k = fx.gather_kernel(11, 64, V=11)
    free = rows_free(k)
    assert free is not None and free.buffer("table").shape == (11, 64) and free.buffer("ids").shape[0] == 0
    a = render(k, None, "sm_90a")
    b = render(fx.gather_kernel(12, 64, V=12), default_schedule(k, "sm_90a"), "sm_90a")
    assert "< 11ULL" in a.source and "< 12ULL" in b.source and a.source != b.source


def test_grid_reductions_and_single_rows_keep_the_count_in_the_source():
    k = fx.rmsnorm_kernel(1, 4096)
    assert rows_free(k) is None and render(k, None, "sm_90a").rows is None
    assert rows_free(replace(fx.rmsnorm_kernel(8, 64), scratch=fx.rmsnorm_kernel(8, 64).params[:1])) is None


def test_a_count_too_large_for_32_bit_rows_is_refused():
    src = render(fx.rmsnorm_kernel(4096, 256), None, "sm_90a")
    with pytest.raises(ValueError, match="too many"):
        mapreduce.at_rows(src, 2**31 - 1)


@pytest.mark.parametrize("name,R,C,dtype", [("rmsnorm", 1000, 256, "bf16"), ("softmax", 32768, 4096, "f32"),
                                            ("add_rmsnorm", 4096, 65536, "bf16"), ("cross_entropy", 1001, 2048, "f16")])
def test_the_argument_costs_no_spill_the_baked_source_does_not_have(name, R, C, dtype):
    """Under the same schedule, the rows-argument kernel spills no more than the baked one (the
    guard compares 32 bits: a 64-bit compare with the argument held a register pair through the
    row and spilled 24 bytes of a batch-of-2 RMSNorm capped at 64 registers)."""
    from tilefuse.runtime import nvrtc

    k = fx.BUILDERS[name](R, C, dtype)
    sched = default_schedule(k, "sm_90a")
    arg, baked = render(k, sched, "sm_90a"), _baked(k, sched)
    a = nvrtc.compile_cuda(arg.source, arg.name, "sm_90a").info
    b = nvrtc.compile_cuda(baked.source, baked.name, "sm_90a").info
    assert (a.spill_stores, a.spill_loads, a.stack_bytes) <= (b.spill_stores, b.spill_loads, b.stack_bytes), (a, b)
    assert a.registers <= b.registers + 4, (a, b)


def test_a_program_kernel_at_another_count_is_rendered_once():
    """A program renders kernels named by structure (their digest counts the rows): the memo
    keys them without that digest, so a second count renders nothing new."""
    from tilefuse.loop.canon import named_by_structure

    sched = default_schedule(fx.rmsnorm_kernel(3000, 4096), "sm_90a")
    mapreduce._RENDERED.clear()
    a = render(named_by_structure(fx.rmsnorm_kernel(3000, 4096)), sched, "sm_90a")
    n = len(mapreduce._RENDERED)
    b = render(named_by_structure(fx.rmsnorm_kernel(2250, 4096)), sched, "sm_90a")
    assert len(mapreduce._RENDERED) == n and a.source == b.source and (a.rows, b.rows) == (3000, 2250)


def test_schedules_that_render_the_same_code_are_one_kernel():
    """The name hashes the code without its comments (the header comment names every knob), so
    two schedules whose code is the same are one kernel: the tuner counts them once, the cubin
    cache builds them once. (two_pass changes nothing for a row of a CTA's width.)"""
    k = fx.rmsnorm_kernel(64, 1024)
    sched = replace(default_schedule(k, "sm_90a"), group=256, threads=256, batch=1)
    a, b = render(k, sched, "sm_90a"), render(k, replace(sched, two_pass=not sched.two_pass), "sm_90a")
    assert cache.code_of(a.source) == cache.code_of(b.source) and a.name == b.name
    assert a.source != b.source  # (their comments differ)


# -- rows cycling through a table (rows_period): RoPE's cos / sin beside heads x S rows ------------


def _rope(q, cos, sin):
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin


def _rope_kernel(S, heads=4, dim=16, batch=1, dtype=None):
    """The program's kernel that reads the cos / sin tables, as the program builds it."""
    from tilefuse.compiler import compile_stages
    from tilefuse.loop.canon import named_by_structure

    t = dtype or torch.bfloat16
    x = (torch.randn(batch, heads, S, dim, dtype=t), torch.randn(batch, 1, S, dim, dtype=t),
         torch.randn(batch, 1, S, dim, dtype=t))
    st = compile_stages(_rope, x, arch="sm_90a")
    # (the tables' kernel: q, cos, rotated q, its signs, sin and the output)
    return named_by_structure(max((lk.kernel for lk in st.kernels.values()), key=lambda k: len(k.params)))


def _restored(free, k, S):
    """`free` with its count and period put back (the inverse of rows_free, given `k`'s params)."""
    loop = free.body[0]
    body = mapreduce.map_index(loop.body, lambda e: ir.IConst(S) if e == ir.Var(cexpr.PERIOD) else e)
    return replace(free, params=k.params, body=(replace(loop, extent=k.body[0].extent, body=body),))


@pytest.mark.parametrize("S", [40, 30, 3000, 7])
def test_the_rows_free_form_is_the_kernel_at_its_count_and_period(S):
    """Putting the count and the period back into rows_free's form gives the kernel: every place
    the form differs from the kernel held one of them (so two kernels with one form are that
    form at their own count and period)."""
    k = _rope_kernel(S)
    assert mapreduce.rows_period(k) == S
    free = rows_free(k)
    assert free != k and _restored(free, k, S) == k
    # q, the tables, the rotated half and the output keep no length; the rotation's signs
    # (graph/rules/cat_signs.py) are a column vector, the same at every length
    assert all(b.shape[0] == 0 for b in free.params if len(b.shape) > 1)
    assert [b.shape for b in free.params if len(b.shape) == 1] == [(16,)]


def test_rope_at_every_prompt_length_is_one_source():
    """The tables' kernel at 40, 30, 3000 and 7 tokens renders one text (one NVRTC build), each
    launch with its own count, period and grid; the table is read at the row modulo tf_s in
    32-bit arithmetic, and no length is written into the code."""
    srcs = {S: render(_rope_kernel(S), default_schedule(_rope_kernel(40), "sm_90a"), "sm_90a")
            for S in (40, 30, 3000, 7)}
    assert len({s.source for s in srcs.values()}) == 1 and len({s.name for s in srcs.values()}) == 1
    for S, s in srcs.items():
        assert (s.rows, s.period) == (4 * S, S)
        assert s.grid == (-(-4 * S // s.schedule.rows_per_cta) * s.schedule.cluster, 1, 1)
    code = "\n".join(_code(srcs[40]))
    assert "const int tf_rows, const int tf_s)" in code and "(long long)((int)(r) % tf_s)" in code
    assert not re.search(r"\b(40|30|3000|160|120)\b", code)


def test_the_period_source_is_the_baked_one_but_for_the_row_bound_and_the_period():
    k = _rope_kernel(40)
    sched = default_schedule(k, "sm_90a")
    a, b = _code(render(k, sched, "sm_90a")), _code(_baked(k, sched))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x != y:
            assert (x.replace("(long long)((int)(r) % tf_s)", "(r % 40)") == y
                    or x.startswith("const bool row_ok") or x.endswith("const int tf_rows, const int tf_s) {")
                    or re.match(r"const (long long r|int rowblock) = ", x)), (x, y)


def test_no_period_where_the_tables_hold_a_batch():
    """A table per batch item ([B, S, d]: S is a stride) keeps its length: each prompt length is
    its own source (its count is still an argument); a kernel with no table has no period."""
    k2, k3 = _rope_kernel(40, batch=2), _rope_kernel(30, batch=2)
    assert mapreduce.rows_period(k2) is None and rows_free(k2) is not None
    sched = default_schedule(k2, "sm_90a")
    assert render(k2, sched, "sm_90a").source != render(k3, sched, "sm_90a").source
    assert render(k2, sched, "sm_90a").period is None
    assert mapreduce.rows_period(fx.rmsnorm_kernel(3000, 4096)) is None


def test_the_launcher_passes_the_period_after_the_count():
    import ctypes

    k = _rope_kernel(30)
    src, cubin = compile_source_only(k, "sm_90a")
    assert cubin.info.clean, cubin.info
    ck = CompiledKernel(k, "sm_90a", src, cubin, False)
    n = len(src.params)
    assert len(ck._ptrs) == n + 2
    assert [ctypes.c_int.from_address(ck._ptrs[n + i]).value for i in (0, 1)] == [120, 30]


def test_a_source_taking_a_period_is_not_launched_without_one():
    src = render(_rope_kernel(30), None, "sm_90a")
    with pytest.raises(ValueError, match="period"):
        mapreduce.at_rows(src, 120)
    with pytest.raises(ValueError, match="takes no period"):
        mapreduce.at_rows(render(fx.rmsnorm_kernel(64, 256), None, "sm_90a"), 64, 8)


def _row_and_constant_reads(S, C=4100, k=4):
    """out[r, c] = x[r, c] + T[r % S, c] + W[S, c]: a table read at the row's period, and a row
    of W at the constant S (shared by every row)."""
    from loop_fixtures import _load, _store

    r, c = ir.Var("r"), ir.Var("c")
    body = (ir.Loop("c", C, (*_load("x1", "x", (r, c), "f32"), *_load("t1", "T", (ir.IBin("%", r, ir.IConst(S)), c), "f32"),
                             *_load("w1", "W", (ir.IConst(S), c), "f16"),
                             ir.Op("a", "add", ("x1", "t1"), "f32"), ir.Op("b", "add", ("a", "w1"), "f32"),
                             *_store("out", (r, c), "b", "f32"))),)
    params = (ir.Buffer("x", (k * S, C), "f32", "in"), ir.Buffer("T", (S, C), "f32", "in"),
              ir.Buffer("W", (64, C), "f16", "in"), ir.Buffer("out", (k * S, C), "f32", "out"))
    return ir.Kernel("row_of_w", params, (ir.Loop("r", k * S, body, parallel=True),))


def test_only_the_rows_divisors_become_the_period():
    """An S that does not divide the row (a constant row index W[S, c]) stays a number: the form
    renders under its kernel's own schedule (read as the row-shared vector it is, not as a row
    stream), and the kernel at another S is another source."""
    k8, k9 = _row_and_constant_reads(8), _row_and_constant_reads(9)
    assert mapreduce.rows_period(k8) == 8
    loads = {s.buf: s.index for s in ir.walk(rows_free(k8).body) if isinstance(s, ir.Load)}
    assert loads["W"][0] == ir.IConst(8) and loads["T"][0] == ir.IBin("%", ir.Var("r"), ir.Var(cexpr.PERIOD))
    sched = default_schedule(k8, "sm_90a")
    a, b = render(k8, sched, "sm_90a"), render(k9, sched, "sm_90a")
    assert a.period == 8 and b.period == 9 and a.source != b.source


@settings(max_examples=6, deadline=None)
@given(heads=st.integers(1, 6), S=st.integers(2, 50), dim=st.sampled_from([8, 16, 64]), batch=st.integers(1, 2),
       other=st.integers(2, 50), half=st.booleans())
def test_period_forms_at_hypothesis_shapes(heads, S, dim, batch, other, half):
    """At any shape: the count and the period put back into rows_free's form give the kernel;
    where a second length has the same form, both render one source, each launched with its
    own count and period; and a kernel that rows_period gives no period keeps its S in a form
    that differs from the other length's."""
    dt = torch.float16 if half else torch.float32
    ks = {n: _rope_kernel(n, heads, dim, batch, dt) for n in (S, other)}
    for n, k in ks.items():
        free = rows_free(k)
        period = mapreduce.rows_period(k)
        assert period in (None, n)
        assert free is not None and _restored(free, k, n) == k
    if S != other:
        fa, fb = rows_free(ks[S]), rows_free(ks[other])
        if replace(fa, name="k") == replace(fb, name="k"):
            sched = default_schedule(ks[S], "sm_90a")
            a, b = render(ks[S], sched, "sm_90a"), render(ks[other], sched, "sm_90a")
            assert a.source == b.source and (a.period, b.period) == tuple(map(mapreduce.rows_period, ks.values()))
            assert heads == 1 or (a.period, b.period) == (S, other)  # (one head: the rows are the table's)
            assert (a.rows, b.rows) == (batch * heads * S, batch * heads * other)
        else:
            assert batch > 1 or heads == 1 or mapreduce.rows_period(ks[S]) is None

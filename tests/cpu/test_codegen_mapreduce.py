"""The map-reduce CUDA generator and the NVRTC runtime, without a GPU.

Every fixture kernel, at every dtype and at issue-sized and odd shapes, compiles through
NVRTC for sm_90a and sm_80 with no spills and no stack frame; the generated source has
the properties the design promises (16-byte row loads issued once per row, clusters for
very long rows on Hopper only); the cubin cache hits, and rebuilds corrupted entries; bad
inputs get clear errors.
"""
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import loop_fixtures as fx
from tilefuse.codegen import cexpr, mapreduce
from tilefuse.codegen.mapreduce import MapReduceSchedule, default_schedule, render
from tilefuse.loop import ir
from tilefuse.runtime import cache, nvrtc
from tilefuse.runtime.launch import CompiledKernel, compile_source_only

SHAPES = [(32768, 4096), (32768, 256), (4096, 65536), (8192, 262144), (3, 1), (5, 1000), (7, 4097)]
DTYPES = ["bf16", "f16", "f32"]
ARCHS = ["sm_90a", "sm_80"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Every test compiles into a cache of its session's own (never the user's)."""
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin"))


def _has_reduce(k):
    return any(isinstance(s, ir.Reduce) for s in ir.row_kernel_parts(k).body)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", fx.NAMES)
def test_every_fixture_compiles_without_spills(name, dtype, shape, arch):
    kernel = fx.BUILDERS[name](*shape, dtype)
    src, cubin = compile_source_only(kernel, arch)
    info = cubin.info
    assert info.registers > 0, cubin.log
    assert info.clean, f"{name} {dtype} {shape} {arch} {src.schedule}: {info}"
    assert "warning" not in cubin.log, cubin.log
    if arch == "sm_80":
        assert src.cluster == (1, 1, 1), "sm_80 has no thread-block clusters"


@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "cross_entropy"])
def test_scalar_fallback_compiles(name):
    """The variant for misaligned tensors: scalar accesses, row re-read, any schedule."""
    kernel = fx.BUILDERS[name](64, 4096, "bf16")
    sched = mapreduce.scalar_fallback(default_schedule(kernel, "sm_90a"))
    src, cubin = compile_source_only(kernel, "sm_90a", sched)
    assert "tf_ld16" not in src.source.split('extern "C"')[1]
    assert cubin.info.clean


@pytest.mark.parametrize("sched,shape", [
    (MapReduceSchedule(threads=256, group=4, vector=8), (33, 96)),
    (MapReduceSchedule(threads=256, group=128, vector=8, min_blocks=3), (33, 4096)),
    (MapReduceSchedule(threads=512, group=512, vector=8, stage="stream", unroll=2, min_blocks=2), (33, 4096)),
    (MapReduceSchedule(threads=256, group=256, vector=4, cluster=2, min_blocks=4), (33, 4096)),
    (MapReduceSchedule(threads=128, group=128, vector=1, cluster=4, stage="stream"), (33, 4097)),
    (MapReduceSchedule(threads=256, group=8, vector=8, stage="smem", min_blocks=4), (33, 256)),
    (MapReduceSchedule(threads=1024, group=1024, vector=8, stage="smem"), (33, 32768)),
    (MapReduceSchedule(threads=256, group=256, vector=8, cluster=8, stage="smem", min_blocks=6), (33, 65536)),
    (MapReduceSchedule(threads=512, group=512, vector=8, stage="stream", min_blocks=2, l2_hints=True), (33, 8192)),
    (MapReduceSchedule(threads=256, group=256, vector=8, stage="smem", min_blocks=6, l2_hints=True), (33, 4096)),
    (MapReduceSchedule(threads=256, group=8, vector=8, l2_hints=True), (33, 256)),
], ids=str)
def test_explicit_schedules_compile(sched, shape):
    for name in ("layernorm", "cross_entropy", "add_rmsnorm"):
        src, cubin = compile_source_only(fx.BUILDERS[name](*shape, "bf16"), "sm_90a", sched)
        assert cubin.info.clean, (name, cubin.info)


def test_a_row_too_long_for_registers_is_refused():
    with pytest.raises(ValueError, match="stage='stream'"):
        render(fx.softmax_kernel(4, 65536, "bf16"), MapReduceSchedule(threads=128, group=128))


# ---------------------------------------------------------------- what the source promises


def _body(src):
    return src.source.split('extern "C"')[1]


def test_rows_are_read_once_with_16_byte_loads():
    k = fx.rmsnorm_kernel(32768, 4096, "bf16")
    src = render(k, arch="sm_90a")  # default: the row staged in shared memory
    body = _body(src)
    # one copy site for the row of x (16-byte cp.async), one load site for the weight vector
    # (ahead of the reduction: _hoisted_vectors)
    assert src.schedule.stage == "smem" and body.count("tf_cp_async16(") == 1
    assert src.smem_bytes == 4096 * 2
    assert body.count("tf_ld16(w_h[j]") == 1 and "tf_ld16(w_c" not in body and "tf_ld16_stream" not in body
    assert body.count("tf_st16(g_y") == 1
    assert dict(src.alignment) == {"x": 16, "w": 16, "y": 16}
    regs = _body(render(k, default_schedule(k, "sm_90a", stage="regs")))
    assert regs.count("tf_ld16_stream(x_s[j]") == 1 and "tf_cp_async16(" not in regs


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_a_staged_rows_column_vectors_are_loaded_before_its_reductions(arch):
    """Where a CTA's one row is staged in shared memory, the weight and bias its output pass
    reads are loaded into registers ahead of the row's reductions, once each (their latency
    then overlaps the row's copies instead of following its shuffle tree), and the pass reads
    them there; rows held in registers, or spread over a cluster, load them in the pass."""
    k = fx.layernorm_kernel(32768, 4096, "bf16")
    src = render(k, arch=arch)
    assert src.schedule.stage == "smem" and src.schedule.group == src.schedule.threads
    head, out = _body(src).split("// ---- map over the row")
    ahead = head.index("loaded ahead of the reductions")
    assert ahead < head.index("// ---- reduce")
    for v in ("w", "b"):
        assert head.count(f"tf_ld16({v}_h[j]") == 1 and f"tf_ld16({v}" not in out
        assert f"const unsigned* {v}_c = {v}_h[j];" in out
    _, cubin = compile_source_only(k, arch, src.schedule)
    assert cubin.info.spill_stores == 0 and cubin.info.spill_loads == 0
    short = _body(render(k := fx.layernorm_kernel(32768, 256, "bf16"), default_schedule(k, arch), arch))
    assert "ahead of the reductions" not in short and "tf_ld16(w_c" in short.split("// ---- map over the row")[1]
    if arch == "sm_90a":  # a cluster's row holds too many chunks per thread to keep them (it spilled)
        long = render(k := fx.layernorm_kernel(4096, 65536, "bf16"), arch=arch)
        assert long.schedule.cluster > 1 and "ahead of the reductions" not in long.source


def test_l2_hints_keep_a_re_read_row_until_its_last_pass():
    """With l2_hints, every pass over a streamed row but its last reads evict_last (the next
    pass finds the row in L2), the last reads evict_first; a row read once (registers, shared
    memory) reads evict_first; the weight vector and the stores carry no hint."""
    k = fx.layernorm_kernel(64, 8192, "bf16")
    stream = MapReduceSchedule(threads=512, group=512, vector=8, stage="stream", l2_hints=True)
    body = _body(render(k, stream))
    plain = _body(render(k, replace(stream, l2_hints=False)))
    passes = plain.count("tf_ld16_stream(x_c")
    assert passes >= 2  # the mean and the normalisation (LayerNorm's passes over the row)
    assert body.count("tf_ld16_last(x_c") == body.count("tf_pol_last);") == passes - 1
    assert body.count("tf_ld16_first(x_c") == body.count("tf_pol_first);") == 1
    assert "tf_ld16_stream(" not in body and body.count("tf_ld16(w_c") == plain.count("tf_ld16(w_c")
    assert "cache_hint" not in body and "tf_st16(" in body  # stores as before (hints are in the prelude)
    smem = _body(render(k, MapReduceSchedule(threads=256, group=256, vector=8, stage="smem", l2_hints=True)))
    assert smem.count("tf_cp_async16_hint(") == 1 and "tf_pol_first);" in smem and "tf_pol_last);" not in smem
    regs = _body(render(fx.rmsnorm_kernel(64, 256, "bf16"), MapReduceSchedule(threads=256, group=8, l2_hints=True)))
    assert regs.count("tf_ld16_first(x_s[j]") == 1 and "tf_pol_last);" not in regs
    assert "tf_pol" not in _body(render(k, replace(stream, l2_hints=False)))


def test_plain_norms_of_16_to_32_kb_rows_stream_them_twice_through_l2():
    """RMSNorm and LayerNorm rows of 16-32 KB default to the stream stage with L2 hints (2048
    threads per SM); shorter rows stay staged, longer ones take a cluster; softmax (the online
    pass) and add+RMSNorm (two row streams) keep their staged schedules."""
    for name in ("rmsnorm", "layernorm"):
        for cols, dtype in ((8192, "bf16"), (16384, "bf16"), (8192, "f32"), (8192, "f16")):
            s = default_schedule(fx.BUILDERS[name](16, cols, dtype), "sm_90a")
            assert (s.stage, s.threads, s.min_blocks, s.l2_hints) == ("stream", 512, 4, True), (name, cols, dtype)
        assert default_schedule(fx.BUILDERS[name](16, 4096, "bf16"), "sm_90a").stage == "smem"
        assert default_schedule(fx.BUILDERS[name](16, 65536, "bf16"), "sm_90a").cluster > 1
    for name in ("softmax", "add_rmsnorm"):
        s = default_schedule(fx.BUILDERS[name](16, 8192, "bf16"), "sm_90a")
        assert s.stage == "smem" and not s.l2_hints, name


def test_shared_memory_staging_needs_16_byte_chunks():
    k = fx.softmax_kernel(8, 1000, "bf16")
    with pytest.raises(ValueError, match="16-byte"):
        render(k, MapReduceSchedule(threads=256, group=32, vector=4, stage="smem"))
    with pytest.raises(ValueError, match="16-byte"):
        default_schedule(fx.softmax_kernel(8, 1001, "bf16"), stage="smem")


def test_odd_row_length_uses_masked_scalar_accesses():
    src = render(fx.softmax_kernel(7, 4097, "bf16"), arch="sm_90a")
    body = _body(src)
    assert "tf_ld16" not in body and "tf_st16" not in body
    assert "c0 < 4097" in body  # the tail is masked
    assert src.alignment == ()


def test_short_rows_share_a_warp_and_long_rows_span_a_cluster():
    short = default_schedule(fx.rmsnorm_kernel(32768, 256, "bf16"), "sm_90a")
    assert short.group <= 32 and short.rows_per_cta > 1
    for name, stage in (("softmax", "smem"), ("cross_entropy", "regs")):
        k = fx.BUILDERS[name](8192, 262144, "bf16")
        long = default_schedule(k, "sm_90a")
        assert long.cluster > 1 and long.stage == stage, long
        src = render(k, long, "sm_90a")
        assert src.cluster == (long.cluster, 1, 1) and src.grid[0] == 8192 * long.cluster
        assert "mapa.shared::cluster" in src.source and "tf_cluster_sync();" in _body(src)
        fallback = default_schedule(k, "sm_80")
        assert fallback.cluster == 1


def test_a_loss_over_cluster_rows_reads_them_in_registers_with_the_staged_shape():
    """Cross-entropy over rows that need a cluster: one (max, sum-exp) pass reads each chunk
    once, so the default keeps the staged heuristic's shape (threads, cluster, register cap)
    but in registers, without the cp.async pipeline; naming stage="smem" still stages it,
    a softmax (it writes the row) stays staged, and the registers do not spill."""
    k = fx.cross_entropy_kernel(8192, 262144, "bf16")
    auto, staged = default_schedule(k, "sm_90a"), default_schedule(k, "sm_90a", stage="smem")
    assert staged.stage == "smem" and staged.pipeline and staged.cluster > 1
    assert auto == replace(staged, stage="regs", pipeline=False)
    assert default_schedule(fx.softmax_kernel(8192, 262144, "bf16"), "sm_90a").stage == "smem"
    assert default_schedule(fx.cross_entropy_kernel(64, 65536, "bf16"), "sm_90a").stage == "smem"  # one CTA
    src = render(k, auto, "sm_90a")
    info = nvrtc.compile_cuda(src.source, src.name, "sm_90a").info
    assert info.spill_stores == 0 and info.spill_loads == 0, info


def test_rows_up_to_64k_with_one_exchange_and_no_column_vector_stay_in_one_cta():
    """Softmax and cross-entropy at 65536 bf16 columns: one CTA of 512 threads stages the
    whole row (128 KB of shared memory, 16 chunks per thread), no cluster; LayerNorm (weight
    and bias loaded in its output pass) and RMSNorm (a weight) keep theirs;
    at 262144 columns the row does not fit one CTA and softmax keeps its cluster."""
    for name in ("softmax", "cross_entropy"):
        s = default_schedule(fx.BUILDERS[name](64, 65536, "bf16"), "sm_90a")
        assert (s.threads, s.cluster, s.stage) == (512, 1, "smem"), s
        src = render(fx.BUILDERS[name](64, 65536, "bf16"), s, "sm_90a")
        assert src.smem_bytes == 65536 * 2 and "tf_cluster_sync" not in _body(src)
    for name in ("layernorm", "rmsnorm", "add_rmsnorm"):
        assert default_schedule(fx.BUILDERS[name](64, 65536, "bf16"), "sm_90a").cluster > 1, name
    assert default_schedule(fx.softmax_kernel(64, 262144, "bf16"), "sm_90a").cluster > 1


def test_short_rows_of_a_plain_norm_stay_in_registers():
    """RMSNorm, add+RMSNorm and LayerNorm rows of 256 bf16 columns in registers: RMSNorm at
    four chunks per thread and a batch of two rows per row group, add+RMSNorm at a chunk per
    thread for each row stream (half a warp per row), LayerNorm at two chunks per thread and
    a batch of two; softmax and cross-entropy (the online pass) staged in shared memory, a
    row at a time."""
    for name, stage, group, batch in [("rmsnorm", "regs", 8, 2), ("add_rmsnorm", "regs", 16, 1),
                                      ("layernorm", "regs", 16, 2), ("softmax", "smem", 8, 1),
                                      ("cross_entropy", "smem", 8, 1)]:
        s = default_schedule(fx.BUILDERS[name](32768, 256, "bf16"), "sm_90a")
        assert (s.stage, s.group, s.batch) == (stage, group, batch), (name, s)


def test_clustered_schedule_is_refused_on_sm80():
    k = fx.layernorm_kernel(64, 65536, "bf16")
    clustered = default_schedule(k, "sm_90a")
    assert clustered.cluster > 1
    with pytest.raises(ValueError, match="cluster"):
        render(k, clustered, "sm_80")


def test_a_map_splits_long_rows_without_a_cluster_launch():
    src = render(fx.map_kernel(64, 262144, "bf16"), arch="sm_90a")
    assert src.cluster == (1, 1, 1) and "tf_cluster_sync" not in _body(src)


def test_cross_entropy_is_one_pass_one_exchange_and_one_target_load():
    """max and sum(exp(x - max)) come out of one online pass and one exchange; the target
    logit is a single load at column t, hoisted above the pass (no per-element compare)."""
    k = fx.cross_entropy_kernel(64, 4096, "bf16")
    assert mapreduce.exchanges(k) == (1, True)
    body = _body(render(k, arch="sm_90a"))  # one warp per row: the butterfly is the exchange
    assert default_schedule(k, "sm_90a").group == 32 and "__syncthreads();" not in body
    assert _body(render(k, MapReduceSchedule(threads=128, group=128, vector=8, stage="smem"))).count(
        "__syncthreads();") == 1
    assert body.count("for (int j = 0;") == 2  # the copy, then the one pass
    assert "tf_lse_scale(" in body and body.count("tf_ex2_ftz(") == 2  # rescale + one exp per element
    assert "(long long)(c)" not in body, "no per-element index compare"
    target_load = body.index("x[(r) * 4096LL + sel_xt]")
    assert target_load < body.index("tf_cp_async_wait_pending("), "the target logit is loaded before the pass"
    for C, sched in [(136, MapReduceSchedule(threads=256, group=4, vector=8)),
                     (4096, MapReduceSchedule(threads=128, group=128, vector=8, cluster=2)),
                     (4096, MapReduceSchedule(threads=256, group=256, vector=8, stage="stream", unroll=2))]:
        src = _body(render(fx.cross_entropy_kernel(64, C, "bf16"), sched, "sm_90a"))
        assert "tf_lse_scale(" in src and "sel_xt" in src and "(long long)(c)" not in src


def test_softmax_reads_the_staged_row_twice_and_exchanges_once():
    """Without kept values (and on rows a cluster holds, which keep none) a softmax's max and sum
    of exps share one online pass and one exchange, then one pass maps the row."""
    for shape, sched in [((64, 4096), None),
                         ((8, 262144), None),
                         ((64, 136), MapReduceSchedule(threads=256, group=4, vector=8))]:
        src = render(fx.softmax_kernel(*shape, "bf16"), sched, "sm_90a", keep_values=shape[1] > 65536)
        assert src.kept == 0
        body = _body(src)
        exchanges = "tf_cluster_sync();" if src.cluster != (1, 1, 1) else "__syncthreads();"
        assert body.count(exchanges) == (1 if src.schedule.group > 32 else 0)
        assert "tf_lse_scale(" in body
        assert body.count("for (int j = 0;") == 2 + (src.schedule.stage != "stream")  # (+ the staging loop)


def test_a_held_softmax_keeps_its_exps_for_the_map():
    """With values kept (the default) a softmax whose row is held on chip takes a max pass and a
    sum pass (two exchanges) and keeps the sum's exp(y - max) for the map over the row: one exp
    per element, and no online rescaling."""
    for shape, sched in [((64, 4096), None), ((64, 136), MapReduceSchedule(threads=256, group=4, vector=8))]:
        src = render(fx.softmax_kernel(*shape, "bf16"), sched, "sm_90a")
        body = _body(src)
        assert src.kept == 1 and "tf_lse_scale(" not in body
        assert body.count("tf_exp_fast(") == 1
        assert body.count("__syncthreads();") == (2 if src.schedule.group > 32 else 0)
        assert body.count("for (int j = 0;") == 3 + (src.schedule.stage != "stream")


def test_special_function_unit_math_only_where_results_are_16_bit():
    """A bf16 softmax's output pass takes exp (and a division: the program's softmax divides
    by the sum) on the special-function unit, its results being rounded to bf16; an f32
    softmax keeps expf and IEEE division; a loss
    with an f32 output keeps them too, except in the sum of exp(y - max), which is always fast
    (y <= max bounds its error). The fast kernel is also far shorter in SASS terms: no
    library-call bodies, no division slow path."""
    bf = _body(render(fx.softmax_kernel(64, 4096, "bf16"), arch="sm_90a"))
    f32 = _body(render(fx.softmax_kernel(64, 4096, "f32"), arch="sm_90a"))
    assert mapreduce.fast_math(fx.softmax_kernel(64, 4096, "bf16"))
    assert mapreduce.fast_math(fx.softmax_kernel(64, 4096, "f16"))
    assert not mapreduce.fast_math(fx.softmax_kernel(64, 4096, "f32"))
    assert "tf_exp_fast(" in bf and "expf(" not in bf
    assert "tf_exp_fast(" not in f32 and "expf(" in f32
    ce = fx.cross_entropy_kernel(64, 4096, "bf16")
    assert not mapreduce.fast_math(ce)  # its per-row loss is f32
    body = _body(render(ce, arch="sm_90a"))
    assert "tf_ex2_ftz(" in body and "logf(" in body and "tf_exp_fast(" not in body
    from tilefuse.compiler import compile_stages
    st = compile_stages(lambda x: torch.softmax(x, -1), (torch.randn(4, 4096, dtype=torch.bfloat16),), arch="sm_90a")
    (low,) = st.kernels.values()
    prog = _body(render(low.kernel, arch="sm_90a"))
    assert "tf_div_fast(" in prog and "tf_exp_fast(" in prog and " / " not in prog
    # the accurate and the fast spelling of the same ops
    assert cexpr.op("exp", ["a"], ["f32"], "f32") == "expf(a)"
    assert cexpr.op("exp", ["a"], ["f32"], "f32", fast=True) == "tf_exp_fast(a)"
    assert cexpr.op("div", ["a", "b"], ["f32", "f32"], "bf16", fast=True) == "tf_round_bf16(tf_div_fast(a, b))"
    assert cexpr.op("exp", ["a"], ["f64"], "f64", fast=True) == "exp(a)"  # doubles stay accurate


def test_a_cluster_arrives_after_its_last_remote_read_and_waits_before_exit():
    """LayerNorm (one exchange of (count, mean, M2)) and a row with two dependent exchanges
    (a mean absolute deviation: not a centred sum of squares): every exchange but the last
    is a full cluster barrier, the last one's remote reads are followed by one arrive, and
    the CTA waits for the others' arrivals only before it exits."""
    from tilefuse.compiler import compile_stages

    def mad_norm(x):
        d = x - x.mean(-1, keepdim=True)
        return d / d.abs().mean(-1, keepdim=True)

    st = compile_stages(mad_norm, (torch.randn(4, 65536, dtype=torch.bfloat16),), arch="sm_90a")
    (mad,) = [lk.kernel for lk in st.kernels.values()]
    for k, n_ex in [(fx.layernorm_kernel(4, 65536, "bf16"), 1), (mad, 2)]:
        assert mapreduce.exchanges(k) == (n_ex, False)
        src = render(k, arch="sm_90a")
        body = _body(src)
        assert src.cluster[0] > 1
        assert body.count("tf_cluster_sync();") == n_ex and body.count("tf_cluster_arrive();") == 1
        assert body.rindex("tf_remote_ld(") < body.index("tf_cluster_arrive();") < body.index("tf_st16(")
        assert body.rstrip().endswith("tf_cluster_wait();\n}") or body.rstrip().splitlines()[-2].strip() == "tf_cluster_wait();"


def test_pipelined_staging_waits_per_chunk_in_the_first_pass_only():
    k = fx.rmsnorm_kernel(64, 4096, "bf16")
    sched = default_schedule(k, "sm_90a")
    assert sched.pipeline and sched.stage == "smem"
    body = _body(render(k, sched, "sm_90a"))
    assert body.count("tf_cp_async_commit();") == 1 and "tf_cp_async_wait_all" not in body
    first, second = body.split("// ---- map over the row")
    assert first.count("tf_cp_async_wait_pending(") == 1 and "tf_cp_async_wait_pending(" not in second
    plain = _body(render(k, replace(sched, pipeline=False), "sm_90a"))
    assert "tf_cp_async_wait_all();" in plain and "tf_cp_async_wait_pending(" not in plain


def test_generated_source_is_deterministic():
    k = fx.layernorm_kernel(100, 3000, "f16")
    assert render(k).source == render(k).source


def test_every_op_has_a_cpp_spelling():
    assert cexpr.check_all_ops_spelled() == []


def test_constants_round_trip_in_their_dtype():
    assert cexpr.const(0.1, "bf16") == "0.100097656f"
    assert cexpr.const(1e-6, "f32") == "1e-06f"
    assert cexpr.const(float("-inf"), "f32").startswith("__uint_as_float(0xff800000u)")
    assert cexpr.const(3, "i64") == "3LL"


# ---------------------------------------------------------------- NVRTC and its report


def test_ptxas_report_is_parsed():
    log = ("ptxas info    : 0 bytes gmem\nptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 68 bytes smem\n")
    info = nvrtc.parse_ptxas_info(log, "k")
    assert info == nvrtc.CompileInfo(registers=40, spill_stores=12, spill_loads=16, smem_bytes=68, stack_bytes=8)
    assert not info.clean


def test_compile_error_names_the_kernel_and_carries_the_log():
    with pytest.raises(nvrtc.CompileError) as e:
        nvrtc.compile_cuda('extern "C" __global__ void broken() { undeclared_thing = 1; }', "broken", "sm_90a")
    assert e.value.kernel == "broken" and "undeclared_thing" in e.value.log
    assert "broken" in str(e.value) and "sm_90a" in str(e.value)


def test_arch_names():
    assert nvrtc.normalize_arch("sm_90") == "sm_90a"
    assert nvrtc.normalize_arch((8, 0)) == "sm_80"
    with pytest.raises(ValueError):
        nvrtc.normalize_arch("hopper")
    assert nvrtc.normalize_arch("75") == "sm_75" and nvrtc.normalize_arch("sm_120") == "sm_120"
    for made_up in ("sm_42", "sm_70", "sm_1000", (4, 2)):  # below what CUDA 13 builds, or no such number
        with pytest.raises(ValueError, match="not one tilefuse builds for"):
            nvrtc.normalize_arch(made_up)


# ---------------------------------------------------------------- the cubin cache


def test_cache_hits_and_rebuilds_corrupted_entries(tmp_path):
    c = cache.CubinCache(tmp_path)
    src = render(fx.rmsnorm_kernel(8, 512, "bf16"))
    cubin, hit = cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    assert not hit
    again, hit = cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    assert hit and again == cubin
    (entry,) = list(tmp_path.rglob("*.cubin"))
    blob = bytearray(entry.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # a flipped byte
    entry.write_bytes(bytes(blob))
    rebuilt, hit = cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    assert not hit and rebuilt.data == cubin.data
    entry.write_bytes(entry.read_bytes()[:100])  # a truncated file
    assert cache.compile_cached(src.source, src.name, "sm_90a", cache=c)[1] is False
    assert cache.compile_cached(src.source, src.name, "sm_90a", cache=c)[1] is True
    assert not list(tmp_path.rglob(".tmp-*")), "no temporary files left behind"


def test_a_source_met_again_is_keyed_without_stripping_and_hashing_it_again(tmp_path, monkeypatch):
    """The key of a source is memoised by its text, arch and flags (a new size of a program meets
    its sources again); the memo gives the key a fresh computation gives, and the entry hits."""
    c = cache.CubinCache(tmp_path)
    src = render(fx.rmsnorm_kernel(8, 512, "bf16"))
    cache._KEYS.clear()
    cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    calls = []
    real = cache.code_of
    monkeypatch.setattr(cache, "code_of", lambda s: calls.append(1) or real(s))
    _, hit = cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    assert hit and not calls
    opts = nvrtc.options_for("sm_90a")
    assert cache._key(src.source, "sm_90a", opts) == cache.cache_key(real(src.source), "sm_90a", opts, nvrtc.version())
    cache.compile_cached(src.source, src.name, "sm_80", cache=c)  # another arch: keyed afresh
    assert calls


def test_cache_key_covers_source_arch_flags_and_version():
    k = cache.cache_key("src", "sm_90a", ("-O3",), (13, 0))
    assert k != cache.cache_key("src2", "sm_90a", ("-O3",), (13, 0))
    assert k != cache.cache_key("src", "sm_80", ("-O3",), (13, 0))
    assert k != cache.cache_key("src", "sm_90a", ("-O2",), (13, 0))
    assert k != cache.cache_key("src", "sm_90a", ("-O3",), (13, 1))


def test_sources_that_differ_only_in_whole_line_comments_share_a_cache_entry(tmp_path):
    """The same kernel in every layer of a model differs only in the comment naming its
    epilogue: one compile serves all. Code (and a comment after code on its line) still counts."""
    k = fx.rmsnorm_kernel(4, 64, "bf16")
    src = render(k)
    c = cache.CubinCache(tmp_path)
    cubin, hit = cache.compile_cached("// kernel of layer 0\n" + src.source, src.name, "sm_90a", cache=c)
    assert not hit
    again, hit = cache.compile_cached("  // kernel of layer 1\n" + src.source, src.name, "sm_90a", cache=c)
    assert hit and again.data == cubin.data
    changed = src.source + "\n__device__ int tf_extra_symbol;  // code\n"
    assert cache.compile_cached(changed, src.name, "sm_90a", cache=c)[1] is False
    assert cache.code_of("a\n  // b\nc // d") == "a\nc // d"
    assert cache.code_of("// x \\\nfoo;") != cache.code_of("foo;")  # a comment continued onto the next line


def test_threads_compiling_one_key_share_one_compile(tmp_path, monkeypatch):
    """Program.prepare compiles in threads: a key another thread is compiling is waited for
    and then read from the cache, not compiled twice; every caller gets the same cubin."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tilefuse.runtime import nvrtc

    calls, gate = [], threading.Event()

    def slow_compile(source, name, arch, opts):
        calls.append(name)
        gate.wait(5)
        return nvrtc.Cubin(b"\x00cubin of " + name.encode(), arch, nvrtc.CompileInfo(32, 0, 0, 0), "")

    monkeypatch.setattr(nvrtc, "compile_cuda", slow_compile)
    c = cache.CubinCache(tmp_path)
    sources = [f"// layer {i}\n__global__ void k() {{}}\n" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(cache.compile_cached, s, "k", "sm_90a", None, c) for s in sources]
        time.sleep(0.2)  # all six are in: one compiling, five waiting on it
        gate.set()
        results = [f.result() for f in futures]
    assert calls == ["k"]
    assert len({r[0].data for r in results}) == 1 and sorted(hit for _, hit in results) == [False] + [True] * 5
    assert not cache._inflight


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x"


def test_warm_compile_is_fast(tmp_path):
    k = fx.rmsnorm_kernel(32768, 4096, "bf16")
    c = cache.CubinCache(tmp_path)
    t0 = time.perf_counter()
    src = render(k)
    cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    src = render(k)
    _, hit = cache.compile_cached(src.source, src.name, "sm_90a", cache=c)
    warm = time.perf_counter() - t0
    assert hit and cold < 2.0 and warm < 0.1, (cold, warm)


# ---------------------------------------------------------------- errors


def _compiled(kernel):
    src, cubin = compile_source_only(kernel, "sm_90a")
    return CompiledKernel(kernel=kernel, arch="sm_90a", source=src, cubin=cubin, cache_hit=False)


def test_wrong_tensors_get_errors_naming_the_buffer():
    ck = _compiled(fx.rmsnorm_kernel(4, 64, "bf16"))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    y = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"takes 3 tensors \(x, w, y\), got 2"):
        ck(x, w)
    with pytest.raises(ValueError, match=r"input 'x': expected dtype torch.bfloat16, got torch.float32"):
        ck(x.float(), w, y)
    with pytest.raises(ValueError, match=r"input 'w': expected shape \(64,\), got \(65,\)"):
        ck(x, torch.randn(65, dtype=torch.bfloat16), y)
    with pytest.raises(ValueError, match=r"output 'y': expected a contiguous"):
        ck(x, w, torch.empty(64, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"input 'x': expected a CUDA tensor, got one on cpu"):
        ck(x, w, y)
    with pytest.raises(ValueError, match=r"expected a torch.Tensor, got list"):
        ck([1], w, y)


def test_bad_schedules_and_kernels_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        MapReduceSchedule(threads=256, group=12)
    with pytest.raises(ValueError, match="multiple of 32"):
        MapReduceSchedule(threads=100, group=4)
    with pytest.raises(ValueError, match="one row per cluster"):
        MapReduceSchedule(threads=256, group=32, cluster=2)
    with pytest.raises(ValueError, match="does not divide the row length"):
        render(fx.softmax_kernel(4, 1001, "bf16"), MapReduceSchedule(vector=8))
    flat = ir.Kernel("flat", (ir.Buffer("x", (4,), "f32", "in"),), (ir.Load("a", "x", (ir.IConst(0),)),))
    with pytest.raises(ValueError, match="one parallel row loop"):
        render(flat)
    with pytest.raises(ValueError, match="family"):
        compile_source_only(ir.Kernel("g", (), (), family="contraction"))


# ---------------------------------------------------------------- row patterns (codegen/patterns.py)


def _lowered(fn, *inputs):
    from tilefuse.compiler import compile_stages

    c = compile_stages(fn, inputs)
    return [lw.kernel for lw in c.kernels.values()]


def _row_reduces(k):
    return [s for s in ir.row_kernel_parts(k).body if isinstance(s, ir.Reduce)]


def test_online_lse_and_target_select_match_what_the_lowering_produces():
    """The patterns are found in the kernels PyTorch's softmax, log_softmax and
    cross_entropy lower to, not only in the hand-written fixtures."""
    import torch.nn.functional as F

    from tilefuse.codegen import patterns

    x, t = torch.randn(6, 64, dtype=torch.bfloat16), torch.randint(0, 64, (6,))
    for fn, args, n_select in [(lambda x: torch.softmax(x, -1), (x,), 0),
                               (lambda x: F.log_softmax(x.float(), -1), (x,), 0),
                               (lambda x, t: F.cross_entropy(x, t), (x, t), 1),
                               (lambda x, t: F.cross_entropy(x, t, reduction="none"), (x, t), 1)]:
        k = _lowered(fn, *args)[0]
        reds = _row_reduces(k)
        assert patterns.online_lse(reds[0], reds[1]) is not None, k
        body = ir.row_kernel_parts(k).body
        consts = {s.dst: s for s in body if isinstance(s, ir.Const)}
        dts = {s.dst: (k.buffer(s.buf).dtype if isinstance(s, ir.Load) else s.dtype)
               for s in body if hasattr(s, "dst") and not isinstance(s, ir.Store)}
        assert sum(patterns.target_select(r, consts, dts) is not None for r in reds) == n_select
    for name in ("softmax", "cross_entropy"):
        reds = _row_reduces(fx.BUILDERS[name](4, 64, "bf16"))
        assert patterns.online_lse(reds[0], reds[1]) is not None


def test_patterns_refuse_look_alikes():
    """A sum of exp over other values than the max's, a max fed elsewhere, a compare with a
    column-dependent value, a where whose other branch is not 0: no rewrite."""
    from tilefuse.codegen import patterns
    from tilefuse.loop.ir import Const, IndexValue, Load, Op, Reduce, Var

    c = Var("c")
    mx = Reduce("m", "max", "c", 8, (Load("a", "x", (Var("r"), c)),), "a", "f32")
    ok = Reduce("s", "sum", "c", 8, (Load("b", "x", (Var("r"), c)), Op("d", "sub", ("b", "m"), "f32"),
                                    Op("e", "exp", ("d",), "f32")), "e", "f32")
    assert patterns.online_lse(mx, ok) is not None
    other_buf = Reduce("s", "sum", "c", 8, (Load("b", "z", (Var("r"), c)), Op("d", "sub", ("b", "m"), "f32"),
                                           Op("e", "exp", ("d",), "f32")), "e", "f32")
    scaled = Reduce("s", "sum", "c", 8, (Load("b", "x", (Var("r"), c)), Op("b2", "add", ("b", "b"), "f32"),
                                        Op("d", "sub", ("b2", "m"), "f32"), Op("e", "exp", ("d",), "f32")),
                    "e", "f32")
    m_twice = Reduce("s", "sum", "c", 8, (Load("b", "x", (Var("r"), c)), Op("d", "sub", ("b", "m"), "f32"),
                                         Op("e", "exp", ("d",), "f32"), Op("f", "mul", ("e", "m"), "f32")),
                     "f", "f32")
    min_not_max = Reduce("m", "min", "c", 8, mx.body, "a", "f32")
    for a, b in [(mx, other_buf), (mx, scaled), (mx, m_twice), (min_not_max, ok)]:
        assert patterns.online_lse(a, b) is None
    zero = {"z": Const("z", 0.0, "f32")}
    dts = {"t": "i64", "u": "f32", "z": "f32"}

    def sel(eq_arg, other="z", iv_dtype="i64"):
        return Reduce("xt", "sum", "c", 8, (IndexValue("i", c, iv_dtype), Load("b", "x", (Var("r"), c)),
                                           Op("h", "eq", ("i", eq_arg), "bool"),
                                           Op("w", "where", ("h", "b", other), "f32")), "w", "f32")
    assert patterns.target_select(sel("t"), zero, dts) is not None
    assert patterns.target_select(sel("u"), zero, dts) is None          # a float, not an index
    assert patterns.target_select(sel("b"), zero, dts) is None          # varies along the row
    assert patterns.target_select(sel("t", other="b"), zero, dts) is None
    assert patterns.target_select(sel("t", iv_dtype="u8"), zero, dts) is None  # wraps past 255
    one = {"z": Const("z", 1.0, "f32")}
    assert patterns.target_select(sel("t"), one, dts) is None


def _online_row(x, threads, V, warps, ctas):
    """The printed algorithm, step for step, in float32: each thread folds its chunks
    (chunk max, rescale by exp2((m - m_new) log2 e), add exp2((y - m) log2 e));
    a butterfly takes the max, each thread rescales once, a butterfly adds; warps, then CTAs,
    gather their partials: max of the maxima, then the rescaled sums, in order. Every exp
    is the kernels' tf_ex2_ftz of (d log2 e): 2^z, flushed to 0 under 2^-126 (the GPU's
    ex2.approx adds up to 2 ulp, inside the tolerance below)."""
    f = np.float32
    L2E = f(1.44269504)

    def ex2(z):  # tf_ex2_ftz
        r = f(np.exp2(z))
        return f(0) if r < f(2.0 ** -126) else r

    def scale(s, m, M):  # tf_lse_scale
        return s if m == M else f(s * ex2(f(f(m - M) * L2E)))

    def fmax(a, b):  # max.NaN
        return f(np.nan) if np.isnan(a) or np.isnan(b) else max(a, b)

    P = threads * warps * ctas
    m, s = [f(-np.inf)] * P, [f(0)] * P
    with np.errstate(invalid="ignore", over="ignore"):
        for p in range(P):
            for j in range(0, len(x), P * V):
                c0 = j + p * V
                if c0 >= len(x):
                    continue
                y = x[c0:c0 + V].astype(f)
                cm = y[0]
                for v in y[1:]:
                    cm = fmax(cm, v)
                mn = fmax(m[p], cm)
                s[p] = s[p] if m[p] == mn else f(s[p] * ex2(f(f(m[p] - mn) * L2E)))
                m[p] = mn
                mz = f(0) if mn == -np.inf else mn
                for v in y:
                    s[p] = f(s[p] + ex2(f(f(v - mz) * L2E)))
        # butterfly within each group of `threads`: max, rescale, sum (all lanes agree)
        for g in range(0, P, threads):
            lanes = range(g, g + threads)
            mt = [m[i] for i in lanes]
            o = threads // 2
            while o:
                m[g:g + threads] = [fmax(m[i], m[g + ((i - g) ^ o)]) for i in lanes]
                o //= 2
            for k, i in enumerate(lanes):
                s[i] = scale(s[i], mt[k], m[i])
            o = threads // 2
            while o:
                s[g:g + threads] = [f(s[i] + s[g + ((i - g) ^ o)]) for i in lanes]
                o //= 2

        def gather(ms, ss):
            M = ms[0]
            for v in ms[1:]:
                M = fmax(M, v)
            S = scale(ss[0], ms[0], M)
            for a, b in zip(ss[1:], ms[1:]):
                S = f(S + scale(a, b, M))
            return M, S

        per_cta = []
        for c in range(ctas):
            ws = [(m[(c * warps + w) * threads], s[(c * warps + w) * threads]) for w in range(warps)]
            per_cta.append(gather([a for a, _ in ws], [b for _, b in ws]))
        M, S = gather([a for a, _ in per_cta], [b for _, b in per_cta])
    return M, (f(np.nan) if M == -np.inf else S)


@pytest.mark.parametrize("case", ["normal", "some -inf", "all -inf", "nan", "+inf", "tail", "huge"])
def test_online_log_sum_exp_algorithm_matches_two_passes(case):
    """The merge order of the printed kernels (per chunk, butterfly, warps, CTAs) gives the
    max exactly and sum(exp(x - max)) to a few f32 ulps, with the two-pass special values."""
    rng = np.random.default_rng(7)
    n = 8 * 32 * 2 * 2 * 3 + (5 * 8 if case == "tail" else 0)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    if case == "some -inf":
        x[rng.integers(0, n, 200)] = -np.inf
        x[:64] = -np.inf  # whole chunks of -inf, folded first
    elif case == "all -inf":
        x[:] = -np.inf
    elif case == "nan":
        x[1234 % n] = np.nan
    elif case == "+inf":
        x[77] = np.inf
    elif case == "huge":
        x = x * np.float32(30) + np.float32(500)
    M, S = _online_row(x, threads=32, V=8, warps=2, ctas=2)
    with np.errstate(invalid="ignore"):
        m_ref = np.float64(np.max(x)) if not np.isnan(x).any() else np.nan
        s_ref = np.sum(np.exp(x.astype(np.float64) - m_ref))
    if np.isnan(m_ref):
        assert np.isnan(M) and np.isnan(S)
        return
    assert M == m_ref
    if np.isnan(s_ref):
        assert np.isnan(S)
    else:
        assert abs(np.float64(S) - s_ref) <= 1e-5 * s_ref, (S, s_ref)


def test_cluster_exchange_gathers_partials_max_first():
    """What the printed exchange does for a (max, sum) pair: one max butterfly, one
    rescale, one sum butterfly; across warps and CTAs no chain of exps."""
    body = _body(render(fx.softmax_kernel(8, 262144, "bf16"), arch="sm_90a"))  # a 512 x 8 cluster
    exchange = body[body.index("// across the 32"):body.index("tf_cluster_arrive();")]
    assert exchange.count("tf_lse_scale(") == 1 + 2 + 2  # the lane's own, then warps and CTAs (first + loop)
    assert exchange.count("for (int o = 16;") == 2
    assert "tf_remote_ld(&cl0_m, i)" in exchange and "tf_remote_ld(&cl0_s, i)" in exchange


def test_tensors_named_like_template_locals_compile():
    """Graph tensors take their names from the user's code; a parameter called `r`, `slot` or `tid`
    must not collide with the template's own variables (it did: `r` redeclared the row index)."""
    import torch

    from tilefuse.compiler import compile_stages
    from tilefuse.runtime.nvrtc import compile_cuda

    names = ["r", "slot", "rowblock", "tid", "lane", "j", "c0", "row_ok", "v", "acc", "warp", "n"]
    src = (f"class M(torch.nn.Module):\n    def forward(self, {', '.join(names)}):\n"
           f"        return torch.rms_norm({' + '.join(names)}, (64,)), torch.softmax(r * slot, -1)\n")
    ns = {"torch": torch}
    exec(src, ns)
    st = compile_stages(ns["M"](), tuple(torch.randn(8, 64) for _ in names))
    params = {b.name for lk in st.kernels.values() for b in lk.kernel.params}
    assert {"r", "slot", "tid"} <= params, params
    for lk in st.kernels.values():
        s = render(lk.kernel, None, arch="sm_90a")
        compile_cuda(s.source, s.name, "sm_90a")  # raises CompileError with NVRTC's log


# ---------------------------------------------------------------- a batch of rows per row group

def test_a_batch_layout_gives_every_row_to_exactly_one_thread_group():
    """(slot, b, row block) -> row is a bijection onto the CTAs' rows, and a row group's
    batch rows lie `slots` apart (each of a warp's loads then covers neighbouring rows)."""
    from tilefuse.codegen.rowlayout import row_layouts
    from tilefuse.layout import size
    for threads, group, batch, R in [(128, 8, 2, 1000), (32, 32, 4, 37), (256, 16, 2, 32768), (64, 1, 8, 999)]:
        lay = row_layouts(threads=threads, group=group, cluster=1, vector=8, nchunk=1, rows=R, batch=batch)
        slots = threads // group
        blocks = -(-R // (slots * batch))
        rows = sorted(lay.row(s, b, blk) for s in range(slots) for b in range(batch) for blk in range(blocks))
        assert rows == list(range(slots * batch * blocks)) and size(lay.row) == len(rows)
        assert all(lay.row(s, b + 1, 0) - lay.row(s, b, 0) == slots for s in range(slots) for b in range(batch - 1))


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "softmax", "add_rmsnorm", "cross_entropy", "map"])
def test_a_batch_loads_every_row_before_the_first_exchange(name):
    """With a batch of B rows, a thread issues the 16-byte loads of all B rows before the
    first row's body (its reductions and exchanges) begins; each row then has its own scope
    with its own row index and row guard, the grid covers R / (slots * B) CTAs, and ptxas
    reports no spills."""
    R, C = 1001, 256
    k = fx.BUILDERS[name](R, C, "bf16")
    d = default_schedule(k, "sm_90a")
    s = replace(d, stage="regs", pipeline=False, threads=128, group=16, vector=8, min_blocks=4, batch=2)
    src, cubin = compile_source_only(k, "sm_90a", s)
    body = _body(src)
    first_body = body.index("// ---- row 0 of the batch")
    staged_loads = [i for i in range(len(body)) if body.startswith("tf_ld16_stream(", i)]
    one_row = _body(render(k, replace(s, batch=1), "sm_90a")).count("tf_ld16_stream(")
    assert one_row >= 1 and len(staged_loads) == 2 * one_row and max(staged_loads) < first_body
    assert "__shfl" not in body[:first_body] and "tf_var" not in body[:first_body]
    rows = re.findall(r"const long long r = (.*?);", body)
    assert len(rows) == 4 and rows[:2] == rows[2:] and rows[0] != rows[1]  # loads, then bodies, of rows 0 and 1
    for b in range(2):
        scope = body.split(f"// ---- row {b} of the batch")[1].split("// ---- row ")[0]
        assert scope.count("const long long r = ") == 1 and rows[b] in scope
        staged = re.findall(r"auto& (\w+)_s = (\w+);", scope)
        assert staged and all(alias == f"{st}_s{b}" for st, alias in staged)  # row b reads row b's chunks
    # two load scopes, two row scopes; the row count is the kernel's argument (rows_free)
    assert src.rows == R and body.count("const bool row_ok = (int)r < tf_rows;") == 4
    assert src.grid == (-(-R // (128 // s.group * 2)), 1, 1)
    assert cubin.info.clean, cubin.info


def test_a_batch_needs_a_warp_row_group_in_registers():
    """A batch is refused (with the reason) where its rows could not share a row group's
    registers: batch sizes other than 1/2/4/8, row groups wider than a warp, clusters, the
    smem and stream stages (grid reductions: tests/cpu/test_grid_reduce.py); the
    misaligned-data fallback of a batched schedule streams one row at a time."""
    for kw in (dict(batch=3), dict(group=64, batch=2), dict(group=128, threads=128, cluster=2, batch=2),
               dict(stage="smem", batch=2), dict(stage="stream", batch=2)):
        with pytest.raises(ValueError, match="batch"):
            MapReduceSchedule(**{"threads": 128, "group": 16, "vector": 8, **kw})
    fb = mapreduce.scalar_fallback(MapReduceSchedule(threads=128, group=8, vector=8, batch=2))
    assert fb.batch == 1 and fb.stage == "stream"
    render(fx.rmsnorm_kernel(64, 256, "bf16"), fb, "sm_90a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "add_rmsnorm", "softmax"])
def test_every_short_row_default_compiles_without_spills(name, dtype, arch):
    """The short-row defaults (batches included) at every row length up to 256 that is a
    multiple of 8: no spills, no stack frame. The fixture sweep above tries only 256, where
    the batched RMSNorm layout sits at its 64-register cap; 128 columns once spilled."""
    bad = []
    for C in range(8, 257, 8):
        k = fx.BUILDERS[name](4096, C, dtype)
        src, cubin = compile_source_only(k, arch)
        if not cubin.info.clean:
            bad.append((C, str(src.schedule), cubin.info))
    assert not bad, bad


def _lowered_kernel(fn, inputs):
    import tilefuse

    (lk,) = tilefuse.compile(fn, inputs).kernels.values()
    return lk.kernel


def test_staged_rows_of_different_widths_get_areas_sized_by_the_widest_chunk():
    """A bf16 row and an f32 row staged side by side: chunk j of every stream sits j times
    the widest (f32) chunk into its area, so each area is sized by that chunk, and the f32
    area starts where the bf16 one's last chunk ends (sized by its own 16-byte chunks it ran
    into the f32 area from its second chunk on: NaN outputs on an H100 at 1032 columns)."""
    import torch.nn.functional as F

    def fn(x, r):
        h = x.float() + r
        return h, F.layer_norm(h, (h.shape[-1],))
    for C in (520, 1032, 2056):
        k = _lowered_kernel(fn, (torch.randn(8, C, dtype=torch.bfloat16), torch.randn(8, C)))
        src = render(k, default_schedule(k, "sm_90a"), "sm_90a")
        sch = src.schedule
        nchunk = -(-C // (sch.vector * sch.group))
        assert sch.stage == "smem" and nchunk >= 2, sch
        area = nchunk * sch.threads * 32  # 8 f32 values a chunk
        assert src.smem_bytes == 2 * area
        assert sorted({int(m) for m in re.findall(r"smem0 \+ (\d+)u", src.source)}) == [0, area]
        assert f"j * {sch.threads * 32})" in src.source  # a chunk's stride: the widest chunk


def test_rows_of_many_streams_keep_a_row_per_cta_where_staging_would_outgrow_its_share():
    """LayerNorm of the sum of 9 bf16 rows of 3064 columns: a row per 128 threads would stage
    3 chunks a thread of each (110 KB, over SMEM_PER_CTA's 96 KB); the default keeps a row per
    CTA and renders for both targets. With 3 rows the several-rows layout fits (37 KB)."""
    import torch.nn.functional as F

    def many(n):
        def fn(*xs):
            h = xs[0]
            for t in xs[1:]:
                h = h + t
            return F.layer_norm(h, (h.shape[-1],))
        return _lowered_kernel(fn, [torch.randn(4, 3064, dtype=torch.bfloat16) for _ in range(n)])
    k7, k3 = many(9), many(3)
    for arch in ("sm_90a", "sm_80"):
        s7 = render(k7, default_schedule(k7, arch), arch)
        assert s7.schedule.group == s7.schedule.threads and s7.smem_bytes <= mapreduce.max_smem(arch)
        s3 = render(k3, default_schedule(k3, arch), arch)
        assert s3.schedule.group < s3.schedule.threads and s3.smem_bytes <= mapreduce.SMEM_PER_CTA


def test_defaults_for_wide_mixed_rows_fit_shared_memory():
    """Staging areas sized by the widest chunk (an f64 or f32 row beside a bf16 one) can
    outgrow a CTA's shared memory under a row-per-CTA layout: the default then takes a
    layout that fits (a cluster or the stream stage), and renders, on both targets."""
    import torch.nn.functional as F

    def with_f64(x, a):
        return F.layer_norm(x.double() + a, (x.shape[-1],))

    def with_3_f32(x, a, b, c):
        h = x.float() + a + b + c
        return h, F.layer_norm(h, (h.shape[-1],))
    for C in (12288, 16384):
        x = torch.randn(4, C, dtype=torch.bfloat16)
        for fn, ins in ((with_f64, (x, torch.randn(4, C, dtype=torch.float64))),
                        (with_3_f32, (x, *(torch.randn(4, C) for _ in range(3))))):
            k = _lowered_kernel(fn, ins)
            for arch in ("sm_90a", "sm_80"):
                src = render(k, default_schedule(k, arch), arch)
                assert src.smem_bytes <= mapreduce.max_smem(arch), (fn.__name__, C, arch, src.schedule)

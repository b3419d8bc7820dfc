"""The GEMV template (codegen/gemv.py) without a GPU: which GEMMs it takes, its default
schedule, that every knob and epilogue kind compiles for sm_90a and sm_80 with no spills, and
that nothing global is read before the wait for the kernel before except B where B is a weight.
(tests/gpu/test_gemv_gpu.py checks its numbers against float32.)"""
import re

import pytest

from tilefuse.codegen import epilogue as epi, gemv
from tilefuse.codegen.gemm_sm90 import GemmError, GemmProblem
from tilefuse.runtime import nvrtc

S = gemv.GemvSchedule
T = gemv.MmaGemvSchedule


def test_takes_one_row_of_a_k_major_weight_and_says_why_not_otherwise():
    assert gemv.why_not(GemmProblem(1, 4096, 4096)) == ""
    assert gemv.why_not(GemmProblem(8, 4096, 4096)) == ""
    assert "more than 8 rows" in gemv.why_not(GemmProblem(9, 4096, 4096))
    assert gemv.why_not(GemmProblem(9, 4096, 4096), max_m=16) == ""
    assert "batched" in gemv.why_not(GemmProblem(1, 64, 64, batch=2))
    assert "N-major" in gemv.why_not(GemmProblem(1, 64, 64, b_major="N"))
    assert "multiple of 8" in gemv.why_not(GemmProblem(1, 64, 68))
    assert "argument" in gemv.why_not(GemmProblem(1, 64, 64, m_arg=True))
    assert "128 columns" in gemv.why_not(GemmProblem(1, 256, 64, epilogue=_with_sq(1, 256, epi.PARTIAL_WIDTH)))


def _with_sq(m, n, width=gemv.GROUP, also_max=False, lse=False):
    """y = acc + residual stored in bf16, and per `width` columns the sum of y * y (and y's max,
    or a log-sum-exp pair)."""
    e = epi.EpilogueBuilder(m, n)
    y = e.op("add", e.acc(), e.load("residual", "tile", "bf16"))
    e.store("out", y, "bf16")
    e.partial_sum("ss", e.op("mul", y, y), width)
    if also_max:
        e.partial_max("mx", y, width)
    if lse:
        e.partial_lse("pmax", "psum", y, width)
    return e.kernel("with_partials")


def test_partials_over_its_16_columns_and_nothing_else():
    """A norm's sums (or maxima) over groups of a CTA's 16 columns: taken, at one row too, in the
    tensor-core form; groups of 128, N not whole groups, a log-sum-exp (needs the group's max
    before its sum): not, each saying why; the FMA form refuses partials."""
    for m in (1, 4, 8):
        p = GemmProblem(m, 4096, 4096, epilogue=_with_sq(m, 4096, also_max=True))
        assert gemv.why_not(p) == ""
        assert isinstance(gemv.default_schedule(p), T)
    assert "not a multiple of 16" in gemv.why_not(GemmProblem(2, 200, 64, epilogue=_with_sq(2, 200)))
    assert "log-sum-exp" in gemv.why_not(GemmProblem(2, 256, 64, epilogue=_with_sq(2, 256, lse=True)))
    with pytest.raises(GemmError, match="tensor-core form"):
        gemv.render(GemmProblem(1, 256, 64, epilogue=_with_sq(1, 256)), S())


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("sched", [None, T(1, 1), T(32, 4)], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (3, 4096, 11008), (8, 16, 72)])
def test_partials_compile_and_one_lane_stores_each(m, n, k, sched, arch):
    """Without spills; each partial is stored by the lanes of g = 0 only (one per row of the
    CTA), at column blockIdx.x of its [M, N / 16] output, after the xor-4/8/16 exchange."""
    src = _compiles(GemmProblem(m, n, k, epilogue=_with_sq(m, n, also_max=True)), sched, arch).source
    tail = src.split("// the partials:", 1)[1]
    assert tail.count("__shfl_xor_sync") == 2 * 2 * 3  # two rows a lane, two partials, three masks
    for buf in ("ss", "mx"):
        stores = re.findall(rf"\b{buf}\[(.*?)\] = ", src)
        assert stores == [f"(m) * {n // 16}LL + blockIdx.x" if n > 16 else "m + blockIdx.x"] * 2, stores
    assert tail.count("if (tf_g == 0 && ") == 2


def test_tilefuse_gemv_0_turns_it_off():
    p = GemmProblem(1, 4096, 4096)
    assert gemv.takes(p, environ={})
    assert not gemv.takes(p, environ={gemv.ENV: "0"})
    assert not gemv.takes(p, environ={gemv.ENV: "off"})
    assert gemv.takes(GemmProblem(8, 4096, 4096), environ={})
    assert not gemv.takes(GemmProblem(9, 4096, 4096), environ={})


@pytest.mark.parametrize("k,unroll", [(4096, 8), (2048, 8), (5632, 2), (11008, 1), (1024, 4), (72, 1), (8, 1)])
def test_default_unroll_is_the_deepest_whose_steps_tile_k(k, unroll):
    """The session-50 sweep's rule: the deepest unroll whose steps (32 lanes x unroll vectors)
    divide K's 16-byte vectors; one column a warp, 4 warps."""
    s = gemv.default_schedule(GemmProblem(1, 4096, k))
    assert (s.cols, s.warps, s.unroll) == (1, 4, unroll)


def test_a_pairwise_epilogue_takes_two_columns_a_warp():
    s = gemv.default_schedule(GemmProblem(1, 22016, 4096, epilogue=epi.glu(1, 22016, "bf16")))
    assert s.cols == 2 and s.unroll == 4


def _compiles(p, sched=None, arch="sm_90a"):
    src = gemv.render(p, sched, arch)
    info = nvrtc.compile_cuda(src.source, src.name, arch).info
    assert info.clean, (src.name, info)
    return src


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 8), (1, 33, 72), (2, 4097, 4104), (4, 130, 96), (1, 4096, 11008)])
def test_shapes_and_dtypes_compile_without_spills(m, n, k, dtype, arch):
    _compiles(GemmProblem(m, n, k, dtype, b_const=True), None, arch)


@pytest.mark.parametrize("sched", [S(c, w, u) for c in (1, 2, 4) for w in (1, 4, 16) for u in (1, 2, 4, 8)
                                   if c * u <= 16], ids=str)
def test_knobs_compile_without_spills(sched):
    _compiles(GemmProblem(2, 1000, 2056, "bf16", b_const=True), sched)


@pytest.mark.parametrize("act", epi.ACTIVATIONS)
def test_epilogue_kinds_compile(act):
    m, n, k = 1, 1030, 776
    ep = epi.standard(m, n, "bf16", bias="col", activation=act, residual=True, row_scale=True)
    _compiles(GemmProblem(m, n, k, "bf16", epilogue=ep), S(2, 4, 4))


@pytest.mark.parametrize("sched", [None, S(2, 8, 4), S(4, 4, 2)], ids=str)
def test_glu_compiles(sched):
    _compiles(GemmProblem(3, 3002, 1032, "bf16", epilogue=epi.glu(3, 3002, "bf16")), sched)


def test_bad_knobs_are_clear_errors():
    with pytest.raises(GemmError, match="cols"):
        S(3, 4, 4)
    with pytest.raises(GemmError, match="warps"):
        S(1, 3, 4)
    with pytest.raises(GemmError, match="unroll"):
        S(1, 4, 3)
    with pytest.raises(GemmError, match="even number of columns"):
        gemv.render(GemmProblem(1, 64, 64, epilogue=epi.glu(1, 64, "bf16")), S(1, 4, 1))
    with pytest.raises(GemmError, match="32 lanes"):
        gemv.render(GemmProblem(16, 64, 64), S(4, 4, 1))
    with pytest.raises(GemmError, match="does not take"):
        gemv.render(GemmProblem(1, 64, 64, b_major="N"))


def _before_wait(src: str) -> str:
    body = src.split('extern "C"')[1]
    return body.split("tf_pdl_wait();")[0]


@pytest.mark.parametrize("m,k", [(1, 4096), (2, 4104), (1, 72)])
def test_nothing_but_a_weight_is_read_before_the_wait(m, k):
    """Under programmatic launch the kernel before may still be writing A and the epilogue's
    operands: before tf_pdl_wait only B's loads may run, and only where B is a weight (b_const);
    then they are the first whole step's, each row's vectors at lane + 32 u."""
    ep = epi.standard(m, 512, "bf16", bias="col", residual=True, row_scale=True)
    s = gemv._fma_default(GemmProblem(m, 512, k))
    for b_const in (False, True):
        src = gemv.render(GemmProblem(m, 512, k, "bf16", epilogue=ep, b_const=b_const), s).source
        head = _before_wait(src)
        assert "tf_pdl_launch();" in head
        for name in ("A", "bias", "residual", "row_scale", "__ldg"):
            assert not re.search(rf"\b{name}\b", head.split("{", 1)[1]), (name, head)
        assert "tf_ld_stream(" not in head   # (.nc loads: ptxas moves them after the wait)
        loads = re.findall(r"tf_ld_early\((\w+) \+ lane \+ (\d+)\)", head)
        whole = k // 8 >= 32 * s.unroll
        if b_const and whole:
            assert sorted(loads) == sorted((f"brow{c}", str(32 * u)) for u in range(s.unroll) for c in range(s.cols))
        else:
            assert loads == []




def test_more_than_one_row_defaults_to_the_tensor_core_form():
    assert isinstance(gemv.default_schedule(GemmProblem(1, 4096, 4096)), S)
    for m in (2, 5, 8):
        assert isinstance(gemv.default_schedule(GemmProblem(m, 4096, 4096)), T)


@pytest.mark.parametrize("n,k,warps,unroll", [(4096, 4096, 16, 8), (22016, 4096, 16, 8), (4096, 11008, 16, 2),
                                              (11264, 2048, 16, 2), (2048, 2048, 32, 2), (1024, 4096, 32, 4),
                                              (2048, 5632, 32, 2), (2048, 4096, 32, 4), (2049, 4096, 16, 8),
                                              (32, 64, 2, 2), (4096, 256, 8, 2), (4096, 72, 2, 2)])
def test_tensor_core_default_rule(n, k, warps, unroll):
    """Session 51's rule: 32 warps where at most 128 CTAs of 16 columns, else 16, but no more
    than K's chunks of 32; the deepest unroll (128 / warps chunks, at most 8) where K is whole
    steps of it, else 2."""
    s = gemv.default_schedule(GemmProblem(4, n, k))
    assert (s.warps, s.unroll) == (warps, unroll)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("m,n,k", [(2, 1, 8), (2, 33, 72), (5, 4097, 4104), (8, 130, 96), (8, 4096, 11008),
                                   (1, 1024, 4096)])
def test_tensor_core_form_compiles_without_spills(m, n, k, dtype, arch):
    src = _compiles(GemmProblem(m, n, k, dtype, b_const=True), T(), arch)
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in src.source


@pytest.mark.parametrize("sched", [T(w, u) for w in (1, 2, 4, 8, 16) for u in (1, 2, 4, 8)], ids=str)
def test_tensor_core_knobs_compile_without_spills(sched):
    src = _compiles(GemmProblem(8, 1000, 2056, "bf16", b_const=True), sched)
    assert src.block == (32 * sched.warps, 1, 1) and src.grid == (-(-1000 // 16), 1, 1)


@pytest.mark.parametrize("sched", [T(4, 2), T(16, 2), T(16, 8), T(32, 4)], ids=str)
@pytest.mark.parametrize("ep", list(epi.ACTIVATIONS) + ["glu"])
def test_tensor_core_epilogues_compile(ep, sched):
    """Every epilogue kind at the default rule's warps: no spills (at 16 warps ptxas spilled a
    GLU epilogue while the cross-warp sum was unrolled)."""
    m, n, k = 6, 1030, 4096
    kernel = (epi.glu(m, n, "bf16") if ep == "glu" else
              epi.standard(m, n, "bf16", bias="col", activation=ep, residual=True, row_scale=True))
    _compiles(GemmProblem(m, n, k, "bf16", epilogue=kernel, b_const=True), sched)


def test_tensor_core_form_refuses_more_than_8_rows():
    with pytest.raises(GemmError, match="more than 8 rows"):
        gemv.render(GemmProblem(9, 64, 64), T())


@pytest.mark.parametrize("b_const", [False, True])
def test_tensor_core_form_reads_nothing_before_the_wait(b_const):
    """Nothing, a weight included, is loaded before tf_pdl_wait (gemv's docstring says why)."""
    ep = epi.standard(4, 512, "bf16", bias="col", residual=True, row_scale=True)
    src = gemv.render(GemmProblem(4, 512, 4096, "bf16", epilogue=ep, b_const=b_const), T(4, 2)).source
    head = _before_wait(src).split("{", 1)[1]
    assert "tf_pdl_launch();" in head
    for name in ("A", "bias", "residual", "row_scale", "__ldg", "tf_a", "tf_ld_stream", "tf_ld_early"):
        assert not re.search(rf"\b{name}\b", head.split("tf_pdl_launch();", 1)[1]), (name, head)


def test_both_forms_launch_programmatically():
    """Session 53: the tensor-core form launched programmatically (loading nothing before its
    wait) made decode steps of 1 and 4 sequences 0.3-0.8% faster on an H200 (session 51's loss
    under it came with A's non-coherent reads, since gone)."""
    from tilefuse.runtime.gemv import GemvKernel

    assert GemvKernel(gemv.render(GemmProblem(1, 64, 64)), None, False).pdl
    assert GemvKernel(gemv.render(GemmProblem(4, 64, 64)), None, False).pdl


@pytest.mark.parametrize("m,n,k,sched", [(4, 22016, 4096, T(16, 8, 1)), (4, 4096, 11008, T(16, 2, 2)),
                                         (3, 1000, 2056, T(32, 2, 2)), (8, 33, 72, T(1, 1, 1)),
                                         (4, 4097, 11008, T(4, 2, 2))], ids=str)
def test_l2_prefetches_are_asked_before_the_wait_and_ahead_in_the_loop(m, n, k, sched):
    """With `prefetch` p, B's first p steps (those K holds) are asked into L2 before
    tf_pdl_wait and, inside the main loop, step s asks for step s + p, by thread 0 a row at a
    time (a uniform address), or where one step is all of K in one for the CTA's rows end to
    end (rows past N not asked). The kernel compiles clean and is named apart from p = 0."""
    P = GemmProblem(m, n, k, "bf16", b_const=True)
    src = gemv.render(P, sched)
    assert src.name != gemv.render(P, T(sched.warps, sched.unroll)).name
    kv = k // 8
    step = 4 * sched.warps * sched.unroll
    head = _before_wait(src.source).split("tf_pdl_launch();", 1)[1]
    if step >= kv:
        assert head.count("tf_prefetch_l2(") == 1
        assert f"if (threadIdx.x == 0) tf_prefetch_l2(B + (long long)n0 * {kv}, 16u * {kv} * min(16, {n} - n0));" in head
        assert "(s + " not in src.source.split("tf_pdl_wait();", 1)[1].split("tf_prefetch_l2", 1)[0]
    else:
        rows = f"if (threadIdx.x == 0) for (int r = 0; r < min(16, {n} - n0); ++r) tf_prefetch_l2("
        assert head.count(rows) == len([j for j in range(sched.prefetch) if j * step < kv]), head
        assert f"if (threadIdx.x == 0 && (s + {sched.prefetch}) * {step} < {kv}) for (int r = 0;" in src.source
    _compiles(P, sched)


def test_l2_prefetches_need_sm_90_and_at_most_two_steps():
    with pytest.raises(GemmError, match="need sm_90"):
        gemv.render(GemmProblem(4, 64, 64), T(4, 2, 1), "sm_80")
    with pytest.raises(GemmError, match="prefetch"):
        T(4, 2, 3)


@pytest.mark.parametrize("m,n,k,prefetch", [(4, 2048, 2048, 1), (4, 1024, 4096, 1), (2, 2048, 4096, 1),
                                            (4, 2048, 5632, 0), (4, 4096, 4096, 0), (4, 11264, 2048, 0)],
                         ids=str)
def test_the_default_prefetches_where_the_ctas_are_few_and_k_short(m, n, k, prefetch):
    """Session 54's sweep (H200): one step of B asked into L2 made the few-CTA shapes with K up
    to 4096 7-15% faster and the rest slower, so the default asks for it there only, and on
    sm_80 (which has no bulk prefetch) the default it renders asks for none."""
    P = GemmProblem(m, n, k, "bf16", b_const=True)
    assert gemv.default_schedule(P).prefetch == prefetch
    assert ("tf_prefetch_l2(B" in gemv.render(P).source) == bool(prefetch)
    old = gemv.render(P, arch="sm_80")
    assert old.schedule.prefetch == 0 and "tf_prefetch_l2(B" not in old.source



def _qkv(m, n_kv=1024):
    """A decode step's Q, K and V projections of one A: Q with a row scale (a folded norm),
    K pairwise (a GLU stands in for RoPE's pairs), V plain; GQA's narrower K and V."""
    return [GemmProblem(m, 4096, 4096, "bf16", epilogue=epi.standard(m, 4096, "bf16", row_scale=True), b_const=True),
            GemmProblem(m, n_kv, 4096, "bf16", epilogue=epi.glu(m, n_kv, "bf16"), b_const=True),
            GemmProblem(m, n_kv, 4096, "bf16", b_const=True)]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_a_group_hands_each_member_its_ctas_under_one_schedule(m, arch):
    """render_group: one schedule for all (the tensor-core form from 2 rows, else the FMA form
    with the widest member's columns), each member's CTAs in turn (grid the sum of theirs),
    its body the member's own with blockIdx.x rebased; A shared, each B and epilogue tensor
    its own parameter; compiles clean."""
    ps = _qkv(m)
    g = gemv.render_group(ps, arch=arch)
    alone = [gemv.render(p, g.schedule, arch) for p in ps]
    assert isinstance(g.schedule, T if m > 1 else gemv.GemvSchedule) and (m > 1 or g.schedule.cols == 2)
    assert g.grid[0] == sum(a.grid[0] for a in alone) and g.block == alone[0].block
    assert g.params == ("g0_out", "g0_row_scale", "g1_B", "g1_out", "g2_B", "g2_out")
    g0, g1 = alone[0].grid[0], alone[0].grid[0] + alone[1].grid[0]
    part = ", tf_part" if m > 1 else ""
    assert f"if (blockIdx.x < {g0}) {{ tf_member0(A, B, g0_out, g0_row_scale{part}, blockIdx.x - 0); return; }}" in g.source
    assert f"if (blockIdx.x < {g1}) {{ tf_member1(A, g1_B, g1_out{part}, blockIdx.x - {g0}); return; }}" in g.source
    assert f"{{ tf_member2(A, g2_B, g2_out{part}, blockIdx.x - {g1}); return; }}" in g.source
    for i, a in enumerate(alone):  # each member's body is the kernel it would be alone, but for its CTA
        # index and the warps' exchange buffer, which the kernel declares once for all
        body = a.source.split(a.name + "(", 1)[1].split(") {", 1)[1].rstrip().removesuffix("}")
        assert gemv._EXCHANGE.sub("", body).replace("blockIdx.x", "tf_bid") in g.source, i
    assert g.source.count("__shared__") == (1 if m > 1 else 0)
    assert g.members == tuple((p, a.params) for p, a in zip(ps, alone))
    info = nvrtc.compile_cuda(g.source, g.name, arch).info
    assert info.clean, info


def test_a_group_takes_partials_and_refuses_what_is_not_one_a():
    ps = _qkv(4)
    e = epi.EpilogueBuilder(4, 4096)
    y = e.op("add", e.acc(), e.load("residual", "tile", "bf16"))
    e.store("out", y, "bf16")
    e.partial_sum("sq", e.op("mul", y, y), gemv.GROUP)
    ps[0] = GemmProblem(4, 4096, 4096, "bf16", epilogue=e.kernel("res_sq"), b_const=True)
    g = gemv.render_group(ps)
    assert "g0_sq" in g.params and nvrtc.compile_cuda(g.source, g.name, "sm_90a").info.clean
    with pytest.raises(GemmError, match="one A"):
        gemv.render_group([ps[1], GemmProblem(4, 1024, 2048, "bf16")])
    with pytest.raises(GemmError, match="two or more"):
        gemv.render_group(ps[:1])


def test_a_group_kernels_call_says_what_is_wrong_and_which_member():
    """A call with the wrong number of B tensors is refused before any check; a bad tensor is
    named with the member it belongs to."""
    import torch
    from tilefuse.runtime.gemv import GemvGroupKernel

    k = GemvGroupKernel(gemv.render_group([GemmProblem(4, 64, 64), GemmProblem(4, 32, 64)]), None, False)
    a = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="2 members, got 1 B tensor"):
        k(a, [torch.randn(64, 64).bfloat16()])
    with pytest.raises(ValueError, match=r"expected a CUDA tensor.*\(member 0: 4x64x64\)"):
        k(a, [torch.randn(64, 64).bfloat16(), torch.randn(32, 64).bfloat16()])


def test_a_groups_warps_share_one_exchange_buffer():
    """The tensor-core form's cross-warp buffer is declared once in the group's kernel, not once
    a member: four 512-wide members at 32 warps take 15.5 KB of shared memory, not 62 KB (past
    the 48 KB of static shared memory: sm_80's ptxas refused it)."""
    for arch in ("sm_90a", "sm_80"):
        g = gemv.render_group([GemmProblem(4, 512, 4096, "bf16") for _ in range(4)], arch=arch)
        assert g.schedule.warps == 32
        info = nvrtc.compile_cuda(g.source, g.name, arch).info
        assert info.clean and info.smem_bytes == 31 * 32 * 16, info


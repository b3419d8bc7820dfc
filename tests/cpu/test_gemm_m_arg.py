"""GEMMs that take M as an argument: one source, so one NVRTC build and one cubin, for every M
of a tail class (M a multiple of the tile's rows, or not), whatever the epilogue and schedule;
baked where M cannot be an argument, and an explicit request for it refused there."""
from dataclasses import replace

import pytest

from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90 as g
from tilefuse.codegen.epilogue import EpilogueBuilder
from tilefuse.loop import ir
from tilefuse.runtime import nvrtc


def _rmsnorm_partials(m, n):
    """The RMSNorm fold's producer: the value stored, its sum of squares per column group."""
    e = EpilogueBuilder(m, n)
    x = e.op("add", e.acc(), e.load("residual", "tile", "bf16"))
    e.store("out", x, "bf16")
    e.partial_sum("sumsq", e.op("mul", x, x))
    return e.kernel()


def _cross_entropy_partials(m, n):
    """The LM head's: running max and sum-exp per column group, and the target's logit."""
    e = EpilogueBuilder(m, n)
    x = e.acc()
    e.partial_lse("pmax", "psum", x)
    e.partial_select("picked", x, "target")
    return e.kernel()


EPILOGUES = {
    "plain": lambda m, n: None,
    "bias_gelu": lambda m, n: epi.standard(m, n, "bf16", bias="col", activation="gelu"),
    "row_scale_residual": lambda m, n: epi.standard(m, n, "bf16", row_scale=True, residual=True),
    "swiglu": lambda m, n: epi.glu(m, n, "bf16"),
    "rope_table": lambda m, n: epi.rope(m, n, "bf16", table=(4096, 64)),
    "rmsnorm_partials": _rmsnorm_partials,
    "cross_entropy": _cross_entropy_partials,
}

SCHEDULES = {
    "128x256_tma_store": g.GemmSchedule(128, 256, stages=4),
    "cluster_m2": g.GemmSchedule(128, 256, stages=4, cluster_m=2),
    "128x64_direct": g.GemmSchedule(128, 64, stages=8, tma_store=False),
    "split_k2": g.GemmSchedule(128, 128, stages=6, split_k=2),
    "stream_k": g.GemmSchedule(128, 128, stages=6, stream_k=132),
    "pingpong": g.GemmSchedule(128, 128, stages=4, pingpong=True),
}


def _render(m, n, k, ep, sched, **kw):
    return g.render(g.GemmProblem(m, n, k, "bf16", epilogue=ep(m, n), **kw), sched)


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("ep", EPILOGUES, ids=str)
def test_one_source_serves_every_m_of_a_tail_class(ep, sched):
    """Two Ms with whole tiles render the same source, as do two with a tail tile (the classes
    differ where the tail needs guards: loads, direct stores, partials); baked kernels
    (m_arg=False) of those Ms differ: M is in them."""
    s, make = SCHEDULES[sched], EPILOGUES[ep]
    n, k = 2048, 4096
    if ep == "swiglu" or ep == "rope_table":
        n = 4096  # (pairwise: the product is twice the output's width)
    try:
        whole = [_render(m, n, k, make, s) for m in (4096, 6144)]
        tail = [_render(m, n, k, make, s) for m in (4000, 6100)]
    except g.GemmError as e:  # (a combination this template takes from no planner: said why)
        pytest.skip(str(e))
    for a, b in (whole, tail):
        assert a.m_arg and b.m_arg
        assert a.source == b.source and a.name == b.name
        assert "const int tf_m)" in a.source and "xMx" in a.name
    baked = [g.render(g.GemmProblem(m, n, k, "bf16", epilogue=make(m, n), m_arg=False), s) for m in (4096, 6144)]
    assert not baked[0].m_arg and baked[0].source != baked[1].source and "const int tf_m" not in baked[0].source


def test_a_kernel_launches_with_m_last():
    """The runtime passes M after the pointers exactly where the source takes it."""
    src = _render(3000, 1024, 512, EPILOGUES["plain"], SCHEDULES["128x256_tma_store"])
    signature = src.source[src.source.index(src.name + "("):].split(")")[0]
    assert signature.rstrip().endswith("const int tf_m")


@pytest.mark.parametrize("why, problem, sched", [
    ("batch strides", g.GemmProblem(512, 1024, 512, batch=2), g.GemmSchedule(128, 128, stages=6)),
    ("under one tile", g.GemmProblem(40, 1024, 512), g.GemmSchedule(64, 128, stages=8, consumers=1, tma_store=False)),
])
def test_m_stays_baked_where_it_must(why, problem, sched):
    """A batched GEMM and an M under one tile hold M as a number; asking for the argument
    there is an error that says why."""
    assert why in g.rows_as_argument(problem, sched)
    src = g.render(problem, sched)
    assert not src.m_arg and "const int tf_m" not in src.source
    with pytest.raises(g.GemmError, match=why):
        g.render(replace(problem, m_arg=True), sched)


@pytest.mark.parametrize("sched", ["128x256_tma_store", "split_k2", "stream_k"])
def test_m_argument_kernels_compile_without_spills(sched):
    """The kernels that count tiles at run time build for sm_90a with no spills."""
    src = _render(4000, 2048, 4096, EPILOGUES["rmsnorm_partials"], SCHEDULES[sched])
    assert src.m_arg
    cubin = nvrtc.compile_cuda(src.source, src.name, "sm_90a")
    assert cubin.info.clean, cubin.info


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("ep", EPILOGUES, ids=str)
def test_a_source_rendered_at_one_m_serves_another_as_rendering_it_would(ep, sched):
    """render's memo (a source of one M given for another M of its key) returns what rendering
    at that M returns: the same text, and the launch's counts (tiles, workspace) and problem
    of the new M."""
    s, make = SCHEDULES[sched], EPILOGUES[ep]
    n = 4096 if ep in ("swiglu", "rope_table") else 2048
    g._RENDERED.clear()
    for first, then in ((4096, 6144), (4000, 6100), (6100, 4000)):
        try:
            g.render(g.GemmProblem(first, n, 4096, "bf16", epilogue=EPILOGUES[ep](first, n)), s)
            problem = g.GemmProblem(then, n, 4096, "bf16", epilogue=make(then, n))
            memo = g.render(problem, s)
        except g.GemmError as e:
            pytest.skip(str(e))
        fresh = g._render(problem, s)
        assert g._m_free_key(problem, s) in g._RENDERED
        assert memo == fresh and memo.problem.m == then and memo.problem.epilogue is problem.epilogue


def test_no_memo_where_m_could_reach_the_source_otherwise():
    """An epilogue buffer indexed by m in a later dimension (its length a stride), a batch,
    or M baked: rendered every time."""
    m, n = 3000, 1024
    e = EpilogueBuilder(m, n)
    x = e.op("add", e.acc(), e.load_at("colmajor", (n, m), "bf16", (ir.Var("n"), ir.Var("m"))))
    e.store("out", x, "bf16")
    s = SCHEDULES["128x256_tma_store"]
    assert g._m_free_key(g.GemmProblem(m, n, 512, epilogue=e.kernel()), s) is None
    assert g._m_free_key(g.GemmProblem(m, n, 512, batch=2), s) is None
    assert g._m_free_key(g.GemmProblem(m, n, 512, m_arg=False), s) is None
    assert g._m_free_key(g.GemmProblem(m, n, 512), s) is not None


def test_the_memo_holds_what_the_source_depends_on_beyond_the_epilogue():
    """A source rendered under other template constants (a bench's A/B patches one) or with a
    zero of the other sign (equal in Python, not in the C it writes) is not given again."""
    s = SCHEDULES["128x256_tma_store"]
    res = g.GemmProblem(4096, 4096, 4096, epilogue=epi.standard(4096, 4096, "bf16", residual=True))
    saved = g.MAINLOOP_PAIR_REGS
    try:
        g.MAINLOOP_PAIR_REGS = 0
        ahead = g.render(res, s)
    finally:
        g.MAINLOOP_PAIR_REGS = saved
    assert g.render(res, s).source == g._render(res, s).source != ahead.source
    g.render(g.GemmProblem(4096, 2048, 1024, epilogue=epi.standard(4096, 2048, "bf16", alpha=0.0)), s)
    p = g.GemmProblem(6144, 2048, 1024, epilogue=epi.standard(6144, 2048, "bf16", alpha=-0.0))
    assert g.render(p, s).source == g._render(p, s).source


def test_a_model_compiled_at_two_prompt_lengths_shares_its_gemm_sources():
    """Through the whole pipeline (capture, rewrites, lowering): a Llama's GEMMs at two prompt
    lengths whose schedules agree render one source each (one build serves both lengths);
    the lowering puts no M into an epilogue other than as the rows it indexes."""
    import torch

    from tilefuse.compiler import compile_stages
    from tilefuse.models import hf

    torch.manual_seed(0)
    cfg = hf.config("llama", 1, 256, seq=1024, vocab=512)
    model = hf.CausalLM(hf.causal_lm(cfg).to(torch.bfloat16).eval())
    sources = []
    for seq in (700, 900):  # (tails both: 700 and 900 are not multiples of 128)
        ids = torch.randint(0, cfg.vocab_size, (1, seq))
        with torch.no_grad():
            prog = compile_stages(model, (ids,), arch="sm_90a").program
        sources.append({name: g.render(lg.problem()) for name, lg in prog.gemms.items()})
    a, b = sources
    assert a.keys() == b.keys()
    same_schedule = [n for n in a if a[n].schedule == b[n].schedule]
    assert len(same_schedule) >= 3, {n: (a[n].schedule, b[n].schedule) for n in a}
    for n in same_schedule:
        assert a[n].m_arg and a[n].source == b[n].source, n
        assert a[n].problem.m == 700 and b[n].problem.m == 900

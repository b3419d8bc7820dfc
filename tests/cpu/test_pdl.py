"""Programmatic dependent launch: a kernel launched with programmatic stream serialization
may start while the kernel before it on the stream still runs, so each generated kernel must
wait (tf_pdl_wait) before it touches global memory; the launchers ask for the overlap only
where that wait is an instruction (sm_90 on) and the user has not turned it off."""
import re

import loop_fixtures as fx
import pytest
from cuda.bindings import driver

from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90 as g
from tilefuse.codegen import mapreduce
from tilefuse.runtime import nvrtc
from tilefuse.runtime.launch import launch_attributes, pdl_enabled


def _params(source: str) -> tuple[str, list[str]]:
    """The kernel's body and the names of its parameters (the only way it reaches global memory)."""
    m = re.search(r'extern "C" __global__ void[^\n]*\n?\s*(\w+)\(([^)]*)\)\s*\{', source)
    assert m, "no kernel signature found"
    names = [re.findall(r"\w+", p)[-1] for p in m.group(2).split(",") if "*" in p or "CUtensorMap" in p]
    return source[m.end():], names


def _assert_waits_first(source: str):
    """Every pointer and tensor map is used only after tf_pdl_wait(), which every thread
    reaches (it sits in the body's outermost block, not in a branch)."""
    body, names = _params(source)
    assert "tf_pdl_wait();" in body and "tf_pdl_launch();" in body
    before = body[:body.index("tf_pdl_wait();")]
    used = [n for n in names if re.search(rf"\b{n}\b", before)]
    assert not used, f"parameters used before the wait: {used}"
    assert before.count("{") == before.count("}"), "the wait sits inside a block some threads may skip"
    line = body[:body.index("tf_pdl_wait();") + len("tf_pdl_wait();")].rsplit("\n", 1)[-1]
    assert line.strip() == "tf_pdl_wait();", f"the wait is a statement of its own, not under a condition: {line!r}"


MAPREDUCE = [fx.rmsnorm_kernel(64, 4096), fx.softmax_kernel(8, 65536), fx.cross_entropy_kernel(32, 1000),
             fx.layernorm_kernel(4096, 256), fx.add_rmsnorm_kernel(16, 6144), fx.gather_kernel(9, 40),
             fx.softmax_kernel(4, 262144)]


@pytest.mark.parametrize("kernel", MAPREDUCE, ids=lambda k: k.name + str(k.params[0].shape))
def test_map_reduce_kernels_wait_for_the_kernel_before_them_before_any_global_access(kernel):
    src = mapreduce.render(kernel, None, "sm_90a")
    _assert_waits_first(src.source)
    # and the scalar variant a misaligned tensor runs, launched the same way
    _assert_waits_first(mapreduce.render(kernel, mapreduce.scalar_fallback(src.schedule), "sm_90a").source)


@pytest.mark.parametrize("problem,sched", [
    (g.GemmProblem(8192, 4096, 4096), None),
    (g.GemmProblem(8192, 4096, 4096), g.GemmSchedule(128, 256, stages=4, cluster_m=2)),
    (g.GemmProblem(200, 512, 1000), g.GemmSchedule(128, 128, stages=6, split_k=3)),
    (g.GemmProblem(1, 4096, 4096), None),
    (g.GemmProblem(1152, 4096, 4096), None),   # stream-K
    (g.GemmProblem(4096, 4096, 4096), g.GemmSchedule(128, 128, stages=4, pingpong=True)),
], ids=str)
def test_gemm_kernels_wait_for_the_kernel_before_them_before_any_global_access(problem, sched):
    src = g.render(problem, sched)
    _assert_waits_first(src.source)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_wait_builds_on_hopper_and_before_it(arch):
    """griddepcontrol exists from sm_90; on sm_80 the helpers compile to nothing."""
    src = mapreduce.render(fx.rmsnorm_kernel(64, 4096), None, arch)
    assert nvrtc.compile_cuda(src.source, src.name, arch).data


def test_programmatic_launch_is_asked_for_on_hopper_with_a_new_enough_driver_unless_turned_off():
    new = 13000
    assert pdl_enabled("sm_90a", {}, new) and pdl_enabled("sm_90", {}, new) and pdl_enabled("sm_100a", {}, new)
    assert not pdl_enabled("sm_80", {}, new) and not pdl_enabled("sm_89", {}, new)
    for off in ("0", "false", "OFF", " no "):
        assert not pdl_enabled("sm_90a", {"TILEFUSE_PDL": off}, new)
    assert pdl_enabled("sm_90a", {"TILEFUSE_PDL": "1"}, new)
    # a driver before CUDA 12.3 cannot capture programmatic launches into a graph
    assert pdl_enabled("sm_90a", {}, 12030) and not pdl_enabled("sm_90a", {}, 12020)


def test_launch_attributes_carry_the_cluster_and_the_programmatic_serialization():
    ids = driver.CUlaunchAttributeID
    assert launch_attributes(driver) == []
    both = launch_attributes(driver, (2, 1, 1), pdl=True)
    assert [a.id for a in both] == [ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                                    ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert both[0].value.clusterDim.x == 2 and both[1].value.programmaticStreamSerializationAllowed == 1
    only = launch_attributes(driver, (1, 1, 1), pdl=True)
    assert [a.id for a in only] == [ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]


def test_a_grid_reduction_waits_before_its_workspace_counters(monkeypatch, tmp_path):
    """A grid reduction counts CTAs in a workspace that the kernel before may be using: its
    counters too are touched only after the wait."""
    import torch
    import torch.nn.functional as F

    from tilefuse.compiler import compile_stages

    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TILEFUSE_GRID_REDUCE", "1")
    stages = compile_stages(lambda x, t: F.cross_entropy(x, t),
                            (torch.empty(4096, 65536, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.long)))
    kernels = [lw.kernel for lw in stages.kernels.values() if lw.kernel.family == "mapreduce"]
    srcs = [mapreduce.render(k, None, "sm_90a") for k in kernels]
    assert any(s.workspace_bytes for s in srcs), "expected a grid reduction"
    for s in srcs:
        _assert_waits_first(s.source)


def _producer(source: str) -> str:
    return source[source.index("if (threadIdx.x == 0) {", source.index("setmaxnreg.dec")):source.index("} else {\n    asm volatile(\"setmaxnreg.inc")]


@pytest.mark.parametrize("problem,sched", [
    (g.GemmProblem(1, 4096, 4096, b_const=True), None),
    (g.GemmProblem(1, 1024, 2816, b_const=True), None),                        # K slices
    (g.GemmProblem(1152, 4096, 4096, b_const=True), None),                     # stream-K
    (g.GemmProblem(4096, 4096, 4096, b_const=True), g.GemmSchedule(128, 128, stages=4, pingpong=True)),
    (g.GemmProblem(300, 1000, 2000, "bf16", "N", b_const=True), None),          # N-major B, tails
    (g.GemmProblem(8192, 2048, 2048, b_const=True, epilogue=epi.standard(8192, 2048, "bf16", bias="col",
                                                                         residual=True)),
     g.GemmSchedule(128, 256, stages=3, tma_loads=True)),                          # the residual by TMA
    (g.GemmProblem(512, 1024, 2048, b_const=True, epilogue=epi.standard(512, 1024, "bf16", row_scale=True,
                                                                        activation="gelu")),
     g.GemmSchedule(128, 128, stages=4, split_k=2)),
], ids=lambda x: str(x)[:120])
def test_a_weight_as_b_goes_out_before_the_wait_and_a_after_it(problem, sched):
    """B, a weight no kernel writes, is loaded for the first unit's first stages before the
    producer waits; A (the kernel before's output) only after; the consumers wait before
    anything global; the main loop skips the stages already issued; and it builds clean."""
    src = g.render(problem, sched)
    prod = _producer(src.source)
    before, after = prod.split("tf_pdl_wait();", 1)
    assert "&b_map" in before and "&a_map" not in before
    assert "&a_map" in after and "if (pre > 0)" in after
    body, _ = _params(src.source)
    assert "tf_pdl_wait();" not in body[:body.index("if (wg == 0)")], "no common wait before the roles"
    consumer = body[body.index('setmaxnreg.inc'):]
    first_global = min(consumer.index(x) for x in ("g_", "tf_ws", "tf_flags", "&r_map", "&c_map", "out") if x in consumer)
    assert consumer.index("tf_pdl_wait();") < first_global
    assert src.schedule.cluster_m * src.schedule.cluster_n == 1
    cubin = nvrtc.compile_cuda(src.source, src.name, "sm_90a")
    assert cubin.info.clean, cubin.info


def test_a_weight_as_b_waits_as_usual_under_a_cluster_and_without_the_flag():
    """A cluster multicasts B into the peer's stages, so there the producer waits first; a B
    that is not a weight (b_const False) is read only after the wait."""
    clustered = g.render(g.GemmProblem(8192, 4096, 4096, b_const=True), g.GemmSchedule(128, 256, stages=4, cluster_m=2))
    plain = g.render(g.GemmProblem(1, 4096, 4096))
    for src in (clustered, plain):
        _assert_waits_first(src.source)
        assert "int pre = 0;" not in src.source
    assert g.render(g.GemmProblem(1, 4096, 4096)).source != g.render(g.GemmProblem(1, 4096, 4096, b_const=True)).source


def test_a_programs_gemms_take_b_as_a_weight_only_where_it_is_one():
    import torch

    from tilefuse import models
    from tilefuse.compiler import compile_stages

    m = models.llama(256, 1, 128, 256, 4, max_seq=64).to(torch.bfloat16)
    st = compile_stages(m, (torch.randint(0, 256, (1, 8)),))
    assert st.gemms and all(lg.problem().b_const for lg in st.gemms.values())
    st = compile_stages(lambda x, y: (x @ y.T).relu(), (torch.randn(256, 512, dtype=torch.bfloat16),
                                                         torch.randn(512, 512, dtype=torch.bfloat16)))
    gemms = list(st.gemms.values())
    assert gemms and not any(lg.problem().b_const for lg in gemms)

"""The map-reduce knob space: derived from MapReduceSchedule, holding the heuristic default,
and containing only schedules the code generator accepts, each rendering a different kernel.

Checked over the fixture kernels at several shapes, for sm_90a and sm_80.
"""
from __future__ import annotations

import re
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import loop_fixtures as fx  # noqa: E402

from tilefuse.codegen import mapreduce as mr  # noqa: E402
from tilefuse.tune import mapreduce as mrs  # noqa: E402
from tilefuse.tune.families import get_family, register_family  # noqa: E402

CASES = [("rmsnorm", 64, 1024, "sm_90a"), ("softmax", 300, 256, "sm_80"),
         ("gather", 33, 1000, "sm_90a"), ("map", 3, 1, "sm_90a"), ("add_rmsnorm", 5, 300001, "sm_90a")]


def kernel(name, R, C, dtype="bf16"):
    return getattr(fx, f"{name}_kernel")(R, C, dtype)


@pytest.mark.parametrize("name, R, C, arch", CASES, ids=[f"{n}-{r}x{c}-{a}" for n, r, c, a in CASES])
def test_every_candidate_renders_a_distinct_kernel_and_the_default_is_one(name, R, C, arch):
    k = kernel(name, R, C)
    space = mrs.space(k, arch)
    configs = list(space.configs())
    assert space.as_dict(space.default) == asdict(mr.default_schedule(k, arch))
    assert space.default in configs
    seen = set()
    for cfg in configs:
        sched = mrs.build(k, space.as_dict(cfg), arch)
        src = mr.render(k, sched, arch)  # raises if the code generator rejects it
        body = re.sub(r"//[^\n]*", "", src.source)
        fp = (body, src.grid, src.block, src.smem_bytes, src.cluster)
        assert fp not in seen, f"{sched} renders the same kernel as another candidate"
        seen.add(fp)
        if arch == "sm_80":
            assert sched.cluster == 1
    assert len(configs) >= (1 if C == 1 else 10)


def test_the_dimensions_are_the_schedules_fields():
    space = mrs.space(kernel("rmsnorm", 64, 1024))
    assert set(space.names) == {f.name for f in fields(mr.MapReduceSchedule)}
    assert space.names[:3] == ("stage", "vector", "threads")  # the knobs that matter most branch first


def test_pruning_keeps_threads_busy_and_chunks_per_thread_bounded():
    k = kernel("rmsnorm", 64, 4096)
    space = mrs.space(k)
    for cfg in space.admitted():
        s = space.as_dict(cfg)
        if cfg == space.default:
            continue
        chunks, p = 4096 // s["vector"], s["group"] * s["cluster"]
        assert p <= chunks and (s["stage"] == "stream" or -(-chunks // p) <= mrs.MAX_CHUNKS_PER_THREAD)
        assert s["threads"] * s["min_blocks"] <= mrs.SM_THREADS
        assert s["stage"] == "stream" or s["unroll"] == space.as_dict(space.default)["unroll"]


def test_build_rejects_knobs_the_schedule_does_not_have():
    k = kernel("softmax", 8, 256)
    with pytest.raises(ValueError, match="warp_size"):
        mrs.build(k, {"threads": 256, "warp_size": 64})
    with pytest.raises(ValueError, match="multiple of 32"):
        mrs.build(k, {"threads": 48})


def test_families_are_registered_by_name():
    assert get_family("mapreduce").space is mrs.space
    with pytest.raises(ValueError, match="no knob space for the 'nope' kernel family"):
        get_family("nope")
    fam = register_family("test-only", mrs.space, mrs.build, version="7")
    assert get_family("test-only") is fam and fam.version == "7"


def test_a_batch_is_searched_only_where_a_row_group_holds_it_in_registers():
    """batch > 1 appears in the space (RMSNorm's 256-column rows), and only with the regs
    stage, a row group of at most a warp, no cluster, at most 16 staged chunks per thread
    counting the batch's rows, and no more rows per CTA than the kernel has."""
    k = kernel("rmsnorm", 64, 256)
    space = mrs.space(k)
    batched = [space.as_dict(c) for c in space.admitted() if space.as_dict(c)["batch"] > 1]
    assert batched
    for s in batched:
        assert s["stage"] == "regs" and s["group"] <= 32 and s["cluster"] == 1
        assert -(-(256 // s["vector"]) // s["group"]) * s["batch"] <= mrs.MAX_CHUNKS_PER_THREAD
        assert s["threads"] // s["group"] * s["batch"] <= 64

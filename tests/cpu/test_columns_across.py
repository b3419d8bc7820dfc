"""Column kernels whose rows are split between warps (MapReduceSchedule.across): the schedule's
rules, the thread layout (neighbouring threads on neighbouring rows, a row's threads a warp
apart), the exchange through shared memory, and spill-free builds for sm_90a and sm_80."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import tilefuse
from tilefuse.codegen import columns, mapreduce, rowlayout
from tilefuse.codegen.mapreduce import MapReduceSchedule
from tilefuse.layout import size
from tilefuse.runtime.launch import compile_source_only


@pytest.fixture
def any_rows(monkeypatch):
    monkeypatch.setenv("TILEFUSE_COLUMN_MIN_ROWS", "1")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("cubins")))


def ln_channels_first(x, w, b):
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return w[:, None, None] * ((x - u) / torch.sqrt(s + 1e-6)) + b[:, None, None]


PROGRAMS = {
    "softmax": lambda x, w, b: torch.softmax(x, 1),
    "layernorm": ln_channels_first,
    "mean_times_max": lambda x, w, b: x.mean(1) * x.amax(1),
    "var": lambda x, w, b: x.float().var(1),
}


def _kernel(name, C, dtype=torch.bfloat16, H=32, W=64):
    ins = (torch.randn(4, C, H, W, dtype=dtype), torch.randn(C, dtype=dtype), torch.randn(C, dtype=dtype))
    p = tilefuse.compile(PROGRAMS[name], ins)
    (k,) = [lw.kernel for lw in p.kernels.values() if columns.strided_rows(lw.kernel)]
    return k


@pytest.mark.parametrize("bad", [
    dict(group=1, threads=32),                       # nothing to split
    dict(group=4, threads=64),                        # 16 rows a CTA: a warp would hold two members
    dict(group=64, threads=2048 // 2),                # more than a warp's worth of members
    dict(group=4, threads=128, stage="smem"),
    dict(group=4, threads=128, two_pass=True),
])
def test_a_schedule_across_warps_refuses_what_it_cannot_lay_out(bad):
    with pytest.raises(ValueError, match="across warps"):
        MapReduceSchedule(**{"vector": 1, "stage": "stream", "across": True, **bad})


@pytest.mark.parametrize("group, threads", [(2, 64), (4, 128), (8, 512), (32, 1024)])
def test_neighbouring_threads_take_neighbouring_rows_and_a_rows_threads_lie_a_warp_apart(group, threads):
    """thread -> (lane, slot) is a bijection; thread t + 1 has row slot + 1 (while in the CTA's
    rows), and the threads of one row are `slots` apart, so each warp holds one lane of 32
    neighbouring rows: its loads of one column are one run."""
    lay = rowlayout.row_layouts(threads=threads, group=group, cluster=1, vector=1, nchunk=4, rows=10**6,
                                across=True)
    slots = threads // group
    seen = set()
    for t in range(threads):
        lane, slot = lay.lane(t), lay.slot(t)
        assert lay.thread((lane, slot)) == t
        seen.add((lane, slot))
        assert (lane, slot) == (t // slots, t % slots)
        assert len({lay.lane(u) for u in range(t - t % 32, t - t % 32 + 32)}) == 1  # a warp, one lane
    assert len(seen) == threads == size(lay.thread)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_exchange_goes_through_shared_memory_in_member_order(name, any_rows):
    k = _kernel(name, 96)
    s = replace(mapreduce.default_schedule(k), threads=256, group=8, across=True, stage="stream", unroll=16,
                two_pass=False)
    src, _ = compile_source_only(k, "sm_90a", s)
    text = src.source
    assert "rows across lanes" in text
    assert "__shfl" not in text  # a row's threads are in different warps: no shuffle reaches them
    assert "[lane][slot] = " in text and "__syncthreads();" in text
    assert "[i][slot]" in text  # every thread reads the partials in the same order


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("C", [3, 96, 97, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_column_kernels_split_between_warps_build_without_spills(name, dtype, C, arch, any_rows):
    k = _kernel(name, C, dtype)
    d = mapreduce.default_schedule(k)
    for g, stage in ((2, "regs"), (8, "stream"), (32, "stream")):
        s = replace(d, threads=32 * g, group=g, across=True, stage=stage, unroll=16, two_pass=False, min_blocks=1)
        src, cubin = compile_source_only(k, arch, s)
        assert src.schedule.across
        assert cubin.info.clean, f"{name} {C} {dtype} {arch} {s}: {cubin.info}"


def test_a_scan_does_not_take_a_row_split_between_warps(any_rows):
    x = torch.randn(4, 64, 32, 64)
    p = tilefuse.compile(lambda x: x.cumsum(1), (x,))
    (lw,) = p.kernels.values()
    s = MapReduceSchedule(threads=128, group=4, vector=1, stage="stream", unroll=16, across=True)
    with pytest.raises(ValueError, match="the row's threads"):
        compile_source_only(lw.kernel, "sm_90a", s)

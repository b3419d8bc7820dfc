"""Host overhead measurement in analyze/bench.py (timing logic only; no GPU needed)."""
import time

import pytest
import torch

from tilefuse.analyze import bench
from tilefuse.compiler import compile_stages


def test_host_us_is_the_median_wall_time_of_one_call(monkeypatch):
    """A call that sleeps 2 ms measures at least 2000 us and not wildly more; syncs happen around each call."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    us = bench.host_us(lambda: time.sleep(0.002), reps=7, warmup=1)
    assert 2000 <= us < 20000
    assert len(syncs) == 8  # one before each timed call, one after the last


def test_graph_note_says_how_tilefuse_ran():
    p = compile_stages(lambda x: torch.softmax(x, -1), [torch.randn(2, 8)]).program
    p.graphs = False
    p(torch.randn(2, 8))
    assert "graphs off" in bench._graph_note(p)
    p.graphs = True
    p(torch.randn(2, 8))
    note = bench._graph_note(p)
    assert "no CUDA graph" in note and "not a CUDA device" in note


def test_program_flops_count_every_matrix_product():
    """2*M*N*K for a generated GEMM and for a matmul left to cuBLAS; nothing for map-reduce steps."""
    import torch

    from tilefuse.analyze.bench import program_flops
    from tilefuse.compiler import compile_stages

    class M(torch.nn.Module):
        def forward(self, x, w, v):
            return torch.softmax((x @ w).float() @ v, -1)

    bf = torch.bfloat16
    st = compile_stages(M(), (torch.randn(16, 64, dtype=bf), torch.randn(64, 32, dtype=bf), torch.randn(32, 8)))
    assert sorted(s.family for s in st.plan.steps if s.flops) == ["extern", "gemm"]
    assert program_flops(st.plan) == 2 * 16 * 32 * 64 + 2 * 16 * 8 * 32


class _FakeEvent:
    """Stands in for torch.cuda.Event: records the order of events, 1 ms between any two."""

    log: list = []

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        _FakeEvent.log.append(("record", self))
        self.t = len(_FakeEvent.log)

    def elapsed_time(self, end):
        return float(end.t - self.t)


def test_median_ms_flushes_before_every_timed_call_and_times_only_the_call(monkeypatch):
    """flush="read": each timed call is preceded by the flush and bracketed by its own events,
    the flush outside them; "none" never flushes; an unknown mode is refused."""
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_read_flush", lambda: lambda: _FakeEvent.log.append(("flush", None)))
    ms = bench.median_ms(lambda: _FakeEvent.log.append(("call", None)), warmup=0, rep=40, flush="read")
    assert ms == 2.0  # start.record, call, end.record: two log entries apart
    kinds = [k for k, _ in _FakeEvent.log]
    timed = [i for i in range(1, len(kinds) - 2) if kinds[i:i + 3] == ["record", "call", "record"]]
    assert len(timed) >= 5 and all(kinds[i - 1] == "flush" for i in timed)
    _FakeEvent.log = []
    bench.median_ms(lambda: _FakeEvent.log.append(("call", None)), warmup=0, rep=40, flush="none")
    assert "flush" not in [k for k, _ in _FakeEvent.log]
    import pytest

    with pytest.raises(ValueError, match="flush must be"):
        bench.median_ms(lambda: None, flush="zero")


def test_compare_interleaves_rounds_and_takes_each_implementations_median(monkeypatch):
    """With rounds=R every implementation is timed R times, the order rotated each round (so
    no implementation always runs first), and its time is the median of its own rounds."""
    results = {"tilefuse": [3.0, 1.0, 2.0, 9.0, 2.5], "eager": [4.0, 8.0, 5.0, 6.0, 7.0]}
    order, last = [], []

    def fake_median_ms(fn):
        fn()  # the implementation says who it is
        name = last.pop()
        order.append(name)
        return results[name][order.count(name) - 1]

    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    monkeypatch.setattr(bench, "host_us", lambda fn: 1.0)
    prog = lambda *a: last.append("tilefuse")  # noqa: E731
    module = lambda *a: last.append("eager")  # noqa: E731
    rows = bench.compare(prog, module, (), nbytes=10**6, copy_bps=1e12, with_compile=False, rounds=5)
    assert {r.name: r.ms for r in rows} == {"tilefuse": 2.5, "eager": 6.0}
    assert order == ["tilefuse", "eager", "eager", "tilefuse"] * 2 + ["tilefuse", "eager"]
    with pytest.raises(ValueError, match="rounds"):
        bench.compare(prog, module, (), nbytes=1, copy_bps=1e12, with_compile=False, rounds=0)


def test_settle_queues_calls_back_to_back_for_about_the_time_asked(monkeypatch):
    """settle syncs once before, once after the sizing call and once at the end: no sync between
    the queued calls (a sync would let the GPU idle and cool); as many calls as fit the time."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    bench.settle(lambda: (log.append("call"), time.sleep(0.002)), seconds=0.02)
    calls = log.count("call")
    assert 5 <= calls <= 12  # one sizing call (~2 ms) then ~0.02 / 0.002 more
    assert log[:3] == ["sync", "call", "sync"] and log[-1] == "sync"
    assert "sync" not in log[3:-1]
    log.clear()
    bench.settle(lambda: log.append("call"), seconds=0)
    assert log == []


def test_sustained_ms_times_back_to_back_calls_between_two_events(monkeypatch):
    """After settling, one pair of events brackets n >= 5 back-to-back calls and the result is
    the elapsed time over n: the time per call in continuous use, no flush."""
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    settled = []
    monkeypatch.setattr(bench, "settle", lambda fn, s: settled.append(s))
    monkeypatch.setattr(bench, "_read_flush", lambda: pytest.fail("sustained timing must not flush"))
    ms = bench.sustained_ms(lambda: _FakeEvent.log.append(("call", None)), seconds=0.0, settle_s=1.5)
    kinds = [k for k, _ in _FakeEvent.log]
    first, last = kinds.index("record"), len(kinds) - 1 - kinds[::-1].index("record")
    n = kinds[first:last].count("call")
    assert settled == [1.5] and n >= 5 and kinds.count("record") == 2
    assert ms == (last - first) / n  # the fake clock: one unit per log entry


def test_compare_sustained_times_each_implementation_with_sustained_ms(monkeypatch):
    """sustained=True: every timing goes through sustained_ms, none through the flushed median."""
    used = []
    monkeypatch.setattr(bench, "sustained_ms", lambda fn: (used.append("sustained"), 2.0)[1])
    monkeypatch.setattr(bench, "median_ms", lambda fn: pytest.fail("per-call timing used"))
    monkeypatch.setattr(bench, "host_us", lambda fn: 1.0)
    rows = bench.compare(lambda *a: None, lambda *a: None, (), nbytes=10**6, copy_bps=1e12, with_compile=False,
                         rounds=3, sustained=True)
    assert used == ["sustained"] * 6 and {r.name: r.ms for r in rows} == {"tilefuse": 2.0, "eager": 2.0}


def test_sustained_timing_only_for_matrix_products_whose_data_outgrow_l2():
    """Back-to-back timing would find a small program's data still in L2: those keep the flushed
    single calls; so do programs without matrix products (memory-bound: no clock to settle)."""
    l2 = 50 << 20
    assert bench.sustained_timing(10**12, 2 * l2, l2)
    assert not bench.sustained_timing(10**12, 2 * l2 - 1, l2)
    assert not bench.sustained_timing(0, 100 * l2, l2)

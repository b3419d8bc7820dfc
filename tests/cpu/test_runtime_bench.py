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


def test_settle_queues_calls_back_to_back_for_the_time_asked(monkeypatch):
    """settle runs for the wall time asked, with calls queued in chunks (a sync per ~chunk, not
    per call: a sync lets the GPU idle and cool); seconds <= 0 runs nothing."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    t0 = time.perf_counter()
    bench.settle(lambda: (log.append("call"), time.sleep(0.002)), seconds=0.1, chunk=0.02)
    took = time.perf_counter() - t0
    assert 0.1 <= took < 0.3
    calls, syncs = log.count("call"), log.count("sync")
    assert calls >= 35 and syncs <= calls / 3  # ~50 calls of 2 ms; a sync per ~10 of them
    log.clear()
    bench.settle(lambda: log.append("call"), seconds=0)
    assert log == []


def test_settle_is_not_cut_short_by_a_slow_first_call(monkeypatch):
    """A program's early call captures its CUDA graph (several times a replay's time): settle
    must still run for the time asked, not size its loop by that call."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []

    def fn():
        time.sleep(0.05 if not calls else 0.002)
        calls.append(1)

    t0 = time.perf_counter()
    bench.settle(fn, seconds=0.1)
    assert time.perf_counter() - t0 >= 0.1 + 0.05 and len(calls) >= 40


def test_sustained_ms_times_back_to_back_calls_between_two_events(monkeypatch):
    """Settle first, then one pair of events around n back-to-back calls, n sized from `seconds`
    (at least 5), and the result is the elapsed time over n: the time per call in continuous
    use, no flush."""
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "settle", lambda fn, s: _FakeEvent.log.append(("settle", s)))
    monkeypatch.setattr(bench, "_read_flush", lambda: pytest.fail("sustained timing must not flush"))

    clock = [0.0]  # a host clock that each call advances by 2 ms (sleeping stretched under load)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def call():
        _FakeEvent.log.append(("call", None))
        clock[0] += 0.002

    ms = bench.sustained_ms(call, seconds=0.04, settle_s=1.5)
    kinds = [k for k, _ in _FakeEvent.log]
    first, last = kinds.index("record"), len(kinds) - 1 - kinds[::-1].index("record")
    n = kinds[first:last].count("call")
    assert _FakeEvent.log[0] == ("settle", 1.5) and kinds.count("record") == 2
    assert n == int(0.04 / 0.002)  # sized from the probe call's time
    assert ms == (last - first) / n  # the fake clock: one unit per log entry
    _FakeEvent.log = []
    bench.sustained_ms(lambda: _FakeEvent.log.append(("call", None)), seconds=0.0, settle_s=0)
    kinds = [k for k, _ in _FakeEvent.log]
    assert kinds[kinds.index("record"):].count("call") == 5  # never fewer than 5


def test_compare_sustained_times_each_implementation_with_sustained_ms(monkeypatch):
    """sustained=True: every timing goes through sustained_ms, none through the flushed median."""
    used = []
    monkeypatch.setattr(bench, "sustained_ms", lambda fn: (used.append("sustained"), 2.0)[1])
    monkeypatch.setattr(bench, "median_ms", lambda fn: pytest.fail("per-call timing used"))
    monkeypatch.setattr(bench, "host_us", lambda fn: 1.0)
    rows = bench.compare(lambda *a: None, lambda *a: None, (), nbytes=10**6, copy_bps=1e12, with_compile=False,
                         rounds=3, sustained=True)
    assert used == ["sustained"] * 6 and {r.name: r.ms for r in rows} == {"tilefuse": 2.0, "eager": 2.0}


def test_sustained_timing_only_for_matrix_bound_programs_whose_data_outgrow_l2():
    """Back-to-back timing would find a small program's data still in L2: those keep the flushed
    single calls; so do memory-bound programs (a decode step's GEMV reads every weight for 2
    FLOPs: it does not draw the power that moves the clock)."""
    l2 = 50 << 20
    big = 2 * l2
    assert bench.sustained_timing(100 * big, big, l2)
    assert not bench.sustained_timing(10**15, big - 1, l2)
    assert not bench.sustained_timing(0, 100 * l2, l2)
    assert not bench.sustained_timing(big, big, l2)  # 1 FLOP a byte
    assert not bench.sustained_timing(100 * big - 1, big, l2)


def test_a_fresh_compile_at_new_sizes_is_static_as_a_first_compile_is():
    """The torch.compile baseline of a benchmark's later case is compiled as a user compiling
    once at its sizes gets it: the same function met again at other sizes would otherwise be
    recompiled with dynamic shapes (dynamo's automatic dynamic), a slower baseline."""
    seen = []

    def record(gm, example_inputs):
        sizes = [d for t in example_inputs for d in (t.shape if isinstance(t, torch.Tensor) else (t,))]
        seen.append(any(isinstance(d, torch.SymInt) for d in sizes))  # a size symbol: a dynamic graph
        return gm.forward

    def fn(x):
        return torch.softmax(x * 2, -1)

    torch._dynamo.reset()
    torch.compile(fn, backend=record)(torch.randn(4, 8))
    torch.compile(fn, backend=record)(torch.randn(4, 16))  # the same code at new sizes: dynamic
    assert seen == [False, True]
    bench.fresh_compile(fn, backend=record)(torch.randn(4, 32))
    assert seen[-1] is False
    torch._dynamo.reset()

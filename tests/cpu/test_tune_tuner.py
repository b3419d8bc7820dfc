"""The tuner end to end on a CPU: search + (fake) measurements + cache, and everything that
reads the cache: the Program hook, `--ir schedule`, and `tilefuse tune` itself.

A fake `measure` stands in for the GPU: a deterministic time per knob set (so the best is
known), or a failure for chosen knobs. Properties:
- the default is measured first, the pick is the fastest measured, the entry is stored with
  stats and failures; a second run is a cache hit that measures nothing; --force re-tunes;
- kernels equal up to names are tuned once; failing candidates are recorded with reasons
  and the search goes on; a kernel without a reference fails fast and stores nothing;
- real worker processes survive fake candidates that crash or hang mid-search;
- `choose`/`tuned_schedule` return the tuned schedule on the same GPU, the default (with a
  note saying why) on no GPU, another arch, TILEFUSE_TUNED=0 or knobs that no longer render;
- compiled programs pass tuned knobs to compile_kernel; `--ir schedule` names the source;
- `tilefuse tune` without a GPU is one error line; with a (faked) GPU it tunes and caches.
"""
from __future__ import annotations

import sys
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import loop_fixtures as fx  # noqa: E402

from tune_fakes import crashy_measure, fake_time  # noqa: E402

from tilefuse.cli import main  # noqa: E402
from tilefuse.codegen.mapreduce import MapReduceSchedule, default_schedule  # noqa: E402
from tilefuse.compiler import compile_stages  # noqa: E402
from tilefuse.frontend.expr import parse  # noqa: E402
from tilefuse.loop.canon import canonicalize  # noqa: E402
from tilefuse.tune import command, lookup  # noqa: E402
from tilefuse.tune import device as tdevice  # noqa: E402
from tilefuse.tune.cache import TuneCache, key_for  # noqa: E402
from tilefuse.tune.families import get_family, register_family  # noqa: E402
from tilefuse.tune.measure import Measurement, NoReference  # noqa: E402
from tilefuse.tune.tuner import TuneOptions, Tuner  # noqa: E402
from tilefuse.tune.worker import Outcome, WorkerPool  # noqa: E402

H100 = tdevice.Device("NVIDIA H100 80GB HBM3", "9.0", "13.0")
MR = get_family("mapreduce")
CALLS: list = []


def fake_measure(job):
    CALLS.append(job.knobs)
    return Measurement(fake_time(job.knobs), {"reps": 1})


def flaky_measure(job):
    if job.knobs["stage"] == "regs":
        raise ValueError("wrong result: output y has error 0.5, bound 0.01")
    return fake_measure(job)


def no_reference(job):
    raise NoReference("no reference to check against: index out of range")


class InlinePool:
    """Runs jobs in this process, one at a time: the tuner logic without processes."""

    size = 1

    def __init__(self, *a, **kw):
        pass

    def submit(self, fn, payload, timeout=None):
        f = Future()
        try:
            f.set_result(Outcome(True, fn(payload)))
        except Exception as e:
            f.set_result(Outcome(False, reason=f"{type(e).__name__}: {e}"))
        return f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    CALLS.clear()
    return TuneCache()


def tuner(cache, fn=fake_measure, pool=None, **opts):
    # polish off unless a test asks: these tests count candidates against the budget
    return Tuner(pool or InlinePool(), H100, cache,
                 TuneOptions(**{"budget": 24, "confirm": 2, "confirm_rounds": 1, "polish": 0, **opts}),
                 measure_fn=fn)


def best_known(kernel):
    space = MR.space(kernel, "sm_90a")
    return min(fake_time(space.as_dict(c)) for c in space.configs())


# ---------------------------------------------------------------- tuning


def test_tunes_stores_and_then_hits_the_cache(cache):
    k = fx.rmsnorm_kernel(8, 128, "bf16")
    r = tuner(cache, exhaustive=True).tune({"k0": k})[0]
    assert CALLS[0] == MR.knobs(default_schedule(k, "sm_90a"))  # the default first
    assert r.status == "tuned" and r.method == "exhaustive"
    assert r.best_us == best_known(k) and r.default_us == fake_time(CALLS[0])
    entry = cache.get(key_for(k, H100, MR))
    assert entry.knobs == r.knobs and entry.stats["median_us"] == r.best_us
    assert entry.stats["default_us"] == r.default_us and entry.stats["evaluated"] == r.evaluated
    CALLS.clear()
    again = tuner(cache).tune({"k0": k})[0]
    assert again.status == "cached" and again.knobs == r.knobs and CALLS == []
    forced = tuner(cache, force=True, budget=5).tune({"k0": k})[0]
    assert forced.status == "tuned" and len(CALLS) > 0


def test_mcts_within_budget_picks_the_fastest_it_measured(cache):
    k = fx.softmax_kernel(300, 2048, "bf16")
    r = tuner(cache, budget=20, threshold=10).tune({"k": k})[0]
    assert r.method == "sp-mcts" and r.evaluated == 20
    assert r.best_us == min(fake_time(c) for c in CALLS) and r.best_us <= r.default_us


def test_polish_measures_the_best_configs_one_knob_neighbours_after_the_budget(cache):
    """With polish, the tuner goes on past the tree search's budget to the untried one-knob
    neighbours of its best config (within the allowance), and picks the fastest of all."""
    k = fx.softmax_kernel(300, 2048, "bf16")
    r = tuner(cache, budget=12, threshold=10, polish=16).tune({"k": k})[0]
    assert r.method == "sp-mcts" and 12 < r.evaluated <= 12 + 16
    searched = CALLS[:r.evaluated]
    assert r.best_us == min(fake_time(c) for c in searched)


def test_kernels_equal_up_to_names_are_tuned_once(cache):
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    twin = replace(canonicalize(k, rename_buffers=True), name="other")
    rs = tuner(cache, budget=6).tune({"a": k, "b": twin})
    assert [r.status for r in rs] == ["tuned", "same-as"] and rs[1].knobs == rs[0].knobs
    search = CALLS[:6]
    top2 = sorted(search, key=fake_time)[:2]
    confirm = top2 + ([] if search[0] in top2 else [search[0]])  # the best two and the default
    assert CALLS[6:] == confirm  # nothing measured for the twin


def test_failing_candidates_are_recorded_and_the_search_goes_on(cache):
    k = fx.rmsnorm_kernel(8, 128, "bf16")
    r = tuner(cache, fn=flaky_measure, exhaustive=True).tune({"k": k})[0]
    assert r.status == "tuned" and r.knobs["stage"] != "regs" and r.failed > 0
    assert all(f["knobs"]["stage"] == "regs" and "wrong result" in f["reason"] for f in r.failures)
    assert len(cache.get(key_for(k, H100, MR)).failures) == r.failed


def test_a_kernel_without_a_reference_fails_fast_and_stores_nothing(cache):
    k = fx.softmax_kernel(300, 2048, "bf16")
    r = tuner(cache, fn=no_reference).tune({"k": k})[0]
    assert r.status == "failed" and "no reference" in r.note and r.evaluated == 1
    assert cache.get(key_for(k, H100, MR)) is None


def test_real_workers_survive_crashing_and_hanging_candidates(cache):
    """Four hand-picked candidates, in a family registered for this test: one crashes its
    worker, one hangs past the watchdog, two run; the search finishes and keeps the faster."""
    k = fx.softmax_kernel(8, 1024, "bf16")
    space = MR.space(k, "sm_90a")
    smem = [c for c in space.configs() if space.as_dict(c)["stage"] == "smem"]
    picks = {[c for c in smem if space.as_dict(c)["threads"] == t][0] for t in (1024, 64)}
    picks |= set([c for c in smem if space.as_dict(c)["threads"] == 512][:2])
    few = replace(space, valid=lambda kn: tuple(kn.values()) in picks, default=None)
    register_family("test-crashy", lambda kernel, arch: few, lambda kernel, knobs, arch: knobs)
    with WorkerPool([None, None], timeout=0.5, preload=("tune_fakes",)) as pool:
        r = tuner(cache, pool=pool, fn=crashy_measure, exhaustive=True, timeout=0.5).tune(
            {"k": replace(k, family="test-crashy")})[0]
    reasons = [f["reason"] for f in r.failures]
    assert r.status == "tuned" and r.evaluated == 4 and r.failed == 2, reasons
    assert any("died (exit code 9)" in x for x in reasons) and any("timed out after 0.5 s" in x for x in reasons)
    assert r.best_us == min(fake_time(space.as_dict(c)) for c in picks if space.as_dict(c)["threads"] == 512)


def test_the_real_measure_path_checks_candidates_in_worker_processes(cache):
    """measure() in a worker, on the CPU: the Loop IR interpreter plays the compiled kernel;
    candidates that leave an element unwritten or compute 1% off are failed with reasons."""
    from tilefuse.tune.measure import measure

    k = replace(fx.rmsnorm_kernel(100, 8, "bf16"), family="interp-cpu")  # 40 candidates
    with WorkerPool([None], timeout=30, preload=("tune_fakes",)) as pool:
        opts = dict(exhaustive=True, device="cpu", rep_ms=2.0, confirm_rep_ms=4.0)
        r = tuner(cache, fn=measure, pool=pool, **opts).tune({"k": k})[0]
    assert r.status == "tuned" and r.knobs["group"] != 2 and r.knobs["stage"] != "stream"
    reasons = {(f["knobs"]["group"] == 2, f["knobs"]["stage"] == "stream"): f["reason"] for f in r.failures}
    assert "differs between two launches" in reasons[(True, False)]
    assert "wrong result" in reasons[(False, True)] and "2x the interpreter" in reasons[(False, True)]
    assert r.evaluated - r.failed > 0 and r.best_us > 0


def test_a_kernel_whose_every_candidate_fails_gives_up_early(cache):
    def broken(job):
        raise RuntimeError("triton is not installed")

    r = tuner(cache, fn=broken, budget=40).tune({"k": fx.softmax_kernel(300, 2048, "bf16")})[0]
    assert r.status == "failed" and "triton is not installed" in r.note and r.evaluated == 8


# ---------------------------------------------------------------- reading the cache


@pytest.fixture
def on_h100(monkeypatch):
    monkeypatch.setattr(tdevice, "cuda_device", lambda index=0: H100)


def _store(cache, kernel, knobs):
    from tilefuse.tune.cache import Entry

    cache.put(Entry(key_for(kernel, H100, MR), knobs, {"median_us": 5.0, "default_us": 6.0}))


TUNED = {"threads": 128, "group": 128, "vector": 8, "cluster": 1, "stage": "regs", "unroll": 4, "min_blocks": 8}


def tuned_knobs():
    return {**MR.knobs(MapReduceSchedule()), **TUNED}


def test_choose_returns_tuned_knobs_on_the_gpu_they_were_tuned_on(cache, on_h100, monkeypatch):
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    assert not lookup.choose(k, "sm_90a").tuned
    _store(cache, k, tuned_knobs())
    c = lookup.choose(k, "sm_90a")
    assert c.tuned and c.schedule == MapReduceSchedule(**tuned_knobs()) and "cache hit" in c.note
    assert lookup.tuned_schedule(k, None, torch.device("cuda", 0)) == c.schedule
    renamed = replace(canonicalize(k, rename_buffers=True), name="elsewhere")
    assert lookup.choose(renamed, "sm_90a").schedule == c.schedule
    other = lookup.choose(k, "sm_80")
    assert not other.tuned and "building for sm_80" in other.note
    monkeypatch.setenv("TILEFUSE_TUNED", "0")
    assert not lookup.choose(k, "sm_90a").tuned and lookup.tuned_schedule(k, None, torch.device("cuda")) is None


def test_knobs_that_no_longer_render_fall_back_to_the_default(cache, on_h100):
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    _store(cache, k, {**tuned_knobs(), "stage": "smem", "vector": 4})  # smem copies 16-byte chunks: 8 bytes fail
    c = lookup.choose(k, "sm_90a")
    assert not c.tuned and "no longer valid" in c.note and c.schedule == default_schedule(k, "sm_90a")


def test_without_a_gpu_the_default_says_why(cache):
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    c = lookup.choose(k, "sm_90a")
    assert not c.tuned and "no GPU" in c.note and c.schedule == default_schedule(k, "sm_90a")


def test_a_miss_on_the_gpu_says_it_is_not_tuned_yet(cache, on_h100):
    c = lookup.choose(fx.rmsnorm_kernel(64, 1024, "bf16"), "sm_90a")
    assert not c.tuned and "not tuned for NVIDIA H100 80GB HBM3; `tilefuse tune` measures it" in c.note


EXPR = "torch.nn.RMSNorm(1024)(torch.randn(64, 1024))"


@pytest.fixture(scope="module")
def stages():
    m, inputs, _ = parse(EXPR)
    return compile_stages(m, inputs, expr=EXPR, arch="sm_90a")


def test_compiled_programs_build_kernels_with_tuned_knobs(cache, on_h100, monkeypatch, stages):
    (lowered,) = stages.kernels.values()
    _store(cache, lowered.kernel, tuned_knobs())
    seen = []
    import tilefuse.runtime.launch as launch

    monkeypatch.setattr(launch, "compile_kernel", lambda kernel, arch=None, schedule=None: seen.append(schedule))
    stages.program.compiled(lowered, torch.device("cuda", 0))
    assert seen == [MapReduceSchedule(**tuned_knobs())]


def test_ir_schedule_says_where_the_knobs_came_from(cache, on_h100, capsys, stages):
    (lowered,) = stages.kernels.values()
    _store(cache, lowered.kernel, tuned_knobs())
    assert main(["compile", "-c", EXPR, "--ir", "schedule", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert f"{lowered.kernel.name}: {MapReduceSchedule(**tuned_knobs())}  (source: tuned (cache hit: 5.0 us" in out


# ---------------------------------------------------------------- the command


def test_tune_without_a_gpu_is_one_error_line(capfd):
    rc = main(["tune", "-c", EXPR])
    out, err = capfd.readouterr()
    assert rc == 1 and out == ""
    assert err.strip().splitlines() == ["tilefuse: error: tune measures kernels on a GPU, and none is visible "
                                        "(torch.cuda.is_available() is False)"]


def test_tune_command_tunes_every_kernel_then_hits_the_cache(cache, on_h100, monkeypatch, capsys):
    monkeypatch.setattr(command, "check_gpus", lambda n: [H100] * n)
    monkeypatch.setattr(command, "MEASURE", fake_measure)
    monkeypatch.setattr(command, "POOL", InlinePool)
    monkeypatch.setattr(command, "JOBS", 0)  # the fake measures nothing a compiler could prepare
    expr = "torch.softmax(torch.randn(32, 512), -1) + torch.nn.RMSNorm(512)(torch.randn(32, 512))"
    assert main(["tune", "-c", expr, "--budget", "6", "--threshold", "4"]) == 0
    out = capsys.readouterr().out
    assert "tilefuse tune on NVIDIA H100" in out and out.count("tuned") >= 2
    n = len(CALLS)
    assert main(["tune", "-c", expr]) == 0
    assert len(CALLS) == n and capsys.readouterr().out.count("cached") >= 2


def test_confirmation_interleaves_rounds_so_clock_drift_does_not_pick(cache):
    """The finalists are re-timed in `confirm_rounds` rounds, each in a rotated order, and each
    keeps its fastest median: under a GPU whose clock falls with every kernel it runs (a drift
    of 3% per timing here), the truly fastest finalist still wins although timing it last in a
    single round would have made it look slowest."""
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    calls = []

    def drifting(job):
        calls.append(dict(job.knobs))
        return Measurement(fake_time(job.knobs) * (1 + 0.03 * len(calls)), {"reps": 1})

    r = tuner(cache, fn=drifting, budget=6, confirm=3, confirm_rounds=3).tune({"k": k})[0]
    search, confirm = calls[:6], calls[6:]
    finalists = confirm[:len(confirm) // 3]
    assert len(confirm) == 3 * len(finalists) >= 3
    for rnd in range(3):  # round rnd starts at finalist rnd (a rotation)
        shift = rnd % len(finalists)
        assert confirm[rnd * len(finalists):(rnd + 1) * len(finalists)] == finalists[shift:] + finalists[:shift]
    # the truly fastest, whatever the drift (knobs fake_time ignores, e.g. pipeline, make ties)
    assert fake_time(r.knobs) == min(fake_time(f) for f in finalists)


def test_one_lucky_confirmation_round_does_not_make_a_pick(cache):
    """A finalist that beats the default in one confirmation round and loses in the others (as
    a GPU whose clocks recover for one timing shows it) is scored by its median ratio to the
    default in the same rounds: the default stays. The minimum of medians would have picked it."""
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    space = MR.space(k, "sm_90a")
    default = space.as_dict(space.default)
    seen: dict = {}

    def lucky(job):
        key = tuple(sorted(job.knobs.items()))
        seen[key] = seen.get(key, 0) + 1
        base = fake_time(default)
        if job.knobs == default:
            return Measurement(base, {"reps": 1})
        return Measurement((0.8 if seen[key] == 2 else 1.1) * base, {"reps": 1})  # 2nd: its first re-timing

    r = tuner(cache, fn=lucky, budget=6, confirm=2, confirm_rounds=3, min_gain=0.01).tune({"k": k})[0]
    assert r.knobs == default


def test_a_pick_within_min_gain_of_the_default_keeps_the_default(cache):
    """A finalist faster than the default by less than `min_gain` (here 1000x the spread of the
    fake timings) is noise as far as the tuner knows: the heuristic default stays the pick, and
    with min_gain 0 the fastest finalist wins as before."""
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    keep = tuner(cache, budget=6, min_gain=0.99).tune({"k": k})[0]
    space = MR.space(k, "sm_90a")
    assert keep.knobs == space.as_dict(space.default)
    CALLS.clear()
    r = tuner(TuneCache(cache.path.parent / "other.sqlite"), budget=6, min_gain=0.0).tune({"k": k})[0]
    assert r.knobs == min(CALLS[:6], key=fake_time)


def test_the_results_table_reads_in_an_80_column_pipe():
    """The last table names only the knobs the tuner changed: with all 11 of a map-reduce
    schedule's in a column, an 80-column pipe (tune under a CI log) wrapped them a word a line
    and cut every name."""
    import io

    from rich.console import Console

    from tilefuse.tune.tuner import KernelResult

    default = {"stage": "regs", "vector": 8, "threads": 256, "group": 4, "cluster": 1, "min_blocks": 3, "unroll": 4,
               "batch": 1, "pipeline": False, "l2_hints": False, "two_pass": False}
    tuned = dict(default, stage="smem", threads=128, group=8, min_blocks=16)
    results = [KernelResult("tf_k0_view", None, "tuned", tuned, default, 33.2, 36.8, 48, 0, wall_s=20.0),
               KernelResult("tf_k1_add", None, "tuned", dict(default), default, 47.0, 47.0, 40, 0, wall_s=9.0)]
    out = io.StringIO()
    Console(file=out, width=80).print(command.results_table(results, "tilefuse tune on a GPU"))
    text = out.getvalue()
    flat = " ".join(text.split())  # (a line longer than the console wraps, whole words kept)
    assert "tf_k0_view: stage=smem threads=128 group=8 min_blocks=16 (48 tried, 0 failed, 20.0 s)" in flat, text
    assert "tf_k1_add: (the default)" in flat and "vector=" not in text, text
    row = next(line for line in text.splitlines() if "tf_k0_view" in line and "│" in line)
    assert "36.8" in row and "33.2" in row and "1.11x" in row, text

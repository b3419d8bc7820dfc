"""The benchmark worker survives every way a candidate can go wrong, and says which.

A fake benchmark function stands in for the GPU: it returns, raises, raises a sticky
("fatal") error, exits the process, dies of SIGSEGV, or sleeps past the watchdog. Each bad
job becomes a failed Outcome with its reason; the next job on the same Worker succeeds
(in a respawned process where the old one is gone). A pool of two runs jobs at once.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tilefuse.tune.worker import Fatal, Worker, WorkerPool


def fake_bench(job):
    kind, arg = job
    if kind == "ok":
        return {"pid": os.getpid(), "value": arg * 2}
    if kind == "raise":
        raise ValueError(f"bad knob {arg}")
    if kind == "cuda":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if kind == "fatal":
        raise Fatal("context is gone")
    if kind == "exit":
        os._exit(arg)
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(5)
    if kind == "sleep":
        time.sleep(arg)
        return "woke"
    raise AssertionError(kind)


@pytest.fixture
def worker():
    w = Worker(timeout=5.0)
    yield w
    w.close()


def test_a_good_job_returns_its_value_from_another_process(worker):
    out = worker.run(fake_bench, ("ok", 21))
    assert out.ok and out.value["value"] == 42
    assert out.value["pid"] != os.getpid() and out.value["pid"] == worker.pid


def test_an_exception_fails_the_job_and_keeps_the_process(worker):
    pid = worker.run(fake_bench, ("ok", 1)).value["pid"]
    out = worker.run(fake_bench, ("raise", 7))
    assert not out.ok and out.reason == "ValueError: bad knob 7"
    again = worker.run(fake_bench, ("ok", 2))
    assert again.ok and again.value["pid"] == pid and worker.restarts == 0


def test_sticky_errors_and_crashes_fail_the_job_with_a_reason_and_the_next_job_runs_in_a_new_process(worker):
    """A CUDA-style sticky error or Fatal: reported, then the process is replaced; exit and SIGSEGV:
    the reason names the exit status."""
    pid = worker.run(fake_bench, ("ok", 1)).value["pid"]
    cases = [(("cuda", None), "illegal memory access"), (("fatal", None), "context is gone"),
             (("exit", 7), "died (exit code 7)"), (("segv", None), "died (killed by SIGSEGV)")]
    for n, (job, reason) in enumerate(cases, 1):
        out = worker.run(fake_bench, job)
        assert not out.ok and reason in out.reason, (job, out.reason)
        again = worker.run(fake_bench, ("ok", n))
        assert again.ok and again.value["pid"] != pid and worker.restarts == n
        pid = again.value["pid"]


def test_a_hang_is_killed_by_the_watchdog_and_the_next_job_runs(worker):
    pid = worker.run(fake_bench, ("ok", 1)).value["pid"]
    t0 = time.perf_counter()
    out = worker.run(fake_bench, ("sleep", 60), timeout=0.5)
    assert time.perf_counter() - t0 < 5
    assert not out.ok and "timed out after 0.5 s" in out.reason
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung child is gone
    again = worker.run(fake_bench, ("ok", 5))
    assert again.ok and again.value["pid"] != pid


def test_a_pool_runs_jobs_concurrently_on_separate_workers():
    with WorkerPool([None, None], timeout=10.0) as pool:
        for f in [pool.submit(fake_bench, ("ok", 0)) for _ in range(2)]:
            f.result()  # both started
        t0 = time.perf_counter()
        futs = [pool.submit(fake_bench, ("sleep", 0.4)) for _ in range(2)]
        outs = [f.result() for f in futs]
        assert all(o.ok and o.value == "woke" for o in outs)
        assert time.perf_counter() - t0 < 0.78  # two 0.4 s sleeps overlapped
        bad = [pool.submit(fake_bench, ("segv", None)), pool.submit(fake_bench, ("ok", 9))]
        assert [o.ok for o in (f.result() for f in bad)] == [False, True]


def test_each_gpu_worker_sees_only_its_gpu():
    w = Worker(gpu=3, timeout=5.0)
    try:
        out = w.run(_visible, None)
        assert out.ok and out.value == "3"
    finally:
        w.close()


def _visible(_):
    return os.environ.get("CUDA_VISIBLE_DEVICES")

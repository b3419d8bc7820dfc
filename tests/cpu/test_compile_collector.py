"""A compile runs with Python's cyclic garbage collector paused (tilefuse.collector): the full
collections a compile's many small objects set off walked every object of the process, a
model's included. The pause must end with the compile, whatever happens in it, must not turn
on a collector the caller had turned off, and must not turn it on under another thread's
hold (a CUDA-graph capture holds it off so that no finalizer runs inside the capture)."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from tilefuse import collector
from tilefuse.compiler import compile_stages
from tilefuse.frontend.capture import CaptureError


@pytest.fixture
def collector_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def _softmax(x):
    seen.append(gc.isenabled())  # (called by the export inside the compile)
    return torch.softmax(x, -1)


seen: list = []


def test_the_collector_is_off_during_a_compile_and_on_after_it(collector_state):
    gc.enable()
    seen.clear()
    compile_stages(_softmax, [torch.randn(4, 8)])
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_compile_that_fails_turns_the_collector_back_on(collector_state):
    gc.enable()
    seen.clear()

    def bad(x):
        seen.append(gc.isenabled())
        raise RuntimeError("the program itself fails")

    with pytest.raises(CaptureError, match="the program itself fails"):
        compile_stages(bad, [torch.randn(4, 4)])
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_state):
    gc.disable()
    compile_stages(_softmax, [torch.randn(4, 8)])
    assert not gc.isenabled()


def test_a_hold_ending_on_one_thread_leaves_the_collector_off_under_another_threads(collector_state):
    """Thread B holds the collector off (as a capture does) across the end of a compile on
    this thread: it stays off until B's hold ends too, then comes back on."""
    gc.enable()
    held, release, states = threading.Event(), threading.Event(), []

    def other():
        with collector.paused():
            held.set()
            release.wait(30)
            states.append(gc.isenabled())

    t = threading.Thread(target=other)
    with collector.paused():
        t.start()
        assert held.wait(30)
    compile_stages(_softmax, [torch.randn(4, 8)])  # a whole compile inside B's hold
    states.append(gc.isenabled())
    release.set()
    t.join(30)
    assert states == [False, False]
    assert gc.isenabled()

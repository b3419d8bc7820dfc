"""A compile runs with Python's cyclic garbage collector paused (compiler._collector_paused):
the full collections a compile's many small objects set off walked every object of the
process, a model's included. The pause must end with the compile, whatever happens in it,
and must not turn on a collector the caller had turned off."""
from __future__ import annotations

import gc

import pytest
import torch

from tilefuse.compiler import compile_stages
from tilefuse.frontend.capture import CaptureError


@pytest.fixture
def collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def _softmax(x):
    seen.append(gc.isenabled())  # (called by the export inside the compile)
    return torch.softmax(x, -1)


seen: list = []


def test_the_collector_is_off_during_a_compile_and_on_after_it(collector):
    gc.enable()
    seen.clear()
    compile_stages(_softmax, [torch.randn(4, 8)])
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_compile_that_fails_turns_the_collector_back_on(collector):
    gc.enable()
    seen.clear()

    def bad(x):
        seen.append(gc.isenabled())
        raise RuntimeError("the program itself fails")

    with pytest.raises(CaptureError, match="the program itself fails"):
        compile_stages(bad, [torch.randn(4, 4)])
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector):
    gc.disable()
    compile_stages(_softmax, [torch.randn(4, 8)])
    assert not gc.isenabled()

"""Fixtures shared by the CPU tests.

Hypothesis draws new examples on every run. CI (`.ci/run` sets HYPOTHESIS_PROFILE=ci) draws
the same ones every time, so a landing is never turned back by an example no change made
reachable; local runs keep exploring and are where such examples are found (and fixed, as
the shifted cross-entropy's all-ignored batch was in session 7).
"""
import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def fresh_backend():
    """The "tilefuse" torch.compile backend registered, with dynamo's and its own state empty
    before and dynamo's after: each test compiles from scratch."""
    from tilefuse.frontend import backend as tb

    tb.register()
    torch._dynamo.reset()
    tb.reset()
    yield
    torch._dynamo.reset()

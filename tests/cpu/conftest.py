"""Fixtures shared by the CPU tests."""
import pytest
import torch


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

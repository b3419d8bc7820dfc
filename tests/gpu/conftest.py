"""GPU tests (marked `gpu`) are skipped, not failed, on a machine without a CUDA device."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class Runners(list):
    """Each dynamo graph's GraphRunner, in the order dynamo compiled them:
    `torch.compile(fn, backend=runners.backend)` compiles with tilefuse and keeps them."""

    def backend(self, gm, example_inputs, **kw):
        from tilefuse.frontend import backend as tb

        self.append(tb.tilefuse_backend(gm, example_inputs, **kw))
        return self[-1]


@pytest.fixture
def runners() -> Runners:
    return Runners()

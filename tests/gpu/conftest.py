"""GPU tests (marked `gpu`) are skipped, not failed, on a machine without a CUDA device."""
import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (`-n 8`) each worker takes its share of the cores for torch's CPU
    threads: eight workers of 16 threads each on 16 cores made a test of 200 small calls take
    200 s instead of 2 (oversubscribed threads, most likely OpenMP's spinning against each other)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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

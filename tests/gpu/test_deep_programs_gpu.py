"""Programs deeper than Python's recursion limit, on the GPU: their generated kernels compile
(NVRTC) and compute what a float64 reference does within the 2x rule. A chain of 1200 maps
ending in a softmax is split before the softmax's passes (RECOMPUTE_LIMIT); a chain after a
matmul fills the epilogue up to MAX_EPILOGUE and runs on in a map-reduce kernel."""
import sys

import pytest
import torch

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.graph.contraction import MAX_EPILOGUE
from tilefuse.graph.fusion import RECOMPUTE_LIMIT

pytestmark = pytest.mark.gpu

STEPS = sys.getrecursionlimit() // 2 + 100  # two maps a step: deeper than the recursion limit


def _chain_then_softmax(x):
    for _ in range(STEPS):
        x = x * 0.999 + 0.001
    return torch.softmax(x, -1)


def _matmul_then_chain(x, w):
    y = x @ w
    for _ in range(STEPS):
        y = y * 0.999 + 0.001
    return y


def _check(fn, c, *inputs):
    """The compiled program on these (fresh) inputs against the float64 reference, 2x rule."""
    out = c(*inputs)
    torch.cuda.synchronize()
    check = compare("out", out, float64_reference(fn, inputs), fn(*inputs))
    assert check.ok, check


def test_a_map_chain_deeper_than_the_recursion_limit_then_a_softmax_on_the_gpu():
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    c = tilefuse.compile(_chain_then_softmax, (x,))
    kernels = [s for s in c.stages.plan.steps if s.family == "mapreduce"]
    assert len(kernels) == 2 and all(s.recomputed <= RECOMPUTE_LIMIT for s in kernels)
    _check(_chain_then_softmax, c, torch.randn_like(x))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the sm_90a GEMM template")
def test_a_map_chain_deeper_than_the_recursion_limit_after_a_matmul_on_the_gpu():
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(128, 192, device="cuda") / 11).bfloat16()
    c = tilefuse.compile(_matmul_then_chain, (x, w))
    assert [s.family for s in c.stages.plan.steps] == ["gemm", "mapreduce"]
    assert [len(lg.spec.maps) for lg in c.stages.gemms.values()] == [MAX_EPILOGUE]
    _check(_matmul_then_chain, c, torch.randn_like(x), w)


def _diamond_then(last):
    def f(x):
        for _ in range(40):
            x = x + 0.1 * torch.sin(x * x)  # 3^40 paths from the result to x; the rows stay apart
        return last(x)
    return f


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_a_row_kernel_below_maps_reading_one_tensor_twice_on_the_gpu(name):
    """The online log-sum-exp and centred-squares kernels below `x + 0.1 sin(x * x)` forty deep
    (their patterns once walked every path): built by NVRTC and within the 2x rule."""
    last = (lambda x: torch.softmax(x, -1)) if name == "softmax" else (lambda x: torch.nn.functional.layer_norm(x, (1000,)))
    fn = _diamond_then(last)
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    c = tilefuse.compile(fn, (x,))
    assert [s.family for s in c.stages.plan.steps] == ["mapreduce"]
    _check(fn, c, torch.randn_like(x))

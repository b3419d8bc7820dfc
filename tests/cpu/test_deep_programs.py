"""Programs whose chains of dependent ops run deeper than Python's recursion limit compile and
compute what PyTorch does; and a chain of row reductions is split before one kernel's passes
would compute a quadratic number of maps per element.

The passes walk dependency chains (row views' hoisting, residual chains, Loop IR emission, the
plan's step order); each walks with its own stack, so a program of a thousand elementwise
steps in a Python loop, or of a thousand kernels in a row, is no longer refused.
"""
from __future__ import annotations

import sys

import torch

import tilefuse
from tilefuse.frontend.builder import Builder
from tilefuse.graph import ir
from tilefuse.graph.fusion import RECOMPUTE_LIMIT, plan

from test_fusion import check_invariants


def test_a_map_chain_longer_than_the_recursion_limit_is_one_kernel_equal_to_eager():
    steps = sys.getrecursionlimit() // 2 + 100  # two maps a step: 1200 maps in a row at the default 1000

    def f(x):
        for _ in range(steps):
            x = x * 0.999 + 0.001
        return x

    x = torch.randn(3, 40)
    c = tilefuse.compile(f, (x,))
    assert [s.family for s in c.stages.plan.steps] == ["mapreduce"]
    torch.testing.assert_close(c(x), f(x), rtol=1e-5, atol=1e-6)


def test_a_plan_of_more_steps_in_a_chain_than_the_recursion_limit_is_ordered():
    """Each sum over rows (axis 0) is an extern and each add of it a kernel that cannot join the
    kernel before it (that would read its own output): 2 steps a link, 1200 links deep."""
    b = Builder()
    x = b.add(ir.Input("x", ir.TensorType((4, 8), "f32")))
    links = sys.getrecursionlimit() + 200
    for _ in range(links):
        x = b.map("add", x, b.reduce("sum", x, (0,), True))
    g = ir.Graph(tuple(b.nodes), ("x",), (x,), {})
    p = plan(g)
    assert len(p.steps) == 2 * links
    check_invariants(g, p)


def _softmaxes(k):
    def f(x):
        for _ in range(k):
            x = torch.softmax(x * 2, -1)
        return x
    return f


def test_two_softmaxes_stay_one_kernel():
    x = torch.randn(5, 33)
    c = tilefuse.compile(_softmaxes(2), (x,))
    assert [s.family for s in c.stages.plan.steps] == ["mapreduce"]
    torch.testing.assert_close(c(x), _softmaxes(2)(x))


def test_a_chain_of_softmaxes_is_split_before_its_passes_recompute_too_much():
    """Each softmax's passes compute its argument again from the row's loads: 12 in one kernel
    would be ~700 maps per element. Split, every kernel keeps within RECOMPUTE_LIMIT."""
    x = torch.randn(5, 33)
    c = tilefuse.compile(_softmaxes(12), (x,))
    kernels = [s for s in c.stages.plan.steps if s.family == "mapreduce"]
    assert 1 < len(kernels) < 12
    assert all(0 < s.recomputed <= RECOMPUTE_LIMIT for s in kernels)
    torch.testing.assert_close(c(x), _softmaxes(12)(x))


def test_a_long_chain_after_a_matmul_fills_the_epilogue_up_to_its_limit_and_runs_on_in_a_kernel():
    """200 maps after x @ w: the GEMM's epilogue takes MAX_EPILOGUE of them (each is unrolled
    over the tile's fragments) and a map-reduce kernel the rest. The result keeps the 2x rule:
    within twice eager bf16's distance from float32."""
    from tilefuse.compiler import compile_stages
    from tilefuse.graph.contraction import MAX_EPILOGUE

    def f(x, w):
        y = x @ w
        for _ in range(100):
            y = y * 0.999 + 0.001
        return y

    torch.manual_seed(0)
    x, w = torch.randn(64, 32).bfloat16(), (torch.randn(32, 48) / 6).bfloat16()
    c = compile_stages(f, (x, w), arch="sm_90a")
    assert [s.family for s in c.plan.steps] == ["gemm", "mapreduce"]
    assert [len(lg.spec.maps) for lg in c.gemms.values()] == [MAX_EPILOGUE]
    ref = f(x.double(), w.double())
    err = (c.program(x, w).double() - ref).abs().max()
    assert err <= 2 * (f(x, w).double() - ref).abs().max()

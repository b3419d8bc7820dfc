"""Programs whose chains of dependent ops run deeper than Python's recursion limit compile and
compute what PyTorch does; and a chain of row reductions is split before one kernel's passes
would compute a quadratic number of maps per element (beyond RECOMPUTE_LIMIT).

The passes walk dependency chains (row views' hoisting, residual chains, Loop IR emission, the
plan's step order); each walks with its own stack, so a program of a thousand elementwise
steps in a Python loop, or of a thousand kernels in a row, is no longer refused.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.frontend.builder import Builder
from tilefuse.graph import ir
from tilefuse.graph.fusion import RECOMPUTE_LIMIT, plan
from tilefuse.runtime.launch import compile_source_only

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


def test_a_plan_whose_first_kernel_waits_on_a_chain_deeper_than_the_recursion_limit_is_ordered():
    """The row kernel opened by the first node takes, as a sibling, the sum at the end of a chain
    of 1200 matmuls (externs here): the plan's order must put the whole chain before it, a walk
    as deep as the chain (the recursive one ran out of stack)."""
    b = Builder()
    x = b.add(ir.Input("x", ir.TensorType((4, 8), "f32")))
    w = b.add(ir.Input("w", ir.TensorType((8, 8), "f32")))
    a = b.reduce("sum", x, (-1,), True)
    y = x
    for _ in range(sys.getrecursionlimit() + 200):
        y = b.add(ir.Contraction(b.fresh("mm"), ir.TensorType((4, 8), "f32"), y, w))
    z = b.reduce("sum", y, (-1,), True)
    g = ir.Graph(tuple(b.nodes), ("x", "w"), (a, z), {})
    p = plan(g, gemm=False)
    assert p.steps[-1].nodes == [a, z]  # the first kernel, run last
    check_invariants(g, p)


def _softmaxes(k):
    def f(x):
        for _ in range(k):
            x = torch.softmax(x * 2, -1)
        return x
    return f


def test_one_reduction_after_a_long_chain_stays_in_its_kernel():
    """A kernel's first pass over its rows computes its maps once: 200 maps and a sum are one
    kernel (split, the chain's result would be written and read back for nothing)."""
    def f(x):
        for _ in range(100):
            x = x * 0.999 + 0.001
        return x.sum(-1)

    x = torch.randn(3, 40)
    c = tilefuse.compile(f, (x,))
    assert [(s.family, s.recomputed) for s in c.stages.plan.steps] == [("mapreduce", 0)]
    torch.testing.assert_close(c(x), f(x))


def test_two_softmaxes_stay_one_kernel():
    x = torch.randn(5, 33)
    c = tilefuse.compile(_softmaxes(2), (x,))
    assert [s.family for s in c.stages.plan.steps] == ["mapreduce"]
    torch.testing.assert_close(c(x), _softmaxes(2)(x))


def test_a_chain_of_softmaxes_is_split_before_its_passes_recompute_too_much():
    """Each softmax's passes compute its argument again from the row's loads: 24 in one kernel
    would recompute ~3500 maps per element. Split, every kernel keeps within RECOMPUTE_LIMIT."""
    x = torch.randn(5, 33)
    c = tilefuse.compile(_softmaxes(24), (x,))
    kernels = [s for s in c.stages.plan.steps if s.family == "mapreduce"]
    assert 1 < len(kernels) < 24
    assert all(s.recomputed <= RECOMPUTE_LIMIT for s in kernels)
    assert sum(s.recomputed for s in kernels) > 0
    torch.testing.assert_close(c(x), _softmaxes(24)(x))


def test_twelve_softmaxes_stay_one_kernel():
    """Below the limit nothing is split: splitting was measured as often slower as faster."""
    c = tilefuse.compile(_softmaxes(12), (torch.randn(5, 33),))
    assert [s.family for s in c.stages.plan.steps] == ["mapreduce"]


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


def test_a_map_chain_deeper_than_the_recursion_limit_then_a_softmax_is_two_kernels_equal_to_eager():
    """The reduction rules (apart_reductions' layout walk) follow the chain above the softmax
    with a stack of their own; it is split before the softmax (RECOMPUTE_LIMIT)."""
    steps = sys.getrecursionlimit() // 2 + 100

    def f(x):
        for _ in range(steps):
            x = x * 0.999 + 0.001
        return torch.softmax(x, -1)

    x = torch.randn(5, 40)
    c = tilefuse.compile(f, (x,))
    assert [s.family for s in c.stages.plan.steps] == ["mapreduce", "mapreduce"]
    torch.testing.assert_close(c(x), f(x), rtol=1e-5, atol=1e-6)


def test_maps_reading_one_tensor_twice_sixty_deep_compile_in_a_walk_of_their_size():
    """`x * x` sixty times over: 2^60 paths from the sum to x. The rules that ask what a tensor
    is made of (its layout, whether maps of the program's tensors, whether a GEMM's output) visit
    each node once; a walk of every path never ended."""
    def f(x):
        for _ in range(60):
            x = torch.tanh(x * x)
        return x.reshape(6, 10).sum(-1), x.sum(0)

    x = torch.randn(3, 20)
    c = tilefuse.compile(f, (x,))
    for got, want in zip(c(x), f(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _deep(x):
    for _ in range(sys.getrecursionlimit() // 2 + 100):
        x = x * 0.999 + 0.001
    return x


@pytest.mark.parametrize("name, fn, shapes", [
    ("slice", lambda x: _deep(x)[:, :24] * x[:, 24:], [(6, 48)]),
    ("row gather", lambda x, i: _deep(x)[i].sum(-1), [(12, 32), "index"]),
    ("leading reshape", lambda x: torch.softmax(_deep(x).reshape(2, 3, 40), -1), [(6, 40)]),
])
def test_a_view_below_a_chain_deeper_than_the_recursion_limit_compiles_equal_to_eager(name, fn, shapes):
    """The rules that move a slice, a row gather or a leading reshape up through the maps above
    it walk without recursion and stop after MAX_PASSES maps (one map a pass: a chain of
    thousands took minutes, or ran out of stack); what they leave computes the same function."""
    inputs = tuple(torch.randint(0, 12, (7,)) if s == "index" else torch.randn(*s) for s in shapes)
    c = tilefuse.compile(fn, inputs)
    torch.testing.assert_close(c(*inputs), fn(*inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, last", [
    ("softmax", lambda x: torch.softmax(x, -1)),  # codegen.patterns.online_lse: same_value, _depends_on
    ("layer_norm", lambda x: F.layer_norm(x, (64,))),  # codegen.patterns.centred_squares
])
def test_a_row_kernel_below_maps_reading_one_tensor_twice_renders_and_builds_without_spills(name, last):
    """The CUDA patterns (an online log-sum-exp, centred squares) compare and search a row's
    values through their arguments; below `tanh(x * x)` forty deep (2^40 paths) they visit each
    value once, where they walked every path (the render never ended), and the kernel builds."""
    def f(x):
        for _ in range(40):
            x = torch.tanh(x * x)
        return last(x)

    p = tilefuse.compile(f, (torch.randn(8, 64, dtype=torch.bfloat16),))
    steps = [s for s in p.stages.plan.steps if s.family == "mapreduce"]
    assert steps
    for s in steps:
        src, cubin = compile_source_only(p.kernels[s.name].kernel, "sm_90a")
        assert cubin.info.clean, f"{s.name}: {cubin.info}"

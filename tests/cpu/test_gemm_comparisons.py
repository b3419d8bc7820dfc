"""Comparisons in a GEMM's epilogue: leaky ReLU, ELU, softplus (its threshold) and `where(y > 0,
...)` after a matmul read a bool the epilogue computes and never writes. They were a GEMM that
wrote its result and a map kernel that read it back (the epilogue took float maps alone). The
epilogue's Loop IR runs through the interpreter here (the product by torch), and the kernels
build for sm_90a and sm_80 with no spills."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.runtime import nvrtc

ACTS = {
    "leaky_relu": lambda y: F.leaky_relu(y, 0.1),
    "elu": F.elu,
    "softplus": lambda y: F.softplus(y, 2.0, 3.0),
    "where": lambda y: torch.where(y > 0.5, y * 2, -y),
    "selu": F.selu,
    "hardshrink": F.hardshrink,  # (a band: two comparisons and an `and`)
}


def _families(p):
    return [s.family for s in p.plan.steps if s.family != "alias" and not s.view]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(ACTS))
def test_an_activation_with_a_comparison_runs_in_the_epilogue(name, dtype):
    act = ACTS[name]
    x, w, b = torch.randn(96, 256, dtype=dtype), torch.randn(160, 256, dtype=dtype) * 0.1, torch.randn(160, dtype=dtype)
    fn = lambda x, w, b: act(F.linear(x, w, b))  # noqa: E731
    p = tilefuse.compile(fn, (x, w, b))
    assert _families(p) == ["gemm"], str(p.plan)
    # (the epilogue compares the f32 accumulator, eager its 16-bit rounding: the float64
    # reference decides, as the project's rule does)
    ref = act(F.linear(x.double(), w.double(), b.double()))
    err, eager_err = (p(x, w, b).double() - ref).abs().max(), (fn(x, w, b).double() - ref).abs().max()
    assert err <= 2 * eager_err + 1e-6, (err, eager_err)


def test_a_compared_result_that_is_returned_stays_out_of_the_epilogue():
    """`y > 0` as an output: a bool the epilogue would have to write; the GEMM writes y and a map
    kernel compares (as before)."""
    x, w = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(96, 128, dtype=torch.bfloat16)
    fn = lambda x, w: (x @ w.t()) > 0  # noqa: E731
    p = tilefuse.compile(fn, (x, w))
    assert _families(p) == ["gemm", "mapreduce"], str(p.plan)
    assert (p(x, w) == fn(x, w)).float().mean() > 0.99


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "gemv"])
@pytest.mark.parametrize("name", ["leaky_relu", "softplus", "hardshrink"])
def test_epilogues_with_comparisons_build_without_spills(name, arch):
    """The tiled GEMM for sm_90a and sm_80, and the matrix-vector kernel a decode step's
    projections run (sm_90a)."""
    from tilefuse.codegen import gemm_sm80, gemm_sm90, gemv

    act = ACTS[name]
    x, w = torch.randn(512, 1024, dtype=torch.bfloat16), torch.randn(768, 1024, dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x, w: act(x @ w.t()), (x, w))
    (lg,) = p.gemms.values()
    problem = lg.problem()
    assert ": bool" in str(problem.epilogue), str(problem.epilogue)  # (the comparison, inside)
    if arch == "sm_90a":
        src = gemm_sm90.render(problem, gemm_sm90.default_schedule(problem))
    elif arch == "sm_80":
        src = gemm_sm80.render(problem, gemm_sm80.default_schedule(problem))
    else:
        x = x[:4]
        (lg,) = tilefuse.compile(lambda x, w: act(x @ w.t()), (x, w)).gemms.values()
        problem = lg.problem()
        src, arch = gemv.render(problem, gemv.default_schedule(problem)), "sm_90a"
    cubin = nvrtc.compile_cuda(src.source, src.name, arch)
    assert cubin.info.clean, cubin.info


@pytest.mark.parametrize("act", ["gelu", "where"])
def test_the_epilogue_writes_16_bits_where_only_kernels_widen_them(act):
    """softmax(act(x @ w.T)) in bf16: the softmax's f32 cast is read only by its kernel, so the
    epilogue stops before it and writes bf16 (it wrote the f32 cast: twice the bytes both ways;
    with comparisons in epilogues the `where` form newly reached that cast)."""
    f = {"gelu": F.gelu, "where": lambda y: torch.where(y > 0, y, -y)}[act]
    x, w = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 512, dtype=torch.bfloat16) * 0.05
    fn = lambda x, w: torch.softmax(f(x @ w.t()), -1)  # noqa: E731
    p = tilefuse.compile(fn, (x, w))
    (gemm,) = [s for s in p.plan.steps if s.family == "gemm"]
    assert [p.graph[o].type.dtype for o in gemm.outputs] == ["bf16"], str(p.plan)
    torch.testing.assert_close(p(x, w).float(), fn(x, w).float(), rtol=2e-2, atol=1e-3)


def test_a_widening_cast_that_is_returned_is_still_written_by_the_epilogue():
    x, w = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(96, 128, dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x, w: F.gelu(x @ w.t()).float(), (x, w))
    assert [s.family for s in p.plan.steps if s.family != "alias" and not s.view] == ["gemm"], str(p.plan)


MASKS = {
    "(y > 0).float()": lambda y: (y > 0).float(),
    "(y > 0).half() * 2 + y": lambda y: (y > 0).to(y.dtype) * 2 + y,
    "y.bool().float() * 3": lambda y: y.bool().float() * 3,
    "any(y, dim=-2)": lambda y: torch.any(y, dim=-2),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_a_comparison_cast_back_to_a_number_in_the_epilogue(name):
    """A truth value the epilogue makes, cast to a number (a mask as floats): the cast is a
    conversion of the bool, not the pass-through a float-to-float cast is there. It was dropped,
    so the epilogue stored a bool into an f32 buffer and the Loop IR verifier refused the kernel:
    `(x @ w.T > 0).float()` did not compile (CPU fuzzing, session 79). Eager's values, and the
    sm_90a kernel builds with no spills."""
    from tilefuse.codegen import gemm_sm90

    g = torch.Generator().manual_seed(79)
    x, w = (torch.randn(n, 128, generator=g).half() for n in (96, 160))
    x[:3] = 0  # (rows whose product is exactly 0: False)
    fn = lambda x, w: MASKS[name](F.linear(x, w))  # noqa: E731
    p = tilefuse.compile(fn, (x, w))
    got, want = p(x, w), fn(x, w)
    assert got.dtype == want.dtype
    # (the epilogue compares the f32 accumulator, eager its f16 rounding: only elements whose
    # product rounds to 0 in f16 and is not 0 in f32 may differ, and none do at these sizes;
    # `+ y` adds the f32 product where eager adds its f16 rounding: within an f16 rounding)
    if got.is_floating_point():  # the project's rule: within twice eager's error against float64
        ref = fn(x.double(), w.double())
        err, eager_err = (got.double() - ref).abs().max(), (want.double() - ref).abs().max()
        assert err <= 2 * eager_err + 1e-6, (err, eager_err)
    else:
        assert torch.equal(got, want)
    (lg,) = p.gemms.values()
    problem = lg.problem()
    src = gemm_sm90.render(problem, gemm_sm90.default_schedule(problem))
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean

"""Floor and truncating division and the remainder, lowered as PyTorch computes them (each was
a PyTorch extern: a mixture of experts' router divides its sorted positions by k).

Properties: for every integer dtype and every sign of either operand, a // b, a % b and
torch.div with rounding_mode 'floor' or 'trunc' equal eager's bit for bit, tensor or Python
number on either side; a float a // b follows PyTorch's steps (fmod, the sign fix, floor, the
round-up past .5), so it equals eager's bits too, signed zeros and b = 0 (inf, NaN) included
(a 16-bit one: f32's, rounded once);
none leaves an extern in the plan; the kernel builds for sm_90a and sm_80."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.runtime.launch import compile_source_only

INTS = [torch.int64, torch.int32, torch.int8, torch.uint8]  # (the integer dtypes tilefuse takes)
OPS = {
    "floordiv": lambda a, b: a // b,
    "remainder": lambda a, b: a % b,
    "div floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
}


def _same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.is_floating_point:
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit())
    else:
        assert torch.equal(got, want)


def _no_extern(p):
    assert not [s for s in p.plan.steps if s.family == "extern"], str(p.plan)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(INTS), op=st.sampled_from(sorted(OPS)), data=st.data())
def test_integer_division_equals_eager(dtype, op, data):
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    n = data.draw(st.integers(1, 12))
    a = torch.tensor(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=dtype)
    divisors = st.integers(lo, hi).filter(lambda v: v != 0)
    b = torch.tensor(data.draw(st.lists(divisors, min_size=n, max_size=n)), dtype=dtype)
    fn = OPS[op]
    p = tilefuse.compile(fn, (a, b))
    _no_extern(p)
    _same_bits(p(a, b), fn(a, b))


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("k", [2, -3, 7])
def test_a_python_number_on_either_side_as_eager(op, k):
    a = torch.arange(-20, 21)
    fn, rfn = (lambda a: OPS[op](a, k)), (lambda a: OPS[op](k * 13, a.masked_fill(a == 0, 5)))
    for f in (fn, rfn):
        p = tilefuse.compile(f, (a,))
        _no_extern(p)
        _same_bits(p(a), f(a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["floordiv", "div floor", "div trunc", "remainder"])
def test_float_division_equals_eagers_bits(op, dtype):
    torch.manual_seed(2)
    a = torch.cat([torch.randn(200) * 30, torch.tensor([0.0, -0.0, 5.0, -5.0, 1.0, 7.5, -7.5, float("inf")])]).to(dtype)
    b = torch.cat([torch.randn(200), torch.tensor([3.0, 3.0, -2.5, 2.5, 0.0, -0.0, 0.5, 2.0])]).to(dtype)
    fn = OPS[op]
    p = tilefuse.compile(fn, (a, b))
    _no_extern(p)
    # a 16-bit division is computed in f32 and rounded once. PyTorch rounds steps to 16 bits
    # (its CPU kernels each step; its CUDA truncating division the quotient before truncating),
    # so where a quotient is near an integer its result may be one 16-bit step away
    want = fn(a, b) if dtype == torch.float32 else fn(a.float(), b.float()).to(dtype)
    _same_bits(p(a, b), want)


def test_the_router_positions_divided_by_k_are_one_kernel_that_builds():
    """`sorted // top_k` and a remainder beside it: one kernel, built for sm_90a and sm_80 with
    no spills; its source spells the floor division and the remainder."""
    idx = torch.randint(0, 16384, (16384,))
    fn = lambda i: (i // 2, i % 2 == 1)  # noqa: E731
    p = tilefuse.compile(fn, (idx,))
    kernels = [s for s in p.plan.steps if s.family == "mapreduce"]
    assert len(kernels) == 1 and not [s for s in p.plan.steps if s.family == "extern"], str(p.plan)
    (lw,) = p.kernels.values()
    for arch in ("sm_90a", "sm_80"):
        src, cubin = compile_source_only(lw.kernel, arch)
        assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info
        assert "tf_floordiv(" in src.source and "tf_mod(" in src.source
    for got, want in zip(p(idx), fn(idx)):
        assert torch.equal(got, want)

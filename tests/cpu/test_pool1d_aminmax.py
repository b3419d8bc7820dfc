"""`aminmax` is two reductions of one input, and F.avg_pool1d / F.max_pool1d over windows that
tile the length (stride = kernel, no padding) a reduction over [.., L // k, k]'s last dim
(frontend/aten.py): no PyTorch op, equal to eager; overlapping or padded windows stay
PyTorch's op, said in the plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse


def _externs(p):
    return [s for s in p.plan.steps if s.family == "extern" and not s.view]


def _same(got, want):
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 4), length=st.integers(1, 40), k=st.integers(1, 6),
       op=st.sampled_from(["avg", "max"]), keyword=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_pools_whose_windows_tile_the_length_equal_eager(n, c, length, k, op, keyword, seed):
    if k > length:
        return
    x = torch.randn(n, c, length, generator=torch.Generator().manual_seed(seed))
    pool = F.avg_pool1d if op == "avg" else F.max_pool1d
    fn = (lambda x: pool(x, kernel_size=k, stride=k)) if keyword else (lambda x: pool(x, k))
    p = tilefuse.compile(fn, (x,))
    assert k == 1 or not _externs(p), str(p.plan)  # (k = 1: below)
    got = p(x)
    _same(got, fn(x))
    assert got.data_ptr() != x.data_ptr()


def test_one_element_windows_give_a_new_tensor_not_the_inputs_memory():
    """A window of one element, or aminmax over a dim of one, reduces one element: it would be a
    reshape of the input (rewrites.drop_one_element_reductions), and writing the result wrote x
    (review). It stays a reduction: a new tensor, as PyTorch's."""
    for fn, x in ((lambda x: F.max_pool1d(x, 1), torch.randn(2, 3, 4)),
                  (lambda x: torch.aminmax(x, dim=-1), torch.randn(3, 1)),
                  (lambda x: x.amax(-1), torch.randn(3, 1)),
                  (lambda x: (x * 2, (x * 2).sum(-1)), torch.randn(3, 1))):
        p = tilefuse.compile(fn, (x,))
        got, want = p(x), fn(x)
        outs = got if isinstance(got, tuple) else (got,)
        _same(got, want)
        ptrs = [o.data_ptr() for o in outs]
        assert x.data_ptr() not in ptrs and len(set(ptrs)) == len(ptrs), str(p.plan)


@pytest.mark.parametrize("fn", [lambda x: F.avg_pool1d(x, 3, 2), lambda x: F.avg_pool1d(x, 2, padding=1),
                                lambda x: F.max_pool1d(x, 2, ceil_mode=True), lambda x: F.max_pool1d(x, 2, dilation=2),
                                lambda x: F.avg_pool1d(x, 2, ceil_mode=True)])
def test_other_windows_stay_pytorchs_op_saying_why(fn):
    x = torch.randn(2, 3, 9)
    p = tilefuse.compile(fn, (x,))
    assert any("windows other than stride = kernel" in (s.note or "") for s in _externs(p)), str(p.plan)
    _same(p(x), fn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("kw", [{}, {"dim": -1}, {"dim": 1, "keepdim": True}], ids=str)
def test_aminmax_equals_eager(kw, dtype):
    x = torch.randn(6, 33).mul(10).to(dtype)
    fn = lambda x: torch.aminmax(x, **kw)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert not [s for s in _externs(p) if "aminmax" in s.nodes[0]], str(p.plan)
    _same(p(x), fn(x))


def test_a_bf16_average_pool_accumulates_in_f32_and_rounds_once():
    x = torch.randn(4, 8, 64).bfloat16()
    fn = lambda x: F.avg_pool1d(x, 8)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    ref = F.avg_pool1d(x.double(), 8)
    got = p(x)
    assert got.dtype == torch.bfloat16
    assert (got.double() - ref).abs().max() <= (fn(x).double() - ref).abs().max() * 2 + 1e-6

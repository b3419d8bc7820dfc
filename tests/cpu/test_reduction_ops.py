"""aten ops that lower to reductions (frontend/aten.py): logsumexp about its max, adaptive
average pooling to one element a channel as a mean; through the interpreter against PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse


def _steps(p):
    return [s for s in p.plan.steps if s.family != "alias" and not s.view]


@pytest.mark.parametrize("dim,keepdim", [(1, False), (-1, True), ((1, 2), False), (0, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_logsumexp_matches_pytorch(dim, keepdim, dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 50, 40) * 20).to(dtype)
    fn = lambda x: torch.logsumexp(x, dim, keepdim=keepdim)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(p(x), fn(x), **tol)


def test_logsumexp_of_infinities_is_pytorchs():
    """A row of -inf gives -inf (its max taken as 0, not -inf - -inf = NaN); a +inf gives +inf."""
    x = torch.tensor([[float("-inf")] * 3, [1.0, float("inf"), 2.0], [1.0, 2.0, 3.0]])
    p = tilefuse.compile(lambda x: torch.logsumexp(x, 1), (x,))
    torch.testing.assert_close(p(x), torch.logsumexp(x, 1))


def test_logsumexp_over_the_last_dim_is_one_kernel():
    x = torch.randn(64, 1000)
    p = tilefuse.compile(lambda x: torch.logsumexp(x, -1), (x,))
    assert [s.family for s in _steps(p)] == ["mapreduce"]


def test_logsumexp_of_integers_is_a_float():
    x = torch.randint(-5, 5, (4, 7))
    p = tilefuse.compile(lambda x: torch.logsumexp(x, 1), (x,))
    got = p(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.logsumexp(x, 1))


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.adaptive_avg_pool2d(x, 1), (4, 300, 7, 9)),
    (lambda x: F.adaptive_avg_pool2d(x, (1, 1)), (4, 300, 7, 9)),
    (lambda x: torch.nn.AdaptiveAvgPool2d((1, 1))(x).flatten(1), (4, 300, 7, 9)),
    (lambda x: F.adaptive_avg_pool1d(x, 1), (4, 300, 63)),
], ids=["2d", "2d pair", "module then flatten", "1d"])
def test_adaptive_average_pooling_to_one_is_a_row_kernel(fn, shape):
    """ResNet's head: a mean over the pooled dims, one row kernel over them merged."""
    x = torch.randn(*shape)
    p = tilefuse.compile(fn, (x,))
    assert [s.family for s in _steps(p)] == ["mapreduce"], str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


def test_adaptive_average_pooling_to_more_stays_pytorchs_and_says_why():
    x = torch.randn(2, 8, 6, 6)
    p = tilefuse.compile(lambda x: F.adaptive_avg_pool2d(x, 2), (x,))
    assert [s.family for s in _steps(p)] == ["extern"]
    assert "only 1 per pooled dim" in str(p.plan)
    torch.testing.assert_close(p(x), F.adaptive_avg_pool2d(x, 2))

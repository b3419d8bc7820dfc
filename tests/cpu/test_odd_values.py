"""Inputs at the edges of an op's domain: out-of-range class targets (eager stops with an assert;
a compiled loss must not look plausible) and reductions of 0-d tensors over their one dim."""
import math

import pytest
import torch
import torch.nn.functional as F

import tilefuse


def _ce(reduction):
    return lambda x, t: F.cross_entropy(x, t, reduction=reduction)


def _nll(reduction):
    return lambda x, t: F.nll_loss(F.log_softmax(x, -1), t, reduction=reduction)


@pytest.mark.parametrize("loss", [_ce, _nll], ids=["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("bad_target", [10, 57, -1, -7])
def test_a_target_outside_the_classes_gives_nan_not_a_plausible_loss(loss, bad_target):
    """Per-row losses: NaN exactly at the out-of-range row, the others (ignore_index included,
    which stays 0) as eager computes them; mean and sum: NaN."""
    torch.manual_seed(0)
    x, t = torch.randn(6, 10), torch.tensor([1, 2, -100, 9, 0, 3])
    bad = t.clone()
    bad[3] = bad_target
    per_row = tilefuse.compile(loss("none"), [x, t])
    got, want = per_row(x, bad), loss("none")(x, t)
    assert math.isnan(got[3])
    keep = [0, 1, 2, 4, 5]
    torch.testing.assert_close(got[keep], want[keep])
    assert got[2] == 0
    for reduction in ("mean", "sum"):
        prog = tilefuse.compile(loss(reduction), [x, t])
        torch.testing.assert_close(prog(x, t), loss(reduction)(x, t))  # in range: unchanged
        assert math.isnan(prog(x, bad))


@pytest.mark.parametrize("fn", [lambda x: x.var(0), lambda x: x.std(-1), lambda x: x.var(0, correction=0),
                                lambda x: x.mean(0, keepdim=True)], ids=["var0", "std-1", "var0_c0", "mean0_keep"])
def test_reductions_of_a_scalar_over_its_one_dim_match_eager(fn):
    """A 0-d tensor's dim 0 (or -1) is its one element: var with correction 1 is NaN, as eager's."""
    import warnings

    x = torch.randn(())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager warns that the degrees of freedom are <= 0
        want = fn(x)
    got = tilefuse.compile(fn, [x])(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True)

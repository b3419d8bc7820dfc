"""Inputs at the edges of an op's domain: out-of-range class targets (eager stops with an assert;
a compiled loss must not look plausible) and reductions of 0-d tensors over their one dim."""
import math

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.frontend.capture import CaptureError


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


@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 5])
def test_only_targets_outside_the_classes_and_not_ignored_are_nan(ignore_index):
    """An ignored row (whatever ignore_index is, inside [0, C) or not) stays 0, as eager has it;
    a bad row in the same batch is NaN; the others match eager."""
    torch.manual_seed(1)
    x = torch.randn(6, 10)
    t = torch.tensor([1, 2, 3, 9, 0, 4])
    t[2] = ignore_index
    bad = t.clone()
    bad[4] = 10 if ignore_index != 10 else 11
    f = lambda x, t: F.cross_entropy(x, t, reduction="none", ignore_index=ignore_index)  # noqa: E731
    got, want = tilefuse.compile(f, [x, t])(x, bad), f(x, t)
    assert math.isnan(got[4]) and got[2] == 0
    keep = [0, 1, 2, 3, 5]
    torch.testing.assert_close(got[keep], want[keep])


def test_the_lm_head_partials_path_marks_a_bad_label_and_not_the_rows_the_shift_drops():
    """Linear + cross-entropy over shifted logits goes through the LM head's partials (the logits
    never stored); a bad label where the shift drops it changes nothing, one in a kept row is NaN."""
    from tilefuse.compiler import compile_stages

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.nn.Linear(64, 300, bias=False)

        def forward(self, x, t):
            z = self.h(x).float()
            return F.cross_entropy(z[:, :-1].reshape(-1, 300), t[:, 1:].reshape(-1))

    torch.manual_seed(2)
    m = Head().bfloat16()
    x, t = torch.randn(2, 9, 64, dtype=torch.bfloat16), torch.randint(0, 300, (2, 9))
    st = compile_stages(m, [x, t])
    assert any(s.family == "gemm" and s.gemm.partials for s in st.plan.steps if s.gemm is not None)
    prog = st.program
    dropped = t.clone()
    dropped[0, 0] = 300  # the shift never reads it
    ok = prog(x, t)
    assert not math.isnan(ok) and prog(x, dropped) == ok
    kept = t.clone()
    kept[1, 4] = 303
    assert math.isnan(prog(x, kept))


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


@pytest.mark.parametrize("loss", [_ce, _nll], ids=["cross_entropy", "nll_loss"])
def test_uint8_class_targets_stop_at_capture_saying_to_pass_int64(loss):
    """Eager takes uint8 targets; torch.export's trace cannot (it indexes with them): the error
    says what to do instead of only what failed."""
    x, t = torch.randn(4, 10), torch.tensor([1, 2, 9, 0], dtype=torch.uint8)
    with pytest.raises(CaptureError, match=r"uint8 .*\.long\(\)"):
        tilefuse.compile(loss("mean"), [x, t])


@pytest.mark.parametrize("loss", [_ce, _nll], ids=["cross_entropy", "nll_loss"])
def test_int32_class_targets_give_the_loss_of_the_same_targets_as_int64(loss):
    """Eager refuses int32 targets; a compiled loss takes them (export's trace does) and must then
    compute what eager computes for the same classes as int64."""
    torch.manual_seed(1)
    x, t = torch.randn(5, 10), torch.tensor([1, 2, 9, 0, -100])
    prog = tilefuse.compile(loss("mean"), [x, t.int()])
    torch.testing.assert_close(prog(x, t.int()), loss("mean")(x, t))


@pytest.mark.parametrize("shift", [2048.0, -3000.0, 1e5])
def test_cross_entropy_of_large_logits_keeps_the_loss_precise(shift):
    """Logits far from zero: the loss is (max - x[target]) + log(sum exp(x - max)), so the row's
    max and its target logit cancel before the small log is added; lse - x[target] rounded the
    lse at the logits' magnitude (1.0986328 for ln 3 = 1.0986123 near 2049 in f32). Per row,
    within a few f32 ulps of the loss itself against float64."""
    torch.manual_seed(0)
    x = torch.randn(16, 33) + shift
    t = torch.randint(0, 33, (16,))
    prog = tilefuse.compile(_ce("none"), [x, t])
    want = F.cross_entropy(x.double(), t, reduction="none")
    got = prog(x, t).double()
    assert ((got - want).abs() <= 8 * torch.finfo(torch.float32).eps * want.abs().clamp_min(1)).all(), (got - want)

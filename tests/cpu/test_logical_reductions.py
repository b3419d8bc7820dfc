"""all / any, count_nonzero, nansum / nanmean, dot / vdot and mv lower to reductions (each was a
PyTorch extern): results equal eager's, in its dtype and shape, NaN handled as PyTorch does
(NaN is nonzero; nansum skips it; nanmean averages what is left)."""
import pytest
import torch

import tilefuse


def _x():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    x[0, 3] = float("nan")
    x[5, :] = float("nan")
    x[2, 7] = 0.0
    return x


CASES = {
    "all_rows": (lambda x: (x > -0.5).all(-1), lambda: (_x(),)),
    "all_of_floats": (lambda x: x.all(1), lambda: (_x(),)),  # NaN is nonzero, 0.0 is not
    "all_whole": (lambda x: (x > -5).all(), lambda: (_x(),)),
    "all_dims": (lambda x: (x.nan_to_num() > -5).all((0, 1)), lambda: (_x(),)),
    "any_keepdim": (lambda x: (x > 1.5).any(-1, keepdim=True), lambda: (_x(),)),
    "all_uint8": (lambda u: u.all(1), lambda: (torch.randint(0, 3, (8, 16), dtype=torch.uint8),)),
    "any_bf16": (lambda x: (x * 0).any(-1), lambda: (_x().bfloat16(),)),
    "count_nonzero": (lambda x: torch.count_nonzero(x, -1), lambda: (_x(),)),
    "count_nonzero_all": (lambda x: torch.count_nonzero(x), lambda: (_x(),)),
    "nansum": (lambda x: x.nansum(-1), lambda: (_x(),)),
    "nansum_all": (lambda x: x.nansum(), lambda: (_x(),)),
    "nanmean": (lambda x: x.nanmean(-1, keepdim=True), lambda: (_x(),)),
    "nanmean_bf16": (lambda x: x.nanmean(-1), lambda: (_x().bfloat16(),)),
    "dot": (lambda v, w: torch.dot(v, w), lambda: (torch.randn(33), torch.randn(33))),
    "vdot": (lambda v, w: torch.vdot(v, w * 2), lambda: (torch.randn(33), torch.randn(33))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowered_reduction_equals_eager_with_no_extern(case):
    fn, make = CASES[case]
    ins = make()
    prog = tilefuse.compile(fn, ins)
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    got, want = prog(*ins), fn(*ins)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype in (torch.bool, torch.uint8, torch.int64):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_dot_of_bf16_vectors_accumulates_in_f32():
    """A bf16 sum of 4096 products rounded at each step would be far off; f32 accumulation
    lands within bf16's rounding of the f64 value."""
    torch.manual_seed(1)
    v, w = torch.randn(4096).bfloat16(), torch.randn(4096).bfloat16()
    got = tilefuse.compile(lambda v, w: torch.dot(v, w), (v, w))(v, w)
    ref = float((v.double() * w.double()).sum())
    assert abs(float(got) - ref) <= 2 ** -8 * abs(ref) + 1e-3


def test_mv_is_a_matmul_not_an_extern_of_mv():
    x, v = torch.randn(8, 16).bfloat16(), torch.randn(16).bfloat16()
    prog = tilefuse.compile(lambda x, v: torch.mv(x, v), (x, v))
    assert "aten.mv" not in str(prog.plan), str(prog.plan)
    torch.testing.assert_close(prog(x, v).float(), (x.float() @ v.float()), rtol=2 ** -7, atol=2 ** -6)

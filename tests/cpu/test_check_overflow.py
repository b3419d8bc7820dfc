"""check.compare where a value leaves the output dtype's range: the check must still see a wrong
output (an infinite PyTorch error made the bound infinite, passing anything), and an output
that overflows as the float64 reference rounds, or as PyTorch does, passes."""
import torch

from tilefuse.check import compare, rel_error


def _case(dtype=torch.float32):
    ref = torch.randn(64, dtype=torch.float64)
    ref[:4] = torch.tensor([1e39, -1e39, 5e38, 3.0], dtype=torch.float64)  # the first three overflow f32
    eager = ref.to(dtype)
    return ref, eager


def test_overflowing_reference_rounds_to_inf_and_a_wrong_rest_still_fails():
    ref, eager = _case()
    assert compare("same", eager.clone(), ref, eager).ok
    wrong = eager.clone()
    wrong[10:] *= 1.01  # finite elements off by 1%: PyTorch's own error is ~1e-8
    c = compare("wrong", wrong, ref, eager)
    assert not c.ok and c.bound < 1e-3, c
    finite = eager.clone()
    finite[0] = 3.4e38  # where the reference overflows f32, a finite value is neither inf nor PyTorch's
    c = compare("finite", finite, ref, eager)
    assert not c.ok and "overflows" in c.note, c


def test_where_pytorch_overflows_inside_its_chain_the_output_is_judged_by_the_reference():
    """(x * 1000) / 1000 in f16: eager overflows to inf at x > 65.5, the exact result is x."""
    ref = torch.linspace(50, 120, 64, dtype=torch.float64)
    x16 = ref.to(torch.float16)
    eager = (x16 * 1000) / 1000
    assert not torch.isfinite(eager).all()
    assert compare("exact", x16.clone(), ref, eager).ok  # finite and right where PyTorch is inf
    assert compare("as eager", eager.clone(), ref, eager).ok  # inf where PyTorch is inf
    off = x16.clone()
    off[-1] = 1.0  # wrong where PyTorch is inf: it counts in the output's error
    c = compare("off", off, ref, eager)
    assert not c.ok and c.torch_error < 1e-2, c


def test_float64_outputs_near_the_top_and_bottom_of_the_range_are_judged_not_nan():
    """Squares of float64 values past ~1e154 overflow and below ~1e-162 vanish: the relative
    error is taken on values scaled by a power of two, so an output of 1e306 off by 3e-10 (a pow
    of a GEMM's result, as fuzzing found) has that error, not NaN, and one off by 1% fails."""
    for magnitude in (1e306, 1e-300):
        ref = torch.linspace(1, 2, 64, dtype=torch.float64) * magnitude
        close = ref * (1 + 3e-10)
        c = compare("close", close, ref, ref)
        assert c.ok and 1e-10 < c.error < 1e-9, (magnitude, c)
        c = compare("off", ref * 1.01, ref, ref)
        assert not c.ok and abs(c.error - 0.01) < 1e-6, (magnitude, c)
    assert rel_error(torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)) == 0.0
    assert rel_error(torch.ones(4), torch.zeros(4)) == 2.0  # a zero reference: the absolute norm


def test_where_the_reference_is_not_finite_pytorchs_value_passes_and_another_fails():
    """`sqrt(log_softmax(x, dtype=f16))`: a float64 -1.4e-11 that f16 rounds to -0 is NaN in
    the reference alone; PyTorch's 0 there, and the output's, pass (fuzzing). A value that is
    neither the reference's nor PyTorch's still fails."""
    ref = torch.rand(32, dtype=torch.float64)
    ref[3] = float("nan")
    eager = ref.half()
    eager[3] = 0.0
    assert compare("pytorchs", eager.clone(), ref, eager).ok
    other = eager.clone()
    other[3] = 0.5
    assert not compare("other", other, ref, eager).ok


def test_a_nan_pytorch_also_gives_passes_and_one_it_does_not_fails():
    """Eager's own NaN where the float64 reference has none (an f16 overflow, inf - inf): the
    output's NaN there passes; a NaN where PyTorch's value is finite still fails."""
    ref = torch.rand(32, dtype=torch.float64) + 1
    eager = ref.half()
    eager[5] = float("nan")
    out = ref.half()
    out[5] = float("nan")
    assert compare("same nan", out, ref, eager).ok
    out[6] = float("nan")
    c = compare("own nan", out, ref, eager)
    assert not c.ok and "NaN where the reference has none" in c.note

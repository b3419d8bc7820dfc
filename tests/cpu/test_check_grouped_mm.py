"""check.float64_reference runs torch._grouped_mm (a mixture of experts' matmul in transformers),
which PyTorch takes only in 16- and 32-bit floats, in float64: rows offs[i-1]:offs[i] times
expert i, equal to the per-group products, and a 3-D batch equal to bmm."""
import pytest
import torch

from tilefuse.check import float64_reference


def test_grouped_mm_with_offsets_is_each_groups_product_in_float64():
    torch.manual_seed(0)
    a, b = torch.randn(10, 16), torch.randn(3, 16, 8)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # (group 1 is empty)
    got = float64_reference(lambda a, b: torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs), (a, b))
    assert got.dtype == torch.float64
    want = torch.cat([a[:4].double() @ b[0].double(), a[4:10].double() @ b[2].double()])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_grouped_mm_of_3d_operands_is_a_batched_product():
    a, b = torch.randn(2, 5, 4), torch.randn(2, 4, 3)
    got = float64_reference(lambda a, b: torch._grouped_mm(a, b), (a, b))
    torch.testing.assert_close(got, a.double() @ b.double(), rtol=1e-12, atol=1e-12)


def test_a_grouped_mm_form_it_does_not_take_says_so():
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    with pytest.raises(NotImplementedError, match="2-D by 2-D"):
        float64_reference(lambda a, b: torch._grouped_mm(a, b, offs=torch.tensor([3, 6], dtype=torch.int32)), (a, b))

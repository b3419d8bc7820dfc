"""Rows read as pieces of contiguous elements (`mapreduce._split_load`: attention's heads
merged back into rows) on the GPU: the merge and maps of it against PyTorch, outputs poisoned,
at head dims whose pieces take whole chunks (128, 64, 8) and one that does not (100), 16-bit and
f32, and an input starting past a 16-byte boundary (the scalar variant)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def heads_merge(x):
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B, S, H * D)


@pytest.mark.parametrize("shape", [(2, 32, 1024, 128), (3, 12, 77, 64), (2, 5, 33, 8), (2, 4, 50, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("then", ["copy", "scaled"])
def test_merged_heads_equal_pytorchs(shape, dtype, then):
    import tilefuse

    fn = heads_merge if then == "copy" else (lambda x: heads_merge(x) * 0.5 + 1)
    torch.manual_seed(sum(shape))
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,))
    prog.poison = True
    got, want = prog(x), fn(x)
    assert got.shape == want.shape
    if then == "copy":
        assert torch.equal(got, want)
    else:  # (computed in f32 and rounded once: the 2x rule against float64)
        from tilefuse.check import compare, float64_reference

        c = compare(then, got, float64_reference(fn, (x,)), want)
        assert c.ok, c


def test_a_misaligned_input_runs_the_scalar_variant():
    import tilefuse

    flat = torch.randn(1 + 2 * 8 * 64 * 128, device="cuda", dtype=torch.bfloat16)
    x = flat[:-1].view(2, 8, 64, 128).clone()
    prog = tilefuse.compile(heads_merge, (x,))
    odd = flat[1:].view(2, 8, 64, 128)
    assert odd.data_ptr() % 16
    assert torch.equal(prog(odd), heads_merge(odd))
    assert torch.equal(prog(x), heads_merge(x))

"""A sliding window (ir.Attention.window) on the GPU: flash attention's own window, checked
against SDPA with the window as a mask within the 2x rule of a float64 reference, for bf16 and
f16, grouped and full heads, windows of 1 key to nearly the whole sequence; the flash path is
the one taken (runtime.program checks it once a process and says when it is not)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _band(L, W):
    i = torch.arange(L, device="cuda")[:, None]
    j = torch.arange(L, device="cuda")
    return (j <= i) & (j > i - W)


def windowed(q, k, v, W):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[-2], W), enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("H, Hkv, D", [(8, 8, 64), (16, 4, 128)])
@pytest.mark.parametrize("L, W", [(1024, 1), (1024, 100), (2048, 1024), (777, 776)])
def test_flash_window_is_the_masked_attention(dtype, H, Hkv, D, L, W):
    from tilefuse.check import compare
    from tilefuse.graph import ir
    from tilefuse.runtime import program

    torch.manual_seed(L + W)
    q = torch.randn(2, H, L, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, Hkv, L, D, device="cuda", dtype=dtype) for _ in range(2))
    n = ir.Attention("a", ir.TensorType(tuple(q.shape), "bf16" if dtype == torch.bfloat16 else "f16"), "q", "k", "v",
                     True, None, None, window=W)
    got = program.run_extern(n, {"q": q, "k": k, "v": v}.__getitem__)
    assert program._flash_window_takes(q, k, v) and program._flash_window_agrees(q, k)
    want = windowed(q, k, v, W)
    ref = windowed(q.double(), k.double(), v.double(), W)
    check = compare(f"window {W}", got, ref, want)
    assert check.ok, check


def test_a_mistral_layer_with_its_window_runs_flash_and_matches():
    """SDPA with a causal window mask compiled by tilefuse: the mask becomes the window (no mask
    kernel, no mask tensor), the output within the 2x rule."""
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.graph import ir

    def fn(q, k, v):
        L = q.shape[-2]
        i = torch.arange(L, device=q.device)[:, None]
        j = torch.arange(L, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - 256))

    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    prog = tilefuse.compile(fn, (q, k, v))
    prog.poison = True
    (att,) = [n for n in prog.graph.nodes if isinstance(n, ir.Attention)]
    assert att.window == 256 and att.mask is None and att.causal
    check = compare("window", prog(q, k, v), float64_reference(fn, (q, k, v)), fn(q, k, v))
    assert check.ok, check
    from tilefuse.runtime import program

    assert program._WINDOW_CHECKED.get((q.device, q.dtype, 64, 1)) is True  # flash's window ran, not the mask

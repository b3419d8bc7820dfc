"""graph/rules/roll_sink.py and permute_lift.py on the GPU: Gemma 3's and Qwen3's q norm and
rotate-half RoPE as one kernel (q read a second time at the rotated column), within the 2x rule
of a float64 reference, outputs poisoned first."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


class Gemma3Q(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, q, cos, sin):
        x = q.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = (x * (1.0 + self.w.float())).to(q.dtype)
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


@pytest.mark.parametrize("D", [128, 256])
def test_norm_and_rotation_in_one_kernel_within_the_2x_rule(D):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(D)
    q = torch.randn(2, 16, 1000, D, device="cuda", dtype=torch.bfloat16)
    ang = torch.arange(1000, device="cuda")[:, None] * torch.rand(D // 2, device="cuda").repeat(2)
    args = (q, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16))
    model = Gemma3Q((0.1 * torch.randn(D, device="cuda")).to(torch.bfloat16)).eval()
    prog = tilefuse.compile(model, args)
    prog.poison = True
    assert len([s for s in prog.plan.steps if s.family == "mapreduce"]) == 1, str(prog.plan)
    with torch.no_grad():
        check = compare("gemma3 q", prog(*args), float64_reference(model, args), model(*args))
    assert check.ok, check


class Qwen3Q(torch.nn.Module):
    """Qwen3's q: an RMSNorm over each head before the head transpose, RoPE after it, SDPA."""

    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(d, device="cuda"), requires_grad=False)
        self.d = d

    def forward(self, q, k, v, cos, sin):
        x = q.view(q.shape[0], q.shape[1], -1, self.d).float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype) * self.w.to(q.dtype)
        x = x.transpose(1, 2)
        h = self.d // 2
        x = x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin
        return torch.nn.functional.scaled_dot_product_attention(x, k, v, is_causal=True)


def test_qwen3_norm_and_rotation_in_the_norms_order_within_the_2x_rule():
    """graph/rules/permute_lift.py: the rotation computed in the norm's [B, S, H] order in the
    norm's kernel, attention reading it through the head transpose."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(3)
    B, S, H, D = 2, 1000, 16, 128
    q = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ang = torch.arange(S, device="cuda")[:, None] * torch.rand(D // 2, device="cuda").repeat(2)
    args = (q, k, v, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16))
    model = Qwen3Q(D).eval()
    prog = tilefuse.compile(model, args)
    prog.poison = True
    assert len([s for s in prog.plan.steps if s.family == "mapreduce"]) == 1, str(prog.plan)
    with torch.no_grad():
        check = compare("qwen3 q", prog(*args), float64_reference(model, args), model(*args))
    assert check.ok, check

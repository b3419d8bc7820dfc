"""graph/rules/roll_sink.py on the GPU: Gemma 3's q norm and rotate-half RoPE as one kernel (q
read a second time at the rotated column), within the 2x rule of a float64 reference, outputs
poisoned first."""
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

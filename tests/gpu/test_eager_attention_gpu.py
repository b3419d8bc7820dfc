"""graph/rules/eager_attention.py on the GPU: attention written out in ops (GPT-J's f32 scores of
bf16 q and k; transformers' bf16 eager path) runs as SDPA, within the 2x rule of a float64
reference, with a causal mask (is_causal) and with a random additive one, and Bloom's ALiBi form
(baddbmm on [B·H] views, a [B, H] mask: SDPA with the masks summed), outputs poisoned first."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

B, H, S, D = 2, 8, 1024, 64


def gptj(q, k, v, mask):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(D)
    return torch.matmul(torch.softmax(s + mask, -1).to(v.dtype), v)


def llama(q, k, v, mask):
    s = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + mask
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


@pytest.mark.parametrize("fn", [gptj, llama], ids=lambda f: f.__name__)
@pytest.mark.parametrize("mask_kind", ["causal", "random"])
def test_eager_attention_runs_as_sdpa_within_the_2x_rule(fn, mask_kind):
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.graph import ir

    torch.manual_seed(4)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if mask_kind == "causal":
        mask = torch.triu(torch.full((S, S), torch.finfo(torch.bfloat16).min, device="cuda"), 1)
        mask = mask.to(torch.bfloat16)[None, None]
    else:
        mask = (torch.randn(B, 1, S, S, device="cuda") * 2).to(torch.bfloat16)
    prog = tilefuse.compile(fn, (q, k, v, mask))
    prog.poison = True
    assert [type(prog.graph[s.nodes[0]]).__name__ for s in prog.plan.steps
            if s.family == "extern" and not s.view] == ["Attention"], str(prog.plan)
    assert not any(isinstance(n, ir.Contraction) for n in prog.graph.nodes)
    check = compare(fn.__name__, prog(q, k, v, mask), float64_reference(fn, (q, k, v, mask)), fn(q, k, v, mask))
    assert check.ok, check


def bloom(q, k, v, alibi, mask):
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    s = alibi.baddbmm(q3, k3.transpose(1, 2), beta=1.0, alpha=D ** -0.5).view(B, H, S, S) + mask
    return torch.bmm(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype).view(B * H, S, S), v3)


def test_bloom_alibi_attention_runs_as_sdpa_within_the_2x_rule():
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(5)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    alibi = (slopes[None, :, None, None] * torch.arange(S, device="cuda")).expand(B, H, 1, S)
    alibi = alibi.reshape(B * H, 1, S).to(torch.bfloat16)
    mask = torch.triu(torch.full((S, S), torch.finfo(torch.bfloat16).min, device="cuda"), 1)
    mask = mask.to(torch.bfloat16)[None, None].expand(B, 1, S, S).clone()
    mask[1, :, :, :100] = torch.finfo(torch.bfloat16).min  # padding: every key of row < 100 masked
    args = (q, k, v, alibi, mask)
    prog = tilefuse.compile(bloom, args)
    prog.poison = True
    externs = [type(prog.graph[s.nodes[0]]).__name__ for s in prog.plan.steps if s.family == "extern" and not s.view]
    assert externs == ["Attention"], str(prog.plan)
    got = prog(*args)
    assert torch.isfinite(got).all()
    check = compare("bloom", got, float64_reference(bloom, args), bloom(*args))
    assert check.ok, check

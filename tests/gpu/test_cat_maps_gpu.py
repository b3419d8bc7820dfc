"""graph/rules/cat_maps.py on the GPU: a cat along the last dim with a computed piece, run as one
kernel selecting its pieces, equals eager's cat bit for bit where the pieces round nothing
differently (views and exact maps), in every float dtype, at widths on and off 16-byte chunks,
its output poisoned first, in the thin call and CUDA-graph replays; partial-rotary RoPE on a
projection (GPT-NeoX's form) within the 2x rule of a float64 reference; an interleaving stack
(stacks_as_maps) of strided slices read in place bit for bit, and GPT-J's interleaved rotary
within the 2x rule."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("widths", [(16, 48), (8, 8, 112), (3, 61), (32, 0, 96)], ids=str)
def test_a_cat_of_a_map_and_views_equals_eager_bit_for_bit(widths, dtype):
    import tilefuse

    total = sum(widths)

    def fn(x):
        pieces, at = [], 0
        for i, n in enumerate(widths):
            v = x[..., at + 1:at + 1 + n]
            pieces.append(v * 2 if i % 2 == 0 else v)  # (doubling is exact)
            at += n
        return torch.cat(pieces, -1)

    torch.manual_seed(0)
    x = torch.randn(3, 8, 333, total + 7, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    want = fn(x)
    for call in range(3):  # the thin call, then CUDA-graph replays
        got = prog(x)
        assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"
    x.copy_(torch.randn_like(x))
    assert torch.equal(prog(x), fn(x))


@pytest.mark.parametrize("rot", [16, 32, 64], ids=str)
def test_partial_rotary_on_a_projection_within_the_2x_rule(rot):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(1)
    B, S, H, D = 2, 512, 8, 64
    x = torch.randn(B, S, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * H * D, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    ang = torch.randn(S, rot // 2, device="cuda")
    cos = torch.cat((ang, ang), -1).cos().bfloat16()
    sin = torch.cat((ang, ang), -1).sin().bfloat16()

    def rope(t):
        r, rest = t[..., :rot], t[..., rot:]
        half = torch.cat((-r[..., rot // 2:], r[..., :rot // 2]), -1)
        return torch.cat((r * cos + half * sin, rest), -1)

    def fn(x, w):
        qkv = (x @ w.t()).view(B, S, H, 3 * D).transpose(1, 2)
        q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
        return torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)

    prog = tilefuse.compile(fn, (x, w))
    prog.poison = True
    copies = [s.nodes[0] for s in prog.plan.steps if s.family == "extern" and not s.view
              and type(prog.graph[s.nodes[0]]).__name__ != "Attention"]
    assert not copies, str(prog.plan)
    check = compare("partial rope", prog(x, w), float64_reference(fn, (x, w)), fn(x, w))
    assert check.ok, check


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k", [2, 3], ids=str)
def test_an_interleaving_stack_of_strided_slices_equals_eager_bit_for_bit(k, dtype):
    import tilefuse

    def fn(x):
        pieces = [x[..., i::k] for i in range(k)]
        pieces[0] = -pieces[0]  # (negation is exact)
        return torch.stack(pieces[::-1], -1).flatten(-2)

    torch.manual_seed(2)
    x = torch.randn(3, 8, 333, 64 * k, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    want = fn(x)
    for call in range(3):
        got = prog(x)
        assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"


@pytest.mark.parametrize("rot", [16, 64], ids=str)
def test_interleaved_rotary_on_a_projection_within_the_2x_rule(rot):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(3)
    B, S, H, D = 2, 512, 8, 64
    x = torch.randn(B, S, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * H * D, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    ang = torch.randn(S, 1, rot // 2, device="cuda")
    cos = torch.repeat_interleave(ang.cos(), 2, -1).bfloat16()
    sin = torch.repeat_interleave(ang.sin(), 2, -1).bfloat16()

    def rope(t):  # t: [B, S, H, D]
        r, rest = t[..., :rot], t[..., rot:]
        turned = torch.stack((-r[..., 1::2], r[..., ::2]), -1).flatten(-2)
        return torch.cat((r * cos + turned * sin, rest), -1).transpose(1, 2)

    def fn(x, w):
        q, k, v = (x @ w.t()).view(B, S, H, 3 * D).split(D, -1)
        return torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v.transpose(1, 2), is_causal=True)

    prog = tilefuse.compile(fn, (x, w))
    prog.poison = True
    copies = [s.nodes[0] for s in prog.plan.steps if s.family == "extern" and not s.view
              and type(prog.graph[s.nodes[0]]).__name__ != "Attention"]
    assert not copies, str(prog.plan)
    check = compare("interleaved rope", prog(x, w), float64_reference(fn, (x, w)), fn(x, w))
    assert check.ok, check

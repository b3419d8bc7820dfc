"""Views a map-reduce kernel reads where their tensor lies (fusion.views_read_in_place) on the
GPU: slices at vector-aligned and misaligned offsets, a head transpose that keeps the last dim,
and HF's rotate-half RoPE as a roll (rules/cat_roll.py), each one kernel with no copy, its
outputs poisoned, under the 2x rule against float64 (not PyTorch's bits: the fused multiply-add
rounds once where eager rounds twice), in the thin call and in the CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _rope(q, cos, sin):  # transformers' form, on q laid out [B, S, H, D] and transposed to heads
    q = q.transpose(1, 2)
    h = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., h:], q[..., :h]), -1) * sin


def _halves(x, at):
    return x[..., at:] * 2 + torch.sin(x[..., :x.shape[-1] - at])


def _check(fn, ins, kinds=("roll",)):
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.graph import ir

    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    # (a result PyTorch lays out permuted is returned as a strided view: no launch)
    assert [s.family for s in prog.plan.steps if s.family != "alias" and not s.view] == ["mapreduce"], str(prog.plan)
    read = [prog.graph[v].op for s in prog.plan.steps for v in s.reads]
    assert all(k in read for k in kinds), str(prog.plan)
    assert not any(isinstance(n, ir.Extern) for n in prog.graph.nodes)
    ref = float64_reference(fn, ins)
    eager = fn(*ins)
    for call in range(3):  # the thin call, then (forced: one launch) CUDA-graph replays
        got = prog(*ins)
        c = compare(f"call {call}", got, ref, eager)
        assert c.ok, c
        assert got.stride() == eager.stride(), (got.stride(), eager.stride())
    info = prog.graph_info()
    assert info and info[0]["replays"] >= 1, info
    return got, eager


@pytest.mark.parametrize("b,s,h,d", [(1, 1, 32, 128), (4, 1, 8, 128), (2, 77, 4, 64), (1, 8192, 2, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotate_half_rope_reads_q_twice_in_place(b, s, h, d, dtype):
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    cos, sin = (torch.randn(1, 1, s, d, device="cuda", dtype=dtype) for _ in range(2))
    # (at one token the head transpose moves no element: a free reshape; at more, the result is
    # computed in q's order, eager's layout, and the transpose composes away: rules/permute_sink.py)
    _check(_rope, (q, cos, sin))


@pytest.mark.parametrize("b,s,h,d", [(4, 1, 8, 128), (2, 77, 4, 64), (1, 8192, 2, 128)], ids=str)
def test_rotate_half_rope_written_contiguous_reads_the_transposed_q_in_place(b, s, h, d):
    """`.contiguous()` asks for [B, H, S, D]: the kernel reads q through the head transpose."""
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got, _ = _check(lambda *a: _rope(*a).contiguous(), (q, cos, sin), kinds=("roll", "permute") if s > 1 else ("roll",))
    assert got.is_contiguous()


@pytest.mark.parametrize("b,s,h,d", [(1, 64, 4, 128), (2, 8192, 8, 128)], ids=str)
def test_rotate_half_rope_transposed_back_is_one_kernel_writing_the_copy(b, s, h, d):
    """`.transpose(1, 2).contiguous()` of it: the permute moves onto the inputs, where it cancels
    q's; one kernel, no PyTorch copy after it (rules/permute_sink.permutes_into_maps)."""
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got, _ = _check(lambda *a: _rope(*a).transpose(1, 2).contiguous(), (q, cos, sin))
    assert got.is_contiguous() and got.shape == q.shape


@pytest.mark.parametrize("at", [64, 3, 8], ids=lambda a: f"at{a}")
@pytest.mark.parametrize("rows,n", [(4096, 128), (3, 200)], ids=str)
def test_slices_of_one_row_read_in_place(rows, n, at):
    """A slice at an offset of whole 16-byte vectors reads through the vector path, a misaligned
    one through scalar loads; both where the input lies."""
    torch.manual_seed(0)
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    _check(lambda t: _halves(t, at), (x,), kinds=("slice",))

"""Results that are views of an input, returned contiguous (rules/result_copies.py), on the GPU:
each is one map-reduce kernel reading the views in place (no PyTorch copy), its output poisoned
first, equal to eager's bit for bit (a copy rounds nothing), in the thin call and in CUDA-graph
replays, at odd sizes and at the sizes bench/op_sweep.py times."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {
    "head_permute": (lambda x: x.transpose(1, 2).contiguous(), [(8, 1024, 32, 128), (3, 7, 5, 24)]),
    "head_merge": (lambda x: x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1), [(8, 32, 1024, 128), (2, 3, 9, 40)]),
    "repeat_kv": (lambda x: x[:, :, None].expand(x.shape[0], x.shape[1], 4, *x.shape[2:]).reshape(
        x.shape[0], 4 * x.shape[1], *x.shape[2:]), [(8, 8, 1024, 128), (1, 3, 17, 72)]),
    "slice": (lambda x: x[:, 3:x.shape[1] - 5].contiguous(), [(4096, 8192), (33, 77)]),
    "expand": (lambda x: x.expand(3, *x.shape).contiguous(), [(512, 4096), (5, 9)]),
    "roll": (lambda x: x.roll(5, -1), [(4096, 4096), (7, 33)]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,big", [(n, b) for n in CASES for b in (False, True)],
                         ids=[f"{n}-{'big' if b else 'odd'}" for n in CASES for b in (False, True)])
def test_a_result_view_is_copied_by_one_kernel_bit_for_bit(name, big, dtype):
    import tilefuse

    fn, shapes = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shapes[0] if big else shapes[1], device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert [s.family for s in prog.plan.steps if s.family != "alias"] == ["mapreduce"], str(prog.plan)
    want = fn(x).contiguous()
    for call in range(3):  # the thin call, then CUDA-graph replays
        got = prog(x)
        assert got.is_contiguous() and got.shape == want.shape
        assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"
    x.copy_(torch.randn_like(x))  # a new input in place: the replay reads it
    assert torch.equal(prog(x), fn(x).contiguous())

"""`repeat` / `tile` (views) and `tril` / `triu` (a select by column - row) on the GPU: no PyTorch
op, outputs poisoned first, equal to eager CUDA bit for bit, in the thin call and CUDA-graph
replays, at odd sizes and at model sizes (GQA's heads repeated, a 2048 x 2048 causal triangle)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {
    "repeat heads": (lambda x: x.repeat(1, 4, 1, 1), [(2, 8, 1024, 128), (1, 3, 7, 24)]),
    "repeat read by a map": (lambda x: x.repeat(2, 3) * 2, [(4096, 1024), (5, 7)]),
    "tile": (lambda x: torch.tile(x, (3, 1, 2)), [(64, 512), (3, 5)]),
    "tril": (lambda x: torch.tril(x), [(8, 2048, 2048), (3, 5, 7)]),
    "triu softmax": (lambda x: torch.triu(x, 1).softmax(-1), [(16, 512, 512), (2, 9, 9)]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,big", [(n, b) for n in CASES for b in (False, True)],
                         ids=[f"{n}-{'big' if b else 'odd'}" for n in CASES for b in (False, True)])
def test_repeat_and_triangles_equal_eager_on_the_gpu(name, big, dtype):
    import tilefuse

    fn, shapes = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shapes[0] if big else shapes[1], device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    want = fn(x)
    for call in range(3):
        got = prog(x)
        if "softmax" in name:  # (a softmax rounds: DESIGN.md's 2x rule against float64)
            from tilefuse.check import compare, float64_reference

            check = compare(f"call {call}", got, float64_reference(fn, (x,)), want)
            assert check.ok, check
        else:
            assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"

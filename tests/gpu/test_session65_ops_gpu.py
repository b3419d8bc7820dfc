"""The ops lowered in session 65, on the GPU: `repeat` / `tile` (views), `tril` / `triu` (a select
by column - row), `aminmax` (two reductions), F.avg_pool1d / F.max_pool1d over windows that tile
the length (a reduction of [.., L // k, k]). No PyTorch op; outputs poisoned first; in the thin
call and CUDA-graph replays, at odd sizes and at model sizes. What rounds nothing (copies, selects,
max and min) equals eager CUDA bit for bit; what rounds (an average, a softmax) is within
DESIGN.md's 2x rule of a float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {  # name: (fn, [big shape, odd shape], rounds)
    "repeat heads": (lambda x: x.repeat(1, 4, 1, 1), [(2, 8, 1024, 128), (1, 3, 7, 24)], False),
    "repeat read by a map": (lambda x: x.repeat(2, 3) * 2, [(4096, 1024), (5, 7)], False),
    "tile": (lambda x: torch.tile(x, (3, 1, 2)), [(64, 512), (3, 5)], False),
    "tril": (lambda x: torch.tril(x), [(8, 2048, 2048), (3, 5, 7)], False),
    "triu softmax": (lambda x: torch.triu(x, 1).softmax(-1), [(16, 512, 512), (2, 9, 9)], True),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 4), [(32, 256, 4096), (2, 3, 9)], True),
    "max_pool1d": (lambda x: F.max_pool1d(x, 2) * 2, [(32, 256, 4096), (3, 5, 7)], False),
    "aminmax rows": (lambda x: torch.aminmax(x, dim=-1), [(8192, 4096), (5, 33)], False),
    "aminmax all": (lambda x: torch.aminmax(x), [(4096, 4096), (7, 3)], False),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,big", [(n, b) for n in CASES for b in (False, True)],
                         ids=[f"{n}-{'big' if b else 'odd'}" for n in CASES for b in (False, True)])
def test_session65_ops_equal_eager_on_the_gpu(name, big, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, shapes, rounds = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shapes[0] if big else shapes[1], device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    outs = lambda o: o if isinstance(o, tuple) else (o,)  # noqa: E731
    want = outs(fn(x))
    ref = outs(float64_reference(fn, (x,))) if rounds else want
    for call in range(3):
        for i, (got, w, r) in enumerate(zip(outs(prog(x)), want, ref)):
            if rounds:
                check = compare(f"call {call} out {i}", got, r, w)
                assert check.ok, check
            else:
                assert torch.equal(got, w), f"call {call} out {i}: {(got != w).sum().item()} elements differ"

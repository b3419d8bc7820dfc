"""`aminmax` and F.avg_pool1d / F.max_pool1d over windows that tile the length, on the GPU: no
PyTorch op, outputs poisoned first; the max and min equal eager's bit for bit, the average within
DESIGN.md's 2x rule of a float64 reference; in the thin call and CUDA-graph replays."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 4), [(32, 256, 4096), (2, 3, 9)]),
    "max_pool1d": (lambda x: F.max_pool1d(x, 2) * 2, [(32, 256, 4096), (3, 5, 7)]),
    "aminmax rows": (lambda x: torch.aminmax(x, dim=-1), [(8192, 4096), (5, 33)]),
    "aminmax all": (lambda x: torch.aminmax(x), [(4096, 4096), (7, 3)]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,big", [(n, b) for n in CASES for b in (False, True)],
                         ids=[f"{n}-{'big' if b else 'odd'}" for n in CASES for b in (False, True)])
def test_pools_and_aminmax_on_the_gpu(name, big, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, shapes = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shapes[0] if big else shapes[1], device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    outs = lambda o: o if isinstance(o, tuple) else (o,)  # noqa: E731
    want, ref = outs(fn(x)), outs(float64_reference(fn, (x,)))
    for call in range(3):
        for i, (got, w, r) in enumerate(zip(outs(prog(x)), want, ref)):
            if name == "avg_pool1d":
                check = compare(f"call {call} out {i}", got, r, w)
                assert check.ok, check
            else:
                assert torch.equal(got, w), f"call {call} out {i}: {(got != w).sum().item()} elements differ"

"""loop/flat.py's merged rows on a GPU: kernels of maps alone whose row-level values (a
per-channel scale, a group's statistics) allow m neighbouring rows to be one, against a float64
reference (the 2x rule), outputs poisoned, in the thin call and replays."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

CASES = {  # fn, input shapes, the merged row length the plan must show
    "per channel 56x56": (lambda x, w, b: torch.relu(x * w + b), ((8, 32, 56, 56), (32, 1, 1), (32, 1, 1)), 1568),
    "per channel 28x28": (lambda x, w, b: torch.relu(x * w + b), ((64, 16, 28, 28), (16, 1, 1), (16, 1, 1)), 784),
    "per image 7x9": (lambda x, s: x * torch.sigmoid(s), ((512, 4, 7, 9), (512, 1, 1, 1)), 252),
    "scale 112": (lambda x: x * 2 - 1, ((16, 24, 112, 112),), None),
    "unaligned 1001": (lambda x: F.silu(x) * 3, ((4096, 1001),), 8008),
    "groupnorm silu": (lambda x, g: F.silu(F.group_norm(x, 8, g)), ((2, 64, 32, 32), (64,)), None),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_row_kernels_match_the_reference(case, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, shapes, length = CASES[case]
    torch.manual_seed(12)
    ins = tuple(torch.randn(s, device="cuda", dtype=dtype) for s in shapes)
    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    merged = [s.note for s in prog.plan.steps if "rows merged" in (s.note or "")]
    assert merged, str(prog.plan)
    if length is not None and dtype == torch.bfloat16:
        assert any(f"rows of {length} " in n for n in merged), merged
    ref, eager = float64_reference(fn, ins), fn(*ins)
    for call in range(3):
        c = compare(f"call {call}", prog(*ins), ref, eager)
        assert c.ok, c

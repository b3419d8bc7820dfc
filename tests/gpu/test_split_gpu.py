"""Few long rows cut into pieces on a GPU: maps (loop/flat.py's split rows) and reductions
(rewrites.split_long_reductions, with the maps they read in their kernel), against a float64
reference (the 2x rule), outputs poisoned, in the thin call and replays."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

CASES = {  # fn, input shapes, a note the plan must show (or None)
    "1-D map": (lambda x: torch.expm1(x * 2 + 1), ((1 << 22,),), "rows split"),
    "per-row gate": (lambda x, s: torch.sigmoid(x * s), ((4, 1 << 20), (4, 1)), "rows split"),
    "sum of squares": (lambda x: (x * x).sum(), ((1 << 22,),), None),
    "vector norm": (lambda x: torch.linalg.vector_norm(x), ((2048, 2048),), None),
    "mse": (lambda x, y: F.mse_loss(x, y), ((2048, 2048), (2048, 2048)), None),
    "row max": (lambda x: x.amax(-1), ((3, 1 << 18),), None),
    "row mean of exp": (lambda x: torch.exp(x * 0.5).mean(-1, keepdim=True), ((2, 1 << 19),), None),
    "1-D softmax": (lambda x: torch.softmax(x, 0), ((1 << 20,),), None),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_kernels_match_the_reference(case, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, shapes, note = CASES[case]
    torch.manual_seed(3)
    ins = tuple(torch.randn(s, device="cuda", dtype=dtype) for s in shapes)
    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    # no kernel is left with one row of more than 16k elements that it does not split
    lone = [s for s in prog.plan.steps if s.family == "mapreduce" and s.space[0] == () and s.space[1] > 16384
            and "rows split" not in (s.note or "")]
    assert not lone, str(prog.plan)
    if note:
        assert note in str(prog.plan), str(prog.plan)
    ref, eager = float64_reference(fn, ins), fn(*ins)
    for call in range(3):
        c = compare(f"call {call}", prog(*ins), ref, eager)
        assert c.ok, c

"""loop/flat.py on a GPU: kernels of maps alone over short rows, walked as rows of K
of the whole tensor, against a float64 reference (the 2x rule), in the thin call and replays."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = {
    "gate 14x14": (lambda x, s: x * torch.sigmoid(s), lambda d: ((32, 64, 14, 14), (32, 64, 1, 1))),
    "gate 7x7": (lambda x, s: x * torch.sigmoid(s), lambda d: ((64, 256, 7, 7), (64, 256, 1, 1))),
    "bias 49": (lambda x, b: torch.nn.functional.gelu(x + b), lambda d: ((4096, 49), (49,))),
    "scale and bias 51": (lambda x, s: x * s + s.mean(), lambda d: ((8, 64, 8, 51), (8, 64, 1, 1))),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_flat_map_kernels_match_the_reference(case, dtype, monkeypatch):
    """(Merged rows off: the gate's rows of 14 and the scale's rows of 51 would merge instead,
    tests/gpu/test_merged_rows_gpu.py)"""
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.loop import flat

    monkeypatch.setenv("TILEFUSE_MERGED_ROWS", "0")
    fn, shapes = CASES[case]
    torch.manual_seed(11)
    ins = tuple(torch.randn(s, device="cuda", dtype=dtype) for s in shapes(dtype))
    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    flats = [lw.kernel for lw in prog.kernels.values()
             if isinstance(lw.kernel.body[0].body[0], type(lw.kernel.body[0])) and lw.kernel.body[0].body[0].extent in flat.K_CHOICES]
    assert flats, str(prog.plan)
    ref, eager = float64_reference(fn, ins), fn(*ins)
    for call in range(3):
        c = compare(f"call {call}", prog(*ins), ref, eager)
        assert c.ok, c

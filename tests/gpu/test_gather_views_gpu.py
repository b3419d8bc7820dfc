"""Gathers whose table is a view, read where the view's tensor lies (tests/cpu/test_gather_views.py),
on the GPU: one kernel each, its output poisoned first, equal to eager's bit for bit (a gather
and a scale by 2 or 3 round nothing beyond what eager rounds), in the thin call and CUDA-graph
replays, at the CPU test's sizes and at sizes with many rows."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_gather_views import CASES, TRANSPOSED  # noqa: E402

BIG = {
    "rows of a slice": lambda: (torch.randn(32768, 4096), torch.randint(0, 64, (8192,))),
    "pad of a slice": lambda: (torch.randn(8192, 4096),),
    "flip of a slice": lambda: (torch.randn(8192, 4096),),
    "pad of a transpose": lambda: (torch.randn(1024, 2048),),
}


def _run(fn, ins, transposed=False):
    import tilefuse

    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    want_steps = (["extern"] if transposed else []) + ["mapreduce"]  # (a transposed table: PyTorch's copy)
    assert [s.family for s in prog.plan.steps if s.family != "alias" and not s.view] == want_steps, str(prog.plan)
    want = fn(*ins)
    for call in range(3):  # the thin call, then CUDA-graph replays
        got = prog(*ins)
        assert got.shape == want.shape
        assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_a_gather_of_a_view_equals_eager_bit_for_bit(name, dtype):
    fn, make = CASES[name]
    torch.manual_seed(0)
    ins = tuple((x.to(dtype) if x.is_floating_point() else x).cuda() for x in make())
    _run(fn, ins, name in TRANSPOSED)


@pytest.mark.parametrize("name", BIG)
def test_a_gather_of_a_view_at_model_sizes(name):
    fn = CASES[name][0]
    torch.manual_seed(1)
    ins = tuple((x.to(torch.bfloat16) if x.is_floating_point() else x).cuda() for x in BIG[name]())
    _run(fn, ins, name in TRANSPOSED)

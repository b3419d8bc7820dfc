"""Integer arithmetic that overflows, as generated CUDA kernels against eager on the GPU: int32
and int64 add, sub, mul, neg and abs wrap as PyTorch's do (session 79's GPU fuzz finding:
nvcc folded abs(-(x * x)) of `int`s into x * x), in maps and under a row sum and a cumsum.
Values are drawn across the whole range so most products overflow; outputs are poisoned first
and must equal eager's bit for bit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_scalars_gpu import _as_eager_on_the_gpu

pytestmark = pytest.mark.gpu



def _squared_in_place(x):
    t = x + 0
    t.pow_(2)
    return t


PROGRAMS = {
    "abs(-(x * x))": lambda x, y: torch.abs(-(x * x)),
    "x * y + x - y": lambda x, y: x * y + x - y,
    "abs of pow_(2) then neg": lambda x, y: _squared_in_place(x).neg().abs(),
    "abs(-(relu(x * y).sum))": lambda x, y: torch.abs(-(torch.relu(x * y).sum(-1, dtype=x.dtype))),
    "abs(-cumsum(x * y))": lambda x, y: torch.abs(-(x * y).cumsum(-1, dtype=x.dtype)),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_overflowing_integer_programs_equal_eager_on_the_gpu(name, dtype):
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(79)
    x, y = (torch.randint(info.min, info.max, (33, 257), generator=g, dtype=dtype) for _ in range(2))
    x[0, :4] = torch.tensor([info.min, info.max, -1, 0], dtype=dtype)
    _as_eager_on_the_gpu(name, PROGRAMS[name], (x, y), rtol=0)

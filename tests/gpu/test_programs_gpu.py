"""Whole programs on the GPU: generated kernels vs a float64 PyTorch reference (the 2x rule)."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.check import compare, flatten, float64_reference

pytestmark = pytest.mark.gpu


class AddRMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))

    def forward(self, x, res):
        h = x + res
        return h, F.rms_norm(h, (h.shape[-1],), self.weight, 1e-6).to(torch.bfloat16)


def _softmax(x):
    return torch.softmax(x, -1)


def _xent(x, t):
    return F.cross_entropy(x, t)


def _xent_rows(x, t):
    return F.cross_entropy(x, t, reduction="none")


def _gelu_mul(x, y):
    return F.gelu(x) * y + 1.0


def _programs(rows, cols, dtype):
    x = lambda: torch.randn(rows, cols, device="cuda", dtype=dtype)
    t = lambda: torch.randint(0, cols, (rows,), device="cuda")
    return [
        ("rmsnorm", torch.nn.RMSNorm(cols).cuda().to(dtype), lambda: (x(),)),
        ("layernorm", torch.nn.LayerNorm(cols).cuda().to(dtype), lambda: (x(),)),
        ("add_rmsnorm", AddRMSNorm(cols).cuda().to(dtype), lambda: (x(), x())),
        ("softmax", _softmax, lambda: (x(),)),
        ("cross_entropy", _xent, lambda: (x(), t())),
        ("cross_entropy_rows", _xent_rows, lambda: (x(), t())),
        ("gelu_mul", _gelu_mul, lambda: (x(), x())),
    ]


SHAPES = [(1, 1), (3, 5), (7, 4097), (33, 1000), (256, 4096), (8, 40000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_program_matches_float64_reference(shape, dtype):
    """Each program's outputs, written over NaN-poisoned buffers, pass the 2x rule on fresh inputs,
    both on the first call (the thin launch path) and the second (captured and replayed as a CUDA graph)."""
    for name, fn, make in _programs(*shape, dtype):
        prog = tilefuse.compile(fn, make())
        prog.poison = True
        for call in ("thin", "graph"):
            inputs = make()  # fresh inputs, not the ones it was compiled with
            out = flatten(prog(*inputs))
            with torch.no_grad():
                eager = flatten(fn(*inputs))
            ref = flatten(float64_reference(fn, inputs))
            for i, (o, r, e) in enumerate(zip(out, ref, eager)):
                c = compare(f"{name}[{i}]", o, r, e)
                assert c.ok, f"{name} {shape} {dtype} ({call} call): {c}"
        (info,) = prog.graph_info()
        assert info["graphs"] and info["replays"] == 1, f"{name}: {info}"

"""Programs made for a new cache length with no compile (runtime.resize), on the GPU.

Properties: a bf16 decode step (RMSNorm, a generated GEMM for Q/K/V, appending to a key/value
cache, attention, an output GEMM with the residual) made at cache lengths it was not compiled
for passes the 2x rule against a float64 reference on the thin path and on its CUDA-graph
replay, outputs poisoned first, and holds the family's compiled kernels (nothing compiled
again); through the torch.compile backend, a step called at 16 lengths compiles two and each
result passes the same rule.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tilefuse
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.frontend import backend as tb
from tilefuse.runtime import resize

pytestmark = pytest.mark.gpu

D, HEADS, HD = 256, 4, 64


class Decode(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.RMSNorm(D), nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x, k_cache, v_cache):
        q, k, v = self.qkv(self.norm(x)).view(1, 1, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(1, 1, D)), k, v


def _model():
    torch.manual_seed(0)
    return Decode().to("cuda", torch.bfloat16).eval()


def _inputs(length):
    return tuple(torch.randn(*s, device="cuda", dtype=torch.bfloat16)
                 for s in ((1, 1, D), (1, HEADS, length, HD), (1, HEADS, length, HD)))


def _check(name, prog, m, xs):
    for _ in range(3):  # the thin path (warm-up), the capture, a replay
        out = flatten(prog(*xs))
        ref, eager = flatten(float64_reference(m, xs)), flatten(m(*xs))
        for i, (o, r, e) in enumerate(zip(out, ref, eager)):
            c = compare(f"{name}[{i}]", o, r, e)
            assert c.ok, c


@torch.no_grad()
def test_a_program_made_at_a_new_length_passes_the_2x_rule_with_the_familys_kernels():
    m = _model()
    p0, p1 = tilefuse.compile(m, _inputs(16)), tilefuse.compile(m, _inputs(17))
    fam = resize.family(p0, p1)
    assert isinstance(fam, resize.Family), fam
    assert {s.family for s in p1.plan.steps} >= {"gemm", "extern"}
    _check("compiled", p1, m, _inputs(17))
    kernels = {id(k) for k in p1._compiled.values()}
    for length in (1, 37, 300):
        made = fam.at([tuple(x.shape) for x in _inputs(length)])
        assert made is not None
        made.poison = True
        _check(f"made at {length}", made, m, _inputs(length))
        assert {id(k) for k in made._compiled.values()} == kernels


@pytest.fixture
def fresh_backend():
    tb.register()
    torch._dynamo.reset()
    tb.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_backend")
@torch.no_grad()
def test_the_backend_compiles_two_lengths_and_makes_the_rest():
    m = _model()
    step = torch.compile(m, backend="tilefuse")
    for length in range(8, 24):
        xs = _inputs(length)
        out = flatten(step(*xs))
        ref, eager = flatten(float64_reference(m, xs)), flatten(m(*xs))
        for i, (o, r, e) in enumerate(zip(out, ref, eager)):
            c = compare(f"length {length}[{i}]", o, r, e)
            assert c.ok, c
    r = next(r for r in tb.reports() if r.variants > 1)
    assert r.calls_eager == 0 and r.resized == r.variants - 2, tb.summary()

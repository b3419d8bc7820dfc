"""The prelude's fast expm1, tanh and log1p on the GPU (their error bounds rest on the PTX ISA's
for ex2, rcp and lg2; tests/cpu/test_fast_functions.py checks the arithmetic around them): a map
kernel reading f32 and writing 16 bits takes them, and its results round as the float64 value
does but in rare ties, and then one unit in the last place away."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

FNS = {  # fn, the inputs' range: a uniform grid, plus values near 0 of both signs
    "expm1": (torch.expm1, (-20.0, 20.0)),
    "tanh": (torch.tanh, (-12.0, 12.0)),
    "log1p": (torch.log1p, (-0.999, 200.0)),
}


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(FNS))
def test_fast_functions_round_as_the_exact_value(name, out):
    import tilefuse
    from tilefuse.codegen.mapreduce import render

    fn, (lo, hi) = FNS[name]
    tiny = torch.logspace(-8, 0, 200_000, dtype=torch.float64)
    x = torch.cat([torch.linspace(lo, hi, 1_000_000, dtype=torch.float64), tiny, -tiny * min(1.0, -lo)])
    x = x.float().cuda()
    f = lambda x: fn(x).to(out)  # noqa: E731
    prog = tilefuse.compile(f, (x,))
    srcs = [render(lk.kernel).source for lk in prog.kernels.values()]
    assert any(f"tf_{name}_fast(" in s[s.index('extern "C"'):] for s in srcs), "the fast spelling was not used"
    prog.poison = True
    got = prog(x).double()
    exact = fn(x.double())
    want = exact.to(out).double()
    bits, tiny = (7, 2.0 ** -133) if out == torch.bfloat16 else (10, 2.0 ** -24)
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(tiny))) - bits).clamp_min(tiny)
    assert torch.equal(got.isnan(), want.isnan())
    same = (got == want) | want.isnan()
    near = same | ((got - want).abs() <= ulp)
    bad = (~near).nonzero().flatten()[:5].tolist()
    assert not bad, [(x[i].item(), got[i].item(), exact[i].item()) for i in bad]
    assert (~same).float().mean().item() < 1e-3, (~same).float().mean().item()

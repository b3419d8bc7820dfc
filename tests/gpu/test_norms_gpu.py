"""BatchNorm (inference), InstanceNorm, GroupNorm (+ SiLU) and hardswish as generated kernels,
against a float64 reference (the 2x rule), outputs poisoned first, thin call and replays."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _cases(filled):
    bn, gn, gn_small, inorm = (filled(nn.BatchNorm2d(64)), filled(nn.GroupNorm(32, 320)), filled(nn.GroupNorm(4, 12)),
                               filled(nn.InstanceNorm2d(64, affine=True)))
    gn_vae = filled(nn.GroupNorm(32, 128))
    return {
        "batchnorm relu": (lambda x: F.relu(bn(x)), (16, 64, 56, 56), [bn]),
        "groupnorm silu": (lambda x: F.silu(gn(x)), (2, 320, 64, 64), [gn]),
        "groupnorm odd": (gn_small, (3, 12, 7, 9), [gn_small]),
        "groupnorm vae": (lambda x: F.silu(gn_vae(x)), (1, 128, 256, 256), [gn_vae]),  # (32 rows of 262144)
        "instancenorm": (inorm, (8, 64, 56, 56), [inorm]),
        "hardswish": (lambda x: F.hardswish(x) * F.hardsigmoid(x), (64, 96, 28, 28), []),
        "mish": (lambda x: F.mish(x * 12), (64, 96, 28, 28), []),  # (x * 12: past the switch at 20 too)
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["batchnorm relu", "groupnorm silu", "groupnorm odd", "groupnorm vae", "instancenorm",
                                  "hardswish", "mish"])
def test_norms_match_the_reference(case, dtype, filled):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(13)
    fn, shape, mods = _cases(filled)[case]
    for m in mods:
        m.to("cuda", dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 1
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    with torch.no_grad():
        ref, eager = float64_reference(fn, [x]), fn(x)
        for call in range(3):
            c = compare(f"call {call}", prog(x), ref, eager)
            assert c.ok, c

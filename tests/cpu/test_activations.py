"""Activations lowered to maps (frontend/aten.py): ELU, SELU, CELU, softplus, Mish, log-sigmoid,
leaky ReLU, PReLU, ReLU6, threshold, hard/soft shrink, GLU. Each was a PyTorch op in the plan
(`tilefuse does not lower aten.mish`); now each joins the maps around it in one kernel, computes
what PyTorch computes (NaN, infinities and zeros among the values), and builds for the GPUs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.runtime.launch import compile_source_only

W = torch.randn(64)
ACTS = {
    "elu": lambda x: F.elu(x, 0.5), "selu": F.selu, "celu": lambda x: F.celu(x, 2.0),
    "softplus": lambda x: F.softplus(x, 2.0, 5.0), "mish": F.mish, "logsigmoid": F.logsigmoid,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "rrelu": lambda x: F.rrelu(x, 0.1, 0.3, training=False), "prelu": lambda x: F.prelu(x, W.to(x.dtype)), "relu6": F.relu6,
    "threshold": lambda x: F.threshold(x, 0.5, -2.0), "hardshrink": F.hardshrink, "softshrink": F.softshrink,
    "glu": F.glu,
}


def _x(dtype=torch.float32):
    x = torch.randn(16, 64) * 6
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    return x.to(dtype)


@pytest.mark.parametrize("name", sorted(ACTS))
def test_an_activation_is_one_kernel_with_its_neighbours(name):
    act = ACTS[name]
    fn = lambda x: act(x * 2 + 1) - 3  # noqa: E731
    x = _x()
    p = tilefuse.compile(fn, (x,))
    steps = [s for s in p.plan.steps if s.family != "alias" and not s.view]
    assert [s.family for s in steps] == ["mapreduce"] * len(steps) and len(steps) <= (2 if name == "glu" else 1), str(p.plan)
    torch.testing.assert_close(p(x), fn(x), equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_activation_kernels_build_without_spills(dtype, arch):
    x = _x(dtype)
    for name, act in ACTS.items():
        p = tilefuse.compile(act, (x,))
        for lw in p.kernels.values():
            src, cubin = compile_source_only(lw.kernel, arch)
            assert cubin.info.clean, f"{name} {arch} {src.schedule}: {cubin.info}"


def test_pixel_shuffle_then_a_map_is_one_kernel_reading_x_in_place():
    """F.pixel_shuffle as views (reshape, permute, reshape): the GELU after it reads x where it
    lies, in tiles (no copy); unshuffle likewise."""
    for fn, x in ((lambda x: F.gelu(F.pixel_shuffle(x, 2)), torch.randn(2, 16, 6, 5)),
                  (lambda x: F.pixel_unshuffle(x, 2).sigmoid() * 3, torch.randn(2, 4, 6, 8))):
        p = tilefuse.compile(fn, (x,))
        steps = [s for s in p.plan.steps if s.family != "alias" and not s.view]
        assert [s.family for s in steps] == ["mapreduce"] and steps[0].reads, str(p.plan)
        torch.testing.assert_close(p(x), fn(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mish_joins_a_gemms_epilogue(dtype):
    """mish(x @ w.T) is one GEMM: Mish's maps (exp of min(x, 20), a product, a division) are all
    float maps, which the epilogue takes (a `where` on a comparison, in an earlier form, stopped
    it: the GEMM wrote its f32 result and a map kernel read it back)."""
    x, w = torch.randn(256, 512, dtype=dtype), torch.randn(384, 512, dtype=dtype) * 0.05
    fn = lambda x, w: F.mish(x @ w.t())  # noqa: E731
    p = tilefuse.compile(fn, (x, w))
    assert [s.family for s in p.plan.steps if s.family != "alias" and not s.view] == ["gemm"], str(p.plan)
    torch.testing.assert_close(p(x, w).float(), fn(x, w).float(), rtol=2e-2, atol=2e-2)


def test_mish_at_its_extremes_matches_pytorch():
    """Around the clamp at 20 (the ratio n / (n + 2) is 1 there in f32 and f64), where exp(x)
    underflows, and at infinities and NaN: PyTorch's values (f64 within a few ulp)."""
    x = torch.cat([torch.linspace(-800, 800, 20001, dtype=torch.float64),
                   torch.tensor([19.99, 20.0, 20.01, 44.0, 89.0, float("inf"), -float("inf"), float("nan"), -0.0])])
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        p = tilefuse.compile(F.mish, (xd,))
        torch.testing.assert_close(p(xd), F.mish(xd), equal_nan=True, rtol=4 * torch.finfo(dtype).eps, atol=1e-30)

"""Vision and diffusion norms lowered to maps and reductions (frontend/aten.py): BatchNorm at
inference, InstanceNorm, GroupNorm, and MobileNetV3's hardswish / hardsigmoid. Each was an
aten op PyTorch ran for the plan (`tilefuse does not lower aten.group_norm`); the plans below
are what they become, the values the interpreter's against PyTorch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse.runtime.launch import compile_source_only


def _steps(p):
    return [s for s in p.plan.steps if s.family != "alias" and not s.view]


def test_batchnorm_then_relu_is_one_map_kernel(filled):
    bn = filled(nn.BatchNorm2d(16))
    fn = lambda x: F.relu(bn(x))  # noqa: E731
    x = torch.randn(4, 16, 9, 9)
    p = tilefuse.compile(fn, (x,))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and not any("reduce" in p.graph[n].describe() for n in s.nodes)
    with torch.no_grad():
        torch.testing.assert_close(p(x), fn(x))


def test_batchnorm_with_batch_statistics_stays_pytorchs():
    bn = nn.BatchNorm2d(8, track_running_stats=False).eval()  # (no running statistics: batch ones, even in eval)
    x = torch.randn(4, 8, 5, 5)
    p = tilefuse.compile(bn, (x,))
    (s,) = _steps(p)
    assert s.family == "extern" and "batch statistics" in s.note, str(p.plan)
    with torch.no_grad():
        torch.testing.assert_close(p(x), bn(x))


def test_instance_norm_is_one_row_kernel(filled):
    """Mean and variance over each channel's H x W (merged: graph/rules/merged_reductions.py),
    x - mean computed once for both, the normalised value in the same kernel."""
    m = filled(nn.InstanceNorm2d(64, affine=True))
    x = torch.randn(8, 64, 12, 12)
    p = tilefuse.compile(m, (x,))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and s.space == ((8, 64), 144), str(p.plan)
    with torch.no_grad():
        torch.testing.assert_close(p(x), m(x), rtol=1e-5, atol=1e-5)


def test_instance_norm_before_a_conv_and_at_few_rows_is_one_kernel(filled):
    """Before a conv (a PyTorch op reading the result: written anyway), at batch 1 (64 rows), and
    in bf16 (the f32 cast read through the [N, C, L] view in the kernel, not a kernel of its own):
    one row kernel each (a review's findings: 4, 5 and 4 steps)."""
    conv = nn.Conv2d(40, 8, 3).eval()
    inorm = filled(nn.InstanceNorm2d(64, affine=True))
    cases = [(lambda x: conv(F.instance_norm(x)), torch.randn(8, 40, 6, 6), ["mapreduce", "extern"]),
             (inorm, torch.randn(1, 64, 20, 20), ["mapreduce"]),
             (nn.InstanceNorm2d(64).eval(), torch.randn(8, 64, 12, 12).bfloat16(), ["mapreduce"])]
    for fn, x, families in cases:
        p = tilefuse.compile(fn, (x,))
        assert [s.family for s in _steps(p)] == families, str(p.plan)
        with torch.no_grad():
            want = fn(x)
        torch.testing.assert_close(p(x).float(), want.float(), rtol=1e-2 if x.dtype == torch.bfloat16 else 1e-5,
                                   atol=5e-2 if x.dtype == torch.bfloat16 else 1e-5)


def test_a_bf16_group_norm_is_two_kernels(filled):
    gn = filled(nn.GroupNorm(8, 64)).bfloat16()
    x = torch.randn(2, 64, 10, 10).bfloat16()
    p = tilefuse.compile(lambda x: F.silu(gn(x)), (x,))
    assert [s.family for s in _steps(p)] == ["mapreduce", "mapreduce"], str(p.plan)


def test_hardshrink_compares_in_the_inputs_type():
    """lambda rounded to bf16 (0.3 -> 0.30078125) and compared there, as PyTorch's kernels do:
    0.30078125 shrinks to 0 (compared in f32 with 0.3 it stayed)."""
    x = torch.tensor([0.30078125, -0.30078125, 0.3046875, float("nan")], dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x: F.hardshrink(x, 0.3), (x,))
    torch.testing.assert_close(p(x), F.hardshrink(x, 0.3), equal_nan=True)


@pytest.mark.parametrize("shape", [(2, 32, 16, 16), (3, 12, 5), (4, 6)], ids=str)
def test_group_norm_then_silu_is_two_kernels(shape, filled):
    """The groups' statistics (rows of C / G x H x W), then one map kernel over x's shape that
    normalises, scales and takes the SiLU, reading the [N, G] statistics broadcast to channels
    in place (no copy, no PyTorch op)."""
    gn = filled(nn.GroupNorm(shape[1] // 2 if shape[1] > 8 else 3, shape[1]))
    fn = lambda x: F.silu(gn(x))  # noqa: E731
    x = torch.randn(shape)
    p = tilefuse.compile(fn, (x,))
    stats, apply = _steps(p)
    assert stats.family == apply.family == "mapreduce", str(p.plan)
    assert stats.space == ((shape[0], gn.num_groups), x.numel() // (shape[0] * gn.num_groups))
    assert "sigmoid" in {getattr(p.graph[n], "op", None) for n in apply.nodes}
    assert len(shape) == 2 or apply.reads  # (over [N, C] the statistics' views are made in the stats kernel)
    with torch.no_grad():
        torch.testing.assert_close(p(x), fn(x), rtol=1e-5, atol=1e-5)


def test_hardswish_joins_the_maps_around_it():
    fn = lambda x: F.hardswish(x * 2) + F.hardsigmoid(x)  # noqa: E731
    x = torch.linspace(-5, 5, 1001).reshape(7, 143)
    p = tilefuse.compile(fn, (x,))
    assert len(_steps(p)) == 1
    torch.testing.assert_close(p(x), fn(x))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_norm_kernels_build_without_spills(dtype, arch, filled):
    gn = filled(nn.GroupNorm(32, 320)).to(dtype)
    inorm = filled(nn.InstanceNorm2d(64, affine=True)).to(dtype)
    for fn, x in [(lambda x: F.silu(gn(x)), torch.randn(2, 320, 32, 32)), (inorm, torch.randn(4, 64, 28, 28))]:
        p = tilefuse.compile(fn, (x.to(dtype),))
        for lw in p.kernels.values():
            src, cubin = compile_source_only(lw.kernel, arch)
            assert cubin.info.clean, f"{lw.kernel.name} {arch} {src.schedule}: {cubin.info}"

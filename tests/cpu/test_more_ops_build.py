"""The ops added in session 60 (ceil, round, log10, tan, atan, asin, acos, sinh, cosh, asinh,
acosh, atanh, erfc, lgamma, atan2, hypot, fmod, copysign): every one has a C++ spelling, and a
map kernel using all of them builds for sm_90a and sm_80 in bf16, f32 and f64 with no spills
(their values are the interpreter's: tests/cpu/test_graph_interp.py)."""
from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse.codegen import cexpr
from tilefuse.runtime.launch import compile_source_only

NEW = ("ceil", "round", "log10", "tan", "atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh",
       "erfc", "lgamma", "atan2", "hypot", "fmod", "copysign")


def _all(x, y):
    u = x.clamp(-0.9, 0.9)
    return (torch.ceil(x) + torch.round(x) + torch.log10(x.abs() + 1) + torch.tan(u) + torch.atan(x) + torch.asin(u)
            + torch.acos(u) + torch.sinh(u) + torch.cosh(u) + torch.asinh(x) + torch.acosh(x.abs() + 1) + torch.atanh(u)
            + torch.erfc(x) + torch.lgamma(x.abs() + 0.5) + torch.atan2(x, y) + torch.hypot(x, y) + torch.fmod(x, y)
            + torch.copysign(x, y) + torch.remainder(x, y))


def test_every_new_op_is_spelled():
    assert not cexpr.check_all_ops_spelled()
    for name in NEW:
        arity = 2 if name in ("atan2", "hypot", "fmod", "copysign") else 1
        assert cexpr.op(name, ["a", "b"][:arity], ["f32"] * arity, "f32").startswith(f"{'rint' if name == 'round' else name}f(")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_a_kernel_of_every_new_op_builds_without_spills(dtype, arch):
    x, y = torch.randn(64, 256, dtype=dtype), torch.randn(64, 256, dtype=dtype)
    p = tilefuse.compile(_all, (x, y))
    assert not [s for s in p.plan.steps if s.family == "extern"], str(p.plan)
    ops = {n.op for n in p.graph.nodes if hasattr(n, "op")}
    assert set(NEW) <= ops, set(NEW) - ops
    for lk in p.kernels.values():
        _, cubin = compile_source_only(lk.kernel, arch)
        assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info
        # (f64 tan's argument reduction is libdevice's call with a stack frame, as f64 sin's is)
        assert cubin.info.clean or dtype == torch.float64, cubin.info
    torch.testing.assert_close(p(x, y).double(), _all(x.double(), y.double()),
                               rtol=0.05 if dtype == torch.bfloat16 else 1e-4, atol=0.2 if dtype == torch.bfloat16 else 1e-4)

"""The CPU cases of test_scalars_and_int_ops.py as generated CUDA kernels: Python numbers
beside bool and integer tensors (i64 beside bool, wrapped into u8/i8), integer ops run in
PyTorch, float arange, softmax(dtype=f64), mse/l1 losses, addmm's beta and alpha in bf16; Python
floats beside bf16/f16 tensors (kept in arithmetic, rounded in comparisons, clamp, where, pow),
where eager on the GPU is the expectation for the additions too (its CPU kernels round there);
mixed dtypes, 0-d operands, alpha and values folded at compile time, as PyTorch promotes them.
Each compared with eager on the GPU, dtype and value; outputs poisoned before each kernel."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tilefuse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_scalars_and_int_ops import ADDS_16, CASES, MIXED, SCALARS_16, ULP  # noqa: E402

pytestmark = pytest.mark.gpu


def _as_eager_on_the_gpu(name, fn, inputs, rtol, atol=0):
    """The program's outputs (poisoned first) have eager's dtypes and values on the GPU."""
    inputs = tuple(x.cuda() for x in inputs)
    prog = tilefuse.compile(fn, inputs)
    prog.poison = True
    want, got = torch.utils._pytree.tree_leaves(fn(*inputs)), torch.utils._pytree.tree_leaves(prog(*inputs))
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype, f"{name}: {g.dtype} against eager's {w.dtype}"
        tol = (rtol, atol) if w.is_floating_point() else (0, 0)
        torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1], equal_nan=True)


@pytest.mark.parametrize("name,fn,x", CASES, ids=[c[0] for c in CASES])
def test_same_dtype_and_values_as_eager_on_the_gpu(name, fn, x):
    _as_eager_on_the_gpu(name, fn, (x,), rtol=1e-6)


CASES_16 = SCALARS_16 + [(name, fn, x) for name, fn, _, x in ADDS_16]


@pytest.mark.parametrize("name,fn,x", CASES_16, ids=[c[0] for c in CASES_16])
def test_a_float_beside_a_16_bit_tensor_as_eager_on_the_gpu(name, fn, x):
    _as_eager_on_the_gpu(name, fn, (x,), rtol=ULP.get(name, 0))


@pytest.mark.parametrize("name,fn,f32_once,x", ADDS_16, ids=[c[0] for c in ADDS_16])
def test_eager_on_the_gpu_adds_a_float_to_a_16_bit_tensor_in_f32(name, fn, f32_once, x):
    """What the CPU test expects of tilefuse is what eager does on the GPU."""
    x = x.cuda()
    torch.testing.assert_close(fn(x), f32_once(x), rtol=0, atol=0)


@pytest.mark.parametrize("name,fn,inputs", MIXED, ids=[c[0] for c in MIXED])
def test_mixed_dtypes_and_folded_values_as_eager_on_the_gpu(name, fn, inputs):
    _as_eager_on_the_gpu(name, fn, inputs, rtol=1e-5, atol=1e-5)  # SDPA: PyTorch's attention kernel against ours


@pytest.mark.parametrize("fn", [lambda a, b: F.mse_loss(a, b), lambda a, b: F.l1_loss(a, b, reduction="none"),
                                lambda a, b: F.softmax(a, -1, dtype=torch.float64) + b.double()],
                         ids=["mse", "l1 none", "softmax f64"])
def test_losses_and_f64_softmax_on_the_gpu(fn):
    torch.manual_seed(0)
    a, b = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    prog = tilefuse.compile(fn, (a, b))
    prog.poison = True
    want, got = fn(a, b), prog(a, b)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta,alpha", [(0.5, 2.0), (0, 1)])
def test_addmm_beta_alpha_bf16_gemm(beta, alpha):
    """bf16 operands take the generated GEMM; within 2x of eager's error against float64."""
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(1)
    dt = torch.bfloat16
    c, a, b = (torch.randn(256, 512, device="cuda", dtype=dt), torch.randn(256, 384, device="cuda", dtype=dt),
               torch.randn(384, 512, device="cuda", dtype=dt))
    fn = lambda c, a, b: torch.addmm(c, a, b, beta=beta, alpha=alpha)  # noqa: E731
    prog = tilefuse.compile(fn, (c, a, b))
    prog.poison = True
    res = compare("addmm", prog(c, a, b), float64_reference(fn, (c, a, b)), fn(c, a, b))
    assert res.ok, res

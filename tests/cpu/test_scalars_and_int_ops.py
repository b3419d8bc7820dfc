"""Python numbers beside tensors, and integer ops, lowered as PyTorch computes them.

Properties: a Python int beside a bool tensor is an i64 (not True), a float beside an integer
tensor is f32, an int beside an integer tensor wraps into its dtype (u8 + 300 adds 44), and a
float op (div) takes the int exactly; ops whose integer meaning differs from the float one
(~ on integers, integer powers) run in PyTorch, not as the float op; addmm keeps beta and alpha,
rsub its positional alpha; a float arange is the integer one cast; a result whose size depends
on the data is refused in one line. Every case is compared with eager, dtype and value.

Beside a bf16/f16 tensor a Python float keeps its value in arithmetic, as PyTorch's CUDA
kernels keep it in f32 (`f16 * 1e5` is 100.06 at 1e-3, not inf), and is rounded to the
tensor's dtype in comparisons, clamp, where and pow's exponent, as they round it. PyTorch's CPU
kernels round it in add and sub too; there the f32 result rounded once is the expectation. A
number PyTorch refuses to convert (clamp's bounds, alpha, an integer where) is refused in
capture; one it wraps (u8 clamp min=-1) gives PyTorch's result.
"""
from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse.frontend.capture import CaptureError

X = torch.tensor([0.5, -1.0, 2.0, 0.0])
U8 = torch.tensor([0, 1, 200, 255], dtype=torch.uint8)
I8 = torch.tensor([100, -100, 0, 127], dtype=torch.int8)
I64 = torch.tensor([257, 1001, 3001, -7])

CASES = [
    ("where int scalars", lambda x: torch.where(x > 0, 2, 5), X),
    ("where negative int scalars", lambda x: torch.where(x > 0, -1, 1), X),
    ("where float and int", lambda x: torch.where(x > 0, 2.5, 7), X),
    ("bool + int", lambda x: (x > 0) + 3, X),
    ("bool * int", lambda x: (x > 0) * 3, X),
    ("bool == int", lambda x: (x > 0) == 3, X),
    ("bool / int", lambda x: (x > 0) / 3, X),
    ("rsub alpha", lambda x: torch.rsub(x, 2.0, alpha=3), X),
    ("add.Scalar alpha", lambda x: torch.add(x, 2.0, alpha=3), X),
    ("u8 + negative", lambda t: t + (-2), U8),
    ("u8 + 300", lambda t: t + 300, U8),
    ("u8 * 300", lambda t: t * 300, U8),
    ("u8 == -1", lambda t: t == -1, U8),
    ("u8 / 300", lambda t: t / 300, U8),
    ("i8 > 200", lambda t: t > 200, I8),
    ("u8 * 2.5", lambda t: t * 2.5, U8),
    ("~u8", lambda t: ~t, U8),
    ("~i64", lambda t: ~t, I64),
    ("~bool", lambda x: ~(x > 0), X),
    ("i64 ** 3", lambda t: t ** 3, I64),
    ("i64 ** 2", lambda t: t ** 2, I64),
    ("i64 ** 2.0 is a float", lambda t: t ** 2.0, I64),
    ("i64 ** 0.5", lambda t: t.abs() ** 0.5, I64),
    ("float arange", lambda x: x + torch.arange(4, dtype=torch.float32, device=x.device), X),
    ("bf16 arange with a step", lambda x: x + torch.arange(1, 9, 2, dtype=torch.bfloat16, device=x.device).float(), X),
    ("RoPE frequencies", lambda x: x * (1 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32, device=x.device) / 8))), X),
]


@pytest.mark.parametrize("name,fn,x", CASES, ids=[c[0] for c in CASES])
def test_same_dtype_and_values_as_eager(name, fn, x):
    want, got = fn(x), tilefuse.compile(fn, (x,))(x)
    assert got.dtype == want.dtype, f"{name}: {got.dtype} against eager's {want.dtype}"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)


H = torch.tensor([1e-3, 0.1, 3.0, -2.5, 0.5], dtype=torch.float16)
B = torch.tensor([1e-3, 0.1, 3.0, -2.5, 0.75], dtype=torch.bfloat16)

# the same on PyTorch's CPU and CUDA kernels
SCALARS_16 = [
    ("f16 * 1e5", lambda x: x * 1e5, H),
    ("f16 / 1e-5", lambda x: x / 1e-5, H),
    ("bf16 * 257", lambda x: x * 257.0, B),
    ("bf16 * int 257", lambda x: x * 257, B),
    ("f16 >= 0.1 (rounded)", lambda x: x >= 0.1, H),
    ("bf16 == 0.1 (rounded)", lambda x: x == 0.1, B),
    ("bf16 clamp max 257 (rounded)", lambda x: torch.clamp(x * 100, max=257.0), B),
    ("f16 where 2049 (rounded)", lambda x: torch.where(x > 0.05, x, 2049.0), H),
    # powf's last bit may differ between libraries: 1 ulp allowed, 1/4 of the exponent's rounding
    ("f16 ** 2.01 (rounded)", lambda x: (x.abs() * 40) ** 2.01, H),
    ("bf16 ** 8.01 (rounded)", lambda x: x.abs() ** 8.01, B),
]
ULP = {"f16 ** 2.01 (rounded)": 1e-3, "bf16 ** 8.01 (rounded)": 8e-3}

# PyTorch's CUDA kernels add in f32 with the number's own value; its CPU kernels round it first
ADDS_16 = [
    ("f16 + 2049", lambda x: x + 2049.0, lambda x: (x.float() + 2049.0).to(x.dtype), H),
    ("bf16 - 257", lambda x: x - 257.0, lambda x: (x.float() - 257.0).to(x.dtype), B),
    ("257 - bf16", lambda x: 257.0 - x, lambda x: (257.0 - x.float()).to(x.dtype), B),
    ("f16 + alpha 2049", lambda x: torch.add(x, torch.ones_like(x), alpha=2049.0),
     lambda x: (x.float() + 2049.0).to(x.dtype), H),
]


@pytest.mark.parametrize("name,fn,x", SCALARS_16, ids=[c[0] for c in SCALARS_16])
def test_a_float_beside_a_16_bit_tensor_as_eager(name, fn, x):
    want, got = fn(x), tilefuse.compile(fn, (x,))(x)
    assert got.dtype == want.dtype, f"{name}: {got.dtype} against eager's {want.dtype}"
    torch.testing.assert_close(got, want, rtol=ULP.get(name, 0), atol=0, equal_nan=True)


@pytest.mark.parametrize("name,fn,f32_once,x", ADDS_16, ids=[c[0] for c in ADDS_16])
def test_a_float_added_to_a_16_bit_tensor_keeps_its_value(name, fn, f32_once, x):
    got = tilefuse.compile(fn, (x,))(x)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, f32_once(x), rtol=0, atol=0)


def test_a_16_bit_tensor_made_from_a_number_holds_the_rounded_number():
    """torch.full makes a tensor: its value is rounded to bf16 before it is used (257 -> 256)."""
    fn = lambda x: x + torch.full((5,), 257.0, dtype=torch.bfloat16)  # noqa: E731
    torch.testing.assert_close(tilefuse.compile(fn, (B,))(B), fn(B), rtol=0, atol=0)


@pytest.mark.parametrize("beta,alpha", [(0.5, 2.0), (1, 3), (2, 1), (0, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_addmm_keeps_beta_and_alpha(beta, alpha, dtype):
    """beta = 0 ignores the input altogether, NaN included, as PyTorch does."""
    torch.manual_seed(0)
    c, a, b = torch.randn(3, 5, dtype=dtype), torch.randn(3, 4, dtype=dtype), torch.randn(4, 5, dtype=dtype)
    if beta == 0:
        c[0, 0] = float("nan")
    fn = lambda c, a, b: torch.addmm(c, a, b, beta=beta, alpha=alpha)  # noqa: E731
    torch.testing.assert_close(tilefuse.compile(fn, (c, a, b))(c, a, b), fn(c, a, b))


@pytest.mark.parametrize("fn", [lambda x: x[x > 0] * 2, lambda x: torch.nonzero(x > 0),
                                lambda x: torch.masked_select(x, x > 0)], ids=["mask index", "nonzero", "masked_select"])
def test_a_data_dependent_size_is_refused_in_one_line(fn):
    with pytest.raises(CaptureError, match=r"size that depends on the tensors' values") as e:
        tilefuse.compile(fn, (torch.randn(2, 4),))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fn,x", [
    (lambda t: torch.clamp(t, max=300), U8), (lambda t: torch.where(t > 1, t, 300), U8),
    (lambda t: torch.add(t, t, alpha=300), U8), (lambda t: torch.clamp(t, min=-200), I8),
    (lambda x: torch.clamp(x, max=1e6), H), (lambda x: torch.add(x, x, alpha=1e6), H),
], ids=["u8 clamp 300", "u8 where 300", "u8 alpha 300", "i8 clamp -200", "f16 clamp 1e6", "f16 alpha 1e6"])
def test_a_number_pytorch_cannot_convert_is_refused_as_pytorch_refuses_it(fn, x):
    with pytest.raises(RuntimeError, match="without overflow"):
        fn(x)
    with pytest.raises(CaptureError, match=r"cannot be converted to \w+ without overflow"):
        tilefuse.compile(fn, (x,))


@pytest.mark.parametrize("fn,x", [
    (lambda t: torch.clamp(t, min=-1), U8), (lambda t: torch.where(t > 1, t, -255), U8),
    (lambda t: t + 300, U8), (lambda x: torch.where(x > 1, x, 1e6), H),
], ids=["u8 clamp -1 wraps", "u8 where -255 wraps", "u8 + 300 wraps", "f16 where 1e6 is inf"])
def test_a_number_pytorch_converts_gives_its_result(fn, x):
    torch.testing.assert_close(tilefuse.compile(fn, (x,))(x), fn(x), rtol=0, atol=0)

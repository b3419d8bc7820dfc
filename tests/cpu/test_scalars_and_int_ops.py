"""Python numbers beside tensors, and integer ops, lowered as PyTorch computes them.

Properties: a Python int beside a bool tensor is an i64 (not True), a float beside an integer
tensor is f32, an int beside an integer tensor wraps into its dtype (u8 + 300 adds 44), and a
float op (div) takes the int exactly; ops whose integer meaning differs from the float one
(~ on integers, integer powers) run in PyTorch, not as the float op; addmm keeps beta and alpha,
rsub its positional alpha; a float arange is the integer one cast; a result whose size depends
on the data is refused in one line. Every case is compared with eager, dtype and value.
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

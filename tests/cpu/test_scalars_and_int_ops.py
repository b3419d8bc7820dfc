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

Mixed dtypes follow PyTorch's type promotion: a 0-d tensor raises the common dtype only from a
higher category (`u8 > torch.tensor(300)` compares in u8), operands are converted to it before
the op (an integer beside bf16 is rounded to bf16 first), alpha multiplies in the result's dtype;
values folded at compile time keep their dtypes (`~full_like(u8, 1)` is 254).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.frontend.aten import Unsupported
from tilefuse.frontend.capture import CaptureError
from tilefuse.graph import ir

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
    # inside a fused chain, where no store rounds it afterwards: 256 + 0.5 and 2048 + 1 stay 256, 2048
    ("bf16 clamp max 257, + 0.5", lambda x: torch.clamp(x * 1000, max=257.0) + 0.5, B),
    ("f16 where 2049, + 1", lambda x: torch.where(x > 0.05, x, 2049.0) + 1.0, H),
    # powf's last bit may differ between libraries: 1 ulp allowed, 1/4 of the exponent's rounding
    ("f16 ** 2.01 (rounded)", lambda x: (x.abs() * 40) ** 2.01, H),
    ("bf16 ** 8.01 (rounded)", lambda x: x.abs() ** 8.01, B),
    ("2.01 ** f16 (base rounded)", lambda x: torch.pow(2.01, x.abs() * 0 + 8), H),
    ("2.01 ** bf16 (base rounded)", lambda x: torch.pow(2.01, x.abs() * 0 + 8), B),
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
    (lambda x: x ** 1e5, H), (lambda x: x + torch.full((5,), 1e6, dtype=torch.float16), H),
    (lambda t: t + torch.full_like(t, 300), U8),
], ids=["u8 clamp 300", "u8 where 300", "u8 alpha 300", "i8 clamp -200", "f16 ** 1e5", "full f16 1e6",
        "full_like u8 300"])
def test_a_number_pytorch_cannot_convert_is_refused_as_pytorch_refuses_it(fn, x):
    """(on the CPU and, measured on an H100, on the GPU)"""
    with pytest.raises(RuntimeError, match="without overflow"):
        fn(x)
    with pytest.raises(CaptureError, match=r"cannot be converted to \w+ without overflow"):
        tilefuse.compile(fn, (x,))


def test_a_16_bit_where_number_is_refused_as_pytorchs_cuda_kernels_refuse_it():
    """torch.where(c, f16, 1e6): an error on the GPU (H100, torch 2.11), inf on the CPU."""
    with pytest.raises(CaptureError, match="cannot be converted to f16 without overflow"):
        tilefuse.compile(lambda x: torch.where(x > 1, x, 1e6), (H,))


@pytest.mark.parametrize("fn,x", [
    (lambda t: torch.clamp(t, min=-1), U8), (lambda t: torch.where(t > 1, t, -255), U8),
    (lambda t: t + 300, U8),
], ids=["u8 clamp -1 wraps", "u8 where -255 wraps", "u8 + 300 wraps"])
def test_a_number_pytorch_converts_gives_its_result(fn, x):
    torch.testing.assert_close(tilefuse.compile(fn, (x,))(x), fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("fn,want", [
    (lambda x: torch.clamp(x, max=1e6), lambda x: x),
    (lambda x: torch.add(x, x, alpha=1e6), lambda x: (x.float() + 1e6 * x.float()).to(x.dtype)),
], ids=["f16 clamp 1e6", "f16 alpha 1e6"])
def test_16_bit_clamp_bounds_and_alpha_are_taken_in_f32_as_on_the_gpu(fn, want):
    """PyTorch's CUDA kernels take these in f32 (H100, torch 2.11); its CPU kernels refuse them."""
    torch.testing.assert_close(tilefuse.compile(fn, (H,))(H), want(H), rtol=0, atol=0)


def _sdpa_with_a_full_mask(q):
    return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.full((4, 4), -1e4, device=q.device).triu(1))


_I32, _I8 = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([50, -3], dtype=torch.int8)
_U8 = torch.tensor([50, 200], dtype=torch.uint8)

# (name, fn, inputs): PyTorch's type promotion (the result dtype, and the operands converted to
# it before the op), alpha in the result's dtype, integer floor, bool max/min indices, values
# folded at compile time in their own dtypes, a returned matmul in its own dtype (not the f32 of
# the residual epilogue it also feeds), view(dtype) as the same bits, empty slices; each
# compared with eager exactly (the matmul's small integers sum exactly)
MIXED = [
    ("i32 + alpha 100 i8 (no i8 wrap)", lambda a, b: torch.add(a, b, alpha=100), (_I32, _I8)),
    ("i64 - alpha 2 u8 (no u8 wrap)", lambda a, b: torch.sub(a, b, alpha=2),
     (torch.tensor([1000, 2]), torch.tensor([200, 3], dtype=torch.uint8))),
    ("rsub i8, i32, alpha 100", lambda a, b: torch.rsub(a, b, alpha=100), (_I8, _I32)),
    ("f16 + alpha 255 bf16 (in f32)", lambda a, b: torch.add(a, b, alpha=255),
     (torch.tensor([1.5, -3.0], dtype=torch.float16), torch.tensor([1.3984375, 7.0], dtype=torch.bfloat16))),
    ("floor of i64 is itself", lambda a: torch.floor(a), (torch.tensor([16777217, 2**40 + 1]),)),
    ("i64 == bf16 (257 is bf16 256)", lambda a, b: a == b,
     (torch.tensor([257, 2049]), torch.tensor([256.0, 2048.0], dtype=torch.bfloat16))),
    ("i64 == f16", lambda a, b: a == b, (torch.tensor([2049]), torch.tensor([2048.0], dtype=torch.float16))),
    ("i64 * bf16 (257 rounded first)", lambda a, b: a * b,
     (torch.tensor([257, 3]), torch.tensor([1.5, 1.5], dtype=torch.bfloat16))),
    ("u8 > 0-d i64 300 (in u8)", lambda a, s: a > s, (_U8, torch.tensor(300))),
    ("maximum u8, 0-d i64", lambda a, s: torch.maximum(a, s), (_U8, torch.tensor(300))),
    ("minimum i32, 0-d i64", lambda a, s: torch.minimum(a, s),
     (torch.tensor([5, -5], dtype=torch.int32), torch.tensor(2**32 + 1))),
    ("f32 > 0-d f64 (in f32)", lambda a, s: a > s, (torch.tensor([0.1]), torch.tensor(0.1, dtype=torch.float64))),
    ("f16 == 0-d f32 (in f16)", lambda a, s: a == s, (torch.tensor([0.1], dtype=torch.float16), torch.tensor(0.1))),
    ("where u8 < 0-d i64", lambda a, s: torch.where(a < s, a, 2), (_U8, torch.tensor(256))),
    ("~full_like(u8) folded as u8", lambda x: torch.bitwise_not(torch.full_like(x, 1)).float() * x,
     (torch.tensor([3, 0], dtype=torch.uint8),)),
    ("sgn(~ones_like(u8))", lambda x: torch.sgn(~torch.ones_like(x)), (torch.tensor([3, 0], dtype=torch.uint8),)),
    ("full f32 triu mask + x", lambda x: torch.full((3, 3), -1e4, device=x.device).triu(1) + x, (torch.zeros(3, 3),)),
    ("x / floor_divide of ones", lambda x: x / torch.floor_divide(torch.ones_like(x), torch.ones_like(x)),
     (torch.tensor([[1.5, -2.0, 3.25]]),)),
    ("sdpa with a full().triu mask", _sdpa_with_a_full_mask, (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0)),)),
    ("a returned matmul keeps its bf16", lambda a, b, r: (lambda v: (v + r, v))(a @ b),
     tuple(torch.randint(-3, 4, s, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
           for s in ((8, 16), (16, 8), (8, 8)))),
    ("f32 .view(i32) is the bits", lambda x: x.view(torch.int32) + 1, (torch.tensor([1.0, -2.5, 3.0]),)),
    ("f32 .view(u8).sum()", lambda x: x.view(torch.uint8).sum(), (torch.tensor([1.0, -2.5, 3.0]),)),
    ("x[3:1] is empty", lambda a: a[3:1].sum(0) + 1, (torch.ones(4, 6),)),
    ("x[:, -1:-3] is empty", lambda a: (a[:, -1:-3], a * 2), (torch.ones(4, 6),)),
    ("max(bool, dim)", lambda x: torch.max(x, dim=-1), (torch.tensor([[True, False], [False, False]]),)),
    ("min(bool, dim) indices", lambda x: torch.min(x, dim=0)[1], (torch.tensor([[True, False], [False, False]]),)),
]


@pytest.mark.parametrize("name,fn,inputs", MIXED, ids=[c[0] for c in MIXED])
def test_mixed_dtypes_and_folded_values_as_eager(name, fn, inputs):
    want, got = fn(*inputs), tilefuse.compile(fn, inputs)(*inputs)
    want, got = torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype, f"{name}: {g.dtype} against eager's {w.dtype}"
        torch.testing.assert_close(g, w, rtol=1e-6 if w.is_floating_point() else 0, atol=1e-6 if w.is_floating_point() else 0)


@pytest.mark.parametrize("beta,alpha,want", [(0.5, 1, Unsupported), (1, 2.0, None)])
def test_integer_addmm_with_float_factors(beta, alpha, want):
    """A fractional beta/alpha on integer tensors runs in PyTorch (which truncates it); a whole
    one is an integer factor, not an f32 one (16777217 * 2 stays exact)."""
    b, x, w = torch.tensor([[0]]), torch.tensor([[16777217]]), torch.tensor([[1]])
    fn = lambda b, x, w: torch.addmm(b, x, w, beta=beta, alpha=alpha)  # noqa: E731
    prog = tilefuse.compile(fn, (b, x, w))
    assert prog(b, x, w).tolist() == fn(b, x, w).tolist()
    externs = [n.target for n in prog.stages.graph.nodes if isinstance(n, ir.Extern)]
    assert ("aten.addmm.default" in externs) == (want is Unsupported), externs

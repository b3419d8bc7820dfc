"""Programs a fuzz of random programs on the GPU found wrong (session 29), each now as eager:
a float converted to uint8 (PyTorch goes through int64, so -1.5 is 255, where the GPU's own
conversion saturates to 0); max, min and relu of 8-bit integers and cluster-wide reductions of
bool and uint8 rows (their kernels did not compile); integer and bool matmuls (PyTorch's matmul
refuses them on CUDA, einsum reaches them); torch.norm and F.normalize (their norm is lowered; it
ran as an extern, typed with the shape torch.export gave it, which PyTorch 2.11 gets wrong over a
dim of size 1; that case is now refused in one line); clamp_min / clamp_max; a negative fill
of a uint8 tensor (it wraps); x ** 0.

Each program gives eager's dtype and values through the interpreter, and its kernels compile
through NVRTC for sm_90a and sm_80 without a GPU (tests/gpu/test_int_casts_and_norms_gpu.py
runs them against eager on one)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.compiler import compile_stages
from tilefuse.graph import ir
from tilefuse.runtime.launch import compile_source_only

g = torch.Generator().manual_seed(29)


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _ints(lo, hi, *shape, dtype):
    return torch.randint(lo, hi, shape, generator=g, dtype=dtype)


_SPECIAL = torch.tensor([-1.5, -129.0, -300.7, 255.9, 256.0, 300.7, 1e10, -1e10, 127.9, 128.0, -128.9, 0.0, -0.0])

# (name, program, inputs)
CASES = [
    ("f32 to uint8 wraps", lambda x: (x * 100).to(torch.uint8), (_randn(64, 33),)),
    ("f32 special values to uint8", lambda x: x.byte(), (_SPECIAL,)),
    ("bf16 to uint8", lambda x: x.byte(), (_randn(8, 40, dtype=torch.bfloat16, scale=200),)),
    ("f16 to uint8 beside a sum", lambda x: (x.byte(), x.sum(-1)), (_randn(8, 40, dtype=torch.float16, scale=200),)),
    ("f64 to uint8", lambda x: x.byte(), (_randn(5, 7, dtype=torch.float64, scale=300),)),
    ("where of numbers to uint8", lambda x: torch.where(x > 0, -0.5, -129).to(torch.uint8), (_randn(3, 5),)),
    ("relu of uint8", lambda x: torch.relu(x), (_ints(0, 256, 8, 40, dtype=torch.uint8),)),
    ("relu of int8", lambda x: torch.relu(x), (_ints(-128, 128, 8, 40, dtype=torch.int8),)),
    ("clamp of int8 by numbers", lambda x: torch.clamp(x, min=-3, max=100), (_ints(-128, 128, 8, 40, dtype=torch.int8),)),
    # a float bound makes the result f32 and the int bound is compared as a float (in uint8 the
    # -1 had wrapped to 255: every value clamped to 255, a fuzzing finding)
    ("clamp of uint8 by an int and a float", lambda x: torch.clamp(x, -1, 100000.0), (_ints(0, 256, 8, 40, dtype=torch.uint8),)),
    # true division of integers goes straight to f32: a 0-dim i64 beside an i32 tensor had been
    # cast to i32 first and wrapped (-2462023543 became 1832943753: a fuzzing finding)
    ("i32 divided by a 0-dim i64", lambda x: x / (x.sum().long() * 0 - 2462023543), (_ints(-1000, 1000, 4, 8, dtype=torch.int32),)),
    # so do atan2's (given its float dtype): a u8 tensor's i64 product beside it was
    # cast to u8 first (1728 became 192; CPU fuzzing, session 79)
    ("atan2 of a 0-dim i64 product and uint8", lambda x: torch.atan2(torch.prod(x), x), (_ints(2, 9, 1, 4, dtype=torch.uint8),)),
    ("std of uint8 clamped by a float", lambda x: torch.std(torch.clamp(x, -1, 1e5), dim=0), (_ints(0, 256, 7, 3, dtype=torch.uint8),)),
    ("maximum of uint8 tensors", lambda x: torch.maximum(x, x.flip(-1)), (_ints(0, 256, 8, 40, dtype=torch.uint8),)),
    ("relu of bf16 cast to uint8 then to int8", lambda x: torch.relu(x.byte()).char(), (_randn(4, 64, dtype=torch.bfloat16, scale=100),)),
    ("min over bool rows of 33000", lambda x: (x > -2).amin(-1), (_randn(3, 33000),)),
    ("any over bool rows of 70001", lambda x: (x > 3).any(-1), (_randn(2, 70001),)),
    ("max over uint8 rows of 70001", lambda x: x.amax(-1), (_ints(0, 256, 2, 70001, dtype=torch.uint8),)),
    ("min over int8 rows of 33000", lambda x: x.amin(-1), (_ints(-128, 128, 3, 33000, dtype=torch.int8),)),
    ("int64 einsum with one contracted element", lambda a: torch.einsum("ij,kj->ik", a, a), (_ints(-50, 50, 16, 1, dtype=torch.int64),)),
    ("int32 outer product by einsum", lambda a: torch.einsum("i,j->ij", a, a), (_ints(-50, 50, 6, dtype=torch.int32),)),
    ("bool einsum with one contracted element", lambda a: torch.einsum("ij,kj->ik", a > 0, a > 0), (_randn(6, 1),)),
    ("torch.norm over a size-1 dim", lambda x: torch.norm(x, dim=-2), (_randn(16, 1, 7),)),
    ("torch.norm of bf16 rows", lambda x: torch.norm(x, dim=-1), (_randn(8, 300, dtype=torch.bfloat16),)),
    ("vector norms p = 1, inf, -inf, 0, 3, -1.5", lambda x: tuple(torch.linalg.vector_norm(x, p, dim=(0, 2), keepdim=True)
                                                          for p in (1, math.inf, -math.inf, 0, 3, -1.5)),
     (torch.where(_randn(5, 4, 6) > 1, 0.0, _randn(5, 4, 6)),)),
    ("norm of f16 in f64", lambda x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64), (_randn(4, 9, dtype=torch.float16),)),
    ("F.normalize", lambda x: F.normalize(x, dim=-1), (_randn(16, 64),)),
    ("F.normalize of a zero row", lambda x: F.normalize(x * (x > 5), dim=-1), (_randn(4, 8),)),
    ("clamp_min and clamp_max", lambda x: (x.clamp_min(0.5), x.clamp_max(-0.25)), (_randn(4, 8, dtype=torch.bfloat16),)),
    ("clamp_min of int32 by a float", lambda x: x.clamp_min(0.5), (_ints(-5, 5, 4, 8, dtype=torch.int32),)),
    ("full_like of uint8 with -2", lambda x: torch.full_like(x, -2) + x, (_ints(0, 256, 3, 5, dtype=torch.uint8),)),
    ("x ** 0, NaN included", lambda x: (x ** 0, x ** 0.0), (torch.tensor([math.nan, 1.0, 0.0, -2.0, math.inf]),)),
    ("int ** 0", lambda x: x ** 0, (_ints(-5, 5, 6, dtype=torch.int64),)),
]


def _leaves(x):
    return torch.utils._pytree.tree_leaves(x)


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_same_dtype_and_values_as_eager(name, fn, inputs):
    want, got = _leaves(fn(*inputs)), _leaves(tilefuse.compile(fn, inputs)(*inputs))
    for w, t in zip(want, got, strict=True):
        assert t.dtype == w.dtype and t.shape == w.shape, f"{name}: {t.dtype}{tuple(t.shape)} against {w.dtype}{tuple(w.shape)}"
        if w.is_floating_point():
            rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(w.dtype, 1e-6)
            torch.testing.assert_close(t, w, rtol=rtol, atol=0, equal_nan=True)
        else:
            assert torch.equal(t, w), f"{name}: {t} against eager's {w}"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("name,fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_kernels_compile(name, fn, inputs, arch):
    stages = compile_stages(fn, inputs, arch=arch)
    for lowered in stages.kernels.values():
        _, cubin = compile_source_only(lowered.kernel, arch)
        assert cubin.info.clean, f"{name} {arch}: {cubin.info}"


def test_a_float_to_uint8_kernel_converts_through_int64():
    stages = compile_stages(lambda x: x.byte(), (_randn(4, 8),), arch="sm_90a")
    (lowered,) = stages.kernels.values()
    src, _ = compile_source_only(lowered.kernel, "sm_90a")
    assert "(unsigned char)(long long)(" in src.source


def test_norms_are_lowered_and_f_normalize_is_one_kernel():
    stages = compile_stages(lambda x: F.normalize(x, dim=-1), (_randn(16, 64),), arch="sm_90a")
    assert not any(isinstance(n, ir.Extern) for n in stages.graph.nodes)
    assert len(stages.kernels) == 1
    stages = compile_stages(lambda x: torch.norm(x, dim=-2), (_randn(16, 1, 7),), arch="sm_90a")
    assert stages.graph[stages.graph.outputs[0]].type.shape == (16, 7)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 2)),
                                   ((64, 3000), (3000, 700)), ((3, 0), (0, 4))])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int64])
def test_the_exact_integer_matmul_equals_pytorchs_cpu_matmul(sa, sb, dtype):
    """The integer matmul tilefuse runs where PyTorch's refuses (CUDA) wraps as PyTorch's CPU
    matmul does, for vectors, broadcast batches, an empty K, and a K summed in slices (a
    64x3000x700 product would otherwise hold 134M int64 products at once)."""
    from tilefuse.runtime.program import _exact_matmul
    a, b = _ints(-100, 100, *sa, dtype=torch.int64).to(dtype), _ints(-100, 100, *sb, dtype=torch.int64).to(dtype)
    got, want = _exact_matmul(a, b), torch.matmul(a, b)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("cast", ["bool", "int"])
def test_a_matmul_cast_to_bool_or_int_keeps_its_cast_before_a_residual_add(cast):
    """The residual-epilogue rule moves an add onto a matmul's f32 accumulator through the casts
    between them; a cast to bool or an integer changes the value (x.bool() is x != 0), so the
    rule must not look through it (found on the GPU: (x @ x).bool() + i8 gave trunc(x @ x) + i8)."""
    def f(a, w, r):
        y = (a @ w)
        return (y.bool() if cast == "bool" else y.to(torch.int32)) + r
    a, w = _randn(16, 32, dtype=torch.bfloat16, scale=2), _randn(32, 8, dtype=torch.bfloat16)
    r = _ints(-100, 100, 16, 8, dtype=torch.int8)
    stages = compile_stages(f, (a, w, r), arch="sm_90a")
    casts = [n for n in stages.graph.nodes if isinstance(n, ir.Map) and n.op == "cast"]
    assert any(n.type.dtype == ("bool" if cast == "bool" else "i32") for n in casts), stages.graph
    got, want = stages.program(a, w, r), f(a, w, r)
    assert got.dtype == want.dtype and torch.equal(got, want)

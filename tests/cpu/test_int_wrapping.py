"""32- and 64-bit integer add, sub, mul, neg and abs wrap in a kernel as they do in PyTorch.

Signed overflow is undefined in C++, and the compiler uses that: with `int` arithmetic nvcc
folded abs(-(x * x)) into x * x (x * x >= 0 where nothing overflows), so a GPU kernel gave
-517945072 where PyTorch's wrapped product, negated and abs'd, is 517945072 (GPU fuzzing,
session 79). The kernels now compute these ops in the unsigned type. Properties checked here,
without a GPU: the interpreter equals eager on overflowing programs; the rendered kernel spells
the ops unsigned; and the PTX NVRTC makes of it keeps the abs that the signed spelling lost
(the last shown to be lost, so the check can fail)."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.codegen import cexpr
from tilefuse.runtime.launch import compile_source_only


def _ptx(source: str, name: str) -> str:
    """PTX of `source` for compute_90a through NVRTC (no GPU needed)."""
    from cuda.bindings import nvrtc

    from tilefuse.runtime.nvrtc import DEFAULT_OPTIONS, _check, cuda_include_dir

    opts = ["--gpu-architecture=compute_90a", *[o for o in DEFAULT_OPTIONS if "ptxas" not in o]]
    if cuda_include_dir():
        opts.append(f"-I{cuda_include_dir()}")
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "create")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        size = _check(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
        buf = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, buf), "ptx")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return buf.rstrip(b"\x00").decode()


def _abs_neg_square(a):
    return torch.abs(torch.neg(a * a))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_abs_of_a_negated_square_keeps_its_abs_in_the_ptx(dtype):
    """abs(-(x * x)) of int32 / int64: the kernel's mul, neg and abs are unsigned in the source,
    and the PTX holds an abs (nvcc dropped it from the signed form); on the CPU the program
    equals eager where the square overflows."""
    info = torch.iinfo(dtype)
    a = torch.tensor([[50000, -46341, 7, info.max], [info.min, 3, -65536, 1 << 20]], dtype=dtype)
    if dtype == torch.int64:
        a = a * (1 << 16)
    p = tilefuse.compile(_abs_neg_square, (a,))
    assert torch.equal(p(a), _abs_neg_square(a))
    (lw,) = p.kernels.values()
    src, _ = compile_source_only(lw.kernel, "sm_90a")
    u = "unsigned" if dtype == torch.int32 else "unsigned long long"
    assert f"({u})(" in src.source
    ptx = _ptx(src.source, src.name)
    bits = 32 if dtype == torch.int32 else 64
    assert re.search(rf"\babs\.s{bits}\b", ptx), "the abs was folded away"


def test_the_signed_spelling_loses_the_abs():
    """The hazard itself: the same ops written with signed int arithmetic compile to PTX with
    no abs (nvcc assumes x * x does not overflow), which is why op() spells them unsigned."""
    body = "int v = -(x * x); o[threadIdx.x] = (v < 0 ? -v : v);"
    src = f'extern "C" __global__ void k(const int* a, int* o) {{ int x = a[threadIdx.x]; {body} }}'
    assert not re.search(r"\babs\.s32\b", _ptx(src, "k"))
    wrapped = cexpr.op("abs", [cexpr.op("neg", [cexpr.op("mul", ["x", "x"], ["i32", "i32"], "i32")], ["i32"], "i32")],
                       ["i32"], "i32")
    src = f'extern "C" __global__ void k(const int* a, int* o) {{ int x = a[threadIdx.x]; o[threadIdx.x] = {wrapped}; }}'
    assert re.search(r"\babs\.s32\b", _ptx(src, "k"))


OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "neg abs": lambda a, b: torch.abs(-(a * b)),
    "sum": lambda a, b: (a * b).sum(-1),
}


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.int32, torch.int64]), op=st.sampled_from(sorted(OPS)), data=st.data())
def test_overflowing_integer_maps_equal_eager(dtype, op, data):
    """Random values across the whole range: add, sub, mul, abs(-(a * b)) and a row sum of
    products wrap as eager's do (the interpreter; the kernels' spelling is checked above)."""
    info = torch.iinfo(dtype)
    n = data.draw(st.integers(1, 9))
    vals = st.lists(st.integers(info.min, info.max), min_size=2 * n, max_size=2 * n)
    v = torch.tensor(data.draw(vals), dtype=dtype).reshape(2, n)
    a, b = v[0:1].clone(), v[1:2].clone()
    fn = OPS[op]
    p = tilefuse.compile(fn, (a, b))
    assert torch.equal(p(a, b), fn(a, b))

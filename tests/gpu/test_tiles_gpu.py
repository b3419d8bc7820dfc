"""Maps that read an input transposed (a permute that moved the last dim), on the GPU: one kernel
in 2-D tiles, the transposed input staged through shared memory (codegen/tiles.py), at shapes
that fill the tiles and shapes with ragged edges, 16-bit and f32, a second input read where it
lies, a broadcast vector, and a misaligned input (the scalar fallback). Outputs poisoned, the
2x rule against float64, in the thin call and in the CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _check(fn, ins):
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen import mapreduce

    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    kernels = [s for s in prog.plan.steps if s.family != "alias" and not s.view]
    assert [s.family for s in kernels] == ["mapreduce"], str(prog.plan)
    stages = [mapreduce.default_schedule(k.kernel).stage for k in prog.kernels.values()]
    assert stages == ["tiles"], stages
    ref = float64_reference(fn, ins)
    eager = fn(*ins)
    for call in range(3):  # the thin call, then (one launch) CUDA-graph replays
        got = prog(*ins)
        c = compare(f"call {call}", got, ref, eager)
        assert c.ok, c
    return prog


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("shape", [(64, 512, 256), (3, 100, 70), (2, 1000, 33), (1, 17, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_transposed_map_result_is_one_tiled_kernel(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    _check(lambda x: (x * 2 + 1).transpose(1, 2).contiguous(), (x,))


@pytest.mark.parametrize("shape", [(2, 64, 56, 56), (3, 24, 7, 9), (1, 96, 14, 14)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_nchw_to_nhwc_with_a_bias_reads_the_image_in_tiles(shape, dtype):
    torch.manual_seed(1)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    b = torch.randn(shape[1], device="cuda", dtype=dtype)
    _check(lambda x, b: torch.nn.functional.gelu(x.permute(0, 2, 3, 1) + b), (x, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_input_transposed_and_one_where_it_lies(dtype):
    torch.manual_seed(2)
    x = torch.randn(4, 300, 96, device="cuda", dtype=dtype)
    y = torch.randn(4, 96, 300, device="cuda", dtype=dtype)
    _check(lambda x, y: x.transpose(1, 2) * torch.sigmoid(y), (x, y))


def test_a_misaligned_input_runs_the_scalar_fallback():
    """An input one element past an allocation: the tiles' 16-byte loads cannot take it; the
    launcher runs the scalar row kernel instead (same values)."""
    torch.manual_seed(3)
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    fn = lambda x: (x * 3 - 1).transpose(1, 2).contiguous()  # noqa: E731
    prog = _check(fn, (x,))
    odd = torch.randn(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view(x.shape)
    odd.copy_(x)
    from tilefuse.check import compare, float64_reference

    c = compare("misaligned", prog(odd), float64_reference(fn, (odd,)), fn(odd))
    assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_tile_schedule_the_tuner_may_pick_computes_the_same(dtype):
    """Output vectors of 1-8 columns, 128-512 threads, 1 or 8 CTAs an SM, on ragged tiles (a
    [3, 100, 70] read transposed: 70 rows a segment, 100 columns): the default's values."""
    from dataclasses import replace

    import tilefuse
    from tilefuse.codegen import mapreduce
    from tilefuse.runtime.launch import compile_kernel

    torch.manual_seed(4)
    x = torch.randn(3, 100, 70, device="cuda", dtype=dtype)
    prog = tilefuse.compile(lambda x: torch.sigmoid(x.transpose(1, 2)).contiguous() * 3, (x,))
    want = prog(x)
    (step, low), = prog.kernels.items()
    d = mapreduce.default_schedule(low.kernel)
    assert d.stage == "tiles"
    ran = 0
    for vector in (1, 2, 4, 8):
        for threads in (128, 256, 512):
            for mb in (1, 8):
                s = replace(d, vector=vector, threads=threads, group=threads, min_blocks=mb)
                try:
                    ck = compile_kernel(low.kernel, None, s)
                except ValueError:
                    continue  # (wider than 16 bytes of output, or not dividing the columns)
                (src, dst) = low.kernel.params  # (the input where it lies, the output as rows x columns)
                out = torch.full(dst.shape, float("nan"), device="cuda", dtype=dtype)
                ck(x.view(src.shape), out)
                torch.cuda.synchronize()
                assert torch.equal(out.view(want.shape), want), s
                ran += 1
    assert ran >= 12, ran


@pytest.mark.parametrize("shape", [(16, 1024, 256), (3, 100, 70), (2, 7, 1000)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_transposed_input_returned_contiguous_is_copied_in_tiles(shape, dtype):
    torch.manual_seed(5)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    prog = _check(lambda x: x.transpose(1, 2).contiguous(), (x,))
    assert torch.equal(prog(x), x.transpose(1, 2))  # (a copy: the same bits)


def test_a_transposed_softmax_is_the_row_kernel_then_a_tiled_copy():
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen import mapreduce

    torch.manual_seed(6)
    x = torch.randn(4, 300, 96, device="cuda", dtype=torch.bfloat16)
    fn = lambda x: torch.softmax(x, -1).transpose(1, 2).contiguous()  # noqa: E731
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert [s.family for s in prog.plan.steps if s.family != "alias"] == ["mapreduce", "mapreduce"], str(prog.plan)
    assert [mapreduce.default_schedule(k.kernel).stage == "tiles" for k in prog.kernels.values()] == [False, True]
    for call in range(3):
        c = compare(f"call {call}", prog(x), float64_reference(fn, (x,)), fn(x))
        assert c.ok, c


def _two_outputs(x):
    y = x.transpose(1, 2) * 2
    return y, y + 1


@pytest.mark.parametrize("name,fn,dtype", [
    ("two outputs", _two_outputs, torch.bfloat16),
    ("bool", lambda x: (x.transpose(1, 2) > 0).contiguous(), torch.bfloat16),
    ("int32 from f32", lambda x: (x.transpose(1, 2) * 10).to(torch.int32).contiguous(), torch.float32),
    ("f64", lambda x: (x.transpose(1, 2) * 2).contiguous(), torch.float64),
    ("f16 to f32", lambda x: (x.transpose(1, 2).float() * 2).contiguous(), torch.float16),
], ids=lambda v: v if isinstance(v, str) else "")
def test_outputs_of_every_width_from_tiles(name, fn, dtype):
    """Outputs of 1, 2, 4 and 8 bytes (stores of 8 bytes a thread, or one element), two outputs
    of one kernel: each equal to eager's within the 2x rule, every element written."""
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen import mapreduce

    torch.manual_seed(7)
    x = (torch.randn(3, 100, 72, device="cuda") * 3).to(dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert [mapreduce.default_schedule(k.kernel).stage for k in prog.kernels.values()] == ["tiles"], str(prog.plan)
    ref, eager = float64_reference(fn, (x,)), fn(x)
    got = prog(x)
    for i, (a, r, e) in enumerate(zip(*(v if isinstance(v, tuple) else (v,) for v in (got, ref, eager)))):
        c = compare(f"{name} out{i}", a, r, e)
        assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_map_of_a_transposed_input_comes_back_in_eagers_strides(dtype):
    """x.transpose(1, 2) * 2 + 1 without .contiguous(): eager keeps x's memory order (its last
    dim strided); the kernel computes in that order and the result is eager's strided view."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(8)
    x = torch.randn(8, 300, 130, device="cuda", dtype=dtype)
    fn = lambda x: x.transpose(1, 2) * 2 + 1  # noqa: E731
    prog = tilefuse.compile(fn, (x,))
    prog.poison = True
    got, eager = prog(x), fn(x)
    assert got.stride() == eager.stride(), (got.stride(), eager.stride())
    c = compare("strided", got, float64_reference(fn, (x,)), eager)
    assert c.ok, c


def test_a_transposed_left_operand_is_copied_in_tiles_before_the_gemm():
    """x.transpose(1, 2) @ w: the tiled copy, then the generated GEMM (no PyTorch copy)."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(9)
    x = torch.randn(8, 512, 384, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    fn = lambda x, w: x.transpose(1, 2) @ w  # noqa: E731
    prog = tilefuse.compile(fn, (x, w), graphs=True)
    prog.poison = True
    assert [s.family for s in prog.plan.steps if s.family != "alias"] == ["mapreduce", "gemm"], str(prog.plan)
    for call in range(3):
        c = compare(f"call {call}", prog(x, w), float64_reference(fn, (x, w)), fn(x, w))
        assert c.ok, c

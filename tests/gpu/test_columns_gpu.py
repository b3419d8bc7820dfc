"""Reductions over a dim that is not last, on the GPU: one column kernel a program (rows on
neighbouring lanes, a long row split between threads a warp apart: codegen/columns.py), rows of a few channels held in registers and long ones streamed,
16-bit and f32, per-channel weights, reductions kept and dropped dims, rows that do not fill
the last CTA. Outputs poisoned, the 2x rule against float64, in the thin call and in the
CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _check(fn, ins, kernels=(("mapreduce", True),)):
    """`fn` as the kernels named ((family, column kernel?), in order; a column kernel's default
    splits its rows between threads exactly when it is not a grid reduction and its rows have at
    least twice columns.MIN_SHARE columns), right in the thin call and the graph replays."""
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.loop import ir
    from tilefuse.codegen import columns, mapreduce

    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    steps = [s for s in prog.plan.steps if s.family != "alias" and not s.view]
    assert [(s.family, s.columns) for s in steps] == list(kernels), str(prog.plan)
    for s in steps:
        if s.columns:
            k = prog.kernels[s.name].kernel
            sch = mapreduce.default_schedule(k)
            C = ir.row_kernel_parts(k).col_extent
            split = ir.grid_parts(k) is None and C >= 2 * columns.MIN_SHARE
            assert sch.across == split and (sch.group > 1) == split, (C, sch)
    ref = float64_reference(fn, ins)
    eager = fn(*ins)
    outs = lambda o: o if isinstance(o, tuple) else (o,)  # noqa: E731
    for call in range(3):  # the thin call, then (one launch) CUDA-graph replays
        for i, (got, r, e) in enumerate(zip(outs(prog(*ins)), outs(ref), outs(eager))):
            c = compare(f"call {call} out {i}", got, r, e)
            assert c.ok, c
    return prog


def ln_channels_first(x, w, b):
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return w[:, None, None] * ((x - u) / torch.sqrt(s + 1e-6)) + b[:, None, None]


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(4, 64, 96, 96), (2, 3, 160, 110), (3, 200, 99, 111), (1, 96, 181, 191)]  # >= COLUMN_MIN_ROWS rows


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_over_channels(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
    _check(lambda x: torch.softmax(x, 1), (x,))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channels_first_layernorm(shape, dtype):
    torch.manual_seed(1)
    x = torch.randn(*shape, device="cuda", dtype=dtype) + 2
    w = torch.randn(shape[1], device="cuda", dtype=dtype)
    b = torch.randn(shape[1], device="cuda", dtype=dtype)
    _check(ln_channels_first, (x, w, b))


@pytest.mark.parametrize("op", ["mean", "sum", "amax", "amin"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_reductions_over_the_middle_dim(op, dtype):
    torch.manual_seed(2)
    x = torch.randn(32, 300, 1030, device="cuda", dtype=dtype)
    _check(lambda x: getattr(x, op)(1), (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_reduction_over_the_first_dim_kept_and_two_outputs(dtype):
    """x.sum(0, keepdim=True) and x / it, one kernel writing both: rows 40 x 900, rows of 50."""
    torch.manual_seed(3)
    x = torch.rand(50, 40, 900, device="cuda", dtype=dtype) + 0.5
    _check(lambda x: (x.sum(0, keepdim=True), x / x.sum(0, keepdim=True)), (x,))


def test_rmsnorm_over_channels_with_an_upcast():
    torch.manual_seed(4)
    x = torch.randn(4, 64, 96, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    _check(lambda x, w: (x.float() * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6)).to(x.dtype)
           * w[:, None, None], (x, w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_global_average_pooling_and_a_squeeze_excitation(dtype):
    """x.mean((2, 3)) a row kernel over the merged H * W (graph/rules/merged_reductions.py), and
    x * sigmoid(relu(x).mean((2, 3))) one row kernel, the gate's product in it."""
    torch.manual_seed(5)
    x = torch.randn(32, 256, 14, 14, device="cuda", dtype=dtype)
    _check(lambda x: x.mean((2, 3)), (x,), kernels=[("mapreduce", False)])
    _check(lambda x: x * torch.sigmoid(torch.relu(x).mean((2, 3), keepdim=True)), (x,),
           kernels=[("mapreduce", False)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_reduction_over_two_leading_dims_is_a_column_kernel(dtype):
    torch.manual_seed(6)
    x = torch.randn(8, 64, 40000, device="cuda", dtype=dtype)
    _check(lambda x: x.sum((0, 1)), (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_logsumexp_and_adaptive_pooling_to_one(dtype):
    """torch.logsumexp over the last dim and F.adaptive_avg_pool2d(x, 1): row kernels
    (frontend/aten.py lowers both to reductions)."""
    torch.manual_seed(7)
    x = torch.randn(4096, 1000, device="cuda", dtype=dtype) * 10
    _check(lambda x: torch.logsumexp(x, -1), (x,), kernels=[("mapreduce", False)])
    y = torch.randn(64, 512, 7, 7, device="cuda", dtype=dtype)
    _check(lambda y: torch.nn.functional.adaptive_avg_pool2d(y, 1), (y,), kernels=[("mapreduce", False)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layernorm_of_nhwc_read_from_nchw(dtype):
    """F.layer_norm(x.permute(0, 2, 3, 1)): the permute copied in tiles, then the row kernel."""
    torch.manual_seed(8)
    x = torch.randn(8, 96, 56, 56, device="cuda", dtype=dtype)
    _check(lambda x: torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (96,)), (x,),
           kernels=[("mapreduce", False), ("mapreduce", False)])


@pytest.mark.parametrize("name,fn,shape,dtype", [
    ("sum dim 0 bf16", lambda x: x.sum(0), (8192, 2048), torch.bfloat16),
    ("mean of squares dim 0 f32", lambda x: (x * x).mean(0, keepdim=True), (4096, 1024), torch.float32),
    ("amax dim 1 f16", lambda x: x.amax(1), (2, 8192, 1024), torch.float16),
    ("prod dim 1 f32", lambda x: (1 + 0.001 * x).prod(1), (1, 8192, 1031), torch.float32),
])
def test_few_long_columns_reduce_in_pieces(name, fn, shape, dtype):
    """A lone reduction with too few rows for a column kernel (rewrites.split_long_columns):
    pieces reduced by a column kernel, then finished; right in the thin call and graph replays."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(7)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert any(n.name.endswith("_pieces") for n in prog.graph.nodes), str(prog.plan)
    assert any(s.columns for s in prog.plan.steps), str(prog.plan)
    ref, eager = float64_reference(fn, (x,)), fn(x)
    for call in range(3):
        c = compare(f"{name} call {call}", prog(x), ref, eager)
        assert c.ok, c

"""codegen/tiles.py on the CPU: which maps read an input transposed, the tile analysis against
every element of every tile, and the kernels' builds (sm_90a, sm_80: no spills)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.codegen import mapreduce, tiles
from tilefuse.loop import ir


def _eval(e: ir.Index, env: dict) -> int:
    if isinstance(e, ir.IConst):
        return e.value
    if isinstance(e, ir.Var):
        return env[e.name]
    a, b = _eval(e.a, env), _eval(e.b, env)
    return {"+": a + b, "*": a * b, "//": a // b if b else 0, "%": a % b if b else 0}[e.op]


def _offset(buf: ir.Buffer, index, env) -> int:
    off = 0
    for e, n in zip(index, buf.shape):
        off = off * n + _eval(e, env)
    return off


def _kernels(fn, *shapes, dtype=torch.float32):
    ins = tuple(torch.randn(*s, dtype=dtype) for s in shapes)
    p = tilefuse.compile(fn, ins)
    torch.testing.assert_close(p(*ins), fn(*ins))  # (the CPU interpreter runs the rewritten graph)
    return p, [k.kernel for k in p.kernels.values()]


def _check_tiles(k: ir.Kernel):
    """Every staged load of `k`'s plan: at every valid element (i, j) of every tile, its address
    is the corner's + i + dc * j, as the kernel computes it."""
    tp = tiles.plan(k)
    assert tp is not None, str(k)
    parts = ir.row_kernel_parts(k)
    for s in tp.staged:
        seen = 0
        for seg in range(tp.rows // tp.Lr):
            for d0 in range(0, tp.Lr, tp.TR):
                for c0 in range(0, tp.cols, tp.TC):
                    r0 = seg * tp.Lr + d0
                    corner = _offset(s.buf, s.index, {parts.row_var: r0, s.col: c0})
                    for i in range(min(tp.TR, tp.Lr - d0)):
                        for j in range(min(tp.TC, tp.cols - c0)):
                            got = _offset(s.buf, s.index, {parts.row_var: r0 + i, s.col: c0 + j})
                            assert got == corner + i + s.dc * j, (s, r0, c0, i, j)
                            seen += 1
        assert seen == tp.rows * tp.cols
    return tp


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_tile_analysis_holds_at_every_element(data):
    """Random shapes and permutes that move the last dim, under a map: the plan's claim (an
    address affine inside each tile) checked at every element; the program's values too."""
    rank = data.draw(st.integers(2, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 40), min_size=rank, max_size=rank)))
    perm = data.draw(st.permutations(range(rank)))
    if perm[-1] == rank - 1 or shape[-1] == 1:
        return
    fn = lambda x: (x * 2 + 1).permute(*perm).contiguous()  # noqa: E731
    _, ks = _kernels(fn, shape)
    for k in ks:
        if tiles.plan(k) is not None:
            _check_tiles(k)


@pytest.mark.parametrize("shape,perm,lr", [
    ((4, 96, 64), (0, 2, 1), 4 * 64),      # rows of whole tiles: no segment
    ((3, 70, 100), (0, 2, 1), 100),        # 100 rows a batch: tiles stay inside one
    ((2, 64, 56, 56), (0, 2, 3, 1), 2 * 3136),  # NCHW -> NHWC: the image's digits recombine
], ids=str)
def test_tiles_and_segments(shape, perm, lr):
    _, ks = _kernels(lambda x: (x * 2).permute(*perm).contiguous(), shape)
    assert len(ks) == 1 and mapreduce.default_schedule(ks[0]).stage == "tiles"
    assert _check_tiles(ks[0]).Lr == lr


def test_maps_that_read_rows_in_order_and_reductions_take_no_tiles():
    _, ks = _kernels(lambda x: x * 2 + 1, (64, 128))
    assert tiles.plan(ks[0]) is None and mapreduce.default_schedule(ks[0]).stage != "tiles"
    p, ks = _kernels(lambda x: torch.softmax(x.transpose(0, 1), -1), (64, 128))
    copy, soft = ks  # (the transposed view copied in tiles, then the row kernel reads the copy)
    assert tiles.plan(copy) is not None and tiles.plan(soft) is None, str(p.plan)
    with pytest.raises(ValueError, match="transposed"):
        mapreduce.render(ks[-1], mapreduce.MapReduceSchedule(stage="tiles"))


def test_a_transposed_map_is_one_kernel_in_the_plan():
    p, ks = _kernels(lambda x: (x * 2 + 1).transpose(1, 2).contiguous(), (8, 64, 32))
    assert [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce"], str(p.plan)
    assert "tiles" in str(mapreduce.default_schedule(ks[0]))
    assert "a transpose of the last dim: the kernel reads it in 2-D tiles" in str(p.plan)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_16_bit_gelu_of_a_transposed_sum_is_one_tiled_kernel(dtype):
    """gelu(x.permute(0, 2, 3, 1) + b) widens a 16-bit sum to f32 and narrows it again: the
    widening cast joins the tiled kernel (session 58's rule against a widened tiles copy split
    it off into a second kernel that wrote and read the sum)."""
    p, ks = _kernels(lambda x, b: torch.nn.functional.gelu(x.permute(0, 2, 3, 1) + b), (2, 64, 7, 9), (64,),
                     dtype=dtype)
    assert len(ks) == 1 and mapreduce.default_schedule(ks[0]).stage == "tiles", str(p.plan)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(8, 512, 256), (3, 100, 70), (1, 17, 5)], ids=str)
def test_tiled_kernels_build_without_spills(arch, dtype, shape):
    from tilefuse.runtime import launch

    _, ks = _kernels(lambda x, y: (x.transpose(1, 2) * torch.sigmoid(y)).contiguous(), shape,
                     (shape[0], shape[2], shape[1]), dtype=dtype)
    for k in ks:
        src, cubin = launch.compile_source_only(k, arch)
        assert src.schedule.stage == "tiles"
        assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info
        # (16-bit outputs 4 columns a thread: 8 CTAs an SM as the default asks, not halved after a spill)
        assert src.schedule == mapreduce.default_schedule(k, arch), src.schedule
        assert src.schedule.min_blocks == (8 if dtype != torch.float32 and shape[1] % 4 == 0 else 1)


def test_a_transposed_result_is_copied_by_a_kernel():
    """x.transpose(1, 2).contiguous() (and a softmax's output transposed) as a result: a kernel
    of one identity cast reading the view in place, in tiles, not PyTorch's copy."""
    from tilefuse.graph.rules.permute_sink import transposed_results_as_copies

    for fn, shape in ((lambda x: x.transpose(1, 2).contiguous(), (4, 96, 64)),
                      (lambda x: torch.softmax(x, -1).transpose(1, 2).contiguous(), (4, 96, 64))):
        p, ks = _kernels(fn, shape)
        assert not [s for s in p.plan.steps if s.family == "extern"], str(p.plan)
        assert any(tiles.plan(k) is not None for k in ks), str(p.plan)
        assert transposed_results_as_copies(p.graph) is p.graph  # (once is enough)
    # the rule alone: a transpose of an input is copied; a permute keeping the last dim, and a
    # transposed iota (made where it is read), stay as they were
    from tilefuse.graph import ir as g_ir

    def T(*shape):
        return g_ir.TensorType(shape, "f32")

    g = g_ir.Graph((g_ir.Input("x", T(3, 4)), g_ir.View("y", T(4, 3), "permute", "x", (1, 0))), ("x",), ("y",))
    h = transposed_results_as_copies(g)
    (r,) = h.results
    assert isinstance(h[r], g_ir.Map) and h[r].op == "cast" and h[r].args == ("y",), str(h)
    keeps = g_ir.Graph((g_ir.Input("x", T(2, 3, 4)), g_ir.View("y", T(3, 2, 4), "permute", "x", (1, 0, 2))),
                       ("x",), ("y",))
    iota = g_ir.Graph((g_ir.Input("x", T(3, 4)), g_ir.Iota("i", T(3, 4), 1),
                       g_ir.View("y", T(4, 3), "permute", "i", (1, 0))), ("x",), ("y",))
    assert transposed_results_as_copies(keeps) is keeps and transposed_results_as_copies(iota) is iota


def test_a_transposed_left_operand_of_a_matmul_is_copied_by_a_kernel():
    """x.transpose(1, 2) @ w (the GEMM reads its left operand row-major): the copy is a tiles
    kernel, not PyTorch's; a transposed right operand stays as the GEMM takes it (no copy)."""
    x, w = torch.randn(4, 64, 32, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16)
    p, ks = _kernels(lambda x, w: x.transpose(1, 2) @ w, (4, 64, 32), (64, 48), dtype=torch.bfloat16)
    assert [s.family for s in p.plan.steps] == ["mapreduce", "gemm"], str(p.plan)
    assert [tiles.plan(k) is not None for k in ks] == [True]
    p2 = tilefuse.compile(lambda x, w: x @ w.t(), (x.transpose(1, 2).contiguous(), w.t().contiguous()))
    assert [s.family for s in p2.plan.steps if s.family != "alias"] == ["gemm"], str(p2.plan)


def test_the_backend_still_returns_a_transposed_input_by_eager():
    """Under torch.compile(backend="tilefuse") a graph returning x.t() runs in eager (code after
    a graph break may write through the view): the check reads the graph as captured, before the
    copy the rewrite makes."""
    from tilefuse.frontend.backend import _aliased_output
    from tilefuse.compiler import compile_stages

    x = torch.randn(32, 16)
    c = compile_stages(lambda x: x.t(), (x,))
    assert "permute view of an input" in _aliased_output(c.captured)


def test_an_empty_transposed_result_compiles_as_before():
    """(review, session 56) A zero-size transposed result is no kernel's copy: it compiled
    before the rule existed and still does, empty like eager's."""
    x = torch.randn(0, 5)
    p = tilefuse.compile(lambda x: x.t().contiguous(), (x,))
    assert p(x).shape == (5, 0)


@pytest.mark.parametrize("fn,shape", [
    (lambda x: x.transpose(1, 2) * 2 + 1, (8, 16, 13)),
    (lambda x: (x * 2).t(), (6, 5)),
    (lambda x: torch.sigmoid(x.permute(2, 0, 1)), (4, 6, 10)),
], ids=["map of x.T", "map.T", "sigmoid of a rotation"])
def test_a_map_laid_out_with_its_last_dim_moved_keeps_eager_strides(fn, shape):
    """(review, session 56) Eager keeps x's memory order for a map of x transposed, its last
    dim strided too; the kernel computes in that order (reading x in its own) and the result is
    returned as eager's strided view."""
    x = torch.randn(*shape)
    p = tilefuse.compile(fn, (x,))
    y = p(x)
    torch.testing.assert_close(y, fn(x))
    assert y.stride() == fn(x).stride(), (y.stride(), fn(x).stride())

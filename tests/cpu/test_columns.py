"""Column kernels on the CPU: reductions over a dim that is not last planned as one map-reduce
kernel whose row runs along that dim (graph/fusion.py, column_start / column_ahead), the
results through the interpreter against PyTorch at random shapes, the row-a-thread schedule
(codegen/columns.py) and its builds (sm_90a, sm_80: no spills)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.codegen import columns, mapreduce
from tilefuse.graph import fusion, ir
from tilefuse.runtime.launch import compile_source_only


@pytest.fixture
def any_rows(monkeypatch):
    """Column kernels for any number of rows (the planner's floor is for the GPU's sake)."""
    monkeypatch.setattr(fusion, "COLUMN_MIN_ROWS", 1)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin"))


def ln_channels_first(x, w, b):
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return w[:, None, None] * ((x - u) / torch.sqrt(s + 1e-6)) + b[:, None, None]


def _steps(p):
    return [s for s in p.plan.steps if s.family != "alias" and not s.view]


def test_softmax_over_channels_is_one_column_kernel(any_rows):
    """softmax(x, 1) of [N, C, H, W]: max, exp, sum and division in one kernel, rows the N*H*W
    positions, the row the C channels, where PyTorch's reductions and two row kernels ran."""
    x = torch.randn(2, 16, 64, 64)
    p = tilefuse.compile(lambda x: torch.softmax(x, 1), (x,))
    (s,) = _steps(p)
    assert s.family == "mapreduce" and s.columns and s.space == ((2, 64, 64), 16)
    assert "(strided: a column kernel)" in str(p.plan)
    torch.testing.assert_close(p(x), torch.softmax(x, 1))


def test_a_16_bit_upcast_before_the_reduction_joins_the_column_kernel(any_rows):
    """The cast to f32 a bf16 softmax starts with is no row kernel of its own (column_ahead)."""
    x = torch.randn(2, 16, 64, 64, dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x: torch.softmax(x, 1), (x,))
    (s,) = _steps(p)
    assert s.columns and s.inputs == [p.graph.inputs[0]]
    torch.testing.assert_close(p(x), torch.softmax(x, 1), atol=1e-2, rtol=1e-2)


def test_channels_first_layernorm_is_one_kernel_with_its_weights_per_channel(any_rows):
    x, w, b = torch.randn(2, 24, 64, 64), torch.randn(24), torch.randn(24)
    p = tilefuse.compile(ln_channels_first, (x, w, b))
    (s,) = _steps(p)
    assert s.columns
    torch.testing.assert_close(p(x, w, b), ln_channels_first(x, w, b), atol=1e-5, rtol=1e-4)


def test_too_few_rows_stay_in_pytorch(monkeypatch):
    """Fewer rows than column_min_rows() (threads to keep the memory busy): PyTorch's reduction;
    from there on, a column kernel, alone or with maps; a row longer than COLUMN_LONG_ROW wants
    proportionally more rows (a thread's share of the row is what a split kernel waits on).
    (TILEFUSE_SPLIT=0: a lone reduction below the floor would reduce pieces of its column,
    tests/cpu/test_split_columns.py.)"""
    monkeypatch.setenv("TILEFUSE_SPLIT", "0")
    floor, long = fusion.COLUMN_MIN_ROWS, fusion.COLUMN_LONG_ROW
    softmax = lambda x: torch.softmax(x, 0)  # noqa: E731
    lone = lambda x: x.sum(0)  # noqa: E731
    for C, rows, fn, columns in ((17, floor - 1, softmax, False), (17, floor, softmax, True),
                                 (17, floor - 1, lone, False), (17, floor, lone, True),
                                 (3 * long, 3 * floor - 1, lone, False), (3 * long, 3 * floor, lone, True)):
        # (17 > small_reductions.MAX_EXTENT: no maps; 17 x 1023 > fusion.COLUMN_SMALL: not small)
        p = tilefuse.compile(fn, (torch.randn(C, rows),))
        assert any(s.columns for s in _steps(p)) == columns, (C, rows, str(p.plan))
        if not columns:
            assert "reduction over a non-last axis runs in PyTorch" in str(p.plan)
            assert f"{rows} rows beside it, fewer than a column kernel over rows of {C} takes" in str(p.plan)


def test_the_row_floor_can_be_set_from_the_environment(monkeypatch):
    x = torch.randn(9, 100)
    monkeypatch.setenv("TILEFUSE_COLUMN_MIN_ROWS", "1")
    p = tilefuse.compile(lambda x: x.sum(0), (x,))
    assert [(s.family, s.columns) for s in _steps(p)] == [("mapreduce", True)]
    monkeypatch.setenv("TILEFUSE_COLUMN_MIN_ROWS", "lots")
    with pytest.raises(ValueError, match="TILEFUSE_COLUMN_MIN_ROWS"):
        tilefuse.compile(lambda x: x.sum(0), (x,))


def test_columns_off_leaves_the_reductions_to_pytorch(monkeypatch, any_rows):
    monkeypatch.setenv("TILEFUSE_COLUMNS", "0")
    x = torch.randn(2, 16, 64, 64)
    p = tilefuse.compile(lambda x: torch.softmax(x, 1), (x,))
    assert sum(s.family == "extern" for s in _steps(p)) == 2
    assert not any(s.columns for s in _steps(p))


def test_a_row_kernel_of_the_same_sizes_is_not_joined_by_a_column_reduction(any_rows):
    """[4, 9, 16] reduced over dim 1 and [4, 16, 9] over its last dim share sizes (rows 4 x 16,
    rows of 9) but not a layout: two kernels, both right."""
    fn = lambda x, y: (x.sum(1), y.sum(-1))  # noqa: E731
    x, y = torch.randn(4, 9, 16), torch.randn(4, 16, 9)
    p = tilefuse.compile(fn, (x, y))
    steps = _steps(p)
    assert sorted(s.columns for s in steps) == [False, True]
    for got, want in zip(p(x, y), fn(x, y)):
        torch.testing.assert_close(got, want)


PROGRAMS = {
    "sum": lambda x, k: x.sum(k),
    "mean_keepdim": lambda x, k: x.mean(k, keepdim=True),
    "amax": lambda x, k: x.amax(k),
    "amin_plus": lambda x, k: x.amin(k, keepdim=True) + x,
    "softmax": lambda x, k: torch.softmax(x, k),
    "log_softmax": lambda x, k: torch.log_softmax(x, k),
    "logsumexp": lambda x, k: (x - x.amax(k, keepdim=True)).exp().sum(k).log() + x.amax(k),
    "var": lambda x, k: x.var(k),
    "norm": lambda x, k: (x - x.mean(k, keepdim=True)) * torch.rsqrt(x.pow(2).mean(k, keepdim=True) + 1e-5),
}


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=2, max_size=4), data=st.data(),
       name=st.sampled_from(sorted(PROGRAMS)))
def test_reductions_over_a_dim_not_last_match_pytorch(shape, data, name):
    """Any program of PROGRAMS over any dim but the last, at any shape (sizes 1 included), run
    through the interpreter on the plan with column kernels for any number of rows, equals
    PyTorch's; and where that dim has more than one element followed by one that has, the
    reduction is in a column kernel."""
    k = data.draw(st.integers(0, len(shape) - 2))
    fn = PROGRAMS[name]
    x = torch.randn(*shape, dtype=torch.float64)
    old = fusion.COLUMN_MIN_ROWS
    fusion.COLUMN_MIN_ROWS = 1
    try:
        p = tilefuse.compile(lambda x: fn(x, k), (x,))
    finally:
        fusion.COLUMN_MIN_ROWS = old
    torch.testing.assert_close(p(x), fn(x, k), equal_nan=True)  # (var over one element: NaN, as in PyTorch)
    strided = shape[k] > 1 and any(d > 1 for d in shape[k + 1:])
    # (a lone sum or max over a short dim is maps of its slices instead: rules/small_reductions)
    reduces = any(isinstance(n, ir.Reduce) for n in p.plan.graph.nodes)
    assert any(s.columns for s in _steps(p)) == (strided and reduces), str(p.plan)
    if strided:
        assert not any(s.family == "extern" for s in _steps(p)), str(p.plan)


def _kernel(fn, *shapes, dtype=torch.float32):
    ins = tuple(torch.randn(*s, dtype=dtype) for s in shapes)
    p = tilefuse.compile(fn, ins)
    (lw,) = p.kernels.values()
    return lw.kernel


def test_column_kernels_split_rows_across_warps_and_row_kernels_do_not(any_rows):
    """A column kernel's rows go to neighbouring lanes, single elements, each row split between
    threads a warp apart (whole warps of rows a CTA); a row kernel reads chunks along its rows."""
    k = _kernel(lambda x: torch.softmax(x, 1), (2, 16, 64, 64))
    assert columns.strided_rows(k)
    s = mapreduce.default_schedule(k)
    assert s.vector == 1 and s.across and s.group > 1 and s.slots % 32 == 0
    assert mapreduce.default_schedule(_kernel(lambda x: torch.softmax(x, 1), (2, 3, 64, 64))).group == 1
    row = _kernel(lambda x: torch.softmax(x, -1), (2, 64, 64, 16))
    assert not columns.strided_rows(row)
    assert mapreduce.default_schedule(row).vector > 1  # (the row kernel reads chunks along its rows)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("C", [3, 64, 96, 97, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["softmax", "layernorm", "mean"])
def test_column_kernels_build_without_spills(name, dtype, C, arch, any_rows):
    fn = {"softmax": lambda x, w, b: torch.softmax(x, 1), "layernorm": ln_channels_first,
          "mean": lambda x, w, b: x.mean(1) * x.amax(1)}[name]  # (x read twice: no maps, small_reductions)
    k = _kernel(fn, (4, C, 32, 64), (C,), (C,), dtype=dtype)
    src, cubin = compile_source_only(k, arch)
    assert src.schedule.across == (C >= 2 * columns.MIN_SHARE) and src.schedule.across == (src.schedule.group > 1)
    assert cubin.info.clean, f"{name} {C} {dtype} {arch} {src.schedule}: {cubin.info}"


def test_an_upcast_beside_the_one_leading_to_the_reduction_joins_too(any_rows):
    """`x.float() * rsqrt(x.float().pow(2).mean(1))`: two upcasts of x, the first read only after
    the mean; both in the column kernel (column_ahead looks beside a map too), one kernel."""
    fn = lambda x, w: ((x.float() * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6)).to(x.dtype)  # noqa: E731
                       * w[:, None, None])
    x, w = torch.randn(2, 64, 96, 96, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    p = tilefuse.compile(fn, (x, w))
    (s,) = _steps(p)
    assert s.columns
    torch.testing.assert_close(p(x, w), fn(x, w), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("C", [64, 1000])
def test_the_tuner_searches_rows_split_across_warps_for_column_kernels(C, any_rows):
    """Every config of a column kernel's knob space keeps single elements (a row's neighbours
    lie a whole row apart) and splits a row (across warps) exactly where its group is more than
    one thread; a thread's share of up to twice REGS_MAX_COLUMNS may be held in registers,
    longer ones are streamed; the default is among them."""
    from tilefuse.tune import mapreduce as tm

    k = _kernel(lambda x: torch.softmax(x, 1), (4, C, 32, 64))
    sp = tm.space(k)
    configs = [dict(zip(sp.names, c)) for c in sp.configs() if sp.is_valid(c)]
    assert configs and all(c["vector"] == 1 and c["across"] == (c["group"] > 1) for c in configs)
    assert {c["group"] for c in configs} >= {1, 2, 4, 8}
    for c in configs:
        assert c["stage"] == "stream" or -(-C // c["group"]) <= 2 * columns.REGS_MAX_COLUMNS
    assert {c["stage"] for c in configs if c["group"] == 1} == (
        {"regs", "stream"} if C <= 2 * columns.REGS_MAX_COLUMNS else {"stream"})
    assert dict(zip(sp.names, sp.default)) in configs


def test_a_map_behind_a_last_dim_reduction_does_not_start_a_column_kernel():
    """LayerNorm over the last dim, then a mean over dim 1 (final norm, then pooling): the residual
    add stays in the LayerNorm's row kernel. Led into a column kernel toward the mean (through
    the norm's maps, which its mean(-1) keeps out of that kernel), it was written and read back."""
    fn = lambda x, r, w, b: torch.nn.functional.layer_norm(x + r, (1024,), w, b).mean(1)  # noqa: E731
    ins = (torch.randn(32, 64, 1024), torch.randn(32, 64, 1024), torch.randn(1024), torch.randn(1024))
    p = tilefuse.compile(fn, ins)
    first = _steps(p)[0]
    assert not first.columns and {"add", "rsqrt"} <= {p.graph[n].op for n in first.nodes if hasattr(p.graph[n], "op")}
    torch.testing.assert_close(p(*ins), fn(*ins), atol=1e-4, rtol=1e-4)


def test_a_sibling_of_square_sizes_joins_along_the_reduced_dim():
    """(x.sum(1), (y * 2).sum(1)) at [64, 512, 512]: y * 2 joins x's column kernel aligned as a
    column kernel's tensors are (not as a row kernel's, which square sizes also fit), and so does
    its sum: one kernel, each input read once."""
    fn = lambda x, y: (x.sum(1), (y * 2).sum(1))  # noqa: E731
    ins = (torch.randn(64, 512, 512), torch.randn(64, 512, 512))
    p = tilefuse.compile(fn, ins)
    (s,) = _steps(p)
    assert s.columns and s.outputs == list(p.graph.outputs)
    for got, want in zip(p(*ins), fn(*ins)):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_a_full_tensor_beside_a_reduced_one_joins_the_column_kernel(any_rows):
    """x.amax(1, keepdim=True) * y: y, not yet in the kernel, takes the column kernel's alignment
    of a full tensor (Step.ref), not the row kernel's fallback."""
    fn = lambda x, y: x.amax(1, keepdim=True) * y  # noqa: E731
    ins = (torch.randn(2, 16, 64, 64), torch.randn(2, 16, 64, 64))
    p = tilefuse.compile(fn, ins)
    (s,) = _steps(p)
    assert s.columns
    torch.testing.assert_close(p(*ins), fn(*ins))


def test_a_transposed_view_is_copied_once_for_its_reductions_and_views():
    """t = x.permute(0, 2, 1) summed over its last dim and over (0, 1) (a merged reshape of t):
    one tiles copy that both read (the reshape a free view of it), no PyTorch copy beside it."""
    fn = lambda x: ((t := x.permute(0, 2, 1)).sum(-1), t.sum((0, 1)))  # noqa: E731
    x = torch.randn(32, 64, 256)
    p = tilefuse.compile(fn, (x,))
    copies = [s for s in _steps(p) if any(getattr(p.graph[n], "op", None) == "permute" for n in s.nodes)
              or "permute_copy" in s.nodes]
    assert len(copies) == 1 and copies[0].family == "mapreduce", str(p.plan)
    for got, want in zip(p(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_widening_cast_stays_out_of_the_tiles_copy():
    """The LayerNorm's f32 cast of bf16 x joins the row kernel, not the copy: the copy is written
    in bf16 (written in f32 it was half again the bytes, a review's finding)."""
    fn = lambda x, w: torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (64,), w)  # noqa: E731
    x, w = torch.randn(4, 64, 7, 7).bfloat16(), torch.randn(64).bfloat16()
    p = tilefuse.compile(fn, (x, w))
    copy, norm = _steps(p)
    assert [p.graph[o].type.dtype for o in copy.outputs] == ["bf16"], str(p.plan)
    torch.testing.assert_close(p(x, w).float(), fn(x, w).float(), rtol=2e-2, atol=2e-2)


def test_a_transposed_view_a_reduction_reads_is_copied_in_tiles():
    """A LayerNorm over the channels of NHWC read from NCHW (ConvNeXt's): the permute is copied
    by a kernel of its own that reads it in tiles (a map kernel: no PyTorch copy), and the
    LayerNorm's row kernel reads that copy; the two kernels stay apart (a kernel with a
    reduction has no tiles)."""
    fn = lambda x: torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1) * 2, (24,))  # noqa: E731
    x = torch.randn(2, 24, 16, 16)
    p = tilefuse.compile(fn, (x,))
    copy, norm = _steps(p)
    assert copy.family == norm.family == "mapreduce"
    assert not any(isinstance(p.graph[n], ir.Reduce) for n in copy.nodes)
    assert sum(isinstance(p.graph[n], ir.Reduce) for n in norm.nodes) == 2
    assert "2-D tiles" in str(p.plan)
    torch.testing.assert_close(p(x), fn(x), atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("fn", [lambda e: e.t().to(torch.int32).sum(0), lambda e: e.t().to(torch.int32).prod(0)],
                         ids=["sum", "prod"])
def test_a_column_kernel_whose_row_would_not_fit_registers_streams_it(fn):
    """40 i64 columns a thread are 80 registers of row, more than render holds (it refused the
    default, a crash when called): such rows are streamed; every kernel builds without spills
    and the program computes eager's integers."""
    e = torch.randint(-3, 4, (40000, 40))
    p = tilefuse.compile(fn, (e,))
    for lw in p.kernels.values():
        for arch in ("sm_90a", "sm_80"):
            src, cubin = compile_source_only(lw.kernel, arch)
            assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"
    assert torch.equal(p(e), fn(e))


def test_a_scan_keeps_its_own_floor_inside_a_reductions_column_kernel():
    """(x / x.sum(1)).cumsum(1) over 2000 rows: the sum and division are a column kernel (1024
    rows suffice), the scan, a row a thread, is not in it below SCAN_MIN_ROWS (review, session 69:
    it joined, and took the reduction's split away)."""
    x = torch.rand(4, 300, 500) + 0.5  # (positive: no sum near 0 to divide by)
    fn = lambda x: (x / x.sum(1, keepdim=True)).cumsum(1)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    cols = [s for s in _steps(p) if s.columns]
    assert cols and not any(s.scan for s in cols), str(p.plan)
    assert "scan runs in PyTorch" in str(p.plan)
    from tilefuse.check import compare, float64_reference

    c = compare("cumsum", p(x), float64_reference(fn, (x,)), fn(x))
    assert c.ok, c


def test_the_floor_from_the_environment_is_taken_as_it_is(monkeypatch):
    """TILEFUSE_COLUMN_MIN_ROWS=1: column kernels at any size, long rows too (not scaled by the
    row's length as the default floor is)."""
    monkeypatch.setenv("TILEFUSE_COLUMN_MIN_ROWS", "1")
    assert fusion.column_min_rows(8192) == 1
    p = tilefuse.compile(lambda x: torch.softmax(x, 0), (torch.randn(4096, 3),))
    assert [s.columns for s in _steps(p)] == [True], str(p.plan)
    monkeypatch.delenv("TILEFUSE_COLUMN_MIN_ROWS")
    assert fusion.column_min_rows(8192) == 8 * fusion.COLUMN_MIN_ROWS
    assert fusion.column_min_rows(2047) == fusion.COLUMN_MIN_ROWS


@pytest.mark.parametrize("shape,axes,why", [
    ((2000, 1, 300), (1, 2), "its dim is last but for dims of one element"),
    ((3000, 7), (0,), "fewer than a column kernel over rows of 3000 takes (2048)"),
    ((64, 3000, 40), (1, 2), "neighbouring dims [1, 2] not merged into one"),
    ((64, 3000, 40), (0, 2), "dims [0, 2] are not neighbours"),
])
def test_a_reduction_left_to_pytorch_says_why(shape, axes, why, monkeypatch):
    from tilefuse.graph.fusion import _Planner

    monkeypatch.delenv("TILEFUSE_COLUMN_MIN_ROWS", raising=False)
    out = tuple(d for i, d in enumerate(shape) if i not in axes)
    g = ir.Graph((ir.Input("x", ir.TensorType(shape, "f32")), ir.Reduce("y", ir.TensorType(out, "f32"), "sum", "x", axes,
                                                                         False)), ("x",), ("y",))
    assert why in _Planner(g).reduce_note(g["y"])


def test_the_interpreter_sums_a_column_as_accurately_as_pytorch():
    """x.sum(0) of f32 2048 x 2048 (a column kernel now) through the Loop IR interpreter: within
    the 2x rule of float64 (NumPy added row after row over axis 0: 12x eager's error)."""
    from tilefuse.check import compare, float64_reference

    x = torch.randn(2048, 2048)
    fn = lambda x: x.sum(0)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert [s.columns for s in _steps(p)] == [True], str(p.plan)
    c = compare("sum(0)", p(x), float64_reference(fn, (x,)), fn(x))
    assert c.ok, c

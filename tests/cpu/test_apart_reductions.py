"""Reductions over dims that are not neighbours (graph/rules/apart_reductions.py): a run of
neighbouring dims at a time, the last run first; a variance's second moment from each row's own
moments (one pass over x); BatchNorm's batch statistics lowered through them. The rewritten
programs compute what PyTorch does (CPU interpreter, tilefuse.check's 2x rule against
float64), which reductions are taken and which stay PyTorch's, what the plans hold, and that
their kernels build clean."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.graph import fusion
from tilefuse.graph.interp import run_graph
from tilefuse.graph.rules import apart_reductions as ar
from tilefuse.runtime.launch import compile_source_only


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin"))
    monkeypatch.delenv("TILEFUSE_COLUMN_MIN_ROWS", raising=False)


def _steps(p):
    return [s for s in p.plan.steps if s.family != "alias" and not s.view]


def _in_runs(p) -> bool:
    return any(n.name.endswith("_run") or "_run_" in n.name for n in p.graph.nodes)


def _check(fn, *ins):
    p = tilefuse.compile(fn, ins)
    got, ref, eager = p(*ins), float64_reference(fn, ins), fn(*ins)
    got, ref, eager = [o if isinstance(o, tuple) else (o,) for o in (got, ref, eager)]
    for i, (a, r, e) in enumerate(zip(got, ref, eager)):
        c = compare(f"out {i}", a, r, e)
        assert c.ok, c
    return p


def test_runs_split_where_a_longer_dim_is_kept():
    assert ar.runs((32, 64, 56, 56), (0, 2, 3)) == [[0], [2, 3]]
    assert ar.runs((32, 1, 64, 1, 56), (0, 1, 3, 4)) == [[0, 1], [3, 4]]
    assert ar.runs((8, 1, 9), (0, 2)) == [[0, 2]]  # (only a dim of one element between: neighbours)
    assert ar.runs((4, 5, 6, 7, 8), (0, 2, 4)) == [[0], [2], [4]]


def test_batchnorm_statistics_are_two_kernels_not_pytorchs():
    """mean over (0, 2, 3) of [32, 64, 56, 56]: a row kernel over the 2048 rows of 3136 (merged)
    and a column kernel over the 64 x 32 row means; no PyTorch reduction."""
    x = torch.randn(32, 64, 56, 56)
    p = _check(lambda x: x.mean((0, 2, 3)), x)
    steps = _steps(p)
    assert [s.family for s in steps] == ["mapreduce", "mapreduce"], str(p.plan)
    assert steps[0].space == ((32, 64), 3136) and steps[1].columns, str(p.plan)


def test_a_variance_reads_x_once():
    """x.var((0, 2, 3)): each row's mean and squares about it in one kernel, the combination
    (Chan et al.) and the scaling in a second: two kernels, x read once."""
    x = torch.randn(32, 64, 56, 56, dtype=torch.bfloat16)
    p = _check(lambda x: x.var((0, 2, 3)), x)
    steps = _steps(p)
    assert len(steps) == 2 and steps[1].columns, str(p.plan)
    assert sum(s.bytes for s in steps) < 1.01 * x.numel() * 2, str(p.plan)
    assert any(n.name.endswith("_within") for n in p.graph.nodes), str(p.graph)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_norm_with_batch_statistics_is_lowered(dtype):
    """F.batch_norm(training=True) without running statistics, then ReLU: statistics, finish,
    normalisation (plus the 16-bit weights' upcast): no PyTorch op, x read twice."""
    x = (torch.randn(16, 64, 40, 40) + 1).to(dtype)
    w, b = (torch.rand(64) + 0.5).to(dtype), torch.randn(64).to(dtype)
    fn = lambda x, w, b: F.relu(F.batch_norm(x, None, None, w, b, training=True))  # noqa: E731
    p = _check(fn, x, w, b)
    steps = _steps(p)
    assert all(s.family == "mapreduce" for s in steps) and len(steps) <= 4, str(p.plan)
    big = [s for s in steps if s.bytes > x.numel()]
    assert len(big) == 2, str(p.plan)  # (the statistics' pass and the normalisation's)


def test_batch_norm_left_to_pytorch_where_it_is_one_launch():
    """Under 2^20 elements, or over one run of dims ([N, C]), PyTorch's BatchNorm stays, named."""
    for shape in [(8, 64, 32, 32), (4096, 128)]:
        x = torch.randn(*shape)
        p = tilefuse.compile(lambda x: F.batch_norm(x, None, None, training=True), (x,))
        ext = [s for s in _steps(p) if s.family == "extern"]
        assert len(ext) == 1 and "batch statistics" in str(p.plan), str(p.plan)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_variance_over_few_long_columns_reads_x_once_in_pieces(dtype):
    """x.var(0) of [8192, 1024] (1024 rows of 8192: too few for a column kernel whole): x viewed
    as 32 pieces of 256 (32768 rows of pieces), a column kernel making each piece's mean and
    squares about it (the 16-bit upcast in it), and one combining the 32: two kernels, x read
    once; it was PyTorch's mean, a kernel of squares and PyTorch's sum."""
    x = (torch.randn(8192, 1024) * 2 + 3).to(dtype)
    p = _check(lambda x: x.std(0), x)
    steps = _steps(p)
    assert len(steps) == 2 and all(s.columns for s in steps), str(p.plan)
    assert steps[0].space == ((32, 1024), 256), str(p.plan)
    assert sum(s.bytes for s in steps) < 1.05 * x.numel() * x.element_size(), str(p.plan)


def test_batch_norm_of_a_maps_result_stays_pytorchs():
    """The statistics' kernel and the normalisation's would each read relu(x): written between
    them, where the map kernel and PyTorch's BatchNorm move fewer bytes (a review's find)."""
    x = torch.randn(32, 64, 32, 32)
    p = tilefuse.compile(lambda x: F.batch_norm(torch.relu(x), None, None, training=True), (x,))
    assert [s.family for s in _steps(p)] == ["mapreduce", "extern"], str(p.plan)
    assert "computed or viewed tensor" in str(p.plan)


def test_a_variance_about_the_mean_written_either_way_reads_x_once():
    x = torch.randn(32, 64, 32, 32)
    p = _check(lambda x: ((x.mean((0, 2, 3), keepdim=True) - x) ** 2).mean((0, 2, 3)), x)
    assert len(_steps(p)) == 2 and any(n.name.endswith("_within") for n in p.graph.nodes), str(p.plan)


def test_batch_norm_updating_running_statistics_stays_pytorchs():
    x, rm, rv = torch.randn(16, 64, 40, 40), torch.zeros(64), torch.ones(64)
    p = tilefuse.compile(lambda x, rm, rv: F.batch_norm(x, rm, rv, training=True), (x, rm, rv))
    assert any(s.family == "extern" for s in _steps(p)), str(p.plan)


@pytest.mark.parametrize("name,fn,shape", [
    ("sum over B and D, keepdim", lambda x: x.sum((0, 2), keepdim=True), (8, 1000, 1031)),
    ("amax over three runs", lambda x: x.amax((0, 2, 4)), (3, 5, 70, 6, 1100)),
    ("min, int", lambda x: (x * 100).to(torch.int32).amin((0, 2, 3)), (16, 48, 37, 45)),
    ("a bf16 sum: f32 partials", lambda x: x.to(torch.bfloat16).sum((0, 2, 3)), (16, 48, 37, 45)),
    ("a map's sum: the map in the first step's kernel", lambda x: torch.relu(x).sum((0, 2)), (16, 48, 2000)),
    ("var_mean, unbiased", lambda x: torch.var_mean(x, (0, 2)), (64, 96, 1000)),
    ("std, keepdim", lambda x: x.std((0, 2, 3), keepdim=True), (9, 33, 61, 67)),
    ("a mean of squares about the mean", lambda x: ((x - x.mean((0, 2), keepdim=True)) ** 2).mean((0, 2)),
     (64, 96, 1000)),
])
def test_reductions_in_runs_match_pytorch(name, fn, shape):
    x = torch.randn(*shape) * 3 + 1
    p = _check(fn, x)
    assert _in_runs(p), (name, str(p.graph))
    assert not any(s.family == "extern" for s in _steps(p)), (name, str(p.plan))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=3, max_size=5), st.data())
def test_any_apart_dims_any_op_matches_float64(dims, data):
    """Any shape, any apart reduced dims, each op: the interpreter's values against float64
    (the rule forced on at any size)."""
    shape = tuple(d * data.draw(st.sampled_from([1, 3, 7]), label="scale") for d in dims)
    axes = sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=2), label="axes"))
    op = data.draw(st.sampled_from(["sum", "mean", "amax", "amin", "var"]), label="op")
    keep = data.draw(st.booleans(), label="keepdim")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5
    fn = lambda x: getattr(x, op)(tuple(axes), keepdim=keep)  # noqa: E731
    old = ar.MIN_ELEMENTS, ar.MIN_SHRINK, ar.MIN_ROWS, fusion.COLUMN_MIN_ROWS
    ar.MIN_ELEMENTS, ar.MIN_SHRINK, ar.MIN_ROWS, fusion.COLUMN_MIN_ROWS = 1, 1, 1, 1
    try:
        p = _check(fn, x)
        rs = ar.runs(shape, axes)
        if len(rs) > 1 and all(any(shape[a] > 1 for a in r) for r in rs):
            assert _in_runs(p), str(p.graph)
    finally:
        ar.MIN_ELEMENTS, ar.MIN_SHRINK, ar.MIN_ROWS, fusion.COLUMN_MIN_ROWS = old


@pytest.mark.parametrize("name,fn,shape", [
    ("one run of dims", lambda x: x.sum((2, 3)), (32, 64, 56, 56)),
    ("a small tensor of the program's", lambda x: x.sum((0, 2, 3)), (8, 64, 32, 32)),
    ("a short last run: half the tensor left for the rest", lambda x: x.sum((0, 2)), (4096, 64, 2)),
    ("few rows beside the last run", lambda x: x.sum((0, 2)), (2, 100, 60000)),
    ("a permuted view: one run in memory", lambda x: x.transpose(1, 2).sum((0, 2)), (8, 1024, 512)),
])
def test_what_stays_as_it_was(name, fn, shape):
    x = torch.randn(*shape)
    assert not _in_runs(tilefuse.compile(fn, (x,))), name


def test_a_small_column_reduction_is_a_kernel_at_any_rows():
    """fusion.COLUMN_SMALL: [64, 32].sum(0) (32 rows, under the 1024-row floor) is one column
    kernel, as PyTorch's reduction would be one launch; [65536, 32] stays PyTorch's."""
    p = _check(lambda x: x.sum(0), torch.randn(64, 32))
    assert [s.columns for s in _steps(p)] == [True], str(p.plan)
    p = tilefuse.compile(lambda x: x.sum(0), (torch.randn(65536, 32),))
    assert [s.family for s in _steps(p)] == ["extern"], str(p.plan)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_kernels_build_without_spills(arch):
    x = torch.randn(16, 64, 40, 40, dtype=torch.bfloat16)
    w, b = torch.rand(64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x, w, b: F.relu(F.batch_norm(x, None, None, w, b, training=True)), (x, w, b))
    for s in _steps(p):
        src, cubin = compile_source_only(p.kernels[s.name].kernel, arch)
        assert cubin.info.clean, f"{s.name} {arch}: {cubin.info}"


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
def test_equal_reductions_are_computed_once(dtype):
    """rewrites.shared_reductions: the user's mean and the one std makes inside are one ; the one without kept dims a view of the other.
    z-scores over columns: statistics, their finish, the normalisation: three kernels, no
    PyTorch mean beside them."""
    from tilefuse.graph import ir, rewrites

    x = torch.randn(8192, 2048, dtype=dtype)
    p = _check(lambda x: (x - x.mean(0)) / x.std(0), x)
    steps = _steps(p)
    assert len(steps) == 3 and all(s.family == "mapreduce" for s in steps), str(p.plan)
    g = ir.Graph((ir.Input("x", ir.TensorType((4, 6), "f32")),
                  ir.Reduce("a", ir.TensorType((4,), "f32"), "sum", "x", (1,), False),
                  ir.Reduce("b", ir.TensorType((4, 1), "f32"), "sum", "x", (1,), True),
                  ir.Reduce("c", ir.TensorType((4, 1), "f32"), "max", "x", (1,), True)), ("x",), ("a", "b", "c"))
    h = rewrites.shared_reductions(g)
    assert [type(n).__name__ for n in h.nodes] == ["Input", "Reduce", "View", "Reduce"], str(h)
    assert h["b"].keepdim and h["a"].arg == "b" and h["c"].op == "max", str(h)
    xs = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for want, got in zip(run_graph(g, {"x": xs}), run_graph(h, {"x": xs})):
        assert np.array_equal(want, got)

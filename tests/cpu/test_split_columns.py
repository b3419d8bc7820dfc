"""Reductions over a dim that is not last with too few rows for a column kernel, split into
pieces (rewrites.split_long_columns): `x.sum(0)` over 8192 x 2048 (2048 rows of 8192) was
PyTorch's reduction; now a column kernel reduces 32768 rows of 512 and a small reduction
finishes. The rewritten graphs compute what the originals do (graph interpreter, tilefuse.check's
2x rule against float64), which reductions split and which stay as they were, and the pieces'
kernel builds clean."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.graph import fusion, ir, rewrites
from tilefuse.graph.interp import run_graph
from tilefuse.runtime.launch import compile_source_only


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin"))
    monkeypatch.delenv("TILEFUSE_COLUMN_MIN_ROWS", raising=False)


def _columns(p):
    return [s for s in p.plan.steps if s.family == "mapreduce" and s.columns]


def _graph(op, shape, axis, keepdim=False, dtype="f32"):
    out = tuple(1 if i == axis else d for i, d in enumerate(shape)) if keepdim else \
        tuple(d for i, d in enumerate(shape) if i != axis)
    nodes = (ir.Input("x", ir.TensorType(shape, dtype)), ir.Reduce("y", ir.TensorType(out, dtype), op, "x", (axis,), keepdim))
    return ir.Graph(nodes, ("x",), ("y",))


def test_a_sum_over_few_long_columns_reduces_pieces_then_finishes():
    """8192 x 2048, sum over dim 0: pieces of 512 (the longest divisor up to 1024 giving 32768
    rows), a column kernel over them with f32 partials, and a reduction over the 16 pieces."""
    x = torch.randn(8192, 2048, dtype=torch.bfloat16)
    fn = lambda x: x.sum(0)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    cols = _columns(p)
    assert cols and cols[0].space == ((16, 2048), 512), str(p.plan)
    part = p.graph[cols[0].outputs[0]]
    assert isinstance(part, ir.Reduce) and part.type.dtype == "f32", str(p.graph)
    c = compare("sum(0)", p(x), float64_reference(fn, (x,)), fn(x))
    assert c.ok, c


def test_the_squares_a_split_column_sum_reads_join_its_pieces_kernel():
    """(x * x).sum(0): the map moves into the pieces' space (reshapes_onto_maps), not a kernel
    of its own writing the squares."""
    x = torch.randn(4096, 1024)
    fn = lambda x: (x * x).sum(0, keepdim=True)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    cols = _columns(p)
    steps = [s for s in p.plan.steps if s.family != "alias" and not s.view]
    assert len(steps) == 2 and steps[0] is cols[0] and "mul_pieces" in cols[0].nodes, str(p.plan)
    c = compare("(x*x).sum(0)", p(x), float64_reference(fn, (x,)), fn(x))
    assert c.ok, c


@pytest.mark.parametrize("name,fn,shape", [
    ("rows enough for a column kernel", lambda x: x.sum(0), (1024, 1024)),
    ("too few rows for the finish to be a kernel", lambda x: x.mean(0), (4096, 300)),
    ("a flip: a gather of the whole, not maps of the input", lambda x: torch.flip(x, (0,)).sum(0), (8192, 2048)),
    ("a softmax: its max and exp read x together", lambda x: torch.softmax(x, 0), (8192, 512)),
    ("no divisor in 64-1024 (a prime)", lambda x: x.sum(0), (8191, 512)),
    ("too small even in pieces", lambda x: x.sum(0), (256, 3)),
    ("the last dim", lambda x: x.sum(-1), (4, 8192)),
])
def test_what_stays_as_it_was(name, fn, shape):
    x = torch.randn(*shape)
    g = tilefuse.compile(fn, (x,)).graph
    assert not any(n.name.endswith("_pieces") for n in g.nodes), (name, str(g))


def test_an_integer_sum_and_split_off_keep_pytorchs_reduction(monkeypatch):
    """An i32 sum (no f32 partials to take) and TILEFUSE_SPLIT=0 leave the graph as it was."""
    g = _graph("sum", (8192, 2048), 0, dtype="i32")
    assert rewrites.split_long_columns(g) is g
    monkeypatch.setenv("TILEFUSE_SPLIT", "0")
    f = _graph("sum", (8192, 2048), 0)
    assert rewrites.split_long_columns(f) is f


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_the_rewritten_graph_computes_what_the_original_does(op, keepdim):
    """[2, C, 512] over dim 1 -> [2, P, K, 512] -> [2, P, 512] -> [2, 512]: max and min exactly;
    sums, means and products (f32 partials) at most twice the whole column's error against
    float64 (the graph interpreter)."""
    shape = (2, 4096, 512)  # (1024 rows beside the column: its finish a column kernel too)
    g = _graph(op, shape, 1, keepdim)
    h = rewrites.split_long_columns(g)
    assert h is not g
    parts = [n for n in h.nodes if isinstance(n, ir.Reduce) and n.name != "y"]
    assert len(parts) == 1 and parts[0].axes == (2,), str(h)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    if op == "prod":
        x = 1 + 0.001 * x
    a, b = (run_graph(q, {"x": x})[0].astype(np.float64) for q in (g, h))
    assert a.shape == b.shape
    if op in ("max", "min"):
        assert np.array_equal(a, b)
    else:  # as close to float64 as the whole column's reduction, within the 2x rule
        ref = {"sum": np.sum, "mean": np.mean, "prod": np.prod}[op](x.astype(np.float64), axis=1, keepdims=keepdim)
        if op == "prod":  # (the interpreter multiplies a whole column in float64, the pieces' in
            # f32 partials: at most a rounding a piece and one more)
            P = parts[0].type.shape[1]
            assert np.abs(b - ref).max() <= (P + 1) * 2.0 ** -24 * np.abs(ref).max()
        else:
            assert np.abs(b - ref).max() <= 2 * np.abs(a - ref).max() + 1e-7 * np.abs(ref).max()


@settings(max_examples=15, deadline=None)
@given(lead=st.integers(1, 2), pieces=st.sampled_from([16, 24]), k=st.sampled_from([64, 96, 128]),
       after=st.sampled_from([1, 7, 600, 1031]), op=st.sampled_from(["sum", "mean", "amax", "amin"]),
       keepdim=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_split_column_reductions_compute_what_pytorch_does(lead, pieces, k, after, op, keepdim, dtype):
    """Rows beside the column few and many (1-1031 after it, 1-2 before), columns of 16-24
    pieces: split where _column_piece finds a piece, within the 2x rule of float64 either way."""
    C = pieces * k
    x = torch.randn(lead, C, after, dtype=dtype)
    fn = lambda x: getattr(torch, op)(x * 0.5 + 1, 1, keepdim=keepdim)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    split = any(n.name.endswith("_pieces") for n in p.graph.nodes)
    # (after = 1: the column is last but for a dim of one element, a row kernel's)
    rows = lead * after
    assert split == (after > 1 and rows < fusion.column_min_rows(C) and rewrites._column_piece(C, rows) is not None), \
        str(p.plan)
    c = compare(op, p(x), float64_reference(fn, (x,)), fn(x))
    assert c.ok, (c, str(p.plan))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_pieces_kernel_builds_without_spills(dtype, arch):
    x = torch.randn(8192, 2048, dtype=dtype)
    p = tilefuse.compile(lambda x: (x * x).sum(0), (x,))
    for s in _columns(p):
        src, cubin = compile_source_only(p.kernels[s.name].kernel, arch)
        assert cubin.info.clean, f"{s.name} {arch}: {cubin.info}"


def test_the_floor_it_works_below_is_the_planners():
    """A split happens only where the whole column would have stayed PyTorch's (fewer rows than
    fusion.column_min_rows for its length), so a column kernel the planner takes is never cut."""
    C = 8192
    floor = fusion.column_min_rows(C)
    g = _graph("sum", (C, floor), 0)
    assert rewrites.split_long_columns(g) is g
    g = _graph("sum", (C, floor - 1), 0)
    assert rewrites.split_long_columns(g) is not g

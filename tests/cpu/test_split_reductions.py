"""Reductions over few long rows split into pieces (rewrites.split_long_reductions) and the maps
they read moved into the pieces' row space (rewrites.reshapes_onto_maps): a full reduction of
16M elements was one row (one CTA streaming 64 MB) and its maps a kernel of their own. The
rewritten graphs compute what the originals do (the graph interpreter), which reductions split
and which stay whole, and the plans: the maps and the pieces' reduction in one kernel, one small
kernel finishing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph
from tilefuse.graph.rewrites import reshapes_onto_maps, split_long_reductions


def T(*shape, dtype="f32"):
    return ir.TensorType(tuple(shape), dtype)


def _reduce_graph(op, rows, C, keepdim=False, dtype="f32", square=False):
    lead = (rows,) if rows else ()
    nodes = [ir.Input("x", T(*lead, C, dtype=dtype))]
    arg = "x"
    if square:
        nodes.append(ir.Map("sq", T(*lead, C, dtype=dtype), "mul", ("x", "x")))
        arg = "sq"
    out = T(*lead, *((1,) if keepdim else ()), dtype=dtype) if rows else T(dtype=dtype)
    nodes.append(ir.Reduce("y", out, op, arg, (len(lead),), keepdim))
    return ir.Graph(tuple(nodes), ("x",), ("y",))


def _run(g, x):
    return run_graph(g, {"x": x})[0].astype(np.float64)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("rows,keepdim", [(0, False), (3, False), (3, True)])
def test_a_split_reduction_computes_what_the_whole_row_does(op, rows, keepdim):
    """[R, C] -> [R, P, K] pieces (f32 partials for sums and means) -> [R]: the same values (max
    and min exactly; sums within f32 reassociation)."""
    C = 1 << 17
    g = _reduce_graph(op, rows, C, keepdim)
    h = split_long_reductions(g)
    assert h is not g
    parts = [n for n in h.nodes if isinstance(n, ir.Reduce) and n.name != "y"]
    assert [p.type.shape for p in parts] == [((rows,) if rows else ()) + (C // 1024,)], str(h)
    x = np.random.default_rng(1).standard_normal(((rows,) if rows else ()) + (C,)).astype(np.float32)
    a, b = _run(g, x), _run(h, x)
    assert a.shape == b.shape
    if op in ("max", "min"):
        assert np.array_equal(a, b)
    else:
        np.testing.assert_allclose(b, x.astype(np.float64).sum(-1, keepdims=keepdim) / (C if op == "mean" else 1),
                                   rtol=1e-5, atol=1e-3)


def test_a_bf16_sum_keeps_f32_partials():
    h = split_long_reductions(_reduce_graph("sum", 2, 1 << 16, dtype="bf16"))
    (part,) = [n for n in h.nodes if isinstance(n, ir.Reduce) and n.name != "y"]
    assert part.type.dtype == "f32" and h["y"].type.dtype == "bf16"


@pytest.mark.parametrize("rows,C", [(512, 1 << 16), (4, 32768), (2, 65537), (1, 3 * 65539)])
def test_what_stays_whole(rows, C):
    """Rows enough for every SM (512), rows short enough for a CTA (< 65536), and rows with no
    piece length in SPLIT_REDUCE_K dividing them."""
    g = _reduce_graph("sum", rows, C)
    assert split_long_reductions(g) is g


def test_the_maps_a_split_reduction_reads_move_to_its_pieces():
    """sum(x * x) split: the square is computed on reshaped x, its result is the pieces."""
    g = _reduce_graph("sum", 0, 1 << 17, square=True)
    h = split_long_reductions(g)
    assert isinstance(h[h["y_part"].arg], ir.Map) and h[h["y_part"].arg].type.shape == (128, 1024), str(h)
    assert "sq" not in {n.name for n in h.nodes}
    x = np.random.default_rng(2).standard_normal(1 << 17).astype(np.float32)
    np.testing.assert_allclose(_run(h, x), (x.astype(np.float64) ** 2).sum(), rtol=1e-5)


def test_a_map_with_other_readers_or_a_generated_operand_keeps_its_place():
    x, sq = T(1 << 16), T(1 << 16)
    base = [ir.Input("x", x), ir.Map("sq", sq, "mul", ("x", "x")),
            ir.View("flat", T(64, 1024), "reshape", "sq", (64, 1024)),
            ir.Reduce("y", T(64), "sum", "flat", (1,), False)]
    shared = ir.Graph(tuple(base) + (ir.Map("z", sq, "exp", ("sq",)),), ("x",), ("y", "z"))
    assert reshapes_onto_maps(shared, {"flat"}) is shared  # (sq is read by exp too: moving it would compute it twice)
    returned = ir.Graph(tuple(base), ("x",), ("y", "sq"))
    assert reshapes_onto_maps(returned, {"flat"}) is returned
    gen = ir.Graph((ir.Input("x", x), ir.Iota("i", T(1 << 16), 0), ir.Map("sq", sq, "mul", ("x", "i")),
                    *base[2:]), ("x",), ("y",))
    assert reshapes_onto_maps(gen, {"flat"}) is gen
    moved = reshapes_onto_maps(ir.Graph(tuple(base), ("x",), ("y",)), {"flat"})
    assert isinstance(moved["flat"], ir.Map) and moved["flat"].type.shape == (64, 1024)
    assert reshapes_onto_maps(ir.Graph(tuple(base), ("x",), ("y",)), set()).nodes == tuple(base)  # (only those named)


def test_a_row_other_passes_read_stays_whole_where_a_cluster_holds_it():
    """A cross-entropy over 8 rows of 262144 (1 MB f32 a row: a cluster holds it, one read) keeps
    its one kernel; over one row of 1M f32 (4 MB: more than a cluster holds) a softmax splits."""
    x, t = torch.randn(8, 262144), torch.randint(0, 262144, (8,))
    p = tilefuse.compile(lambda x, t: F.cross_entropy(x, t), (x, t))
    assert _kernels(p)[0].space == ((8,), 262144), str(p.plan)
    p = tilefuse.compile(lambda x: torch.softmax(x, 0), (torch.randn(1 << 20),))
    assert ((1024,), 1024) in [s.space for s in _kernels(p)], str(p.plan)


def _kernels(p):
    return [s for s in p.plan.steps if s.family == "mapreduce"]


@pytest.mark.parametrize("name", ["sum of squares", "vector norm", "mse", "bf16 mean"])
def test_full_reductions_of_maps_are_a_pieces_kernel_and_a_finishing_one(name):
    fn, shape = {"sum of squares": (lambda x, y: (x * x).sum(), (1 << 20,)),
                 "vector norm": (lambda x, y: torch.linalg.vector_norm(x), (1024, 1024)),
                 "mse": (lambda x, y: F.mse_loss(x, y), (1024, 1024)),
                 "bf16 mean": (lambda x, y: x.bfloat16().mean(), (1024, 1024))}[name]
    x, y = torch.randn(shape), torch.randn(shape)
    p = tilefuse.compile(fn, (x, y))
    ks = _kernels(p)
    assert len(ks) == 2, str(p.plan)
    assert ks[0].space == ((1024,), 1024) and ks[1].space == ((), 1024), str(p.plan)
    want = fn(x.double(), y.double())
    torch.testing.assert_close(p(x, y).double(), want.to(p(x, y).dtype).double(), rtol=1e-2 if "bf16" in name else 1e-5, atol=0)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), k=st.sampled_from([512, 1024, 2048, 4096]), pieces=st.integers(16, 40),
       op=st.sampled_from(["sum", "mean", "amax", "amin"]), keepdim=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_split_row_reductions_compute_what_pytorch_does(rows, k, pieces, op, keepdim, dtype):
    C = k * pieces
    if C < 65536:
        C = k * (-(-65536 // k))
    x = torch.randn(rows, C, dtype=dtype)
    fn = lambda x: getattr(torch, op)(torch.exp(x * 0.5), -1, keepdim=keepdim)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert len(_kernels(p)) == 2, str(p.plan)
    want = fn(x.double())
    tol = dict(rtol=2e-2, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=0)
    torch.testing.assert_close(p(x).double(), want.to(dtype).double(), **tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mse_loss_is_lowered_and_within_the_2x_rule(reduction, dtype):
    """F.mse_loss (an extern before): squares in f32, their mean or sum rounded once."""
    from tilefuse.check import compare, float64_reference

    x, y = torch.randn(300, 517, dtype=dtype), torch.randn(300, 517, dtype=dtype)
    fn = lambda x, y: F.mse_loss(x, y, reduction=reduction)  # noqa: E731
    p = tilefuse.compile(fn, (x, y))
    assert not [s for s in p.plan.steps if s.family == "extern"], str(p.plan)
    c = compare("mse", p(x, y), float64_reference(fn, (x, y)), fn(x, y))
    assert c.ok, c


def test_a_per_row_operand_moves_with_the_maps():
    """(x * s).sum(-1), s of [R, 1]: s is read as [R, 1, 1] in the pieces' space, so the product
    is computed in the pieces' kernel (not written by a kernel of its own)."""
    x, s = torch.randn(4, 1 << 18), torch.randn(4, 1)
    p = tilefuse.compile(lambda x, s: (x * s).sum(-1), (x, s))
    ks = _kernels(p)
    assert [k.space for k in ks] == [((4, 256), 1024), ((4,), 256)], str(p.plan)
    torch.testing.assert_close(p(x, s), (x.double() * s.double()).sum(-1).float(), rtol=1e-5, atol=1e-3)


def test_a_row_no_power_of_two_divides_splits_into_its_largest_divisor():
    """999999 = 3^3 7 11 13 37: pieces of 3861, its largest divisor up to 4096."""
    h = split_long_reductions(_reduce_graph("max", 0, 999_999))
    (part,) = [n for n in h.nodes if isinstance(n, ir.Reduce) and n.name != "y"]
    assert h[part.arg].type.shape == (259, 3861), str(h)
    x = np.random.default_rng(3).standard_normal(999_999).astype(np.float32)
    assert _run(h, x) == x.max()

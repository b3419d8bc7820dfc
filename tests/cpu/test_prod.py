"""Products: `torch.prod` as a row reduction ("prod", identity 1, combine a * b) in the map-reduce
kernels, and, with it, `cumprod` over few long rows in pieces (each piece's product, their
running product, each piece scanned from it). Checked on the CPU: values through the
interpreters against eager and a float64 reference, the plans, and spill-free builds."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.codegen import cexpr
from tilefuse.graph import ir
from tilefuse.graph.interp import eval_reduce
from tilefuse.runtime.launch import compile_source_only


def _externs(p):
    return [s for s in p.plan.steps if s.family == "extern" and not s.view]


def _kernels(p):
    return [s for s in p.plan.steps if s.family == "mapreduce"]


FNS = {
    "row": lambda x: (1 + 0.05 * x).prod(-1),
    "row keepdim, divided by": lambda x: (1 + 0.05 * x) / (1 + 0.05 * x).prod(-1, keepdim=True),
    "all, in f32": lambda x: torch.prod(1 + 0.01 * x.float()),
    "short middle dim": lambda x: (1 + 0.1 * x).reshape(x.shape[0], 1, -1).prod(1),
    "float out of 16-bit": lambda x: (1 + 0.05 * x).prod(-1, dtype=torch.float32),
}


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(FNS)), rows=st.integers(16, 40), cols=st.integers(1, 1100),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_products_equal_eager_within_the_2x_rule(name, rows, cols, dtype):
    """Any row length (1, odd, past a CTA's registers): kernels only, no PyTorch op, values
    within the 2x rule of a float64 reference. At least 16 rows: eager's CPU 16-bit product
    rounds at every step, ours once, so a single value is a coin toss against the rule
    (check.VALUES); the full product is taken in f32 for that reason."""
    fn = FNS[name]
    torch.manual_seed(rows * 1103 + cols)  # (an example's draw is the same when hypothesis replays it)
    x = torch.randn(rows, cols).to(dtype)
    p = tilefuse.compile(fn, (x,))
    assert not _externs(p), str(p.plan)
    got, want = p(x), fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    chk = compare(name, got, float64_reference(fn, (x,)), want)
    assert chk.ok, chk


@pytest.mark.parametrize("fn", [lambda e: e.prod(-1), lambda e: (e > 0).prod(-1),
                                lambda e: e.to(torch.int8).prod(-1), lambda e: e.to(torch.int32).prod(0)],
                         ids=["i64", "bool", "i8", "i32 over rows"])
def test_an_integer_product_is_int64_and_exact(fn):
    """PyTorch widens bool and integer products to int64: so do the kernels, bit for bit
    (wrapping as int64 does)."""
    e = torch.randint(-3, 4, (6, 40))
    e[0] = 3  # 3^40 wraps int64, as eager's does
    p = tilefuse.compile(fn, (e,))
    got, want = p(e), fn(e)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(got, want)


def test_a_row_product_is_one_kernel_reading_x_once():
    """The maps before the product and the division after it share one kernel."""
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    p = tilefuse.compile(FNS["row keepdim, divided by"], (x,))
    (k,) = _kernels(p)
    assert not _externs(p) and k.bytes == 2 * x.numel() * 2


def test_a_long_row_product_is_reduced_in_pieces():
    """split_long_reductions takes products as sums: f32 partial products of pieces, then their
    product; values as a float64 reference's."""
    x = 1 + 1e-4 * torch.randn(2, 1 << 17)
    fn = lambda x: x.prod(-1)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert len(_kernels(p)) == 2 and not _externs(p), str(p.plan)
    chk = compare("prod", p(x), float64_reference(fn, (x,)), fn(x))
    assert chk.ok, chk


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 3), cols=st.sampled_from([16384, 40000, 65536]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_few_long_cumprods_are_scanned_in_pieces(rows, cols, dtype):
    """A running product over few long rows: each piece's product, their running product shifted
    one piece back (the first piece's offset 1), each piece scanned from it."""
    x = (1 + 1e-4 * torch.randn(rows, cols)).to(dtype)
    fn = lambda x: x.cumprod(-1)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert any(n.name.endswith("_pieces") for n in p.plan.graph.nodes), str(p.plan.graph)
    assert any(isinstance(n, ir.Reduce) and n.op == "prod" for n in p.plan.graph.nodes)
    assert not _externs(p)
    chk = compare("cumprod", p(x), float64_reference(fn, (x,)), fn(x))
    assert chk.ok, chk


def test_a_zero_or_an_inf_in_a_piece_spoils_nothing_it_should_not():
    """A zero makes every later running product 0 and an inf every later one inf (or NaN past a
    zero), in the pieces after it too: as eager."""
    x = torch.full((1, 65536), 1.0)
    x[0, 100] = 0.0
    y = torch.full((1, 65536), 1.0)
    y[0, 5000] = float("inf")
    fn = lambda x: x.cumprod(-1)  # noqa: E731
    for t in (x, y):
        got, want = tilefuse.compile(fn, (t,))(t), fn(t)
        assert torch.equal(got, want)


def test_the_interpreter_multiplies_a_float_product_in_float64():
    """A chain of float32 products drifts (here 5e-4 relative); the graph interpreter's product
    is float64's, rounded once."""
    rng = np.random.default_rng(0)
    x = (1 + 1e-5 * rng.standard_normal((2, 1 << 17))).astype(np.float32)
    n = ir.Reduce("r", ir.TensorType((2,), "f32"), "prod", "x", (1,), False, None)
    want = np.prod(x.astype(np.float64), axis=1)
    assert np.abs(eval_reduce(n, x) - want).max() < 1e-6


def test_the_product_identity_and_step():
    assert cexpr.identity("prod", "f32") == cexpr.const(1, "f32")
    assert cexpr.combine("prod", "a", "b") == "a * b"


def test_a_product_over_other_dims_with_few_rows_stays_pytorchs_op():
    """A column product needs rows enough beside it, as a column sum does (the plan says why)."""
    p = tilefuse.compile(lambda x: x.prod(0), (torch.randn(300, 100),))
    (e,) = _externs(p)
    assert "100 rows beside it, fewer than a column kernel over rows of 300 takes" in e.note


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("fn,shape,dtype", [
    (lambda x: x.prod(-1), (512, 4096), torch.bfloat16),
    (lambda x: (1 + x).prod(-1, keepdim=True) * x, (4096, 128), torch.float16),
    (lambda x: x.prod(0), (64, 65536), torch.float32),
    (lambda x: (x > 0).prod(-1), (128, 1000), torch.float32),
], ids=["bf16 row", "f16 short rows", "columns", "int64"])
def test_product_kernels_build_without_spills(fn, shape, dtype, arch):
    p = tilefuse.compile(fn, (torch.randn(shape, dtype=dtype),))
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"

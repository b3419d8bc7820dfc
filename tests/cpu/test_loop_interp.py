"""The NumPy interpreter matches PyTorch on the example kernels (DESIGN.md's 2x rule), implements
the Loop IR's dtype and index semantics exactly, and refuses wrong inputs and unsafe writes."""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loop_fixtures import NAMES, check_against_torch, example, rmsnorm_kernel

from tilefuse.loop.interp import run_kernel
from tilefuse.loop.ir import (
    Buffer, Const, IBin, IConst, IndexValue, Kernel, Load, Loop, Op, Reduce, Store, Val, Var,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
i, j, k_ = Var("i"), Var("j"), Var("k")


def kernel(params, *body) -> Kernel:
    return Kernel("t", tuple(params), tuple(body))


def unary_map(n: int, in_dtype: str, op: str, out_dtype: str) -> Kernel:
    """y[i] = op(x[i]) : out_dtype, for a 1-D x of n elements."""
    return kernel(
        (Buffer("x", (n,), in_dtype, "in"), Buffer("y", (n,), out_dtype, "out")),
        Loop("i", n, (Load("a", "x", (i,)), Op("b", op, ("a",), out_dtype), Store("y", (i,), "b")), parallel=True),
    )


# ---------------------------------------------------------------- against PyTorch


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES), st.sampled_from(["bf16", "f16", "f32"]),
       st.integers(1, 9), st.integers(1, 70), st.integers(0, 2**31))
def test_fixtures_match_pytorch_within_2x_its_own_error(name, dtype, R, C, seed):
    """On random shapes (1 and odd sizes included), every output is within 2x PyTorch's own
    low-precision error of the float64 reference (plus a floor of 1e-6 x magnitude), and never NaN."""
    ex = example(name, R, C, dtype, seed)
    check_against_torch(ex, run_kernel(ex.kernel, ex.inputs))


@pytest.mark.parametrize("name", NAMES)
def test_fixtures_match_pytorch_at_transformer_row_length(name):
    """A realistic row length (4096 bf16) with many rows also meets the 2x rule."""
    ex = example(name, 33, 4096, "bf16", seed=7)
    check_against_torch(ex, run_kernel(ex.kernel, ex.inputs))


def test_the_2x_check_rejects_wrong_answers():
    """The PyTorch comparison is not vacuous: a 3% error or a NaN in the output fails it."""
    ex = example("rmsnorm", 8, 64, "bf16", seed=5)
    y = run_kernel(ex.kernel, ex.inputs)["y"]
    with pytest.raises(AssertionError, match="2x rule"):
        check_against_torch(ex, {"y": (y.astype(np.float32) * 1.03).astype(BF16)})
    y[3, 5] = np.nan
    with pytest.raises(AssertionError, match="NaN"):
        check_against_torch(ex, {"y": y})


def test_rmsnorm_4096_square_f32_runs_well_under_a_second():
    """The interpreter is vectorized: RMSNorm on 4096x4096 f32 takes < 1 s (best of two)."""
    k = rmsnorm_kernel(4096, 4096, "f32")
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((4096, 4096), np.float32), "w": rng.standard_normal(4096, np.float32)}
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        run_kernel(k, inputs)
        best = min(best, time.perf_counter() - start)
    assert best < 1.0, f"{best:.2f} s"


def test_inputs_are_never_written():
    """Loads are views of the inputs; the run must leave every input unchanged."""
    ex = example("add_rmsnorm", 5, 7, "f32", seed=1)
    before = {n: a.copy() for n, a in ex.inputs.items()}
    out = run_kernel(ex.kernel, ex.inputs)
    out["h"][...] = 0
    for n, a in ex.inputs.items():
        assert np.array_equal(a, before[n])


# ---------------------------------------------------------------- dtype semantics


def test_bf16_ops_round_after_every_op():
    """(1 + 2^-8) + 2^-8 in bf16 rounds to 1 after the first add (ties to even), as PyTorch's bf16 does,
    whereas one f32 computation rounded once would give 1 + 2^-7."""
    n = 1
    k = kernel(
        (Buffer("x", (n,), "bf16", "in"), Buffer("y", (n,), "bf16", "out")),
        Loop("i", n, (
            Load("a", "x", (i,)), Const("e", 2.0**-8, "bf16"),
            Op("b", "add", ("a", "e"), "bf16"), Op("c", "add", ("b", "e"), "bf16"),
            Store("y", (i,), "c"),
        ), parallel=True),
    )
    got = run_kernel(k, {"x": np.ones(n, BF16)})["y"]
    t = torch.ones(n, dtype=torch.bfloat16)
    e = torch.tensor(2.0**-8, dtype=torch.bfloat16)
    assert float(got[0]) == 1.0 == float((t + e) + e)


def test_bf16_reduction_accumulates_in_f32():
    """A bf16 sum of 1000 ones is 1000 (f32 accumulation, rounded once), not bf16's stuck 256."""
    k = kernel(
        (Buffer("x", (1000,), "bf16", "in"), Buffer("s", (), "bf16", "out")),
        Reduce("t", "sum", "i", 1000, (Load("a", "x", (i,)),), "a", "bf16"),
        Store("s", (), "t"),
    )
    assert float(run_kernel(k, {"x": np.ones(1000, BF16)})["s"]) == 1000.0


def test_cast_float_to_int_truncates_toward_zero_like_c():
    x = np.array([-2.7, -0.5, 0.5, 2.7, 3.0, -3.0], np.float32)
    got = run_kernel(unary_map(6, "f32", "cast", "i32"), {"x": x})["y"]
    assert got.dtype == np.int32 and got.tolist() == [-2, 0, 0, 2, 3, -3]


def test_cast_bf16_to_int_and_to_bool():
    """bf16 -> i64 truncates; any -> bool is x != 0 (so 0.5 is true, -0.0 is false)."""
    x = np.array([-1.5, 0.5, -0.0, 7.0], BF16)
    assert run_kernel(unary_map(4, "bf16", "cast", "i64"), {"x": x})["y"].tolist() == [-1, 0, 0, 7]
    assert run_kernel(unary_map(4, "bf16", "cast", "bool"), {"x": x})["y"].tolist() == [True, True, False, True]


def test_cast_f32_to_bf16_rounds_to_nearest_even():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 3.14159], np.float32)
    got = run_kernel(unary_map(3, "f32", "cast", "bf16"), {"x": x})["y"]
    assert got.tolist() == x.astype(BF16).tolist() == [1.0, 1 + 2**-6, float(np.float32(3.140625))]


def test_comparisons_give_bool_and_where_selects():
    """lt yields a bool buffer; where picks its second argument where the condition holds."""
    n = 5
    k = kernel(
        (Buffer("x", (n,), "f32", "in"), Buffer("m", (n,), "bool", "out"), Buffer("y", (n,), "f32", "out")),
        Loop("i", n, (
            Load("a", "x", (i,)), Const("z", 0.0, "f32"),
            Op("neg", "lt", ("a", "z"), "bool"), Op("r", "where", ("neg", "z", "a"), "f32"),
            Store("m", (i,), "neg"), Store("y", (i,), "r"),
        ), parallel=True),
    )
    x = np.array([-1.0, 2.0, -0.0, 3.5, -7.0], np.float32)
    out = run_kernel(k, {"x": x})
    assert out["m"].dtype == np.bool_ and out["m"].tolist() == [True, False, False, False, True]
    assert out["y"].tolist() == [0.0, 2.0, 0.0, 3.5, 0.0]


def test_integer_ops_stay_integer():
    """relu/add on i32 stay i32 (no float detour)."""
    x = np.array([-3, 4, 2**30], np.int32)
    assert run_kernel(unary_map(3, "i32", "relu", "i32"), {"x": x})["y"].tolist() == [0, 4, 2**30]


# ---------------------------------------------------------------- indices


def test_reduce_of_a_loop_invariant_value_counts_each_iteration():
    """sum over c in 0..8 of a value defined outside the reduction is 8 times that value."""
    k = kernel(
        (Buffer("s", (3,), "f32", "out"),),
        Loop("r", 3, (
            Const("one", 1.0, "f32"),
            Reduce("n", "sum", "c", 8, (), "one", "f32"),
            Store("s", (Var("r"),), "n"),
        ), parallel=True),
    )
    assert run_kernel(k, {})["s"].tolist() == [8.0, 8.0, 8.0]


def test_index_division_and_modulo_follow_c():
    """Index // and % truncate toward zero like C (-7 // 2 == -3, -7 % 2 == -1), not like Python."""
    k = kernel(
        (Buffer("q", (), "i64", "out"), Buffer("m", (), "i64", "out")),
        IndexValue("a", IBin("//", IConst(-7), IConst(2)), "i64"),
        IndexValue("b", IBin("%", IConst(-7), IConst(2)), "i64"),
        Store("q", (), "a"), Store("m", (), "b"),
    )
    out = run_kernel(k, {})
    assert (int(out["q"]), int(out["m"])) == (-3, -1)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 7), st.integers(1, 7))
def test_flat_index_arithmetic_transposes(R, C):
    """y[r, c] = x_flat[c * R + r] reads a column-major copy: IBin index arithmetic over two loop axes."""
    x = np.arange(R * C, dtype=np.float32)
    k = kernel(
        (Buffer("x", (R * C,), "f32", "in"), Buffer("y", (R, C), "f32", "out")),
        Loop("r", R, (Loop("c", C, (
            Load("a", "x", (IBin("+", IBin("*", Var("c"), IConst(R)), Var("r")),)),
            Store("y", (Var("r"), Var("c")), "a"),
        )),), parallel=True),
    )
    assert np.array_equal(run_kernel(k, {"x": x})["y"], x.reshape(C, R).T)


def test_transposed_load_and_store_use_the_right_axes():
    """y[c, r] = x[c, r] + 10 * z[r, c]: loop variables in swapped dimension order (the view fast path)."""
    R, C = 3, 5
    rng = np.random.default_rng(2)
    x, z = rng.standard_normal((C, R)), rng.standard_normal((R, C))
    r, c = Var("r"), Var("c")
    k = kernel(
        (Buffer("x", (C, R), "f64", "in"), Buffer("z", (R, C), "f64", "in"), Buffer("y", (C, R), "f64", "out")),
        Loop("r", R, (Const("ten", 10.0, "f64"), Loop("c", C, (
            Load("a", "x", (c, r)), Load("b", "z", (r, c)), Op("p", "mul", ("b", "ten"), "f64"),
            Op("q", "add", ("a", "p"), "f64"), Store("y", (c, r), "q"),
        ))), parallel=True),
    )
    assert np.array_equal(run_kernel(k, {"x": x, "z": z})["y"], x + 10.0 * z.T)


def test_val_index_gathers_and_scatters():
    """Load table[ids[r], c] gathers rows; Store y[perm[r], c] scatters them to a permutation."""
    R, C, V = 6, 5, 9
    rng = np.random.default_rng(3)
    table = rng.standard_normal((V, C)).astype(np.float32)
    ids = rng.integers(0, V, R).astype(np.int64)
    perm = rng.permutation(R).astype(np.int32)
    r, c = Var("r"), Var("c")
    k = kernel(
        (Buffer("table", (V, C), "f32", "in"), Buffer("ids", (R,), "i64", "in"), Buffer("perm", (R,), "i32", "in"),
         Buffer("y", (R, C), "f32", "out")),
        Loop("r", R, (
            Load("id", "ids", (r,)), Load("p", "perm", (r,)),
            Loop("c", C, (Load("e", "table", (Val("id"), c)), Store("y", (Val("p"), c), "e"))),
        ), parallel=True),
    )
    want = np.empty((R, C), np.float32)
    want[perm] = table[ids]
    assert np.array_equal(run_kernel(k, {"table": table, "ids": ids, "perm": perm})["y"], want)


def test_three_nested_loops_broadcast_on_further_axes():
    """y[b, r, c] = x[b, r, c] * w[c] + sum_c x[b, r, :]: values broadcast over three loop axes."""
    B, R, C = 2, 3, 4
    x = np.random.default_rng(0).standard_normal((B, R, C)).astype(np.float64)
    w = np.arange(C, dtype=np.float64)
    b, r, c = Var("b"), Var("r"), Var("c")
    k = kernel(
        (Buffer("x", (B, R, C), "f64", "in"), Buffer("w", (C,), "f64", "in"), Buffer("y", (B, R, C), "f64", "out")),
        Loop("b", B, (Loop("r", R, (
            Reduce("s", "sum", "c", C, (Load("a", "x", (b, r, c)),), "a", "f64"),
            Loop("c", C, (Load("a2", "x", (b, r, c)), Load("wc", "w", (c,)), Op("p", "mul", ("a2", "wc"), "f64"),
                          Op("q", "add", ("p", "s"), "f64"), Store("y", (b, r, c), "q"))),
        )),), parallel=True),
    )
    np.testing.assert_allclose(run_kernel(k, {"x": x, "w": w})["y"], x * w + x.sum(-1, keepdims=True), rtol=1e-12)


# ---------------------------------------------------------------- errors


def test_out_of_range_gather_is_an_error_naming_the_statement():
    ex = example("gather", 4, 3, "f32", seed=0)
    ids = ex.inputs["ids"].copy()
    ids[2] = 11  # the table has 11 rows
    with pytest.raises(ValueError, match=r"index 11 out of range for dimension 0 of size 11 in `%e = load table"):
        run_kernel(ex.kernel, {**ex.inputs, "ids": ids})


def test_negative_index_is_an_error_not_a_wraparound():
    k = kernel(
        (Buffer("x", (4,), "f32", "in"), Buffer("y", (4,), "f32", "out")),
        Loop("i", 4, (Load("a", "x", (IBin("+", i, IConst(-1)),)), Store("y", (i,), "a"))),
    )
    with pytest.raises(ValueError, match="index -1 out of range"):
        run_kernel(k, {"x": np.zeros(4, np.float32)})


def test_unwritten_output_element_is_an_error():
    """Outputs start poisoned; an element no store reaches makes the run fail."""
    k = kernel(
        (Buffer("x", (3, 4), "f32", "in"), Buffer("y", (3, 4), "f32", "out")),
        Loop("r", 3, (Loop("c", 3, (Load("a", "x", (Var("r"), Var("c"))), Store("y", (Var("r"), Var("c")), "a"))),),
             parallel=True),
    )
    with pytest.raises(ValueError, match=r"3 element\(s\) of output y are never written, the first at index \(0, 3\)"):
        run_kernel(k, {"x": np.zeros((3, 4), np.float32)})


def test_row_store_inside_column_loop_is_a_double_write():
    """Storing y[r] once per column writes each element C times: an error (a race on the GPU)."""
    k = kernel(
        (Buffer("x", (3, 4), "f32", "in"), Buffer("y", (3,), "f32", "out")),
        Loop("r", 3, (Loop("c", 4, (Load("a", "x", (Var("r"), Var("c"))), Store("y", (Var("r"),), "a"))),),
             parallel=True),
    )
    with pytest.raises(ValueError, match="written more than once"):
        run_kernel(k, {"x": np.zeros((3, 4), np.float32)})


def test_two_stores_to_one_element_are_a_double_write():
    k = kernel(
        (Buffer("y", (2,), "f32", "out"),),
        Const("z", 0.0, "f32"),
        Loop("i", 2, (Store("y", (i,), "z"),)),
        Store("y", (IConst(1),), "z"),
    )
    with pytest.raises(ValueError, match=r"element \(1,\) was already written"):
        run_kernel(k, {})


def test_colliding_scatter_is_a_double_write():
    """A Val-indexed store whose indices repeat is caught on the general (scatter) path."""
    k = kernel(
        (Buffer("p", (3,), "i32", "in"), Buffer("y", (3,), "f32", "out")),
        Const("z", 0.0, "f32"),
        Loop("i", 3, (Load("q", "p", (i,)), Store("y", (Val("q"),), "z"))),
    )
    with pytest.raises(ValueError, match="two iterations write the same element"):
        run_kernel(k, {"p": np.array([0, 2, 0], np.int32)})


@pytest.mark.parametrize("inputs, words", [
    ({}, "missing input(s) x"),
    ({"x": np.zeros(4, np.float32), "w": np.zeros(4, np.float32)}, "unexpected input(s) w"),
    ({"x": np.zeros(5, np.float32)}, "input x has shape (5,), expected (4,)"),
    ({"x": np.zeros(4, np.float64)}, "input x has dtype float64, expected f32"),
    ({"x": torch.zeros(4)}, "must be a NumPy array"),
], ids=["missing", "extra", "shape", "dtype", "not numpy"])
def test_inputs_are_checked_against_the_kernel(inputs, words):
    with pytest.raises(ValueError) as err:
        run_kernel(unary_map(4, "f32", "neg", "f32"), inputs)
    assert words in str(err.value)


def test_malformed_kernel_is_refused_before_running():
    k = kernel((Buffer("y", (), "f32", "out"),), Store("y", (), "ghost"))
    with pytest.raises(ValueError, match="%ghost is used before"):
        run_kernel(k, {})

"""verify(kernel) accepts the well-formed example kernels and names each kind of malformation."""
from __future__ import annotations

import re

import pytest
from loop_fixtures import BUILDERS, NAMES

from tilefuse.loop.ir import (
    Buffer, Const, IBin, IConst, IndexValue, Kernel, Load, Loop, Op, Reduce, Store, Val, Var,
    row_kernel_parts,
)
from tilefuse.loop.verify import verify

r, c = Var("r"), Var("c")
PARAMS = (
    Buffer("x", (4, 8), "f32", "in"),
    Buffer("ids", (4,), "i64", "in"),
    Buffer("y", (4, 8), "f32", "out"),
    Buffer("s", (4,), "f32", "out"),
)


def row(*stmts, params=PARAMS) -> Kernel:
    """A kernel named `bad` whose parallel row loop (r in 0..4) holds `stmts`."""
    return Kernel("bad", params, (Loop("r", 4, tuple(stmts), parallel=True),))


def copy_row() -> tuple:
    """A correct column loop copying x[r, :] to y[r, :]."""
    return (Loop("c", 8, (Load("a", "x", (r, c)), Store("y", (r, c), "a"))),)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_fixtures_are_well_formed_mapreduce_kernels(name, dtype):
    """Every example kernel passes verify and has the map-reduce shape the CUDA printer expects."""
    k = BUILDERS[name](5, 7, dtype)
    verify(k)
    parts = row_kernel_parts(k)
    assert (parts.rows, parts.col_extent) == (5, 7)


def test_sibling_loops_may_reuse_a_loop_variable_and_reduce_may_yield_an_outer_value():
    """Reusing `c` in sibling loops is allowed (not shadowing); a Reduce may reduce a value from outside."""
    k = row(
        Const("one", 1.0, "f32"),
        Reduce("n", "sum", "c", 8, (), "one", "f32"),
        Store("s", (r,), "n"),
        *copy_row(),
    )
    verify(k)


def _bad_cases():
    """(id, kernel, offending statement text or None, expected words in the message)."""
    load_a = Load("a", "x", (r, c))
    use_b = Op("a", "add", ("b", "b"), "f32")
    dup = Const("k", 1.0, "f32")
    inner_def = Loop("c", 8, (Load("t", "x", (r, c)), Store("y", (r, c), "t")))
    after_loop = Store("s", (r,), "t")
    shadow = Loop("r", 2, ())
    out_of_scope_var = Load("a", "x", (r, c))
    no_value = Reduce("m", "max", "c", 8, (load_a,), "nope", "f32")
    unknown_op = Op("b", "frobnicate", ("k",), "f32")
    arity = Op("b", "add", ("k",), "f32")
    load_out = Load("a", "y", (r, c))
    store_in = Store("x", (r, c), "k")
    rank = Load("a", "x", (r,))
    unknown_buf = Load("a", "z", (r,))
    float_val = Load("a", "x", (r, Val("k")))
    undefined_val = Load("a", "x", (Val("nope"), c))
    cmp_dtype = Op("b", "lt", ("k", "k"), "f32")
    logic_dtype = Op("b", "and", ("k", "k"), "f32")
    bad_cast = Op("b", "cast", ("k",), "f8")
    zero_loop = Loop("c", 0, ())
    neg_reduce = Reduce("m", "sum", "c", -1, (), "k", "f32")
    bad_reduction = Reduce("m", "median", "c", 8, (load_a,), "a", "f32")
    exp_int = Op("b", "exp", ("i",), "i64")
    where_cond = Op("b", "where", ("k", "k", "k"), "f32")
    store_dtype = Store("s", (r,), "i")
    float_iota = IndexValue("b", c, "f32")
    k_const = Const("k", 1.0, "f32")
    i_load = Load("i", "ids", (r,))
    return [
        ("use before definition", row(use_b, Const("b", 1.0, "f32")), use_b, "used before"),
        ("defined twice", row(dup, dup), dup, "defined twice"),
        ("defined twice in sibling scopes",
         row(Loop("c", 8, (dup,)), Loop("c", 8, (dup,))), dup, "defined twice"),
        ("value used after its loop", row(inner_def, after_loop), after_loop, "out of its scope"),
        ("shadowed loop variable", row(shadow), shadow, "shadows"),
        ("loop variable out of scope", row(out_of_scope_var), out_of_scope_var, "outside its loop"),
        ("reduce value undefined", row(no_value), no_value, "%nope"),
        ("unknown op", row(k_const, unknown_op), unknown_op, "frobnicate"),
        ("wrong arity", row(k_const, arity), arity, "takes 2 argument"),
        ("load from output", row(Loop("c", 8, (load_out,))), load_out, "load from output"),
        ("store to input", row(k_const, Loop("c", 8, (store_in,))), store_in, "store to input"),
        ("index rank", row(rank), rank, "rank 2"),
        ("unknown buffer", row(unknown_buf), unknown_buf, "unknown buffer 'z'"),
        ("float value as index", row(k_const, float_val), float_val, "not an integer dtype"),
        ("undefined value as index", row(Loop("c", 8, (undefined_val,))), undefined_val, "%nope"),
        ("comparison not bool", row(k_const, cmp_dtype), cmp_dtype, "yields bool"),
        ("logic not bool", row(k_const, logic_dtype), logic_dtype, "yields bool"),
        ("cast to unknown dtype", row(k_const, bad_cast), bad_cast, "unknown dtype 'f8'"),
        ("zero extent", row(zero_loop), zero_loop, "positive"),
        ("negative reduce extent", row(k_const, neg_reduce), neg_reduce, "positive"),
        ("unknown reduction", row(bad_reduction), bad_reduction, "unknown reduction 'median'"),
        ("float op on integers", row(i_load, exp_int), exp_int, "float dtype"),
        ("where condition not bool", row(k_const, where_cond), where_cond, "not bool"),
        ("store dtype mismatch", row(i_load, store_dtype), store_dtype, "cast it first"),
        ("float index value", row(Loop("c", 8, (float_iota,))), float_iota, "integer dtype"),
        ("index constant not int", row(Load("a", "x", (r, IBin("+", IConst(True), IConst(0))))),
         None, "not an int"),
        ("duplicate buffer", Kernel("bad", PARAMS + (Buffer("x", (1,), "f32", "in"),), ()), None, "declared twice"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda case: case[0])
def test_each_malformation_is_a_value_error_naming_kernel_and_statement(case):
    """verify raises ValueError whose message names the kernel, the statement and the problem."""
    _, kernel, stmt, words = case
    with pytest.raises(ValueError) as err:
        verify(kernel)
    message = str(err.value)
    assert message.startswith("kernel bad:"), message
    assert words in message, message
    if stmt is not None:
        text = stmt.header() if isinstance(stmt, (Loop, Reduce)) else str(stmt)
        assert re.search(re.escape(f"`{text}`"), message), message

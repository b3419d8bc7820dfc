"""structural_hash ignores names and independent-statement order and sees every real change;
canonicalize is idempotent, hash-preserving and semantics-preserving."""
from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loop_fixtures import BUILDERS, NAMES, example

from tilefuse.loop.canon import canonicalize, free_uses, named_by_structure, structural_hash
from tilefuse.loop.interp import run_kernel
from tilefuse.loop.ir import (
    Buffer, Const, IBin, IConst, IndexValue, Kernel, Load, Loop, Op, Reduce, Store, Val, Var, walk,
)
from tilefuse.loop.verify import verify

DTYPES = ("bf16", "f16", "f32")


# ---------------------------------------------------------------- renaming and shuffling


def _defines(s):
    return s.dst if isinstance(s, (Load, Const, IndexValue, Op, Reduce)) else None


def rename_kernel(k: Kernel, rng: random.Random) -> Kernel:
    """`k` with every value, loop variable and buffer (and the kernel) given a fresh random name."""
    values = {d for s in walk(k.body) if (d := _defines(s))}
    loops = {s.var for s in walk(k.body) if isinstance(s, (Loop, Reduce))}
    fresh = iter(f"n{i:x}" for i in rng.sample(range(1 << 20), len(values) + len(loops) + len(k.params)))
    vmap = {v: next(fresh) for v in sorted(values)}
    lmap = {v: next(fresh) for v in sorted(loops)}
    bmap = {b.name: next(fresh) for b in k.params}

    def ix(e):
        if isinstance(e, Var):
            return Var(lmap[e.name])
        if isinstance(e, Val):
            return Val(vmap[e.name])
        if isinstance(e, IBin):
            return IBin(e.op, ix(e.a), ix(e.b))
        return e

    def stmt(s):
        if isinstance(s, Load):
            return Load(vmap[s.dst], bmap[s.buf], tuple(map(ix, s.index)))
        if isinstance(s, Store):
            return Store(bmap[s.buf], tuple(map(ix, s.index)), vmap[s.value])
        if isinstance(s, Const):
            return replace(s, dst=vmap[s.dst])
        if isinstance(s, IndexValue):
            return replace(s, dst=vmap[s.dst], expr=ix(s.expr))
        if isinstance(s, Op):
            return replace(s, dst=vmap[s.dst], args=tuple(vmap[a] for a in s.args))
        if isinstance(s, Loop):
            return replace(s, var=lmap[s.var], body=tuple(map(stmt, s.body)))
        return replace(s, dst=vmap[s.dst], var=lmap[s.var], body=tuple(map(stmt, s.body)), value=vmap[s.value])

    params = tuple(replace(b, name=bmap[b.name]) for b in k.params)
    return Kernel(f"renamed_{rng.randrange(1000)}", params, tuple(map(stmt, k.body)), k.family)


def shuffle_block(body, rng: random.Random) -> tuple:
    """A random dependency-respecting order of a block (nested blocks shuffled too)."""
    body = [replace(s, body=shuffle_block(s.body, rng)) if isinstance(s, (Loop, Reduce)) else s for s in body]
    defined_here = {_defines(s) for s in body} - {None}
    remaining, done, order = list(body), set(), []
    while remaining:
        ready = [s for s in remaining if (free_uses(s) & defined_here) <= done]
        pick = rng.choice(ready)
        remaining.remove(pick)
        order.append(pick)
        done.add(_defines(pick))
    return tuple(order)


def shuffle_kernel(k: Kernel, rng: random.Random) -> Kernel:
    return replace(k, body=shuffle_block(k.body, rng))


kernels = st.builds(
    lambda name, dtype, R, C: BUILDERS[name](R, C, dtype),
    st.sampled_from(NAMES), st.sampled_from(DTYPES), st.integers(1, 9), st.integers(1, 9),
)


@settings(max_examples=40, deadline=None)
@given(kernels, st.randoms(use_true_random=False))
def test_hash_ignores_names_and_independent_statement_order(k, rng):
    """Randomly renamed and reordered copies of a kernel hash equal and canonicalize equal."""
    other = shuffle_kernel(rename_kernel(k, rng), rng)
    verify(other)
    assert structural_hash(other) == structural_hash(k)
    a, b = canonicalize(k, rename_buffers=True), canonicalize(other, rename_buffers=True)
    assert replace(a, name="k") == replace(b, name="k")


def test_shuffling_does_reorder_statements():
    """The order-invariance test is not vacuous: shuffling produces a different statement order."""
    k = BUILDERS["cross_entropy"](4, 8, "bf16")
    orders = {tuple(map(str, walk(shuffle_kernel(k, random.Random(seed)).body))) for seed in range(10)}
    assert len(orders) > 1


# ---------------------------------------------------------------- real changes


def replace_nth(k: Kernel, pred, change, n: int) -> Kernel | None:
    """`k` with the (n mod count)-th statement (depth-first) satisfying `pred` replaced by change(stmt)."""
    hits = [s for s in walk(k.body) if pred(s)]
    if not hits:
        return None
    target, seen = n % len(hits), [0]

    def block(body):
        out = []
        for s in body:
            if pred(s):
                seen[0] += 1
                if seen[0] - 1 == target:
                    new = change(s)
                    if new is not None:
                        out.append(new)
                    continue
            if isinstance(s, (Loop, Reduce)):
                s = replace(s, body=block(s.body))
            out.append(s)
        return tuple(out)

    return replace(k, body=block(k.body))


def replace_param(k: Kernel, n: int, change) -> Kernel:
    i = n % len(k.params)
    return replace(k, params=k.params[:i] + (change(k.params[i]),) + k.params[i + 1:])


OTHER_OP = {"add": "sub", "sub": "add", "mul": "div", "div": "mul", "max": "min", "min": "max", "exp": "exp2",
            "log": "log2", "rsqrt": "sqrt", "sigmoid": "tanh", "recip": "neg", "eq": "ne"}
OTHER_DTYPE = {"bf16": "f16", "f16": "bf16", "f32": "f64", "f64": "f32", "i64": "i32", "i32": "i64", "bool": "u8"}


def _swap_args(s: Op) -> Op:
    args = s.args[::-1] if len(s.args) == 2 else (s.args[0], s.args[2], s.args[1])
    return replace(s, args=args)


def _shift_first_index(s):
    return replace(s, index=(IBin("+", s.index[0], IConst(1)),) + s.index[1:])


def _other_yield(s: Reduce):
    defs = [d for t in s.body if (d := _defines(t)) and d != s.value]
    return replace(s, value=defs[0]) if defs else None


MUTATIONS = {
    "op": lambda k, n: replace_nth(k, lambda s: isinstance(s, Op) and s.op in OTHER_OP,
                                   lambda s: replace(s, op=OTHER_OP[s.op]), n),
    "constant": lambda k, n: replace_nth(k, lambda s: isinstance(s, Const), lambda s: replace(s, value=s.value + 1), n),
    "op dtype": lambda k, n: replace_nth(k, lambda s: isinstance(s, Op) and s.op == "cast",
                                         lambda s: replace(s, dtype=OTHER_DTYPE[s.dtype]), n),
    "index dtype": lambda k, n: replace_nth(k, lambda s: isinstance(s, IndexValue),
                                            lambda s: replace(s, dtype=OTHER_DTYPE[s.dtype]), n),
    "buffer dtype": lambda k, n: replace_param(k, n, lambda b: replace(b, dtype=OTHER_DTYPE[b.dtype])),
    "buffer shape": lambda k, n: replace_param(k, n, lambda b: replace(b, shape=(b.shape[0] + 1,) + b.shape[1:])),
    "buffer role": lambda k, n: replace_param(k, n, lambda b: replace(b, role="out" if b.role == "in" else "in")),
    "extent": lambda k, n: replace_nth(k, lambda s: isinstance(s, (Loop, Reduce)),
                                       lambda s: replace(s, extent=s.extent + 1), n),
    "index": lambda k, n: replace_nth(k, lambda s: isinstance(s, (Load, Store)) and s.index, _shift_first_index, n),
    "argument order": lambda k, n: replace_nth(k, lambda s: isinstance(s, Op) and s.op in ("sub", "div", "where"),
                                               _swap_args, n),
    "reduction": lambda k, n: replace_nth(k, lambda s: isinstance(s, Reduce),
                                          lambda s: replace(s, op="max" if s.op == "sum" else "sum"), n),
    "yielded value": lambda k, n: replace_nth(k, lambda s: isinstance(s, Reduce) and _other_yield(s), _other_yield, n),
    "parallel": lambda k, n: replace_nth(k, lambda s: isinstance(s, Loop),
                                         lambda s: replace(s, parallel=not s.parallel), n),
    "dropped store": lambda k, n: replace_nth(k, lambda s: isinstance(s, Store), lambda s: None, n),
    "family": lambda k, n: replace(k, family="contraction"),
}


@settings(max_examples=60, deadline=None)
@given(kernels, st.sampled_from(sorted(MUTATIONS)), st.integers(0, 50), st.randoms(use_true_random=False))
def test_every_real_change_changes_the_hash(k, mutation, n, rng):
    """Changing an op, constant, dtype, shape, extent, index, role, argument order, reduction,
    yield, parallelism, store or family gives a different hash, even after renaming and shuffling."""
    changed = MUTATIONS[mutation](k, n)
    if changed is None:
        return  # this kernel has nothing this mutation applies to
    assert structural_hash(shuffle_kernel(rename_kernel(changed, rng), rng)) != structural_hash(k)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_mutation_applies_to_some_fixture(mutation):
    """The mutation property test exercises every mutation kind (none is vacuous)."""
    assert any(MUTATIONS[mutation](BUILDERS[name](3, 5, "bf16"), 0) is not None for name in NAMES)


def test_fixtures_shapes_and_dtypes_all_hash_differently():
    """Distinct example kernels, sizes and dtypes have distinct hashes."""
    hashes = [structural_hash(BUILDERS[n](R, C, dt)) for n in NAMES for R, C in ((1, 1), (3, 5), (5, 3))
              for dt in DTYPES]
    assert len(set(hashes)) == len(hashes)


def _two_input_kernel(op: str, params_order=("a", "b"), args=("va", "vb")) -> Kernel:
    buffers = {"a": Buffer("a", (4,), "f32", "in"), "b": Buffer("b", (4,), "f32", "in")}
    params = tuple(buffers[p] for p in params_order) + (Buffer("y", (4,), "f32", "out"),)
    i = Var("i")
    body = (Loop("i", 4, (Load("va", "a", (i,)), Load("vb", "b", (i,)), Op("d", op, args, "f32"),
                          Store("y", (i,), "d")), parallel=True),)
    return Kernel("two", params, body)


def test_commutative_argument_order_does_not_change_the_hash():
    """add(a, b) and add(b, a) are the same program; sub(a, b) and sub(b, a) are not."""
    assert structural_hash(_two_input_kernel("add")) == structural_hash(_two_input_kernel("add", args=("vb", "va")))
    assert structural_hash(_two_input_kernel("sub")) != structural_hash(_two_input_kernel("sub", args=("vb", "va")))


def test_buffers_are_identified_by_position_not_name():
    """Swapping the parameter positions of a and b changes what sub computes; swapping names does not."""
    base = _two_input_kernel("sub")
    assert structural_hash(_two_input_kernel("sub", params_order=("b", "a"))) != structural_hash(base)
    swapped_names = Kernel("two", (Buffer("b", (4,), "f32", "in"), Buffer("a", (4,), "f32", "in"),
                                   Buffer("y", (4,), "f32", "out")),
                           _two_input_kernel("sub", args=("vb", "va")).body)
    assert structural_hash(swapped_names) == structural_hash(base)


def test_constants_are_compared_by_value_in_their_dtype():
    """const 1 : f32 and const 1.0 : f32 hash equal; 1.0 and -1.0 (and 0.0 and -0.0) do not."""
    def k(v):
        return Kernel("c", (Buffer("y", (), "f32", "out"),), (Const("v", v, "f32"), Store("y", (), "v")))

    assert structural_hash(k(1)) == structural_hash(k(1.0))
    assert structural_hash(k(1.0)) != structural_hash(k(-1.0))
    assert structural_hash(k(0.0)) != structural_hash(k(-0.0))


def test_hash_is_hex_sha256():
    h = structural_hash(BUILDERS["rmsnorm"](2, 3, "bf16"))
    assert re.fullmatch(r"[0-9a-f]{64}", h)


# ---------------------------------------------------------------- canonicalize


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_canonicalize_is_idempotent_hash_preserving_and_well_formed(name, dtype):
    """canonicalize(canonicalize(k)) == canonicalize(k), same hash as k, and it verifies."""
    k = BUILDERS[name](3, 5, dtype)
    c = canonicalize(k)
    verify(c)
    assert canonicalize(c) == c
    assert structural_hash(c) == structural_hash(k)
    assert [b.name for b in c.params] == [b.name for b in k.params]


@pytest.mark.parametrize("name", NAMES)
def test_canonical_names_are_v_and_i_in_order(name):
    """Values are named v0, v1, … and loop variables i0, i1, … in order of appearance."""
    c = canonicalize(BUILDERS[name](3, 5, "bf16"), rename_buffers=True)
    defs = [d for s in walk(c.body) if (d := _defines(s))]
    loops = [s.var for s in walk(c.body) if isinstance(s, (Loop, Reduce))]
    assert defs == [f"v{i}" for i in range(len(defs))]
    assert loops == [f"i{i}" for i in range(len(loops))]
    assert [b.name for b in c.params] == [f"b{i}" for i in range(len(c.params))]


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(NAMES), st.sampled_from(DTYPES), st.integers(1, 6), st.integers(1, 9),
       st.randoms(use_true_random=False))
def test_canonicalize_preserves_meaning(name, dtype, R, C, rng):
    """The interpreter gives bit-identical outputs for a kernel and its canonical form."""
    ex = example(name, R, C, dtype, seed=rng.randrange(1 << 30))
    k = shuffle_kernel(ex.kernel, rng)
    want, got = run_kernel(k, ex.inputs), run_kernel(canonicalize(k), ex.inputs)
    for out in want:
        assert want[out].tobytes() == got[out].tobytes()


@settings(max_examples=30, deadline=None)
@given(kernels, st.randoms(use_true_random=False))
def test_named_by_structure_forgets_every_name_and_keeps_the_order(k, rng):
    """Kernels equal but for their names (values, loops, buffers, the kernel's numbers) are one
    kernel named by structure: what a program builds once for all of them. Statements keep
    their order, buffers their position, role, shape and dtype, and the hash is unchanged."""
    n = named_by_structure(k)
    verify(n)
    other = replace(rename_kernel(k, rng), name=f"k{rng.randrange(99)}_{k.name}_{rng.randrange(99)}")
    assert named_by_structure(other) == n
    assert named_by_structure(n) == n
    assert structural_hash(n) == structural_hash(k)
    assert [(b.role, b.shape, b.dtype) for b in n.params] == [(b.role, b.shape, b.dtype) for b in k.params]
    assert [b.name for b in n.params] == [f"b{i}" for i in range(len(k.params))]
    assert [type(s) for s in walk(n.body)] == [type(s) for s in walk(k.body)]
    assert n.name.endswith("_" + structural_hash(k)[:10])


@pytest.mark.parametrize("name, stem", [("tf_k16_mean_1_sum", "tf_mean_sum"), ("tf_k1_cast_4", "tf_cast"),
                                        ("k3_max_1", "max"), ("7", "kernel")])
def test_named_by_structure_keeps_the_stem_of_the_name(name, stem):
    """The kernel's name keeps its words, not its numbers: profiles still say what it computes."""
    k = replace(BUILDERS[NAMES[0]](3, 5, "bf16"), name=name)
    assert named_by_structure(k).name == f"{stem}_{structural_hash(k)[:10]}"


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(NAMES), st.sampled_from(DTYPES), st.integers(1, 6), st.integers(1, 9),
       st.randoms(use_true_random=False))
def test_named_by_structure_preserves_meaning(name, dtype, R, C, rng):
    """Bound by position, a kernel and its form named by structure give bit-identical outputs."""
    ex = example(name, R, C, dtype, seed=rng.randrange(1 << 30))
    n = named_by_structure(ex.kernel)
    ins = {nb.name: ex.inputs[kb.name] for kb, nb in zip(ex.kernel.params, n.params) if kb.role == "in"}
    want, got = run_kernel(ex.kernel, ex.inputs), run_kernel(n, ins)
    outs = [(kb.name, nb.name) for kb, nb in zip(ex.kernel.params, n.params) if kb.role == "out"]
    assert outs
    for a, b in outs:
        assert want[a].tobytes() == got[b].tobytes()


def test_hash_of_malformed_kernel_is_a_clear_error():
    """Hashing a kernel that uses an undefined value raises ValueError naming the value."""
    k = Kernel("broken", (Buffer("y", (), "f32", "out"),), (Store("y", (), "ghost"),))
    with pytest.raises(ValueError, match="%ghost"):
        structural_hash(k)

"""Python ints that dynamo made dynamic and that only enter tensor arithmetic are passed to the
program as 0-d tensors (frontend/scalar_ints.py), so every value runs one compiled program.

Properties:
- such an int is found where its uses are integer arithmetic, elementwise operators with a
  tensor, or outputs; one used as a size, an index or a slice bound is not;
- the rewritten graph, given 0-d int64 tensors, computes the original's tensors exactly, for
  integer, float, bfloat16 and bool operands (0-d tensors promote as Python ints do), with
  sym_max / sym_min as clamps;
- through the backend: eager's tensors and integer outputs at every value, from one compiled
  variant; an int used as a size still compiles per value, as before.
"""
from __future__ import annotations

import operator

import pytest
import torch

from tilefuse.frontend import backend as tb
from tilefuse.frontend.scalar_ints import tensorize, value_ints


def _gm(nodes_fn, n_val=5):
    """A GraphModule (x: tensor, n: SymInt-like int) built by `nodes_fn(graph, x, n)`, with
    example values in the metas as dynamo leaves them."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n_sym = env.create_unbacked_symint()  # (a SymInt that no tensor's dim holds)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.zeros(4)
    n = g.placeholder("n")
    n.meta["example_value"] = n_sym
    out = nodes_fn(g, x, n)
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _node(g, target, args, value):
    node = g.call_function(target, args)
    node.meta["example_value"] = value
    return node


def _int_value(n):
    return n.meta["example_value"]


def position_mask(g, x, n):
    """The sliding-window mask's positions: arange + n, and n - 8 + 1 clamped at 0."""
    t = torch.zeros(4, dtype=torch.int64)
    ar = _node(g, torch.arange, (4,), t)
    q = _node(g, operator.add, (ar, n), t)
    lo = _node(g, torch.sym_max, (_node(g, operator.add, (_node(g, operator.sub, (n, 8), _int_value(n)), 1),
                                          _int_value(n)), 0), _int_value(n))
    kv = _node(g, operator.add, (ar, lo), t)
    gt = _node(g, operator.gt, (kv, q), torch.zeros(4, dtype=torch.bool))
    nxt = _node(g, operator.add, (n, 1), _int_value(n))
    return (q, kv, gt, nxt)


def as_size(g, x, n):
    return (_node(g, torch.arange, (n,), torch.zeros(4, dtype=torch.int64)),)


def as_slice(g, x, n):
    return (_node(g, operator.getitem, (x, slice(None, n)), torch.zeros(4)),)


def test_an_int_that_only_enters_tensor_arithmetic_is_found_and_one_used_as_a_size_is_not():
    for fn, found in ((position_mask, [1]), (as_size, []), (as_slice, [])):
        gm = _gm(fn)
        ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert value_ints(ph, ["input", "int"], set()) == found, fn.__name__
    gm = _gm(position_mask)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    expr = ph[1].meta["example_value"].node.expr
    assert value_ints(ph, ["input", "int"], {expr}) == []  # a tensor's dim: a size, handled as before


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64, torch.bool, torch.uint8])
@pytest.mark.parametrize("n", [0, 3, 9, 200, 257, 2049, 2**24 + 1, 2**40 + 3])
def test_the_rewritten_graph_computes_the_same_tensors_for_every_dtype(dtype, n):
    def fn(g, x, n_):
        t = torch.zeros(4, dtype=dtype)
        y = _node(g, operator.add, (x, n_), t)
        z = _node(g, operator.mul, (x, _node(g, torch.sym_min, (n_, 7), _int_value(n_))), t)
        w = _node(g, operator.floordiv, (_node(g, operator.sub, (x, n_), t), 2), t) if dtype != torch.bool else y
        return (y, z, w)

    gm = _gm(fn)
    ph = [node for node in gm.graph.nodes if node.op == "placeholder"]
    ph[0].meta["example_value"] = torch.zeros(4, dtype=dtype)
    assert value_ints(ph, ["input", "int"], set()) == [1]
    new = tensorize(gm, [1])
    x = (torch.arange(-5, 5) if dtype != torch.bool else torch.arange(10) % 2).to(dtype)
    want = gm(x, n)
    got = new(x, torch.tensor(n))
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("n", [0, 5, 8, 30])
def test_the_sliding_window_positions_match_with_the_length_as_a_tensor(n):
    gm = _gm(position_mask)
    new = tensorize(gm, [1])
    x = torch.zeros(4)
    q, kv, gt, nxt = gm(x, n)
    q2, kv2, gt2, nxt2 = new(x, torch.tensor(n))
    assert torch.equal(q, q2) and torch.equal(kv, kv2) and torch.equal(gt, gt2)
    assert nxt == n + 1 and int(nxt2) == n  # (an integer output: the backend evaluates it on the host, and
    # the rewritten graph returns its first rewritten input there, leaving that arithmetic dead)
    assert torch.clamp in {node.target for node in new.graph.nodes}
    assert torch.sym_max not in {node.target for node in new.graph.nodes}


@pytest.mark.usefixtures("fresh_backend")
def test_every_value_runs_one_compiled_program_with_eager_results_and_integer_outputs():
    def f(x, n):
        pos = torch.arange(x.shape[0]) + n
        lo = max(n - 8 + 1, 0)
        return x * (pos > lo + 2).to(x.dtype) + n, n + 1

    cf = torch.compile(f, backend="tilefuse")
    x = torch.randn(16)
    with torch.no_grad():
        for n in (3, 4, 5, 9, 17, 40):
            y, m = cf(x, n)
            want, want_m = f(x, n)
            assert torch.equal(y, want) and m == want_m and type(m) is int, (n, y, want, m)
    rs = [r for r in tb.reports() if any("passed as 0-d tensors" in e for e in r.events)]
    assert len(rs) == 1 and rs[0].variants == 1 and rs[0].calls_eager == 0, tb.summary()
    assert rs[0].calls_tilefuse >= 5, tb.summary()  # (the first value compiles as a static graph)


@pytest.mark.usefixtures("fresh_backend")
def test_an_int_used_as_a_size_still_compiles_per_value():
    def f(x, n):
        return x[:n] * 2

    cf = torch.compile(f, backend="tilefuse")
    x = torch.randn(16)
    with torch.no_grad():
        for n in (3, 4, 5):
            assert torch.equal(cf(x, n), f(x, n))
    assert not any("passed as 0-d tensors" in e for r in tb.reports() for e in r.events), tb.summary()


def test_the_integer_outputs_are_evaluated_from_a_calls_arguments_without_sympy_per_call():
    """`_int_evaluator` (made once, then plain Python per call) agrees with the sympy evaluation
    for polynomials in an int input and a tensor's dim, and declines anything else."""
    import sympy

    gm = _gm(position_mask)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_expr = ph[1].meta["example_value"].node.expr
    x_dim = sympy.Symbol("s7", integer=True, positive=True)
    ph[0].meta["example_value"] = torch.empty(4)  # (a static tensor: its dims give no symbol)
    outs = {3: n_expr + 1, 4: 2 * n_expr ** 2 - 3, 5: 11}
    ev = tb._int_evaluator(outs, gm, ["input", "int"], {})
    for n in (0, 1, 8, 1000):
        assert ev([torch.zeros(4), n]) == {3: n + 1, 4: 2 * n * n - 3, 5: 11}
    assert tb._int_evaluator({3: x_dim + 1}, gm, ["input", "int"], {}) is None  # no argument gives s7
    from torch.utils._sympy.functions import FloorDiv

    assert tb._int_evaluator({3: FloorDiv(n_expr, 2)}, gm, ["input", "int"], {}) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_int_beside_a_16_bit_float_tensor_stays_an_int(dtype):
    """PyTorch computes a 16-bit tensor times a Python int with the int in float32 (bf16: x * 257
    is x * 257), but on a GPU a 0-d int64 CUDA tensor is an ordinary operand, cast to the 16-bit
    type first (257 becomes 256): such an int is not taken. (On the CPU both give x * 257.)"""

    def fn(g, x_, n_):
        return (_node(g, operator.mul, (x_, n_), torch.zeros(4, dtype=dtype)),)

    gm = _gm(fn)
    ph = [node for node in gm.graph.nodes if node.op == "placeholder"]
    ph[0].meta["example_value"] = torch.zeros(4, dtype=dtype)
    assert value_ints(ph, ["input", "int"], set()) == []


def _eager_and_compiled(f, argsets):
    """(eager, compiled) results or exception types of `f` at each argument set, in order (a
    second value makes dynamo mark the int dynamic)."""
    cf = torch.compile(f, backend="tilefuse")
    out = []
    with torch.no_grad():
        for a in argsets:
            pair = []
            for fn in (f, cf):
                try:
                    pair.append(fn(*a))
                except Exception as e:  # noqa: BLE001 (compared by type)
                    pair.append(type(e))
            out.append(pair)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


XI32 = torch.arange(-4, 4, dtype=torch.int32)
XU8 = torch.arange(250, 256, dtype=torch.uint8)
CASES = {  # (function, argument sets): each once wrongly taken as a 0-d tensor (a review found them)
    "a 0-d int32 beside the int": (lambda x, n: x[0] + n, [(XI32, 3), (XI32, 4)]),
    "a 0-d comparison past int32": (lambda x, n: x[0] < n, [(XI32, 3), (XI32, 2**31)]),
    "a 0-d uint8 reduction beside the int": (lambda x, n: x.amax() + n, [(XU8, 3), (XU8, 4)]),
    "only an integer output": (lambda x, n: (x * 2, n + 1)[1], [(XI32, 3), (XI32, 4)]),
    "the int as a divisor": (lambda x, n: x + 7 // n, [(XI32, 3), (XI32, 4), (XI32, 0), (XI32, 5)]),
    "the int as a modulus": (lambda x, n: x % n, [(XI32, 3), (XI32, 4), (XI32, 0), (XI32, 5)]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.usefixtures("fresh_backend")
def test_what_a_0d_tensor_would_change_stays_an_int_and_matches_eager(case):
    f, argsets = CASES[case]
    for args, (want, got) in zip(argsets, _eager_and_compiled(f, argsets)):
        assert _same(want, got), (case, args[-1], want, got)
    assert not any("passed as 0-d tensors" in e for r in tb.reports() for e in r.events), tb.summary()


@pytest.mark.usefixtures("fresh_backend")
def test_a_graph_reading_only_such_ints_and_weights_is_not_given_a_device_of_its_own():
    """A graph of weights and ints alone (no tensor of the caller's) would not know its device:
    it runs in eager, as before, rather than on wherever a 0-d tensor was made."""
    lin = torch.nn.Linear(4, 4)

    def f(n):
        return lin.weight * 2 + n

    for (want, got) in _eager_and_compiled(f, [(3,), (4,), (5,)]):
        assert _same(want, got)
    assert not any("passed as 0-d tensors" in e for r in tb.reports() for e in r.events), tb.summary()


@pytest.mark.usefixtures("fresh_backend")
def test_ints_equal_at_compile_time_and_unequal_later_reach_their_own_uses():
    """Two ints equal when the program compiles (a cache's layers pass the same length) and
    unequal in later calls each reach their own uses: they are two inputs of the program, not
    one. A call passes one 0-d tensor for equal values (one fill, not one per layer), and
    torch.export, which would take one object passed twice as one input, is given distinct
    ones (without that, a later unequal pair got the first value for both)."""
    def f(x, a, b):
        return x + a, x * b, a + 1, b + 2

    cf = torch.compile(f, backend="tilefuse")
    x = torch.arange(6, dtype=torch.int64)
    with torch.no_grad():
        for a, b in ((3, 3), (4, 4), (5, 5), (5, 7), (9, 2), (6, 6)):
            got, want = cf(x, a, b), f(x, a, b)
            assert all(_same(w, g) for w, g in zip(want, got)), ((a, b), got, want)
    runners = [r for r in tb.reports() if any("passed as 0-d tensors" in e for e in r.events)]
    assert runners and all(not r.calls_eager for r in runners), tb.summary()



def test_a_call_fills_one_tensor_per_distinct_value_and_export_gets_distinct_ones():
    """`_tensorized(share=True)` (each call) makes one 0-d tensor per distinct value, so equal
    ints share it; `_distinct` (before torch.export) clones each repeat, leaving the values."""
    from tilefuse.frontend.backend import GraphRunner, _distinct

    r = GraphRunner.__new__(GraphRunner)
    r.scalars = {1: "s0", 2: "s1", 3: "s2"}
    x = torch.ones(2)
    args = r._tensorized([x, 5, 5, 7], share=True)
    assert args[0] is x and args[1] is args[2] and args[3] is not args[1]
    assert [int(a) for a in args[1:]] == [5, 5, 7]
    alone = r._tensorized([x, 5, 5, 7])
    assert alone[1] is not alone[2]
    d = _distinct(args)
    assert d[0] is x and d[1] is args[1] and d[2] is not args[2] and d[3] is args[3]
    assert len({id(t) for t in d}) == 4 and [int(a) for a in d[1:]] == [5, 5, 7]


@pytest.mark.usefixtures("fresh_backend")
def test_an_integer_output_of_a_size_and_the_int_does_not_stop_sizes_from_being_made():
    """`len(cache) + n` returned as an int: evaluated on the host, so the rewritten graph does
    not compute it as a tensor op taking a size (which made every size compile on its own);
    the cache's later sizes are made with no compile, with eager's results."""
    def f(x, cache, n):
        c = torch.cat([cache, x], dim=0)
        return c, x * 2 + n, c.shape[0] + n

    cf = torch.compile(f, backend="tilefuse")
    x = torch.randn(1, 4)
    with torch.no_grad():
        for s in range(3, 12):
            cache = torch.randn(s, 4)
            got, want = cf(x, cache, s + 7), f(x, cache, s + 7)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2], (s, got)
    r = max(tb.reports(), key=lambda r: r.variants)
    assert any("passed as 0-d tensors" in e for e in r.events) and r.calls_eager == 0, tb.summary()
    assert r.resized >= r.variants - 2, tb.summary()

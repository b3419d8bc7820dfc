"""The frontend: `-c` expressions, torch.export capture, and aten -> Graph IR translation.

Properties checked: factory calls in an expression become the program's inputs (re-made fresh
on demand) and modules its weights; the Graph IR has one Input per user input and one Weight
per parameter (with its value); dead nodes are dropped; nodes remember the user's source line;
dtype promotion agrees with PyTorch; and every program tilefuse cannot take is refused with one
line naming what and where (a CaptureError / ExprError), or becomes a visible Extern node.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse import dtypes
from tilefuse.frontend.builder import Builder, broadcast_shapes, promote
from tilefuse.frontend.capture import CaptureError, export, source_of, to_graph
from tilefuse.frontend.expr import ExprError, parse
from tilefuse.graph import ir

HERE = __file__
# torch.export keeps stack frames of `forward` methods only; capture anchors plain functions through
# this hook so their lines are kept too (torch 2.13 has it; without it sources fall back to "")
ANCHORS = hasattr(torch.fx.proxy, "_register_stack_trace_anchor")


def graph_of(fn, *inputs, expr=None):
    return to_graph(export(fn, inputs, expr=expr), expr=expr)


def one_line(e: Exception) -> str:
    text = str(e)
    assert "\n" not in text, f"error message spans several lines: {text!r}"
    return text


# -- `-c` expressions ---------------------------------------------------------------------------------


def test_expression_factories_become_inputs_and_modules_weights():
    """Each torch.randn/randint call is an input (in order); a module built in the expression is a
    submodule whose parameters are the program's weights."""
    m, inputs, specs = parse("nn.Linear(8, 3)(torch.randn(2, 8)) + torch.randint(0, 4, (2, 3))")
    assert [s.text for s in specs] == ["torch.randn(2, 8)", "torch.randint(0, 4, (2, 3))"]
    assert [tuple(x.shape) for x in inputs] == [(2, 8), (2, 3)]
    assert sorted(n for n, _ in m.named_parameters()) == ["mods._m0.bias", "mods._m0.weight"]
    g = graph_of(m, *inputs, expr="...")
    assert len(g.inputs) == 2 and len(g.weights) == 2
    assert {g[w].source for w in g.weights} == {"mods._m0.weight", "mods._m0.bias"}
    torch.testing.assert_close(m(*inputs), m.mods._m0(inputs[0]) + inputs[1])


@pytest.mark.parametrize("text", ["(torch.randn(4, 6, 8) * 2 + 1).transpose(1, 2).contiguous()",
                                  "nn.Linear(8, 3)(torch.randn(2, 8)).relu()",
                                  "(lambda x: x.sin())(torch.randn(5)) * 2"])
def test_torch_compile_traces_the_expression_whole(text):
    """The module's forward is a function of its inputs: torch.compile (the bench's baseline)
    captures the whole expression as one graph. As an eval in forward it captured none and
    ran eager under torch.compile's name."""
    import copy

    torch._dynamo.reset()
    m, inputs, _ = parse(text)
    ex = torch._dynamo.explain(m)(*inputs)
    assert ex.graph_count == 1 and ex.graph_break_count == 0, ex.break_reasons
    torch.testing.assert_close(copy.deepcopy(m)(*inputs), m(*inputs))
    torch._dynamo.reset()


def test_expression_module_methods_apply_to_the_hoisted_module():
    """`nn.Linear(8, 3).bfloat16()` calls a method of a module built in the expression: the
    result is that one module (its weights bf16), registered once."""
    m, inputs, _ = parse("nn.Linear(8, 3).bfloat16()(torch.randn(2, 8).bfloat16())")
    assert sorted(n for n, _ in m.named_parameters()) == ["mods._m0.bias", "mods._m0.weight"]
    assert m.mods._m0.weight.dtype == torch.bfloat16 and m(*inputs).dtype == torch.bfloat16


def test_float64_reference_keeps_the_programs_own_casts_in_float64():
    """A program that casts (`.to(bf16)`, `.half()`, a `dtype=` argument) is referenced in float64
    all the way: the reference is the exact value, not eager's own rounding of it."""
    from tilefuse.check import compare, float64_reference

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1, dtype=torch.float32).to(torch.bfloat16), x.half().float() * 3

    x = torch.randn(64, 33, dtype=torch.bfloat16)
    soft, tripled = float64_reference(M(), [x])
    assert soft.dtype == tripled.dtype == torch.float64
    torch.testing.assert_close(soft, torch.softmax(x.double(), -1), rtol=0, atol=0)
    torch.testing.assert_close(tripled, x.double() * 3, rtol=0, atol=0)
    eager = M()(x)[0]
    c = compare("softmax", eager, soft, eager)
    assert c.torch_error > 1e-4, "eager's bf16 rounding is an error against the float64 value"


def test_float64_reference_raises_a_float_made_from_integers_to_meet_a_float64_buffer():
    """An integer tensor cast with `.float()` (positions, as a rotary embedding makes them) and
    then multiplied by a float64 buffer runs in float64 under the reference, not as a dtype error."""
    from tilefuse.check import float64_reference

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))

        def forward(self, x):
            pos = torch.arange(x.shape[0])[:, None].float()
            return x * torch.cos(pos @ self.inv_freq[None, :])

    x = torch.randn(5, 4, dtype=torch.bfloat16)
    out = float64_reference(Rotary(), [x])
    assert out.dtype == torch.float64
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).double() / 8)
    torch.testing.assert_close(out, x.double() * torch.cos(torch.arange(5).double()[:, None] @ inv[None, :]))


def test_expression_inputs_are_fresh_each_time_they_are_made():
    """InputSpec.make evaluates the factory again: same shape and dtype, new values."""
    _, inputs, specs = parse("torch.randn(4, 5) * 2")
    again = specs[0].make({"torch": torch})
    assert again.shape == inputs[0].shape and again.dtype == inputs[0].dtype
    assert not torch.equal(again, inputs[0])


def test_expression_dtype_casts_float_inputs_and_weights_only():
    """parse(dtype=bf16) casts floating inputs and the module's weights; integer inputs stay integers."""
    m, inputs, _ = parse("F.cross_entropy(nn.Linear(4, 6)(torch.randn(3, 4)), torch.randint(0, 6, (3,)))",
                         torch.bfloat16)
    assert [x.dtype for x in inputs] == [torch.bfloat16, torch.int64]
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("text, message", [
    ("torch.randn(3, 4 +", "the expression does not parse"),
    ("1 + 2", "the expression has no inputs"),
    ("nn.NoSuchModule(3)(torch.randn(3))", "cannot evaluate 'nn.NoSuchModule(3)'"),
    ("torch.randn(-1) * 2", "cannot make the inputs"),
    ("torch.randn(3)" + ".relu()" * 10000, "nests too deeply"),  # deeper than the raised recursion limit
])
def test_bad_expressions_raise_one_line_expr_errors(text, message):
    with pytest.raises(ExprError) as e:
        parse(text)
    assert message in one_line(e.value)


def test_a_long_chain_of_calls_parses_into_a_module_that_runs_it():
    """1500 chained calls: the AST is ~1500 deep, past Python's default recursion limit in
    ast.parse, the rewrite and compile()."""
    m, (x,), _ = parse("torch.randn(3, 4)" + ".neg()" * 1501)
    with torch.no_grad():
        torch.testing.assert_close(m(x), -x, rtol=0, atol=0)


# -- capture and translation ------------------------------------------------------------------------


def test_graph_has_user_inputs_in_order_and_module_weights_with_values():
    """Inputs keep the forward's order and types; each parameter is a Weight whose value is the module's."""
    m = torch.nn.LayerNorm(6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(6))

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = m

        def forward(self, a, b):
            return self.norm(a) * b

    a, b = torch.randn(2, 6), torch.randn(6).to(torch.bfloat16)
    g = graph_of(Two(), a, b)
    assert [g[i].type for i in g.inputs] == [ir.TensorType((2, 6), "f32"), ir.TensorType((6,), "bf16")]
    weights = {g[w].source: g.weights[w] for w in g.weights}
    assert set(weights) == {"norm.weight", "norm.bias"}
    torch.testing.assert_close(weights["norm.weight"], m.weight.detach())
    assert all(isinstance(g[w], ir.Weight) for w in g.weights)


def test_dead_nodes_are_dropped_but_unused_inputs_are_kept():
    """Only nodes the outputs need remain; an input the program ignores is still an Input."""
    def fn(x, unused):
        _ = torch.exp(x)  # dead
        return x * 2
    g = graph_of(fn, torch.randn(3), torch.randn(3))
    assert len(g.inputs) == 2
    assert not any(isinstance(n, ir.Map) and n.op == "exp" for n in g.nodes)


def test_translated_types_match_torch_for_mixed_dtypes():
    """Every output's dtype and shape is what PyTorch says (int/bool/bf16/f32 mixes, scalars)."""
    def fn(x, i, h):
        return (x + i, i * 2, i / 2, (x > 0).sum(-1), h + 1.5, h * x, i + True, (i > 1) & (i < 3))
    x, i, h = torch.randn(3, 4), torch.randint(-5, 5, (3, 4)), torch.randn(3, 4).to(torch.bfloat16)
    g = graph_of(fn, x, i, h)
    want = fn(x, i, h)
    got = [g[o].type for o in g.outputs]
    assert got == [ir.TensorType(tuple(w.shape), dtypes.from_torch(w.dtype)) for w in want]


@pytest.mark.skipif(not ANCHORS, reason="this torch has no stack-trace anchors")
def test_nodes_remember_the_users_source_line():
    """Nodes made by a plain Python function name its file and line (not tilefuse's wrapper)."""
    def fn(x):
        y = x * 3  # the line
        return torch.logcumsumexp(y, -1)
    g = graph_of(fn, torch.randn(2, 5))
    mul = next(n for n in g.nodes if isinstance(n, ir.Map) and n.op == "mul")
    assert mul.source.startswith(f"{HERE}:") and "y = x * 3" in mul.source
    ext = next(n for n in g.nodes if isinstance(n, ir.Extern))
    assert "torch.logcumsumexp(y, -1)" in ext.source


def test_unsupported_single_output_op_is_a_visible_extern():
    """logcumsumexp is not lowered: it becomes an Extern naming aten.logcumsumexp and why, shown by
    the graph printer."""
    g = graph_of(lambda x: torch.logcumsumexp(x, 0) + 1, torch.randn(4, 3))
    (ext,) = [n for n in g.nodes if isinstance(n, ir.Extern)]
    assert ext.target == "aten.logcumsumexp.default"
    assert "tilefuse does not lower aten.logcumsumexp" in ext.reason
    assert "extern aten.logcumsumexp.default" in str(g)


def test_unsupported_argument_becomes_an_extern_naming_it():
    """A handled op with an argument tilefuse cannot take (an adaptive pool to 2 x 2) is an Extern saying so."""
    g = graph_of(lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 2), torch.randn(1, 3, 8, 8))
    (ext,) = [n for n in g.nodes if isinstance(n, ir.Extern)]
    assert "output size (2, 2)" in ext.reason, ext.reason


@pytest.mark.parametrize("fn, op", [
    (lambda x: torch.sort(x, -1)[0], "aten.sort"),
    (lambda x: torch.sort(x, -1), "aten.sort"),
    (lambda x: torch.topk(x, 2).indices, "aten.topk"),
    (lambda x: torch.kthvalue(x, 2, -1).values, "aten.kthvalue"),
])  # (max/min along a dim and var_mean are translated: test_multi_output_ops.py; topk/sort: test_topk_sort.py)
def test_several_output_ops_run_as_externs_naming_the_op_and_line(fn, op):
    """An op that returns several tensors and is not lowered runs in PyTorch as a visible extern,
    one per result used, each carrying the user's line (this file)."""
    g = graph_of(fn, torch.randn(3, 5))
    externs = [n for n in g.nodes if isinstance(n, ir.Extern)]
    assert externs and all(n.target.startswith(op + ".") and n.item is not None for n in externs), externs
    assert all(HERE in n.source for n in externs) or not ANCHORS


def test_mismatched_shapes_are_one_capture_error_and_log_nothing(capfd):
    """(3,4) + (5,6) fails in torch.export: one CaptureError line, and torch's logger prints no traceback."""
    with pytest.raises(CaptureError) as e:
        graph_of(lambda a, b: a + b, torch.randn(3, 4), torch.randn(5, 6))
    assert "torch.export could not capture" in one_line(e.value) and "broadcast" in str(e.value)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


class _KeepsAState(torch.nn.Module):
    """Assigns a tensor attribute in forward: torch.export warns that it was "assigned during
    export" (as for an LSTM's flat weights)."""

    def __init__(self, then):
        super().__init__()
        self.then = then

    def forward(self, x):
        self.state = x.detach() * 0
        return self.then(x)


def _warnings_to_stderr(monkeypatch):
    import sys
    import warnings

    monkeypatch.setattr(warnings, "showwarning",
                        lambda m, c, f, n, file=None, line=None: sys.stderr.write(warnings.formatwarning(m, c, f, n)))
    monkeypatch.setattr(warnings, "filters", [("always", None, Warning, None, 0)])


def test_export_warnings_show_only_when_the_capture_succeeds(monkeypatch, capfd):
    """What torch.export says on stderr is shown after the whole capture succeeded, so a program
    then refused gives its one error line alone, not a warning about export internals first."""
    _warnings_to_stderr(monkeypatch)
    with torch.no_grad():
        tilefuse.compile(_KeepsAState(lambda x: x * 2), (torch.randn(3),))
    assert "assigned during export" in capfd.readouterr().err
    with torch.no_grad(), pytest.raises(CaptureError, match="nonzero"):
        tilefuse.compile(_KeepsAState(lambda x: torch.nonzero(x)), (torch.randn(3),))
    assert "assigned during export" not in capfd.readouterr().err


def test_unsupported_dtype_names_the_dtype_and_op():
    with pytest.raises(CaptureError) as e:
        graph_of(lambda x: x.to(torch.complex64) * 2, torch.randn(3))
    assert "complex64" in one_line(e.value) and "aten.to" in str(e.value)
    with pytest.raises(CaptureError, match="input .*complex64"):
        graph_of(lambda x: x * 2, torch.randn(3, dtype=torch.complex64))


def test_non_tensor_results_are_refused():
    with pytest.raises(CaptureError, match="reads a tensor's value into Python"):
        graph_of(lambda x: x.sum().item(), torch.randn(3))


def test_source_of_without_a_trace_falls_back_to_the_expression():
    class Node:
        meta = {}
    assert source_of(Node(), "torch.randn(3) * 2") == "torch.randn(3) * 2"
    assert source_of(Node()) == ""


# -- builder ----------------------------------------------------------------------------------------


def test_promote_agrees_with_torch_promote_types():
    """For every pair of tilefuse dtypes whose PyTorch promotion is a tilefuse dtype, promote agrees."""
    for a, b in itertools.product(dtypes.ALL, repeat=2):
        want = torch.promote_types(dtypes.to_torch(a), dtypes.to_torch(b))
        try:
            want = dtypes.from_torch(want)
        except ValueError:
            continue  # e.g. u8 + i8 -> i16, which tilefuse does not have
        assert promote(a, b) == want, (a, b)


def test_broadcast_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"shapes \(3, 4\) and \(5, 6\) do not broadcast"):
        broadcast_shapes((3, 4), (5, 6))


def test_builder_names_are_fresh_and_reshape_to_same_shape_is_free():
    b = Builder()
    x = b.add(ir.Input("x", ir.TensorType((2, 3), "f32")))
    y1, y2 = b.map("exp", x), b.map("exp", x)
    assert y1 != y2 and len(set(b.names)) == len(b.names)
    assert b.reshape(x, (2, 3)) == x and b.cast(x, "f32") == x
    assert b.type(b.map("gt", x, b.scalar(0.5, x))).dtype == "bool"
    assert b.type(b.reduce("sum", x, (-1,), True)).shape == (2, 1)


def test_rms_norm_default_eps_is_the_compute_types_epsilon():
    """F.rms_norm without eps uses torch.finfo(compute type).eps: f32's for f32 and bf16 inputs."""
    for dt in (torch.float32, torch.bfloat16):
        g = graph_of(lambda x: F.rms_norm(x, (8,)), torch.randn(2, 8).to(dt))
        consts = [n.value for n in g.nodes if isinstance(n, ir.Constant)]
        assert torch.finfo(torch.float32).eps in consts


def test_module_forward_lines_are_sources():
    """For an nn.Module, the line in its forward that made each node is the node's source."""
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x) + 1  # module line

    g = graph_of(M(), torch.randn(3))
    exp = next(n for n in g.nodes if isinstance(n, ir.Map) and n.op == "exp")
    assert exp.source.startswith(f"{HERE}:") and "# module line" in exp.source


def test_a_batch_norm_in_training_mode_is_refused_naming_its_buffer_and_eval():
    """Its in-place update of num_batches_tracked is a write into the module's state: the error
    names the buffer and says to compile after .eval(), which then compiles."""
    import tilefuse
    from tilefuse.frontend.capture import CaptureError

    m, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), torch.randn(5, 4)
    with pytest.raises(CaptureError, match=r"buffer 1\.num_batches_tracked.*after \.eval\(\)"):
        tilefuse.compile(m, (x,))
    m.eval()
    torch.testing.assert_close(tilefuse.compile(m, (x,))(x), m(x), rtol=1e-5, atol=1e-5)


def test_in_place_write_through_a_view_is_refused_not_lost():
    import tilefuse

    """The Graph IR is pure; an in-place add through a view must be an error naming the op
    and the line, never a silently dropped write."""
    from tilefuse.frontend.capture import CaptureError

    def g(x):
        y = x * 1
        y.view(2, 2).add_(1)
        return y * 2

    with pytest.raises(CaptureError, match=r"aten\.add_.*in place.*test_frontend\.py"):
        tilefuse.compile(g, (torch.randn(4),))


def test_a_tensor_literal_in_the_program_is_a_constant_not_an_in_place_write():
    """torch.export lifts `torch.tensor([...])` as lift_fresh_copy + detach_; detach_ writes
    autograd state only, so the program compiles (transformers' KV cache makes one too)."""
    import tilefuse

    def f(x):
        return x * torch.tensor([1.0, -2.0, 3.0])

    x = torch.randn(2, 3)
    torch.testing.assert_close(tilefuse.compile(f, (x,))(x), f(x))


@pytest.mark.parametrize("fn, dim", [(lambda x: x.softmax(dim=5), 5), (lambda x: torch.softmax(x, -3), -3)],
                         ids=["softmax-5", "softmax--3"])
def test_a_dim_out_of_range_is_refused_as_pytorch_does(fn, dim):
    """torch.export does not check softmax's dim; wrapping it modulo the rank would compute a
    softmax over another axis, where PyTorch raises."""
    import tilefuse
    from tilefuse.frontend.capture import CaptureError

    with pytest.raises(CaptureError, match=rf"aten\.softmax: dim {dim} is out of range for a 2-d tensor"):
        tilefuse.compile(fn, (torch.randn(2, 3),))


def test_a_pass_that_runs_out_of_stack_is_one_capture_error(monkeypatch):
    """The passes walk dependency chains with stacks of their own (test_deep_programs.py); should
    one still recurse as deep as a chain, the user gets one CaptureError naming the program,
    never a RecursionError's thousand-frame dump."""
    import tilefuse
    from tilefuse import compiler
    from tilefuse.frontend.capture import CaptureError

    def too_deep(*args):
        raise RecursionError("maximum recursion depth exceeded")

    def chain(x):
        return x * 1.001 + 0.01

    monkeypatch.setattr(compiler, "_stages", too_deep)
    with pytest.raises(CaptureError, match="chain: its chain of dependent ops is too long"):
        tilefuse.compile(chain, (torch.randn(2, 4),))


def test_compile_under_autocast_is_refused_in_one_line_naming_the_module():
    """torch.export drops autocast's casts (Linear then Linear met bf16 @ f32): a clear refusal,
    naming the module's class, instead of a dtype error about the second matmul."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(CaptureError) as e:
        tilefuse.compile(m, (torch.randn(3, 4),))
    assert "Sequential" in str(e.value) and "autocast" in str(e.value) and "\n" not in str(e.value)


def test_example_inputs_as_a_dict_or_a_number_are_refused_saying_what_to_pass():
    """A dict as example_inputs was taken as its keys (`input args_0 is a str`)."""
    with pytest.raises(TypeError, match="example_inputs is a dict: pass the positional inputs as a tuple"):
        tilefuse.compile(lambda x: x * 2, {"x": torch.randn(3)})
    with pytest.raises(CaptureError, match="input args_1 is an int, not a tensor"):
        tilefuse.compile(lambda x, n: x * n, (torch.randn(3), 2))
    out = tilefuse.compile(lambda d: d["x"] * 2, ({"x": torch.ones(3)},))({"x": torch.ones(3)})
    assert torch.equal(out, torch.full((3,), 2.0))


def test_a_lambda_expression_runs_under_torch_compile_call_after_call():
    """`tilefuse run --bench` times a -c expression under torch.compile too: dynamo installs what
    it compiles from the expression's lambdas in their globals, which must be the same dict at
    the next call (a fresh one each call raised NameError: __compiled_fn_...), and a copy of the
    module still works (its globals, which hold modules, are not copied)."""
    import copy

    from tilefuse.frontend.expr import parse

    m, ins, _ = parse("(lambda q: (lambda t: t * 2 + t[..., :1])(q.transpose(0, 1)))(torch.randn(3, 4))")
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="eager")
    want = m(*ins)
    for _ in range(3):
        assert torch.equal(compiled(*ins), want)
    assert torch.equal(copy.deepcopy(m)(*ins), want)

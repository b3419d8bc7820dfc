"""torch.compile(model, backend="tilefuse") on the CPU (kernels run in the Loop IR interpreter).

Properties: the name is registered (entry point or `register()`); compiled outputs equal
eager's within DESIGN.md's 2x rule; what cannot be compiled runs in eager with the reason
recorded and logged (training graphs, a graph capture refuses, a kernel failing at run time)
and still gives eager's answer; graph breaks give several graphs, each compiled; dynamic
sizes compile once per size; an in-place weight update or another module's weights are
never served from a stale compilation; TILEFUSE_LOG=summary prints kernels and externs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilefuse.check import compare, float64_reference
from tilefuse.frontend import backend as tb


pytestmark = pytest.mark.usefixtures("fresh_backend")


class NormMLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _check(module, out, *inputs):
    with torch.no_grad():
        eager = module(*inputs)
    c = compare("out", out, float64_reference(module, inputs), eager)
    assert c.ok, c


def test_registered_by_name():
    assert "tilefuse" in torch._dynamo.list_backends()
    tb.register()  # idempotent
    assert torch._dynamo.backends.registry.lookup_backend("tilefuse") is tb.tilefuse_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_matches_eager_and_runs_kernels(dtype):
    torch.manual_seed(0)
    m = NormMLP().to(dtype).eval()
    x = torch.randn(3, 5, 16, dtype=dtype)
    with torch.no_grad():
        out = torch.compile(m, backend="tilefuse")(x)
    _check(m, out, x)
    (r,) = tb.reports()
    assert r.status == "tilefuse" and r.kernels >= 2 and r.calls_tilefuse == 1
    matmuls = {note: k for (what, note), k in r.externs.items() if what == "contraction"}
    if dtype == torch.float32:  # the generated GEMM takes bf16/fp16: both matmuls stay in cuBLAS, saying why
        assert list(matmuls.values()) == [2] and "bf16 or fp16" in next(iter(matmuls))
    else:  # both run as generated GEMMs, with the norm, GELU and residual in their epilogues
        assert matmuls == {}
        assert sum(s.family == "gemm" for s in r.stages.plan.steps) == 2


def test_summary_is_printed_when_asked(monkeypatch, capsys):
    monkeypatch.setenv("TILEFUSE_LOG", "summary")
    m = NormMLP().eval()
    with torch.no_grad():
        torch.compile(m, backend="tilefuse")(torch.randn(4, 16))
    err = capsys.readouterr().err
    assert "tilefuse: graph 0 (" in err and "tilefuse kernel(s)" in err and "extern 2x contraction" in err
    assert "tilefuse kernel(s)" in tb.summary()


def test_strided_views_are_counted_apart_from_externs():
    """Head transposes SDPA reads in place, and a result in eager's layout, launch nothing and
    copy nothing: the report lists them as views, not externs."""
    def fn(q, k, v):
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return a, q.transpose(1, 2) * 2
    q, k, v = (torch.randn(2, 8, 4, 16) for _ in range(3))
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    want = fn(q, k, v)
    for got, w in zip(out, want):
        torch.testing.assert_close(got, w)
    assert out[1].stride() == want[1].stride()
    (r,) = tb.reports()
    notes = {note for (what, note) in r.views if what == "permute"}
    assert sum(r.views.values()) == 4 and len(notes) == 2, r.views  # q, k, v for SDPA; the result laid out as eager's
    assert not any(what == "view permute" for what, _ in r.externs), r.externs
    assert f"{sum(r.views.values())} strided view(s)" in r.line() and "\n    view " in r.line()


def test_silent_without_the_variable(monkeypatch, capsys):
    monkeypatch.delenv("TILEFUSE_LOG", raising=False)
    with torch.no_grad():
        torch.compile(NormMLP().eval(), backend="tilefuse")(torch.randn(4, 16))
    assert "tilefuse:" not in capsys.readouterr().err


def test_training_graph_falls_back_and_backward_works():
    """...and says so once without TILEFUSE_LOG (a model called without torch.no_grad() ran every
    graph in eager unseen)."""
    torch.manual_seed(1)
    m = NormMLP()
    x = torch.randn(4, 16)
    with pytest.warns(RuntimeWarning, match="runs in eager: training graph"):
        out = torch.compile(m, backend="tilefuse")(x)
    out.sum().backward()
    assert m.up.weight.grad is not None and torch.allclose(out, m(x))
    (r,) = tb.reports()
    assert r.status == "eager" and "training" in r.reason and r.calls_eager == 1


def test_graph_breaks_compile_each_graph(monkeypatch, capsys):
    monkeypatch.setenv("TILEFUSE_LOG", "summary")

    def f(x):
        y = torch.softmax(x, -1) * 2
        print("a graph break")
        return torch.tanh(y) + x

    x = torch.randn(3, 7)
    with torch.no_grad():
        out = torch.compile(f, backend="tilefuse")(x)
    assert torch.allclose(out, f(x), atol=1e-6)
    rs = tb.reports()
    assert len(rs) == 2 and all(r.status == "tilefuse" and r.kernels >= 1 for r in rs)
    assert "graph break" in capsys.readouterr().err


def test_dynamic_sizes_compile_once_per_size():
    torch.manual_seed(2)
    m = NormMLP().eval()
    f = torch.compile(m, backend="tilefuse", dynamic=True)
    with torch.no_grad():
        for n in (3, 5, 3):
            x = torch.randn(n, 16)
            _check(m, f(x), x)
    (r,) = tb.reports()
    assert r.variants == 2 and r.calls_tilefuse == 3


def test_in_place_weight_update_recompiles():
    torch.manual_seed(3)
    m = NormMLP().eval()
    f = torch.compile(m, backend="tilefuse")
    x = torch.randn(4, 16)
    with torch.no_grad():
        f(x)
        m.down.weight.mul_(-2)
        m.norm.weight.add_(0.5)
        out = f(x)
    _check(m, out, x)
    (r,) = tb.reports()
    assert r.variants == 2 and any("changed in place" in e for e in r.events)


def test_one_graph_serves_two_modules_with_their_own_weights():
    torch.manual_seed(4)
    a, b = NormMLP().eval(), NormMLP().eval()
    fa, fb = torch.compile(a, backend="tilefuse"), torch.compile(b, backend="tilefuse")
    x = torch.randn(2, 16)
    with torch.no_grad():
        oa, ob = fa(x), fb(x)
    _check(a, oa, x)
    _check(b, ob, x)
    (r,) = tb.reports()  # dynamo reuses one graph for both: tilefuse compiles it per set of weights
    assert r.variants == 2


def test_capture_failure_falls_back_with_its_reason():
    def f(x):
        return (x.to(torch.complex64) * 2).abs() + 1  # a complex dtype: tilefuse's capture refuses it

    x = torch.randn(3, 8)
    with torch.no_grad():
        out = torch.compile(f, backend="tilefuse")(x)
    assert torch.equal(out, f(x))
    (r,) = tb.reports()
    assert r.status == "eager" and "complex64" in r.reason and r.calls_eager == 1


@pytest.mark.parametrize("where", ["inside", "around"])
def test_autocast_falls_back_to_eager_with_its_reason(where):
    """torch.export records none of autocast's casts (two Linears in a row met a bf16 @ f32), so a
    graph under autocast, entered inside the compiled function or around its call, runs in
    eager, saying why, and gives eager's result."""
    l1, l2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def inner(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return l2(l1(x))

    x = torch.randn(3, 4)
    with torch.no_grad():
        if where == "inside":
            out, eager = torch.compile(inner, backend="tilefuse")(x), inner(x)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, eager = torch.compile(lambda x: l2(l1(x)), backend="tilefuse")(x), l2(l1(x))
    assert out.dtype == torch.bfloat16 and torch.equal(out, eager)
    (r,) = tb.reports()
    assert r.status == "eager" and "autocast" in r.reason and r.calls_eager == 1, r


def test_run_time_failure_falls_back_once(monkeypatch):
    from tilefuse.runtime.program import Program

    def broken(self, *args):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(Program, "__call__", broken)
    m = NormMLP().eval()
    f = torch.compile(m, backend="tilefuse")
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(f(x), m(x)) and torch.equal(f(x), m(x))
    (r,) = tb.reports()
    assert r.calls_eager == 2 and r.calls_tilefuse == 0
    assert [e for e in r.events if "simulated launch failure" in e] == [r.events[0]]


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="unknown option"):
        with torch.no_grad():
            torch.compile(NormMLP().eval(), backend="tilefuse", options={"fast": True})(torch.randn(2, 16))


def test_graph_of_weights_alone_runs_in_eager():
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, n: int):
            return self.w.sin() * n

    m = Table()
    with torch.no_grad():
        assert torch.equal(torch.compile(m, backend="tilefuse")(3), m(3))
    (r,) = tb.reports()
    assert r.status == "eager" and "only weights" in r.reason


def test_in_place_writes_run_in_eager():
    """A write through a view, or into a buffer, must not be lost: such graphs run in eager."""

    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(4))

        def forward(self, x):
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
            return x * 2

    def through_view(x):
        y = x * 1
        y.view(2, 2)[0] += 1
        return y * 2

    x = torch.randn(4)
    with torch.no_grad():
        assert torch.equal(torch.compile(through_view, backend="tilefuse")(x), through_view(x))
        m, ref = Running(), Running()
        xs = torch.randn(3, 4)
        torch.compile(m, backend="tilefuse")(xs)
        ref(xs)
    assert torch.equal(m.mean, ref.mean)
    rs = tb.reports()
    assert len(rs) == 2 and all(r.status == "eager" and "writes to a tensor in place" in r.reason for r in rs)


def test_a_refused_graph_is_not_captured_again_on_every_call():
    """A graph refused for a buffer write stays in eager: its own run moves the buffer's
    version, which must not count as a weight change to compile for (torch.export per call)."""

    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("avg", torch.zeros(4))

        def forward(self, x):
            self.avg.mul_(0.9).add_(0.1 * x.mean(0))
            return x * 2

    m, ref = Ema(), Ema()
    fast = torch.compile(m, backend="tilefuse")
    with torch.no_grad():
        for _ in range(4):
            xs = torch.randn(3, 4)
            assert torch.equal(fast(xs), ref(xs))
    assert torch.equal(m.avg, ref.avg)
    (r,) = tb.reports()
    assert r.status == "eager" and r.calls_eager == 4
    assert not any("compiling again" in e for e in r.events), r.events


def _break():
    torch._dynamo.graph_break()


@pytest.mark.parametrize("name", ["transpose of an input", "slice of another output", "same-shape view"])
def test_an_output_that_is_a_view_keeps_its_aliasing_across_a_graph_break(name):
    """dynamo runs the code after a break on the graph's outputs: an in-place write through a
    returned view (x.t(), h[:, :2]) must reach its base, so such a graph runs in eager (tilefuse
    returns fresh tensors), with the reason said; the write's own graph, whose inputs then share
    memory, runs that call in eager too (overlapping_writes)."""

    def through_t(x):
        y = x.t()
        _break()
        y.mul_(10)
        return x + 1

    def through_slice(x):
        h = x * 2
        v = h[:, :2]
        _break()
        v.zero_()
        return h.sum(-1)

    def same_shape(x):
        y = x.view(2, -1)
        _break()
        y.add_(1)
        return x * 3

    fn = {"transpose of an input": through_t, "slice of another output": through_slice,
          "same-shape view": same_shape}[name]
    with torch.no_grad():
        want = fn(torch.ones(2, 3))
        got = torch.compile(fn, backend="tilefuse")(torch.ones(2, 3))
    assert torch.equal(got, want)
    if name == "same-shape view":
        # x.view(x.shape) is returned as x itself, so the write after the break is a write into
        # the next graph's input, which that graph makes (Graph.writes)
        assert all(r.status == "tilefuse" for r in tb.reports()) and tb.reports()[-1].stages.graph.writes
    else:
        assert any(r.status == "eager" and "view" in r.reason for r in tb.reports())


def test_in_place_ops_on_the_graphs_own_tensors_compile():
    """nn.ReLU(inplace=True) and `y += 1` on a tensor the graph made are value updates: the
    graph compiles (no eager fallback) and computes what eager does."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))

        def forward(self, x):
            y = self.seq(x)
            y += 1
            return y

    m, x = M().eval(), torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend="tilefuse")(x), m(x))
    (r,) = tb.reports()
    assert r.status == "tilefuse", r.reason


def test_a_dtype_round_trip_of_the_module_is_not_served_stale():
    """`m.half(); m.float()` swaps each parameter's data (same object, same version counter):
    dynamo's guards pass again for the f32 graph, and the weights' new storage must compile again."""
    torch.manual_seed(5)
    m = nn.Linear(16, 8)
    f = torch.compile(m, backend="tilefuse")
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = f(x)
        m.half()
        m.float()
        after = f(x)
        assert not torch.equal(after, before), "the f16-rounded weights were not used"
        torch.testing.assert_close(after, m(x), rtol=1e-5, atol=1e-5)


def test_compilations_of_freed_models_are_dropped_not_counted_against_the_limit(monkeypatch):
    """One graph serves every instance of a class; a model freed leaves a variant no call can use.
    Those go before MAX_VARIANTS is applied, so later models still compile, and a new weight
    landing at a freed one's id is a new weight set, not 'a weight changed in place'."""
    import gc

    monkeypatch.setattr(tb, "MAX_VARIANTS", 4)
    x = torch.randn(2, 8)
    for _ in range(7):
        m = nn.Linear(8, 8)
        with torch.no_grad():
            torch.compile(m, backend="tilefuse")(x)
        del m
        gc.collect()
    (r,) = tb.reports()
    assert r.calls_tilefuse == 7 and r.calls_eager == 0
    assert not any("changed in place" in e or "more than" in e for e in r.events), r.events


def test_graph_breaks_of_every_kind_are_counted_and_reset_forgets_them():
    """A data-dependent `if` is filed by dynamo under "unimplemented", a print under
    "graph_break": the summary names both (with dynamo's explanation); after reset() a graph
    without breaks reports none."""
    def f(x):
        y = x.relu()
        if y.sum() > 0:
            y = y * 2
        print("a graph break")
        return y.exp()

    with torch.no_grad():
        torch.compile(f, backend="tilefuse")(torch.randn(2, 8))
    s = tb.summary()
    assert "dynamo graph breaks: 2" in s and "Data-dependent branching" in s and "`print`" in s
    torch._dynamo.reset()
    tb.reset()
    with torch.no_grad():
        torch.compile(lambda x: x.sin(), backend="tilefuse")(torch.randn(2, 8))
    assert "graph breaks" not in tb.summary()


def test_a_changing_python_float_falls_back_once_saying_so():
    def g(x, a: float):
        return x * a + 1

    f = torch.compile(g, backend="tilefuse", dynamic=True)
    with torch.no_grad():
        for a, n in ((1.5, 4), (2.5, 4), (3.5, 5), (4.5, 6)):
            xs = torch.randn(n, 8)
            torch.testing.assert_close(f(xs, a), g(xs, a))
    events = [e for r in tb.reports() for e in r.events]
    said = [e for e in events if "an argument that changes between calls" in e]
    assert len(said) == 1, events


def test_inference_tensor_weights_are_said_to_go_unwatched():
    with torch.inference_mode():
        m = nn.Linear(8, 4)
        torch.compile(m, backend="tilefuse")(torch.randn(3, 8))
    (r,) = tb.reports()
    assert any("inference tensors" in e for e in r.events)


def test_inference_tensor_weights_serve_later_calls_without_a_compile():
    """Inference tensors keep no version counter (reading it raises): a call still finds the
    variant compiled for them, by identity and address."""
    torch.manual_seed(0)
    with torch.inference_mode():
        m = nn.Linear(8, 4)
        f = torch.compile(m, backend="tilefuse")
        for _ in range(3):
            x = torch.randn(3, 8)
            torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    (r,) = tb.reports()
    assert r.variants == 1 and r.calls_tilefuse == 3 and r.calls_eager == 0, (r.variants, r.calls_tilefuse)


def test_a_graph_refused_at_two_sizes_for_one_reason_stops_being_tried(monkeypatch):
    """Each try of a refused graph costs a compile (~0.5 s a size of a small model, every token of
    a `generate`): after REFUSED_AFTER sizes fail for the same reason, new sizes run in eager
    untried, saying so once; every call still gives eager's answer."""
    import tilefuse.compiler

    tries = []
    real = tilefuse.compiler.compile_stages
    monkeypatch.setattr(tilefuse.compiler, "compile_stages", lambda *a, **k: tries.append(1) or real(*a, **k))

    def f(x):
        return x.t(), x + 1  # an output that is a view of an input: refused at every size

    g = torch.compile(f, backend="tilefuse", dynamic=True)
    with torch.no_grad():
        for n in (3, 4, 5, 6, 7):
            x = torch.randn(n, 8)
            for got, want in zip(g(x), f(x)):
                torch.testing.assert_close(got, want)
    (r,) = tb.reports()
    assert r.calls_eager == 5 and r.calls_tilefuse == 0
    assert len(tries) == tb.REFUSED_AFTER
    assert sum("without compiling" in e for e in r.events) == 1, r.events


def test_an_output_that_is_an_input_itself_is_the_callers_tensor():
    """A graph returning an input unchanged (a no-op `.to`, as transformers' sliding-window cache
    does) compiles, and that output is the caller's own tensor, as in eager (the whole graph ran
    in eager before)."""
    def f(x, y):
        return y.to("cpu"), x + 1, y

    g = torch.compile(f, backend="tilefuse")
    with torch.no_grad():
        x, y = torch.randn(3, 4), torch.randn(5)
        a, b, c = g(x, y)
    assert a is y and c is y
    torch.testing.assert_close(b, x + 1)
    (r,) = tb.reports()
    assert r.status == "tilefuse" and r.calls_tilefuse == 1, (r.status, r.reason)


def test_an_integer_output_is_evaluated_from_the_calls_sizes():
    """A graph returning a size (transformers' sliding-window cache returns its length) compiles:
    tilefuse's program gives the tensors and the integer is evaluated from the call's sizes,
    equal to eager's at every size, all sizes from one symbolic export."""
    def f(x, cache):
        c = torch.cat([cache, x], 0)
        return c * 2, c.shape[0] + 1, x.relu()

    g = torch.compile(f, backend="tilefuse", dynamic=True)
    with torch.no_grad():
        for n in (3, 4, 7):
            x, cache = torch.randn(2, 4), torch.randn(n, 4)
            got, want = g(x, cache), f(x, cache)
            assert got[1] == want[1] == n + 3
            torch.testing.assert_close(got[0], want[0])
            torch.testing.assert_close(got[2], want[2])
    (r,) = tb.reports()
    assert r.status == "tilefuse" and r.calls_tilefuse == 3 and r.calls_eager == 0
    assert r.variants == 3 and r.exports == 1


def test_the_reports_do_not_keep_a_compiled_graph_alive_past_a_reset():
    """The backend's reports outlive dynamo's graphs (a summary is asked for later); the last
    variant's stages (graph IR, program, derived weights) are reachable from a report only while
    dynamo holds the graph. Holding them in the report kept every program compiled in the
    process alive (a fuzzing process grew to 21 GB)."""
    import gc
    import weakref

    from tilefuse.compiler import Compiled

    tb.register()
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(4, 16)
    kept = []
    for _ in range(2):
        torch._dynamo.reset()
        tb.reset()
        with torch.no_grad():
            torch.compile(m, backend="tilefuse")(x)
        (r,) = tb.reports()
        assert r.status == "tilefuse" and isinstance(r.stages, Compiled), tb.summary()
        kept.append((r, weakref.ref(r.stages), weakref.ref(r.stages.program)))
    torch._dynamo.reset()
    gc.collect()
    for r, stages, program in kept:
        assert stages() is None and program() is None and r.stages is None

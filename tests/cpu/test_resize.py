"""One program for every size of a graph whose changing sizes reach only externs (runtime.resize).

Properties:
- a decode step (norm, projection, append to a key/value cache, attention, output projection)
  compiled at two cache lengths is one program: the family's program at a third length prints
  the same graph and plan as a compile at that length, and computes the same outputs;
- two sizes' programs are not one program, and `family` says why, where a kernel reads the
  cache, or a node keeps a size in its parameters (a slice to the cache's end, a reshape of the
  cache);
- a size that would change a tensor outside the varying ones (a step of two tokens), or a varying
  one in a dim that did not vary between the compiles (another head count, another rank), is
  not made; two programs of one size are no family;
- over drawn decode steps (heads, grouped-query attention through enable_gqa or a repeat, head
  width, the cache appended along its last dim or its third, what else reads the cache): where
  a kernel reads the grown cache there is no family, and otherwise the family's program at a
  third length prints and computes as the compile at that length;
- `Symbolic.sized_op` names an op that takes a size as an argument, and is "" for a graph whose
  sizes are only its tensors' shapes;
- through the torch.compile backend, a decode step called at many cache lengths compiles two and
  makes the rest with no compile, each result eager's; made sizes have a limit of their own
  (MAX_MADE, not MAX_VARIANTS's), past which new sizes run in eager (said once) while the sizes
  made before still run in tilefuse;
  after an in-place update of a weight, sizes compile again and later ones are made from the
  program of the new weights.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tilefuse
from tilefuse.frontend import backend as tb
from tilefuse.frontend.capture import export
from tilefuse.frontend.sizes import Symbolic
from tilefuse.graph import ir
from tilefuse.runtime import resize


class Decode(nn.Module):
    """One token against a key/value cache; `extra` adds what stops a family."""

    def __init__(self, extra: str = ""):
        super().__init__()
        self.norm, self.qkv, self.out = nn.RMSNorm(16), nn.Linear(16, 48, bias=False), nn.Linear(16, 16)
        self.extra = extra

    def forward(self, x, k_cache, v_cache):
        q, k, v = self.qkv(self.norm(x)).view(1, 1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
        a = F.scaled_dot_product_attention(q, k, v)
        y = x + self.out(a.transpose(1, 2).reshape(1, 1, 16))
        if self.extra == "kernel":
            return y, k * 2.0, v
        if self.extra == "slice":
            return y, k[:, :, 1:], v
        if self.extra == "reshape":
            return y, k.reshape(1, 2, -1), v
        return y, k, v


def _inputs(length: int, tokens: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, tokens, 16, generator=g), torch.randn(1, 2, length, 8, generator=g),
            torch.randn(1, 2, length, 8, generator=g))


def _model(extra: str = "") -> Decode:
    torch.manual_seed(0)
    return Decode(extra).eval()


def _family(m, lengths=(5, 6)):
    p0, p1 = (tilefuse.compile(m, _inputs(n)) for n in lengths)
    return resize.family(p0, p1)


def test_the_family_program_at_a_new_length_is_the_compile_at_that_length():
    m = _model()
    fam = _family(m)
    assert isinstance(fam, resize.Family), fam
    for length in (1, 9, 40):
        xs = _inputs(length, seed=length)
        made = fam.at([tuple(x.shape) for x in xs])
        assert made is not None
        fresh = tilefuse.compile(m, xs)
        assert str(made.graph) == str(fresh.graph)
        assert str(made.plan) == str(fresh.plan)  # the externs' bytes and FLOPs at the new length too
        with torch.no_grad():
            want = m(*xs)
        for got, ref, exact in zip(made(*xs), fresh(*xs), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the same steps on the same values
            torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-5)


def test_the_cache_and_what_appends_to_it_vary_nothing_else():
    fam = _family(_model())
    g = fam.program.graph
    cats = {n.name for n in g.nodes if isinstance(n, ir.Extern) and "cat" in n.target}
    assert len(cats) == 2
    assert set(fam.varying) == {g.inputs[1], g.inputs[2]} | cats
    assert all(dims == {2} for dims in fam.varying.values())  # the length, no other dim


@pytest.mark.parametrize("extra, why", [
    ("kernel", "kernel"),                 # a map over the grown cache: its kernel's code has the length in it
    ("slice", "beyond its shape"),        # the slice's end is the length
    ("reshape", "beyond its shape"),      # a reshape keeps its target shape in its parameters
])
def test_no_family_where_the_sizes_reach_more_than_externs(extra, why):
    fam = _family(_model(extra))
    assert isinstance(fam, str) and why in fam, fam


def test_no_family_where_a_value_folded_from_the_sizes_is_a_weight():
    """An extern reducing a constant over a varying dim folds to a constant weight: the fuzzing
    finding was a nansum of ones, [4.] at one size and [9.] at another, which gave 4. at length
    6 under the backend; nansum and prod are lowered since, so here a running log-sum-exp of
    twos (aten.logcumsumexp, still an extern), 2 + log n at each length n. The programs differ
    in that value, so no third size may share either's."""
    def f(b):
        return torch.logcumsumexp(torch.ones_like(b) * 2, -1)[-1:] * 3

    p0, p1 = (tilefuse.compile(f, [torch.randn(n)]) for n in (4, 9))
    fam = resize.family(p0, p1)
    assert isinstance(fam, str) and "another value at each size" in fam, fam
    torch._dynamo.reset()
    g = torch.compile(f, backend=tb.tilefuse_backend)
    for n in (4, 9, 6, 4, 7):
        x = torch.randn(n)
        assert torch.allclose(g(x), f(x)), n


def test_a_size_that_changes_a_fixed_tensor_is_not_made():
    fam = _family(_model())
    assert fam.at([tuple(x.shape) for x in _inputs(7, tokens=2)]) is None  # the token, not only the cache
    assert fam.at([(1, 1, 16), (1, 2, 7, 8)]) is None  # an input missing


def test_sized_op_names_an_op_that_takes_a_size():
    class Sized(nn.Module):
        def forward(self, x):
            return x.view(x.shape[0] * 2, -1) + 1, torch.arange(x.shape[0])

    class Shapes(nn.Module):
        def forward(self, x, c):
            return torch.cat([c, x], 0) * 2

    sized = Symbolic(export(Sized(), (torch.randn(4, 6),), dynamic_shapes=({0: Dim.AUTO},)))
    assert sized.why_not == "" and sized.sized_op != ""
    plain = Symbolic(export(Shapes(), (torch.randn(1, 6), torch.randn(5, 6)), dynamic_shapes=(None, {0: Dim.AUTO})))
    assert plain.why_not == "" and plain.sized_op == ""


def test_piecewise_names_a_size_two_compiles_cannot_show():
    """A diagonal's length is Min(7, s0): equal at s0 = 7 and 10, so two compiled sizes cannot
    tell a program made from them that it is 5 at s0 = 5; a polynomial size (a reshape's 7 s0)
    can be told."""

    class Diagonal(nn.Module):
        def forward(self, b):
            return torch.cat([torch.ones_like(b.diagonal())] * 2, 0)

    class Flat(nn.Module):
        def forward(self, b):
            return b.reshape(-1) * 2

    d = Symbolic(export(Diagonal(), (torch.randn(7, 7),), dynamic_shapes=({0: Dim.AUTO},)))
    assert d.why_not == "" and d.sized_op == "" and "Min(" in d.piecewise
    f = Symbolic(export(Flat(), (torch.randn(7, 7),), dynamic_shapes=({0: Dim.AUTO},)))
    assert f.why_not == "" and f.piecewise == ""


@pytest.mark.usefixtures("fresh_backend")
def test_a_piecewise_size_makes_no_family_so_a_third_size_is_right():
    """The fuzzer's case (seed 6106035): through the backend at (5, 7), then (7, 7) and
    (10, 7) (dynamo's symbolic graph, compiled at each), then (5, 7) again: eager's shapes and
    values at every size; no size made from the other two."""

    def f(a, b):
        return torch.cat([torch.ones_like(b.diagonal())] * 2, 0) + a.sum()

    step = torch.compile(f, backend="tilefuse")
    with torch.no_grad():
        for rows in (5, 7, 10, 5):
            a, b = torch.randn(1, 1, rows, 1), torch.randn(rows, 7)
            got, want = step(a, b), f(a, b)
            assert got.shape == want.shape, (rows, got.shape, want.shape)
            torch.testing.assert_close(got, want)
    assert all(r.resized == 0 for r in tb.reports()), tb.summary()
    assert any("piecewise" in e for r in tb.reports() for e in r.events), [r.events for r in tb.reports()]


def _decode_calls(m, lengths):
    """The step compiled with the tilefuse backend, called at each cache length; its results and eager's."""
    step = torch.compile(m, backend="tilefuse")
    out = []
    with torch.no_grad():
        for n in lengths:
            xs = _inputs(n, seed=n)
            out.append((step(*xs), m(*xs)))
    return out


@pytest.mark.usefixtures("fresh_backend")
def test_backend_makes_later_cache_lengths_with_no_compile():
    m = _model()
    lengths = list(range(4, 16))
    for got, want in _decode_calls(m, lengths):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    dynamic = [r for r in tb.reports() if r.variants > 1]
    assert len(dynamic) == 1, tb.summary()
    r = dynamic[0]
    assert r.calls_eager == 0 and r.status == "tilefuse", tb.summary()
    # dynamo's first graph takes the first length; its dynamic graph compiles the next two and makes the rest
    assert r.variants == len(lengths) - 1 and r.resized == len(lengths) - 3, tb.summary()
    assert any("no compile" in e for e in r.events), r.events
    assert "resized with no compile" in tb.summary()


@pytest.mark.usefixtures("fresh_backend")
def test_made_lengths_do_not_count_against_the_compiled_limit(monkeypatch):
    """MAX_VARIANTS bounds compiles; sizes made with no compile share the family's kernels and
    weights, so a generation longer than it stays in tilefuse."""
    monkeypatch.setattr(tb, "MAX_VARIANTS", 4)
    m = _model()
    lengths = list(range(4, 14))  # 4 alone; the dynamic graph: 2 compiled, 7 made
    for got, want in _decode_calls(m, lengths):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    r = next(r for r in tb.reports() if r.variants > 1)
    assert (r.variants, r.resized) == (9, 7) and r.calls_eager == 0, tb.summary()
    assert not any("new ones run in eager" in e for e in r.events), r.events


@pytest.mark.usefixtures("fresh_backend")
def test_past_the_made_limit_new_lengths_run_in_eager_and_made_ones_stay(monkeypatch):
    monkeypatch.setattr(tb, "MAX_MADE", 2)
    m = _model()
    lengths = list(range(4, 11)) + [7, 8]  # 4 alone; the dynamic graph: 2 compiled, 2 made, 2 past them, 2 made before
    for got, want in _decode_calls(m, lengths):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    r = next(r for r in tb.reports() if r.variants > 1)
    assert (r.variants, r.resized) == (4, 2), tb.summary()
    assert r.calls_eager == 2 and r.calls_tilefuse == 6, tb.summary()
    assert sum("more than 2 sizes made with no compile" in e for e in r.events) == 1, r.events


def _past_two_made(monkeypatch, lengths):
    """The decode model and its compiled step, called at `lengths` with MAX_MADE at 2, and the
    dynamic graph's report."""
    monkeypatch.setattr(tb, "MAX_MADE", 2)
    m = _model()
    step = torch.compile(m, backend="tilefuse")
    with torch.no_grad():
        for n in lengths:
            step(*_inputs(n, seed=n))
    return m, step, next(r for r in tb.reports() if r.variants > 1)


@pytest.mark.usefixtures("fresh_backend")
def test_past_the_made_limit_sizes_compile_again_after_a_weight_update(monkeypatch):
    """MAX_MADE bounds only sizes the family would make: after an in-place weight update (the
    old values' programs, made sizes too, are dropped) sizes compile as before, and are made
    again, with eager's results (a review found every such call sent to eager)."""
    m, step, r = _past_two_made(monkeypatch, range(4, 10))
    eager = r.calls_eager
    assert eager == 1, tb.summary()  # (9: 5 and 6 compiled, 7 and 8 made)
    with torch.no_grad():
        m.out.bias.add_(1.0)
        for n in (6, 7, 6, 7):
            xs = _inputs(n, seed=n)
            torch.testing.assert_close(step(*xs), m(*xs), rtol=1e-4, atol=1e-5)
    assert r.calls_eager == eager, r.events
    assert sum("changed in place" in e for e in r.events) == 1, r.events


@pytest.mark.usefixtures("fresh_backend")
def test_past_the_made_limit_new_sizes_after_a_weight_update_are_made_from_the_new_weights(monkeypatch):
    """A weight update followed by new sizes only (a second review): the stale family and the
    sizes made from it go, so new sizes compile, form a new family and are made again."""
    m, step, r = _past_two_made(monkeypatch, range(4, 9))
    eager, resized = r.calls_eager, r.resized
    with torch.no_grad():
        m.out.bias.add_(1.0)
        for n in (10, 11, 12):  # 10 compiles (a family with the last size), 11 and 12 are made
            xs = _inputs(n, seed=n)
            torch.testing.assert_close(step(*xs), m(*xs), rtol=1e-4, atol=1e-5)
    assert r.calls_eager == eager and r.resized == resized + 2, r.events


def test_a_dim_that_did_not_vary_between_the_compiles_is_not_made():
    fam = _family(_model())
    x, k, v = _inputs(9)
    assert fam.at([x.shape, (1, 2, 9, 8), (1, 2, 9, 8)]) is not None
    assert fam.at([x.shape, (1, 3, 9, 8), (1, 3, 9, 8)]) is None  # a head count never compiled
    assert fam.at([x.shape, (1, 2, 9, 8, 1), (1, 2, 9, 8, 1)]) is None  # another rank


def test_two_programs_of_one_size_are_no_family():
    m = _model()
    xs = _inputs(5)
    assert resize.family(tilefuse.compile(m, xs), tilefuse.compile(m, xs)) == "the two programs have the same shapes"


@pytest.mark.usefixtures("fresh_backend")
def test_after_an_in_place_weight_update_new_lengths_are_made_from_the_new_weights():
    m = _model()
    step = torch.compile(m, backend="tilefuse")

    def check(lengths):
        with torch.no_grad():
            for n in lengths:
                xs = _inputs(n, seed=n)
                for a, b in zip(step(*xs), m(*xs)):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    check(range(4, 9))  # 4 alone; 5 and 6 compiled, 7 and 8 made
    r = next(r for r in tb.reports() if r.variants > 1)
    assert r.resized == 2, tb.summary()
    with torch.no_grad():
        m.out.weight.mul_(2.0)
    check([6, 9, 10, 11])  # 6 and 9 compile again with the new weights, 10 and 11 are made from them
    assert r.resized == 4 and r.calls_eager == 0, tb.summary()


class Drawn(nn.Module):
    """A decode step of drawn heads, kv heads (grouped-query through enable_gqa or a repeat),
    head width, cache dim order, and what else reads the grown cache."""

    def __init__(self, heads, kv, width, gqa_repeat, seq_last, extra):
        super().__init__()
        self.h, self.kv, self.w, self.rep, self.seq_last, self.extra = heads, kv, width, gqa_repeat, seq_last, extra
        d = heads * width
        self.d = d
        self.norm = nn.RMSNorm(d)
        self.q, self.k, self.v = (nn.Linear(d, n * width, bias=False) for n in (heads, kv, kv))
        self.out = nn.Linear(d, d)

    def forward(self, x, k_cache, v_cache):
        h = self.norm(x)
        q = self.q(h).view(1, 1, self.h, self.w).transpose(1, 2)
        k = self.k(h).view(1, 1, self.kv, self.w).transpose(1, 2)
        v = self.v(h).view(1, 1, self.kv, self.w).transpose(1, 2)
        if self.seq_last:  # the cache stored [b, kv, w, seq]: appended along the last dim
            k, v = torch.cat([k_cache, k.transpose(2, 3)], 3), torch.cat([v_cache, v.transpose(2, 3)], 3)
            ka, va = k.transpose(2, 3), v.transpose(2, 3)
        else:
            k, v = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
            ka, va = k, v
        if self.rep and self.kv != self.h:
            ka, va = (t.repeat_interleave(self.h // self.kv, 1) for t in (ka, va))
        a = F.scaled_dot_product_attention(q, ka, va, enable_gqa=not self.rep and self.kv != self.h)
        y = x + self.out(a.transpose(1, 2).reshape(1, 1, self.d))
        if self.extra == "scaled":
            return y, k * 0.5, v
        if self.extra == "sum":
            return y, k, v, k.float().sum()
        return y, k, v

    def inputs(self, length, seed):
        g = torch.Generator().manual_seed(seed)
        cache = (1, self.kv, self.w, length) if self.seq_last else (1, self.kv, length, self.w)
        return (torch.randn(1, 1, self.d, generator=g), torch.randn(*cache, generator=g),
                torch.randn(*cache, generator=g))


@settings(max_examples=12, deadline=None)
@given(heads_kv=st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]), width=st.sampled_from([4, 8]),
       gqa_repeat=st.booleans(), seq_last=st.booleans(), extra=st.sampled_from(["", "", "scaled", "sum"]),
       lengths=st.lists(st.integers(2, 24), min_size=3, max_size=3, unique=True))
def test_where_two_lengths_make_a_family_a_third_is_its_compile(heads_kv, width, gqa_repeat, seq_last, extra, lengths):
    torch.manual_seed(0)
    m = Drawn(*heads_kv, width, gqa_repeat, seq_last, extra).eval()
    a, b, c = (m.inputs(n, seed=n) for n in lengths)
    fam = resize.family(tilefuse.compile(m, a), tilefuse.compile(m, b))
    if extra:  # a kernel reads the grown cache (its code has the length in it), or a reshape of it
        assert isinstance(fam, str), "a family where a kernel reads the grown cache"
        return
    assert isinstance(fam, resize.Family), fam  # only externs see the length change
    made = fam.at([tuple(x.shape) for x in c])
    assert made is not None
    fresh = tilefuse.compile(m, c)
    assert (str(made.graph), str(made.plan)) == (str(fresh.graph), str(fresh.plan))
    with torch.no_grad():
        want = m(*c)
    for got, ref, exact in zip(made(*c), fresh(*c), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-5)

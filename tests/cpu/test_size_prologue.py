"""Tensors a graph builds from its sizes alone are made in PyTorch before the program
(frontend/size_prologue.py), so a decode step whose mask is built from the cache's length (as
transformers does under torch 2.11, and OPT and Gemma2 on any torch) makes its later sizes
with no compile, with eager's results; a square mask (prefill) stays in the program, where it
becomes attention's is_causal; a tensor computed from a tensor's values never moves."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from tilefuse.frontend import backend as tb
from tilefuse.frontend.size_prologue import split

pytestmark = pytest.mark.usefixtures("fresh_backend")


def _step(q, cache, k):
    """A decode step's attention over a growing cache, with a mask built from its length."""
    keys = torch.cat([cache, k], dim=2)
    s = cache.shape[2]
    q_pos = torch.arange(1) + s
    kv_pos = torch.arange(s + 1)
    mask = (kv_pos[None, None, None, :] <= q_pos[None, None, :, None]).expand(1, -1, 1, s + 1)
    return F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask), keys


def _decode_like_eager(step, lengths, padded: bool = False):
    """`step` compiled by tilefuse, called at each cache length on random q, k and cache (and,
    `padded`, an attention mask with a left pad): eager's attention and cache each time."""
    cf = torch.compile(step, backend="tilefuse")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for s in lengths:
            q, k = torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen)
            args = [q, torch.randn(1, 2, s, 8, generator=gen), k]
            if padded:
                args.append(torch.ones(1, s + 1, dtype=torch.long))
                args[-1][0, 0] = 0  # a left pad
            got, want = cf(*args), step(*args)
            torch.testing.assert_close(got[0], want[0])
            assert torch.equal(got[1], want[1])


def test_a_mask_built_from_the_cache_length_runs_before_the_program_and_later_sizes_need_no_compile():
    _decode_like_eager(_step, range(3, 12))
    r = max(tb.reports(), key=lambda r: r.variants)
    assert r.status == "tilefuse" and r.calls_eager == 0, tb.summary()
    assert any("made from sizes alone" in e for e in r.events), tb.summary()
    assert r.resized >= r.variants - 2 > 0, tb.summary()  # past the two compiled sizes, none compiled


def _step_padded(q, cache, k, attention_mask):
    """transformers 5.17's decode step on any torch: the causal part from the cache's length
    (`ones(()) & (kv <= q)`), and'ed with `generate`'s attention mask gathered at the keys'
    positions and cast to bool, a tensor whose length follows the cache's."""
    keys = torch.cat([cache, k], dim=2)
    s = cache.shape[2]
    kv_pos = torch.arange(s + 1)[None, None, None, :]
    causal = torch.ones((), dtype=torch.bool) & (kv_pos <= (torch.arange(1) + s)[None, None, :, None])
    padding = attention_mask.to(torch.bool)[torch.arange(1)[:, None, None, None], kv_pos]
    mask = (causal & padding).expand(1, -1, 1, s + 1)
    return F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask), keys


def test_a_causal_mask_anded_with_the_padding_mask_moves_and_only_the_and_runs_in_pytorch():
    """The causal part moves to the prologue (`a & b` is no in-place write: a first version took
    `operator.and_` for one and kept it). The and with the padding mask, whose length changes,
    runs in PyTorch from the third size on; past the four compiled sizes, none compiles, and a
    padded position stays masked."""
    _decode_like_eager(_step_padded, range(3, 14), padded=True)
    r = max(tb.reports(), key=lambda r: r.variants)
    assert r.status == "tilefuse" and r.calls_eager == 0, tb.summary()
    assert any("made from sizes alone" in e for e in r.events), tb.summary()
    assert any("runs in PyTorch from the next size on" in e for e in r.events), tb.summary()
    assert r.resized >= r.variants - 4 > 0, tb.summary()


def test_an_and_of_two_size_made_tensors_moves_to_the_prologue():
    """`operator.and_` (Python's `&`) writes nothing, so a tensor made with it from sizes alone
    moves, as one made with `<=` does."""
    def f(x, n):
        inside = (torch.arange(n) >= 1) & (torch.arange(n) < n - 1)
        return x * inside

    gm, kinds = _graph(f, torch.randn(6), 6)
    sp = split(gm, kinds)
    assert sp is not None and len(sp.names) == 1, gm.code
    assert any(n.target is operator.and_ for n in sp.prologue.graph.nodes), sp.prologue.code
    for n in (6, 9):
        x = torch.randn(n)
        args = [x if k == "input" else n for k in kinds]
        assert torch.equal(sp.main(*args, *sp.prologue(*args))[0], f(x, n))


def _graph(fn, *args):
    """fn's dynamo graph with its sizes dynamic, and the kinds the backend gives its inputs."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, ["int" if not isinstance(a, torch.Tensor) else "input" for a in example_inputs]))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, dynamic=True)(*args)
    torch._dynamo.reset()
    return graphs[-1]


def test_the_split_moves_only_what_is_made_from_sizes_and_keeps_what_reads_values():
    """`(arange(n + 1) * 2).sum()` and `arange(n)[0]` move (sizes alone made them); the ops
    reading x's values stay; the prologue and the rest compute what the graph did."""
    def f(x, n):
        a = torch.arange(n + 1) * 2
        return x + a.sum(), x * 3 + torch.arange(n)[0]

    x = torch.arange(10.0)
    gm, kinds = _graph(f, x, 4)
    sp = split(gm, kinds)
    assert sp is not None and len(sp.names) == 2, (gm.code, sp and sp.names)
    moved = [n.target for n in sp.prologue.graph.nodes if n.op == "call_function"]
    assert moved.count(torch.arange) == 2, sp.prologue.code
    kept = [n.target for n in sp.main.graph.nodes if n.op == "call_function"]
    assert torch.arange not in kept and any("mul" in str(t) for t in kept), sp.main.code
    for n in (4, 7, 1):
        args = [x if k == "input" else n for k in kinds]
        extra = sp.prologue(*args)
        assert torch.equal(extra[0], (torch.arange(n + 1) * 2).sum())
        got, want = sp.main(*args, *extra), f(x, n)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (n, got, want)


def test_a_square_mask_stays_in_the_program_so_prefill_attention_stays_causal():
    """A mask of two varying dims (q and kv of a prefill step) is not moved: the rewrite to
    is_causal reads how it was built."""
    def prefill(q, k):
        s = q.shape[2]
        i = torch.arange(s)
        mask = i[None, None, None, :] <= i[None, None, :, None]
        return F.scaled_dot_product_attention(q, k, k, attn_mask=mask)

    q = torch.randn(1, 2, 6, 8)
    gm, kinds = _graph(prefill, q, torch.randn(1, 2, 6, 8))
    assert "int" in kinds, gm.code
    assert split(gm, kinds) is None, gm.code


def test_a_graph_whose_other_ops_take_sizes_is_left_whole():
    """A view to a varying shape compiles each size anyway: nothing moves there. (n is no dim of
    x here: a view that only restates its input's dims, `x.view(x.shape[0], -1)`, takes no size
    of the call's own.)"""
    def f(x, n):
        return x.view(n, -1) + torch.arange(n)[:, None]

    gm, kinds = _graph(f, torch.randn(4, 6), 2)
    assert "int" in kinds, gm.code
    assert split(gm, kinds) is None, gm.code


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
def test_llama_generate_with_torch_211s_in_graph_mask_makes_decode_sizes_with_no_compile(monkeypatch, kv_heads):
    """transformers under torch 2.11 (is_torchdynamo_exporting() True while dynamo traces) builds
    each decode step's all-true causal mask from the cache's length in the graph. Emulated here:
    the compiled model generates eager's tokens, its decode sizes past the first two are made
    with no compile, and every prefill attention stays is_causal (the square mask stays). With
    grouped-query attention and a mask, transformers repeats the cache's heads
    (`expand(1, 1, 2, s0 + 1, d)`, a view restating the cache's own length): no size of its own."""
    transformers = pytest.importorskip("transformers")
    import transformers.masking_utils as masking

    from tilefuse.models import hf

    monkeypatch.setattr(masking, "is_torchdynamo_exporting", lambda: True)
    cfg = hf.config("llama", 1, 32, seq=64, vocab=128, heads=2, kv_heads=kv_heads, ffn=96)
    cfg.use_cache = True
    torch.manual_seed(0)
    model = hf.causal_lm(cfg).float().eval()
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    prompts = [torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 9, 15)]
    runners = []

    def backend(gm, example_inputs, **kw):
        runners.append(tb.tilefuse_backend(gm, example_inputs, **kw))
        return runners[-1]

    with torch.no_grad():
        want = [model.generate(p, **gen) for p in prompts]
        model.forward = torch.compile(model.forward, backend=backend)
        got = [model.generate(p, **gen) for p in prompts]
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)
    assert all(r.report.status == "tilefuse" and not r.report.calls_eager for r in runners), tb.summary()
    decode = max(runners, key=lambda r: r.report.calls_tilefuse)
    assert any("made from sizes alone" in e for e in decode.report.events), tb.summary()
    assert decode.report.resized >= decode.report.variants - 2 > 0, tb.summary()
    prefills = 0
    for r in runners:
        for v in r.variants.values():
            attention = [n for n in v.program.graph.nodes if type(n).__name__ == "Attention"]
            if v.program.graph[v.program.graph.inputs[0]].type.shape[-1] > 1:  # more than one token: prefill
                prefills += 1
                assert attention and all(a.causal for a in attention), (r.report.index, attention)
    assert prefills >= 3, tb.summary()


def _same_as_eager(fn, calls, check=None):
    """fn compiled by tilefuse gives eager's results (and, with `check`, leaves what eager leaves)
    on each of `calls` (argument makers)."""
    cf = torch.compile(fn, backend="tilefuse")
    with torch.no_grad():
        for make in calls:
            e_args, c_args = make(), make()
            torch.manual_seed(0)
            want = fn(*e_args)
            torch.manual_seed(0)
            got = cf(*c_args)
            want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w)
            for a, b in zip(e_args, c_args):
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a, b), (a, b)  # what the call wrote into its arguments


@pytest.mark.parametrize("case", ["fill", "scale", "view_then_write", "through_an_alias", "operator_iadd"])
def test_a_tensor_written_in_place_stays_with_all_that_may_share_its_memory(case):
    """A tensor made from sizes that an op then writes (`torch.empty(n).fill_(2)`) is not moved,
    nor anything made from it or that it is made from: a moved reader would run before the write
    (a review found each of these reading uninitialised or unscaled memory)."""
    def fill(x, n):
        e = torch.empty(n)
        e.fill_(2.0)
        return x + e.sum()

    def scale(x, n):
        m = torch.ones(n)
        m.mul_(x.sum())
        return m.cumsum(0) + x[0], m * 2

    def view_then_write(x, n):
        a = torch.zeros(n)
        v = a[:1]
        a.add_(x.sum())
        return v * 2 + x

    def through_an_alias(x, n):  # `.to(y)` of the same dtype returns m itself (a review found it)
        m = torch.ones(n)
        y = x[:n]
        m.to(y).add_(y)
        return m + y * 0, m * 2

    def operator_iadd(x, n):
        m = torch.arange(n)
        operator.iadd(m, 2)
        return x[:n] + m

    fn = {"fill": fill, "scale": scale, "view_then_write": view_then_write, "through_an_alias": through_an_alias,
          "operator_iadd": operator_iadd}[case]
    # (repeated sizes: a reused prologue tensor written by a call would show at the repeat)
    _same_as_eager(fn, [lambda n=n: (torch.arange(8.0) + 1, n) for n in (3, 4, 5, 6, 4, 5)])


@pytest.mark.parametrize("inplace", [False, True])
def test_random_ops_never_move_to_the_prologue(inplace):
    """A random op made from sizes alone (`F.dropout(ones(n), training=True)`, which FX does not
    mark impure) stays in the graph: moved, its draws would be reused (the prologue's tensors
    are kept per size) or reordered. What it reads may move, unless it writes that in place."""
    def f(x, n):
        return x[:n] * F.dropout(torch.ones(n), 0.5, True, inplace)

    gm, kinds = _graph(f, torch.ones(64), 40)
    sp = split(gm, kinds)
    moved = [] if sp is None else [getattr(n.target, "__name__", n.target) for n in sp.prologue.graph.nodes
                                   if n.op == "call_function"]
    assert "dropout" not in moved and (moved == [] if inplace else moved == ["ones"]), moved
    cf = torch.compile(f, backend="tilefuse", dynamic=True)
    x = torch.ones(64)
    with torch.no_grad():
        outs = [cf(x, 40) for _ in range(4)]
    assert len({tuple(o.tolist()) for o in outs}) == 4  # a fresh mask each call, as in eager


def test_deterministic_ops_with_random_sounding_names_still_move():
    """`F.normalize` and dropout with training off are no draws: a mask beside them moves."""
    def f(x, n):
        pos = torch.arange(x.shape[0], dtype=torch.float32) + n
        m = (pos <= 2 * n).to(x.dtype)
        return x * m + F.normalize(pos, dim=0) + F.dropout(pos, 0.1, training=False)

    gm, kinds = _graph(f, torch.randn(8), 3)
    sp = split(gm, kinds)
    assert sp is not None and "m" in sp.names, gm.code


def test_the_prologue_reads_inputs_shapes_only_so_effects_run_once():
    """A size of a tensor the graph computes (`nonzero` of a written input) is no size the
    prologue may read: it would run what made that tensor (the write, the RNG draw) again."""
    def inc(x, n):
        y = torch.nonzero(x.add_(1) > 2)
        return torch.arange(y.shape[0] + n).float().sum() + x

    def rng(x, n):
        r = torch.rand(8)
        y = torch.nonzero(r > 0.5)
        return torch.arange(y.shape[0] + n).float().sum() + x, r

    old = torch._dynamo.config.capture_dynamic_output_shape_ops
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    try:
        for fn in (inc, rng):
            tb.reset()
            torch._dynamo.reset()
            _same_as_eager(fn, [lambda n=n: (torch.arange(4.0) + 1, n) for n in (3, 4, 5, 6)])
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = old


def test_a_strided_tensor_made_from_sizes_reaches_the_program_contiguous():
    """`arange(2 * s)[::2]`: given to the program as is, its strides became sizes of their own to
    torch.export that nothing bound, and the graph was refused for good; it is passed
    contiguous, and every call runs in tilefuse."""
    def f(x):
        s = x.shape[1]
        m = torch.arange(2 * s).float()[::2]
        return (x + m).exp()

    _same_as_eager(f, [lambda n=n: (torch.randn(3, n, generator=torch.Generator().manual_seed(n)),)
                       for n in (3, 4, 5, 6, 7)])
    assert all(r.status == "tilefuse" and not r.calls_eager for r in tb.reports()), tb.summary()


def test_a_written_tensor_and_its_view_stay_so_every_call_runs_in_tilefuse():
    """`m` and `m[None]` (one memory) both moved became two inputs sharing memory, one written by
    the program, and every call ran in eager; kept in the graph, every call runs in tilefuse."""
    def f(x, n):
        m = torch.ones(n)
        m.mul_(x.sum())
        return x[:, None] * m[None, :]

    _same_as_eager(f, [lambda n=n: (torch.arange(4.0) + 1, n) for n in (3, 4, 5, 6, 7)])
    assert all(r.status == "tilefuse" and not r.calls_eager for r in tb.reports()), tb.summary()


def test_the_prologue_runs_once_per_sizes_and_its_tensors_serve_every_later_call():
    """Its results depend on the sizes alone: a second call at the same cache length reuses
    them (no prologue run), with eager's results still."""
    runners = []

    def backend(gm, example_inputs, **kw):
        runners.append(tb.tilefuse_backend(gm, example_inputs, **kw))
        return runners[-1]

    cf = torch.compile(_step, backend=backend)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for s in (3, 4, 5, 6, 5, 6, 6):
            q, k = torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen)
            cache = torch.randn(1, 2, s, 8, generator=gen)
            got, want = cf(q, cache, k), _step(q, cache, k)
            torch.testing.assert_close(got[0], want[0])
    (runner,) = [r for r in runners if r.prologue is not None]
    assert runner.prologue_reads is not None
    assert len(runner.prologue_made) == 3, runner.prologue_made.keys()  # 4, 5, 6 (3 went to dynamo's static graph)
    calls = []
    inner = runner.prologue
    runner.prologue = lambda *a: calls.append(1) or inner(*a)
    with torch.no_grad():
        q, k, cache = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
        torch.testing.assert_close(cf(q, cache, k)[0], _step(q, cache, k)[0])
        assert not calls
        cache = torch.randn(1, 2, 9, 8)
        torch.testing.assert_close(cf(q, cache, k)[0], _step(q, cache, k)[0])
        assert len(calls) == 1


def test_a_prologue_tensor_the_graph_returns_is_made_each_call():
    """A graph returning a tensor made from sizes (or a view of one) hands it to the caller, who
    may write into it: that prologue's results are not reused."""
    def f(x, n):
        m = torch.arange(n) * 2
        return x[:n] + m, m.view(1, -1)

    gm, kinds = _graph(f, torch.randn(8), 4)
    sp = split(gm, kinds)
    assert sp is not None and not sp.reusable, gm.code
    cf = torch.compile(f, backend="tilefuse", dynamic=True)
    x = torch.randn(8)
    with torch.no_grad():
        first = cf(x, 4)[1]
        first.fill_(-1)  # the caller writes into what it was given
        for n in (4, 5, 4):
            got = cf(x, n)
            assert torch.equal(got[0], f(x, n)[0]) and torch.equal(got[1], f(x, n)[1]), (n, got)


def test_an_int_value_the_prologue_reads_is_part_of_the_key():
    """An int the prologue reads besides the sizes (`arange(c, n + c)`) keys its results by its
    value: the same n with another c is made again, never served another c's tensor."""
    runners = []

    def backend(gm, example_inputs, **kw):
        runners.append(tb.tilefuse_backend(gm, example_inputs, **kw))
        return runners[-1]

    def f(x, n, c):
        return x[:n] + torch.arange(c, n + c)

    cf = torch.compile(f, backend=backend, dynamic=True)
    x = torch.randn(8)
    with torch.no_grad():
        for n, c in ((4, 2), (5, 2), (4, 3), (5, 3), (4, 2)):
            assert torch.equal(cf(x, n, c), f(x, n, c)), (n, c)
    (r,) = [r for r in runners if r.prologue is not None]
    assert r.prologue_reads is not None and len(r.prologue_made) == 4, r.prologue_made.keys()

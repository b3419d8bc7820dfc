"""A program's first call at its sizes runs attention where no per-shape plan is built (flash
or memory-efficient attention: program._planless_attention, under graphs.FIRST_CALL), masked
attention too where every query row keeps a key; later calls, captured and replayed, and a mask
with a row of no keys run PyTorch's default. Every call's result passes DESIGN.md's 2x rule
against a float64 reference; a case neither planless backend takes runs the default."""
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.graph import ir
from tilefuse.runtime import graphs, program

pytestmark = pytest.mark.gpu


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _masked(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in p.events() if e.device_type.name == "CUDA"}


@pytest.mark.parametrize("case", ["causal_prefill", "masked_decode", "float_masked_prefill", "gqa_decode"])
def test_first_call_builds_no_plan_and_every_call_is_right(case):
    t = torch.bfloat16
    if case == "causal_prefill":
        fn, x = _causal, [torch.randn(1, 8, 300, 64, device="cuda", dtype=t) for _ in range(3)]
    elif case == "masked_decode":
        q = torch.randn(2, 8, 1, 64, device="cuda", dtype=t)
        kv = [torch.randn(2, 8, 517, 64, device="cuda", dtype=t) for _ in range(2)]
        fn, x = _masked, [q, *kv, torch.rand(2, 1, 1, 517, device="cuda") > 0.3]
    elif case == "float_masked_prefill":  # an additive causal mask, as transformers builds one
        x = [torch.randn(1, 8, 300, 64, device="cuda", dtype=t) for _ in range(3)]
        m = torch.full((300, 300), float("-inf"), device="cuda", dtype=t).triu(1)
        fn, x = _masked, [*x, m[None, None]]
    else:
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        x = [torch.randn(1, 8, 1, 128, device="cuda", dtype=t), torch.randn(1, 2, 333, 128, device="cuda", dtype=t),
             torch.randn(1, 2, 333, 128, device="cuda", dtype=t)]
    prog = tilefuse.compile(fn, x, graphs=True)
    assert any(isinstance(n, ir.Attention) for n in prog.graph.nodes), prog.graph
    ref, eager = float64_reference(fn, x), fn(*x)
    out, names = _kernels(lambda: prog(*x))
    assert not any("cudnn" in n.lower() for n in names), names
    for i in range(4):  # the first, then the capture and replays
        c = compare(f"{case} call {i}", out, ref, eager)
        assert c.ok, c
        out = prog(*x)
    (info,) = prog.graph_info()
    assert info["replays"] >= 1, info


def test_a_mask_with_a_row_of_no_keys_runs_the_default_on_the_first_call(monkeypatch):
    """Where a query row keeps no key, the backend decides what the row gives: the first call
    runs PyTorch's default, as the replays do, and gives eager's result for that row."""
    calls = []
    real = program._planless_attention
    monkeypatch.setattr(program, "_planless_attention", lambda *a: calls.append(1) or real(*a))
    t = torch.bfloat16
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=t)
    k, v = (torch.randn(2, 8, 517, 64, device="cuda", dtype=t) for _ in range(2))
    m = torch.rand(2, 1, 1, 517, device="cuda") > 0.3
    m[1] = False  # batch item 1 keeps no key
    x = [q, k, v, m]
    prog = tilefuse.compile(_masked, x, graphs=True)
    out, eager = prog(*x), _masked(*x)
    assert calls == []
    torch.testing.assert_close(out[1], eager[1], equal_nan=True)
    c = compare("row with keys", out[:1], float64_reference(_masked, x)[:1], eager[:1])
    assert c.ok, c
    m[1] = True  # every row keeps a key: the planless path runs (a new program: the first call again)
    prog = tilefuse.compile(_masked, x, graphs=True)
    out = prog(*x)
    assert calls == [1]
    c = compare("all rows with keys", out, float64_reference(_masked, x), _masked(*x))
    assert c.ok, c


def test_attention_neither_planless_backend_takes_runs_the_default():
    """float64: neither flash nor memory-efficient attention takes it; the default (math) runs."""
    x = [torch.randn(1, 2, 5, 8, device="cuda", dtype=torch.float64) for _ in range(3)]
    assert program._planless_attention(tuple(x), dict(attn_mask=None, is_causal=True, scale=None,
                                                      enable_gqa=False)) is None
    token = graphs.FIRST_CALL.set(True)
    try:
        g = tilefuse.compile(_causal, x).graph
        (att,) = [n for n in g.nodes if isinstance(n, ir.Attention)]
        env = dict(zip(g.inputs, x))
        got = program.run_extern(att, lambda a: env[a])
    finally:
        graphs.FIRST_CALL.reset(token)
    torch.testing.assert_close(got, _causal(*x), rtol=0, atol=0)

"""The repeated_kv_into_attention rule: k and v repeated per query-head group (transformers'
repeat_kv) reach SDPA unrepeated, as grouped-query attention (query head h reads KV head
h // (H / Hkv)).

Each case checks through the Graph IR interpreter in float64 that the rewritten graph computes
the same function as before, and that the rule fires only for the head-major repeat (a tiled
repeat pairs heads differently and must stay)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda_fixtures import EXACT, capture, nodes_of, run
from tilefuse.check import rel_error
from tilefuse.compiler import compile_stages
from tilefuse.graph import ir
from tilefuse.graph.rules.gqa_attention import repeated_kv_into_attention

B, H, HKV, S, D = 2, 6, 2, 5, 8


def repeat_kv(x, n):
    """transformers' repeat_kv: each KV head n times in a row."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def repeat_tiled(x, n):
    """The whole set of KV heads n times over: head h reads KV head h % Hkv (not SDPA's pairing)."""
    b, h, s, d = x.shape
    return x[:, None].expand(b, n, h, s, d).reshape(b, h * n, s, d)


def _attn(repeat):
    def f(q, k, v):
        n = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat(k, n), repeat(v, n), is_causal=True)
    return f


def _qkv(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, S, D, generator=g, dtype=dtype) for h in (H, HKV, HKV)]


def test_repeated_kv_reaches_attention_unrepeated_and_the_function_is_unchanged():
    inputs = _qkv()
    g = capture(_Wrap(_attn(repeat_kv)), *inputs)
    g2 = repeated_kv_into_attention(g)
    (att,) = nodes_of(g2, ir.Attention)
    assert g2[att.k].type.shape == (B, HKV, S, D) and g2[att.v].type.shape == (B, HKV, S, D)
    assert not any(isinstance(n, ir.View) and n.op == "expand" for n in g2.nodes)
    err = rel_error(run(g2, inputs, "f64"), run(g, inputs, "f64"))
    assert err <= EXACT, err


def test_a_tiled_repeat_stays():
    """x[:, None].expand(...) pairs query head h with KV head h % Hkv: not grouped-query attention."""
    inputs = _qkv()
    g = capture(_Wrap(_attn(repeat_tiled)), *inputs)
    assert repeated_kv_into_attention(g) is g


def test_only_k_repeated_stays():
    """v arriving with all heads (not repeated) leaves the attention as it is."""
    q, k, _ = _qkv()
    v = torch.randn(B, H, S, D, dtype=torch.float64)
    g = capture(_Wrap(lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 3), v)), q, k, v)
    assert repeated_kv_into_attention(g) is g


def test_compiled_program_matches_pytorch():
    inputs = _qkv(torch.float32)
    fn = _attn(repeat_kv)
    c = compile_stages(_Wrap(fn), inputs)
    assert "repeated_kv_into_attention" in [f.rule for f in c.fired]
    torch.testing.assert_close(c.program(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)
    assert not any(s.family == "extern" and "expand" in s.note for s in c.plan.steps)


def test_sdpa_with_enable_gqa_is_captured_and_runs():
    """SDPA called with fewer KV heads and enable_gqa=True (no repeat at all) compiles too."""
    inputs = _qkv(torch.float32)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    c = compile_stages(_Wrap(fn), inputs)
    torch.testing.assert_close(c.program(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.program(*inputs), _attn(repeat_kv)(*inputs), atol=1e-5, rtol=1e-5)


def test_llama_block_with_fewer_kv_heads():
    """tilefuse's own Llama block repeats its KV heads the same way; after the rule its output
    is unchanged (float64, interpreter)."""
    from tilefuse import models

    torch.manual_seed(0)
    m = models.llama_block(48, 64, 6, 2, max_seq=16).double().eval()
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    g = capture(m, x)
    g2 = repeated_kv_into_attention(g)
    assert g2 is not g
    err = rel_error(run(g2, [x], "f64"), run(g, [x], "f64"))
    assert err <= EXACT, err


def test_transformers_qwen2_attention_reads_kv_heads_unrepeated():
    pytest.importorskip("transformers")
    from tilefuse import models

    b = models.build("qwen2", 2, hidden=64, seq=12, batch=2, vocab=96, heads=4, kv_heads=2, dtype=torch.float64)
    g = capture(b.model, *b.inputs)
    g2 = repeated_kv_into_attention(g)
    after = nodes_of(g2, ir.Attention)
    assert len(after) == 2 and all(g2[a.k].type.shape[1] == 2 and g2[a.q].type.shape[1] == 4 for a in after)
    err = rel_error(run(g2, list(b.inputs), "f64"), run(g, list(b.inputs), "f64"))
    assert err <= EXACT, err


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)

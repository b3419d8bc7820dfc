"""The causal_masks rule: an attention mask known when compiling that equals SDPA's causal mask
becomes is_causal (no mask kernel per call; the attention kernel skips the upper triangle).

Each case checks through the Graph IR interpreter in float64 that the rewritten graph computes
the same function as the graph before it, and that the rule fires exactly where the mask is
tril(ones(L, S)) (top-left aligned), boolean or additive."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coda_fixtures import EXACT, capture, nodes_of, run
from tilefuse.check import rel_error
from tilefuse.compiler import compile_stages
from tilefuse.graph import ir
from tilefuse.graph.fold import fold_weights
from tilefuse.graph.rules.causal_mask import causal_masks

NEG = float("-inf")


class MaskedAttention(nn.Module):
    """SDPA with a mask built from index compares of the sequence positions (as transformers does)."""

    def __init__(self, mask_fn, batch_mask: bool = False):
        super().__init__()
        self.mask_fn, self.batch_mask = mask_fn, batch_mask

    def forward(self, q, k, v):
        L, S = q.shape[-2], k.shape[-2]
        i = torch.arange(L, device=q.device).view(L, 1)
        j = torch.arange(S, device=q.device).view(1, S)
        mask = self.mask_fn(i, j, q.dtype)
        if self.batch_mask:  # [B, 1, L, S], as transformers' masks are
            mask = mask[None, None].expand(q.shape[0], 1, L, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _causal_bool(i, j, dtype):
    return j <= i


def _causal_additive_inf(i, j, dtype):
    return torch.where(j <= i, torch.zeros((), dtype=dtype), torch.full((), NEG, dtype=dtype))


def _causal_additive_lowest(i, j, dtype):
    return torch.where(j <= i, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def _one_ahead(i, j, dtype):  # sees one key past the diagonal: not causal
    return j <= i + 1


def _window(i, j, dtype):  # sliding window of 3: not causal
    return (j <= i) & (j > i - 3)


def _bottom_right(i, j, dtype):  # decode-style alignment (L < S): not SDPA's top-left is_causal
    return j <= i + (j.shape[-1] - i.shape[0])


def _additive_small(i, j, dtype):  # -1e4 does not make exp underflow to 0: not the same function
    return torch.where(j <= i, torch.zeros((), dtype=dtype), torch.full((), -1e4, dtype=dtype))


def _qkv(L=6, S=6, b=2, h=3, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(L * 100 + S)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for n in (L, S, S)]


def _rewrite(module, inputs):
    """(graph with the mask folded as when compiling, the rule applied to it)."""
    g = fold_weights(capture(module, *inputs))
    return g, causal_masks(g)


@pytest.mark.parametrize("mask_fn, batch_mask, L, S", [
    (_causal_bool, False, 6, 6),
    (_causal_bool, True, 6, 6),
    (_causal_bool, False, 5, 9),    # L < S: is_causal is top-left aligned, so is this mask
    (_causal_bool, False, 9, 5),
    (_causal_additive_inf, True, 7, 7),
    (_causal_additive_lowest, False, 7, 7),
])
def test_a_causal_mask_becomes_is_causal_and_the_function_is_unchanged(mask_fn, batch_mask, L, S):
    inputs = _qkv(L, S)
    g, g2 = _rewrite(MaskedAttention(mask_fn, batch_mask), inputs)
    (before,), (after,) = nodes_of(g, ir.Attention), nodes_of(g2, ir.Attention)
    assert before.mask is not None and not before.causal
    assert after.mask is None and after.causal
    assert not any(n.type.dtype == "bool" for n in g2.nodes)  # the mask's cone is pruned
    err = rel_error(run(g2, inputs, "f64"), run(g, inputs, "f64"))
    assert err <= EXACT, err


def _window_additive(i, j, dtype):  # Mistral's window of 4 as an additive mask
    return torch.where((j <= i) & (j > i - 4), torch.zeros((), dtype=dtype), torch.full((), NEG, dtype=dtype))


def _diagonal(i, j, dtype):  # a window of one key: each query sees itself
    return j == i


def _window_with_a_hole(i, j, dtype):  # the window of 3 without key 0: not a band
    return (j <= i) & (j > i - 3) & (j != 0)


def _window_bottom_right(i, j, dtype):  # L < S, a window of 3 aligned to the last key: stays
    off = j.shape[-1] - i.shape[0]
    return (j <= i + off) & (j > i + off - 3)


@pytest.mark.parametrize("mask_fn, window, batch_mask", [
    (_window, 3, True), (_window, 3, False), (_window_additive, 4, True), (_diagonal, 1, False)])
def test_a_sliding_window_mask_becomes_a_causal_window(mask_fn, window, batch_mask):
    """Query i keeps keys i - W < j <= i: causal with window W, no mask, the same function."""
    inputs = _qkv(7, 7)
    g, g2 = _rewrite(MaskedAttention(mask_fn, batch_mask), inputs)
    (after,) = nodes_of(g2, ir.Attention)
    assert after.mask is None and after.causal and after.window == window
    assert f"causal, window={window}" in after.describe()
    err = rel_error(run(g2, inputs, "f64"), run(g, inputs, "f64"))
    assert err <= EXACT, err


@pytest.mark.parametrize("mask_fn, L, S", [(_one_ahead, 6, 6), (_window_with_a_hole, 6, 6), (_additive_small, 6, 6),
                                           (_bottom_right, 4, 9), (_window_bottom_right, 4, 9)])
def test_a_mask_that_is_not_the_causal_one_stays(mask_fn, L, S):
    inputs = _qkv(L, S)
    g, g2 = _rewrite(MaskedAttention(mask_fn, batch_mask=True), inputs)
    assert g2 is g
    (att,) = nodes_of(g2, ir.Attention)
    assert att.mask is not None and not att.causal


def test_a_mask_given_as_an_input_stays_even_when_it_is_causal():
    """Its value is only known per call, so the rule must not assume it."""
    q, k, v = _qkv()
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    g, g2 = _rewrite(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), [q, k, v, mask])
    assert g2 is g


def test_compile_reports_the_rule_and_the_program_matches_pytorch():
    inputs = _qkv(dtype=torch.float32)
    m = MaskedAttention(_causal_bool, batch_mask=True)
    c = compile_stages(m, inputs)
    assert "causal_masks" in [f.rule for f in c.fired]
    (att,) = nodes_of(c.graph, ir.Attention)
    assert att.causal and att.mask is None
    torch.testing.assert_close(c.program(*inputs), m(*inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformers_causal_masks_become_is_causal(name):
    """transformers builds its mask from index compares under export; after folding it is
    known and causal, so every layer's SDPA becomes causal and the logits are unchanged."""
    pytest.importorskip("transformers")
    from tilefuse import models

    b = models.build(name, 2, hidden=64, seq=12, batch=2, vocab=96, heads=4, dtype=torch.float64)
    g, g2 = _rewrite(b.model, list(b.inputs))
    assert all(a.mask is not None and not a.causal for a in nodes_of(g, ir.Attention))
    after = nodes_of(g2, ir.Attention)
    assert len(after) == 2 and all(a.mask is None and a.causal for a in after)
    err = rel_error(run(g2, list(b.inputs), "f64"), run(g, list(b.inputs), "f64"))
    assert err <= EXACT, err


class BatchVaryingMask(nn.Module):
    """Causal for the first sequence, one key more for the second: not one mask for all."""

    def forward(self, q, k, v):
        L = q.shape[-2]
        i = torch.arange(L).view(1, L, 1)
        j = torch.arange(L).view(1, 1, L)
        extra = torch.arange(q.shape[0]).view(-1, 1, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i + extra)[:, None])


def test_a_mask_that_varies_across_the_batch_stays():
    inputs = _qkv()
    g, g2 = _rewrite(BatchVaryingMask(), inputs)
    assert g2 is g


def test_a_mask_shared_by_layers_is_evaluated_once(monkeypatch):
    """Every layer of a model reads the same mask; the rule evaluates it once, not per layer."""
    from tilefuse.graph.rules import causal_mask

    class TwoLayers(nn.Module):
        def forward(self, q, k, v):
            L = q.shape[-2]
            mask = torch.arange(L).view(1, L) <= torch.arange(L).view(L, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return F.scaled_dot_product_attention(o, k, v, attn_mask=mask)

    calls = []
    real = causal_mask.known_value
    monkeypatch.setattr(causal_mask, "known_value", lambda g, name: calls.append(name) or real(g, name))
    inputs = _qkv()
    g, g2 = _rewrite(TwoLayers(), inputs)
    assert all(a.causal and a.mask is None for a in nodes_of(g2, ir.Attention))
    assert len(calls) == 1


@pytest.mark.parametrize("heads_kv", [3, 1])
def test_a_window_runs_in_pytorch_as_sdpa_with_the_band_mask(heads_kv):
    """Off the GPU (and where flash attention's window is not taken) the runtime gives SDPA the
    band i - W < j <= i as a mask: the same values as the interpreter's window."""
    from tilefuse.graph.interp import _attention
    from tilefuse.runtime.program import run_extern

    q, k, v = _qkv(9, 9, h=3)
    k, v = k[:, :heads_kv], v[:, :heads_kv]
    n = ir.Attention("a", ir.TensorType(tuple(q.shape), "f64"), "q", "k", "v", True, 0.4, None, window=4)
    got = run_extern(n, {"q": q, "k": k, "v": v}.__getitem__)
    i, j = torch.arange(9)[:, None], torch.arange(9)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - 4), scale=0.4, enable_gqa=heads_kv != 3)
    assert rel_error(got, want) <= EXACT
    interp = torch.from_numpy(_attention(n, q.numpy(), k.numpy(), v.numpy(), None, "f64"))
    assert rel_error(interp, want) <= EXACT

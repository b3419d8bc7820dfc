"""tilefuse.models: the native Llama and the transformers builders, through the backend.

Properties: the native block is causal and its grouped-query path equals plain multi-head
attention with repeated k/v weights; torch.compile(backend="tilefuse") of the block, the
native model and random tiny Llama (2 layers) / Qwen2 / GPT-2 (1 layer) equals eager within
DESIGN.md's 2x rule, for logits and the loss; each graph either runs tilefuse kernels or
names why it runs in eager; builders refuse unknown models and say how to get transformers.
"""
from __future__ import annotations

import sys

import pytest
import torch

from tilefuse import models
from tilefuse.check import compare, float64_reference
from tilefuse.frontend import backend as tb


pytestmark = pytest.mark.usefixtures("fresh_backend")


def _compiled_matches_eager(module, *inputs):
    with torch.no_grad():
        outs = torch.compile(module, backend="tilefuse")(*inputs)
        eager = module(*inputs)
    refs = float64_reference(module, inputs)
    if isinstance(outs, torch.Tensor):
        outs, eager, refs = (outs,), (eager,), (refs,)
    for i, (o, r, e) in enumerate(zip(outs, refs, eager)):
        c = compare(f"out{i}", o, r, e)
        assert c.ok, c
    rs = tb.reports()
    assert rs and all((r.status == "tilefuse" and r.kernels > 0) or r.reason for r in rs), tb.summary()
    return rs


def test_block_is_causal():
    torch.manual_seed(0)
    block = models.llama_block(32, 64, 4, 2, max_seq=16).eval()
    x = torch.randn(1, 8, 32)
    y = x.clone()
    y[:, 5:] += torch.randn(1, 3, 32)
    with torch.no_grad():
        assert torch.equal(block(x)[:, :5], block(y)[:, :5])
        assert not torch.allclose(block(x)[:, 5:], block(y)[:, 5:])


def test_grouped_query_equals_repeated_heads():
    torch.manual_seed(1)
    gqa = models.llama_block(32, 64, 4, 2, max_seq=16).eval()
    mha = models.llama_block(32, 64, 4, 4, max_seq=16).eval()
    with torch.no_grad():
        for (name, p), q in zip(gqa.named_parameters(), mha.parameters()):
            if p.shape == q.shape:
                q.copy_(p)
        for name in ("wk", "wv"):  # kv head j serves query heads 2j and 2j+1
            w = getattr(gqa.attn, name).weight.view(2, 8, 32)
            getattr(mha.attn, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(32, 32))
        x = torch.randn(2, 6, 32)
        assert torch.allclose(gqa(x), mha(x), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_through_the_backend(dtype):
    torch.manual_seed(2)
    block = models.llama_block(32, 64, 4, 2, max_seq=16).to(dtype).eval()
    (r,) = _compiled_matches_eager(block, torch.randn(2, 8, 32, dtype=dtype))
    assert r.status == "tilefuse" and r.kernels >= 4  # two RMSNorms, SwiGLU, residual adds, RoPE


def test_native_llama_through_the_backend():
    torch.manual_seed(3)
    m = models.llama(64, 1, 32, 64, 4, 2, max_seq=16).eval()
    (r,) = _compiled_matches_eager(m, torch.randint(0, 64, (2, 8)))
    assert r.status == "tilefuse"


transformers = pytest.importorskip("transformers", reason="the transformers builders need transformers "
                                                          "(pip install 'tilefuse[models]')")


class LogitsAndLoss(torch.nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids, labels):
        out = self.hf(input_ids=ids, labels=labels, use_cache=False)
        return out.logits, out.loss


@pytest.mark.parametrize("name,layers", [("llama", 2), ("qwen2", 1), ("gpt2", 1)])
def test_transformers_models_through_the_backend(name, layers):
    b = models.build(name, layers, hidden=32, seq=8, batch=2, vocab=64, heads=2, output="loss")
    rs = _compiled_matches_eager(LogitsAndLoss(b.model.hf), *b.inputs)
    if name != "gpt2":  # GPT-2's fused qkv split is not captured yet: it runs in eager, with its reason
        assert all(r.status == "tilefuse" for r in rs)


def test_build_refuses_unknown_models_and_explains_missing_transformers(monkeypatch):
    with pytest.raises(ValueError, match="llama, qwen2, gpt2"):
        models.build("bert")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(models.TransformersMissing, match=r"pip install 'tilefuse\[models\]'"):
        models.build("llama")


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_transformers_models_through_tilefuse_compile(name):
    """torch.export of a transformers model wraps its rotary embedding in grad-mode and
    disabled-autocast regions (higher-order ops with a subgraph); capture inlines them, and the
    bf16 model compiles whole, its projections as GEMMs, and passes the 2x rule."""
    pytest.importorskip("transformers")
    import tilefuse

    b = models.build(name, 2, hidden=64, seq=8, batch=2, vocab=64, dtype=torch.bfloat16)
    prog = tilefuse.compile(b.model, b.inputs)
    assert sum(s.family == "gemm" for s in prog.plan.steps) >= 8
    with torch.no_grad():
        eager = b.model(*b.inputs)
    c = compare(name, prog(*b.inputs), float64_reference(b.model, b.inputs), eager)
    assert c.ok, c


def test_an_enabled_autocast_region_is_refused_with_its_line():
    from tilefuse.frontend.capture import CaptureError, export, to_graph

    class M(torch.nn.Module):
        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return x @ x

    with pytest.raises(CaptureError, match="autocast region"):
        to_graph(export(M(), (torch.randn(4, 4),)))

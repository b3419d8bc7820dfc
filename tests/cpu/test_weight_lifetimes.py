"""Weights a compile derives (a norm's gamma folded into the next matmul's weight, gate and up
interleaved, RoPE's rows permuted) live as long as a program holds them, by reference counting
alone.

Each compile under `generate` derives them anew; runtime.shared_weights.WeightPool then swaps
them for the equal tensors an earlier size's program holds. A reference cycle through a
compile's graph (a recursive closure over it) kept the swapped-out copies alive until Python's
cyclic collector happened to run: on an H200 an 8-layer, 4096-wide Llama under `generate` held
9.4 GiB of them beside its 3.5 GiB of weights (bench/LOG_blocks.md, session 38). With the
collector off, for a Llama (RMSNorm folds, SwiGLU, RoPE) and a GPT-2 (LayerNorm partials)
generating at two prompt lengths:
- every derived tensor the pool replaced is already freed when the generate returns;
- the derived tensors still alive hold no two equal values (one copy each).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason="the models need transformers (pip install 'tilefuse[models]')")

from tilefuse.frontend import backend as tb  # noqa: E402
from tilefuse.models import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_backend")

GENERATE = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_derived_weights_the_pool_replaced_are_freed_without_the_cyclic_collector(name, monkeypatch):
    derived, replaced = [], []  # weak references to every weight the pool was given, to those it replaced
    share = tb.POOL.share

    def tracked_share(weights, live=()):
        before = dict(weights)
        saved = share(weights, live)
        derived.extend(weakref.ref(t) for t in before.values() if isinstance(t, torch.Tensor))
        replaced.extend(weakref.ref(t) for k, t in before.items() if weights[k] is not t)
        return saved

    monkeypatch.setattr(tb.POOL, "share", tracked_share)
    torch.manual_seed(0)
    cfg = hf.config(name, 2, 256, seq=64, vocab=256)  # (partials need N a multiple of PARTIAL_WIDTH)
    cfg.use_cache = True
    model = hf.causal_lm(cfg).to(torch.bfloat16).eval()
    params = {p.data_ptr() for p in model.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # (norm weights of ones would fold into nothing)
                p.uniform_(0.5, 1.5)
    model.forward = torch.compile(model.forward, backend=tb.tilefuse_backend)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            for prompt in (ids, ids[:, 5:]):
                model.generate(prompt, **GENERATE)
        assert replaced, "no compile derived a weight an earlier one held: the property is untested"
        kept = [r() for r in replaced if r() is not None]
        assert len(kept) == 0, (f"{len(kept)} of {len(replaced)} derived weights the pool replaced are still alive "
                          f"(held by a reference cycle): {[tuple(t.shape) for t in kept][:6]}")
        alive = list({t.data_ptr(): t for t in (r() for r in derived) if t is not None and t.data_ptr() not in params}.values())
        assert alive, "no derived weight is alive: the programs hold none, so the model folded nothing"
        twins = [(tuple(a.shape), a.dtype) for i, a in enumerate(alive) for b in alive[i + 1:]
                 if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)]
        assert not twins, f"equal derived weights alive twice: {twins[:6]}"
    finally:
        gc.enable()

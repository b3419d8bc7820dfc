"""`model.generate` through the backend for transformers models whose layers attend to a
sliding window, with a dynamic and a static cache, on the CPU (random float32 weights, 1-D
parameters perturbed, two layers, hidden 32, window 8 < prompt 12).

Their caches pass the cache's length to each decode step as a Python int; tilefuse takes it
as a 0-d tensor (frontend/scalar_ints.py). Properties, for each model and cache:
- eager's tokens, twice in a row;
- every graph compiled by tilefuse and run there (no eager call, no graph break);
- the decode graph takes its length as a 0-d tensor, and where every layer is a sliding
  window, one compiled variant serves every decode step (with transformers 5.24, what CI
  installs; 5.17 also passes generate's growing attention mask into a dynamic cache's decode
  step, so there each length compiles). Models that mix in global layers
  (Gemma3, Cohere2) grow those layers' cache with a dynamic cache, so each decode step is a
  new size there: from one export, and most made from a compiled size with no compile.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the models need transformers (pip install 'tilefuse[models]')")

from tilefuse.frontend import backend as tb  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_backend")

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=True, pad_token_id=0, bos_token_id=1,
              eos_token_id=127)
MIXED = ["sliding_attention", "full_attention"]
MODELS = {  # name: (config class, model class, config arguments, every layer a window)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8), True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                   layer_types=["sliding_attention"] * 2), True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=8), True),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=8), True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=8, head_dim=8, layer_types=MIXED), False),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=8, layer_types=MIXED), False),
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_a_sliding_window_model_generates_eager_tokens_with_its_length_as_a_tensor(name, cache):
    import transformers

    config, model_class, kw, every_layer = MODELS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**COMMON, **kw)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p += 0.1 * torch.randn_like(p)
    ids = torch.randint(2, 120, (1, 12), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    if cache == "static":
        gen.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        eager = model.generate(ids, **gen)
        model.forward = torch.compile(model.forward, backend="tilefuse")
        for _ in range(2):
            got = model.generate(ids, **gen)
            assert torch.equal(got, eager), (got, eager)
    reports = tb.reports()
    assert all(r.status == "tilefuse" and not r.calls_eager for r in reports), tb.summary()
    assert not sum(tb._graph_breaks().values()), tb.summary()
    decode = max(reports, key=lambda r: r.calls_tilefuse)
    assert decode.calls_tilefuse >= 17, tb.summary()
    assert any("passed as 0-d tensors" in e for e in decode.events), tb.summary()
    if every_layer or cache == "static":
        assert decode.variants == 1, tb.summary()
    else:
        assert decode.exports == 1 and decode.resized > decode.variants // 2, tb.summary()

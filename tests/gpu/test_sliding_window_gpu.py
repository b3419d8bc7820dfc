"""A sliding-window model (Mistral) generating through the backend on the GPU, its cache's
length passed to the decode program as a 0-d tensor (frontend/scalar_ints.py).

Properties, for a dynamic and a static cache, in float32 (the property is the length's
handling; bf16 greedy decoding of a random model parts ways with eager's at near ties):
- eager's tokens, three generates in a row;
- every graph ran in tilefuse, none in eager;
- the decode step (a full window every step) is one compiled variant for every length, its
  length taken as a 0-d tensor, and replays a CUDA graph on most calls (with transformers
  5.24; 5.17 also passes the growing attention mask into a dynamic cache's decode step, so
  there most lengths are made from a compiled one, from one export).
Beside a 0-d CPU tensor input, a graph with such an int still runs in tilefuse.
"""
from __future__ import annotations

import pytest
import torch

from tilefuse.frontend import backend as tb

pytestmark = pytest.mark.gpu


def _version(text: str) -> tuple:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mistral_generates_eager_tokens_from_one_decode_program(cache, runners):
    transformers = pytest.importorskip("transformers")

    torch._dynamo.reset()
    tb.reset()
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     sliding_window=8, use_cache=True)
    cfg._attn_implementation = "sdpa"
    model = transformers.MistralForCausalLM(cfg).to("cuda", torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), device="cuda")  # longer than the window
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, disable_compile=True)
    if cache == "static":
        gen["cache_implementation"] = "static"
    with torch.no_grad():
        eager = model.generate(ids, **gen)
        model.forward = torch.compile(model.forward, backend=runners.backend)
        for _ in range(3):
            got = model.generate(ids, **gen)
            assert torch.equal(got, eager), (got, eager)
    assert all(r.report.status == "tilefuse" and not r.report.calls_eager for r in runners), tb.summary()
    r = max(runners, key=lambda r: r.report.calls_tilefuse)
    assert r.report.calls_tilefuse >= 3 * 14, tb.summary()
    assert r.scalars, tb.summary()
    if cache == "dynamic" and _version(transformers.__version__) < (5, 24):
        # (transformers 5.17 also passes generate's growing attention mask into each decode
        # step, cast to bool there: that cast runs in PyTorch, and most lengths are made from a
        # compiled one with no compile, from one export)
        assert r.report.exports == 1 and r.report.resized > r.report.variants // 2, tb.summary()
        return
    assert r.report.variants == 1, tb.summary()
    (v,) = r.variants.values()
    info = v.program.graph_info()
    assert sum(g["replays"] for g in info) >= r.report.calls_tilefuse - 3, info


def test_an_int_taken_as_a_tensor_beside_a_host_scalar_runs_in_tilefuse():
    """A graph with a 0-d CPU tensor input beside CUDA ones (moved per call) and an int that
    only enters tensor arithmetic, returned one larger: its integer output is not a CPU tensor
    output (which would send the graph to eager), and every value runs one program."""
    torch._dynamo.reset()
    tb.reset()

    def f(x, c, n):
        return x * c + (torch.arange(x.shape[0], device=x.device) + n), n + 1

    cf = torch.compile(f, backend=tb.tilefuse_backend)
    x = torch.randn(64, device="cuda")
    c = torch.tensor(3.0)
    with torch.no_grad():
        for n in (3, 4, 5, 9, 30):
            y, m = cf(x, c, n)
            want, want_m = f(x, c.cuda(), n)
            # (the kernel contracts x * c + ... into one fma where eager rounds the product first, so
            # results differ by rounding: PyTorch's float32 tolerance, not bitwise equality)
            torch.testing.assert_close(y, want)
            assert m == want_m, (n, m, want_m)
    rs = [r for r in tb.reports() if any("passed as 0-d tensors" in e for e in r.events)]
    assert len(rs) == 1 and rs[0].status == "tilefuse" and rs[0].variants == 1 and not rs[0].calls_eager, \
        tb.summary()

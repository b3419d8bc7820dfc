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
- every derived tensor the pool replaced (as a rewrite made it, or after the compile) is
  already freed when the generate returns;
- the derived tensors still alive hold no two equal values (one copy each);
- at the second length, a derived weight equal to one a program holds is that tensor from the
  moment it is made, so a compile never holds a second set.
Also: the exact products the RMSNorm fold rounds a block of rows at a time give the same bits.
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
    # (by `intern` as a rewrite makes it, or by `share` once the compile is done)
    share = tb.POOL.share

    def tracked_share(weights, live=()):
        before = dict(weights)
        saved = share(weights, live)
        derived.extend(weakref.ref(t) for t in before.values() if isinstance(t, torch.Tensor))
        replaced.extend(weakref.ref(t) for k, t in before.items() if weights[k] is not t)
        return saved

    intern = tb.POOL.intern

    def tracked_intern(t, live=()):
        got = intern(t, live)
        derived.append(weakref.ref(t))
        if got is not t:
            replaced.append(weakref.ref(t))
        return got

    monkeypatch.setattr(tb.POOL, "share", tracked_share)
    monkeypatch.setattr(tb.POOL, "intern", tracked_intern)
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


def test_a_new_size_derives_no_weight_a_program_already_holds(monkeypatch):
    """At a second prompt length, each weight a rewrite derives that equals one an earlier
    size's program holds is that program's tensor as soon as it is made (the backend's pool
    interns it), so a compile never holds a second full set of derived weights."""
    from tilefuse.graph.rules import match

    made = []  # (the tensor a rewrite stored, during which generate)
    weight = match.Editor.weight

    def tracked_weight(self, base, matrix, dtype, source):
        w = weight(self, base, matrix, dtype, source)
        made.append((self.weights[w.name], phase[0]))
        return w

    monkeypatch.setattr(match.Editor, "weight", tracked_weight)
    phase = [0]
    torch.manual_seed(0)
    cfg = hf.config("llama", 2, 256, seq=64, vocab=256)
    cfg.use_cache = True
    model = hf.causal_lm(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.forward = torch.compile(model.forward, backend=tb.tilefuse_backend)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        model.generate(ids, **GENERATE)
        first = [t for t, _ in made]
        phase[0] = 1
        model.generate(ids[:, 5:], **GENERATE)
    later = [t for t, ph in made if ph == 1]
    assert later, "the second prompt length derived nothing: the property is untested"
    equal = [(t, f) for t in later for f in first if t.shape == f.shape and t.dtype == f.dtype and torch.equal(t, f)]
    assert equal, "no weight of the second length equals one of the first"
    assert all(t is f for t, f in equal), \
        f"{sum(t is not f for t, f in equal)} of {len(equal)} equal derived weights were held twice"


def test_an_exact_product_rounded_in_row_blocks_equals_rounding_it_whole(monkeypatch):
    """exact_product(round_to=...) rounds a block of rows at a time (no whole float32 product
    held): the same bits as the product rounded at once, for a column or row broadcast and
    blocks that do not divide the rows (finite values: a NaN may come out with other payload bits)."""
    from tilefuse.graph.rules import match

    monkeypatch.setattr(match, "_BLOCK", 7 * 33)  # 7 rows of 33 a block: 100 rows in 15 blocks
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a = torch.randn(100, 33, dtype=dtype)
        for b in (torch.rand(100, 1, dtype=dtype) + 0.5, torch.rand(1, 33, dtype=dtype) + 0.5):
            whole = match.exact_product(a, b).to(dtype)
            assert torch.equal(match.exact_product(a, b, round_to=dtype), whole), (dtype, tuple(b.shape))


def _extremes(dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, info.eps, 0.0, -0.0, 1.0, -3.0],
                        dtype=torch.float64).to(dtype)


def test_an_exact_product_of_16_bit_floats_is_pytorchs_multiply_bit_for_bit():
    """The 16-bit fast path (torch.mul, float32 opmath, one rounding) gives the bits of the
    product formed in float64 and rounded once, overflow to inf and subnormals included, for
    a row or a column broadcast."""
    from tilefuse.graph.rules import match

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = _extremes(dtype)
        a = torch.cat([torch.randn(64 * 33, dtype=torch.float64).to(dtype), x.repeat(33)]).reshape(-1, 33)
        for b in (torch.randn(a.shape[0], 1, dtype=torch.float64).to(dtype),
                  torch.cat([x, torch.randn(33 - x.numel(), dtype=torch.float64).to(dtype)]).reshape(1, 33)):
            got = match.exact_product(a, b, round_to=dtype)
            want = (a.double() * b.double()).to(dtype)
            assert got.dtype == dtype and torch.equal(got, want), (dtype, tuple(b.shape))

"""`model.generate` with a KV cache through `torch.compile(model.forward, backend="tilefuse")`,
on the CPU, across transformers causal LMs: Llama, Qwen2, GPT-2 (tilefuse.models.hf) and the
nine causal architectures of hf_arch_fixtures.py (Mistral and Gemma2 with a sliding window
smaller than prompt + new tokens, Phi3, Gemma, GPT-NeoX, OPT, Qwen3, Olmo, StableLM), random
float32 weights (1-D parameters perturbed), one layer (Gemma2: two), hidden 32, vocab 128.

Properties, per architecture, for greedy generation of 8 tokens:
- the compiled model generates eager's tokens: twice for a 12-token prompt, then once for a
  9-token prompt (a new prefill length, and decode sizes not seen before);
- every dynamo graph was compiled by tilefuse and ran there on every call (no eager call, no
  run-time fallback, no graph break);
- a graph compiled for several sizes (each decode step's cache is one longer) got them from one
  symbolic torch.export: fewer exports than compiled variants;
- the second identical generate makes no new export, and a third compiles nothing. The second
  may compile a size the first already compiled, as an instance of the symbolic export, at most
  once per graph dynamo compiled for one size: dynamo compiles the first call of each graph
  for its sizes alone, and once it has a dynamic graph of the same code it tries that graph
  first, so a size a static graph served in the first generate reaches the dynamic graph in
  the second;
- Mistral and Gemma2 (transformers' DynamicSlidingWindowLayer) run in tilefuse too: their
  prefill graph returns an input unchanged (a no-op `.to` of the layer's window tensor), which
  is the caller's tensor, and their decode graphs return the layer's `cumulative_length`, an
  integer evaluated from the call's values. That length, a Python int no tensor's shape
  holds, only enters tensor arithmetic (the mask's positions): it is passed as a 0-d tensor,
  and one compiled decode program serves every step once the window is full, and says so;
- where a decode graph's sizes reach only extern ops (the cache's cat, attention), its later
  sizes are made from a compiled size's program with no compile (runtime.resize), and the
  tokens above are theirs; Gemma2's decode graph builds its global layers' mask from the cache's
  length (an op taking a size) for eager attention's kernels and compiles each size, and says why.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the models need transformers (pip install 'tilefuse[models]')")

from hf_arch_fixtures import ARCHS, Sizes, _ids, perturb, sizes_for  # noqa: E402

from tilefuse.frontend import backend as tb  # noqa: E402
from tilefuse.models import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_backend")

SIZES = Sizes(hidden=32, layers=1, seq=32, batch=1, vocab=128, head_dim=8, window=8)
PROMPTS = (12, 9)  # tokens: the first generated twice, then the second
GENERATE = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


class RanInEager(AssertionError):
    """A graph ran (wholly or in part) in eager."""


# transformers' DynamicSlidingWindowLayer passes its cumulative_length, a Python int, to the decode
# graph (dynamo makes it a SymInt that is no tensor's dim) and gets it back as an output: it only
# enters tensor arithmetic (the mask's positions), so it is passed as a 0-d tensor
# (frontend/scalar_ints.py). Mistral's decode steps (every layer a full window) are then one
# program; Gemma2's global layers still grow their cache and build their mask from its length
LENGTH_AS_TENSOR = {"mistral", "gemma2"}
ONE_DECODE_PROGRAM = {"mistral", "gemma3"}

# decode graphs that compile every size, and say why: Gemma2's global layers repeat the cache's heads
# for eager attention (a reshape of the growing cache that stays in the program, its shape differing
# between sizes) and run attention's softmax in kernels whose shapes follow the length. OPT's decode
# step builds a mask from the length that nothing reads (dropped, frontend.sizes._live), so its
# sizes are made too
NOT_RESIZED = {"gemma2": "each size compiles on its own",
               # GPT-J and BLOOM run eager attention too (its softmax's kernels follow the length;
               # BLOOM's ALiBi biases are a reshape of the length); Qwen2-MoE's router counts tokens
               # per expert with an op that takes the token count as an argument
               "gptj": "each size compiles on its own", "bloom": "each size compiles on its own",
               "qwen2moe": "each size compiles on its own"}

CAUSAL = ["llama", "qwen2", "gpt2"] + [n for n, a in ARCHS.items() if a.kind == "causal"]


def _build(name: str) -> torch.nn.Module:
    """A random float32 model of `name` with its KV cache on, 1-D parameters perturbed."""
    import transformers

    torch.manual_seed(0)
    if name in hf.MODELS:
        cfg = hf.config(name, 1, SIZES.hidden, seq=64, vocab=SIZES.vocab, heads=2, ffn=3 * SIZES.hidden)
        cfg.use_cache = True
        model = hf.causal_lm(cfg)
    else:
        a, s = ARCHS[name], sizes_for(name, SIZES)
        cfg = getattr(transformers, a.config)(**{**_ids(s, a.kind), **a.config_kw(s), "use_cache": True})
        cfg._attn_implementation = a.attn
        model = getattr(transformers, a.model)(cfg)
        model.loss_type = "ForCausalLM"
    perturb(model, torch.Generator().manual_seed(1))
    return model.float().eval()


def _variants() -> int:
    return sum(r.variants for r in tb.reports())


def _exports() -> int:
    return sum(r.exports for r in tb.reports())


def _assert_ran_in_tilefuse() -> None:
    summary = tb.summary()
    rs = tb.reports()
    if not rs:
        raise AssertionError("no graph reached the tilefuse backend")
    breaks = sum(tb._graph_breaks().values())
    for r in rs:
        if r.status != "tilefuse" or r.calls_eager or any("runtime error" in e for e in r.events) or breaks:
            raise RanInEager(f"graph {r.index}: status {r.status}, {r.calls_eager} eager call(s), {breaks} "
                             f"graph break(s): {r.reason} {r.events}\n{summary}")


@pytest.mark.parametrize("name", CAUSAL)
def test_generate_gives_eager_tokens_in_tilefuse_from_one_export_per_graph(name):
    model = _build(name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, model.config.vocab_size, (1, n), generator=gen) for n in PROMPTS]
    with torch.no_grad():
        eager = [model.generate(p, **GENERATE) for p in prompts]
        assert all(e.shape[1] == p.shape[1] + 8 for e, p in zip(eager, prompts))
        model.forward = torch.compile(model.forward, backend="tilefuse")

        got = model.generate(prompts[0], **GENERATE)
        assert torch.equal(got, eager[0]), (got, eager[0])
        _assert_ran_in_tilefuse()
        variants, exports = _variants(), _exports()
        single = sum(r.variants == 1 for r in tb.reports())  # graphs dynamo compiled for one size

        again = model.generate(prompts[0], **GENERATE)
        assert torch.equal(again, eager[0]), (again, eager[0])
        _assert_ran_in_tilefuse()
        assert _exports() == exports, f"the second identical generate exported again\n{tb.summary()}"
        assert _variants() - variants <= single, f"{_variants() - variants} new variant(s)\n{tb.summary()}"
        variants = _variants()
        model.generate(prompts[0], **GENERATE)
        assert _variants() == variants, f"the third identical generate compiled again\n{tb.summary()}"

        other = model.generate(prompts[1], **GENERATE)
        assert torch.equal(other, eager[1]), (other, eager[1])

    _assert_ran_in_tilefuse()
    for r in tb.reports():
        if r.variants > 1:
            assert r.exports < r.variants, (f"graph {r.index}: {r.variants} variants from {r.exports} exports: "
                                            f"{r.events}\n{tb.summary()}")
    decode = [r for r in tb.reports() if r.calls_tilefuse > 8]
    if name in LENGTH_AS_TENSOR:
        assert decode and all(any("passed as 0-d tensors" in e for e in r.events) for r in decode), tb.summary()
    if name in ONE_DECODE_PROGRAM:  # every decode step of a full window: one compiled program
        assert all(r.variants == 1 for r in decode), tb.summary()
        return
    assert any(r.variants > 1 for r in tb.reports()), tb.summary()
    resized = sum(r.resized for r in tb.reports())
    if name in NOT_RESIZED:
        assert resized == 0, tb.summary()
        assert all(NOT_RESIZED[name] in "".join(r.events) for r in tb.reports() if r.variants > 1), tb.summary()
    else:
        assert resized > 0, f"no size was made with no compile\n{tb.summary()}"




@pytest.mark.parametrize("name", CAUSAL)
def test_generate_with_a_static_cache_updates_it_in_place_and_compiles_one_decode_step(name):
    """`cache_implementation="static"`: transformers preallocates the cache and each step writes
    its keys and values into it (`index_copy_`) and advances a step counter (`add_`), writes
    into the graph's inputs that the program makes itself (Graph.writes). Properties: eager's
    tokens, for two prompts; every graph ran in tilefuse; every decode step is one size, so the
    decode graph compiles once (sliding-window layers too: their length, a Python int, is passed
    as a 0-d tensor); a second generate
    from the same prompt compiles nothing."""
    model = _build(name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, model.config.vocab_size, (1, n), generator=gen) for n in PROMPTS]
    static = dict(GENERATE, cache_implementation="static")
    with torch.no_grad():
        eager = [model.generate(p, **static) for p in prompts]
        model.forward = torch.compile(model.forward, backend="tilefuse")
        got = model.generate(prompts[0], **static)
        assert torch.equal(got, eager[0]), (got, eager[0])
        _assert_ran_in_tilefuse()
        variants = _variants()
        assert torch.equal(model.generate(prompts[0], **static), eager[0])
        assert _variants() == variants, f"the second generate compiled again\n{tb.summary()}"
        other = model.generate(prompts[1], **static)
        assert torch.equal(other, eager[1]), (other, eager[1])
    _assert_ran_in_tilefuse()
    decode = [r for r in tb.reports() if r.calls_tilefuse > 2]
    assert decode and all(r.stages.graph.writes for r in decode), tb.summary()
    assert all(r.variants == 1 for r in decode), tb.summary()


def test_transformers_compile_config_can_name_tilefuse_for_its_static_cache_decode_step():
    """`generate(..., compile_config=CompileConfig(backend="tilefuse"))`: transformers compiles
    the static-cache decode step itself (it runs the prefill in eager), passing its mode to the
    backend; eager's tokens, the decode graph in tilefuse at every step."""
    import transformers

    model = _build("llama")
    p = torch.randint(2, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    static = dict(GENERATE, cache_implementation="static")
    config = transformers.CompileConfig(backend="tilefuse")
    config._compile_all_devices = True  # transformers compiles on a GPU only, unless told (a private flag)
    with torch.no_grad():
        eager = model.generate(p, **static)
        got = model.generate(p, compile_config=config, **static)
    assert torch.equal(got, eager), (got, eager)
    _assert_ran_in_tilefuse()
    (r,) = tb.reports()
    assert r.calls_tilefuse == GENERATE["max_new_tokens"] - 1 and r.stages.graph.writes, tb.summary()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_padded_batch_with_a_static_cache_gives_eager_tokens_from_one_decode_compile(name):
    """Two prompts, the second left-padded (attention_mask zeros): eager's tokens for both rows
    from one decode compile, greedy; sampling runs through the same graphs (no new compile)."""
    model = _build(name)
    ids = torch.randint(2, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4], ids[1, :4] = 0, 0
    static = dict(GENERATE, cache_implementation="static")
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, **static)
        model.forward = torch.compile(model.forward, backend="tilefuse")
        got = model.generate(ids, attention_mask=mask, **static)
        assert torch.equal(got, eager), (got, eager)
        variants = _variants()
        sampled = model.generate(ids, attention_mask=mask, **{**static, "do_sample": True})
    assert sampled.shape == eager.shape and _variants() == variants, tb.summary()
    _assert_ran_in_tilefuse()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_padded_batch_with_a_dynamic_cache_makes_later_decode_lengths_with_no_compile(name):
    """Two prompts, the second left-padded, dynamic cache: eager's tokens, and once the growing
    mask's small maps run in PyTorch, later decode lengths are made with no compile. (The mask's
    `and` shared a kernel with RoPE's [batch, 1, 1] position cast, whose shape does not grow, and
    every decode length compiled in full: runtime.resize.torch_maps took only growing maps.)"""
    model = _build(name)
    ids = torch.randint(2, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4], ids[1, :4] = 0, 0
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, **GENERATE)
        model.forward = torch.compile(model.forward, backend="tilefuse")
        got = model.generate(ids, attention_mask=mask, **GENERATE)
    assert torch.equal(got, eager), (got, eager)
    _assert_ran_in_tilefuse()
    decode = max(tb.reports(), key=lambda r: r.variants)
    assert decode.variants >= GENERATE["max_new_tokens"] - 2 and decode.resized >= 2, tb.summary()

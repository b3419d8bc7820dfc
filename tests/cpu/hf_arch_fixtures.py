"""Shared by tests/cpu/test_hf_architectures.py and tests/gpu/test_hf_architectures_gpu.py:
random transformers models of architectures beyond Llama / Qwen2 / GPT-2 (which
tests/cpu/test_models.py and the GPU program tests cover) through
`torch.compile(model, backend="tilefuse")`, checked with DESIGN.md's 2x rule.

`run_architecture(name, sizes, device)` builds the model from its config class with random
weights (nothing is downloaded), adds noise to every 1-D parameter (transformers initialises
norm gains to 1, Gemma's to 0, and biases to 0: exact values that would hide a wrong fold of a
gain into a weight, or a dropped bias), casts it to bf16 and calls the compiled model on
`draws` fresh inputs of one shape under `torch.no_grad()`. The first call compiles; every
compiled program is then set to poison its outputs (NaN before each kernel, so an element no
kernel writes fails) and the other draws run; the first call's results are checked after them,
so a result a later call overwrote fails too.

Checks (`tilefuse.check.compare` against `float64_reference`, eager bf16 on the same inputs):
tensor outputs (logits, hidden states) draw by draw; the scalar loss as the vector of its values
over the draws (`tilefuse.check.compare_draws`, on at least `check.VALUES` = 16 draws). One
scalar has one rounding error, and eager's is sometimes near 0 by luck, which puts the bound at
the 1e-5 floor and fails a correct program (at hidden 64, 3 of 10 seeds of a correct Llama's
loss did); over 16 draws the rule compares the typical sizes of the two errors.

`assert_ran_in_tilefuse` then asserts from the backend's reports that the model really ran in
tilefuse: every dynamo graph compiled by tilefuse and run there on every call (none in eager,
no run-time fallback, no graph break), generated GEMMs planned, and no matmul that reads a
weight left to PyTorch (an extern contraction), so an architecture that silently falls back
to eager, wholly or in part, fails.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from tilefuse.check import VALUES, compare, compare_draws, draws_needed, flatten, float64_reference
from tilefuse.frontend import backend as tb
from tilefuse.graph import ir


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    seq: int
    batch: int
    vocab: int
    head_dim: int  # narrow heads; "wide" cases use 2 x head_dim
    window: int  # sliding windows, smaller than seq

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    @property
    def wide_heads(self) -> int:
        return self.hidden // (2 * self.head_dim)

    @property
    def positions(self) -> int:
        return max(self.seq, 64)


# the CPU interpreter's sizes, and GPU-realistic ones (M = batch x seq = 512 rows for every GEMM);
# an architecture may need more layers (`Arch.layers`, `sizes_for`)
TINY = Sizes(hidden=64, layers=2, seq=16, batch=2, vocab=128, head_dim=16, window=8)
GPU = Sizes(hidden=512, layers=2, seq=256, batch=2, vocab=2048, head_dim=64, window=64)


# -- the architectures ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    kind: str  # "causal" (outputs logits, loss) or "encoder" (last hidden state, pooler output)
    model: str  # transformers class
    config: str  # its config class
    config_kw: object  # Sizes -> dict of config arguments
    attn: str = "sdpa"
    note: str = ""
    layers: int = 1  # the fewest layers that show every layer kind (Gemma2 alternates sliding and full)
    experts_in_pytorch: bool = False  # a mixture of experts: the experts' grouped matmul stays an extern


def _ids(s: Sizes, kind: str) -> dict:
    """Special ids inside the vocab, untied heads, no KV cache."""
    d = dict(vocab_size=s.vocab, pad_token_id=0, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if kind == "causal":
        d["use_cache"] = False
    return d


def _llama_like(s: Sizes, wide=True, kv_div=2, **extra) -> dict:
    heads = s.wide_heads if wide else s.heads
    return dict(hidden_size=s.hidden, num_hidden_layers=s.layers, max_position_embeddings=s.positions,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // kv_div),
                intermediate_size=3 * s.hidden, **extra)


ARCHS: dict[str, Arch] = {
    "mistral": Arch("causal", "MistralForCausalLM", "MistralConfig",
                    lambda s: _llama_like(s, sliding_window=s.window),
                    note="sliding window smaller than the sequence, GQA 2:1"),
    "phi3": Arch("causal", "Phi3ForCausalLM", "Phi3Config",
                 lambda s: _llama_like(s, wide=False, kv_div=1, original_max_position_embeddings=s.positions),
                 note="fused qkv and gate_up projections"),
    "gemma": Arch("causal", "GemmaForCausalLM", "GemmaConfig",
                  lambda s: _llama_like(s, kv_div=1, head_dim=2 * s.head_dim),
                  note="(1 + w) RMSNorm, embedding scale, gelu-tanh GLU"),
    # SDPA drops attn_logit_softcapping (only eager_attention_forward applies it), hence eager
    # attention; caps near the scores' and logits' own scale, so that tanh is far from linear
    "gemma2": Arch("causal", "Gemma2ForCausalLM", "Gemma2Config",
                   lambda s: _llama_like(s, head_dim=2 * s.head_dim, query_pre_attn_scalar=2 * s.head_dim,
                                         sliding_window=s.window,
                                         attn_logit_softcapping=0.5 if s.hidden >= 256 else 0.05,
                                         final_logit_softcapping=0.5 if s.hidden >= 256 else 0.2),
                   attn="eager", layers=2, note="attention and final logit soft-capping, sliding and full layers"),
    "gptneox": Arch("causal", "GPTNeoXForCausalLM", "GPTNeoXConfig",
                    lambda s: dict(hidden_size=s.hidden, num_hidden_layers=s.layers,
                                   max_position_embeddings=s.positions, num_attention_heads=s.heads,
                                   intermediate_size=4 * s.hidden),
                    note="parallel residual, partial rotary (0.25), fused qkv"),
    "opt": Arch("causal", "OPTForCausalLM", "OPTConfig",
                lambda s: dict(hidden_size=s.hidden, num_hidden_layers=s.layers, max_position_embeddings=s.positions,
                               num_attention_heads=s.heads, ffn_dim=4 * s.hidden, word_embed_proj_dim=s.hidden,
                               vocab_size=s.vocab - s.vocab // 40),
                note="learned positions, relu, biases, a vocab not a multiple of 128"),
    "bert": Arch("encoder", "BertModel", "BertConfig",
                 lambda s: dict(hidden_size=s.hidden, num_hidden_layers=s.layers, max_position_embeddings=s.positions,
                                num_attention_heads=s.heads, intermediate_size=4 * s.hidden),
                 note="post-LayerNorm encoder, a padding attention mask, the pooler"),
    "qwen3": Arch("causal", "Qwen3ForCausalLM", "Qwen3Config",
                  lambda s: _llama_like(s, head_dim=2 * s.head_dim), note="q/k RMSNorm per head"),
    "olmo": Arch("causal", "OlmoForCausalLM", "OlmoConfig", lambda s: _llama_like(s, kv_div=1, clip_qkv=0.05),
                 note="LayerNorm without parameters, clip_qkv (binding at 0.05)"),
    "stablelm": Arch("causal", "StableLmForCausalLM", "StableLmConfig",
                     lambda s: _llama_like(s, kv_div=1, use_qkv_bias=True),
                     note="LayerNorm, partial rotary (0.25), qkv bias"),
    "mixtral": Arch("causal", "MixtralForCausalLM", "MixtralConfig",
                    lambda s: _llama_like(s, num_local_experts=4, num_experts_per_tok=2),
                    experts_in_pytorch=True, note="mixture of experts: softmax router, top-2 (topk), grouped matmul"),
    "qwen2moe": Arch("causal", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                     lambda s: _llama_like(s, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=s.hidden,
                                           shared_expert_intermediate_size=s.hidden),
                     experts_in_pytorch=True, note="mixture of experts beside a shared expert with a sigmoid gate"),
    "falcon": Arch("causal", "FalconForCausalLM", "FalconConfig",
                   lambda s: dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                  new_decoder_architecture=True, num_kv_heads=2),
                   note="parallel attention and MLP off one LayerNorm pair, multi-group KV, GELU"),
    "gptj": Arch("causal", "GPTJForCausalLM", "GPTJConfig",
                 lambda s: dict(n_embd=s.hidden, n_layer=s.layers, n_head=s.heads, n_positions=s.positions,
                                rotary_dim=s.head_dim // 2),
                 attn="eager",  # (transformers before 5.2x has no SDPA path for GPT-J)
                 note="interleaved (even/odd) rotary on part of each head, parallel residual, eager attention"),
    "bloom": Arch("causal", "BloomForCausalLM", "BloomConfig",
                  lambda s: dict(hidden_size=s.hidden, n_layer=s.layers, n_head=s.heads),
                  attn="eager", note="ALiBi position biases (baddbmm), embedding LayerNorm, eager attention"),
    "gemma3": Arch("causal", "Gemma3ForCausalLM", "Gemma3TextConfig",
                   lambda s: _llama_like(s, head_dim=2 * s.head_dim, sliding_window=s.window,
                                         query_pre_attn_scalar=2 * s.head_dim),
                   note="q/k norms, sandwich norms, sliding and global rotary bases"),
    "cohere": Arch("causal", "CohereForCausalLM", "CohereConfig", lambda s: _llama_like(s),
                   note="bias-free LayerNorm, parallel block, interleaved rotary, logit scale"),
    "granite": Arch("causal", "GraniteForCausalLM", "GraniteConfig",
                    lambda s: _llama_like(s, residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=3.0,
                                          attention_multiplier=0.1),
                    note="embedding, residual, attention and logit multipliers"),
}


def sizes_for(name: str, s: Sizes, archs: dict | None = None) -> Sizes:
    """`s` with at least the architecture's own number of layers (`archs`: another table, by
    default ARCHS)."""
    return replace(s, layers=max(s.layers, (archs or ARCHS)[name].layers))


def build(name: str, s: Sizes, archs: dict | None = None) -> nn.Module:
    import transformers

    a = (archs or ARCHS)[name]
    cfg = getattr(transformers, a.config)(**{**_ids(s, a.kind), **a.config_kw(s)})
    cfg._attn_implementation = a.attn
    model = getattr(transformers, a.model)(cfg)
    if a.kind == "causal":
        model.loss_type = "ForCausalLM"  # said, not guessed from the class name (a warning breaks dynamo's graph)
    return model


def perturb(model: nn.Module, gen: torch.Generator) -> None:
    """Noise on every 1-D parameter (norm gains and biases), see the module docstring."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


class Wrap(nn.Module):
    """The HF model as a function of positional tensors, returning a tuple of tensors."""

    def __init__(self, hf: nn.Module, names: tuple, outs: tuple):
        super().__init__()
        self.hf, self.names, self.outs = hf, names, outs

    def forward(self, *xs):
        out = self.hf(**dict(zip(self.names, xs)))
        return tuple(getattr(out, o) for o in self.outs)


def draw_inputs(kind: str, s: Sizes, vocab: int, pad_id: int, gen: torch.Generator, device) -> tuple:
    """(input names, tensors, output names): token ids (from 2, clear of the special ids) and
    labels with about 10% ignored (-100) for a causal LM; for an encoder, ids and an attention
    mask whose last sequence is right-padded by a quarter."""
    ids = torch.randint(2, vocab, (s.batch, s.seq), generator=gen)
    if kind == "encoder":
        mask = torch.ones(s.batch, s.seq, dtype=torch.long)
        mask[-1, s.seq - s.seq // 4:] = 0
        ids[mask == 0] = pad_id
        return ("input_ids", "attention_mask"), [ids.to(device), mask.to(device)], ("last_hidden_state",
                                                                                    "pooler_output")
    labels = torch.randint(0, vocab, (s.batch, s.seq), generator=gen)
    labels[torch.rand(s.batch, s.seq, generator=gen) < 0.1] = -100
    return ("input_ids", "labels"), [ids.to(device), labels.to(device)], ("logits", "loss")


# -- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    sizes: Sizes
    outs: tuple  # output names
    checks: list = field(default_factory=list)  # tilefuse.check.Check
    reports: list = field(default_factory=list)  # the backend's GraphReports
    stages: list = field(default_factory=list)  # each report's last Compiled, taken while the model lives
    breaks: int = 0  # dynamo graph breaks
    draws: int = 0


def run_architecture(name: str, s: Sizes, device: str, draws: int = VALUES, seed: int = 0,
                     dtype=torch.bfloat16) -> Run:
    """Build, compile, call on `draws` input draws and check every output (module docstring).
    `s` gets at least the architecture's own number of layers (`sizes_for`)."""
    assert draws >= 2
    s = sizes_for(name, s)
    tb.register()
    torch._dynamo.reset()
    tb.reset()
    try:
        torch.manual_seed(seed)
        hf = build(name, s)
        gen = torch.Generator().manual_seed(seed + 1)
        perturb(hf, gen)
        cfg = hf.config
        xs = []
        for _ in range(draws):
            names, x, outs = draw_inputs(ARCHS[name].kind, s, cfg.vocab_size, cfg.pad_token_id, gen, device)
            xs.append(x)
        model = Wrap(hf, names, outs).to(device=device, dtype=dtype).eval()
        compiled = torch.compile(model, backend="tilefuse")
        with torch.no_grad():
            got = [flatten(compiled(*xs[0]))]
            for r in tb.reports():
                if r.stages is not None:
                    r.stages.program.poison = True
            got += [flatten(compiled(*x)) for x in xs[1:]]
            eager = [flatten(model(*x)) for x in xs]
        model64 = copy.deepcopy(model).double()  # what float64_reference makes of a module, made once
        ref = [flatten(float64_reference(lambda *a: model64(*a), x)) for x in xs]  # a function: no copy per draw
        run = Run(name, s, outs, reports=tb.reports(), stages=[r.stages for r in tb.reports()],
                  breaks=sum(tb._graph_breaks().values()), draws=draws)
        assert all(len(g) == len(outs) for g in got), [len(g) for g in got]
        for i, o in enumerate(outs):
            need = draws_needed(eager[0][i])
            if need > 1:  # the loss: its values over the draws, as one vector
                assert draws >= need, f"{o}: {draws} draws; the 2x rule needs {need} for {need}+ values"
                run.checks.append(compare_draws(f"{name}.{o}[{draws} draws]", *([d[i] for d in v]
                                                                                 for v in (got, ref, eager))))
            else:
                run.checks += [compare(f"{name}.draw{k}.{o}", got[k][i], ref[k][i], eager[k][i])
                               for k in range(draws)]
        return run
    finally:
        torch._dynamo.reset()


def assert_checks_pass(run: Run) -> None:
    failed = [c for c in run.checks if not c.ok]
    assert not failed, f"{len(failed)} of {len(run.checks)} checks fail the 2x rule: {failed[:4]}"


def _weight_read(g: ir.Graph, name: str) -> bool:
    """Whether `name` is a weight (or a constant folded from weights) under views and casts."""
    n = g[name]
    while isinstance(n, ir.View) or (isinstance(n, ir.Map) and len(n.args) == 1 and n.op == "cast"):
        n = g[n.arg if isinstance(n, ir.View) else n.args[0]]
    return isinstance(n, (ir.Weight, ir.Constant))


def assert_ran_in_tilefuse(run: Run) -> None:
    """Every dynamo graph compiled by tilefuse and ran there on every call; at least four
    generated GEMMs per layer (q/k/v projections, fused or not; the attention output projection;
    the MLP's up, with its gate; its down) plus the LM head (the pooler for an encoder); no
    contraction that reads a weight left to PyTorch as an extern; a mixture of experts' grouped
    matmuls (torch._grouped_mm) in PyTorch where the table says so (`Arch.experts_in_pytorch`),
    and nowhere else."""
    summary = tb.summary()
    assert run.reports, "no graph reached the tilefuse backend"
    assert run.breaks == 0, f"{run.breaks} dynamo graph break(s):\n{summary}"
    gemms = experts = 0
    for r, stages in zip(run.reports, run.stages):
        assert r.status == "tilefuse" and stages is not None, f"graph {r.index} in eager: {r.reason}\n{summary}"
        assert r.calls_eager == 0 and r.calls_tilefuse == run.draws, (r.calls_tilefuse, r.calls_eager, r.events)
        assert not [e for e in r.events if "runtime error" in e], r.events
        plan = stages.plan
        gemms += sum(st.family == "gemm" for st in plan.steps)
        left = [st.nodes[0] for st in plan.steps if st.family == "extern" and isinstance(plan.graph[st.nodes[0]],
                                                                                           ir.Contraction)]
        weighted = [n for n in left if any(_weight_read(plan.graph, a) for a in ir.node_args(plan.graph[n]))]
        assert not weighted, f"matmul(s) of weights left to PyTorch: {weighted}\n{summary}"
        grouped = [st.nodes[0] for st in plan.steps if st.family == "extern"
                   and getattr(plan.graph[st.nodes[0]], "target", "").startswith("aten._grouped_mm")]
        experts += len(grouped)
        assert not grouped or ARCHS[run.name].experts_in_pytorch, f"grouped matmul(s) in PyTorch: {grouped}"
    if ARCHS[run.name].experts_in_pytorch:  # (said in ARCHS: the guard holds the claim to what runs)
        assert experts, f"no experts' grouped matmul found in the plan of {run.name}\n{summary}"
    floor = 4 * run.sizes.layers + 1
    assert gemms >= floor, f"{gemms} generated GEMM(s), expected at least {floor}\n{summary}"

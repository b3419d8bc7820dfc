"""Hugging Face causal LMs (Llama, Qwen2, GPT-2) from configs with random weights.

Nothing is downloaded: each model is built from its transformers config, initialised by
transformers' own `_init_weights` under a fixed seed, in eval mode, with SDPA attention.
`build` wraps it as one module with one tensor out (logits, last hidden state or loss), the
shape every tilefuse entry point and `tilefuse.check` take.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MODELS = ("llama", "qwen2", "gpt2", "mixtral")
OUTPUTS = ("logits", "hidden", "loss")


def check_sizes(name: str, layers: int, hidden: int, seq: int, batch: int, vocab: int, heads: int | None = None,
                kv_heads: int | None = None) -> None:
    """ValueError naming the first size a model cannot be built with (rather than a failure deep
    inside transformers, or a model of no layers)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; tilefuse builds {', '.join(MODELS)}")
    for what, v in (("layers", layers), ("hidden", hidden), ("seq", seq), ("batch", batch), ("vocab", vocab),
                    ("heads", heads), ("kv_heads", kv_heads)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    h = heads or default_heads(hidden)
    how = "" if heads else " (the default for this hidden size)"
    if hidden % h:
        raise ValueError(f"hidden {hidden} is not a multiple of the {h} attention heads{how}")
    if name != "gpt2" and (hidden // h) % 2:
        raise ValueError(f"{name}: the head width, hidden {hidden} / {h} head(s){how}, is {hidden // h}: "
                         f"odd, and rotary embeddings rotate pairs")
    if kv_heads is not None and h % kv_heads:
        raise ValueError(f"{h} attention heads are not a multiple of {kv_heads} kv heads")


class TransformersMissing(ImportError):
    """transformers is not installed: says how to get it."""


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise TransformersMissing("tilefuse.models.build needs transformers: "
                                  "pip install 'tilefuse[models]' (or pip install transformers)") from e
    return transformers


def default_heads(hidden: int) -> int:
    """Heads of 128 from hidden 512 up (Llama-7B: 4096 -> 32), of 16 below (tiny test models)."""
    return max(1, hidden // 128) if hidden >= 512 else max(1, hidden // 16)


def llama_ffn(hidden: int) -> int:
    """Llama's MLP width: 8/3 of hidden, up to a multiple of 256 (4096 -> 11008)."""
    return -(-(8 * hidden // 3) // 256) * 256


def config(name: str, layers: int, hidden: int, *, seq: int = 2048, vocab: int = 32000, heads: int | None = None,
           kv_heads: int | None = None, ffn: int | None = None):
    """The transformers config of a random model (SDPA attention, no KV cache)."""
    t = _transformers()
    heads = heads or default_heads(hidden)
    common = dict(vocab_size=vocab, attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=vocab - 1)
    if name == "llama":
        return t.LlamaConfig(hidden_size=hidden, intermediate_size=ffn or llama_ffn(hidden), num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                             max_position_embeddings=seq, **common)
    if name == "qwen2":  # biases on the q, k, v projections; grouped-query attention by default
        kv = kv_heads or (heads // 2 if heads % 2 == 0 else heads)
        return t.Qwen2Config(hidden_size=hidden, intermediate_size=ffn or llama_ffn(hidden), num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                             **common)
    if name == "gpt2":  # LayerNorm, GELU (tanh), learned positions, Conv1D (x @ W + b) projections
        if kv_heads not in (None, heads):
            raise ValueError("gpt2 has no grouped-query attention")
        return t.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, n_positions=seq, **common)
    if name == "mixtral":  # a mixture of experts: 8 experts of Llama's MLP, top-2 routing; GQA 4:1
        kv = kv_heads or (heads // 4 if heads % 4 == 0 else heads)
        return t.MixtralConfig(hidden_size=hidden, intermediate_size=ffn or llama_ffn(hidden), num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                               num_local_experts=8, num_experts_per_tok=2, sliding_window=None, **common)
    raise ValueError(f"unknown model {name!r}; tilefuse builds {', '.join(MODELS)}")


def causal_lm(cfg) -> nn.Module:
    t = _transformers()
    cls = {"llama": t.LlamaForCausalLM, "qwen2": t.Qwen2ForCausalLM, "gpt2": t.GPT2LMHeadModel,
           "mixtral": t.MixtralForCausalLM}[cfg.model_type]
    model = cls(cfg)
    # GPT2LMHeadModel's name does not tell transformers its loss; saying it avoids a warning that
    # would also break dynamo's graph
    model.loss_type = "ForCausalLM"
    return model


class CausalLM(nn.Module):
    """A transformers causal LM with one tensor out: ids -> logits | last hidden state, (ids, labels) -> loss."""

    def __init__(self, hf: nn.Module, output: str = "logits"):
        super().__init__()
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.hf, self.output = hf, output

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.output == "hidden":
            return self.hf.base_model(input_ids=ids, use_cache=False).last_hidden_state
        out = self.hf(input_ids=ids, labels=labels, use_cache=False)
        return out.loss if self.output == "loss" else out.logits


def token_inputs(vocab: int, batch: int, seq: int, output: str, device, seed: int) -> tuple:
    """(ids,) of (batch, seq) random tokens, and random labels too for the loss, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return (ids, torch.randint(0, vocab, (batch, seq), generator=g).to(device)) if output == "loss" else (ids,)


def routes(cfg) -> bool:
    """Whether a model of this config routes each token to the top k of its router's rounded
    scores (a mixture of experts): its outputs are judged over several draws (tilefuse.check)."""
    return getattr(cfg, "num_experts_per_tok", None) is not None


@dataclass
class Built:
    name: str
    model: CausalLM
    inputs: tuple  # (ids,) or (ids, labels)
    config: object

    @property
    def routed(self) -> bool:
        return routes(self.config)

    def fresh_inputs(self, seed: int) -> tuple:
        """Inputs like `inputs`, drawn from `seed`: a scalar output (the loss) is checked over
        several input draws (tilefuse.check.check_outputs)."""
        ids = self.inputs[0]
        return token_inputs(self.config.vocab_size, *ids.shape, self.model.output, ids.device, seed)


def build(name: str, layers: int = 2, hidden: int = 64, seq: int = 16, batch: int = 1,
          dtype: torch.dtype = torch.float32, *, output: str = "logits", device="cpu", vocab: int = 256,
          heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None, seed: int = 0) -> Built:
    """A random `name` model (one of MODELS) and inputs of (batch, seq) token ids."""
    check_sizes(name, layers, hidden, seq, batch, vocab, heads, kv_heads)
    cfg = config(name, layers, hidden, seq=max(seq, 1), vocab=vocab, heads=heads, kv_heads=kv_heads, ffn=ffn)
    torch.manual_seed(seed)
    model = CausalLM(causal_lm(cfg), output).to(device=device, dtype=dtype).eval()
    return Built(name, model, token_inputs(vocab, batch, seq, output, device, seed + 1), cfg)

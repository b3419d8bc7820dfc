"""graph/rules/eager_attention.py: attention written out in ops (transformers' eager attention:
GPT-J's in f32 from bf16 q and k, Llama's in bf16 with its scale and additive mask) becomes one
Attention node, run as SDPA. The rewritten graph is within the 2x rule of a float64 reference
(the interpreter); a causal mask becomes is_causal; where the pattern is not attention as SDPA
computes it (another softmax dim, a soft cap between, 32-bit q, k and v, the probabilities read
elsewhere) nothing changes."""
from __future__ import annotations

import math

import pytest
import torch

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.rules.eager_attention import eager_attention_as_sdpa

B, H, S, D = 2, 4, 24, 16


def _qkv(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(3))


def _causal(dtype):
    lowest = torch.finfo(dtype).min
    return torch.triu(torch.full((S, S), lowest, dtype=dtype), 1)[None, None]


def gptj(q, k, v, mask):
    """GPT-J: f32 scores of the bf16 q and k, divided by sqrt(D), masked, softmax, bf16 p @ v."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) / torch.tensor(math.sqrt(D))
    p = torch.softmax(s + mask, -1).to(v.dtype)
    return torch.matmul(p, v)


def llama(q, k, v, mask):
    """transformers' eager_attention_forward: bf16 scores scaled, masked, f32 softmax, cast back."""
    s = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def unmasked(q, k, v, mask):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)), -1), v)


def _attention(g):
    return [n for n in g.nodes if isinstance(n, ir.Attention)]


@pytest.mark.parametrize("fn", [gptj, llama, unmasked], ids=lambda f: f.__name__)
@pytest.mark.parametrize("mask_kind", ["causal", "random"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_eager_attention_is_sdpa_within_the_2x_rule(fn, mask_kind, dtype):
    q, k, v = _qkv(dtype)
    mask = _causal(dtype) if mask_kind == "causal" else (torch.randn(B, 1, S, S) * 2).to(dtype)
    g = to_graph(export(fn, (q, k, v, mask)))
    g2 = eager_attention_as_sdpa(g)
    (att,) = _attention(g2)
    assert not [n for n in g2.nodes if isinstance(n, ir.Contraction)], str(g2)
    scale = {"gptj": 1 / math.sqrt(D), "llama": D ** -0.5, "unmasked": 1.0}[fn.__name__]
    assert att.scale == pytest.approx(scale, rel=1e-6) and (att.mask is None) == (fn is unmasked)
    p = tilefuse.compile(fn, (q, k, v, mask))
    assert [type(p.graph[s.nodes[0]]).__name__ for s in p.plan.steps if s.family == "extern" and not s.view] \
        == ["Attention"], str(p.plan)
    check = compare(fn.__name__, p(q, k, v, mask), float64_reference(fn, (q, k, v, mask)), fn(q, k, v, mask))
    assert check.ok, check


def test_a_causal_mask_computed_in_the_program_becomes_is_causal():
    """The mask made from the sequence length (as transformers' is) is folded and recognised."""
    def fn(q, k, v):
        i = torch.arange(S)
        mask = torch.where(i[None, :] <= i[:, None], 0.0, torch.finfo(torch.float32).min)
        return gptj(q, k, v, mask)

    q, k, v = _qkv()
    p = tilefuse.compile(fn, (q, k, v))
    (att,) = _attention(p.graph)
    assert att.causal and att.mask is None
    check = compare("causal", p(q, k, v), float64_reference(fn, (q, k, v)), fn(q, k, v))
    assert check.ok, check


def test_an_f32_mask_with_rows_masked_whole_stays_finite():
    """An f32 mask (min f32, which is -inf in bf16) beside bf16 q: clamped to bf16's lowest
    before the cast, so a query row masked everywhere is uniform, as eager's, not NaN."""
    q, k, v = _qkv()
    mask = torch.zeros(B, 1, S, S)
    mask[:, :, 3, :] = torch.finfo(torch.float32).min  # (row 3 sees nothing)
    mask[:, :, 5:, :7] = torch.finfo(torch.float32).min
    g2 = eager_attention_as_sdpa(to_graph(export(gptj, (q, k, v, mask))))
    (att,) = _attention(g2)
    assert g2[att.mask].type.dtype == "bf16"
    p = tilefuse.compile(gptj, (q, k, v, mask))
    got, want = p(q, k, v, mask), gptj(q, k, v, mask)
    assert torch.isfinite(got).all()
    check = compare("rows masked whole", got, float64_reference(gptj, (q, k, v, mask)), want)
    assert check.ok, check


@pytest.mark.parametrize("name, fn, dtype", [
    ("softmax over another dim", lambda q, k, v, m: torch.matmul(torch.softmax(q @ k.transpose(-1, -2) + m, -2), v),
     torch.bfloat16),
    ("a soft cap between (Gemma 2)", lambda q, k, v, m: torch.matmul(
        torch.softmax(torch.tanh((q @ k.transpose(-1, -2)) / 50.0) * 50.0 + m, -1), v), torch.bfloat16),
    ("32-bit q, k and v", llama, torch.float32),
    ("k reshaped, not transposed", lambda q, k, v, m: torch.matmul(torch.softmax(q @ k.reshape(B, H, D, S) + m, -1), v),
     torch.bfloat16),
    ("a tensor scale", lambda q, k, v, m: torch.matmul(torch.softmax(q @ k.transpose(-1, -2) * m[..., :1] , -1), v),
     torch.bfloat16),
])
def test_not_taken(name, fn, dtype):
    q, k, v = _qkv(dtype)
    mask = _causal(dtype)
    g = to_graph(export(fn, (q, k, v, mask)))
    assert eager_attention_as_sdpa(g) is g, name


def test_probabilities_read_elsewhere_are_kept():
    """output_attentions: the probabilities are returned, so they are computed as before."""
    def fn(q, k, v, mask):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, -1)
        return p @ v, p

    q, k, v = _qkv()
    g = to_graph(export(fn, (q, k, v, _causal(torch.bfloat16))))
    assert eager_attention_as_sdpa(g) is g


def test_hf_llama_with_eager_attention_runs_sdpa():
    """A 2-layer Llama loaded with attn_implementation="eager": the same plan of attention as
    with SDPA, and its logits within the 2x rule."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.LlamaForCausalLM(cfg)

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    model = Logits().to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 16))
    p = tilefuse.compile(model, (ids,))
    atts = _attention(p.graph)
    assert len(atts) == 2 and all(a.causal for a in atts), str(p.plan)
    with torch.no_grad():
        check = compare("eager llama", p(ids), float64_reference(model, (ids,)), model(ids))
    assert check.ok, check


def _alibi(dtype, seed=1):
    """Bloom's ALiBi: head h adds slope_h · j to its scores of key j, as [B·H, 1, S]."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    pos = torch.arange(S).float()
    return (slopes[None, :, None, None] * pos).expand(B, H, 1, S).reshape(B * H, 1, S).to(dtype)


def bloom(q, k, v, alibi, mask):
    """transformers' BloomAttention: ALiBi as baddbmm's input on [B·H, S, D] q, kᵀ and v, the
    scores viewed [B, H, S, S] for the mask, an f32 softmax cast back, viewed [B·H, S, S] for p @ v."""
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    s = alibi.baddbmm(q3, k3.transpose(1, 2), beta=1.0, alpha=D ** -0.5)
    s = s.view(B, H, S, S) + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(B * H, S, S), v3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
def test_bloom_alibi_attention_is_sdpa_with_the_masks_summed(dtype, mask_kind):
    """Scores regrouped [B·H] <-> [B, H] between baddbmm, the mask and p @ v: one Attention in
    the mask's [B, H, S, S] shape on q, k and v as given (no copies), its mask ALiBi plus the
    causal (or padding) mask, summed once in f32 and clamped, so masked rows stay finite."""
    q, k, v = _qkv(dtype)
    alibi = _alibi(dtype)
    mask = _causal(dtype).expand(B, 1, S, S).clone()
    if mask_kind == "padding":
        mask[1, :, :, :5] = torch.finfo(dtype).min  # the second sequence's first 5 keys are padding
    args = (q, k, v, alibi, mask)
    g = to_graph(export(bloom, args))
    assert any(isinstance(n, ir.Contraction) for n in g.nodes)  # baddbmm lowered: a matmul, not an extern
    assert not [n for n in g.nodes if isinstance(n, ir.Extern)], str(g)
    g2 = eager_attention_as_sdpa(g)
    (att,) = _attention(g2)
    assert not [n for n in g2.nodes if isinstance(n, ir.Contraction)], str(g2)
    assert (att.q, att.k, att.v) == tuple(g.inputs[:3]) and att.scale == pytest.approx(D ** -0.5)
    cast = g2[att.mask]  # cast(max(alibi + mask in f32, lowest)) to q's dtype, [B, H, S, S]
    assert cast.type == ir.TensorType((B, H, S, S), g2[att.q].type.dtype) and cast.op == "cast"
    floor = g2[cast.args[0]]
    assert floor.op == "max" and g2[floor.args[1]].value == torch.finfo(dtype).min
    assert g2[floor.args[0]].op == "add" and g2[floor.args[0]].type.dtype == "f32"
    p = tilefuse.compile(bloom, args)
    got = p(*args)
    assert torch.isfinite(got).all()
    check = compare("bloom", got, float64_reference(bloom, args), bloom(*args))
    assert check.ok, check


def test_layers_adding_the_same_masks_share_one_summed_mask():
    """Two Bloom layers with one ALiBi and one causal mask: the summed mask is built once."""
    def two(q, k, v, alibi, mask):
        o = bloom(q, k, v, alibi, mask).reshape(B, H, S, D)
        return bloom(o, k, v, alibi, mask)

    q, k, v = _qkv()
    args = (q, k, v, _alibi(torch.bfloat16), _causal(torch.bfloat16).expand(B, 1, S, S).clone())
    g2 = eager_attention_as_sdpa(to_graph(export(two, args)))
    atts = _attention(g2)
    assert len(atts) == 2 and atts[0].mask == atts[1].mask
    p = tilefuse.compile(two, args)
    check = compare("two layers", p(*args), float64_reference(two, args), two(*args))
    assert check.ok, check


@pytest.mark.parametrize("alpha, beta", [(0.5, 1.0), (1.0, 0.0), (2.0, 0.5)])
def test_baddbmm_is_beta_bias_plus_alpha_product(alpha, beta):
    """torch.baddbmm lowers to a batched matmul and maps (beta 0 ignores the input, NaN included)."""
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(5, 1, 9, generator=g)
    if beta == 0:
        bias[0, 0, 0] = float("nan")
    x, y = torch.randn(5, 7, 6, generator=g), torch.randn(5, 6, 9, generator=g)

    def fn(bias, x, y):
        return torch.baddbmm(bias, x, y, beta=beta, alpha=alpha)

    p = tilefuse.compile(fn, (bias, x, y))
    assert not [n for n in p.graph.nodes if isinstance(n, ir.Extern)]
    torch.testing.assert_close(p(bias, x, y), fn(bias, x, y), rtol=1e-5, atol=1e-5)


def test_not_taken_where_p_at_v_broadcasts_across_the_regrouped_batch():
    """Probabilities regrouped to [N, 1, S, S] against v [N, S, D]: p @ v broadcasts to [N, N, S, D]
    (every batch's probabilities times every batch's v), which is not attention."""
    def fn(q, k, v):
        s = (q @ k.transpose(1, 2)).reshape(6, 1, S, S)
        return torch.softmax(s, -1) @ v

    q, k, v = (t.reshape(B * H, S, D)[:6] for t in _qkv())
    g = to_graph(export(fn, (q, k, v)))
    assert eager_attention_as_sdpa(g) is g


def test_a_second_scaled_matmul_beside_the_scores_is_a_mask():
    """`q @ kᵀ · c + q @ rᵀ` (a relative-position term): the first is the scores, the second a mask
    computed as before, as the rule took it before it followed sums."""
    def fn(q, k, v, r):
        s = q @ k.transpose(-1, -2) * 0.25 + q @ r.transpose(-1, -2)
        return torch.softmax(s, -1) @ v

    q, k, v = _qkv()
    r = _qkv(seed=1)[0]
    g2 = eager_attention_as_sdpa(to_graph(export(fn, (q, k, v, r))))
    (att,) = _attention(g2)
    assert att.mask is not None and len([n for n in g2.nodes if isinstance(n, ir.Contraction)]) == 1
    p = tilefuse.compile(fn, (q, k, v, r))
    check = compare("relative", p(q, k, v, r), float64_reference(fn, (q, k, v, r)), fn(q, k, v, r))
    assert check.ok, check


def test_not_taken_where_a_reshape_splits_the_key_dim():
    """A view of the scores that does not keep the last two dims (keys split in two) is not
    attention over those keys."""
    def fn(q, k, v):
        s = (q @ k.transpose(-1, -2)).reshape(B, H, S, 2, S // 2)
        p = torch.softmax(s, -1).reshape(B, H, S, S)
        return p @ v

    q, k, v = _qkv()
    g = to_graph(export(fn, (q, k, v)))
    assert eager_attention_as_sdpa(g) is g

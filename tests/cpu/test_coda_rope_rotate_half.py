"""rotate_half_to_pairs: Hugging Face's rotate-half RoPE rewritten into the adjacent-pair form on
Q/K weights permuted per head, so that rope_into_projection moves it into the GEMM epilogues.

Properties: on transformers' own Llama and Qwen2 (bias on q/k, grouped-query attention), the
rewritten graph computes the same function as the original (float64 through the interpreter, to
1e-12) and passes the 2x rule in bf16; the rule leaves the graph alone when a rotated q or k
escapes (returned as an output, as a KV cache does) or when cos and sin do not repeat their
halves; and compiled with it, the plan runs every rotation in the Q/K GEMMs' pairwise epilogues
with no cat, neg or slice copies left for RoPE.
"""
from __future__ import annotations

import copy

import pytest
import torch

from coda_fixtures import EXACT, capture, run
from tilefuse.check import compare, float64_reference, rel_error
from tilefuse.graph import ir
from tilefuse.graph.fold import fold_weights
from tilefuse.graph.rewrites import run_rewrites
from tilefuse.graph.rules import run_coda
from tilefuse.graph.rules.rope_epilogue import rope_into_projection
from tilefuse.graph.rules.rope_rotate_half import rotate_half_to_pairs
from tilefuse.models import hf

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402


def _prepared(m, *xs) -> ir.Graph:
    """The graph as compile_stages has it when the RoPE rules run: CODA rules, then folding."""
    g, _ = run_rewrites(capture(m, *xs))
    g, _ = run_coda(g)
    g, _ = run_rewrites(g, (fold_weights,))
    return g


def _cats(g: ir.Graph) -> list:
    return [n for n in g.nodes if isinstance(n, ir.Extern) and n.target == "aten.cat.default"]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_transformers_models_compute_the_same_function(name):
    """f64: the rewritten graph (and after rope_into_projection too) equals the original to
    float64 rounding; bf16: it passes the 2x rule against a float64 reference of the model."""
    b = hf.build(name, layers=2, hidden=64, seq=16, batch=2, dtype=torch.float64, output="hidden")
    (ids,) = b.inputs
    g = _prepared(b.model, ids)
    g2 = rotate_half_to_pairs(g)
    assert g2 is not g and len(_cats(g)) == 4 and not _cats(g2)  # q and k of two layers
    g3 = rope_into_projection(g2)
    assert g3 is not g2
    ref = run(g, [ids], "f64")
    for gr in (g2, g3):
        err = rel_error(run(gr, [ids], "f64"), ref)
        assert err <= EXACT, err
    mb = copy.deepcopy(b.model).bfloat16().eval()
    gb = rope_into_projection(rotate_half_to_pairs(_prepared(mb, ids)))
    with torch.no_grad():
        eager = mb(ids)
    c = compare(name, run(gb, [ids]), float64_reference(mb, [ids]), eager)
    assert c.ok, c


def test_weights_rows_are_permuted_per_head_and_biases_with_them():
    """Qwen2: the q/k projection weights' output columns h*D + 2j + e are the old ones' h*D + j +
    e*D/2 (and the biases' likewise); v's weight and bias are untouched."""
    b = hf.build("qwen2", layers=1, hidden=64, seq=16, batch=1, dtype=torch.float64, output="hidden")
    g = _prepared(b.model, *b.inputs)
    g2 = rotate_half_to_pairs(g)
    new = {n.name for n in g2.nodes if isinstance(n, ir.Weight)} - {n.name for n in g.nodes if isinstance(n, ir.Weight)}
    pairs = sorted(w for w in new if w.endswith("_pairs"))
    assert len(pairs) == 4 and sum("bias" in w for w in pairs) == 2 and not any("v_proj" in w for w in pairs)
    D = 16
    direct = {n.b for n in g2.nodes if isinstance(n, ir.Contraction)}  # stored (K, N): columns last
    for w in pairs:
        old = g.weights[w[: -len("_pairs")]]
        if "bias" in w:
            old, axis = old.reshape(1, -1), 1
        else:
            axis = 1 if w in direct else 0
        n = old.shape[axis]
        perm = torch.arange(n).reshape(-1, 2, D // 2).transpose(1, 2).reshape(-1)  # h*D + 2j + e <- h*D + j + e*D/2
        expect = old.index_select(axis, perm)
        assert torch.equal(g2.weights[w].reshape(expect.shape), expect), w


class HFAttention(torch.nn.Module):
    """transformers' rotary embedding and apply_rotary_pos_emb around SDPA; `escape` returns the
    rotated q or k as well (what a KV cache does with k)."""

    def __init__(self, escape: str | None = None, d=64, heads=4):
        super().__init__()
        cfg = transformers.LlamaConfig(hidden_size=d, num_attention_heads=heads, max_position_embeddings=16)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.heads, self.escape = heads, escape

    def forward(self, x):
        B, S, d = x.shape
        split = lambda t: t.view(B, S, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        cos, sin = self.rotary(x, torch.arange(S)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, S, d)
        if self.escape is None:
            return o
        return o, {"q": q, "k": k}[self.escape]


def test_fires_on_transformers_apply_rotary_pos_emb_read_only_by_sdpa():
    torch.manual_seed(0)
    m = HFAttention().double().eval()
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    g = _prepared(m, x)
    g2 = rotate_half_to_pairs(g)
    assert g2 is not g and not _cats(g2)
    assert rel_error(run(g2, [x], "f64"), run(g, [x], "f64")) <= EXACT


class MatmulRotary(LlamaRotaryEmbedding):
    """The rotary angles as transformers computed them before 5.2x: inv_freq @ positions, a
    batched matmul (a Contraction in the graph, which fold_weights must fold for the tables to
    become weights), not an elementwise product."""

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def test_fires_when_the_rotary_angles_are_a_matmul():
    """Older transformers' inv_freq @ positions folds (a contraction of known values) and the
    rule fires on the tables it gives, with the function unchanged."""
    torch.manual_seed(0)
    m = HFAttention()
    m.rotary = MatmulRotary(m.rotary.config)
    m = m.double().eval()
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    g = _prepared(m, x)
    assert [n for n in g.nodes if isinstance(n, ir.Contraction)] == [
        n for n in g.nodes if isinstance(n, ir.Contraction) and n.a not in g.weights]  # only x @ W are left
    g2 = rotate_half_to_pairs(g)
    assert g2 is not g and not _cats(g2)
    assert rel_error(run(g2, [x], "f64"), run(g, [x], "f64")) <= EXACT


@pytest.mark.parametrize("escape", ["q", "k"])
def test_left_alone_when_rotated_q_or_k_escapes(escape):
    """Returned (as a KV cache returns k), the rotated tensor would leave in the permuted order:
    the rule must not fire, for either side (attention needs both permuted alike)."""
    torch.manual_seed(0)
    m = HFAttention(escape).bfloat16().eval()
    g = _prepared(m, torch.randn(2, 16, 64).bfloat16())
    assert _cats(g) and rotate_half_to_pairs(g) is g


def test_left_alone_when_the_tables_do_not_repeat_their_halves():
    """cos[..., i] != cos[..., i + D/2]: not a rotation of (i, i + D/2) pairs; no rewrite."""
    torch.manual_seed(0)
    m = HFAttention().double().eval()
    g = _prepared(m, torch.randn(2, 16, 64, dtype=torch.float64))
    tables = [n.name for n in g.nodes if isinstance(n, ir.Weight) and n.type.shape[-2:] == (16, 16)]
    assert len(tables) == 2
    w = dict(g.weights)
    w[tables[0]] = w[tables[0]].clone()
    w[tables[0]][..., -1] += 0.5
    changed = ir.Graph(g.nodes, g.inputs, g.outputs, w)
    assert rotate_half_to_pairs(changed) is changed


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_plan_runs_the_rotations_in_the_qk_gemm_epilogues(monkeypatch, name):
    """Compiled (sm_90a plan), each layer's Q and K GEMMs carry the pairwise rotation in their
    epilogue (rendering and compiling for sm_90a and sm_80, Qwen2's with its bias); no cat, neg
    or slice copy is left in the plan; the program (interpreter) passes the 2x rule against
    float64."""
    from tilefuse.compiler import compile_stages
    from tilefuse.check import flatten

    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    b = hf.build(name, layers=2, hidden=64, seq=16, batch=2, dtype=torch.bfloat16, output="hidden")
    st = compile_stages(b.model, b.inputs, arch="sm_90a")
    assert {"rotate_half_to_pairs", "rope_into_projection"} <= {f.rule for f in st.fired}
    roped = [s for s in st.plan.steps if s.family == "gemm" and s.gemm.stacks]
    assert len(roped) == 4  # q and k of two layers
    plan = str(st.plan)
    assert "aten.cat" not in plan and "aten.stack" not in plan and "slice copy" not in plan
    assert not any(isinstance(n, ir.Map) and n.op == "neg" for n in st.graph.nodes)
    from tilefuse.codegen import gemm_sm80, gemm_sm90
    from tilefuse.runtime import nvrtc

    lg = st.gemms[roped[0].name]
    src = gemm_sm90.render(lg.problem())
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean
    s8 = gemm_sm80.render(lg.problem(), None, "sm_80")
    assert nvrtc.compile_cuda(s8.source, s8.name, "sm_80").info.clean
    out = flatten(st.program(*b.inputs))[0]
    with torch.no_grad():
        eager = b.model(*b.inputs)
    c = compare(name, out, float64_reference(b.model, list(b.inputs)), eager)
    assert c.ok, c


def test_fires_through_the_torch_compile_backend(monkeypatch):
    """Through torch.compile(backend="tilefuse") dynamo lifts inv_freq and the weights to inputs;
    the backend puts them back as weights, so cos and sin are folded tables there too and the
    rule fires; the output passes the 2x rule against float64."""
    import tilefuse.frontend.backend as be

    import functools

    from tilefuse.graph.rules import rope_rotate_half

    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    fired = []
    orig = rope_rotate_half.rotate_half_to_pairs

    @functools.wraps(orig)
    def rotate_half_to_pairs(g):  # compile_stages imports the rule when it runs it
        g2 = orig(g)
        fired.append(g2 is not g)
        return g2

    monkeypatch.setattr(rope_rotate_half, "rotate_half_to_pairs", rotate_half_to_pairs)
    be.register()
    torch._dynamo.reset()
    b = hf.build("llama", layers=2, hidden=64, seq=16, batch=2, dtype=torch.bfloat16, output="hidden")
    try:
        with torch.no_grad():
            out = torch.compile(b.model, backend="tilefuse")(*b.inputs)
            eager = b.model(*b.inputs)
    finally:
        torch._dynamo.reset()
    assert fired == [True]
    c = compare("llama", out, float64_reference(b.model, list(b.inputs)), eager)
    assert c.ok, c

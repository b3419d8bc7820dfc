"""rope_into_projection: RoPE on adjacent pairs moved onto the Q/K projections' columns, where
the GEMM's pairwise epilogue computes it (on by default; TILEFUSE_ROPE_EPILOGUE=0 turns it off).

Properties: the rewritten graph computes the same bits as the original (bf16, through the
interpreter) and the same function in float64; the tables over heads and batch are views of
the small (S, D/2) ones, made once and shared by Q and K (no new weight); the plan then runs
each rotation in its projection's epilogue, written once in bf16 at full width, with no
`stack`, slice or expand copies left in PyTorch, the GEMMs binding the (S, D/2) tables and
reading them at (m mod S, n mod D/2); the epilogue renders and compiles for sm_90a and sm_80;
the compiled block gives the bits it gave reading materialised repeated tables; a RoPE of
another form (rotate-half) is left alone; without the switch nothing changes.
"""
from __future__ import annotations

import copy

import pytest
import torch

from coda_fixtures import capture, randomise_norms, run
from tilefuse import models
from tilefuse.models.llama import apply_rope, rope_tables
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.compiler import compile_stages
from tilefuse.codegen import epilogue as epi
from tilefuse.graph import ir
from tilefuse.graph.contraction import view_chain
from tilefuse.graph.fold import fold_weights
from tilefuse.graph.rewrites import run_rewrites
from tilefuse.graph.rules.rope_epilogue import rope_into_projection
from loop_fixtures import index_value


class Attention(torch.nn.Module):
    """The native Llama attention's first half: projections, heads, RoPE (models/llama.py apply_rope)."""

    def __init__(self, d=64, heads=4, max_seq=16):
        super().__init__()
        self.heads = heads
        self.wq, self.wk = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)
        cos, sin = rope_tables(d // heads, max_seq, 10000.0)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x):
        B, S, D = x.shape
        q = self.wq(x).view(B, S, self.heads, D // self.heads).transpose(1, 2)
        k = self.wk(x).view(B, S, self.heads, D // self.heads).transpose(1, 2)
        cos, sin = self.cos[:S], self.sin[:S]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class RotateHalf(Attention):
    """transformers' form: the pairs are (i, i + D/2), built with slices and `cat`."""

    def forward(self, x):
        B, S, D = x.shape
        q = self.wq(x).view(B, S, self.heads, D // self.heads).transpose(1, 2)
        h = q.shape[-1] // 2
        c = torch.cat((self.cos[:S], self.cos[:S]), -1)
        s = torch.cat((self.sin[:S], self.sin[:S]), -1)
        rot = torch.cat((-q[..., h:], q[..., :h]), -1)
        return q * c + rot * s


def _folded(m, x):
    g, _ = run_rewrites(capture(m, x), (fold_weights,))
    return g


@pytest.mark.parametrize("batch,seq", [(1, 16), (2, 16), (2, 12)])
def test_same_bits_in_bf16_and_same_function_in_f64(batch, seq):
    torch.manual_seed(0)
    m = Attention().bfloat16().eval()
    x = torch.randn(batch, seq, 64).bfloat16()
    g = _folded(m, x)
    g2 = rope_into_projection(g)
    assert g2 is not g
    assert not any(isinstance(n, ir.Extern) and n.target == "aten.stack.default" and len(n.type.shape) == 5
                   for n in g2.nodes)  # the head-shaped stacks are gone; the new ones are (B, S, N/2, 2)
    for i in range(2):  # q and k
        a = run(ir.Graph(g.nodes, g.inputs, (g.outputs[i],), g.weights), [x])
        b = run(ir.Graph(g2.nodes, g2.inputs, (g2.outputs[i],), g2.weights), [x])
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"
    m64, x64 = copy.deepcopy(m).double(), x.double()
    g64 = _folded(m64, x64)
    for i in range(2):
        a = run(ir.Graph(g64.nodes, g64.inputs, (g64.outputs[i],), g64.weights), [x64], "f64")
        g64r = rope_into_projection(g64)
        b = run(ir.Graph(g64r.nodes, g64r.inputs, (g64r.outputs[i],), g64r.weights), [x64], "f64")
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 2])
def test_one_position_whose_transpose_is_a_reshape_rotates_the_same(batch):
    """At one position (decode) the heads' transpose (B, 1, H, D) -> (B, H, 1, D) moves a unit
    dim only and the standard rewrites make it a reshape: the rule still fires, the result is
    the same bits, and the transpose back is a reshape too (an alias, not a permute copy)."""
    from tilefuse.graph.rewrites import RULES

    torch.manual_seed(0)
    m = Attention().bfloat16().eval()
    x = torch.randn(batch, 1, 64).bfloat16()
    g, _ = run_rewrites(capture(m, x), RULES + (fold_weights,))
    assert not any(isinstance(n, ir.View) and n.op == "permute" and len(n.type.shape) == 4 for n in g.nodes)
    g2 = rope_into_projection(g)
    assert g2 is not g
    assert not any(isinstance(n, ir.Extern) and n.target == "aten.stack.default" and len(n.type.shape) == 5
                   for n in g2.nodes)
    assert all(n.op == "reshape" for n in g2.nodes if isinstance(n, ir.View) and n.name.startswith("rope_bhsd"))
    for i in range(2):
        a = run(ir.Graph(g.nodes, g.inputs, (g.outputs[i],), g.weights), [x])
        b = run(ir.Graph(g2.nodes, g2.inputs, (g2.outputs[i],), g2.weights), [x])
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"


def test_the_tables_are_views_of_the_small_ones_made_once_and_shared_by_q_and_k():
    """No new weight: the (B, S, H*D/2) tables are views (reshape, expand, reshape) of the folded
    (S, D/2) cos and sin, one chain each, read by Q's and K's rotations alike, holding cos[s, i] at
    column h*D/2 + i of row (b, s)."""
    torch.manual_seed(0)
    m = Attention().bfloat16().eval()
    x = torch.randn(2, 16, 64).bfloat16()
    g = _folded(m, x)
    g2 = rope_into_projection(g)
    weights = lambda gr: {n.name for n in gr.nodes if isinstance(n, ir.Weight)}  # noqa: E731
    assert weights(g2) <= weights(g)
    tables = [n for n in g2.nodes if n.name.endswith("_tiled")]
    assert [(type(t), t.type.shape) for t in tables] == [(ir.View, (2, 16, 32))] * 2  # cos and sin
    users = g2.users()
    assert all(len(users[t.name]) == 4 for t in tables)  # two products each in Q's and in K's rotation
    cos = run(ir.Graph(g2.nodes, g2.inputs, (tables[0].name,), g2.weights), [x])
    ref = m.cos[:16].repeat(1, 4)  # column h * D/2 + i holds cos[s, i]
    assert torch.equal(cos[0], ref) and torch.equal(cos[1], ref)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_plan_runs_each_rotation_in_its_projection_epilogue_reading_the_small_tables(monkeypatch, batch):
    """Q's and K's GEMMs compute the rotation in their epilogues, written once in bf16 at full
    width, with no `stack` or slice copies left; they bind the (S, D/2) cos and sin tables
    themselves, read at (m mod S, n mod D/2) (and not a (B, S, H*D/2) repeated copy: no step but
    these GEMMs holds or reads the views that repeat them); the epilogue renders and compiles
    for sm_90a and sm_80."""
    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    torch.manual_seed(0)
    S, heads, half = 16, 4, 16  # head_dim 32
    m = randomise_norms(models.llama_block(128, 256, heads, max_seq=S)).bfloat16().eval()
    x = torch.randn(batch, S, 128).bfloat16()
    st = compile_stages(m, [x], arch="sm_90a")
    g = st.graph
    assert "rope_into_projection" in [f.rule for f in st.fired]
    roped = [s for s in st.plan.steps if s.family == "gemm" and s.gemm.stacks]
    assert len(roped) == 2  # q and k
    views = set()
    for s in roped:
        (out,) = s.gemm.outs
        assert g[out].type.dtype == "bf16" and g[out].type.shape[-1] == s.gemm.n
        assert sorted(k for _, k in s.gemm.operands) == ["row", "view", "view"]  # rsqrt; cos and sin
        sources = {src for _, src in s.gemm.viewed}
        assert len(sources) == 2 and all(g[t].type.shape == (S, half) for t in sources)
        assert sources <= set(s.inputs) and not any(g[t].type.shape == (batch, S, heads * half) for t in s.inputs)
        for operand, _ in s.gemm.viewed:
            views |= set(view_chain(g, operand))
        lg = st.gemms[s.name]
        bound = {b.tensor: b.shape for b in lg.bindings}
        assert all(bound[t] == (S, half) for t in sources)
        tables = {b.buffer for b in lg.bindings if b.tensor in sources}
        loads = [x for x in epi.inner_body(lg.epilogue) if getattr(x, "buf", None) in tables]
        assert len(loads) == 2
        for ld in loads:
            for mm in range(batch * S):
                for n in range(s.gemm.n // 2):
                    assert [index_value(e, {"m": mm, "n": n}) for e in ld.index] == [mm % S, n % half]
    assert len(views) == 6  # reshape, expand, reshape of cos and of sin
    others = [s for s in st.plan.steps if s not in roped]
    assert not any(views & (set(s.nodes) | set(s.inputs)) for s in others), str(st.plan)
    plan = str(st.plan)
    assert "aten.stack" not in plan and "slice copy" not in plan and "expand copy" not in plan
    assert "stack to columns (2j, 2j+1)" in plan
    from tilefuse.codegen import gemm_sm80, gemm_sm90
    from tilefuse.runtime import nvrtc

    lg = st.gemms[roped[0].name]
    src = gemm_sm90.render(lg.problem())
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean
    s8 = gemm_sm80.render(lg.problem(), None, "sm_80")
    assert nvrtc.compile_cuda(s8.source, s8.name, "sm_80").info.clean


def _materialised(g: ir.Graph, x) -> ir.Graph:
    """g with each table's views replaced by a weight holding their value: the repeated
    (B, S, H*D/2) copies the rule used to build."""
    from tilefuse.graph.interp import run_graph
    from tilefuse.graph.rules.match import prune
    from tilefuse.tensors import to_torch

    tiled = tuple(n.name for n in g.nodes if n.name.endswith("_tiled"))
    values = run_graph(ir.Graph(g.nodes, g.inputs, tiled, g.weights), {g.inputs[0]: x})
    weights = dict(g.weights)
    for name, v in zip(tiled, values):
        weights[name] = to_torch(v).reshape(v.shape).contiguous()
    nodes = tuple(ir.Weight(n.name, n.type) if n.name in tiled else n for n in g.nodes)
    return prune(ir.Graph(nodes, g.inputs, g.outputs, weights))


@pytest.mark.parametrize("batch", [1, 2])
def test_reading_the_small_tables_gives_the_bits_the_repeated_copies_gave(monkeypatch, batch):
    """The compiled Llama block (GEMMs and their epilogues through the interpreter) computes the
    same bits reading the (S, D/2) tables through their views as it did reading materialised
    (B, S, H*D/2) copies of them (the rule's former tables): same values, same arithmetic."""
    from tilefuse.compiler import lower_plan
    from tilefuse.graph.fusion import plan
    from tilefuse.runtime.program import Program

    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    torch.manual_seed(2)
    m = randomise_norms(models.llama_block(128, 256, 4, max_seq=16)).bfloat16().eval()
    x = torch.randn(batch, 12, 128).bfloat16()
    st = compile_stages(m, [x])
    g2 = _materialised(st.graph, x)
    p2 = plan(g2)
    roped = [s for s in p2.steps if s.family == "gemm" and s.gemm.stacks]
    assert len(roped) == 2 and not any(s.gemm.viewed for s in roped)
    assert all(g2[t].type.shape == (batch, 12, 64) for s in roped for t, k in s.gemm.operands if k == "tile")
    kernels, gemms = lower_plan(g2, p2)
    old = flatten(Program(g2, p2, kernels, gemms=gemms)(x))
    new = flatten(st.program(x))
    assert len(old) == len(new)
    for a, b in zip(old, new):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_program_passes_the_2x_rule_on_the_cpu(monkeypatch):
    """Compiled with the rule and run through the interpreter on fresh inputs, the block's
    output is within the 2x rule of float64 PyTorch."""
    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    import tilefuse

    torch.manual_seed(1)
    m = randomise_norms(models.llama_block(128, 256, 4, max_seq=16)).bfloat16().eval()
    prog = tilefuse.compile(m, [torch.randn(2, 16, 128).bfloat16()])
    x = torch.randn(2, 16, 128).bfloat16()
    with torch.no_grad():
        eager = flatten(m(x))
    for o, r, e in zip(flatten(prog(x)), flatten(float64_reference(m, [x])), eager):
        c = compare("block", o, r, e)
        assert c.ok, c


def test_other_forms_are_left_alone(monkeypatch):
    torch.manual_seed(0)
    m = RotateHalf().bfloat16().eval()
    x = torch.randn(2, 16, 64).bfloat16()
    g = _folded(m, x)
    assert rope_into_projection(g) is g
    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "0")
    st = compile_stages(Attention().bfloat16().eval(), [x], arch="sm_90a")
    assert "rope_into_projection" not in [f.rule for f in st.fired]

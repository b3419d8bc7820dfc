"""rope_into_projection: RoPE on adjacent pairs moved onto the Q/K projections' columns, where
the GEMM's pairwise epilogue computes it (on by default; TILEFUSE_ROPE_EPILOGUE=0 turns it off).

Properties: the rewritten graph computes the same bits as the original (bf16, through the
interpreter) and the same function in float64; the plan then runs each rotation in its
projection's epilogue, written once in bf16 at full width, with no `stack` or slice copies
left in PyTorch; the epilogue renders and compiles for sm_90a; the tables are built once and
shared by Q and K; a RoPE of another form (rotate-half) is left alone; without the switch
nothing changes.
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
from tilefuse.graph import ir
from tilefuse.graph.fold import fold_weights
from tilefuse.graph.rewrites import run_rewrites
from tilefuse.graph.rules.rope_epilogue import rope_into_projection


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


def test_the_tables_are_built_once_and_shared_by_q_and_k():
    torch.manual_seed(0)
    m = Attention().bfloat16().eval()
    x = torch.randn(2, 16, 64).bfloat16()
    g2 = rope_into_projection(_folded(m, x))
    tables = [n for n in g2.nodes if isinstance(n, ir.Weight) and n.name.endswith("_heads")]
    assert sorted(t.type.shape for t in tables) == [(2, 16, 32)] * 2  # cos and sin: (B, S, H * D/2)
    cos = g2.weights[next(t.name for t in tables if "cos" in t.name)]
    ref = m.cos[:16].repeat(1, 4)  # column h * D/2 + i holds cos[s, i]
    assert torch.equal(cos[0], ref) and torch.equal(cos[1], ref)


def test_the_plan_runs_each_rotation_in_its_projection_epilogue(monkeypatch):
    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    torch.manual_seed(0)
    m = randomise_norms(models.llama_block(128, 256, 4, max_seq=16)).bfloat16().eval()
    x = torch.randn(2, 16, 128).bfloat16()
    st = compile_stages(m, [x], arch="sm_90a")
    assert "rope_into_projection" in [f.rule for f in st.fired]
    roped = [s for s in st.plan.steps if s.family == "gemm" and s.gemm.stacks]
    assert len(roped) == 2  # q and k
    for s in roped:
        (out,) = s.gemm.outs
        assert st.graph[out].type.dtype == "bf16" and st.graph[out].type.shape[-1] == s.gemm.n
        kinds = dict(s.gemm.operands)
        assert sorted(kinds.values()).count("tile") == 2  # the cos and sin tables
    plan = str(st.plan)
    assert "aten.stack" not in plan and "slice copy" not in plan
    assert "stack to columns (2j, 2j+1)" in plan
    lg = st.gemms[roped[0].name]
    from tilefuse.codegen import gemm_sm90
    from tilefuse.runtime import nvrtc

    src = gemm_sm90.render(lg.problem())
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean


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

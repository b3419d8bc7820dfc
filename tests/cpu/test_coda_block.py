"""All CODA rules together, on whole transformer blocks.

Properties: on the native Llama block every rule that applies fires (gate/up interleaved,
both RMSNorms folded into the four matmuls they feed, residual adds on the accumulators in
bf16) and the block computes the same function (exact in f64, 2x rule in bf16); the
rewritten graph still plans, lowers and runs through today's pipeline (the Loop IR
interpreter) within the 2x rule; on the graph dynamo captures from a transformers Llama the
rules fire and keep its function.
"""
from __future__ import annotations

import pytest
import torch

from coda_fixtures import assert_bf16, assert_exact, capture, nodes_of, randomise_norms, run
from tilefuse import models
from tilefuse.check import compare, float64_reference, rel_error
from tilefuse.graph import ir
from tilefuse.compiler import lower_plan
from tilefuse.graph.fusion import plan
from tilefuse.graph.rewrites import run_rewrites
from tilefuse.graph.rules import run_coda
from tilefuse.loop.lower import lower_step
from tilefuse.runtime.program import Program


def coda(g):
    return run_coda(g)[0]


def _block():
    torch.manual_seed(0)
    return randomise_norms(models.llama_block(32, 48, 4, 2, max_seq=16).eval())


def test_llama_block_same_function():
    block, x = _block(), torch.randn(2, 6, 32)
    g, g2 = assert_exact(block, coda, x)
    assert [f.rule for f in run_coda(g)[1]] == ["interleave_glu", "rmsnorm_into_matmul"]
    assert len(nodes_of(g2, ir.Contraction)) == len(nodes_of(g, ir.Contraction)) - 1
    folded = [n for n in nodes_of(g2, ir.Weight) if "RMSNorm weight" in n.source]
    assert len(folded) == 4, "q, k, v and the interleaved gate/up weights carry γ"
    gb = assert_bf16(block, coda, x)
    adds = [n for n in nodes_of(gb, ir.Map) if n.op == "add" and any(isinstance(gb[a], ir.Contraction)
                                                                     for a in n.args)]
    assert len(adds) == 2 and all(gb[a].type.dtype == "f32" for n in adds for a in n.args
                                  if isinstance(gb[a], ir.Contraction))


def test_rewritten_block_runs_through_the_pipeline():
    block = _block().to(torch.bfloat16)
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    g, _ = run_rewrites(coda(capture(block, x)))
    p = plan(g)
    kernels, gemms = lower_plan(g, p)
    specs = [s.gemm for s in p.steps if s.family == "gemm"]
    assert len(specs) == 6, "q, k, v, o, the interleaved gate/up and down run as generated GEMMs"
    glu = [sp for sp in specs if sp.pairwise]
    assert len(glu) == 1 and [k for _, k in glu[0].operands] == ["row"], "SwiGLU pairs columns after the row scale"
    out = Program(g, p, kernels, gemms=gemms)(x)
    with torch.no_grad():
        eager = block(x)
    c = compare("block", out, float64_reference(block, (x,)), eager)
    assert c.ok, c


def test_transformers_llama_graph():
    pytest.importorskip("transformers")
    from tilefuse.frontend import backend as tb

    tb.register()
    torch._dynamo.reset()
    tb.reset()
    b = models.build("llama", 1, hidden=32, seq=8, batch=2, vocab=64, heads=2, seed=1)
    randomise_norms(b.model)
    for m in b.model.modules():  # transformers' own RMSNorm class
        if type(m).__name__.endswith("RMSNorm"):
            with torch.no_grad():
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape))
    with torch.no_grad():
        torch.compile(b.model, backend="tilefuse")(*b.inputs)
    (r,) = tb.reports()
    g = r.stages.captured  # (while dynamo holds the graph: a report keeps no stages past a reset)
    torch._dynamo.reset()
    g2, fired = run_coda(g)
    assert {f.rule for f in fired} == {"interleave_glu", "rmsnorm_into_matmul"}
    ins = [b.inputs[0]]
    assert rel_error(run(g2, ins), run(g, ins, "f64")) <= 2 * rel_error(run(g, ins), run(g, ins, "f64")) + 1e-5

"""Transformers architectures beyond Llama / Qwen2 / GPT-2 (test_models.py) through
`torch.compile(model, backend="tilefuse")` on the CPU (the Loop IR interpreter), at tiny sizes:
hidden 64, 2 layers (Gemma2's sliding and full layers alternate), seq 16, batch 2, vocab 128.

Property, per architecture (the model table and the procedure: hf_arch_fixtures.py): a random
bf16 model, 1-D parameters perturbed, compiled by the backend and called on 16 input draws (all
but the first with poisoned outputs), gives logits (last hidden state and pooler output for
BERT) within DESIGN.md's 2x rule of a float64 reference on every draw, and a causal LM's loss
within the rule as the vector of its values over the draws (on one scalar alone the rule fails
correct programs: hf_arch_fixtures.py says why); and the model really ran in tilefuse: every
dynamo graph compiled by tilefuse and run there on every call, no graph break, generated GEMMs
for the projections and the head, no matmul of a weight left to PyTorch. The GPU twin,
tests/gpu/test_hf_architectures_gpu.py, runs the same code at GPU sizes.
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers", reason="the models need transformers (pip install 'tilefuse[models]')")

from hf_arch_fixtures import ARCHS, TINY, assert_checks_pass, assert_ran_in_tilefuse, run_architecture  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_backend")


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_matches_float64_and_runs_in_tilefuse(name):
    """See the module docstring; the architecture's distinctive features: ARCHS[name].note."""
    run = run_architecture(name, TINY, "cpu")  # check.VALUES (16) draws
    assert_checks_pass(run)
    assert_ran_in_tilefuse(run)


@pytest.mark.parametrize("how", ["generated GEMMs off", "run-time failure"])
def test_a_model_that_did_not_run_in_tilefuse_fails_the_guard(how, monkeypatch):
    """The guard of the test above is not vacuous: with generated GEMMs off (TILEFUSE_GEMM=0,
    every projection left to PyTorch), or with every call of the compiled program failing at run
    time (the backend goes on in eager, eager's own answer), the outputs still pass the 2x rule,
    but assert_ran_in_tilefuse fails, saying why."""
    if how == "generated GEMMs off":
        monkeypatch.setenv("TILEFUSE_GEMM", "0")
        why = "matmul(s) of weights left to PyTorch"
    else:
        from tilefuse.runtime.program import Program

        def broken(self, *args):
            raise RuntimeError("simulated launch failure")

        monkeypatch.setattr(Program, "__call__", broken)
        why = "simulated launch failure"
    run = run_architecture("bert", TINY, "cpu", draws=2)
    assert_checks_pass(run)
    with pytest.raises(AssertionError, match=re.escape(why)):
        assert_ran_in_tilefuse(run)


@pytest.mark.parametrize("name", ["gptj", "cohere"])
def test_interleaved_rotary_and_eager_attention_leave_no_pytorch_stack_or_score_matmul(name):
    """GPT-J's and Cohere's interleaved rotary (`stack` of strided slices, flattened) runs in
    kernels (cat_maps.stacks_as_maps), and GPT-J's eager attention (f32 score matmuls, softmax,
    p @ v) runs as SDPA (rules/eager_attention.py): no stack extern, no matmul of two activations
    left to PyTorch, and the outputs still within the 2x rule."""
    from tilefuse.graph import ir

    run = run_architecture(name, TINY, "cpu")  # (the loss's 2x rule needs its 16 draws)
    assert_checks_pass(run)
    for st in run.stages:
        g, plan = st.graph, st.plan
        ext = [g[s.nodes[0]] for s in plan.steps if s.family == "extern" and not s.view]
        assert not [n for n in ext if isinstance(n, ir.Extern) and n.target == "aten.stack.default"], str(plan)
        assert not [n for n in ext if isinstance(n, ir.Contraction)], str(plan)
        assert any(isinstance(n, ir.Attention) for n in ext)

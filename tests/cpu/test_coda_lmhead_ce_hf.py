"""lmhead_ce_partials on transformers' causal LMs (random weights, nothing downloaded).

transformers' ForCausalLMLoss shifts the labels (pads them with -100 and drops the first), casts
the [B, S, V] logits to f32, views them as [B S, V] and takes F.cross_entropy(ignore_index=-100).
Properties: when the module returns only the loss, the rule fires on that graph (Llama at a V
that 128 divides and not, GPT-2 at an odd V) and on a user's own loss over the model's logits
(labels as given, or the logits of all positions but the last against shifted labels);
the plan's LM-head GEMM writes the partials, compiles for sm_90a without spills, and no step
moves the [B S, V] logits; the compiled program (CPU interpreter) passes the 2x rule on the
loss over 16 draws of ids and labels. When the module returns the logits too (what
`model(ids, labels=labels)` gives: loss and logits), they are a program output and written
anyway: the rule does not fire and the LM-head GEMM writes them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.compiler import compile_stages
from tilefuse.check import VALUES, compare_draws, float64_reference
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90
from tilefuse.compiler import lower_plan
from tilefuse.graph import ir
from tilefuse.runtime import nvrtc

pytest.importorskip("transformers", reason="the transformers builders need transformers "
                                           "(pip install 'tilefuse[models]')")
from tilefuse import models  # noqa: E402

W = epi.PARTIAL_WIDTH
BATCH, SEQ = 2, 8


def _draw(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100   # a masked prompt
    return ids, labels


def _build(name, vocab, output="loss"):
    b = models.build(name, 1, hidden=64, seq=SEQ, batch=BATCH, vocab=vocab, dtype=torch.bfloat16, output=output)
    return b, _draw(vocab, 7)[1]


class UserLoss(torch.nn.Module):
    """A training step's loss written by hand over the model's logits: on the labels as given, or
    shifting the logits (`logits[..., :-1, :]` against `labels[..., 1:]`, the transformers loss
    before ForCausalLMLoss and many training loops)."""

    def __init__(self, hf, shift=False):
        super().__init__()
        self.hf, self.shift = hf, shift

    def forward(self, ids, labels):
        logits = self.hf(input_ids=ids, use_cache=False).logits
        v = logits.shape[-1]
        if self.shift:
            logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        return F.cross_entropy(logits.float().view(-1, v), labels.view(-1), ignore_index=-100)


class LossAndLogits(torch.nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids, labels):
        out = self.hf(input_ids=ids, labels=labels, use_cache=False)
        return out.loss, out.logits


def _check_fused(module, inputs, vocab):
    c = compile_stages(module, inputs)
    assert "lmhead_ce_partials" in [f.rule for f in c.fired]
    rows = BATCH * SEQ
    heads = [s for s in c.plan.steps if s.family == "gemm" and s.gemm.partials]
    assert len(heads) == 1
    assert [c.graph[o].type.shape for o in heads[0].outputs] == [(rows, -(-vocab // W))] * 3
    for step in c.plan.steps:
        for name in list(step.inputs) + list(step.outputs):
            n = c.graph[name]
            logits = n.type.shape[-1:] == (vocab,) and n.type.numel == rows * vocab
            assert isinstance(n, ir.Weight) or not logits, f"{step.name} moves the logits {name}"
    _, gemms = lower_plan(c.graph, c.plan)
    head = gemm_sm90.render(gemms[heads[0].name].problem())  # (with the final norm's row scale)
    assert nvrtc.compile_cuda(head.source, head.name, "sm_90a").info.clean
    prog = tilefuse.compile(module, inputs)
    # a scalar loss is judged over VALUES draws of ids and labels (check.draws_needed): on one,
    # PyTorch's own error is near 0 by luck at times, and the bound with it
    outs, refs, eagers = [], [], []
    for k in range(VALUES):
        ids, labels = _draw(vocab, 100 + k)
        with torch.no_grad():
            eagers.append(module(ids, labels).reshape(()))
        outs.append(prog(ids, labels).reshape(()))
        refs.append(float64_reference(module, (ids, labels)).reshape(()))
    res = compare_draws("loss", outs, refs, eagers)
    assert res.ok, res


@pytest.mark.parametrize("name,vocab", [("llama", 384), ("llama", 300), ("gpt2", 257)])
def test_transformers_loss_runs_on_the_partials(name, vocab):
    b, labels = _build(name, vocab)
    _check_fused(b.model, (b.inputs[0], labels), vocab)


@pytest.mark.parametrize("shift", [False, True])
def test_a_users_own_loss_over_the_logits_runs_on_the_partials(shift):
    b, labels = _build("llama", 300)
    _check_fused(UserLoss(b.model.hf, shift), (b.inputs[0], labels), 300)


def test_returned_logits_are_written_and_the_rule_does_not_fire():
    b, labels = _build("llama", 300)
    m = LossAndLogits(b.model.hf)
    c = compile_stages(m, (b.inputs[0], labels))
    assert "lmhead_ce_partials" not in [f.rule for f in c.fired]
    assert not any(s.gemm.partials for s in c.plan.steps if s.family == "gemm")
    logits = c.graph.outputs[1]
    assert c.graph[logits].type.shape == (BATCH, SEQ, 300)
    assert any(s.family == "gemm" and logits in s.outputs for s in c.plan.steps)

"""rewrites.tanh_halves_as_sigmoids: (0.5 a)(1 + tanh(u)) computed as a sigmoid(2u). GPT-2's GELU
(transformers' NewGELUActivation) takes it, inside the GEMM epilogue after c_fc; the rewritten
programs pass the 2x rule against float64; products the pattern does not own stay as written."""
from __future__ import annotations

import math

import pytest
import torch

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.graph import ir


def _ops(p):
    return [n.op for n in p.graph.nodes if isinstance(n, ir.Map)]


FORMS = {
    "NewGELU": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "operands swapped": lambda x: (1.0 + torch.tanh(x * 0.8)) * (x * 0.5),
    "a different a": lambda x: (0.5 * torch.exp(x)) * (torch.tanh(x - 1) + 1.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_half_one_plus_tanh_becomes_a_sigmoid(form, dtype):
    fn = FORMS[form]
    x = torch.randn(64, 96, dtype=dtype) * 3
    p = tilefuse.compile(fn, (x,))
    assert "tanh" not in _ops(p) and "sigmoid" in _ops(p), str(p.graph)
    c = compare(form, p(x), float64_reference(fn, (x,)), fn(x))
    assert c.ok, c


def test_a_tanh_read_elsewhere_or_a_factor_other_than_a_half_stays():
    x = torch.randn(32, 48)
    for fn in (lambda x: (0.5 * x * (1.0 + torch.tanh(x)), torch.tanh(x)),  # (the tanh is returned)
               lambda x: 0.25 * x * (1.0 + torch.tanh(x)),
               lambda x: 0.5 * x * (2.0 + torch.tanh(x))):
        p = tilefuse.compile(fn, (x,))
        assert "tanh" in _ops(p), str(p.graph)


def test_gpt2_mlp_runs_its_gelu_as_a_sigmoid_in_the_gemm_epilogue():
    from transformers.activations import NewGELUActivation

    m = torch.nn.Sequential(torch.nn.Linear(128, 512), NewGELUActivation(), torch.nn.Linear(512, 128))
    m = m.to(torch.bfloat16).eval()
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    p = tilefuse.compile(m, (x,))
    gemms = [s for s in p.plan.steps if s.family == "gemm"]
    assert len(gemms) == 2 and [s.family for s in p.plan.steps if s.family not in ("gemm", "alias")] == [], str(p.plan)
    assert any(p.graph[n].op == "sigmoid" for n in gemms[0].nodes if isinstance(p.graph[n], ir.Map)), str(p.plan)
    with torch.no_grad():
        c = compare("mlp", p(x), float64_reference(m, (x,)), m(x))
    assert c.ok, c

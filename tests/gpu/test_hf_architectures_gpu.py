"""Transformers architectures that no other GPU test covers (Llama, Qwen2 and GPT-2 are in
test_programs_gemm_gpu.py and test_gemm_partials_gpu.py) through
`torch.compile(model, backend="tilefuse")` on a GPU, at sizes that make the generated GEMM path
real: bf16, hidden 512, 2 layers, seq 256, batch 2 (512-row GEMMs), vocab 2048 (1997 for OPT:
a tail in N).

Property, per architecture (the model table and the procedure: tests/cpu/hf_arch_fixtures.py,
shared with the CPU twin tests/cpu/test_hf_architectures.py): a random bf16 model, 1-D
parameters perturbed, compiled by the backend and called on 16 input draws (all but the first
with poisoned outputs, on the CUDA-graph replay path; the first call's results checked after
them), gives logits (last hidden state and pooler output for BERT) within DESIGN.md's 2x rule
of a float64 reference on every draw, and a causal LM's loss within the rule as the vector of
its values over the draws (on one scalar alone the rule fails correct programs:
hf_arch_fixtures.py says why); and the model really ran in tilefuse: every dynamo graph
compiled by tilefuse and run there on every call (no run-time fallback to eager), no graph
break, at least four generated GEMMs per layer plus the head, no matmul of a weight left to
cuBLAS.

DEVICE / SIZES / DRAWS are module-level so that the same code can be dry-run on the CPU (device
"cpu", SIZES = hf_arch_fixtures.TINY) by a script that sets them and calls the test; the CPU
twin runs the same helpers at those sizes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the models need transformers (pip install 'tilefuse[models]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from hf_arch_fixtures import (ARCHS, GPU, VALUES, assert_checks_pass, assert_ran_in_tilefuse,  # noqa: E402
                              run_architecture)

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("generated GEMMs need an sm_80 or newer GPU", allow_module_level=True)

DEVICE = "cuda"
SIZES = GPU
DRAWS = VALUES  # tilefuse.check.VALUES (16): the draws a scalar loss is judged over


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_matches_float64_and_runs_in_tilefuse(name):
    """See the module docstring; the architecture's distinctive features: ARCHS[name].note."""
    run = run_architecture(name, SIZES, DEVICE, draws=DRAWS)
    assert_checks_pass(run)
    assert_ran_in_tilefuse(run)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

"""Kernels shared between the programs of one process (runtime.program._SHARED).

Properties: two programs of one computation hold the same compiled GEMM and map-reduce
kernels (the second renders nothing); GEMMs of equal sizes whose epilogues differ (one
output, or the pre-activation stored too) are never confused, and each program's results
pass the 2x rule against a float64 reference, outputs poisoned first.
"""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.check import compare, flatten, float64_reference

pytestmark = pytest.mark.gpu


def _plain(x, w):
    return x @ w.t()


def _two_outputs(x, w):
    h = x @ w.t()
    return h, F.relu(h)


def _norm_then_matmul(x, w):
    return F.rms_norm(x, (x.shape[-1],)) @ w.t()


def _check(fn, inputs):
    prog = tilefuse.compile(fn, inputs)
    prog.poison = True
    for _ in range(2):  # the thin path, then the CUDA-graph replay
        out = flatten(prog(*inputs))
        ref, eager = flatten(float64_reference(fn, inputs)), flatten(fn(*inputs))
        for i, (o, r, e) in enumerate(zip(out, ref, eager)):
            c = compare(f"{fn.__name__}[{i}]", o, r, e)
            assert c.ok, c
    return prog


def _compiled(prog) -> set:
    return {id(k) for k in prog._compiled.values()}


def test_programs_of_one_computation_share_their_compiled_kernels():
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    a, b = _check(_norm_then_matmul, (x, w)), _check(_norm_then_matmul, (x, w))
    assert {s.family for s in a.plan.steps} >= {"gemm"}
    assert _compiled(a) and _compiled(a) == _compiled(b)


@pytest.mark.parametrize("order", [(_plain, _two_outputs), (_two_outputs, _plain)])
def test_gemms_of_equal_sizes_with_other_epilogues_are_not_confused(order):
    x = torch.randn(128, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    progs = [_check(fn, (x, w)) for fn in order]
    gemms = [[k for k in p._compiled.values() if hasattr(k, "problem")] for p in progs]
    assert all(len(g) == 1 for g in gemms)
    assert gemms[0][0] is not gemms[1][0]

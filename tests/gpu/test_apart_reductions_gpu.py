"""Reductions over dims that are not neighbours (rules/apart_reductions.py) on the GPU: a run of
dims at a time, a variance's second moment from each row's own (one pass over x), BatchNorm's
batch statistics, 16-bit and f32, odd sizes. Outputs poisoned, the 2x rule against float64, in
the thin call and in the CUDA-graph replays; no step of the plan left to PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _bn(x, w, b):
    return F.relu(F.batch_norm(x, None, None, w, b, training=True))


CASES = [
    ("mean over N, H, W", lambda x: x.mean((0, 2, 3)), (32, 64, 56, 56)),
    ("sum over B and D", lambda x: x.sum((0, 2), keepdim=True), (8, 1000, 1031)),
    ("amax over N, H, W", lambda x: x.amax((0, 2, 3)), (16, 48, 37, 45)),
    ("variance over N, H, W", lambda x: x.var((0, 2, 3)), (32, 64, 56, 56)),
    ("var_mean over N, L", lambda x: torch.var_mean(x, (0, 2), correction=0), (64, 96, 1000)),
    ("std, odd sizes", lambda x: x.std((0, 2, 3), keepdim=True), (9, 33, 61, 67)),
    ("variance over few long columns, in pieces", lambda x: x.var(0), (8192, 4096)),
    ("var_mean over dim 1, in pieces", lambda x: torch.var_mean(x, 1, keepdim=True), (4, 8192, 1000)),

]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name,fn,shape", CASES, ids=[c[0] for c in CASES])
def test_reduction_in_runs_matches_float64(name, fn, shape, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(3)
    x = (torch.randn(*shape, device="cuda") * 2 + 0.5).to(dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert any(n.name.endswith(("_run", "_within")) or "_run_" in n.name for n in prog.graph.nodes), str(prog.graph)
    assert all(s.family == "mapreduce" for s in prog.plan.steps if s.family != "alias" and not s.view), str(prog.plan)
    assert not any(s.family == "extern" for s in prog.plan.steps), str(prog.plan)
    ref, eager = float64_reference(fn, (x,)), fn(x)
    outs = lambda o: o if isinstance(o, tuple) else (o,)  # noqa: E731
    for call in range(3):
        for i, (got, r, e) in enumerate(zip(outs(prog(x)), outs(ref), outs(eager))):
            c = compare(f"{name} call {call} out {i}", got, r, e)
            assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(32, 64, 56, 56), (16, 40, 37, 47), (8, 32, 16, 32, 32)], ids=str)
def test_batch_norm_batch_statistics(shape, dtype):
    """F.batch_norm(training=True) without running statistics, then ReLU: statistics in one pass,
    their finish, the normalisation: three or four kernels, no PyTorch op."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(5)
    C = shape[1]
    x = (torch.randn(*shape, device="cuda") + 1).to(dtype)
    w = (torch.rand(C, device="cuda") + 0.5).to(dtype)
    b = torch.randn(C, device="cuda").to(dtype)
    prog = tilefuse.compile(_bn, (x, w, b), graphs=True)
    prog.poison = True
    assert not any(s.family == "extern" for s in prog.plan.steps), str(prog.plan)
    ref, eager = float64_reference(_bn, (x, w, b)), _bn(x, w, b)
    for call in range(3):
        c = compare(f"batch norm call {call}", prog(x, w, b), ref, eager)
        assert c.ok, c

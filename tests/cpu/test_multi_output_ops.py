"""Ops with several results: max/min along a dim give (values, indices), the values a row
reduction in tilefuse's kernels and the indices PyTorch's argmax/argmin as a visible extern;
var_mean/std_mean give (variance or std, mean) as reductions. Each result equals eager's, NaN
rows included (the max is NaN there and its index the NaN's), at every dtype and keepdim."""
import pytest
import torch

import tilefuse
from tilefuse.graph import ir

CASES = {
    "max_last": lambda x: x.max(-1),
    "max_values_only": lambda x: x.max(dim=1).values * 2,
    "min_first_keep": lambda x: torch.min(x, 0, keepdim=True),
    "max_all": lambda x: x.max() + 1,
    "min_all": lambda x: x.min(),
    "max_of_two": lambda x: torch.max(x, x.flip(0)),
    "var_mean_keep": lambda x: torch.var_mean(x, -1, keepdim=True, correction=0),
    "std_mean": lambda x: torch.std_mean(x, 1),
    "layernorm_by_hand": lambda x: (lambda v, m: (x - m) * torch.rsqrt(v + 1e-5))(
        *torch.var_mean(x, -1, keepdim=True, unbiased=False)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_multi_result_op_matches_eager(name, dtype):
    fn = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(5, 7).to(dtype)
    with torch.no_grad():
        prog = tilefuse.compile(fn, (x,))
        fresh = torch.randn(5, 7).to(dtype)
        fresh[2, 3] = float("nan")
        got, want = torch.utils._pytree.tree_leaves(prog(fresh)), torch.utils._pytree.tree_leaves(fn(fresh))
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)


def test_the_indices_of_a_max_along_the_last_dim_are_a_second_reduction_in_its_kernel():
    x = torch.randn(3, 4)
    prog = tilefuse.compile(lambda x: x.max(-1), (x,))
    assert not any(isinstance(n, ir.Extern) for n in prog.stages.graph.nodes), str(prog.stages.graph)
    assert sorted(n.op for n in prog.stages.graph.nodes if isinstance(n, ir.Reduce)) == ["max", "min"]
    assert [s.family for s in prog.plan.steps if s.family != "alias"] == ["mapreduce"], str(prog.plan)
    got, want = prog(x), x.max(-1)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


def test_the_indices_of_a_max_over_another_dim_are_an_explicit_argmax_extern():
    prog = tilefuse.compile(lambda x: x.max(0), (torch.randn(3, 4),))
    externs = [n for n in prog.stages.graph.nodes if isinstance(n, ir.Extern)]
    assert [n.target for n in externs] == ["aten.argmax.default"]
    assert any(isinstance(n, ir.Reduce) and n.op == "max" for n in prog.stages.graph.nodes)


def test_only_the_values_of_a_max_leave_no_extern():
    prog = tilefuse.compile(lambda x: x.max(-1).values, (torch.randn(3, 4),))
    assert not any(isinstance(n, ir.Extern) for n in prog.stages.graph.nodes)

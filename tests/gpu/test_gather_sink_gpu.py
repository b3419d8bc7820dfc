"""A mixture of experts' combine on a GPU (rules/gather_sink.py): expert rows masked and scaled
by their routing weights, put back in token order and each token's top-k summed, in one kernel that
reads the experts' 16-bit rows at their gathered positions; against a float64 reference (the
2x rule), outputs poisoned, fresh permutations each call, in the thin call and replays."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _root(g, name):
    """The tensor under a chain of views (a kernel reads the rows through a reshape of them)."""
    from tilefuse.graph import ir

    while isinstance(g[name], ir.View):
        name = g[name].arg
    return name


def _combine(k):
    def fn(y, w, inv):
        # (the mask of rows whose expert is not local, as transformers 5.17 writes it: a bool a row)
        return (torch.where(w > 0.1, y.float(), 0.0) * w)[inv].view(-1, k, y.shape[-1]).sum(1).to(y.dtype)
    return fn


@pytest.mark.parametrize("tokens, k, d", [(4096, 2, 2048), (333, 4, 72), (1, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_combine_matches_the_reference(tokens, k, d, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(5)
    fn = _combine(k)
    y = torch.randn(tokens * k, d, device="cuda", dtype=dtype)
    w = torch.rand(tokens * k, 1, device="cuda")
    prog = tilefuse.compile(fn, (y, w, torch.randperm(tokens * k, device="cuda")), graphs=True)
    prog.poison = True
    kernels = [s for s in prog.plan.steps if s.family != "alias" and not s.view]
    assert {s.family for s in kernels} == {"mapreduce"}, str(prog.plan)
    # one kernel reads the expert rows, and it writes the result (the mask's f32 table, a value
    # a row, is a kernel of its own here: in a model the kernel that computes the mask writes it)
    (rows,) = [s for s in kernels if any(_root(prog.graph, a) == prog.graph.inputs[0] for a in s.inputs)]
    assert rows.outputs == list(prog.graph.outputs), str(prog.plan)
    for call in range(3):
        inv = torch.randperm(tokens * k, device="cuda")
        c = compare(f"combine call {call}", prog(y, w, inv), float64_reference(fn, (y, w, inv)), fn(y, w, inv))
        assert c.ok, c

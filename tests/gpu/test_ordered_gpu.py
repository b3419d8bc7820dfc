"""topk and sort on a GPU (frontend/aten.py _ordered): the order from PyTorch's own op, the
values gathered in a kernel; a mixture of experts' router (softmax, top-2, renormalised) and
sorts of floats and of integer ids with ties, outputs poisoned, fresh inputs each call, through
the program's CUDA graph: the chosen experts and the sorted indices equal eager's exactly, the
values equal eager's (gathered copies) or, for the router's renormalised weights, pass the 2x
rule against a float64 reference."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _router(x):
    v, i = torch.topk(torch.softmax(x.float(), -1), 2, dim=-1)
    return (v / v.sum(-1, keepdim=True)).to(x.dtype), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("experts", [8, 64])
def test_router_top2_matches_eager_choices_and_the_reference(experts, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(3)
    x = torch.randn(4096, experts, device="cuda", dtype=dtype)
    prog = tilefuse.compile(_router, (x,), graphs=True)
    prog.poison = True
    for call in range(3):
        x = torch.randn(4096, experts, device="cuda", dtype=dtype)
        (w, i), (w0, i0) = prog(x), _router(x)
        assert torch.equal(i, i0), f"call {call}: {(i != i0).any(-1).sum().item()} rows chose other experts"
        c = compare(f"router[{call}]", w, float64_reference(_router, (x,))[0], w0)
        assert c.ok, c


@pytest.mark.parametrize("case", ["topk 2-D", "sort floats", "sort ids stable", "sort descending dim 0"])
def test_topk_and_sort_equal_eager(case):
    import tilefuse

    fns = {
        "topk 2-D": lambda x, e: torch.topk(x, 7, dim=-1),
        "sort floats": lambda x, e: torch.sort(x * 2),
        "sort ids stable": lambda x, e: torch.sort(e, stable=True),
        "sort descending dim 0": lambda x, e: torch.sort(x, dim=0, descending=True),
    }
    fn = fns[case]
    torch.manual_seed(5)
    make = lambda: (torch.randn(300, 130, device="cuda", dtype=torch.bfloat16),  # noqa: E731
                    torch.randint(0, 16, (4096,), device="cuda"))
    prog = tilefuse.compile(fn, make(), graphs=True)
    prog.poison = True
    for call in range(3):
        ins = make()
        for g, w in zip(prog(*ins), fn(*ins)):
            assert g.dtype == w.dtype and torch.equal(g, w), f"call {call}"

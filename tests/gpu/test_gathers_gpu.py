"""Gathers computed in map-reduce kernels on a GPU (graph/fusion.py gathers_in, loop/lower.py
emit_gather): embeddings with the norm after them in one kernel (short rows, 4096, and rows
long enough for a cluster), index_select, x[idx] with negative indices, torch.gather along
the row, against a float64 reference (the 2x rule; a gather alone copies exactly), outputs
poisoned, in the thin call and replays; an index out of range gives NaN in its row."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

CASES = {  # fn, table shape, index shape, index range
    "embedding": (lambda w, i: F.embedding(i, w) * 2, (1000, 256), (3, 17), 1000),
    "embedding+rmsnorm": (lambda w, i: F.rms_norm(F.embedding(i, w).float(), (4096,)), (32000, 4096), (2, 100), 32000),
    "embedding+layernorm": (lambda w, i: F.layer_norm(F.embedding(i, w), (2048,)), (5000, 2048), (130,), 5000),
    "embedding long rows": (lambda w, i: torch.softmax(F.embedding(i, w).float(), -1), (64, 65536), (12,), 64),
    "index_select rows": (lambda w, i: w.index_select(0, i) + 1, (300, 72), (50,), 300),
    "index_select columns": (lambda w, i: torch.sigmoid(w.index_select(1, i)), (96, 300), (77,), 300),
    "x[i] negative": (lambda w, i: w[i - 150].exp(), (300, 40), (4, 9), 300),
    "gather along the row": (lambda w, i: torch.gather(w, 1, i.expand(w.shape[0], -1)) * 3, (64, 1000), (1, 999), 1000),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_kernels_match_the_reference(case, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, wshape, ishape, n = CASES[case]
    torch.manual_seed(4)
    w = torch.randn(wshape, device="cuda", dtype=dtype)
    i = torch.randint(0, n, ishape, device="cuda")
    prog = tilefuse.compile(fn, (w, i), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    for call in range(3):
        i = torch.randint(0, n, ishape, device="cuda")  # fresh ids each call: nothing cached
        c = compare(f"{case} call {call}", prog(w, i), float64_reference(fn, (w, i)), fn(w, i))
        assert c.ok, c


def test_a_token_id_out_of_range_gives_nan_in_its_row_only():
    import tilefuse

    w = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    fn = lambda w, i: F.rms_norm(F.embedding(i, w).float(), (512,))  # noqa: E731
    prog = tilefuse.compile(fn, (w, torch.zeros(6, dtype=torch.long, device="cuda")))
    i = torch.tensor([0, 999, 1000, -1, 5, 1 << 40], device="cuda")
    got = prog(w, i)
    assert got[[2, 3, 5]].isnan().all()
    ok = torch.tensor([0, 1, 4], device="cuda")
    torch.testing.assert_close(got[ok], fn(w, i[ok]), rtol=2e-3, atol=2e-3)

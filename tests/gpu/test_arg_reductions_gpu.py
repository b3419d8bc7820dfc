"""argmax / argmin and max / min along the last dim (frontend/aten.py `_arg_index`) on the GPU:
one map-reduce kernel, outputs poisoned first, indices equal to eager CUDA's exactly (first of
ties, first NaN), at a vocabulary-sized row, a short row and an odd one, in every float dtype."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2048, 32000), (4096, 256), (7, 4097), (3, 1)], ids=str)
@pytest.mark.parametrize("name", ["argmax", "min_dim", "argmax_all"])
def test_arg_reductions_equal_eagers_indices(name, shape, dtype):
    import tilefuse

    fn = {"argmax": lambda x: x.argmax(-1), "min_dim": lambda x: torch.min(x, -1), "argmax_all": lambda x: x.argmax()}[name]
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * 3).round().to(dtype)  # rounded: many ties
    x[0, -1] = float("nan")
    if shape[0] > 2:
        x[2, 0] = x[2, -1] = float("nan")
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    from tilefuse.frontend.aten import arg_lowered
    # (an argmax of a whole tensor is one row: past a split row's length it is PyTorch's)
    lowered = arg_lowered((x.numel(),), 0) if name == "argmax_all" else arg_lowered(tuple(x.shape), x.dim() - 1)
    want_steps = ["mapreduce"] if lowered else ["extern"]
    assert [s.family for s in prog.plan.steps if s.family != "alias"] == want_steps, str(prog.plan)
    for call in range(2):
        got, want = prog(x), fn(x)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)

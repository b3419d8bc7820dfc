"""GPT-2's MLP (Conv1D: addmm on the rows, viewed back; tanh GELU; Conv1D) compiled for the GPU,
the GELU moved above the view into the first GEMM's epilogue (rules/row_views.py): outputs
under the 2x rule against float64, outputs poisoned, thin call and CUDA-graph replay."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("lead,d,f", [((2, 1000), 768, 3072), ((1, 37), 128, 512), ((4, 256), 1024, 4096)])
def test_conv1d_mlp_with_gelu_in_the_epilogue(lead, d, f):
    import tilefuse
    from test_coda_row_views import Conv1DMLP
    from tilefuse.check import compare, float64_reference

    torch.manual_seed(0)
    m = Conv1DMLP(d, f).cuda().to(torch.bfloat16).eval()
    x = torch.randn(*lead, d, device="cuda", dtype=torch.bfloat16)
    prog = tilefuse.compile(m, (x,))
    prog.poison = True
    assert "maps_before_row_views" in [r.rule for r in prog.stages.fired]
    assert [s.family for s in prog.plan.steps if s.family != "alias"] == ["gemm", "gemm"]
    ref = float64_reference(m, (x,))
    with torch.no_grad():
        eager = m(x)
    for call in range(2):
        c = compare(f"mlp call{call}", prog(x), ref, eager)
        assert c.ok, c

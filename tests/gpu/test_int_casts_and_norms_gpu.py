"""The cases of tests/cpu/test_int_casts_and_norms.py as generated CUDA kernels, against eager
on the GPU: float to uint8 through int64 (special values included: inf and NaN convert as the
GPU's own conversion to int64 gives them), 8-bit max/min/relu, cluster-wide reductions of bool,
uint8 and int8 rows, integer and bool matmuls (no cuBLAS for them), lowered norms. Outputs are
poisoned before each run; dtypes, shapes and values are eager's."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_int_casts_and_norms import CASES  # noqa: E402
from test_scalars_gpu import _as_eager_on_the_gpu  # noqa: E402

import tilefuse  # noqa: E402
from tilefuse.frontend.capture import CaptureError  # noqa: E402

pytestmark = pytest.mark.gpu
SIZE_1 = "torch.norm over a size-1 dim"


@pytest.mark.parametrize("name,fn,inputs", [c for c in CASES if c[0] != SIZE_1],
                         ids=[c[0] for c in CASES if c[0] != SIZE_1])
def test_same_dtype_and_values_as_eager_on_the_gpu(name, fn, inputs):
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(inputs[0].dtype, 1e-6)
    _as_eager_on_the_gpu(name, fn, inputs, rtol=rtol)


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool])
def test_special_values_convert_as_eager_on_the_gpu(src, dst):
    x = torch.tensor([-1.5, -129.0, -300.7, 255.9, 256.0, 300.7, 1e10, -1e10, math.inf, -math.inf, math.nan,
                      127.9, 128.0, -128.9, 3e9, -0.0]).to(src)
    _as_eager_on_the_gpu(f"{src} to {dst}", lambda x: x.to(dst), (x,), rtol=0)


def test_a_norm_over_a_size_1_dim_is_as_eager_or_refused_where_torch_export_mistypes_it():
    """PyTorch 2.11's shape function for linalg_vector_norm keeps a reduced dim of size 1
    ((16, 1, 7) for (16, 7)); 2.13's does not. Either eager's result, or a one-line refusal."""
    (_, fn, inputs), = [c for c in CASES if c[0] == SIZE_1]
    x = inputs[0].cuda()
    try:
        prog = tilefuse.compile(fn, (x,))
    except CaptureError as e:
        assert "keeps a reduced dim of size 1" in str(e) and "keepdim=True" in str(e)
        return
    torch.testing.assert_close(prog(x), fn(x), rtol=1e-6, atol=0)

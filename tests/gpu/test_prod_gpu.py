"""Products (`torch.prod`) as map-reduce kernels on the GPU: a row per sub-warp, warp or CTA,
rows staged or streamed, columns, long rows reduced in pieces; `cumprod` over few long rows in
pieces. No PyTorch op; outputs poisoned first; the thin call and CUDA-graph replays. Float
products within DESIGN.md's 2x rule of a float64 reference; integer products (int64, wrapping)
equal eager bit for bit."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {  # name: (fn, shapes, kernels at most)
    "row": (lambda x: (1 + 0.01 * x).prod(-1), [(8192, 4096), (5, 33), (300, 7), (512, 128), (64, 20000)], 1),
    "row keepdim, divided": (lambda x: x / (1 + 0.01 * x).prod(-1, keepdim=True), [(1024, 4096), (3, 77)], 1),
    "columns": (lambda x: (1 + 0.01 * x).prod(0), [(64, 65536)], 1),
    "long rows (split)": (lambda x: (1 + 1e-4 * x).prod(-1), [(2, 1 << 20), (1 << 20,)], 2),
    "cumprod (split)": (lambda x: (1 + 1e-4 * x).cumprod(-1), [(2, 65536), (1, 128256)], 4),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,shape", [(n, s) for n in CASES for s in CASES[n][1]],
                         ids=[f"{n}-{'x'.join(map(str, s))}" for n in CASES for s in CASES[n][1]])
def test_products_match_eager_on_the_gpu(name, shape, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, _, most = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    assert 1 <= len([s for s in prog.plan.steps if s.family == "mapreduce"]) <= most, str(prog.plan)
    want, ref = fn(x), float64_reference(fn, (x,))
    for call in range(3):
        check = compare(f"call {call}", prog(x), ref, want)
        assert check.ok, check


@pytest.mark.parametrize("fn", [lambda e: e.prod(-1), lambda e: (e > 0).prod(-1), lambda e: e.t().to(torch.int32).prod(0)],
                         ids=["i64", "bool", "i32 columns"])
def test_integer_products_equal_eager_bit_for_bit(fn):
    import tilefuse

    torch.manual_seed(0)
    e = torch.randint(-3, 4, (40000, 40), device="cuda")
    e[0] = 3  # 3^40 wraps int64, as eager's does
    prog = tilefuse.compile(fn, (e,))
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    got, want = prog(e), fn(e)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)

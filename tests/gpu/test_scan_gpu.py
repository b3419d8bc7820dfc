"""Scans (cumsum, cumprod, cummax / cummin values) as map-reduce kernels on the GPU
(codegen/scan.py): a row per sub-warp, warp, CTA of several warps, several rows per CTA, and
long rows streamed tile by tile; maps before and after the scan in the same kernel; few long
rows split into pieces (rewrites.split_long_scans); column kernels for other dims. No PyTorch
op; outputs poisoned first; the thin call and CUDA-graph replays. A running max or min and an
integer sum round nothing and equal eager CUDA bit for bit; a float sum or product is within
DESIGN.md's 2x rule of a float64 reference (PyTorch's CUDA scan rounds in its own order too)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {  # name: (fn, shapes, rounds)
    "cumsum": (lambda x: x.cumsum(-1), [(8192, 4096), (5, 33), (7, 3), (3, 1000), (512, 128), (2, 70001),
                                        (4, 65536), (2, 65537)], True),  # (65537: prime, streamed whole)
    "cumsum maps": (lambda x: (x * 2 + 1).cumsum(-1).sigmoid() - x, [(1024, 4096), (3, 77)], True),
    "cumsum 3-d dim 1": (lambda x: x.cumsum(1) * 0.5, [(8, 512, 1), (3, 9, 1)], True),
    "cumprod": (lambda x: (1 + 0.01 * x).cumprod(-1), [(256, 4096), (5, 33)], True),
    "cummax": (lambda x: torch.cummax(x, -1)[0], [(512, 4096), (5, 33), (2, 70001), (300, 70001)], False),
    "cummin minus": (lambda x: x - torch.cummin(x, -1).values, [(512, 2048), (9, 15)], False),
    "position ids": (lambda x: (x > 0).long().cumsum(-1) - 1, [(64, 8192), (3, 17)], False),
    "softmax then cumsum": (lambda x: x.softmax(-1).cumsum(-1), [(1024, 4096), (5, 33), (300, 20000)], True),
    "cumsum over the sum": (lambda x: x.cumsum(-1) / x.abs().sum(-1, keepdim=True), [(512, 2048), (3, 100)], True),
    "cummax minus itself": (lambda x: (lambda y: torch.cummax(y, -1)[0] - y)(x * 1.37 + 0.1), [(256, 1024), (5, 40)],
                            True),
    "vocab cumsum (split)": (lambda x: x.softmax(-1).cumsum(-1), [(1, 128256), (3, 20000)], True),
    "cummax (split)": (lambda x: torch.cummax(x, -1)[0] * 2, [(2, 65536), (40000,)], False),
    "maps after a split cumsum": (lambda x: x.cumsum(-1) * 0.5 - x, [(2, 65536), (1, 128256)], True),
    "cumprod (split)": (lambda x: (1 + 1e-4 * x).cumprod(-1), [(2, 65536), (1, 128256)], True),
    "maps of maps after a split cumsum": (lambda x: (lambda y: y.exp() * 1e-3 * y)(x.cumsum(-1) * 0.01),
                                          [(2, 65536)], True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,shape", [(n, s) for n in CASES for s in CASES[n][1]],
                         ids=[f"{n}-{'x'.join(map(str, s))}" for n in CASES for s in CASES[n][1]])
def test_scans_match_eager_on_the_gpu(name, shape, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn, _, rounds = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    kernels = [s for s in prog.plan.steps if s.family == "mapreduce"]
    # (few long rows: rewrites.split_long_scans; its pieces' kernel may read a map's reshape, the
    # softmax's division moved into the pieces, so the split is told by its nodes' names)
    split = any("_piece" in n for s in kernels for n in s.nodes)
    assert len(kernels) == 1 or split, str(prog.plan)
    want = fn(x)
    ref = float64_reference(fn, (x,)) if rounds else want
    for call in range(3):
        got = prog(x)
        if rounds:
            check = compare(f"call {call}", got, ref, want)
            assert check.ok, check
        else:
            assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape,dim", [((8, 1024, 4096), 1), ((4096, 64), 0), ((3, 77, 5), 1), ((2, 3, 40, 9), 2)],
                         ids=["seq", "dim0", "odd", "4d"])
def test_scans_along_another_dim_are_column_kernels(shape, dim, dtype, monkeypatch):
    """x.cumsum(dim) with dims after it: a column kernel, a row a thread (TILEFUSE_COLUMN_MIN_ROWS=1
    lets the small shapes take one too), maps around it in the kernel; eager's values (2x rule)."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    monkeypatch.setenv("TILEFUSE_COLUMN_MIN_ROWS", "1")
    fn = lambda x: (x * 2).cumsum(dim) * 0.5 + x  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    ref, want = float64_reference(fn, (x,)), fn(x)
    for call in range(3):
        check = compare(f"call {call}", prog(x), ref, want)
        assert check.ok, check


def test_a_tuned_scan_schedule_is_checked_against_eager():
    """Every schedule the scan renders for (the stream stage at several unrolls, rows per
    sub-warp, warp and CTA) gives the same cummax as eager."""
    import tilefuse
    from tilefuse.codegen.mapreduce import MapReduceSchedule
    from tilefuse.runtime.launch import compile_kernel

    x = torch.randn(33, 3000, device="cuda", dtype=torch.bfloat16)
    fn = lambda x: torch.cummax(x * 2, -1)[0]  # noqa: E731
    prog = tilefuse.compile(fn, (x,))
    (lw,) = prog.kernels.values()
    want = fn(x)
    for sch in [MapReduceSchedule(threads=512, group=512, vector=8, stage="stream", unroll=u) for u in (1, 2, 4)] + [
            MapReduceSchedule(threads=256, group=g, vector=v, stage="regs") for g, v in ((32, 8), (64, 8), (256, 4))]:
        out = torch.full_like(want, float("nan"))
        ck = compile_kernel(lw.kernel, schedule=sch)
        assert ck.info.clean, f"{sch}: {ck.info}"
        ck(x, out)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"{sch}: {(out != want).sum().item()} elements differ"


@pytest.mark.parametrize("shape", [(64, 4096), (64, 100), (2, 70001)], ids=str)
def test_a_scan_of_six_f32_streams_matches_eager(shape):
    """Six f32 inputs combined before the scan: wide staged streams, fewer chunks a thread
    (codegen/scan.py default_schedule; four a thread held 96 registers and did not build)."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn = lambda a, b, c, d, e, f: (a * b + c * d + e * f).cumsum(-1)  # noqa: E731
    torch.manual_seed(0)
    xs = tuple(torch.randn(shape, device="cuda") for _ in range(6))
    prog = tilefuse.compile(fn, xs)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    check = compare("out", prog(*xs), float64_reference(fn, xs), fn(*xs))
    assert check.ok, check

"""F.pad read as a stream (codegen/mapreduce.py `_clamped_column`), on the GPU: the padded tensor,
its output poisoned first, equals eager's bit for bit (a pad rounds nothing), for pads by whole
chunks (vector loads, element loads at the edge's chunks), pads by part of a chunk (element loads),
replicate and crop, in every float dtype, in the thin call and CUDA-graph replays; and a kernel
staged in shared memory (cp.async) that loads the pad in its pass."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PADS = [((0, 96), "constant", None), ((16, 8), "constant", -2.5), ((8, 16), "replicate", None),
        ((-8, 24), "constant", 1.0), ((1, 7), "constant", None), ((3, 5), "replicate", None),
        ((0, 8, 2, 1), "constant", 0.5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("pads,mode,value", PADS, ids=[f"{p}-{m}" for p, m, _ in PADS])
@pytest.mark.parametrize("shape", [(4096, 4000), (3, 5, 40)], ids=str)
def test_a_padded_tensor_equals_eager_bit_for_bit(shape, pads, mode, value, dtype):
    import tilefuse

    fn = lambda x: F.pad(x, pads, mode=mode, value=value) if mode == "constant" else F.pad(x, pads, mode=mode)  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    kernels = [s.family for s in prog.plan.steps if s.family not in ("alias",) and not s.view]
    assert kernels == ["mapreduce"] * (len(pads) // 2), str(prog.plan)  # (a gather along each padded dim)
    want = fn(x)
    for call in range(3):  # the thin call, then CUDA-graph replays
        got = prog(x)
        assert got.shape == want.shape
        assert torch.equal(got, want), f"call {call}: {(got != want).sum().item()} elements differ"
    x.copy_(torch.randn_like(x))
    assert torch.equal(prog(x), fn(x))


@pytest.mark.parametrize("stage", ["smem", "regs", "stream"])
def test_a_norm_beside_a_pad_in_every_stage(stage):
    """The norm's row staged (shared memory, registers) or streamed; the pad's chunks loaded in
    the pass that reads them. Within the 2x rule of a float64 reference (DESIGN.md)."""
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen.mapreduce import default_schedule
    from tilefuse.runtime.launch import compile_kernel

    import tilefuse

    fn = lambda x, y: F.rms_norm(x, (4096,)) + F.pad(y, (0, 8))  # noqa: E731
    torch.manual_seed(1)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(300, 4088, device="cuda", dtype=torch.bfloat16)
    prog = tilefuse.compile(fn, (x, y))
    (lw,) = prog.kernels.values()
    sch = replace(default_schedule(lw.kernel), stage=stage)
    ck = compile_kernel(lw.kernel, schedule=sch)
    assert ck.info.clean, ck.info
    outs = ck.allocate_outputs()
    for t in outs.values():
        t.fill_(float("nan"))
    feeds = dict(zip([b.name for b in lw.kernel.params if b.role == "in"], (x, y)))  # (x's buffer, then y's table)
    assert [t.shape for t in feeds.values()] == [x.shape, y.shape]
    ck(*[feeds[b.name] if b.role == "in" else outs[b.name] for b in lw.kernel.params])
    torch.cuda.synchronize()
    (got,) = outs.values()
    check = compare(str(sch), got, float64_reference(fn, (x, y)), fn(x, y))
    assert check.ok, check

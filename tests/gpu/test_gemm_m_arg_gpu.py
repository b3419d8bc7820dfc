"""A GEMM that takes M as an argument, built once and run at several M: the second M's build
is a cubin-cache hit of the first's kernel, and every M's output is right (DESIGN.md's 2x
rule against float32, NaN-poisoned outputs, fresh random inputs), with whole and tail tiles,
split-K, stream-K, a cluster and an epilogue that reads operands."""
import pytest
import torch

from tilefuse.check import rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen.gemm_sm90 import GemmProblem, GemmSchedule
from tilefuse.runtime.gemm import compile_gemm

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("the sm_90a GEMM needs a Hopper GPU", allow_module_level=True)

SCHEDULES = {
    "128x256": GemmSchedule(128, 256, stages=4),
    "cluster_m2": GemmSchedule(128, 256, stages=4, cluster_m=2),
    "128x64_direct": GemmSchedule(128, 64, stages=8, tma_store=False),
    "split_k2": GemmSchedule(128, 128, stages=6, split_k=2),
    "stream_k": GemmSchedule(128, 128, stages=6, stream_k=132),
}


def _run(m, n, k, sched, fused):
    """(kernel, output, float32 reference, torch's bf16 result) at M = m."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref, lowp = a.float() @ b.float().T, a @ b.T
    tensors = {}
    ep = None
    if fused:
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ep = epi.standard(m, n, "bf16", bias="col", activation="gelu", residual=True)
        tensors = {"bias": bias, "residual": res}
        ref = torch.nn.functional.gelu(ref + bias.float()) + res.float()
        lowp = torch.nn.functional.gelu(lowp + bias) + res
    g = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=ep), sched)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(a, b, out=out, **tensors)
    torch.cuda.synchronize()
    return g, out, ref, lowp


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "bias_gelu_residual"])
@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("ms", [(2048, 3072, 4096), (2000, 2500, 3001)], ids=["whole", "tail"])
def test_one_build_runs_right_at_every_m(ms, sched, fused):
    n, k = 2048, 1024
    kernels = []
    for m in ms:
        g, out, ref, lowp = _run(m, n, k, SCHEDULES[sched], fused)
        assert g.source.m_arg, g.source.name
        assert torch.isfinite(out).all(), f"M={m}: NaN/inf in the output: an element was not written"
        err, base = rel_error(out.float(), ref), rel_error(lowp.float(), ref)
        assert err <= 2 * base + 1e-5, f"M={m}: error {err:.3e} vs torch's {base:.3e}"
        kernels.append(g)
    assert len({g.source.name for g in kernels}) == 1
    assert all(g.cache_hit for g in kernels[1:]), "a later M rebuilt the kernel"

"""Launch glue of runtime/launch.py without a GPU: which variant a set of pointers runs."""
import loop_fixtures as fx

from tilefuse.runtime.launch import CompiledKernel, compile_source_only


def _compiled(kernel):
    src, cubin = compile_source_only(kernel, "sm_90a")
    return CompiledKernel(kernel=kernel, arch="sm_90a", source=src, cubin=cubin, cache_hit=False)


def test_aligned_pointers_launch_the_vector_kernel_and_misaligned_ones_the_scalar_variant(monkeypatch):
    ck = _compiled(fx.rmsnorm_kernel(4, 64, "bf16"))
    assert ck._align_idx, "the fixture should use 16-byte vectors"
    scalar = _compiled(fx.rmsnorm_kernel(4, 64, "bf16"))
    ck._scalar = scalar  # stands in for the variant compiled on first need
    ran = []
    monkeypatch.setattr(CompiledKernel, "launch", lambda self, tensors, device, ptrs=None: ran.append((self, ptrs)))
    ck.launch_ptrs(0, [4096, 8192, 12288])
    i, _ = ck._align_idx[0]
    odd = [4096, 8192, 12288]
    odd[i] += 2
    ck.launch_ptrs(0, odd)
    assert [r[0] for r in ran] == [ck, scalar] and ran[1][1] == odd


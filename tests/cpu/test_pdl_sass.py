"""Under programmatic launch a kernel may start while the kernel before it still writes its
inputs; tf_pdl_wait (griddepcontrol.wait, ACQBULK in SASS) must come before every read of
them. The source puts it there, but ptxas moves non-coherent (.nc) loads across it (session
51: a GEMV's __ldg of A went above it). So this reads what ptxas made (runtime.sass) of the
map-reduce kernels of the transformer glue programs and a 2-layer Llama: no global load may
come before the wait."""
import pytest
import torch

from tilefuse.codegen.mapreduce import render
from tilefuse.compiler import compile_stages
from tilefuse.models.llama import llama
from tilefuse.runtime import nvrtc, sass
from tilefuse.tune.lookup import choose

from test_lower import PROGRAMS

pytestmark = pytest.mark.skipif(not sass.available(), reason="no nvdisasm (pip install nvidia-cuda-nvdisasm)")


def _kernels():
    torch.manual_seed(0)
    stages = [compile_stages(mk(4097, torch.bfloat16), tuple(mkin(7, 4097, torch.bfloat16)))
              for mk, mkin in PROGRAMS.values()]
    stages.append(compile_stages(llama(1000, 2, 256, 688, 4).to(torch.bfloat16), (torch.randint(0, 1000, (2, 64)),)))
    sources = {}
    for st in stages:
        for lk in st.program.kernels.values():
            src = render(lk.kernel, choose(lk.kernel, "sm_90a").schedule, arch="sm_90a")
            sources.setdefault(src.source, src.name)
    return sources


def test_no_global_load_comes_before_the_wait():
    sources = _kernels()
    assert len(sources) >= 10
    early = {}
    for source, name in sources.items():
        ops = sass.opcodes(sass.disassemble(nvrtc.compile_cuda(source, name, "sm_90a").data))
        assert "ACQBULK" in ops, f"{name}: no griddepcontrol.wait"
        loads = [op for op in ops[:ops.index("ACQBULK")] if op.startswith(("LDG", "LD.E"))]
        if loads:
            early[name] = loads
    assert not early, early

"""A model's layers repeat each GEMM with an epilogue equal but for the step's name: they render
one source (one NVRTC build, one cubin), as the layers' map-reduce kernels do. Before the
epilogue was named by its stem (loop.canon.stem), the source's epilogue comment carried the
step's name and every layer built its own copy of every GEMM."""
import collections

import torch

from tilefuse import models
from tilefuse.codegen import gemm_sm90
from tilefuse.compiler import compile_stages
from tilefuse.loop.canon import structural_hash


def test_layers_equal_but_for_names_render_one_gemm_source_each():
    torch.manual_seed(0)
    m = models.llama(64, 3, 64, 128, 4, 2, max_seq=32).eval().to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 32))
    c = compile_stages(m, [ids], arch="sm_90a")
    by_structure, by_source = collections.defaultdict(set), collections.defaultdict(set)
    for step, lg in c.gemms.items():
        p = lg.problem()
        src = gemm_sm90.render(p)
        key = (structural_hash(lg.epilogue), p.m, p.n, p.k, p.b_major)
        by_structure[key].add(src.source)
        by_source[src.source].add(step)
    assert len(c.gemms) >= 3 * 4  # every layer's projections are GEMM steps
    # equal structure, one source; and the three layers' steps share each source
    assert all(len(s) == 1 for s in by_structure.values()), {k: len(s) for k, s in by_structure.items()}
    assert len(by_source) < len(c.gemms) / 2, (len(by_source), len(c.gemms))
    assert max(len(steps) for steps in by_source.values()) >= 3

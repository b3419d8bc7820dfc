"""Host overhead measurement in analyze/bench.py (timing logic only; no GPU needed)."""
import time

import torch

from tilefuse.analyze import bench
from tilefuse.compiler import compile_stages


def test_host_us_is_the_median_wall_time_of_one_call(monkeypatch):
    """A call that sleeps 2 ms measures at least 2000 us and not wildly more; syncs happen around each call."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    us = bench.host_us(lambda: time.sleep(0.002), reps=7, warmup=1)
    assert 2000 <= us < 20000
    assert len(syncs) == 8  # one before each timed call, one after the last


def test_graph_note_says_how_tilefuse_ran():
    p = compile_stages(lambda x: torch.softmax(x, -1), [torch.randn(2, 8)]).program
    p.graphs = False
    p(torch.randn(2, 8))
    assert "graphs off" in bench._graph_note(p)
    p.graphs = True
    p(torch.randn(2, 8))
    note = bench._graph_note(p)
    assert "no CUDA graph" in note and "not a CUDA device" in note


def test_program_flops_count_every_matrix_product():
    """2*M*N*K for a generated GEMM and for a matmul left to cuBLAS; nothing for map-reduce steps."""
    import torch

    from tilefuse.analyze.bench import program_flops
    from tilefuse.compiler import compile_stages

    class M(torch.nn.Module):
        def forward(self, x, w, v):
            return torch.softmax((x @ w).float() @ v, -1)

    bf = torch.bfloat16
    st = compile_stages(M(), (torch.randn(16, 64, dtype=bf), torch.randn(64, 32, dtype=bf), torch.randn(32, 8)))
    assert sorted(s.family for s in st.plan.steps if s.flops) == ["extern", "gemm"]
    assert program_flops(st.plan) == 2 * 16 * 32 * 64 + 2 * 16 * 8 * 32

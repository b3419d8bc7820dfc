"""A mixture of experts' weights reach torch._grouped_mm as eager passes them.

transformers hands the experts' weights to the grouped matmul as `w.transpose(-2, -1)`, a
column-major view. Property: at any size that transpose stays a strided view in the plan, never
a weight folded into a row-major copy at compile time (a copy that PyTorch's CPU kernel took
7-9x slower, and that doubled the experts' memory), and the program computes eager's values.
"""
from __future__ import annotations

import torch
from torch import nn

import tilefuse


class Experts(nn.Module):
    def __init__(self, experts=4, hidden=64, inner=96):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, inner, hidden) / hidden ** 0.5)

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


def test_the_experts_transpose_is_a_view_not_a_folded_copy():
    torch.manual_seed(0)
    m = Experts().bfloat16()
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    offs = torch.tensor([8, 20, 20, 40], dtype=torch.int32)
    prog = tilefuse.compile(m, (x, offs))
    views = [s for s in prog.plan.steps if s.view]
    assert len(views) == 1, str(prog.plan)
    folded = [n for n in prog.graph.nodes if "folded at compile time" in getattr(n, "source", "")]
    assert not folded, folded
    assert torch.equal(prog(x, offs), m(x, offs))

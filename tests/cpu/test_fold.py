"""graph.fold.fold_weights reads a weight's values only when a fold needs them.

Property: compiling a module whose weights are mostly read by matmuls (nothing to fold)
(16-bit, so generated GEMMs read their transposes through) converts none of those to NumPy (on a GPU each conversion is a device-to-host copy, every
weight at every compile: a 7B model's 14 GB a size), while a weight that does fold (a bias cast
to the input's dtype, a scale applied to a weight) is read and the result is still right.
"""
from __future__ import annotations

import torch
from torch import nn

from tilefuse import tensors
from tilefuse.check import compare, float64_reference
from tilefuse.compiler import compile_stages
from tilefuse.graph import fold


class ScaledMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.scale = nn.Parameter(torch.randn(32))
        self.bias = nn.Parameter(torch.randn(32, dtype=torch.float64))

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        return h * (2 * self.scale) + self.bias.to(x.dtype)  # both fold: 2 * scale, bias.to(bf16)


def test_only_the_weights_a_fold_reads_are_converted(monkeypatch):
    read = []

    def counting(t):
        read.append(tuple(t.shape))
        return tensors.to_numpy(t)

    monkeypatch.setattr(fold, "to_numpy", counting)
    m = ScaledMLP().eval().bfloat16()  # 16-bit: the matmuls read W.t() through (an f32 one folds the copy)
    m.bias.data = m.bias.data.double()
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    c = compile_stages(m, (x,))
    assert sorted(read) == [(32,), (32,)], read  # scale and bias; not the (64, 32), (32, 64) matrices
    with torch.no_grad():
        res = compare("out", c.program(x), float64_reference(m, (x,)), m(x))
    assert res.ok, res


def test_a_folded_cast_to_bool_keeps_pytorch_truth():
    """i0e(ones) is 0.466 everywhere (an extern: the fold evaluates it); its .bool() folds into a
    weight that must hold True (a fuzzed program computed atan(False) = 0 from the fold's
    truncating cast, when atan was an extern: it is a map since session 60)."""
    import tilefuse

    def f(b):
        return torch.atan(torch.special.i0e(torch.ones_like(b)).bool())

    b = torch.randint(1, 5, (3, 2), dtype=torch.int32)
    st = compile_stages(f, (b,))
    assert any(n.name in st.graph.weights for n in st.graph.nodes), "the cast folded into a weight"
    torch.testing.assert_close(tilefuse.compile(f, (b,))(b), f(b))

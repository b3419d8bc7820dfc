"""One symbolic torch.export serving many sizes (tilefuse.frontend.sizes).

Properties: an instance of the symbolic export at a size translates to the same Graph IR as
a fresh export at that size (views, cat, slices with size arithmetic, arange, SDPA, a
Linear); a size the export does not hold for is refused (a dim it specialised, a size
outside the range it assumed, a guard it recorded in a branch on a size, another rank or
dtype), so the caller exports that size on its own; an export without symbolic sizes says
why it cannot serve others. Through the torch.compile backend, a graph called at several
sizes is exported once and each size's result is eager's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from tilefuse.check import compare, float64_reference
from tilefuse.frontend import backend as tb
from tilefuse.frontend.capture import export, to_graph
from tilefuse.frontend.sizes import Symbolic


class Attn(nn.Module):
    """A decode step's shape work: project, split heads, append to a cache, attend, and size
    arithmetic (arange over the cache, a slice of its last half)."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.RMSNorm(16), nn.Linear(16, 32)

    def forward(self, x, cache):
        b, n, _ = x.shape
        h = self.lin(self.norm(x)).view(b, n, 2, 16).transpose(1, 2)
        cache = torch.cat([cache, h], dim=2)
        att = F.scaled_dot_product_attention(h, cache, cache)
        pos = torch.arange(cache.shape[2]).float()
        return att.transpose(1, 2).reshape(b, n, 32) + pos[-n:, None], cache[:, :, -cache.shape[2] // 2:]


def _inputs(n, length):
    return torch.randn(1, n, 16), torch.randn(1, 2, length, 16)


def _symbolic(m, example, dims):
    ep = export(m, example, dynamic_shapes=dims)
    return Symbolic(ep), dict(ep.state_dict)


@pytest.mark.parametrize("n, length", [(3, 5), (4, 9), (2, 30), (7, 2)])
def test_an_instance_translates_as_a_fresh_export_at_that_size(n, length):
    m = Attn().eval()
    sym, state = _symbolic(m, _inputs(3, 5), ({1: Dim.AUTO}, {2: Dim.AUTO}))
    assert sym.why_not == ""
    xs = _inputs(n, length)
    inst = sym.instance(xs, state)
    assert inst is not None
    assert str(to_graph(inst)) == str(to_graph(export(m, xs)))


def test_an_instances_values_are_fake_tensors_as_the_fake_mode_makes_them():
    """Each tensor value of an instance is a fake tensor of the size's concrete shape and
    stride, on the export's device and of its dtype, the same as the fake mode's own
    empty_strided makes (sizes._fake builds it around a meta tensor, which is ~10x cheaper)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    m = Attn().eval()
    sym, state = _symbolic(m, _inputs(3, 5), ({1: Dim.AUTO}, {2: Dim.AUTO}))
    inst = sym.instance(_inputs(4, 9), state)
    vals = [n.meta["val"] for n in inst.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    sized = [v for v in vals if 9 in v.shape or 4 in v.shape]
    assert len(sized) >= 5
    mode = FakeTensorMode()
    for v in vals:
        assert isinstance(v, FakeTensor) and all(isinstance(d, int) for d in (*v.shape, *v.stride()))
        with mode:
            want = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        assert (v.shape, v.stride(), v.dtype, v.device) == (want.shape, want.stride(), want.dtype, want.device)
        assert v.device == torch.device("cpu")


def test_sizes_the_export_does_not_hold_for_are_refused():
    m = Attn().eval()
    sym, state = _symbolic(m, _inputs(3, 5), ({1: Dim.AUTO}, {2: Dim.AUTO}))
    assert sym.bind(_inputs(1, 5)) is None  # below the range [2, inf) the export assumed
    assert sym.bind((torch.randn(2, 3, 16), torch.randn(2, 2, 5, 16))) is None  # batch was kept fixed at 1
    assert sym.bind((torch.randn(1, 3, 16).double(), torch.randn(1, 2, 5, 16).double())) is None
    assert sym.bind((torch.randn(1, 3, 16, 1), torch.randn(1, 2, 5, 16))) is None
    assert sym.bind(_inputs(3, 6)) is not None


def test_a_guard_recorded_in_a_branch_on_a_size_is_checked():
    def f(x):
        return x * 2 if x.shape[0] > 4 else x - 1

    sym, state = _symbolic(f, (torch.randn(6, 3),), (({0: Dim.AUTO},),))  # f runs as forward(*args)
    assert sym.why_not == ""
    assert sym.bind((torch.randn(9, 3),)) is not None
    assert sym.bind((torch.randn(3, 3),)) is None  # the other branch: this export does not hold


def test_an_export_without_symbolic_sizes_says_it_cannot_serve_others():
    sym = Symbolic(export(lambda x: x + 1, (torch.randn(4, 3),)))
    assert sym.why_not and sym.instance((torch.randn(4, 3),), {}) is None


class Decode(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()

    def forward(self, x, cache):
        return self.attn(x, cache)


@pytest.mark.usefixtures("fresh_backend")
def test_the_backend_exports_a_graph_once_for_all_its_sizes():
    torch.manual_seed(0)
    m = Decode().eval()
    f = torch.compile(m, backend="tilefuse", dynamic=True)
    with torch.no_grad():
        for length in (5, 6, 9, 6, 17):
            xs = _inputs(1, length)
            out = f(*xs)
            ref = float64_reference(m, xs)
            for i, (o, e) in enumerate(zip(out, m(*xs))):
                c = compare(f"out{i}", o, ref[i], e)
                assert c.ok, c
    (r,) = tb.reports()
    assert r.status == "tilefuse" and r.calls_tilefuse == 5 and r.calls_eager == 0
    assert r.variants == 4 and r.exports == 1, (r.variants, r.exports, r.events)

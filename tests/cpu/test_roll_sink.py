"""graph/rules/roll_sink.py: a roll of a map's result becomes the map of its rolled arguments.
Gemma 3's rotate-half RoPE after its q norm is then one kernel (the norm and the rotation) where
it was two, within the 2x rule (the graph after the rule gives the interpreter's values before
it, bit for bit; a fused kernel keeps its intermediates in f32); where a roll's map chain reaches a reduction's full result it is
left as it is."""
from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph
from tilefuse.graph.rules import roll_sink
from tilefuse.graph.rules.roll_sink import rolls_into_maps

B, H, S, D = 2, 3, 10, 16


class Gemma3Q(torch.nn.Module):
    """Gemma 3's q: a (1 + w) RMSNorm over each head, then rotate-half RoPE."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, q, cos, sin):
        x = q.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = (x * (1.0 + self.w.float())).to(q.dtype)
        rot = torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)
        return x * cos + rot * sin


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    w = (0.1 * torch.randn(D, generator=g)).to(dtype)
    ang = torch.arange(S)[:, None] * torch.rand(D // 2, generator=g).repeat(2)
    return Gemma3Q(w).eval(), (q, ang.cos().to(dtype), ang.sin().to(dtype))


def _kernels(prog):
    return [s for s in prog.plan.steps if s.family == "mapreduce"]


def test_the_norm_and_the_rotation_are_one_kernel(monkeypatch):
    model, args = _inputs()
    prog = tilefuse.compile(model, args)
    assert len(_kernels(prog)) == 1, str(prog.plan)
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    monkeypatch.setattr(roll_sink, "rolls_into_maps", lambda g: g)
    before = tilefuse.compile(model, args)
    assert len(_kernels(before)) == 2, str(before.plan)  # (what the rule removes: the norm's own kernel)
    with torch.no_grad():
        ref, eager = float64_reference(model, args), model(*args)
    for p in (prog, before):
        check = compare("gemma3 q", p(*args), ref, eager)
        assert check.ok, check


def test_an_argument_of_size_one_along_the_roll_is_taken_as_it_is():
    """A row's statistic (one value a row, [4, 1]) is read as it is; x under the exp is rolled."""
    x, r = torch.randn(4, 8), torch.randn(4, 1)

    def fn(x, r):
        return torch.roll(torch.exp(x) * r, 3, -1)

    g = rolls_into_maps(to_graph(export(fn, (x, r))))
    (top,) = [g[o] for o in g.outputs]
    assert isinstance(top, ir.Map) and top.op == "mul" and g.inputs[1] in top.args
    (e,) = [g[a] for a in top.args if a != g.inputs[1]]
    assert e.op == "exp" and g[e.args[0]].op == "roll" and g[e.args[0]].arg == g.inputs[0]
    torch.testing.assert_close(tilefuse.compile(fn, (x, r))(x, r), fn(x, r))


def test_not_moved_onto_a_reduction_along_the_rolled_dim():
    """softmax over dim 0, rolled along dim 1: its max and sum vary along dim 1, and a rolled
    reduction is not a map: the graph is left as it is."""
    def fn(x):
        return torch.roll(torch.softmax(x, 0), 2, 1)

    x = torch.randn(5, 7)
    g = to_graph(export(fn, (x,)))
    assert any(isinstance(n, ir.View) and n.op == "roll" for n in g.nodes)
    assert rolls_into_maps(g) is g
    torch.testing.assert_close(tilefuse.compile(fn, (x,))(x), fn(x))


def test_rolled_maps_compute_the_same_function():
    """A chain of maps with broadcast arguments of every rank, rolled along each dim: the graph
    after the rule gives the interpreter's values before it, bit for bit."""
    g0 = torch.Generator().manual_seed(1)
    x, a, c = torch.randn(3, 4, 6, generator=g0), torch.randn(6, generator=g0), torch.randn(3, 1, 1, generator=g0)

    for dim in (0, 1, 2, -1):
        def fn(x, a, c, dim=dim):
            return torch.roll(torch.tanh(x * a + c) - a, 1, dim)

        g = to_graph(export(fn, (x, a, c)))
        g2 = rolls_into_maps(g)
        assert g2 is not g and not any(isinstance(n, ir.View) and n.op == "roll" and isinstance(g2[n.arg], ir.Map)
                                       for n in g2.nodes)
        feed = dict(zip(g.inputs, (x, a, c)))
        assert (run_graph(g, feed)[0] == run_graph(g2, feed)[0]).all()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_fused_norm_and_rotation_builds_clean(arch):
    """The one kernel at Gemma 3's sizes (16 heads of 128, 512 tokens), q read twice (the second
    time at the rotated column): no spill and no stack frame as built, at two or more blocks of
    256 threads an SM (its default's 4, and 3, spill on sm_90a; the build lowers it until none does)."""
    from tilefuse.codegen import mapreduce as mr
    from tilefuse.runtime.launch import compile_source_only

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 512, 128, generator=g).to(torch.bfloat16)
    ang = torch.arange(512)[:, None] * torch.rand(64, generator=g).repeat(2)
    global D
    saved, D = D, 128
    try:
        p = tilefuse.compile(Gemma3Q((0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)).eval(),
                             (q, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)))
    finally:
        D = saved
    (lw,) = p.kernels.values()
    src, cubin = compile_source_only(lw.kernel, arch)
    default = mr.default_schedule(lw.kernel, arch)
    assert src.schedule.min_blocks >= 2 and src.schedule.threads == default.threads, src.schedule
    assert cubin.info.clean, f"{src.schedule}: {cubin.info}"

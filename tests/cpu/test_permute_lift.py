"""graph/rules/permute_lift.py: maps that attention reads through a permute of a computed tensor
are computed in that tensor's order, attention reading the result through the permute. Qwen3's
per-head q norm (before the head transpose) and its rotate-half RoPE (after it) are then one
kernel where they were two, within the 2x rule; nothing changes where the result is read by
anything but attention, or where no permuted tensor is computed (nothing would fuse)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.rules import permute_lift
from tilefuse.graph.rules.permute_lift import maps_in_source_order

B, S, H, D = 2, 12, 4, 16


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class Qwen3Q(torch.nn.Module):
    """q [B, S, H·D] from its projection: an RMSNorm over each head, the head transpose, RoPE, SDPA."""

    def __init__(self, d=D):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(d), requires_grad=False)
        self.d = d

    def forward(self, q, k, v, cos, sin):
        x = q.view(q.shape[0], q.shape[1], -1, self.d).float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype) * self.w.to(q.dtype)
        x = _rope(x.transpose(1, 2), cos, sin)
        return F.scaled_dot_product_attention(x, k, v, is_causal=True)


def _inputs(d=D, s=S, h=H, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, s, h * d, generator=g).to(dtype)
    k, v = (torch.randn(B, h, s, d, generator=g).to(dtype) for _ in range(2))
    ang = torch.arange(s)[:, None] * torch.rand(d // 2, generator=g).repeat(2)
    return q, k, v, ang.cos().to(dtype), ang.sin().to(dtype)


def _kernels(prog):
    return [s for s in prog.plan.steps if s.family == "mapreduce"]


def test_norm_before_the_transpose_and_rope_after_are_one_kernel(monkeypatch):
    torch.manual_seed(0)
    model, args = Qwen3Q().eval(), _inputs()
    prog = tilefuse.compile(model, args)
    assert len(_kernels(prog)) == 1, str(prog.plan)
    (att,) = [n for n in prog.graph.nodes if isinstance(n, ir.Attention)]
    assert isinstance(prog.graph[att.q], ir.View) and prog.graph[att.q].op == "permute"
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view
                and not isinstance(prog.graph[s.nodes[0]], ir.Attention)], str(prog.plan)  # (q read as a view)
    monkeypatch.setattr(permute_lift, "maps_in_source_order", lambda g: g)
    before = tilefuse.compile(model, args)
    assert len(_kernels(before)) == 2, str(before.plan)
    with torch.no_grad():
        ref, eager = float64_reference(model, args), model(*args)
    for p in (prog, before):
        check = compare("qwen3 q", p(*args), ref, eager)
        assert check.ok, check


def test_a_result_read_by_more_than_attention_stays():
    """The RoPE'd q returned too: a program output keeps the order it was computed in."""
    class Both(Qwen3Q):
        def forward(self, q, k, v, cos, sin):
            x = q.view(q.shape[0], q.shape[1], -1, self.d).float()
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype)
            x = _rope(x.transpose(1, 2), cos, sin)
            return F.scaled_dot_product_attention(x, k, v), x

    args = _inputs()
    g = to_graph(export(Both().eval(), args))
    assert maps_in_source_order(g) is g


def test_rope_of_a_permuted_input_stays():
    """Nothing computed under the permute (q straight from an input): nothing would fuse, and
    permutes_into_maps would move the permute back down."""
    def fn(q, k, v, cos, sin):
        x = _rope(q.view(B, S, H, D).transpose(1, 2), cos, sin)
        return F.scaled_dot_product_attention(x, k, v)

    g = to_graph(export(fn, _inputs()))
    assert maps_in_source_order(g) is g


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_fused_kernel_builds_clean(arch):
    """At Qwen3's sizes (16 heads of 128, 512 tokens): no spill and no stack frame as built."""
    from tilefuse.runtime.launch import compile_source_only

    torch.manual_seed(0)
    prog = tilefuse.compile(Qwen3Q(128).eval(), _inputs(128, 512, 16))
    (step,) = _kernels(prog)
    src, cubin = compile_source_only(prog.kernels[step.name].kernel, arch)
    assert cubin.info.clean, f"{src.schedule}: {cubin.info}"


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _roll_of_low_rank(q, k, v, cos, sin):
    """A roll of a lower-rank table (its dim counted from its own first dim)."""
    x = _norm(q.view(B, S, H, D)).permute(1, 2, 0, 3)  # [S, H, B, D]
    return F.scaled_dot_product_attention(x * torch.roll(cos, 3, dims=1) + x * sin, k, v)


def _low_rank_permute(q, k, v, w, sin):
    """A rank-3 permute of a computed map broadcast into a rank-4 map."""
    x = _norm(q.view(S, B, D)).permute(1, 0, 2)  # [B, S, D]
    return F.scaled_dot_product_attention(x * w, k, v)


def _low_rank_computed(q, k, v, cos, sin):
    """Only a lower-rank computed tensor under the permute: permutes_into_maps would move it back."""
    r = q.view(B, S, H, D).pow(2).mean((0, 1, 2))  # [D]
    x = (q.view(B, S, H, D) * r).transpose(1, 2)
    return F.scaled_dot_product_attention(x * cos + 1, k, v)


def _other_order(q, k, v, cos, sin):
    """p = (2, 0, 1, 3), a permute that is not its own inverse, tables of two ranks."""
    x = _norm(q.view(B, S, H, D)).permute(2, 0, 1, 3)  # [H, B, S, D]
    h = D // 2
    return F.scaled_dot_product_attention(x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin, k, v)


def _args(shapes):
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(*s, generator=g) for s in shapes)


@pytest.mark.parametrize("fn, shapes, fires", [
    (_roll_of_low_rank, [(B, S, H * D), (S, H, B, D), (S, H, B, D), (B, D), (B, D)], False),
    (_low_rank_permute, [(S, B * D), (H, B, S, D), (H, B, S, D), (H, B, S, D), (1,)], False),
    (_low_rank_computed, [(B, S, H * D), (B, H, S, D), (B, H, S, D), (S, D), (S, D)], False),
    (_other_order, [(B, S, H * D), (H, B, S, D), (H, B, S, D), (H, 1, S, D), (S, D)], True),
], ids=["roll of a lower-rank table", "lower-rank permute", "lower-rank computed", "p=(2,0,1,3)"])
def test_edge_cases_keep_the_function(fn, shapes, fires):
    """Where it is not taken the graph is left as it is; where it is, the interpreter's values
    before and after are the same bits (cases a review found: the first two were taken and wrong)."""
    from tilefuse.graph.interp import run_graph
    from tilefuse.graph.rules.cat_roll import rotated_cat_as_roll
    from tilefuse.graph.rules.cat_signs import negated_pieces_as_signs

    args = _args(shapes)
    g = rotated_cat_as_roll(negated_pieces_as_signs(to_graph(export(fn, args))))
    g2 = maps_in_source_order(g)
    assert (g2 is not g) == fires
    feed = dict(zip(g.inputs, args))
    assert (run_graph(g, feed)[0] == run_graph(g2, feed)[0]).all()

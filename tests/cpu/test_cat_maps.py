"""graph/rules/cat_maps.py: a `cat` along the last dim with a computed piece becomes a select of
its pieces, each computed at its clamped column, so one kernel reads the pieces' tensors where
they lie and writes the cat once. The rewritten graph computes PyTorch's cat bit for bit (the
interpreter, random shapes); partial-rotary RoPE (GPT-NeoX, StableLM) is one kernel with no
copy of the projection's views; an empty piece is dropped (Phi-3); other cats are left alone;
the kernels build without spills."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph, to_torch
from tilefuse.graph.rules.cat_maps import cats_as_maps
from tilefuse.runtime.launch import compile_source_only


def _graph(fn, inputs):
    return to_graph(export(fn, inputs))


def _run(g, inputs):
    return [to_torch(a).reshape(a.shape) for a in run_graph(g, dict(zip(g.inputs, inputs)))]


def _cats(g):
    return [n.name for n in g.nodes if isinstance(n, ir.Extern) and n.target == "aten.cat.default"]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_select_is_the_cat_bit_for_bit(data):
    """Pieces of random widths (zero included), some maps of views, weights and broadcast
    vectors, some views of an input: the select holds each piece's own values."""
    rows = data.draw(st.integers(1, 4))
    widths = data.draw(st.lists(st.integers(0, 9), min_size=2, max_size=4))
    kinds = data.draw(st.lists(st.sampled_from(["map", "view", "map2"]), min_size=len(widths), max_size=len(widths)))
    if "map" not in kinds and "map2" not in kinds:
        kinds[0] = "map"
    total = sum(widths)
    x = torch.randn(rows, 3, total + 5)
    w = torch.randn(1, 1, total + 5)

    def fn(x, w):
        pieces, at = [], 0
        for k, n in zip(kinds, widths):
            v = x[..., at + 2:at + 2 + n]
            if k == "map":
                v = torch.tanh(v) * w[..., at:at + n] + 1.5
            elif k == "map2":
                v = v * v[..., :1]  # (a column that broadcasts)
            pieces.append(v)
            at += n
        return torch.cat(pieces, -1) * 2

    g = _graph(fn, (x, w))
    out = cats_as_maps(g)
    nonempty = [k for k, n in zip(kinds, widths) if n]
    taken = len(nonempty) == 1 or len(nonempty) > 1 and any(k != "view" for k in nonempty)
    assert bool(_cats(out)) != taken, str(out)
    (got,) = _run(out, (x, w))
    (want,) = _run(g, (x, w))
    assert torch.equal(got, want)
    torch.testing.assert_close(got, fn(x, w))


def _partial_rope(q, cos, sin):
    """GPT-NeoX's RoPE on the first 16 of 64 dims of each head of a permuted projection."""
    q = q.view(2, 24, 4, 64).transpose(1, 2)
    rot, rest = q[..., :16], q[..., 16:]
    half = torch.cat((-rot[..., 8:], rot[..., :8]), -1)
    return torch.cat((rot * cos + half * sin, rest), -1)


def test_partial_rotary_is_one_kernel_reading_the_projection_in_place():
    x, w = torch.randn(2, 24, 128, dtype=torch.bfloat16), torch.randn(256, 128, dtype=torch.bfloat16)
    ang = torch.randn(24, 8)
    cos, sin = torch.cat((ang, ang), -1).cos().bfloat16(), torch.cat((ang, ang), -1).sin().bfloat16()

    def fn(x, w):
        q = x @ w.t()
        return torch.nn.functional.scaled_dot_product_attention(_partial_rope(q, cos, sin), _partial_rope(q, cos, sin),
                                                                 _partial_rope(q, cos, sin))

    p = tilefuse.compile(fn, (x, w))
    externs = [s for s in p.plan.steps if s.family == "extern" and not s.view]
    assert [type(p.graph[s.nodes[0]]).__name__ for s in externs] == ["Attention"], str(p.plan)
    assert not any(isinstance(n, ir.Extern) and n.target == "aten.cat.default" for n in p.graph.nodes)
    check = compare("partial rope", p(x, w), float64_reference(fn, (x, w)), fn(x, w))
    assert check.ok, check


def test_an_empty_piece_is_dropped():
    """Phi-3 rotates the whole head and cats an empty pass-through: the cat is its one piece."""
    def fn(x):
        y = torch.sin(x[..., :8]) * 2
        return torch.cat((y, x[..., 8:]), -1) + 1

    x = torch.randn(3, 8)
    before = _graph(fn, (x,))
    g = cats_as_maps(before)
    assert not _cats(g)
    assert torch.equal(_run(g, (x,))[0], _run(before, (x,))[0])
    torch.testing.assert_close(_run(g, (x,))[0], fn(x))


@pytest.mark.parametrize("name, fn", [
    ("along another dim (a KV cache's)", lambda x: torch.cat((torch.sin(x), x), 0)),
    ("of tensors in memory alone", lambda x: torch.cat((x, x[:, 1:]), -1)),
    ("of integers", lambda x: torch.cat(((x > 0).long() * 2, x.long()), -1)),
])
def test_not_taken(name, fn):
    x = torch.randn(4, 6)
    g = _graph(fn, (x,))
    assert cats_as_maps(g) is g, name


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_kernels_build_without_spills(arch, dtype):
    x = torch.randn(2, 4, 96, 64, dtype=dtype)
    ang = torch.randn(96, 8)
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)

    def fn(x):
        rot, rest = x[..., :16], x[..., 16:]
        return torch.cat((rot * cos + torch.cat((-rot[..., 8:], rot[..., :8]), -1) * sin, rest), -1)

    p = tilefuse.compile(fn, (x,))
    assert p.kernels
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"
    torch.testing.assert_close(p(x).float(), fn(x).float(), rtol=2e-2, atol=2e-2)

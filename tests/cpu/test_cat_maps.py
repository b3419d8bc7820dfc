"""graph/rules/cat_maps.py: a `cat` along the last dim with a computed piece becomes a select of
its pieces, each computed at its clamped column, so one kernel reads the pieces' tensors where
they lie and writes the cat once. The rewritten graph computes PyTorch's cat bit for bit (the
interpreter, random shapes); partial-rotary RoPE (GPT-NeoX, StableLM) is one kernel with no
copy of the projection's views; an empty piece is dropped (Phi-3); other cats are left alone;
the kernels build without spills. A stack along a new last dim viewed back flat (GPT-J's and
Cohere's interleaved rotary) is a select too (stacks_as_maps), and with the cat after it one
kernel reading q and k where they lie."""
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
from tilefuse.graph.rules.cat_maps import cats_as_maps, stacks_as_maps
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


def test_many_pieces_are_left_to_pytorch():
    """Every column computes every piece, so a cat of more than MAX_PIECES (a NeRF encoding's 21
    sines and cosines, 18 slices doubled: one kernel past the registers a row may hold; review,
    session 72) stays PyTorch's cat, and what is compiled builds."""
    def nerf(x):
        return torch.cat([x] + [f(x * 2.0 ** i) for i in range(10) for f in (torch.sin, torch.cos)], -1)

    widths = [8] * 9 + [16] * 9

    def slices(x):
        ps, at = [], 0
        for w in widths:
            ps.append(x[:, at:at + w] * 2)
            at += w
        return torch.cat(ps, -1)

    for fn, x in ((nerf, torch.randn(64, 3)), (slices, torch.randn(64, sum(widths), dtype=torch.bfloat16))):
        g = _graph(fn, (x,))
        assert cats_as_maps(g) is g
        p = tilefuse.compile(fn, (x,))
        for lw in p.kernels.values():
            _, cubin = compile_source_only(lw.kernel, "sm_90a")
            assert cubin.info.spill_stores == 0
        assert torch.equal(p(x), fn(x)) or torch.allclose(p(x).float(), fn(x).float(), rtol=1e-5, atol=1e-5)


def test_a_cache_grown_along_the_last_dim_stays_resizable():
    """A key cache kept transposed ([B, D, S]) and grown by a cat along its last dim: a piece
    that is a program input stays PyTorch's cat, which a program resized for the next length
    runs without a compile (review, session 72: as a select, each length compiled anew)."""
    from tilefuse.frontend import backend as tb

    w = torch.randn(8, 8)

    def step(x, kc):
        return torch.cat((kc, (x @ w).transpose(1, 2) * 0.5), -1)

    x = torch.randn(2, 1, 8)
    g = _graph(step, (x, torch.randn(2, 8, 5)))
    assert cats_as_maps(g) is g
    tb.register()
    torch._dynamo.reset()
    tb.reset()
    try:
        f = torch.compile(step, backend="tilefuse")
        kc = torch.randn(2, 8, 3)
        for _ in range(6):
            out = f(x, kc)
            torch.testing.assert_close(out, step(x, kc))
            kc = out
        assert sum(r.resized for r in tb.reports()) >= 2, tb.summary()
    finally:
        torch._dynamo.reset()


def _stacks(g):
    return [n.name for n in g.nodes if isinstance(n, ir.Extern) and n.target == "aten.stack.default"]


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_an_interleaving_stack_is_a_select_bit_for_bit(data):
    """2 to 4 pieces of one random width, maps of strided slices and broadcast vectors, strided
    slices of a map (computed at their columns) beside plain views, stacked along a new last dim
    and flattened: each column is its piece's value."""
    k = data.draw(st.integers(2, 4))
    w = data.draw(st.integers(1, 6))
    kinds = data.draw(st.lists(st.sampled_from(["map", "view", "neg", "sliced map"]), min_size=k, max_size=k))
    if set(kinds) == {"view"}:
        kinds[0] = "map"
    x = torch.randn(2, 3, k * w + 3)
    v = torch.randn(1, 1, w)

    def fn(x, v):
        pieces, t = [], torch.tanh(x) * 2  # (a map that is read only through its slices)
        for i, kind in enumerate(kinds):
            s = x[..., i:i + k * w:k]  # (a strided slice: piece i's columns)
            pieces.append(torch.tanh(s) * v + 0.5 if kind == "map" else -s if kind == "neg"
                          else t[..., i:i + k * w:k] if kind == "sliced map" else s)
        return torch.stack(pieces, -1).flatten(-2) * 3

    g = _graph(fn, (x, v))
    out = stacks_as_maps(g)
    assert not _stacks(out), str(out)
    (got,) = _run(out, (x, v))
    (want,) = _run(g, (x, v))
    assert torch.equal(got, want)
    torch.testing.assert_close(got, fn(x, v))


def _interleaved_rope(q, cos, sin):
    """GPT-J's rotary on the first 16 of 64 dims of each head: pairs (2i, 2i+1) rotated."""
    q = q.view(2, 24, 4, 64)
    rot, rest = q[..., :16], q[..., 16:]
    x1, x2 = rot[..., ::2], rot[..., 1::2]
    turned = torch.stack((-x2, x1), -1).flatten(-2)
    return torch.cat((rot * cos + turned * sin, rest), -1).transpose(1, 2)


def test_interleaved_rotary_is_one_kernel_reading_the_projection_in_place():
    """No stack, no copy of the strided slices x[..., ::2] and x[..., 1::2] (a step of 2 reads the
    sectors a copy would: fusion.MAX_SECTOR_STEP): one kernel for the rotation and the cat."""
    x, w = torch.randn(2, 24, 128, dtype=torch.bfloat16), torch.randn(256, 128, dtype=torch.bfloat16)
    ang = torch.randn(24, 1, 8)
    cos = torch.repeat_interleave(ang.cos(), 2, -1).bfloat16()
    sin = torch.repeat_interleave(ang.sin(), 2, -1).bfloat16()

    def fn(x, w):
        q = x @ w.t()
        r = _interleaved_rope(q, cos, sin)
        return torch.nn.functional.scaled_dot_product_attention(r, r, r)

    p = tilefuse.compile(fn, (x, w))
    externs = [s for s in p.plan.steps if s.family == "extern" and not s.view]
    assert [type(p.graph[s.nodes[0]]).__name__ for s in externs] == ["Attention"], str(p.plan)
    assert not _stacks(p.graph) and not _cats(p.graph)
    check = compare("interleaved rope", p(x, w), float64_reference(fn, (x, w)), fn(x, w))
    assert check.ok, check


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_interleaved_rotary_kernels_build_without_spills(arch):
    x = torch.randn(2, 4, 96, 64, dtype=torch.bfloat16)
    ang = torch.randn(96, 8)
    cos = torch.repeat_interleave(ang.cos(), 2, -1).bfloat16()
    sin = torch.repeat_interleave(ang.sin(), 2, -1).bfloat16()

    def fn(x):
        rot, rest = x[..., :16], x[..., 16:]
        turned = torch.stack((-rot[..., 1::2], rot[..., ::2]), -1).flatten(-2)
        return torch.cat((rot * cos + turned * sin, rest), -1)

    p = tilefuse.compile(fn, (x,))
    assert p.kernels and not _stacks(p.graph)
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"
    check = compare("interleaved rope", p(x), float64_reference(fn, (x,)), fn(x))
    assert check.ok, check


@pytest.mark.parametrize("name, fn", [
    ("along a dim that is not new and last", lambda x: torch.stack((torch.sin(x), x), 0).flatten(0, 1)),
    ("not flattened back", lambda x: torch.stack((torch.sin(x), x), -1) * 2),
    ("of views alone", lambda x: torch.stack((x[:, ::2], x[:, 1::2]), -1).flatten(-2) * 2),
    ("of integers", lambda x: torch.stack(((x > 0).long(), x.long()), -1).flatten(-2)),
])
def test_stacks_not_taken(name, fn):
    x = torch.randn(4, 6)
    g = _graph(fn, (x,))
    assert stacks_as_maps(g) is g, name

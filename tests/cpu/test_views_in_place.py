"""Views that map-reduce kernels read where their tensor lies (fusion.views_read_in_place) and
cats that are views (rules/cat_roll.py): which are taken, which are left as copies, and that
the program computes what PyTorch does, through the Loop IR interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.graph import ir
from tilefuse.graph.rules.cat_roll import rotated_cat_as_roll


def _prog(fn, *ins):
    return tilefuse.compile(fn, ins)


def _views(p, op):
    return [n.name for n in p.graph.nodes if isinstance(n, ir.View) and n.op == op]


def _externs(p):
    return [s for s in p.plan.steps if s.family == "extern"]


# -- cat as views -------------------------------------------------------------------------------

@pytest.mark.parametrize("cuts,dim", [((5,), -1), ((3, 9), -1), ((2,), 1), ((1, 4, 6), 0)], ids=str)
def test_a_cat_of_one_tensors_slices_in_rotated_order_is_a_roll(cuts, dim):
    """Pieces x[a:b], x[b:c], ..., x[:a] along the cat's dim (any number of pieces) make a roll
    by a; the result is the cat's, bit for bit."""
    def fn(x):
        n = x.shape[dim]
        edges = [0, *cuts, n]
        pieces = [x.narrow(dim, s, e - s) for s, e in zip(edges, edges[1:])]
        return torch.cat(pieces[1:] + pieces[:1], dim) * 3

    x = torch.randn(7, 8, 10)
    p = _prog(fn, x)
    assert len(_views(p, "roll")) == 1 and not _views(p, "slice") and not _externs(p), str(p.plan)
    assert torch.equal(p(x), fn(x))


def test_slices_in_order_from_zero_are_the_tensor_itself():
    fn = lambda x: torch.cat((x[:, :3], x[:, 3:7], x[:, 7:]), 1) * 3  # noqa: E731
    x = torch.randn(4, 9)
    p = _prog(fn, x)
    assert not _views(p, "roll") and not _views(p, "slice") and not _externs(p), str(p.plan)
    assert torch.equal(p(x), fn(x))


@pytest.mark.parametrize("fn", [
    lambda x: torch.cat((x[:, 4:], x[:, :3]), 1) * 2,          # a gap: not all of x
    lambda x: torch.cat((x[:, 4:], x[:, :5]), 1) * 2,          # an overlap
    lambda x: torch.cat((x[:, 4:], x[:, :4]), 0) * 2,          # along another dim than the slices'
    lambda x: torch.cat((x[:, 1::2], x[:, 0::2]), 1) * 2,      # stepped slices
    lambda x: torch.cat((x[:, 4:], x[:2, :4]), 1) * 2 if False else torch.cat((x[:, 4:], x[:, :4].exp()), 1),
], ids=["gap", "overlap", "other_dim", "stepped", "mapped_piece"])
def test_other_cats_are_left_as_cats(fn):
    x = torch.randn(6, 8)
    p = _prog(fn, x)
    assert not _views(p, "roll"), str(p.graph)
    torch.testing.assert_close(p(x), fn(x))


@pytest.mark.parametrize("k,dim", [(2, -1), (3, 0), (2, 1)], ids=str)
def test_a_cat_of_one_tensor_repeated_is_views_of_it(k, dim):
    """cat((f,) * k, dim), RoPE's cat((freqs, freqs), -1): an expand and reshapes of f, read in
    place by the kernel that reads the cat (no copy)."""
    fn = lambda f: (torch.cat((f * 0.5,) * k, dim) + 1) * 3  # noqa: E731
    f = torch.randn(3, 5, 4)
    p = _prog(fn, f)
    assert not any(isinstance(n, ir.Extern) for n in p.graph.nodes), str(p.graph)
    assert not _externs(p), str(p.plan)
    assert torch.equal(p(f), fn(f))


def test_the_roll_rule_leaves_a_graph_without_cats_unchanged():
    p = _prog(lambda x: x[:, 2:] * 2, torch.randn(3, 5))
    assert rotated_cat_as_roll(p.graph) is p.graph


# -- which views are read in place ---------------------------------------------------------------

def test_a_slice_read_only_by_a_kernel_is_read_where_it_lies():
    fn = lambda x: x[..., 64:] * 2 + torch.sin(x[..., :64])  # noqa: E731
    x = torch.randn(3, 4, 128)
    p = _prog(fn, x)
    (step,) = p.plan.steps
    assert step.family == "mapreduce" and set(step.reads.values()) == {p.graph.inputs[0]}
    assert len(step.reads) == 2 and step.inputs.count(p.graph.inputs[0]) == 1
    assert "in place" in str(p.plan)
    torch.testing.assert_close(p(x), fn(x))  # (sin: numpy's and PyTorch's may differ in an ulp)


def test_a_head_transpose_that_keeps_the_last_dim_is_read_in_place():
    fn = lambda x: (x.transpose(1, 2) * 3).sum(-1)  # noqa: E731
    x = torch.randn(2, 5, 3, 16)
    p = _prog(fn, x)
    assert not _externs(p) and any(p.graph[v].op == "permute" for s in p.plan.steps for v in s.reads), str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


def test_a_transpose_of_the_last_dim_a_reduction_reads_is_copied_in_tiles():
    """A kernel reading along rows through a transpose of the last dim would read each element
    in a transaction of its own: a kernel of its own copies it in tiles (no PyTorch copy), the
    row kernel reads the copy's contiguous rows."""
    fn = lambda x: x.transpose(0, 1).softmax(-1)  # noqa: E731
    x = torch.randn(6, 10)
    p = _prog(fn, x)
    assert not _externs(p), str(p.plan)
    copy, soft = [s for s in p.plan.steps if s.family == "mapreduce"]
    assert copy.reads and not soft.reads and copy.outputs == soft.inputs
    torch.testing.assert_close(p(x), fn(x))


def test_a_view_that_is_a_result_or_read_by_a_gemm_is_still_made():
    def fn(x, w):
        s = x[:, 8:]
        return s, (x[:, :8] @ w) + s.sum(-1, keepdim=True)

    ins = torch.randn(4, 16), torch.randn(8, 3)
    p = _prog(fn, *ins)
    made = {s.nodes[0] for s in _externs(p)}
    # the slice the GEMM reads is made by its extern; the result, by a kernel's identity copy
    # of it (rules/result_copies.py), which reads it in place
    assert {n for n in _views(p, "slice") if n != "slice"} <= made and "slice" not in made, str(p.plan)
    copy = p.graph.results[0]
    assert p.graph[copy].op == "cast" and any(copy in s.outputs for s in p.plan.steps if s.family == "mapreduce")
    for got, want in zip(p(*ins), fn(*ins)):
        torch.testing.assert_close(got, want)


def test_a_view_of_an_iota_is_not_read_in_place():
    """An iota (or constant) is computed where it is read, at the reader's own index: a view of
    it keeps its own step."""
    fn = lambda x: x * torch.arange(12)[3:9]  # noqa: E731
    x = torch.randn(2, 6)
    p = _prog(fn, x)
    assert isinstance(p.graph[p.graph["slice"].arg], ir.Iota)
    assert not any(s.reads for s in p.plan.steps) and len(_externs(p)) == 1, str(p.plan)
    assert torch.equal(p(x), fn(x))


# -- any chain of such views -----------------------------------------------------------------------

@st.composite
def _chains(draw):
    """A random chain of views over a 3-d input (slices, last-dim-keeping permutes, rolls as
    rotated cats, expands of size-1 dims, reshapes) read by a map and a row reduction."""
    shape = [draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(2, 12))]
    ops = draw(st.lists(st.sampled_from(["slice", "permute", "roll", "reshape", "unsqueeze"]), min_size=1, max_size=4))
    params = [draw(st.integers(0, 1000)) for _ in ops]
    return tuple(shape), tuple(ops), tuple(params)


def _apply(x, ops, params):
    for op, r in zip(ops, params):
        n = x.shape[-1]
        if op == "slice" and n > 1:
            a = r % (n - 1)
            x = x[..., a:a + max(1, (n - a) // 2 + 1)]
        elif op == "permute" and x.dim() >= 3:
            x = x.transpose(0, 1)
        elif op == "roll" and n > 1:
            h = 1 + r % (n - 1)
            x = torch.cat((x[..., h:], x[..., :h]), -1)
        elif op == "reshape" and x.dim() >= 2:
            x = x.reshape(-1, x.shape[-1])
        elif op == "unsqueeze":
            x = x.unsqueeze(0).expand(2, *x.shape)
    return x


@settings(max_examples=40, deadline=None)
@given(_chains())
def test_any_chain_of_views_read_in_place_computes_what_pytorch_does(case):
    shape, ops, params = case
    fn = lambda x: (lambda v: v * 2 + v.amax(-1, keepdim=True))(_apply(x, ops, params))  # noqa: E731
    x = torch.randn(*shape)
    p = _prog(fn, x)
    assert torch.equal(p(x), fn(x)), (shape, ops, params, str(p.plan))


@pytest.mark.parametrize("h,whole", [(64, True), (32, True), (3, False)], ids=str)
def test_a_rolls_chunks_are_whole_vectors_where_the_shift_allows(h, whole):
    """A roll by a multiple of the 16-byte vector over a row of whole vectors reads each chunk
    with one vector load from column (c0 + h) % n (codegen.mapreduce._chunk_col); by any other
    shift its elements are scalar loads; both compile clean (NVRTC, sm_90a and sm_80)."""
    from tilefuse.codegen import mapreduce
    from tilefuse.runtime import nvrtc

    fn = lambda x: torch.cat((x[..., h:], x[..., :h]), -1) * 2 + x  # noqa: E731
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    p = _prog(fn, x)
    (step,) = p.plan.steps
    for arch in ("sm_90a", "sm_80"):
        src = mapreduce.render(p.kernels[step.name].kernel, None, arch)
        assert (f"((c0 + {h}) % 128))" in src.source) == whole, src.source
        assert nvrtc.compile_cuda(src.source, src.name, arch).info.clean
    assert torch.equal(p(x), fn(x))


def test_an_empty_view_is_refused_as_before_not_read_in_place():
    """A zero-size slice read by a kernel keeps its step, so the compiler's refusal of empty
    tensors names it (read in place, its index divided by a zero extent)."""
    with pytest.raises(ValueError, match="no elements"):
        _prog(lambda x: x[:, 3:3].sum(-1) * 2, torch.randn(4, 8))


def test_a_view_whose_reader_keeps_its_copy_keeps_its_own():
    """slice -> permute (moving the last dim) -> strided slice -> softmax over a non-last dim: the
    strided slice read under the permute would be read in place, but alone it is a copy (an
    extern reading the permute), so the permute and the slice before it stay copies too: the
    copy's input exists (fuzz crash 9502758: the runner met a tensor no step had made)."""
    import tilefuse

    def f(x):
        v = torch.atan2(x, x + 1)[..., :1].swapaxes(0, -1)[..., ::2]
        return torch.softmax(v, -2)

    x = torch.randn(3, 2, 1, 8)
    p = tilefuse.compile(f, (x,))
    made = {o for s in p.plan.steps for o in s.nodes} | set(p.graph.inputs)
    for s in p.plan.steps:
        for t in s.inputs:
            assert t in made or not isinstance(p.graph[t], ir.View), (s.name, t, str(p.plan))
    torch.testing.assert_close(p(x), f(x))


@pytest.mark.parametrize("name, fn", [
    # a slice under the transpose SDPA's v is cut from, the q half read by kernels
    ("slice under a kept permute", lambda y: (lambda qv: F.scaled_dot_product_attention(
        qv[..., :4] * 2, qv[..., :4] * 3, qv[..., 4:]))(y[..., 1:].transpose(1, 2))),
    # the kept view an alias (a reshape of a slice)
    ("kept alias", lambda y: (lambda qv: F.scaled_dot_product_attention(
        qv[..., :4] * 2, qv[..., :4] * 3, qv[..., 4:]))(y[:, 1:].view(1, 4, 2, 8))),
])
def test_a_view_kept_for_an_extern_is_made_from_what_exists(name, fn):
    """A view kernels read and an extern reads in place through a strided view stays one only
    where it is an extern step over a tensor that is made; else it keeps its copy (review,
    session 72: the view under it was dropped and the strided view ran on nothing)."""
    y = torch.randn(1, 4, 2, 9) if name != "kept alias" else torch.randn(1, 5, 16)
    p = tilefuse.compile(fn, (y,))
    torch.testing.assert_close(p(y), fn(y), rtol=1e-5, atol=1e-5)

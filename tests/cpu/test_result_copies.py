"""rules/result_copies.py: a view of a tensor in memory that a result returns contiguous, or that
an extern takes contiguous, is copied by a map-reduce kernel reading the views in place, not by
PyTorch's copy (an extern step). And nearest upsampling by whole factors as views
(frontend/aten.py `_upsample_nearest`), which that rule then copies.

Each program is checked through the CPU interpreter against eager exactly (a copy rounds
nothing) and by its plan: the kernel that copies, no extern view copy. Where the rule must not
fire it does not: a reshape alone (free), a strided slice of the last dim (no row a kernel
reads in one run), a result PyTorch returns strided, a view a cat reads as it lies, a view of
an input the program writes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.graph import ir

VIEW_RESULTS = {
    "head_permute": (lambda x: x.transpose(1, 2).contiguous(), (2, 5, 3, 8)),
    "head_merge": (lambda x: x.transpose(1, 2).reshape(2, 5, 24), (2, 3, 5, 8)),
    "repeat_kv": (lambda x: x[:, :, None].expand(2, 3, 4, 5, 8).reshape(2, 12, 5, 8), (2, 3, 5, 8)),
    "slice": (lambda x: x[:, 3:9].contiguous(), (7, 16)),
    "rows_slice": (lambda x: x[2:5], (7, 16)),
    "expand": (lambda x: x.expand(3, 7, 16).contiguous(), (7, 16)),
    "broadcast_row": (lambda x: x.expand(4, 16), (1, 16)),
    "roll": (lambda x: x.roll(5, -1), (7, 16)),
}


def _copy_kernels(p):
    steps = [s for s in p.plan.steps if s.family not in ("alias",) and not s.view]
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
@pytest.mark.parametrize("name", sorted(VIEW_RESULTS))
def test_a_result_view_is_one_kernel_reading_it_in_place(name, dtype):
    fn, shape = VIEW_RESULTS[name]
    x = (torch.randn(shape) * 10).to(dtype)
    p = tilefuse.compile(fn, (x,))
    steps = _copy_kernels(p)
    assert [s.family for s in steps] == ["mapreduce"] and steps[0].reads, str(p.plan)
    (res,) = p.graph.results
    assert isinstance(p.graph[res], ir.Map) and p.graph[res].op == "cast"
    got, want = p(x), fn(x)
    assert got.is_contiguous() and torch.equal(got, want.contiguous())


@pytest.mark.parametrize("fn,shape,why", [
    (lambda x: x.reshape(4, 12), (6, 8), "a reshape alone is free"),
    (lambda x: x[:, 1::2].contiguous(), (6, 8), "a strided slice of the last dim"),
    (lambda x: torch.cat([x.transpose(0, 1), x.transpose(0, 1)], -1), (3, 6, 8), "cat reads it as it lies"),
], ids=["reshape", "strided_slice", "cat"])
def test_views_the_rule_leaves(fn, shape, why):
    x = torch.randn(shape)
    p = tilefuse.compile(fn, (x,))
    assert not any(isinstance(n, ir.Map) and n.op == "cast" and n.name.endswith("_copy") for n in p.graph.nodes), \
        f"{why}: {p.graph}"
    torch.testing.assert_close(p(x), fn(x), rtol=0, atol=0)


def test_a_result_pytorch_returns_strided_stays_a_strided_view():
    fn = lambda x: (x * 2).transpose(1, 2)  # noqa: E731  (eager: a view of the product)
    x = torch.randn(2, 5, 3, 8)
    p = tilefuse.compile(fn, (x,))
    got, want = p(x), fn(x)
    assert torch.equal(got, want) and got.stride() == want.stride()


def test_a_view_an_extern_takes_is_copied_by_a_kernel_first():
    """logcumsumexp (an extern) of a head transpose: the transpose was PyTorch's copy; now a kernel's."""
    fn = lambda x: torch.logcumsumexp(x.transpose(1, 2), -1)  # noqa: E731
    x = torch.randn(2, 5, 6, 7)
    p = tilefuse.compile(fn, (x,))
    fams = [s.family for s in p.plan.steps if s.family != "alias"]
    assert fams == ["mapreduce", "extern"] and p.plan.steps[-1].nodes == ["logcumsumexp"], str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


def test_a_transposed_result_of_an_input_written_in_place_reads_its_new_value():
    def fn(cache, x):
        cache.add_(x)
        return cache.transpose(0, 1).contiguous()
    cache, x = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    want_cache = cache.clone()
    want = fn(want_cache, x)
    p = tilefuse.compile(fn, (cache.clone(), x))
    c = cache.clone()
    got = p(c, x)
    assert torch.equal(got, want) and torch.equal(c, want_cache)


UPSAMPLES = {
    "2d_factor_2": lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
    "2d_size": lambda x: F.interpolate(x, size=(12, 15), mode="nearest"),
    "2d_unequal": lambda x: F.interpolate(x, scale_factor=(2, 3), mode="nearest"),
    "1d_factor_3": lambda x: F.interpolate(x[:, :, 0], scale_factor=3, mode="nearest"),
    "3d": lambda x: F.interpolate(x[:, :, None], scale_factor=(1, 2, 3), mode="nearest"),
    "exact": lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact"),
    "module_then_map": lambda x: torch.nn.Upsample(scale_factor=2)(x).sigmoid() * 2,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(UPSAMPLES))
def test_nearest_upsampling_by_whole_factors_is_views_read_in_place(name, dtype):
    fn = UPSAMPLES[name]
    x = torch.randn(2, 3, 4, 5).to(dtype)
    p = tilefuse.compile(fn, (x,))
    assert not any(isinstance(n, ir.Extern) for n in p.graph.nodes), str(p.graph)
    assert [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce"], str(p.plan)
    got, want = p(x), fn(x)
    if name == "module_then_map":
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("fn", [lambda x: F.interpolate(x, scale_factor=2.5, mode="nearest"),
                                lambda x: F.interpolate(x, size=(7, 9), mode="nearest")], ids=["2.5", "7x9"])
def test_nearest_upsampling_by_other_factors_stays_pytorchs(fn):
    x = torch.randn(2, 3, 4, 5)
    p = tilefuse.compile(fn, (x,))
    assert [n.target for n in p.graph.nodes if isinstance(n, ir.Extern)] == ["aten.upsample_nearest2d.vec"]
    assert torch.equal(p(x), fn(x))


def test_an_upsample_a_convolution_reads_is_copied_by_a_kernel():
    w = torch.randn(8, 3, 3, 3)
    fn = lambda x: F.conv2d(F.interpolate(x, scale_factor=2), w, padding=1)  # noqa: E731
    x = torch.randn(2, 3, 8, 8)
    p = tilefuse.compile(fn, (x,))
    assert [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce", "extern"], str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


# -- found by review (session 64) ------------------------------------------------------------------


def test_a_factor_where_pytorchs_float32_index_is_not_j_div_f_stays_pytorchs():
    """At f = 41 PyTorch's source index floor(j * float32(1/41)) is 0 at j = 41 (1/41 rounds
    below): j // f would read another element, so the op stays PyTorch's."""
    x = torch.arange(7.0).view(1, 1, 7)
    fn = lambda x: F.interpolate(x, scale_factor=41.0)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert [n.target for n in p.graph.nodes if isinstance(n, ir.Extern)] == ["aten.upsample_nearest1d.vec"]
    assert torch.equal(p(x), fn(x))


@pytest.mark.parametrize("fn", [lambda x: torch.topk(x.transpose(1, 2), 2).values,
                                lambda x: torch.sort(x[:, 1:], -1).values,
                                lambda x: x.transpose(1, 2).max(1)], ids=["topk", "sort", "max_dim_1"])
def test_a_view_another_reader_has_pytorch_copy_is_not_copied_twice(fn):
    """topk's values are a gather of the view (its table, copied by PyTorch), a max over a dim
    that is not last may be PyTorch's: a kernel copying the view too would copy it twice."""
    x = torch.randn(2, 3, 5, 8)
    p = tilefuse.compile(fn, (x,))
    assert not any(n.name.endswith("_copy") for n in p.graph.nodes), str(p.plan)
    got, want = p(x), fn(x)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w)


def test_attentions_output_transposed_back_is_not_copied():
    """Free where SDPA lays its output out [B, S, H, D] (fusion._extern_note)."""
    B, S, H, D = 2, 16, 4, 8
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    fn = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).reshape(B, S, H * D)
    p = tilefuse.compile(fn, (q, k, v))
    assert not any(n.name.endswith("_copy") for n in p.graph.nodes), str(p.plan)
    torch.testing.assert_close(p(q, k, v), fn(q, k, v))


def test_an_upsample_a_cat_reads_is_copied_by_a_kernel():
    """A cat reads permutes and slices as they lie, but an expand it took as PyTorch's copy."""
    x, skip = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 8, 10)
    fn = lambda x, s: torch.cat([F.interpolate(x, scale_factor=2), s], 1)  # noqa: E731
    p = tilefuse.compile(fn, (x, skip))
    assert [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce", "extern"], str(p.plan)
    assert torch.equal(p(x, skip), fn(x, skip))

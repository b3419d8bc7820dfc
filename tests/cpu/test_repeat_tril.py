"""`repeat` / `tile` lower to views (each dim (1, n) expanded to (r, n) and merged) and `tril` /
`triu` to a select by the position's column - row (frontend/aten.py): no PyTorch op, equal to
eager for every dtype and at odd shapes, repeats of 1 and diagonals past the matrix included."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.runtime.launch import compile_source_only

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def _make(shape, dtype, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-9, 9, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _no_externs(p):
    return not [s for s in p.plan.steps if s.family == "extern" and not s.view]


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), extra=st.integers(0, 2),
       reps=st.lists(st.integers(1, 3), min_size=5, max_size=5), tile=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_repeat_and_tile_equal_eager_with_no_pytorch_op(shape, extra, reps, tile, dtype, seed):
    x = _make(tuple(shape), dtype, torch.Generator().manual_seed(seed))
    r = tuple(reps[:len(shape) + extra]) if not tile else tuple(reps[:max(1, len(shape) - 1 + extra)])
    fn = (lambda x: torch.tile(x, r)) if tile else (lambda x: x.repeat(*r))
    p = tilefuse.compile(fn, (x,))
    assert _no_externs(p), str(p.plan)
    got, want = p(x), fn(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=2, max_size=4), k=st.integers(-10, 10), upper=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_tril_and_triu_equal_eager_with_no_pytorch_op(shape, k, upper, dtype, seed):
    x = _make(tuple(shape), dtype, torch.Generator().manual_seed(seed))
    fn = (lambda x: torch.triu(x, k)) if upper else (lambda x: torch.tril(x, k))
    p = tilefuse.compile(fn, (x,))
    assert _no_externs(p), str(p.plan)
    got, want = p(x), fn(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_triangle_or_repeat_of_weights_and_constants_folds_when_compiling():
    """`torch.tril(torch.ones(T, T))` and `w.repeat(4, 1)` keep PyTorch's op, which folds into a
    weight once (graph/fold.py): lowered, the mask was rebuilt from a stored `ones` each call
    past T = 362 (its i64 positions too large to fold), and the repeat copied each call (review)."""
    T = 1024
    fn = lambda x: x.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf")).softmax(-1)  # noqa: E731
    x = torch.randn(2, T, T)
    p = tilefuse.compile(fn, (x,))
    assert [s.family for s in p.plan.steps] == ["mapreduce"], str(p.plan)
    torch.testing.assert_close(p(x), fn(x))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def forward(self, x):
            return x * self.w.repeat(1, 2)[:, :48].sum(0) + torch.triu(self.w[:32]).sum(0).repeat(1)[:1]

    m, x = M(), torch.randn(8, 48)
    p = tilefuse.compile(m, (x,))
    assert [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce"], str(p.plan)
    with torch.no_grad():
        torch.testing.assert_close(p(x), m(x))


def test_a_repeat_read_by_a_map_is_read_in_place():
    """`x.repeat(1, 4, 1, 1) * 2`, GQA's heads repeated: one kernel reading x, not a copy."""
    x = torch.randn(2, 3, 5, 8)
    fn = lambda x: x.repeat(1, 4, 1, 1) * 2  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert [s.family for s in p.plan.steps if s.family != "alias"] == ["mapreduce"], str(p.plan)
    assert torch.equal(p(x), fn(x))


def test_tril_of_an_expanded_matrix_and_a_repeat_of_a_slice_equal_eager():
    """Through views that PyTorch leaves strided (a broadcast batch, a slice of the last dim)."""
    x = torch.randn(3, 9)
    for fn in (lambda x: torch.tril(x[:, :3][None].expand(2, 3, 3)), lambda x: x[:, 2:7].repeat(2, 3) + 1):
        p = tilefuse.compile(fn, (x,))
        assert _no_externs(p), str(p.plan)
        assert torch.equal(p(x), fn(x))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("fn,shape", [(lambda x: x.repeat(1, 4, 1, 1), (8, 8, 128, 128)),
                                      (lambda x: torch.tril(x) * 2, (8, 512, 512)),
                                      (lambda x: torch.triu(x, 1).softmax(-1), (4, 256, 256))],
                         ids=["repeat", "tril", "triu softmax"])
def test_repeat_and_tril_kernels_build_without_spills(fn, shape, arch):
    p = tilefuse.compile(fn, (torch.randn(shape, dtype=torch.bfloat16),))
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"

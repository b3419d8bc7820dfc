"""argmax / argmin, and the indices of max / min along a dim, as two row reductions in one
kernel (frontend/aten.py `_arg_index`): the max, then the least index where x equals it or is
NaN. They were PyTorch externs (`tilefuse does not lower aten.argmax`).

Checked through the CPU interpreter against PyTorch exactly (an index is exact or wrong): ties
give the first index, a NaN wins from its first position (PyTorch's max propagates NaN), -0.0
ties with 0.0, every dtype, the last dim and none, keepdim. Each is one map-reduce kernel with no
extern, and its kernels build for sm_90a and sm_80 with no spills. Over another dim the index
stays PyTorch's argmax (the values a reduction of tilefuse's)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.graph import ir
from tilefuse.runtime.launch import compile_source_only

FNS = {
    "argmax_last": lambda x: x.argmax(-1),
    "argmin_last": lambda x: x.argmin(-1),
    "argmax_first": lambda x: x.argmax(0),
    "argmax_all": lambda x: x.argmax(),
    "argmin_all_keepdim": lambda x: x.argmin(dim=None, keepdim=True),
    "argmax_keepdim": lambda x: torch.argmax(x, dim=1, keepdim=True),
    "max_dim": lambda x: torch.max(x, 1),
    "min_dim_keepdim": lambda x: x.min(0, keepdim=True),
}


def _same(got, want):
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def _program(fn, x, one_kernel: bool = True):
    """The compiled program: one map-reduce kernel and nothing else (`one_kernel`; over a dim
    that is not last the index is PyTorch's, `test_over_a_dim_that_is_not_last...`)."""
    p = tilefuse.compile(fn, (x,))
    steps = [s for s in p.plan.steps if s.family not in ("alias",) and not s.view]
    if one_kernel:
        assert [s.family for s in steps] == ["mapreduce"], str(p.plan)
    return p




def _with_ties_and_nans(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[1, 3] = x[1, 5] = float("nan")   # two NaNs in a row: the first wins
    x[2] = 1.0                          # a row of ties: index 0
    x[3, 2] = x[3, 4] = 9.0             # a tie at the max: the first
    x[4, 0], x[4, 1:] = -0.0, -1.0      # -0.0 is the max of its row
    x[:, 6] = -9.0                      # a column with a tie for the min (argmin along dim 0)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                                   torch.uint8], ids=str)
@pytest.mark.parametrize("name", sorted(FNS))
def test_arg_reductions_equal_pytorchs_indices(name, dtype):
    x = _with_ties_and_nans(torch.randn(6, 9) * 4)
    if not dtype.is_floating_point:
        x = x.nan_to_num(0.0).abs().to(dtype) if dtype == torch.uint8 else x.nan_to_num(0.0).to(dtype)
    else:
        x = x.to(dtype)
    fn = FNS[name]
    _same(_program(fn, x, one_kernel=name not in ("argmax_first", "min_dim_keepdim"))(x), fn(x))


def test_max_along_a_dim_of_a_bool_tensor_gives_pytorchs_indices():
    x = torch.rand(5, 11) > 0.6
    _same(_program(lambda x: x.max(-1), x)(x), x.max(-1))


def test_a_0d_tensor_and_a_dim_of_one():
    s = torch.tensor(3.0)
    values, index = _program(lambda x: x.max(0), s, one_kernel=False)(s)  # (below)
    _same((values, index), s.max(0))
    # a result reducing one element of an input stays a reduction, a new tensor as PyTorch's,
    # not a reshape of the input's memory (rewrites.drop_one_element_reductions)
    assert values.data_ptr() != s.data_ptr()
    _same(_program(lambda x: x.argmax(), s)(s), s.argmax())
    x = torch.randn(4, 1)
    _same(_program(lambda x: x.argmax(-1), x)(x), x.argmax(-1))


def test_argmax_of_a_bool_tensor_stays_pytorchs_which_refuses_it():
    """PyTorch has no argmax over bool: the op stays an extern, which raises as eager does."""
    x = torch.rand(3, 4) > 0.5
    p = tilefuse.compile(lambda x: x.argmax(-1), (x,))
    assert any(s.family == "extern" for s in p.plan.steps), str(p.plan)
    with pytest.raises(RuntimeError, match="bool"):
        p(x)


def test_over_a_dim_that_is_not_last_the_arg_stays_pytorchs():
    """The planner does not put the second reduction in the first's column kernel, so the index
    would be two kernels with an i64 tensor written between them; PyTorch's argmax is one op."""
    x = torch.randn(32, 9)
    for fn in (lambda x: x.argmax(0), lambda x: x.max(0)):
        p = tilefuse.compile(fn, (x,))
        assert [n.target for n in p.graph.nodes if isinstance(n, ir.Extern)] == ["aten.argmax.default"], str(p.graph)
        _same(p(x), fn(x))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 70), dim=st.sampled_from([0, 1, -1]),
       levels=st.integers(1, 6), nan=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_random_rows_with_few_levels_tie_as_pytorch(rows, cols, dim, levels, nan, seed):
    """Values drawn from a few levels (many ties), NaNs sometimes: max and argmax agree with
    PyTorch at every size, a row of one element and a dim of one included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, cols), generator=g).float()
    if nan:
        x[torch.rand(rows, cols, generator=g) < 0.1] = float("nan")
    for fn in (lambda x: x.argmax(dim), lambda x: x.min(dim)):
        _same(_program(fn, x, one_kernel=False)(x), fn(x))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("shape,dim", [((64, 32000), -1), ((7, 4097), -1), ((512, 256), -1), ((3, 5, 64), 2)],
                         ids=str)
def test_arg_reduction_kernels_build_without_spills(shape, dim, arch):
    x = torch.randn(shape, dtype=torch.bfloat16)
    p = _program(lambda x: torch.max(x, dim), x, one_kernel=True)
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"


@pytest.mark.parametrize("shape", [(1, 1 << 17), (2, 70000)], ids=str)
def test_few_long_rows_keep_pytorchs_argmax(shape):
    """Few rows of 65536 or more are split into pieces (rewrites.split_long_reductions): the
    index pass would write an index per element between kernels, where PyTorch's argmax reads x
    once. So is a whole tensor that long."""
    x = torch.randn(shape)
    for fn in (lambda x: x.argmax(-1), lambda x: x.max(-1), lambda x: x.argmax()):
        p = tilefuse.compile(fn, (x,))
        assert any(isinstance(n, ir.Extern) and n.target.startswith("aten.argmax") for n in p.graph.nodes), \
            str(p.graph)
        _same(p(x), fn(x))
